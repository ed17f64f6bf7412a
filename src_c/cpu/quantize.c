/* Symmetric block quantization of float32, float16 and bfloat16 data, bit-identical
 * to the numpy specification on its float32 values: float32 scale 2*amax/(hi-lo),
 * stored rounded up in its dtype, IEEE division by the stored scale, round half to
 * even, clamp. */
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

/* x as the passes read it.  16-bit values are widened to float32 (exactly) a piece at
 * a time into `buf`, WIDEN_CHUNK floats of the reading thread's own, and the float32
 * kernels run on the pieces: the same bits as on x's float32 copy, which is never made.
 * Each parallel loop declares buf in its body, a frame each thread enters once (a
 * buffer in each function below was a 16 KiB frame a block: small blocks of float32 x
 * took longer). */
typedef struct quant_input {
    const void *x;
    int64_t cols;
    void (*widen)(const uint16_t *src, int64_t n, float *dst);  /* NULL: float32, read in place */
    const qd_quant_kernels *kern;
} quant_input;

/* Values widened at a time: 16 KiB of floats, still in L1 when the kernels read them
 * (a row of 4096, a common width of weights, in one piece). */
#define WIDEN_CHUNK 4096

/* The values a pass takes at once: all that are left of float32 x, a chunk of 16-bit x. */
static int64_t piece_length(const quant_input *in, int64_t left)
{
    return in->widen && left > WIDEN_CHUNK ? WIDEN_CHUNK : left;
}

/* n values of x from flat index `at` as float32: where they are, or widened into buf. */
static const float *floats_at(const quant_input *in, int64_t at, int64_t n, float *buf)
{
    if (!in->widen)
        return (const float *)in->x + at;
    in->widen((const uint16_t *)in->x + at, n, buf);
    return buf;
}

/* The kernels of qd_quant_kernels on the n values of x from flat index `at` (the two
 * that run for each block row inline: float32 x's is one kernel call, as it was). */
static inline uint32_t input_absmax(const quant_input *in, float *buf, int64_t at, int64_t n)
{
    uint32_t m = 0;
    for (int64_t i = 0, len; i < n; i += len) {
        len = piece_length(in, n - i);
        const uint32_t piece_max = in->kern->absmax_bits(floats_at(in, at + i, len, buf), len);
        m = piece_max > m ? piece_max : m;
    }
    return m;
}

static inline void input_quantize(const quant_input *in, float *buf, int64_t at, int64_t n, int lo, int hi,
                                  float scale, int8_t *q)
{
    for (int64_t i = 0, len; i < n; i += len) {
        len = piece_length(in, n - i);
        in->kern->quantize(floats_at(in, at + i, len, buf), len, (float)lo, (float)hi, scale, q + i);
    }
}

static void input_absmax_each(const quant_input *in, float *buf, int64_t at, int64_t n, uint32_t *m)
{
    for (int64_t i = 0, len; i < n; i += len) {
        len = piece_length(in, n - i);
        in->kern->absmax_each(floats_at(in, at + i, len, buf), len, m + i);
    }
}

static void input_quantize_each(const quant_input *in, float *buf, int64_t at, int64_t n, int lo, int hi,
                                const float *scale, int8_t *q)
{
    for (int64_t i = 0, len; i < n; i += len) {
        len = piece_length(in, n - i);
        in->kern->quantize_each(floats_at(in, at + i, len, buf), len, (float)lo, (float)hi, scale + i, q + i);
    }
}

static int64_t first_non_finite(const quant_input *in, float *buf, int64_t n)
{
    for (int64_t i = 0, len; i < n; i += len) {
        len = piece_length(in, n - i);
        const float *f = floats_at(in, i, len, buf);
        for (int64_t j = 0; j < len; j++)
            if (!isfinite(f[j]))
                return i + j;
    }
    return -1;
}

#define NON_FINITE_BITS 0x7F800000u

/* One block, rows r0.. and columns c0.. of `in`: its absmax and its quantize pass over
 * data still in cache; q: the block's first value, rows ldq apart.  Returns 1 when the
 * block holds NaN or Inf. */
