/* qdispatch.h: the public C interface of the qdispatch kernels.
 *
 * C99, no Python or CUDA headers.  Every entry point validates its arguments
 * and returns a qd_status; none aborts on bad input.  Entry points give
 * QD_ERR_ARGUMENT for sizes that no array could have (its bytes would overflow
 * ptrdiff_t) and for an output array that overlaps an input or another output
 * (only qd_cuda_add_bias_f32 may write over its x, exactly).  All arrays are row-major and C-contiguous.  The only global state is the ISA
 * choice, the thread count and the CUDA decode's batch invariance.
 * Entry points may run on several threads at once where no call writes an array that
 * another reads or writes, and qd_isa_set, qd_isa_reset and qd_set_num_threads may be
 * called meanwhile (a call under way finishes on either setting).  An output that
 * overlaps memory the library allocated (packed weights) is not looked for.
 * Typed pointers must be aligned to their type, as C requires of them (a float * to
 * 4 bytes): the CPU entry points check alignment only for their void * arguments, and
 * the CUDA ones say what more they need.
 */
#ifndef QDISPATCH_H
#define QDISPATCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library's own files are compiled with hidden visibility: what this header
 * declares is all that libqdispatch exports. */
#if defined(__GNUC__) && !defined(_WIN32)
#pragma GCC visibility push(default)
#endif

/* ---- version ----
 * QD_ABI_VERSION goes up whenever an entry point's arguments or meaning change.  A program
 * should check qd_abi_version() == QD_ABI_VERSION before its first call: that catches a
 * different libqdispatch found at run time than the header it was compiled against. */
#define QD_ABI_VERSION 2

/* The ABI version of the library linked in. */
int qd_abi_version(void);
/* The qdispatch release the library was built from, such as "0.1.0"; never NULL. */
const char *qd_version(void);

/* ---- backends ---- */
typedef enum qd_backend { QD_BACKEND_REFERENCE = 0, QD_BACKEND_CPU = 1, QD_BACKEND_CUDA = 2, QD_BACKEND_COUNT = 3 } qd_backend;

/* ---- status ---- */
typedef enum qd_status {
    QD_OK = 0,
    QD_ERR_NULL = 1,              /* a required pointer is NULL */
    QD_ERR_SHAPE = 2,             /* a dimension is <= 0, a block does not divide its dim, dimensions
                                     disagree (K against packed weights' K, n against rows), or (CUDA)
                                     one past a kernel's limit: M, N, K < 2^31, a transpose's batch <= 65535 */
    QD_ERR_ARGUMENT = 3,          /* an argument's value is out of range (an enum, a size, an id, a
                                     weight value for its bits), or an output overlaps an input */
    QD_ERR_SCHEME = 4,            /* unknown value kind / scale dtype / bit width */
    QD_ERR_ISA_NOT_BUILT = 5,     /* the ISA's kernels are not compiled into this library */
    QD_ERR_ISA_NOT_SUPPORTED = 6, /* this CPU (or OS) does not support the ISA */
    QD_ERR_NO_MEMORY = 7,
    QD_ERR_K_TOO_LARGE = 8,       /* K > QD_INT_MATMUL_MAX_K: int32 could overflow */
    QD_ERR_NOT_FINITE = 9,        /* NaN or Inf in an input that is quantized */
    QD_ERR_SCALE_OVERFLOW = 10,   /* a scale does not fit its scale dtype */
    QD_ERR_CUDA_UNAVAILABLE = 11, /* CUDA not built, or no device */
    QD_ERR_CUDA = 12              /* a CUDA runtime call failed */
} qd_status;

/* A short English sentence for a status; never NULL. */
const char *qd_status_string(qd_status status);

/* Largest K for which an int8 x int8 dot product is exact in int32:
 * 131071 * 128 * 128 < 2^31 <= 131072 * 128 * 128. */
#define QD_INT_MATMUL_MAX_K 131071

