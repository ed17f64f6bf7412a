// Products whose scale blocks along K are too fine for the tensor-core kernels,
// on the float units:
// - qq whose blocks share fewer than 8 values (a scale per input channel, blocks
//   of 4): the tensor cores' steps take 32 values of one block, and qq_spread
//   would copy every piece of G values to a 32-byte slot.  A block's sum of at
//   most 7 int8 products is an integer below 2^24, exact in float32 in any order,
//   so the float units sum it; then each block is scaled and added as the
//   reference does (the scales' product, times the sum, added: each rounded, no
//   FMA), in order of K, the same bits.
// - fq whose weight blocks along K are no multiple of 16 values (the decode
//   tiles' scale steps): each weight value is dequantized as it loads (q * scale,
//   rounded, as dequantize gives it) and the products are summed in float32.
//   (The cuda backend sends one row of scales for all of N, a scale per input
//   channel say, to the decode kernel instead, with x scaled by it.)
// A block of 256 threads computes 64 x 64 outputs, 4 x 4 a thread, from slices of
// K in shared memory as floats; the next slice is loaded into registers while
// this one is summed.  Each output's sum runs in order of K whatever M.
// fq at few rows (decode) runs few_rows_kernel instead: a 64-row tile would leave
// most of the GPU idle, each block waiting on its slices one after another.
#include "float_units.cuh"

#include <algorithm>

namespace {

using qd::Scales;

constexpr int TILE = 64, THREADS = 256, PER = 4;  // outputs a block a side, a thread a side
constexpr int SLICE = 32;                         // K values a slice at most
constexpr int LD = TILE + 4;                      // floats a k row of a tile: 16-byte aligned rows
constexpr int VALUE_THREADS = THREADS / TILE;     // threads loading a tile row's values, 8 each
constexpr int SCALE_ROWS = THREADS / SLICE;       // rows whose scales one pass of the block loads
constexpr int QQ = -1;                            // the kernel's x dtype for qq: int8 values

// Which block along K the value at k belongs to, kept as k = index * per + offset
// and stepped without a division.
struct KWalk {
    int64_t index, offset;
    int64_t per, step_index, step_offset, last;
    __device__ KWalk(int64_t first, int64_t per, int64_t step, int64_t last)
        : index(first / per), offset(first % per), per(per), step_index(step / per), step_offset(step % per),
          last(last) {}
    __device__ int64_t at() const { return min(index, last); }  // past K: the last block (never summed)
    __device__ void next() {  // k + step
        index += step_index;
        offset += step_offset;
        if (offset >= per) offset -= per, ++index;
    }
    __device__ void next_one() {  // k + 1
        if (++offset == per) offset = 0, ++index;
    }
};

// X: x's dtype (QD_CUDA_F32, F16 or BF16) for fq, QQ for qq.  G: qq's values a block.
template <int X, int G>
__global__ void __launch_bounds__(THREADS)
float_units_kernel(const void *__restrict__ a, int64_t lda, const int8_t *__restrict__ bt, int64_t ldb, int M,
                   int N, int64_t K, Scales sc, int tiles_n, void *out, int out_dtype) {
    constexpr bool qq = X == QQ;
    constexpr int NG = qq ? SLICE / G : 1, KS = qq ? NG * G : SLICE;  // qq's blocks, and K values, a slice
    __shared__ __align__(16) float av[KS][LD], bv[KS][LD];  // values [k][row]; fq's weights dequantized
    __shared__ __align__(16) float as[NG][LD], bs[NG][LD];  // qq's scales [block][row]
    __shared__ int64_t a_first[TILE], b_first[TILE];        // each row's first scale

    const int tid = threadIdx.x;
    const int m0 = blockIdx.x / tiles_n * TILE, n0 = blockIdx.x % tiles_n * TILE;
    // rows past M or N take the last row's scales and zero values: their outputs are not stored
    if (qq && tid < TILE) a_first[tid] = min(m0 + tid, M - 1) / sc.a_bm * sc.a_ld;
    else if (tid >= TILE && tid < 2 * TILE) b_first[tid - TILE] = min(n0 + tid - TILE, N - 1) / sc.b_bn * sc.b_ld;

    // Values: row vr of both tiles, 8 of K from vk on.  qq's scales: block slot sg of
    // rows sr, sr + SCALE_ROWS, ...
    const int vr = tid / VALUE_THREADS, vk = tid % VALUE_THREADS * 8;
    const int64_t a_row = (int64_t)min(m0 + vr, M - 1) * lda, b_row = (int64_t)min(n0 + vr, N - 1) * ldb;
    const bool a_in = m0 + vr < M, b_in = n0 + vr < N;
    const int sg = tid % SLICE, sr = tid / SLICE;
    // qq: the scale blocks (of G-value blocks) of block slot sg; fq: the weight's blocks of
    // K values at vk
    KWalk a_walk(sg, qq ? sc.a_bk / G : 1, NG, sc.a_ld - 1),
        b_walk(qq ? sg : vk, qq ? sc.b_bk / G : sc.b_bk, qq ? NG : SLICE, sc.b_ld - 1);
    float a_next[8], b_next[8], as_next[TILE / SCALE_ROWS], bs_next[TILE / SCALE_ROWS];
    __syncthreads();  // a_first, b_first

    auto load = [&](int64_t k0) {
        KWalk at = b_walk;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int64_t k = k0 + vk + i;
            const bool in = vk + i < KS && k < K;
            if constexpr (qq) a_next[i] = a_in && in ? static_cast<const int8_t *>(a)[a_row + k] : 0;
            else a_next[i] = a_in && in ? qd::load_as_f32(a, X, a_row + k) : 0.0f;
            const float q = b_in && in ? bt[b_row + k] : 0;
            if constexpr (qq) {
                b_next[i] = q;
            } else {  // dequantized as dequantize rounds it
                b_next[i] = __fmul_rn(q, sc.b[b_first[vr] + at.at()]);
                at.next_one();
            }
        }
        if (qq && sg < NG) {
#pragma unroll
            for (int i = 0; i < TILE / SCALE_ROWS; ++i) {
                as_next[i] = sc.a[a_first[sr + SCALE_ROWS * i] + a_walk.at()];
                bs_next[i] = sc.b[b_first[sr + SCALE_ROWS * i] + b_walk.at()];
            }
        }
        a_walk.next();
        b_walk.next();
    };

