# cython: language_level=3
"""Backend kinds, devices, the tensor types and the dispatch table.

The backend kind is the C enum `qd_backend` of qdispatch.h (defined there and
nowhere else).  Every tensor stores it in a C field, and the dispatcher checks
that two operands share a device with two C integer compares before it looks
the backend up in a C-indexed table."""
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.object cimport Py_EQ, Py_NE

import math
import sys
from enum import IntEnum

import numpy as _np

from .scheme import index_of
from .errors import (ArgumentError, ArgumentTypeError, BackendMismatchError, BackendUnavailableError,
                     DeviceMismatchError, DLPackExportError, QDispatchError, ShapeError)

from .dlpack cimport DLManagedTensor, DLManagedTensorVersioned, DLTensor, kDLBfloat, kDLUInt

cdef extern from "qdispatch.h":
    cpdef enum qd_backend:
        QD_BACKEND_REFERENCE
        QD_BACKEND_CPU
        QD_BACKEND_CUDA
        QD_BACKEND_COUNT


class BackendKind(IntEnum):
    """The backend kinds, with the values of the C enum `qd_backend`."""
    REFERENCE = QD_BACKEND_REFERENCE
    CPU = QD_BACKEND_CPU
    CUDA = QD_BACKEND_CUDA


KIND_NAMES = {int(k): k.name.lower() for k in BackendKind}
_KIND_BY_NAME = {v: k for k, v in KIND_NAMES.items()}
_FLOAT_DTYPE_NAMES = ("float32", "float16", "bfloat16")  # what Tensor.astype converts between
# Transfers under transfer="auto" move data towards the faster backend.
_SPEED_RANK = {QD_BACKEND_REFERENCE: 0, QD_BACKEND_CPU: 1, QD_BACKEND_CUDA: 2}

# The dispatch table: one backend object per kind, registered by each backend's
# module; the dispatcher never changes when a backend is added.
cdef list _table = [None] * QD_BACKEND_COUNT
cdef object _ops = None  # qdispatch.ops, imported on first use (it imports this module)


cdef object ops_module():
    global _ops
    if _ops is None:
        from . import ops
        _ops = ops
    return _ops


def register_backend(backend):
    """Install `backend` (an object with `kind`, `name` and the kernel methods)."""
    _table[int(backend.kind)] = backend


cdef object backend_of(int kind):
    return _table[kind]


def get_backend(kind):
    """The registered backend object for a kind (an int, BackendKind or name)."""
    if isinstance(kind, str):
        if kind not in _KIND_BY_NAME:
            raise ArgumentError(f"Unknown backend {kind!r}: expected one of {', '.join(_KIND_BY_NAME)}")
        kind = _KIND_BY_NAME[kind]
    backend = _table[int(kind)]
    if backend is None:
        raise BackendUnavailableError(f"The {KIND_NAMES[int(kind)]} backend is not registered")
    return backend


cdef bint same_device(TensorBase a, TensorBase b) noexcept:
    return a.kind == b.kind and a.index == b.index