/* ---- instruction sets ---- */
typedef enum qd_isa {
    QD_ISA_SCALAR = 0,
    QD_ISA_AVX2 = 1,
    QD_ISA_AVXVNNI = 2,
    QD_ISA_AVX512VNNI = 3,
    QD_ISA_NEON_DOTPROD = 4,
    QD_ISA_AMX = 5,             /* AMX-INT8 tiles for qq, AVX-512 VNNI for the rest */
    QD_ISA_COUNT = 6
} qd_isa;

/* "scalar", "avx2", "avxvnni", "avx512vnni", "neon_dotprod", "amx"; "?" if out of range. */
const char *qd_isa_name(qd_isa isa);
/* Parses a name as returned by qd_isa_name (case-insensitive), or "neon" for
 * neon_dotprod; any other name is QD_ERR_ARGUMENT. */
qd_status qd_isa_from_name(const char *name, qd_isa *out);
/* 1 if the ISA's kernels are compiled into this library. */
int qd_isa_built(qd_isa isa);
/* 1 if this CPU and OS can run the ISA (cpuid + xgetbv, detected once). */
int qd_isa_supported(qd_isa isa);
/* The ISA in use: the override if one is set, else the best built and supported. */
qd_isa qd_isa_active(void);
/* Forces an ISA; fails unless built and supported. */
qd_status qd_isa_set(qd_isa isa);
/* Drops the override: back to the best built and supported ISA. */
void qd_isa_reset(void);

/* ---- threads ---- */
/* n <= 0 restores the default: OMP_NUM_THREADS's count where it names one (its first
 * entry), else the number of processors the process may run on, either read at the
 * first call that needs it; n (and OMP_NUM_THREADS) above 4 per processor
 * counts as 4 per processor.  A library built without OpenMP runs on one thread: it
 * accepts n, and qd_get_num_threads() returns 1.  Where the system refuses threads (a
 * container's limit on tasks, say), the kernels run on as many as it let start, which
 * qd_get_num_threads() then returns, until the next qd_set_num_threads: OpenMP would
 * end the process. */
void qd_set_num_threads(int n);
int qd_get_num_threads(void);
/* 0, or the threads the kernels fell back to when the system refused more: the most
 * it let a team start since the last qd_set_num_threads. */
int qd_thread_cap(void);
/* 1 in a process forked after the library was loaded: OpenMP's threads do not survive
 * fork(), so there the kernels run on one thread, whatever qd_set_num_threads said.
 * A build without OpenMP runs on one thread anyway, watches no forks and returns 0. */
int qd_forked_child(void);

/* ---- quantization ---- */
typedef enum qd_value { QD_Q8S = 0, QD_Q8F = 1, QD_Q4S = 2, QD_Q4F = 3, QD_Q2S = 4, QD_Q2F = 5 } qd_value;
typedef enum qd_scale_dtype { QD_SCALE_F32 = 0, QD_SCALE_F16 = 1, QD_SCALE_BF16 = 2 } qd_scale_dtype;

/* Quantizes x [rows, cols] in blocks of [block_rows, block_cols]:
 *   scale = (2*amax)/(b - a) in float32, computed as amax / ((b - a) / 2) so that
 *   an amax near FLT_MAX does not overflow, and at least the smallest subnormal
 *   where it would round to 0; stored in scale_dtype rounded up (1.0 for an
 *   all-zero block); q = clamp(rint(x / scale), a, b) with an
 *   IEEE float32 division and round half to even.  That assumes the default
 *   floating-point environment (round to nearest, no flush-to-zero): a caller
 *   that changed it gets divisions and rint in its mode.
 * scales: [rows/block_rows, cols/block_cols] float32 (the stored values).
 * bad_index (optional): on QD_ERR_NOT_FINITE, the flat index of the first
 * NaN/Inf; on QD_ERR_SCALE_OVERFLOW, the flat index of the offending scale.
 * A float16 scale below 2^-20 has few steps left (one below 2^-24 becomes 2^-24, and
 * its block's values may all round to 0): that is QD_OK, and the scales returned show
 * it (the Python package warns there). */
qd_status qd_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                          int64_t block_rows, int64_t block_cols, int scale_dtype,
                          float *scales, int8_t *q, int64_t *bad_index);

/* Float dtypes of host arrays (the numbers of qd_cuda_dtype's float dtypes); 16-bit
 * values as their uint16 bit patterns. */
