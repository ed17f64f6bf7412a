"""The cpu backend: the C SIMD kernels of `qdispatch._cpu`, threaded, GIL released.

Weights are packed into the kernels' panel layout once, when a QTensor is
created on or moved to cpu, and their store is then read back from the panels
where it is asked for (a weight takes its size once); a weight used in the other
orientation is packed on first use and kept."""
import math
import os
import re
import threading
import warnings

import numpy as np

from .. import packing, quantmath
from .._core import BackendKind, register_backend
from ..errors import ArgumentError, ArgumentTypeError, BackendUnavailableError
from ..layout import as_2d_block
from ..scheme import index_of
from .host import HostBackend


def _packing_lock(storage):
    """The lock under which one thread packs this weight while the others wait.
    One per weight, so threads meeting different fresh weights pack them at once;
    and one per process: a lock another thread held when the process forked stays
    held in the child, where no thread would ever release it."""
    key = ("packing lock", os.getpid())
    lock = storage.cache.get(key)
    if lock is None:
        lock = storage.cache.setdefault(key, threading.Lock())  # one dict step under the GIL: one winner
    return lock


try:
    from .. import _cpu
    _IMPORT_ERROR = None
except ImportError as exc:
    _cpu = None
    _IMPORT_ERROR = exc


_MOST_THREADS = 2**31 - 1  # the C library's thread count is an int
# float conversions the C library runs (16-bit payloads as numpy holds them), and the
# size from which a float16 one goes to C
_CONVERSIONS = {} if _cpu is None else {
    ("float32", "float16"): _cpu.f32_to_f16, ("float32", "bfloat16"): _cpu.f32_to_bf16,
    ("float16", "float32"): _cpu.f16_to_f32, ("bfloat16", "float32"): _cpu.bf16_to_f32}
_C_CAST_FROM = 1024
# the dtype of a payload to quantize by its numpy dtype (a bfloat16 payload holds its bits)
_PAYLOAD_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                   np.dtype(np.uint16): "bfloat16"}
_PANEL_ROWS = 16  # output channels a panel holds (QD_NR)


class _StoreFromPanels:
    """Rebuilds a 2-D weight's store from its [N, K] panels: int8 values, packed into
    words for a `packed_u32` store (`bits`; 0 for native).  It holds the panels only,
    never the storage (no reference cycle)."""
    __slots__ = ("panels", "bits")

    def __init__(self, panels, bits):
        self.panels, self.bits = panels, bits

    def __call__(self):
        values = self.int8()
        return packing.pack_u32(values, self.bits) if self.bits else values

    def int8(self):
        """The values as int8, whatever the store."""
        return self.panels.unpack()[0]


DEFAULT_THREADS = "OMP_NUM_THREADS's count where it is set, else one per processor"


def _thread_count_setting(text):
    """QDISPATCH_NUM_THREADS as an int, or ValueError naming the variable.  Plain
    ASCII digits only: int() also reads "2_0" as 20 and other scripts' digits."""
    count = int(text) if re.fullmatch(r"\s*[+-]?[0-9]+\s*", text) else None
    if count is None or count > _MOST_THREADS:
        raise ArgumentError(f"QDISPATCH_NUM_THREADS={text!r} is not a whole number up to {_MOST_THREADS}: set it "
                            f"to a thread count such as 4 (0 or less means the default: {DEFAULT_THREADS}), or unset it")
    return count


FORKED_ONE_THREAD = ("this process was forked after qdispatch was loaded, and OpenMP's threads do not "
                     "survive fork, so its cpu kernels run on one thread here; start worker processes "
                     "with multiprocessing's 'spawn' or 'forkserver' method to run them on several")


