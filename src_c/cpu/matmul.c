/* Matmul drivers: argument checks, operand preparation (zero-padded A, group
 * sums, scale grids), the group length, the ISA's kernels and the parallel
 * loop over (column panel, row block) tasks.  Each output element is computed
 * by one microkernel call with a fixed operation order, so results do not
 * depend on the thread count or on the other rows of the batch. */
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include "qd_internal.h"

#define ROW_BLOCK 64   /* rows of A that one task runs against a panel held in L2 */
#define TASK_PANELS 8  /* panels a qq task runs its row block against, at most */
/* int_matmul's packing buffer per task, at most (see int_task_panels). */
#define INT_TASK_BYTES (4 << 20)
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

/* What every tile of one qq / integer call shares. */
typedef struct {
    const qd_kernels *kern;
    const qd_packed_weights *w;     /* shape and scales; the panels may lie elsewhere */
    const int8_t *a;                /* padded [M, kp] */
    const float *a_scales;          /* [M, a_groups] per row; NULL in integer mode */
    int32_t *rowsums;
    int64_t M, K, a_block_k, group, ngroups;
    int np;                         /* panels per tile */
    float *out;
    int32_t *out_i32;
} qq_plan;

static qd_status plan_qq(qq_plan *pl, const int8_t *a, int64_t M, int64_t K, const float *a_scales,
                         int64_t a_block_k, const qd_packed_weights *w, float *out, int32_t *out_i32)
{
    const int ku = QD_KU(w->bits);
    const int64_t group = out_i32 ? K : exact_group(gcd64(a_block_k, w->block_k), ku);
    const int64_t ngroups = K / group;
    const qd_kernels *kern = qd_kernels_for(qd_isa_active());
    if (qd_fq_short_groups(ngroups, group, w->bits))  /* vector kernels sum whole units a group */
        kern = kern->qq_short_groups && qd_qq_short_groups(ngroups, group, w->bits) ? kern->qq_short_groups
                                                                                   : &qd_kernels_scalar;
    *pl = (qq_plan){
        .kern = kern, .w = w, .a = a, .a_scales = a_scales, .M = M, .K = K,
        .a_block_k = a_block_k, .group = group, .ngroups = ngroups,
        .np = kern->qq_np > 0 ? kern->qq_np : 1, .out = out, .out_i32 = out_i32,
    };
    if (kern->needs_rowsum && !(pl->rowsums = group_rowsums(a, M, w->k_padded, K, group)))
        return QD_ERR_NO_MEMORY;
    return QD_OK;
}

/* Rows m0 .. m1 - 1 against the tile's panels from panel p on, read from `panels`. */
static void run_tiles(const qq_plan *pl, const uint8_t *panels, int64_t p, int64_t m0, int64_t m1)
{
    const qd_packed_weights *w = pl->w;
    const int64_t K = pl->K, N = w->n, n0 = p * QD_NR, ngroups = pl->ngroups;
    qd_qq_tile t = {
        .lda = w->k_padded,
        .rowsum_ld = ngroups,
        .a_scale_ld = K / pl->a_block_k,
        .a_ratio = pl->a_block_k / pl->group,
        .panel = panels,
        .panel_ld = w->panel_bytes,
        .np = (int)(w->n_panels - p < pl->np ? w->n_panels - p : pl->np),
        .w_scale = pl->a_scales ? w->panel_scales + p * w->k_groups * QD_NR : NULL,
        .w_scale_ld = w->k_groups * QD_NR,
        .w_ratio = w->block_k / pl->group,
        .bits = w->bits,
        .nr = (int)(N - n0 < pl->np * QD_NR ? N - n0 : pl->np * QD_NR),
        .k = K,
        .group_k = pl->group,
        .ngroups = ngroups,
        .group_units = ngroups == 1 ? w->k_padded / QD_KU(w->bits) : pl->group / QD_KU(w->bits),
        .ldo = N,
        /* row 0 of the whole call, for qd_qq_tile_rows */
        .a = pl->a,
        .a_rowsum = pl->rowsums,
        .a_scale = pl->a_scales,
        .out = pl->out ? pl->out + n0 : NULL,
        .out_i32 = pl->out_i32 ? pl->out_i32 + n0 : NULL,
    };
    const int mr = pl->kern->qq_mr;
    for (int64_t m = m0; m < m1; m += mr) {
        const qd_qq_tile rows = qd_qq_tile_rows(&t, m, (int)(m1 - m < mr ? m1 - m : mr));
        pl->kern->qq_tile(&rows);
    }
}

