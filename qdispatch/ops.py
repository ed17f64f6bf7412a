"""The arms of q_matmul (qq, fq, qf), int_matmul and linear's bias.

Runs after the dispatcher has checked that the operands share a device: here
shapes, dtypes and schemes are validated (before any kernel runs), batch dims
are broadcast, and each 2-D product goes to the backend's kernel."""
import functools
import itertools
import math

import numpy as np

from ._core import QTensor, Tensor, get_backend
from .errors import ArgumentError, ArgumentTypeError, NonFiniteError, QuantSchemeError, ShapeError
from .quantmath import INT32_EXACT_K, check_finite, groups_past_int32, summed_in_pieces
from .scheme import QuantScheme, as_scheme
from .tensor_api import (DTYPES, FLOAT_DTYPES, check_dtype, float32_payload, in_device_memory, not_int8_error,
                         numpy_of, quantize, quantize_activation, tensor)


def _check_float(t, side):
    if t.dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(f"q_matmul's float {side} must be float32/float16/bfloat16, got {t.dtype}: "
                                f"quantize integer data first")


def _shapes(lhs, rhs, op, names, vectors):
    """(lhs shape, rhs shape, batch dims); `names` are the operands' as `op`'s signature
    gives them, `vectors` says which vectors `op` takes."""
    ls, rs = tuple(lhs.shape), tuple(rhs.shape)
    if len(ls) < 2 or len(rs) < 2:
        raise ShapeError(f"{op} multiplies matrices, batches of them and {vectors}; got shapes {ls} and {rs}")
    if ls[-1] != rs[-2]:
        # the likeliest slip: a weight in nn.Linear's [out, in] layout, given as it is
        hint = (f": {names[1]}.T fits" + (" (or qdispatch.linear(x, w) for a weight stored [out_features, "
                                          "in_features])" if op == "q_matmul" else "")) if ls[-1] == rs[-1] else ""
        raise ShapeError(f"{op} shapes {ls} and {rs} don't fit: {names[0]} has K={ls[-1]} columns but "
                         f"{names[1]} has K={rs[-2]} rows{hint}")
    if len(rs) == 2:  # a plain weight: lhs's batch dims are the batch (the decode case, kept cheap)
        return ls, rs, ls[:-2]
    try:
        batch = np.broadcast_shapes(ls[:-2], rs[:-2])
    except ValueError:
        raise ShapeError(f"{op} batch dims {ls[:-2]} and {rs[:-2]} don't broadcast") from None
    return ls, rs, tuple(batch)


def activation_scheme_for(spec, x_shape, tokens_are_columns=False):
    """`activation_scheme=` as given: a QuantScheme, or a value name meaning one
    scale per token, the usual dynamic-quantization choice: per row of a float lhs,
    per column of a float rhs (x.T in w @ x.T), so a group spans all of K."""
    if isinstance(spec, str):
        # A block of one whole row, not axis=-2: that would give row m of every
        # batch one shared scale, and a large batch would crush the others' rows.
        return _token_scheme(spec, (x_shape[-2], 1) if tokens_are_columns else (1, x_shape[-1]))
    return as_scheme(spec)


@functools.lru_cache(maxsize=256)
def _token_scheme(value, block):
    # once per value and K: checking a scheme costs as much as a decode step's own Python
    store = "native" if as_scheme(value).bits == 8 else "packed_u32"
    return QuantScheme(value, block=block, store=store)