cdef class Device:
    """A (backend kind, index) pair: 'cpu', 'reference', 'cuda', 'cuda:1'."""

    def __cinit__(self, kind, index=0):
        cdef Device named
        if isinstance(kind, str) or _is_torch_device(kind):  # Device('cuda:1'), as its repr writes it
            named = Device.parse(kind)
            if index and named.index:
                raise ArgumentError(f"Device({kind!r}, {index!r}) gives the index twice: write Device('cuda:N')")
            kind, index = named.kind, index or named.index
        try:
            kind, index = index_of(kind), index_of(index)  # whole numbers: no 1.5, no "1", no True
        except TypeError as exc:  # index_of's words name no call
            raise ArgumentTypeError(f"Device({kind!r}, {index!r}): {exc}; give a device like 'cpu' or 'cuda:1', or a "
                                    f"backend kind and an index (whole numbers)") from None
        if not 0 <= kind < QD_BACKEND_COUNT:
            raise ArgumentError(f"Unknown backend kind {kind}")
        if not 0 <= index < 2**31:  # a C int
            raise ArgumentError(f"Device index must lie in [0, 2**31), got {index}")
        self.kind = kind
        self.index = index

    @staticmethod
    def parse(spec):
        """Accept a Device, 'cpu', 'reference', 'cuda', 'cuda:N', a BackendKind, or
        a torch.device ('cpu' or 'cuda:N', read as its name)."""
        if isinstance(spec, Device):
            return spec
        if _is_torch_device(spec):
            spec = str(spec)
        if isinstance(spec, BackendKind):
            return Device(int(spec), 0)
        if isinstance(spec, int) and not isinstance(spec, bool):  # True is no device either
            # a bare number would name a backend kind (0: reference), where torch's means a GPU
            hint = f": a GPU is 'cuda:{spec}' here" if spec >= 0 else ""
            raise ArgumentTypeError(f"Expected a device like 'cpu' or 'cuda:0', got the number {spec}{hint}")
        if not isinstance(spec, str):
            raise ArgumentTypeError(f"Expected a device like 'cpu' or 'cuda:0', got {spec!r}")
        name, _, idx = spec.strip().lower().partition(":")
        if name not in _KIND_BY_NAME:
            # t.to("float16") is torch's way to change a dtype
            hint = f" ({spec!r} is a dtype: t.astype({name!r}) converts a Tensor)" if name in _FLOAT_DTYPE_NAMES else ""
            raise ArgumentError(f"Unknown device {spec!r}: expected 'reference', 'cpu', 'cuda' or 'cuda:N'{hint}")
        if idx and not (idx.isascii() and idx.isdigit() and int(idx) < 2**31):  # a C int; '²' is a digit too
            raise ArgumentError(f"Bad device index in {spec!r}: expected e.g. 'cuda:0'")
        return Device(_KIND_BY_NAME[name], int(idx) if idx else 0)

    @property
    def backend(self):
        """The backend's name: 'reference', 'cpu' or 'cuda'."""
        return KIND_NAMES[self.kind]

    @property
    def is_host(self):
        """Whether the memory is the host's (reference, cpu), so numpy can view it."""
        return self.kind != QD_BACKEND_CUDA

    def __str__(self):
        if self.kind == QD_BACKEND_CUDA:
            return f"cuda:{self.index}"
        return KIND_NAMES[self.kind] if self.index == 0 else f"{KIND_NAMES[self.kind]}:{self.index}"

    def __repr__(self):
        return f"Device({str(self)!r})"

    def __eq__(self, other):
        if isinstance(other, str) or _is_torch_device(other):
            try:
                other = Device.parse(other)
            except (TypeError, ValueError):
                return False
        if not isinstance(other, Device):
            return NotImplemented
        return self.kind == (<Device>other).kind and self.index == (<Device>other).index

    def __hash__(self):
        # as its name's: equal to 'cpu' or 'cuda:1', a Device finds their entries in dicts and sets
        return hash(str(self))

    def __reduce__(self):
        return Device, (self.kind, self.index)


cdef class TensorBase:
    """What every tensor has: a device (kind + index, as C ints) and a shape."""

    @property
    def device(self):
        """Where the tensor lives: a Device ('cpu', 'reference', 'cuda:N')."""
        return Device(self.kind, self.index)

    @property
    def backend(self):
        """The device's backend name: 'reference', 'cpu' or 'cuda'."""
        return KIND_NAMES[self.kind]

    @property
    def ndim(self):
        """len(shape)."""
        return len(self.shape)

    @property
    def size(self):
        """The number of values: the product of shape."""
        return math.prod(self.shape)

    def __getattr__(self, str name):
        # Reached only where lookup failed.  numpy's methods (t.reshape, t.sum, q.item)
        # said no more than "no attribute": say where they are.  Protocol probes
        # (hasattr(t, "__array_interface__")) stay as cheap as a plain miss.
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        from . import tensor_api
        raise tensor_api.missing_attribute(self, name)

    def __matmul__(self, other):
        if _is_torch_tensor(other):
            return _torch_operator().matmul_operator(self, other)
        return q_matmul(self, other)

    def __rmatmul__(self, other):
        if _is_torch_tensor(other):
            return _torch_operator().matmul_operator(other, self)
        return q_matmul(other, self)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # `array @ t` reaches numpy's matmul ufunc: it must be the `@` of `t @ array`
        # (q_matmul), not numpy's product of the values, which wraps int8 sums
        from . import tensor_api
        return tensor_api.tensor_ufunc(ufunc, method, inputs, kwargs)

    # Arithmetic is numpy's on a Tensor's host values, as comparisons are: `t + 1` is
    # np.add(t, 1), an array.  A QTensor has none (tensor_api.tensor_arithmetic says why).
    def __add__(self, other): return _arithmetic("add", (self, other))
    def __radd__(self, other): return _arithmetic("add", (other, self))
    def __sub__(self, other): return _arithmetic("subtract", (self, other))
    def __rsub__(self, other): return _arithmetic("subtract", (other, self))
    def __mul__(self, other): return _arithmetic("multiply", (self, other))
    def __rmul__(self, other): return _arithmetic("multiply", (other, self))
    def __truediv__(self, other): return _arithmetic("true_divide", (self, other))
    def __rtruediv__(self, other): return _arithmetic("true_divide", (other, self))
    def __floordiv__(self, other): return _arithmetic("floor_divide", (self, other))
    def __rfloordiv__(self, other): return _arithmetic("floor_divide", (other, self))
    def __mod__(self, other): return _arithmetic("remainder", (self, other))
    def __rmod__(self, other): return _arithmetic("remainder", (other, self))
    def __pow__(self, other, modulo): return _arithmetic("power", (self, other))
    def __rpow__(self, other, modulo): return _arithmetic("power", (other, self))
    def __neg__(self): return _arithmetic("negative", (self,))
    def __pos__(self): return _arithmetic("positive", (self,))
    def __abs__(self): return _arithmetic("absolute", (self,))

    # `t += 1` would bind t to a new array while other names keep the tensor: refused
    def __iadd__(self, other): return _in_place("+=")
    def __isub__(self, other): return _in_place("-=")
    def __imul__(self, other): return _in_place("*=")
    def __itruediv__(self, other): return _in_place("/=")
    def __ifloordiv__(self, other): return _in_place("//=")
    def __imod__(self, other): return _in_place("%=")
    def __ipow__(self, other): return _in_place("**=")
    def __imatmul__(self, other): return _in_place("@=")