    const int tm = tid / (TILE / PER) * PER, tn = tid % (TILE / PER) * PER;  // the thread's outputs
    // f(r, c, x, y) for each of the thread's outputs, x and y its row's and column's
    // values in a k row of two tiles
    auto each_output = [&](const float (&a)[LD], const float (&b)[LD], auto f) {
        const float4 x = *reinterpret_cast<const float4 *>(&a[tm]), y = *reinterpret_cast<const float4 *>(&b[tn]);
        const float xs[PER] = {x.x, x.y, x.z, x.w}, ys[PER] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int r = 0; r < PER; ++r)
#pragma unroll
            for (int c = 0; c < PER; ++c) f(r, c, xs[r], ys[c]);
    };
    float sum[PER][PER] = {};
    auto sum_slice = [&](int blocks) {
        if constexpr (qq) {
#pragma unroll 2
            for (int j = 0; j < blocks; ++j) {
                float dot[PER][PER];
#pragma unroll
                for (int i = 0; i < G; ++i)
                    each_output(av[j * G + i], bv[j * G + i], [&](int r, int c, float x, float y) {
                        dot[r][c] = i ? fmaf(x, y, dot[r][c]) : x * y;
                    });
                each_output(as[j], bs[j], [&](int r, int c, float x, float y) {
                    sum[r][c] = __fadd_rn(sum[r][c], __fmul_rn(__fmul_rn(x, y), dot[r][c]));
                });
            }
        } else {  // values past K are zeros on both sides
#pragma unroll 8
            for (int k = 0; k < KS; ++k)
                each_output(av[k], bv[k], [&](int r, int c, float x, float y) { sum[r][c] = fmaf(x, y, sum[r][c]); });
        }
    };

    const int64_t blocks = qq ? K / G : K;  // qq's blocks of G, or fq's values, along K
    load(0);
    for (int64_t b0 = 0; b0 < blocks; b0 += NG * (qq ? 1 : KS)) {
        __syncthreads();  // the slice before is summed
        if (vk < KS) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (vk + i < KS) {
                    av[vk + i][vr] = a_next[i];
                    bv[vk + i][vr] = b_next[i];
                }
            }
        }
        if (qq && sg < NG) {
#pragma unroll
            for (int i = 0; i < TILE / SCALE_ROWS; ++i) {
                as[sg][sr + SCALE_ROWS * i] = as_next[i];
                bs[sg][sr + SCALE_ROWS * i] = bs_next[i];
            }
        }
        __syncthreads();
        const int64_t k_next = (b0 + NG * (qq ? 1 : KS)) * (qq ? G : 1);
        if (k_next < K) load(k_next);
        sum_slice((int)min((int64_t)NG, blocks - b0));
    }
