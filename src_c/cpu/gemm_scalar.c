/* Portable kernels: any bit width, any group length (also the fallback when a
 * group does not fall on the SIMD kernels' unit boundaries). */
#include "qd_internal.h"
#include "panel_layout.h"

static void qq_tile_scalar(const qd_qq_tile *t)
{
    for (int r = 0; r < t->mr; r++) {
        const int8_t *a = t->a + r * t->lda;
        for (int n = 0; n < t->nr; n++) {
            float acc = 0.0f;
            qd_group_scales sc = qd_group_scales_start(t->w_scale, t);
            for (int64_t g = 0; g < t->ngroups; g++) {
                /* Wrapping unsigned arithmetic: the true group sum fits int32. */
                uint32_t dot = 0;
                const int64_t k_end = g == t->ngroups - 1 ? t->k : (g + 1) * t->group_k;
                for (int64_t k = g * t->group_k; k < k_end; k++)
                    dot += (uint32_t)(a[k] * qd_panel_get(t->panel, t->bits, k, n));
                if (t->out_i32) {
                    t->out_i32[r * t->ldo + n] = (int32_t)dot;
                    continue;
                }
                const float s = t->a_scale[r * t->a_scale_ld + sc.a_at] * sc.w[n];
                acc += (float)(int32_t)dot * s;
                qd_group_scales_next(&sc);
            }
            if (!t->out_i32)
                t->out[r * t->ldo + n] = acc;
        }
    }
}

static void fq_tile_scalar(const qd_fq_tile *t)
{
    for (int r = 0; r < t->mr; r++) {
        const float *x = t->x + r * t->ldx;
        for (int n = 0; n < t->nr; n++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < t->ngroups; g++) {
                const int64_t k_end = g == t->ngroups - 1 ? t->k : (g + 1) * t->group_k;
                float part = 0.0f;
                for (int64_t k = g * t->group_k; k < k_end; k++)
                    part += x[k] * (float)qd_panel_get(t->panel, t->bits, k, n);
                acc += part * t->w_scale[g * QD_NR + n];
            }
            t->out[r * t->ldo + n] = acc;
        }
    }
}

const qd_kernels qd_kernels_scalar = {
    .qq_tile = qq_tile_scalar,
    .fq_tile = fq_tile_scalar,
    .qq_mr = 4,
    .fq_mr = 4,
    .needs_rowsum = 0,
};
