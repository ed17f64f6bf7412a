/* Symmetric block quantization of float32 data, bit-identical to the numpy
 * specification: float32 scale 2*amax/(hi-lo), stored rounded up in its dtype,
 * IEEE division by the stored scale, round half to even, clamp. */
#include <math.h>
#include "qd_internal.h"
#include "half_convert.h"

qd_status qd_value_range(int value_kind, int *lo, int *hi)
{
    static const int ranges[6][2] = {{-127, 127}, {-128, 127}, {-7, 7}, {-8, 7}, {-1, 1}, {-2, 1}};
    if (value_kind < 0 || value_kind > 5)
        return QD_ERR_SCHEME;
    *lo = ranges[value_kind][0];
    *hi = ranges[value_kind][1];
    return QD_OK;
}

/* rint for |y| <= 2^22 in the default rounding mode (half to even), without a
 * libm call: adding 1.5 * 2^23 pushes the fraction bits out. */
static inline float round_half_even(float y)
{
    const float magic = 12582912.0f;
    return (y + magic) - magic;
}

static inline int8_t quantize_one(float x, float scale, float lo, float hi)
{
    float y = x / scale;                 /* true IEEE division, never a reciprocal */
    y = y < 256.0f ? y : 256.0f;         /* clamping first keeps the magic rounding valid */
    y = y > -256.0f ? y : -256.0f;
    y = round_half_even(y);
    y = y < hi ? y : hi;
    y = y > lo ? y : lo;
    return (int8_t)y;
}

void qd_quantize_segment(const float *x, int64_t n, int lo, int hi, float scale, int8_t *q)
{
    for (int64_t i = 0; i < n; i++)
        q[i] = quantize_one(x[i], scale, (float)lo, (float)hi);
}

static float scale_from_amax(float amax, int lo, int hi)
{
    if (amax == 0.0f)
        return 1.0f;
    float scale = (2.0f * amax) / (float)(hi - lo);
    /* A tiny amax can underflow to 0; rounding up gives the smallest subnormal. */
    return scale > 0.0f ? scale : 0x1p-149f;
}

float qd_segment_scale(const float *x, int64_t n, int lo, int hi)
{
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return scale_from_amax(amax, lo, hi);
}

/* The smallest value of the dtype that is >= scale; returns 0 on overflow. */
static int store_scale_rounded_up(float scale, int scale_dtype, float *stored)
{
    float s = scale;
    if (scale_dtype == QD_SCALE_F16) {
        uint16_t h = qd_f32_to_f16_bits(scale);
        if (qd_f16_bits_to_f32(h) < scale)
            h++;                                   /* positive: next representable up */
        s = qd_f16_bits_to_f32(h);
    } else if (scale_dtype == QD_SCALE_BF16) {
        const uint32_t bits = qd_f32_bits(scale);
        uint32_t truncated = bits & 0xFFFF0000u;
        if (truncated != bits)
            truncated += 0x10000u;
        s = qd_bits_f32(truncated);
    }
    *stored = s;
    return isfinite(s);
}

static int64_t first_non_finite(const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return i;
    return -1;
}

qd_status qd_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                          int64_t block_rows, int64_t block_cols, int scale_dtype,
                          float *scales, int8_t *q, int64_t *bad_index)
{
    int lo, hi;
    if (!x || !scales || !q)
        return QD_ERR_NULL;
    if (qd_value_range(value_kind, &lo, &hi) != QD_OK)
        return QD_ERR_SCHEME;
    if (scale_dtype < QD_SCALE_F32 || scale_dtype > QD_SCALE_BF16)
        return QD_ERR_SCHEME;
    if (rows <= 0 || cols <= 0 || block_rows <= 0 || block_cols <= 0 ||
        rows % block_rows || cols % block_cols)
        return QD_ERR_SHAPE;
    const int64_t bad = first_non_finite(x, rows * cols);
    if (bad >= 0) {
        if (bad_index)
            *bad_index = bad;
        return QD_ERR_NOT_FINITE;
    }
    const int64_t grid_rows = rows / block_rows, grid_cols = cols / block_cols;
    const int64_t nblocks = grid_rows * grid_cols;
    int64_t overflow_at = -1;

#pragma omp parallel for schedule(static) num_threads(qd_threads_for(nblocks * block_rows * block_cols / 65536 + 1))
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t r0 = (b / grid_cols) * block_rows, c0 = (b % grid_cols) * block_cols;
        float amax = 0.0f;
        for (int64_t r = r0; r < r0 + block_rows; r++)
            for (int64_t c = c0; c < c0 + block_cols; c++) {
                const float a = fabsf(x[r * cols + c]);
                amax = a > amax ? a : amax;
            }
        float stored;
        if (!store_scale_rounded_up(scale_from_amax(amax, lo, hi), scale_dtype, &stored)) {
#pragma omp critical(qd_quantize_overflow)
            if (overflow_at < 0 || b < overflow_at)
                overflow_at = b;
            continue;
        }
        scales[b] = stored;
        for (int64_t r = r0; r < r0 + block_rows; r++)
            qd_quantize_segment(x + r * cols + c0, block_cols, lo, hi, stored, q + r * cols + c0);
    }
    if (overflow_at >= 0) {
        if (bad_index)
            *bad_index = overflow_at;
        return QD_ERR_SCALE_OVERFLOW;
    }
    return QD_OK;
}
