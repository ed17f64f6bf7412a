"""The cpu backend through the public API: every ISA this machine runs, against
the reference backend; thread, batch and concurrency invariance."""
import os
import platform
import sys
import threading
import time

import numpy as np
import pytest

import qdispatch as qd
from helpers import built_with_openmp, rel_err, run_python

pytestmark = pytest.mark.skipif("cpu" not in qd.available_backends(), reason="cpu backend not built")

CPU_INFO = qd.info()["backends"]["cpu"]
GRID = [(1, 64, 1), (3, 33, 17), (16, 64, 65), (17, 96, 31), (1, 127, 63), (5, 160, 97), (33, 32, 2)]


@pytest.fixture
def threads():
    before = qd.get_num_threads()
    yield
    qd.set_num_threads(before)


def both(x, scheme, rng=None):
    return qd.quantize(x, scheme, device="cpu"), qd.quantize(x, scheme, device="reference")


def test_isa_is_reported_and_forced(isa):
    assert qd.info()["backends"]["cpu"]["isa"] == isa


@pytest.mark.parametrize("m,k,n", GRID)
def test_int_matmul_is_bit_identical(isa, rng, m, k, n):
    a = rng.integers(-128, 128, size=(m, k), dtype=np.int8)
    b = rng.integers(-128, 128, size=(k, n), dtype=np.int8)
    got = qd.int_matmul(qd.tensor(a, device="cpu"), qd.tensor(b, device="cpu")).numpy()
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("fill", ["all_min", "alternating"])
def test_extremes_stay_exact_in_qq(isa, fill):
    m, k, n = 4, 4096, 9
    if fill == "all_min":
        a = np.full((m, k), -128, np.int8)
        w = np.full((n, k), -128, np.int8)
    else:
        a = np.where(np.arange(m * k).reshape(m, k) % 2, 127, -128).astype(np.int8)
        w = np.where(np.arange(n * k).reshape(n, k) % 2, -128, 127).astype(np.int8)
    scheme = qd.QuantScheme("q8f")
    aq = qd.qtensor_from_parts(a, np.float32(1.0), scheme, device="cpu")
    wq = qd.qtensor_from_parts(w, np.float32(1.0), scheme, device="cpu")
    want = (a.astype(np.int64) @ w.T.astype(np.int64)).astype(np.float32)
    np.testing.assert_array_equal(qd.q_matmul(aq, wq.T).numpy(), want)
    np.testing.assert_array_equal(
        qd.int_matmul(qd.tensor(a, device="cpu"), qd.tensor(np.ascontiguousarray(w.T), device="cpu")).numpy(),
        want.astype(np.int64))


W_SCHEMES = [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8f"), qd.QuantScheme("q8s", block=32),
             qd.QuantScheme("q8f", block=64), qd.QuantScheme("q4s", block=32, store="packed_u32"),
             qd.QuantScheme("q4f", axis=0, store="packed_u32"), qd.QuantScheme("q2f", block=32, store="packed_u32")]
A_SCHEMES = [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8f", block=32), qd.QuantScheme("q8s"),
             qd.QuantScheme("q8s", block=128)]


@pytest.mark.parametrize("w_scheme", W_SCHEMES, ids=repr)
@pytest.mark.parametrize("m", [1, 4, 17, 33])
def test_qq_and_fq_match_the_reference(isa, rng, w_scheme, m):
    """qq (and W8A8, which is qq) bit for bit on every ISA: exact integer sums per
    scale group, each scaled and added with the reference's roundings."""
    k, n = 256, 67
    wq, wr = both(rng.standard_normal((n, k)).astype(np.float32), w_scheme)
    x = rng.standard_normal((m, k)).astype(np.float32)
    for a_scheme in A_SCHEMES:
        xq, xr = both(x, a_scheme)
        np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(xr, wr.T).numpy())
    assert rel_err(qd.q_matmul(x, wr.T).numpy(), qd.q_matmul(x, wq.T).numpy()) < 1e-5
    for act in ("q8s", qd.QuantScheme("q8f", block=(1, 32))):
        np.testing.assert_array_equal(qd.q_matmul(x, wq.T, activation_scheme=act).numpy(),
                                      qd.q_matmul(x, wr.T, activation_scheme=act).numpy())


@pytest.mark.parametrize("a_scheme", [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=32, store="packed_u32")],
                         ids=repr)
