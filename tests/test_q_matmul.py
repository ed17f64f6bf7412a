"""q_matmul's qq / fq / qf arms and linear, against float64 math on the
dequantized operands (what each arm is defined to compute)."""
import re
import warnings

import numpy as np
import pytest

import qdispatch as qd
from helpers import rel_err
from qdispatch._core import get_backend

W_SCHEMES = [
    qd.QuantScheme("q8s", axis=0),                              # per output channel of w[N, K]
    qd.QuantScheme("q8f"),                                      # per tensor, full range
    qd.QuantScheme("q8s", block=32),                            # ggml Q8_0-like
    qd.QuantScheme("q8s", block=64, scale_dtype="f16"),
    qd.QuantScheme("q4s", block=32, store="packed_u32"),
    qd.QuantScheme("q4f", block=128, store="packed_u32", scale_dtype="bf16"),
    qd.QuantScheme("q2s", block=32, store="packed_u32"),
]
A_SCHEMES = [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8f", block=32), qd.QuantScheme("q8s")]


def deq64(q):
    return q.dequantize().numpy().astype(np.float64)


@pytest.mark.parametrize("w_scheme", W_SCHEMES, ids=repr)
@pytest.mark.parametrize("a_scheme", A_SCHEMES, ids=repr)
def test_qq_matches_dequantized_float64(device, rng, w_scheme, a_scheme):
    x = rng.standard_normal((7, 256)).astype(np.float32)
    w = rng.standard_normal((33, 256)).astype(np.float32)
    xq = qd.quantize(x, a_scheme, device=device)
    wq = qd.quantize(w, w_scheme, device=device)
    out = qd.q_matmul(xq, wq.T)
    assert out.shape == (7, 33) and out.device == device and out.dtype == "float32"
    assert rel_err(deq64(xq) @ deq64(wq).T, out.numpy()) < 1e-5


@pytest.mark.parametrize("K, block", [(131101, None), (262144, None), (2 * 131088, 131088)],
                         ids=["prime-K", "2^18", "two-long-blocks"])
def test_qq_groups_longer_than_int32_sums_are_exact(device, rng, K, block):
    """A K-group past int32's exact range (131071 products of -128 * -128) is summed
    exactly all the same, rounded to float32 once and scaled: the reference's bits on
    every backend, for all -128 values too (whose sums pass 2**31), and for W8A8."""
    scheme = qd.QuantScheme("q8f", axis=0) if block is None else qd.QuantScheme("q8f", block=block)
    x, w = rng.standard_normal((3, K)).astype(np.float32), rng.standard_normal((2, K)).astype(np.float32)
    xq, wq = qd.quantize(x, scheme, device=device), qd.quantize(w, scheme, device=device)
    lowest = [qd.qtensor_from_parts(np.full(q.shape, -128, np.int8), q.scales, scheme, device=device)
              for q in (xq, wq)]
    for a, b in ((xq, wq), lowest):
        got = qd.q_matmul(a, b.T).numpy()
        np.testing.assert_array_equal(got, qd.q_matmul(a.to("reference"), b.to("reference").T).numpy())
        if block is None:  # one group: (row scale * column scale) * the exact sum in float32
            exact = (a.values.astype(np.int64) @ b.values.astype(np.int64).T).astype(np.float32)
            np.testing.assert_array_equal(got, (a.scales[:, None] * b.scales[None, :]) * exact)
    w8a8 = qd.q_matmul(x, wq.T, activation_scheme="q8f").numpy()
    np.testing.assert_array_equal(w8a8, qd.q_matmul(x, wq.to("reference").T, activation_scheme="q8f").numpy())


@pytest.mark.parametrize("w_scheme", W_SCHEMES, ids=repr)
def test_fq_matches_float_times_dequantized(device, rng, w_scheme):
    x = rng.standard_normal((5, 128)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((40, 128)).astype(np.float32), w_scheme, device=device)
    out = qd.q_matmul(x, wq.T)
    assert rel_err(x.astype(np.float64) @ deq64(wq).T, out.numpy()) < 1e-5


def test_qf_arm(device, rng):
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device=device)
    x = rng.standard_normal((64, 3)).astype(np.float32)
    out = qd.q_matmul(wq, x)
    assert out.shape == (16, 3)
    assert rel_err(deq64(wq) @ x.astype(np.float64), out.numpy()) < 1e-5


