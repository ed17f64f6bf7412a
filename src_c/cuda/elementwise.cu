// Memory-bound helpers: casts, bias, transposes, padding, the packed_u32 store,
// dequantization, columns scaled, float32 cut into bfloat16 parts and added back,
// and the sums of splits of K added.  All are grid-stride loops over the output.
#include <algorithm>
#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "fq_tiles.cuh"
#include "split_sums.cuh"

namespace {

constexpr int kThreads = 256;

using qd::load_as_f32;
using qd::store_from_f32;

__global__ void cast_kernel(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        store_from_f32(dst, dst_dtype, i, load_as_f32(src, src_dtype, i));
}

// x = hi + mid + lo, each rounded to bfloat16 from what the parts before it left
// (exact for normal float32 values: 8 + 8 + 8 significant bits); an inf or NaN
// stays in hi.  The decode kernel cuts float32 x the same way.
__global__ void split_bf16_kernel(const float *x, int64_t rows, int64_t cols, int64_t ldx, __nv_bfloat16 *parts,
                                  int64_t ld) {
    const int64_t n = rows * ld;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / ld, c = i - r * ld;
        float v = c < cols ? x[r * ldx + c] : 0.0f;
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            const __nv_bfloat16 p = __float2bfloat16_rn(v);
            parts[part * n + i] = p;
            v -= __bfloat162float(p);
            if (!isfinite(v)) v = 0.0f;
        }
    }
}

// out = x * scales[c] per column, rounded once in float32 (x widened exactly first).
__global__ void scale_columns_kernel(const void *x, int x_dtype, int64_t rows, int64_t cols, int64_t ldx,
                                     const float *scales, float *out, int64_t ld) {
    const int64_t n = rows * ld;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / ld, c = i - r * ld;
        out[i] = c < cols ? __fmul_rn(load_as_f32(x, x_dtype, r * ldx + c), scales[c]) : 0.0f;
    }
}

__global__ void sum3_kernel(const float *a, int64_t n, void *out, int out_dtype) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        store_from_f32(out, out_dtype, i, __fadd_rn(__fadd_rn(a[i], a[n + i]), a[2 * n + i]));
}

// Four outputs a thread, each split's four read as one 16-byte load when n is a
// multiple of 4 (the splits then stay 16-byte aligned), and four splits' loads in
// flight at a time; the additions stay in split order.
// Launched early where it runs sm_90 code: its blocks are in place when the
// kernel that wrote the splits ends, and the next launch may start in turn
// (3-7% less time a call for the one-launch fq kernel's splits on an H200).
__global__ void add_split_sums_kernel(const float *__restrict__ partial, int splits, int64_t M, int64_t N,
                                      const float *__restrict__ col_scales, int64_t bn, int64_t ld, void *out,
                                      int out_dtype) {
    qd::allow_dependent_launch();
    qd::wait_for_prior_grids();  // the splits' sums come from the kernel before
    const int64_t n = M * N;
    const bool vector = n % 4 == 0;
    auto load = [&](int s, int64_t i) {
        if (vector) return __ldg(reinterpret_cast<const float4 *>(partial + s * n + i));
        const float *p = partial + s * n + i;
        return make_float4(p[0], i + 1 < n ? p[1] : 0.f, i + 2 < n ? p[2] : 0.f, i + 3 < n ? p[3] : 0.f);
    };
    auto add = [](float4 a, float4 b) {
        return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
    };
    for (int64_t i = 4 * (blockIdx.x * (int64_t)blockDim.x + threadIdx.x); i < n;
         i += 4 * (int64_t)gridDim.x * blockDim.x) {
        float4 total = load(0, i);
        int s = 1;
        for (; s + 4 <= splits; s += 4) {
            const float4 a = load(s, i), b = load(s + 1, i), c = load(s + 2, i), d = load(s + 3, i);
            total = add(add(add(add(total, a), b), c), d);
        }
        for (; s < splits; ++s) total = add(total, load(s, i));
        const float v[4] = {total.x, total.y, total.z, total.w};
        for (int e = 0; e < 4 && i + e < n; ++e)
            store_from_f32(out, out_dtype, i + e,
                           col_scales ? __fmul_rn(__ldg(col_scales + (i + e) % N / bn * ld), v[e]) : v[e]);
    }
}

__global__ void add_bias_kernel(const float *x, int64_t n, int64_t cols, const float *bias,
                                float *out) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = x[i] + bias[i % cols];
}