#pragma unroll
    for (int r = 0; r < PER; ++r)
#pragma unroll
        for (int c = 0; c < PER; ++c) {
            const int m = m0 + tm + r, n = n0 + tn + c;
            if (m < M && n < N) qd::store_from_f32(out, out_dtype, (int64_t)m * N + n, sum[r][c]);
        }
}

template <int X, int G = 1>
qd_status launch_tiles(const void *a, int64_t lda, const int8_t *bt, int64_t ldb, int64_t M, int64_t N, int64_t K,
                 const Scales &sc, void *out, int out_dtype, cudaStream_t s) {
    const int64_t tiles_n = qd::ceil_div(N, TILE), tiles = qd::ceil_div(M, TILE) * tiles_n;
    if (tiles > 0x7FFFFFFF) return QD_ERR_SHAPE;  // more outputs than any GPU holds
    float_units_kernel<X, G><<<(unsigned)tiles, THREADS, 0, s>>>(a, lda, bt, ldb, (int)M, (int)N, K, sc, (int)tiles_n,
                                                                 out, out_dtype);
    return qd::launched();
}

// fq at up to FEW_ROWS rows of x: a warp takes 4 weight rows (outputs) for all of
// them, its lanes 4 adjacent values of K in each 128 (one 4-byte load a weight
// row), the block's x staged CHUNK values of K at a time in shared memory as
// floats, with each value's block of scales along K.  A chunk's weight words are
// loaded before the staging, so that their trip to memory overlaps it.  Each lane
// sums its values in order of K, and the lanes' sums meet by shuffles in a fixed
// order: a row's result does not depend on the others.
constexpr int FEW_ROWS = 16, FEW_WARPS = 8, W_ROWS = 4, CHUNK = 512, STEPS = CHUNK / 128;