cdef object _arithmetic(str ufunc, tuple operands):
    from . import tensor_api
    return tensor_api.tensor_arithmetic(ufunc, operands)


cdef object _in_place(str op):
    raise ArgumentTypeError(f"A qdispatch tensor is not changed in place by `{op}`: write `t = t {op[:-1]} x` for an "
                            f"array of the result, or change a host Tensor's memory through np.asarray(t) (bfloat16: "
                            f"a copy), or a torch view of it (DLPack)")


cdef bint _is_torch(object obj, str kind):
    # only where torch is loaded already: none of its objects can exist otherwise
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, getattr(torch, kind))


cdef inline bint _is_torch_device(object obj):
    return _is_torch(obj, "device")


cdef inline bint _is_torch_tensor(object obj):
    return _is_torch(obj, "Tensor")


def _torch_operator():
    # `x @ w` with a torch tensor goes to qdispatch.torch, which returns a torch tensor
    # and keeps autograd (loaded on first use: qdispatch itself never imports torch)
    from . import torch as qd_torch
    return qd_torch


# The numpy dtype a host Tensor's payload holds each dtype a payload may hold in
# (bfloat16: its bits); C globals, as every result's Tensor() reads them.
cdef dict _HOST_STORAGE = {name: _np.dtype(storage) for name, storage in (
    ("float32", "float32"), ("float16", "float16"), ("bfloat16", "uint16"), ("int8", "int8"), ("int32", "int32"),
    ("uint32", "uint32"), ("int64", "int64"))}
cdef object _ndarray = _np.ndarray
# Bytes per value of each (the cuda module's device arrays too).
ITEMSIZE = {name: storage.itemsize for name, storage in _HOST_STORAGE.items()}


cdef inline bint _holds(object payload, object storage, tuple shape):
    """Whether a host payload is a numpy array of `storage` dtype and `shape` (numpy's
    dtypes of a kind are one object each, so `is` mostly decides: on every call's result)."""
    if not isinstance(payload, _ndarray):
        return False
    dtype = (<object>payload).dtype
    return (dtype is storage or dtype == storage) and (<object>payload).shape == shape


