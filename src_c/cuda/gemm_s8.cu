// int8 x int8 GEMM on tensor cores with the scale epilogue fused, and the same
// kernel on 16-bit float operands for fq at many rows (qd_cuda_fq_gemm).
//
// A is [M, ld] and B is [N, ld] (both K-contiguous, ld in bytes).  A 128x128 block
// tile is computed by 8 warps (2 x 4, 64x32 each) from a cp.async pipeline of
// 128-byte K slices, 3 stages deep (108 KB), or 2 (72 KB) on GPUs whose blocks may
// have at most 99 KB of shared memory (sm_86, sm_89).  Integer accumulators are
// exact; in the scaled mode they are flushed into float accumulators at the end of
// each K group that shares one scale pair (the gcd of the two K blocks), as the
// reference does.  16-bit operands sum in float32 per K group the same way.
//
// On Hopper (sm_90a builds) every mode runs gemm_s8_sm90.cu's wgmma kernel
// instead, except one group over a long K cut every MAX_GROUP_STEPS steps into
// parts that do not divide K; every other GPU uses this one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "gemm_s8.cuh"
#include "gemm_s8_sm90.cuh"
#include "mma_s8.cuh"
#include "float_units.cuh"

namespace {

using namespace qd;

constexpr int BM = 128, BN = 128, BK = 128, THREADS = 256;
constexpr int LDS = BK + 16;  // smem row: 144 bytes keeps ldmatrix rows on distinct banks
constexpr int ROW_CHUNKS = BK / 16, LOADS = BM * ROW_CHUNKS / THREADS;  // 16-byte copies
constexpr int smem_bytes(int stages) { return stages * (BM + BN) * LDS; }
// The pipeline's depth on a device whose blocks may have `optin` bytes of shared
// memory: 3 stages where they fit, else 2 (every sm_80+ GPU holds 2).
constexpr int stages_for(int optin) { return optin >= smem_bytes(3) ? 3 : 2; }
constexpr int GROUP_M = 8;    // tile rows visited together, for L2 reuse of B
constexpr int KSTEP = 32;     // K bytes per mma
constexpr int64_t MAX_GROUP_STEPS = QD_INT_MATMUL_MAX_K / KSTEP;  // int32 stays exact
// K groups of at least this many values that fall off the mma steps are spread to
// whole steps (qq_spread: at most 4x the bytes); finer ones run on the float units
// (float_units.cu).
constexpr int64_t MIN_SPREAD_GROUP = KSTEP / 4;
static_assert(FINE_GROUP_MAX + 1 == MIN_SPREAD_GROUP, "every group is spread or fine");

template <int OPS>
__device__ __forceinline__ void mma_step(typename Sums<OPS>::type (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    if constexpr (OPS == S8) mma_s8(c, a, b0, b1);
    else mma_16bit<OPS == F16>(c, a, b0, b1);
}

template <int MODE, int OPS, int STAGES>
__global__ void __launch_bounds__(THREADS, MODE == GROUPED ? 1 : 2)  // GROUPED keeps float sums too
gemm_s8_kernel(const int8_t *__restrict__ a, const int8_t *__restrict__ bt, int M, int N,
               int64_t Kp, int64_t ld, void *out, int out_dtype, Scales sc) {
    using Sum = typename Sums<OPS>::type;
    extern __shared__ __align__(16) int8_t smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 2, wn = warp & 3;

    int tm, tn;
    raster(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN, GROUP_M, tm, tn);
    const int m0 = tm * BM, n0 = tn * BN;

    auto stage_a = [&](int s) { return smem + s * (BM + BN) * LDS; };
    auto stage_b = [&](int s) { return smem + s * (BM + BN) * LDS + BM * LDS; };

    const int ktiles = (int)((Kp + BK - 1) / BK);
    auto load_tile = [&](int kt, int s) {
        int8_t *sa = stage_a(s), *sb = stage_b(s);
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            int c = tid + i * THREADS, row = c / ROW_CHUNKS, kc = (c % ROW_CHUNKS) * 16;
            int64_t k = (int64_t)kt * BK + kc;
            bool ok_a = m0 + row < M && k < Kp, ok_b = n0 + row < N && k < Kp;
            cp_async16(sa + row * LDS + kc, ok_a ? a + (int64_t)(m0 + row) * ld + k : a, ok_a);
            cp_async16(sb + row * LDS + kc, ok_b ? bt + (int64_t)(n0 + row) * ld + k : bt, ok_b);
        }
    };

    constexpr bool SCALED = MODE != INT32_OUT;
    constexpr int F = MODE == GROUPED ? 4 : 1;  // float partial sums only when groups are flushed
    Sum acc[4][4][4];
    float facc[F][F][F];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                acc[i][j][e] = Sum(0);
                if constexpr (MODE == GROUPED) facc[i][j][e] = 0.0f;
            }