def test_non_transposed_rhs_weight(device, rng):
    wq = qd.quantize(rng.standard_normal((64, 24)).astype(np.float32), qd.QuantScheme("q8s", axis=1),
                     device=device)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    assert rel_err(x.astype(np.float64) @ deq64(wq), qd.q_matmul(x, wq).numpy()) < 1e-5


def test_batch_dims_broadcast(device, rng):
    x = rng.standard_normal((2, 3, 5, 32)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((8, 32)).astype(np.float32), "q8s", device=device)
    out = qd.q_matmul(x, wq.T)
    assert out.shape == (2, 3, 5, 8)
    assert rel_err(x.astype(np.float64) @ deq64(wq).T, out.numpy()) < 1e-5
    # batched quantized operands on both sides
    aq = qd.quantize(rng.standard_normal((2, 1, 4, 32)).astype(np.float32),
                     qd.QuantScheme("q8s", block=(1, 32)), device=device)
    bq = qd.quantize(rng.standard_normal((3, 32, 6)).astype(np.float32), qd.QuantScheme("q8s"), device=device)
    out = qd.q_matmul(aq, bq)
    assert out.shape == (2, 3, 4, 6)
    assert rel_err(deq64(aq) @ deq64(bq), out.numpy()) < 1e-5


@pytest.mark.parametrize("scheme, folds", [
    (qd.QuantScheme("q8s", block=(1, 1, 32)), True), (qd.QuantScheme("q8f"), True),
    (qd.QuantScheme("q8s", block=(1, 3, 16)), True), (qd.QuantScheme("q8s", block=(2, 3, 64)), True),
    (qd.QuantScheme("q4s", block=(2, 1, 32), store="packed_u32"), False)], ids=repr)
def test_a_batched_quantized_lhs_gives_each_item_what_it_gives_alone(device, rng, monkeypatch, scheme, folds):
    """A batch whose scales fold into rows (per token, per tensor, blocks of whole
    items) runs as one product, the others item by item; the same bits either way."""
    aq = qd.quantize(rng.standard_normal((4, 3, 64)).astype(np.float32), scheme, device=device)
    wq = qd.quantize(rng.standard_normal((64, 24)).astype(np.float32), qd.QuantScheme("q8s", axis=1), device=device)
    backend = type(get_backend(aq.kind))
    calls = []
    kernel = backend.qq_matmul
    monkeypatch.setattr(backend, "qq_matmul", lambda self, a, b: calls.append(a.shape) or kernel(self, a, b))
    out = qd.q_matmul(aq, wq).numpy()
    assert out.shape == (4, 3, 24)
    assert calls == ([(12, 64)] if folds else [(3, 64)] * 4)
    monkeypatch.setattr(backend, "qtensor_rows", lambda self, q: None)  # item by item, as before
    np.testing.assert_array_equal(out, qd.q_matmul(aq, wq).numpy())


