/* Symmetric block quantization of float32 data, bit-identical to the numpy
 * specification: float32 scale 2*amax/(hi-lo), stored rounded up in its dtype,
 * IEEE division by the stored scale, round half to even, clamp. */
#include <math.h>
#include <stdlib.h>
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

void qd_quantize_segment(const float *x, int64_t n, int lo, int hi, float scale, int8_t *q)
{
    qd_quant_kernels_active()->quantize(x, n, (float)lo, (float)hi, scale, q);
}

static float scale_from_amax(float amax, int lo, int hi)
{
    if (amax == 0.0f)
        return 1.0f;
    /* amax / ((hi-lo)/2) rounds exactly as (2*amax)/(hi-lo) (halving the exact
     * integer hi-lo is exact), and does not overflow where 2*amax would. */
    float scale = amax / (0.5f * (float)(hi - lo));
    /* A tiny amax can underflow to 0; rounding up gives the smallest subnormal. */
    return scale > 0.0f ? scale : 0x1p-149f;
}

float qd_segment_scale(const float *x, int64_t n, int lo, int hi)
{
    return scale_from_amax(qd_bits_f32(qd_quant_kernels_active()->absmax_bits(x, n)), lo, hi);
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

#define NON_FINITE_BITS 0x7F800000u

/* Many blocks: one task per block, its absmax and its quantize pass over data
 * still in cache.  Returns 1 when the block holds NaN or Inf. */
static int quantize_block(const qd_quant_kernels *kern, const float *x, int64_t cols,
                          int64_t r0, int64_t c0, int64_t block_rows, int64_t block_cols,
                          int lo, int hi, int scale_dtype, float *scale, int *overflow, int8_t *q)
{
    uint32_t amax = 0;
    for (int64_t r = r0; r < r0 + block_rows; r++) {
        const uint32_t m = kern->absmax_bits(x + r * cols + c0, block_cols);
        amax = m > amax ? m : amax;
    }
    if (amax >= NON_FINITE_BITS)
        return 1;
    float stored;
    *overflow = !store_scale_rounded_up(scale_from_amax(qd_bits_f32(amax), lo, hi), scale_dtype, &stored);
    if (*overflow)
        return 0;
    *scale = stored;
    for (int64_t r = r0; r < r0 + block_rows; r++)
        kern->quantize(x + r * cols + c0, block_cols, (float)lo, (float)hi, stored, q + r * cols + c0);
    return 0;
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
    if (!qd_dims_fit(rows, cols, sizeof(float)))
        return QD_ERR_ARGUMENT;
    const qd_quant_kernels *kern = qd_quant_kernels_active();
    const int64_t grid_rows = rows / block_rows, grid_cols = cols / block_cols;
    const int64_t nblocks = grid_rows * grid_cols;
    const size_t x_bytes = (size_t)(rows * cols) * sizeof(float), s_bytes = (size_t)nblocks * sizeof(float);
    if (qd_overlap(q, (size_t)(rows * cols), x, x_bytes) || qd_overlap(scales, s_bytes, x, x_bytes) ||
        qd_overlap(scales, s_bytes, q, (size_t)(rows * cols)))
        return QD_ERR_ARGUMENT;
    const int threads = qd_threads_for(rows * cols / 65536 + 1);
    int64_t overflow_at = -1;
    int not_finite = 0;

    if (nblocks >= 4 * threads) {
        /* the first overflowing block, as a min reduction (a named critical section
         * would be a symbol that the library exports) */
        int64_t first_overflow = INT64_MAX;
        QD_PARALLEL_FOR(threads, nblocks, reduction(|: not_finite) reduction(min: first_overflow),
        for (int64_t b = 0; b < nblocks; b++) {
            int overflow = 0;
            not_finite |= quantize_block(kern, x, cols, (b / grid_cols) * block_rows,
                                         (b % grid_cols) * block_cols, block_rows, block_cols,
                                         lo, hi, scale_dtype, &scales[b], &overflow, q);
            if (overflow && b < first_overflow)
                first_overflow = b;
        });
        if (first_overflow != INT64_MAX)
            overflow_at = first_overflow;
    } else {
        /* Few large blocks (per tensor, say): absmax of every row segment in
         * parallel, the scales from those, then the quantize pass in parallel. */
        uint32_t *seg_max = malloc((size_t)(rows * grid_cols) * sizeof(uint32_t));
        if (!seg_max)
            return QD_ERR_NO_MEMORY;
        QD_PARALLEL_FOR(threads, rows * grid_cols, ,
        for (int64_t i = 0; i < rows * grid_cols; i++)
            seg_max[i] = kern->absmax_bits(x + (i / grid_cols) * cols + (i % grid_cols) * block_cols, block_cols););
        /* Past an overflowing scale the blocks are still looked at: a later NaN wins. */
        for (int64_t b = 0; b < nblocks && !not_finite; b++) {
            const int64_t r0 = (b / grid_cols) * block_rows, gc = b % grid_cols;
            uint32_t amax = 0;
            for (int64_t r = r0; r < r0 + block_rows; r++)
                amax = seg_max[r * grid_cols + gc] > amax ? seg_max[r * grid_cols + gc] : amax;
            if (amax >= NON_FINITE_BITS)
                not_finite = 1;
            else if (!store_scale_rounded_up(scale_from_amax(qd_bits_f32(amax), lo, hi), scale_dtype, &scales[b]) &&
                     overflow_at < 0)
                overflow_at = b;
        }
        free(seg_max);
        if (!not_finite && overflow_at < 0) {
            QD_PARALLEL_FOR(threads, rows * grid_cols, ,
            for (int64_t i = 0; i < rows * grid_cols; i++) {
                const int64_t r = i / grid_cols, gc = i % grid_cols;
                const int64_t off = r * cols + gc * block_cols;
                kern->quantize(x + off, block_cols, (float)lo, (float)hi,
                               scales[(r / block_rows) * grid_cols + gc], q + off);
            });
        }
    }
    /* NaN or Inf wins over an overflowing scale, and names its first flat index. */
    if (not_finite) {
        if (bad_index)
            *bad_index = first_non_finite(x, rows * cols);
        return QD_ERR_NOT_FINITE;
    }
    if (overflow_at >= 0) {
        if (bad_index)
            *bad_index = overflow_at;
        return QD_ERR_SCALE_OVERFLOW;
    }
    return QD_OK;
}
