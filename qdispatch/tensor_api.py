"""Creating tensors, moving them between devices, and reading them back."""
import contextlib
import math
import operator
import sys
import warnings

import numpy as np

from . import policy, quantmath
from ._core import Device, QTensor, Tensor, dlpack_bfloat16_bits, get_backend
from .backends.host import NUMPY_DLPACK_1
from .errors import (ArgumentError, ArgumentTypeError, BackendUnavailableError, NonFiniteError, OutOfMemoryError,
                     OutOfRangeError, QDispatchError, QuantSchemeError, ShapeError, UnsupportedIndexError,
                     WrongBackendError, byte_size)
from .layout import QLayout, swap_last2
from .scheme import _whole_number, as_scheme

# dtype name -> numpy dtype of the host payload (bfloat16 travels as its bits)
DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int8": np.dtype(np.int8),
    "int32": np.dtype(np.int32),
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
_NUMPY_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                np.dtype(np.int8): "int8", np.dtype(np.int32): "int32"}


def check_dtype(name, allowed=FLOAT_DTYPES):
    """name as a plain str when it names one of `allowed`: a str (numpy's str_, read
    out of an array, included) or a numpy dtype such as np.float16."""
    given = name
    if not isinstance(name, str):
        try:
            name = np.dtype(name).name if name is not None else None
        except TypeError:
            pass
    if not isinstance(name, str) or name not in allowed:
        raise ArgumentTypeError(f"Unsupported dtype {given!r}: expected one of {', '.join(allowed)}")
    return str(name)


def backend_for(device):
    """The backend object of a device, or BackendUnavailableError saying why."""
    dev = Device.parse(device)
    backend = get_backend(dev.kind)
    reason = backend.unavailable_reason(dev.index)
    if reason:
        raise BackendUnavailableError(reason)
    return dev, backend


def _host_array(data, dtype=None):
    """A numpy array plus its qdispatch dtype name; float64 becomes float32."""
    try:
        arr = np.asarray(data)
    except ValueError as exc:  # a ragged list
        raise ShapeError(f"tensor takes an array of numbers: {exc}") from None
    if not arr.dtype.isnative:  # big-endian data: the same numbers (or bfloat16 bits) in the host's order
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if dtype is not None:
        dtype = check_dtype(dtype, tuple(DTYPES))
        if dtype in ("int8", "int32"):
            return _as_integers(arr, dtype), dtype
        _refuse_non_numbers(arr, dtype)
        with np.errstate(over="ignore"):  # past the dtype's range is inf, as IEEE rounds it: no warning
            if dtype != "bfloat16":
                return arr.astype(DTYPES[dtype], copy=False), dtype
            if arr.dtype != np.uint16:
                arr = quantmath.f32_to_bf16_bits(arr.astype(np.float32))
            return arr, dtype
    if arr.dtype in _NUMPY_NAMES:
        return arr, _NUMPY_NAMES[arr.dtype]
    if arr.dtype.name == "bfloat16" and arr.dtype.itemsize == 2:  # ml_dtypes' (JAX's): its bits, in place
        return arr.view(np.uint16), "bfloat16"
    if arr.dtype.kind == "f" and arr.dtype.itemsize > 4:  # narrowed unasked: no finite value may become inf
        return within_float32(arr, op="take", reason=f"{arr.dtype} data becomes float32 here"), "float32"
    if arr.dtype.kind in "iub":  # integers of a dtype we don't hold: int8, which int_matmul takes
        return _as_integers(arr, "int8", wider="int32"), "int8"
    if arr.dtype.kind == "O":  # what numpy keeps as Python objects: a generator, integers past int64
        raise ArgumentTypeError(f"Can't make a tensor of {type(data).__name__} data that numpy holds as Python objects "
                                f"(a generator, say, or integers past int64): pass a list or array of numbers")
    raise ArgumentTypeError(f"Can't make a tensor from numpy dtype {arr.dtype}: use float32, float16, int8 or int32 "
                            f"data (bfloat16 as its uint16 bits with dtype='bfloat16')")


def _refuse_non_numbers(arr, dtype, hint=""):
    """Complex, dates, text, Python objects: numpy's cast would drop an imaginary part,
    count a date's units, parse text or take None for NaN."""
    if arr.dtype.kind not in "iufb" and arr.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 is kind V
        article = "an" if dtype.startswith("int") else "a"
        raise ArgumentTypeError(f"Can't make {article} {dtype} tensor of {arr.dtype} data: only integers, floats and "
                                f"bools convert to {dtype} (numpy's cast would drop an imaginary part, count a "
                                f"date's units, parse text or take None for NaN); {hint}convert it to numbers first")


def _as_integers(arr, dtype, wider=None):
    """arr cast to integer `dtype`, refusing the values the cast would change
    (numpy's cast wraps out-of-range integers and truncates floats); the message
    names integer dtype `wider` where every value fits it."""
    target = DTYPES[dtype]
    hint = f"pass dtype='{wider}' for an {wider} tensor, or " if wider else ""
    _refuse_non_numbers(arr, dtype, hint)
    if arr.dtype == target or arr.dtype.kind == "b" or not arr.size:
        return arr.astype(target, copy=False)
    flat = arr.reshape(-1)
    fits = _fitting(flat, dtype)
    if not fits.all():
        if wider and not _fitting(flat, wider).all():
            hint = ""
        first = int(np.argmin(fits))
        value = flat[first].item()
        position = tuple(int(i) for i in np.unravel_index(first, arr.shape))
        raise ArgumentTypeError(f"Can't make an {dtype} tensor of {arr.dtype} data: the value {value!r} at position "
                                f"{position} {_misfit(value, dtype)}; {hint}quantize float data instead, or "
                                f"round and clip it (np.rint, np.clip) to {dtype} first")
    return arr.astype(target)


def _fitting(flat, dtype):
    """Which values of 1-d `flat` are values of integer `dtype`."""
    lo, hi = int(np.iinfo(DTYPES[dtype]).min), int(np.iinfo(DTYPES[dtype]).max)
    with np.errstate(invalid="ignore"):
        if flat.dtype.kind == "f":
            flat = flat.astype(np.float64)  # holds both bounds exactly, where float32 rounds 2**31 - 1 up
            return (flat >= lo) & (flat <= hi) & (flat == np.trunc(flat))  # NaN fails every test
        return (flat >= lo) & (flat <= hi)


