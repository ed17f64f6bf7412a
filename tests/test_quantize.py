"""quantize / dequantize against the formulas of DESIGN.md, on every backend."""
import re
import warnings

import numpy as np
import pytest

import qdispatch as qd
from qdispatch import quantmath
from qdispatch._core import get_backend
from qdispatch.layout import as_2d_block
from qdispatch.scheme import VALUE_RANGES
from helpers import QUANTIZE_SCHEMES, sqnr_db, transient_bytes

ALL_VALUES = list(VALUE_RANGES)


def scheme_for(value, **kw):
    store = "native" if VALUE_RANGES[value][2] == 8 else "packed_u32"
    return qd.QuantScheme(value, store=store, **kw)


def spec_quantize(x, value, block_rows, block_cols):
    """The formula written out with explicit loops over 2-D blocks."""
    lo, hi, _ = VALUE_RANGES[value]
    q = np.zeros(x.shape, np.int8)
    scales = np.zeros((x.shape[0] // block_rows, x.shape[1] // block_cols), np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = x[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols]
            amax = np.float32(np.abs(blk).max())
            s = np.float32(np.float32(2) * amax / np.float32(hi - lo)) if amax else np.float32(1)
            scales[i, j] = s
            q[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols] = \
                np.clip(np.rint(blk / s), lo, hi)
    return q, scales


@pytest.mark.parametrize("value", ALL_VALUES)
@pytest.mark.parametrize("gran,blocks", [
    (dict(), (8, 64)), (dict(axis=0), (1, 64)), (dict(axis=1), (8, 1)),
    (dict(block=32), (1, 32)), (dict(block=(2, 16)), (2, 16))])
def test_quantize_matches_the_formula(device, rng, value, gran, blocks):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    q = qd.quantize(x, scheme_for(value, **gran), device=device)
    want_q, want_s = spec_quantize(x, value, *blocks)
    np.testing.assert_array_equal(q.values, want_q)
    np.testing.assert_array_equal(qd.tensor_api.qtensor_host(q)[1], want_s)
    deq = q.dequantize().numpy()
    np.testing.assert_array_equal(deq, want_q.astype(np.float32) *
                                  np.repeat(np.repeat(want_s, blocks[0], 0), blocks[1], 1))


@pytest.mark.parametrize("scheme,floor_db", [
    (qd.QuantScheme("q8s", axis=0), 40.0),
    (qd.QuantScheme("q8s", block=32), 40.0),
    (qd.QuantScheme("q8f", axis=0), 40.0),
    (qd.QuantScheme("q4s", block=32, store="packed_u32"), 18.0),
    (qd.QuantScheme("q4f", block=32, store="packed_u32"), 18.0),
])
def test_round_trip_sqnr_on_gaussian_data(device, rng, scheme, floor_db):
    x = rng.standard_normal((256, 512)).astype(np.float32)
    q = qd.quantize(x, scheme, device=device)
    assert sqnr_db(x, q.dequantize().numpy()) >= floor_db


def test_packing_is_lsb_first():
    assert quantmath.pack_u32(np.array([-128, 2, -3, 127], np.int8), 8)[0] == 0x7FFD0280
    # 4-bit: 8 values per word, first value in the lowest nibble
    assert quantmath.pack_u32(np.array([1, -1, 0, 7, -8, 2, 3, -2], np.int8), 4)[0] == 0xE328_70F1
    # 2-bit: 16 values per word
    assert quantmath.pack_u32(np.array([1, -1, -2, 0] * 4, np.int8), 2)[0] == 0x2D2D2D2D


def test_packed_store_keeps_words_and_pads_ragged_rows():
    x = np.array([[1.0, -1.0, 0.5, 0.25, -0.75]], np.float32)
    q = qd.quantize(x, qd.QuantScheme("q4s", store="packed_u32"), device="reference")
    assert q.storage.values.dtype == np.uint32 and q.storage.values.shape == (1, 1)
    np.testing.assert_array_equal(quantmath.unpack_u32(q.storage.values, 4, 5), q.values)
    assert q.nbytes == 4 + 4


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip(rng, bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    v = rng.integers(lo, hi + 1, size=(3, 37)).astype(np.int8)
    np.testing.assert_array_equal(quantmath.unpack_u32(quantmath.pack_u32(v, bits), bits, 37), v)


def test_rounding_ties_go_to_even(device):
    # amax 127 -> scale 1.0 exactly for q8s; x/scale hits exact .5 ties
    x = np.array([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 127.0]], np.float32)
    q = qd.quantize(x, qd.QuantScheme("q8s"), device=device)
    assert float(q.scales) == 1.0
    np.testing.assert_array_equal(q.values, [[0, 2, 2, 0, -2, -2, 4, 127]])


def test_all_zero_groups_get_scale_one(device):
    x = np.zeros((2, 64), np.float32)
    x[1, 40] = 3.0
    q = qd.quantize(x, qd.QuantScheme("q8s", block=32), device=device)
    np.testing.assert_array_equal(q.scales[0], [1.0, 1.0])
    assert q.scales[1, 0] == 1.0 and q.scales[1, 1] == np.float32(np.float32(6.0) / np.float32(254))
    np.testing.assert_array_equal(q.dequantize().numpy()[0], 0)


@pytest.mark.parametrize("scheme", ["q8s", qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", axis=1),
                                    qd.QuantScheme("q8s", block=32), qd.QuantScheme("q8f", block=(3, 16)),
                                    qd.QuantScheme("q8s", block=4)], ids=repr)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_rejected_with_their_position(device, bad, scheme):
    """On every path of the kernels (a scale per tensor, row, column, wide and narrow
    blocks): an Inf is no scale overflow, it is named where it is."""
    x = np.ones((3, 64), np.float32)
    x[2, 37] = bad
    with pytest.raises(qd.NonFiniteError, match=r"position \(2, 37\)"):
        qd.quantize(x, scheme, device=device)


def test_float64_data_past_float32s_range_is_named_as_it_is(device):
    """quantize works in float32: 1e300 would be inf there, and the error named an inf
    the data lacks (after numpy's overflow warning).  Values that round to float32's
    largest pass that check (and meet the one of what dequantize would give), and
    NaN or Inf the data really holds is named as such."""
    x = np.ones((3, 8))
    x[1, 4] = -1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(qd.NonFiniteError, match=r"holding -1e\+300 at position \(1, 4\): quantize works in "
                                                     r"float32, whose range ends at 3\.4028234663852886e\+38; scale the data"):
            qd.quantize(x, "q8s", device=device)
        x[1, 4] = float(np.finfo(np.float32).max) * (1 + 2.0**-30)  # rounds down to float32's largest
        with pytest.raises(qd.ScaleOverflowError, match=r"magnitude 127 times the block's scale 2\.679\d*e\+36"):
            qd.quantize(x, "q8s", device=device)  # 127 * scale rounds past float32's largest
        x[1, 4] = 3.4e38
        assert qd.quantize(x, "q8s", device=device).scales.max() > 1e36
        x[1, 4] = np.inf
        with pytest.raises(qd.NonFiniteError, match=r"holding inf at position \(1, 4\)"):
            qd.quantize(x, "q8s", device=device)


def test_a_ragged_list_is_a_shape_error():
    with pytest.raises(qd.ShapeError, match="quantize takes an array of numbers: .*inhomogeneous"):
        qd.quantize([[1.0, 2.0], [1.0]], "q8s")


@pytest.mark.parametrize("gran", [dict(), dict(axis=0), dict(block=(2, 1, 4))], ids=repr)
def test_a_non_finite_value_is_named_by_its_index_in_an_nd_tensor(device, gran):
    """Not by its index in the 2-D view a kernel quantizes ((5, 3) for (1, 2, 3))."""
    x = np.ones((2, 3, 4), np.float32)
    x[1, 2, 3] = np.nan
    with pytest.raises(qd.NonFiniteError, match=r"position \(1, 2, 3\)"):
        qd.quantize(x, qd.QuantScheme("q8s", **gran), device=device)


@pytest.mark.skipif("cpu" not in qd.available_backends(), reason="cpu backend not built")
def test_a_scale_overflow_names_its_block_in_the_tensors_scale_grid():
    """On cpu the block is named in the grid of the tensor's own blocks, (1, 2, 0) of
    a (2, 3, 1) grid, not in the kernel's 2-D grid ((5, 0))."""
    x = np.ones((2, 3, 4), np.float32)
    x[1, 2] = 1e9  # amax / 127 is past f16's 65504
    scheme = qd.QuantScheme("q8s", block=(1, 1, 4), scale_dtype="f16")
    with pytest.raises(qd.ScaleOverflowError, match=r"block \(1, 2, 0\)"):
        qd.quantize(x, scheme, device="cpu")
    with pytest.raises(qd.ScaleOverflowError):
        qd.quantize(x, scheme, device="reference")


@pytest.mark.skipif(quantmath.NUMPY_MAX_DIMS < 34, reason="numpy before 2 holds no array of 34 dims")
@pytest.mark.parametrize("gran", [dict(), dict(axis=-2), dict(axis=0), dict(block=2), dict(block=(3, 2)),
                                  dict(block=(1, 3, 4))])
def test_tensors_of_more_than_32_dims_quantize_as_their_few_long_dims_do(device, rng, gran):
    # numpy holds at most 64 dims, and the blocked view took two per dim
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    many = x.reshape((1,) * 31 + x.shape)
    long_gran = dict(axis=gran["axis"] % 3 + 31) if "axis" in gran else gran  # the same dim
    q = qd.quantize(many, qd.QuantScheme("q8s", **long_gran), device=device)
    q3 = qd.quantize(x, qd.QuantScheme("q8s", **gran), device=device)
    np.testing.assert_array_equal(q.values, q3.values.reshape(many.shape))
    assert q.scales.size == q3.scales.size
    np.testing.assert_array_equal(q.scales, q3.scales.reshape(q.scales.shape))
    np.testing.assert_array_equal(q.dequantize().numpy(), q3.dequantize().numpy().reshape(many.shape))


def test_an_overflowing_scale_is_shown_with_the_digits_that_tell_it_from_one_that_fits(device):
    # %g wrote 65504.004 as 65504, a value float16 holds
    x = np.array([[np.nextafter(np.float32(65504 * 127), np.float32(np.inf))]], np.float32)
    with pytest.raises(qd.ScaleOverflowError, match=r"\(65504\.004\) overflows scale_dtype='f16'"):
        qd.quantize(x, qd.QuantScheme("q8s", scale_dtype="f16"), device=device)


def test_non_divisible_block_is_an_error(device):
    with pytest.raises(qd.QuantSchemeError, match="does not divide"):
        qd.quantize(np.ones((4, 48), np.float32), qd.QuantScheme("q8s", block=32), device=device)


@pytest.mark.parametrize("scale_dtype", ["f16", "bf16"])
def test_scales_are_rounded_up_into_their_dtype(device, rng, scale_dtype):
    x = rng.standard_normal((64, 64)).astype(np.float32) * 3
    q = qd.quantize(x, qd.QuantScheme("q8s", axis=0, scale_dtype=scale_dtype), device=device)
    exact = (np.float32(2) * np.abs(x).max(axis=1)) / np.float32(254)
    stored = q.scales
    assert np.all(stored >= exact) and np.any(stored > exact)
    if scale_dtype == "f16":
        np.testing.assert_array_equal(stored.astype(np.float16).astype(np.float32), stored)
        below = np.nextafter(stored.astype(np.float16), np.float16(0)).astype(np.float32)
    else:
        np.testing.assert_array_equal(stored.view(np.uint32) & 0xFFFF, 0)
        below = (stored.view(np.uint32) - 0x10000).view(np.float32)
    assert np.all(below < exact)  # the next value down would have been too small
    # values are quantized with the stored scale: no value exceeds the range
    assert np.abs(q.values).max() <= 127


@pytest.mark.parametrize("big", [1e7, 65504 * 127 * 1.0001])  # the second rounds to 65504, then up to inf
def test_scale_overflowing_f16_is_an_error(device, big):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the error, not a warning on the way to it
        with pytest.raises(qd.ScaleOverflowError,
                           match="overflows scale_dtype='f16': use scale_dtype='f32' or rescale"):
            qd.quantize(np.full((2, 4), big, np.float32), qd.QuantScheme("q8s", scale_dtype="f16"),
                        device=device)


@pytest.mark.parametrize("magnitude, warns", [(1e-8, True), (1e-5, True), (1e-3, False)])
def test_float16_scales_of_few_steps_warn(device, rng, magnitude, warns):
    """Below 2^-20 float16 holds a scale in 16 steps or fewer, so rounding it up may
    enlarge it by 1/15 or more (a scale under 2^-24 becomes 2^-24): quantize warns,
    counts them, names the fix, and returns what it would without the warning."""
    x = (rng.standard_normal((4, 64)) * magnitude).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = qd.quantize(x, qd.QuantScheme("q8s", block=32, scale_dtype="f16"), device=device)
    found = [w for w in caught if issubclass(w.category, qd.ScaleUnderflowWarning)]
    exact = np.abs(x.reshape(4, 2, 32)).max(axis=-1) / np.float32(127)
    stored = q.scales
    assert np.all(stored >= exact)
    nearest = exact.astype(np.float16)
    rounded_up = np.where(nearest.astype(np.float32) < exact, np.nextafter(nearest, np.float16(1)), nearest)
    np.testing.assert_array_equal(stored, rounded_up.astype(np.float32))
    if not warns:
        assert not found
        return
    assert len(found) == 1 and found[0].filename == __file__  # the caller's line
    few = int(np.count_nonzero(stored < 2.0 ** -20))
    message = str(found[0].message)
    assert message.startswith(f"{few} of 8 float16 scales are below 2^-20") and few > 0
    assert "scale_dtype='bf16' or 'f32'" in message
    if magnitude == 1e-8:
        np.testing.assert_array_equal(stored, np.float32(2.0 ** -24))  # each scale enlarged many times over
    with warnings.catch_warnings():
        warnings.simplefilter("error", qd.ScaleUnderflowWarning)
        kept = qd.quantize(x, qd.QuantScheme("q8s", block=32, scale_dtype="bf16"), device=device)
    assert qd.error_report(x, kept).sqnr_db > qd.error_report(x, q).sqnr_db


@pytest.mark.parametrize("scheme,big,block", [
    (qd.QuantScheme("q8s", block=(2, 4), scale_dtype="f16"), 1e7, (1, 1, 1)),
    (qd.QuantScheme("q2s", axis=1, store="packed_u32", scale_dtype="bf16"), 3.4e38, (0, 3, 0)),
])
def test_errors_name_the_block_and_the_value_as_every_backend_does(device, scheme, big, block):
    """The scale that overflows is named by its block in the scale grid, a NaN or
    Inf by its position and its value as Python writes it, the same way on every
    backend."""
    x = np.ones((2, 4, 16), np.float32)
    x[1, 3, 5] = big
    with pytest.raises(qd.ScaleOverflowError, match=re.escape(f"The scale of block {block} (")) as info:
        qd.quantize(x, scheme, device=device)
    with pytest.raises(qd.ScaleOverflowError) as reference:
        qd.quantize(x, scheme, device="reference")
    assert str(info.value) == str(reference.value)  # the float32 scale's value too
    x[1, 3, 5] = -np.inf
    with pytest.raises(qd.NonFiniteError, match=re.escape("holding -inf at position (1, 3, 5): remove NaN/Inf")):
        qd.quantize(x, scheme, device=device)


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q4s", store="packed_u32", scale_dtype="f16"),
                                    qd.QuantScheme("q2s", axis=0, store="packed_u32", scale_dtype="bf16"),
                                    qd.QuantScheme("q8f", block=32, scale_dtype="f16")])
