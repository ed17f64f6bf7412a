"""error_report: the figures against independent float64 arithmetic, on every kind of input."""
import math

import numpy as np
import pytest

import qdispatch as qd
from helpers import rel_err, sqnr_db


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_figures_match_float64_arithmetic(rng):
    want = rng.standard_normal((33, 17)).astype(np.float32)
    got = want + 0.01 * rng.standard_normal(want.shape).astype(np.float32)
    report = qd.error_report(want, got)
    w, g = want.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    assert report.sqnr_db == pytest.approx(sqnr_db(want, got), rel=1e-12)
    assert report.relative_error == pytest.approx(rel_err(want, got), rel=1e-12)
    assert report.cosine == pytest.approx(w @ g / (np.linalg.norm(w) * np.linalg.norm(g)), rel=1e-12)
    assert report.max_abs_error == np.max(np.abs(g - w))
    assert report.size == want.size
    assert f"SQNR {report.sqnr_db:.2f} dB" in str(report)


def test_a_quantized_tensor_is_compared_by_its_dequantized_values(device, rng):
    w = rng.standard_normal((64, 96)).astype(np.float32)
    for scheme, floor_db in ((qd.QuantScheme("q8s", axis=0), 38),
                             (qd.QuantScheme("q4s", block=32, store="packed_u32"), 18)):
        q = qd.quantize(w, scheme, device=device)
        report = qd.error_report(w, q)
        assert report == qd.error_report(w, q.dequantize().numpy())
        assert report.sqnr_db > floor_db
    assert qd.error_report(w, qd.quantize(w, "q8s", device=device)).sqnr_db > \
        qd.error_report(w, qd.quantize(w, qd.QuantScheme("q4s", store="packed_u32"), device=device)).sqnr_db


def test_tensors_of_every_dtype_and_a_layer_output(device, rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = qd.quantize(rng.standard_normal((32, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device=device)
    want = x.astype(np.float64) @ w.dequantize().numpy().astype(np.float64).T
    for dtype in ("float32", "float16", "bfloat16"):
        y = qd.linear(qd.tensor(x, dtype=dtype, device=device), w)
        report = qd.error_report(want, y)
        assert report == qd.error_report(want, y.numpy().astype(np.float64))
        assert report.relative_error < {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]


def test_exact_integers_give_no_error(device, rng):
    a = rng.integers(-128, 128, size=(5, 300), dtype=np.int8)
    b = rng.integers(-128, 128, size=(300, 7), dtype=np.int8)
    report = qd.error_report(a.astype(np.int64) @ b.astype(np.int64), qd.int_matmul(qd.tensor(a, device=device), b))
    assert (report.sqnr_db, report.relative_error, report.cosine, report.max_abs_error) == (math.inf, 0.0, 1.0, 0.0)


def test_zero_and_opposite_arrays():
    zeros, ones = np.zeros((3, 3)), np.ones((3, 3))
    both_zero = qd.error_report(zeros, zeros)
    assert (both_zero.sqnr_db, both_zero.relative_error, both_zero.cosine) == (math.inf, 0.0, 1.0)
    nothing_kept = qd.error_report(ones, zeros)
    assert (nothing_kept.sqnr_db, nothing_kept.relative_error, nothing_kept.cosine) == (0.0, 1.0, 0.0)
    from_nothing = qd.error_report(zeros, ones)
    assert (from_nothing.sqnr_db, from_nothing.relative_error, from_nothing.cosine) == (-math.inf, math.inf, 0.0)
    flipped = qd.error_report(ones, -ones)
    assert flipped.cosine == -1.0 and flipped.relative_error == 2.0
    assert flipped.sqnr_db == pytest.approx(-10 * math.log10(4))


def test_values_near_float64s_range_stay_finite():
    want = np.array([1e300, -3e300, 2e300])
    report = qd.error_report(want, want * (1 + 1e-6))
    assert report.relative_error == pytest.approx(1e-6, rel=1e-6)
    assert report.sqnr_db == pytest.approx(120, rel=1e-6)
    assert report.max_abs_error == pytest.approx(3e294, rel=1e-6)
    tiny = np.array([1e-310, 2e-310])  # subnormal: their squares would be 0
    assert qd.error_report(tiny, tiny * 0.5).relative_error == pytest.approx(0.5)


def test_differences_far_below_or_past_the_values_are_measured():
    """A difference 1e-300 the size of the signal is no agreement, and one past
    float64's range still has a relative size."""
    small = qd.error_report([1e300, 1.0], [1e300, 2.0])
    assert small.sqnr_db == pytest.approx(6000) and small.relative_error == pytest.approx(1e-300)
    assert small.cosine == 1.0 and small.max_abs_error == 1.0
    past = qd.error_report(np.array([1e308, -1e308]), np.array([1e308, 1e308]))
    assert past.relative_error == pytest.approx(math.sqrt(2)) and past.max_abs_error == math.inf
    assert past.sqnr_db == pytest.approx(-10 * math.log10(2)) and past.cosine == pytest.approx(0.0, abs=1e-15)


def test_scalars_and_lists():
    assert qd.error_report(2.0, 1.0).relative_error == 0.5
    assert qd.error_report([1, 2, 3], [1, 2, 3]).max_abs_error == 0.0


@pytest.mark.parametrize("reference, approx, error, words", [
    (np.zeros((2, 3)), np.zeros((3, 2)), qd.ShapeError, "reference (2, 3) and approx (3, 2)"),
    (np.zeros((0, 3)), np.zeros((0, 3)), qd.ShapeError, "nothing to compare"),
    ([[1, 2], [3]], [1, 2], qd.ShapeError, "reference must be an array of numbers"),
    (np.array([1.0, np.nan]), np.zeros(2), qd.NonFiniteError, "reference holds nan at position (1,)"),
    (np.ones((2, 2)), np.array([[1, 1], [np.inf, 1]]), qd.NonFiniteError, "approx holds inf at position (1, 0)"),
    (np.ones(2), np.ones(2) * 1j, qd.ArgumentTypeError, "approx must hold real numbers, got complex128"),
    (np.array(["a", "b"]), np.ones(2), qd.ArgumentTypeError, "reference must hold real numbers"),
])
def test_bad_input_is_refused(reference, approx, error, words):
    with pytest.raises(error) as caught:
        qd.error_report(reference, approx)
    assert words in str(caught.value)
    assert isinstance(caught.value, qd.QDispatchError)


def test_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((8, 16)).astype(np.float32)
    expected = qd.error_report(x, x.astype(np.float16))
    assert qd.error_report(torch.from_numpy(x), torch.from_numpy(x).half()) == expected
    assert qd.error_report(torch.from_numpy(x).requires_grad_(), x.astype(np.float16)) == expected
    as_bf16 = torch.from_numpy(x).bfloat16()
    assert qd.error_report(x, as_bf16) == qd.error_report(x, as_bf16.float().numpy())
    with pytest.raises(qd.ArgumentTypeError):
        qd.error_report(torch.ones(2, dtype=torch.complex64), np.ones(2))


def test_cosine_stays_within_minus_one_and_one():
    """Parallel arrays whose sums round the ratio just past 1 (or -1) give 1 (-1): a
    cosine past them would break acos() and any check of `cosine <= 1`."""
    for seed in range(50):  # seeds 17, 20 and 33 round past 1 unclamped
        a = np.random.default_rng(seed).standard_normal(3).astype(np.float32)
        b = a * np.float32(1.1)
        assert qd.error_report(a, b).cosine <= 1.0 and qd.error_report(a, -b).cosine >= -1.0