def _misfit(value, dtype):
    """Why `value` is no value of integer `dtype`."""
    lo, hi = int(np.iinfo(DTYPES[dtype]).min), int(np.iinfo(DTYPES[dtype]).max)
    if not np.isfinite(value):
        return "is not finite"
    if lo <= value <= hi:
        return "is not a whole number"
    return f"is outside {dtype}'s range [{lo}, {hi}]"


def tensor(data, device=None, dtype=None):
    """A Tensor on `device` (default: the default backend).  Host tensors share
    memory with a numpy array of a supported dtype (float32/float16/int8/int32).
    With dtype="bfloat16", numpy has no such dtype: float data is rounded to it,
    and uint16 data is taken as bfloat16 bit patterns (how numpy code and files
    keep bfloat16), not as integers to convert."""
    if isinstance(data, Tensor):
        return _as_dtype(data.to(device) if device is not None else data, dtype)
    if hasattr(data, "__dlpack__") and not isinstance(data, np.ndarray):
        host = numpy_of(data) if dtype is not None else None
        if host is None:
            return _as_dtype(from_dlpack(data, device=device), dtype)
        data = host  # converted to dtype as numpy data is, not first to a dtype of qdispatch's own
    if dtype in ("float16", "bfloat16") and isinstance(data, np.ndarray) and data.dtype == np.float32:
        return _as_dtype(tensor(data, device), dtype)  # the backend's cast (C on cpu), not numpy's
    arr, name = _host_array(data, dtype)
    dev, backend = backend_for(device if device is not None else policy.default_device())
    return Tensor(backend.from_host(arr, dev.index), name, tuple(arr.shape), dev.kind, dev.index)


def numpy_from_dlpack(obj):
    """np.from_dlpack(obj) as numpy 2.1-2.4 give it, on any numpy: an ndarray is viewed
    as it is (numpy before 2.1 refused read-only ones), with numpy's errors for what
    DLPack can't carry; and only numpy's own dtypes are taken: numpy 2.5 reads bfloat16
    and float8 in the dtypes a library such as ml_dtypes registers (onnx and JAX
    import it), which nothing here takes."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biufc":
            raise BufferError("DLPack only supports signed/unsigned integers, float and complex dtypes.")
        if not obj.dtype.isnative:
            raise BufferError("DLPack only supports native byte order.")
        return obj.view(np.ndarray)
    arr = np.from_dlpack(obj)
    if arr.dtype.isbuiltin != 1:  # 2: a dtype another library registered
        raise RuntimeError(f"Unsupported dtype in DLTensor: {arr.dtype} is none of numpy's own")
    return arr


def numpy_of(obj):
    """The numpy view of a DLPack producer's host memory, in its own dtype; None where
    it is on a GPU or of a dtype numpy lacks (bfloat16, float8), which from_dlpack takes."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_cpu:
            return None
        obj = obj.detach().resolve_conj().resolve_neg()  # what DLPack can't carry: a gradient, lazy views
    elif isinstance(obj, QTensor) or dlpack_device(obj)[0] not in _HOST_DLPACK_TYPES or _is_bf16(obj):
        return None
    try:
        return numpy_from_dlpack(obj)
    except (BufferError, RuntimeError, TypeError, ValueError):
        return None


def _as_dtype(t, dtype):
    """Tensor t as `dtype` (None: as it is): float dtypes convert into a new
    Tensor on t's device, as numpy's asarray(a, dtype) would."""
    if dtype is None:
        return t
    dtype = check_dtype(dtype, tuple(DTYPES))
    if t.dtype == dtype:
        return t
    if t.dtype not in FLOAT_DTYPES or dtype not in FLOAT_DTYPES:
        raise ArgumentTypeError(f"Can't convert a {t.dtype} Tensor to {dtype}: only float32, float16 and bfloat16 "
                                f"convert into each other; go through numpy (qd.tensor(t.numpy(), dtype='{dtype}'))")
    return Tensor(get_backend(t.kind).cast(t.payload, t.dtype, dtype), dtype, t.shape, t.kind, t.index)


def as_host_operand(x, other, float_for=None):
    """numpy data next to `other` joins other's device: plain arrays (and another
    library's host tensors) carry no device to mismatch (on CUDA this copies them
    over).  Another library's GPU tensor is viewed where it is, so the call's device
    check sees it there.  `float_for` names an operation that takes only float data here."""
    if float_for is not None:
        x = _float_host_data(x, float_for)
    if other is not None and not in_device_memory(x):
        return tensor(x, device=other.device)
    return tensor(x)


def as_int8_host_operand(x, other, side):
    """int_matmul's host data: integer arrays of any dtype become int8 when every
    value fits (int32 ones too, which a tensor keeps as int32 elsewhere); float
    arrays are refused under their own dtype (a float64 one would be named as the
    float32 tensor it becomes)."""
    if isinstance(x, (Tensor, QTensor)):
        return x
    host = numpy_of(x) if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray) else x  # a torch CPU tensor
    if isinstance(host, np.ndarray) and host.dtype.kind in "iu" and host.dtype != np.int8:
        return tensor(host, device=None if other is None else other.device, dtype="int8")
    if isinstance(host, np.ndarray) and host.dtype.kind in "fc":
        raise not_int8_error(side, host)
    return as_host_operand(x, other)