// 32x32 tiles through shared memory so that reads and writes are both coalesced;
// the +1 column avoids bank conflicts on the transposed read.  A block takes every
// gridDim.y-th tile of rows (the grid's y dimension stops at 65535).
template <typename T>
__global__ void transpose_kernel(const T *src, int64_t rows, int64_t cols, T *dst) {
    __shared__ T tile[32][33];
    const int64_t b = blockIdx.z;
    src += b * rows * cols;
    dst += b * rows * cols;
    const int64_t c0 = (int64_t)blockIdx.x * 32;
    for (int64_t r0 = (int64_t)blockIdx.y * 32; r0 < rows; r0 += (int64_t)gridDim.y * 32) {
        for (int i = threadIdx.y; i < 32; i += blockDim.y) {
            int64_t r = r0 + i, c = c0 + threadIdx.x;
            if (r < rows && c < cols) tile[i][threadIdx.x] = src[r * cols + c];
        }
        __syncthreads();
        for (int i = threadIdx.y; i < 32; i += blockDim.y) {
            int64_t c = c0 + i, r = r0 + threadIdx.x;
            if (r < rows && c < cols) dst[c * rows + r] = tile[threadIdx.x][i];
        }
        __syncthreads();  // the tile is read before the next one lands
    }
}

__global__ void pad_kernel(const int8_t *src, int64_t rows, int64_t cols, int8_t *dst,
                           int64_t dst_ld) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * dst_ld;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / dst_ld, c = i % dst_ld;
        dst[i] = c < cols ? src[r * cols + c] : 0;
    }
}

__global__ void pack_kernel(const int8_t *q, int64_t rows, int64_t cols, int bits,
                            uint32_t *words) {
    const int per = 32 / bits;
    const int64_t wpr = (cols + per - 1) / per;
    const uint32_t mask = (1u << bits) - 1u;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * wpr;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / wpr, c0 = (i % wpr) * per;
        uint32_t word = 0;
        for (int j = 0; j < per && c0 + j < cols; ++j)
            word |= ((uint32_t)(int32_t)q[r * cols + c0 + j] & mask) << (j * bits);
        words[i] = word;
    }
}

__device__ __forceinline__ int packed_value(const uint32_t *words, int64_t wpr, int64_t r,
                                            int64_t c, int bits) {
    const int per = 32 / bits;
    uint32_t word = words[r * wpr + c / per];
    int shift = 32 - bits - (int)(c % per) * bits;
    return (int32_t)(word << shift) >> (32 - bits);  // sign-extend the field
}

__global__ void unpack_kernel(const uint32_t *words, int64_t rows, int64_t cols, int bits,
                              int8_t *q) {
    const int64_t wpr = (cols + 32 / bits - 1) / (32 / bits);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * cols;
         i += (int64_t)gridDim.x * blockDim.x)
        q[i] = (int8_t)packed_value(words, wpr, i / cols, i % cols, bits);
}

// Value (r, c) of int8 values [rows, cols] (bits == 0) or of their packed_u32 store
// (wpr words a row).
__device__ __forceinline__ int stored_value(const void *values, int bits, int64_t wpr, int64_t cols, int64_t r,
                                            int64_t c) {
    return bits ? packed_value(static_cast<const uint32_t *>(values), wpr, r, c, bits)
                : static_cast<const int8_t *>(values)[r * cols + c];
}

// The W-bit fields of `word` from its lowest, sign-extended: n of them.
template <int W>
__device__ __forceinline__ void fields(uint32_t word, int n, int *q) {
#pragma unroll
    for (int j = 0; j < n; ++j) q[j] = (int32_t)(word << (32 - W * (j + 1))) >> (32 - W);
}