def test_vector_lhs_and_rhs(device, rng):
    """A float vector is one row on the left and one column on the right, dropped
    from the result again, as numpy's matmul does."""
    wq = qd.quantize(rng.standard_normal((8, 32)).astype(np.float32), "q8s", device=device)
    v = rng.standard_normal(32).astype(np.float32)
    out = qd.q_matmul(v, wq.T)
    assert out.shape == (8,)
    assert rel_err(v.astype(np.float64) @ deq64(wq).T, out.numpy()) < 1e-5
    out = qd.q_matmul(wq, v)
    assert out.shape == (8,)
    assert rel_err(deq64(wq) @ v.astype(np.float64), out.numpy()) < 1e-5
    x = qd.tensor(v, device=device)
    for spec in ("q8s", "q4f"):  # quantized on the fly: the same bits as the column's
        np.testing.assert_array_equal(qd.q_matmul(wq, x, activation_scheme=spec).numpy(),
                                      qd.q_matmul(wq, v[:, None], activation_scheme=spec).numpy()[:, 0])


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_out_dtype(device, rng, out_dtype):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    full = qd.q_matmul(x, wq.T).numpy()
    out = qd.q_matmul(x, wq.T, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    # the float32 result rounded once to the 16-bit type (round to nearest even), not near it
    once = qd.tensor(full, device="reference", dtype=out_dtype).numpy()
    np.testing.assert_array_equal(out.numpy(), once)



def test_float16_results_past_its_range_are_inf_without_warnings(device):
    """out_dtype='float16' (and dequantize to it) rounds as IEEE does: values past
    float16's 65504 are inf, and no backend warns (an error under -W error)."""
    wq = qd.quantize(np.full((2, 64), 2000.0, np.float32), "q8s", device=device)  # sums of 128000
    big = qd.quantize(np.full((2, 4), 1e5, np.float32), "q8s", device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qd.q_matmul(np.ones((1, 64), np.float32), wq.T, out_dtype="float16")
        linear = qd.linear(np.ones((1, 64), np.float32), wq, np.zeros(2, np.float32), out_dtype="float16")
        deq = big.dequantize("float16")
    np.testing.assert_array_equal(out.numpy(), np.full((1, 2), np.inf, np.float16))
    np.testing.assert_array_equal(linear.numpy(), np.full((1, 2), np.inf, np.float16))
    np.testing.assert_array_equal(deq.numpy(), np.full((2, 4), np.inf, np.float16))


def test_a_bias_past_float32s_range_is_inf_without_warnings(device):
    top = np.finfo(np.float32).max
    wq = qd.quantize(np.ones((2, 64), np.float32), "q8s", device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qd.linear(np.full((1, 64), 1e34, np.float32), wq, np.full(2, top, np.float32))
    np.testing.assert_array_equal(out.numpy(), np.full((1, 2), np.inf, np.float32))

def test_half_inputs(device, rng):
    x = rng.standard_normal((4, 64)).astype(np.float16)
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    out = qd.q_matmul(x, wq.T)
    assert rel_err(x.astype(np.float64) @ deq64(wq).T, out.numpy()) < 1e-5


def test_requantize_returns_a_qtensor(device, rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    out = qd.q_matmul(x, wq.T, requantize=qd.QuantScheme("q8s", axis=0))
    assert isinstance(out, qd.QTensor) and out.device == device
    float_out = qd.q_matmul(x, wq.T)
    want = qd.quantize(float_out, qd.QuantScheme("q8s", axis=0))
    np.testing.assert_array_equal(out.values, want.values)
    with pytest.raises(ValueError, match="out_dtype='float16' and requantize="):  # not silently dropped
        qd.q_matmul(x, wq.T, requantize=qd.QuantScheme("q8s", axis=0), out_dtype="float16")


def test_activation_scheme_takes_the_qq_path(device, rng):
    x = rng.standard_normal((6, 128)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((16, 128)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device=device)
    out = qd.q_matmul(x, wq.T, activation_scheme="q8s")
    xq = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device=device)
    assert rel_err(deq64(xq) @ deq64(wq).T, out.numpy()) < 1e-5
    # and the W8A8 result is close to the float one
    assert rel_err(x.astype(np.float64) @ deq64(wq).T, out.numpy()) < 0.03


@pytest.mark.parametrize("act", [qd.QuantScheme("q8s", block=(1, 32), scale_dtype="f16"),
                                 qd.QuantScheme("q8f", block=(1, 64), scale_dtype="bf16"),
                                 qd.QuantScheme("q8s", block=(2, 32))], ids=repr)
def test_activation_schemes_the_one_pass_kernel_does_not_take_are_kept(device, rng, act):
    """W8A8 with 16-bit activation scales, or blocks spanning rows, quantizes x in
    exactly that scheme: the reference's bits (the one-pass W8A8 kernel's float32
    scales of single rows would give others)."""
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[1] *= 1000  # rows 0 and 1 share their blocks of two rows
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device=device)
    np.testing.assert_array_equal(qd.q_matmul(x, wq.T, activation_scheme=act).numpy(),
                                  qd.q_matmul(x, wq.to("reference").T, activation_scheme=act).numpy())


def test_activation_scheme_scales_each_row_of_each_batch(device, rng):
    """A value name quantizes every row on its own: row m of one batch shares no
    scale with row m of another (a batch 1000x larger used to zero the other)."""
    x = rng.standard_normal((2, 4, 64)).astype(np.float32)
    x[0] *= 1000
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device=device)
    for act in ("q8s", "q4f"):
        batched = qd.q_matmul(x, wq.T, activation_scheme=act).numpy()
        for b in range(2):
            np.testing.assert_array_equal(batched[b], qd.q_matmul(x[b], wq.T, activation_scheme=act).numpy())
        if act == "q8s":
            assert rel_err(x[1].astype(np.float64) @ deq64(wq).T, batched[1]) < 0.03


def test_activation_scheme_scales_each_token_of_a_float_rhs(device, rng):
    """w @ x.T with a value name quantizes each column of x.T (a token) on its own, as
    x @ w.T does each row of x: one group over all of K, and the same bits, turned."""
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    x[0, 1] *= 1000
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device=device)
    for act in ("q8s", "q4f"):
        turned = qd.q_matmul(wq, np.swapaxes(x, -1, -2), activation_scheme=act)
        assert turned.shape == (2, 16, 5)
        np.testing.assert_array_equal(
            turned.numpy(), np.swapaxes(qd.q_matmul(x, wq.T, activation_scheme=act).numpy(), -1, -2))


@pytest.mark.parametrize("shape,bad", [((4, 64), (2, 5)), ((2, 3, 64), (1, 2, 5))])
def test_activation_scheme_names_a_non_finite_activation_by_its_position(device, rng, shape, bad):
    """As quantize does, also where the kernel quantizes x on the fly (cpu's fused W8A8)."""
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), "q8s", device=device)
    x = rng.standard_normal(shape).astype(np.float32)
    x[bad] = np.inf
    position = re.escape(f"position {bad}")
    with pytest.raises(qd.NonFiniteError, match=position):
        qd.q_matmul(x, wq.T, activation_scheme="q8s")