def test_a_kernels_scale_overflow_is_the_references_error(device, scheme):
    """The C and CUDA kernels' 2-D path: a sub-byte scheme's overflow came out as a
    QuantSchemeError about native stores, from the message's own scheme."""
    x = np.ones((2, 64), np.float32)
    x[1, 40] = 3.4e38 if scheme.scale_dtype == "bf16" else 1e7  # q2s's scale is amax: past bf16's 3.39e38
    with pytest.raises(qd.ScaleOverflowError) as info:
        qd.quantize(x, scheme, device=device)
    with pytest.raises(qd.ScaleOverflowError) as reference:
        qd.quantize(x, scheme, device="reference")
    assert str(info.value) == str(reference.value)


def exact_scale(amax, lo, hi):
    """The float32 rounding of 2*amax/(hi-lo), where 2*amax itself would overflow
    float32 for the largest amax: large ones are scaled down by 4 and back up
    (exact, as both quotients are normal floats)."""
    amax = np.asarray(amax, np.float32)
    direct = (np.float32(2) * np.minimum(amax, np.float32(2.0**100))) / np.float32(hi - lo)
    quarter = np.float32(4) * ((np.float32(2) * (amax / np.float32(4))) / np.float32(hi - lo))
    scale = np.where(amax < np.float32(2.0**100), direct, quarter)
    return np.where(amax == 0, np.float32(1), np.where(scale == 0, np.float32(2.0**-149), scale))