class CpuBackend(HostBackend):
    kind = BackendKind.CPU
    name = "cpu"
    pack_u32 = staticmethod(packing.pack_u32)
    unpack_u32 = staticmethod(packing.unpack_u32)

    def __init__(self):
        # A bad setting makes the backend unavailable, saying why, rather than failing
        # the import: `qdispatch info` and the reference backend still work.
        self._bad_settings = {}
        if _cpu is None:
            return
        isa = os.environ.get("QDISPATCH_ISA")
        if isa:
            try:
                self.set_isa(isa)
            except (ArgumentError, BackendUnavailableError) as exc:
                self._bad_settings["isa"] = f"QDISPATCH_ISA={isa}: {exc}"
        threads = os.environ.get("QDISPATCH_NUM_THREADS")
        if threads:
            try:
                self.set_num_threads(_thread_count_setting(threads))
            except ValueError as exc:
                self._bad_settings["threads"] = str(exc)

    @property
    def built(self):
        """Whether this copy of qdispatch has the compiled kernels."""
        return _cpu is not None

    def unavailable_reason(self, index=0):
        if _cpu is None:
            return (f"The cpu backend's compiled kernels failed to import ({_IMPORT_ERROR}): "
                    f"reinstall qdispatch with `pip install .`")
        # a copy: set_isa or set_num_threads on another thread may drop an entry meanwhile
        reasons = list(self._bad_settings.values())
        if reasons:
            return reasons[0]
        return super().unavailable_reason(index)

    # ---- ISA and threads ----
    def set_isa(self, name):
        try:
            _cpu.set_isa(name)
        except TypeError:  # no name at all
            raise
        except Exception as exc:  # a name of no ISA is a bad argument; an ISA this CPU or build lacks, unavailable
            error = ArgumentError if isinstance(exc, ArgumentError) else BackendUnavailableError
            raise error(f"{exc}. Built and supported here: "
                        f"{', '.join(sorted(set(_cpu.isa_info()['built']) & set(_cpu.isa_info()['supported'])))}"
                        f" (or 'auto')") from None
        self._bad_settings.pop("isa", None)  # a good choice in code replaces the variable's

    def set_num_threads(self, n):
        try:
            count = index_of(n)  # a whole number (int, numpy integer); 2.7, "4" or True is none
        except TypeError:
            raise ArgumentTypeError(f"set_num_threads takes a whole number of threads, got {n!r} ({type(n).__name__}); "
                                    f"0 or less means the default: {DEFAULT_THREADS}") from None
        if count > _MOST_THREADS:
            raise ArgumentError(f"set_num_threads({count}): at most {_MOST_THREADS} threads; "
                                f"0 or less means the default: {DEFAULT_THREADS}")
        _cpu.set_num_threads(max(count, 0))
        self._bad_settings.pop("threads", None)
        if count != 1 and _cpu.forked_child():
            warnings.warn(f"set_num_threads({count}) has no effect: {FORKED_ONE_THREAD}", RuntimeWarning,
                          stacklevel=3)

    def get_num_threads(self):
        return _cpu.get_num_threads()

    def describe(self):
        if _cpu is None:
            return {}
        d = dict(_cpu.isa_info())
        d["isa"] = d.pop("active")
        d["threads"] = _cpu.get_num_threads()
        for setting in list(self._bad_settings):  # a copy: another thread may fix one meanwhile
            d[setting] = None  # none runs: not the ISA or thread count the library fell back to
        if _cpu.forked_child():
            d["threads_note"] = FORKED_ONE_THREAD
        elif _cpu.thread_cap():
            d["threads_note"] = (f"the system let only {_cpu.thread_cap()} threads start (a limit on tasks or "
                                 f"memory), so the cpu kernels run on that many; qd.set_num_threads tries again")
        d["library"] = _cpu.library_version()
        return d

    # ---- quantized storage ----
    def qstorage_from_host(self, values, scales, layout, index, weight=True):
        storage = super().qstorage_from_host(values, scales, layout, index)
        if weight and len(layout.shape) == 2 and layout.shape[0] >= _PANEL_ROWS and layout.block[-1] > 1:
            # a weight: pack its [N, K] panels now, once.  Fewer rows than one panel's
            # are a few tokens' activations far more often (quantized for a qq product,
            # which reads them as rows): packing a 1 x 4096 one took half of its quantize
            # call.  A scale per column is a [K, N] weight's per output channel far more
            # often: as [N, K] panels it would carry a scale per value (80 MiB for a 4096^2
            # weight of 16 MiB, and 40 ms), for the other orientation than its product
            # reads.  Such weights pack at their first product, as that product reads them.
            panels = self._panels(storage, layout, transposed_pack=False, values=values)
            # The panels hold every value: the store goes, and is read back from them
            # where it is asked for (a save, a move, .values), so that a weight takes its
            # size once in memory, not twice.
            storage.release_values(_StoreFromPanels(panels, layout.bits if layout.scheme.store == "packed_u32" else 0))
        return storage

    def qstorage_to_host(self, storage, layout):
        source = storage.released_to
        if isinstance(source, _StoreFromPanels):  # int8 from the panels, not packed into words to unpack again
            return source.int8(), storage.scales
        return super().qstorage_to_host(storage, layout)

    def quantize_activation(self, payload, layout, index):
        return self.quantize(payload, layout, index, weight=False)

    # 16-bit payloads are read in place, widened to float32 a few KiB at a time in C
    quantize_dtypes = ("float32", "float16", "bfloat16")

    def quantize(self, payload, layout, index, weight=True):
        payload = np.asarray(payload)
        dtype = _PAYLOAD_DTYPES[payload.dtype]  # one of quantize_dtypes: tensor_api casts others
        flat = as_2d_block(layout.shape, layout.block)
        if flat is None:
            # an N-d blocking C does not take: the numpy spec, same bits, on a float32
            # copy of 16-bit data (such blockings are rare and mostly small)
            values, scales, _ = quantmath.quantize_array(self.cast(payload, dtype, "float32"), layout.scheme)
            return self.qstorage_from_host(values, scales, layout, index, weight=weight)
        rows, cols, br, bc = flat
        x = np.ascontiguousarray(payload)  # a copy in x's own dtype only of a strided view
        # errors name positions in x's own shape and its scale grid, not C's 2-D view
        q, scales = _cpu.quantize(x.reshape(rows, cols), layout.scheme.value, br, bc, layout.scheme.scale_dtype,
                                  shape=tuple(layout.shape), grid=tuple(layout.grid), dtype=dtype)
        return self.qstorage_from_host(q.reshape(layout.shape), scales.reshape(layout.grid),
                                       layout, index, weight=weight)

    def _panels(self, storage, layout, transposed_pack, values=None):
        """Weight panels for using storage [R, C] as [N, K]: K = C normally,
        K = R when `transposed_pack`."""
        key = ("panels", transposed_pack)
        panels = storage.cache.get(key)
        if panels is not None:
            return panels
        with _packing_lock(storage):  # packing runs without the GIL: threads meeting the weight wait
            panels = storage.cache.get(key)
            if panels is not None:
                return panels
            if values is None:
                values, _ = self.qstorage_to_host(storage, layout)
            scales, block = storage.scales, layout.block
            if transposed_pack:
                values, scales, block = values.T, scales.T, block[::-1]
            panels = _cpu.PackedWeights(np.ascontiguousarray(values, dtype=np.int8),
                                        np.ascontiguousarray(scales, dtype=np.float32),
                                        int(block[0]), int(block[1]), layout.bits)
            storage.cache[key] = panels
        return panels

    def weight_panels(self, w):
        """Panels of a logical [K, N] QTensor as [N, K] rows (K contiguous)."""
        panels = self._panels(w.storage, w.layout, transposed_pack=not w.transposed)
        w.storage.cache["panels served"] = True  # a product reads them: a lookup keeps them (see above)
        return panels

    # ---- dense helpers ----
    def cast(self, payload, src, dst):
        """The host cast's values (round to nearest even; bfloat16 as uint16 bits), by
        C's vectorized conversions: numpy's float16 casts and its bfloat16 rounding
        (several passes) took 10-20x as long on a million values.  numpy keeps a
        small float16 cast, where a C call costs more than numpy's."""
        convert = _CONVERSIONS.get((src, dst))
        if convert is None or (dst != "bfloat16" and np.size(payload) < _C_CAST_FROM):
            return super().cast(payload, src, dst)
        payload = np.asarray(payload)
        return convert(payload).reshape(payload.shape)  # the C call's array is flat for a 0-d payload

    # ---- dequantize ----
    def _store_as_rows(self, storage, layout, keep=True):
        """(values, bits, rows, cols, scales, block_rows, block_cols): the store seen as
        the 2-D matrix C dequantizes, or None where it can't be (no values, or an N-d
        blocking that is no 2-D one).  Kept with the store (`keep`): a lookup of one row
        costs little more than finding them.  A store released to its panels is read
        back: for a lookup it is held again (see _store_back_from_panels), for a
        dequantize not."""
        store = storage.cache.get("as rows", False)
        if store is not False:
            return store
        if not storage.holds_values:
            if not keep:
                return self._flat_store(storage, layout)
            self._store_back_from_panels(storage)
        return storage.cache.setdefault("as rows", self._flat_store(storage, layout))

    @staticmethod
    def _store_back_from_panels(storage):
        """A table looked up, or a left operand multiplied, before any product read its
        panels (an embedding table or activations, most likely never a weight): its
        store comes back and the panels go, so that it takes its size once; a product
        then packs them again, and both stay."""
        with _packing_lock(storage):  # no product packs or reads them meanwhile
            if storage.holds_values or "panels served" in storage.cache:
                return
            storage.restore_values(storage.values)
            storage.cache.pop(("panels", False), None)

    @staticmethod
    def _flat_store(storage, layout):
        flat = as_2d_block(layout.shape, layout.block) if layout.shape and math.prod(layout.shape) else None
        if flat is not None:
            rows, cols, br, bc = flat
            values = storage.values
            flat = (values.reshape(rows, values.shape[-1]), layout.bits if layout.scheme.store == "packed_u32" else 0,
                    rows, cols, storage.scales.reshape(rows // br, cols // bc), br, bc)
        return flat

    def dequantize(self, q, dtype="float32"):
        source = q.storage.released_to
        if isinstance(source, _StoreFromPanels):
            # the panels hold every value: scaled as they are read, a few rows at a
            # time, with no int8 copy of the weight in between (a third of the time)
            out = source.panels.dequantize(dtype).reshape(q.layout.shape)
        else:
            store = self._store_as_rows(q.storage, q.layout, keep=False)
            if store is None:
                return super().dequantize(q, dtype)
            out = _cpu.dequantize_rows(*store, dtype=dtype).reshape(q.layout.shape)
        return np.swapaxes(out, -1, -2) if q.transposed else out

    def dequantize_rows(self, q, rows, dtype):
        store = None if q.transposed else self._store_as_rows(q.storage, q.layout)
        if store is None:  # a transposed table's rows are stored as columns
            return super().dequantize_rows(q, rows, dtype)
        return _cpu.dequantize_rows(*store, ids=rows, dtype=dtype)

    # ---- kernels ----
    def int_matmul(self, a, b):
        a = np.ascontiguousarray(a, dtype=np.int8)
        if b.dtype == np.int8 and b.size and not b.flags.c_contiguous and b.T.flags.c_contiguous:
            # an [N, K] weight seen as [K, N] (w.T): packed from its own rows, which the
            # panels keep, not copied through numpy's transpose first (90x the product)
            return _cpu.int_matmul_packed(a, _cpu.PackedWeights(b.T, np.ones((1, 1), np.float32), *b.T.shape))
        return _cpu.int_matmul(a, np.ascontiguousarray(b, dtype=np.int8))

    def qq_matmul(self, lhs, rhs):
        if not lhs.storage.holds_values:
            # Activations of 16 rows or more quantize as a weight would (see
            # qstorage_from_host): as the left operand they are read as rows, which the
            # panels gave back at each product (48 us for 64 x 1024, half the product).
            # One never multiplied as a weight holds its values again, as a looked-up table does.
            self._store_back_from_panels(lhs.storage)
        if quantmath.groups_past_int32(lhs.layout.logical_block(lhs.transposed)[-1],
                                       rhs.layout.logical_block(rhs.transposed)[-2]):
            # groups past int32's exact sums: the int8 kernel on pieces, added in int64
            return self.qq_in_groups(lhs, rhs, lambda a, b: quantmath.summed_in_pieces(
                lambda s, e: self.int_matmul(a[:, s:e], b[s:e]), 0, a.shape[1]))
        a, sa = self.logical(lhs)
        bm, bk = lhs.layout.logical_block(lhs.transposed)
        return _cpu.qq_matmul(np.ascontiguousarray(a), np.ascontiguousarray(sa, dtype=np.float32),
                              int(bm), int(bk), self.weight_panels(rhs))

    def fq_matmul(self, x, w, out_dtype="float32"):  # fq_dtypes: float32 only
        return _cpu.fq_matmul(np.ascontiguousarray(x, dtype=np.float32), self.weight_panels(w))

    def w8a8_matmul(self, x, w, value, block_k):
        """Quantize x per row (or per block of K) in C, then the int8 kernel."""
        return _cpu.w8a8_matmul(np.ascontiguousarray(x, dtype=np.float32), value, int(block_k),
                                self.weight_panels(w))


register_backend(CpuBackend())
