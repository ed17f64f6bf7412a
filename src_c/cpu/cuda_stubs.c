/* The CUDA entry points of a library built without CUDA: each one reports
 * QD_ERR_CUDA_UNAVAILABLE, so C code can probe for CUDA at run time. */
#ifndef QD_WITH_CUDA
#include <stdatomic.h>

#include "qdispatch.h"

int qd_cuda_available(void) { return 0; }
const char *qd_cuda_last_error(void) { return "qdispatch was built without CUDA"; }
int qd_cuda_fq_supported(int bits, int64_t K, int64_t block_k) {
    (void)bits; (void)K; (void)block_k;
    return 0;
}
int qd_cuda_fq_wide_supported(void) { return 0; }
/* Kept, so that a program may set it whether or not CUDA is there; atomic, as
 * the CUDA build's is, since any thread may set it while others read it. */
static _Atomic int batch_invariant = 0;
void qd_cuda_set_batch_invariant(int on) { atomic_store(&batch_invariant, on != 0); }
int qd_cuda_batch_invariant(void) { return atomic_load(&batch_invariant); }

#define UNAVAILABLE { return QD_ERR_CUDA_UNAVAILABLE; }

qd_status qd_cuda_cast(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n,
                       void *stream) UNAVAILABLE
qd_status qd_cuda_add_bias_f32(const float *x, int64_t rows, int64_t cols, const float *bias,
                               float *out, void *stream) UNAVAILABLE
qd_status qd_cuda_transpose(const void *src, int64_t batch, int64_t rows, int64_t cols,
                            int elem_size, void *dst, void *stream) UNAVAILABLE
qd_status qd_cuda_pad_s8(const int8_t *src, int64_t rows, int64_t cols, int8_t *dst,
                         int64_t dst_ld, void *stream) UNAVAILABLE
qd_status qd_cuda_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits,
                           uint32_t *words, void *stream) UNAVAILABLE
qd_status qd_cuda_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols, int bits,
                             int8_t *q, void *stream) UNAVAILABLE
qd_status qd_cuda_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                               int64_t block_rows, int64_t block_cols, int scale_dtype,
                               float *scales, int8_t *q, void *scratch, int64_t *bad_index,
                               void *stream) UNAVAILABLE
qd_status qd_cuda_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols, int value_kind,
                           int64_t block_rows, int64_t block_cols, int scale_dtype, float *scales,
                           int8_t *q, void *scratch, int64_t *bad_index, void *stream) UNAVAILABLE
qd_status qd_cuda_largest_magnitude(const float *x, int64_t n, float *largest, void *scratch,
                                    void *stream) UNAVAILABLE
qd_status qd_cuda_dequantize(const void *values, int bits, int64_t rows, int64_t cols,
                             const float *scales, int64_t block_rows, int64_t block_cols,
                             float *out, void *stream) UNAVAILABLE
qd_status qd_cuda_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols,
                                  const float *scales, int64_t block_rows, int64_t block_cols,
                                  const int64_t *ids, int64_t n, void *out, int out_dtype,
                                  void *stream) UNAVAILABLE
qd_status qd_cuda_int_matmul_s8(const int8_t *a, const int8_t *bt, int64_t M, int64_t N,
                                int64_t K, int64_t ld, int32_t *c, void *stream) UNAVAILABLE
qd_status qd_cuda_qq_matmul(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K,
                            int64_t ld, const float *a_scales, int64_t a_block_m,
                            int64_t a_block_k, const float *b_scales, int64_t b_block_n,
                            int64_t b_block_k, void *out, int out_dtype, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_tile_weights(const int8_t *q, int64_t N, int64_t K, int64_t ld, int bits,
                                  void *tiles, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_untile_weights(const void *tiles, int64_t N, int64_t K, int bits, int8_t *q,
                                    int64_t ld, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_dequantize_rows(const void *tiles, int bits, int64_t N, int64_t K,
                                     const float *scales, int64_t block_rows, int64_t block_cols,
                                     const int64_t *ids, int64_t n, void *out, int out_dtype,
                                     void *stream) UNAVAILABLE
qd_status qd_cuda_fq_tile_scales(const float *scales, int64_t N, int64_t K, int64_t block_n,
                                 int64_t block_k, void *scale_tiles, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_matmul(const void *x, int x_dtype, int64_t M, int64_t ldx,
                            const void *tiles, const void *scale_tiles, int bits, int64_t N,
                            int64_t K, int64_t block_k, void *out, int out_dtype, void *stream) UNAVAILABLE
qd_status qd_cuda_split_bf16(const float *x, int64_t rows, int64_t cols, int64_t ldx, void *parts,
                             int64_t ld, void *stream) UNAVAILABLE
qd_status qd_cuda_scale_columns(const void *x, int x_dtype, int64_t rows, int64_t cols, int64_t ldx,
                                const float *scales, float *out, int64_t ld, void *stream) UNAVAILABLE
qd_status qd_cuda_sum3_f32(const float *a, int64_t n, void *out, int out_dtype, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_expand_weights(const void *tiles, int64_t N, int64_t K, int bits, int dtype,
                                    void *w16, int64_t ld, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_gemm(const void *x, const void *w16, int dtype, int64_t M, int64_t N, int64_t K,
                          int64_t ld, const float *scales, int64_t block_n, int64_t block_k, void *out,
                          int out_dtype, void *stream) UNAVAILABLE
qd_status qd_cuda_fq_values(const void *x, int x_dtype, int64_t M, int64_t ldx, const int8_t *w, int64_t N,
                            int64_t K, int64_t ldw, const float *scales, int64_t block_n, int64_t block_k,
                            void *out, int out_dtype, void *stream) UNAVAILABLE
#endif