@pytest.mark.parametrize("value", ALL_VALUES)
def test_f32_scale_is_2_amax_over_the_range_for_every_finite_amax(device, rng, value):
    """From subnormals to float32's max, where 2*amax overflows: every f32 scale is
    the rounding of 2*amax/(hi-lo), the same on every backend.  Rows whose value
    would dequantize past float32's range are left out (quantize refuses them: see
    the test below)."""
    lo, hi, _ = VALUE_RANGES[value]
    bits = rng.integers(0, 0x7F7FFFFF, size=2048, dtype=np.uint32, endpoint=True)
    bits[:4] = [0, 1, 0x7F7FFFFF, 0x7F000000]  # zero, the smallest subnormal, the largest float, 2**127
    x = bits.view(np.float32).reshape(-1, 1) * np.where(rng.random((2048, 1)) < 0.5, -1, 1).astype(np.float32)
    x[4] = -x[2]  # the largest float with both signs
    want = exact_scale(np.abs(x[:, 0]), lo, hi)
    with np.errstate(over="ignore"):  # the pinned arithmetic: q = clip(rint(x / scale)), then q * scale
        finite = np.isfinite(np.clip(np.rint(x[:, 0] / want), lo, hi) * want)
    x, want = x[finite], want[finite]
    scheme = scheme_for(value, axis=0, scale_dtype="f32")
    q = qd.quantize(x, scheme, device=device)
    np.testing.assert_array_equal(q.scales, want)
    np.testing.assert_array_equal(q.values, np.clip(np.rint(x / want[:, None]), lo, hi).astype(np.int8))
    ref = qd.quantize(x, scheme, device="reference")
    np.testing.assert_array_equal(q.values, ref.values)
    np.testing.assert_array_equal(q.scales, ref.scales)