def test_activation_scheme_errors_on_a_float_vector_say_how_it_was_quantized(device, rng):
    """A vector is quantized as a one-row (lhs) or one-column (rhs) matrix: the error's
    position (0, 5) or shape (1, 64) is that matrix's, and the message says so."""
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), "q8s", device=device)
    v = rng.standard_normal(64).astype(np.float32)
    v[5] = np.nan
    for spec in ("q8s", qd.QuantScheme("q8s", block=32)):
        with pytest.raises(qd.NonFiniteError, match=re.escape("position (0, 5): remove NaN/Inf first (for example "
                                                              "np.nan_to_num) (the float vector lhs is quantized as "
                                                              "the row (1, 64): position (0, i) is its value i)")):
            qd.q_matmul(v, wq.T, activation_scheme=spec)
    with pytest.raises(qd.NonFiniteError, match=re.escape("position (5, 0): remove NaN/Inf first (for example "
                                                          "np.nan_to_num) (the float vector rhs is quantized as the "
                                                          "column (64, 1): position (i, 0) is its value i)")):
        qd.q_matmul(wq, v, activation_scheme="q8s")
    with pytest.raises(qd.QuantSchemeError, match=re.escape("(the float vector lhs is quantized as the row (1, 64))")):
        qd.q_matmul(np.ones(64, np.float32), wq.T, activation_scheme=qd.QuantScheme("q8s", block=48))
    with pytest.raises(qd.QuantSchemeError) as matrix:  # a matrix x gets no such words
        qd.q_matmul(np.ones((1, 64), np.float32), wq.T, activation_scheme=qd.QuantScheme("q8s", block=48))
    assert "vector" not in str(matrix.value)


