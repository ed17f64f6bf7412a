"""The quantization arithmetic in numpy: the executable specification that every
backend's kernels must match bit for bit.

Pinned arithmetic: the scale is 2*amax/(hi-lo) rounded to float32 (computed as
amax/((hi-lo)/2), which rounds the same and never overflows), stored in its
scale dtype rounded up (never down), and values are quantized with a true
float32 division by the stored scale, rounded half to even, then clamped."""
import math

import numpy as np

from .errors import NonFiniteError, ScaleOverflowError, ScaleUnderflowWarning, ShapeError
from .scheme import QuantScheme

F16_MAX = float(np.finfo(np.float16).max)


# ---- half-precision helpers (bf16 travels as uint16 bit patterns) ----------

def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
    # the shift makes a 0-d array a scalar; a uint32 count keeps it uint32 (numpy 1.x made
    # a scalar shifted by a Python int the smallest type that held its value)
    return np.asarray(wide << np.uint32(16)).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, the conversion every framework uses; NaN stays NaN."""
    bits = np.asarray(x, dtype=np.float32, order="C").view(np.uint32)  # ascontiguousarray makes 0-d 1-d
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, np.uint32(0x7FC0), rounded).astype(np.uint16)


def round_up_to_dtype(scale: np.ndarray, scale_dtype: str) -> np.ndarray:
    """The smallest value of `scale_dtype` that is >= each float32 scale (as float32)."""
    scale = np.asarray(scale, dtype=np.float32)
    if scale_dtype == "f32":
        stored = scale
    elif scale_dtype == "f16":
        with np.errstate(over="ignore"):  # a scale past float16's range is refused below
            half = scale.astype(np.float16)
            low = half.astype(np.float32) < scale
            half = np.where(low, np.nextafter(half, np.float16(np.inf)), half)
        stored = half.astype(np.float32)
    elif scale_dtype == "bf16":
        bits = scale.view(np.uint32)
        truncated = bits & np.uint32(0xFFFF0000)
        up = truncated != bits
        stored = np.where(up, truncated + np.uint32(0x10000), truncated).astype(np.uint32).view(np.float32)
    else:  # validated by QuantScheme already
        raise ValueError(scale_dtype)
    if not np.all(np.isfinite(stored)):
        flat = int(np.flatnonzero(~np.isfinite(stored.reshape(-1)))[0])
        block = tuple(int(i) for i in np.unravel_index(flat, stored.shape))
        raise scale_overflow_error(block, scale_dtype, float(scale.reshape(-1)[flat]))
    return stored


def first_scale_off_dtype(scales: np.ndarray, scale_dtype: str):
    """The position of the first float32 scale that `scale_dtype` does not hold
    exactly (between two of its values, or past its range), or None."""
    scales = np.asarray(scales, dtype=np.float32)
    if scale_dtype == "f16":
        with np.errstate(over="ignore"):  # past f16's range is inf, which differs
            back = scales.astype(np.float16).astype(np.float32)
    elif scale_dtype == "bf16":
        back = bf16_bits_to_f32(f32_to_bf16_bits(scales))
    else:
        return None
    off = back.view(np.uint32) != scales.view(np.uint32)
    if not off.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(off)), scales.shape))


# float16 holds scales below 2^-14 in steps of 2^-24; below 16 steps (2^-20, about
# 9.5e-07) rounding up to the next step may enlarge a scale by 1/15 or more.
F16_FEW_STEPS = 2.0 ** -20


def f16_scale_underflow_warning(scales):
    """A ScaleUnderflowWarning for stored float16 `scales` (as float32) below
    F16_FEW_STEPS, or None."""
    scales = np.asarray(scales, dtype=np.float32)
    few = scales < F16_FEW_STEPS
    count = int(np.count_nonzero(few))
    if not count:
        return None
    first = np.unravel_index(int(np.argmax(few)), scales.shape)
    where = f"block {tuple(int(i) for i in first)}, " if scales.ndim else ""
    return ScaleUnderflowWarning(
        f"{count} of {scales.size} float16 scales are below 2^-20 (9.5e-07; the first: {where}"
        f"{np.float32(scales[first])!s}), where float16 has steps of 2^-24 (5.96e-08): rounding a scale up to the "
        f"next step may have enlarged it by 1/15 or more (a scale under 5.96e-08 becomes 5.96e-08), and its "
        f"values keep fewer levels; scale_dtype='bf16' or 'f32' holds such scales to 8 or 24 bits")


def scale_overflow_error(block, scale_dtype, value=None):
    """The error for the scale of `block` (its position in the scale grid), whose
    float32 `value` (when known) `scale_dtype` cannot hold."""
    of = f" ({np.float32(value)!s})" if value is not None else ""  # float32's shortest digits: %g's 6 say 65504
    return ScaleOverflowError(f"The scale of block {block}{of} overflows scale_dtype={scale_dtype!r}: "
                              f"{scale_overflow_advice(scale_dtype)}")


def largest_magnitude(a: np.ndarray) -> float:
    """The largest |value| of a float array: two passes, no temporary."""
    return float(max(a.max(), -a.min()))


def may_pass_float32(largest_scale, qrange):
    """Whether the range's widest value times the largest scale's magnitude is past
    float32's range: only then can a block dequantize to an infinity."""
    lo, hi = qrange
    with np.errstate(over="ignore"):  # overflow is what is looked for
        return bool(np.isinf(np.float32(max(-lo, hi)) * np.float32(largest_scale)))