// Values (r, c .. c + WIDTH - 1) of a weight's store (stored_value) or of its decode
// tiles (fq_tiles.cuh), for dequantize_rows_kernel.  Four or eight at a time start
// at a multiple of WIDTH in rows of a multiple of WIDTH values: within one word of
// the store (two of 8-bit values), or WIDTH whole bytes of int8 values when
// `whole(WIDTH)`.
struct StoreValues {
    const void *values;
    int bits;
    int64_t wpr, cols;
    bool whole(int width) const { return bits || reinterpret_cast<uintptr_t>(values) % width == 0; }
    template <int WIDTH>
    __device__ void read(int64_t r, int64_t c, int *q) const {
        if constexpr (WIDTH == 1) {
            q[0] = stored_value(values, bits, wpr, cols, r, c);
        } else {
            static_assert(WIDTH == 4 || WIDTH == 8, "a store is read a value, four or eight at a time");
            if (bits == 0) {
                const int8_t *at = static_cast<const int8_t *>(values) + r * cols + c;
                if constexpr (WIDTH == 8) {
                    const uint2 w = *reinterpret_cast<const uint2 *>(at);
                    fields<8>(w.x, 4, q), fields<8>(w.y, 4, q + 4);
                } else {
                    fields<8>(*reinterpret_cast<const uint32_t *>(at), 4, q);
                }
                return;
            }
            const uint32_t *row = static_cast<const uint32_t *>(values) + r * wpr;
            if (bits == 8) {
                fields<8>(row[c / 4], 4, q);
                if constexpr (WIDTH == 8) fields<8>(row[c / 4 + 1], 4, q + 4);
            } else if (bits == 4) {  // c's field the word's lowest
                fields<4>(row[c / 8] >> (4 * (int)(c % 8)), WIDTH, q);
            } else {
                fields<2>(row[c / 16] >> (2 * (int)(c % 16)), WIDTH, q);
            }
        }
    }
};
StoreValues store_values(const void *values, int bits, int64_t cols) {
    return {values, bits, bits ? qd::ceil_div(cols, int64_t(32 / bits)) : 0, cols};
}

template <int BITS>
struct TileValues {
    const uint32_t *tiles;
    qd::fq::TileOrder<BITS> order;
    bool whole(int) const { return true; }
    template <int WIDTH>
    __device__ void read(int64_t r, int64_t c, int *q) const {
#pragma unroll
        for (int j = 0; j < WIDTH; ++j) q[j] = qd::fq::tile_value<BITS>(tiles, order, r, c + j);
    }
};

// Rows `ids` (every row in turn where ids is null) of value(r, c) * scale as float32
// (the reference's product, bit-identical) in out_dtype (rounded as the host casts).
// 2^lane_bits threads of a block (its lanes) take an output row at a time, its id
// and scale row read once, and share its columns with the lanes of the other blocks
// of their y (a few values a thread: a lookup of one row is not one block's chain of
// loads); a block takes blockDim.x / lanes rows at once, so narrow rows leave no
// thread idle.  WIDTH 4 or 8: a thread's values are one 16-byte store (four float32
// or eight 16-bit values, so that each store of a warp fills whole sectors), read
// from one word of 4-bit values.  An id outside [0, rows) gives a row of NaN, not
// another row's values.  I: the column type (32 bits below 2^30 columns).  NARROW:
// lanes fewer than the block's threads (else a block's row is uniform, and a
// thread's work, often one store, has no per-thread row to find).
template <int WIDTH, bool NARROW, typename I, typename Values>
__global__ void dequantize_rows_kernel(Values value, int64_t rows, I cols, const float *scales, int64_t br, I bc,
                                       const int64_t *ids, int64_t n, void *out, int out_dtype, int lane_bits) {
    const I gc = cols / bc;
    const bool one_scale = bc % WIDTH == 0;  // a thread's values share a scale
    // shifts, not divisions: a thread's whole work may be one store
    const int lanes = NARROW ? 1 << lane_bits : blockDim.x, rows_at_once = NARROW ? blockDim.x >> lane_bits : 1;
    const int lane = NARROW ? threadIdx.x & (lanes - 1) : threadIdx.x;
    for (int64_t o = blockIdx.x * (int64_t)rows_at_once + (NARROW ? threadIdx.x >> lane_bits : 0); o < n;
         o += (int64_t)gridDim.x * rows_at_once) {
        const int64_t r = ids ? ids[o] : o;
        const bool inside = r >= 0 && r < rows;
        const float *scale_row = scales + (inside ? r / br : 0) * gc;
        for (I c = WIDTH * (blockIdx.y * lanes + lane); c < cols; c += WIDTH * lanes * gridDim.y) {
            int q[WIDTH];
            float v[WIDTH];
            if (inside) value.template read<WIDTH>(r, c, q);
            const float scale = inside ? scale_row[c / bc] : 0.f;
#pragma unroll
            for (int j = 0; j < WIDTH; ++j)
                v[j] = inside ? (float)q[j] * (one_scale ? scale : scale_row[(c + j) / bc])
                              : __int_as_float(0x7FC00000);  // quiet NaN
            if constexpr (WIDTH == 1) qd::store_from_f32(out, out_dtype, o * (int64_t)cols + c, v[0]);
            else qd::store16_from_f32(out, out_dtype, o * (int64_t)cols + c, v);
        }
    }
}

