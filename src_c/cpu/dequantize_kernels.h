/* The row kernel of qd_dequantize_rows and the float32 <-> 16-bit conversion loops,
 * plain C that each ISA's file compiles with its own flags (dequantize_base.c,
 * dequantize_avx2.c, dequantize_avx512vnni.c): the compiler vectorizes them for it,
 * and the conversions are branch-free so that it can (float16 <-> float32 goes through
 * F16C where the ISA has it).  Same bits on every ISA. */
#ifndef QD_DEQUANTIZE_KERNELS_H
#define QD_DEQUANTIZE_KERNELS_H

#include <string.h>
#ifdef __F16C__
#include <immintrin.h>
#endif
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

/* The scale of each of n columns from c0 on, where a scale spans block_cols columns,
 * `step` columns at a time: a constant after inlining that divides block_cols (and
 * so c0 and n: chunks and rows end on a block's end), so that each step is one
 * vector store. */
static inline void spread_in_steps(const float *row_scales, int64_t block_cols, int64_t c0, int n, int step,
                                   float *s)
{
    int64_t block = c0 / block_cols, left = block_cols - c0 % block_cols;
    for (int i = 0; i < n; i += step) {
        const float scale = row_scales[block];
        for (int k = 0; k < step; k++)
            s[i + k] = scale;
        if ((left -= step) == 0) {
            block++;
            left = block_cols;
        }
    }
}

static void spread_scales(const float *row_scales, int64_t block_cols, int64_t c0, int n, float *s)
{
    if (block_cols % 16 == 0)
        spread_in_steps(row_scales, block_cols, c0, n, 16, s);
    else if (block_cols % 4 == 0)
        spread_in_steps(row_scales, block_cols, c0, n, 4, s);
    else
        spread_in_steps(row_scales, block_cols, c0, n, 1, s);
}

/* A loop of one scalar conversion, for the compiler to vectorize. */
#define QD_CONVERSION_LOOP(name, src_type, dst_type, convert)        \
    static void name(const src_type *src, int64_t n, dst_type *dst) \
    {                                                               \
        for (int64_t i = 0; i < n; i++)                             \
            dst[i] = convert(src[i]);                               \
    }

QD_CONVERSION_LOOP(f32_to_bf16, float, uint16_t, qd_f32_to_bf16_bits)
QD_CONVERSION_LOOP(bf16_to_f32, uint16_t, float, qd_bf16_bits_to_f32)

#ifdef __F16C__
QD_CONVERSION_LOOP(f32_to_f16_exact, float, uint16_t, qd_f32_to_f16_bits)
QD_CONVERSION_LOOP(f16_to_f32_exact, uint16_t, float, qd_f16_bits_to_f32)

/* F16C's vcvtps2ph, 5-9 times faster than the loop: it rounds to nearest even as
 * its immediate says, whatever the caller's rounding mode or flush-to-zero, and
 * gives the loop's bits but for a NaN, which it makes quiet where numpy (and the
 * loop) keep a signalling one: 8 values holding a NaN go through the loop. */
static void f32_to_f16(const float *src, int64_t n, uint16_t *dst)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)))
            f32_to_f16_exact(src + i, 8, dst + i);
        else
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    f32_to_f16_exact(src + i, n - i, dst + i);
}

/* F16C's vcvtph2ps, several times faster than the loop and exact but for a
 * signalling NaN, which it makes quiet: 8 values holding a NaN or an infinity
 * (exponent all ones) go through the loop, which keeps the payload. */
static void f16_to_f32(const uint16_t *src, int64_t n, float *dst)
{
    const __m128i exponent = _mm_set1_epi16(0x7C00);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        if (_mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent)))
            f16_to_f32_exact(src + i, 8, dst + i);
        else
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    f16_to_f32_exact(src + i, n - i, dst + i);
}
#else
QD_CONVERSION_LOOP(f32_to_f16, float, uint16_t, qd_f32_to_f16_bits)
QD_CONVERSION_LOOP(f16_to_f32, uint16_t, float, qd_f16_bits_to_f32)
#endif

static void dequantize_row(const qd_dequantize_job *job, int64_t r, int64_t i)
{
    const int64_t cols = job->cols;
    const float *row_scales = job->scales + (r / job->block_rows) * (cols / job->block_cols);
    int8_t unpacked[CHUNK];
    float scale[CHUNK], product[CHUNK];
    for (int64_t c0 = 0; c0 < cols; c0 += CHUNK) {
        const int n = cols - c0 < CHUNK ? (int)(cols - c0) : CHUNK;
        const int8_t *v = unpacked;
        if (job->bits == 0) {
            v = (const int8_t *)job->values + (r - job->first_row) * cols + c0;
        } else {
            const uint32_t *words = (const uint32_t *)job->values + (r - job->first_row) * job->words_per_row;
            if (job->bits == 2)
                unpack_words(words, 2, c0, n, unpacked);
            else if (job->bits == 4)
                unpack_words(words, 4, c0, n, unpacked);
            else
                unpack_words(words, 8, c0, n, unpacked);
        }
        float *restrict dst = job->out_dtype == QD_FLOAT32 ? (float *)job->out + i * cols + c0 : product;
        const int64_t bc = job->block_cols;
        if (c0 / bc == (c0 + n - 1) / bc) {  /* one block's scale (a scale per row, say) */
            const float s = row_scales[c0 / bc];
            for (int k = 0; k < n; k++)
                dst[k] = (float)v[k] * s;
        } else {  /* a scale per column is the scale row itself */
            const float *restrict s = row_scales + c0;
            if (bc > 1) {
                spread_scales(row_scales, bc, c0, n, scale);
                s = scale;
            }
            for (int k = 0; k < n; k++)
                dst[k] = (float)v[k] * s[k];
        }
        if (job->out_dtype == QD_FLOAT16)
            f32_to_f16(product, n, (uint16_t *)job->out + i * cols + c0);
        else if (job->out_dtype == QD_BFLOAT16)
            f32_to_bf16(product, n, (uint16_t *)job->out + i * cols + c0);
    }
}

#define QD_DEQUANT_KERNELS(name) \
    const qd_dequant_kernels name = {dequantize_row, f32_to_f16, f32_to_bf16, f16_to_f32, bf16_to_f32}

#endif