typedef enum qd_float_dtype { QD_FLOAT32 = 0, QD_FLOAT16 = 1, QD_BFLOAT16 = 2 } qd_float_dtype;

/* qd_quantize_f32 for x of x_dtype (QD_FLOAT32, QD_FLOAT16 or QD_BFLOAT16; another is
 * QD_ERR_ARGUMENT), each value read as its exact float32: the bits (q, scales, status,
 * bad_index) of quantizing x's float32 copy, without the copy (16-bit values are
 * widened a few KiB at a time, on the threads that read them). */
qd_status qd_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols, int value_kind,
                      int64_t block_rows, int64_t block_cols, int scale_dtype,
                      float *scales, int8_t *q, int64_t *bad_index);

/* Rows `ids` of a quantized matrix, dequantized (an embedding lookup): out[i, c] =
 * value(ids[i], c) * scales[ids[i] / block_rows, c / block_cols], the float32 product,
 * written as out_dtype (16-bit dtypes rounded from it to nearest even), without
 * dequantizing the other rows.  values: int8 [rows, cols] when bits == 0, else the
 * packed_u32 store of `bits`-bit values (2, 4 or 8): 32/bits values a uint32, lowest
 * bits first, each row a whole number of words.  scales: [rows/block_rows,
 * cols/block_cols] float32.  ids NULL: every row in turn (n must be rows, else
 * QD_ERR_SHAPE), the whole matrix.  An id outside [0, rows) is QD_ERR_ARGUMENT, before anything is written, and
 * so are packed values not aligned to 4 bytes and an out not aligned to its dtype's
 * size.  n = 0 with ids given writes nothing (out may be NULL). */
qd_status qd_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols,
                             const float *scales, int64_t block_rows, int64_t block_cols,
                             const int64_t *ids, int64_t n, void *out, int out_dtype);

/* The packed_u32 store of `bits`-bit values (2, 4 or 8), as QTensors keep it: each row
 * of `cols` int8 values becomes ceil(cols / (32 / bits)) uint32 words, 32 / bits values
 * a word, lowest bits first, the last word zero-padded.  Packing keeps each value's low
 * `bits` bits (two's complement; values out of range wrap); unpacking sign-extends them.
 * q and words must not overlap. */
qd_status qd_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits, uint32_t *words);
qd_status qd_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols, int bits, int8_t *q);

/* ---- packed weights ----
 * Made only by qd_pack_weights: the functions that take them return QD_ERR_ARGUMENT
 * for memory that qd_pack_weights did not fill (zeroed memory, say).  They tell by a
 * tag in the memory's first 8 bytes, so such memory must have 8 readable bytes. */
typedef struct qd_packed_weights qd_packed_weights;

/* w: [N, K] int8 (nn.Linear layout), values in range for `bits` (8, 4 or 2; one
 * outside, such as 8 at 4 bits, is QD_ERR_ARGUMENT); scales: [N/block_n, K/block_k]
 * float32, taken as given (may be NULL: all ones).  *out is NULL
 * after any error but one: an out inside w or scales is QD_ERR_ARGUMENT, written to
 * nothing. */
qd_status qd_pack_weights(const int8_t *w, int64_t N, int64_t K, int bits,
                          const float *scales, int64_t block_n, int64_t block_k,
                          qd_packed_weights **out);
/* Does nothing for NULL or for anything qd_pack_weights did not make.  Free each once:
 * as with free(), a second call on the same pointer reads memory already given back. */
void qd_packed_weights_free(qd_packed_weights *pw);
/* Bytes held by the packed weights (panels + scales). 0 for NULL and for anything
 * qd_pack_weights did not make. */
size_t qd_packed_weights_nbytes(const qd_packed_weights *pw);
/* Shape and format of packed weights; any out pointer may be NULL. */
qd_status qd_packed_weights_info(const qd_packed_weights *pw, int64_t *N, int64_t *K, int *bits,
                                 int64_t *block_n, int64_t *block_k);
/* Writes back the exact inputs: w_out [N, K], scales_out [N/block_n, K/block_k]
 * (either may be NULL to skip it). */