def first_block_past_float32(scales: np.ndarray, values, shape, qrange, block):
    """The first block (its position in the scale grid) holding a value that,
    times the block's scale, lies past float32's range, where `dequantize` would
    give an infinity, as (position, the value's magnitude, scale); None where
    there is none.  `values` gives the int8 values of `shape` when called: only
    when some scale times the range's widest value overflows, so the common case
    reads the scales alone."""
    grid = np.asarray(scales, dtype=np.float32).reshape(grid_shape(shape, block))
    if not may_pass_float32(largest_magnitude(grid), qrange):
        return None
    with np.errstate(over="ignore"):  # overflow is what is looked for
        q = np.asarray(values())
        blocked = _blocked(np.abs(q.astype(np.int16)), block)  # int16: |-128| fits
        largest = blocked.max(axis=tuple(range(1, blocked.ndim, 2))).reshape(grid.shape)
        past = np.isinf(largest.astype(np.float32) * grid)
    if not past.any():
        return None
    flat = int(np.argmax(past.reshape(-1)))
    position = tuple(int(i) for i in np.unravel_index(flat, grid.shape))
    return position, int(largest[position]), float(grid[position])


def dequantize_overflow_error(found, advice):
    """The error for a block found by first_block_past_float32."""
    position, magnitude, scale = found
    return ScaleOverflowError(
        f"Block {position} dequantizes past float32's range: a value of magnitude {magnitude} times the block's "
        f"scale {np.float32(scale)!s} overflows float32 (its largest is {np.finfo(np.float32).max}), so "
        f"dequantize would give inf there and products with it could differ by backend; {advice}")


def non_finite_error(value, position):
    """The error for a NaN or Inf `value` at `position` in data to quantize."""
    return NonFiniteError(f"Can't quantize a tensor holding {float(value)!r} at position {position}: "
                          f"remove NaN/Inf first (for example np.nan_to_num)")


def scale_overflow_advice(scale_dtype):
    """What to do about a scale too large for `scale_dtype`."""
    if scale_dtype == "f32":  # no wider scale dtype to offer
        return "rescale the input"
    return "use scale_dtype='f32' or rescale the input"


# ---- blocks ------------------------------------------------------------------

