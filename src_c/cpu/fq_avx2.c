/* The AVX2 fq kernel (float32 x int8 / int4 / int2 weights), plan in fq_common.h;
 * the AVX-VNNI table uses it too (VNNI adds nothing for floats).  A unit is two
 * ymm, columns 0..7 and 8..15.  Sub-byte fields are made two's complement by
 * flipping their top bit once per unit (w + bias = w ^ bias in `bits` bits); then
 * every field is sign-extended with two shifts and converted.  Up to FQ_MR rows
 * share each dequantized vector. */
#include <immintrin.h>
#include "fq_common.h"

#define FQ_MR QD_FQ_MR_YMM
#define PARTIALS 2   /* per half: with the two halves, four chains per row */

QD_INLINE __m256i to_signed_fields(__m256i v, int bits)
{
    if (bits == 8)
        return v;
    return _mm256_xor_si256(v, _mm256_set1_epi8((char)(bits == 4 ? 0x88 : 0xAA)));
}

/* A unit's columns 0..7 and 8..15, their fields two's complement, kept in registers
 * for the unit's k-steps. */
QD_INLINE void load_unit(const uint8_t *wp, int bits, __m256i *lo, __m256i *hi)
{
    __m256i v_lo = to_signed_fields(_mm256_load_si256((const __m256i *)wp), bits);
    __m256i v_hi = to_signed_fields(_mm256_load_si256((const __m256i *)(wp + 32)), bits);
    QD_KEEP_IN_REGISTER(v_lo);
    QD_KEEP_IN_REGISTER(v_hi);
    *lo = v_lo;
    *hi = v_hi;
}

QD_INLINE __m256 dequant(__m256i v, int bits, int i)
{
    const int b = qd_fq_field_bit(bits, i), top = 32 - bits - b;
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(top ? _mm256_slli_epi32(v, top) : v, 32 - bits));
}

QD_INLINE void fq_tile_impl(const qd_fq_tile *t, const int bits, const int mr)
{
    const int ku = QD_KU(bits);
    const uint8_t *wp = t->panel;
    float acc[FQ_MR][QD_NR];
    memset(acc, 0, sizeof acc);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        __m256 part[FQ_MR][2][PARTIALS];
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++)
                for (int p = 0; p < PARTIALS; p++)
                    part[r][h][p] = _mm256_setzero_ps();
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            qd_fq_prefetch(wp, bits);
            __m256i v_lo, v_hi;
            load_unit(wp, bits, &v_lo, &v_hi);
            /* Unrolled: shift counts and partial indices must be constants. */
#pragma GCC unroll 16
            for (int i = 0; i < ku; i++) {
                const __m256 w_lo = dequant(v_lo, bits, i), w_hi = dequant(v_hi, bits, i);
                for (int r = 0; r < mr; r++) {
                    const __m256 xb = _mm256_broadcast_ss(t->x + r * t->ldx + k0 + i);
                    __m256 *lo = &part[r][0][i % PARTIALS], *hi = &part[r][1][i % PARTIALS];
                    *lo = _mm256_fmadd_ps(xb, w_lo, *lo);
                    *hi = _mm256_fmadd_ps(xb, w_hi, *hi);
                }
            }
        }
        const float *scale = t->w_scale + g * QD_NR;
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++) {
                const __m256 sum = _mm256_add_ps(part[r][h][0], part[r][h][1]);
                _mm256_storeu_ps(acc[r] + 8 * h, _mm256_fmadd_ps(sum, _mm256_loadu_ps(scale + 8 * h),
                                                                 _mm256_loadu_ps(acc[r] + 8 * h)));
            }
    }
    for (int r = 0; r < mr; r++)
        memcpy(t->out + r * t->ldo, acc[r], (size_t)t->nr * sizeof(float));
}

/* A unit's ku int8 activations (rows are zero-padded to whole units) as floats,
 * 8 a vector: converted once, not once a row and k-step. */
QD_INLINE void load_activations(const int8_t *a, int ku, __m256 out[2])
{
    __m128i bytes;
    if (ku == 4) {
        int32_t four;
        memcpy(&four, a, sizeof four);
        bytes = _mm_cvtsi32_si128(four);
    } else {
        bytes = ku == 8 ? _mm_loadl_epi64((const __m128i *)a) : _mm_loadu_si128((const __m128i *)a);
    }
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    out[1] = ku == 16 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))) : out[0];
}

/* Scale groups that are no whole units (a [K, N] weight with a scale per row of K,
 * say): one chain per row and half, folded into the accumulator as each group ends.
 * fq (ft) chains x * w and scales each group's sum with an FMA.  qq (qt) chains its
 * int8 activations as floats: products and group sums are whole numbers below 2^24
 * (qd_qq_short_groups), exact in float32 in any order, and each sum times its scale
 * product is added as the reference adds it, a multiply and an add.  One of ft and
 * qt is NULL: each call site compiles to its own kernel. */
