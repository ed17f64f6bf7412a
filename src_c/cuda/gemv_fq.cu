// Weight-only products for small M (decode): x[M, K] float32 times int8, int4 or
// int2 weights [N, K] that are dequantized as they are loaded.  Devices with bf16
// tensor cores take fq_mma.cu; this float kernel serves the older ones.  The weights are
// read once, 16 bytes per lane per load, so the kernel runs at memory speed.
// A block owns R weight rows; its warps and lanes split K, and the partial sums
// meet through shuffles and shared memory.
#include "fq_mma.cuh"

namespace {

constexpr int WARPS = 4, R = 4;
constexpr int MAX_M = 16;  // rows of x per launch
constexpr int PIECE = 16;  // values converted to float at a time (registers)

// Value V of a 16-byte chunk as float, without the quarter-rate int->float
// conversion: the biased field is placed in the mantissa of 2^23 and the bias
// subtracted again, both exact.
template <int BITS, int V>
__device__ __forceinline__ float chunk_value(const uint4 &w) {
    constexpr int per = 32 / BITS, word = V / per, shift = (V % per) * BITS;
    constexpr uint32_t mask = (1u << BITS) - 1u, half = 1u << (BITS - 1);
    const uint32_t bits = word == 0 ? w.x : word == 1 ? w.y : word == 2 ? w.z : w.w;
    const uint32_t field = ((bits >> shift) & mask) ^ (0x4B000000u | half);
    return __uint_as_float(field) - (8388608.0f + (float)half);
}

template <int BITS, int H, int J = 0>
__device__ __forceinline__ void convert_piece(const uint4 &w, float (&out)[PIECE]) {
    if constexpr (J < PIECE) {
        out[J] = chunk_value<BITS, H * PIECE + J>(w);
        convert_piece<BITS, H, J + 1>(w, out);
    }
}

using WeightScales = qd::FqScales;

template <int BITS, int MT, int H = 0>
__device__ __forceinline__ void chunk_fma(const float *__restrict__ x, int M, int64_t ld,
                                          int64_t k0, const uint4 (&w)[R], const float (&s)[R],
                                          float (&acc)[MT][R]) {
    constexpr int CH = 128 / BITS;
    if constexpr (H * PIECE < CH) {
        float wf[R][PIECE];  // converted once, used for every row of x
#pragma unroll
        for (int r = 0; r < R; ++r) convert_piece<BITS, H>(w[r], wf[r]);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (m >= M) break;
            const float4 *xp = reinterpret_cast<const float4 *>(x + m * ld + k0 + H * PIECE);
            float xs[PIECE];
#pragma unroll
            for (int q = 0; q < PIECE / 4; ++q) {
                float4 v = __ldg(xp + q);
                xs[4 * q] = v.x; xs[4 * q + 1] = v.y; xs[4 * q + 2] = v.z; xs[4 * q + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float d = 0.0f;
#pragma unroll
                for (int j = 0; j < PIECE; ++j) d = fmaf(xs[j], wf[r][j], d);
                acc[m][r] = fmaf(s[r], d, acc[m][r]);
            }
        }
        chunk_fma<BITS, MT, H + 1>(x, M, ld, k0, w, s, acc);
    }
}

template <int BITS, int MT>
__global__ void __launch_bounds__(WARPS * 32)
fq_kernel(const float *__restrict__ x, int M, const uint8_t *__restrict__ w, int64_t N, int64_t K,
          int64_t ld, WeightScales ws, float *__restrict__ out) {
    constexpr int CH = 128 / BITS;  // values per 16-byte chunk
    constexpr int UNROLL = BITS == 8 ? 2 : 1;  // chunks in flight per lane (registers allow)
    __shared__ float partial[WARPS][MT][R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t n0 = (int64_t)blockIdx.x * R;
    const int64_t row_bytes = ld * BITS / 8, nchunks = (K + CH - 1) / CH;

    float acc[MT][R];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

    constexpr int STRIDE = WARPS * 32;
    for (int64_t c0 = threadIdx.x; c0 < nchunks; c0 += STRIDE * UNROLL) {
        uint4 wv[UNROLL][R];  // all loads issued before any use
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int64_t c = c0 + u * STRIDE;
                wv[u][r] = c < nchunks && n0 + r < N
                               ? __ldg(reinterpret_cast<const uint4 *>(w + (n0 + r) * row_bytes) + c)
                               : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t c = c0 + u * STRIDE;
            if (c >= nchunks) break;
            float s[R];
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] = ws.per_chunk ? ws.at(min(n0 + r, N - 1), c * CH) : 1.0f;
            chunk_fma<BITS, MT>(x, M, ld, c * CH, wv[u], s, acc);
        }
    }

#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int off = 16; off; off >>= 1) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], off);
            if (lane == 0) partial[warp][m][r] = acc[m][r];
        }
    __syncthreads();
    for (int i = threadIdx.x; i < MT * R; i += blockDim.x) {
        const int m = i / R, r = i % R;
        if (m >= M || n0 + r >= N) continue;
        float sum = 0.0f;
#pragma unroll
        for (int wi = 0; wi < WARPS; ++wi) sum += partial[wi][m][r];
        out[m * N + n0 + r] = ws.per_chunk ? sum : sum * ws.at(n0 + r, 0);
    }
}

