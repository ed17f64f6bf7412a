/* The qq tile's epilogue pieces in AVX-512, shared by the VNNI and AMX kernels
 * (files built with AVX-512 flags), so that both scale and round a group's sums
 * alike and a row's result doesn't depend on which of them ran it. */
#ifndef QD_QQ_ZMM_H
#define QD_QQ_ZMM_H

#include <immintrin.h>
#include "qd_internal.h"
#include "simd_common.h"

/* The valid columns of panel p of the tile. */
QD_INLINE __mmask16 qd_zmm_panel_cols(const qd_qq_tile *t, int p)
{
    const int n = t->nr - p * QD_NR;
    return n >= QD_NR ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

/* acc + sum * (w_scale * a_scale): one scale product per output and group, then a
 * product and an add, each rounded as the reference rounds them (not fused). */
QD_INLINE __m512 qd_zmm_add_scaled(__m512 acc, __m512i sum, __m512 w_scale, __m512 a_scale)
{
    return _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(w_scale, a_scale)));
}

/* Panels a call of the AVX-512 qq kernels covers (VNNI and AMX alike). */
#define QD_ZMM_NP 2

/* Integer mode: the one group's sums, [row][panel], to out_i32. */
QD_INLINE void qd_zmm_store_sums(const qd_qq_tile *t, int mr, int np, const __m512i sums[][QD_ZMM_NP])
{
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++)
            _mm512_mask_storeu_epi32(t->out_i32 + r * t->ldo + p * QD_NR, qd_zmm_panel_cols(t, p), sums[r][p]);
}

/* acc[r][p] += the group's sums[r][p], scaled (qd_zmm_add_scaled) by its scales, sc. */
QD_INLINE void qd_zmm_add_group(const qd_qq_tile *t, const qd_group_scales *sc, int mr, int np,
                                __m512 acc[][QD_ZMM_NP], const __m512i sums[][QD_ZMM_NP])
{
    __m512 ws[QD_ZMM_NP];
    for (int p = 0; p < np; p++)
        ws[p] = _mm512_load_ps(sc->w + p * t->w_scale_ld);
    for (int r = 0; r < mr; r++) {
        const __m512 as = _mm512_set1_ps(t->a_scale[r * t->a_scale_ld + sc->a_at]);
        for (int p = 0; p < np; p++)
            acc[r][p] = qd_zmm_add_scaled(acc[r][p], sums[r][p], ws[p], as);
    }
}

/* The tile's results, acc[row][panel], to out. */
QD_INLINE void qd_zmm_store_out(const qd_qq_tile *t, int mr, int np, const __m512 acc[][QD_ZMM_NP])
{
    for (int r = 0; r < mr; r++)
        for (int p = 0; p < np; p++)
            _mm512_mask_storeu_ps(t->out + r * t->ldo + p * QD_NR, qd_zmm_panel_cols(t, p), acc[r][p]);
}

#endif