template <int WIDTH, typename Values>
qd_status launch_dequantize_rows_of(Values value, int64_t rows, int64_t cols, const float *scales, int64_t br,
                                    int64_t bc, const int64_t *ids, int64_t n, void *out, int out_dtype,
                                    cudaStream_t s) {
    constexpr int64_t PER_THREAD = WIDTH < 4 ? 4 : WIDTH;  // values of a row per thread
    int lane_bits = 0;  // 2^lane_bits threads a row: enough for PER_THREAD values each, up to a block
    while ((1 << lane_bits) < kThreads && (int64_t(1) << lane_bits) * PER_THREAD < cols) ++lane_bits;
    const int64_t lanes = int64_t(1) << lane_bits;
    const dim3 grid((unsigned)std::min<int64_t>(qd::ceil_div(n, int64_t(kThreads / lanes)), 65535),  // in turn past that
                    (unsigned)std::min<int64_t>(qd::ceil_div(cols, lanes * PER_THREAD), 65535));
    if (cols >= (int64_t(1) << 30))  // column indices near 32 bits' end (and rows of a whole block)
        dequantize_rows_kernel<WIDTH, false, int64_t><<<grid, kThreads, 0, s>>>(value, rows, cols, scales, br, bc,
                                                                               ids, n, out, out_dtype, lane_bits);
    else if (lanes == kThreads)
        dequantize_rows_kernel<WIDTH, false, int32_t><<<grid, kThreads, 0, s>>>(
            value, rows, (int32_t)cols, scales, br, (int32_t)bc, ids, n, out, out_dtype, lane_bits);
    else
        dequantize_rows_kernel<WIDTH, true, int32_t><<<grid, kThreads, 0, s>>>(
            value, rows, (int32_t)cols, scales, br, (int32_t)bc, ids, n, out, out_dtype, lane_bits);
    return qd::launched();
}

// A 16-byte store a thread where rows are whole stores (and whole words or bytes of
// the values, `whole`); a value a thread otherwise.
template <typename Values>
qd_status launch_dequantize_rows(Values value, int64_t rows, int64_t cols, const float *scales, int64_t br,
                                 int64_t bc, const int64_t *ids, int64_t n, void *out, int out_dtype,
                                 cudaStream_t s) {
    const int width = 16 / (int)qd::dtype_bytes(out_dtype);
    if (cols % width == 0 && value.whole(width) && reinterpret_cast<uintptr_t>(out) % 16 == 0)
        return width == 8 ? launch_dequantize_rows_of<8>(value, rows, cols, scales, br, bc, ids, n, out, out_dtype, s)
                          : launch_dequantize_rows_of<4>(value, rows, cols, scales, br, bc, ids, n, out, out_dtype, s);
    return launch_dequantize_rows_of<1>(value, rows, cols, scales, br, bc, ids, n, out, out_dtype, s);
}

bool packed_bits(int bits) { return bits == 2 || bits == 4 || bits == 8; }
// Bytes of the packed_u32 store of rows x cols `bits`-bit values.
size_t packed_bytes(int64_t rows, int64_t cols, int bits) {
    return (size_t)(rows * qd::ceil_div(cols, 32 / bits)) * sizeof(uint32_t);
}

}  // namespace

using qd::as_stream;
using qd::Bytes;
using qd::dtype_bytes;
using qd::float_dtype;
using qd::grid_for;
using qd::overlaps_any;
using qd::span_bytes;

extern "C" qd_status qd_cuda_cast(const void *src, int src_dtype, void *dst, int dst_dtype,
                                  int64_t n, void *stream) {
    if (!src || !dst) return QD_ERR_NULL;
    if (!float_dtype(src_dtype) || !float_dtype(dst_dtype) || n < 0) return QD_ERR_ARGUMENT;
    if (!qd_dims_fit(1, n, sizeof(float))) return QD_ERR_ARGUMENT;
    if (overlaps_any({dst, n * dtype_bytes(dst_dtype)}, {{src, n * dtype_bytes(src_dtype)}})) return QD_ERR_ARGUMENT;
    if (n == 0) return QD_OK;
    cast_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(src, src_dtype, dst,
                                                                            dst_dtype, n);
    return qd::launched();
}