def test_a_left_operand_holds_its_values_after_its_first_product(rng, a_scheme):
    """Activations of 16 rows or more quantize into panels, as a weight does, and
    give up their store; as a product's left operand they were read back from the
    panels at every call (half of a 64 x 1024 qq product)."""
    w = qd.quantize(rng.standard_normal((40, 256)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
    x = rng.standard_normal((64, 256)).astype(np.float32)
    xq = qd.quantize(x, a_scheme, device="cpu")
    want = qd.q_matmul(xq.to("reference"), w.to("reference").T).numpy()
    assert not xq.storage.holds_values
    np.testing.assert_array_equal(qd.q_matmul(xq, w.T).numpy(), want)
    assert xq.storage.holds_values and ("panels", False) not in xq.storage.cache  # its size once
    np.testing.assert_array_equal(qd.q_matmul(xq, w.T).numpy(), want)
    np.testing.assert_array_equal(qd.q_matmul(xq.T.T, w.T).numpy(), want)
    # one that a product has read as a weight keeps its panels as a left operand too
    served = qd.quantize(rng.standard_normal((32, 256)).astype(np.float32), "q8s", device="cpu")
    qd.q_matmul(xq, served.T)  # read as a weight: its panels served
    assert not served.storage.holds_values
    np.testing.assert_array_equal(qd.q_matmul(served, w.T).numpy(),
                                  qd.q_matmul(served.to("reference"), w.to("reference").T).numpy())
    assert not served.storage.holds_values and ("panels", False) in served.storage.cache


@pytest.mark.parametrize("m", [9, 16, 17, 32, 40, 70])
@pytest.mark.parametrize("k", [64, 200, 256, 1000])
def test_qq_row_tiles_and_k_tails_match_the_reference(isa, rng, m, k):
    """Row counts around the kernels' tiles (AMX: 16-row tiles, 32 a call, 8 rows or
    fewer on VNNI) and K that ends inside a 64-value step, bit for bit: per channel,
    blocks of 64 values where K allows (else of 8), blocks of 32 (VNNI on AMX too),
    and 4- and 2-bit weights (unpacked a step at a time on AMX) per channel and in
    blocks."""
    n = 33
    x = rng.standard_normal((m, k)).astype(np.float32)
    for w_scheme in (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8f", block=64 if k % 64 == 0 else 8),
                     qd.QuantScheme("q8s", block=32 if k % 32 == 0 else 8),
                     qd.QuantScheme("q4s", block=8, store="packed_u32"),
                     qd.QuantScheme("q4s", axis=0, store="packed_u32"),
                     qd.QuantScheme("q4f", block=32 if k % 32 == 0 else 8, store="packed_u32"),
                     qd.QuantScheme("q2f", axis=0, store="packed_u32"),
                     qd.QuantScheme("q2s", block=64 if k % 64 == 0 else 8, store="packed_u32")):
        wq, wr = both(rng.standard_normal((n, k)).astype(np.float32), w_scheme)
        xq, xr = both(x, qd.QuantScheme("q8s", axis=0))
        np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(xr, wr.T).numpy())
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (k, n), dtype=np.int8)
    np.testing.assert_array_equal(qd.int_matmul(a, b).numpy(), a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("threads", [1, 2])
def test_qq_tasks_of_several_panel_groups_match_the_reference(isa, rng, threads):
    """Several row blocks of 64 rows take their panels in runs of up to 8 per task, the
    last run shorter (341 columns: 22 panels): every output still comes out exact."""
    m, k, n = 130, 192, 341
    wq, wr = both(rng.standard_normal((n, k)).astype(np.float32), qd.QuantScheme("q8s", axis=0))
    xq, xr = both(rng.standard_normal((m, k)).astype(np.float32), qd.QuantScheme("q8s", axis=0))
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    qd.set_num_threads(threads)
    try:
        np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(xr, wr.T).numpy())
        np.testing.assert_array_equal(qd.int_matmul(a, wr.values.T).numpy(),
                                      a.astype(np.int64) @ wr.values.T.astype(np.int64))
    finally:
        qd.set_num_threads(0)


def test_qq_rounds_each_group_as_the_reference(isa):
    """Each scale group's sum is scaled, rounded, then added, as the reference does
    it; a fused multiply-add rounds once and differs.  Row 0: group 0 gives -3,
    group 1 gives 3 * (1 + 2**-23), which rounds to 3 + 2**-21, so the sum is
    2**-21 (fused: 3 * 2**-23).  Row 1: group 1's scaled sum 2**128 overflows to
    inf, so the sum is inf (fused: the finite 56 * 2**120)."""
    a = np.zeros((2, 64), np.int8)
    a[0, 0], a[0, 32] = -3, 3
    a[1, :2], a[1, 32:35] = -100, (127, 127, 2)
    a_scales = np.array([[1.0, 1.0 + 2.0 ** -23], [2.0 ** 120, 2.0 ** 120]], np.float32)
    w = np.zeros((16, 64), np.int8)
    w[:, 0], w[:, 1], w[:, 32:35] = 1, 1, 1

    def product(device):
        aq = qd.qtensor_from_parts(a, a_scales, qd.QuantScheme("q8s", block=(1, 32)), device=device)
        wq = qd.qtensor_from_parts(w, np.ones(16, np.float32), qd.QuantScheme("q8s", axis=0), device=device)
        return qd.q_matmul(aq, wq.T).numpy()

    expect = product("reference")
    assert np.all(expect[0] == np.float32(2.0 ** -21)) and np.all(expect[1] == np.inf)
    np.testing.assert_array_equal(product("cpu"), expect)


# weights scaled in groups along K that are no whole SIMD units (8-bit values come 4 a
# unit, 4-bit 8 and 2-bit 16): [N, K] and its scheme, K-groups of 1, 2, 3, 4 and 10
SHORT_GROUP_WEIGHTS = [((40, 64), qd.QuantScheme("q8s", axis=1)),
                       ((17, 42), qd.QuantScheme("q8f", block=(1, 3))),
                       ((33, 64), qd.QuantScheme("q4s", block=4, store="packed_u32")),
                       ((20, 60), qd.QuantScheme("q2f", block=(4, 10), store="packed_u32")),
                       ((16, 96), qd.QuantScheme("q2s", block=(1, 2), store="packed_u32"))]