    // Rows and columns this thread's accumulators belong to (mma C layout).
    const int g = lane >> 2, t = lane & 3;
    auto row_of = [&](int i, int half) { return m0 + wm * 64 + i * 16 + g + half * 8; };
    auto col_of = [&](int j, int odd) { return n0 + wn * 32 + j * 8 + t * 2 + odd; };

    // The scales of this thread's rows and columns for one K group, the a_index-th
    // of the rows' and the b_index-th of the columns'; without a scales (fq_gemm)
    // a row's factor is 1.  locate_scales() finds where each row's and column's
    // scales start, once: GROUPED before its first group, ONE_GROUP after its last
    // step (so that the pointers hold no registers in the loop).  GROUPED loads a
    // group's scales as it starts, so that their latency hides behind its steps.
    float sa[4][2], sb[4][2];
    const float *a_rows[4][2], *b_columns[4][2];
    auto locate_scales = [&]() {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned r = min(row_of(i, h), M - 1), c = min(col_of(i, h), N - 1);  // <= M, N: 32 bits
                a_rows[i][h] = sc.a ? sc.a + (int64_t)(r / (unsigned)sc.a_bm) * sc.a_ld : nullptr;
                b_columns[i][h] = sc.b + (int64_t)(c / (unsigned)sc.b_bn) * sc.b_ld;
            }
    };
    auto load_scales = [&](int a_index, int b_index) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                sa[i][h] = sc.a ? a_rows[i][h][a_index] : 1.0f;
                sb[i][h] = b_columns[i][h][b_index];
            }
    };
    // Adds each sum times its scale pair into facc (GROUPED) or returns in place
    // of acc (ONE_GROUP, at the end; as float bits in int32 sums).
    auto flush = [&]() {
        if constexpr (SCALED) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float s = __fmul_rn(sa[i][e >> 1], sb[j][e & 1]);
                        float v = __fmul_rn(s, (float)acc[i][j][e]);
                        if constexpr (MODE == GROUPED) {
                            facc[i][j][e] = __fadd_rn(facc[i][j][e], v);
                            acc[i][j][e] = Sum(0);
                        } else if constexpr (OPS == S8) {
                            acc[i][j][e] = __float_as_int(v);
                        } else {
                            acc[i][j][e] = v;
                        }
                    }
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) load_tile(s, s);
        cp_async_commit();
    }
    const int64_t ksteps = (Kp + KSTEP - 1) / KSTEP;
    // GROUPED: steps left in the K group, and the scales' walk along K (the
    // scales' blocks are whole groups, or one block over all of K)
    const int group_steps = (int)sc.group_steps;  // <= MAX_GROUP_STEPS
    int left = group_steps;
    const int64_t group_bytes = (MODE == GROUPED ? sc.group_steps : 1) * KSTEP;
    BlockWalk a_walk((int)max(sc.a_bk / group_bytes, (int64_t)1), (int)sc.a_ld - 1, 0),
        b_walk((int)max(sc.b_bk / group_bytes, (int64_t)1), (int)sc.b_ld - 1, 0);
    if constexpr (MODE == GROUPED) {
        locate_scales();
        load_scales(a_walk.index, b_walk.index);
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt landed for all; stage (kt-1)%STAGES is free again
        if (kt + STAGES - 1 < ktiles) load_tile(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        cp_async_commit();

        const int8_t *sa = stage_a(kt % STAGES), *sb = stage_b(kt % STAGES);
#pragma unroll
        for (int ks = 0; ks < BK / KSTEP; ++ks) {
            const int64_t step = (int64_t)kt * (BK / KSTEP) + ks;
            if (step >= ksteps) break;
            uint32_t fa[4][4], fb[2][4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                ldmatrix_x4(fa[i], sa + (wm * 64 + i * 16 + (lane & 15)) * LDS + ks * KSTEP + (lane >> 4) * 16);
#pragma unroll
            for (int p = 0; p < 2; ++p)
                ldmatrix_x4(fb[p], sb + (wn * 32 + p * 16 + ((lane >> 4) << 3) + (lane & 7)) * LDS +
                                       ks * KSTEP + ((lane >> 3) & 1) * 16);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_step<OPS>(acc[i][j], fa[i], fb[j >> 1][(j & 1) * 2], fb[j >> 1][(j & 1) * 2 + 1]);
            if constexpr (MODE == GROUPED) {
                if (--left == 0 || step + 1 == ksteps) {
                    flush();
                    left = group_steps;
                    a_walk.next();
                    b_walk.next();
                    if (step + 1 < ksteps) load_scales(a_walk.index, b_walk.index);
                }
            }
        }
    }
    cp_async_wait<0>();
    if constexpr (MODE == ONE_GROUP) {
        locate_scales();
        load_scales(0, 0);
        flush();
    }

    // Epilogue: int32 as is, or the scaled float sums in the output dtype.
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int r = row_of(i, e >> 1), c = col_of(j, e & 1);
                if (r >= M || c >= N) continue;
                int64_t o = (int64_t)r * N + c;
                if constexpr (!SCALED) {
                    static_cast<int32_t *>(out)[o] = acc[i][j][e];
                } else {
                    float v;
                    if constexpr (MODE == GROUPED) v = facc[i][j][e];
                    else if constexpr (OPS == S8) v = __int_as_float(acc[i][j][e]);
                    else v = acc[i][j][e];
                    qd::store_from_f32(out, out_dtype, o, v);
                }
            }
}