def missing_attribute(t, name):
    """The AttributeError for an attribute `t` lacks: for a name numpy arrays (or,
    once torch is imported, torch tensors) have, where to find it."""
    message = f"{type(t).__name__!r} object has no attribute {name!r}"
    if isinstance(t, QTensor) and name == "grad":  # torch's attribute: a QTensor is a constant to autograd
        return AttributeError("A QTensor has no gradient: gradients flow to the float operand only "
                              "(dX = dY @ dequantize(W).T); keep a float copy of the weight to train it")
    if hasattr(np.ndarray, name):
        if isinstance(t, QTensor):
            message += (f": a QTensor is not a numpy array. Its values as floats are q.dequantize().numpy(), "
                        f"which has .{name}; the stored ones are q.values and q.scales")
        else:
            message += (f": a qdispatch Tensor is not a numpy array. t.numpy() is one (the tensor's own "
                        f"memory on a host backend, a copy from a GPU), and has .{name}")
    elif "torch" in sys.modules and hasattr(sys.modules["torch"].Tensor, name):  # a layer's weight used as torch's
        if isinstance(t, QTensor):
            message += (f": a QTensor is not a torch tensor. Multiply by it with x @ q (or qdispatch.torch.q_matmul, "
                        f"differentiable in x); its values as a float torch tensor are "
                        f"qdispatch.torch.to_torch(q.dequantize()), which has .{name}")
        else:
            message += (f": a qdispatch Tensor is not a torch tensor. qdispatch.torch.to_torch(t) is one (sharing "
                        f"its memory), and has .{name}")
    return AttributeError(message)


def not_int8_error(side, t):
    """int_matmul's error for an operand `t` that is not int8 data."""
    dtype = getattr(t, "dtype", None)
    if isinstance(t, QTensor):
        got, fix = "a QTensor", "use q_matmul for QTensors"
    elif dtype in FLOAT_DTYPES or (isinstance(dtype, np.dtype) and dtype.kind in "fc"):
        got, fix = str(dtype), "it multiplies integers exactly; for float data quantize it and use q_matmul"
    else:
        got = dtype if dtype is not None else type(t).__name__
        fix = "convert integers that fit to int8 first (qdispatch.tensor(data, dtype='int8'))"
    return ArgumentTypeError(f"int_matmul's {side} must be int8 data, got {got}: {fix}")


_KDL_CUDA = 2
_HOST_DLPACK_TYPES = (1, 3)  # kDLCPU, kDLCUDAHost: memory numpy reads
# DLPack's device types that qdispatch doesn't serve, for the error that names one
_DLPACK_DEVICE_NAMES = {4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host",
                        12: "an extension device", 13: "CUDA managed", 14: "oneAPI", 15: "WebGPU",
                        16: "Hexagon", 17: "MAIA"}


def in_device_memory(obj):
    """Whether `obj` is another library's tensor in GPU memory (torch's, CuPy's)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, np.ndarray) or not hasattr(obj, "__dlpack_device__"):
        return False
    try:
        return dlpack_device(obj)[0] not in _HOST_DLPACK_TYPES
    except Exception:  # a producer that can't say: from_dlpack will
        return False


def tensor_numpy(t):
    host = get_backend(t.kind).to_host(t.payload)
    return quantmath.bf16_bits_to_f32(host) if t.dtype == "bfloat16" else host


def tensor_array(t, dtype=None, copy=None):
    if not t.device.is_host:
        raise WrongBackendError(
            f"Tensor is on the wrong backend (expected a host device, it is on '{t.device}'): "
            f"call .numpy() or .to('cpu') to copy it to host memory")
    arr = tensor_numpy(t)
    wanted = arr.dtype if dtype is None else np.dtype(dtype)
    if copy is False and (t.dtype == "bfloat16" or wanted != arr.dtype):
        # numpy's protocol: copy=False promises a view, so a conversion must refuse
        raise ArgumentError(f"Can't view a {t.dtype} Tensor as {wanted} without a copy (copy=False): "
                            f"pass copy=None to allow one, or convert t.numpy() yourself")
    if dtype is not None:
        arr = arr.astype(dtype, copy=False)
    if copy:
        arr = arr.copy()
    return arr


_COMPARISON_UFUNCS = (np.equal, np.not_equal, np.less, np.less_equal, np.greater, np.greater_equal)


def tensor_ufunc(ufunc, method, inputs, kwargs):
    """numpy's ufuncs on qdispatch tensors: np.matmul (`array @ t`) is q_matmul, as
    `t @ array` is; every other ufunc sees a Tensor's host values, as it would through
    __array__, and a QTensor refuses (it is no dense array)."""
    from ._core import QTENSOR_NOT_COMPARED, TensorBase, q_matmul
    if ufunc is np.matmul:
        out = kwargs.get("out") or ()
        if method == "__call__" and len(out) == 1 and out[0] is inputs[0]:  # numpy adds axes= for @= too
            raise ArgumentTypeError("`a @= b` with a qdispatch tensor would write the product into the numpy array a in "
                                    "place, which q_matmul does not do (it returns a new Tensor): write a = a @ b")
        if method != "__call__" or kwargs:
            given = ", ".join(kwargs) if kwargs else f"np.matmul.{method}"
            raise ArgumentTypeError(f"np.matmul with a qdispatch Tensor is qdispatch.q_matmul, which takes no {given}: "
                                    f"call qdispatch.q_matmul(a, b, out_dtype=...) directly, or np.matmul on t.numpy()")
        return q_matmul(*inputs)
    if any(isinstance(o, TensorBase) for o in kwargs.get("out", ()) or ()):
        raise ArgumentTypeError(f"A qdispatch Tensor can't be the out= of np.{ufunc.__name__}: write into a numpy "
                                f"array (np.asarray(t) shares a host Tensor's memory, except bfloat16's)")
    if ufunc in _COMPARISON_UFUNCS and any(isinstance(x, QTensor) for x in inputs):  # `array == q`, as `q == array`
        raise ArgumentTypeError(QTENSOR_NOT_COMPARED)
    arrays = [np.asarray(x) if isinstance(x, TensorBase) else x for x in inputs]
    return getattr(ufunc, method)(*arrays, **kwargs)


def tensor_astype(t, dtype):
    """Tensor.astype: t in float dtype `dtype`, on its device."""
    return _as_dtype(t, check_dtype(dtype, tuple(DTYPES)))


def _dtype_named(spec):
    """The dtype's name when `spec` is a dtype (torch's, numpy's, or a float dtype's
    name), as torch's t.to(dtype) passes one; else None."""
    if type(spec).__name__ == "dtype" and type(spec).__module__ == "torch":
        return str(spec).removeprefix("torch.")
    if isinstance(spec, np.dtype) or (isinstance(spec, type) and issubclass(spec, np.generic)):
        return np.dtype(spec).name
    if isinstance(spec, str) and spec.strip().lower() in FLOAT_DTYPES + ("float64",):
        return spec.strip().lower()
    return None


