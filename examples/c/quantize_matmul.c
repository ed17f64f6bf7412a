/* quantize_matmul.c: qdispatch's kernels from plain C99, no Python.
 *
 * Quantizes activations and weights, packs the weights once, multiplies them
 * (quantized x quantized, float out), multiplies raw int8 matrices and looks
 * rows of the weights up as an embedding table, then checks them against plain C
 * loops.  Also shows that bad input comes back as
 * a status, not a crash.  Exits non-zero on any mismatch.
 *
 * Build (the flags come from the installed package):
 *   cc examples/c/quantize_matmul.c $(qdispatch config --cflags --libs) -lm -o quantize_matmul
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <qdispatch.h>

/* Tile-unfriendly sizes: M, N odd, K three blocks of 32. */
enum { M = 5, K = 96, N = 7, BLOCK_K = 32 };

/* The float result may differ from the float64 reference of the same quantized
 * values by float32 rounding only: the int32 dot of each K-block is exact, its
 * scaling and the sum over the K / BLOCK_K blocks round in float32. */
static const double FLOAT_RTOL = 1e-5;

static int failures = 0;

#define CHECK_OK(call)                                                              \
    do {                                                                            \
        qd_status st_ = (call);                                                     \
        if (st_ != QD_OK) {                                                         \
            fprintf(stderr, "%s failed: %s\n", #call, qd_status_string(st_));       \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* Deterministic data in [-1, 1) without depending on the C library's rand(). */
static float next_uniform(uint32_t *state)
{
    *state = *state * 1664525u + 1013904223u;
    return (float)(*state >> 8) / (float)(1u << 23) - 1.0f;
}

static void fill(float *x, int64_t n, uint32_t seed)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = next_uniform(&seed);
}

/* Bad input must return the expected status and a readable message. */
static void expect_status(const char *what, qd_status got, qd_status want)
{
    printf("  %-40s -> %s\n", what, qd_status_string(got));
    if (got != want) {
        fprintf(stderr, "%s: expected status %d, got %d\n", what, (int)want, (int)got);
        failures++;
    }
}

static void check_int_matmul(const int8_t *a, const int8_t *w)
{
    static int8_t aa[M * K], b[K * N];
    static int32_t c[M * N];
    /* a as is, b = w^T; then the all -128 row and column that saturate int16 tricks. */
    for (int i = 0; i < M * K; i++)
        aa[i] = a[i];
    for (int k = 0; k < K; k++) {
        aa[k] = -128;
        for (int n = 0; n < N; n++)
            b[k * N + n] = n == 0 ? -128 : w[n * K + k];
    }
    CHECK_OK(qd_int_matmul_s8(aa, M, K, b, N, c));

    int mismatches = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t want = 0;
            for (int k = 0; k < K; k++)
                want += (int32_t)aa[m * K + k] * (int32_t)b[k * N + n];
            mismatches += c[m * N + n] != want;
        }
    printf("qd_int_matmul_s8 [%d x %d] @ [%d x %d]: %d mismatches (exact check), c[0][0] = %d\n",
           M, K, K, N, mismatches, (int)c[0]);
    failures += mismatches != 0;
}

static void check_qq_matmul(const int8_t *a, const float *a_scales, const int8_t *w,
                            const float *w_scales, const qd_packed_weights *pw)
{
    static float out[M * N];
    CHECK_OK(qd_qq_matmul(a, M, K, a_scales, 1, BLOCK_K, pw, out));

    double worst = 0.0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double want = 0.0, magnitude = 0.0;
            for (int k = 0; k < K; k++) {
                int g = k / BLOCK_K;
                double term = (double)a[m * K + k] * a_scales[m * (K / BLOCK_K) + g] *
                              (double)w[n * K + k] * w_scales[n * (K / BLOCK_K) + g];
                want += term;
                magnitude += fabs(term);
            }
            double err = fabs(out[m * N + n] - want) / (magnitude > 0 ? magnitude : 1.0);
            worst = err > worst ? err : worst;
        }
    printf("qd_qq_matmul: worst error %.2e of sum |terms| (tolerance %.0e)\n", worst, FLOAT_RTOL);
    failures += !(worst <= FLOAT_RTOL);
}

/* The weights as an embedding table [N, K]: rows ids, dequantized (value times its
 * block's scale, one float32 multiply: exact against the same multiply here). */