// Any K grouping: one thread per output, exact int32 per group.  For groups of 8
// values or more whose spread operands do not fit in memory (finer ones run
// qq_fine_groups).
__global__ void qq_simple_kernel(const int8_t *a, const int8_t *bt, int M, int N, int64_t K,
                                 int64_t ld, Scales sc, int64_t G, void *out, int out_dtype) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)M * N;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t m = i / N, n = i % N;
        float sum = 0.0f;
        for (int64_t k0 = 0; k0 < K; k0 += G) {
            int32_t dot = 0;
            for (int64_t k = k0; k < k0 + G; ++k) dot += (int32_t)a[m * ld + k] * (int32_t)bt[n * ld + k];
            float s = __fmul_rn(sc.a[(m / sc.a_bm) * sc.a_ld + k0 / sc.a_bk],
                                sc.b[(n / sc.b_bn) * sc.b_ld + k0 / sc.b_bk]);
            sum = __fadd_rn(sum, __fmul_rn(s, (float)dot));
        }
        qd::store_from_f32(out, out_dtype, i, sum);
    }
}

// Rows [rows, ld] of int8 values whose K is cut into pieces of `piece` values, each
// copied to a slot of `slot` bytes (slot >= piece, a multiple of 4) followed by zeros:
// dst [rows, pieces * slot].  Four bytes a thread, which never span two slots.
__global__ void spread_pieces_kernel(const int8_t *__restrict__ src, int64_t rows, int64_t ld, int piece,
                                     int slot, int64_t pieces, int8_t *__restrict__ dst) {
    const int64_t words_per_row = pieces * slot / 4, words = rows * words_per_row;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < words;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / words_per_row, k = (i - r * words_per_row) * 4, p = k / slot;
        const int at = (int)(k - p * slot);
        const int8_t *from = src + r * ld + p * piece;
        uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (at + j < piece) word |= (uint32_t)(uint8_t)from[at + j] << (8 * j);
        reinterpret_cast<uint32_t *>(dst)[i] = word;
    }
}

int64_t gcd(int64_t x, int64_t y) {
    while (y) { int64_t t = x % y; x = y; y = t; }
    return x;
}