@pytest.mark.parametrize("shape, w_scheme", SHORT_GROUP_WEIGHTS, ids=[repr(s) for _, s in SHORT_GROUP_WEIGHTS])
@pytest.mark.parametrize("threads", [1, 2])
def test_qq_with_short_scale_groups_matches_the_reference(isa, rng, shape, w_scheme, threads):
    """Bit for bit, on the vector kernels as on the scalar one, at row counts that
    fill tiles and leave tails, through qq, W8A8 and a [K, N] weight."""
    wq, wr = both(rng.standard_normal(shape).astype(np.float32), w_scheme)
    qd.set_num_threads(threads)
    try:
        for m in (1, 2, 3, 5, 33):
            x = rng.standard_normal((m, shape[1])).astype(np.float32)
            # activation blocks of 2 values, finer than the weights' blocks of 3, 4 and 10:
            # each of those weight scales then holds for several groups
            for a_scheme in (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8f"),
                             qd.QuantScheme("q8s", block=(1, shape[1] // 2)), qd.QuantScheme("q8s", block=(1, 2))):
                xq, xr = both(x, a_scheme)
                np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(xr, wr.T).numpy())
            np.testing.assert_array_equal(qd.linear(x, wq, activation_scheme="q8s").numpy(),
                                          qd.linear(x, wr, activation_scheme="q8s").numpy())
        w_kn = rng.standard_normal(shape[::-1]).astype(np.float32)  # [K, N] scaled per row of K
        kq, kr = both(w_kn, qd.QuantScheme("q8s", axis=0))
        np.testing.assert_array_equal(qd.q_matmul(x, kq, activation_scheme="q8s").numpy(),
                                      qd.q_matmul(x, kr, activation_scheme="q8s").numpy())
    finally:
        qd.set_num_threads(0)


def test_qq_short_groups_round_each_group_as_the_reference(isa):
    """A group of one value: k = 0 gives -3, k = 1 gives 3 * (1 + 2**-23), which rounds
    to 3 + 2**-21, so the sum is 2**-21 (a fused multiply-add: 3 * 2**-23)."""
    a = np.zeros((1, 8), np.int8)
    a[0, :2] = -3, 3
    w = np.zeros((16, 8), np.int8)
    w[:, :2] = 1
    w_scales = np.ones((1, 8), np.float32)
    w_scales[0, 1] = 1 + 2.0 ** -23

    def product(device):
        aq = qd.qtensor_from_parts(a, np.float32(1), qd.QuantScheme("q8s"), device=device)
        wq = qd.qtensor_from_parts(w, w_scales, qd.QuantScheme("q8s", axis=1), device=device)
        return qd.q_matmul(aq, wq.T).numpy()

    expect = product("reference")
    assert np.all(expect == np.float32(2.0 ** -21))
    np.testing.assert_array_equal(product("cpu"), expect)


def test_quantize_is_bit_identical_to_the_reference(isa, rng):
    x = rng.standard_normal((33, 96)).astype(np.float32)
    for scheme in (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"),
                   qd.QuantScheme("q8f", block=(3, 32), scale_dtype="bf16"), qd.QuantScheme("q2s", axis=1, store="packed_u32")):
        q, r = both(x, scheme)
        np.testing.assert_array_equal(q.values, r.values)
        np.testing.assert_array_equal(q.scales, r.scales)


def read_only(a, form, path):
    """a as a read-only array of the kind users meet: a memory-mapped .npy file,
    np.frombuffer over bytes, or an array locked with flags.writeable."""
    if form == "mmap":
        np.save(path, a)
        out = np.load(path, mmap_mode="r")
    elif form == "frombuffer":
        out = np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape)
    else:
        out = a.copy()
        out.flags.writeable = False
    assert not out.flags.writeable
    return out


@pytest.mark.parametrize("form", ["mmap", "frombuffer", "locked"])
def test_read_only_arrays_feed_every_kernel(rng, tmp_path, form):
    w = rng.standard_normal((8, 64)).astype(np.float32)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    a = rng.integers(-128, 128, (4, 64), dtype=np.int8)
    b = rng.integers(-128, 128, (64, 5), dtype=np.int8)
    w_ro, x_ro, a_ro, b_ro = (read_only(arr, form, tmp_path / f"{name}.npy")
                              for name, arr in (("w", w), ("x", x), ("a", a), ("b", b)))
    scheme = qd.QuantScheme("q8s", axis=0)
    q, ref = qd.quantize(w_ro, scheme, device="cpu"), qd.quantize(w, scheme, device="reference")
    np.testing.assert_array_equal(q.values, ref.values)
    np.testing.assert_array_equal(q.scales, ref.scales)
    wq = qd.quantize(w, scheme, device="cpu")
    for act in (None, "q8s"):  # weight-only, and x quantized in C on the way
        np.testing.assert_array_equal(qd.linear(x_ro, wq, activation_scheme=act).numpy(),
                                      qd.linear(x, wq, activation_scheme=act).numpy())
    np.testing.assert_array_equal(qd.q_matmul(x_ro, wq.T).numpy(), qd.q_matmul(x, wq.T).numpy())
    aq_ro, aq = (qd.qtensor_from_parts(v, np.float32(0.5), "q8f", device="cpu") for v in (a_ro, a))
    np.testing.assert_array_equal(qd.q_matmul(aq_ro, wq.T).numpy(), qd.q_matmul(aq, wq.T).numpy())
    np.testing.assert_array_equal(qd.int_matmul(a_ro, b_ro).numpy(), a.astype(np.int64) @ b.astype(np.int64))


def test_broadcast_views_quantize_and_multiply_like_their_copies(rng):
    row = rng.standard_normal(64).astype(np.float32)
    x = np.broadcast_to(row, (4, 64))  # read-only, rows repeated with stride 0
    scheme = qd.QuantScheme("q8s", axis=0)
    q, ref = qd.quantize(x, scheme, device="cpu"), qd.quantize(x.copy(), scheme, device="reference")
    np.testing.assert_array_equal(q.values, ref.values)
    np.testing.assert_array_equal(q.scales, ref.scales)
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), scheme, device="cpu")
    np.testing.assert_array_equal(qd.linear(x, wq).numpy(), qd.linear(x.copy(), wq).numpy())
    scalar = qd.quantize(np.broadcast_to(np.float32(1.5), (4, 64)), "q8s", device="cpu")
    assert float(scalar.scales) == np.float32(1.5) / np.float32(127)
    np.testing.assert_array_equal(scalar.values, np.full((4, 64), 127, np.int8))


def test_results_do_not_depend_on_thread_count(rng, threads):
    x = rng.standard_normal((37, 512)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((300, 512)).astype(np.float32), qd.QuantScheme("q8s", block=32), device="cpu")
    w4 = qd.quantize(rng.standard_normal((300, 512)).astype(np.float32),
                     qd.QuantScheme("q4s", block=32, store="packed_u32"), device="cpu")
    xq = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="cpu")
    runs = []
    for n in (1, 2, 3):
        qd.set_num_threads(n)
        assert qd.get_num_threads() == (n if built_with_openmp() else 1)
        runs.append([qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(x, wq.T).numpy(),
                     qd.q_matmul(x, w4.T).numpy(), qd.q_matmul(x, wq.T, activation_scheme="q8s").numpy()])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("M,K,N", [(1, 1000, 16 * 150 + 5), (70, 1000, 16 * 150 + 5), (3, 20000, 16 * 70 + 9),
                                   (2, 70000, 41), (5, 64, 16 * 1100)])
def test_int_matmul_packs_strips_of_any_width_exactly(rng, threads, M, K, N):
    """int_matmul packs b in strips of up to 4 MB (wide where K is short, one unit
    of panels where a panel alone is past that) shared among the threads, the last
    one narrower: every cut gives the exact product."""
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    b = rng.integers(-128, 128, (K, N), dtype=np.int8)
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)
    for n in (1, 2, 3):
        qd.set_num_threads(n)
        np.testing.assert_array_equal(qd.int_matmul(a, qd.tensor(b, device="cpu")).numpy(), want)


