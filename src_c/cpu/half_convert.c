/* Public float16 / bfloat16 conversions (portable; the Python layer uses them to
 * feed and return half-precision arrays). */
#include "qd_internal.h"
#include "half_convert.h"

#define QD_CONVERT_LOOP(src, n, dst, expr)        \
    do {                                          \
        if (!(src) || !(dst))                     \
            return QD_ERR_NULL;                   \
        if ((n) < 0)                              \
            return QD_ERR_SHAPE;                  \
        if (!qd_dims_fit(1, (n), sizeof(float)))  \
            return QD_ERR_ARGUMENT;               \
        for (int64_t i = 0; i < (n); i++)         \
            (dst)[i] = expr((src)[i]);            \
        return QD_OK;                             \
    } while (0)

qd_status qd_convert_f16_to_f32(const uint16_t *src, int64_t n, float *dst)
{
    QD_CONVERT_LOOP(src, n, dst, qd_f16_bits_to_f32);
}

qd_status qd_convert_bf16_to_f32(const uint16_t *src, int64_t n, float *dst)
{
    QD_CONVERT_LOOP(src, n, dst, qd_bf16_bits_to_f32);
}

qd_status qd_convert_f32_to_f16(const float *src, int64_t n, uint16_t *dst)
{
    QD_CONVERT_LOOP(src, n, dst, qd_f32_to_f16_bits);
}

qd_status qd_convert_f32_to_bf16(const float *src, int64_t n, uint16_t *dst)
{
    QD_CONVERT_LOOP(src, n, dst, qd_f32_to_bf16_bits);
}