extern "C" qd_status qd_cuda_split_bf16(const float *x, int64_t rows, int64_t cols, int64_t ldx, void *parts,
                                        int64_t ld, void *stream) {
    if (!x || !parts) return QD_ERR_NULL;
    if (rows < 0 || cols < 0) return QD_ERR_SHAPE;
    if (ldx < cols || ld < cols) return QD_ERR_ARGUMENT;
    if (!qd_dims_fit(rows, ldx, sizeof(float)) || !qd_dims_fit(rows, ld, 3 * sizeof(__nv_bfloat16)) ||
        overlaps_any({parts, (size_t)(rows * ld) * 3 * sizeof(__nv_bfloat16)}, {{x, span_bytes(rows, cols, ldx, 4)}}))
        return QD_ERR_ARGUMENT;
    if (rows * ld == 0) return QD_OK;
    split_bf16_kernel<<<grid_for(rows * ld, kThreads), kThreads, 0, as_stream(stream)>>>(
        x, rows, cols, ldx, static_cast<__nv_bfloat16 *>(parts), ld);
    return qd::launched();
}

extern "C" qd_status qd_cuda_scale_columns(const void *x, int x_dtype, int64_t rows, int64_t cols, int64_t ldx,
                                           const float *scales, float *out, int64_t ld, void *stream) {
    if (!x || !scales || !out) return QD_ERR_NULL;
    if (!float_dtype(x_dtype)) return QD_ERR_ARGUMENT;
    if (rows < 0 || cols < 0) return QD_ERR_SHAPE;
    if (ldx < cols || ld < cols) return QD_ERR_ARGUMENT;
    if (!qd_dims_fit(rows, ldx, dtype_bytes(x_dtype)) || !qd_dims_fit(rows, ld, sizeof(float)) ||
        overlaps_any({out, (size_t)(rows * ld) * sizeof(float)},
                     {{x, span_bytes(rows, cols, ldx, dtype_bytes(x_dtype))}, {scales, cols * sizeof(float)}}))
        return QD_ERR_ARGUMENT;
    if (rows * ld == 0) return QD_OK;
    scale_columns_kernel<<<grid_for(rows * ld, kThreads), kThreads, 0, as_stream(stream)>>>(
        x, x_dtype, rows, cols, ldx, scales, out, ld);
    return qd::launched();
}

extern "C" qd_status qd_cuda_sum3_f32(const float *a, int64_t n, void *out, int out_dtype, void *stream) {
    if (!a || !out) return QD_ERR_NULL;
    if (!float_dtype(out_dtype) || n < 0) return QD_ERR_ARGUMENT;
    if (!qd_dims_fit(1, n, 3 * sizeof(float))) return QD_ERR_ARGUMENT;
    if (overlaps_any({out, n * dtype_bytes(out_dtype)}, {{a, 3 * n * sizeof(float)}})) return QD_ERR_ARGUMENT;
    if (n == 0) return QD_OK;
    sum3_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(a, n, out, out_dtype);
    return qd::launched();
}

namespace {

// Whether add_split_sums_kernel runs sm_90 code on the current device (asked once
// per device): only then does it wait for the kernel before it, so only then may
// it launch early.
bool add_launches_early() {
    static std::atomic<signed char> known[qd::MAX_DEVICES];  // 0: not asked yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= qd::MAX_DEVICES) {
        cudaGetLastError();  // the launch reports what is wrong
        return false;
    }
    signed char v = known[dev].load(std::memory_order_relaxed);
    if (v == 0) {
        v = qd::runs_sm90_code((const void *)add_split_sums_kernel) ? 1 : -1;
        known[dev].store(v, std::memory_order_relaxed);
    }
    return v > 0;
}

}  // namespace

qd_status qd::add_split_sums(const float *partial, int splits, int64_t M, int64_t N, const float *col_scales,
                             int64_t bn, int64_t ld, void *out, int out_dtype, cudaStream_t stream) {
    return launch(add_split_sums_kernel, dim3(grid_for(ceil_div(M * N, 4), kThreads)), dim3(kThreads), 0, stream,
                  add_launches_early(), dim3(1, 1, 1), partial, splits, M, N, col_scales, bn, ld, out, out_dtype);
}

