# cython: language_level=3, boundscheck=False, wraparound=False
"""The cpu backend's kernels: a thin wrapper over the C library (qdispatch.h).

Arrays must be C-contiguous numpy arrays of the stated dtype; inputs may be
read-only (memory-mapped files, np.frombuffer), as the kernels only read them.
Every kernel runs with the GIL released.  A non-OK status from C becomes an exception."""
import numpy as np
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t

from qdispatch.qdispatch_c cimport *
from qdispatch.errors import ArgumentError, ArgumentTypeError


_VALUE_KINDS = {"q8s": QD_Q8S, "q8f": QD_Q8F, "q4s": QD_Q4S, "q4f": QD_Q4F, "q2s": QD_Q2S, "q2f": QD_Q2F}
_SCALE_DTYPES = {"f32": QD_SCALE_F32, "f16": QD_SCALE_F16, "bf16": QD_SCALE_BF16}


def _error_class(code):
    try:
        from qdispatch import errors
    except ImportError:
        return RuntimeError
    if code in (QD_ERR_SHAPE, QD_ERR_K_TOO_LARGE):
        return errors.ShapeError
    if code == QD_ERR_NOT_FINITE:
        return getattr(errors, "NonFiniteError", errors.QDispatchError)
    if code == QD_ERR_SCALE_OVERFLOW:
        return getattr(errors, "ScaleOverflowError", errors.QDispatchError)
    if code == QD_ERR_SCHEME:
        return errors.QuantSchemeError
    if code == QD_ERR_NO_MEMORY:  # a MemoryError, as numpy's and the GPU's are
        return errors.OutOfMemoryError
    return errors.KernelError


_ADVICE = {
    QD_ERR_SHAPE: "check that the operand shapes agree and that every block size divides its dimension",
    QD_ERR_K_TOO_LARGE: "split K into chunks of at most 131071 and add the int32 results in int64",
    QD_ERR_NOT_FINITE: "remove NaN/Inf first (for example np.nan_to_num)",
    QD_ERR_SCALE_OVERFLOW: "use scale_dtype='f32' or rescale the input",
    QD_ERR_ISA_NOT_BUILT: "pick one of qdispatch.info()['backends']['cpu']['built']",
    QD_ERR_ISA_NOT_SUPPORTED: "pick one of qdispatch.info()['backends']['cpu']['supported']",
    QD_ERR_NO_MEMORY: "free memory or use smaller operands",
    QD_ERR_SCHEME: "use a value kind among q8s/q8f/q4s/q4f/q2s/q2f and bits among 8/4/2",
    QD_ERR_ARGUMENT: "check the argument ranges (weight values must fit their bit width)",
}


def _raise_status(code, what):
    """Raises the exception matching a qd_status code (no-op for QD_OK)."""
    if code == QD_OK:
        return
    text = qd_status_string(<qd_status>code).decode()
    advice = _ADVICE.get(code)
    message = f"{what}: {text}" + (f"; {advice}" if advice else "")
    raise _error_class(code)(message)


cdef inline _check(qd_status status, what):
    if status != QD_OK:
        _raise_status(<int>status, what)