// a [M, ld] and bt [N, ld] of elem-byte values (K of them a row, then zeros up to
// 16 bytes), and out [M, N] of out_dtype, which must not overlap them.
qd_status check_operands(const void *a, const void *bt, const void *out, int out_dtype, int64_t M, int64_t N,
                         int64_t K, int64_t ld, size_t elem = 1) {
    if (!a || !bt || !out) return QD_ERR_NULL;
    if (M <= 0 || N <= 0 || K <= 0) return QD_ERR_SHAPE;
    // rows are copied 16 bytes at a time (cp.async, TMA): a misaligned one would be a
    // fault that ends the CUDA context, not an error
    if (!qd_dims_fit(M, ld, elem) || !qd_dims_fit(N, ld, elem) || !qd_dims_fit(M, N, sizeof(float)) ||
        ld * elem % 16 || ld < K || reinterpret_cast<uintptr_t>(a) % 16 || reinterpret_cast<uintptr_t>(bt) % 16)
        return QD_ERR_ARGUMENT;
    if (M > 0x7FFFFFFF || N > 0x7FFFFFFF) return QD_ERR_SHAPE;  // the grid's limit, past sizes no array has
    const int64_t row = (K * elem + 15) / 16 * 16;  // bytes read a row
    if (qd::overlaps_any({out, (size_t)(M * N) * qd::dtype_bytes(out_dtype)},
                         {{a, qd::span_bytes(M, row, ld * elem, 1)}, {bt, qd::span_bytes(N, row, ld * elem, 1)}}))
        return QD_ERR_ARGUMENT;
    return QD_OK;
}

// Whether out [M, N] of out_dtype overlaps scales [rows / block_rows, K / block_k].
bool overlaps_scales(const void *out, int out_dtype, int64_t M, int64_t N, const float *scales, int64_t rows,
                     int64_t block_rows, int64_t K, int64_t block_k) {
    return qd::overlaps_any({out, (size_t)(M * N) * qd::dtype_bytes(out_dtype)},
                            {{scales, (size_t)(rows / block_rows * (K / block_k)) * sizeof(float)}});
}

template <int MODE, int OPS, int STAGES>
qd_status launch_stages(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t Kp, int64_t ld, void *out,
                        int out_dtype, const Scales &sc, void *stream, int64_t tiles) {
    static unsigned long long configured = 0;
    auto kernel = gemm_s8_kernel<MODE, OPS, STAGES>;
    qd_status st = qd::allow_dynamic_smem((const void *)kernel, smem_bytes(STAGES), &configured);
    if (st != QD_OK) return st;
    kernel<<<(unsigned)tiles, THREADS, smem_bytes(STAGES), qd::as_stream(stream)>>>(
        a, bt, (int)M, (int)N, Kp, ld, out, out_dtype, sc);
    return qd::launched();
}

// K in bytes: the zero padding up to the next 16 bytes is part of the rows.
template <int MODE, int OPS = S8>
qd_status launch_gemm(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K,
                      int64_t ld, void *out, int out_dtype, const Scales &sc, void *stream) {
    const int64_t Kp = (K + 15) / 16 * 16;
    // the Hopper kernel ends blocks of K on whole blocks only, and its copies' coordinates
    // are 32-bit: past 2^31 bytes of K (fq's 16-bit rows, qq's spread slots) the kernel
    // below runs, whose K is 64-bit
    const bool whole_blocks = MODE != GROUPED || Kp % (sc.group_steps * KSTEP) == 0;
    if (whole_blocks && Kp <= 0x7FFFFFFF - 1024 && qd::gemm_s8_sm90_usable())
        return qd::gemm_s8_sm90(a, bt, M, N, Kp, ld, out, out_dtype, sc, GemmMode(MODE), Operands(OPS),
                                qd::as_stream(stream));
    const int64_t tiles = qd::ceil_div(M, BM) * qd::ceil_div(N, BN);
    if (tiles > 0x7FFFFFFF) return QD_ERR_SHAPE;
    int device = 0, optin = 0;
    qd_status st;
    if ((st = qd::check(cudaGetDevice(&device))) != QD_OK ||
        (st = qd::check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device))) != QD_OK)
        return st;
    if (stages_for(optin) == 3)
        return launch_stages<MODE, OPS, 3>(a, bt, M, N, Kp, ld, out, out_dtype, sc, stream, tiles);
    return launch_stages<MODE, OPS, 2>(a, bt, M, N, Kp, ld, out, out_dtype, sc, stream, tiles);
}