template <int X, int MR>  // MR: rows of x staged, at least M
__global__ void __launch_bounds__(FEW_WARPS * 32)
few_rows_kernel(const void *__restrict__ x, int64_t ldx, const int8_t *__restrict__ w, int64_t ldw, int M, int N,
                int K, Scales sc, void *out, int out_dtype) {
    __shared__ __align__(16) float xs[MR][CHUNK];
    __shared__ __align__(16) unsigned k_block[CHUNK];  // the scale block along K of each value
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n0 = (blockIdx.x * FEW_WARPS + warp) * W_ROWS;
    const int8_t *row[W_ROWS];
    int64_t first_scale[W_ROWS];
#pragma unroll
    for (int r = 0; r < W_ROWS; ++r) {  // rows past N read row N - 1, whose outputs are not stored
        const int n = min(n0 + r, N - 1);
        row[r] = w + (int64_t)n * ldw;
        first_scale[r] = n / sc.b_bn * sc.b_ld;
    }
    const bool rows_share_scales = first_scale[0] == first_scale[W_ROWS - 1];  // one scale row for all four
    const unsigned bk = (unsigned)sc.b_bk, last = (unsigned)sc.b_ld - 1;
    float acc[MR][W_ROWS] = {};
    for (int k0 = 0; k0 < K; k0 += CHUNK) {
        uint32_t words[STEPS][W_ROWS];
#pragma unroll
        for (int q = 0; q < STEPS; ++q) {
            const int k = k0 + 128 * q + 4 * lane;
            const uint32_t keep = K - k >= 4 ? ~0u : K > k ? (1u << (8 * (K - k))) - 1 : 0u;  // bytes past K: zero
#pragma unroll
            for (int r = 0; r < W_ROWS; ++r)
                words[q][r] = keep ? *reinterpret_cast<const uint32_t *>(row[r] + k) & keep : 0u;
        }
        __syncthreads();  // the chunk before is read
        for (int i = threadIdx.x; i < MR * CHUNK; i += FEW_WARPS * 32) {  // rows past M repeat row M - 1
            const int m = i / CHUNK, c = i % CHUNK;
            xs[m][c] = k0 + c < K ? qd::load_as_f32(x, X, min(m, M - 1) * ldx + k0 + c) : 0.0f;
        }
        for (int c = threadIdx.x; c < CHUNK; c += FEW_WARPS * 32) k_block[c] = min((unsigned)(k0 + c) / bk, last);
        __syncthreads();
#pragma unroll
        for (int q = 0; q < STEPS; ++q) {
            if (k0 + 128 * q + 4 * lane >= K) break;
            const uint4 b4 = *reinterpret_cast<const uint4 *>(&k_block[128 * q + 4 * lane]);
            const unsigned block[4] = {b4.x, b4.y, b4.z, b4.w};
            float scale[W_ROWS][4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (rows_share_scales) {
                    const float v = sc.b[first_scale[0] + block[i]];
#pragma unroll
                    for (int r = 0; r < W_ROWS; ++r) scale[r][i] = v;
                } else {
#pragma unroll
                    for (int r = 0; r < W_ROWS; ++r) scale[r][i] = sc.b[first_scale[r] + block[i]];
                }
            }
            float wf[W_ROWS][4];  // dequantized as dequantize rounds it
#pragma unroll
            for (int r = 0; r < W_ROWS; ++r)
#pragma unroll
                for (int i = 0; i < 4; ++i) wf[r][i] = __fmul_rn((float)(int8_t)(words[q][r] >> (8 * i)), scale[r][i]);
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                const float4 v = *reinterpret_cast<const float4 *>(&xs[m][128 * q + 4 * lane]);
                const float xv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int r = 0; r < W_ROWS; ++r)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[m][r] = fmaf(xv[i], wf[r][i], acc[m][r]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int r = 0; r < W_ROWS; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(~0u, v, d);
            if (lane == r && m < M && n0 + r < N) qd::store_from_f32(out, out_dtype, (int64_t)m * N + n0 + r, v);
        }
}

template <int X, int MR>
qd_status launch_few_rows(const void *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t M, int64_t N, int64_t K,
                          const Scales &sc, void *out, int out_dtype, cudaStream_t s) {
    const unsigned blocks = (unsigned)qd::ceil_div(N, FEW_WARPS * W_ROWS);
    few_rows_kernel<X, MR><<<blocks, FEW_WARPS * 32, 0, s>>>(x, ldx, w, ldw, (int)M, (int)N, (int)K, sc, out,
                                                             out_dtype);
    return qd::launched();
}

// fq in launches of up to FEW_ROWS rows.
template <int X>
qd_status fq_few_rows(const void *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t M, int64_t N, int64_t K,
                      const Scales &sc, void *out, int out_dtype, cudaStream_t s) {
    const size_t x_row = qd::dtype_bytes(X) * ldx, out_row = qd::dtype_bytes(out_dtype) * N;
    for (int64_t m0 = 0; m0 < M; m0 += FEW_ROWS) {
        const int64_t rows = std::min<int64_t>(FEW_ROWS, M - m0);
        const void *xr = static_cast<const char *>(x) + m0 * x_row;
        void *o = static_cast<char *>(out) + m0 * out_row;
        const qd_status st =
            rows == 1   ? launch_few_rows<X, 1>(xr, ldx, w, ldw, rows, N, K, sc, o, out_dtype, s)
            : rows <= 4 ? launch_few_rows<X, 4>(xr, ldx, w, ldw, rows, N, K, sc, o, out_dtype, s)
            : rows <= 8 ? launch_few_rows<X, 8>(xr, ldx, w, ldw, rows, N, K, sc, o, out_dtype, s)
                        : launch_few_rows<X, 16>(xr, ldx, w, ldw, rows, N, K, sc, o, out_dtype, s);
        if (st != QD_OK) return st;
    }
    return QD_OK;
}

// Rows of x up to which fq runs in launches of FEW_ROWS (each reading the whole
// weight) rather than 64 x 64 tiles, and always with batch invariance on.
constexpr int64_t FEW_ROWS_MAX = 64;

template <int X>
qd_status fq_values(const void *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t M, int64_t N, int64_t K,
                    const Scales &sc, void *out, int out_dtype, cudaStream_t s) {
    if (M <= FEW_ROWS_MAX || qd_cuda_batch_invariant())
        return fq_few_rows<X>(x, ldx, w, ldw, M, N, K, sc, out, out_dtype, s);
    return launch_tiles<X>(x, ldx, w, ldw, M, N, K, sc, out, out_dtype, s);
}

}  // namespace