static int quantize_block(const quant_input *in, float *buf, int64_t r0, int64_t c0, int64_t block_rows,
                          int64_t block_cols, int lo, int hi, int scale_dtype, float *scale, int *overflow,
                          int8_t *q, int64_t ldq)
{
    const quant_input src = *in;  /* a copy the kernels' calls can't reach: its fields stay in registers */
    in = &src;
    uint32_t amax = 0;
    for (int64_t r = 0; r < block_rows; r++) {
        const uint32_t m = input_absmax(in, buf, (r0 + r) * in->cols + c0, block_cols);
        amax = m > amax ? m : amax;
    }
    if (amax >= NON_FINITE_BITS)
        return 1;
    float stored;
    *overflow = !block_scale(amax, lo, hi, scale_dtype, &stored);
    if (*overflow)
        return 0;
    *scale = stored;
    for (int64_t r = 0; r < block_rows; r++)
        input_quantize(in, buf, (r0 + r) * in->cols + c0, block_cols, lo, hi, stored, q + r * ldq);
    return 0;
}

/* Blocks a tile of the many-blocks branch holds: as many as the widening buffer does,
 * at least one.  16-bit x is widened once for both passes, and a task a tile rather
 * than a block spares small blocks the loop's overhead (float32 x in blocks of 32
 * values took 10% less time). */
static int64_t tile_blocks(int64_t block_values, int64_t grid_cols)
{
    const int64_t fit = WIDEN_CHUNK / block_values;
    return fit < 1 ? 1 : fit < grid_cols ? fit : grid_cols;
}

/* Many blocks: one task per tile, nb blocks side by side from block (band, gc0) of the
 * grid, b0 in its flat order, each block's two passes over data still in cache.  A tile
 * of 16-bit x that fits buf is widened into it once; a larger block reads x a row piece
 * at a time.  Returns 1 when a block holds NaN or Inf (it wins over an overflowing
 * scale); *first_overflow: the grid index of the first block whose scale overflows. */