@pytest.mark.parametrize("value", ALL_VALUES)
def test_data_at_float32s_max_quantizes_unless_it_would_dequantize_to_inf(device, value):
    """The scale of float32's largest amax is still 2*amax/(hi-lo) rounded; where
    a value times it rounds past float32's range (every range but q4s's and q2s's,
    whose hi * scale rounds back to amax), quantize refuses on every backend alike
    rather than make a QTensor that dequantizes to inf."""
    lo, hi, _ = VALUE_RANGES[value]
    top = np.finfo(np.float32).max
    scale = quantmath.float32_scales(top, (lo, hi))
    np.testing.assert_array_equal(scale, exact_scale(top, lo, hi))
    x = np.array([[-top, top, 1.0]], np.float32).T  # one block per value
    scheme = scheme_for(value, axis=0, scale_dtype="f32")
    with np.errstate(over="ignore"):  # the pinned arithmetic: q = clip(rint(x / scale)), then q * scale
        q_ends = np.clip(np.rint(np.array([-top, top], np.float32) / scale), lo, hi)
        overflows = np.isinf(q_ends * scale).any()
    if not overflows:
        q = qd.quantize(x, scheme, device=device)
        assert np.isfinite(q.dequantize().numpy()).all()
        np.testing.assert_array_equal(q.scales[:2], [scale, scale])
        return
    with pytest.raises(qd.ScaleOverflowError, match=r"^Block \(0, 0\) dequantizes past float32's range") as info:
        qd.quantize(x, scheme, device=device)
    with pytest.raises(qd.ScaleOverflowError) as reference:
        qd.quantize(x, scheme, device="reference")
    assert str(info.value) == str(reference.value)


def test_data_near_float32s_max_quantizes_with_f32_scales(device):
    x = np.full((2, 4), 2e38, np.float32)
    q = qd.quantize(x, qd.QuantScheme("q8s", scale_dtype="f32"), device=device)
    assert float(q.scales) == np.float32(2e38) / np.float32(127)
    np.testing.assert_array_equal(q.values, np.full((2, 4), 127, np.int8))


def test_scale_overflow_in_f32_does_not_advise_f32():
    with pytest.raises(qd.ScaleOverflowError, match="overflows scale_dtype='f32'") as info:
        quantmath.round_up_to_dtype(np.array([np.inf], np.float32), "f32")
    assert str(info.value).endswith(": rescale the input")