qd_status qd_unpack_weights(const qd_packed_weights *pw, int8_t *w_out, float *scales_out);

/* Packed weights [N, K] dequantized whole (qd_dequantize_rows of their values,
 * scales and blocks, every row): out[n, k] = w[n, k] * scale, the float32 product,
 * written as out_dtype (16-bit dtypes rounded to nearest even).  The panels are read
 * in place, a few rows at a time, so no int8 copy of the matrix is made (what
 * qd_unpack_weights then qd_dequantize_rows would take).  out holds N x K values of
 * out_dtype (N and K from qd_packed_weights_info); an out not aligned to its dtype's
 * size is QD_ERR_ARGUMENT. */
qd_status qd_dequantize_packed(const qd_packed_weights *pw, void *out, int out_dtype);

/* ---- integer matmul (exact) ---- */
/* c[M, N] = a[M, K] @ b[K, N] in int32; K <= QD_INT_MATMUL_MAX_K. */
qd_status qd_int_matmul_s8(const int8_t *a, int64_t M, int64_t K, const int8_t *b, int64_t N,
                           int32_t *c);
/* c[m, n] = sum_k a[m, k] * w[n, k] against packed weights (scales ignored). */
qd_status qd_int_matmul_packed(const int8_t *a, int64_t M, int64_t K,
                               const qd_packed_weights *w, int32_t *c);

/* ---- quantized matmuls (float32 out) ---- */
/* out[m, n] = sum over K-groups g of (a_scale(m, g) * w_scale(n, g)) * exact int32 dot
 * of the group; groups are gcd(a_block_k, w_block_k) long (a group past
 * QD_INT_MATMUL_MAX_K is split, each part scaled as a group of its own; the Python
 * package sums such groups whole, in int64). a_scales: [M/a_block_m, K/a_block_k]. */
qd_status qd_qq_matmul(const int8_t *a, int64_t M, int64_t K, const float *a_scales,
                       int64_t a_block_m, int64_t a_block_k, const qd_packed_weights *w,
                       float *out);
/* Weight-only: out[M, N] = x[M, K] @ dequantize(w).T with float32 accumulation, whose
 * order, and so the last bits, differ between ISAs (qq's results do not). */
qd_status qd_fq_matmul_f32(const float *x, int64_t M, int64_t K, const qd_packed_weights *w,
                           float *out);
/* fq of a weight with one row of scales for all of N (a scale per input channel, or
 * blocks along K alone): x can take the scales.  x[k] * x_scales[k / block_k], each
 * product rounded once, times the weight's values as one group scaled by *power, is
 * x @ dequantize(w).T within fq's float32 rounding for terms above 2^-110 in
 * magnitude.  x_scales[i] = scales[i] * 2^-e and *power = 2^e, e the least >= 0 with
 * every |scales[i]| < 2^e, so that no finite x overflows where a weight value of 0
 * leaves its term at 0.  Returns 1, or 0 with nothing written where a scale is not
 * finite or is 2^16 or more (dividing by more would take small scales' bits).
 * qd_fq_matmul_f32 does this itself where it pays (groups of no whole SIMD unit). */
int qd_fq_fold_scales(const float *scales, int64_t n, float *x_scales, float *power);
/* W8A8: quantizes x in blocks of [1, act_block_k] (float32 scales, same math as
 * qd_quantize_f32), then runs the qq kernel. */
qd_status qd_w8a8_matmul_f32(const float *x, int64_t M, int64_t K, int act_value_kind,
                             int64_t act_block_k, const qd_packed_weights *w, float *out);

/* ---- half-precision conversions (uint16 bit patterns, round to nearest even) ----
 * n = 0 converts nothing and returns QD_OK; n < 0 is QD_ERR_SHAPE. */
qd_status qd_convert_f16_to_f32(const uint16_t *src, int64_t n, float *dst);
qd_status qd_convert_bf16_to_f32(const uint16_t *src, int64_t n, float *dst);
qd_status qd_convert_f32_to_f16(const float *src, int64_t n, uint16_t *dst);
qd_status qd_convert_f32_to_bf16(const float *src, int64_t n, uint16_t *dst);