def test_activation_scheme_on_an_empty_product(device, rng):
    wq = qd.quantize(rng.standard_normal((8, 16)).astype(np.float32), "q8s", device=device)
    for shape in ((0, 16), (0, 3, 16)):
        out = qd.q_matmul(np.zeros(shape, np.float32), wq.T, activation_scheme="q8s")
        assert out.shape == shape[:-1] + (8,) and out.device == device
        # a QTensor holds at least one value: requantize says so, as q_matmul (it was quantize's error)
        with pytest.raises(qd.ShapeError, match=re.escape(f"q_matmul's product has shape {shape[:-1] + (8,)}, "
                                                          "with no values for requantize= to quantize")):
            qd.q_matmul(np.zeros(shape, np.float32), wq.T, activation_scheme="q8s", requantize="q8s")
    # a scheme that is none is refused as on a product with values (it was taken silently)
    with pytest.raises(qd.QuantSchemeError, match="bogus"):
        qd.q_matmul(np.zeros((0, 16), np.float32), wq.T, activation_scheme="bogus")
    with pytest.raises(qd.QuantSchemeError, match="Expected a QuantScheme or a value name like 'q8s', got 5"):
        qd.q_matmul(np.zeros((0, 16), np.float32), wq.T, activation_scheme=5)


def test_linear_with_bias(device, rng):
    x = rng.standard_normal((3, 5, 64)).astype(np.float32)
    w = rng.standard_normal((10, 64)).astype(np.float32)
    bias = rng.standard_normal(10).astype(np.float32)
    wq = qd.quantize(w, qd.QuantScheme("q8s", axis=0), device=device)
    out = qd.linear(x, wq, bias)
    assert out.shape == (3, 5, 10)
    assert rel_err(x.astype(np.float64) @ deq64(wq).T + bias, out.numpy()) < 1e-5
    with pytest.raises(qd.ShapeError, match="bias must have shape"):
        qd.linear(x, wq, bias[:3])


def test_linear_names_its_own_arguments_in_shape_errors(device, rng):
    """The errors were q_matmul's, naming w.T's shape (64, 10), which the caller never wrote."""
    wq = qd.quantize(rng.standard_normal((10, 64)).astype(np.float32), "q8s", device=device)
    for x in (np.zeros((3, 10), np.float32), qd.tensor(np.zeros((2, 3, 10), np.float32), device=device)):
        with pytest.raises(qd.ShapeError, match=re.escape(
                f"linear's x has 10 features (shape {tuple(x.shape)}) but its weight w [out_features, "
                f"in_features] takes 64 (shape (10, 64)): x @ w.T needs x's last dim to be w's")):
            qd.linear(x, wq)
    w1 = qd.quantize(rng.standard_normal(64).astype(np.float32), "q8s", device=device)
    with pytest.raises(qd.ShapeError, match=re.escape("linear's weight w must be [out_features, in_features], "
                                                      "got a QTensor of shape (64,)")):
        qd.linear(np.zeros((3, 64), np.float32), w1)


@pytest.mark.parametrize("bias", [[1, -2, 3], [100, 200, -300], np.array([70000, 0, -5], np.int64),
                                  np.array([255, 0, 1], np.uint8), [True, False, True]])
