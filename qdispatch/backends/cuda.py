"""The cuda backend: device memory and the kernels of `qdispatch._cuda`.

Without the compiled module (built without CUDA) or without a usable GPU the
backend stays registered, so every use says why it can't run and what to do.

Quantized storage keeps the values in the scheme's store (int8, or packed
uint32 words) plus a float32 scale grid, like the host backends.  The operand
forms the kernels read (K-contiguous rows, zero padded) are derived on first
use and cached in the storage, so a weight is re-laid out once, not per call.
Once a weight is laid out for the decode kernel, its tiles hold every value:
the store is freed, so a decode weight takes its size once on the GPU, and is
read back from the tiles whenever something else needs it."""
import math
import os
import warnings
from typing import NamedTuple

import numpy as np

from .. import quantmath
from .._core import BackendKind, Tensor, register_backend
from ..errors import ArgumentError, DLPackExportError, KernelError, NonFiniteError, ScaleOverflowError
from ..layout import as_2d_block
from .base import Backend, QStorage

try:
    from .. import _cuda
    _IMPORT_ERROR = None
except ImportError as exc:  # built without CUDA
    _cuda = None
    _IMPORT_ERROR = exc

REBUILD = ("To rebuild with it: QDISPATCH_CUDA=1 pip install --force-reinstall --no-deps <qdispatch's source "
           "tree or sdist>, with the CUDA toolkit 12.0 or newer (nvcc) on PATH, in /usr/local/cuda or where "
           "CUDA_HOME says; QDISPATCH_CUDA=1 makes whatever is in the way a build error that names it.")
_HOST_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
               np.dtype(np.uint16): "bfloat16", np.dtype(np.int8): "int8",
               np.dtype(np.int32): "int32", np.dtype(np.uint32): "uint32"}


# From how many rows of x fq runs as a GEMM on the weight's values expanded to
# 16 bits (None: never), by the weight's scale blocks along K (one over all of K,
# blocks of 128 values or more, of 64 or more, finer ones: the GEMM handles a
# block's end at a cost) and its bits (8, or 4 and 2: "packed").  Below that, fq
# runs as decode launches of 32 rows (16 of float32 x) that each stream the whole
# weight (FQ_GEMM_MIN_ROWS; measured with 8-bit weights), or, for more than 40 rows
# of 16-bit x on an H100/H200 (_cuda.fq_wide_supported), as one launch that streams
# it once per 64 rows, which leads the GEMM further (FQ_GEMM_MIN_ROWS_WIDE).  The
# one launch's cost follows the weight's bytes and the GEMM's does not, so packed
# weights keep the one launch longer: over all of K up to 256 rows of 8-bit weights
# (34 us at 4096^2 against the GEMM's 49) and 639 of 4-bit ones (42 against 60 at
# 512 rows); with blocks of 128 or more up to 383 and 1535 rows; with blocks of 64
# up to 1023 rows of 8-bit weights, and 4-bit ones at every row count measured (up
# to 4096).  Each threshold is where a Llama-7B block's linear layers (K = N = 4096;
# K = 4096, N = 11008; K = 11008, N = 4096) take least time in all, measured on an
# H200 (benchmarks/cuda_notes.md).
# float32 x is cut into three bfloat16 parts, for the GEMM as for the decode kernel.
FQ_GEMM_MIN_ROWS = {"whole_k": 144, "whole_k_packed": 144, "blocks_128": 384, "blocks_128_packed": 384,
                    "blocks_64": 384, "blocks_64_packed": 384, "fine_blocks": None, "fine_blocks_packed": None}
FQ_GEMM_MIN_ROWS_WIDE = {"whole_k": 257, "whole_k_packed": 640, "blocks_128": 384, "blocks_128_packed": 1536,
                         "blocks_64": 1024, "blocks_64_packed": None, "fine_blocks": None, "fine_blocks_packed": None}


