/* Public float16 / bfloat16 conversions (the cpu backend's casts use them). */
#include "qd_internal.h"

/* The checks of a conversion of n values of src_size bytes to dst_size bytes. */
static qd_status check_convert(const void *src, int64_t n, size_t src_size, const void *dst, size_t dst_size)
{
    if (n == 0)
        return QD_OK; /* nothing to convert: the pointers may be NULL, as for memcpy's callers */
    if (!src || !dst)
        return QD_ERR_NULL;
    if (n < 0)
        return QD_ERR_SHAPE;
    if (!qd_dims_fit(1, n, sizeof(float)) || qd_overlap(dst, (size_t)n * dst_size, src, (size_t)n * src_size))
        return QD_ERR_ARGUMENT;
    return QD_OK;
}

/* Values a thread converts at a time: past two of these a conversion runs on the
 * library's threads (64K values take a few microseconds, a parallel region about 0.4). */
#define CONVERT_CHUNK 65536

/* The active ISA's loops (dequantize_kernels.h): the same bits on every ISA, and
 * whatever the chunks. */
#define QD_CONVERT(src, n, dst, loop)                                                              \
    do {                                                                                          \
        const qd_status st_ = check_convert(src, n, sizeof *(src), dst, sizeof *(dst));           \
        if (st_ == QD_OK && (n) > 0) {                                                            \
            const qd_dequant_kernels *kernels_ = qd_dequant_kernels_active();                     \
            const int64_t chunks_ = ((n) + CONVERT_CHUNK - 1) / CONVERT_CHUNK;                    \
            QD_PARALLEL_FOR(qd_threads_for(chunks_ - 1), chunks_, ,                               \
            for (int64_t c_ = 0; c_ < chunks_; c_++) {                                            \
                const int64_t at_ = c_ * CONVERT_CHUNK;                                           \
                kernels_->loop(src + at_, (n) - at_ < CONVERT_CHUNK ? (n) - at_ : CONVERT_CHUNK, dst + at_); \
            });                                                                                   \
        }                                                                                         \
        return st_;                                                                               \
    } while (0)

qd_status qd_convert_f16_to_f32(const uint16_t *src, int64_t n, float *dst)
{
    QD_CONVERT(src, n, dst, f16_to_f32);
}

qd_status qd_convert_bf16_to_f32(const uint16_t *src, int64_t n, float *dst)
{
    QD_CONVERT(src, n, dst, bf16_to_f32);
}

qd_status qd_convert_f32_to_f16(const float *src, int64_t n, uint16_t *dst)
{
    QD_CONVERT(src, n, dst, f32_to_f16);
}

qd_status qd_convert_f32_to_bf16(const float *src, int64_t n, uint16_t *dst)
{
    QD_CONVERT(src, n, dst, f32_to_bf16);
}