def _device_for_to(x, device):
    """backend_for(device) for x.to(device), where a dtype gets the way to convert to it:
    torch's t.to(dtype) changes dtypes, but .to here moves between devices only."""
    name = _dtype_named(device)
    if name is None:
        return backend_for(device)
    if isinstance(x, QTensor):
        how = ("its stored values are q.values" if name == "int8" else
               f"its values as floats are q.dequantize(), a float32 Tensor" +
               (f" (then .astype({name!r}))" if name in FLOAT_DTYPES[1:] else ""))
    elif name in FLOAT_DTYPES:
        how = f"t.astype({name!r}) converts its values"
    else:
        how = f"t.astype converts between float32, float16 and bfloat16; for {name}, convert t.numpy()"
    # a str could name a device: a value error, as an unknown device's is
    error, shown = (ArgumentError, repr(device.strip())) if isinstance(device, str) else (ArgumentTypeError, name)
    raise error(f"{type(x).__name__}.to moves between devices ('cpu', 'cuda:0'), got the dtype {shown}: {how}")


def tensor_to(t, device):
    dev, dst = _device_for_to(t, device)
    if dev == t.device:
        return t
    host = get_backend(t.kind).to_host(t.payload)
    return Tensor(dst.from_host(host, dev.index), t.dtype, t.shape, dev.kind, dev.index)


_BASIC_INDEXING = ("a Tensor takes integers on its leading axes, then at most one slice of step 1 "
                   "(t[i], t[a:b], t[i, a:b]), and gives a view of its memory; for other indexing "
                   "copy it to numpy with t.numpy()[...], or index a torch or CuPy view of it (DLPack)")


def _slice_indices(k, n):
    """slice k's (start, stop, step) over an axis of n, its bounds checked as numpy does."""
    try:
        return k.indices(n)
    except TypeError:  # Python's, naming no argument
        raise ArgumentTypeError(f"Slice {k!r} has bounds that are not integers: slice bounds and steps are "
                                f"integers or None, as in numpy") from None


def _without_whole_trailing_axes(shape, key):
    """key less its trailing entries that take whole axes (t[i, :], t[i, 0:n],
    t[i, ...]): they add nothing to the view."""
    from_end = any(k is Ellipsis for k in key)  # entries after an ellipsis index axes counted from the last
    dropped = 0
    while key:
        k = key[-1]
        if k is Ellipsis:
            from_end = False
        elif not isinstance(k, slice):
            break
        else:
            n = shape[len(shape) - 1 - dropped if from_end else len(key) - 1]
            if _slice_indices(k, n) != (0, n, 1):
                break
        key, dropped = key[:-1], dropped + 1
    return key


def _leading_index(shape, key):
    """(integers, (start, stop) or None) for a key that keeps t's trailing axes whole."""
    given = key
    key = key if isinstance(key, tuple) else (key,)
    if any(k is None for k in key):
        raise UnsupportedIndexError("Index None (np.newaxis) is not supported: a Tensor view keeps its axes; add one "
                                    "with t.numpy()[None] (numpy's view), or make a tensor of data shaped as you need "
                                    "(qdispatch.tensor(t.numpy().reshape(...)))")
    ellipses = sum(k is Ellipsis for k in key)
    if ellipses > 1:
        raise UnsupportedIndexError("An index can only have a single ellipsis ('...'), as in numpy")
    if len(key) - ellipses > len(shape):  # counted before whole axes are dropped, as numpy counts
        raise UnsupportedIndexError(f"Too many indices ({len(key) - ellipses}) for a Tensor of shape {shape}")
    key = _without_whole_trailing_axes(shape, key)
    ints, rows = [], None
    for axis, k in enumerate(key):
        if isinstance(k, slice):
            if axis != len(key) - 1:
                raise UnsupportedIndexError(f"A slice may only be followed by whole axes: {_BASIC_INDEXING}")
            start, stop, step = _slice_indices(k, shape[axis])
            if step != 1:
                raise UnsupportedIndexError(f"Slice step {k.step} is not supported: {_BASIC_INDEXING}")
            rows = (start, max(start, stop))
        elif isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
            n = shape[axis]
            if not -n <= k < n:
                raise OutOfRangeError(f"Index {int(k)} is out of range for axis {axis} of size {n}")
            ints.append(int(k) % n)
        elif k is Ellipsis:
            raise UnsupportedIndexError(f"An ellipsis may only follow the leading indices (t[i, ...]): "
                                        f"{_BASIC_INDEXING}")
        else:
            raise UnsupportedIndexError(f"Index {k!r} is not supported: {_BASIC_INDEXING}")
    if ints and len(ints) == len(shape):  # t[()] of a 0-d t picks no element: it is t, as in numpy
        raise UnsupportedIndexError(f"Index {given!r} picks one element, a number rather than a view: read it with "
                                    f"t.numpy()[...]")
    return ints, rows


def tensor_getitem(t, key):
    ints, rows = _leading_index(t.shape, key)
    backend = get_backend(t.kind)
    payload, shape = t.payload, t.shape
    if ints:
        payload, shape = backend.index(payload, tuple(ints)), shape[len(ints):]
    if rows is not None:
        payload, shape = backend.slice_rows(payload, *rows), (rows[1] - rows[0],) + shape[1:]
    return Tensor(payload, t.dtype, shape, t.kind, t.index)


def tensor_transpose(t):
    if len(t.shape) < 2:
        return t
    backend = get_backend(t.kind)
    return Tensor(backend.transpose2(t.payload) if hasattr(backend, "transpose2")
                  else np.swapaxes(t.payload, -1, -2),
                  t.dtype, swap_last2(t.shape), t.kind, t.index)