/* ---- CUDA entry points (see qd_cuda_available) ---- */
/* All pointers are device pointers unless said otherwise; `stream` is a
 * cudaStream_t (NULL: the legacy default stream).  Work is queued on the
 * stream; only the qd_cuda_quantize functions and qd_cuda_largest_magnitude wait for it
 * (to report bad input, or their result).
 * Built without CUDA, every function returns QD_ERR_CUDA_UNAVAILABLE. */
typedef enum qd_cuda_dtype {
    QD_CUDA_F32 = 0, QD_CUDA_F16 = 1, QD_CUDA_BF16 = 2, QD_CUDA_S8 = 3, QD_CUDA_S32 = 4
} qd_cuda_dtype;

/* 1 if this library has CUDA kernels and a device and driver can run them. */
int qd_cuda_available(void);
/* Text of the last failed CUDA call on this thread ("" if none); a library built
 * without CUDA says so. */
const char *qd_cuda_last_error(void);

/* dst[i] = (dst_dtype) src[i] for float dtypes (round to nearest even). */
qd_status qd_cuda_cast(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n,
                       void *stream);
/* float32 x [rows, cols] (rows ldx apart) as three bfloat16 parts, parts [3][rows][ld]
 * (zero in columns cols..ld): x == hi + mid + lo for normal values, each part rounded
 * from what the parts before it left; an inf or NaN stays in hi.  A 16-bit GEMM of
 * the parts, stacked as 3 x rows rows, and qd_cuda_sum3_f32 give float32 x's product. */
qd_status qd_cuda_split_bf16(const float *x, int64_t rows, int64_t cols, int64_t ldx, void *parts,
                             int64_t ld, void *stream);
/* float32 out [rows, ld] = x [rows, cols] (float32/float16/bfloat16, rows ldx apart) times
 * scales[c] per column, each product rounded once to nearest even; zero in columns
 * cols..ld.  fq of a weight with one row of scales for all of N multiplies x scaled so
 * (by qd_fq_fold_scales's x_scales). */
qd_status qd_cuda_scale_columns(const void *x, int x_dtype, int64_t rows, int64_t cols, int64_t ldx,
                                const float *scales, float *out, int64_t ld, void *stream);
/* out[i] = (a[i] + a[n + i]) + a[2n + i] for float32 a [3][n], written as out_dtype. */
qd_status qd_cuda_sum3_f32(const float *a, int64_t n, void *out, int out_dtype, void *stream);
/* out[r, c] = x[r, c] + bias[c] (float32; out may be x). */
qd_status qd_cuda_add_bias_f32(const float *x, int64_t rows, int64_t cols, const float *bias,
                               float *out, void *stream);
/* dst[b, c, r] = src[b, r, c] for elements of elem_size bytes (1, 2 or 4). */
qd_status qd_cuda_transpose(const void *src, int64_t batch, int64_t rows, int64_t cols,
                            int elem_size, void *dst, void *stream);
/* dst[r, c] = src[r, c] for c < cols, 0 for cols <= c < dst_ld (int8 rows padded with zeros). */
qd_status qd_cuda_pad_s8(const int8_t *src, int64_t rows, int64_t cols, int8_t *dst,
                         int64_t dst_ld, void *stream);
/* The packed_u32 store: 32/bits values per word along rows of `cols` values. */
qd_status qd_cuda_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits,
                           uint32_t *words, void *stream);
qd_status qd_cuda_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols, int bits,
                             int8_t *q, void *stream);

/* Bytes of device scratch that qd_cuda_quantize and qd_cuda_quantize_f32 need. */
#define QD_CUDA_QUANTIZE_SCRATCH 16
/* Same contract and bits as qd_quantize_f32; scratch: QD_CUDA_QUANTIZE_SCRATCH device
 * bytes, 8-byte aligned; bad_index is a host pointer. */
qd_status qd_cuda_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                               int64_t block_rows, int64_t block_cols, int scale_dtype,
                               float *scales, int8_t *q, void *scratch, int64_t *bad_index,
                               void *stream);
/* qd_cuda_quantize_f32 for x of x_dtype (QD_CUDA_F32, F16 or BF16), each value read
 * as its exact float32: the bits of quantizing x's float32 copy, without the copy. */