def test_non_float_data_is_named_by_its_own_dtype():
    for data in (np.arange(64).reshape(8, 8), [[1, 2], [3, 4]], np.ones((2, 2), np.uint8)):
        with pytest.raises(TypeError, match=f"quantize expects float data, got {np.asarray(data).dtype}: "
                                            f"convert it to float32 first"):
            qd.quantize(data, device="reference")
    with pytest.raises(TypeError, match="quantize expects float data, got int8"):
        qd.quantize(qd.tensor(np.ones((2, 2), np.int8), device="reference"))


def test_torch_integer_data_is_named_by_its_own_dtype():
    """torch's integers crossed as int8 first, so the error named int8 for int64 data,
    or told a quantize call to quantize floats instead."""
    torch = pytest.importorskip("torch")
    w = qd.quantize(np.ones((4, 2), np.float32), device="reference")
    for data, name in ((torch.tensor([[1, 2]]), "int64"), (torch.tensor([[1000, 2]]), "int64"),
                       (torch.tensor([[True, False]]), "bool")):
        with pytest.raises(TypeError, match=f"quantize expects float data, got {name}: convert it to float32"):
            qd.quantize(data, device="reference")
        with pytest.raises(TypeError, match=f"q_matmul expects float data, got {name}"):
            qd.q_matmul(data, w.T)


def test_3d_blocks_follow_burn_semantics(device, rng):
    x = rng.standard_normal((2, 4, 64)).astype(np.float32)
    q = qd.quantize(x, qd.QuantScheme("q8s", block=(1, 32)), device=device)
    assert q.scales.shape == (2, 4, 2)
    ref = qd.quantize(x, qd.QuantScheme("q8s", block=(1, 32)), device="reference")
    np.testing.assert_array_equal(q.values, ref.values)
    q2 = qd.quantize(x, qd.QuantScheme("q8s", block=(2, 2, 32)), device=device)
    ref2 = qd.quantize(x, qd.QuantScheme("q8s", block=(2, 2, 32)), device="reference")
    np.testing.assert_array_equal(q2.values, ref2.values)
    np.testing.assert_array_equal(q2.scales, ref2.scales)