/* Groups of np panels a qq task takes.  With several row blocks, up to TASK_PANELS
 * panels, so that a row block read into L2 serves several groups: at many rows it
 * is A, not the weights, that streams from memory, once per task's panels (AMX, 2048
 * x 4096 x 4096 on one thread: 1303-1376 GOP/s against 1026-1061 with one group).
 * Fewer where a thread would get fewer than 4 tasks, to keep the threads' shares
 * even; one group when one row block holds all rows, which stays in L2 anyway. */
static int64_t groups_per_task(int64_t groups, int64_t row_blocks, int np)
{
    if (row_blocks == 1)
        return 1;
    const int64_t threads = qd_get_num_threads();
    int64_t per_task = TASK_PANELS / np > 1 ? TASK_PANELS / np : 1;
    while (per_task > 1 && (groups + per_task - 1) / per_task * row_blocks < 4 * threads)
        per_task--;
    return per_task;
}

/* The qq / integer core over packed weights (integer mode: a_scales NULL, out_i32 written). */
static qd_status run_qq(const int8_t *a, int64_t M, int64_t K, const float *a_scales,
                        int64_t a_block_k, const qd_packed_weights *w, float *out, int32_t *out_i32)
{
    qq_plan pl;
    qd_status st = plan_qq(&pl, a, M, K, a_scales, a_block_k, w, out, out_i32);
    if (st != QD_OK)
        return st;
    /* Tasks are (run of panels, row block) pairs, row blocks inner: a thread keeps
     * its panels in L2 while the row blocks pass, and each row block meets all the
     * task's panels while it is in L2. */
    const int64_t groups = (w->n_panels + pl.np - 1) / pl.np;
    const int64_t per_task = groups_per_task(groups, (M + ROW_BLOCK - 1) / ROW_BLOCK, pl.np);
    const task_grid grid = make_grid(M, (groups + per_task - 1) / per_task, ROW_BLOCK);
    const int64_t ntasks = grid.n_panels * grid.n_row_blocks;
    QD_PARALLEL_FOR(qd_threads_for_product(ntasks, M, K, w->n), ntasks, ,
    for (int64_t task = 0; task < ntasks; task++) {
        const int64_t p0 = task / grid.n_row_blocks * per_task * pl.np, rb = task % grid.n_row_blocks;
        const int64_t m_end = (rb + 1) * grid.row_block < M ? (rb + 1) * grid.row_block : M;
        for (int64_t p = p0; p < w->n_panels && p < p0 + per_task * pl.np; p += pl.np)
            run_tiles(&pl, w->panels + p * w->panel_bytes, p, rb * grid.row_block, m_end);
    });
    free(pl.rowsums);
    return QD_OK;
}

static qd_status check_weights(const qd_packed_weights *w, int64_t M, int64_t K)
{
    const qd_status st = qd_packed_check(w);
    if (st != QD_OK)
        return st;
    if (M <= 0 || K <= 0 || K != w->k)
        return QD_ERR_SHAPE;
    /* float-sized: x, a's scales and the outputs are float32 or int32 */
    if (!qd_dims_fit(M, K, sizeof(float)) || !qd_dims_fit(M, w->n, sizeof(float)))
        return QD_ERR_ARGUMENT;
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
    if (qd_overlap(c, (size_t)(M * w->n) * sizeof(int32_t), a, (size_t)(M * K)))
        return QD_ERR_ARGUMENT;
    int8_t *ap = padded_rows_s8(a, M, K, w->k_padded);
    if (!ap)
        return QD_ERR_NO_MEMORY;
    st = run_qq(ap, M, K, NULL, K, w, NULL, c);
    qd_aligned_free(ap);
    return st;
}

