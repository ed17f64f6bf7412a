/* An ISA's kernels against exact references, on shapes at their edges: rows around
 * the qq tiles (NEON's 4; AMX's 16-row tiles, 32 a call, and VNNI's 8 below them),
 * columns around a 16-column panel, K around each width's unit (4, 8 or 16 k) and
 * AMX's 64-value steps, and scale blocks of one or several units, on one thread and
 * on three.  Integer products must equal int64 sums; qq and W8A8 must equal the
 * scalar ISA's bit for bit; fq must lie within a float64 bound and sum each scale
 * block before scaling it.  Built and run by test_build_support.py: cross-compiled
 * for aarch64 and run under qemu-aarch64 (NEON), or with the tile instructions in
 * software (AMX, tests/amx_emulator.h).
 *   isa_check ISA supported     the CPU runs ISA: it is chosen and checked
 *   isa_check ISA unsupported   it does not: ISA is built but not supported */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qdispatch.h"

static long checks, failures;

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        checks++;                                                                                  \
        if (!(cond) && failures++ < 20) {                                                          \
            printf("FAIL line %d, threads %d: ", __LINE__, qd_get_num_threads());                  \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

static qd_isa checked;   /* the ISA under test */
static uint64_t state = 0x243F6A8885A308D3ull;

static int64_t uniform(int64_t lo, int64_t hi)
{
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return lo + (int64_t)(state % (uint64_t)(hi - lo + 1));
}

/* Random values in [lo, hi], or (extreme) every one lo: the largest products. */
static void fill_s8(int8_t *v, int64_t n, int lo, int hi, int extreme)
{
    for (int64_t i = 0; i < n; i++)
        v[i] = (int8_t)(extreme ? lo : uniform(lo, hi));
}

static void fill_f32(float *v, int64_t n, float lo, float hi)
{
    for (int64_t i = 0; i < n; i++)
        v[i] = lo + (hi - lo) * (float)uniform(0, 1 << 20) / (float)(1 << 20);
}

static int same_bits(const float *a, const float *b, int64_t n)
{
    return memcmp(a, b, (size_t)n * sizeof(float)) == 0;
}

static void set_isa(qd_isa isa)
{
    if (qd_isa_set(isa) != QD_OK) {
        printf("FAIL: qd_isa_set(%s)\n", qd_isa_name(isa));
        exit(1);
    }
}

static void check_int_matmul_s8(int64_t M, int64_t K, int64_t N, int extreme)
{
    int8_t *a = malloc(M * K), *b = malloc(K * N);
    int32_t *c = malloc(M * N * sizeof(int32_t));
    fill_s8(a, M * K, -128, 127, extreme);
    fill_s8(b, K * N, -128, 127, extreme);
    CHECK(qd_int_matmul_s8(a, M, K, b, N, c) == QD_OK, "int_matmul_s8 status");
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            int64_t want = 0;
            for (int64_t k = 0; k < K; k++)
                want += (int64_t)a[m * K + k] * b[k * N + n];
            CHECK(c[m * N + n] == want, "int_matmul_s8 M=%lld K=%lld N=%lld: c[%lld,%lld] = %d, want %lld",
                  (long long)M, (long long)K, (long long)N, (long long)m, (long long)n, c[m * N + n],
                  (long long)want);
        }
    free(a), free(b), free(c);
}