qd_status qd_cuda_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols, int value_kind,
                           int64_t block_rows, int64_t block_cols, int scale_dtype, float *scales,
                           int8_t *q, void *scratch, int64_t *bad_index, void *stream);
/* The largest magnitude of x's n float32 values, written to the host's *largest: one
 * reduction on the device, so that a check of a scale grid (quantize's, against
 * dequantizing past float32's range) copies 4 bytes to the host, not the grid.  Waits
 * for the stream.  A NaN or an infinity in x is QD_ERR_NOT_FINITE.  scratch:
 * QD_CUDA_QUANTIZE_SCRATCH device bytes, 8-byte aligned. */
qd_status qd_cuda_largest_magnitude(const float *x, int64_t n, float *largest, void *scratch,
                                    void *stream);
/* out[r, c] = value(r, c) * scales[r / block_rows, c / block_cols] (float32).  values:
 * int8 [rows, cols] when bits == 0, else packed_u32 words of `bits`-bit values.  In a
 * 16-bit dtype: qd_cuda_dequantize_rows without ids. */
qd_status qd_cuda_dequantize(const void *values, int bits, int64_t rows, int64_t cols,
                             const float *scales, int64_t block_rows, int64_t block_cols,
                             float *out, void *stream);
/* The rows `ids` of that dequantized matrix (an embedding lookup): out[i, c] =
 * value(ids[i], c) * scales[ids[i] / block_rows, c / block_cols] for the n ids
 * (int64, in device memory), without dequantizing the other rows; out [n, cols] of
 * out_dtype (QD_CUDA_F32, F16 or BF16: the float32 product rounded to nearest even).
 * An id outside [0, rows) gives a row of NaN in out: check ids that come from outside.
 * ids NULL: every row in turn (n must be rows, else QD_ERR_SHAPE), the whole matrix in
 * out_dtype. */
qd_status qd_cuda_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols,
                                  const float *scales, int64_t block_rows, int64_t block_cols,
                                  const int64_t *ids, int64_t n, void *out, int out_dtype,
                                  void *stream);

/* c[M, N] = a[M, K] @ bt[N, K]^T in int32, exact.  Rows of a and bt are `ld` bytes
 * apart, ld % 16 == 0, a and bt 16-byte aligned, bytes K..round_up(K, 16) zero;
 * K <= QD_INT_MATMUL_MAX_K. */
qd_status qd_cuda_int_matmul_s8(const int8_t *a, const int8_t *bt, int64_t M, int64_t N,
                                int64_t K, int64_t ld, int32_t *c, void *stream);
/* out[m, n] = sum over K-groups g of (a_scale(m, g) * b_scale(n, g)) * exact int32 dot of
 * the group, groups gcd(a_block_k, b_block_k) long (split past QD_INT_MATMUL_MAX_K, as
 * for qd_qq_matmul).  a, bt as for qd_cuda_int_matmul_s8;
 * a_scales [M/a_block_m, K/a_block_k], b_scales [N/b_block_n, K/b_block_k];
 * out_dtype QD_CUDA_F32, QD_CUDA_F16 or QD_CUDA_BF16. */
qd_status qd_cuda_qq_matmul(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K,
                            int64_t ld, const float *a_scales, int64_t a_block_m,
                            int64_t a_block_k, const float *b_scales, int64_t b_block_n,
                            int64_t b_block_k, void *out, int out_dtype, void *stream);
/* Weight-only products stream the weights and their scales in tiled forms, laid
 * out once per weight: qd_cuda_fq_tiles_bytes(N, K, bits) bytes, written by
 * qd_cuda_fq_tile_weights from int8 values q [N, ld] (K-contiguous, ld >= K), and
 * qd_cuda_fq_scale_tiles_bytes(N, K, block_k) bytes, written by
 * qd_cuda_fq_tile_scales from float32 scales [N/block_n, K/block_k] (row-major).
 * Both return once the tiles are written (they synchronize `stream`).  On sm_90 GPUs
 * qd_cuda_fq_matmul starts reading the tiles while the kernel before it on the
 * stream still runs (it waits for that kernel before reading x or writing out), so
 * tiles must not be written by work still queued.  Both sizes are 0 for bits other
 * than 8, 4 or 2, for block_k, N or K <= 0, for a block_k that does not divide K, and
 * where the size would pass INT64_MAX: the tiling calls refuse all of those. */