QD_INLINE void short_groups(const qd_fq_tile *ft, const qd_qq_tile *qt, const int bits, const int mr)
{
    const int ku = QD_KU(bits);
    const uint8_t *wp = qt ? qt->panel : ft->panel;
    const int64_t K = qt ? qt->k : ft->k, group_k = qt ? qt->group_k : ft->group_k;
    __m256 acc[FQ_MR][2], part[FQ_MR][2], a_unit[FQ_MR][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++)
            acc[r][h] = part[r][h] = a_unit[r][h] = _mm256_setzero_ps();
    qd_group_scales sc = qd_group_scales_start(ft ? ft->w_scale : qt->w_scale, qt);
    int64_t left = group_k;  /* k-steps of the group still to come */
    for (int64_t k0 = 0; k0 < K; k0 += ku, wp += QD_UNIT_BYTES) {
        __m256i v_lo, v_hi;
        load_unit(wp, bits, &v_lo, &v_hi);
        for (int r = 0; qt && r < mr; r++)
            load_activations(qt->a + r * qt->lda + k0, ku, a_unit[r]);
#pragma GCC unroll 16
        for (int i = 0; i < ku; i++) {
            if (k0 + i == K)  /* the panel's zero padding: no group's */
                break;
            const __m256 w_lo = dequant(v_lo, bits, i), w_hi = dequant(v_hi, bits, i);
            for (int r = 0; r < mr; r++) {
                const __m256 xb = qt ? _mm256_permutevar8x32_ps(a_unit[r][i / 8], _mm256_set1_epi32(i % 8))
                                     : _mm256_broadcast_ss(ft->x + r * ft->ldx + k0 + i);
                part[r][0] = _mm256_fmadd_ps(xb, w_lo, part[r][0]);
                part[r][1] = _mm256_fmadd_ps(xb, w_hi, part[r][1]);
            }
            if (--left)
                continue;
            const __m256 s_lo = _mm256_loadu_ps(sc.w), s_hi = _mm256_loadu_ps(sc.w + 8);
            for (int r = 0; r < mr; r++) {
                if (qt) {
                    const __m256 a_scale = _mm256_set1_ps(qt->a_scale[r * qt->a_scale_ld + sc.a_at]);
                    acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_mul_ps(part[r][0], _mm256_mul_ps(a_scale, s_lo)));
                    acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_mul_ps(part[r][1], _mm256_mul_ps(a_scale, s_hi)));
                } else {
                    acc[r][0] = _mm256_fmadd_ps(part[r][0], s_lo, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(part[r][1], s_hi, acc[r][1]);
                }
                part[r][0] = part[r][1] = _mm256_setzero_ps();
            }
            qd_group_scales_next(&sc);
            left = group_k;
        }
    }
    float *out = qt ? qt->out : ft->out;
    const int64_t ldo = qt ? qt->ldo : ft->ldo;
    const int nr = qt ? qt->nr : ft->nr;
    for (int r = 0; r < mr; r++) {
        float row[QD_NR];
        _mm256_storeu_ps(row, acc[r][0]);
        _mm256_storeu_ps(row + 8, acc[r][1]);
        memcpy(out + r * ldo, row, (size_t)nr * sizeof(float));
    }
}

#define QQ_SHORT_CASE(MR) short_groups(NULL, t, bits, (MR) > FQ_MR ? FQ_MR : (MR))
QD_DEFINE_QQ_TILE(qq_tile_short_groups_avx2, QQ_SHORT_CASE)

const qd_kernels qd_kernels_qq_short_groups_avx2 = {
    .qq_tile = qq_tile_short_groups_avx2,
    .qq_mr = FQ_MR,
    .qq_np = 1,
};

#define FQ_CASE(MR) fq_tile_impl(t, bits, (MR) > FQ_MR ? FQ_MR : (MR))
#define FQ_SHORT_CASE(MR) short_groups(t, NULL, bits, (MR) > FQ_MR ? FQ_MR : (MR))
QD_INLINE void fq_tile_bits(const qd_fq_tile *t, const int bits)
{
    if (qd_fq_short_groups(t->ngroups, t->group_k, bits)) {
        QD_SWITCH_MR(t->mr, FQ_SHORT_CASE)
    } else {
        QD_SWITCH_MR(t->mr, FQ_CASE)
    }
}

void qd_fq_tile_avx2(const qd_fq_tile *t)
{
    switch (t->bits) {
    case 8: fq_tile_bits(t, 8); break;
    case 4: fq_tile_bits(t, 4); break;
    default: fq_tile_bits(t, 2); break;
    }
}
