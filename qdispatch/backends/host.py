"""What the two host backends (reference and cpu) share: numpy payloads and
quantized storage in the scheme's own store (int8, or packed uint32)."""
import numpy as np

from .. import quantmath
from .._core import dlpack_as_bfloat16
from ..errors import ArgumentError, ArgumentTypeError, DLPackExportError
from .base import Backend, QStorage

# numpy 2.1 reads and writes DLPack 1.0: versioned capsules, and __dlpack__'s max_version,
# dl_device and copy; numpy before it takes stream alone
NUMPY_DLPACK_1 = np.lib.NumpyVersion(np.__version__) >= "2.1.0"


class HostQStorage(QStorage):
    """A QStorage of numpy arrays (the cpu backend releases a weight's store to its
    kernel panels)."""
    __slots__ = ()


class HostBackend(Backend):
    # The packed_u32 store's codec: numpy's, the spec (the cpu backend runs it in C)
    pack_u32 = staticmethod(quantmath.pack_u32)
    unpack_u32 = staticmethod(quantmath.unpack_u32)

    def unavailable_reason(self, index=0):
        if index != 0:
            return f"The {self.name} backend has one device, '{self.name}'; there is no {self.name}:{index}"
        return None

    def from_host(self, array, index):
        return array

    def to_host(self, payload):
        return payload

    def qstorage_from_host(self, values, scales, layout, index):
        values = np.ascontiguousarray(values, dtype=np.int8)
        if layout.scheme.store == "packed_u32":
            values = self.pack_u32(values, layout.bits)
        return HostQStorage(values, np.ascontiguousarray(scales, dtype=np.float32))

    def qstorage_scales_to_host(self, storage):
        return storage.scales

    def qstorage_to_host(self, storage, layout):
        values = storage.values
        if layout.scheme.store == "packed_u32":
            values = self.unpack_u32(values, layout.bits, layout.shape[-1])
        return values, storage.scales

    def quantize(self, payload, layout, index):
        values, scales, _ = quantmath.quantize_array(payload, layout.scheme)
        return self.qstorage_from_host(values, scales, layout, index)

    def logical(self, q):
        """int8 values and float32 scale grid of QTensor q, logical orientation."""
        values, scales = self.qstorage_to_host(q.storage, q.layout)
        if q.transposed:
            values, scales = np.swapaxes(values, -1, -2), np.swapaxes(scales, -1, -2)
        return values, scales

    def qq_in_groups(self, lhs, rhs, int_products):
        """qq by its arithmetic (quantmath.qq_in_groups) on the host values, each
        K-group's exact sums from int_products(a [M, G], b [G, N])."""
        a, sa = self.logical(lhs)
        b, sb = self.logical(rhs)
        return quantmath.qq_in_groups(lambda k0, k1: int_products(a[:, k0:k1], b[k0:k1]),
                                      sa, lhs.layout.logical_block(lhs.transposed),
                                      sb, rhs.layout.logical_block(rhs.transposed), *a.shape, b.shape[1])

    def dequantize(self, q, dtype="float32"):
        values, scales = self.logical(q)
        return self.cast(quantmath.dequantize_array(values, scales, q.layout.logical_block(q.transposed)),
                         "float32", dtype)

    def dequantize_rows(self, q, rows, dtype):
        br, bc = q.layout.logical_block(q.transposed)
        if q.transposed:  # the rows are stored as columns: read those columns only
            values = quantmath.stored_columns(q.storage.values, rows, q.layout.bits,
                                              q.layout.scheme.store == "packed_u32").T
            scales = np.swapaxes(q.storage.scales, -1, -2)
        else:
            values, scales = q.storage.values[rows], q.storage.scales
            if q.layout.scheme.store == "packed_u32":
                values = self.unpack_u32(values, q.layout.bits, q.shape[-1])
        # each row's scales broadcast over their blocks (no repeated scale array): the
        # same float32 products as dequantize_array
        n, D = values.shape
        out = values.astype(np.float32).reshape(n, D // bc, bc)
        out *= scales[rows // br][:, :, None]  # finite: QTensors that would overflow are refused when made
        return self.cast(out.reshape(n, D), "float32", dtype)

    def qstorage_view(self, values, scales):
        return HostQStorage(values, scales)

    def qstorage_item(self, storage, index, scale_index):
        # values packed along the last dim index by their leading dims as they are
        return HostQStorage(storage.values[index], np.ascontiguousarray(storage.scales[scale_index]))

    # ---- dense helpers the dispatcher uses ----
    def cast(self, payload, src, dst):
        if src == dst:
            return payload
        f32 = quantmath.bf16_bits_to_f32(payload) if src == "bfloat16" else np.asarray(payload, np.float32)
        if dst == "bfloat16":
            return quantmath.f32_to_bf16_bits(f32)
        with np.errstate(over="ignore"):  # past float16's range is inf, as IEEE rounds it: no warning
            return f32.astype(np.float16 if dst == "float16" else np.float32)

    def reshape(self, payload, shape):
        return np.reshape(payload, shape)

    def transpose2(self, payload):
        return np.swapaxes(payload, -1, -2)

    def index(self, payload, idx):
        return payload[idx]

    def slice_rows(self, payload, start, stop):
        return payload[start:stop]

    def stack(self, payloads, shape):
        """The arrays of iterable `payloads` as one new array of `shape`, each written
        as it comes: the whole is allocated at the first, so a result too large for
        memory fails then, not once every item is held."""
        out = items = None
        for i, p in enumerate(payloads):
            if out is None:
                out = np.empty(shape, p.dtype)
                items = out.reshape((-1,) + p.shape)
            items[i] = p
        return out

    def add(self, payload, bias):
        with np.errstate(over="ignore"):  # past float32's range is inf, as every product's is
            return payload + bias

    def dlpack(self, t, *args, **kwargs):
        payload = np.asarray(t.payload)
        if min(payload.strides, default=0) < 0 and kwargs.get("copy") is not True:
            # DLPack allows them, but torch's import aborts the process on one
            raise DLPackExportError(f"A Tensor with negative strides {payload.strides} is not shared through DLPack, "
                                    f"as torch aborts on them: ask for a copy (copy=True), or copy it first "
                                    f"(qdispatch.tensor(t.numpy().copy(), dtype=t.dtype))")
        if not payload.flags.writeable and kwargs.get("copy") is not True:
            # DLPack 1.0 can flag it, but torch ignores the flag: its tensor would write
            # into the memory (a bytes object, a file mapped read-only: a crash)
            raise DLPackExportError("A Tensor over read-only memory is not shared through DLPack, as torch would "
                                    "take it as writable: ask for a copy (copy=True; qdispatch.torch.to_torch "
                                    "copies it), or copy it first (qdispatch.tensor(t.numpy().copy(), dtype=t.dtype))")
        try:
            capsule = _exported(payload, kwargs).__dlpack__(*args, **kwargs)
        except BufferError as exc:  # numpy's words for a device or copy it can't give
            raise DLPackExportError(f"A host Tensor can't be exported so: {exc}") from None
        except TypeError as exc:
            raise ArgumentTypeError(f"__dlpack__ of a host Tensor: {exc}") from None
        except (RuntimeError, ValueError) as exc:  # stream=5: numpy's RuntimeError
            raise ArgumentError(f"__dlpack__ of a host Tensor: {exc}") from None
        if t.dtype == "bfloat16":  # numpy exports the payload's bits as uint16
            return dlpack_as_bfloat16(capsule)
        return capsule

    def dlpack_device(self, t):
        return (1, 0)  # kDLCPU


def _exported(payload, kwargs):
    """The array to export.  dl_device and copy are taken out of `kwargs` and applied
    here, as numpy 2.2 applies them, on every numpy: 2.1 refused another device as a
    ValueError and left its copies of read-only memory read-only, and numpy before 2.1
    takes stream alone, so max_version is checked here too, and the capsule is then
    unversioned whatever it says, which the protocol allows."""
    dl_device = kwargs.pop("dl_device", None)
    if dl_device is not None and tuple(dl_device) != (1, 0):
        raise BufferError(f"dl_device={dl_device!r}: a host Tensor is on the CPU, (1, 0), and is exported there")
    copy = kwargs.pop("copy", None)
    if copy is not None and not isinstance(copy, bool):
        raise ValueError(f"copy must be True, False or None, got {copy!r}")
    if not NUMPY_DLPACK_1:
        max_version = kwargs.pop("max_version", None)
        if max_version is not None and not (isinstance(max_version, tuple) and len(max_version) == 2):
            raise TypeError(f"max_version must be None or a (major, minor) tuple, got {max_version!r}")
    return payload.copy() if copy else payload