static inline int64_t qd_cuda_tiles_size(int64_t row_groups, int64_t k_tiles, int64_t tile_bytes) {
    if (row_groups <= 0 || k_tiles <= 0 || tile_bytes <= 0 || row_groups > INT64_MAX / tile_bytes / k_tiles)
        return 0;
    return row_groups * k_tiles * tile_bytes;
}
static inline int64_t qd_cuda_fq_tiles_bytes(int64_t N, int64_t K, int bits) {
    const int64_t tile_k = bits > 0 ? 16 * (16 / bits) : 0;  /* 512-byte tiles of 16 rows */
    if ((bits != 8 && bits != 4 && bits != 2) || N <= 0 || K <= 0)
        return 0;
    return qd_cuda_tiles_size(N / 16 + (N % 16 != 0), K / tile_k + (K % tile_k != 0), 512);
}
static inline int64_t qd_cuda_fq_scale_tiles_bytes(int64_t N, int64_t K, int64_t block_k) {
    if (block_k <= 0 || N <= 0 || K <= 0 || K % block_k)
        return 0;
    return qd_cuda_tiles_size(N / 16 + (N % 16 != 0), K / block_k, 64);  /* 16 rows' float32 scales a block */
}
qd_status qd_cuda_fq_tile_weights(const int8_t *q, int64_t N, int64_t K, int64_t ld, int bits,
                                  void *tiles, void *stream);
qd_status qd_cuda_fq_tile_scales(const float *scales, int64_t N, int64_t K, int64_t block_n,
                                 int64_t block_k, void *scale_tiles, void *stream);
/* The int8 values q [N, ld] back from their tiles (the inverse of
 * qd_cuda_fq_tile_weights), queued on `stream`. */
qd_status qd_cuda_fq_untile_weights(const void *tiles, int64_t N, int64_t K, int bits, int8_t *q,
                                    int64_t ld, void *stream);
/* Rows `ids` of a weight [N, K] whose values are in tiles, dequantized: as
 * qd_cuda_dequantize_rows on those values, with scales [N/block_rows, K/block_cols]
 * (row-major, as for the store), reading only the rows asked for. */
qd_status qd_cuda_fq_dequantize_rows(const void *tiles, int bits, int64_t N, int64_t K,
                                     const float *scales, int64_t block_rows, int64_t block_cols,
                                     const int64_t *ids, int64_t n, void *out, int out_dtype,
                                     void *stream);
/* Weight-only small-M product: out[M, N] = x[M, K] @ dequantize(w)^T with float32
 * accumulation, for M <= 32 (16 for float32 x, and with batch invariance on; larger M
 * runs in slices of that many rows, each streaming the weights, except where
 * qd_cuda_fq_wide_supported says more than 40 rows go in one launch; its splits of K
 * meet in thread-block clusters or in a temporary from the device's default memory
 * pool, taken in stream order).  x: [M, ldx] of
 * x_dtype (QD_CUDA_F32, QD_CUDA_F16 or QD_CUDA_BF16), its rows 16-byte aligned (x too);
 * tiles and scale_tiles: the weight laid out as above (16-byte aligned), block_k its
 * scales' block along K; out_dtype QD_CUDA_F32, QD_CUDA_F16 or QD_CUDA_BF16.  Each stream has its own
 * scratch for partial sums, so calls on several streams may run at once, and calls from
 * several threads are safe (but for the per-thread default stream, whose handle is the
 * same in every thread: its threads share one scratch, so their calls must not overlap).  A call may be captured into a CUDA graph (once the weight's
 * tiles are laid out): the graph holds the capturing stream's scratch, kept from then on
 * for the process's life, so graphs captured on one stream must not run at the same time
 * as each other or as calls queued on that stream. */