static int quantize_tile(const quant_input *in, float *buf, int64_t band, int64_t gc0, int64_t b0, int64_t nb,
                         int64_t block_rows, int64_t block_cols, int lo, int hi, int scale_dtype, float *scales,
                         int64_t *first_overflow, int8_t *q)
{
    const int64_t cols = in->cols, r0 = band * block_rows, c0 = gc0 * block_cols, width = nb * block_cols;
    const quant_input *blocks = in;
    int64_t at_r0 = r0, at_c0 = c0;  /* the tile's place in what its blocks are read from */
    quant_input widened;
    if (in->widen && block_rows * width <= WIDEN_CHUNK) {
        for (int64_t r = 0; r < block_rows; r++)
            in->widen((const uint16_t *)in->x + (r0 + r) * cols + c0, width, buf + r * width);
        widened = (quant_input){buf, width, NULL, in->kern};  /* float32 now, read where it is */
        blocks = &widened;
        at_r0 = at_c0 = 0;
    }
    int64_t overflow_at = INT64_MAX;
    for (int64_t j = 0; j < nb; j++) {
        int overflow = 0;
        if (quantize_block(blocks, buf, at_r0, at_c0 + j * block_cols, block_rows, block_cols, lo, hi, scale_dtype,
                           &scales[b0 + j], &overflow, q + r0 * cols + c0 + j * block_cols, cols))
            return 1;
        if (overflow && overflow_at == INT64_MAX)
            overflow_at = b0 + j;
    }
    *first_overflow = overflow_at;
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
static int quantize_sweep(const quant_input *in, float *buf, int64_t r0, int64_t c0, int64_t n, int64_t block_rows,
                          int64_t block_cols, int lo, int hi, int scale_dtype, float *scales,
                          int64_t *first_overflow, int8_t *q)
{
    const int64_t cols = in->cols;
    uint32_t col_max[SWEEP_COLS];
    float col_scale[SWEEP_COLS];
    memset(col_max, 0, (size_t)n * sizeof *col_max);
    for (int64_t r = r0; r < r0 + block_rows; r++)
        input_absmax_each(in, buf, r * cols + c0, n, col_max);
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
        input_quantize_each(in, buf, r * cols + c0, n, lo, hi, col_scale, q + r * cols + c0);
    return 0;
}

/* x of x_dtype (a float dtype) with rows `cols` long, read by the active ISA's kernels. */
static quant_input input_of(const void *x, int x_dtype, int64_t cols)
{
    const qd_dequant_kernels *conv = qd_dequant_kernels_active();
    const quant_input in = {x, cols, x_dtype == QD_FLOAT16 ? conv->f16_to_f32 :
                                     x_dtype == QD_BFLOAT16 ? conv->bf16_to_f32 : NULL,
                            qd_quant_kernels_active()};
    return in;
}

qd_status qd_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols, int value_kind,
                      int64_t block_rows, int64_t block_cols, int scale_dtype,
                      float *scales, int8_t *q, int64_t *bad_index)
{
    int lo, hi;
    if (!x || !scales || !q)
        return QD_ERR_NULL;
    if (x_dtype != QD_FLOAT32 && x_dtype != QD_FLOAT16 && x_dtype != QD_BFLOAT16)
        return QD_ERR_ARGUMENT;
    if (qd_value_range(value_kind, &lo, &hi) != QD_OK)
        return QD_ERR_SCHEME;
    if (scale_dtype < QD_SCALE_F32 || scale_dtype > QD_SCALE_BF16)
        return QD_ERR_SCHEME;
    if (rows <= 0 || cols <= 0 || block_rows <= 0 || block_cols <= 0 ||
        rows % block_rows || cols % block_cols)
        return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, sizeof(float)))  /* float32 scales: as many as the values at most */
        return QD_ERR_ARGUMENT;
    const quant_input in = input_of(x, x_dtype, cols);
    const int64_t grid_rows = rows / block_rows, grid_cols = cols / block_cols;
    const int64_t nblocks = grid_rows * grid_cols;
    const size_t x_size = x_dtype == QD_FLOAT32 ? sizeof(float) : sizeof(uint16_t);
    const size_t x_bytes = (size_t)(rows * cols) * x_size, s_bytes = (size_t)nblocks * sizeof(float);
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
            float buf[WIDEN_CHUNK];
            const int64_t c0 = (i % per_band) * width, n = cols - c0 < width ? cols - c0 : width;
            int64_t overflow = INT64_MAX;
            not_finite |= quantize_sweep(&in, buf, (i / per_band) * block_rows, c0, n, block_rows, block_cols,
                                         lo, hi, scale_dtype, scales, &overflow, q);
            first_overflow = overflow < first_overflow ? overflow : first_overflow;
        });
        if (first_overflow != INT64_MAX)
            overflow_at = first_overflow;
    } else if (nblocks >= 4 * threads) {
        /* the first overflowing block, as a min reduction (a named critical section
         * would be a symbol that the library exports) */
        const int64_t per_tile = tile_blocks(block_rows * block_cols, grid_cols);
        const int64_t per_band = (grid_cols + per_tile - 1) / per_tile, tiles = grid_rows * per_band;
        int64_t first_overflow = INT64_MAX;
        QD_PARALLEL_FOR(threads, tiles, reduction(|: not_finite) reduction(min: first_overflow),
        for (int64_t t = 0; t < tiles; t++) {
            float buf[WIDEN_CHUNK];
            const int64_t band = t / per_band, gc0 = (t % per_band) * per_tile;
            const int64_t nb = grid_cols - gc0 < per_tile ? grid_cols - gc0 : per_tile;
            int64_t overflow = INT64_MAX;
            not_finite |= quantize_tile(&in, buf, band, gc0, band * grid_cols + gc0, nb, block_rows, block_cols,
                                        lo, hi, scale_dtype, scales, &overflow, q);
            first_overflow = overflow < first_overflow ? overflow : first_overflow;
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
        for (int64_t i = 0; i < rows * grid_cols; i++) {
            float buf[WIDEN_CHUNK];
            seg_max[i] = input_absmax(&in, buf, (i / grid_cols) * cols + (i % grid_cols) * block_cols, block_cols);
        });
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
                float buf[WIDEN_CHUNK];
                const int64_t r = i / grid_cols, gc = i % grid_cols;
                const int64_t off = r * cols + gc * block_cols;
                input_quantize(&in, buf, off, block_cols, lo, hi, scales[(r / block_rows) * grid_cols + gc], q + off);
            });
        }
    }
    /* NaN or Inf wins over an overflowing scale, and names its first flat index. */
    if (not_finite) {
        float buf[WIDEN_CHUNK];
        if (bad_index)
            *bad_index = first_non_finite(&in, buf, rows * cols);
        return QD_ERR_NOT_FINITE;
    }
    if (overflow_at >= 0) {
        if (bad_index)
            *bad_index = overflow_at;
        return QD_ERR_SCALE_OVERFLOW;
    }
    return QD_OK;
}

qd_status qd_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                          int64_t block_rows, int64_t block_cols, int scale_dtype,
                          float *scales, int8_t *q, int64_t *bad_index)
{
    return qd_quantize(x, QD_FLOAT32, rows, cols, value_kind, block_rows, block_cols, scale_dtype,
                       scales, q, bad_index);
}