def test_transpose_is_free_and_swaps_blocks(rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    q = qd.quantize(x, qd.QuantScheme("q4s", block=32, store="packed_u32"), device="reference")
    t = q.T
    assert t.storage is q.storage
    assert t.shape == (64, 8) and t.scheme.block == (32, 1)
    np.testing.assert_array_equal(t.values, q.values.T)
    np.testing.assert_array_equal(t.dequantize().numpy(), q.dequantize().numpy().T)
    assert t.T.scheme == q.scheme
    qa = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference")
    assert qa.T.scheme.axis == 1


def test_half_precision_inputs_quantize_like_their_float32_values(device, rng):
    x16 = rng.standard_normal((4, 32)).astype(np.float16)
    a = qd.quantize(x16, "q8s", device=device)
    b = qd.quantize(x16.astype(np.float32), "q8s", device=device)
    np.testing.assert_array_equal(a.values, b.values)
    bf = qd.tensor(x16.astype(np.float32), device=device, dtype="bfloat16")
    c = qd.quantize(bf, "q8s")
    d = qd.quantize(quantmath.bf16_bits_to_f32(quantmath.f32_to_bf16_bits(x16.astype(np.float32))),
                    "q8s", device=device)
    np.testing.assert_array_equal(c.values, d.values)


def test_empty_and_scalar_inputs_are_shape_errors():
    with pytest.raises(qd.ShapeError):
        qd.quantize(np.zeros((0, 4), np.float32), "q8s")
    with pytest.raises(qd.ShapeError):
        qd.quantize(np.float32(1.0), "q8s")


# ---- blocks a few columns wide: the cpu backend sweeps their rows -------------

needs_cpu = pytest.mark.skipif("cpu" not in qd.available_backends(), reason="cpu backend not built")
NARROW_LAYOUTS = [
    ((33, 17), dict(axis=1)), ((33, 17), dict(axis=0)), ((1, 5), dict(axis=1)), ((1, 5), dict(axis=0)),
    ((64, 1), dict(axis=1)), ((64, 1), dict(axis=0)), ((3, 5, 7), dict(axis=-1)), ((2, 4, 33), dict(axis=-1)),
    ((64, 17), dict(block=(32, 1))), ((16, 34), dict(block=(8, 2))), ((12, 33), dict(block=(4, 3))),
    ((8, 45), dict(block=(2, 15))), ((8, 48), dict(block=(1, 16))),
    # 65536 values or more: two threads share the columns (or the bands of blocks)
    ((256, 257), dict(axis=1)), ((130, 1100), dict(block=(2, 2))), ((64, 1035), dict(block=(4, 3))),
    ((4, 32, 520), dict(axis=-1)),
]


@pytest.fixture(params=[1, 2])
def cpu_threads(request):
    before = qd.get_num_threads()
    qd.set_num_threads(request.param)
    yield request.param
    qd.set_num_threads(before)


def narrow_data(rng, shape, value):
    """Columns of magnitudes far apart, one of rounding ties (scale 1 where a block
    holds the half range), an all-zero one and two of subnormals (1e-44: the scale
    underflows to 0 and is rounded up)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x *= (10.0 ** rng.uniform(-3, 3, shape[-1])).astype(np.float32)
    lo, hi, _ = VALUE_RANGES[value]
    flat = x.reshape(-1, shape[-1])
    ties = np.array([(hi - lo) / 2, 0.5, -(hi - lo) / 2, -1.5, 2.5, -0.5], np.float32)
    special = [np.resize(ties, len(flat)), 0.0, np.float32(1e-40) * flat[:, 2 % shape[-1]],
               np.float32(1e-44) * np.sign(flat[:, 3 % shape[-1]])]
    for c, column in enumerate(special[:shape[-1]]):
        flat[:, c] = column
    return x


def assert_same_quantization(got, want):
    np.testing.assert_array_equal(got.values, want.values)
    got_scales, want_scales = (qd.tensor_api.qtensor_host(q)[1] for q in (got, want))
    np.testing.assert_array_equal(got_scales.view(np.uint32), want_scales.view(np.uint32))


def assert_cpu_quantizes_as_reference(x, scheme):
    assert_same_quantization(qd.quantize(x, scheme, device="cpu"), qd.quantize(x, scheme, device="reference"))


def assert_cpu_fails_as_reference(x, scheme):
    with pytest.raises(qd.QDispatchError) as want:
        qd.quantize(x, scheme, device="reference")
    with pytest.raises(qd.QDispatchError) as got:
        qd.quantize(x, scheme, device="cpu")
    assert (type(got.value), str(got.value)) == (type(want.value), str(want.value))


@needs_cpu
@pytest.mark.filterwarnings("ignore::qdispatch.ScaleUnderflowWarning")  # subnormal data on purpose
@pytest.mark.parametrize("shape,gran", NARROW_LAYOUTS)
def test_narrow_blocks_quantize_as_the_reference(isa, cpu_threads, rng, shape, gran):
    for value in ALL_VALUES:
        x = narrow_data(rng, shape, value)
        for scale_dtype in ("f32", "f16", "bf16"):
            assert_cpu_quantizes_as_reference(x, scheme_for(value, scale_dtype=scale_dtype, **gran))


@needs_cpu
@pytest.mark.parametrize("shape,gran", [((33, 17), dict(axis=1)), ((16, 34), dict(block=(8, 2))),
                                        ((256, 257), dict(axis=1)), ((64, 1035), dict(block=(4, 3)))])
def test_narrow_blocks_report_errors_as_the_reference(isa, cpu_threads, rng, shape, gran):
    rows, cols = shape
    for bad in ({(rows // 2, cols // 2): np.nan},
                {(rows - 1, 0): np.nan, (0, cols - 1): -np.inf},   # the first in flat order is named
                {(0, 0): 1e30, (rows - 1, cols - 1): np.inf},     # NaN or Inf wins over an overflowing scale
                {(rows - 1, 1): 1e30, (0, cols - 1): -1e30}):  # the first overflowing block
        x = rng.standard_normal(shape).astype(np.float32)
        for at, v in bad.items():
            x[at] = v
        for value in ("q8s", "q4f"):
            for scale_dtype in ("f32", "f16", "bf16"):
                scheme = scheme_for(value, scale_dtype=scale_dtype, **gran)
                if np.isfinite(x).all() and scale_dtype != "f16":
                    assert_cpu_quantizes_as_reference(x, scheme)  # 1e30 / 63.5 fits float32 and bfloat16
                else:
                    assert_cpu_fails_as_reference(x, scheme)


# ---- a transposed view (W.T of a row-major W) ---------------------------------

TRANSPOSED_SCHEMES = [qd.QuantScheme("q8s", axis=1), qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8f"),
                      qd.QuantScheme("q8s", axis=-1), qd.QuantScheme("q4f", axis=-2, store="packed_u32"),
                      qd.QuantScheme("q4s", block=(32, 1), store="packed_u32"),
                      qd.QuantScheme("q4f", block=(1, 16), store="packed_u32", scale_dtype="f16"),
                      qd.QuantScheme("q2s", block=(8, 4), store="packed_u32")]


@pytest.mark.parametrize("scheme", TRANSPOSED_SCHEMES, ids=repr)
def test_a_transposed_view_quantizes_as_its_copy(device, rng, scheme):
    """W.T is quantized in W's own order, kept as a transpose: the values, scales and
    products of the copy np.ascontiguousarray(W.T)."""
    w = rng.standard_normal((48, 64)).astype(np.float32)
    view, copy = qd.quantize(w.T, scheme, device=device), qd.quantize(np.ascontiguousarray(w.T), scheme, device=device)
    assert view.transposed and view.shape == copy.shape == (64, 48) and view.scheme == copy.scheme
    np.testing.assert_array_equal(view.values, copy.values)
    np.testing.assert_array_equal(view.scales, copy.scales)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_array_equal(qd.q_matmul(x, view, activation_scheme="q8s").numpy(),
                                  qd.q_matmul(x, copy, activation_scheme="q8s").numpy())
    batched = rng.standard_normal((2, 64, 48)).astype(np.float32).swapaxes(-1, -2)
    np.testing.assert_array_equal(qd.quantize(batched, "q8s", device=device).values,
                                  qd.quantize(np.ascontiguousarray(batched), "q8s", device=device).values)
    assert view.T.T.scheme == scheme  # a negative axis stays negative, as given (it became positive)
    if scheme.axis is not None:
        assert qd.quantize(batched, scheme, device=device).scheme == scheme


def test_a_transposed_view_names_bad_values_where_they_are(device):
    w = np.ones((6, 5), np.float32)
    w[1, 4] = np.nan  # at (4, 1) of w.T
    with pytest.raises(qd.NonFiniteError, match=r"position \(4, 1\)"):
        qd.quantize(w.T, qd.QuantScheme("q8s", axis=1), device=device)


@pytest.mark.parametrize("raised", [MemoryError(), qd.CudaOutOfMemoryError("tried to allocate 76293.9 MiB")],
                         ids=["numpy's", "the GPU's"])
def test_out_of_memory_for_the_float32_copy_says_so(monkeypatch, raised):
    """A 40 GB bf16 weight on the GPU failed for 76 GiB, its float32 copy, with no word of it."""
    from qdispatch._core import get_backend
    x = qd.tensor(np.ones((64, 128), np.float32), device="reference", dtype="bfloat16")

    def cast(*args):
        raise raised
    monkeypatch.setattr(get_backend("reference"), "cast", cast)
    with pytest.raises(qd.OutOfMemoryError) as exc:
        qd.quantize(x, "q8s")
    assert type(exc.value) is (type(raised) if isinstance(raised, qd.OutOfMemoryError) else qd.OutOfMemoryError)
    assert str(exc.value).startswith("quantize reads bfloat16 data through a float32 copy (32.0 KiB, twice the data's "
                                     "bytes), which did not fit: ")
    assert exc.value.__cause__ is raised
    monkeypatch.undo()
    again = qd.quantize(x, "q8s").dequantize().numpy()  # the next call, with memory, works
    np.testing.assert_array_equal(again, qd.quantize(x.numpy(), "q8s").dequantize().numpy())


# ---- 16-bit data on the cpu backend: read in place, no float32 copy ------------

HALF_DTYPES = ["float16", "bfloat16"]
HALF_SHAPES = [(8, 128), (4, 8, 256), (1, 4096), (4096, 1), (300, 12), (77, 36), (3, 4100)]


def half_tensor(x32, dtype):
    """A host Tensor of float32 data rounded to `dtype`, on the reference backend."""
    return qd.tensor(x32, device="reference", dtype=dtype)


def no_float32_copy(monkeypatch):
    """The cpu backend's cast made to fail: quantizing through a float32 copy fails the test."""
    def cast(payload, src, dst):
        raise AssertionError(f"quantize cast {src} data to {dst}")
    monkeypatch.setattr(get_backend("cpu"), "cast", cast)


def reads_in_place(q):
    """Whether the cpu backend quantizes q's layout in C (not an N-d blocking's numpy spec)."""
    return as_2d_block(q.layout.shape, q.layout.block) is not None


@needs_cpu
@pytest.mark.filterwarnings("ignore::qdispatch.ScaleUnderflowWarning")
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=str)
@pytest.mark.parametrize("scheme", QUANTIZE_SCHEMES, ids=repr)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_16bit_data_quantizes_in_place_as_the_reference(monkeypatch, rng, dtype, scheme, shape):
    """Its bits are the reference's (quantizing the float32 values), with no float32 copy."""
    x32 = (rng.standard_normal(shape) * rng.uniform(0.01, 100, size=shape[-1])).astype(np.float32)
    if shape[-1] > 32:
        x32[..., :32] = 0.0  # an all-zero block (scale 1.0) where blocks are 32 wide
    x32.reshape(-1)[7 % x32.size] = 0.5 * float(np.abs(x32).max())  # ties to even at .5 steps
    x = half_tensor(x32, dtype)
    try:
        want = qd.quantize(x, scheme)
    except qd.QDispatchError as exc:  # the scheme does not fit this shape: the same error on cpu
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            qd.quantize(x, scheme, device="cpu")
        return
    if reads_in_place(want):
        no_float32_copy(monkeypatch)
    got = qd.quantize(x, scheme, device="cpu")
    assert got.device == "cpu"
    assert_same_quantization(got, want)


