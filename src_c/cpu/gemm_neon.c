/* NEON dot-product kernels (ARMv8.2-A dotprod).  vdotq_s32 multiplies s8 x s8
 * exactly into int32, so no bias correction is needed.  A 64-byte unit is four
 * q registers, each holding 4 columns x 4 k. */
#include <arm_neon.h>
#include "qd_internal.h"
#include "simd_common.h"

#define QQ_MR 4

/* Quarter q (columns 4q..4q+3) of sub-step s as signed bytes. */
QD_INLINE int8x16_t unpack_signed(uint8x16_t v, int bits, int s)
{
    if (bits == 8)
        return vreinterpretq_s8_u8(v);
    const uint8x16_t field = vandq_u8(vshlq_u8(v, vdupq_n_s8((int8_t)(-s * bits))),
                                      vdupq_n_u8((uint8_t)((1 << bits) - 1)));
    return vsubq_s8(vreinterpretq_s8_u8(field), vdupq_n_s8((int8_t)(1 << (bits - 1))));
}

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int bits, const int mr)
{
    const int ku = QD_KU(bits), substeps = 8 / bits;
    const uint8_t *wp = t->panel;
    float facc[QQ_MR][QD_NR] = {{0}};
    qd_group_scales sc = qd_group_scales_start(t->w_scale, t);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        int32x4_t iacc[QQ_MR][4];
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < 4; q++)
                iacc[r][q] = vdupq_n_s32(0);
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            uint8x16_t v[4];
            for (int q = 0; q < 4; q++)
                v[q] = vld1q_u8(wp + 16 * q);
            for (int s = 0; s < substeps; s++) {
                int8x16_t w[4];
                for (int q = 0; q < 4; q++)
                    w[q] = unpack_signed(v[q], bits, s);
                for (int r = 0; r < mr; r++) {
                    const int8x16_t a4 = vreinterpretq_s8_s32(vdupq_n_s32(qd_load_i32(t->a + r * t->lda + k0 + 4 * s)));
                    for (int q = 0; q < 4; q++)
                        iacc[r][q] = vdotq_s32(iacc[r][q], w[q], a4);
                }
            }
        }
        for (int r = 0; r < mr; r++) {
            if (t->out_i32) {
                int32_t tmp[QD_NR];
                for (int q = 0; q < 4; q++)
                    vst1q_s32(tmp + 4 * q, iacc[r][q]);
                memcpy(t->out_i32 + r * t->ldo, tmp, (size_t)t->nr * sizeof(int32_t));
                continue;
            }
            const float *ws = sc.w;
            const float32x4_t as = vdupq_n_f32(t->a_scale[r * t->a_scale_ld + sc.a_at]);
            for (int q = 0; q < 4; q++) {
                const float32x4_t s = vmulq_f32(vld1q_f32(ws + 4 * q), as);
                /* product and add rounded apart, as the reference rounds them */
                vst1q_f32(facc[r] + 4 * q, vaddq_f32(vld1q_f32(facc[r] + 4 * q), vmulq_f32(vcvtq_f32_s32(iacc[r][q]), s)));
            }
        }
        qd_group_scales_next(&sc);
    }
    if (!t->out_i32)
        for (int r = 0; r < mr; r++)
            memcpy(t->out + r * t->ldo, facc[r], (size_t)t->nr * sizeof(float));
}

#define QQ_CASE(MR) qq_tile_impl(t, bits, (MR) > QQ_MR ? QQ_MR : (MR))
QD_DEFINE_QQ_TILE(qq_tile_neon, QQ_CASE)

/* fq, one row: each column's 4 k of a sub-step become one float32x4 multiplied
 * by x[k..k+3].  At the end of each scale group the 4 lanes of each column are
 * added pairwise, (l0 + l1) + (l2 + l3), and the sum is scaled once by the group's
 * weight scale into the row's result: x * q is summed per group, then scaled, as
 * on the other ISAs (a sum past float32's range is inf whatever the scale). */
QD_INLINE void fq_row_impl(const qd_fq_tile *t, int r, const int bits)
{
    const int ku = QD_KU(bits), substeps = 8 / bits;
    const uint8_t *wp = t->panel;
    const float *x = t->x + r * t->ldx;
    float32x4_t out[4];
    for (int q = 0; q < 4; q++)
        out[q] = vdupq_n_f32(0.0f);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        float32x4_t acc[QD_NR];
        for (int n = 0; n < QD_NR; n++)
            acc[n] = vdupq_n_f32(0.0f);
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            for (int s = 0; s < substeps; s++) {
                const float32x4_t xb = vld1q_f32(x + k0 + 4 * s);
                for (int q = 0; q < 4; q++) {
                    const int8x16_t w8 = unpack_signed(vld1q_u8(wp + 16 * q), bits, s);
                    const int16x8_t w16[2] = {vmovl_s8(vget_low_s8(w8)), vmovl_s8(vget_high_s8(w8))};
                    for (int c = 0; c < 4; c++) {
                        const int16x4_t part = (c & 1) ? vget_high_s16(w16[c / 2]) : vget_low_s16(w16[c / 2]);
                        acc[4 * q + c] = vfmaq_f32(acc[4 * q + c], xb, vcvtq_f32_s32(vmovl_s16(part)));
                    }
                }
            }
        }
        /* Pairwise adds give columns 4q..4q+3 their (l0 + l1) + (l2 + l3); the
         * product and the add are rounded apart, as the reference rounds them. */
        const float *ws = t->w_scale + g * QD_NR;
        for (int q = 0; q < 4; q++) {
            const float32x4_t sums = vpaddq_f32(vpaddq_f32(acc[4 * q], acc[4 * q + 1]),
                                                vpaddq_f32(acc[4 * q + 2], acc[4 * q + 3]));
            out[q] = vaddq_f32(out[q], vmulq_f32(sums, vld1q_f32(ws + 4 * q)));
        }
    }
    float tmp[QD_NR];
    for (int q = 0; q < 4; q++)
        vst1q_f32(tmp + 4 * q, out[q]);
    memcpy(t->out + r * t->ldo, tmp, (size_t)t->nr * sizeof(float));
}

QD_INLINE void fq_tile_bits(const qd_fq_tile *t, const int bits)
{
    for (int r = 0; r < t->mr; r++)
        fq_row_impl(t, r, bits);
}

static void fq_tile_neon(const qd_fq_tile *t)
{
    switch (t->bits) {
    case 8: fq_tile_bits(t, 8); break;
    case 4: fq_tile_bits(t, 4); break;
    default: fq_tile_bits(t, 2); break;
    }
}

const qd_kernels qd_kernels_neon = {
    .qq_tile = qq_tile_neon,
    .fq_tile = fq_tile_neon,
    .qq_mr = QQ_MR,
    .fq_mr = 1,
    .needs_rowsum = 0,
};