def q_matmul(backend, lhs, rhs, out_dtype, requantize, activation_scheme):
    out_dtype = check_dtype(out_dtype)
    if requantize is not None and out_dtype != "float32":
        raise ArgumentError(f"q_matmul got out_dtype={out_dtype!r} and requantize={requantize!r}: the product is "
                            f"then a QTensor of the requantize scheme, made from float32 sums; leave out_dtype out, "
                            f"or drop requantize for a {out_dtype} result")
    lq, rq = isinstance(lhs, QTensor), isinstance(rhs, QTensor)  # one at least: the caller checked
    if lq and rq and activation_scheme is not None:  # it would quantize nothing, silently
        raise ArgumentError(f"q_matmul got activation_scheme={activation_scheme!r}, but both operands are QTensors "
                            f"already: it quantizes a float operand on the fly; leave it out")
    if not lq:
        _check_float(lhs, "lhs")
    if not rq:
        _check_float(rhs, "rhs")
    lhs, rhs, row, col = _vectors_as_matrices(backend, lhs, rhs)
    for side, t in (("lhs", lhs), ("rhs", rhs)):
        if isinstance(t, QTensor) and len(t.shape) < 2:  # its blocks are laid out for its own shape
            raise ShapeError(f"q_matmul's {side} is a QTensor of shape {tuple(t.shape)}: a QTensor operand needs at "
                             f"least 2 dims (quantize a vector as [1, K] for a row or [K, 1] for a column; float "
                             f"vectors are taken as either)")
    ls, rs, batch = _shapes(lhs, rhs, "q_matmul", ("lhs", "rhs"),
                            "float vectors (a QTensor holds at least 2 dims)")
    fused = None
    # An empty product runs no kernel, so there is nothing to quantize on the fly
    # (and quantize refuses empty data); a scheme that is none is refused all the same.
    if activation_scheme is not None and _is_empty(ls, rs, batch):
        as_scheme(activation_scheme)
    elif activation_scheme is not None:
        try:
            if not lq and rq:
                fused = fused_w8a8(backend, activation_scheme_for(activation_scheme, ls), ls, rhs)
            if fused is None:
                if not lq:
                    lhs = quantize_activation(lhs, activation_scheme_for(activation_scheme, ls))
                if not rq:
                    rhs = quantize_activation(rhs, activation_scheme_for(activation_scheme, rs,
                                                                         tokens_are_columns=True))
                lq = rq = True
        except NonFiniteError as exc:
            raise on_the_fly_error(exc, activation_scheme, _vector_note(row, col, ls, rs)) from None
        except QuantSchemeError as exc:  # its shapes and positions are the matrix's a vector became
            if row or col:
                raise type(exc)(f"{exc}{_vector_note(row, col, ls, rs, positions=False)}") from None
            raise
    kernel_dtype = "float32"  # what the kernel writes
    if fused is not None:
        kernel = lambda x, w: fused(_as_f32(backend, x), w)
    elif lq and rq:
        kernel = backend.qq_matmul
    elif rq:
        # Backends that read 16-bit activations and write 16-bit results directly
        # save a conversion pass on each side (decode steps are that short).
        if requantize is None and out_dtype in backend.fq_dtypes:
            kernel_dtype = out_dtype
        kernel = lambda x, w: backend.fq_matmul(_fq_input(backend, x), w, kernel_dtype)
    else:  # qf: w @ x == (x.T @ w.T).T
        kernel = lambda w, x: backend.transpose2(
            backend.fq_matmul(_as_f32(backend, x, transpose=True), w.T))
    out_shape = batch + (ls[-2], rs[-1])
    try:
        payload = _batched(backend, kernel, lhs, rhs, batch, out_shape, kernel_dtype)
    except NonFiniteError:
        if fused is not None:
            # the fused kernel only says that x holds NaN or Inf: name where, as quantize does
            try:
                check_finite(np.asarray(lhs.numpy(), np.float32))
            except NonFiniteError as exc:
                raise on_the_fly_error(exc, activation_scheme, _vector_note(row, col, ls, rs)) from None
        raise
    if row or col:
        out_shape = _without_vector_dims(out_shape, row, col)
        payload = backend.reshape(payload, out_shape)
    out = Tensor(payload, kernel_dtype, out_shape, lhs.kind, lhs.index)
    if requantize is not None:
        if 0 in out_shape:  # quantize would name itself, not this call
            raise ShapeError(f"q_matmul's product has shape {tuple(out_shape)}, with no values for requantize= to "
                             f"quantize (a QTensor holds at least one): drop requantize for an empty Tensor")
        return quantize(out, requantize)
    if out_dtype != kernel_dtype:
        out = Tensor(backend.cast(out.payload, kernel_dtype, out_dtype), out_dtype, out.shape,
                     out.kind, out.index)
    return out


def _is_empty(ls, rs, batch):
    """Whether a product of these shapes has no output or sums over K = 0."""
    return 0 in batch + (ls[-2], ls[-1], rs[-1])


def on_the_fly_error(exc, activation_scheme, note=""):
    """quantize's NonFiniteError, said of the call that quantized for the caller."""
    return NonFiniteError(f"activation_scheme={activation_scheme!r} quantizes the float operand on the fly (W8A8), "
                          f"which failed: {exc}{note}; a product without activation_scheme (weight-only) keeps a NaN "
                          f"or Inf in the rows it is in")