ODD_LAYOUTS = [
    ((1, 5), dict()), ((1, 5), dict(axis=0)), ((5, 1), dict(axis=1)), ((7, 1), dict()), ((1, 17), dict(block=17)),
    ((1, 4097), dict(axis=0)), ((3, 8195), dict()),       # a value past the widened pieces of 4096
    ((64, 8200), dict(block=4100)),                       # blocks too large to widen at once, many of them
    ((130, 4160), dict(block=32)),                        # a band's tiles of 128 blocks, then one of 2
    ((33, 1040), dict(block=(3, 16))), ((257, 300), dict(axis=0)), ((70, 1000), dict()),
    ((129, 520), dict(block=(43, 8))), ((4, 32, 520), dict(axis=-1)), ((256, 257), dict(axis=1)),
    ((9, 7, 33), dict(block=(3, 1, 11))),                 # an N-d blocking: numpy on a float32 copy
]


@needs_cpu
@pytest.mark.filterwarnings("ignore::qdispatch.ScaleUnderflowWarning")  # subnormal data on purpose
@pytest.mark.parametrize("shape,gran", ODD_LAYOUTS)
def test_16bit_data_of_odd_shapes_quantizes_as_the_reference(monkeypatch, isa, cpu_threads, rng, shape, gran):
    """Tails shorter than a vector, single rows and columns, rows that two threads
    share unevenly, and the widening's own pieces and tiles."""
    for dtype in HALF_DTYPES:
        for value, scale_dtype in (("q8s", "f32"), ("q4f", "f16"), ("q2s", "bf16")):
            x = half_tensor(narrow_data(rng, shape, value), dtype)
            scheme = scheme_for(value, scale_dtype=scale_dtype, **gran)
            want = qd.quantize(x, scheme)
            with monkeypatch.context() as patch:
                if reads_in_place(want):
                    no_float32_copy(patch)
                got = qd.quantize(x, scheme, device="cpu")
            assert_same_quantization(got, want)