cdef class Tensor(TensorBase):
    """A dense tensor (float32/float16/bfloat16, or int8/int32) on a device.

    On host devices the payload is a numpy array and `np.asarray(t)` shares its
    memory; on CUDA it is device memory.  Both speak DLPack."""

    def __cinit__(self, payload, str dtype, tuple shape, int kind, int index=0):
        storage = _HOST_STORAGE.get(dtype)  # every dtype a payload may hold
        if storage is None or not 0 <= kind < QD_BACKEND_COUNT or index < 0:
            raise ArgumentError(f"Tensor({type(payload).__name__}, {dtype!r}, {shape}, {kind}, {index}) names no "
                                f"dtype and device: make tensors with qdispatch.tensor(data, dtype=..., device=...)")
        if kind != QD_BACKEND_CUDA and not _holds(payload, storage, shape):
            # a payload that is not what the tensor says gave results of the wrong shape
            raise ShapeError(f"A host Tensor's payload must be a numpy array of its shape {shape} and its dtype's "
                             f"storage ({dtype}), got {type(payload).__name__} {getattr(payload, 'dtype', '')}"
                             f"{getattr(payload, 'shape', '')}: make tensors with qdispatch.tensor(data, dtype=...)")
        self.payload = payload
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self.index = index

    def __array__(self, dtype=None, copy=None):
        from . import tensor_api
        return tensor_api.tensor_array(self, dtype, copy)

    def numpy(self):
        """A host numpy array of the values: on a host backend the tensor's own memory,
        except bfloat16 (numpy has no such type), which comes as a float32 copy; a copy
        from device memory on CUDA."""
        from . import tensor_api
        return tensor_api.tensor_numpy(self)

    def to(self, device):
        from . import tensor_api
        return tensor_api.tensor_to(self, device)

    def astype(self, dtype):
        """This tensor's values in another float dtype (float32, float16, bfloat16), a
        new Tensor on the same device, as numpy's astype; itself when it has that dtype."""
        from . import tensor_api
        return tensor_api.tensor_astype(self, dtype)

    def __dlpack__(self, *args, **kwargs):
        return backend_of(self.kind).dlpack(self, *args, **kwargs)

    def __dlpack_device__(self):
        return backend_of(self.kind).dlpack_device(self)

    @property
    def T(self):
        """The last two dims swapped (a view on host backends, as numpy's .T of a 2-D array)."""
        from . import tensor_api
        return tensor_api.tensor_transpose(self)

    @property
    def mT(self):
        """The last two dims swapped, as numpy's and torch's .mT (.T here too)."""
        return _matrix_transpose(self)

    def __len__(self):
        if not self.shape:
            raise ArgumentTypeError("len() of a 0-d tensor")  # as numpy says for a 0-d array
        return self.shape[0]

    def __bool__(self):
        # numpy's rule, not a container's (which __len__ would give): `if t:` on [0.0] is False
        if self.size == 0:
            raise ArgumentError("The truth value of an empty Tensor is ambiguous: "
                                "test its size (t.size > 0) instead")
        if self.size > 1:
            raise ArgumentError("The truth value of a Tensor of more than one value is ambiguous: "
                                "use t.numpy().any() or t.numpy().all()")
        return bool(self._only_value())

    def __float__(self):
        return float(self._only_value())

    def __int__(self):
        return int(self._only_value())

    def _only_value(self):
        if self.size != 1:
            raise ArgumentTypeError(f"Only a Tensor of one value converts to a Python number; this one holds "
                                    f"{self.size}: use t.numpy()")
        return self.numpy().reshape(-1)[0]

    @property
    def nbytes(self):
        """Bytes of its values in memory."""
        return self.size * ITEMSIZE[self.dtype]

    def __getitem__(self, key):
        """t[i], t[a:b], t[i, a:b]: integers on leading axes, then at most one slice of
        step 1; a view of t's memory on every device (no copy)."""
        from . import tensor_api
        return tensor_api.tensor_getitem(self, key)

    def __setitem__(self, key, value):
        # Python's "does not support item assignment" named no way to change values
        raise ArgumentTypeError("A Tensor's values are not assigned in place: change them in numpy "
                                "(t.numpy() is a copy for a GPU tensor) and make a tensor of the result, "
                                "qdispatch.tensor(array, device=t.device)")

    def __iter__(self):
        # without it Python would iterate through __getitem__, and a 1-D tensor
        # (whose elements are not Tensors) would look empty
        if not self.shape:
            raise ArgumentTypeError("iteration over a 0-d Tensor")  # as numpy says for a 0-d array
        if len(self.shape) < 2:
            raise ArgumentTypeError("A 1-D Tensor's elements are not Tensors: iterate over t.numpy()")
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device='{self.device}')"

    def __richcmp__(self, other, int op):
        # value by value, as numpy compares (identity, the default, said that two tensors
        # of equal values differ); a host array of bools
        from . import tensor_api
        return tensor_api.tensor_compare(self, other, op)

    def __hash__(self):  # by identity, as before: comparisons don't make tensors equal keys
        return object.__hash__(self)

    def __reduce__(self):
        # pickle and deepcopy: the values through the host, back on the same device
        from . import tensor_api
        return tensor_api.tensor, tensor_api.tensor_stored(self)

    def __copy__(self):
        from . import tensor_api
        return tensor_api.tensor_copy(self)