/* Panels int_matmul packs per task, a multiple of np.  Packing walks b's rows down
 * a strip of 16 bytes a panel: a strip of one cache line (4 panels) met a new page
 * at every row, where the TLB and the prefetcher gave up, and packing set the pace
 * (7.6 against 17 GOP/s at 1 x 4096 x 4096 for 64 panels, 300 against 340 at 128
 * rows).  So strips are as wide as a buffer of INT_TASK_BYTES allows, and no wider
 * than leaves every thread a task.  run_tiles still takes np panels at a time, so
 * the panels the rows pass over stay in L2. */
static int64_t int_task_panels(const qd_packed_weights *w, int64_t np)
{
    int64_t panels = INT_TASK_BYTES / w->panel_bytes;
    const int64_t per_thread = w->n_panels / qd_get_num_threads();
    if (panels > per_thread)
        panels = per_thread;
    panels = panels / np * np;
    return panels > np ? panels : np;
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
    if (!qd_dims_fit(M, K, 1) || !qd_dims_fit(K, N, 1) || !qd_dims_fit(M, N, sizeof(int32_t)))
        return QD_ERR_ARGUMENT;
    const size_t c_bytes = (size_t)(M * N) * sizeof(int32_t);
    if (qd_overlap(c, c_bytes, a, (size_t)(M * K)) || qd_overlap(c, c_bytes, b, (size_t)(K * N)))
        return QD_ERR_ARGUMENT;
    /* b comes unpacked: each thread packs a strip of panels at a time into a
     * buffer and runs all rows against it, so b is read once and no packed copy
     * of all of it is ever written to memory. */
    qd_packed_weights w;
    qd_packed_layout(&w, N, K, 8, 1, K);
    w.panels = NULL;
    w.panel_scales = NULL;
    int8_t *ap = padded_rows_s8(a, M, K, w.k_padded);
    if (!ap)
        return QD_ERR_NO_MEMORY;
    qq_plan pl;
    qd_status st = plan_qq(&pl, ap, M, K, NULL, K, &w, NULL, c);
    const int64_t task_panels = int_task_panels(&w, pl.np);
    const int64_t ntasks = (w.n_panels + task_panels - 1) / task_panels;
    int no_memory = 0;
    if (st == QD_OK) {
        /* a team as QD_PARALLEL_FOR's, for the same reason; a worker allocates its
         * buffer at its first task, so the threads past `workers` allocate none */
        const int workers = qd_threads_for_product(ntasks, M, K, N);
        const int64_t run = qd_run_length(ntasks, workers);
#pragma omp parallel num_threads(workers > 1 ? qd_get_num_threads() : 1) reduction(|: no_memory)
        {
            uint8_t *buf = NULL;
#pragma omp for schedule(static, run)
            for (int64_t task = 0; task < ntasks; task++) {
                const int64_t p0 = task * task_panels;
                const int64_t np = w.n_panels - p0 < task_panels ? w.n_panels - p0 : task_panels;
                if (!buf && !no_memory) {
                    buf = qd_aligned_alloc((size_t)(task_panels * w.panel_bytes));
                    no_memory = !buf;
                }
                if (!buf)
                    continue;
                qd_pack_s8_kn_panels(b, K, N, p0, (int)np, w.panel_bytes, buf);
                for (int64_t p = p0; p < p0 + np; p += pl.np)
                    run_tiles(&pl, buf + (p - p0) * w.panel_bytes, p, 0, M);
            }
            qd_aligned_free(buf);
        }
        st = no_memory ? QD_ERR_NO_MEMORY : QD_OK;
    }
    free(pl.rowsums);
    qd_aligned_free(ap);
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
    const size_t out_bytes = (size_t)(M * w->n) * sizeof(float);
    if (qd_overlap(out, out_bytes, a, (size_t)(M * K)) ||
        qd_overlap(out, out_bytes, a_scales, (size_t)(M / a_block_m * (K / a_block_k)) * sizeof(float)))
        return QD_ERR_ARGUMENT;
    int8_t *ap = padded_rows_s8(a, M, K, w->k_padded);
    float *row_scales = scales_per_row(a_scales, M, a_block_m, K / a_block_k);
    st = ap && row_scales ? run_qq(ap, M, K, row_scales, a_block_k, w, out, NULL) : QD_ERR_NO_MEMORY;
    qd_aligned_free(ap);
    free(row_scales);
    return st;
}