def test_thread_counts_that_are_no_count_are_refused(threads):
    """A thread count is a whole number: a float would be cut silently, a string or a
    count past a C int would fail with no word of what set_num_threads takes."""
    qd.set_num_threads(np.int64(2))  # numpy integers are counts
    assert qd.get_num_threads() == (2 if built_with_openmp() else 1)
    for bad in (2.7, "4", None):
        with pytest.raises(TypeError, match="whole number of threads"):
            qd.set_num_threads(bad)
    with pytest.raises(ValueError, match="at most 2147483647 threads"):
        qd.set_num_threads(10**12)
    assert qd.get_num_threads() == (2 if built_with_openmp() else 1)  # unchanged by the refusals
    qd.set_num_threads(0)
    default = qd.get_num_threads()
    qd.set_num_threads(2)
    qd.set_num_threads(-10**12)  # 0 or less: the default, however far below
    assert qd.get_num_threads() == default


def test_a_rows_result_does_not_depend_on_its_batch(rng):
    x = rng.standard_normal((40, 256)).astype(np.float32)
    for scheme in (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=32, store="packed_u32")):
        wq = qd.quantize(rng.standard_normal((96, 256)).astype(np.float32), scheme, device="cpu")
        full = qd.q_matmul(x, wq.T).numpy()
        full8 = qd.q_matmul(x, wq.T, activation_scheme="q8s").numpy()
        for m in (0, 1, 15, 16, 39):
            np.testing.assert_array_equal(qd.q_matmul(x[m:m + 1], wq.T).numpy()[0], full[m])
            np.testing.assert_array_equal(qd.q_matmul(x[m:m + 1], wq.T, activation_scheme="q8s").numpy()[0],
                                          full8[m])
        for m0, m1 in ((0, 16), (3, 20), (16, 40)):
            np.testing.assert_array_equal(qd.q_matmul(x[m0:m1], wq.T).numpy(), full[m0:m1])