QTENSOR_NOT_COMPARED = ("QTensors are not compared value by value: compare q.dequantize().numpy(), or "
                        "q.values and q.scales")


cdef class QTensor(TensorBase):
    """Quantized values + scales + logical shape + scheme + device.

    Storage belongs to the backend (it may keep pre-packed weight panels);
    `.values` and `.scales` always give the logical values as numpy arrays."""

    def __array__(self, dtype=None, copy=None):
        # without it numpy would wrap the QTensor in a 0-d object array, silently
        raise ArgumentTypeError("A QTensor is no dense array: use q.dequantize().numpy() for its float values, "
                                "or q.values and q.scales for what it stores")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # torch calls this for a QTensor among a torch function's arguments: a layer's
        # weight in F.linear(x, layer.weight) multiplies; other functions run as without it
        return _torch_operator().torch_function(func, args, kwargs or {})

    def __cinit__(self, storage, layout, bint transposed, int kind, int index=0, tuple shape=None):
        if not 0 <= kind < QD_BACKEND_COUNT or index < 0 or not hasattr(layout, "logical_shape"):
            raise ArgumentError(f"QTensor({type(storage).__name__}, {type(layout).__name__}, ...) names no layout "
                                f"and device: make QTensors with qdispatch.quantize() or "
                                f"qdispatch.qtensor_from_parts()")
        self.storage = storage
        self.layout = layout
        self.transposed = transposed
        self.kind = kind
        self.index = index
        self.shape = tuple(layout.logical_shape(transposed)) if shape is None else shape

    @property
    def scheme(self):
        """The QuantScheme as this tensor is seen (a transpose's blocks and axis swapped)."""
        return self.layout.logical_scheme(self.transposed)

    @property
    def values(self):
        """The integer values as an int8 numpy array of the tensor's shape (a copy, unpacked)."""
        from . import tensor_api
        return tensor_api.qtensor_values(self)

    @property
    def scales(self):
        """The scales as a float32 numpy array (a copy): 0-d per tensor, one per index of
        the axis, or the grid of blocks."""
        from . import tensor_api
        return tensor_api.qtensor_scales(self)

    @property
    def nbytes(self):
        """Bytes the stored values and scales take (packed 4- and 2-bit values as stored).
        A backend may hold them in a layout of its own instead (the cpu backend's kernel
        panels, the cuda backend's decode tiles), of about as many bytes."""
        from . import tensor_api
        return tensor_api.qtensor_nbytes(self)

    def dequantize(self, dtype="float32"):
        """The float values (values * scales) as a Tensor of `dtype` on this device."""
        from . import tensor_api
        return tensor_api.dequantize(self, dtype)

    def to(self, device):
        from . import tensor_api
        return tensor_api.qtensor_to(self, device)

    @property
    def requires_grad(self):
        """Always False: a QTensor is a constant to autograd (see qdispatch.torch)."""
        return False

    @property
    def T(self):
        """A free transpose of the last two dims (block dims swap with them)."""
        if len(self.shape) < 2:
            return self
        return QTensor(self.storage, self.layout, not self.transposed, self.kind, self.index,
                       self.shape[:-2] + (self.shape[-1], self.shape[-2]))

    @property
    def mT(self):
        """The last two dims swapped, as numpy's and torch's .mT (.T here too)."""
        return _matrix_transpose(self)

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, key):
        # a slice of quantized values would have to cut scale blocks: name the ways that exist
        raise ArgumentTypeError(f"A QTensor can't be indexed: its rows come dequantized through "
                                f"qdispatch.embedding(ids, q) (those rows only) or q.dequantize().numpy()[...]")

    def __dlpack__(self, *args, **kwargs):
        # torch.from_dlpack(q) would otherwise fail in torch's words, naming no fix
        raise DLPackExportError("A QTensor has no DLPack form (DLPack has no type for quantized values with "
                                "scales): export q.dequantize() for its float values, or q.values and q.scales")

    def __dlpack_device__(self):
        return backend_of(self.kind).dlpack_device(self)

    def __repr__(self):
        return (f"QTensor(shape={self.shape}, scheme={self.scheme!r}, "
                f"device='{self.device}', nbytes={self.nbytes})")

    def __bool__(self):
        # len() would make it True, as a container: numpy-style data has no one truth value
        raise ArgumentTypeError("A QTensor has no truth value: test `q is not None`, or q.dequantize().numpy().any()")

    def __float__(self):
        # Python's own TypeError named no way to the value, as float(t) of a 0-d Tensor has
        raise ArgumentTypeError("A QTensor is no number for float() or int(): its values as floats are "
                                "q.dequantize().numpy() (float(...) of that for a single one)")

    def __int__(self):
        return self.__float__()

    def __richcmp__(self, other, int op):
        # Against data (an array, a Tensor, a number) the default said False, as if values had
        # been compared; between QTensors it stays identity, a weight's handle, so `w in seen` works.
        # Ordering has no such meaning against anything (Python's own TypeError said so untyped).
        if op not in (Py_EQ, Py_NE):
            raise ArgumentTypeError(QTENSOR_NOT_COMPARED)
        if isinstance(other, (TensorBase, int, float)) or hasattr(other, "__array__"):
            if not isinstance(other, QTensor):
                raise ArgumentTypeError(QTENSOR_NOT_COMPARED)
        return NotImplemented

    def __hash__(self):  # by identity: weak sets and caches key on QTensors
        return object.__hash__(self)

    def __reduce__(self):
        # pickle and copy: the store as a file keeps it, rebuilt on the same device
        from . import io
        return io.qtensor_unpickled, io.qtensor_reduced(self)


