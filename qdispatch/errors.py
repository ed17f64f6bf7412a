"""The exception tree.  Every error is a `QDispatchError` and also the builtin
exception a Python user would reach for, so `except ValueError` keeps working.
Only the file system's own errors (a missing folder, no permission) stay `OSError`."""


class QDispatchError(Exception):
    """Base class of every error qdispatch raises on purpose."""


class BackendMismatchError(QDispatchError, TypeError):
    """Two operands live on different backends (for example 'cpu' and 'cuda:0')."""


class DeviceMismatchError(QDispatchError, ValueError):
    """Two operands share a backend kind but not a device index (cuda:0 vs cuda:1)."""


class WrongBackendError(QDispatchError, TypeError):
    """A tensor is on another backend than the operation requires."""


class QuantSchemeError(QDispatchError, ValueError):
    """A quantization scheme is invalid, or does not fit the tensor it is used with."""


class ShapeError(QDispatchError, ValueError):
    """Operand shapes do not fit the operation."""


class OutOfRangeError(QDispatchError, IndexError):
    """An index is outside the axis it indexes (an embedding id past the table's rows)."""


class NonFiniteError(QDispatchError, ValueError):
    """The input to quantize holds NaN or Inf."""


class ScaleOverflowError(QuantSchemeError):
    """A scale does not fit in the scheme's scale dtype, or times a value of its
    block lies past float32's range (dequantize would give inf)."""


class ScaleUnderflowWarning(UserWarning):
    """Scales so small that float16, the scheme's scale dtype, holds them in few
    steps: rounding them up may have enlarged them, and their blocks keep fewer levels."""


class ArgumentTypeError(QDispatchError, TypeError):
    """An argument or operand of a type the call doesn't take (and what Python's
    protocols raise as TypeError: len() of a 0-d Tensor, a QTensor's missing operators)."""


class ArgumentError(QDispatchError, ValueError):
    """An argument of the right type whose value the call doesn't take: an unknown
    name or option, or (as numpy says) the truth value of a Tensor of many values."""


class UnsupportedIndexError(QDispatchError, IndexError):
    """An index a Tensor view doesn't take: numpy's basic indexing but for steps and new axes."""


class NotFoundError(QDispatchError, KeyError):
    """A name asked for is not there: a tensor the file doesn't hold."""

    def __str__(self):  # KeyError's repr()s its message, quotes and all
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class DLPackExportError(QDispatchError, BufferError):
    """A Tensor can't be shared through DLPack as asked: only a copy can give it."""


class BackendUnavailableError(QDispatchError, RuntimeError):
    """A backend was not built into this copy of qdispatch, or has no device."""


class KernelError(QDispatchError, RuntimeError):
    """A C or CUDA kernel reported a failure; the message carries its status text."""


class OutOfMemoryError(KernelError, MemoryError):
    """A kernel could not allocate the memory it works in; nothing was changed."""


class CudaOutOfMemoryError(OutOfMemoryError):
    """The GPU has not enough free memory for an allocation; nothing was changed."""


class SerializationError(QDispatchError, ValueError):
    """A file can't be written or read back: truncated, corrupted, an unknown
    format version, or stored bytes that do not match their recorded scheme."""


# Said wherever a CUDA graph capture meets qdispatch's work (which would invalidate it).
NOT_IN_CUDA_GRAPHS = ("qdispatch queues its work on the legacy default stream, which can't be part of "
                      "a CUDA graph: only qdispatch.torch's products (QLinear, q_matmul) and lookups (QEmbedding) are "
                      "captured; "
                      "run other qdispatch calls outside the captured region")


def byte_size(nbytes):
    """A byte count as messages give it: "76293.9 MiB", "2.5 GiB", "32.0 KiB"."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"
