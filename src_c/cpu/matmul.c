/* Matmul drivers: argument checks, operand preparation (zero-padded A, group
 * sums, scale grids), the group length, the ISA's kernels and the parallel
 * loop over (column panel, row block) tasks.  Each output element is computed
 * by one microkernel call with a fixed operation order, so results do not
 * depend on the thread count or on the other rows of the batch. */
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include "qd_internal.h"

#define ROW_BLOCK 64   /* rows of A that one task runs against a panel held in L2 */
#define FQ_ROW_BYTES (256 << 10)   /* float rows per task: they stay in L2 across panels */

static int64_t gcd64(int64_t a, int64_t b)
{
    while (b) {
        const int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The longest divisor of g that keeps an int8 dot exact in int32, preferring one
 * that stays a whole number of SIMD units. */
static int64_t exact_group(int64_t g, int ku)
{
    if (g <= QD_INT_MATMUL_MAX_K)
        return g;
    int64_t fallback = 1;
    for (int64_t d = QD_INT_MATMUL_MAX_K; d >= 1; d--) {
        if (g % d)
            continue;
        if (d % ku == 0)
            return d;
        if (fallback == 1)
            fallback = d;
    }
    return fallback;
}

/* Rows of A copied to a 64-byte aligned buffer with a zeroed tail to k_padded. */
static int8_t *padded_rows_s8(const int8_t *a, int64_t M, int64_t K, int64_t kp)
{
    int8_t *buf = qd_aligned_alloc((size_t)(M * kp));
    if (!buf)
        return NULL;
    for (int64_t m = 0; m < M; m++) {
        memcpy(buf + m * kp, a + m * K, (size_t)K);
        memset(buf + m * kp + K, 0, (size_t)(kp - K));
    }
    return buf;
}

static int32_t *group_rowsums(const int8_t *a, int64_t M, int64_t lda, int64_t K, int64_t group)
{
    const int64_t ngroups = K / group;
    int32_t *sums = malloc((size_t)(M * ngroups) * sizeof(int32_t));
    if (!sums)
        return NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < ngroups; g++) {
            int32_t s = 0;
            for (int64_t k = g * group; k < (g + 1) * group; k++)
                s += a[m * lda + k];
            sums[m * ngroups + g] = s;
        }
    return sums;
}

typedef struct {
    int64_t M, n_panels, row_block, n_row_blocks;
} task_grid;

static task_grid make_grid(int64_t M, int64_t n_panels, int64_t row_block)
{
    task_grid grid = {M, n_panels, M <= row_block ? M : row_block, 0};
    grid.n_row_blocks = (M + grid.row_block - 1) / grid.row_block;
    return grid;
}

/* The qq / integer core.  a: padded [M, kp]; a_scales: [M, a_groups] per row or NULL
 * for integer mode (then out_i32 is written). */
static qd_status run_qq(const int8_t *a, int64_t M, int64_t K, const float *a_scales,
                        int64_t a_block_k, const qd_packed_weights *w, float *out, int32_t *out_i32)
{
    const int ku = QD_KU(w->bits);
    const int64_t group = out_i32 ? K : exact_group(gcd64(a_block_k, w->block_k), ku);
    const int64_t ngroups = K / group;
    const qd_kernels *kern = qd_kernels_for(qd_isa_active());
    if (ngroups > 1 && group % ku != 0)
        kern = &qd_kernels_scalar;
    int32_t *rowsums = NULL;
    if (kern->needs_rowsum && !(rowsums = group_rowsums(a, M, w->k_padded, K, group)))
        return QD_ERR_NO_MEMORY;

    /* Tasks are (group of np panels, row block) pairs, row blocks inner: a thread
     * keeps its panels in L2 while the row blocks pass. */
    const int np = kern->qq_np > 0 ? kern->qq_np : 1;
    const int64_t n_groups = (w->n_panels + np - 1) / np;
    const task_grid grid = make_grid(M, n_groups, ROW_BLOCK);
    const int64_t ntasks = grid.n_panels * grid.n_row_blocks;
    const int64_t N = w->n;
#pragma omp parallel for schedule(static) num_threads(qd_threads_for(ntasks))
    for (int64_t task = 0; task < ntasks; task++) {
        const int64_t pg = task / grid.n_row_blocks, rb = task % grid.n_row_blocks;
        const int64_t p = pg * np, n0 = p * QD_NR;
        const int64_t m_end = (rb + 1) * grid.row_block < M ? (rb + 1) * grid.row_block : M;
        qd_qq_tile t = {
            .lda = w->k_padded,
            .rowsum_ld = ngroups,
            .a_scale_ld = K / a_block_k,
            .a_ratio = a_block_k / group,
            .panel = w->panels + p * w->panel_bytes,
            .panel_ld = w->panel_bytes,
            .np = (int)(w->n_panels - p < np ? w->n_panels - p : np),
            .w_scale = w->panel_scales + p * w->k_groups * QD_NR,
            .w_scale_ld = w->k_groups * QD_NR,
            .w_ratio = w->block_k / group,
            .bits = w->bits,
            .nr = (int)(N - n0 < np * QD_NR ? N - n0 : np * QD_NR),
            .k = K,
            .group_k = group,
            .ngroups = ngroups,
            .group_units = ngroups == 1 ? w->k_padded / ku : group / ku,
            .ldo = N,
        };
        for (int64_t m = rb * grid.row_block; m < m_end; m += kern->qq_mr) {
            t.mr = (int)(m_end - m < kern->qq_mr ? m_end - m : kern->qq_mr);
            t.a = a + m * w->k_padded;
            t.a_rowsum = rowsums ? rowsums + m * ngroups : NULL;
            t.a_scale = a_scales ? a_scales + m * t.a_scale_ld : NULL;
            t.out = out ? out + m * N + n0 : NULL;
            t.out_i32 = out_i32 ? out_i32 + m * N + n0 : NULL;
            kern->qq_tile(&t);
        }
    }
    free(rowsums);
    return QD_OK;
}

static qd_status check_weights(const qd_packed_weights *w, int64_t M, int64_t K)
{
    if (M <= 0 || K <= 0 || K != w->k)
        return QD_ERR_SHAPE;
    return QD_OK;
}

qd_status qd_int_matmul_packed(const int8_t *a, int64_t M, int64_t K,
                               const qd_packed_weights *w, int32_t *c)
{
    if (!a || !w || !c)
        return QD_ERR_NULL;
    qd_status st = check_weights(w, M, K);
    if (st != QD_OK)
        return st;
    if (K > QD_INT_MATMUL_MAX_K)
        return QD_ERR_K_TOO_LARGE;
    int8_t *ap = padded_rows_s8(a, M, K, w->k_padded);
    if (!ap)
        return QD_ERR_NO_MEMORY;
    st = run_qq(ap, M, K, NULL, K, w, NULL, c);
    qd_aligned_free(ap);
    return st;
}

qd_status qd_int_matmul_s8(const int8_t *a, int64_t M, int64_t K, const int8_t *b, int64_t N,
                           int32_t *c)
{
    if (!a || !b || !c)
        return QD_ERR_NULL;
    if (M <= 0 || K <= 0 || N <= 0)
        return QD_ERR_SHAPE;
    if (K > QD_INT_MATMUL_MAX_K)
        return QD_ERR_K_TOO_LARGE;
    /* b is [K, N]; the packer wants [N, K]. */
    int8_t *bt = malloc((size_t)(N * K));
    if (!bt)
        return QD_ERR_NO_MEMORY;
    const int64_t tile = 64;
    for (int64_t k0 = 0; k0 < K; k0 += tile)
        for (int64_t n0 = 0; n0 < N; n0 += tile)
            for (int64_t k = k0; k < K && k < k0 + tile; k++)
                for (int64_t n = n0; n < N && n < n0 + tile; n++)
                    bt[n * K + k] = b[k * N + n];
    qd_packed_weights *w = NULL;
    qd_status st = qd_pack_weights(bt, N, K, 8, NULL, 1, K, &w);
    free(bt);
    if (st == QD_OK)
        st = qd_int_matmul_packed(a, M, K, w, c);
    qd_packed_weights_free(w);
    return st;
}

/* a_scales grid [M/a_block_m, K/a_block_k] repeated to one row per row of A. */
static float *scales_per_row(const float *a_scales, int64_t M, int64_t a_block_m, int64_t a_groups)
{
    float *rows = malloc((size_t)(M * a_groups) * sizeof(float));
    if (!rows)
        return NULL;
    for (int64_t m = 0; m < M; m++)
        memcpy(rows + m * a_groups, a_scales + (m / a_block_m) * a_groups, (size_t)a_groups * sizeof(float));
    return rows;
}

qd_status qd_qq_matmul(const int8_t *a, int64_t M, int64_t K, const float *a_scales,
                       int64_t a_block_m, int64_t a_block_k, const qd_packed_weights *w,
                       float *out)
{
    if (!a || !a_scales || !w || !out)
        return QD_ERR_NULL;
    qd_status st = check_weights(w, M, K);
    if (st != QD_OK)
        return st;
    if (a_block_m <= 0 || a_block_k <= 0 || M % a_block_m || K % a_block_k)
        return QD_ERR_SHAPE;
    int8_t *ap = padded_rows_s8(a, M, K, w->k_padded);
    float *row_scales = scales_per_row(a_scales, M, a_block_m, K / a_block_k);
    st = ap && row_scales ? run_qq(ap, M, K, row_scales, a_block_k, w, out, NULL) : QD_ERR_NO_MEMORY;
    qd_aligned_free(ap);
    free(row_scales);
    return st;
}

qd_status qd_w8a8_matmul_f32(const float *x, int64_t M, int64_t K, int act_value_kind,
                             int64_t act_block_k, const qd_packed_weights *w, float *out)
{
    int lo, hi;
    if (!x || !w || !out)
        return QD_ERR_NULL;
    qd_status st = check_weights(w, M, K);
    if (st != QD_OK)
        return st;
    if (qd_value_range(act_value_kind, &lo, &hi) != QD_OK)
        return QD_ERR_SCHEME;
    if (act_block_k <= 0 || K % act_block_k)
        return QD_ERR_SHAPE;
    for (int64_t i = 0; i < M * K; i++)
        if (!isfinite(x[i]))
            return QD_ERR_NOT_FINITE;
    const int64_t kp = w->k_padded, a_groups = K / act_block_k;
    int8_t *ap = qd_aligned_alloc((size_t)(M * kp));
    float *scales = malloc((size_t)(M * a_groups) * sizeof(float));
    if (!ap || !scales) {
        qd_aligned_free(ap);
        free(scales);
        return QD_ERR_NO_MEMORY;
    }
    int overflow = 0;
#pragma omp parallel for schedule(static) num_threads(qd_threads_for(M * K / 65536 + 1)) reduction(|: overflow)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < a_groups; g++) {
            const float *seg = x + m * K + g * act_block_k;
            const float s = qd_segment_scale(seg, act_block_k, lo, hi);
            overflow |= !isfinite(s);
            scales[m * a_groups + g] = s;
            qd_quantize_segment(seg, act_block_k, lo, hi, s, ap + m * kp + g * act_block_k);
        }
        memset(ap + m * kp + K, 0, (size_t)(kp - K));
    }
    st = overflow ? QD_ERR_SCALE_OVERFLOW : run_qq(ap, M, K, scales, act_block_k, w, out, NULL);
    qd_aligned_free(ap);
    free(scales);
    return st;
}