/* Every product of packed weights [N, K] of `bits` with block_k wbk, M rows of A. */
static void check_packed(int64_t M, int64_t K, int64_t N, int bits, int64_t wbk, int extreme)
{
    const int lo = -(1 << (bits - 1)), hi = (1 << (bits - 1)) - 1;
    const int64_t wgroups = N * (K / wbk);
    int8_t *w = malloc(N * K), *a = malloc(M * K);
    float *ws = malloc(wgroups * sizeof(float)), *x = malloc(M * K * sizeof(float));
    fill_s8(w, N * K, lo, hi, extreme);
    fill_s8(a, M * K, -128, 127, extreme);
    fill_f32(ws, wgroups, 0.01f, 2.0f);
    fill_f32(x, M * K, -4.0f, 4.0f);
    qd_packed_weights *pw = NULL;
    CHECK(qd_pack_weights(w, N, K, bits, ws, 1, wbk, &pw) == QD_OK, "pack_weights status");
    int32_t *c = malloc(M * N * sizeof(int32_t));
    float *out = malloc(M * N * sizeof(float)), *ref = malloc(M * N * sizeof(float));
#define SHAPE "M=%lld K=%lld N=%lld bits=%d block_k=%lld"
#define SHAPE_ARGS (long long)M, (long long)K, (long long)N, bits, (long long)wbk

    CHECK(qd_int_matmul_packed(a, M, K, pw, c) == QD_OK, "int_matmul_packed status");
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            int64_t want = 0;
            for (int64_t k = 0; k < K; k++)
                want += (int64_t)a[m * K + k] * w[n * K + k];
            CHECK(c[m * N + n] == want, "int_matmul_packed " SHAPE ": [%lld,%lld] = %d, want %lld", SHAPE_ARGS,
                  (long long)m, (long long)n, c[m * N + n], (long long)want);
        }

    /* qq with A's blocks along K of wbk, of all K, and of a unit of 8 bits (groups of
     * gcd(a, w) k that are not whole units of 4- and 2-bit weights go to the scalar kernel) */
    const int64_t a_blocks[] = {wbk, K, K % 4 == 0 ? 4 : K};
    for (int i = 0; i < 3; i++) {
        const int64_t abk = a_blocks[i];
        float *as = malloc(M * (K / abk) * sizeof(float));
        fill_f32(as, M * (K / abk), 0.001f, 1.0f);
        set_isa(QD_ISA_SCALAR);
        qd_qq_matmul(a, M, K, as, 1, abk, pw, ref);
        set_isa(checked);
        CHECK(qd_qq_matmul(a, M, K, as, 1, abk, pw, out) == QD_OK, "qq status");
        CHECK(same_bits(out, ref, M * N), "qq " SHAPE " a_block_k=%lld: not the scalar ISA's bits", SHAPE_ARGS,
              (long long)abk);
        free(as);
    }

    for (int kind = QD_Q8S; kind <= QD_Q4F; kind += 3) {   /* q8s and q4f activations */
        set_isa(QD_ISA_SCALAR);
        qd_w8a8_matmul_f32(x, M, K, kind, wbk, pw, ref);
        set_isa(checked);
        CHECK(qd_w8a8_matmul_f32(x, M, K, kind, wbk, pw, out) == QD_OK, "w8a8 status");
        CHECK(same_bits(out, ref, M * N), "w8a8 " SHAPE " kind %d: not the scalar ISA's bits", SHAPE_ARGS, kind);
    }

    CHECK(qd_fq_matmul_f32(x, M, K, pw, out) == QD_OK, "fq status");
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            double want = 0, magnitude = 0;
            for (int64_t k = 0; k < K; k++) {
                const double t = (double)x[m * K + k] * w[n * K + k] * ws[n * (K / wbk) + k / wbk];
                want += t;
                magnitude += fabs(t);
            }
            const double got = out[m * N + n];
            CHECK(fabs(got - want) <= (K + 16) * 1.2e-7 * magnitude + 1e-30,
                  "fq " SHAPE ": [%lld,%lld] = %.9g, want %.9g", SHAPE_ARGS, (long long)m, (long long)n, got, want);
        }
    free(c), free(out), free(ref);
    qd_packed_weights_free(pw);
    free(w), free(a), free(ws), free(x);
}

/* fq sums x * q over each scale block and then scales it: two blocks of 32 whose
 * sums, 2^131 at 8 bits, lie past float32's range give inf, however small their
 * scales; scaling each weight first would give a finite 2^92. */
static void check_fq_sums_before_scaling(int bits)
{
    enum { N = 17, K = 64 };
    static int8_t w[N * K];
    static float ws[N * 2], x[K], out[N];
    const int big = bits == 8 ? 64 : bits == 4 ? 4 : 1;
    memset(w, big, sizeof w);
    for (int i = 0; i < N * 2; i++)
        ws[i] = 0x1p-40f;
    for (int k = 0; k < K; k++)
        x[k] = bits == 8 ? 0x1p120f : 0x1p125f;
    qd_packed_weights *pw = NULL;
    CHECK(qd_pack_weights(w, N, K, bits, ws, 1, 32, &pw) == QD_OK, "pack_weights status");
    CHECK(qd_fq_matmul_f32(x, 1, K, pw, out) == QD_OK, "fq status");
    for (int n = 0; n < N; n++)
        CHECK(isinf(out[n]) && out[n] > 0, "fq of %d bits, sums past float32's range: out[%d] = %a, want inf",
              bits, n, out[n]);
    qd_packed_weights_free(pw);
}

