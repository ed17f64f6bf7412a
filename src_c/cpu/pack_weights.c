/* Packing int8 / int4 / int2 weights [N, K] into the kernels' panel layout
 * (see qd_internal.h), and back. */
#include <stdlib.h>
#include <string.h>
#include "qd_internal.h"
#include "panel_layout.h"

static int value_fits(int v, int bits)
{
    const int lo = -(1 << (bits - 1)), hi = (1 << (bits - 1)) - 1;
    return v >= lo && v <= hi;
}

static qd_status check_values(const int8_t *w, int64_t count, int bits)
{
    if (bits == 8)
        return QD_OK;
    for (int64_t i = 0; i < count; i++)
        if (!value_fits(w[i], bits))
            return QD_ERR_ARGUMENT;
    return QD_OK;
}

qd_status qd_pack_weights(const int8_t *w, int64_t N, int64_t K, int bits,
                          const float *scales, int64_t block_n, int64_t block_k,
                          qd_packed_weights **out)
{
    if (!w || !out)
        return QD_ERR_NULL;
    *out = NULL;
    if (bits != 8 && bits != 4 && bits != 2)
        return QD_ERR_SCHEME;
    if (N <= 0 || K <= 0 || block_n <= 0 || block_k <= 0 || N % block_n || K % block_k)
        return QD_ERR_SHAPE;
    qd_status st = check_values(w, N * K, bits);
    if (st != QD_OK)
        return st;

    qd_packed_weights *pw = qd_packed_new(N, K, bits, scales, block_n, block_k);
    if (!pw)
        return QD_ERR_NO_MEMORY;
    const uint8_t zero = qd_panel_zero_byte(bits);
#pragma omp parallel for schedule(static) num_threads(qd_threads_for(pw->n_panels))
    for (int64_t p = 0; p < pw->n_panels; p++) {
        uint8_t *panel = pw->panels + p * pw->panel_bytes;
        memset(panel, zero, (size_t)pw->panel_bytes);
        for (int n = 0; n < QD_NR && p * QD_NR + n < N; n++) {
            const int8_t *row = w + (p * QD_NR + n) * K;
            for (int64_t k = 0; k < K; k++)
                qd_panel_put(panel, bits, k, n, row[k]);
        }
    }
    *out = pw;
    return QD_OK;
}

void qd_packed_layout(qd_packed_weights *pw, int64_t N, int64_t K, int bits,
                      int64_t block_n, int64_t block_k)
{
    const int ku = QD_KU(bits);
    pw->n = N;
    pw->k = K;
    pw->bits = bits;
    pw->block_n = block_n;
    pw->block_k = block_k;
    pw->k_padded = (K + ku - 1) / ku * ku;
    pw->n_panels = (N + QD_NR - 1) / QD_NR;
    pw->panel_bytes = pw->k_padded / ku * QD_UNIT_BYTES;
    pw->k_groups = K / block_k;
}

qd_packed_weights *qd_packed_new(int64_t N, int64_t K, int bits, const float *scales,
                                 int64_t block_n, int64_t block_k)
{
    qd_packed_weights *pw = calloc(1, sizeof *pw);
    if (!pw)
        return NULL;
    qd_packed_layout(pw, N, K, bits, block_n, block_k);
    const int64_t grid = (N / block_n) * pw->k_groups;
    pw->panels = qd_aligned_alloc((size_t)(pw->n_panels * pw->panel_bytes));
    pw->panel_scales = qd_aligned_alloc((size_t)(pw->n_panels * pw->k_groups * QD_NR) * sizeof(float));
    pw->scales = malloc((size_t)grid * sizeof(float));
    if (!pw->panels || !pw->panel_scales || !pw->scales) {
        qd_packed_weights_free(pw);
        return NULL;
    }
    for (int64_t i = 0; i < grid; i++)
        pw->scales[i] = scales ? scales[i] : 1.0f;
    for (int64_t col = 0; col < pw->n_panels * QD_NR; col++) {
        float *pscale = pw->panel_scales + (col / QD_NR) * pw->k_groups * QD_NR + col % QD_NR;
        for (int64_t g = 0; g < pw->k_groups; g++)
            pscale[g * QD_NR] = col < N ? pw->scales[(col / block_n) * pw->k_groups + g] : 0.0f;
    }
    return pw;
}

void qd_packed_weights_free(qd_packed_weights *pw)
{
    if (!pw)
        return;
    qd_aligned_free(pw->panels);
    qd_aligned_free(pw->panel_scales);
    free(pw->scales);
    free(pw);
}

size_t qd_packed_weights_nbytes(const qd_packed_weights *pw)
{
    if (!pw)
        return 0;
    return (size_t)(pw->n_panels * pw->panel_bytes) +
           (size_t)(pw->n_panels * pw->k_groups * QD_NR) * sizeof(float) +
           (size_t)((pw->n / pw->block_n) * pw->k_groups) * sizeof(float);
}

qd_status qd_packed_weights_info(const qd_packed_weights *pw, int64_t *N, int64_t *K, int *bits,
                                 int64_t *block_n, int64_t *block_k)
{
    if (!pw)
        return QD_ERR_NULL;
    if (N) *N = pw->n;
    if (K) *K = pw->k;
    if (bits) *bits = pw->bits;
    if (block_n) *block_n = pw->block_n;
    if (block_k) *block_k = pw->block_k;
    return QD_OK;
}

qd_status qd_unpack_weights(const qd_packed_weights *pw, int8_t *w_out, float *scales_out)
{
    if (!pw)
        return QD_ERR_NULL;
    if (w_out) {
        for (int64_t col = 0; col < pw->n; col++) {
            const uint8_t *panel = pw->panels + (col / QD_NR) * pw->panel_bytes;
            for (int64_t k = 0; k < pw->k; k++)
                w_out[col * pw->k + k] = (int8_t)qd_panel_get(panel, pw->bits, k, (int)(col % QD_NR));
        }
    }
    if (scales_out)
        memcpy(scales_out, pw->scales, (size_t)((pw->n / pw->block_n) * pw->k_groups) * sizeof(float));
    return QD_OK;
}
