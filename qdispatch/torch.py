"""PyTorch interop (optional extra `torch`): quantized weights inside torch models.

    from qdispatch.torch import QLinear, q_matmul

- `q_matmul(x, w)`: `x @ w` for a torch float tensor `x` [..., K] and a 2-D
  QTensor `w` [K, N], as an `autograd.Function`.  float32/float16/bfloat16 run
  on qdispatch's kernels (float32 accumulation) and return x's dtype.
- `QLinear`: a `torch.nn.Module` holding a QTensor weight [out_features,
  in_features] and an optional float bias; `QLinear.from_linear(linear, scheme)`
  quantizes an existing `nn.Linear`.
- `quantize_linears(model, scheme, skip=...)`: every `nn.Linear` of a model
  replaced by a `QLinear`, in place (transformers' Conv1D by a `QConv1D`).
- `QEmbedding` / `quantize_embeddings(model, scheme)`: the same for `nn.Embedding`
  tables, whose lookups dequantize only the rows asked for.
- `save_model(model, path)` / `load_model(model, path)`: a model with QLinears
  and QEmbeddings as one safetensors file (qdispatch's format), nothing pickled.
- `from_torch` / `to_torch`: tensors cross without copies, on CPU (as numpy views)
  and, when qdispatch's cuda backend is built, on CUDA (by pointer in, by DLPack
  out), ordered with torch's current stream.
- Inside `torch.cuda.graph`, `q_matmul`, `QLinear` and `QEmbedding` on CUDA are
  captured: the decode kernel (or the lookup kernel) runs on torch's capturing stream
  into an output torch allocates.  Run each layer once first (its first product lays
  out the weight's tiles).  A captured lookup can't check its ids on the host: an id
  outside the table gives a row of NaN there, where an eager lookup raises.

Gradients flow to the float input only: `dX = dY @ dequantize(W).T`, computed
with the same quantized weight (its free transpose).  The weight is a constant
to autograd, as in Burn: `backward` returns None for it, and `QLinear.weight` is
a QTensor rather than a Parameter, so `parameters()` and optimizers never see
it (it has no `.grad`).  To train a weight, keep it in float (nn.Linear).
The backward is differentiable again (second order), forward-mode AD and
torch.func's transforms (grad, jacrev, jacfwd, jvp, vmap) work through it, and
under torch.autocast x is cast to autocast's dtype, as nn.Linear's is.

float64 inputs (what `torch.autograd.gradcheck` uses) take a float64 path: torch
matmuls against W dequantized in float64, whose products of values and scales
are exact.  Same semantics, no float32 rounding, so finite differences match.

The input must be on the weight's backend: a torch CPU tensor works with a
QTensor on any host backend ('cpu' or 'reference'); anything else raises
`BackendMismatchError`, e.g. a CUDA input with a 'cpu' weight.
"""
import itertools
import os
import sys
import threading
import warnings
import weakref

import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad

from . import policy, quantmath, tensor_api
from ._core import BackendKind, Device, QTensor, Tensor
from ._core import q_matmul as _qd_matmul
from .io import brief, decode_qtensor, encode_qtensor, reading as read_stored, save as save_tensors, stored_shapes
from .backends.host import HostQStorage
from .layout import QLayout, swap_last2
from .errors import (NOT_IN_CUDA_GRAPHS, ArgumentError, ArgumentTypeError, BackendMismatchError,
                     BackendUnavailableError, DeviceMismatchError, KernelError, NonFiniteError, QDispatchError,
                     QuantSchemeError, SerializationError, ShapeError)
from .ops import activation_scheme_for, fused_w8a8, on_the_fly_error
from .scheme import QuantScheme, as_scheme

__all__ = ["q_matmul", "QLinear", "QConv1D", "QMatmul", "quantize_linears", "QEmbedding", "quantize_embeddings",
           "save_model", "load_model",
           "from_torch", "to_torch"]

_KERNEL_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_CUDA_VIEW_DTYPES = {**_KERNEL_DTYPES, torch.int8: "int8", torch.int32: "int32"}
# the float weights a checkpoint may hold for a quantized layer to quantize
_CHECKPOINT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_EMBEDDING_DTYPES = {**_KERNEL_DTYPES, torch.float64: "float64"}  # QEmbedding's outputs, as its state names them
_EMBEDDING_DTYPE_NAMED = {name: dtype for dtype, name in _EMBEDDING_DTYPES.items()}
_NUMPY_VIEW_DTYPES = (torch.float32, torch.float16, torch.int8, torch.int32)  # not bfloat16
# torch's current stream on a GPU as a raw handle (0: the legacy default stream)
_current_raw_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                       or (lambda index: torch.cuda.current_stream(index).cuda_stream))
_cuda_ready = {}  # GPU index -> qdispatch's cuda backend, once it said it can run there


# ---- crossing between torch and qdispatch ------------------------------------------

def from_torch(x, device=None):
    """A qdispatch Tensor sharing x's memory (host memory, or CUDA memory when
    the cuda backend is built).  A CPU tensor is viewed on `device` (default: the
    default backend) where that is a host device, and copied to it where it is a GPU.  A strided
    x (an expanded gradient, say) or a negative view is copied to dense rows first:
    the kernels read rows.  So is a dtype qdispatch does not hold, converted as
    qdispatch.tensor converts numpy data (float64 to float32, other integers to int8)."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"from_torch expects a torch tensor, got {type(x).__name__}: "
                                f"use qdispatch.tensor(...) for other data")
    _check_strided(x, "from_torch")
    return _shared(x, device)


def _shared(x, device):
    """from_torch past its checks (q_matmul has made them on x already)."""
    x = _dense(x)
    if x.is_cpu and x.dtype in _NUMPY_VIEW_DTYPES:  # numpy's view: no DLPack round
        return tensor_api.host_view(x.detach().numpy(), device)
    if x.is_cuda:
        t = _from_torch_cuda(x, _current_raw_stream(x.get_device()))
        return t if device is None else t.to(device)
    if x.is_meta:
        raise BackendUnavailableError("a tensor on torch device 'meta' has no values to share: load or "
                                      "initialize it first (e.g. with load_state_dict or to_empty)")
    return tensor_api.import_dlpack(x.detach(), device=device)


def _check_strided(x, op):
    """Refuse a sparse, mkldnn or nested x: it has no rows of values to read, and
    torch's own errors for one are internal (a nested one's asks to file an issue)."""
    if x.is_nested:
        raise ArgumentTypeError(f"{op} expects a dense torch tensor, got a nested one: pass its tensors one at "
                                f"a time, or pad them with x.to_padded_tensor(0)")
    if x.layout != torch.strided:
        raise ArgumentTypeError(f"{op} expects a dense torch tensor, got layout {x.layout}: convert it with "
                                f"x.to_dense() first")


def _dense(x):
    """x's values in dense rows: the kernels read rows, and the memory of torch's
    negative view (`z.conj().imag`, say) holds its values unnegated."""
    if x.is_neg():
        x = x.resolve_neg()
    return x if x.is_contiguous() else x.contiguous()


def _from_torch_cuda(x, stream):
    """A qdispatch cuda Tensor sharing dense CUDA tensor x's memory, ordered after
    `stream`, torch's current stream on x's GPU (a raw handle).  When that is a side
    stream, x's memory goes back to torch only once our stream has passed our reads
    of it (see `_cuda.view`)."""
    index = x.get_device()
    cuda = _cuda_ready.get(index) or _cuda_backend(index)
    if cuda is not None and x.dtype in _CUDA_VIEW_DTYPES:
        # the pointer directly: DLPack's negotiation costs more than a decode kernel;
        # the view refuses a capturing stream
        return cuda.tensor_viewing(x.data_ptr(), tuple(x.shape), _CUDA_VIEW_DTYPES[x.dtype], index,
                                   x, stream)
    if cuda is not None and _capturing(index, stream):
        # DLPack's import would make our stream wait on the capturing one: invalid there
        raise KernelError(f"torch is capturing a CUDA graph on {x.device}; {NOT_IN_CUDA_GRAPHS}. "
                          f"The capture is left as it was.")
    if cuda is not None:  # a dtype qdispatch does not hold: converted by the host's rules, then copied back
        return _shared(x.detach().cpu(), policy.default_host_device()).to(f"cuda:{index}")
    return tensor_api.import_dlpack(x.detach())


def _cuda_backend(index):
    """qdispatch's cuda backend when it can run on GPU `index`, else None."""
    try:
        _, backend = tensor_api.backend_for(f"cuda:{index}")
    except (BackendUnavailableError, ValueError):
        return None
    _cuda_ready[index] = backend
    return backend


def to_torch(t):
    """A torch tensor sharing the memory of qdispatch Tensor t (a copy where that
    memory is read-only: torch has no read-only tensors)."""
    if not isinstance(t, Tensor):
        hint = ": dequantize it first (t.dequantize())" if isinstance(t, QTensor) else ""
        raise ArgumentTypeError(f"to_torch expects a qdispatch Tensor, got {type(t).__name__}{hint}")
    if not t.device.is_host:
        return _to_torch_cuda(t, _current_raw_stream(t.index))
    if min(t.payload.strides, default=0) < 0:  # torch's DLPack import aborts the process on one
        raise ArgumentError(f"to_torch can't share a Tensor with negative strides {t.payload.strides}: torch "
                            f"tensors have none. Copy it first: to_torch(qdispatch.tensor(t.numpy().copy(), "
                            f"dtype=t.dtype))")
    payload = t.payload
    if not payload.flags.writeable:  # bytes, a read-only mmap: torch's alias would write there, or fault
        payload = payload.copy()
    if t.dtype == "bfloat16":
        # numpy has no bfloat16: the host payload holds its 16-bit patterns
        return torch.from_numpy(payload).view(torch.bfloat16)
    return torch.from_numpy(payload)  # numpy's memory as it is, without DLPack's round


def _to_torch_cuda(t, stream):
    """to_torch of a CUDA Tensor t: a capsule ordered for `stream`, torch's current
    stream on t's GPU (a raw handle; DLPack calls the legacy default stream 1)."""
    return torch.from_dlpack(t.__dlpack__(stream=stream or 1))


def _operand(x, w, stream):
    """x as a qdispatch Tensor next to w, or the mismatch error the dispatcher
    would raise when qdispatch has no backend for x's device.  `stream`: torch's
    current stream on CUDA x's GPU."""
    if x.is_cpu:
        return _shared(x, w.device if w.device.is_host else None)
    reason = f"qdispatch has no backend for torch device {str(x.device)!r}"
    if x.is_cuda:
        try:
            return _from_torch_cuda(_dense(x), stream)
        except BackendUnavailableError as exc:
            reason = str(exc)
    raise _mismatch(x, w, f"({reason})")


def _mismatch(x, w, reason):
    """The error for torch tensor x beside QTensor w on another device, as the
    dispatcher words it, with `reason` (why it can't be moved here) after."""
    lhs, rhs = str(x.device), str(w.device)
    if x.is_meta:  # nothing to move: a meta tensor holds no values, and a QTensor can't go there
        move = "x is on torch's meta device, which holds no values: make it on a device with data"
    else:
        move = f"Move one operand first ({'x.cpu()' if w.device.is_host else f'x.to({rhs!r})'} or w.to({lhs!r}))"
    if x.is_cuda and not w.device.is_host:
        return DeviceMismatchError(f"q_matmul inputs are on different devices of the cuda backend: lhs is on "
                                   f"{lhs!r}, rhs is on {rhs!r}. {move}. {reason}")
    return BackendMismatchError(f"q_matmul inputs are on different backends: lhs is on {lhs!r}, rhs is on "
                                f"{rhs!r}. {move}. {reason}")


def _dequantize_f64(w, device):
    values, scales = tensor_api.qtensor_host(w)
    block = w.layout.logical_block(w.transposed)
    full = quantmath.expand_scales(scales.astype(np.float64), values.shape, block)
    return torch.from_numpy(values.astype(np.float64) * full).to(device)


