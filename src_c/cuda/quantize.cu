// Quantization on the GPU, bit-identical to the reference: per-block amax, the
// scale in float32 (IEEE division) rounded up to its stored dtype, then
// q = clamp(rint(x / scale)) with a true division.  Built without fast-math.
// float16 and bfloat16 x are read as they are, each value widened (exactly) as it
// loads: no float32 copy, which for a large weight would need twice its bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kSegment = 1024;        // columns one warp reduces before its atomic
constexpr uint64_t kNone = 0x7F7F7F7F7F7F7F7FULL;  // the scratch's memset pattern: "no bad index"

struct Blocking {
    int64_t rows, cols, br, bc;
    __host__ __device__ int64_t grid_cols() const { return cols / bc; }
    __host__ __device__ int64_t scale_of(int64_t r, int64_t c) const {
        return (r / br) * grid_cols() + c / bc;
    }
};

// One warp per (row, column block, segment of the block): a warp max, then one
// atomic per block (non-negative floats order like their bit patterns).  The
// first non-finite input, in flat order, goes to *bad.
__global__ void amax_kernel(const void *x, int x_dtype, Blocking b, int64_t segs_per_block, float *amax,
                            unsigned long long *bad) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
    const int64_t segs_per_row = b.grid_cols() * segs_per_block;
    if (warp >= b.rows * segs_per_row) return;  // whole warps exit together
    const int64_t r = warp / segs_per_row, rem = warp % segs_per_row;
    const int64_t cb = rem / segs_per_block;
    const int64_t begin = cb * b.bc + (rem % segs_per_block) * kSegment;
    const int64_t end = min(begin + kSegment, (cb + 1) * b.bc);
    float m = 0.0f;
    unsigned long long first_bad = kNone;
    for (int64_t c = begin + lane; c < end; c += 32) {
        const float v = qd::load_as_f32(x, x_dtype, r * b.cols + c);
        if (isfinite(v)) m = fmaxf(m, fabsf(v));
        else if (first_bad == kNone) first_bad = (unsigned long long)(r * b.cols + c);
    }
    for (int off = 16; off; off >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        first_bad = min(first_bad, __shfl_xor_sync(0xffffffffu, first_bad, off));
    }
    if (lane == 0) {
        if (m > 0.0f) atomicMax(reinterpret_cast<unsigned *>(amax + b.scale_of(r, begin)), __float_as_uint(m));
        if (first_bad != kNone) atomicMin(bad, first_bad);
    }
}

// The smallest value of the scale dtype that is >= s (as float32).
__device__ float round_up(float s, int scale_dtype) {
    if (scale_dtype == QD_SCALE_F16) {
        __half h = __float2half_rn(s);
        if (__half2float(h) < s) h = __ushort_as_half(__half_as_ushort(h) + 1);  // s > 0
        return __half2float(h);
    }
    if (scale_dtype == QD_SCALE_BF16) {
        unsigned bits = __float_as_uint(s), truncated = bits & 0xFFFF0000u;
        return __uint_as_float(truncated != bits ? truncated + 0x10000u : truncated);
    }
    return s;
}

// amax -> stored scale, in place.  A scale that is not finite in its dtype is an overflow.
__global__ void scale_kernel(float *scales, int64_t n, float range, int scale_dtype,
                             unsigned long long *bad) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float amax = scales[i];
        // amax / (range/2): the rounding of 2*amax/range, without 2*amax overflowing
        float s = amax == 0.0f ? 1.0f : __fdiv_rn(amax, __fmul_rn(0.5f, range));
        if (s == 0.0f) s = 0x1p-149f;  // a tiny amax underflows: rounding up gives the smallest subnormal
        s = round_up(s, scale_dtype);
        if (!isfinite(s)) atomicMin(bad, (unsigned long long)i);
        scales[i] = s;
    }
}

