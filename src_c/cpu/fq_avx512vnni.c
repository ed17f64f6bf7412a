/* The AVX-512 fq kernel (float32 x int8 / int4 / int2 weights), plan in fq_common.h.
 * A zmm holds one k-step of the 16 columns.  8 bits: the byte is sign-extended with
 * two shifts and converted (at one row, made a float by its mantissa bits instead).
 * 4 and 2 bits: vpermps looks the field up in a 16-entry table of float values (it
 * reads only the low 4 bits of each index, so a shift is the whole unpack).  Up to
 * FQ_MR rows share each dequantized vector. */
#include <immintrin.h>
#include "fq_common.h"

#define FQ_MR QD_FQ_MR_ZMM
#define PARTIALS 8   /* eight chains per row: enough to hide the FMA latency at one row */

/* table[i] = signed value of a stored field whose low bits are i. */
QD_INLINE __m512 field_table(int bits)
{
    const __m512i i = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int mask = (1 << bits) - 1, bias = 1 << (bits - 1);
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(i, _mm512_set1_epi32(mask)),
                                               _mm512_set1_epi32(bias)));
}

QD_INLINE __m512 dequant(__m512i v, __m512 table, int bits, int i, int mr)
{
    const int b = qd_fq_field_bit(bits, i);
    if (bits == 8 && mr == 1) {
        /* One row leaves the FMA pipes half idle and the shifts set the pace: the byte,
         * flipped to w + 128, goes into the low mantissa bits of 2^23 (one shift and one
         * ternary op), and the float 2^23 + 128 + w less 2^23 + 128 is w, exactly.
         * 22% faster at 1 x 1024 x 1024 in cache on Zen 4; with more rows the subtraction
         * competes with their FMAs, and sign extension stays. */
        const __m512i field = b ? _mm512_srli_epi32(v, (unsigned)b) : v;
        const __m512i biased = _mm512_ternarylogic_epi32(field, _mm512_set1_epi32(0xFF),
                                                         _mm512_set1_epi32(0x4B000080), 0x6A); /* (a & b) ^ c */
        return _mm512_sub_ps(_mm512_castsi512_ps(biased), _mm512_set1_ps(8388736.0f));
    }
    if (bits == 8) {
        const __m512i top = b == 24 ? v : _mm512_slli_epi32(v, (unsigned)(24 - b));
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(top, 24));
    }
    return _mm512_permutexvar_ps(b ? _mm512_srli_epi32(v, (unsigned)b) : v, table);
}

QD_INLINE void fq_tile_impl(const qd_fq_tile *t, const int bits, const int mr)
{
    const int ku = QD_KU(bits);
    const __m512 table = field_table(bits == 8 ? 4 : bits);
    const uint8_t *wp = t->panel;
    __m512 acc[FQ_MR];
    for (int r = 0; r < mr; r++)
        acc[r] = _mm512_setzero_ps();
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        __m512 part[FQ_MR][PARTIALS];
        for (int r = 0; r < mr; r++)
            for (int p = 0; p < PARTIALS; p++)
                part[r][p] = _mm512_setzero_ps();
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            qd_fq_prefetch(wp, bits);
            __m512i v = _mm512_load_si512((const void *)wp);
            QD_KEEP_IN_REGISTER(v);
            /* Unrolled: shift counts and partial indices must be constants. */
#pragma GCC unroll 16
            for (int i = 0; i < ku; i++) {
                const __m512 w = dequant(v, table, bits, i, mr);
                for (int r = 0; r < mr; r++) {
                    __m512 *p = &part[r][i % PARTIALS];
                    *p = _mm512_fmadd_ps(_mm512_set1_ps(t->x[r * t->ldx + k0 + i]), w, *p);
                }
            }
        }
        const __m512 scale = _mm512_load_ps(t->w_scale + g * QD_NR);
        for (int r = 0; r < mr; r++) {
            const __m512 *p = part[r];
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3])),
                                             _mm512_add_ps(_mm512_add_ps(p[4], p[5]), _mm512_add_ps(p[6], p[7])));
            acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
        }
    }
    const __mmask16 cols = (__mmask16)((1u << t->nr) - 1);
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(t->out + r * t->ldo, cols, acc[r]);
}

/* Scale groups that are no whole units (a [K, N] weight with a scale per row of K,
 * say): one chain per row, scaled into the accumulator as each group ends. */
QD_INLINE void fq_tile_short_groups(const qd_fq_tile *t, const int bits, const int mr)
{
    const int ku = QD_KU(bits);
    const __m512 table = field_table(bits == 8 ? 4 : bits);
    const uint8_t *wp = t->panel;
    __m512 acc[FQ_MR], part[FQ_MR];
    for (int r = 0; r < mr; r++)
        acc[r] = part[r] = _mm512_setzero_ps();
    const float *scale = t->w_scale;
    int64_t left = t->group_k;  /* k-steps of the group that are still to come */
    for (int64_t k0 = 0; k0 < t->k; k0 += ku, wp += QD_UNIT_BYTES) {
        __m512i v = _mm512_load_si512((const void *)wp);
        QD_KEEP_IN_REGISTER(v);
#pragma GCC unroll 16
        for (int i = 0; i < ku; i++) {
            if (k0 + i == t->k)  /* the panel's zero padding: no group's */
                break;
            const __m512 w = dequant(v, table, bits, i, mr);
            for (int r = 0; r < mr; r++)
                part[r] = _mm512_fmadd_ps(_mm512_set1_ps(t->x[r * t->ldx + k0 + i]), w, part[r]);
            if (--left == 0) {
                const __m512 s = _mm512_load_ps(scale);
                for (int r = 0; r < mr; r++) {
                    acc[r] = _mm512_fmadd_ps(part[r], s, acc[r]);
                    part[r] = _mm512_setzero_ps();
                }
                scale += QD_NR;
                left = t->group_k;
            }
        }
    }
    const __mmask16 cols = (__mmask16)((1u << t->nr) - 1);
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(t->out + r * t->ldo, cols, acc[r]);
}

#define FQ_CASE(MR) fq_tile_impl(t, bits, (MR) > FQ_MR ? FQ_MR : (MR))
#define FQ_SHORT_CASE(MR) fq_tile_short_groups(t, bits, (MR) > FQ_MR ? FQ_MR : (MR))
QD_INLINE void fq_tile_bits(const qd_fq_tile *t, const int bits)
{
    if (qd_fq_short_groups(t->ngroups, t->group_k, bits)) {
        QD_SWITCH_MR(t->mr, FQ_SHORT_CASE)
    } else {
        QD_SWITCH_MR(t->mr, FQ_CASE)
    }
}

void qd_fq_tile_avx512(const qd_fq_tile *t)
{
    switch (t->bits) {
    case 8: fq_tile_bits(t, 8); break;
    case 4: fq_tile_bits(t, 4); break;
    default: fq_tile_bits(t, 2); break;
    }
}