def _matmul(x, w, act=None):
    """x @ w as a torch tensor of x's dtype (no autograd); `act`: x's activation scheme (W8A8)."""
    if x.dtype == torch.float64:
        return x @ _dequantize_f64(w, x.device)
    if not x.is_cuda:
        y = _cpu_product(x, w, act) if x.is_cpu and w.kind == _CPU_KIND and x.numel() and w.shape[1] else None
        if y is not None:
            return y
        return to_torch(_qd_matmul(_operand(x, w, None), w, out_dtype=_KERNEL_DTYPES[x.dtype],
                                   activation_scheme=act))
    index = x.get_device()
    stream = _current_raw_stream(index)  # looked up once a call: each lookup costs host time
    on_x_gpu = not w.device.is_host and w.device.index == index
    if _capturing(index, stream):
        if not on_x_gpu:  # an eager call would move x or refuse; a graph can't hold the move
            raise _mismatch(x, w, f"torch is capturing a CUDA graph on {x.device}, which can't hold "
                                  f"a move between devices: place the weight on x's GPU before capturing.")
        if act is not None:
            raise KernelError(f"torch is capturing a CUDA graph on {x.device}, and a product with an "
                              f"activation_scheme (W8A8) quantizes x into memory of qdispatch's own, which a "
                              f"graph can't hold: capture layers without one (the weight-only product is)")
        return _matmul_captured(x, w, stream)
    y = _qd_matmul(_operand(x, w, stream), w, out_dtype=_KERNEL_DTYPES[x.dtype], activation_scheme=act)
    return _to_torch_cuda(y, stream) if on_x_gpu else to_torch(y)  # else a transfer policy placed y


def _cpu_product(x, w, act):
    """x @ w for host x (float32, float16 or bfloat16) and a QTensor w on the cpu
    backend: its float32 kernel (fq, or with `act` the one-pass W8A8 kernel) between
    numpy views of torch's memory.  The product `qd.q_matmul` runs, without the two
    qdispatch Tensors around it, which cost more than a small layer's kernel (and a
    bfloat16 x, which numpy can't view, crossed by DLPack: 47.6 against 11-14 us at
    1 x 256 x 256).  Half-precision x widens to float32 exactly, and the sums round
    once to x's dtype, to nearest even, as qdispatch's own casts round them.  None
    where `act` needs more than the one-pass kernel (qd.q_matmul's general route)."""
    K, N = w.shape
    backend = _cpu_backend or _find_cpu_backend()
    if act is None:
        kernel = backend.fq_matmul
    else:  # the scheme as qd.q_matmul reads it for x's shape (a vector's as a row's): its rows fold into one product
        shape = tuple(x.shape) if x.dim() > 1 else (1, K)
        kernel = fused_w8a8(backend, activation_scheme_for(act, shape), shape, w)
        if kernel is None:
            return None
    x32 = _dense(x if x.dtype == torch.float32 else x.float())
    xs = (x32.detach() if x32.requires_grad else x32).numpy()  # each step costs a microsecond at this size
    try:
        out = kernel(xs if xs.ndim == 2 else xs.reshape(-1, K), w)
    except NonFiniteError:
        try:  # the one-pass kernel only says that x holds NaN or Inf: name where, as qd.q_matmul does
            quantmath.check_finite(xs)
        except NonFiniteError as exc:
            raise on_the_fly_error(exc, act) from None
        raise
    y = torch.from_numpy(out if xs.ndim == 2 else out.reshape(*x.shape[:-1], N))
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _cpu_lookup(ids, table, dtype):
    """Rows `ids` (host, any integer dtype) of a table on the cpu backend, as torch
    `dtype`: the kernel qd.embedding runs, between numpy views of torch's memory,
    without qdispatch Tensors around it (8.7 against 13.8 us for one id).  None where
    that kernel does not take the table (rows stored as columns: a transposed one) or
    an id lies outside it: qd.embedding's route then names it."""
    if table.transposed:
        return None
    # the kernel reads int64 ids in one dense run: reshape keeps a strided view (ids[::2],
    # an expand) strided, which contiguous() copies; dense ids it leaves as they are
    flat = (ids if ids.dtype == torch.int64 else ids.long()).reshape(-1).contiguous()
    try:  # the kernel checks every id before it writes a row
        out = (_cpu_backend or _find_cpu_backend()).dequantize_rows(table, flat.numpy(), _KERNEL_DTYPES[dtype])
    except KernelError:
        return None
    rows = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 \
        else torch.from_numpy(out)
    return rows if ids.dim() == 1 else rows.view(*ids.shape, table.shape[1])


def _find_cpu_backend():
    global _cpu_backend
    _, _cpu_backend = tensor_api.backend_for("cpu")
    return _cpu_backend


_CPU_KIND = int(BackendKind.CPU)
_cpu_backend = None  # found on first use: a QTensor is on it only when it is available


def _capturing(index, stream):
    """Whether torch captures a CUDA graph on `stream`, its current stream on GPU
    `index` (never the default stream, 0: torch refuses to capture there).  Asked of
    that stream itself: torch's own query looks at the current GPU's, which need
    not be x's."""
    if stream == 0:
        return False
    backend = _cuda_ready.get(index) or _cuda_backend(index)
    return backend is not None and backend.capturing(stream)