namespace qd {

qd_status qq_fine_groups(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K, int64_t ld,
                         const Scales &sc, int64_t G, void *out, int out_dtype, cudaStream_t s) {
    switch (G) {
        case 1: return launch_tiles<QQ, 1>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        case 2: return launch_tiles<QQ, 2>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        case 3: return launch_tiles<QQ, 3>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        case 4: return launch_tiles<QQ, 4>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        case 5: return launch_tiles<QQ, 5>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        case 6: return launch_tiles<QQ, 6>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        case 7: return launch_tiles<QQ, 7>(a, ld, bt, ld, M, N, K, sc, out, out_dtype, s);
        default: return QD_ERR_ARGUMENT;
    }
}

}  // namespace qd

extern "C" qd_status qd_cuda_fq_values(const void *x, int x_dtype, int64_t M, int64_t ldx, const int8_t *w,
                                       int64_t N, int64_t K, int64_t ldw, const float *scales, int64_t block_n,
                                       int64_t block_k, void *out, int out_dtype, void *stream) {
    if (!x || !w || !scales || !out) return QD_ERR_NULL;
    if (M <= 0 || N <= 0 || K <= 0) return QD_ERR_SHAPE;
    if (block_n <= 0 || block_k <= 0 || N % block_n || K % block_k) return QD_ERR_SHAPE;
    if (!qd::float_dtype(x_dtype) || !qd::float_dtype(out_dtype)) return QD_ERR_ARGUMENT;
    if (ldx < K || ldw < K || !qd_dims_fit(M, ldx, qd::dtype_bytes(x_dtype)) || !qd_dims_fit(N, ldw, 1) ||
        !qd_dims_fit(M, N, sizeof(float)))
        return QD_ERR_ARGUMENT;
    // weight rows are read 4 bytes at a time at few rows: a misaligned read would be a
    // fault that ends the CUDA context
    if (ldw % 16 || reinterpret_cast<uintptr_t>(w) % 16) return QD_ERR_ARGUMENT;
    if (M > 0x7FFFFFFF || N > 0x7FFFFFFF || K > 0x7FFFFFFF) return QD_ERR_SHAPE;  // the kernels' int limits
    if (qd::overlaps_any({out, (size_t)(M * N) * qd::dtype_bytes(out_dtype)},
                         {{x, qd::span_bytes(M, K, ldx, qd::dtype_bytes(x_dtype))},
                          {w, qd::span_bytes(N, K, ldw, 1)},
                          {scales, (size_t)(N / block_n * (K / block_k)) * sizeof(float)}}))
        return QD_ERR_ARGUMENT;
    const qd::Scales sc{nullptr, 0, 1, 1, scales, K / block_k, block_n, block_k, 0};
    const cudaStream_t s = qd::as_stream(stream);
    if (x_dtype == QD_CUDA_F16) return fq_values<QD_CUDA_F16>(x, ldx, w, ldw, M, N, K, sc, out, out_dtype, s);
    if (x_dtype == QD_CUDA_BF16) return fq_values<QD_CUDA_BF16>(x, ldx, w, ldw, M, N, K, sc, out, out_dtype, s);
    return fq_values<QD_CUDA_F32>(x, ldx, w, ldw, M, N, K, sc, out, out_dtype, s);
}