def _vector_note(row, col, ls, rs, positions=True):
    """What a quantize error's shapes (and positions) mean where a float vector was
    quantized as a one-row (one-column) matrix; empty where none was."""
    if not (row or col):
        return ""
    side, kind, shape, at = ("lhs", "row", ls, "(0, i)") if row else ("rhs", "column", rs, "(i, 0)")
    return f" (the float vector {side} is quantized as the {kind} {tuple(shape)}" + (
        f": position {at} is its value i)" if positions else ")")


def fused_w8a8(backend, scheme, x_shape, w):
    """The backend's one-pass W8A8 kernel when it takes this activation scheme
    (8-bit values, one scale per row or per block of K, float32 scales) and
    weight w's K-groups keep int32 sums exact (longer ones take qq's path)."""
    fused = getattr(backend, "w8a8_matmul", None)
    if fused is None or scheme.bits != 8 or scheme.scale_dtype != "f32":
        return None
    block = scheme.block_shape(x_shape)
    if any(b != 1 for b in block[:-1]):
        return None
    if groups_past_int32(block[-1], w.layout.logical_block(w.transposed)[-2]):
        return None
    return lambda x, w: fused(x, w, scheme.value, block[-1])


def _fq_input(backend, t):
    """x's payload in a dtype the backend's fq kernel reads."""
    return t.payload if t.dtype in backend.fq_dtypes else _as_f32(backend, t)


def _as_f32(backend, t, transpose=False):
    payload = float32_payload(t)
    return backend.transpose2(payload) if transpose else payload


def _batched(backend, kernel, lhs, rhs, batch, out_shape, dtype="float32"):
    """Run a 2-D kernel over broadcast batch dims.  A float lhs against a 2-D
    rhs folds its batch dims into M: one kernel call, one weight pass."""
    if _is_empty(lhs.shape, rhs.shape, batch):  # nothing to run: an empty sum is zero
        return backend.from_host(np.zeros(out_shape, DTYPES[dtype]), lhs.index)
    if not batch:
        return kernel(lhs, rhs)
    if len(rhs.shape) == 2:
        flat = _as_rows(backend, lhs, quantized_rhs=isinstance(rhs, QTensor))
        if flat is not None:
            return backend.reshape(kernel(flat, rhs), out_shape)
    results = (kernel(_batch_item(backend, lhs, idx), _batch_item(backend, rhs, idx))
               for idx in itertools.product(*(range(n) for n in batch)))
    return backend.stack(results, out_shape)  # one at a time into the whole result


def _as_rows(backend, lhs, quantized_rhs):
    """lhs [..., M, K] as one matrix of its rows, sharing its memory, where one product
    gives every row what a product per batch item would: a dense lhs, or a QTensor
    whose scales fold with it times a QTensor (exact integer sums, whatever the rows)."""
    if not isinstance(lhs, QTensor):
        K = lhs.shape[-1]
        rows = math.prod(lhs.shape[:-1])
        return Tensor(backend.reshape(lhs.payload, (rows, K)), lhs.dtype, (rows, K), lhs.kind, lhs.index)
    return backend.qtensor_rows(lhs) if quantized_rhs else None


def _batch_item(backend, t, idx):
    lead = t.shape[:-2]
    idx = idx[len(idx) - len(lead):]
    own = tuple(i if n > 1 else 0 for i, n in zip(idx, lead))
    if isinstance(t, QTensor):
        if not lead:
            return t
        return backend.qtensor_batch(t, own)
    if not lead:
        return t
    return Tensor(backend.index(t.payload, own), t.dtype, t.shape[len(lead):], t.kind, t.index)


def int_matmul(backend, a, b):
    for side, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor) or t.dtype != "int8":
            raise not_int8_error(side, t)
    a, b, row, col = _vectors_as_matrices(backend, a, b)
    ls, rs, batch = _shapes(a, b, "int_matmul", ("a", "b"), "vectors")
    out_shape = batch + (ls[-2], rs[-1])
    if ls[-1] > INT32_EXACT_K:  # past the K whose int32 sums never overflow
        kernel = lambda x, y: _int_matmul_in_pieces(backend, x.payload, y.payload, ls[-1], a.index)
    else:
        kernel = lambda x, y: backend.int_matmul(x.payload, y.payload)
    payload = _batched(backend, kernel, a, b, batch, out_shape, dtype="int32")
    if row or col:
        out_shape = _without_vector_dims(out_shape, row, col)
        payload = backend.reshape(payload, out_shape)
    return Tensor(payload, "int32", out_shape, a.kind, a.index)