// Columns along x, rows along y (blockDim.y rows a block, each thread taking rows
// in turn).  A thread finds its column's block of scales once, and a row's with a
// 32-bit division (none for a scale per row): 64-bit divisions are long routines,
// and a flat index's, several a value, set the pace.
__global__ void quantize_kernel(const void *x, int x_dtype, Blocking b, const float *scales, float lo,
                                float hi, int8_t *q) {
    const int64_t grid_cols = b.grid_cols();
    const bool narrow = b.rows <= 0xFFFFFFFFll;
    for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < b.cols;
         c += (int64_t)gridDim.x * blockDim.x) {
        const float *column_scales = scales + c / b.bc;
        for (int64_t r = blockIdx.y * (int64_t)blockDim.y + threadIdx.y; r < b.rows;
             r += (int64_t)gridDim.y * blockDim.y) {
            const int64_t scale_row = b.br == 1 ? r : narrow ? (int64_t)((uint32_t)r / (uint32_t)b.br) : r / b.br;
            const float v = rintf(__fdiv_rn(qd::load_as_f32(x, x_dtype, r * b.cols + c),
                                            column_scales[scale_row * grid_cols]));
            q[r * b.cols + c] = (int8_t)fminf(fmaxf(v, lo), hi);
        }
    }
}

}  // namespace

extern "C" qd_status qd_cuda_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols,
                                      int value_kind, int64_t block_rows, int64_t block_cols,
                                      int scale_dtype, float *scales, int8_t *q,
                                      void *scratch, int64_t *bad_index, void *stream) {
    if (!x || !scales || !q || !scratch) return QD_ERR_NULL;
    if (!qd::float_dtype(x_dtype)) return QD_ERR_ARGUMENT;
    if (reinterpret_cast<uintptr_t>(scratch) % 8) return QD_ERR_ARGUMENT;  // 64-bit atomics: a fault otherwise
    int lo, hi;
    if (!qd::value_range(value_kind, &lo, &hi) || scale_dtype < QD_SCALE_F32 ||
        scale_dtype > QD_SCALE_BF16)
        return QD_ERR_SCHEME;
    if (rows <= 0 || cols <= 0 || block_rows <= 0 || block_cols <= 0 || rows % block_rows ||
        cols % block_cols)
        return QD_ERR_SHAPE;
    const size_t x_size = qd::dtype_bytes(x_dtype);
    if (!qd_dims_fit(rows, cols, x_size)) return QD_ERR_ARGUMENT;
    const Blocking b{rows, cols, block_rows, block_cols};
    const int64_t n_scales = (rows / block_rows) * b.grid_cols();
    const qd::Bytes xb{x, (size_t)(rows * cols) * x_size}, qb{q, (size_t)(rows * cols)},
        sb{scales, n_scales * sizeof(float)}, scratch_b{scratch, QD_CUDA_QUANTIZE_SCRATCH};
    if (qd::overlaps_any(qb, {xb, sb, scratch_b}) || qd::overlaps_any(sb, {xb, scratch_b}) ||
        qd::overlaps_any(scratch_b, {xb}))
        return QD_ERR_ARGUMENT;
    auto *bad = static_cast<unsigned long long *>(scratch);  // [0]: non-finite input, [1]: overflow
    cudaStream_t s = qd::as_stream(stream);
    qd_status st;
    if ((st = qd::check(cudaMemsetAsync(scratch, 0x7F, QD_CUDA_QUANTIZE_SCRATCH, s))) != QD_OK) return st;
    if ((st = qd::check(cudaMemsetAsync(scales, 0, n_scales * sizeof(float), s))) != QD_OK) return st;

    const int64_t segs_per_block = qd::ceil_div(block_cols, kSegment);
    const int64_t warps = rows * b.grid_cols() * segs_per_block;
    const int64_t blocks = qd::ceil_div(warps * 32, kThreads);
    if (blocks > 0x7FFFFFFF) return QD_ERR_SHAPE;
    amax_kernel<<<(unsigned)blocks, kThreads, 0, s>>>(x, x_dtype, b, segs_per_block, scales, bad);
    if ((st = qd::launched()) != QD_OK) return st;
    scale_kernel<<<qd::grid_for(n_scales, kThreads), kThreads, 0, s>>>(
        scales, n_scales, (float)(hi - lo), scale_dtype, bad + 1);
    if ((st = qd::launched()) != QD_OK) return st;

    // Bad input must be reported before values are produced, so wait for the checks.
    unsigned long long found[2];
    if ((st = qd::check(cudaMemcpyAsync(found, scratch, sizeof found, cudaMemcpyDeviceToHost, s))) != QD_OK) return st;
    if ((st = qd::check(cudaStreamSynchronize(s))) != QD_OK) return st;
    if (found[0] != kNone) {
        if (bad_index) *bad_index = (int64_t)found[0];
        return QD_ERR_NOT_FINITE;
    }
    if (found[1] != kNone) {
        if (bad_index) *bad_index = (int64_t)found[1];
        return QD_ERR_SCALE_OVERFLOW;
    }
    // a warp's columns at least; narrower rows share a block
    const int row_threads = (int)std::min<int64_t>(kThreads, qd::ceil_div(cols, 32) * 32);
    const dim3 block(row_threads, kThreads / row_threads);
    // About 4096 blocks in all, so that each thread takes many rows: with one value a
    // thread, its setup (the divisions in the kernel's first lines) set the pace.
    const unsigned grid_x = qd::grid_for(cols, row_threads);
    const dim3 grid(grid_x, (unsigned)std::min<int64_t>(qd::ceil_div(rows, block.y), std::max(1u, 4096u / grid_x)));
    quantize_kernel<<<grid, block, 0, s>>>(
        x, x_dtype, b, scales, (float)lo, (float)hi, q);
    return qd::launched();
}