@needs_cpu
@pytest.mark.parametrize("shape,gran", [((4, 64), dict()), ((4, 64), dict(block=32)), ((3, 8195), dict(axis=0)),
                                        ((130, 4160), dict(block=32)), ((64, 1035), dict(block=(4, 3))),
                                        ((256, 257), dict(axis=1)), ((64, 8200), dict(block=4100))], ids=str)
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_16bit_nan_and_inf_are_named_as_the_reference_names_them(monkeypatch, cpu_threads, dtype, shape, gran):
    rows, cols = shape
    no_float32_copy(monkeypatch)
    for bad in ({(0, 0): np.nan}, {(rows - 1, cols - 1): np.inf}, {(rows // 2, cols // 2): -np.inf},
                {(rows - 1, 0): np.nan, (0, cols - 1): -np.inf},  # the first in flat order is named
                {(0, min(cols - 1, 4100)): np.inf}):              # past the first widened piece
        x32 = np.ones(shape, np.float32)
        for at, v in bad.items():
            x32[at] = v
        x = half_tensor(x32, dtype)
        for scale_dtype in ("f32", "f16"):
            scheme = scheme_for("q8s", scale_dtype=scale_dtype, **gran)
            with pytest.raises(qd.NonFiniteError, match=r"holding -?(nan|inf) at position"):
                qd.quantize(x, scheme, device="cpu")
            assert_cpu_fails_as_reference(x, scheme)


@needs_cpu
@pytest.mark.parametrize("bits", [0x7C01, 0xFD00, 0x7DFF], ids=hex)  # signalling NaNs: the quiet bit clear
def test_a_signalling_float16_nan_is_named_as_the_reference_names_it(monkeypatch, isa, cpu_threads, bits):
    """A signalling NaN (F16C alone would widen it to a quiet one) is named where the
    reference names it: near the start, past the first 4096 values, at the end."""
    no_float32_copy(monkeypatch)
    for at in ((0, 3), (5, 4097), (7, 4099)):
        x16 = np.ones((8, 4100), np.float16)
        x16.view(np.uint16)[at] = bits
        x = qd.tensor(x16, device="reference")
        for scheme in (scheme_for("q8s"), scheme_for("q4f", block=(1, 4))):
            with pytest.raises(qd.NonFiniteError, match=re.escape(f"holding nan at position {at}")):
                qd.quantize(x, scheme, device="cpu")
            assert_cpu_fails_as_reference(x, scheme)


@needs_cpu
@pytest.mark.parametrize("shape,gran,big", [
    ((4, 64), dict(block=32), {(3, 40): 1e10}),                  # the block named, not the first
    ((4, 64), dict(), {(2, 5): 1e10}),                            # per tensor
    ((130, 4160), dict(block=32), {(100, 4000): 1e10, (120, 33): -1e10}),
    ((64, 1035), dict(block=(4, 3)), {(60, 1000): 1e10}),         # narrow blocks, swept
    ((64, 8200), dict(block=4100), {(63, 8199): -1e10}),
], ids=str)
def test_a_bfloat16_scale_overflow_is_named_as_the_reference_names_it(monkeypatch, cpu_threads, shape, gran, big):
    """bfloat16 holds 1e10, whose float16 scale (1e10 / 127) overflows."""
    x32 = np.ones(shape, np.float32)
    for at, v in big.items():
        x32[at] = v
    x = half_tensor(x32, "bfloat16")
    no_float32_copy(monkeypatch)
    scheme = scheme_for("q8s", scale_dtype="f16", **gran)
    with pytest.raises(qd.ScaleOverflowError, match=r"The scale of block \("):
        qd.quantize(x, scheme, device="cpu")
    assert_cpu_fails_as_reference(x, scheme)
    x32[0, 1] = np.nan  # NaN wins over an overflowing scale, wherever it is
    assert_cpu_fails_as_reference(half_tensor(x32, "bfloat16"), scheme)


@needs_cpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_quantizing_16bit_data_allocates_no_float32_copy(dtype, rng):
    """A float32 copy would be 4 bytes a value; quantize holds 1 (the int8 values)
    and a few scales.  numpy's allocations are what tracemalloc traces."""
    x = qd.tensor(rng.standard_normal((512, 4096)).astype(np.float32), device="cpu", dtype=dtype)
    for scheme in (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=32, store="packed_u32"),
                   qd.QuantScheme("q8s")):
        assert transient_bytes(lambda: qd.quantize(x, scheme)) < 2 * x.size


@needs_cpu
def test_the_kernel_takes_16bit_data_by_name():
    from qdispatch import _cpu
    x = np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)
    bits = quantmath.f32_to_bf16_bits(x)
    for data, dtype in ((x, "float32"), (x.astype(np.float16), "float16"), (bits, "bfloat16")):
        q, s = _cpu.quantize(data, "q8s", 1, 4, "f32", dtype=dtype)
        np.testing.assert_array_equal(q, [[42, -85, 127, 21]])
        assert s[0, 0] == np.float32(3) / np.float32(127)
    with pytest.raises(qd.ArgumentTypeError, match="x must have dtype uint16"):
        _cpu.quantize(x, "q8s", 1, 4, "f32", dtype="bfloat16")  # float32 data named bfloat16
    with pytest.raises(qd.ArgumentError, match="Can't quantize dtype 'int8'"):
        _cpu.quantize(x, "q8s", 1, 4, "f32", dtype="int8")