template <int BITS>
qd_status launch_bits(const float *x, int M, const void *w, int64_t N, int64_t K, int64_t ld,
                      const WeightScales &ws, float *out, cudaStream_t s) {
    const unsigned blocks = (unsigned)qd::ceil_div(N, R);
    const auto *wb = static_cast<const uint8_t *>(w);
#define QD_FQ_LAUNCH(MT) fq_kernel<BITS, MT><<<blocks, WARPS * 32, 0, s>>>(x, M, wb, N, K, ld, ws, out)
    if (M <= 1) QD_FQ_LAUNCH(1);
    else if (M <= 2) QD_FQ_LAUNCH(2);
    else if (M <= 4) QD_FQ_LAUNCH(4);
    else if (M <= 8) QD_FQ_LAUNCH(8);
    else QD_FQ_LAUNCH(16);
#undef QD_FQ_LAUNCH
    return qd::launched();
}

}  // namespace

extern "C" int qd_cuda_fq_supported(int bits, int64_t K, int64_t block_k) {
    if (bits != 8 && bits != 4 && bits != 2) return 0;
    return block_k == K || block_k % (128 / bits) == 0;
}

extern "C" qd_status qd_cuda_fq_matmul(const float *x, int64_t M, const void *w, int bits,
                                       int64_t N, int64_t K, int64_t ld, const float *scales,
                                       int64_t block_n, int64_t block_k, float *out,
                                       void *stream) {
    if (!x || !w || !scales || !out) return QD_ERR_NULL;
    if (M <= 0 || N <= 0 || K <= 0 || block_n <= 0 || block_k <= 0 || N % block_n || K % block_k)
        return QD_ERR_SHAPE;
    if (ld % 64 || ld < K || !qd_cuda_fq_supported(bits, K, block_k)) return QD_ERR_ARGUMENT;
    if (N / R >= 0x7FFFFFFF) return QD_ERR_SHAPE;
    const WeightScales ws{scales, K / block_k, block_n, block_k, block_k != K};
    cudaStream_t s = qd::as_stream(stream);
    const bool mma = qd::fq_mma_usable();
    for (int64_t m = 0; m < M; m += MAX_M) {  // each slice streams the weights once
        const int rows = (int)(M - m < MAX_M ? M - m : MAX_M);
        const float *xs = x + m * ld;
        float *os = out + m * N;
        qd_status st = mma ? qd::fq_mma(xs, rows, w, bits, N, ld, ws, os, s)
                     : bits == 8 ? launch_bits<8>(xs, rows, w, N, K, ld, ws, os, s)
                     : bits == 4 ? launch_bits<4>(xs, rows, w, N, K, ld, ws, os, s)
                                 : launch_bits<2>(xs, rows, w, N, K, ld, ws, os, s);
        if (st != QD_OK) return st;
    }
    return QD_OK;
}