extern "C" qd_status qd_cuda_add_bias_f32(const float *x, int64_t rows, int64_t cols,
                                          const float *bias, float *out, void *stream) {
    if (!x || !bias || !out) return QD_ERR_NULL;
    if (rows <= 0 || cols <= 0) return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, sizeof(float))) return QD_ERR_ARGUMENT;
    const Bytes o{out, (size_t)(rows * cols) * sizeof(float)};
    if (overlaps_any(o, {{bias, cols * sizeof(float)}}) || (out != x && overlaps_any(o, {{x, o.n}})))
        return QD_ERR_ARGUMENT;  // in place (out == x) is fine: each element is read, then written
    add_bias_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, as_stream(stream)>>>(
        x, rows * cols, cols, bias, out);
    return qd::launched();
}

extern "C" qd_status qd_cuda_transpose(const void *src, int64_t batch, int64_t rows, int64_t cols,
                                       int elem_size, void *dst, void *stream) {
    if (!src || !dst) return QD_ERR_NULL;
    if (elem_size != 1 && elem_size != 2 && elem_size != 4) return QD_ERR_ARGUMENT;
    if (batch <= 0 || rows <= 0 || cols <= 0 || batch > 65535) return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, batch * elem_size)) return QD_ERR_ARGUMENT;
    const size_t bytes = (size_t)(batch * rows * cols) * elem_size;
    if (overlaps_any({dst, bytes}, {{src, bytes}})) return QD_ERR_ARGUMENT;
    // row tiles past the grid's y limit are taken in turn
    dim3 grid((unsigned)qd::ceil_div(cols, 32), (unsigned)std::min<int64_t>(qd::ceil_div(rows, 32), 65535),
              (unsigned)batch);
    dim3 block(32, 8);
    cudaStream_t s = as_stream(stream);
    switch (elem_size) {
        case 1: transpose_kernel<<<grid, block, 0, s>>>((const int8_t *)src, rows, cols, (int8_t *)dst); break;
        case 2: transpose_kernel<<<grid, block, 0, s>>>((const uint16_t *)src, rows, cols, (uint16_t *)dst); break;
        default: transpose_kernel<<<grid, block, 0, s>>>((const uint32_t *)src, rows, cols, (uint32_t *)dst);
    }
    return qd::launched();
}

extern "C" qd_status qd_cuda_pad_s8(const int8_t *src, int64_t rows, int64_t cols, int8_t *dst,
                                    int64_t dst_ld, void *stream) {
    if (!src || !dst) return QD_ERR_NULL;
    if (rows <= 0 || cols <= 0) return QD_ERR_SHAPE;
    if (dst_ld < cols) return QD_ERR_ARGUMENT;
    if (!qd_dims_fit(rows, dst_ld, 1) || overlaps_any({dst, (size_t)(rows * dst_ld)}, {{src, (size_t)(rows * cols)}}))
        return QD_ERR_ARGUMENT;
    pad_kernel<<<grid_for(rows * dst_ld, kThreads), kThreads, 0, as_stream(stream)>>>(
        src, rows, cols, dst, dst_ld);
    return qd::launched();
}

extern "C" qd_status qd_cuda_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits,
                                      uint32_t *words, void *stream) {
    if (!q || !words) return QD_ERR_NULL;
    if (!packed_bits(bits)) return QD_ERR_SCHEME;
    if (rows <= 0 || cols <= 0) return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, 1)) return QD_ERR_ARGUMENT;
    int64_t n = rows * qd::ceil_div(cols, 32 / bits);
    if (overlaps_any({words, packed_bytes(rows, cols, bits)}, {{q, (size_t)(rows * cols)}})) return QD_ERR_ARGUMENT;
    pack_kernel<<<grid_for(n, kThreads), kThreads, 0, as_stream(stream)>>>(q, rows, cols, bits, words);
    return qd::launched();
}

extern "C" qd_status qd_cuda_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols,
                                        int bits, int8_t *q, void *stream) {
    if (!q || !words) return QD_ERR_NULL;
    if (!packed_bits(bits)) return QD_ERR_SCHEME;
    if (rows <= 0 || cols <= 0) return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, 1)) return QD_ERR_ARGUMENT;
    if (overlaps_any({q, (size_t)(rows * cols)}, {{words, packed_bytes(rows, cols, bits)}})) return QD_ERR_ARGUMENT;
    unpack_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, as_stream(stream)>>>(
        words, rows, cols, bits, q);
    return qd::launched();
}