def test_concurrent_calls_from_python_threads(rng):
    wq = qd.quantize(rng.standard_normal((128, 256)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
    inputs = [rng.standard_normal((8, 256)).astype(np.float32) for _ in range(8)]
    expected = [qd.q_matmul(x, wq.T).numpy() for x in inputs]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(20):
                results[i] = qd.q_matmul(inputs[i], wq.T).numpy()
                np.testing.assert_array_equal(results[i], expected[i])
        except Exception as exc:  # reported below, with the thread's own traceback text
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors


def test_weights_are_packed_once_when_created(rng):
    wq = qd.quantize(rng.standard_normal((64, 128)).astype(np.float32), "q8s", device="cpu")
    panels = dict(wq.storage.cache)
    assert panels, "panels are packed at quantize time"
    qd.q_matmul(rng.standard_normal((2, 128)).astype(np.float32), wq.T)
    assert all(wq.storage.cache.get(key) is kept for key, kept in panels.items())  # the same panels, not packed again
    assert [key for key in wq.storage.cache if key[0] == "panels"] == [("panels", False)]
    moved = wq.to("reference").to("cpu")
    assert moved.storage.cache


def test_a_few_tokens_quantized_are_not_packed_until_a_product_takes_them_as_weights(rng):
    """Fewer rows than a panel's 16 are activations far more often than weights: their
    quantize call packs nothing (packing was half of it at 1 x 4096), and a product
    that takes one as a weight packs it then."""
    x = rng.standard_normal((3, 128)).astype(np.float32)
    xq = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="cpu")
    assert not xq.storage.cache
    wq = qd.quantize(rng.standard_normal((40, 128)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
    ref = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference")
    np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(ref, wq.to("reference").T).numpy())
    assert not xq.storage.cache
    y = rng.standard_normal((2, 128)).astype(np.float32)
    as_weight = qd.q_matmul(y, xq.T).numpy()
    assert xq.storage.cache
    np.testing.assert_allclose(as_weight, qd.q_matmul(y, ref.T).numpy(), rtol=1e-5, atol=1e-5)


def test_a_kn_weight_scaled_per_column_packs_at_its_first_product_as_it_reads(rng):
    """A scale per column is a [K, N] weight's per output channel: packed as [N, K] it
    would carry a scale per value, for an orientation q_matmul(x, w) never reads."""
    w = rng.standard_normal((128, 48)).astype(np.float32)  # [K, N]
    wq = qd.quantize(w, qd.QuantScheme("q8s", axis=1), device="cpu")
    assert not wq.storage.cache
    x = rng.standard_normal((3, 128)).astype(np.float32)
    ref = qd.quantize(w, qd.QuantScheme("q8s", axis=1), device="reference")
    np.testing.assert_array_equal(qd.q_matmul(x, wq, activation_scheme="q8s").numpy(),
                                  qd.q_matmul(x, ref, activation_scheme="q8s").numpy())
    assert [key for key in wq.storage.cache if key[0] == "panels"] == [("panels", True)]


@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w.T"])
def test_a_batched_weights_items_are_packed_once(rng, monkeypatch, transposed):
    """Each item of a 3-D weight was sliced into a fresh storage on every call, so
    its panels were packed again for every product."""
    from qdispatch.backends import cpu as cpu_backend
    real, packs = cpu_backend._cpu.PackedWeights, []
    monkeypatch.setattr(cpu_backend._cpu, "PackedWeights", lambda *args: packs.append(args[0].shape) or real(*args))
    w = qd.quantize(rng.standard_normal((3, 64, 32)).astype(np.float32),
                    qd.QuantScheme("q4s", block=(1, 1, 32), store="packed_u32"), device="cpu")
    w = w.T if transposed else w
    x = rng.standard_normal((3, 2, w.shape[-2])).astype(np.float32)
    first = qd.q_matmul(x, w).numpy()
    assert len(packs) == 3
    again = qd.q_matmul(x, w).numpy()
    assert len(packs) == 3, "the items were packed again"
    np.testing.assert_array_equal(again, first)
    np.testing.assert_allclose(first, qd.q_matmul(x, w.to("reference")).numpy(), rtol=1e-5, atol=1e-4)


def test_unknown_or_unsupported_isa_is_a_clear_error():
    active = qd.info()["backends"]["cpu"]["isa"]  # not CPU_INFO's: QDISPATCH_ISA may have set it at import
    # a name of no ISA is a bad argument (a ValueError, as the README's errors row says); it was
    # a BackendUnavailableError, as an ISA this CPU lacks is
    with pytest.raises(qd.ArgumentError, match="^Can't use ISA 'sse9': no ISA has that name") as bad:
        qd.set_isa("sse9")
    assert str(bad.value).count("Can't use ISA") == 1
    unsupported = [i for i in CPU_INFO["built"] if i not in CPU_INFO["supported"]]
    not_built = [i for i in ("neon", "avx2") if i not in CPU_INFO["built"]]
    for name in unsupported + not_built:
        with pytest.raises(qd.BackendUnavailableError, match=name) as bad:
            qd.set_isa(name)
        assert str(bad.value).count("Can't use ISA") == 1
    assert qd.info()["backends"]["cpu"]["isa"] == active  # a refused choice changes nothing
    with pytest.raises(qd.ArgumentError, match=r"^Can't use ISA 'avx2\\x00x': no ISA has that name"):
        qd.set_isa("avx2\x00x")  # C read the name up to the NUL: it was avx2
    for name in (None, 3):  # were BackendUnavailableErrors
        with pytest.raises(TypeError, match=rf"set_isa takes an ISA's name \(a str such as 'avx2', or 'auto'\), "
                                            rf"got {name!r}"):
            qd.set_isa(name)
    assert qd.info()["backends"]["cpu"]["isa"] == active


def test_environment_variables_pick_isa_and_threads():
    code = "import qdispatch as qd; c = qd.info()['backends']['cpu']; print(c['isa'], c['threads'])"
    out = run_python("-c", code, QDISPATCH_ISA="scalar", QDISPATCH_NUM_THREADS="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "1"]


@pytest.mark.skipif(not built_with_openmp(), reason="a build without OpenMP runs one thread")
def test_the_default_thread_count_follows_omp_num_threads():
    """Worker processes sized by OMP_NUM_THREADS=1 (as torch and BLAS read it) each ran a
    team of every processor, spinning against each other: 15-30x slower on 2 cores.
    QDISPATCH_NUM_THREADS and set_num_threads still decide over it."""
    code = ("import os, qdispatch as qd; n = qd.get_num_threads(); qd.set_num_threads(1); qd.set_num_threads(0); "
            "print(n, qd.get_num_threads(), len(os.sched_getaffinity(0)))")

    def counts(**env):
        out = run_python("-c", code, **env)
        assert out.returncode == 0, out.stderr
        return [int(word) for word in out.stdout.split()]

    procs = counts(OMP_NUM_THREADS="")[2]
    assert counts(OMP_NUM_THREADS="")[:2] == [procs, procs]  # unset or empty: one per processor
    assert counts(OMP_NUM_THREADS="1")[:2] == [1, 1]
    assert counts(OMP_NUM_THREADS="3,2")[:2] == [3, 3]  # nested levels: the first is the kernels' team
    assert counts(OMP_NUM_THREADS="100000")[:2] == [4 * procs] * 2  # at most 4 per processor
    for unusable in ("0", "-2", "two", "2x"):  # OpenMP's own to refuse: the kernels keep their default
        assert counts(OMP_NUM_THREADS=unusable)[:2] == [procs, procs], unusable
    assert counts(OMP_NUM_THREADS="1", QDISPATCH_NUM_THREADS="2")[0] == 2



BAD_SETTING = """
import numpy as np, qdispatch as qd
cpu = qd.info()["backends"]["cpu"]
print(cpu["available"], "|", cpu["reason"])
try:
    qd.q_matmul(np.ones((1, 32), np.float32), qd.quantize(np.ones((4, 32), np.float32), "q8s").T)
except qd.BackendUnavailableError as exc:
    print(exc)
print(qd.quantize(np.ones(4, np.float32), "q8s", device="reference").device)
{fix}
print(qd.tensor(np.ones(2, np.float32)).device)
"""


@pytest.mark.parametrize("variable,setting,fix,message", [
    ("QDISPATCH_ISA", "avx9000", "qd.set_isa('auto')", "QDISPATCH_ISA=avx9000: Can't use ISA 'avx9000'"),
    ("QDISPATCH_NUM_THREADS", "abc", "qd.set_num_threads(2)",
     "QDISPATCH_NUM_THREADS='abc' is not a whole number up to 2147483647: set it to a thread count"),
    ("QDISPATCH_NUM_THREADS", "99999999999", "qd.set_num_threads(0)", "QDISPATCH_NUM_THREADS='99999999999'"),
    ("QDISPATCH_NUM_THREADS", "2_0", "qd.set_num_threads(1)", "QDISPATCH_NUM_THREADS='2_0' is not a whole number"),
    ("QDISPATCH_NUM_THREADS", "\u0662", "qd.set_num_threads(1)", "is not a whole number"),  # an Arabic-Indic 2
])
def test_a_bad_setting_makes_the_cpu_backend_unavailable_saying_why(variable, setting, fix, message):
    """A bad setting failed `import qdispatch`, so `qdispatch info` could not say what
    was wrong and the reference backend could not run; int() read "2_0" as 20."""
    out = run_python("-c", BAD_SETTING.format(fix=fix), **{variable: setting})
    assert out.returncode == 0, out.stderr
    status, refused, reference, fixed = out.stdout.strip().splitlines()
    assert status.startswith("False | ") and message in status
    assert message in refused  # the default backend stays cpu, and says why it can't run
    assert (reference, fixed) == ("reference", "cpu")
    info = run_python("-m", "qdispatch", "info", **{variable: setting})
    assert info.returncode == 0 and message in info.stdout, (info.stdout, info.stderr)
    # nothing runs, so info names no ISA or thread count for the setting that is wrong
    shown = "'isa': None" if variable == "QDISPATCH_ISA" else "'threads': None"
    assert shown in info.stdout, info.stdout



def test_a_bad_setting_fixed_on_another_thread_mid_check_is_no_bare_error(monkeypatch):
    """unavailable_reason tested the bad settings, then read the first: a set_num_threads
    on another thread between the two made qd.tensor raise a bare StopIteration (or a
    RuntimeError from a dict that changed size). Here the fix lands right after the test."""
    from qdispatch._core import get_backend
    cpu = get_backend("cpu")

    class FixedOnTest(dict):
        def __len__(self):  # the other thread's set_num_threads, as the settings are tested
            reason = super().__len__()
            self.clear()
            return reason

    for before in ({"threads": "QDISPATCH_NUM_THREADS='two' is not a whole number"}, {}):
        monkeypatch.setattr(cpu, "_bad_settings", FixedOnTest(before), raising=True)
        reason = cpu.unavailable_reason()
        assert reason in (None, *before.values())

ONE_TEAM_OF_THREADS = """
import os
import numpy as np, qdispatch as qd

qd.set_num_threads(4)
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 1024)).astype(np.float32)
a8 = qd.QuantScheme("q8s", axis=0)
w = qd.quantize(rng.standard_normal((512, 1024)).astype(np.float32), a8, device="cpu")
xq = qd.quantize(x, a8, device="cpu")
a, b = rng.integers(-128, 128, (64, 1024), dtype=np.int8), rng.integers(-128, 128, (1024, 512), dtype=np.int8)
small_w = qd.quantize(rng.standard_normal((48, 1024)).astype(np.float32), a8, device="cpu")

def calls():
    # parallel loops of 2 to 4 workers in turn: quantizing x (2), W8A8 (2, then 4),
    # qq and fq products (4), a small product (3), dequantize, int_matmul
    qd.linear(x, w, activation_scheme="q8s")
    qd.quantize(x, a8, device="cpu")
    qd.linear(xq, w)
    qd.linear(x, w)
    qd.linear(x[:8], small_w)
    w.dequantize()
    qd.int_matmul(a, b)

calls()
before = set(os.listdir("/proc/self/task"))
for _ in range(10):
    calls()
print(sorted(set(os.listdir("/proc/self/task")) - before))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc to list threads")
@pytest.mark.skipif(not built_with_openmp(), reason="built without OpenMP: one thread everywhere")
def test_parallel_loops_of_any_size_keep_one_team_of_threads():
    """Every parallel loop runs on a team of the thread setting's size.  libgomp ends
    the threads that a smaller team leaves out and starts new ones for the next larger
    team, so a 2-worker quantize between 4-worker products started two threads a call
    (0.45 ms a product on a 16-core Xeon).  No thread may start once the team exists."""
    out = run_python("-c", ONE_TEAM_OF_THREADS)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"threads started after the first calls: {out.stdout.strip()}"


THREADS_REFUSED = """
import os, resource
import numpy as np, qdispatch as qd

rng = np.random.default_rng(0)
x = rng.standard_normal((128, 1024)).astype(np.float32)
w = qd.quantize(rng.standard_normal((1024, 1024)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
qd.set_num_threads(1)
want = qd.q_matmul(x, w.T).numpy()  # packs the weight, on this thread alone
# room for one thread's stack and a half, then a team of four: OpenMP would end the process
stack = int(os.environ["STACK_BYTES"])
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + stack * 3 // 2, resource.RLIM_INFINITY))
qd.set_num_threads(4)
got = qd.q_matmul(x, w.T).numpy()
print(np.array_equal(got, want), qd.get_num_threads(), qd.info()["backends"]["cpu"].get("threads_note", ""))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's address-space limit")
@pytest.mark.skipif(not built_with_openmp(), reason="built without OpenMP: one thread everywhere")
@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer maps memory as it goes: a limit on it stops the sanitizer, not OpenMP")
@pytest.mark.parametrize("stack_setting", [None, " 24 m ", "GOMP_STACKSIZE=20480"])
def test_threads_the_system_refuses_leave_the_kernels_on_those_it_started(stack_setting):
    """GNU OpenMP ends the process ("Thread creation failed") when the system refuses
    one of a team's threads, as a container's limit on tasks does.  The kernels run on
    the threads that could start, with the bits of one thread, and `info` says so; the
    threads tried first get the stacks OpenMP would give (OMP_STACKSIZE, GOMP_STACKSIZE)."""
    import resource
    if stack_setting is None:
        env = {"STACK_BYTES": str(resource.getrlimit(resource.RLIMIT_STACK)[0])}
        if not 1 << 20 <= int(env["STACK_BYTES"]) <= 1 << 30:  # unlimited, say
            pytest.skip("the default thread stack follows the stack limit only when that is set")
    elif stack_setting.startswith("GOMP_STACKSIZE="):
        env = {"GOMP_STACKSIZE": stack_setting.split("=")[1], "STACK_BYTES": str(20 << 20)}
    else:
        env = {"OMP_STACKSIZE": stack_setting, "STACK_BYTES": str(24 << 20)}
    out = run_python("-c", THREADS_REFUSED, **env)
    assert out.returncode == 0, out.stderr
    same, threads, note = out.stdout.strip().split(" ", 2)
    assert same == "True" and 1 <= int(threads) < 4, out.stdout
    assert note.startswith(f"the system let only {threads} threads start"), note


ROUNDED_UPWARD = """
import ctypes, ctypes.util, platform
import numpy as np, qdispatch as qd

libm = ctypes.CDLL(ctypes.util.find_library("m"))
x86 = platform.machine() in ("x86_64", "AMD64")
FE_UPWARD, FE_INEXACT = (0x800, 0x20) if x86 else (0x400000, 0x10)
rng = np.random.default_rng(0)
x = (rng.integers(-100, 100, (64, 4096)) + 0.5).astype(np.float32)  # ties, so rounding shows
w = qd.quantize(rng.standard_normal((256, 4096)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
by_block = qd.QuantScheme("q8s", block=(1, 64))

def results():
    q = qd.quantize(x, by_block, device="cpu")
    return [q.values, q.scales, q.dequantize().numpy(), qd.linear(x, w).numpy(),
            qd.linear(x, w, activation_scheme="q8s").numpy()]

qd.set_num_threads(2)
nearest = results()  # the team starts here, in the default mode
libm.fesetround(FE_UPWARD)
upward = {threads: (qd.set_num_threads(threads), results())[1] for threads in (2, 1)}
assert libm.fegetround() == FE_UPWARD  # the caller's mode is left as it was
libm.fesetround(0)
qd.set_num_threads(2)
after = results()
for name, two, one, before, again in zip(["values", "scales", "dequantize", "fq", "W8A8"], upward[2], upward[1],
                                         nearest, after):
    assert np.array_equal(two, one), name + ": 2 threads differ from 1 in the upward mode"
    assert np.array_equal(again, before), name + ": the team kept the upward mode"
assert not np.array_equal(upward[1][0], nearest[0])  # the mode did change the values
for threads in (1, 2):  # the flags the caller's thread raised in its share stay raised, as on one thread
    qd.set_num_threads(threads)
    libm.feclearexcept(FE_INEXACT)
    qd.quantize(x, by_block, device="cpu")
    assert libm.fetestexcept(FE_INEXACT), f"{threads} threads: the inexact flag was wiped"
print("ok")
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"),
                    reason="needs fesetround's FE_UPWARD value for this machine")
@pytest.mark.skipif(not built_with_openmp(), reason="built without OpenMP: one thread everywhere")
def test_every_thread_computes_in_the_callers_floating_point_mode():
    """Pool threads keep the floating-point mode they started in: in a process that
    rounded upward, quantize's rows on the second thread were rounded to nearest."""
    out = run_python("-c", ROUNDED_UPWARD)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


FORKED_WORKER = """
import multiprocessing as mp, warnings
import numpy as np, qdispatch as qd

qd.set_num_threads(2)
x = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
qd.q_matmul(qd.quantize(x[:64], "q8s", device="cpu"), qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="cpu").T)


def work(_):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qd.set_num_threads(4)
    got, want = (qd.q_matmul(qd.quantize(x[:64], "q8s", device=d), qd.quantize(x, qd.QuantScheme("q8s", axis=0), device=d).T)
                 for d in ("cpu", "reference"))
    return (qd.get_num_threads(), qd.info()["backends"]["cpu"].get("threads_note", ""),
            [str(w.message) for w in caught if w.category is RuntimeWarning],
            bool(np.array_equal(got.numpy(), want.numpy())))


if __name__ == "__main__":
    with mp.get_context("fork").Pool(1) as pool:
        threads, note, warned, same = pool.map_async(work, [0]).get(timeout=120)[0]
    assert threads == 1 and "forked after qdispatch was loaded" in note, (threads, note)
    assert len(warned) == 1 and warned[0].startswith("set_num_threads(4) has no effect"), warned
    assert same
    assert qd.get_num_threads() == 2 and "threads_note" not in qd.info()["backends"]["cpu"]
    print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.skipif(not built_with_openmp(), reason="built without OpenMP: one thread everywhere")
def test_a_worker_forked_after_threaded_kernels_runs_them_on_one_thread(tmp_path):
    """OpenMP's threads do not survive fork: a worker forked after the kernels ran on
    several threads would wait for them forever in its first threaded kernel.  It runs
    them on one thread instead, with the reference's bits, and says so; the parent
    keeps its threads."""
    script = tmp_path / "forked_worker.py"
    script.write_text(FORKED_WORKER)
    out = run_python(str(script))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


FORKED_WHILE_PACKING = """
import os, signal
import numpy as np, qdispatch as qd
from qdispatch.backends import cpu as cpu_backend

w = qd.quantize(np.ones((32, 64), np.float32), "q8s", device="cpu")
with cpu_backend._packing_lock(w.storage):  # as when another thread packs w at the moment of the fork
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a child waiting for the lock would wait for ever
        qd.q_matmul(np.ones((2, 32), np.float32), w)  # x @ w: the orientation packed on first use
        os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_weight_is_packed_packs_its_own(tmp_path):
    """The packing lock another thread held at the fork stayed held in the child,
    whose first packing then waited for ever."""
    script = tmp_path / "forked_while_packing.py"
    script.write_text(FORKED_WHILE_PACKING)
    out = run_python(str(script))
    assert out.returncode == 0 and out.stdout.strip() == "child 0", (out.stdout, out.stderr)


def test_threads_meeting_a_fresh_weight_pack_it_once(rng, monkeypatch):
    """The panels of a weight used in its lazily packed orientation (x @ w, w not
    transposed) are built by one thread while the others wait: every thread packing
    its own copy cost N times the time and memory."""
    from qdispatch.backends import cpu as cpu_backend
    real, packs = cpu_backend._cpu.PackedWeights, []

    def slow_pack(*args):
        packs.append(args[0].shape)
        time.sleep(0.05)  # hold the window open: the others arrive meanwhile
        return real(*args)
    monkeypatch.setattr(cpu_backend._cpu, "PackedWeights", slow_pack)
    w = qd.quantize(rng.standard_normal((256, 128)).astype(np.float32), qd.QuantScheme("q8s", axis=1), device="cpu")
    packs.clear()  # a weight's own orientation is packed as it is made
    x = rng.standard_normal((4, 256)).astype(np.float32)
    results, start = [None] * 8, threading.Barrier(8)

    def work(i):
        start.wait()
        results[i] = qd.q_matmul(x, w).numpy()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert packs == [(128, 256)]
    want = qd.q_matmul(x, w.to("reference")).numpy()
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_a_thread_packing_one_weight_does_not_hold_up_another(rng):
    """One lock for every weight made a thread meeting a fresh weight wait until
    another thread had packed an unrelated one (a model's layers quantized in
    parallel took as long as one after the other)."""
    from qdispatch.backends import cpu as cpu_backend
    scheme = qd.QuantScheme("q8s", axis=1)
    busy, fresh = (qd.quantize(rng.standard_normal((64, 32)).astype(np.float32), scheme, device="cpu")
                   for _ in range(2))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    results = []
    with cpu_backend._packing_lock(busy.storage):  # another thread is packing `busy`
        worker = threading.Thread(target=lambda: results.append(qd.q_matmul(x, fresh).numpy()), daemon=True)
        worker.start()
        worker.join(timeout=60)
        finished = not worker.is_alive()
    worker.join()
    assert finished, "packing one weight waited for another weight's packing"
    np.testing.assert_allclose(results[0], qd.q_matmul(x, fresh.to("reference")).numpy(), rtol=1e-5, atol=1e-4)


def test_gil_is_released_during_kernels(rng, threads):
    """Another Python thread keeps running while one long kernel call runs; with
    the GIL held it would get no turn until the call returned."""
    qd.set_num_threads(1)
    wq = qd.quantize(rng.standard_normal((2048, 2048)).astype(np.float32), "q8s", device="cpu")
    x = rng.standard_normal((512, 2048)).astype(np.float32)
    ticks = [0]
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0)  # hand the GIL back at once, so the main thread never waits for it

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switches: the ticker runs only if the GIL is released
    t = threading.Thread(target=ticker)
    try:
        t.start()
        during = []
        for _ in range(3):
            before = ticks[0]
            qd.q_matmul(x, wq.T)
            during.append(ticks[0] - before)
    finally:
        done.set()
        sys.setswitchinterval(interval)
        t.join()
    assert max(during) > 100


def test_c_library_matches_the_package_and_its_header():
    """The shipped libqdispatch reports this release, and the ABI of the shipped header."""
    import os
    import re
    with open(os.path.join(qd.get_include(), "qdispatch.h")) as f:
        header_abi = int(re.search(r"#define QD_ABI_VERSION (\d+)", f.read()).group(1))
    assert CPU_INFO["library"] == {"version": qd.__version__, "abi": header_abi}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n", [100, 3000], ids=["numpy's size", "C's size"])
def test_casts_between_float_dtypes_are_the_references(rng, n, backend):
    """The cpu backend casts with C's conversions from 1024 values on (bfloat16 at any
    size), the cuda backend with its kernels: the reference's bits for every value,
    overflow to Inf, subnormal halves, signed zeros and NaNs with their payloads among
    them (C's and CUDA's float16 NaN was one quiet NaN whatever the payload: numpy's
    below 1024 values)."""
    x = (rng.standard_normal(n) * rng.choice([1e-7, 1e-5, 1.0, 1e3, 7e4], n)).astype(np.float32)
    x[:8] = [0.0, -0.0, np.inf, -np.inf, 65520.0, -6e-8, 3e-8, np.nan]
    x[8] = -np.nan
    x[9:14] = np.array([0x7FA00000, 0xFF800001, 0x7FC00001, 0x7F800FFF, 0xFFFFFFFF], np.uint32).view(np.float32)
    for src in ("float32", "float16", "bfloat16"):
        for dst in ("float32", "float16", "bfloat16"):
            if src == dst or "float32" not in (src, dst):
                continue
            got, want = (qd.tensor(qd.tensor(x, device=dev, dtype=src), dtype=dst) for dev in (backend, "reference"))
            assert got.dtype == want.dtype == dst
            g = np.asarray(got.to("cpu").payload)
            w = np.asarray(want.to("reference").payload)
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def test_fq_terms_past_float32s_range_of_both_signs_give_no_finite_sum(isa):
    """README: such sums are inf, or NaN where terms of both signs meet; which one
    depends on the ISA (a fused multiply-add keeps an infinite sum infinite when the
    next product, past the range, is of the other sign), never a finite number."""
    w = np.zeros((16, 32), np.float32)
    for k in (1, 4, 8, 31):  # the other-signed term in another add chain, and in the same
        w[:, 0], w[:, k] = 1.0, -1.0
        wq = qd.quantize(w, "q8s", device="cpu")
        x = np.full((1, 32), 1e37, np.float32)
        out = qd.linear(x, wq).numpy()
        assert not np.isfinite(out).any(), (isa, k)
        w[:, k] = 0.0


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", axis=0),
                                    qd.QuantScheme("q4s", block=(1, 32), store="packed_u32", scale_dtype="f16")],
                         ids=repr)
def test_a_weight_takes_its_size_once(rng, scheme, tmp_path):
    """The stored values stayed beside the kernel panels that hold the same values, so a
    weight on cpu took about twice its nbytes; the store is now read back from them."""
    import tracemalloc
    x = rng.standard_normal((512, 1024)).astype(np.float32)
    tracemalloc.start()  # numpy's arrays are traced, the C library's panels are not
    try:
        w = qd.quantize(x, scheme, device="cpu")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    values_bytes = w.nbytes - w.scales.size * np.dtype(np.float16 if scheme.scale_dtype == "f16" else np.float32).itemsize
    assert held < values_bytes / 2, f"{held} bytes held beside {values_bytes} bytes of values"
    ref = qd.quantize(x, scheme, device="reference")
    np.testing.assert_array_equal(w.values, ref.values)  # read back, every time it is asked for
    np.testing.assert_array_equal(w.dequantize().numpy(), ref.dequantize().numpy())
    np.testing.assert_array_equal(w.to("reference").values, ref.values)
    np.testing.assert_array_equal(qd.embedding(np.array([0, 511, 7]), w).numpy(), ref.dequantize().numpy()[[0, 511, 7]])
    a = rng.standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_allclose(qd.q_matmul(a, w).numpy(), qd.q_matmul(a, ref).numpy(), rtol=1e-5, atol=1e-4)
    qd.save(tmp_path / "w.safetensors", {"w": w})
    np.testing.assert_array_equal(qd.load(tmp_path / "w.safetensors", device="reference")["w"].values, ref.values)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's memory from Linux's /proc")
@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer keeps freed memory in quarantine: the panels' going shows in no RSS")
def test_a_table_looked_up_takes_its_size_once():
    """A table is quantized as a weight, into kernel panels; its first lookup read its
    values back and kept them beside the panels, which only a product reads.  Now the
    panels go at a lookup that comes before any product (and come back for one)."""
    code = """if 1:
        import numpy as np, qdispatch as qd
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        table = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
        ref = qd.quantize(table, qd.QuantScheme("q8s", axis=0), device="reference")
        ids = np.array([3, 4095, 0, 3])
        before = rss()
        w = qd.quantize(table, qd.QuantScheme("q8s", axis=0), device="cpu")
        assert np.array_equal(qd.embedding(ids, w).numpy(), ref.dequantize().numpy()[ids])
        print((rss() - before) / w.nbytes)
        x = np.ones((2, 4096), np.float32)
        assert np.array_equal(qd.q_matmul(x, w.T).numpy(), qd.q_matmul(x, w.T.to("cpu")).numpy())
        assert np.allclose(qd.q_matmul(x, w.T).numpy(), qd.q_matmul(x, ref.T).numpy(), rtol=1e-5, atol=1e-2)
        assert np.array_equal(qd.embedding(ids, w).numpy(), ref.dequantize().numpy()[ids])
    """
    out = run_python("-c", code, MALLOC_MMAP_THRESHOLD_="131072")  # freed panels go back to the system at once
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 1.5, f"the table took {float(out.stdout):.2f}x its nbytes after a lookup"