static void check_all(void)
{
    static const int64_t rows[] = {1, 4, 6, 7, 9};   /* tiles of 1, 4, 4 + 2, 4 + 3, 4 + 4 + 1 rows */
    static const int64_t cols[] = {1, 15, 16, 17, 33};
    static const int64_t depths[] = {1, 3, 4, 7, 8, 16, 17, 32, 48, 64, 100};
    for (int mi = 0; mi < 5; mi++)
        for (int ni = 0; ni < 5; ni++)
            for (int ki = 0; ki < 11; ki++)
                check_int_matmul_s8(rows[mi], depths[ki], cols[ni], (mi + ni + ki) % 7 == 0);
    check_int_matmul_s8(2, QD_INT_MATMUL_MAX_K, 17, 1);   /* the largest int32 sum, -128 * -128 * K */
    check_int_matmul_s8(70, 40, 70, 0);                   /* past a task's 64 rows and 4 panels */
    for (int bits = 8; bits >= 2; bits /= 2) {
        for (int mi = 0; mi < 5; mi++)
            for (int ni = 0; ni < 5; ni++)
                for (int ki = 0; ki < 11; ki++) {
                    const int64_t K = depths[ki];
                    check_packed(rows[mi], K, cols[ni], bits, K, ki % 5 == 0);
                    for (int64_t wbk = 4; wbk < K; wbk *= 2)    /* several blocks along K */
                        if (K % wbk == 0)
                            check_packed(rows[mi], K, cols[ni], bits, wbk, 0);
                }
        check_packed(70, 64, 40, bits, 32, 0);
        check_fq_sums_before_scaling(bits);
    }
    /* many rows, K in and past 64-value steps, blocks of whole steps and not */
    static const int64_t many_rows[] = {16, 17, 32, 40, 70};
    static const int64_t long_depths[] = {64, 200, 256};
    for (int mi = 0; mi < 5; mi++)
        for (int ki = 0; ki < 3; ki++) {
            const int64_t M = many_rows[mi], K = long_depths[ki];
            check_int_matmul_s8(M, K, 33, (mi + ki) % 4 == 0);
            for (int bits = 8; bits >= 2; bits /= 2) {
                check_packed(M, K, 33, bits, K, (mi + ki) % 4 == 0);
                check_packed(M, K, 33, bits, K % 64 == 0 ? 64 : 8, 0);
                if (K % 128 == 0)
                    check_packed(M, K, 33, bits, 128, 0);
            }
        }
}

int main(int argc, char **argv)
{
    if (argc != 3 || (strcmp(argv[2], "supported") != 0 && strcmp(argv[2], "unsupported") != 0)) {
        printf("usage: isa_check ISA supported|unsupported\n");
        return 2;
    }
    if (qd_isa_from_name(argv[1], &checked) != QD_OK) {
        printf("FAIL: no ISA named %s\n", argv[1]);
        return 1;
    }
    if (!qd_isa_built(checked)) {
        printf("FAIL: the %s kernels are not built into this library\n", argv[1]);
        return 1;
    }
    if (strcmp(argv[2], "unsupported") == 0) {   /* other kernels run, and this ISA cannot be forced */
        CHECK(!qd_isa_supported(checked) && qd_isa_active() != checked, "%s chosen on a CPU without it", argv[1]);
        CHECK(qd_isa_set(checked) == QD_ERR_ISA_NOT_SUPPORTED, "qd_isa_set(%s) on a CPU without it", argv[1]);
        check_int_matmul_s8(5, 33, 17, 0);
    } else {
        CHECK(qd_isa_supported(checked) && qd_isa_active() == checked, "%s not chosen on a CPU with it", argv[1]);
        for (int threads = 1; threads <= 3; threads += 2) {
            qd_set_num_threads(threads);
            set_isa(checked);
            check_all();
        }
    }
    printf("%ld checks, %ld failures\n", checks, failures);
    return failures != 0;
}