extern "C" qd_status qd_cuda_largest_magnitude(const float *x, int64_t n, float *largest, void *scratch,
                                               void *stream) {
    if (!x || !largest || !scratch) return QD_ERR_NULL;
    if (reinterpret_cast<uintptr_t>(scratch) % 8) return QD_ERR_ARGUMENT;
    if (n <= 0) return QD_ERR_SHAPE;
    if (!qd_dims_fit(1, n, sizeof(float))) return QD_ERR_ARGUMENT;
    if (qd::overlaps_any(qd::Bytes{scratch, QD_CUDA_QUANTIZE_SCRATCH}, {qd::Bytes{x, (size_t)n * sizeof(float)}}))
        return QD_ERR_ARGUMENT;
    auto *amax = static_cast<float *>(scratch);  // [0]: the largest, [1]: the first non-finite value
    auto *bad = static_cast<unsigned long long *>(scratch) + 1;
    cudaStream_t s = qd::as_stream(stream);
    qd_status st;
    if ((st = qd::check(cudaMemsetAsync(amax, 0, sizeof(float), s))) != QD_OK) return st;
    if ((st = qd::check(cudaMemsetAsync(bad, 0x7F, sizeof *bad, s))) != QD_OK) return st;
    // x as one row in one block: the amax kernel's warps each take a segment of it
    const Blocking b{1, n, 1, n};
    const int64_t segs = qd::ceil_div(n, kSegment), blocks = qd::ceil_div(segs * 32, kThreads);
    if (blocks > 0x7FFFFFFF) return QD_ERR_SHAPE;
    amax_kernel<<<(unsigned)blocks, kThreads, 0, s>>>(x, QD_CUDA_F32, b, segs, amax, bad);
    if ((st = qd::launched()) != QD_OK) return st;
    unsigned long long found[2];
    if ((st = qd::check(cudaMemcpyAsync(found, scratch, sizeof found, cudaMemcpyDeviceToHost, s))) != QD_OK) return st;
    if ((st = qd::check(cudaStreamSynchronize(s))) != QD_OK) return st;
    if (found[1] != kNone) return QD_ERR_NOT_FINITE;
    std::memcpy(largest, found, sizeof(float));  // scratch's first 4 bytes, as copied
    return QD_OK;
}

extern "C" qd_status qd_cuda_quantize_f32(const float *x, int64_t rows, int64_t cols,
                                          int value_kind, int64_t block_rows, int64_t block_cols,
                                          int scale_dtype, float *scales, int8_t *q,
                                          void *scratch, int64_t *bad_index, void *stream) {
    return qd_cuda_quantize(x, QD_CUDA_F32, rows, cols, value_kind, block_rows, block_cols, scale_dtype, scales, q,
                            scratch, bad_index, stream);
}