// fq_gemm's launch for one operand type: the weight's scales over whole K, or per
// block of K (a multiple of 16 values: whole mma steps).  Scales index K in bytes.
template <int OPS>
qd_status launch_fq_gemm(const void *x, const void *w16, int64_t M, int64_t N, int64_t K, int64_t ld,
                         const float *scales, int64_t block_n, int64_t block_k, void *out, int out_dtype,
                         void *stream) {
    const int8_t *a = static_cast<const int8_t *>(x), *bt = static_cast<const int8_t *>(w16);
    Scales sc{nullptr, 0, M, 2 * K, scales, K / block_k, block_n, 2 * block_k, block_k / 16};
    if (block_k == K)
        return launch_gemm<ONE_GROUP, OPS>(a, bt, M, N, 2 * K, 2 * ld, out, out_dtype, sc, stream);
    return launch_gemm<GROUPED, OPS>(a, bt, M, N, 2 * K, 2 * ld, out, out_dtype, sc, stream);
}

}  // namespace

extern "C" qd_status qd_cuda_fq_gemm(const void *x, const void *w16, int dtype, int64_t M, int64_t N,
                                     int64_t K, int64_t ld, const float *scales, int64_t block_n,
                                     int64_t block_k, void *out, int out_dtype, void *stream) {
    // rows copied in 16-byte pieces (checked with the operands); scale blocks end on whole mma steps
    qd_status st = check_operands(x, w16, out, out_dtype, M, N, K, ld, 2);
    if (st != QD_OK) return st;
    if (!qd::float_dtype(out_dtype)) return QD_ERR_ARGUMENT;
    if (!scales) return QD_ERR_NULL;
    if (block_n <= 0 || block_k <= 0 || N % block_n || K % block_k) return QD_ERR_SHAPE;
    if ((block_k != K && block_k % 16) || overlaps_scales(out, out_dtype, M, N, scales, N, block_n, K, block_k))
        return QD_ERR_ARGUMENT;
    if (dtype == QD_CUDA_F16)
        return launch_fq_gemm<F16>(x, w16, M, N, K, ld, scales, block_n, block_k, out, out_dtype, stream);
    if (dtype == QD_CUDA_BF16)
        return launch_fq_gemm<BF16>(x, w16, M, N, K, ld, scales, block_n, block_k, out, out_dtype, stream);
    return QD_ERR_ARGUMENT;
}

extern "C" qd_status qd_cuda_int_matmul_s8(const int8_t *a, const int8_t *bt, int64_t M,
                                           int64_t N, int64_t K, int64_t ld, int32_t *c,
                                           void *stream) {
    qd_status st = check_operands(a, bt, c, QD_CUDA_S32, M, N, K, ld);
    if (st != QD_OK) return st;
    if (K > QD_INT_MATMUL_MAX_K) return QD_ERR_K_TOO_LARGE;
    return launch_gemm<INT32_OUT>(a, bt, M, N, K, ld, c, QD_CUDA_S32, Scales{}, stream);
}

namespace {

// qq whose K blocks share no multiple of 32 values (blocks of 16 or 48, say):
// each piece of G values (the blocks' common divisor) of both operands goes to a
// slot of the next multiple of 32 bytes, zeros after it, so that every block ends
// on an mma step.  Each block's int32 sums, and the order they are scaled and
// added in, are unchanged: the same bits, on the tensor cores, at up to 4x the
// bytes and the tensor work (MIN_SPREAD_GROUP).  The spread operands are
// temporaries from the stream's memory pool.
qd_status qq_spread(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K, int64_t ld,
                    const float *a_scales, int64_t a_block_m, int64_t a_block_k, const float *b_scales,
                    int64_t b_block_n, int64_t b_block_k, int64_t G, void *out, int out_dtype, void *stream) {
    const int64_t slot = ceil_div(G, KSTEP) * KSTEP, pieces = K / G, K2 = pieces * slot;
    cudaStream_t s = as_stream(stream);
    int8_t *a2 = nullptr, *b2 = nullptr;
    qd_status st = check(cudaMallocAsync(reinterpret_cast<void **>(&a2), M * K2, s));
    if (st != QD_OK) return st;
    st = check(cudaMallocAsync(reinterpret_cast<void **>(&b2), N * K2, s));
    if (st == QD_OK) {
        spread_pieces_kernel<<<grid_for(M * K2 / 4, 256), 256, 0, s>>>(a, M, ld, (int)G, (int)slot, pieces, a2);
        spread_pieces_kernel<<<grid_for(N * K2 / 4, 256), 256, 0, s>>>(bt, N, ld, (int)G, (int)slot, pieces, b2);
        st = launched();
        if (st == QD_OK)
            st = qd_cuda_qq_matmul(a2, b2, M, N, K2, K2, a_scales, a_block_m, a_block_k / G * slot, b_scales,
                                   b_block_n, b_block_k / G * slot, out, out_dtype, stream);
        const qd_status freed = check(cudaFreeAsync(b2, s));
        if (st == QD_OK) st = freed;
    }
    const qd_status freed = check(cudaFreeAsync(a2, s));
    return st != QD_OK ? st : freed;
}

}  // namespace

