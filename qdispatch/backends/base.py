"""The contract every backend fulfils.

The dispatcher has already checked that operands share a device, validated
shapes, dtypes and schemes, and reduced batched calls to 2-D ones; a backend
only moves data and runs kernels.  Payloads (dense data) and storages
(quantized data) are the backend's own objects."""

from .. import quantmath


class QStorage:
    """Values in the scheme's store plus a float32 scale grid; `cache` holds what a
    backend derives from them.  Where a derived form holds every value (the cpu
    backend's kernel panels, the cuda backend's decode tiles), the store may be
    released to it: `read_back()` then rebuilds it for each use, so that a weight
    takes its size once."""
    __slots__ = ("_values", "_read_back", "scales", "cache")

    def __init__(self, values, scales):
        self._values, self._read_back = values, None
        self.scales = scales
        self.cache = {}

    @property
    def values(self):
        return self._values if self._values is not None else self._read_back()

    @property
    def holds_values(self):
        """Whether the store is in memory (False once released)."""
        return self._values is not None

    @property
    def released_to(self):
        """The `read_back` the store was released to, or None while it is in memory."""
        return self._read_back if self._values is None else None

    def release_values(self, read_back):
        """Drop the store; `read_back()` gives it again, from memory that holds every value."""
        self._values, self._read_back = None, read_back

    def restore_values(self, values):
        """Hold the store again (`values`, as read back), for a backend that lets go of
        the derived form instead."""
        self._values, self._read_back = values, None


class Backend:
    kind: int          # a qdispatch._core.BackendKind value
    name: str          # 'reference', 'cpu', 'cuda'

    # ---- availability ----
    def unavailable_reason(self, index=0):
        """None when device `index` of this backend can run; else why not."""
        raise NotImplementedError

    # ---- dense data ----
    def from_host(self, array, index):
        """A payload holding `array` (numpy; bfloat16 as uint16 bit patterns)."""
        raise NotImplementedError

    def to_host(self, payload):
        raise NotImplementedError

    # ---- quantized data ----
    def qstorage_from_host(self, values, scales, layout, index):
        """Storage for int8 `values` (storage orientation) and a float32 scale grid."""
        raise NotImplementedError

    def qstorage_scales_to_host(self, storage):
        """The float32 scale grid of `storage` on the host (its values left where they are)."""
        raise NotImplementedError

    def qstorage_to_host(self, storage, layout):
        """(int8 values, float32 scale grid) exactly as they were stored."""
        raise NotImplementedError

    def qstorage_largest_scale(self, storage):
        """The largest magnitude among `storage`'s scales, a Python float."""
        return quantmath.largest_magnitude(self.qstorage_scales_to_host(storage))

    # dtypes whose payloads quantize reads as they are; others come as a float32 copy
    quantize_dtypes = ("float32",)

    def quantize(self, payload, layout, index):
        """A payload of one of quantize_dtypes -> QStorage, the bits of its float32 values."""
        raise NotImplementedError

    def qtensor_batch(self, q, index):
        """The 2-D QTensor at batch `index` (a tuple over q's leading dims).  Its
        storage is kept in q's, so what a backend derives from it (weight panels,
        decode tiles) is made once, as for a 2-D weight, not on every call."""
        from .._core import QTensor
        from ..layout import QLayout
        block = q.layout.block
        # A slice's granularity is a 2-D block, whatever the parent's was.
        layout = QLayout(q.layout.scheme.with_(block=block[len(index):], axis=None),
                         q.layout.shape[len(index):], block[len(index):])
        key = ("batch item", index)
        storage = q.storage.cache.get(key)
        if storage is None:
            scale_index = tuple(i // b for i, b in zip(index, block))
            storage = q.storage.cache.setdefault(key, self.qstorage_item(q.storage, index, scale_index))
        return QTensor(storage, layout, q.transposed, q.kind, q.index)

    def qtensor_rows(self, q):
        """q [..., M, K] as one 2-D QTensor of rows sharing its storage (its layout's
        as_rows), or None where its blocks span the leading dims or q is transposed."""
        from .._core import QTensor
        rows = None if q.transposed else q.layout.as_rows()
        if rows is None:
            return None
        storage = q.storage.cache.get("rows")
        if storage is None:  # views made once: what a backend derives from them is kept with them
            values = q.storage.values
            storage = q.storage.cache.setdefault("rows", self.qstorage_view(
                self.reshape(values, (rows.shape[0],) + tuple(values.shape[-1:])),
                self.reshape(q.storage.scales, rows.grid)))
        return QTensor(storage, rows, False, q.kind, q.index)

    def qstorage_view(self, values, scales):
        """Storage over `values` and a scale grid that view another storage's memory."""
        raise NotImplementedError

    def qstorage_item(self, storage, index, scale_index):
        """Storage of the item at leading `index` of `storage` (its scales at
        `scale_index` of the scale grid), sharing its memory."""
        raise NotImplementedError

    def dequantize(self, q, dtype="float32"):
        """Payload of the QTensor's logical values times scales: their float32
        products, in float `dtype` (rounded once to a 16-bit dtype)."""
        raise NotImplementedError

    def dequantize_rows(self, q, rows, dtype):
        """Payload [len(rows), D] of float `dtype`: rows `rows` (int64 numpy, each in
        range) of 2-D QTensor q's dequantized values, the others left quantized."""
        raise NotImplementedError

    # ---- kernels on 2-D logical operands ----
    def int_matmul(self, a, b):
        raise NotImplementedError

    def qq_matmul(self, lhs, rhs):
        raise NotImplementedError

    # The float dtypes fq_matmul reads x in and writes its result in; q_matmul
    # converts anything else to and from float32 around the call.
    fq_dtypes = ("float32",)

    def fq_matmul(self, x, w, out_dtype="float32"):
        """x [M, K] payload (one of fq_dtypes) times QTensor w [K, N] (weight-only),
        as out_dtype (one of fq_dtypes)."""
        raise NotImplementedError
