/* 256-bit helpers shared by the AVX2 and AVX-VNNI kernel files (both are
 * compiled with AVX2 enabled).  A unit of 64 bytes is two ymm: columns 0..7 and
 * columns 8..15. */
#ifndef QD_SIMD_YMM_H
#define QD_SIMD_YMM_H

#include <immintrin.h>
#include "qd_internal.h"
#include "simd_common.h"

#define QD_YMM_QQ_MR 4

/* Sub-step s of 32 packed bytes as unsigned bytes (w + bias). */
QD_INLINE __m256i qd_ymm_unpack_biased(__m256i v, int bits, int s)
{
    if (bits == 8)
        return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
    const __m256i mask = _mm256_set1_epi8((char)((1 << bits) - 1));
    return _mm256_and_si256(_mm256_srli_epi16(v, s * bits), mask);
}

/* Float accumulators of one qq tile, kept in L1 between groups. */
typedef struct {
    float v[QD_YMM_QQ_MR][QD_NR];
} qd_ymm_qq_acc;

/* acc + idot * (ws * as), rounded after each step as the reference rounds it
 * (a fused multiply-add would round once and differ in the last bit). */
QD_INLINE __m256 qd_ymm_add_scaled(__m256 acc, __m256i idot, __m256 ws, __m256 as)
{
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(idot), _mm256_mul_ps(ws, as)));
}

/* End of group g for row r: idot holds the per-column int32 dots (columns 0..7,
 * 8..15), biased if `biased`.  Integer mode stores; float mode scales by the
 * group's scales (sc) and accumulates. */
QD_INLINE void qd_ymm_qq_group_end(const qd_qq_tile *t, qd_ymm_qq_acc *acc, int r, int64_t g,
                                   const qd_group_scales *sc, __m256i idot_lo, __m256i idot_hi, int bits,
                                   int biased)
{
    if (biased) {
        const __m256i corr = _mm256_set1_epi32(qd_bias_correction(bits, t->a_rowsum[r * t->rowsum_ld + g]));
        idot_lo = _mm256_sub_epi32(idot_lo, corr);
        idot_hi = _mm256_sub_epi32(idot_hi, corr);
    }
    if (t->out_i32) {
        int32_t tmp[QD_NR];
        _mm256_storeu_si256((__m256i *)tmp, idot_lo);
        _mm256_storeu_si256((__m256i *)(tmp + 8), idot_hi);
        memcpy(t->out_i32 + r * t->ldo, tmp, (size_t)t->nr * sizeof(int32_t));
        return;
    }
    const float *ws = sc->w;
    const __m256 as = _mm256_set1_ps(t->a_scale[r * t->a_scale_ld + sc->a_at]);
    float *row = acc->v[r];
    _mm256_storeu_ps(row, qd_ymm_add_scaled(_mm256_loadu_ps(row), idot_lo, _mm256_loadu_ps(ws), as));
    _mm256_storeu_ps(row + 8, qd_ymm_add_scaled(_mm256_loadu_ps(row + 8), idot_hi, _mm256_loadu_ps(ws + 8), as));
}

QD_INLINE void qd_ymm_qq_store(const qd_qq_tile *t, const qd_ymm_qq_acc *acc, int mr)
{
    if (t->out_i32)
        return;
    for (int r = 0; r < mr; r++)
        memcpy(t->out + r * t->ldo, acc->v[r], (size_t)t->nr * sizeof(float));
}

/* Defines `NAME(t, acc, bits, mr)`: the qq tile over weight units stored biased to
 * unsigned, with DOT(acc, w, a4) adding each column's 4-byte u8 x s8 dot product
 * to acc.  The ISA files differ only in DOT (vpdpbusd, or vpmaddubsw + vpmaddwd
 * where the fields are small enough not to saturate). */
#define QD_DEFINE_YMM_QQ_BIASED(NAME, DOT)                                            \
    QD_INLINE void NAME(const qd_qq_tile *t, qd_ymm_qq_acc *acc, const int bits,       \
                        const int mr)                                                 \
    {                                                                                 \
        const int ku = QD_KU(bits), substeps = 8 / bits;                              \
        const uint8_t *wp = t->panel;                                                 \
        qd_group_scales sc = qd_group_scales_start(t->w_scale, t);                    \
        int64_t k0 = 0;                                                               \
        for (int64_t g = 0; g < t->ngroups; g++) {                                    \
            __m256i lo[QD_YMM_QQ_MR], hi[QD_YMM_QQ_MR];                               \
            for (int r = 0; r < mr; r++)                                              \
                lo[r] = hi[r] = _mm256_setzero_si256();                               \
            for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) { \
                const __m256i v_lo = _mm256_load_si256((const __m256i *)wp);          \
                const __m256i v_hi = _mm256_load_si256((const __m256i *)(wp + 32));   \
                for (int s = 0; s < substeps; s++) {                                  \
                    const __m256i w_lo = qd_ymm_unpack_biased(v_lo, bits, s);         \
                    const __m256i w_hi = qd_ymm_unpack_biased(v_hi, bits, s);         \
                    for (int r = 0; r < mr; r++) {                                    \
                        const __m256i a4 =                                            \
                            _mm256_set1_epi32(qd_load_i32(t->a + r * t->lda + k0 + 4 * s)); \
                        lo[r] = DOT(lo[r], w_lo, a4);                                 \
                        hi[r] = DOT(hi[r], w_hi, a4);                                 \
                    }                                                                 \
                }                                                                     \
            }                                                                         \
            for (int r = 0; r < mr; r++)                                              \
                qd_ymm_qq_group_end(t, acc, r, g, &sc, lo[r], hi[r], bits, 1);        \
            qd_group_scales_next(&sc);                                                \
        }                                                                             \
    }

#endif