def _matrix_transpose(t):
    """t.mT: t.T, refused below 2 dims, where numpy and torch refuse .mT (.T keeps a vector)."""
    if len(t.shape) < 2:
        raise ShapeError(f".mT swaps the last two dims, and a tensor of shape {tuple(t.shape)} has fewer "
                         f"(numpy and torch refuse it too); .T leaves a vector as it is")
    return t.T


# ---- dispatch -----------------------------------------------------------------

cdef str _no_qtensor_operand(lhs, rhs):
    """q_matmul's refusal of two dense operands, with the call that multiplies them."""
    names = [str(getattr(x, "dtype", type(x).__name__)).removeprefix("torch.") for x in (lhs, rhs)]
    if names == ["int8", "int8"]:
        instead = "qdispatch.int_matmul(a, b) gives the exact int32 product of two int8 tensors"
    else:
        instead = "multiply dense data in numpy or torch (np.asarray(t) and torch.from_dlpack(t) view a Tensor)"
    return (f"q_matmul (also @ on qdispatch tensors) needs a QTensor operand, got {names[0]} and {names[1]} "
            f"dense data: quantize one side (qdispatch.quantize), or {instead}")


def _operand(x, TensorBase other, float_for=None):
    """Tensors pass through; numpy arrays (or anything array-like) join the
    other operand's device (as float data only, when `float_for` names the op)."""
    if isinstance(x, TensorBase):
        return x
    from . import tensor_api
    return tensor_api.as_host_operand(x, other, float_for)


cdef _check_transfer(transfer):
    """A bad `transfer=` is an error whether or not the operands need a move."""
    from . import policy
    policy.resolve(transfer)


cdef tuple _reconcile(str op, TensorBase lhs, TensorBase rhs, transfer, str lname="lhs", str rname="rhs"):
    """Called only when the devices differ: apply the transfer policy or raise,
    naming the operands as the caller's signature does."""
    from . import policy
    mode = policy.resolve(transfer)
    if mode == "error":
        ld, rd = str(lhs.device), str(rhs.device)
        move = f"Move one operand first ({rname}.to({ld!r}) or {lname}.to({rd!r}))"
        if lhs.kind != rhs.kind:
            raise BackendMismatchError(
                f"{op} inputs are on different backends: {lname} is on {ld!r}, {rname} is on {rd!r}. "
                f"{move}, or pass transfer='auto'.")
        raise DeviceMismatchError(
            f"{op} inputs are on different devices of the {lhs.backend} backend: {lname} is on {ld!r}, "
            f"{rname} is on {rd!r}. {move}, or pass transfer='to_lhs'.")
    if mode == "auto":
        mode = "to_rhs" if _SPEED_RANK[rhs.kind] > _SPEED_RANK[lhs.kind] else "to_lhs"
    if mode == "to_lhs":
        return lhs, rhs.to(lhs.device)
    return lhs.to(rhs.device), rhs


