/* AVX-512 VNNI kernels.  vpdpbusd multiplies u8 x s8: the weights are made
 * unsigned (w + bias) and the exact dot is recovered as
 * dpbusd - bias * sum(a over the group). */
#include <immintrin.h>
#include "qd_internal.h"
#include "simd_common.h"
#include "fq_common.h"

#define QQ_MR 8

/* Sub-step s of a unit as unsigned bytes (w + bias). */
QD_INLINE __m512i unpack_biased(__m512i v, int bits, int s)
{
    if (bits == 8)
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    return _mm512_and_si512(_mm512_srli_epi16(v, (unsigned)(s * bits)), mask);
}

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int bits, const int mr)
{
    const int ku = QD_KU(bits), substeps = 8 / bits;
    const __mmask16 cols = (__mmask16)((1u << t->nr) - 1);
    const uint8_t *wp = t->panel;
    __m512 facc[QQ_MR];
    for (int r = 0; r < mr; r++)
        facc[r] = _mm512_setzero_ps();
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        __m512i iacc[QQ_MR];
        for (int r = 0; r < mr; r++)
            iacc[r] = _mm512_setzero_si512();
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            const __m512i v = _mm512_load_si512((const void *)wp);
            for (int s = 0; s < substeps; s++) {
                const __m512i wu = unpack_biased(v, bits, s);
                for (int r = 0; r < mr; r++) {
                    const __m512i a4 = _mm512_set1_epi32(qd_load_i32(t->a + r * t->lda + k0 + 4 * s));
                    iacc[r] = _mm512_dpbusd_epi32(iacc[r], wu, a4);
                }
            }
        }
        for (int r = 0; r < mr; r++)
            iacc[r] = _mm512_sub_epi32(iacc[r], _mm512_set1_epi32(
                qd_bias_correction(bits, t->a_rowsum[r * t->rowsum_ld + g])));
        if (t->out_i32) {
            for (int r = 0; r < mr; r++)
                _mm512_mask_storeu_epi32(t->out_i32 + r * t->ldo, cols, iacc[r]);
            return;
        }
        const __m512 ws = _mm512_load_ps(t->w_scale + (g / t->w_ratio) * QD_NR);
        for (int r = 0; r < mr; r++) {
            const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(t->a_scale[r * t->a_scale_ld + g / t->a_ratio]));
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r]), s, facc[r]);
        }
    }
    for (int r = 0; r < mr; r++)
        _mm512_mask_storeu_ps(t->out + r * t->ldo, cols, facc[r]);
}

#define QQ_CASE(MR) qq_tile_impl(t, bits, MR)
QD_INLINE void qq_tile_bits(const qd_qq_tile *t, const int bits)
{
    QD_SWITCH_MR(t->mr, QQ_CASE)
}

static void qq_tile_avx512vnni(const qd_qq_tile *t)
{
    switch (t->bits) {
    case 8: qq_tile_bits(t, 8); break;
    case 4: qq_tile_bits(t, 4); break;
    default: qq_tile_bits(t, 2); break;
    }
}

const qd_kernels qd_kernels_avx512vnni = {
    .qq_tile = qq_tile_avx512vnni,
    .fq_tile = qd_fq_tile_avx512,
    .qq_mr = QQ_MR,
    .fq_mr = QD_FQ_MR_ZMM,
    .needs_rowsum = 1,
};