def from_dlpack(obj, device=None):
    """A Tensor viewing a DLPack-capable object (torch, CuPy, numpy) without a copy
    where the memory is on a device qdispatch serves and its dtype is one a Tensor
    holds (float32, float16, bfloat16, int8, int32).  Other dtypes come in as
    `qdispatch.tensor` converts them, in a copy: float64 as float32, other integers
    as int8.  A torch tensor goes through `qdispatch.torch.from_torch`, which knows
    torch's streams.  `device`, when given, is where the Tensor lives ("cpu",
    "cuda:1"): the host backends share host memory, another device gets a copy."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        from .torch import from_torch  # torch's streams and allocator need more than DLPack says
        return from_torch(obj, device)
    if isinstance(obj, Tensor):  # ours already: itself (a view), as numpy's from_dlpack of an array
        return obj.to(device) if device is not None else obj
    if not (hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")):
        raise ArgumentTypeError(f"from_dlpack needs an object that speaks DLPack (__dlpack__ and __dlpack_device__: "
                                f"a numpy array, torch or CuPy tensor), got {type(obj).__name__}: "
                                f"use qdispatch.tensor(...) for other data")
    return import_dlpack(obj, device)


QTENSOR_IS_NO_DATA = ("A QTensor is no float or integer data to take in: its float values are q.dequantize() "
                      "(quantize those to requantize it), its stored parts q.values and q.scales")

def dlpack_device(obj):
    """obj.__dlpack_device__() as (device type, index) ints, or a typed error
    naming what a producer gave instead."""
    said = obj.__dlpack_device__()
    try:
        kind, index = (int(v) for v in said)
    except (TypeError, ValueError):  # "cpu", (1,), (1, None): not DLPack's pair
        raise ArgumentTypeError(f"{type(obj).__name__}.__dlpack_device__() gave {said!r}, not DLPack's "
                                f"(device type, device index) pair of integers: the object does not speak "
                                f"DLPack; pass a numpy array or a torch or CuPy tensor") from None
    return kind, index


def import_dlpack(obj, device=None):
    """from_dlpack by the protocol alone."""
    if isinstance(obj, QTensor):  # it speaks DLPack only to say it can't
        raise ArgumentTypeError(QTENSOR_IS_NO_DATA)
    kind, index = dlpack_device(obj)
    if kind in _HOST_DLPACK_TYPES:
        try:
            arr = _bf16_from_dlpack(obj) if _is_bf16(obj) else numpy_from_dlpack(obj)
        except (TypeError, ValueError) as exc:  # numpy's words for what is no capsule
            raise ArgumentTypeError(f"from_dlpack can't read this {type(obj).__name__}: its __dlpack__ gave no "
                                    f"DLPack tensor numpy reads ({exc})") from None
        except (BufferError, RuntimeError) as exc:
            # "Unsupported dtype" for a type numpy lacks (float8, complex32) comes as a
            # RuntimeError or, from some numpy and torch versions, a BufferError, which
            # otherwise means what the producer can't export (numpy: a big-endian array)
            if isinstance(exc, BufferError) and "dtype" not in str(exc):
                raise ArgumentTypeError(f"from_dlpack can't view this {type(obj).__name__} without a copy ({exc}): "
                                        f"copy it in with qdispatch.tensor(...) instead") from None
            raise ArgumentTypeError(f"from_dlpack can't take this {type(obj).__name__} of dtype "
                                    f"{getattr(obj, 'dtype', 'unknown')} ({exc}): convert it to float32, float16 or "
                                    f"bfloat16 first") from None
        return host_view(arr, device, "bfloat16" if _is_bf16(obj) else None)
    if kind != _KDL_CUDA:
        where = _DLPACK_DEVICE_NAMES.get(kind, "an unknown device")
        raise ArgumentTypeError(f"This {type(obj).__name__}'s memory is on DLPack device type {kind} ({where}), "
                                f"which qdispatch does not serve: it takes host (CPU) and CUDA memory; copy the "
                                f"data to the host first")
    backend = get_backend("cuda")
    reason = backend.unavailable_reason(int(index))
    if reason:
        raise BackendUnavailableError(reason)
    t = backend.tensor_from_dlpack(obj)
    return t.to(device) if device is not None else t


def host_view(arr, device=None, dtype=None):
    """A Tensor sharing host array `arr`'s memory, on `device` when that is a host
    device (else on the default backend, then moved to `device`)."""
    if dtype is None and isinstance(device, Device) and device.is_host and arr.dtype in _NUMPY_NAMES:
        # a device some tensor is on (so available) and a dtype held as it is: the
        # torch adapter's case for every x of a decode step, without tensor()'s checks
        return Tensor(arr, _NUMPY_NAMES[arr.dtype], arr.shape, device.kind, device.index)
    if device is not None and Device.parse(device).is_host:
        return tensor(arr, device=device, dtype=dtype)
    t = tensor(arr, device=policy.default_device(), dtype=dtype)
    return t.to(device) if device is not None else t


def _is_bf16(obj):
    return "bfloat16" in str(getattr(obj, "dtype", ""))


class _Retyped:
    """A DLPack producer whose one capsule is given already (numpy asks for it once)."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


def _bf16_from_dlpack(obj):
    """The uint16 bits of a host producer's bfloat16 values, in place: its capsule
    retyped, since numpy has no bfloat16 to take it as."""
    capsule = None
    if NUMPY_DLPACK_1:  # a versioned capsule says whether the memory is writable
        with contextlib.suppress(TypeError):  # TypeError: a producer older than DLPack 1.0
            capsule = obj.__dlpack__(max_version=(1, 0))
    if capsule is None:  # numpy makes an unversioned capsule's memory read-only
        capsule = obj.__dlpack__()
    return np.from_dlpack(_Retyped(dlpack_bfloat16_bits(capsule), obj.__dlpack_device__()))


_COMPARISONS = (operator.lt, operator.le, operator.eq, operator.ne, operator.gt, operator.ge)  # Cython's op order


def tensor_compare(t, other, op):
    """t <op> other value by value, as numpy compares host arrays (a CUDA tensor's
    np.asarray says to move it first)."""
    if isinstance(other, QTensor):
        return NotImplemented  # the QTensor's own comparison says why not
    return _COMPARISONS[op](tensor_array(t), tensor_array(other) if isinstance(other, Tensor) else other)