def q_matmul(lhs, rhs, *, out_dtype="float32", transfer=None, requantize=None,
             activation_scheme=None):
    """`lhs @ rhs` where at least one side is a QTensor; both must be on one device.

    A float side (a Tensor or numpy array of float32/float16/bfloat16) times a
    QTensor is `float @ dequantize(q)` in float32; two QTensors multiply their
    integers exactly and scale the sums.  Batch dims broadcast as numpy's matmul.

    out_dtype: the result's dtype, "float32" (default), "float16" or "bfloat16".
    activation_scheme: quantize the float side on the fly (W8A8 with an int8
        weight).  A value name such as "q8s" means one scale per token (per row of a
        float lhs, per column of a float rhs); a QuantScheme is taken as given, so
        QuantScheme("q8s") is one scale for the whole tensor.
    requantize: a QuantScheme (or name) for the result: a QTensor is returned,
        quantized from the float32 sums (out_dtype must then stay "float32").
    transfer: what to do when the operands are on different devices: "error"
        (default: BackendMismatchError / DeviceMismatchError naming both sides),
        or a policy that moves one ("auto", "to_lhs", "to_rhs"); the
        `transfer_policy()` context sets it for a region."""
    cdef TensorBase l, r
    if transfer is not None:
        _check_transfer(transfer)
    if not isinstance(lhs, QTensor) and not isinstance(rhs, QTensor):
        raise ArgumentTypeError(_no_qtensor_operand(lhs, rhs))
    # a numpy operand can only be the float side (a QTensor never comes from numpy)
    l = _operand(lhs, rhs if isinstance(rhs, TensorBase) else None, "q_matmul")
    r = _operand(rhs, l, "q_matmul")
    if l.kind != r.kind or l.index != r.index:
        l, r = _reconcile("q_matmul", l, r, transfer)
    backend = <object>_table[l.kind]
    if requantize is None and activation_scheme is None:
        if type(out_dtype) is not str:  # np.str_ or np.float16: the name, as a str
            out_dtype = ops_module().check_dtype(out_dtype)
        out = _decode_step(backend, l, r, out_dtype)
        if out is not None:
            return out
    return ops_module().q_matmul(backend, l, r, out_dtype, requantize, activation_scheme)


cdef object _decode_step(object backend, TensorBase lhs, TensorBase rhs, object out_dtype):
    """x[..., M, K] @ w[K, N] for a 2-D QTensor w, straight to the backend's fq
    kernel when it reads x's dtype and writes out_dtype itself: the product
    ops.q_matmul would run (batch dims folded into M: one kernel, one weight pass),
    without its general checks, since it runs once per layer per generated token
    (a model's activations are [batch, tokens, K]).  None when anything else is
    asked (ops.q_matmul takes it)."""
    if type(lhs) is not Tensor or type(rhs) is not QTensor:
        return None
    cdef Tensor x = <Tensor>lhs
    cdef tuple xs = x.shape, ws = rhs.shape
    fq_dtypes = backend.fq_dtypes
    if (len(xs) < 2 or len(ws) != 2 or xs[-1] != ws[0] or not xs[-1] or not ws[1]
            or x.dtype not in fq_dtypes or out_dtype not in fq_dtypes):
        return None
    cdef tuple out_shape = xs[:-1] + (ws[1],)
    if len(xs) == 2:
        if not xs[0]:
            return None
        return Tensor(backend.fq_matmul(x.payload, rhs, out_dtype), out_dtype, out_shape, x.kind, x.index)
    rows = math.prod(xs[:-1])
    if not rows:
        return None
    out = backend.fq_matmul(backend.reshape(x.payload, (rows, xs[-1])), rhs, out_dtype)
    return Tensor(backend.reshape(out, out_shape), out_dtype, out_shape, x.kind, x.index)


def int_matmul(a, b, *, transfer=None):
    """Exact int8 x int8 -> int32 matrix product, any shape (M = 1 included).

    transfer: what to do when a and b are on different devices, as for q_matmul."""
    cdef TensorBase l, r
    if transfer is not None:
        _check_transfer(transfer)
    from . import tensor_api
    l = tensor_api.as_int8_host_operand(a, b if isinstance(b, TensorBase) else None, "a")
    r = tensor_api.as_int8_host_operand(b, l, "b")
    if l.kind != r.kind or l.index != r.index:
        l, r = _reconcile("int_matmul", l, r, transfer, "a", "b")
    return ops_module().int_matmul(<object>_table[l.kind], l, r)


