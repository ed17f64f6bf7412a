"""qdispatch: quantized tensors that know which backend they live on.

    >>> import numpy as np, qdispatch as qd
    >>> w = qd.quantize(np.random.randn(64, 32).astype(np.float32), qd.QuantScheme("q8s", axis=0))
    >>> y = qd.linear(np.random.randn(4, 32).astype(np.float32), w)
    >>> y.shape
    (4, 64)
"""
from ._version import __version__
try:
    from ._core import BackendKind, Device, QTensor, Tensor, int_matmul, linear, q_matmul
except ModuleNotFoundError as _missing:  # the compiled modules are not beside this file
    if _missing.name != f"{__name__}._core":
        raise
    raise ImportError(f"qdispatch's compiled modules are missing from {__path__[0]}: this is the source tree, "
                      f"or a copy that was never built. Install it (pip install .) and import it from another "
                      f"directory") from None
from .errors import (ArgumentError, ArgumentTypeError, BackendMismatchError, BackendUnavailableError,
                     CudaOutOfMemoryError, DeviceMismatchError, DLPackExportError, KernelError, NonFiniteError,
                     NotFoundError, OutOfMemoryError, OutOfRangeError, QDispatchError, QuantSchemeError,
                     ScaleOverflowError, ScaleUnderflowWarning, SerializationError, ShapeError, UnsupportedIndexError,
                     WrongBackendError)
from .scheme import QuantScheme
from .backends import reference as _reference  # noqa: F401  (registers the backend)
from .backends import cpu as _cpu_backend  # noqa: F401
from .backends import cuda as _cuda_backend  # noqa: F401
from .policy import batch_invariant, default_device, set_batch_invariant, set_default_backend, transfer_policy
from .tensor_api import dequantize, embedding, from_dlpack, quantize, qtensor_from_parts, tensor
from .io import load, save
from .metrics import ErrorReport, error_report
from .gpu import empty_cache, memory_info, synchronize
from .info import available_backends, get_cmake_dir, get_include, get_library_dir, info, set_isa, \
    set_num_threads, get_num_threads

__all__ = [
    "__version__", "BackendKind", "Device", "QTensor", "Tensor", "QuantScheme",
    "quantize", "dequantize", "embedding", "tensor", "from_dlpack", "qtensor_from_parts",
    "q_matmul", "int_matmul", "linear", "save", "load", "error_report", "ErrorReport",
    "transfer_policy", "set_default_backend", "default_device", "set_batch_invariant", "batch_invariant",
    "info", "available_backends", "get_include", "get_library_dir", "get_cmake_dir",
    "set_isa", "set_num_threads", "get_num_threads", "memory_info", "empty_cache", "synchronize",
    "QDispatchError", "BackendMismatchError", "DeviceMismatchError", "WrongBackendError",
    "QuantSchemeError", "ShapeError", "OutOfRangeError", "NonFiniteError", "ScaleOverflowError",
    "BackendUnavailableError", "KernelError", "OutOfMemoryError", "CudaOutOfMemoryError", "SerializationError",
    "ArgumentTypeError", "ArgumentError", "UnsupportedIndexError", "NotFoundError", "DLPackExportError",
    "ScaleUnderflowWarning",
]
