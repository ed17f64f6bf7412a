/* Symmetric block quantization of float32 data, bit-identical to the numpy
 * specification: float32 scale 2*amax/(hi-lo), stored rounded up in its dtype,
 * IEEE division by the stored scale, round half to even, clamp. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
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

/* The stored scale of a block whose |x| peaks at amax (float bits, finite);
 * returns 0 when it overflows the dtype. */
static int block_scale(uint32_t amax, int lo, int hi, int scale_dtype, float *stored)
{
    return store_scale_rounded_up(scale_from_amax(qd_bits_f32(amax), lo, hi), scale_dtype, stored);
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
    *overflow = !block_scale(amax, lo, hi, scale_dtype, &stored);
    if (*overflow)
        return 0;
    *scale = stored;
    for (int64_t r = r0; r < r0 + block_rows; r++)
        kern->quantize(x + r * cols + c0, block_cols, (float)lo, (float)hi, stored, q + r * cols + c0);
    return 0;
}

/* Blocks narrower than this (a scale per column, say) are swept a row at a time:
 * a block at a time, each of their rows would be a kernel call of a few floats.
 * Not blocks as wide as the matrix (per tensor on few columns, say): the other
 * branches share their rows among threads, where one sweep would take them all. */
#define NARROW_COLS 16
/* Columns one sweep covers at most: its maxima and scales are stack arrays. */
#define SWEEP_COLS 512

/* Columns a sweep covers: a whole number of blocks, at most SWEEP_COLS, and fewer
 * when there are not enough bands of blocks to give every thread a sweep. */
static int64_t sweep_width(int64_t cols, int64_t block_cols, int64_t grid_rows, int threads)
{
    const int64_t per_band = (threads + grid_rows - 1) / grid_rows;
    int64_t width = (cols + per_band - 1) / per_band;
    width = width < SWEEP_COLS ? width : SWEEP_COLS;
    width -= width % block_cols;
    return width > block_cols ? width : block_cols;
}

/* The blocks of one band (block_rows rows from r0) over columns c0 .. c0+n-1, narrow
 * blocks: the maxima of the columns (rows read contiguously), those of the blocks,
 * their scales spread back over the columns, then each row quantized against them.
 * Returns 1 when the blocks hold NaN or Inf (it wins over an overflowing scale, so
 * every block is looked at); *first_overflow: the grid index of the first block
 * whose scale overflows. */
static int quantize_sweep(const qd_quant_kernels *kern, const float *x, int64_t cols, int64_t r0, int64_t c0,
                          int64_t n, int64_t block_rows, int64_t block_cols, int lo, int hi, int scale_dtype,
                          float *scales, int64_t *first_overflow, int8_t *q)
{
    uint32_t col_max[SWEEP_COLS];
    float col_scale[SWEEP_COLS];
    memset(col_max, 0, (size_t)n * sizeof *col_max);
    for (int64_t r = r0; r < r0 + block_rows; r++)
        kern->absmax_each(x + r * cols + c0, n, col_max);
    const int64_t b0 = (r0 / block_rows) * (cols / block_cols) + c0 / block_cols;
    int64_t overflow_at = INT64_MAX;
    for (int64_t b = 0; b < n / block_cols; b++) {
        uint32_t amax = 0;
        for (int64_t c = b * block_cols; c < (b + 1) * block_cols; c++)
            amax = col_max[c] > amax ? col_max[c] : amax;
        if (amax >= NON_FINITE_BITS)
            return 1;
        if (!block_scale(amax, lo, hi, scale_dtype, &scales[b0 + b])) {
            overflow_at = overflow_at == INT64_MAX ? b0 + b : overflow_at;
            continue;
        }
        for (int64_t c = b * block_cols; c < (b + 1) * block_cols; c++)
            col_scale[c] = scales[b0 + b];
    }
    *first_overflow = overflow_at;
    if (overflow_at != INT64_MAX)
        return 0;
    for (int64_t r = r0; r < r0 + block_rows; r++)
        kern->quantize_each(x + r * cols + c0, n, (float)lo, (float)hi, col_scale, q + r * cols + c0);
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
    const size_t q_bytes = (size_t)(rows * cols), b_bytes = bad_index ? sizeof *bad_index : 0;
    if (qd_overlap(q, q_bytes, x, x_bytes) || qd_overlap(scales, s_bytes, x, x_bytes) ||
        qd_overlap(scales, s_bytes, q, q_bytes) || qd_overlap(bad_index, b_bytes, x, x_bytes) ||
        qd_overlap(bad_index, b_bytes, scales, s_bytes) || qd_overlap(bad_index, b_bytes, q, q_bytes))
        return QD_ERR_ARGUMENT;
    const int threads = qd_threads_for(rows * cols / 65536 + 1);
    int64_t overflow_at = -1;
    int not_finite = 0;

    if (block_cols < NARROW_COLS && block_cols < cols) {
        const int64_t width = sweep_width(cols, block_cols, grid_rows, threads);
        const int64_t per_band = (cols + width - 1) / width, sweeps = grid_rows * per_band;
        int64_t first_overflow = INT64_MAX;
        QD_PARALLEL_FOR(threads, sweeps, reduction(|: not_finite) reduction(min: first_overflow),
        for (int64_t i = 0; i < sweeps; i++) {
            const int64_t c0 = (i % per_band) * width, n = cols - c0 < width ? cols - c0 : width;
            int64_t overflow = INT64_MAX;
            not_finite |= quantize_sweep(kern, x, cols, (i / per_band) * block_rows, c0, n, block_rows,
                                         block_cols, lo, hi, scale_dtype, scales, &overflow, q);
            first_overflow = overflow < first_overflow ? overflow : first_overflow;
        });
        if (first_overflow != INT64_MAX)
            overflow_at = first_overflow;
    } else if (nblocks >= 4 * threads) {
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
            else if (!block_scale(amax, lo, hi, scale_dtype, &scales[b]) && overflow_at < 0)
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