def linear(x, w, bias=None, *, out_dtype="float32", transfer=None, activation_scheme=None):
    """`x @ w.T + bias` for a QTensor weight w stored [out_features, in_features].

    bias: [out_features] floats (a Tensor or array), added to the float32 product
    before the cast to out_dtype.  out_dtype, activation_scheme and transfer as
    for q_matmul (activation_scheme="q8s": one scale per row of x, W8A8)."""
    if not isinstance(w, QTensor):
        raise ArgumentTypeError(f"linear expects a QTensor weight, got {type(w).__name__}: quantize it first")
    if isinstance(x, QTensor) and activation_scheme is not None:  # in linear's words, not q_matmul's
        raise ArgumentError(f"linear got activation_scheme={activation_scheme!r}, but x is a QTensor already: it "
                            f"quantizes a float x on the fly; leave it out")
    x = _operand(x, <TensorBase>w, "linear")  # as q_matmul takes it: a GPU tensor of torch's stays on its GPU
    _check_linear_shapes((<TensorBase>x).shape, (<QTensor>w).shape)
    if isinstance(x, Tensor) and (<Tensor>x).dtype not in ("float32", "float16", "bfloat16"):
        from . import tensor_api  # the words linear uses for integer numpy data
        raise tensor_api._not_float_error((<Tensor>x).dtype, "linear")
    if not same_device(<TensorBase>x, <TensorBase>w):  # named as linear's
        x, w = _reconcile("linear", <TensorBase>x, <TensorBase>w, transfer, "x", "w")
    # Without a bias the product is the result: the kernel writes out_dtype itself.
    out = q_matmul(x, (<QTensor>w).T, out_dtype="float32" if bias is not None else out_dtype,
                   transfer=transfer, activation_scheme=activation_scheme)
    if bias is None:
        return out
    return ops_module().add_bias(out, bias, out_dtype, transfer)


cdef _check_linear_shapes(tuple x_shape, tuple w_shape):
    """In linear's own terms: q_matmul's error would name w.T, which the caller never wrote."""
    if len(w_shape) < 2:
        raise ShapeError(f"linear's weight w must be [out_features, in_features], got a QTensor of shape {w_shape}")
    if len(x_shape) == 0:
        raise ShapeError(f"linear's x must be a vector of {w_shape[-1]} features or rows of them, got a single "
                         f"number (shape ())")
    if x_shape[-1] != w_shape[-1]:
        raise ShapeError(f"linear's x has {x_shape[-1]} features (shape {tuple(x_shape)}) but its weight w "
                         f"[out_features, in_features] takes {w_shape[-1]} (shape {w_shape}): x @ w.T needs "
                         f"x's last dim to be w's")


def dlpack_as_bfloat16(capsule):
    """numpy's DLPack capsule of a host bfloat16 tensor's uint16 bits, its elements
    retyped as bfloat16 (numpy has no such type, DLPack has): the consumer then sees
    the values without a copy.  Only an unconsumed capsule of 16-bit unsigned data."""
    return _retyped(capsule, kDLUInt, kDLBfloat, "dlpack_as_bfloat16", "the uint16 bits of bfloat16 values")


def dlpack_bfloat16_bits(capsule):
    """The inverse: a producer's capsule of bfloat16 values retyped as their uint16
    bits, which numpy can take (in place)."""
    return _retyped(capsule, kDLBfloat, kDLUInt, "dlpack_bfloat16_bits", "bfloat16 values")


cdef object _retyped(object capsule, int code, int new_code, str name, str expects):
    cdef DLTensor *t
    if PyCapsule_IsValid(capsule, b"dltensor_versioned"):
        t = &(<DLManagedTensorVersioned *>PyCapsule_GetPointer(capsule, b"dltensor_versioned")).dl_tensor
    elif PyCapsule_IsValid(capsule, b"dltensor"):
        t = &(<DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")).dl_tensor
    else:
        raise ArgumentTypeError(f"{name} expects an unconsumed DLPack capsule")
    if t.dtype.code != code or t.dtype.bits != 16 or t.dtype.lanes != 1:
        raise ArgumentTypeError(f"{name} expects {expects}")
    t.dtype.code = new_code
    return capsule