extern "C" qd_status qd_cuda_qq_matmul(const int8_t *a, const int8_t *bt, int64_t M, int64_t N,
                                       int64_t K, int64_t ld, const float *a_scales,
                                       int64_t a_block_m, int64_t a_block_k,
                                       const float *b_scales, int64_t b_block_n,
                                       int64_t b_block_k, void *out, int out_dtype,
                                       void *stream) {
    qd_status st = check_operands(a, bt, out, out_dtype, M, N, K, ld);
    if (st != QD_OK) return st;
    if (!qd::float_dtype(out_dtype)) return QD_ERR_ARGUMENT;
    if (!a_scales || !b_scales) return QD_ERR_NULL;
    if (a_block_m <= 0 || a_block_k <= 0 || b_block_n <= 0 || b_block_k <= 0 ||
        M % a_block_m || K % a_block_k || N % b_block_n || K % b_block_k)
        return QD_ERR_SHAPE;
    if (overlaps_scales(out, out_dtype, M, N, a_scales, M, a_block_m, K, a_block_k) ||
        overlaps_scales(out, out_dtype, M, N, b_scales, N, b_block_n, K, b_block_k))
        return QD_ERR_ARGUMENT;
    const int64_t G = gcd(a_block_k, b_block_k);
    Scales sc{a_scales, K / a_block_k, a_block_m, a_block_k,
              b_scales, K / b_block_k, b_block_n, b_block_k, 0};
    if (G == K || G % KSTEP == 0) {
        // One group (split every MAX_GROUP_STEPS steps to stay exact), or groups on k-step bounds.
        int64_t steps = G == K ? qd::ceil_div(K, KSTEP) : G / KSTEP;
        if (steps > MAX_GROUP_STEPS) {
            steps = MAX_GROUP_STEPS;
            if (G != K) while ((G / KSTEP) % steps) --steps;  // keep flushes on group bounds
        }
        sc.group_steps = steps;
        if (G == K && steps * KSTEP >= K)
            return launch_gemm<ONE_GROUP>(a, bt, M, N, K, ld, out, out_dtype, sc, stream);
        return launch_gemm<GROUPED>(a, bt, M, N, K, ld, out, out_dtype, sc, stream);
    }
    if (G < MIN_SPREAD_GROUP) return qd::qq_fine_groups(a, bt, M, N, K, ld, sc, G, out, out_dtype, as_stream(stream));
    if (ceil_div(G, KSTEP) <= MAX_GROUP_STEPS) {  // a slot's sums stay one group
        const qd_status spread = qq_spread(a, bt, M, N, K, ld, a_scales, a_block_m, a_block_k, b_scales,
                                           b_block_n, b_block_k, G, out, out_dtype, stream);
        if (spread != QD_ERR_NO_MEMORY) return spread;
        (void)cudaGetLastError();  // no room for the spread operands: the simple kernel needs none
    }
    if (G > QD_INT_MATMUL_MAX_K) return QD_ERR_K_TOO_LARGE;
    qq_simple_kernel<<<qd::grid_for(M * N, 256), 256, 0, qd::as_stream(stream)>>>(
        a, bt, (int)M, (int)N, K, ld, sc, G, out, out_dtype);
    return qd::launched();
}