static int row_finite(const float *x, int64_t n)
{
    int finite = 1;
    for (int64_t i = 0; i < n; i++)
        finite &= isfinite(x[i]) != 0;
    return finite;
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
    if (qd_overlap(out, (size_t)(M * w->n) * sizeof(float), x, (size_t)(M * K) * sizeof(float)))
        return QD_ERR_ARGUMENT;
    const int64_t kp = w->k_padded, a_groups = K / act_block_k;
    int8_t *ap = qd_aligned_alloc((size_t)(M * kp));
    float *scales = malloc((size_t)(M * a_groups) * sizeof(float));
    if (!ap || !scales) {
        qd_aligned_free(ap);
        free(scales);
        return QD_ERR_NO_MEMORY;
    }
    /* The finiteness check runs per row inside the parallel loop, while the row is
     * in cache; a row that fails is not quantized. */
    int overflow = 0, not_finite = 0;
    QD_PARALLEL_FOR(qd_threads_for(M * K / 65536 + 1), M, reduction(|: overflow, not_finite),
    for (int64_t m = 0; m < M; m++) {
        if (!row_finite(x + m * K, K)) {
            not_finite = 1;
            continue;
        }
        for (int64_t g = 0; g < a_groups; g++) {
            const float *seg = x + m * K + g * act_block_k;
            const float s = qd_segment_scale(seg, act_block_k, lo, hi);
            overflow |= !isfinite(s);
            scales[m * a_groups + g] = s;
            qd_quantize_segment(seg, act_block_k, lo, hi, s, ap + m * kp + g * act_block_k);
        }
        memset(ap + m * kp + K, 0, (size_t)(kp - K));
    });
    st = not_finite ? QD_ERR_NOT_FINITE : overflow ? QD_ERR_SCALE_OVERFLOW : run_qq(ap, M, K, scales, act_block_k, w, out, NULL);
    qd_aligned_free(ap);
    free(scales);
    return st;
}

/* The most 2^e that qd_fq_fold_scales divides the scales by: x * s * 2^-e keeps
 * float32's precision wherever |x * s| >= 2^(e - 126), so terms above 2^-110 (as the
 * cuda kernels' float32 x holds them) keep it whatever the scales.  A larger e put
 * the small scales of a weight whose scales span 2^93 to 2^-72 at 0. */
#define FOLD_MOST_E 16

int qd_fq_fold_scales(const float *scales, int64_t n, float *x_scales, float *power)
{
    float most = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float s = fabsf(scales[i]);
        if (!(s <= FLT_MAX))
            return 0;
        most = s > most ? s : most;
    }
    int e = 0;
    frexpf(most, &e);  /* most < 2^e */
    e = e > 0 ? e : 0;
    if (e > FOLD_MOST_E)
        return 0;
    const float down = ldexpf(1.0f, -e);  /* 2^-e (e <= 16): each product has the bits of ldexpf(s, -e) */
    for (int64_t i = 0; i < n; i++)
        x_scales[i] = scales[i] * down;
    *power = ldexpf(1.0f, e);
    return 1;
}

/* A weight with one row of scales for all of N whose groups along K are no whole
 * panel units (a scale per input channel, say) made the kernels scale every few
 * k-steps, or left it to the scalar ones: 4.1-4.3x the time of a weight scaled per
 * output channel at one row of 4096 x 4096 on a Zen 4 guest.  x takes its scales
 * instead (qd_fq_fold_scales) and the kernels take K as one group. */
static int x_may_take_scales(const qd_packed_weights *w)
{
    return w->block_n >= w->n && qd_fq_short_groups(w->k_groups, w->block_k, w->bits);
}