def test_an_integer_bias_is_numbers_to_add_whatever_their_size(device, rng, bias):
    # integers past int8's range once made the bias an int8 tensor that refused them
    x = rng.standard_normal((2, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((3, 64)).astype(np.float32), "q8s", device=device)
    expect = qd.linear(x, wq).numpy() + np.asarray(bias, np.float32)
    np.testing.assert_array_equal(qd.linear(x, wq, bias).numpy(), expect)


def test_an_integer_bias_of_another_library_is_numbers_to_add(device, rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((3, 64)).astype(np.float32), "q8s", device=device)
    expect = qd.linear(x, wq).numpy() + np.float32([100, 200, -300])
    np.testing.assert_array_equal(qd.linear(x, wq, torch.tensor([100, 200, -300])).numpy(), expect)


@pytest.mark.parametrize("dtype", ["int8", "int32"])
def test_an_integer_bias_tensor_adds_its_numbers_on_every_backend(device, rng, dtype):
    """An int8 or int32 bias Tensor on the product's device: the cuda backend's casts
    take float dtypes only, so linear raised KernelError there while the host added it."""
    x = rng.standard_normal((2, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((3, 64)).astype(np.float32), "q8s", device=device)
    numbers = np.array([100, -7, 3], dtype)
    bias = qd.tensor(numbers, device=device, dtype=dtype)
    assert bias.dtype == dtype
    for out_dtype in ("float32", "bfloat16"):
        expect = qd.linear(x, wq, numbers.astype(np.float32), out_dtype=out_dtype).numpy()
        got = qd.linear(qd.tensor(x, device=device), wq, bias, out_dtype=out_dtype)
        assert got.dtype == out_dtype and got.device == device
        np.testing.assert_array_equal(got.numpy(), expect)
    np.testing.assert_array_equal(bias.numpy(), numbers)  # the caller's bias, untouched


def test_a_0d_operand_is_refused_by_saying_what_q_matmul_takes(device, rng):
    wq = qd.quantize(rng.standard_normal((3, 64)).astype(np.float32), "q8s", device=device)
    with pytest.raises(qd.ShapeError, match=r"^q_matmul multiplies matrices, batches of them and float vectors "
                                            r"\(a QTensor holds at least 2 dims\); got shapes \(\) and \(64, 3\)$"):
        qd.q_matmul(np.float32(3), wq.T)


def test_shape_dtype_and_operand_errors(device, rng):
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    with pytest.raises(qd.ShapeError, match="lhs has K=32 columns but rhs has K=64 rows"):
        qd.q_matmul(np.zeros((2, 32), np.float32), wq.T)
    with pytest.raises(TypeError, match="float lhs must be"):
        qd.q_matmul(qd.tensor(np.zeros((2, 64), np.int8), device=device), wq.T)
    with pytest.raises(TypeError, match="needs a QTensor operand, got float32 and float32 dense data"):
        qd.q_matmul(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="Unsupported dtype"):
        qd.q_matmul(np.zeros((2, 64), np.float32), wq.T, out_dtype="float64")
    with pytest.raises(qd.ShapeError, match="batch dims"):
        qd.q_matmul(np.zeros((2, 2, 8), np.float32),
                    qd.quantize(np.ones((3, 8, 4), np.float32), "q8s", device=device))
    with pytest.raises(TypeError, match="QTensor weight"):
        qd.linear(np.zeros((2, 64), np.float32), np.zeros((8, 64), np.float32))



@pytest.mark.parametrize("dtype", [np.int64, np.int16, np.uint8, np.bool_])
def test_integer_numpy_data_on_the_float_side_is_named_by_its_own_dtype(device, rng, dtype):
    """Not as int8, the dtype qd.tensor makes of small integers before q_matmul sees them."""
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    x = np.ones((2, 64), dtype)
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=f"q_matmul expects float data, got {name}"):
        qd.q_matmul(x, wq.T)
    with pytest.raises(TypeError, match=f"q_matmul expects float data, got {name}"):
        qd.q_matmul(wq, x.T)
    with pytest.raises(TypeError, match=f"linear expects float data, got {name}"):
        qd.linear(x, wq)

def test_matmul_operator(device, rng):
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    x = qd.tensor(rng.standard_normal((2, 64)).astype(np.float32), device=device)
    np.testing.assert_array_equal((x @ wq.T).numpy(), qd.q_matmul(x, wq.T).numpy())


def test_zero_rows(device, rng):
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), "q8s", device=device)
    out = qd.q_matmul(np.zeros((0, 64), np.float32), wq.T)
    assert out.shape == (0, 8)
    bias = rng.standard_normal(8).astype(np.float32)
    for shape in ((0, 64), (2, 0, 64)):  # a bias on no rows adds nothing, launches nothing
        for out_dtype in ("float32", "bfloat16"):
            out = qd.linear(np.zeros(shape, np.float32), wq, bias, out_dtype=out_dtype)
            assert out.shape == shape[:-1] + (8,) and out.dtype == out_dtype and out.device == device


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lead", [(3,), (1, 1), (2, 3)], ids=["rows", "one token", "batch of tokens"])
def test_decode_step_goes_straight_to_the_kernel(device, rng, monkeypatch, x_dtype, lead):
    """x[..., M, K] @ w.T with a 2-D weight, in a dtype the backend's kernel reads and
    writes, skips ops.q_matmul's general path: the same values, and every other
    call (or a bad one) still reaches the general path and its errors.  A model's
    activations are [batch, tokens, K]: they took the general path, a few
    microseconds a layer more."""
    from qdispatch import ops
    from qdispatch._core import get_backend
    backend = get_backend(device)
    x = qd.tensor(rng.standard_normal(lead + (64,)).astype(np.float32), device=device, dtype=x_dtype)
    w = qd.quantize(rng.standard_normal((40, 64)).astype(np.float32), qd.QuantScheme("q4s", block=32, store="packed_u32"),
                    device=device)
    out_dtype = x_dtype if x_dtype in backend.fq_dtypes else "float32"
    general = ops.q_matmul(backend, x, w.T, out_dtype, None, None)
    direct = x_dtype in backend.fq_dtypes
    if direct:
        def general_path(*args):
            raise AssertionError("a decode step took the general path")
        monkeypatch.setattr(ops, "q_matmul", general_path)
    got = qd.q_matmul(x, w.T, out_dtype=out_dtype)
    assert got.dtype == general.dtype and got.shape == general.shape == lead + (40,)
    assert got.device == x.device
    np.testing.assert_array_equal(got.numpy(), general.numpy())
    rows = qd.q_matmul(qd.tensor(x.numpy().reshape(-1, 64), device=device, dtype=x_dtype), w.T, out_dtype=out_dtype)
    np.testing.assert_array_equal(got.numpy().reshape(-1, 40), rows.numpy())  # the batch is its rows
    monkeypatch.undo()
    with pytest.raises(qd.ShapeError):
        qd.q_matmul(x, w, out_dtype=out_dtype)  # K = 64 against 40 rows
    with pytest.raises(TypeError):
        qd.q_matmul(x, w.T, out_dtype="int8")


