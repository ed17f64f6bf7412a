"""The C kernels behind the `cpu` backend (qdispatch._cpu), checked against plain
numpy / Python-int references on every instruction set this machine runs."""
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import qdispatch as qd
from helpers import built_with_openmp

_cpu = pytest.importorskip("qdispatch._cpu")

# float32 results against float64 math on the same (dequantized) operands:
# error measured relative to the largest reference magnitude.
RTOL_FLOAT_ACCUM = 1e-5
QRANGE = {"q8s": (-127, 127), "q8f": (-128, 127), "q4s": (-7, 7), "q4f": (-8, 7),
          "q2s": (-1, 1), "q2f": (-2, 1)}
BITS_RANGE = {8: (-128, 127), 4: (-8, 7), 2: (-2, 1)}

def exact_matmul(a, b):
    """int8 @ int8 in float64 BLAS: exact while K * 2^14 < 2^53."""
    return (a.astype(np.float64) @ b.astype(np.float64)).astype(np.int64)


def assert_close(out, ref, rtol=RTOL_FLOAT_ACCUM):
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(out.astype(np.float64) - ref).max()) / scale
    assert err <= rtol, f"relative error {err:.3g} > {rtol:g}"


def expand(scales, shape, block):
    return np.repeat(np.repeat(scales, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def random_weights(rng, n, k, bits, block):
    lo, hi = BITS_RANGE[bits]
    w = rng.integers(lo, hi + 1, (n, k), dtype=np.int8)
    scales = (rng.random((n // block[0], k // block[1]), dtype=np.float32) + 0.25).astype(np.float32)
    return w, scales


# ---- a small numpy model of the quantization formula --------------------------

def round_up_scale(scale, scale_dtype):
    if scale_dtype == "f32":
        return scale
    if scale_dtype == "f16":
        half = scale.astype(np.float16)
        half = np.where(half.astype(np.float32) < scale, np.nextafter(half, np.float16(np.inf)), half)
        return half.astype(np.float32)
    bits = scale.view(np.uint32)
    truncated = bits & np.uint32(0xFFFF0000)
    return np.where(truncated != bits, truncated + np.uint32(0x10000), truncated).astype(np.uint32).view(np.float32)


def numpy_quantize(x, value, block, scale_dtype="f32"):
    lo, hi = QRANGE[value]
    r, c = x.shape
    blocks = np.abs(x).reshape(r // block[0], block[0], c // block[1], block[1])
    amax = blocks.max(axis=(1, 3)).astype(np.float32)
    scale = (np.float32(2.0) * amax) / np.float32(hi - lo)
    scale = np.where(amax == 0, np.float32(1.0), scale).astype(np.float32)
    scale = round_up_scale(scale, scale_dtype)
    q = np.clip(np.rint(x / expand(scale, x.shape, block)), lo, hi).astype(np.int8)
    return q, scale


# ---- ISA control ----------------------------------------------------------------

def test_isa_info_lists_active_built_supported():
    info = _cpu.isa_info()
    assert "scalar" in info["built"] and "scalar" in info["supported"]
    assert info["active"] in info["supported"]
    assert set(info["supported"]) <= set(info["built"])


def test_set_isa_rejects_unknown_and_unsupported():
    with pytest.raises(ValueError, match="no ISA has that name"):
        _cpu.set_isa("sse9")
    for name in ("scalar", "avx2", "avxvnni", "avx512vnni", "neon_dotprod", "amx"):
        if name not in _cpu.isa_info()["supported"]:
            with pytest.raises(RuntimeError):
                _cpu.set_isa(name)
    _cpu.set_isa("scalar")
    assert _cpu.get_isa() == "scalar"
    _cpu.set_isa("auto")
    assert _cpu.get_isa() == _cpu.isa_info()["active"]


def test_num_threads_roundtrip():
    default = _cpu.get_num_threads()
    _cpu.set_num_threads(3)
    if built_with_openmp():
        assert _cpu.get_num_threads() == 3
    else:  # the setting is accepted, and the kernels say they run on their one thread
        assert default == _cpu.get_num_threads() == 1
    _cpu.set_num_threads(0)
    assert _cpu.get_num_threads() == default


@pytest.mark.skipif(not built_with_openmp(), reason="one thread without OpenMP")
def test_thread_count_is_capped_at_four_per_processor():
    # Uncapped, a count like this became the OpenMP team size of a loop with enough
    # tasks: the team's setup overflowed the stack, or thread creation failed and
    # OpenMP exited the process.
    try:
        _cpu.set_num_threads(0)
        procs = _cpu.get_num_threads()
        _cpu.set_num_threads(2**31 - 1)
        assert _cpu.get_num_threads() == 4 * procs
        _cpu.set_num_threads(4 * procs - 1)
        assert _cpu.get_num_threads() == 4 * procs - 1
        _cpu.set_num_threads(2**31 - 1)
        w = np.ones((16 * 100, 4), np.int8)   # 100 panels x 4 row blocks: 400 tasks
        pw = _cpu.PackedWeights(w, np.ones((w.shape[0], 1), np.float32), 1, 4, 8)
        np.testing.assert_array_equal(_cpu.int_matmul_packed(np.ones((256, 4), np.int8), pw), 4)
    finally:
        _cpu.set_num_threads(0)


# ---- int_matmul -------------------------------------------------------------------

TAIL_SHAPES = [(1, 1, 1), (1, 7, 1), (2, 3, 5), (3, 17, 16), (4, 16, 17), (5, 31, 33),
               (7, 32, 15), (8, 33, 31), (9, 63, 64), (15, 64, 65), (16, 65, 63), (17, 97, 13),
               (31, 127, 1), (33, 5, 97), (65, 129, 32), (1, 4096, 33), (70, 8, 127)]


@pytest.mark.parametrize("M,K,N", TAIL_SHAPES)
def test_int_matmul_exact_on_tails(isa, rng, M, K, N):
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    b = rng.integers(-128, 128, (K, N), dtype=np.int8)
    np.testing.assert_array_equal(_cpu.int_matmul(a, b), exact_matmul(a, b))


def test_int_matmul_extremes(isa):
    M, K, N = 3, 300, 19
    low_a = np.full((M, K), -128, np.int8)
    low_b = np.full((K, N), -128, np.int8)
    np.testing.assert_array_equal(_cpu.int_matmul(low_a, low_b), np.full((M, N), 128 * 128 * K))
    alternating = np.where(np.arange(K * N) % 2 == 0, -128, 127).astype(np.int8).reshape(K, N)
    np.testing.assert_array_equal(_cpu.int_matmul(low_a, alternating), exact_matmul(low_a, alternating))
    mixed = np.where(np.arange(M * K) % 3 == 0, 127, -128).astype(np.int8).reshape(M, K)
    np.testing.assert_array_equal(_cpu.int_matmul(mixed, alternating), exact_matmul(mixed, alternating))


def test_int_matmul_large_k_exact(isa):
    K = 131071   # the largest exact depth: 131071 * 2^14 < 2^31
    a = np.full((2, K), -128, np.int8)
    b = np.full((K, 3), -128, np.int8)
    np.testing.assert_array_equal(_cpu.int_matmul(a, b), np.full((2, 3), 16384 * K))
    rng = np.random.default_rng(7)
    a = rng.integers(-128, 128, (3, 70000), dtype=np.int8)
    b = rng.integers(-128, 128, (70000, 5), dtype=np.int8)
    np.testing.assert_array_equal(_cpu.int_matmul(a, b), exact_matmul(a, b))


def test_int_matmul_k_too_large_is_a_shape_error():
    a = np.zeros((1, 131072), np.int8)
    b = np.zeros((131072, 1), np.int8)
    with pytest.raises(ValueError, match="131071"):
        _cpu.int_matmul(a, b)


def test_int_matmul_rejects_bad_operands():
    with pytest.raises(qd.ShapeError, match=r"\(2, 3\) and \(4, 2\) do not agree on K"):
        _cpu.int_matmul(np.zeros((2, 3), np.int8), np.zeros((4, 2), np.int8))
    with pytest.raises(TypeError, match="a must have dtype int8, got int16"):
        _cpu.int_matmul(np.zeros((2, 3), np.int16), np.zeros((3, 2), np.int8))
    with pytest.raises(ValueError, match=r"a must be C-contiguous: pass np.ascontiguousarray\(a\)"):
        _cpu.int_matmul(np.zeros((3, 2), np.int8).T, np.zeros((3, 2), np.int8))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_int_matmul_packed_exact(isa, rng, bits):
    for M, K, N in [(1, 33, 17), (6, 64, 40), (19, 100, 3)]:
        w, scales = random_weights(rng, N, K, bits, (1, K))
        a = rng.integers(-128, 128, (M, K), dtype=np.int8)
        pw = _cpu.PackedWeights(w, scales, 1, K, bits)
        np.testing.assert_array_equal(_cpu.int_matmul_packed(a, pw), exact_matmul(a, w.T))


# ---- packed weights ----------------------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_round_trip(rng, bits):
    """Tails of both dims (a partial panel, K past the last whole unit or 16 values),
    and sizes that unpack on several threads."""
    for N, K, block in [(1, 1, (1, 1)), (17, 33, (17, 11)), (32, 64, (1, 32)), (5, 70, (5, 7)),
                        (300, 1000, (1, 1000)), (35, 4100, (35, 4)), (64, 4096, (1, 128))]:
        w, scales = random_weights(rng, N, K, bits, block)
        pw = _cpu.PackedWeights(w, scales, block[0], block[1], bits)
        w2, s2 = pw.unpack()
        np.testing.assert_array_equal(w2, w)
        np.testing.assert_array_equal(s2, scales)
        assert pw.shape == (N, K) and pw.bits == bits and pw.block == block
        assert pw.nbytes >= N * K * bits // 8


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([8, 4, 2]), n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip_at_any_shape(bits, n, k, seed):
    """Every value back where it was, whatever the panel's and the unit's tails."""
    w, scales = random_weights(np.random.default_rng(seed), n, k, bits, (1, k))
    np.testing.assert_array_equal(_cpu.PackedWeights(w, scales, 1, k, bits).unpack()[0], w)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_packed_weights_dequantize_as_their_rows_do_on_every_isa(isa, rng, bits, dtype):
    """Straight from the panels, a few rows at a time: dequantize_rows' bits for the
    unpacked values, with blocks of rows and of columns, tails of both dims, and sizes
    past one thread."""
    for N, K, block in [(1, 1, (1, 1)), (17, 33, (17, 11)), (35, 70, (5, 7)), (40, 64, (8, 32)),
                        (300, 1000, (1, 1000)), (33, 4100, (1, 4))]:
        w, scales = random_weights(rng, N, K, bits, block)
        got = _cpu.PackedWeights(w, scales, *block, bits).dequantize(dtype)
        want = _cpu.dequantize_rows(w, 0, N, K, scales, *block, dtype=dtype)
        assert got.dtype == want.dtype and got.shape == (N, K)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float64", "f16", None, np.float16])
def test_dequantizing_to_a_dtype_with_no_kernel_names_the_ones_there_are(dtype):
    """A dtype other than float32, float16 or bfloat16 (by name) was a bare KeyError."""
    w, scales = np.ones((16, 8), np.int8), np.ones((16, 1), np.float32)
    for call in (lambda: _cpu.PackedWeights(w, scales, 1, 8, 8).dequantize(dtype),
                 lambda: _cpu.dequantize_rows(w, 0, 16, 8, scales, 1, 8, dtype=dtype)):
        with pytest.raises(qd.ArgumentError, match=r"Can't dequantize to dtype .*: use one of "
                                                   r"\['float32', 'float16', 'bfloat16'\]"):
            call()


def test_pack_rejects_out_of_range_values_and_bad_blocks():
    with pytest.raises(ValueError, match=r"must lie in \[-8, 7\] for bits=4: got \[8, 8\]"):
        _cpu.PackedWeights(np.full((2, 4), 8, np.int8), np.ones((2, 1), np.float32), 1, 4, 4)
    with pytest.raises(qd.ShapeError, match=r"Block \(1, 4\) does not divide the weight shape \(2, 6\)"):
        _cpu.PackedWeights(np.zeros((2, 6), np.int8), np.ones((2, 1), np.float32), 1, 4, 8)


# ---- qq ---------------------------------------------------------------------------

QQ_CASES = [
    # M, K, N, (a_block_m, a_block_k), (w_block_n, w_block_k)
    (1, 64, 33, (1, 64), (1, 64)),          # per row x per column
    (5, 96, 17, (5, 96), (17, 96)),         # per tensor
    (17, 128, 31, (1, 32), (1, 32)),        # Q8_0-style blocks
    (3, 256, 16, (1, 64), (1, 128)),        # different block lengths: groups of 64
    (9, 192, 65, (3, 128 // 2), (1, 192)),  # row blocks on A
    (4, 96, 8, (1, 48), (2, 32)),           # groups of 16
    (2, 30, 7, (1, 6), (7, 10)),            # groups of 2: portable fallback
    (33, 65, 9, (1, 65), (1, 5)),           # odd K, groups of 5
]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("case", QQ_CASES)
def test_qq_matmul_matches_float64(isa, rng, bits, case):
    M, K, N, ablock, wblock = case
    w, w_scales = random_weights(rng, N, K, bits, wblock)
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    a_scales = (rng.random((M // ablock[0], K // ablock[1]), dtype=np.float32) + 0.25).astype(np.float32)
    pw = _cpu.PackedWeights(w, w_scales, wblock[0], wblock[1], bits)
    out = _cpu.qq_matmul(a, a_scales, ablock[0], ablock[1], pw)
    ref = (a * expand(a_scales, a.shape, ablock).astype(np.float64)) @ \
          (w * expand(w_scales, w.shape, wblock).astype(np.float64)).T
    assert out.dtype == np.float32 and out.shape == (M, N)
    assert_close(out, ref)


def test_qq_matmul_full_range_extremes(isa):
    M, K, N = 4, 256, 20
    a = np.full((M, K), -128, np.int8)
    w = np.where(np.arange(N * K) % 2 == 0, -128, 127).astype(np.int8).reshape(N, K)
    pw = _cpu.PackedWeights(w, np.ones((N, K // 32), np.float32), 1, 32, 8)
    out = _cpu.qq_matmul(a, np.ones((M, K // 32), np.float32), 1, 32, pw)
    np.testing.assert_array_equal(out, exact_matmul(a, w.T).astype(np.float32))


def test_qq_matmul_rejects_mismatched_scales(rng):
    pw = _cpu.PackedWeights(np.zeros((4, 8), np.int8), np.ones((4, 1), np.float32), 1, 8, 8)
    with pytest.raises(qd.ShapeError, match=r"a_scales must have shape \(2, 1\), got \(2, 2\)"):
        _cpu.qq_matmul(np.zeros((2, 8), np.int8), np.ones((2, 2), np.float32), 1, 8, pw)
    with pytest.raises(qd.ShapeError, match=r"a has K=6 but the weights have shape \(4, 8\)"):
        _cpu.qq_matmul(np.zeros((2, 6), np.int8), np.ones((2, 1), np.float32), 1, 6, pw)


# ---- fq and W8A8 -----------------------------------------------------------------

FQ_CASES = [(1, 64, 33, (1, 64)), (5, 96, 17, (17, 96)), (17, 128, 31, (1, 32)),
            (3, 30, 7, (7, 6)), (20, 65, 16, (1, 65)), (2, 256, 40, (4, 128)),
            # scale groups that are no whole panel units (a [K, N] weight scaled per row of K)
            (4, 9, 20, (5, 1)), (7, 21, 36, (36, 3)), (1, 50, 17, (17, 2)),
            # one row of scales for all of N (a scale per input channel): x takes them
            (3, 40, 33, (33, 1)), (2, 48, 20, (20, 6))]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("case", FQ_CASES)
def test_fq_matmul_matches_float64(isa, rng, bits, case):
    M, K, N, wblock = case
    w, w_scales = random_weights(rng, N, K, bits, wblock)
    x = rng.standard_normal((M, K)).astype(np.float32)
    pw = _cpu.PackedWeights(w, w_scales, wblock[0], wblock[1], bits)
    out = _cpu.fq_matmul(x, pw)
    ref = x.astype(np.float64) @ (w * expand(w_scales, w.shape, wblock).astype(np.float64)).T
    assert_close(out, ref)


def test_fq_fold_scales_takes_the_least_power_above_every_scale():
    """x[k] * s[k] * 2^-e with 2^e the least power (e >= 0) above every |s|; none where a
    scale is not finite or 2^e would pass 2^16 (it would take small scales' bits: a
    weight scaled from 2^93 down to 2^-72 came out 0). One row or column of scales."""
    for scales, power in (([0.5, 3.0, -7.0], 8.0), ([0.01, 0.02], 1.0), ([0.0, 0.0], 1.0), ([4.0], 8.0),
                          ([2.0 ** 15 * 1.5], 2.0 ** 16), ([1e-45, 1.0], 2.0)):
        scales = np.array(scales, np.float32)
        for grid in (scales, scales[None, :], scales[:, None]):
            x_scales, got = _cpu.fq_fold_scales(grid)
            assert got == power and x_scales.dtype == np.float32
            np.testing.assert_array_equal(x_scales, scales / np.float32(power))
            assert np.abs(x_scales).max() < 1
    for scales in ([np.inf], [1.0, np.nan], [2.0 ** 16], [1e30, 1e-20], [np.finfo(np.float32).max]):
        assert _cpu.fq_fold_scales(np.array(scales, np.float32)) is None
    with pytest.raises(qd.ShapeError, match=r"one row or one column, got shape \(2, 3\)"):
        _cpu.fq_fold_scales(np.ones((2, 3), np.float32))
    with pytest.raises(qd.ArgumentTypeError, match="float32"):
        _cpu.fq_fold_scales(np.ones(3))
    with pytest.raises(qd.ArgumentError, match="C-contiguous"):
        _cpu.fq_fold_scales(np.ones(6, np.float32)[::2])


def test_fq_with_scales_far_apart_keeps_the_small_ones(isa):
    """Scales per input channel from 2^93 down to 2^-72, the large channel's x at 0: its
    terms vanish and the small ones are the result. Folded by 2^93 the small scales were
    0 in float32 and so was the product; they stay in the kernels' groups now."""
    w = np.array([[1e30, 1e-20, 2e-20], [1e30, 3e-20, -1e-20]], np.float32)
    wq = qd.quantize(w, qd.QuantScheme("q8s", axis=1), device="cpu")
    x = np.array([[0.0, 1.0, 1.0]], np.float32)
    got = qd.q_matmul(qd.tensor(x, device="cpu"), wq.T).numpy()
    want = qd.q_matmul(qd.tensor(x, device="reference"), wq.to("reference").T).numpy()
    assert (want != 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_fq_with_x_taking_the_scales_stays_finite_where_the_reference_does(isa, rng, bits):
    """A scale per input channel goes into x. Where every weight value at k is 0, x[k]
    up to 2^121 times a scale of 2^15 would overflow (x * s * 0: NaN) though the
    reference's terms there are 0: x takes s * 2^-e instead (2^e above every scale),
    every such product finite. Each row's bits are the same whatever rows it comes
    with."""
    M, K, N = 5, 64, 40
    w, _ = random_weights(rng, N, K, bits, (N, 1))
    w[:, ::3] = 0
    scales = np.ldexp(np.float32(1), rng.integers(-20, 16, (1, K))).astype(np.float32)
    scales[0, ::3] = 2.0 ** 15
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, ::3] = np.ldexp(x[:, ::3], 120)
    pw = _cpu.PackedWeights(w, scales, N, 1, bits)
    out = _cpu.fq_matmul(x, pw)
    ref = x.astype(np.float64) @ (w * scales.astype(np.float64)).T
    assert np.isfinite(ref).all() and np.isfinite(out).all()
    assert_close(out, ref)
    for m in range(M):
        np.testing.assert_array_equal(_cpu.fq_matmul(x[m:m + 1], pw), out[m:m + 1])


@pytest.mark.parametrize("M", [1, 3])
def test_fq_matmul_rows_longer_than_a_task_block(isa, rng, M):
    # K = 65552 float32 is more than the 256 KiB of x rows that one task takes: one row a task.
    # Whole numbers whose sums stay below 2^24 add up exactly in float32, in any order.
    K, N = 65552, 5
    w = rng.integers(-128, 128, (N, K), dtype=np.int8)
    x = rng.integers(-1, 2, (M, K)).astype(np.float32)
    out = _cpu.fq_matmul(x, _cpu.PackedWeights(w, np.ones((N, 1), np.float32), 1, K, 8))
    np.testing.assert_array_equal(out, exact_matmul(x, w.T))


@pytest.mark.parametrize("act_value,act_block", [("q8s", None), ("q8f", 32), ("q4s", 16)])
def test_w8a8_matches_numpy_quantization(isa, rng, act_value, act_block):
    M, K, N = 7, 96, 21
    act_block = act_block or K
    w, w_scales = random_weights(rng, N, K, 8, (1, K))
    pw = _cpu.PackedWeights(w, w_scales, 1, K, 8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[2] = 0.0                                      # an all-zero row: scale 1
    out = _cpu.w8a8_matmul(x, act_value, act_block, pw)
    q, s = numpy_quantize(x, act_value, (1, act_block))
    ref = (q * expand(s, q.shape, (1, act_block)).astype(np.float64)) @ \
          (w * expand(w_scales, w.shape, (1, K)).astype(np.float64)).T
    assert_close(out, ref)


def test_w8a8_rejects_non_finite():
    pw = _cpu.PackedWeights(np.ones((3, 8), np.int8), np.ones((3, 1), np.float32), 1, 8, 8)
    x = np.ones((2, 8), np.float32)
    x[1, 3] = np.nan
    with pytest.raises(qd.NonFiniteError, match="w8a8_matmul: the input holds NaN or Inf"):
        _cpu.w8a8_matmul(x, "q8s", 8, pw)


# ---- quantize -----------------------------------------------------------------------

@pytest.mark.parametrize("value", list(QRANGE))
@pytest.mark.parametrize("scale_dtype", ["f32", "f16", "bf16"])
def test_quantize_bit_identical(rng, value, scale_dtype):
    x = (rng.standard_normal((12, 96)) * 3).astype(np.float32)
    x[:4, :32] = 0.0                                           # zero blocks
    for block in [(1, 96), (12, 96), (1, 32), (4, 16), (3, 1)]:
        q, s = _cpu.quantize(x, value, block[0], block[1], scale_dtype)
        q_ref, s_ref = numpy_quantize(x, value, block, scale_dtype)
        np.testing.assert_array_equal(s.view(np.uint32), s_ref.view(np.uint32))
        np.testing.assert_array_equal(q, q_ref)


def test_quantize_ties_round_half_to_even():
    # amax 127 -> scale exactly 1.0 for q8s; x = n + 0.5 must round to even.
    row = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0.0, 4.5], np.float32)
    q, s = _cpu.quantize(row[None, :], "q8s", 1, row.size, "f32")
    assert s[0, 0] == 1.0
    np.testing.assert_array_equal(q[0], [127, 0, 2, 2, 0, -2, -2, 4, 126, -126, 0, 4])
    # A scale that is not a power of two: ties at (k + 0.5) * scale, where exact.
    scale = np.float32(2.0 * 7.0 / 14.0)
    x = (np.array([7.0, 0.5, 1.5, 2.5, -3.5, 6.5], np.float32) * scale).astype(np.float32)
    q, s = _cpu.quantize(x[None, :], "q4s", 1, x.size, "f32")
    q_ref, s_ref = numpy_quantize(x[None, :], "q4s", (1, x.size))
    np.testing.assert_array_equal(q, q_ref)
    np.testing.assert_array_equal(s, s_ref)


def test_quantize_scales_round_up_in_half_types():
    x = np.array([[1.0, 0.3333333]], np.float32)     # scale 2/254, not representable
    for dtype in ("f16", "bf16"):
        _, s = _cpu.quantize(x, "q8s", 1, 2, dtype)
        exact = np.float32(2.0) / np.float32(254.0)
        assert s[0, 0] >= exact
        assert s[0, 0] == round_up_scale(np.array([exact], np.float32), dtype)[0]


def test_quantize_errors_name_the_problem():
    x = np.ones((3, 4), np.float32)
    x[2, 1] = np.inf
    with pytest.raises(ValueError, match=r"\(2, 1\)"):
        _cpu.quantize(x, "q8s", 1, 4, "f32")
    with pytest.raises(ValueError, match="overflow"):
        _cpu.quantize(np.full((1, 4), 1e9, np.float32), "q8s", 1, 4, "f16")
    with pytest.raises(qd.ShapeError, match=r"Block \(2, 4\) does not divide shape \(3, 4\)"):
        _cpu.quantize(np.ones((3, 4), np.float32), "q8s", 2, 4, "f32")


@pytest.mark.parametrize("cols", [2, 256])   # few blocks and many: both of quantize's loops
def test_quantize_nan_wins_over_an_earlier_overflowing_scale(cols):
    x = np.ones((1, cols), np.float32)
    x[0, 0] = 1e30                                  # its f16 scale overflows
    x[0, cols - 1] = np.nan
    with pytest.raises(ValueError, match=rf"\(0, {cols - 1}\)"):
        _cpu.quantize(x, "q8s", 1, 1, "f16")


# ---- determinism and threads ----------------------------------------------------------

def _all_kernels(rng, M, K=200, N=70):
    w, w_scales = random_weights(rng, N, K, 8, (1, 40))
    w4, w4_scales = random_weights(rng, N, K, 4, (1, K))
    pw, pw4 = _cpu.PackedWeights(w, w_scales, 1, 40, 8), _cpu.PackedWeights(w4, w4_scales, 1, K, 4)
    a = rng.integers(-128, 128, (M, K), dtype=np.int8)
    a_scales = (rng.random((M, K // 20), dtype=np.float32) + 0.5).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)

    def run(rows=slice(None)):
        return [_cpu.int_matmul_packed(a[rows], pw), _cpu.qq_matmul(a[rows], a_scales[rows], 1, 20, pw),
                _cpu.qq_matmul(a[rows], a_scales[rows], 1, 20, pw4), _cpu.fq_matmul(x[rows], pw),
                _cpu.fq_matmul(x[rows], pw4), _cpu.w8a8_matmul(x[rows], "q8s", 40, pw)]
    return run


def test_thread_count_invariance(isa):
    run = _all_kernels(np.random.default_rng(5), M=37)
    try:
        results = []
        for n in (1, 2, 3):
            _cpu.set_num_threads(n)
            results.append(run())
    finally:
        _cpu.set_num_threads(0)
    for other in results[1:]:
        for x, y in zip(results[0], other):
            np.testing.assert_array_equal(x, y)


def test_batch_invariance(isa):
    run = _all_kernels(np.random.default_rng(6), M=80)
    full = run()
    for m in (0, 5, 17, 79):
        alone = run(slice(m, m + 1))
        for x, y in zip(full, alone):
            np.testing.assert_array_equal(x[m:m + 1], y)


def test_concurrent_calls_from_python_threads(rng):
    K, N = 512, 96
    w, w_scales = random_weights(rng, N, K, 8, (1, K))
    pw = _cpu.PackedWeights(w, w_scales, 1, K, 8)
    inputs = [rng.integers(-128, 128, (m, K), dtype=np.int8) for m in (1, 3, 16, 40)]
    expected = [exact_matmul(a, w.T) for a in inputs]
    failures = []

    def worker(i):
        for _ in range(20):
            if not np.array_equal(_cpu.int_matmul_packed(inputs[i], pw), expected[i]):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


# ---- half-precision conversions -------------------------------------------------------

def test_half_conversions(rng):
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 1000,
                        np.array([0.0, -0.0, 65504, 65520, 1e-8, 6e-8, np.inf, -np.inf], np.float32)])
    with np.errstate(over="ignore"):
        f16_ref = x.astype(np.float16)
    np.testing.assert_array_equal(_cpu.f32_to_f16(x).view(np.uint16), f16_ref.view(np.uint16))
    bits = x.view(np.uint32)
    bf_ref = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    bf = _cpu.f32_to_bf16(x)
    np.testing.assert_array_equal(bf[np.isfinite(x)], bf_ref[np.isfinite(x)])
    np.testing.assert_array_equal(_cpu.bf16_to_f32(bf), (bf.astype(np.uint32) << 16).view(np.float32))


def test_f16_to_f32_gives_numpy_bits_for_every_pattern_on_every_isa(isa):
    """All 65536 float16 bit patterns, in order and shuffled (so that NaNs and infinities
    share groups of 8 with finite values): numpy's float32 bits, a signalling NaN's
    payload included, where F16C converts and where the exact loop does."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for src in (h, np.random.default_rng(0).permutation(h), h[3:]):  # h[3:]: groups off by 3
        want = src.view(np.float16).astype(np.float32).view(np.uint32)
        np.testing.assert_array_equal(_cpu.f16_to_f32(src).view(np.uint32), want)


@pytest.fixture(scope="module")
def f32_rounding_points():
    """Every sign, exponent and top mantissa bits, with low bits at the rounding points
    of a normal half (and random ones, for the subnormal halves' other points), in
    order and shuffled (so that NaNs share groups of 8 with numbers), with numpy's
    float16 bits for them."""
    high = np.arange(1 << 19, dtype=np.uint32) << np.uint32(13)
    lows = [0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF] + list(np.random.default_rng(1).integers(0, 1 << 13, 2))
    bits = (high[:, None] | np.array(lows, np.uint32)).reshape(-1)
    cases = []
    for x in (bits, np.random.default_rng(0).permutation(bits)):
        x = x.view(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            cases.append((x, x.astype(np.float16).view(np.uint16)))
    return cases


def test_f32_to_f16_rounds_as_numpy_at_every_exponent_and_rounding_point_on_every_isa(isa, f32_rounding_points):
    """The library's conversion (branch-free so that it vectorizes, or F16C's) gives
    numpy's bits, NaNs' too: their payload's top 10 bits, a NaN still where those are 0
    (it gave one quiet NaN of each sign), a signalling one still signalling (F16C
    quiets it)."""
    for x, want in f32_rounding_points:
        np.testing.assert_array_equal(_cpu.f32_to_f16(x).view(np.uint16), want)
        np.testing.assert_array_equal(_cpu.f32_to_f16(x[3:]).view(np.uint16), want[3:])  # groups off by 3


# ---- the packed_u32 store in C --------------------------------------------------

@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("shape", [(1,), (5,), (3, 17), (2, 3, 33), (64, 1000), (2, 300, 520)])
def test_pack_u32_gives_the_references_words_and_back(rng, bits, shape):
    from qdispatch import quantmath
    values = rng.integers(-128, 128, shape, dtype=np.int8)  # out of range too: the low bits are kept
    words = _cpu.pack_u32(values, bits)
    np.testing.assert_array_equal(words, quantmath.pack_u32(values, bits))
    lo = -(1 << (bits - 1))
    in_range = rng.integers(lo, -lo, shape, dtype=np.int8)
    back = _cpu.unpack_u32(quantmath.pack_u32(in_range, bits), bits, shape[-1])
    np.testing.assert_array_equal(back, in_range)
    np.testing.assert_array_equal(_cpu.unpack_u32(words, bits, shape[-1]),
                                  quantmath.unpack_u32(words, bits, shape[-1]))


def test_unpack_u32_refuses_a_word_count_that_does_not_fit():
    with pytest.raises(qd.ShapeError, match="3 words a row hold no 40 values of 4 bits"):
        _cpu.unpack_u32(np.zeros((2, 3), np.uint32), 4, 40)


def test_the_c_pack_entry_points_check_their_arguments():
    import ctypes
    import os
    lib = ctypes.CDLL(os.path.join(qd.get_library_dir(), "libqdispatch.so"))
    for f in (lib.qd_pack_u32, lib.qd_unpack_u32):
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
    q, words = np.zeros(64, np.int8), np.zeros(16, np.uint32)

    def pack(rows, cols, bits, q_at=q.ctypes.data, words_at=words.ctypes.data):
        return lib.qd_pack_u32(q_at, rows, cols, bits, words_at)

    def unpack(rows, cols, bits, q_at=q.ctypes.data, words_at=words.ctypes.data):
        return lib.qd_unpack_u32(words_at, rows, cols, bits, q_at)

    ok, null, shape, argument, scheme = 0, 1, 2, 3, 4
    for call in (pack, unpack):
        assert call(2, 32, 4) == ok
        assert call(2, 32, 4, q_at=0) == null and call(2, 32, 4, words_at=0) == null
        assert call(2, 32, 3) == scheme and call(2, 32, 16) == scheme
        assert call(0, 32, 4) == shape and call(2, -1, 4) == shape
        assert call(2, 32, 4, q_at=words.ctypes.data) == argument  # the two overlap
        assert call(2 ** 62, 2 ** 62, 4) == argument  # sizes past memory


@pytest.mark.skipif(not built_with_openmp(), reason="built without OpenMP: one thread everywhere")
def test_pack_u32_is_the_same_on_any_thread_count(rng):
    values = rng.integers(-8, 8, (512, 4100), dtype=np.int8)
    try:
        qd.set_num_threads(1)
        one = _cpu.pack_u32(values, 4), _cpu.unpack_u32(_cpu.pack_u32(values, 4), 4, 4100)
        qd.set_num_threads(2)
        two = _cpu.pack_u32(values, 4), _cpu.unpack_u32(_cpu.pack_u32(values, 4), 4, 4100)
    finally:
        qd.set_num_threads(0)
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], values)
    np.testing.assert_array_equal(two[1], values)