qd_status qd_fq_matmul_f32(const float *x, int64_t M, int64_t K, const qd_packed_weights *w,
                           float *out)
{
    if (!x || !w || !out)
        return QD_ERR_NULL;
    qd_status st = check_weights(w, M, K);
    if (st != QD_OK)
        return st;
    if (qd_overlap(out, (size_t)(M * w->n) * sizeof(float), x, (size_t)(M * K) * sizeof(float)))
        return QD_ERR_ARGUMENT;
    const int ku = QD_KU(w->bits);
    const int64_t kp = w->k_padded;
    float *x_scales = NULL, power = 1.0f;
    if (x_may_take_scales(w)) {
        if (!(x_scales = malloc((size_t)w->k_groups * sizeof(float))))
            return QD_ERR_NO_MEMORY;
        if (!qd_fq_fold_scales(w->scales, w->k_groups, x_scales, &power)) {
            free(x_scales);
            x_scales = NULL;
        }
    }
    const int scaled = x_scales != NULL;
    const int64_t group = scaled ? K : w->block_k, ngroups = scaled ? 1 : w->k_groups;
    _Alignas(64) float group_scale[QD_NR];  /* the one group's scale, 2^e, for every column (aligned loads) */
    for (int n = 0; n < QD_NR; n++)
        group_scale[n] = power;
    const qd_kernels *kern = qd_kernels_for(qd_isa_active());
    if (qd_fq_short_groups(ngroups, group, w->bits) && !kern->fq_short_groups)
        kern = &qd_kernels_scalar;
    /* Rows zero-padded to whole units, copied only where K needs the padding or x takes
     * the scales: a copy of many rows comes from fresh pages each call, a fault every
     * 4 KiB (an M = 4096 x 4096 call spent most of its time there). */
    float *xp = NULL;
    if (kp != K || scaled) {
        if (!(xp = qd_aligned_alloc((size_t)(M * kp) * sizeof(float)))) {
            free(x_scales);
            return QD_ERR_NO_MEMORY;
        }
        /* x scaled on the product's threads: on one, 16 x 4096 x 4096 took 0.2-0.6 ms
         * more on two Zen 4 threads than with weights scaled per output channel */
        QD_PARALLEL_FOR(scaled ? qd_threads_for(M) : 1, M, ,
        for (int64_t m = 0; m < M; m++) {
            float *row = xp + m * kp;
            if (scaled)
                for (int64_t g = 0, k = 0; g < w->k_groups; g++)
                    for (int64_t end = k + w->block_k; k < end; k++)
                        row[k] = x[m * K + k] * x_scales[g];
            else
                memcpy(row, x + m * K, (size_t)K * sizeof(float));
            memset(row + K, 0, (size_t)(kp - K) * sizeof(float));
        });
    }
    free(x_scales);
    const float *xs = xp ? xp : x;
    /* Equal row blocks, each as large as fits (a row longer than FQ_ROW_BYTES goes
     * alone): unequal ones would leave a thread idle. */
    const int64_t fits = FQ_ROW_BYTES / (kp * (int64_t)sizeof(float));
    const int64_t fit = fits > 0 ? fits : 1;
    const int64_t n_blocks = (M + fit - 1) / fit;
    const task_grid grid = make_grid(M, w->n_panels, (M + n_blocks - 1) / n_blocks);
    const int64_t ntasks = grid.n_panels * grid.n_row_blocks;
    const int64_t N = w->n;
    /* Row block outermost: a thread's row block of x stays in L2 while its panels pass. */
    QD_PARALLEL_FOR(qd_threads_for_product(ntasks, M, K, N), ntasks, ,
    for (int64_t task = 0; task < ntasks; task++) {
        const int64_t p = task % grid.n_panels, rb = task / grid.n_panels;
        const int64_t m_end = (rb + 1) * grid.row_block < M ? (rb + 1) * grid.row_block : M;
        qd_fq_tile t = {
            .ldx = kp,
            .panel = w->panels + p * w->panel_bytes,
            .w_scale = scaled ? group_scale : w->panel_scales + p * w->k_groups * QD_NR,
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
            t.x = xs + m * kp;
            t.out = out + m * N + p * QD_NR;
            kern->fq_tile(&t);
        }
    });
    qd_aligned_free(xp);
    return QD_OK;
}