qd_status qd_fq_matmul_f32(const float *x, int64_t M, int64_t K, const qd_packed_weights *w,
                           float *out)
{
    if (!x || !w || !out)
        return QD_ERR_NULL;
    qd_status st = check_weights(w, M, K);
    if (st != QD_OK)
        return st;
    const int ku = QD_KU(w->bits);
    const int64_t kp = w->k_padded, group = w->block_k, ngroups = w->k_groups;
    const qd_kernels *kern = qd_kernels_for(qd_isa_active());
    if (ngroups > 1 && group % ku != 0)
        kern = &qd_kernels_scalar;
    float *xp = qd_aligned_alloc((size_t)(M * kp) * sizeof(float));
    if (!xp)
        return QD_ERR_NO_MEMORY;
    for (int64_t m = 0; m < M; m++) {
        memcpy(xp + m * kp, x + m * K, (size_t)K * sizeof(float));
        memset(xp + m * kp + K, 0, (size_t)(kp - K) * sizeof(float));
    }
    /* Equal row blocks, each as large as fits: unequal ones would leave a thread idle. */
    const int64_t fit = FQ_ROW_BYTES / (kp * (int64_t)sizeof(float));
    const int64_t n_blocks = (M + fit - 1) / (fit > 0 ? fit : 1);
    const task_grid grid = make_grid(M, w->n_panels, (M + n_blocks - 1) / n_blocks);
    const int64_t ntasks = grid.n_panels * grid.n_row_blocks;
    const int64_t N = w->n;
    /* Row block outermost: a thread's row block of x stays in L2 while its panels pass. */
#pragma omp parallel for schedule(static) num_threads(qd_threads_for(ntasks))
    for (int64_t task = 0; task < ntasks; task++) {
        const int64_t p = task % grid.n_panels, rb = task / grid.n_panels;
        const int64_t m_end = (rb + 1) * grid.row_block < M ? (rb + 1) * grid.row_block : M;
        qd_fq_tile t = {
            .ldx = kp,
            .panel = w->panels + p * w->panel_bytes,
            .w_scale = w->panel_scales + p * w->k_groups * QD_NR,
            .bits = w->bits,
            .nr = (int)(N - p * QD_NR < QD_NR ? N - p * QD_NR : QD_NR),
            .k = K,
            .group_k = group,
            .ngroups = ngroups,
            .group_units = ngroups == 1 ? kp / ku : group / ku,
            .ldo = N,
        };
        for (int64_t m = rb * grid.row_block; m < m_end; m += kern->fq_mr) {
            t.mr = (int)(m_end - m < kern->fq_mr ? m_end - m : kern->fq_mr);
            t.x = xp + m * kp;
            t.out = out + m * N + p * QD_NR;
            kern->fq_tile(&t);
        }
    }
    qd_aligned_free(xp);
    return QD_OK;
}