def tensor_arithmetic(name, operands):
    """An arithmetic operator on qdispatch tensors: numpy's ufunc `name`, which hands
    them to tensor_ufunc (a Tensor's host values; an array).  A QTensor has no
    arithmetic; with a torch tensor the other side's operator decides."""
    if any(isinstance(x, QTensor) for x in operands):
        raise ArgumentTypeError(f"A QTensor has no arithmetic operators (np.{name}): compute on "
                                f"q.dequantize().numpy(), or multiply with q_matmul")
    torch = sys.modules.get("torch")  # loaded already wherever one of its tensors exists
    if torch is not None and any(isinstance(x, torch.Tensor) for x in operands):
        return NotImplemented
    return getattr(np, name)(*operands)


# ---- quantized tensors -----------------------------------------------------

def quantize(x, scheme="q8s", device=None):
    """Quantize float data (numpy, Tensor or DLPack object; a torch Parameter by its
    values) into a QTensor.  `scheme` is a QuantScheme or a value name ("q8s",
    "q4f", ...: one scale for the whole tensor; 4- and 2-bit names store packed_u32).

    Without `device`, a Tensor stays on its device and host data goes to the
    default backend.  float16 scales that rounding up may have enlarged by 1/15
    or more give a ScaleUnderflowWarning.  Data whose values would dequantize
    past float32's range (a q8f block whose largest magnitude is within 0.4% of
    float32's largest, say) is a ScaleOverflowError."""
    q = _quantize(x, scheme, device, weight=True)
    # the largest scale first: on a GPU that is 4 bytes to the host, not the scale grid
    if quantmath.may_pass_float32(get_backend(q.kind).qstorage_largest_scale(q.storage), q.scheme.qrange):
        _check_dequantizable(q.scales, lambda: q.values, q.shape, q.layout.logical_block(q.transposed), q.scheme,
                             "scale the data down first (values this close to float32's largest leave the rest "
                             "of their block next to nothing anyway)")
    if q.scheme.scale_dtype == "f16":
        warning = quantmath.f16_scale_underflow_warning(q.scales)
        if warning is not None:
            warnings.warn(warning, stacklevel=2)
    return q


def quantize_activation(x, scheme):
    """quantize for an operand used once (no weight panels are packed)."""
    return _quantize(x, scheme, None, weight=False)


def _quantize(x, scheme, device, weight):
    scheme = as_scheme(scheme)
    data = w = None
    if not isinstance(x, Tensor):  # a torch Parameter crosses by its values (from_torch)
        data = _float_host_data(x)
        w = _swapped_view(data)  # W.T given: W crosses (a device gets W's bytes, not a copy of W.T)
        x = tensor(data if w is None else w, device=device)
    elif device is not None:
        x = x.to(device)
    if x.dtype not in FLOAT_DTYPES:
        raise _not_float_error(x.dtype)
    shape = x.shape if w is None else swap_last2(x.shape)
    if len(shape) == 0 or 0 in shape:
        raise ShapeError(f"Can't quantize a tensor of shape {shape}: it needs at least one dim and one value")
    layout = QLayout.for_shape(scheme, shape)
    backend = get_backend(x.kind)
    quantizer = backend.quantize if weight else getattr(backend, "quantize_activation", backend.quantize)
    payload = _payload_to_quantize(x, backend)
    swapped = payload if w is not None else _swapped_view(payload)
    if swapped is not None:  # W.T of a row-major W: quantized in W's order, as W's transpose (no copy of W.T)
        stored = QLayout(layout.logical_scheme(True), swap_last2(layout.shape), swap_last2(layout.block))
        try:
            return QTensor(quantizer(swapped, stored, x.index), stored, True, x.kind, x.index)
        except QDispatchError:
            pass  # its positions would be W's: quantized as given below, the error names x's
    if w is not None:  # x holds W: W.T itself, quantized as given
        payload = _payload_to_quantize(tensor(data, device=x.device), backend)
    return QTensor(quantizer(payload, layout, x.index), layout, False, x.kind, x.index)


def float32_payload(x):
    """Tensor x's payload as float32 on its own backend (itself when it is float32)."""
    return x.payload if x.dtype == "float32" else get_backend(x.kind).cast(x.payload, x.dtype, "float32")


def _payload_to_quantize(x, backend):
    """x's payload as the backend quantizes it: as it is where the backend reads its
    dtype, else a float32 copy (16-bit data on the reference backend), whose
    out-of-memory error says that the copy is what did not fit (twice the data's bytes)."""
    if x.dtype in backend.quantize_dtypes:
        return x.payload
    try:
        return float32_payload(x)
    except MemoryError as exc:
        kind = type(exc) if isinstance(exc, OutOfMemoryError) else OutOfMemoryError
        copy = byte_size(4 * math.prod(x.shape))
        raise kind(f"quantize reads {x.dtype} data through a float32 copy ({copy}, twice the data's bytes), which "
                   f"did not fit: {exc or 'out of memory'}. Free memory first, or quantize it on the cpu backend or "
                   f"a GPU (qd.quantize(x, scheme, device='cpu'), or device='cuda'), which read 16-bit data "
                   f"without the copy") from exc


def _swapped_view(payload):
    """A host payload with its last two dims swapped, where that is row-major and the
    payload is not (a transposed view); None otherwise."""
    if isinstance(payload, np.ndarray) and payload.ndim >= 2 and not payload.flags.c_contiguous:
        swapped = np.swapaxes(payload, -1, -2)
        if swapped.flags.c_contiguous:
            return swapped
    return None


def _float_host_data(x, op="quantize"):
    """x, checked to be float data when it is host data: `tensor` would make int8
    of integers, and the error would then name int8 for, say, int64 data."""
    if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        floating = getattr(x, "is_floating_point", None)  # torch's: its integers would cross as int8
        if callable(floating) and not floating():
            raise _not_float_error(str(x.dtype).replace("torch.", ""), op)
        return x  # keeps its own dtype through from_dlpack
    try:
        arr = np.asarray(x)
    except ValueError as exc:  # a ragged list
        raise ShapeError(f"{op} takes an array of numbers: {exc}") from None
    if arr.dtype.kind != "f":
        raise _not_float_error(arr.dtype, op)
    if op == "quantize" and arr.dtype.itemsize > 4:
        return within_float32(arr)
    return arr


