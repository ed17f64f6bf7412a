/* Dequantizing rows of a quantized matrix on the host (qd_dequantize_rows): each
 * value times its block's float32 scale, one IEEE multiply, as the numpy
 * specification does, then rounded once to a 16-bit dtype if asked. */
#include <string.h>
#include "qd_internal.h"
#include "half_convert.h"

/* Columns of a row handled at a time: its values, scales and float32 products
 * sit in stack arrays this long.  A multiple of every word's count of values. */
#define CHUNK 512

/* n values of a row of the packed_u32 store (`bits` per value, lowest bits first)
 * from value c0 on, c0 a multiple of the values a word holds.  Read byte by byte:
 * on a little-endian machine byte b of a word holds its values 8/bits * b on, in
 * the same order, and byte loops vectorize where word loops' shifts do not.
 * `bits` is a constant after inlining, so each width gets loops of its own. */
static inline void unpack_words(const uint32_t *words, int bits, int64_t c0, int n, int8_t *v)
{
    const int per_byte = 8 / bits;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    const uint32_t *w = words + c0 / (4 * per_byte);
    for (int i = 0; i < n; i++) {
        const uint32_t word = w[i / (4 * per_byte)];
        const int at = i % (4 * per_byte) * bits;
        v[i] = (int8_t)((int32_t)(word << (32 - bits - at)) >> (32 - bits));
    }
#else
    const uint8_t *b = (const uint8_t *)words + c0 / per_byte;
    const int whole = n / per_byte;
    for (int i = 0; i < whole; i++)
        for (int f = 0; f < per_byte; f++)  /* the field to the top, then an arithmetic shift sign-extends it */
            v[i * per_byte + f] = (int8_t)(uint8_t)(b[i] << (8 - bits * (f + 1))) >> (8 - bits);
    for (int f = 0; f < n - whole * per_byte; f++)
        v[whole * per_byte + f] = (int8_t)(uint8_t)(b[whole] << (8 - bits * (f + 1))) >> (8 - bits);
#endif
}

/* The scale of each of n columns from c0 on, where a scale spans block_cols columns. */
static void spread_scales(const float *row_scales, int64_t block_cols, int64_t c0, int n, float *s)
{
    int64_t block = c0 / block_cols, left = block_cols - c0 % block_cols;
    for (int i = 0; i < n; i++) {
        s[i] = row_scales[block];
        if (--left == 0) {
            block++;
            left = block_cols;
        }
    }
}

typedef struct {
    const void *values;
    int bits;                   /* 0: one int8 a value; else packed_u32 of this width */
    int64_t cols, words_per_row;
    const float *scales;
    int64_t block_rows, block_cols;
    void *out;
    int out_dtype;
} dequantize_job;

static void dequantize_row(const dequantize_job *job, int64_t r, int64_t i)
{
    const int64_t cols = job->cols;
    const float *row_scales = job->scales + (r / job->block_rows) * (cols / job->block_cols);
    int8_t unpacked[CHUNK];
    float scale[CHUNK], product[CHUNK];
    for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
        const int n = cols - c0 < CHUNK ? (int)(cols - c0) : CHUNK;
        const int8_t *v = unpacked;
        if (job->bits == 0) {
            v = (const int8_t *)job->values + r * cols + c0;
        } else {
            const uint32_t *words = (const uint32_t *)job->values + r * job->words_per_row;
            if (job->bits == 2)
                unpack_words(words, 2, c0, n, unpacked);
            else if (job->bits == 4)
                unpack_words(words, 4, c0, n, unpacked);
            else
                unpack_words(words, 8, c0, n, unpacked);
        }
        float *dst = job->out_dtype == QD_FLOAT32 ? (float *)job->out + i * cols + c0 : product;
        if (job->block_cols >= 16) {  /* runs of one scale */
            for (int a = 0; a < n;) {
                const int64_t block = (c0 + a) / job->block_cols;
                const int64_t end = (block + 1) * job->block_cols - c0;
                const int b = end < n ? (int)end : n;
                const float s = row_scales[block];
                for (int k = a; k < b; k++)
                    dst[k] = (float)v[k] * s;
                a = b;
            }
        } else {
            spread_scales(row_scales, job->block_cols, c0, n, scale);
            for (int k = 0; k < n; k++)
                dst[k] = (float)v[k] * scale[k];
        }
        if (job->out_dtype == QD_FLOAT16) {
            uint16_t *o = (uint16_t *)job->out + i * cols + c0;
            for (int k = 0; k < n; k++)
                o[k] = qd_f32_to_f16_bits(product[k]);
        } else if (job->out_dtype == QD_BFLOAT16) {
            uint16_t *o = (uint16_t *)job->out + i * cols + c0;
            for (int k = 0; k < n; k++)
                o[k] = qd_f32_to_bf16_bits(product[k]);
        }
    }
}

static size_t dtype_size(int out_dtype)
{
    return out_dtype == QD_FLOAT32 ? 4 : 2;
}

static qd_status check_rows(int bits, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                            const int64_t *ids, int64_t n, int out_dtype)
{
    if (bits != 0 && bits != 2 && bits != 4 && bits != 8)
        return QD_ERR_SCHEME;
    if (out_dtype != QD_FLOAT32 && out_dtype != QD_FLOAT16 && out_dtype != QD_BFLOAT16)
        return QD_ERR_ARGUMENT;
    if (rows <= 0 || cols <= 0 || n < 0 || block_rows <= 0 || block_cols <= 0 ||
        rows % block_rows || cols % block_cols)
        return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, 4) || !qd_dims_fit(n, cols, 4))
        return QD_ERR_ARGUMENT;
    if (!ids && n != rows)
        return QD_ERR_SHAPE;
    for (int64_t i = 0; ids && i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows)
            return QD_ERR_ARGUMENT;
    return QD_OK;
}

qd_status qd_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols, const float *scales,
                             int64_t block_rows, int64_t block_cols, const int64_t *ids, int64_t n,
                             void *out, int out_dtype)
{
    if (!values || !scales || (n > 0 && !out))
        return QD_ERR_NULL;
    const qd_status st = check_rows(bits, rows, cols, block_rows, block_cols, ids, n, out_dtype);
    if (st != QD_OK || n == 0)
        return st;
    const int64_t per_word = bits ? 32 / bits : 1;
    const int64_t words_per_row = (cols + per_word - 1) / per_word;
    const size_t value_bytes = (size_t)(rows * (bits ? words_per_row * 4 : cols));
    const size_t out_bytes = (size_t)(n * cols) * dtype_size(out_dtype);
    const size_t scale_bytes = (size_t)((rows / block_rows) * (cols / block_cols)) * sizeof(float);
    if (qd_overlap(out, out_bytes, values, value_bytes) || qd_overlap(out, out_bytes, scales, scale_bytes) ||
        (ids && qd_overlap(out, out_bytes, ids, (size_t)n * sizeof *ids)))
        return QD_ERR_ARGUMENT;
    const dequantize_job job = {values, bits, cols, words_per_row, scales, block_rows, block_cols, out, out_dtype};
    /* memory-bound: a thread is worth its start from about a hundred thousand values */
    const int threads = qd_threads_for_product(n, 1, n, cols);
    QD_PARALLEL_FOR(threads, ,
        for (int64_t i = 0; i < n; i++)
            dequantize_row(&job, ids ? ids[i] : i, i);
    );
    return QD_OK;
}