def fq_gemm_kind(block_k, K, bits):
    """The key of fq_gemm_min_rows's tables for a weight."""
    blocks = "whole_k" if block_k == K else "blocks_128" if block_k >= 128 else "blocks_64" if block_k >= 64 \
        else "fine_blocks"
    return blocks + ("_packed" if bits < 8 else "")


def fq_gemm_min_rows(block_k, K, bits, wide=False):
    """The rows of x from which fq runs as a GEMM, or None."""
    return (FQ_GEMM_MIN_ROWS_WIDE if wide else FQ_GEMM_MIN_ROWS)[fq_gemm_kind(block_k, K, bits)]


def _build_reason():
    try:
        from .._build_config import BUILD_CONFIG
        return BUILD_CONFIG.get("cuda_skipped_reason") or f"the CUDA extension failed to import ({_IMPORT_ERROR})"
    except ImportError:
        return "no build configuration found"


def _round_up(n, m):
    return -(-n // m) * m


def _host_floats(x, flat=None):
    """Device array x's values on the host as numpy floats (bfloat16 widened from its
    bits), or only element `flat` of it."""
    values = _cuda.to_host(x) if flat is None else _cuda.element(x, flat)
    return quantmath.bf16_bits_to_f32(values) if x.dtype == "bfloat16" else values


def _in_store(q, layout):
    """int8 values q [rows, cols] (2-D, storage orientation) in the scheme's store."""
    if layout.scheme.store == "packed_u32":
        q = _cuda.pack_u32(q, layout.bits)
        return q.view(layout.shape[:-1] + (q.shape[-1],))
    return q.view(layout.shape)


class _ValuesOperands(NamedTuple):
    """fq's weight operands where its blocking along K is too fine for the decode
    tiles: int8 values [N, ld] and float32 scales [N/bn, K/bk], for _cuda.fq_values."""
    values: object
    scales: object
    K: int
    bn: int
    bk: int


class _StoreFromTiles:
    """Rebuilds a 2-D weight's store from its decode tiles.  It holds the tiles and
    the layout only, never the QTensor or its storage (no reference cycle)."""
    __slots__ = ("tiles", "layout", "N", "K", "flip")

    def __init__(self, tiles, layout, N, K, flip):
        self.tiles, self.layout, self.N, self.K, self.flip = tiles, layout, N, K, flip

    def __call__(self):
        q = _cuda.fq_untile_weights(self.tiles, self.N, self.K, self.layout.bits)  # [N, K]
        return _in_store(_cuda.transpose2(q) if self.flip else q, self.layout)


class CudaQStorage(QStorage):
    """A QStorage on one GPU, released to its decode tiles.

    `owns`: the values are this storage's own memory, not a view into another's
    (only then does releasing them free anything)."""
    __slots__ = ("owns", "_kept")

    def __init__(self, values, scales, owns=True):
        super().__init__(values, scales)
        self.owns = owns
        self._kept = False

    def tiled_rows(self, transposed):
        """The `_StoreFromTiles` whose tiles hold this store's rows (the logical rows
        of a QTensor with flag `transposed`) as tile rows, or None while the store
        is in memory."""
        read_back = self.released_to
        return read_back if read_back is not None and read_back.flip == transposed else None

    def keep_values(self):
        """Never free the store from now on: a CUDA graph reads it in place."""
        self._kept = True

    def release_values(self, read_back):
        """Frees the store when `read_back()` can rebuild it (from tiles that hold it)."""
        if self.owns and not self._kept and self._values is not None:
            super().release_values(read_back)


def _batch_invariant_setting(value):
    """QDISPATCH_BATCH_INVARIANT as a bool; a value that is neither on nor off warns and
    leaves it off (a typo must not pass for a choice)."""
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word not in ("", "0", "false", "no", "off"):
        warnings.warn(f"QDISPATCH_BATCH_INVARIANT={value!r} is neither 1 nor 0 (true/false, yes/no, on/off): "
                      f"batch invariance stays off", RuntimeWarning, stacklevel=2)
    return False


class CudaBackend(Backend):
    kind = BackendKind.CUDA
    name = "cuda"
    fq_dtypes = ("float32", "float16", "bfloat16")

    def __init__(self):
        self.set_batch_invariant(_batch_invariant_setting(os.environ.get("QDISPATCH_BATCH_INVARIANT", "")))

    # ---- availability ----
    def unavailable_reason(self, index=0):
        if _cuda is None:
            return (f"The cuda backend is unavailable: qdispatch was built without CUDA: "
                    f"{_build_reason()}. {REBUILD}")
        why = _cuda.unavailable_reason()
        if why == _cuda.FORKED:
            return f"The cuda backend is unavailable in this process: {why}"
        if why is not None:
            return (f"The cuda backend is unavailable: qdispatch was built with CUDA, but no GPU "
                    f"or driver can be used here ({why}). Install the NVIDIA driver (one at least "
                    f"as new as CUDA {self._runtime_version()}) on a machine with a GPU.")
        count = _cuda.device_count()
        if index >= count:
            return f"There is no cuda:{index}: this machine has {count} CUDA device(s)"
        return None

    def _runtime_version(self):
        v = _cuda.versions()["runtime"]
        return f"{v // 1000}.{v % 1000 // 10}"

    def device_count(self):
        return _cuda.device_count() if _cuda is not None else 0

    def describe(self):
        if _cuda is None:
            return {}
        d = {"devices": [], **_cuda.versions(), "batch_invariant": self._batch_invariant}
        for i in range(_cuda.device_count()):
            d["devices"].append(_cuda.device_properties(i))
        return d

    # ---- numerics ----
    def set_batch_invariant(self, on):
        # kept here too, so that it reads back where CUDA is not built
        self._batch_invariant = bool(on)
        if _cuda is not None:
            _cuda.set_batch_invariant(self._batch_invariant)

    def batch_invariant(self):
        return self._batch_invariant

    # ---- the queue and memory ----
    def synchronize(self, index):
        _cuda.synchronize(index)

    def memory_info(self, index):
        return _cuda.memory_info(index)

    def empty_cache(self, index=-1):
        if _cuda is not None:
            _cuda.empty_cache(index)

    # ---- dense data ----
    def from_host(self, array, index):
        array = np.asarray(array)
        return _cuda.from_host(array, _HOST_NAMES[array.dtype], index)

    def to_host(self, payload):
        return _cuda.to_host(payload)

    # ---- quantized data ----
    def qstorage_from_host(self, values, scales, layout, index):
        values = np.ascontiguousarray(values, dtype=np.int8)
        if layout.scheme.store == "packed_u32":
            values = quantmath.pack_u32(values, layout.bits)
        return CudaQStorage(self.from_host(values, index),
                            self.from_host(np.asarray(scales, dtype=np.float32), index))

    def qstorage_scales_to_host(self, storage):
        return _cuda.to_host(storage.scales)

    def qstorage_largest_scale(self, storage):
        return _cuda.largest_magnitude(storage.scales)  # 4 bytes to the host, not the grid

    def qstorage_to_host(self, storage, layout):
        values = _cuda.to_host(storage.values)
        if layout.scheme.store == "packed_u32":
            values = quantmath.unpack_u32(values, layout.bits, layout.shape[-1])
        return values, _cuda.to_host(storage.scales)

    quantize_dtypes = ("float32", "float16", "bfloat16")  # 16-bit x read in place: no float32 copy

    def quantize(self, payload, layout, index):
        flat = as_2d_block(layout.shape, layout.block)
        if flat is None:  # an N-d blocking the kernel does not take: the numpy spec, same bits
            values, scales, _ = quantmath.quantize_array(_host_floats(payload), layout.scheme)
            return self.qstorage_from_host(values, scales, layout, index)
        rows, cols, br, bc = flat
        x = payload.view((rows, cols))
        try:
            q, scales = _cuda.quantize(x, layout.scheme.value, br, bc, layout.scheme.scale_dtype)
        except NonFiniteError as exc:
            position = tuple(int(i) for i in np.unravel_index(exc.index, layout.shape))
            raise quantmath.non_finite_error(_host_floats(x, exc.index), position) from None
        except ScaleOverflowError as exc:
            block = tuple(int(i) for i in np.unravel_index(exc.index, layout.grid))
            raise quantmath.block_scale_overflow_error(_host_floats(x), exc.index, (br, bc),  # an error path
                                                       layout.scheme.qrange, layout.scheme.scale_dtype,
                                                       block) from None
        return CudaQStorage(_in_store(q, layout), scales.view(layout.grid))

    def dequantize_rows(self, q, rows, dtype):
        ids = _cuda.from_host(rows, "int64", q.index)
        values, bits, scales, tiled = self._rows_source(q)
        return _cuda.dequantize_rows(values, bits, *q.shape, scales, *q.layout.logical_block(q.transposed), ids,
                                     dtype, tiled=tiled)

    def dequantize_rows_into(self, q, ids, n, out, dtype, stream):
        """dequantize_rows on memory another library owns (device addresses: int64 ids
        [n], each in [0, rows) or a row of NaN; out [n, dim] of dtype), queued on its
        `stream`.  Nothing here allocates or waits, so a CUDA graph can capture it; the
        table keeps the memory it reads (its store is never freed to decode tiles after)."""
        source = self._rows_source(q, convert=False)
        if source is None:
            raise KernelError("a CUDA graph can't hold this lookup: the table's rows are stored as columns (a "
                              "transposed QTensor, or tiles another product laid out), which each lookup turns "
                              "first; capture a table quantized as [rows, dim]")
        q.storage.keep_values()
        self._rows_into(q, source, ids, n, out, dtype, stream)

    def dequantize_rows_beside(self, q, ids, n, out, dtype, stream):
        """dequantize_rows_into outside a graph capture, the ids left unread on the
        host: queued on our stream, after the work queued on the owner's `stream` so
        far (its ids), and that stream's later work after it (its reads of out, and
        its reuse of the ids' memory).  Events order them; the host never waits."""
        source = self._rows_source(q)  # a turned copy of the rows, if need be, lives on our stream
        if stream:
            _cuda.stream_waits(q.index, 0, stream)
        self._rows_into(q, source, ids, n, out, dtype, 0)
        if stream:
            _cuda.stream_waits(q.index, stream, 0)

    @staticmethod
    def _rows_into(q, source, ids, n, out, dtype, stream):
        values, bits, scales, tiled = source
        _cuda.dequantize_rows_into(values, bits, *q.shape, scales, *q.layout.logical_block(q.transposed), ids, n,
                                   out, dtype, tiled, stream)

    def _rows_source(self, q, convert=True):
        """(values, bits, scales, tiled): what the row lookup of q reads.  The decode
        tiles where they hold q's rows (a table that is an output layer too), else the
        store.  Rows that must first be turned (a transposed table) or rebuilt (from
        tiles that hold columns) are, for the call, unless `convert` is false: None."""
        layout = q.layout
        tiled = q.storage.tiled_rows(q.transposed)
        if not q.transposed and tiled is not None:
            return tiled.tiles, layout.bits, q.storage.scales, True
        if not q.transposed and (convert or q.storage.holds_values):
            return q.storage.values, layout.bits if layout.scheme.store == "packed_u32" else 0, q.storage.scales, False
        if not convert:
            return None
        scales = _cuda.transpose2(q.storage.scales)  # the rows are stored as columns
        if tiled is not None:
            return tiled.tiles, layout.bits, scales, True
        return _cuda.transpose2(self._int8_values(q.storage, layout, cache=False)), 0, scales, False

    def _int8_values(self, storage, layout, cache=True):
        """The values as int8 in storage orientation (unpacked, once when cached)."""
        if layout.scheme.store != "packed_u32":
            return storage.values
        if "int8" in storage.cache:
            return storage.cache["int8"]
        values = _cuda.unpack_u32(storage.values, layout.bits, layout.shape[-1])
        if cache:
            storage.cache["int8"] = values
        return values

    def dequantize(self, q, dtype="float32"):
        layout = q.layout
        if len(q.shape) == 2:  # its rows as a lookup reads them: no copy of the store, nor a turn of the output
            values, bits, scales, tiled = self._rows_source(q)
            return _cuda.dequantize(values, bits, *q.shape, scales, *layout.logical_block(q.transposed), dtype,
                                    tiled=tiled)
        flat = as_2d_block(layout.shape, layout.block)
        if flat is None:
            values, scales = self.qstorage_to_host(q.storage, layout)
            out = quantmath.dequantize_array(values, scales, layout.block)
            out = self.cast(self.from_host(out.astype(np.float32), q.index), "float32", dtype)
        else:
            rows, cols, br, bc = flat
            packed = layout.scheme.store == "packed_u32"
            out = _cuda.dequantize(q.storage.values, layout.bits if packed else 0, rows, cols,
                                   q.storage.scales, br, bc, dtype).view(layout.shape)
        return self.transpose2(out) if q.transposed else out

    def qstorage_item(self, storage, index, scale_index):
        return CudaQStorage(self.index(storage.values, index), self.index(storage.scales, scale_index), owns=False)

    def qtensor_rows(self, q):
        # a store released to its tiles would be read back into a copy, kept with the view
        return super().qtensor_rows(q) if q.storage.holds_values else None

    def qstorage_view(self, values, scales):
        return CudaQStorage(values, scales, owns=False)

    # ---- operand forms for the kernels ----
    def _k_rows(self, q, k_last):
        """(int8 [rows, ld] with K along rows, padded; float32 scales [rows/b, K/bk]) for a
        2-D QTensor, cached in its storage.  `k_last`: K is the logical last dim (lhs)
        rather than the first (rhs)."""
        key = ("k_rows", q.transposed == k_last)
        if key not in q.storage.cache:
            q.storage.cache[key] = self._k_major(q, k_last, cache=True)
        return q.storage.cache[key]

    def _k_major(self, q, k_last, cache):
        """_k_rows's operands, computed; `cache`: keep the unpacked values for reuse."""
        storage, layout = q.storage, q.layout
        # Storage holds K along its last dim when the logical and storage orientations agree
        # for lhs, or disagree for rhs.
        values, scales = self._int8_values(storage, layout, cache), storage.scales
        if q.transposed == k_last:
            values, scales = _cuda.transpose2(values), _cuda.transpose2(scales)
        # rows of whole 16-byte pieces on 16-byte bounds, as the GEMM copies them (a view
        # of another library's memory may start anywhere)
        return _cuda.aligned_rows(values), scales

    # ---- kernels on 2-D logical operands ----
    def int_matmul(self, a, b):
        # rows padded to 16 bytes, and a view that starts off a 16-byte bound copied
        # (t[1:33], say): the GEMM reads whole aligned pieces
        return _cuda.int_matmul(_cuda.aligned_rows(a), _cuda.aligned_rows(_cuda.transpose2(b)), a.shape[1])

    def qq_matmul(self, lhs, rhs):
        lhs_block, rhs_block = lhs.layout.logical_block(lhs.transposed), rhs.layout.logical_block(rhs.transposed)
        if quantmath.groups_past_int32(lhs_block[-1], rhs_block[-2]):
            return self._qq_long_groups(lhs, rhs, lhs_block, rhs_block)
        a, sa = self._k_rows(lhs, k_last=True)
        bt, sb = self._k_rows(rhs, k_last=False)
        K = lhs.shape[1]
        bm, bka = lhs.layout.logical_block(lhs.transposed)
        bkb, bn = rhs.layout.logical_block(rhs.transposed)
        return _cuda.qq_matmul(a, bt, K, sa, bm, bka, sb, bn, bkb)

    def _qq_long_groups(self, lhs, rhs, lhs_block, rhs_block):
        """qq whose K-groups pass int32's exact sums: the int8 kernel on pieces of K,
        their products added in int64 and scaled on the host, as the reference does."""
        (M, K), N = lhs.shape, rhs.shape[1]
        a_k_first, b = self._k_first(lhs, lhs=True), self._k_first(rhs, lhs=False)

        def int_products(s, e):
            a = _cuda.transpose2(self.slice_rows(a_k_first, s, e))
            return _cuda.to_host(self.int_matmul(a, self.slice_rows(b, s, e)))

        out = quantmath.qq_in_groups(lambda k0, k1: quantmath.summed_in_pieces(int_products, k0, k1),
                                     self._logical_scales(lhs), lhs_block, self._logical_scales(rhs), rhs_block,
                                     M, K, N)
        return self.from_host(out, lhs.index)

    def _k_first(self, q, lhs):
        """q's int8 values with K along the first axis: [K, M] of an lhs, [K, N] of an rhs."""
        values = self._int8_values(q.storage, q.layout)
        return values if q.transposed == lhs else _cuda.transpose2(values)

    @staticmethod
    def _logical_scales(q):
        scales = _cuda.to_host(q.storage.scales)
        return scales.T if q.transposed else scales

    def fq_prepared(self, w, lay_out=True):
        """w's fq operands (see _fq_call), derived on its first fq call and kept with its
        storage: a call is then one dict lookup and the launch.  None when they are not
        derived yet and `lay_out` is false (laying out the tiles synchronizes)."""
        key = ("fq_call", w.transposed)
        call = w.storage.cache.get(key)
        if call is None and lay_out:
            call = w.storage.cache[key] = self._fq_call(w)
        return call

    def fq_matmul(self, x, w, out_dtype="float32"):
        call = self.fq_prepared(w)
        if isinstance(call[0], _ValuesOperands):
            return _cuda.fq_values(x, *call[0], out_dtype)
        if call[4] is not None:  # w's scale per input channel goes into x (see _fq_call)
            x = _cuda.scale_columns(x, call[4])
        if self.fq_runs_as_gemm(call, x.shape[0], x.dtype):
            if x.dtype != "float32":
                x = _cuda.aligned_rows(x)  # the GEMM reads whole 16-byte pieces of rows
            out = _cuda.empty((x.shape[0], call[0][3]), out_dtype, x.device)
            held = []  # temporaries, back to the block cache in our stream's order once this returns

            def scratch(nbytes):
                held.append(_cuda.empty((nbytes,), "int8", x.device))
                return held[-1].ptr

            self._fq_gemm_into(call, x.ptr, x.dtype, x.shape[0], x.shape[1], out.ptr, out_dtype, 0, scratch)
            return out
        return _cuda.fq_matmul(x, *call[0], out_dtype)

    def capturing(self, stream):
        """Whether another library's `stream` (a raw handle) is capturing a CUDA graph."""
        return _cuda.capturing(stream)

    def fq_runs_as_gemm(self, call, rows, x_dtype):
        """Whether fq_matmul runs `rows` rows of x_dtype x as a GEMM, given w's fq_prepared."""
        return rows >= call[1][x_dtype == "float32"] and not self._batch_invariant

    def fq_matmul_into(self, call, x, x_dtype, rows, ldx, out, stream, scratch):
        """fq_matmul's x @ w, w's fq_prepared `call`, on memory another library owns
        (device addresses: x [rows, ldx] of x_dtype on 16-byte bounds, ldx * its size a
        multiple of 16, zeros past K; out [rows, N] of x_dtype), queued on its `stream`,
        with temporaries from `scratch(nbytes)` (an address, valid in that stream's
        order).  Nothing here allocates or waits, so a CUDA graph can capture it; it
        takes the decode kernel or the GEMM as fq_matmul does, so the two agree bit
        for bit."""
        out_dtype = x_dtype
        if isinstance(call[0], _ValuesOperands):
            _cuda.fq_values_into(x, x_dtype, rows, ldx, *call[0], out, out_dtype, stream)
            return
        if call[4] is not None:  # w's scale per input channel goes into x (see _fq_call)
            K, ld = call[0][4], _round_up(call[0][4], 4)
            scaled = scratch(rows * ld * 4)
            _cuda.scale_columns_into(x, x_dtype, rows, K, ldx, call[4], scaled, ld, stream)
            x, x_dtype, ldx = scaled, "float32", ld
        if self.fq_runs_as_gemm(call, rows, x_dtype):
            self._fq_gemm_into(call, x, x_dtype, rows, ldx, out, out_dtype, stream, scratch)
        else:
            _cuda.fq_matmul_into(x, x_dtype, rows, ldx, *call[0], out, out_dtype, stream)

    def _fq_gemm_into(self, call, x, x_dtype, rows, ldx, out, out_dtype, stream, scratch):
        """fq as a GEMM on the weight's values expanded to 16 bits (a temporary: the
        weight keeps its quantized size); float32 x as its hi, mid and lo bf16 parts
        stacked as rows, their products added."""
        (tiles, _, bits, N, K, bk), _, scales, bn, _ = call
        ld = _round_up(K, 8)
        dtype = "bfloat16" if x_dtype == "float32" else x_dtype
        w16 = scratch(N * ld * 2)
        _cuda.fq_expand_weights_into(tiles, N, K, bits, dtype, w16, ld, stream)
        if x_dtype != "float32":
            if ldx != ld:
                raise ArgumentError(f"fq's GEMM reads rows of x {ld} values apart (K = {K} rounded up to 8), got {ldx}")
            _cuda.fq_gemm_into(x, w16, dtype, rows, N, K, ld, scales, bn, bk, out, out_dtype, stream)
            return
        parts, sums = scratch(3 * rows * ld * 2), scratch(3 * rows * N * 4)
        _cuda.split_bf16_into(x, rows, K, ldx, parts, ld, tiles.device, stream)
        _cuda.fq_gemm_into(parts, w16, dtype, 3 * rows, N, K, ld, scales, bn, bk, sums, "float32", stream)
        _cuda.sum3_into(sums, rows * N, out, out_dtype, tiles.device, stream)

    def _fq_call(self, w):
        """fq_matmul's weight arguments for w: those of the decode kernel (the tiled
        weights are laid out here, once), the rows from which the GEMM takes over,
        its scales [N/bn, K/bk] with bn, and scales that x takes first (or None).
        A blocking along K that the tiles can't take (no multiple of 16 values) gets
        the int8 values and scales that _cuda.fq_values reads instead, and never the
        GEMM; except one row of scales for all of N (a scale per input channel, say),
        which goes into x instead (_cpu.fq_fold_scales): sum_k x[k] * (q[k] * s[k]) as
        sum_k (x[k] * s'[k]) * q[k] * 2^e, a float32 x (three exact bf16 parts) times
        the weight's values at a scale of 2^e, each term rounded once either way."""
        K, N = w.shape
        bk, bn = w.layout.logical_block(w.transposed)
        bits = w.layout.bits
        x_scales = None
        if not _cuda.fq_supported(bits, K, bk):
            from .. import _cpu  # built beside _cuda: the rule qd_fq_matmul_f32 folds by
            folded = _cpu.fq_fold_scales(_cuda.to_host(w.storage.scales)) if bn == N else None
            if folded is None:
                values, scales = self._k_rows(w, k_last=False)
                return _ValuesOperands(values, scales, K, bn, bk), (float("inf"), float("inf")), scales, bn, None
            x_scales, power = folded
        values, scales = self._k_major(w, k_last=False, cache=False)
        if x_scales is not None:  # one scale row: its order along K whatever the orientation
            x_scales = _cuda.from_host(np.repeat(x_scales, bk), "float32", values.device)
            scales, bk = _cuda.from_host(np.full((1, 1), power, np.float32), "float32", values.device), K
        tiles = _cuda.fq_tile_weights(values, K, bits)
        # The tiles hold every value: the store can go (see the module's docstring).
        # _k_major turned the store's [K, N] into [N, K] unless w is a transposed view.
        w.storage.release_values(_StoreFromTiles(tiles, w.layout, N, K, flip=not w.transposed))
        with _cuda.on_device(tiles.device):  # the weight's GPU, which may differ from the current one
            wide = _cuda.fq_wide_supported()
        # for (16-bit x, float32 x)
        gemm_rows = tuple(float("inf") if rows is None else rows
                          for rows in (fq_gemm_min_rows(bk, K, bits, wide), fq_gemm_min_rows(bk, K, bits)))
        if x_scales is not None:  # x comes as float32 whatever its dtype
            gemm_rows = (gemm_rows[1], gemm_rows[1])
        return ((tiles, _cuda.fq_tile_scales(scales, N, K, bn, bk), bits, N, K, bk), gemm_rows, scales, bn, x_scales)

    # ---- dense helpers the dispatcher uses ----
    def cast(self, payload, src, dst):
        return payload if src == dst else _cuda.cast(payload, dst)

    def reshape(self, payload, shape):
        return payload.view(shape)

    def transpose2(self, payload):
        return _cuda.transpose2(payload)

    def index(self, payload, idx):
        """The sub-array at leading indices `idx` (a view: arrays are C-contiguous)."""
        inner = payload.shape[len(idx):]
        row = 0
        for i, n in zip(idx, payload.shape):
            row = row * n + int(i)
        offset = payload.offset + row * math.prod(inner) * payload.itemsize
        return _cuda.DeviceArray(payload.buffer, offset, tuple(inner), payload.dtype)

    def slice_rows(self, payload, start, stop):
        """Rows start .. stop - 1 of the first axis (a view)."""
        row = math.prod(payload.shape[1:]) * payload.itemsize
        return _cuda.DeviceArray(payload.buffer, payload.offset + start * row,
                                 (stop - start,) + tuple(payload.shape[1:]), payload.dtype)

    def stack(self, payloads, shape):
        """As the host backend's: allocated at the first item, each copied in as it comes."""
        out = offset = None
        for p in payloads:
            if out is None:
                out, offset = _cuda.empty(shape, p.dtype, p.device), 0
            _cuda.copy_into(out, offset, p)
            offset += p.nbytes
        return out

    def add(self, payload, bias):
        return _cuda.add_bias(payload, bias)

    def dlpack(self, t, *, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is not None and tuple(dl_device) != self.dlpack_device(t):
            if tuple(dl_device) != (1, 0):  # kDLCPU
                raise DLPackExportError(f"Can't export a Tensor on {t.device} to DLPack device {tuple(dl_device)}: "
                                        f"move it there first")
            if copy is False:
                raise DLPackExportError(f"A Tensor on {t.device} reaches the CPU by a copy only: "
                                        f"pass copy=None or True")
            from .. import policy  # the host's copy, exported as host tensors are
            asked = {} if max_version is None else {"max_version": max_version}  # numpy before 2.1 takes none
            return t.to(policy.default_host_device()).__dlpack__(**asked)
        if copy:
            return _cuda.to_dlpack(_copy(t.payload), stream)
        return _cuda.to_dlpack(t.payload, stream)

    def dlpack_device(self, t):
        return (2, t.index)  # kDLCUDA

    def tensor_from_dlpack(self, obj):
        arr = _cuda.from_dlpack(obj)
        return Tensor(arr, arr.dtype, arr.shape, int(self.kind), arr.device)

    def tensor_viewing(self, ptr, shape, dtype, index, owner, producer_stream):
        """A Tensor over device memory that `owner` holds (see `_cuda.view`)."""
        arr = _cuda.view(ptr, shape, dtype, index, owner, producer_stream)
        return Tensor(arr, dtype, shape, int(self.kind), index)


def _copy(arr):
    out = _cuda.empty(arr.shape, arr.dtype, arr.device)
    _cuda.copy_into(out, 0, arr)
    return out


register_backend(CudaBackend())