def within_float32(arr, op="quantize", reason="quantize works in float32"):
    """Wider float data as float32, refusing the finite values that would be inf
    there (quantize's error would otherwise name an inf the data lacks)."""
    with np.errstate(over="ignore"):
        narrow = arr.astype(np.float32)
    past = np.isinf(narrow) & np.isfinite(arr)
    if past.any():
        at = tuple(int(i) for i in np.unravel_index(int(np.argmax(past)), arr.shape))
        raise NonFiniteError(f"Can't {op} data holding {arr[at].item()!r} at position {at}: {reason}, whose "
                             f"range ends at {float(np.finfo(np.float32).max)!r}; scale the data down first")
    return narrow


def _not_float_error(dtype, op="quantize"):
    return ArgumentTypeError(f"{op} expects float data, got {dtype}: convert it to float32 first")


def dequantize(q, dtype="float32"):
    """The float values of QTensor q (values * scales) as a Tensor of `dtype`
    ("float32", "float16" or "bfloat16") on q's device."""
    if not isinstance(q, QTensor):
        raise ArgumentTypeError(f"dequantize expects a QTensor, got {type(q).__name__}")
    dtype = check_dtype(dtype)
    backend = get_backend(q.kind)
    return Tensor(backend.dequantize(q, dtype), dtype, q.shape, q.kind, q.index)


def embedding(ids, weight, dtype="float32"):
    """Rows `ids` of a quantized table, dequantized: `dequantize(weight)[ids]` value for
    value, without dequantizing the rest (an embedding lookup, as torch's F.embedding on
    the dequantized table).  weight: a 2-D QTensor [num_embeddings, dim]; ids: integers
    of any shape (int, list, numpy array, host Tensor), each in [0, num_embeddings).
    Returns a Tensor [*ids.shape, dim] of `dtype` on weight's device."""
    if not isinstance(weight, QTensor):
        raise ArgumentTypeError(f"embedding's weight must be a QTensor (quantize the table first), got "
                                f"{type(weight).__name__}")
    if len(weight.shape) != 2:
        raise ShapeError(f"embedding takes a 2-D table [num_embeddings, dim], got a QTensor of shape "
                         f"{tuple(weight.shape)}")
    dtype = check_dtype(dtype)
    rows = embedding_ids(ids, weight.shape[0])
    backend = get_backend(weight.kind)
    shape = rows.shape + (weight.shape[1],)
    if rows.size == 0:
        out = backend.cast(backend.from_host(np.zeros((0, weight.shape[1]), np.float32), weight.index),
                           "float32", dtype)
    else:
        out = backend.dequantize_rows(weight, rows.reshape(-1), dtype)
    return Tensor(backend.reshape(out, shape), dtype, shape, weight.kind, weight.index)


def _python_ints(arr):
    """An object array of integers only (numpy keeps Python ints past int64's range so)."""
    return arr.dtype == object and all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
                                       for v in arr.flat)


def embedding_ids(ids, count):
    """ids as an int64 numpy array, each checked to lie in [0, count)."""
    try:
        arr = tensor_numpy(ids) if isinstance(ids, Tensor) else np.asarray(ids)
    except ValueError as exc:  # a ragged list
        raise ShapeError(f"embedding's ids must form an array of integers: {exc}") from None
    empty_list = not arr.size and arr.dtype.kind == "f"  # numpy makes [] float64
    if arr.dtype.kind not in "iu" and not empty_list and not _python_ints(arr):
        raise ArgumentTypeError(f"embedding's ids must be integers, got {arr.dtype} data")
    # ids past int64 (unsigned, or Python ints numpy holds as objects) are out of range whatever
    # the table: compare before converting
    bad = (arr >= count) if arr.dtype.kind == "u" else (arr < 0) | (arr >= count)
    if bad.any():
        at = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]), arr.shape))
        raise OutOfRangeError(f"embedding id {arr[at]} at position {at} is outside the table's "
                              f"{count} rows: ids must lie in [0, {count})")
    return arr.astype(np.int64)


def qtensor_host(q):
    values, scales = get_backend(q.kind).qstorage_to_host(q.storage, q.layout)
    if q.transposed:
        values, scales = np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)
    return values, scales


def qtensor_stored(q):
    """(values, scales, scheme, transposed): what rebuilds q exactly.  Its values
    (int8) and scales (float32) as stored, in storage orientation, on the host."""
    values, scales = get_backend(q.kind).qstorage_to_host(q.storage, q.layout)
    return (np.ascontiguousarray(values, dtype=np.int8), np.ascontiguousarray(scales, dtype=np.float32),
            q.layout.scheme, bool(q.transposed))


def qtensor_from_stored(values, scales, scheme, transposed, device=None):
    """The QTensor that qtensor_stored took apart, on `device`.  It keeps `values`
    and `scales` (arrays just read from a file or a pickle) without copying them,
    so a load holds each tensor once."""
    q = _qtensor_keeping(np.asarray(values), np.asarray(scales, dtype=np.float32), scheme, device)
    return q.T if transposed else q


def tensor_copy(t):
    """copy.copy(t): its own memory, as numpy's copy of an array (the pickle path
    viewed a C-contiguous host payload)."""
    arr, device, dtype = tensor_stored(t)
    return tensor(np.array(arr, copy=True), device=device, dtype=dtype)


def tensor_stored(t):
    """(host array, device, dtype): what `tensor` rebuilds t from (bfloat16 as its bits)."""
    # np.asarray keeps a 0-d array 0-d, where np.ascontiguousarray makes it 1-d
    return np.asarray(get_backend(t.kind).to_host(t.payload), order="C"), str(t.device), t.dtype


def qtensor_values(q):
    """A copy: the host backends' arrays are their storage, which packed kernel
    panels were built from, so an edit there would reach some products only."""
    return np.array(qtensor_host(q)[0])


def qtensor_scales(q):
    """Per tensor: a 0-d array; per axis: one scale per index; per block: the grid
    (a copy, as for the values)."""
    scales = np.array(get_backend(q.kind).qstorage_scales_to_host(q.storage))  # packed values stay packed
    if q.transposed:
        scales = np.swapaxes(scales, -1, -2)
    scheme = q.scheme
    if scheme.granularity == "tensor":
        return scales.reshape(())
    if scheme.granularity == "axis":
        return scales.reshape(-1)
    return scales