def _matmul_captured(x, w, stream):
    """x @ w while torch captures a CUDA graph: the kernels an eager call runs (the
    decode kernel, or at many rows the GEMM, after x takes a weight's scales per input
    channel; for other weights blocked along K too finely for the decode tiles, the
    float units' kernel), queued on torch's capturing stream,
    reading x in place into an output and temporaries torch allocates there.  Nothing
    crosses, allocates on our side or waits, so the capture holds it.  Eager calls
    keep crossing: a capsule for the output costs less host time than torch.empty."""
    index = x.get_device()
    backend = _cuda_ready.get(index) or _cuda_backend(index)
    call = backend.fq_prepared(w, lay_out=False)
    if call is None:
        raise KernelError(f"torch is capturing a CUDA graph on {x.device}, and this {w.shape} weight has "
                          f"not been multiplied yet: its first product lays out its operands for the "
                          f"kernels, which allocates and synchronizes. Run the model once before capturing "
                          f"(torch's warm-up does).")
    K, N = w.shape
    x2 = _dense(x.detach().reshape(-1, K))
    rows = x2.shape[0]
    out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
    if rows:
        pad = -K % (16 // x2.element_size())
        if pad or x2.data_ptr() % 16:  # the kernels read rows in aligned 16-byte pieces
            x2 = torch.nn.functional.pad(x2, (0, pad)) if pad else x2.clone()
        held = []  # the GEMM's temporaries, from the graph's pool: reused in the stream's order

        def scratch(nbytes):
            held.append(torch.empty(nbytes, dtype=torch.uint8, device=x.device))
            return held[-1].data_ptr()

        backend.fq_matmul_into(call, x2.data_ptr(), _KERNEL_DTYPES[x.dtype], rows, x2.shape[1],
                               out.data_ptr(), stream, scratch)
    return out.view(*x.shape[:-1], N)


def _torch_device(dev):
    """The torch device holding memory of qdispatch device `dev`."""
    return torch.device("cpu") if dev.is_host else torch.device("cuda", dev.index)


_MOVES = weakref.WeakKeyDictionary()  # Module._apply's function -> {id(QTensor): (it, moved)}


def _moved_once(fn, w, move):
    """move() of QTensor w, once for Module._apply's function `fn` (one `.to()`): the
    layers that share w (tied weights) get one moved QTensor, as torch's tied
    parameters stay one tensor."""
    try:
        moved = _MOVES.setdefault(fn, {})
    except TypeError:  # a callable without weak references: nothing to share with
        return move()
    earlier = moved.get(id(w))
    if earlier is None or earlier[0] is not w:
        earlier = moved[id(w)] = (w, move())
    return earlier[1]


def _move_weight(w, target, owner):
    """QTensor w moved to where torch device `target` is (a host weight stays on its
    host backend when the target is the CPU); `owner` names the module in errors."""
    if target.type == "cpu":
        return w if w.device.is_host else w.to(policy.default_host_device())
    if target.type == "cuda":
        return w.to(f"cuda:{target.index}")
    raise BackendUnavailableError(
        f"{owner}'s quantized weight can't move to torch device {str(target)!r}: qdispatch "
        f"has backends for the CPU and CUDA only")


# ---- autograd ------------------------------------------------------------------------

class QMatmul(torch.autograd.Function):
    """`x @ w` with dX = dY @ dequantize(w).T; w (a QTensor) gets no gradient.
    With an activation scheme (W8A8) x is quantized in the forward pass, and the
    derivatives pass through that rounding as if it were the identity (the
    straight-through estimator, as quantization-aware training uses).

    Written for torch.func as well as autograd: the context is set apart from
    forward, the forward-mode derivative is x's tangent @ w (the product is linear
    in x), and a vmapped dim of x moves to the front, where batch dims go."""

    @staticmethod
    def forward(x, w, act=None):
        return _matmul(x, w, act)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w = inputs[:2]
        ctx.w = w  # a QTensor is opaque to autograd: keep it on ctx, not save_for_backward
        ctx.x_device = x.device

    @staticmethod
    def backward(ctx, dy):
        dx = None
        if ctx.needs_input_grad[0]:  # linear in dy too, so differentiable again
            dx = _product(dy, ctx.w.T)  # the free transpose: same quantized weight
            if dx.device != ctx.x_device:  # a transfer policy may have moved the product
                dx = dx.to(ctx.x_device)
        return dx, None, None

    @staticmethod
    def jvp(ctx, dx, _dw, _dact=None):
        return _product(dx, ctx.w)

    @staticmethod
    def vmap(info, in_dims, x, w, act=None):
        x_dim = in_dims[0]
        if x_dim is None:
            return _product(x, w, act), None
        if act is not None and not isinstance(act, str):
            # a scheme's groups may span rows (one scale for all of x): each sample is quantized alone,
            # as it would be without vmap; a value name's groups are single rows, which the batch keeps
            return torch.stack([_product(each, w, act) for each in x.unbind(x_dim)]), 0
        return _product(x.movedim(x_dim, 0), w, act), 0


def q_matmul(x, w, activation_scheme=None):
    """`x @ w` for a torch float tensor x [..., K] and a 2-D QTensor w [K, N].

    Returns a torch tensor [..., N] of x's dtype (float32, float16, bfloat16, or
    float64 on the exact float64 path).  Differentiable in x only; the
    gradient for w is None (QTensors are constants to autograd).

    `activation_scheme` quantizes x on the fly, as `qdispatch.q_matmul`'s does (W8A8
    with an int8 weight): a value name such as "q8s" means one scale per token (row
    of x), a QuantScheme is used as given.  Gradients pass through x's rounding
    unchanged (straight-through).  float64 x takes no activation scheme."""
    _refuse_recording(x)
    if _is_compiling():  # what torch.compile traces: qdispatch's part runs as it is
        return _q_matmul_between_graph_breaks(x, w, activation_scheme)
    return _q_matmul(x, w, activation_scheme)


def matmul_operator(a, b):
    """`a @ b` where one side is a torch tensor and the other a qdispatch tensor
    (the operator's route).  With a 2-D QTensor the result is a torch tensor, through
    autograd: `x @ w` is q_matmul(x, w), `w @ x` its transpose, (x.mT @ w.T).mT (a
    vector x a column).  Anything else is qdispatch.q_matmul's, a qdispatch Tensor."""
    if isinstance(b, QTensor) and len(b.shape) == 2 and isinstance(a, torch.Tensor) and a.dim() >= 1:
        return q_matmul(a, b)
    if isinstance(a, QTensor) and len(a.shape) == 2 and isinstance(b, torch.Tensor) and b.dim() >= 1:
        if b.dim() == 1:
            return q_matmul(b, a.T)
        return q_matmul(b.mT, a.T).mT
    return _qd_matmul(a, b)


def _plus_bias(y, bias):
    """A linear layer's y + bias, in y's dtype (the bias of a bf16 x's product, say)."""
    if bias is None:
        return y
    return y + (bias if bias.dtype == y.dtype else bias.to(y.dtype))  # .to costs a microsecond


def _linear(input, weight, bias=None):
    """F.linear(x, w, bias) with a QTensor weight [out, in], as QLinear computes it."""
    if not isinstance(weight, QTensor) or isinstance(input, QTensor):
        raise _refused("linear", "F.linear takes a QTensor as its weight (a layer's, [out, in]) and a torch tensor x")
    return _plus_bias(q_matmul(input, weight.T), bias)


def _mm(a, b):
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise ShapeError(f"mm multiplies 2-D matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}: "
                         f"torch.matmul (or @) broadcasts")
    return matmul_operator(a, b)


# torch functions that multiply by a QTensor: F.linear(x, layer.weight) and the matmuls
_TORCH_FUNCTIONS = {
    torch.nn.functional.linear: _linear,
    torch.matmul: matmul_operator,
    torch.Tensor.matmul: matmul_operator,
    torch.Tensor.__matmul__: matmul_operator,
    torch.Tensor.__rmatmul__: lambda self, other: matmul_operator(other, self),  # other @ self
    torch.mm: _mm,
    torch.Tensor.mm: _mm,
}


def _refused(name, why=""):
    return ArgumentTypeError(
        f"{name}() got a QTensor, which is not a torch tensor{': ' + why if why else ''}. F.linear(x, w), "
        f"torch.matmul, torch.mm and @ multiply by one (differentiable in x); for other functions use its values "
        f"as a float torch tensor, qdispatch.torch.to_torch(q.dequantize()) (QEmbedding looks rows up)")


def torch_function(func, args, kwargs):
    """A torch function called with a QTensor among its arguments (QTensor's
    __torch_function__): a product where it multiplies by one; any other runs as it
    would without this hook (torch.func's call of QMatmul passes the QTensor on),
    and its TypeError for a QTensor where a tensor goes says what to use."""
    run = _TORCH_FUNCTIONS.get(func)
    if run is not None:
        return run(*args, **kwargs)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    except TypeError as exc:
        if "QTensor" not in str(exc):
            raise
        raise _refused(getattr(func, "__name__", str(func))) from exc


def _q_matmul(x, w, act=None):
    _check_operands(x, w, act)
    if _any_autocast():  # one C call a product; the region's dtype only inside one
        x = _autocast(x)
    return _product(x, w, act)


def _check_operands(x, w, act):
    """q_matmul's errors for operands it can't multiply (each a TypeError or ShapeError)."""
    if not isinstance(x, torch.Tensor):
        if isinstance(x, torch.fx.Proxy):
            raise BackendUnavailableError(_NOT_RECORDED)
        raise ArgumentTypeError(f"qdispatch.torch.q_matmul expects a torch tensor x, got {type(x).__name__}: for "
                                f"numpy data or qdispatch Tensors use qdispatch.q_matmul, which returns a qdispatch "
                                f"Tensor")
    if not isinstance(w, QTensor):
        raise ArgumentTypeError(f"q_matmul expects a QTensor weight, got {type(w).__name__}: quantize it "
                                f"with qdispatch.quantize (quantized weights get no gradient; to train a "
                                f"weight keep it in float)")
    if x.dtype not in _KERNEL_DTYPES and x.dtype != torch.float64:
        raise ArgumentTypeError(f"q_matmul expects a float32/float16/bfloat16/float64 input, got {x.dtype}")
    if act is not None and x.dtype == torch.float64:
        raise ArgumentTypeError("q_matmul got float64 x and an activation_scheme: float64 takes the exact weight-only "
                                "path (for gradcheck); pass float32, float16 or bfloat16 x to quantize it, or leave "
                                "activation_scheme out")
    _check_strided(x, "q_matmul")
    if len(w.shape) != 2:
        raise ShapeError(f"q_matmul expects a 2-D weight [K, N], got shape {w.shape}")
    if x.dim() == 0 or x.shape[-1] != w.shape[0]:
        raise ShapeError(f"q_matmul shapes {tuple(x.shape)} and {w.shape} don't fit: x needs a last "
                         f"dim of K={w.shape[0]}")


def _product(x, w, act=None):
    """x @ w through autograd when something differentiates it, else straight to
    the kernels (autograd's bookkeeping costs microseconds a call)."""
    if (x.requires_grad and torch.is_grad_enabled()) or _transformed():
        return QMatmul.apply(x, w, act)
    return _matmul(x, w, act)


# torch.func's transforms (grad, vmap, jvp) and forward-mode AD wrap x in tensors
# whose data only QMatmul.apply reaches, whether or not x requires grad.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _transformed():
    return _functorch_active() or _forward_ad._current_level >= 0


# Whether any autocast region is open: one C call, where asking for x's device
# type alone costs twice as much.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast(x):
    """x cast as torch.matmul's inputs are in an open autocast region (to the
    region's dtype on x's device; float64 stays)."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4: by device type
        kind = x.device.type
        cast = torch.get_autocast_dtype(kind) if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind) else None
    elif x.is_cuda:
        cast = torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    else:
        cast = torch.get_autocast_cpu_dtype() if x.device.type == "cpu" and torch.is_autocast_cpu_enabled() else None
    return x.to(cast) if cast is not None and x.dtype != cast and x.dtype in _KERNEL_DTYPES else x


# torch.compile can't trace into qdispatch's kernels (Cython, C): it runs this as it
# is, with a graph break on each side, and compiles the rest.  Only while tracing:
# the wrapper costs a few microseconds a call, as much as a decode kernel.
def _between_graph_breaks(fn):
    """fn as torch.compile runs it: outside the graph, saying why where fullgraph=True
    refuses it (torch.compiler.disable's `reason`, where torch takes one)."""
    if not hasattr(torch, "compiler"):
        return fn
    try:
        return torch.compiler.disable(fn, reason="qdispatch's kernels run outside torch, between graph "
                                                 "breaks: compile the model without fullgraph=True")
    except TypeError:
        return torch.compiler.disable(fn)


_q_matmul_between_graph_breaks = _between_graph_breaks(_q_matmul)
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_NOT_RECORDED = ("torch.export, torch.jit.trace, torch.jit.script, torch.fx (make_fx included) and torch.onnx.export "
                 "can't record "
                 "qdispatch's q_matmul (QLinear) or lookups (QEmbedding), nor run them on fake tensors: their "
                 "kernels run outside torch, where a graph can't follow them (a trace would hold this call's "
                 "output as a constant). Run the model "
                 "eagerly, or with torch.compile, which compiles the layers on host tensors as ops of its graph and "
                 "runs other qdispatch calls between graph breaks")
_torch_is_exporting = getattr(getattr(torch, "compiler", None), "is_exporting", lambda: False)


def _is_exporting():
    """Whether torch.export records now.  Dynamo calls this for real (a constant result,
    read when it traces), not by its table of torch's state queries: in some torch
    releases (2.11) that table says is_exporting() under torch.compile too, which
    refused every compiled QLinear and QEmbedding."""
    return _torch_is_exporting()


if hasattr(getattr(torch, "compiler", None), "assume_constant_result"):
    _is_exporting = torch.compiler.assume_constant_result(_is_exporting)
_is_tracing = torch._C._is_tracing  # torch.jit.trace's own check, without its Python wrapper


_MODE_KEYS = getattr(torch._C, "_TorchDispatchModeKey", None)
if _MODE_KEYS is not None:
    _dispatch_mode, _PROXY_MODE, _FAKE_MODE = torch._C._get_dispatch_mode, _MODE_KEYS.PROXY, _MODE_KEYS.FAKE

    def _tracing_mode():
        """Whether make_fx records (a proxy dispatch mode) or fake tensors stand in for
        data (a fake mode): both would run qdispatch's kernels on no values, or keep
        their output as a constant."""
        return _dispatch_mode(_PROXY_MODE) is not None or _dispatch_mode(_FAKE_MODE) is not None
else:
    def _tracing_mode():
        return False


def _refuse_recording(x):
    """BackendUnavailableError where torch records a graph to replay without qdispatch's
    call (export, jit.trace, fx and make_fx) or runs on fake tensors.  Dynamo can't
    trace _is_tracing (with fullgraph=True that failed the compile, with a message that
    named no qdispatch call), so it is asked only outside torch.compile."""
    if _is_exporting() or (not _is_compiling() and (_is_tracing() or isinstance(x, torch.fx.Proxy)
                                                    or _tracing_mode())):
        raise BackendUnavailableError(_NOT_RECORDED)


# ---- nn.Module ---------------------------------------------------------------------------

def _quantized(weight, scheme, device):
    """Torch float tensor `weight` quantized with `scheme` on qdispatch device `device`
    (None: where the weight lives, host weights on the default backend).  A weight on
    torch's meta device (a model built empty, to be loaded) gives zeros in the
    scheme's layout, on `device` or the default backend."""
    if weight.is_meta:
        return tensor_api.qtensor_zeros(tuple(weight.shape), scheme, device=device)
    if weight.dtype == torch.float64:  # narrowed here, so that a value past float32's range is named
        weight = torch.from_numpy(tensor_api.within_float32(weight.cpu().numpy())).to(weight.device)
    host = device is not None and Device.parse(device).is_host
    if host:  # viewed there: the default backend may be another (or unusable, through a bad ISA setting)
        weight = weight.cpu()
    return tensor_api.quantize(from_torch(weight, device if host else None), scheme, device=device)


# Layers that share a QTensor in the model (tied weights) share one after a load too,
# as tied Parameters stay one tensor whatever a checkpoint holds: a layer's new QTensor
# goes to every layer that shared its old one (the last entry loaded wins, as torch's
# copies into one Parameter do).  Layers that do not share one never come to, however
# their entries alias.  What one load_state_dict() call has done is kept for that call
# alone: it is known by its error list, one object passed to every module's load.
_LOADS = threading.local()
_LOADS_KEPT = 64  # loads known at once per thread: loads run from another's hooks keep their own


class _Load:
    """One load_state_dict() call's: the QTensors it read, {key: (weak checkpoint
    tensors, their versions, {id(QTensor): weak QTensor})}; the ids of the layers
    given a sharer's new weight; the layers that found no entry of their own,
    {id(layer): (weak layer, its missing key)}, and those that loaded one,
    {id(layer): (key, entry)}."""

    def __init__(self, error_msgs):
        self.error_msgs, self.reads, self.given, self.without, self.own = error_msgs, {}, set(), {}, {}


def _load_of(error_msgs):
    """The _Load of the load_state_dict() call that passes `error_msgs` to its
    modules, new for a new call."""
    loads = _LOADS.__dict__.setdefault("loads", [])
    for load in loads:
        if load.error_msgs is error_msgs:
            return load
    loads.append(_Load(error_msgs))
    del loads[:-_LOADS_KEPT]
    return loads[-1]


# Which layers hold each QTensor, so that a load replacing one layer's weight reaches
# every layer that shares it, wherever in the model the load starts.
_HOLDERS = {}  # id(QTensor) -> (weak QTensor, weak set of modules)
_HOLDERS_LOCK = threading.Lock()  # a weak set can't be read while another thread adds to it


def _new_holders_lock():
    """A forked child's own lock: one another thread held at the fork stays held there."""
    global _HOLDERS_LOCK
    _HOLDERS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_new_holders_lock)


def _entry_ref(table, obj):
    """A weak reference to obj for table[id(obj)]'s entry, which it heads: the entry
    goes with obj (unless another object's has taken its place)."""
    at = id(obj)

    def gone(ref):
        if at in table and table[at][0] is ref:
            del table[at]
    return weakref.ref(obj, gone)


def _hold(module, weight):
    with _HOLDERS_LOCK:
        entry = _HOLDERS.get(id(weight))
        if entry is None or entry[0]() is not weight:
            entry = _HOLDERS[id(weight)] = (_entry_ref(_HOLDERS, weight), weakref.WeakSet())
        entry[1].add(module)


def _holders(weight, but=None):
    """The modules other than `but` whose weight is `weight` now."""
    with _HOLDERS_LOCK:
        entry = _HOLDERS.get(id(weight))
        if entry is None or entry[0]() is not weight:
            return []
        held = list(entry[1])
    return [m for m in held if m is not but and m.__dict__.get("weight") is weight]


def _read_once(reads, key, tensors, current, read, alike=lambda earlier, now: earlier is now):
    """read(), or `current` where this load read it under `key` from checkpoint
    tensors `alike` these (the entry of a tied layer loaded before this one, which
    passed it on); reads None: no load to remember."""
    if reads is None:
        return read()
    versions = tuple(t._version for t in tensors)  # a hook may have changed them in place since
    hit = reads.get(key)
    if hit is None or hit[1] != versions or not all(alike(ref(), t) for ref, t in zip(hit[0], tensors)):
        hit = reads[key] = (tuple(weakref.ref(t) for t in tensors), versions, {})
    elif id(current) in hit[2] and hit[2][id(current)]() is current:
        return current
    weight = read()
    hit[2][id(weight)] = weakref.ref(weight)  # one key may feed several untied layers, each its own
    return weight


def _view_of(t):
    """Where tensor t's values lie: two tensors alike here are views of the same values."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, str(t.device)


def _same_entry(a, b):
    """Whether two checkpoint entries are one weight under two names: one tensor (or
    views alike of one storage), or extra states of such tensors."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _view_of(a) == _view_of(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return all(_same_entry(a.get(k), b.get(k)) for k in ("qvalues", "qscales"))
    return False


def _quantized_from_checkpoint(weight, scheme, device, current, reads):
    """_quantized(weight, scheme, device), or `current` where this load quantized it
    from the same float weight (views of one storage) for a tied layer before."""
    key = ("float", *_view_of(weight), scheme, str(device))
    # another view of one storage is alike while the first lives: no other tensor has its address then
    return _read_once(reads, key, (weight,), current, lambda: _quantized(weight.detach(), scheme, device),
                      alike=lambda earlier, now: earlier is not None)


# The extra state's format: 2 holds the values and scales as qdispatch.save stores
# them (packed words as int32, 16-bit scales as float16/bfloat16), with the shape;
# 1 (no "format" key, still read) held int8 values and float32 scales.
_STATE_FORMAT = 2
_FORMAT_1_DTYPES = (torch.int8, torch.float32)  # its values and scales, whatever the scheme stores
# the torch dtypes of stored parts; uint32 words and bf16 bits go as int32 and bfloat16
_STORED_DTYPES = {"packed_u32": torch.int32, "int8": torch.int8,
                  "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _stored_dtypes(scheme):
    """The torch dtypes of a weight's stored values and scales in its extra state."""
    return (_STORED_DTYPES["packed_u32" if scheme.store == "packed_u32" else "int8"],
            _STORED_DTYPES[scheme.scale_dtype])


def _to_torch_stored(a, held):
    """A stored part as a torch tensor: a copy where it shares memory with `held` (a
    host weight's storage arrays, which an edit of the state dict must not reach),
    else the fresh array itself (packed words, converted scales: no second copy)."""
    make = torch.tensor if any(np.may_share_memory(a, h) for h in held) else torch.from_numpy
    if a.dtype == np.uint32:
        return make(a.view(np.int32))
    if a.dtype == np.uint16:  # bfloat16 bits
        return make(a.view(np.int16)).view(torch.bfloat16)
    return make(a)


def _from_torch_stored(t):
    """A stored part as numpy (its own copy, on the host), as io.decode_qtensor reads it."""
    t = t.detach().to("cpu", copy=True)
    if t.dtype == torch.int32:
        return t.numpy().view(np.uint32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _stored_weight(w, on_meta=False):
    """QTensor w as a QLinear's extra state: its values and scales as qdispatch
    stores them, as torch tensors (`on_meta`: tensors without values, of their
    dtypes and shapes), its scheme, shape and orientation as plain values."""
    scheme = w.layout.scheme
    if on_meta:
        values, scales = (torch.empty(shape, dtype=dtype, device="meta")
                          for shape, dtype in zip(stored_shapes(scheme, w.layout), _stored_dtypes(scheme)))
    else:
        held = () if not isinstance(w.storage, HostQStorage) else \
            (w.storage.scales,) + ((w.storage.values,) if w.storage.holds_values else ())  # not read back for this
        values, scales = (_to_torch_stored(part, held)
                          for part in encode_qtensor("weight", w, op="put in a state_dict"))
    return {"format": _STATE_FORMAT, "qvalues": values, "qscales": scales,
            "scheme": scheme.to_record(), "shape": list(w.shape), "transposed": bool(w.transposed)}


# state_dict() and load_state_dict() keep a shared weight shared.  One state_dict()
# call puts one extra state dict under the name of each layer that shares a QTensor,
# so torch.save pickles it once and torch.load gives one dict back; a load then meets
# the same tensors under each name and gives them one QTensor.  The state is found
# where the call put it first: under that layer's name in its destination.
# Per thread: .asking, (layer, destination, key) of the layer whose state_dict() runs;
# .written, {id(QTensor): (weak QTensor, id(destination), key, weak "qvalues", weak
# "qscales", versions)}.
_SAVING = threading.local()


def _versions(state):
    return state["qvalues"]._version, state["qscales"]._version


def _stored_weight_once(w, destination, key):
    """_stored_weight(w), or the state of w the state_dict() call filling `destination`
    put there already, under another layer's name (a tied weight); `key` is this
    layer's name for it.  The layer that put it there asking again is a new call."""
    written = _SAVING.__dict__.setdefault("written", {})
    entry = written.get(id(w))
    if entry is not None and entry[0]() is w and entry[1] == id(destination) and entry[2] != key:
        earlier = destination.get(entry[2])
        if (isinstance(earlier, dict) and earlier.get("qvalues") is entry[3]() and earlier.get("qscales") is entry[4]()
                and _versions(earlier) == entry[5]):
            return earlier  # as this call put it there: the same tensors, unchanged
    state = _stored_weight(w)
    written[id(w)] = (_entry_ref(written, w), id(destination), key, weakref.ref(state["qvalues"]),
                      weakref.ref(state["qscales"]), _versions(state))
    return state


def _check_stored_weight(state, owner):
    """Refuse an extra state that is not what _stored_weight writes (a checkpoint of
    another format, say), before its parts are read; `owner` names the module."""
    if not (isinstance(state, dict) and isinstance(state.get("scheme"), dict) and isinstance(state.get("transposed"), bool)
            and all(isinstance(state.get(key), torch.Tensor) for key in ("qvalues", "qscales"))
            and ("format" not in state or (state["format"] == _STATE_FORMAT and isinstance(state.get("shape"), list)))):
        got = ({key: type(value).__name__ for key, value in state.items()} if isinstance(state, dict)
               else type(state).__name__)
        raise SerializationError(f"a {owner}'s _extra_state is a dict of tensors 'qvalues' and 'qscales', a "
                                 f"'scheme' record, a 'shape' list, a 'transposed' flag and 'format' "
                                 f"{_STATE_FORMAT}, as state_dict() writes it; got {got}")


def _weight_from_state(state, owner, device, read=True):
    """The QTensor of extra state `state` (either format) on `device`; the QTensor
    keeps arrays of its own, and the state dict's tensors stay the caller's.
    Without `read`: zeros of the state's shape and scheme, its tensors unread."""
    try:
        scheme = QuantScheme.from_record(state["scheme"])
    except (TypeError, ValueError) as exc:  # a record of unknown fields or values
        raise SerializationError(f"a {owner}'s _extra_state holds no scheme qdispatch reads "
                                 f"({brief(state['scheme'])}): {exc}") from None
    transposed, values, scales = state["transposed"], state["qvalues"], state["qscales"]
    if "format" not in state:  # format 1: int8 values and float32 scales, in storage orientation
        stored = tuple(values.shape)
    else:
        stored = swap_last2(tuple(state["shape"])) if transposed else tuple(state["shape"])
    if not read:
        zeros = tensor_api.qtensor_zeros(stored, scheme, device=device)
        return zeros.T if transposed else zeros
    if "format" not in state:
        # a current state that lost its key (packed words, 16-bit scales) would read as other values
        _check_parts(state, owner, "without a 'format' (the earlier format)", _FORMAT_1_DTYPES,
                     hint="; a state_dict() of this release holds 'format': 2 beside its parts: restore it")
        return tensor_api.qtensor_from_stored(_from_torch_stored(values), _from_torch_stored(scales), scheme,
                                              transposed, device=device)
    layout = QLayout.for_shape(scheme, stored)
    _check_parts(state, owner, f"of a {tuple(state['shape'])} weight of scheme {scheme}", _stored_dtypes(scheme),
                 stored_shapes(scheme, layout))
    values, scales = decode_qtensor(owner, _from_torch_stored(values), _from_torch_stored(scales), scheme, layout)
    return tensor_api.qtensor_from_stored(values, scales, scheme, transposed, device=device)


def _check_parts(state, owner, what, dtypes, shapes=(None, None), hint=""):
    """SerializationError unless extra state `state`'s 'qvalues' and 'qscales' are
    tensors of `dtypes` (and `shapes`, where given); `what` says which weight the
    state holds, `hint` how to mend it."""
    for part, dtype, shape in zip(("qvalues", "qscales"), dtypes, shapes):
        tensor = state[part]
        if tensor.dtype != dtype or shape not in (None, tuple(tensor.shape)):
            wanted = f"a {dtype} tensor" + ("" if shape is None else f" of shape {shape}")
            raise SerializationError(f"a {owner}'s _extra_state {part!r} {what} is {wanted}; got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}{hint}")


# ---- QLinear and QEmbedding inside torch.compile's graphs ---------------------------------
# On the CPU torch.compile keeps a QLinear's product and a QEmbedding's lookup in its
# graph, as custom ops that name the layer by a number (a graph holds tensors and
# numbers, not QTensors); an op runs the layer's eager call.  So a model compiles
# whole (fullgraph=True works) and the code around the layers is compiled with them.
# CUDA inputs still run between graph breaks: the decode kernels' stream handling has
# not been taught to inductor's graphs.

_OP_LAYERS = weakref.WeakValueDictionary()  # handle -> QLinear or QEmbedding
_op_handles = itertools.count(1)
# A number for each weight a layer is given.  The graph's backward finds the layer by
# its handle, not the weight its forward used (eager calls keep that weight): the
# forward's number, passed along as a tensor, lets the backward refuse a weight
# replaced in between rather than take its gradient from other values.
_weight_versions = itertools.count(1)


def _take_op_handle(module):
    module._op_handle = next(_op_handles)
    _OP_LAYERS[module._op_handle] = module


def _op_layer(handle):
    layer = _OP_LAYERS.get(handle)
    if layer is None:
        raise KernelError("a compiled graph ran a QLinear or QEmbedding that no longer exists: compile the "
                          "model again")
    return layer


def _in_graph(layer, x):
    """Whether torch.compile keeps `layer`'s call on x in its graph: a CPU x and the
    custom-op API (torch >= 2.4); not while torch.export records (a program it saves
    would name a layer of this process)."""
    return (_ops_defined and isinstance(x, torch.Tensor) and x.device.type == "cpu"
            and not _is_exporting() and getattr(layer, "_op_handle", None) is not None)


def _define_ops():
    """Whether the custom ops are defined (torch >= 2.4)."""
    if not hasattr(torch.library, "custom_op"):
        return False

    @torch.library.custom_op("qdispatch::qlinear", mutates_args=())
    def qlinear(x: torch.Tensor, handle: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The product, and the number of the weight it used (see _weight_versions)."""
        layer = _op_layer(handle)
        w, act, version = layer.weight.T, layer.activation_scheme, layer._weight_version

        def product():  # the eager call's checks, then its product without autograd (the op's backward is below)
            layer._refuse_unloaded()
            _check_operands(x, w, act)
            return _matmul(x, w, act)
        return layer._named_errors(x, product), torch.tensor(version, dtype=torch.int64)

    @qlinear.register_fake
    def _(x, handle):  # the product's shape and dtype; x the layer can't take raises when the graph runs,
        return (x.new_empty((*x.shape[:-1], _op_layer(handle).out_features)),  # the eager call's error
                x.new_empty((), dtype=torch.int64))

    @torch.library.custom_op("qdispatch::qlinear_input_grad", mutates_args=())
    def qlinear_input_grad(dy: torch.Tensor, handle: int, version: torch.Tensor) -> torch.Tensor:
        layer = _op_layer(handle)
        if layer._weight_version != int(version):
            raise KernelError(f"this {type(layer).__name__}'s weight was replaced between a compiled forward "
                              f"and its backward, which would take the gradient from the new weight: run "
                              f"backward() before replacing the weight (or loading a checkpoint), or run the "
                              f"layer uncompiled, whose backward keeps the forward's weight")
        return _matmul(dy, layer.weight)

    @qlinear_input_grad.register_fake
    def _(dy, handle, version):
        return dy.new_empty((*dy.shape[:-1], _op_layer(handle).in_features))

    def setup_context(ctx, inputs, output):
        ctx.handle = inputs[1]
        ctx.save_for_backward(output[1])

    def backward(ctx, dy, _):  # dX = dY @ dequantize(W), as QMatmul's; the weight takes none
        version, = ctx.saved_tensors
        return torch.ops.qdispatch.qlinear_input_grad(dy, ctx.handle, version), None

    qlinear.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op("qdispatch::qembedding", mutates_args=())
    def qembedding(ids: torch.Tensor, handle: int) -> torch.Tensor:  # rows take no gradient
        layer = _op_layer(handle)
        layer._check_ids(ids)  # the eager call's checks, as QLinear's op makes them
        return layer._lookup(ids)

    @qembedding.register_fake
    def _(ids, handle):
        layer = _op_layer(handle)
        return ids.new_empty((*ids.shape, layer.embedding_dim), dtype=layer.dtype)
    return True


class _QuantizedModule(torch.nn.Module):
    """What QLinear and QEmbedding share: a 2-D QTensor `weight` that moves with the
    module (`Module.to()`, `.cuda()`, `.cpu()`; a dtype change leaves it as it is),
    and that `state_dict()` holds as its stored values and scales (`_extra_state`),
    so torch.save / load_state_dict restore it bit for bit.  A float checkpoint's
    "weight" is quantized into the module's scheme as it loads."""

    # The float weight this one was quantized from: a weak reference to it and its
    # version counter then (an in-place change since, a load say, bumps it).
    _source = None
    # The zeros a layer on torch's meta device was given, until a checkpoint replaces
    # them: a call before that would compute with values no one gave it.
    _unloaded = None
    _weight_version = 0  # set with each weight (see _weight_versions); a pickle of an older release has none

    def __init__(self, weight, dims, made_by):
        """weight: a 2-D QTensor [dims]; `made_by` says how one quantizes a float layer."""
        super().__init__()
        name = type(self).__name__
        if not isinstance(weight, QTensor):
            sized = ""
            if isinstance(weight, int):  # sizes, as torch's layers take them
                float_kind = self._float_name()
                sized = (f"; for an empty layer of given sizes, to load a checkpoint into, quantize {_a(float_kind)} "
                         f"built on torch's meta device ({float_kind}(..., device='meta'))")
            raise ArgumentTypeError(f"{name} needs a QTensor weight, got {type(weight).__name__}: use {made_by}{sized}")
        if len(weight.shape) != 2:
            raise ShapeError(f"{name} needs a 2-D weight [{dims}], got {weight.shape}")
        self.weight = weight
        _take_op_handle(self)

    _float_kind = _made_by = None  # the float layer this class replaces, and the classmethod that does
    _dims = ()  # the attributes that hold the weight's shape
    # A float layer's weight holds this layer's transposed ([in, out]: transformers' Conv1D)
    _float_transposed = False

    @classmethod
    def _float_name(cls):
        return f"nn.{cls._float_kind.__name__}"

    @classmethod
    def _takes(cls, layer):
        """Whether `layer` is a float layer of the kind this class replaces."""
        return isinstance(layer, cls._float_kind)

    @classmethod
    def _float_weight(cls, weight):
        """A float layer's (or checkpoint's) weight as this layer holds it."""
        return weight.T if cls._float_transposed else weight

    @classmethod
    def _class_for(cls, layer):
        """The class of this kind that replaces float `layer`."""
        return cls

    @classmethod
    def _check_layer(cls, layer):
        if not cls._takes(layer):
            other = QLinear._class_for(layer)  # a Conv1D given to QLinear, say
            instead = f": use {other.__name__}.{other._made_by}" if other._takes(layer) and other is not cls else ""
            raise ArgumentTypeError(f"{cls.__name__}.{cls._made_by} needs {_a(cls._float_name())}, got "
                                    f"{type(layer).__name__}{instead}")
        for hook in layer._forward_pre_hooks.values():
            remove = _WEIGHT_REBUILDING_HOOKS.get(type(hook).__name__)
            if remove and type(hook).__module__.startswith("torch.nn.utils"):
                # the hook, carried over, would rebuild the float weight from parameters the layer no longer has
                raise ArgumentError(f"{cls.__name__} can't take a layer under torch.nn.utils.{remove[0]}: fold it "
                                    f"into the weight first with torch.nn.utils.{remove[1]}(layer) (layers under "
                                    f"torch.nn.utils.parametrizations.{remove[0]} quantize as they are)")

    @classmethod
    def _quantize(cls, layer, scheme, device, weight=None, options=None):
        """A module of this class in place of float `layer`, its weight quantized with
        `scheme` on `device`, or `weight` (a QTensor quantized so already: a tied one);
        `options`: the class's own keyword arguments."""
        cls._check_layer(layer)
        if weight is None:
            weight = _quantized(cls._float_weight(layer.weight.detach()), scheme, device)
        module = cls._around(layer, weight, **(options or {}))
        _carry_hooks(layer, module)
        if not cls._float_transposed:  # a float weight another layer may share (ties hold no transposed ones)
            module._source = (weakref.ref(layer.weight), layer.weight._version)
        if layer.weight.is_meta:
            module._unloaded = module.weight
        return module

    @property
    def scheme(self):
        """The weight's QuantScheme (the one the repr shows)."""
        return self.weight.scheme

    def __prepare_scriptable__(self):
        # torch.jit.script asks this of every module before it compiles one; it said only
        # that it could not convert a QTensor
        raise BackendUnavailableError(_NOT_RECORDED)

    @property
    def _holds_no_values(self):
        """Made from a layer on torch's meta device, and not loaded since."""
        return self.weight is self._unloaded

    def _refuse_unloaded(self):
        if self._holds_no_values:
            raise BackendUnavailableError(
                f"this {type(self).__name__} was made from a layer on torch's meta device and holds no "
                f"values until a checkpoint loads: call model.load_state_dict(state, assign=True) or "
                f"qdispatch.torch.load_model(model, path) before running it")

    def __setattr__(self, name, value):
        if name == "weight":
            self._check_weight(value)
        super().__setattr__(name, value)
        if name == "weight" and isinstance(value, QTensor):
            _hold(self, value)
            super().__setattr__("_weight_version", next(_weight_versions))

    def _check_weight(self, value):
        """Once the layer is made (its sizes set), its weight stays a QTensor of its shape."""
        dims = tuple(self.__dict__.get(dim) for dim in self._dims)
        if None in dims:  # __init__, before the sizes
            return
        if not isinstance(value, QTensor):
            raise ArgumentTypeError(f"{type(self).__name__}.weight must be a QTensor, got {type(value).__name__}: "
                                    f"quantize "
                                    f"it with qdispatch.quantize (or keep the float layer)")
        if tuple(value.shape) != dims:
            raise ShapeError(f"{type(self).__name__}.weight must have shape {dims} "
                             f"({', '.join(self._dims)}), got {value.shape}: make a new layer for another shape")

    def __getstate__(self):
        state = dict(self.__dict__)  # a weak reference can't be pickled: a copy starts untied
        state.pop("_source", None)
        state.pop("_op_handle", None)  # the original's: a copy takes its own
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        _hold(self, self.weight)  # a copy's layers that share a weight know it, as the original's did
        _take_op_handle(self)

    def _moved(self, probe):
        """Told where Module.to() sends tensors: `probe`, an empty tensor of the
        module's float dtype on its weight's device, as the move left it."""

    def _apply(self, fn, *args, **kwargs):
        # Module.to/.cuda()/.cpu() pass a function of each tensor: run it on an empty
        # probe where the weight lives to learn where tensors go.  The weight moves
        # first, so a refused move leaves the module as it was.
        probe = fn(torch.empty(0, dtype=getattr(self, "dtype", torch.float32),
                               device=_torch_device(self.weight.device)))
        weight = _moved_once(fn, self.weight, lambda: _move_weight(self.weight, probe.device, type(self).__name__))
        super()._apply(fn, *args, **kwargs)
        if self.weight is self._unloaded:
            self._unloaded = weight
        version = self._weight_version
        self.weight = weight
        self._weight_version = version  # the same values, moved
        self._moved(probe)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        outer = getattr(_SAVING, "asking", None)
        _SAVING.asking = (self, destination, prefix + "_extra_state")  # for get_extra_state: which call asks
        try:
            super()._save_to_state_dict(destination, prefix, keep_vars)
        finally:
            _SAVING.asking = outer

    def get_extra_state(self):
        # The quantized weight in state_dict(), as torch tensors and plain values, so
        # that torch.save, torch.load(weights_only=True) and load_state_dict carry it.
        # torch.onnx's TorchScript exporter reads the state dict first, taking every value
        # for a tensor: refused here, before it fails on this dict in its own words.
        onnx = sys.modules.get("torch.onnx")  # not imported: no export runs
        if onnx is not None and onnx.is_in_onnx_export():
            raise BackendUnavailableError(_NOT_RECORDED)
        if self.weight is self._unloaded:  # no values yet: as torch gives a meta parameter's
            return _stored_weight(self.weight, on_meta=True)
        asking = getattr(_SAVING, "asking", None)
        if asking is None or asking[0] is not self:  # called on its own
            return _stored_weight(self.weight)
        return _stored_weight_once(self.weight, *asking[1:])

    def _placeholder(self, zeros):
        """This layer without values: `zeros` that refuse to run, what a checkpoint of
        meta tensors loads."""
        self.weight, self._unloaded, self._source = zeros, zeros, None

    def _takes_no_values(self, assign):
        """Whether a checkpoint of meta tensors may load here: into a layer that has no
        values either, or by assign=True, which replaces what it holds as torch would."""
        return assign or self.weight is self._unloaded

    def _no_values_message(self, key):
        # torch's load of a meta tensor into a parameter with values fails the same way
        return (f"Cannot load {key}: it holds meta tensors, with no values to copy into this "
                f"{type(self).__name__}'s weight (load_state_dict(..., assign=True) would replace the weight "
                f"with one that has none)")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        load, before, outer = _load_of(error_msgs), self.weight, getattr(_LOADS, "active", None)
        assign = local_metadata.get("assign_to_params_buffers", False)
        _LOADS.active = (self, load, prefix + "_extra_state", assign)  # for set_extra_state, which torch calls
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        except QDispatchError as exc:  # set_extra_state's: say which layer's, as torch names a parameter
            raise type(exc)(f"{prefix}_extra_state: {exc}") from exc
        finally:
            _LOADS.active = outer
        weight_key, state_key = prefix + "weight", prefix + "_extra_state"
        if state_key not in state_dict and weight_key in state_dict:
            load.own[id(self)] = (weight_key, state_dict[weight_key])
            self._load_float(state_dict[weight_key], weight_key, state_key, local_metadata, missing_keys,
                             unexpected_keys, error_msgs, load)
        elif state_key in state_dict:
            load.own[id(self)] = (state_key, state_dict[state_key])
        else:  # nothing of its own: a tied weight named under another layer's name
            if id(self) in load.given:  # given it already, by that layer
                if state_key in missing_keys:
                    missing_keys.remove(state_key)
            else:
                load.without[id(self)] = (weakref.ref(self), state_key)
            return
        if self.weight is not before:
            self._pass_on(before, load, missing_keys)
        if not assign and self.weight is not self._unloaded and \
                any(p.is_meta for p in self.parameters(recurse=False)):
            # torch copies nothing into a meta Parameter (it warns): the layer would run with values
            # in its weight and none in its bias
            error_msgs.append(f"Cannot load {prefix}bias: this {type(self).__name__} was made on torch's meta "
                              f"device, and a load without assign=True copies nothing into its meta bias: "
                              f"load with load_state_dict(..., assign=True) or qdispatch.torch.load_model")

    def _pass_on(self, old, load, missing_keys):
        """This layer's new weight to the layers that shared `old`, as torch's copy into
        one shared Parameter reaches them all; those found wanting earlier in this load
        (a checkpoint naming a tied weight once) are not missing."""
        for other in _holders(old, but=self):
            (key, entry), earlier = load.own[id(self)], load.own.get(id(other))
            if earlier is not None and not _same_entry(earlier[1], entry):  # its own weight gives way: say so
                warnings.warn(f"{earlier[0]} and {key} hold different weights, but the two layers share one "
                              f"quantized weight here (tied, as the model that was quantized tied them): both now "
                              f"use the one loaded last, {key}. To keep both, untie the layers before quantizing "
                              f"the model, as the checkpoint's model had them", stacklevel=2)
            other.weight, other._source, other._unloaded = self.weight, self._source, self._unloaded
            load.given.add(id(other))
            earlier = load.without.pop(id(other), None)
            if earlier is not None and earlier[0]() is other and earlier[1] in missing_keys:
                missing_keys.remove(earlier[1])

    def _load_float(self, weight, weight_key, state_key, local_metadata, missing_keys, unexpected_keys, error_msgs,
                    load):
        """A float checkpoint's weight (an nn.Linear's or nn.Embedding's "weight"),
        quantized into this module's scheme as it loads, so a model built empty never
        holds all its float weights."""
        for keys, key in ((unexpected_keys, weight_key), (missing_keys, state_key)):
            if key in keys:
                keys.remove(key)
        if not isinstance(weight, torch.Tensor) or weight.dtype not in _CHECKPOINT_DTYPES:
            got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ArgumentTypeError(f"{weight_key}: a float checkpoint's weight is a float32, float16, bfloat16 or "
                                    f"float64 torch tensor, got {got} (a quantized checkpoint holds {state_key}; a "
                                    f"QTensor goes in as `layer.weight = qtensor`)")
        wanted = self.weight.shape[::-1] if self._float_transposed else self.weight.shape  # the float layer's
        if tuple(weight.shape) != wanted:
            error_msgs.append(f"size mismatch for {weight_key}: a float weight of shape {tuple(weight.shape)}, "
                              f"but this {type(self).__name__}'s is {tuple(wanted)}")
            return
        weight = self._float_weight(weight)
        if weight.is_meta:  # no values: the layer holds none either
            if not self._takes_no_values(local_metadata.get("assign_to_params_buffers", False)):
                return error_msgs.append(self._no_values_message(weight_key))
            self._placeholder(tensor_api.qtensor_zeros(self.weight.shape, self.weight.scheme,
                                                       device=self.weight.device))
        else:
            try:
                self.weight = _quantized_from_checkpoint(weight, self.weight.scheme, self.weight.device, self.weight,
                                                         load.reads)
            except QDispatchError as exc:  # a NaN or an overflowing scale: say which layer's
                raise type(exc)(f"{weight_key}: {exc}") from exc
            self._source = self._unloaded = None  # no longer the float weight's values, nor zeros
        if local_metadata.get("assign_to_params_buffers", False):
            self._moved(weight)  # assign=True: the float dtype follows the checkpoint's, as a Parameter's would

    def set_extra_state(self, state):
        # As load_state_dict copies into parameters where they are, the weight
        # lands on the device of the weight it replaces.
        active = getattr(_LOADS, "active", None)
        # a hook's call on a layer outside the load is that layer's own call, which takes
        # what it is given, as assign=True does
        load, own_key, assign = active[1:] if active is not None and active[0] is self else (None, None, True)
        dtype = self._dtype_in_state(state)  # a bad one is refused before the layer changes
        # a layer made on meta holds no dtype of its own yet: it takes the checkpoint's, as
        # assign=True gives it (a model of quantized layers alone has no meta tensor to ask for it)
        takes_dtype = assign or self._holds_no_values
        if isinstance(state, _WeightInFile):  # load_model: read from the file as this layer loads
            weight = state.read(self.weight.device)
            if weight is not self.weight and _holders(weight):  # an alias of another layer's, not tied here
                weight = state.read(self.weight.device, shared=False)
        else:
            _check_stored_weight(state, type(self).__name__)
            if state["qvalues"].is_meta or state["qscales"].is_meta:  # a layer's that had no values
                weight = _weight_from_state(state, type(self).__name__, self.weight.device, read=False)
                if weight.shape == self.weight.shape:
                    if not self._takes_no_values(assign):  # reported with the rest, as torch reports it
                        return load.error_msgs.append(self._no_values_message(own_key))
                    self._placeholder(weight)
                    return self._take_dtype(dtype, takes_dtype)
            else:
                parts = (state["qvalues"], state["qscales"])
                key = ("stored", *map(id, parts), repr([state[k] for k in ("scheme", "shape", "transposed")
                                                         if k in state]), str(self.weight.device))
                weight = _read_once(load and load.reads, key, parts, self.weight,
                                    lambda: _weight_from_state(state, type(self).__name__, self.weight.device))
        if weight.shape != self.weight.shape:
            mismatch = (f"{type(self).__name__} state holds a weight of shape {weight.shape}, but this layer's "
                        f"is {self.weight.shape}")
            if load is None:
                raise ShapeError(mismatch)
            # in a load: reported with the rest once they have loaded, as torch reports a size mismatch
            return load.error_msgs.append(f"size mismatch for {own_key}: {mismatch}")
        self.weight, self._source, self._unloaded = weight, None, None
        self._take_dtype(dtype, takes_dtype)

    def _dtype_in_state(self, state):
        """The float dtype that extra state `state` gives the layer's outputs, checked;
        None where it gives none (a QLinear's outputs take x's)."""
        return None

    def _take_dtype(self, dtype, takes):
        if dtype is not None and takes:  # as a float checkpoint's weight gives its dtype (_load_float)
            self._moved(torch.empty(0, dtype=dtype))


class QLinear(_QuantizedModule):
    """`y = x @ weight.T + bias` with a QTensor weight [out_features, in_features].

    Only the bias (a float Parameter) is trainable; gradients flow to the input
    through the quantized weight.  `Module.to()`, `.cuda()` and `.cpu()` move the
    weight with the bias (a dtype change leaves the quantized weight as it is).
    `state_dict()` holds the weight's stored values and scales (its `_extra_state`),
    so torch.save / load_state_dict restore it bit for bit; deepcopy and pickle work."""

    _float_kind, _made_by = torch.nn.Linear, "from_linear"
    _dims = ("out_features", "in_features")
    activation_scheme = None  # x's scheme (W8A8), or None: weight-only

    def __init__(self, weight, bias=None, activation_scheme=None):
        """`activation_scheme`: quantize x on the fly in each forward (W8A8 with an
        int8 weight), as `qdispatch.linear`'s does: a value name such as "q8s" means
        one scale per token, a QuantScheme is used as given.  It is the layer's
        setting, like in_features, not part of its state_dict."""
        super().__init__(weight, "out_features, in_features",
                         "QLinear.from_linear(linear, scheme) to quantize an nn.Linear")
        self.out_features, self.in_features = weight.shape
        if activation_scheme is not None:
            _check_activation_scheme(activation_scheme, self.in_features)  # a bad one fails here, not in forward
            self.activation_scheme = activation_scheme
        if bias is None:
            self.register_parameter("bias", None)
        else:
            try:
                bias = torch.as_tensor(bias).detach()
            except (TypeError, ValueError, RuntimeError) as exc:  # a str, a ragged list: torch's words
                raise ArgumentTypeError(f"QLinear bias must be a float tensor (or array), got {type(bias).__name__} "
                                        f"{bias!r:.60}: {exc}") from None
            if not bias.is_floating_point():  # a Parameter must be able to take a gradient
                raise ArgumentTypeError(f"QLinear bias must be a float tensor, got {bias.dtype}")
            if tuple(bias.shape) != (self.out_features,):
                raise ShapeError(f"QLinear bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            self.bias = torch.nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear, scheme, device=None, activation_scheme=None):
        """Quantize `linear.weight` with `scheme` (on `device`, default: where the
        weight lives, host weights on the default backend); the bias is copied.
        `activation_scheme` as for QLinear().
        A Linear on torch's meta device (a model built empty, to be loaded) gets a
        weight of zeros in the scheme's layout, on `device` or the default backend,
        for `load_state_dict(..., assign=True)` to replace; it refuses to run until then."""
        return cls._quantize(linear, scheme, device, options={"activation_scheme": activation_scheme})

    @staticmethod
    def _describe(linear):
        return f"{linear.in_features} -> {linear.out_features} features"

    @classmethod
    def _class_for(cls, layer):
        """The QLinear class that replaces float `layer`: QConv1D for a Conv1D."""
        return QConv1D if cls is QLinear and _conv1d_class(layer) is not None else cls

    @classmethod
    def _around(cls, linear, qweight, activation_scheme=None):
        layer = cls(qweight, None if linear.bias is None else linear.bias.detach().clone(), activation_scheme)
        if linear.bias is not None:
            layer.bias.requires_grad_(linear.bias.requires_grad)  # a frozen bias stays frozen
        return layer

    def forward(self, x):
        # In a compiled graph the op makes the eager call's checks as the graph runs: raised
        # while tracing they would end a fullgraph compile as torch's Unsupported.
        if _is_compiling() and _in_graph(self, x):
            y, _ = torch.ops.qdispatch.qlinear(_autocast(x) if _any_autocast() else x, self._op_handle)
            if self._holds_no_values:  # the op raises before y is used; the bias on meta would fail the trace
                return y
        else:
            self._refuse_unloaded()
            y = self._named_errors(x, lambda: q_matmul(x, self.weight.T, self.activation_scheme))
        return _plus_bias(y, self.bias)

    def _named_errors(self, x, run):
        """run(), its errors for x naming this layer."""
        try:
            return run()
        except (ShapeError, TypeError) as exc:  # a model has many layers: say which kind of x this one takes
            got = (f"x of shape {tuple(x.shape)} and dtype {x.dtype}" if isinstance(x, torch.Tensor)
                   else f"a {type(x).__name__}")
            raise type(exc)(f"{type(self).__name__}(in_features={self.in_features}, "
                            f"out_features={self.out_features}) got {got}: {exc}") from exc

    def extra_repr(self):
        act = "" if self.activation_scheme is None else f", activation_scheme={self.activation_scheme!r}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.weight.scheme!r}{act}, "
                f"device='{self.weight.device}'")


def _a(name):
    """`name` with its article: "an nn.Linear", "a transformers Conv1D"."""
    return f"{'an' if name.startswith('nn.') else 'a'} {name}"


def _conv1d_class(module):
    """transformers' Conv1D among `module`'s classes, or None.  Known by its name, so
    that qdispatch never imports transformers."""
    return next((cls for cls in type(module).__mro__
                 if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")), None)


class QConv1D(QLinear):
    """transformers' Conv1D (GPT-2's attention and MLP layers) quantized.  Conv1D is
    `y = x @ W + bias` with W [in_features, out_features]; this is the QLinear of
    weight W.T [out_features, in_features], the same product.  Its state_dict() is a
    QLinear's; a float checkpoint's weight is Conv1D's W, [in_features, out_features]."""

    _made_by = "from_conv1d"
    _float_transposed = True

    @classmethod
    def _float_name(cls):
        return "transformers Conv1D"

    @classmethod
    def _takes(cls, layer):
        return _conv1d_class(layer) is not None

    @classmethod
    def from_conv1d(cls, conv1d, scheme, device=None, activation_scheme=None):
        """Quantize `conv1d.weight.T` with `scheme`, as QLinear.from_linear does a Linear's."""
        return cls._quantize(conv1d, scheme, device, options={"activation_scheme": activation_scheme})

    @staticmethod
    def _describe(conv1d):
        return "Conv1D {} -> {} features".format(*conv1d.weight.shape)


def _check_activation_scheme(spec, in_features):
    """An error now for an activation scheme that no x of in_features values fits:
    a name's or scheme's values, a block along K that does not divide it, an axis
    or block of more dims than x can have (x's rows get a block's sizes here)."""
    scheme = activation_scheme_for(spec, (1, in_features))
    if isinstance(spec, str):
        return
    lead = [1]
    if scheme.granularity == "block":
        lead = list(scheme.block[:-1]) or [1]
    elif scheme.granularity == "axis" and scheme.axis >= 0:
        lead = [1] * max(1, scheme.axis)
    QLayout.for_shape(scheme, (*lead, in_features))


class QEmbedding(_QuantizedModule):
    """`nn.Embedding` with a QTensor table [num_embeddings, embedding_dim]: `forward(ids)`
    gives rows `ids` of the dequantized table (`qdispatch.embedding`), dequantizing only
    those, as `dtype` on the table's device.  `ids`: a torch integer tensor on the
    table's device (the CPU for a host table), each in [0, num_embeddings); an id
    outside is `OutOfRangeError`, an IndexError as torch raises.  To check them, CUDA
    ids are copied to the host, so each call waits for the GPU to reach them; with
    `check_ids=False` they are not (no wait, as nn.Embedding's lookups) and an id
    outside gives a row of NaN, as it does inside a CUDA graph capture, where ids are
    never read on the host.  The table is a constant to autograd.  `dtype` follows
    `Module.to(dtype)`, as nn.Embedding's weight's does, and a checkpoint's (its state
    holds it) under `load_state_dict(..., assign=True)` or where the layer, made on
    meta, holds no values yet; moves and state_dict() go as QLinear's.  A table shared with the output layer (tied embeddings) stays one
    QTensor: `QEmbedding(lm_head.weight)`."""

    _float_kind, _made_by = torch.nn.Embedding, "from_embedding"
    _dims = ("num_embeddings", "embedding_dim")
    check_ids = True  # what a module pickled before the setting existed reads

    def __init__(self, weight, padding_idx=None, dtype=torch.float32, check_ids=True):
        """weight: a 2-D QTensor table [num_embeddings, embedding_dim]; `dtype`: the
        rows' torch dtype (float32, float16, bfloat16 or float64); `check_ids`: whether
        ids are checked to be in range (see the class).  `padding_idx` is kept as
        nn.Embedding's, for code that reads it: it shapes only gradients of the table,
        which gets none here."""
        super().__init__(weight, "num_embeddings, embedding_dim",
                         "QEmbedding.from_embedding(embedding, scheme) to quantize an nn.Embedding")
        if dtype not in _EMBEDDING_DTYPES:
            raise ArgumentTypeError(f"QEmbedding's dtype must be torch.float32, float16, bfloat16 or float64, got "
                                    f"{dtype}")
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = padding_idx  # kept as nn.Embedding's: it only shapes gradients of the table
        self.check_ids = bool(check_ids)

    @classmethod
    def from_embedding(cls, embedding, scheme, device=None):
        """Quantize `embedding.weight` with `scheme` (on `device`, default: where the
        table lives, host tables on the default backend); the output dtype is the
        table's.  An Embedding on torch's meta device gets a table of zeros in the
        scheme's layout, for `load_state_dict(..., assign=True)` to replace; it refuses
        to run until then."""
        return cls._quantize(embedding, scheme, device)

    @staticmethod
    def _describe(embedding):
        return f"{embedding.num_embeddings} x {embedding.embedding_dim}"

    @classmethod
    def _check_layer(cls, embedding):
        super()._check_layer(embedding)
        if embedding.max_norm is not None:  # it rescales the looked-up rows in place
            raise ArgumentError(f"QEmbedding can't take an nn.Embedding with max_norm={embedding.max_norm}: a "
                                f"quantized table can't be renormalized as rows are looked up")

    @classmethod
    def _around(cls, embedding, qweight):
        dtype = embedding.weight.dtype
        return cls(qweight, embedding.padding_idx, dtype if dtype in _EMBEDDING_DTYPES else torch.float32)

    def _moved(self, probe):
        if probe.dtype in _EMBEDDING_DTYPES:
            self.dtype = probe.dtype

    def get_extra_state(self):
        # The rows' dtype too, which a load with assign=True (load_model's into a model built
        # on meta) gives the layer, as it gives float layers their checkpoint's.  In a dict of
        # this layer's own: a tied weight's state (its tensors) serves every layer that shares
        # it, and two tables that share one may differ in dtype.
        return {**super().get_extra_state(), "dtype": _EMBEDDING_DTYPES[self.dtype]}

    def _dtype_in_state(self, state):
        if isinstance(state, _WeightInFile):
            return state.dtype  # load_model checked it
        name = state.get("dtype") if isinstance(state, dict) else None
        if name is None:  # a state of an earlier release: the layer keeps its own
            return None
        dtype = _EMBEDDING_DTYPE_NAMED.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise SerializationError(f"a QEmbedding's _extra_state 'dtype' names its rows' dtype, one of "
                                     f"{list(_EMBEDDING_DTYPE_NAMED)}; got {brief(name)}")
        return dtype

    def forward(self, ids):
        _refuse_recording(ids)
        if _is_compiling() and _in_graph(self, ids):  # the op checks the ids when the graph runs, as QLinear's
            return torch.ops.qdispatch.qembedding(ids, self._op_handle)
        self._check_ids(ids)
        if _transformed():
            return _Lookup.apply(ids, self)
        return _lookup_outside_dynamo(self, ids)

    def _check_ids(self, ids):
        self._refuse_unloaded()
        if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() \
                or ids.dtype == torch.bool:
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ArgumentTypeError(f"QEmbedding takes a torch integer tensor of ids (torch.long, torch.int or another "
                                    f"integer dtype; token ids are usually torch.long), got {got}")
        _check_strided(ids, "QEmbedding")
        here = _torch_device(self.weight.device)
        if ids.device != here:
            raise (DeviceMismatchError if ids.is_cuda and here.type == "cuda" else BackendMismatchError)(
                f"QEmbedding's ids are on torch device {str(ids.device)!r}, its table on qdispatch's "
                f"'{self.weight.device}': move the ids first (ids.to({str(here)!r})), as for nn.Embedding")

    def _lookup(self, ids):
        # float64 rows are the float32 ones widened: dequantized values are float32's
        dtype = self.dtype if self.dtype in _KERNEL_DTYPES else torch.float32
        if ids.is_cuda:
            stream = _current_raw_stream(ids.get_device())
            captured = _capturing(ids.get_device(), stream)
            if self.check_ids and not captured:  # a graph can't hold a check on the host
                tensor_api.embedding_ids(ids.detach().cpu().numpy(), self.num_embeddings)
            rows = self._lookup_on_gpu(ids.detach(), dtype, stream, captured)
        else:
            rows = _cpu_lookup(ids.detach(), self.weight, dtype) if self.weight.kind == _CPU_KIND else None
            if rows is None:
                rows = to_torch(tensor_api.embedding(ids.detach().numpy(), self.weight, dtype=_KERNEL_DTYPES[dtype]))
        return rows if dtype == self.dtype else rows.to(self.dtype)

    def _lookup_on_gpu(self, ids, dtype, stream, captured):
        """The rows of CUDA ids as `dtype`, read where they are (an id outside the table
        gives a row of NaN): the lookup kernel writes into an output torch allocates on
        its current `stream`, while it captures a graph (`captured`) or in its order."""
        ids = ids.long().contiguous()  # the kernel reads int64 ids (no copy for torch.long ones)
        out = torch.empty((*ids.shape, self.embedding_dim), dtype=dtype, device=ids.device)
        if ids.numel():
            backend = _cuda_ready.get(ids.get_device()) or _cuda_backend(ids.get_device())
            lookup = backend.dequantize_rows_into if captured else backend.dequantize_rows_beside
            lookup(self.weight, ids.data_ptr(), ids.numel(), out.data_ptr(), _KERNEL_DTYPES[dtype], stream)
        return out

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
                f"dtype={self.dtype}, scheme={self.weight.scheme!r}, device='{self.weight.device}'"
                + ("" if self.check_ids else ", check_ids=False"))


# torch.compile never traces the lookup's host code (reading ids as numpy): where the
# lookup is not an op in its graph (CUDA ids), it runs between graph breaks.  Always,
# not only while tracing as q_matmul: after a graph break torch may compile the
# lookup's frame on its own, and its guards on the ids then failed under
# inference_mode.  The wrapper costs about 4 us a lookup.
_lookup_outside_dynamo = _between_graph_breaks(QEmbedding._lookup)
_ops_defined = _define_ops()


class _Lookup(torch.autograd.Function):
    """QEmbedding's lookup under torch.func's transforms, which hand forward the ids
    themselves (they wrap them in tensors whose data only a Function reaches).  The
    rows take no gradient, and a vmapped dim of the ids stays where it is: each id
    gives one row."""

    @staticmethod
    def forward(ids, layer):
        return layer._lookup(ids)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, d_rows):
        return None, None

    @staticmethod
    def vmap(info, in_dims, ids, layer):
        return _Lookup.apply(ids, layer), in_dims[0]


def quantize_linears(model, scheme, skip=(), device=None, activation_scheme=None):
    """Replace every `nn.Linear` in `model` by a `QLinear` holding its weight
    quantized with `scheme`, in place, and return the model (a QLinear when
    `model` itself is an nn.Linear), and every transformers Conv1D (GPT-2's
    layers) by a QConv1D.  `activation_scheme` (W8A8) as for QLinear().

    `skip` keeps layers in float: names as `model.named_modules()` gives them,
    of Linears or of modules holding them, whose Linears all stay (e.g. ["lm_head",
    "layers.0"]; None for none), or a function `(name, linear) -> bool`.
    A layer reached under several names (shared) is quantized once and stays
    shared.  Weights are quantized where they live (host weights on the default
    backend) unless `device` names another.  Every layer is quantized before any
    is replaced, so an error (naming the layer) leaves the model as it was; a
    subclass of nn.Linear with a forward of its own is such an error.  The
    Linears that torch's fused layers read as tensors stay in float:
    MultiheadAttention's out_proj and TransformerEncoderLayer's linear1/linear2."""
    if activation_scheme is not None:
        activation_scheme_for(activation_scheme, (1, 1))  # a bad one is no layer's fault
    return _quantize_layers(model, scheme, skip, device, torch.nn.Linear, _replaceable, QLinear,
                            {"activation_scheme": activation_scheme})


def quantize_embeddings(model, scheme, skip=(), device=None):
    """Replace every `nn.Embedding` in `model` by a `QEmbedding` holding its table
    quantized with `scheme` (per row, `QuantScheme("q8s", axis=0)`, is the usual
    choice), in place, and return the model; `skip` and `device` as for
    quantize_linears.  An nn.Embedding with max_norm is refused (ValueError)."""
    return _quantize_layers(model, scheme, skip, device, torch.nn.Embedding,
                            lambda parent, module: isinstance(module, torch.nn.Embedding), QEmbedding)


def _quantize_layers(model, scheme, skip, device, kind, replaceable, quantized_class, options=None):
    """quantize_linears and quantize_embeddings: every `kind` layer of `model` that is
    `replaceable(parent, layer)` and not skipped, replaced by a `quantized_class`
    made with keyword arguments `options`."""
    scheme = as_scheme(scheme)  # a bad scheme is no layer's fault, nor a bad or unavailable device
    if device is not None:
        tensor_api.backend_for(device)
    names = None if callable(skip) else _skip_names(skip)
    keep = skip if names is None else (lambda name, _: _named_or_under(name, names))
    if isinstance(model, kind) or replaceable(None, model):
        _refuse_unknown_names(names, {""}, kind)
        if keep("", model):
            return model
        _refuse_unquantizable([("", model)], kind, quantized_class)
        return _quantized_layer("", model, quantized_class, scheme, device, {}, options)
    ties = _tied_weights(_module(model, f"quantize_{kind.__name__.lower()}s"))
    found, kept = [], set()  # (name, parent, attribute, layer) of the replaceable layers; ids kept
    layer_names = set()
    for parent_name, parent in model.named_modules():
        for child_name, child in parent._modules.items():  # named_children() hides a repeat
            name = _joined(parent_name, child_name)
            if isinstance(child, (kind, quantized_class)) or replaceable(parent, child):
                layer_names.add(name)  # a layer quantized before may be named too: it is one to leave
            if replaceable(parent, child):
                found.append((name, parent, child_name, child))
                if keep(name, child):  # a shared layer kept under one name is kept everywhere
                    kept.add(id(child))
    _refuse_unknown_names(names, layer_names, kind)
    places = [place for place in found if id(place[3]) not in kept]
    done = any(isinstance(m, quantized_class) for m in model.modules())  # quantized by an earlier call
    if not places and not kept and not done:  # a model left wholly in float must not pass for a quantized one
        fused = sorted(layer_names - {name for name, _, _, _ in found})
        warnings.warn(f"quantize_{kind.__name__.lower()}s quantized nothing in {type(model).__name__}: " + (
            f"its {kind.__name__} layers ({', '.join(fused)}) are read as tensors by torch's fused layers and "
            f"stay in float" if fused else f"it holds no nn.{kind.__name__}"), UserWarning, stacklevel=3)
    if done:
        _warn_left_as_they_were(model, kind, quantized_class, scheme, device, options, names or frozenset())
    _refuse_unquantizable([(name, child) for name, _, _, child in places], kind, quantized_class)
    quantized = {}  # id(layer) -> its quantized layer
    for name, _, _, child in places:
        if id(child) not in quantized:
            quantized[id(child)] = _quantized_layer(name, child, quantized_class, scheme, device, ties, options)
    for _, parent, child_name, child in places:
        setattr(parent, child_name, quantized[id(child)])
    return model


def _warn_left_as_they_were(model, kind, quantized_class, scheme, device, options, skipped):
    """Layers an earlier call quantized are left as they are: a warning when this
    call asked for something else of them (a scheme, a device, options), which
    would otherwise pass for done.  Layers named in `skipped` (this call's skip
    names) were not asked for: mixed schemes, the odd layer quantized first."""
    target = None if device is None else tensor_api.backend_for(device)[0]
    asked = {key: value for key, value in (options or {}).items() if value is not None}
    differing, first = 0, None
    for name, layer in model.named_modules():
        if not isinstance(layer, quantized_class) or _named_or_under(name, skipped):
            continue
        had = [f"scheme {layer.weight.scheme}"] if layer.weight.scheme != scheme else []
        if target is not None and layer.weight.device != target:
            had.append(f"its weight on {str(layer.weight.device)!r}")
        had += [f"{key}={getattr(layer, key)!r}" for key, value in asked.items() if getattr(layer, key) != value]
        if had:
            differing += 1
            first = first or (name or type(model).__name__, had)
    if differing:
        what = kind.__name__
        warnings.warn(
            f"quantize_{what.lower()}s left {differing} {quantized_class.__name__} layer(s) quantized earlier as "
            f"they were ({first[0]!r} has {', '.join(first[1])}): it quantizes float nn.{what} layers only. For "
            f"another scheme or options, quantize the float model; to move a layer's weight, assign "
            f"layer.weight = layer.weight.to(device)", UserWarning, stacklevel=4)


# torch.nn.utils' old weight_norm and spectral_norm: hook class -> (what made it, what folds it in)
_WEIGHT_REBUILDING_HOOKS = {"WeightNorm": ("weight_norm", "remove_weight_norm"),
                            "SpectralNorm": ("spectral_norm", "remove_spectral_norm")}
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _carry_hooks(layer, module):
    """`layer`'s forward and backward hooks onto `module`, which takes its place (as
    torch.ao's swap_module carries them): what they add to the layer's call goes on.
    Its state_dict hooks stay behind: they were written for the float layer's keys."""
    for name in _HOOKS:
        if hasattr(layer, name):
            getattr(module, name).update(getattr(layer, name))
    if getattr(layer, "_is_full_backward_hook", None) is not None:
        module._is_full_backward_hook = layer._is_full_backward_hook


def _name_and_holders(name):
    """Module name `name` and those of the modules it sits in: "blocks.0.mlp" gives
    "blocks", "blocks.0" and "blocks.0.mlp"."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _named_or_under(name, names):
    """Whether layer `name`, or a module it sits in, is among `names`."""
    return any(n in names for n in _name_and_holders(name))


def _refuse_unknown_names(names, layer_names, kind):
    """ArgumentError for skip names that are neither a `kind` layer's nor a module's
    holding one (the model itself is named ""): a misspelt name would quantize the
    layer it meant to keep."""
    holders = {holder for name in layer_names for holder in _name_and_holders(name)[:-1]}
    unknown = [] if names is None else sorted(names - layer_names - holders, key=str)
    if unknown:
        raise ArgumentError(f"skip names {unknown} that are not nn.{kind.__name__} layers of the model, nor modules "
                            f"holding some; its {kind.__name__}s are {sorted(layer_names)}")


def _refuse_unquantizable(named_layers, kind, quantized_class):
    """ArgumentError naming the layers whose class overrides kind's forward (the
    quantized layer would drop what that forward does), or whose weight a lazy layer
    has not sized yet; before any layer is replaced."""
    bases = {name: _conv1d_class(layer) or kind for name, layer in named_layers}
    own = [name for name, layer in named_layers if type(layer).forward is not bases[name].forward]
    if own:
        of = sorted({"Conv1D" if bases[name] is not kind else f"nn.{kind.__name__}" for name in own})
        raise ArgumentError(f"layers {own} are subclasses of {' or '.join(of)} with a forward of their own, which "
                            f"{quantized_class.__name__} would not run: keep them in float with skip={own}")
    lazy = [name for name, layer in named_layers
            if isinstance(getattr(layer, "weight", None), torch.nn.parameter.UninitializedParameter)]
    if lazy:
        raise ArgumentError(f"layers {lazy} are lazy (nn.Lazy{kind.__name__}) and have no weight yet: run the model "
                            f"on an input once, which sizes them, then quantize it")


def _skip_names(skip):
    """quantize_linears' `skip` names as a set (read once: it may be a generator)."""
    if skip is None or isinstance(skip, str):
        return frozenset(() if skip is None else (skip,))
    try:
        return frozenset(skip)
    except TypeError:
        raise ArgumentTypeError(f"skip takes layer names or a function (name, linear) -> bool, got "
                                f"{type(skip).__name__}") from None


def _replaceable(parent, module):
    # torch's fused layers read these Linears' weights as tensors: MultiheadAttention
    # its out_proj, TransformerEncoderLayer its feed-forward pair (in eval mode).
    # transformers' Conv1D (GPT-2's layers) is a Linear of transposed weight.
    return (isinstance(module, torch.nn.Linear)
            and not isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear)
            and not isinstance(parent, torch.nn.TransformerEncoderLayer)) or _conv1d_class(module) is not None


def _tied_weights(model):
    """{id(float weight): (that weight, its QTensor)} for the layers of `model`
    quantized before (by an earlier quantize_linears or quantize_embeddings) whose
    float weight is still alive and unchanged: another layer may share it (tied
    embeddings)."""
    ties = {}
    for module in model.modules():
        if isinstance(module, _QuantizedModule) and module._source is not None:
            source, version = module._source[0](), module._source[1]
            if source is not None and source._version == version:  # values as they were quantized
                ties[id(source)] = (source, module.weight)
    return ties


def _quantized_layer(name, layer, cls, scheme, device, ties, options=None):
    """A `cls` in place of float `layer`, its errors naming it.  A layer whose float
    weight is one quantized before (`ties`) shares that QTensor, where its scheme and
    device are the ones asked for now, so tied weights stay tied and take their
    memory once."""
    cls = cls._class_for(layer)
    weight = layer.weight
    earlier = None if cls._float_transposed else ties.get(id(weight))
    shared = None
    if earlier is not None and earlier[0] is weight and earlier[1].scheme == scheme:
        here = earlier[1].device
        if (Device.parse(device) == here if device is not None
                else weight.is_meta or _torch_device(here) == weight.device):
            shared = earlier[1]
    if shared is not None and not weight.is_meta:
        # a change through .data bumps no version: the values decide (a second quantization, for tied layers only)
        fresh = _named_layer_errors(name, cls._describe(layer), lambda: _quantized(weight.detach(), scheme, device))
        shared = shared if _same_quantization(fresh, shared) else fresh
    module = _named_layer_errors(name, cls._describe(layer), lambda: cls._quantize(layer, scheme, device, shared, options))
    if not cls._float_transposed:
        ties[id(weight)] = (weight, module.weight)
    return module


def _same_quantization(a, b):
    """Whether QTensors a and b hold the same stored values and scales, bit for bit."""
    host = lambda x: x if isinstance(x, np.ndarray) else x.numpy()
    return all(np.array_equal(host(getattr(a, part)), host(getattr(b, part))) for part in ("values", "scales"))


def _named_layer_errors(name, what, make):
    """make(), its errors saying which layer: a model's layers differ in shape and values."""
    try:
        return make()
    except QDispatchError as exc:
        if isinstance(exc, QuantSchemeError):
            hint = f"; pick a scheme that fits it or keep it in float with skip=[{name!r}]"
        elif isinstance(exc, ArgumentError):  # a layer the quantized class can't take
            hint = f"; keep it in float with skip=[{name!r}]"
        else:
            hint = ""
        raise type(exc)(f"layer {name or 'model'!r} ({what}): {exc}{hint}") from exc


# ---- whole models in safetensors ------------------------------------------------------------

# the torch dtypes a safetensors file holds (bfloat16 as its bits)
_SAVABLE_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                   torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64}


def save_model(model, path):
    """Write `model`'s state_dict to `path` as one safetensors file in qdispatch's
    format (`qdispatch.save`): each QLinear's and QEmbedding's weight as its stored
    values and scales (`<layer>.weight`), a QEmbedding's dtype as an empty tensor of it
    (`<layer>.dtype`: the file holds tensors only), every other parameter and buffer as
    it is.  Nothing is pickled; `load_model` reads it back bit for bit.  A weight that
    several layers share (tied embeddings) is written once, and loads shared."""
    quantized = _quantized_modules(_module(model, "save_model", "qdispatch.save(path, tensors)"))
    tensors, converted = {}, {}
    for key, value in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "_extra_state" and prefix in quantized:
            layer = quantized[prefix]
            if layer.weight is layer._unloaded:
                raise BackendUnavailableError(f"save_model can't save {prefix!r}: it was made from a layer on "
                                              f"torch's meta device and has not been loaded, so it holds no values")
            tensors[_joined(prefix, "weight")] = layer.weight
            if isinstance(layer, QEmbedding):
                tensors[_joined(prefix, "dtype")] = _savable(torch.empty(0, dtype=layer.dtype))
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _SAVABLE_DTYPES or value.layout != torch.strided or value.is_nested \
                    or value.is_meta:
                what = ("meta" if value.is_meta else "nested" if value.is_nested
                        else str(value.layout).replace("torch.", "") if value.layout != torch.strided else value.dtype)
                raise ArgumentTypeError(f"save_model can't save {key!r}, a {what} tensor: the file holds dense bool, "
                                        f"integer and real float tensors with values (use torch.save for other state)")
            # a float parameter under several names converts once, so the file holds it once
            same = (value.device, value.dtype, value.data_ptr(), tuple(value.shape), value.stride())
            if same not in converted:
                converted[same] = _savable(value.detach().cpu().resolve_neg())  # numpy can't view negative views
            tensors[key] = converted[same]
        else:
            raise ArgumentTypeError(f"save_model can't save {key!r}, a {type(value).__name__}: only tensors and "
                                    f"QLinear and QEmbedding weights (use torch.save for other state)")
    save_tensors(path, tensors)


def _savable(host):
    """Host tensor `host` as qdispatch.save takes it: a numpy view, or a qdispatch Tensor
    for bfloat16, which numpy lacks."""
    return from_torch(host, "reference") if host.dtype == torch.bfloat16 else host.numpy()  # any host backend


def load_model(model, path):
    """Fill `model` from a `save_model` file and return it.  The model must have the
    saved structure, its QLinears and QEmbeddings included: build it (on torch's meta
    device, to hold no float weights) and run `quantize_linears` (and
    `quantize_embeddings`) with the saved schemes first.
    Quantized weights land where each layer's weight is, each read from the file
    as its layer loads, so the host holds one of them at a time (a weight whose
    bytes are corrupted raises SerializationError with the layers before it loaded,
    as torch's load_state_dict leaves a model on an error); a model on the meta
    device takes the loaded tensors as they are (`load_state_dict(assign=True)`), and
    its QEmbeddings the saved dtype."""
    quantized = _quantized_modules(_module(model, "load_model", "qdispatch.load(path)"))
    state, as_torch = {}, {}
    with read_stored(path) as stored:
        for key in stored.records:
            prefix, _, leaf = key.rpartition(".")
            if stored.held_record(key)["kind"] == "qtensor":
                if leaf != "weight" or prefix not in quantized:
                    try:
                        model.get_submodule(prefix)
                    except AttributeError:  # the file is of another model
                        raise SerializationError(
                            f"{path}: {key!r} is a quantized weight of a layer {prefix!r}, which this model does "
                            f"not have: load_model fills a model of the saved structure") from None
                    raise SerializationError(
                        f"{path}: {key!r} is a quantized weight, but {prefix or 'the model'!r} is not a QLinear "
                        f"or QEmbedding of this model: run quantize_linears(model, scheme) (and "
                        f"quantize_embeddings for tables) before load_model")
                dtype = _dtype_in_file(stored, prefix) if isinstance(quantized[prefix], QEmbedding) else None
                state[_joined(prefix, "_extra_state")] = _WeightInFile(stored, key, dtype)
            elif leaf == "dtype" and isinstance(quantized.get(prefix), QEmbedding):
                continue  # read with the table's weight, above
            else:
                value = stored.decode(key, Device.parse("reference"))  # a bias or buffer, as stored
                if id(value) not in as_torch:  # an alias decodes to its target: one torch tensor for both
                    as_torch[id(value)] = (value, _as_torch(value))
                state[key] = as_torch[id(value)][1]
        empty = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
        model.load_state_dict(state, assign=empty)
    if empty:
        _warn_still_on_meta(model, "load_model")
    return model


def _warn_still_on_meta(model, by):
    """A warning naming the tensors of `model` that a load left on torch's meta device:
    buffers no checkpoint holds (persistent=False, such as rotary embeddings' inv_freq)
    were made there too, and the model can't run until something computes them."""
    left = [name for name, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if left:
        shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
        warnings.warn(f"{by} left {len(left)} tensor(s) of the model on torch's meta device, which the file does not "
                      f"hold: {shown}. A buffer made with persistent=False is in no checkpoint, so a model built "
                      f"under torch.device('meta') lacks it: build the model with only its parameters on meta (see "
                      f"'Building a model without its float weights' in the README)", UserWarning, stacklevel=3)


def _as_torch(value):
    """A decoded Tensor or numpy array as a torch tensor of its memory."""
    return to_torch(value) if isinstance(value, Tensor) else torch.from_numpy(value)


def _dtype_in_file(stored, prefix):
    """The dtype `save_model` wrote for QEmbedding `prefix` (an empty tensor of it), or
    None where the file holds none (an earlier release's)."""
    key = _joined(prefix, "dtype")
    if key not in stored.records:
        return None
    kind = stored.held_record(key)["kind"]
    dtype = _as_torch(stored.decode(key, Device.parse("reference"))).dtype if kind in ("tensor", "array") else None
    if dtype not in _EMBEDDING_DTYPES:
        got = f"an entry of kind {kind!r}" if dtype is None else str(dtype).replace("torch.", "")
        raise SerializationError(f"{stored.path}: {key!r} holds a QEmbedding's dtype, as save_model writes it: an "
                                 f"empty float32, float16, bfloat16 or float64 tensor; got {got}")
    return dtype


class _WeightInFile:
    """A QLinear's or QEmbedding's quantized weight in an open `save_model` file, read
    when its layer loads it (set_extra_state), straight onto the layer's device; with
    `dtype`, the QEmbedding's rows' dtype the file holds (None: none)."""

    def __init__(self, stored, name, dtype=None):
        self.stored, self.name, self.dtype = stored, name, dtype

    def read(self, device, shared=True):
        return self.stored.decode(self.name, device, shared)


def _module(model, op, instead=None):
    """model, when it is a torch module (a dict of tensors goes through `instead`)."""
    if not isinstance(model, torch.nn.Module):
        hint = f": for a dict of tensors use {instead}" if instead else ""
        raise ArgumentTypeError(f"{op} takes a torch.nn.Module, got {type(model).__name__}{hint}")
    return model


def _quantized_modules(model):
    # a shared layer under each of its names, as state_dict() lists it
    return {name: m for name, m in model.named_modules(remove_duplicate=False) if isinstance(m, _QuantizedModule)}


def _joined(prefix, leaf):
    return f"{prefix}.{leaf}" if prefix else leaf