def _array(x, dtype, ndim, name):
    """Validates a C-contiguous array of the given dtype and rank."""
    if not isinstance(x, np.ndarray):
        raise ArgumentTypeError(f"{name} must be a numpy array, got {type(x).__name__}")
    if x.dtype != dtype:
        raise ArgumentTypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {x.dtype}: "
                                f"convert it with .astype()")
    if x.ndim != ndim:
        raise _error_class(QD_ERR_SHAPE)(f"{name} must have {ndim} dims, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ArgumentError(f"{name} must be C-contiguous: pass np.ascontiguousarray({name})")
    if x.size == 0:
        raise _error_class(QD_ERR_SHAPE)(f"{name} must not be empty, got shape {x.shape}")
    return x


def _shape_error(message):
    return _error_class(QD_ERR_SHAPE)(message)


# ---- ISA and threads ---------------------------------------------------------

def _isa_names(predicate):
    return [qd_isa_name(<qd_isa>i).decode() for i in range(QD_ISA_COUNT) if predicate(i)]


def isa_info():
    """dict(active=name, built=[names], supported=[names built and supported])."""
    return dict(
        active=qd_isa_name(qd_isa_active()).decode(),
        built=_isa_names(lambda i: qd_isa_built(<qd_isa>i)),
        supported=_isa_names(lambda i: qd_isa_built(<qd_isa>i) and qd_isa_supported(<qd_isa>i)),
    )


def library_version():
    """dict(version=the release libqdispatch was built from, abi=its ABI version)."""
    return dict(version=qd_version().decode(), abi=qd_abi_version())


def set_isa(name):
    """Forces an ISA by name ('scalar', 'avx2', ...); 'auto' goes back to the best one."""
    cdef qd_isa isa
    if not isinstance(name, str):
        raise ArgumentTypeError(f"set_isa takes an ISA's name (a str such as 'avx2', or 'auto'), got {name!r}")
    if name == "auto":
        qd_isa_reset()
        return
    # C reads the name up to a NUL: "avx2\0x" would pass for avx2
    if "\0" in name or qd_isa_from_name(name.encode(), &isa) != QD_OK:
        raise ArgumentError(f"Can't use ISA {name!r}: no ISA has that name; use 'auto' or one of "
                            f"{_isa_names(lambda i: True)}")
    _check(qd_isa_set(isa), f"Can't use ISA {name!r}")


def get_isa():
    return qd_isa_name(qd_isa_active()).decode()


def set_num_threads(int n):
    """Threads the kernels use; n <= 0 restores the default (OMP_NUM_THREADS's count,
    else the processor count), and
    more than 4 per processor count as 4 per processor.  Built without OpenMP the
    kernels run on one thread, whatever n is."""
    qd_set_num_threads(n)


def get_num_threads():
    return qd_get_num_threads()


def thread_cap():
    """0, or the threads the kernels fell back to when the system refused more."""
    return qd_thread_cap()


def forked_child():
    """Whether this process was forked after the kernels' library was loaded (its
    kernels then run on one thread: OpenMP's threads do not survive fork)."""
    return bool(qd_forked_child())


# ---- quantization ------------------------------------------------------------

# Float dtypes by name: C's number and the numpy dtype of an array of them (bfloat16:
# its uint16 bits), for arrays quantized and dequantized.
_FLOAT_DTYPES = {"float32": (QD_FLOAT32, np.float32), "float16": (QD_FLOAT16, np.float16),
                 "bfloat16": (QD_BFLOAT16, np.uint16)}


def _float_dtype(dtype, what):
    """_FLOAT_DTYPES[dtype], or an error saying that `what` can't take dtype."""
    try:
        return _FLOAT_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ArgumentError(f"Can't {what} dtype {dtype!r}: use one of {list(_FLOAT_DTYPES)}") from None


def _float32_values(x, dtype):
    """The float32 values of an array of float dtype `dtype` (for a few, in errors)."""
    if dtype == "bfloat16":
        from qdispatch.quantmath import bf16_bits_to_f32
        return bf16_bits_to_f32(x)
    return np.asarray(x, dtype=np.float32)


def quantize(x, value, block_rows, block_cols, scale_dtype="f32", shape=None, grid=None, dtype="float32"):
    """Quantizes x [R, C] of float `dtype` (float32, float16, or bfloat16 as its uint16
    bits) in blocks -> (int8 q [R, C], float32 scales grid): the bits of quantizing x's
    float32 values, which C reads in place (no float32 copy).  x may be a tensor of
    `shape` seen as [R, C], its scales a grid of `grid`: errors then name positions in
    those shapes."""
    x_dtype, np_dtype = _float_dtype(dtype, "quantize")
    x = _array(x, np_dtype, 2, "x")
    if value not in _VALUE_KINDS:
        raise _error_class(QD_ERR_SCHEME)(f"Unknown value kind {value!r}: use one of {list(_VALUE_KINDS)}")
    if scale_dtype not in _SCALE_DTYPES:
        raise _error_class(QD_ERR_SCHEME)(f"Unknown scale dtype {scale_dtype!r}: use one of {list(_SCALE_DTYPES)}")
    cdef int64_t rows = x.shape[0], cols = x.shape[1], br = block_rows, bc = block_cols
    if br <= 0 or bc <= 0 or rows % br or cols % bc:
        raise _shape_error(f"Block ({br}, {bc}) does not divide shape ({rows}, {cols})")
    q = np.empty((rows, cols), dtype=np.int8)
    scales = np.empty((rows // br, cols // bc), dtype=np.float32)
    cdef const uint8_t[:, ::1] xv = x.view(np.uint8)  # x's bytes, whatever its dtype
    cdef int8_t[:, ::1] qv = q
    cdef float[:, ::1] sv = scales
    cdef int kind = _VALUE_KINDS[value], sdt = _SCALE_DTYPES[scale_dtype], xdt = x_dtype
    cdef int64_t bad = -1
    cdef qd_status st
    with nogil:
        st = qd_quantize(&xv[0, 0], xdt, rows, cols, kind, br, bc, sdt, &sv[0, 0], &qv[0, 0], &bad)
    if st == QD_ERR_NOT_FINITE:
        from qdispatch.quantmath import non_finite_error
        value_at = _float32_values(x.reshape(-1)[bad:bad + 1], dtype)[0]
        raise non_finite_error(value_at, tuple(int(i) for i in np.unravel_index(bad, shape or x.shape)))
    if st == QD_ERR_SCALE_OVERFLOW:
        from qdispatch.quantmath import block_scale_overflow_error
        from qdispatch.scheme import VALUE_RANGES
        r, c = divmod(bad, cols // bc)
        # the offending block's values alone widened, seen as an x of one block
        block = _float32_values(x[r * br:(r + 1) * br, c * bc:(c + 1) * bc], dtype)
        raise block_scale_overflow_error(block, 0, (br, bc), VALUE_RANGES[value][:2], scale_dtype,
                                         tuple(int(i) for i in np.unravel_index(bad, grid or scales.shape)))
    _check(st, "quantize")
    return q, scales


# ---- the packed_u32 store ----------------------------------------------------

def pack_u32(values, int bits):
    """int8 values [..., n] -> their packed_u32 store [..., ceil(n / (32 / bits))]:
    quantmath.pack_u32's words, in C."""
    values = np.ascontiguousarray(values, dtype=np.int8)
    lead, cols = _rows_of(values.shape)
    words = np.empty(lead + (-(-cols // (32 // bits)),), dtype=np.uint32)
    if words.size == 0:
        return words
    cdef const int8_t[::1] qv = values.reshape(-1)
    cdef uint32_t[::1] wv = words.reshape(-1)
    cdef int64_t rows = values.size // cols, n = cols
    cdef qd_status st
    with nogil:
        st = qd_pack_u32(&qv[0], rows, n, bits, &wv[0])
    _check(st, f"pack_u32 of {values.shape} in {bits} bits")
    return words


def unpack_u32(words, int bits, int64_t n):
    """pack_u32's inverse: the store [..., words] of a last dim of n values -> int8 [..., n]."""
    words = np.ascontiguousarray(words, dtype=np.uint32)
    lead, row_words = _rows_of(words.shape)
    if row_words != -(-n // (32 // bits)):
        raise _shape_error(f"{row_words} words a row hold no {n} values of {bits} bits")
    values = np.empty(lead + (n,), dtype=np.int8)
    if values.size == 0:
        return values
    cdef const uint32_t[::1] wv = words.reshape(-1)
    cdef int8_t[::1] qv = values.reshape(-1)
    cdef int64_t rows = values.size // n
    cdef qd_status st
    with nogil:
        st = qd_unpack_u32(&wv[0], rows, n, bits, &qv[0])
    _check(st, f"unpack_u32 of {words.shape} in {bits} bits")
    return values


def _rows_of(shape):
    """(leading dims, last dim) of an array's shape (np.ascontiguousarray gives at least
    one dim; this module indexes without wraparound: no negative indices)."""
    last = len(shape) - 1
    return tuple(shape[:last]), shape[last]


# ---- dequantize -------------------------------------------------------------

def dequantize_rows(values, int bits, int64_t rows, int64_t cols, scales, int64_t block_rows,
                    int64_t block_cols, ids=None, dtype="float32"):
    """Rows `ids` (int64 [n], each in [0, rows); None: all rows) of the quantized
    matrix [rows, cols], dequantized -> [n, cols] of dtype.  values: int8 [rows, cols]
    when bits is 0, else the packed_u32 words of bits-bit values [rows, words]."""
    values = _array(values, np.int8 if bits == 0 else np.uint32, 2, "values")
    scales = _array(scales, np.float32, 2, "scales")
    if block_rows <= 0 or block_cols <= 0 or rows % block_rows or cols % block_cols:
        raise _shape_error(f"Block ({block_rows}, {block_cols}) does not divide shape ({rows}, {cols})")
    words = cols if bits == 0 else -(-cols // (32 // bits)) if bits in (2, 4, 8) else 0
    if values.shape[0] != rows or values.shape[1] != words or scales.shape[0] != rows // block_rows \
            or scales.shape[1] != cols // block_cols:
        raise _shape_error(f"values {values.shape} and scales {scales.shape} are not the store of a "
                           f"[{rows}, {cols}] matrix of {bits or 8}-bit values in blocks ({block_rows}, {block_cols})")
    code, np_dtype = _float_dtype(dtype, "dequantize to")
    cdef int64_t n = rows
    cdef const int64_t *pid = NULL
    cdef const int64_t[::1] idv
    if ids is not None:
        n = len(ids)
        if n == 0:
            return np.empty((0, cols), dtype=np_dtype)
        idv = _array(ids, np.int64, 1, "ids")
        pid = &idv[0]
    out = np.empty((n, cols), dtype=np_dtype)
    # memoryviews, not .ctypes.data (a microsecond each): bytes of values, scales, out
    cdef const uint8_t[:, ::1] vv = values.view(np.uint8)
    cdef const float[:, ::1] sv = scales
    cdef uint8_t[:, ::1] ov = out.view(np.uint8)
    cdef int c_dtype = code
    cdef qd_status st
    with nogil:
        st = qd_dequantize_rows(&vv[0, 0], bits, rows, cols, &sv[0, 0], block_rows, block_cols, pid, n,
                                &ov[0, 0], c_dtype)
    _check(st, "dequantize_rows")
    return out


# ---- packed weights ----------------------------------------------------------

cdef class PackedWeights:
    """Weights [N, K] (nn.Linear layout) packed once into the kernels' panel layout."""

    def __cinit__(self, w, scales, block_n, block_k, bits=8):
        self.ptr = NULL
        w = _array(w, np.int8, 2, "w")
        scales = _array(scales, np.float32, 2, "scales")
        cdef int64_t N = w.shape[0], K = w.shape[1], bn = block_n, bk = block_k
        if bn <= 0 or bk <= 0 or N % bn or K % bk:
            raise _shape_error(f"Block ({bn}, {bk}) does not divide the weight shape ({N}, {K})")
        if scales.shape != (N // bn, K // bk):
            raise _shape_error(f"scales must have shape {(N // bn, K // bk)} for block ({bn}, {bk}), got {scales.shape}")
        if bits not in (8, 4, 2):
            raise _error_class(QD_ERR_SCHEME)(f"bits must be 8, 4 or 2, got {bits!r}")
        cdef const int8_t[:, ::1] wv = w
        cdef const float[:, ::1] sv = scales
        cdef int b = bits
        cdef qd_status st
        with nogil:
            st = qd_pack_weights(&wv[0, 0], N, K, b, &sv[0, 0], bn, bk, &self.ptr)
        if st == QD_ERR_ARGUMENT:
            lo, hi = -(1 << (b - 1)), (1 << (b - 1)) - 1
            raise ArgumentError(f"Weight values must lie in [{lo}, {hi}] for bits={b}: "
                                f"got [{int(w.min())}, {int(w.max())}]")
        _check(st, "pack weights")
        self.shape = (N, K)
        self.bits = b
        self.block = (bn, bk)

    def __dealloc__(self):
        qd_packed_weights_free(self.ptr)

    @property
    def nbytes(self):
        return qd_packed_weights_nbytes(self.ptr)

    def unpack(self):
        """-> (int8 w [N, K], float32 scales grid): the exact inputs."""
        N, K = self.shape
        w = np.empty((N, K), dtype=np.int8)
        scales = np.empty((N // self.block[0], K // self.block[1]), dtype=np.float32)
        cdef int8_t[:, ::1] wv = w
        cdef float[:, ::1] sv = scales
        with nogil:
            st = qd_unpack_weights(self.ptr, &wv[0, 0], &sv[0, 0])
        _check(st, "unpack weights")
        return w, scales

    def dequantize(self, dtype="float32"):
        """-> w * its scales [N, K] in dtype (bfloat16 as uint16 bits), read from the
        panels a few rows at a time: unpack()'s values scaled as dequantize_rows does."""
        code, np_dtype = _float_dtype(dtype, "dequantize to")
        out = np.empty(self.shape, dtype=np_dtype)
        cdef uint8_t[:, ::1] ov = out.view(np.uint8)
        cdef int c_dtype = code
        cdef qd_status st
        with nogil:
            st = qd_dequantize_packed(self.ptr, &ov[0, 0], c_dtype)
        _check(st, "dequantize packed weights")
        return out

    def __repr__(self):
        return f"PackedWeights(shape={self.shape}, bits={self.bits}, block={self.block})"


cdef PackedWeights _packed(pw):
    if not isinstance(pw, PackedWeights):
        raise ArgumentTypeError(f"Expected PackedWeights, got {type(pw).__name__}")
    return <PackedWeights>pw


def _check_k(int64_t K, PackedWeights pw, name):
    if K != pw.shape[1]:
        raise _shape_error(f"{name} has K={K} but the weights have shape {pw.shape} (K={pw.shape[1]})")


def _against_weights(x, dtype, pw, name, out_dtype):
    """Validate an [M, K] operand against packed weights [N, K]; allocate [M, N]."""
    w = _packed(pw)
    x = _array(x, dtype, 2, name)
    _check_k(x.shape[1], w, name)
    return x, w, np.empty((x.shape[0], w.shape[0]), dtype=out_dtype)


# ---- matmuls -----------------------------------------------------------------

def int_matmul(a, b):
    """Exact int8 [M, K] @ int8 [K, N] -> int32 [M, N] (K <= 131071)."""
    a = _array(a, np.int8, 2, "a")
    b = _array(b, np.int8, 2, "b")
    cdef int64_t M = a.shape[0], K = a.shape[1], N = b.shape[1]
    if b.shape[0] != K:
        raise _shape_error(f"int_matmul shapes {a.shape} and {b.shape} do not agree on K")
    c = np.empty((M, N), dtype=np.int32)
    cdef const int8_t[:, ::1] av = a
    cdef const int8_t[:, ::1] bv = b
    cdef int32_t[:, ::1] cv = c
    cdef qd_status st
    with nogil:
        st = qd_int_matmul_s8(&av[0, 0], M, K, &bv[0, 0], N, &cv[0, 0])
    _check(st, f"int_matmul of {a.shape} and {b.shape}")
    return c


def int_matmul_packed(a, pw):
    """Exact int8 a [M, K] @ w.T for packed weights w [N, K] -> int32 [M, N]."""
    cdef PackedWeights w
    a, w, c = _against_weights(a, np.int8, pw, "a", np.int32)
    cdef int64_t M = a.shape[0], K = a.shape[1]
    cdef const int8_t[:, ::1] av = a
    cdef int32_t[:, ::1] cv = c
    cdef qd_status st
    with nogil:
        st = qd_int_matmul_packed(&av[0, 0], M, K, w.ptr, &cv[0, 0])
    _check(st, f"int_matmul_packed of {a.shape} and weights {w.shape}")
    return c


def qq_matmul(a, a_scales, a_block_m, a_block_k, pw):
    """Quantized a [M, K] (scales grid in blocks (a_block_m, a_block_k)) @ w.T -> float32."""
    cdef PackedWeights w
    a, w, out = _against_weights(a, np.int8, pw, "a", np.float32)
    a_scales = _array(a_scales, np.float32, 2, "a_scales")
    cdef int64_t M = a.shape[0], K = a.shape[1], bm = a_block_m, bk = a_block_k
    if bm <= 0 or bk <= 0 or M % bm or K % bk:
        raise _shape_error(f"Block ({bm}, {bk}) does not divide a's shape ({M}, {K})")
    if a_scales.shape != (M // bm, K // bk):
        raise _shape_error(f"a_scales must have shape {(M // bm, K // bk)}, got {a_scales.shape}")
    cdef const int8_t[:, ::1] av = a
    cdef const float[:, ::1] sv = a_scales
    cdef float[:, ::1] ov = out
    cdef qd_status st
    with nogil:
        st = qd_qq_matmul(&av[0, 0], M, K, &sv[0, 0], bm, bk, w.ptr, &ov[0, 0])
    _check(st, "qq_matmul")
    return out


def fq_matmul(x, pw):
    """Weight-only: float32 x [M, K] @ dequantize(w).T -> float32 [M, N]."""
    cdef PackedWeights w
    x, w, out = _against_weights(x, np.float32, pw, "x", np.float32)
    cdef int64_t M = x.shape[0], K = x.shape[1]
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] ov = out
    cdef qd_status st
    with nogil:
        st = qd_fq_matmul_f32(&xv[0, 0], M, K, w.ptr, &ov[0, 0])
    _check(st, "fq_matmul")
    return out


def fq_fold_scales(scales):
    """(x's scales s * 2^-e, 2^e) for fq of a weight with one row of float32 `scales`
    along K (1-D, or a grid of one row or one column; qd_fq_fold_scales), or None
    where they can't be folded into x."""
    _array(scales, np.float32, np.ndim(scales), "scales")  # the type checks
    if scales.ndim > 2 or (scales.ndim == 2 and min(scales.shape) != 1):
        raise _shape_error(f"scales must be one row or one column, got shape {scales.shape}")
    cdef const float[::1] sv = _array(np.ravel(scales), np.float32, 1, "scales")
    x_scales = np.empty(sv.shape[0], np.float32)
    cdef float[::1] xv = x_scales
    cdef float power = 1.0
    cdef int folded
    with nogil:
        folded = qd_fq_fold_scales(&sv[0], sv.shape[0], &xv[0], &power)
    return (x_scales, power) if folded else None


def w8a8_matmul(x, act_value, act_block_k, pw):
    """float32 x quantized per row in blocks of act_block_k (f32 scales), then qq."""
    cdef PackedWeights w
    x, w, out = _against_weights(x, np.float32, pw, "x", np.float32)
    cdef int64_t M = x.shape[0], K = x.shape[1], bk = act_block_k
    if act_value not in _VALUE_KINDS:
        raise _error_class(QD_ERR_SCHEME)(f"Unknown value kind {act_value!r}: use one of {list(_VALUE_KINDS)}")
    if bk <= 0 or K % bk:
        raise _shape_error(f"act_block_k={bk} does not divide K={K}")
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] ov = out
    cdef int kind = _VALUE_KINDS[act_value]
    cdef qd_status st
    with nogil:
        st = qd_w8a8_matmul_f32(&xv[0, 0], M, K, kind, bk, w.ptr, &ov[0, 0])
    _check(st, "w8a8_matmul")
    return out


# ---- half-precision conversions (any shape; bf16 as uint16) --------------------

def _half_in(h, name):
    if not isinstance(h, np.ndarray) or h.dtype not in (np.float16, np.uint16):
        raise ArgumentTypeError(f"{name} must be a float16 or uint16 numpy array")
    return np.ascontiguousarray(h).view(np.uint16)


def f16_to_f32(h):
    src = _half_in(h, "h")
    out = np.empty(src.shape, dtype=np.float32)
    cdef const uint16_t[::1] s = src.reshape(-1)
    cdef float[::1] d = out.reshape(-1)
    cdef int64_t n = src.size
    if n:
        with nogil:
            qd_convert_f16_to_f32(&s[0], n, &d[0])
    return out


def bf16_to_f32(h):
    src = _half_in(h, "h")
    out = np.empty(src.shape, dtype=np.float32)
    cdef const uint16_t[::1] s = src.reshape(-1)
    cdef float[::1] d = out.reshape(-1)
    cdef int64_t n = src.size
    if n:
        with nogil:
            qd_convert_bf16_to_f32(&s[0], n, &d[0])
    return out


def f32_to_f16(x):
    src = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(src.shape, dtype=np.float16)
    cdef const float[::1] s = src.reshape(-1)
    cdef uint16_t[::1] d = out.view(np.uint16).reshape(-1)
    cdef int64_t n = src.size
    if n:
        with nogil:
            qd_convert_f32_to_f16(&s[0], n, &d[0])
    return out


def f32_to_bf16(x):
    src = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(src.shape, dtype=np.uint16)
    cdef const float[::1] s = src.reshape(-1)
    cdef uint16_t[::1] d = out.reshape(-1)
    cdef int64_t n = src.size
    if n:
        with nogil:
            qd_convert_f32_to_bf16(&s[0], n, &d[0])
    return out