def qtensor_nbytes(q):
    grid = 1
    for g in q.layout.grid:
        grid *= g
    scale_bytes = 4 if q.layout.scheme.scale_dtype == "f32" else 2
    if q.layout.scheme.store == "packed_u32":
        per_word = 32 // q.layout.bits
        rows = 1
        for d in q.layout.shape[:-1]:
            rows *= d
        value_bytes = rows * -(-q.layout.shape[-1] // per_word) * 4
    else:
        value_bytes = 1
        for d in q.layout.shape:
            value_bytes *= d
    return value_bytes + grid * scale_bytes


def qtensor_to(q, device):
    """The same values and scales on another device; the destination backend may
    re-lay them out (the cpu backend packs weight panels here, once)."""
    dev, dst = _device_for_to(q, device)
    if dev == q.device:
        return q
    values, scales = get_backend(q.kind).qstorage_to_host(q.storage, q.layout)
    storage = dst.qstorage_from_host(values, scales, q.layout, dev.index)
    return QTensor(storage, q.layout, q.transposed, dev.kind, dev.index)


def qtensor_zeros(shape, scheme, device=None):
    """A QTensor of zeros (unit scales) in `scheme`'s layout: room for values to come."""
    layout = QLayout.for_shape(as_scheme(scheme), shape)
    return qtensor_from_parts(np.zeros(shape, np.int8), np.ones(layout.grid, np.float32), scheme,
                              device=device)


def qtensor_from_parts(values, scales, scheme, device=None, shape=None):
    """A QTensor from already-quantized int8 values and a float32 scale grid
    (for loaders); values must lie in the scheme's range, and scales be values of
    its scale_dtype.  `shape`, when given, is the tensor's shape and values may
    come in any shape holding its elements in order (flat, as read from a file),
    as scales may.  `device` is where the QTensor goes (default: the default
    backend).  The QTensor keeps copies: later edits to the arrays passed can't
    reach it, nor get past the range check.  A value whose product with its
    scale is past float32's range is a ScaleOverflowError."""
    values = np.array(values)
    if shape is not None:
        shape = _shape_arg(shape)
        count = math.prod(shape)
        if values.size != count:
            raise ShapeError(f"shape {shape} holds {count} elements but the values hold {values.size}: "
                             f"pass as many values as the shape holds, or leave shape out")
        values = values.reshape(shape)
    scales = np.asarray(scales)
    if scales.dtype.kind not in "fiu":  # complex would lose its imaginary part, text be parsed
        raise ArgumentTypeError(f"scales must be real numbers (float32 is what is kept), got {scales.dtype}")
    with np.errstate(over="ignore"):  # past float32's range is inf, which the grid's check names
        scales = scales.astype(np.float32)
    return _qtensor_keeping(values, scales, scheme, device)


def _shape_arg(shape):
    """shape= as a tuple of sizes, refusing what int() would bend (2.5, "2", True)
    and negative sizes (numpy's reshape would read -1 as "the rest")."""
    try:
        dims = tuple(_whole_number(d) for d in shape)
    except TypeError:  # not iterable
        dims = (None,)
    if None in dims:
        raise ArgumentTypeError(f"shape must be a tuple of ints, got {shape!r}")
    if any(d < 0 for d in dims):
        raise ShapeError(f"shape {dims} has a negative size: sizes are counts of values, 0 or more")
    return dims


def _qtensor_keeping(values, scales, scheme, device):
    """qtensor_from_parts of arrays the QTensor may keep as they are."""
    scheme = as_scheme(scheme)
    if values.dtype != np.int8:
        raise ArgumentTypeError(f"values must be int8, got {values.dtype}")
    layout = QLayout.for_shape(scheme, values.shape)
    lo, hi = scheme.qrange
    if values.min() < lo or values.max() > hi:  # two passes without temporaries: the common case is in range
        outside = (values < lo) | (values > hi)
        first = np.unravel_index(int(np.argmax(outside)), values.shape)
        raise QuantSchemeError(
            f"values outside {scheme.value}'s range [{lo}, {hi}]: {int(values[first])} at position "
            f"{tuple(int(i) for i in first)}; clip them to the range, or pick a scheme whose range holds them")
    scales = _scale_grid(scales, scheme, layout)
    _check_dequantizable(scales, lambda: values, layout.shape, layout.block, scheme,
                         "pass smaller scales, or values of smaller magnitude there")
    dev, backend = backend_for(device if device is not None else policy.default_device())
    return QTensor(backend.qstorage_from_host(values, scales, layout, dev.index),
                   layout, False, dev.kind, dev.index)


def _check_dequantizable(scales, values, shape, block, scheme, advice):
    """ScaleOverflowError where a value times its scale is past float32's range:
    dequantize would hold inf, which the reference backend's products would carry
    and the kernels' (x * q summed, then scaled) need not.  `values` gives the
    values when called (only where a scale is that large)."""
    found = quantmath.first_block_past_float32(scales, values, shape, scheme.qrange, block)
    if found is not None:
        raise quantmath.dequantize_overflow_error(found, advice)


def _scale_grid(scales, scheme, layout):
    """scales as the scale grid of `layout` (any shape holding its values in order),
    finite: a NaN or Inf scale would turn every product of its block into one."""
    if scales.size != np.prod(layout.grid, dtype=np.int64):
        raise ShapeError(f"{scheme!r} on values of shape {layout.shape} takes a scale grid of shape "
                         f"{layout.grid} (one scale per block), got scales of shape {scales.shape}")
    grid = scales.reshape(layout.grid)
    bad = ~np.isfinite(grid)
    if bad.any():
        first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), grid.shape))
        raise NonFiniteError(f"The scale at {first} of the scale grid is {float(grid[first])}: scales must be "
                             f"finite (quantize the float data instead, or repair the scales)")
    off = quantmath.first_scale_off_dtype(grid, scheme.scale_dtype)
    if off is not None:  # what is kept must be what the scheme says it stores (and save writes)
        raise QuantSchemeError(
            f"The scale at {off} of the scale grid, {np.float32(grid[off])!s}, is no {scheme.scale_dtype} value, "
            f"though the scheme stores its scales as {scheme.scale_dtype}: convert the scales to "
            f"{scheme.scale_dtype} first (rounding up keeps the values in range), or use scale_dtype='f32'")
    return grid