namespace {

// The checks qd_cuda_dequantize and the row lookups share, for n rows of out_dtype
// out (ids null: every row in turn, n == rows).  values: the store (bits 0, or
// packed_u32 words of `bits`), or with `tiled` the weight's decode tiles.
qd_status dequantize_checks(const void *values, int bits, bool tiled, int64_t rows, int64_t cols,
                            const float *scales, int64_t block_rows, int64_t block_cols, const int64_t *ids,
                            int64_t n, void *out, int out_dtype) {
    if (!values || !scales || !out) return QD_ERR_NULL;
    if (tiled ? !packed_bits(bits) : bits != 0 && !packed_bits(bits)) return QD_ERR_SCHEME;
    if (!qd::float_dtype(out_dtype)) return QD_ERR_ARGUMENT;
    if (rows <= 0 || cols <= 0 || n <= 0 || block_rows <= 0 || block_cols <= 0 || rows % block_rows ||
        cols % block_cols || (!ids && n != rows))
        return QD_ERR_SHAPE;
    const size_t out_size = qd::dtype_bytes(out_dtype);
    if (!qd_dims_fit(rows, cols, sizeof(float)) || !qd_dims_fit(n, cols, out_size)) return QD_ERR_ARGUMENT;
    const size_t value_bytes = tiled  ? (size_t)qd_cuda_fq_tiles_bytes(rows, cols, bits)
                               : bits ? packed_bytes(rows, cols, bits)
                                      : (size_t)(rows * cols);
    const size_t scale_bytes = (size_t)(rows / block_rows * (cols / block_cols)) * sizeof(float);
    const size_t id_bytes = ids ? (size_t)n * sizeof(int64_t) : 0;
    if (overlaps_any({out, (size_t)(n * cols) * out_size}, {{values, value_bytes}, {scales, scale_bytes}, {ids, id_bytes}}))
        return QD_ERR_ARGUMENT;
    return QD_OK;
}

}  // namespace

extern "C" qd_status qd_cuda_dequantize(const void *values, int bits, int64_t rows, int64_t cols,
                                        const float *scales, int64_t block_rows,
                                        int64_t block_cols, float *out, void *stream) {
    const qd_status st =
        dequantize_checks(values, bits, false, rows, cols, scales, block_rows, block_cols, nullptr, rows, out,
                          QD_CUDA_F32);
    if (st != QD_OK) return st;
    return launch_dequantize_rows(store_values(values, bits, cols), rows, cols, scales, block_rows, block_cols,
                                  nullptr, rows, out, QD_CUDA_F32, as_stream(stream));
}

extern "C" qd_status qd_cuda_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols,
                                             const float *scales, int64_t block_rows, int64_t block_cols,
                                             const int64_t *ids, int64_t n, void *out, int out_dtype,
                                             void *stream) {
    const qd_status st = dequantize_checks(values, bits, false, rows, cols, scales, block_rows, block_cols, ids, n,
                                           out, out_dtype);
    if (st != QD_OK) return st;
    return launch_dequantize_rows(store_values(values, bits, cols), rows, cols, scales, block_rows, block_cols, ids,
                                  n, out, out_dtype, as_stream(stream));
}

extern "C" qd_status qd_cuda_fq_dequantize_rows(const void *tiles, int bits, int64_t N, int64_t K,
                                                const float *scales, int64_t block_rows, int64_t block_cols,
                                                const int64_t *ids, int64_t n, void *out, int out_dtype,
                                                void *stream) {
    const qd_status st =
        dequantize_checks(tiles, bits, true, N, K, scales, block_rows, block_cols, ids, n, out, out_dtype);
    if (st != QD_OK) return st;
    const uint32_t *words = static_cast<const uint32_t *>(tiles);
    cudaStream_t s = as_stream(stream);
    auto launch_bits = [&](auto value) {
        value.tiles = words;
        value.order = {qd::ceil_div(N, int64_t(16)), qd::ceil_div(K, qd::fq::tile_k(bits))};
        return launch_dequantize_rows(value, N, K, scales, block_rows, block_cols, ids, n, out, out_dtype, s);
    };
    return bits == 8 ? launch_bits(TileValues<8>{}) : bits == 4 ? launch_bits(TileValues<4>{}) : launch_bits(TileValues<2>{});
}