def _int_matmul_in_pieces(backend, a, b, K, index):
    """int_matmul of a [M, K] and b [K, N] past int32's exact K: the int32 products
    of pieces of K added in int64, given as int32 where every sum fits it."""
    a_k_first = backend.transpose2(a)
    sums = summed_in_pieces(lambda s, e: backend.to_host(backend.int_matmul(
        backend.transpose2(backend.slice_rows(a_k_first, s, e)), backend.slice_rows(b, s, e))), 0, K)
    past = (sums < np.iinfo(np.int32).min) | (sums > np.iinfo(np.int32).max)
    if past.any():
        at = tuple(int(i) for i in np.unravel_index(int(np.argmax(past)), sums.shape))
        raise ShapeError(f"int_matmul's sum at {at} over K={K} is {int(sums[at])}, past the int32 it returns: "
                         f"split K into parts and add their int32 results in int64")
    return backend.from_host(sums.astype(np.int32), index)


def _vectors_as_matrices(backend, lhs, rhs):
    """(lhs, rhs, row, col): numpy's matmul for a 1-D operand that is data, not a
    QTensor: a vector lhs is one row (`row`), a vector rhs one column (`col`),
    which _without_vector_dims drops from the result again."""
    row = not isinstance(lhs, QTensor) and len(lhs.shape) == 1
    col = not isinstance(rhs, QTensor) and len(rhs.shape) == 1
    if row:
        lhs = Tensor(backend.reshape(lhs.payload, (1,) + lhs.shape), lhs.dtype, (1,) + lhs.shape, lhs.kind, lhs.index)
    if col:
        rhs = Tensor(backend.reshape(rhs.payload, rhs.shape + (1,)), rhs.dtype, rhs.shape + (1,), rhs.kind, rhs.index)
    return lhs, rhs, row, col


def _without_vector_dims(out_shape, row, col):
    return out_shape[:-2] + (() if row else out_shape[-2:-1]) + (() if col else out_shape[-1:])


def _bias_tensor(bias, device):
    """linear's bias as a Tensor (host data go to `device`; a GPU tensor stays on its GPU).  Integer host data are
    numbers to add, so they come as float32: a tensor keeps integers as int8 (the
    dtype int_matmul takes) and refuses those past its range."""
    if isinstance(bias, Tensor):
        return _float_bias(bias)
    data = bias
    if not isinstance(bias, np.ndarray) and hasattr(bias, "__dlpack__"):
        data = numpy_of(bias)  # another library's host tensor (torch's int64, say), as numpy sees it
        if data is None:  # on a GPU (there it stays, for add_bias's device check), or bfloat16
            return _float_bias(tensor(bias, device=None if in_device_memory(bias) else device))
    try:
        integers = np.asarray(data).dtype.kind in "iub"
    except ValueError:  # a ragged list: tensor() says so
        integers = False
    return tensor(data, device=device, dtype="float32" if integers else None)


def _float_bias(b):
    """An integer bias Tensor as float32 on its device, through the host: every backend
    adds it so (the cuda backend's casts take float dtypes only), and it is one row."""
    if b.dtype in ("int8", "int32"):
        return tensor(b.numpy().astype(np.float32), device=b.device)
    return b


def add_bias(out, bias, out_dtype, transfer=None):
    """out + bias, then cast to out_dtype.  A bias on another device follows the
    product there when a transfer policy (argument or context) allows moves."""
    out_dtype = check_dtype(out_dtype)
    from .policy import resolve
    backend = get_backend(out.kind)
    payload = out.payload
    if bias is not None:
        b = _bias_tensor(bias, out.device)
        if b.device != out.device:
            if resolve(transfer) == "error":
                from .errors import BackendMismatchError, DeviceMismatchError
                kind = BackendMismatchError if b.kind != out.kind else DeviceMismatchError
                raise kind(
                    f"linear's bias is on {str(b.device)!r} but the output is on {str(out.device)!r}: "
                    f"move it with bias.to({str(out.device)!r}), or pass transfer='auto'")
            b = b.to(out.device)
        if tuple(b.shape) != (out.shape[-1],):
            raise ShapeError(f"linear's bias must have shape ({out.shape[-1]},), got {tuple(b.shape)}")
        payload = backend.add(payload, _as_f32(backend, b))
    if out_dtype != "float32":
        payload = backend.cast(payload, "float32", out_dtype)
    return Tensor(payload, out_dtype, out.shape, out.kind, out.index)
