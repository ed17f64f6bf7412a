"""Hypothesis properties of quantize and q_matmul, on every backend."""
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import qdispatch as qd
from qdispatch import quantmath
from qdispatch.scheme import VALUE_RANGES
from helpers import product_err

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrix_and_scheme(draw):
    rows = draw(st.integers(1, 6))
    block = draw(st.sampled_from([1, 2, 4, 8]))
    cols = block * draw(st.integers(1, 5))
    x = draw(hnp.arrays(np.float32, (rows, cols), elements=finite))
    value = draw(st.sampled_from(list(VALUE_RANGES)))
    store = "native" if VALUE_RANGES[value][2] == 8 else "packed_u32"
    gran = draw(st.sampled_from([dict(), dict(axis=0), dict(axis=1), dict(block=block)]))
    scale_dtype = draw(st.sampled_from(["f32", "f16", "bf16"]))
    return x, qd.QuantScheme(value, store=store, scale_dtype=scale_dtype, **gran)


@SETTINGS
@given(data=matrix_and_scheme())
@example(data=(np.array([[4.305e-42]], np.float32), qd.QuantScheme("q8s")))  # a subnormal scale
def test_quantize_properties(device, data):
    x, scheme = data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = qd.quantize(x, scheme, device=device)
    # float16 scales of 16 steps or fewer warn, and only those
    underflow = any(issubclass(w.category, qd.ScaleUnderflowWarning) for w in caught)
    assert underflow == (scheme.scale_dtype == "f16" and bool(np.any(q.scales < 2.0 ** -20)))
    lo, hi = scheme.qrange
    values = q.values
    assert values.dtype == np.int8 and values.min() >= lo and values.max() <= hi
    deq = q.dequantize().numpy()
    # every value lands within half a step of its input (the scale never rounds
    # down, so nothing clips by more), up to float32 rounding of x / scale; a
    # subnormal scale is rounded to the grid of 2^-149, so the value at the top of
    # the range may clip by up to qmax times half of that grid
    nonzero = values != 0
    step = np.abs(deq[nonzero] / values[nonzero])
    subnormal_clip = max(-lo, hi) * 2.0 ** -150
    assert np.all(np.abs(deq - x)[nonzero] <= 0.5 * step + 1e-6 * np.abs(x[nonzero]) + subnormal_clip)
    # bit-identical to the reference backend
    ref = qd.quantize(x, scheme, device="reference")
    np.testing.assert_array_equal(values, ref.values)
    np.testing.assert_array_equal(q.scales, ref.scales)


@pytest.mark.skipif("cpu" not in qd.available_backends(), reason="cpu backend not built")
@SETTINGS
@given(data=matrix_and_scheme(), dtype=st.sampled_from(["float16", "bfloat16"]), draw=st.data())
def test_16bit_data_of_any_bits_quantizes_on_cpu_as_the_reference(data, dtype, draw):
    """Every bit pattern (subnormals, NaN and Inf included), read in place by the cpu
    backend: the reference's values and scales, or its error, word for word."""
    shape, scheme = data[0].shape, data[1]
    bits = draw.draw(hnp.arrays(np.uint16, shape))
    x32 = bits.view(np.float16).astype(np.float32) if dtype == "float16" else quantmath.bf16_bits_to_f32(bits)
    x = qd.tensor(x32, device="reference", dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qd.ScaleUnderflowWarning)
        try:
            want = qd.quantize(x, scheme)
        except qd.QDispatchError as exc:
            with pytest.raises(type(exc)) as got:
                qd.quantize(x, scheme, device="cpu")
            assert str(got.value) == str(exc)
            return
        got = qd.quantize(x, scheme, device="cpu")
    np.testing.assert_array_equal(got.values, want.values)
    np.testing.assert_array_equal(got.scales.view(np.uint32), want.scales.view(np.uint32))


@SETTINGS
@given(m=st.integers(1, 9), k=st.integers(1, 70), n=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_int_matmul_is_exact(device, m, k, n, seed):
    r = np.random.default_rng(seed)
    a = r.integers(-128, 128, size=(m, k), dtype=np.int8)
    b = r.integers(-128, 128, size=(k, n), dtype=np.int8)
    np.testing.assert_array_equal(qd.int_matmul(qd.tensor(a, device=device), qd.tensor(b, device=device)).numpy(),
                                  a.astype(np.int64) @ b.astype(np.int64))


@SETTINGS
@given(m=st.integers(1, 6), kb=st.integers(1, 4), n=st.integers(1, 9), seed=st.integers(0, 2**31 - 1),
       wvalue=st.sampled_from(["q8s", "q8f", "q4s", "q4f", "q2f"]), block=st.sampled_from([8, 16, 32]))
@example(m=1, kb=4, n=1, seed=744, wvalue="q8s", block=16)  # a sum that cancels to 1% of its terms
def test_q_matmul_matches_dequantized_math(device, m, kb, n, seed, wvalue, block):
    r = np.random.default_rng(seed)
    k = kb * 32
    x = r.standard_normal((m, k)).astype(np.float32)
    w = r.standard_normal((n, k)).astype(np.float32)
    store = "native" if wvalue.startswith("q8") else "packed_u32"
    wq = qd.quantize(w, qd.QuantScheme(wvalue, block=block, store=store), device=device)
    xq = qd.quantize(x, qd.QuantScheme("q8f", block=(1, 32)), device=device)
    wd = wq.dequantize().numpy().astype(np.float64)
    assert product_err(xq.dequantize().numpy(), wd.T, qd.q_matmul(xq, wq.T).numpy()) < 1e-5
    assert product_err(x, wd.T, qd.q_matmul(x, wq.T).numpy()) < 1e-5


@SETTINGS
@given(value=st.sampled_from(list(VALUE_RANGES)), exponent=st.floats(30.0, 38.53), seed=st.integers(0, 2**31 - 1))
@example(value="q8f", exponent=38.53, seed=0)  # -128 times 2.66e36 and more: past float32's range
def test_no_qtensor_dequantizes_past_float32s_range(value, exponent, seed):
    """Scales up to float32's largest, from parts: a weight is refused by every
    backend alike with the same message, or dequantizes to finite values and its
    fq products agree with the reference's (which computes x @ dequantize(w))."""
    lo, hi, bits = VALUE_RANGES[value]
    r = np.random.default_rng(seed)
    values = r.integers(lo, hi + 1, (4, 32)).astype(np.int8)
    scales = (10.0 ** (exponent - r.random(4) * 4)).astype(np.float32)  # per row, within 10^4 of 10^exponent
    scheme = qd.QuantScheme(value, axis=0, store="native" if bits == 8 else "packed_u32")
    made = {}
    for device in ("reference", "cpu"):
        try:
            made[device] = qd.qtensor_from_parts(values, scales, scheme, device=device)
        except qd.ScaleOverflowError as err:
            made[device] = str(err)
    if isinstance(made["reference"], str):
        assert made["cpu"] == made["reference"]
        with np.errstate(over="ignore"):
            assert np.isinf(values.astype(np.float32) * scales[:, None]).any()
        return
    x = (r.standard_normal((2, 32)) * 1e-3).astype(np.float32)
    wd = made["reference"].dequantize().numpy()
    assert np.isfinite(wd).all()
    for device in ("reference", "cpu"):
        assert product_err(x, wd.astype(np.float64).T, qd.linear(x, made[device]).numpy()) < 1e-5