def grid_shape(shape, block):
    return tuple(n // b for n, b in zip(shape, block))


# The most dims a numpy array holds: 64 from numpy 2, 32 before.
NUMPY_MAX_DIMS = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32


def _fused(shape, block):
    """The fewest dims that keep every block a rectangle: a dim joins the one
    before it where its blocks span it whole or the one before has blocks of 1,
    so the blocks keep their row-major order (the blocked view takes two a dim)."""
    dims = []
    for n, b in zip(shape, block):
        if dims and (b == n or dims[-1][1] == 1):
            n0, b0 = dims[-1]
            dims[-1] = (n0 * n, b0 * n if b == n else b)
        else:
            dims.append((n, b))
    if 2 * len(dims) > NUMPY_MAX_DIMS:
        raise ShapeError(f"Can't quantize a tensor of shape {tuple(shape)} in blocks of {tuple(block)}: "
                         f"its blocks span {len(dims)} dims, and at most {NUMPY_MAX_DIMS // 2} are supported; "
                         f"reshape it to fewer dims first")
    return dims


def _blocked(x: np.ndarray, block):
    """View x as (g0, b0, g1, b1, ...) so each block is a set of odd axes
    (over the dims `_fused` leaves)."""
    split = []
    for n, b in _fused(x.shape, block):
        split += [n // b, b]
    return x.reshape(split)


def expand_scales(scales: np.ndarray, shape, block) -> np.ndarray:
    """Scales broadcast to the full tensor shape."""
    out = scales
    for axis, b in enumerate(block):
        out = np.repeat(out, b, axis=axis)
    return out.reshape(shape)


def check_finite(x: np.ndarray):
    if not np.all(np.isfinite(x)):
        flat = int(np.flatnonzero(~np.isfinite(x.reshape(-1)))[0])
        raise non_finite_error(x.reshape(-1)[flat], tuple(int(i) for i in np.unravel_index(flat, x.shape)))


def compute_scales(x: np.ndarray, scheme: QuantScheme, block) -> np.ndarray:
    blocked = _blocked(np.abs(x), block)
    amax = blocked.max(axis=tuple(range(1, blocked.ndim, 2))).astype(np.float32)
    amax = amax.reshape(grid_shape(x.shape, block))
    return round_up_to_dtype(float32_scales(amax, scheme.qrange), scheme.scale_dtype)


def float32_scales(amax: np.ndarray, qrange) -> np.ndarray:
    """Each block's float32 scale from its largest magnitude, for values in
    `qrange` (lo, hi), before `scale_dtype`."""
    lo, hi = qrange
    amax = np.asarray(amax, dtype=np.float32)
    # Halving hi-lo is exact, so this is the float32 that (2*amax)/(hi-lo) gives,
    # yet finite where 2*amax would overflow float32.
    scale = amax / np.float32((hi - lo) / 2)
    # A tiny amax can underflow to 0: rounding up gives the smallest subnormal.
    scale = np.where(scale == 0, np.float32(2.0 ** -149), scale)
    return np.where(amax == 0, np.float32(1.0), scale).astype(np.float32)


def block_scale_overflow_error(x, flat, block_shape, qrange, scale_dtype, block):
    """The error for the scale that overflowed in a kernel's 2-D view: `x` [R, C] in
    blocks of `block_shape`, the block at `flat` in its scale grid, `block` that
    block's position in the tensor's own grid.  The kernel reports where; this says
    how large, from the block's values."""
    br, bc = block_shape
    r, c = divmod(flat, x.shape[1] // bc)
    amax = np.abs(np.asarray(x[r * br:(r + 1) * br, c * bc:(c + 1) * bc], dtype=np.float32)).max()
    return scale_overflow_error(block, scale_dtype, float(float32_scales(amax, qrange)))


def quantize_values(x: np.ndarray, scales: np.ndarray, scheme: QuantScheme, block) -> np.ndarray:
    lo, hi = scheme.qrange
    blocked = _blocked(x, block)
    s = scales.reshape([d for g in blocked.shape[::2] for d in (g, 1)])
    q = np.rint(blocked / s)  # float32 / float32: a true IEEE division
    return np.clip(q, lo, hi).astype(np.int8).reshape(x.shape)


def quantize_array(x, scheme: QuantScheme):
    """Quantize a float array: returns (int8 values, float32 scale grid, full block)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    if x.ndim == 0 or x.size == 0:
        raise ShapeError(f"Can't quantize a tensor of shape {x.shape}: it needs at least one dim and one value")
    block = scheme.block_shape(x.shape)
    check_finite(x)
    scales = compute_scales(x, scheme, block)
    return quantize_values(x, scales, scheme, block), scales, block


def dequantize_array(values: np.ndarray, scales: np.ndarray, block) -> np.ndarray:
    # finite: QTensors whose q * scale would overflow are refused when made (first_block_past_float32)
    return values.astype(np.float32) * expand_scales(scales, values.shape, block)


# ---- qq: integer sums per K-group, then the scales ----------------------------

INT32_EXACT_K = 131071  # 131072 * (-128)**2 == 2**31 would overflow int32
# A K-group longer than INT32_EXACT_K is summed from int32 products of pieces this
# long (16-byte bounds for the GPU's copies), added in int64: still exact.
LONG_GROUP_PIECE = 65536


def k_group(lhs_block_k, rhs_block_k):
    """Integer dot products accumulate exactly within groups of this many K
    indices: each group lies inside one scale block of either operand."""
    return math.gcd(int(lhs_block_k), int(rhs_block_k))


def groups_past_int32(lhs_block_k, rhs_block_k):
    """Whether qq's K-groups are too long for exact int32 sums (summed_in_pieces)."""
    return k_group(lhs_block_k, rhs_block_k) > INT32_EXACT_K


def group_scales(scales, block_rows, block_k, rows, K, G, k_axis):
    """Scale of each (row, K-group) pair as a [rows, K/G] float32 array, for a
    scale grid whose K dim is `k_axis` (1 for lhs [M,K], 0 for rhs [K,N])."""
    grid = scales if k_axis == 1 else scales.T
    row_idx = np.arange(rows) // block_rows
    group_idx = (np.arange(K // G) * G) // block_k
    return grid[row_idx][:, group_idx].astype(np.float32)


def qq_in_groups(group_sums, sa, lhs_block, sb, rhs_block, M, K, N):
    """qq's arithmetic: each K-group's exact integer sums (group_sums(k0, k1), [M, N]
    of float64 or int64, exact) rounded to float32 once, times the product of its two
    scales, added in order of K.  sa: lhs's [M/bm, K/bka] grid; sb: rhs's [K/bkb, N/bn]."""
    (bm, bka), (bkb, bn) = lhs_block, rhs_block
    G = k_group(bka, bkb)
    sa_g = group_scales(sa, bm, bka, M, K, G, k_axis=1)      # [M, K/G]
    sb_g = group_scales(sb, bn, bkb, N, K, G, k_axis=0)      # [N, K/G]
    out = np.zeros((M, N), dtype=np.float32)
    # a sum past float32's range is inf (and inf - inf NaN), as on the other
    # backends, without numpy's warnings (errors under `-W error`)
    with np.errstate(invalid="ignore", over="ignore"):
        for g in range(K // G):
            acc = np.asarray(group_sums(g * G, (g + 1) * G)).astype(np.float32)
            out += (sa_g[:, g:g + 1] * sb_g[:, g][None, :]) * acc
    return out


def summed_in_pieces(int_products, k0, k1):
    """The exact sums over K in [k0, k1) as int64, from int_products(s, e): the
    int32 products over [s, e), pieces of at most LONG_GROUP_PIECE values."""
    total = None
    for s in range(k0, k1, LONG_GROUP_PIECE):
        part = np.asarray(int_products(s, min(s + LONG_GROUP_PIECE, k1)), dtype=np.int64)
        total = part if total is None else total + part
    return total


# ---- packed_u32 store --------------------------------------------------------

def pack_u32(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack int8 values along the last dim, 32/bits per uint32, lowest bits first,
    two's complement masked to `bits`.  A ragged last word is zero-padded."""
    per_word = 32 // bits
    n = values.shape[-1]
    words = -(-n // per_word)
    lanes = np.zeros(values.shape[:-1] + (words * per_word,), dtype=np.uint8)
    lanes[..., :n] = values.view(np.uint8) & np.uint8((1 << bits) - 1)
    lanes = lanes.reshape(values.shape[:-1] + (words, per_word))
    # One OR per lane position keeps the temporaries at the size of the output.
    out = lanes[..., 0].astype(np.uint32)
    for i in range(1, per_word):
        out |= lanes[..., i].astype(np.uint32) << np.uint32(bits * i)
    return out


def unpack_u32(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of pack_u32 for a last dim of n values."""
    per_word = 32 // bits
    out = np.empty(words.shape + (per_word,), dtype=np.int8)
    up = np.uint32(8 - bits)
    for i in range(per_word):
        # move the field to the top of a byte, then an arithmetic shift sign-extends it
        field = ((words >> np.uint32(bits * i)) << up).astype(np.uint8).view(np.int8)
        out[..., i] = field >> np.int8(8 - bits)
    return out.reshape(words.shape[:-1] + (-1,))[..., :n]


def stored_columns(values: np.ndarray, columns: np.ndarray, bits: int, packed: bool) -> np.ndarray:
    """Columns `columns` of a 2-D store [R, C] as int8 [R, len(columns)]: for
    packed_u32 only the word that holds each column is read and its field taken, so
    a few columns of a large store cost a few columns' work."""
    if not packed:
        return values[:, columns]
    per_word = 32 // bits
    words = values[:, columns // per_word]
    shift = ((columns % per_word) * bits).astype(np.uint32)
    # the field to the top of the word, then an arithmetic shift sign-extends it
    top = (words >> shift) << np.uint32(32 - bits)
    return (top.view(np.int32) >> np.int32(32 - bits)).astype(np.int8)