def test_fq_non_finite_activations_propagate_without_warnings(device, rng):
    """inf and NaN in x come out as IEEE arithmetic gives them, on every backend, and
    no backend warns (a suite run with -W error would fail on a warning)."""
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1, 7], x[2, 100] = np.inf, np.nan
    w = rng.standard_normal((48, 256)).astype(np.float32)
    w[0, 7] = 0.0  # inf * 0: NaN
    wq = qd.quantize(w, qd.QuantScheme("q8s", axis=0), device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qd.q_matmul(qd.tensor(x, device=device), wq.T).numpy()
    zero = wq.dequantize().numpy()[:, 7] == 0  # w[0, 7] and any that quantized to 0
    assert zero[0] and np.isnan(out[1, zero]).all() and np.isinf(out[1, ~zero]).all()
    assert np.isnan(out[2]).all() and np.isfinite(out[[0, 3]]).all()


def test_products_past_float32s_range_give_inf_without_warnings(device):
    """A qq sum of scaled groups past float32's range is inf on every backend, and
    none warns."""
    xq = qd.quantize(np.full((2, 4), 3e38, np.float32), "q8s", device=device)
    wq = qd.quantize(np.ones((3, 4), np.float32), "q8s", device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qq = qd.q_matmul(xq, wq.T).numpy()
    np.testing.assert_array_equal(qq, np.full((2, 3), np.inf, np.float32))


def test_a_weight_that_would_dequantize_to_inf_is_refused_so_backends_agree(device):
    """A q8f weight whose -amax rounds to -128, with amax near float32's max, would
    dequantize to -inf: the reference backend's fq would then be inf whatever x,
    where the kernels (x * q summed, then scaled) give finite sums for small x.
    Such a weight can't be made, quantized or from parts; one just inside the
    range gives the same products on every backend."""
    with pytest.raises(qd.ScaleOverflowError, match=r"^Block \(0, 0\) dequantizes past float32's range: a value "
                                                    r"of magnitude 128 times the block's scale 2\.66\d+e\+36 "):
        qd.quantize(np.array([[-3.4e38, 1.0]], np.float32), "q8f", device=device)
    with pytest.raises(qd.ScaleOverflowError, match=r"^Block \(0, 1\) dequantizes past .* magnitude 100 times the "
                                                    r"block's scale 4e\+36 .*; pass smaller scales"):
        qd.qtensor_from_parts(np.array([[1, 100], [2, 3]], np.int8), np.array([1e30, 4e36], np.float32),
                              qd.QuantScheme("q8s", axis=1), device=device)
    # the same scale beside small enough values is kept
    near = qd.qtensor_from_parts(np.array([[1, 80], [2, -3]], np.int8), np.array([1e30, 4e36], np.float32),
                                 qd.QuantScheme("q8s", axis=1), device=device)
    x = np.array([[1e-3, 2e-3]], np.float32)
    got = qd.q_matmul(x, near).numpy()
    want = qd.q_matmul(x, near.to("reference")).numpy()
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_matmul_operator_with_a_numpy_lhs(device, rng):
    """`x @ w` for an ndarray x: numpy defers to the QTensor (it used to fail inside
    numpy's matmul), and the product is q_matmul's, on w's device."""
    x = rng.standard_normal((3, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device=device)
    out = x @ wq.T
    assert isinstance(out, qd.Tensor) and out.device == device
    np.testing.assert_array_equal(out.numpy(), qd.q_matmul(x, wq.T).numpy())
    with pytest.raises(TypeError):
        np.add(x[:, :16], wq)  # numpy never treats a QTensor as an array


def test_a_numpy_operand_and_a_dense_tensor_meet_in_q_matmul_both_ways(device, rng):
    """`array @ t` for a dense Tensor t is `t.__rmatmul__`, as `t @ array` is q_matmul:
    both refuse two dense operands and name what multiplies them. numpy's own product
    used to run one way only, and wrapped int8 sums silently (100 * 100 * 2 -> 32)."""
    a8 = np.full((1, 2), 100, np.int8)
    t8 = qd.tensor(np.full((2, 1), 100, np.int8), device=device)
    for product in (lambda: a8 @ t8, lambda: t8.T @ a8.T, lambda: np.matmul(a8, t8)):
        with pytest.raises(TypeError, match=r"needs a QTensor operand, got int8 and int8 dense data: .*"
                                            r"qdispatch.int_matmul\(a, b\) gives the exact int32 product"):
            product()
    assert qd.int_matmul(a8, t8).numpy().tolist() == [[20000]]
    x = rng.standard_normal((3, 64)).astype(np.float32)
    t = qd.tensor(rng.standard_normal((64, 5)).astype(np.float32), device=device)
    with pytest.raises(TypeError, match=r"got float32 and float32 dense data: .*multiply dense data in numpy or torch"):
        x @ t
    with pytest.raises(TypeError, match="np.matmul with a qdispatch Tensor is qdispatch.q_matmul, which takes no out"):
        np.matmul(x, t, out=np.empty((3, 5), np.float32))
    wq = qd.quantize(rng.standard_normal((64, 5)).astype(np.float32), "q8s", device=device)
    np.testing.assert_array_equal(np.matmul(x, wq).numpy(), qd.q_matmul(x, wq).numpy())
    square, before = qd.quantize(np.eye(64, dtype=np.float32), "q8s", device=device), x.copy()
    # it named "axes, out"; numpy before 1.25 refuses `@=` itself, in its own words
    with pytest.raises(TypeError, match=r"(`a @= b` with a qdispatch tensor would write the product into the numpy "
                                        r"array a in place, .*: write a = a @ b)|(Use 'a = a @ b' instead of 'a @= b')"):
        x @= square
    np.testing.assert_array_equal(x, before)
    with pytest.raises(TypeError, match="A QTensor is no dense array"):
        np.add(x[:3, :5], wq)
    if qd.Device(device).is_host:  # other ufuncs still see a host Tensor's values
        np.testing.assert_array_equal(np.add(x[:, :5], t[:3]), x[:, :5] + t.numpy()[:3])
        np.testing.assert_array_equal(np.maximum.reduce(t, axis=0), t.numpy().max(axis=0))
        out = t.numpy().copy()
        with pytest.raises(TypeError, match="can't be the out= of np.negative"):
            np.negative(out, out=(t,))
        np.testing.assert_array_equal(t.numpy(), out)  # untouched


def test_a_quantized_vector_is_refused_with_what_to_do(device):
    v = qd.quantize(np.ones(8, np.float32), "q8s", device=device)
    with pytest.raises(qd.ShapeError, match=r"q_matmul's rhs is a QTensor of shape \(8,\): a QTensor operand needs at "
                                         r"least 2 dims \(quantize a vector as \[1, K\]"):
        qd.q_matmul(np.ones((2, 8), np.float32), v)