qd_status qd_cuda_fq_matmul(const void *x, int x_dtype, int64_t M, int64_t ldx,
                            const void *tiles, const void *scale_tiles, int bits, int64_t N,
                            int64_t K, int64_t block_k, void *out, int out_dtype, void *stream);
/* Many rows of x (prefill): the weight's values as float16 or bfloat16 (dtype) rows
 * w16 [N, ld] (ld a multiple of 8, K <= ld; columns K..ld zero), exact integers,
 * from its tiles; then qd_cuda_fq_gemm multiplies them on the tensor cores as
 * qd_cuda_fq_matmul does: out[M, N] = x[M, K] @ (w16 * scales)^T, float32 sums per
 * block of K, each scaled, added in float32.  x: [M, ld] of the same dtype, zero in
 * columns K..ld; x, w16 and the tiles 16-byte aligned; scales [N/block_n, K/block_k]
 * float32, block_k == K or a multiple of 16.  On H100/H200, when the output tiles are too few
 * to fill the GPU, K is cut into splits whose float32 sums are added in a fixed order
 * in a temporary taken from the device's default memory pool in stream order. */
qd_status qd_cuda_fq_expand_weights(const void *tiles, int64_t N, int64_t K, int bits, int dtype,
                                    void *w16, int64_t ld, void *stream);
qd_status qd_cuda_fq_gemm(const void *x, const void *w16, int dtype, int64_t M, int64_t N, int64_t K,
                          int64_t ld, const float *scales, int64_t block_n, int64_t block_k, void *out,
                          int out_dtype, void *stream);
/* Weight-only product for any blocking along K, from the weight's int8 values as
 * stored: out[M, N] = x[M, K] @ (w * scales)^T, each weight value dequantized as
 * qd_cuda_dequantize gives it, float32 sums on the float units (not the tensor cores).
 * For blockings qd_cuda_fq_matmul does not take (blocks of 8, of 24; one row of scales
 * for all of N can go to it instead, through qd_fq_fold_scales and
 * qd_cuda_scale_columns).  Up to 64 rows, and any M with batch invariance on, run in
 * launches of 16 rows whose results do not depend on the rows they come with.
 * x: [M, ldx] of x_dtype (QD_CUDA_F32, QD_CUDA_F16 or QD_CUDA_BF16); w [N, ldw] int8,
 * K-contiguous, 16-byte aligned, ldw % 16 == 0; scales [N/block_n, K/block_k] float32
 * (row-major); out_dtype QD_CUDA_F32, QD_CUDA_F16 or QD_CUDA_BF16.  Nothing is
 * allocated, so a CUDA graph can capture the call. */
qd_status qd_cuda_fq_values(const void *x, int x_dtype, int64_t M, int64_t ldx, const int8_t *w, int64_t N,
                            int64_t K, int64_t ldw, const float *scales, int64_t block_n, int64_t block_k,
                            void *out, int out_dtype, void *stream);
/* 1 if qd_cuda_fq_matmul takes this weight blocking (bits 8, 4 or 2; block_k a
 * multiple of 16, or one block along K); qd_cuda_fq_values takes every other.  A
 * library built without CUDA returns 0. */
int qd_cuda_fq_supported(int bits, int64_t K, int64_t block_k);
/* 1 if, on the current device, qd_cuda_fq_matmul runs more than 40 rows of 16-bit x
 * in one launch that streams the weights once per 64 rows (an H100/H200 and a build
 * with sm_90a code; batch invariance off), 0 if it runs them in launches of 32. */
int qd_cuda_fq_wide_supported(void);
/* Batch invariance of qd_cuda_fq_matmul and qd_cuda_fq_values, for the whole process
 * (0 by default).  Off: K is cut the fastest way for each M, so a row's last bits may depend on the
 * rows it comes with.  On: slices of 16 rows, K cut as for 16 rows whatever M, and the parts' sums
 * are added in one order, so each row's result is the same bit for bit in any batch;
 * large weights at few rows then take longer.  Launches already queued keep the
 * setting they were made with. */
void qd_cuda_set_batch_invariant(int on);
int qd_cuda_batch_invariant(void);
/* ---- end CUDA ---- */

#if defined(__GNUC__) && !defined(_WIN32)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif

#endif /* QDISPATCH_H */