static void check_lookup(const int8_t *w, const float *w_scales)
{
    static const int64_t ids[3] = {N - 1, 0, N - 1};
    static float rows[3 * K];
    CHECK_OK(qd_dequantize_rows(w, 0, N, K, w_scales, 1, BLOCK_K, ids, 3, rows, QD_FLOAT32));

    int mismatches = 0;
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < K; k++)
            mismatches += rows[i * K + k] != (float)w[ids[i] * K + k] * w_scales[ids[i] * (K / BLOCK_K) + k / BLOCK_K];
    printf("qd_dequantize_rows, rows {%d, 0, %d} of [%d x %d]: %d mismatches (exact check)\n",
           N - 1, N - 1, N, K, mismatches);
    failures += mismatches != 0;
}

static void check_bad_input(const int8_t *a, const int8_t *w)
{
    static float x[4] = {1.0f, 2.0f, 0.0f, 4.0f}, s[1];
    static int8_t q[4];
    static int32_t c[M * N];
    int64_t bad_index = -1;
    qd_packed_weights *pw = NULL;

    printf("bad input returns a status:\n");
    x[2] = NAN;
    expect_status("qd_quantize_f32 with a NaN", qd_quantize_f32(x, 1, 4, QD_Q8S, 1, 4, QD_SCALE_F32,
                                                                  s, q, &bad_index), QD_ERR_NOT_FINITE);
    if (bad_index != 2) {
        fprintf(stderr, "bad_index should name the NaN at 2, got %lld\n", (long long)bad_index);
        failures++;
    }
    expect_status("qd_int_matmul_s8 with c = NULL", qd_int_matmul_s8(a, M, K, w, N, NULL), QD_ERR_NULL);
    expect_status("qd_int_matmul_s8 with M = 0", qd_int_matmul_s8(a, 0, K, w, N, c), QD_ERR_SHAPE);
    static const int64_t outside[1] = {N};
    static float row[K];
    expect_status("qd_dequantize_rows, an id past the rows",
                  qd_dequantize_rows(w, 0, N, K, s, N, K, outside, 1, row, QD_FLOAT32), QD_ERR_ARGUMENT);
    expect_status("qd_pack_weights, block_k not dividing K",
                  qd_pack_weights(w, N, K, 8, NULL, 1, 5, &pw), QD_ERR_SHAPE);
    qd_packed_weights_free(pw);
}

int main(void)
{
    static float x[M * K], wf[N * K], a_scales[M * (K / BLOCK_K)], w_scales[N * (K / BLOCK_K)];
    static int8_t a[M * K], w[N * K];
    qd_packed_weights *pw = NULL;

    if (qd_abi_version() != QD_ABI_VERSION) { /* a different library than the header */
        fprintf(stderr, "libqdispatch has ABI %d, qdispatch.h has %d: rebuild against the "
                "installed package\n", qd_abi_version(), QD_ABI_VERSION);
        return 1;
    }
    printf("qdispatch %s kernels: isa %s, %d threads\n", qd_version(),
           qd_isa_name(qd_isa_active()), qd_get_num_threads());
    fill(x, M * K, 1);
    fill(wf, N * K, 2);
    /* Activations full-range int8 (q8f reaches -128), weights symmetric, one scale
     * per 32 values along K (block [1, 32]). */
    CHECK_OK(qd_quantize_f32(x, M, K, QD_Q8F, 1, BLOCK_K, QD_SCALE_F32, a_scales, a, NULL));
    CHECK_OK(qd_quantize_f32(wf, N, K, QD_Q8S, 1, BLOCK_K, QD_SCALE_F32, w_scales, w, NULL));
    /* Weights are packed into the kernels' panel layout once, then reused. */
    CHECK_OK(qd_pack_weights(w, N, K, 8, w_scales, 1, BLOCK_K, &pw));
    printf("packed weights [%d x %d]: %zu bytes\n", N, K, qd_packed_weights_nbytes(pw));

    check_qq_matmul(a, a_scales, w, w_scales, pw);
    check_int_matmul(a, w);
    check_lookup(w, w_scales);
    check_bad_input(a, w);
    qd_packed_weights_free(pw);

    if (failures) {
        printf("FAILED: %d check(s)\n", failures);
        return 1;
    }
    printf("all checks passed\n");
    return 0;
}
