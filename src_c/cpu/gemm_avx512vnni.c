/* AVX-512 VNNI kernels.  vpdpbusd multiplies u8 x s8: the weights are made
 * unsigned (w + bias) and the exact dot is recovered as
 * dpbusd - bias * sum(a over the group). */
#include <immintrin.h>
#include "qd_internal.h"
#include "simd_common.h"
#include "fq_common.h"
#include "qq_zmm.h"

/* 8 rows x 2 panels: 16 independent vpdpbusd chains hide its latency, and each
 * broadcast of 4 activation bytes feeds two of them. */
#define QQ_MR 8
#define QQ_NP QD_ZMM_NP

/* Sub-step s of a unit as unsigned bytes (w + bias). */
QD_INLINE __m512i unpack_biased(__m512i v, int bits, int s)
{
    if (bits == 8)
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    return _mm512_and_si512(_mm512_srli_epi16(v, (unsigned)(s * bits)), mask);
}

/* acc += dot4(w, a) in place.  Through the intrinsic GCC copies every accumulator
 * of the tile twice per k-step (and spills some), which costs about a third. */
QD_INLINE __m512i dpbusd(__m512i acc, __m512i w, __m512i a)
{
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(a));
    return acc;
}

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int bits, const int mr, const int np)
{
    const int ku = QD_KU(bits), substeps = 8 / bits;
    const uint8_t *wp = t->panel;
    __m512 facc[QQ_MR][QQ_NP];
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++)
            facc[r][p] = _mm512_setzero_ps();
    qd_group_scales sc = qd_group_scales_start(t->w_scale, t);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        __m512i iacc[QQ_MR][QQ_NP];
        for (int r = 0; r < mr; r++)
            for (int p = 0; p < np; p++)
                iacc[r][p] = _mm512_setzero_si512();
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            __m512i v[QQ_NP];
            for (int p = 0; p < np; p++)
                v[p] = _mm512_load_si512((const void *)(wp + p * t->panel_ld));
            for (int s = 0; s < substeps; s++) {
                __m512i wu[QQ_NP];
                for (int p = 0; p < np; p++)
                    wu[p] = unpack_biased(v[p], bits, s);
                for (int r = 0; r < mr; r++) {
                    const __m512i a4 = _mm512_set1_epi32(qd_load_i32(t->a + r * t->lda + k0 + 4 * s));
                    for (int p = 0; p < np; p++)
                        iacc[r][p] = dpbusd(iacc[r][p], wu[p], a4);
                }
            }
        }
        for (int r = 0; r < mr; r++) {
            const __m512i corr = _mm512_set1_epi32(
                qd_bias_correction(bits, t->a_rowsum[r * t->rowsum_ld + g]));
            for (int p = 0; p < np; p++)
                iacc[r][p] = _mm512_sub_epi32(iacc[r][p], corr);
        }
        if (t->out_i32) {
            qd_zmm_store_sums(t, mr, np, iacc);
            return;
        }
        qd_zmm_add_group(t, &sc, mr, np, facc, iacc);
        qd_group_scales_next(&sc);
    }
    qd_zmm_store_out(t, mr, np, facc);
}

#define QQ_CASE(MR) (t->np == 1 ? qq_tile_impl(t, bits, MR, 1) : qq_tile_impl(t, bits, MR, QQ_NP))
QD_DEFINE_QQ_TILE(qq_tile_avx512vnni, QQ_CASE)

const qd_kernels qd_kernels_avx512vnni = {
    .qq_tile = qq_tile_avx512vnni,
    .fq_tile = qd_fq_tile_avx512,
    .qq_mr = QQ_MR,
    .qq_np = QQ_NP,
    .fq_mr = QD_FQ_MR_ZMM,
    .fq_short_groups = 1,
    /* ymm: a zmm form of that kernel (fq_avx512vnni.c's short groups taking qq too)
     * took 1.2-1.3x its time at 16 and 64 x 4096 x 4096 on Zen 4, one thread */
    .qq_short_groups = &qd_kernels_qq_short_groups_avx2,
    .needs_rowsum = 1,
};
