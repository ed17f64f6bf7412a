// Shared by the CUDA kernels: status handling and small helpers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <initializer_list>

#include "qd_checks.h"
#include "qdispatch.h"

namespace qd {

// Records the CUDA error's text for qd_cuda_last_error(); out-of-memory maps to
// QD_ERR_NO_MEMORY so callers can tell it apart from a broken context, no device
// or driver to QD_ERR_CUDA_UNAVAILABLE.
qd_status cuda_failure(cudaError_t err);

// After a kernel launch: a launch error (bad configuration, no device) as a status.
inline qd_status launched() {
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? QD_OK : cuda_failure(err);
}

inline qd_status check(cudaError_t err) { return err == cudaSuccess ? QD_OK : cuda_failure(err); }

inline cudaStream_t as_stream(void *stream) { return static_cast<cudaStream_t>(stream); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Devices that the per-device caches (shared-memory limits, plans, cluster fits)
// keep apart: one bit each in allow_dynamic_smem's mask.
constexpr int MAX_DEVICES = 64;

// Raises a kernel's dynamic shared-memory limit on the current device, once per
// device: `configured` holds a bit per device (setting it twice is harmless, so
// a racy bit is enough).
inline qd_status allow_dynamic_smem(const void *kernel, int bytes, unsigned long long *configured) {
    int device = 0;
    qd_status st = check(cudaGetDevice(&device));
    if (st != QD_OK) return st;
    static_assert(MAX_DEVICES <= 64, "one bit per device in a 64-bit mask");
    const bool tracked = device >= 0 && device < MAX_DEVICES;  // others set it every call
    const unsigned long long bit = tracked ? 1ULL << device : 0;
    if (tracked && (*configured & bit)) return QD_OK;
    st = check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (st == QD_OK) *configured |= bit;
    return st;
}

// Programmatic dependent launch (sm_90 on): a kernel launched with it may start
// while the kernel before it in the stream still runs.  Such a kernel does only
// work that no earlier kernel can affect before wait_for_prior_grids(), which
// returns once every earlier grid has finished and its writes are visible.
// allow_dependent_launch() lets the next such kernel start (it waits in turn).
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Thread-block clusters (sm_90 on): the blocks of a cluster run at the same time
// and may write each other's shared memory.  Every thread of every block of the
// cluster passes each barrier phase: arrive, then wait.
__device__ __forceinline__ unsigned cluster_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
#else
    return 1;
#endif
}
// Arrives at the cluster barrier; with `release`, this thread's writes before it
// (to any block's shared memory) are visible to threads after their wait.
template <bool RELEASE>
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (RELEASE) asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    else asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// *p = v in block `rank`'s shared memory, p being this block's address of the same variable.
__device__ __forceinline__ void store_in_block(float *p, unsigned rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t remote, local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
#endif
}

// Block `rank`'s float4 at p, p being this block's address of the same variable.
__device__ __forceinline__ float4 load_from_block(const float4 *p, unsigned rank) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t remote, local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote)
                 : "memory");
#endif
    return v;
}

// Whether `kernel`, as it runs on the current device, was compiled for sm_90 or
// newer (PTX 9.0 on): only then does it wait as above, so only then may it be
// launched early.
inline bool runs_sm90_code(const void *kernel) {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
        cudaGetLastError();  // not this call's to report: the launch says what is wrong
        return false;
    }
    return attr.ptxVersion >= 90;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), early (see above) when
// `early`, in clusters of `cluster` blocks unless that is 1 x 1 x 1.
template <typename... Params, typename... Args>
qd_status launch(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                 bool early, dim3 cluster, Args... args) {
    cudaLaunchAttribute attrs[2]{};
    cudaLaunchConfig_t config{};
    config.attrs = attrs;
    if (early) {
        attrs[config.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[config.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (cluster.x * cluster.y * cluster.z > 1) {
        attrs[config.numAttrs].id = cudaLaunchAttributeClusterDimension;
        attrs[config.numAttrs++].val.clusterDim = {cluster.x, cluster.y, cluster.z};
    }
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = (size_t)smem;
    config.stream = stream;
    return check(cudaLaunchKernelEx(&config, kernel, args...));
}

__host__ __device__ inline bool half_dtype(int dtype) { return dtype == QD_CUDA_F16 || dtype == QD_CUDA_BF16; }

// The bits of v as float16 or bfloat16 (dtype), rounded to nearest even.  A float16
// NaN keeps its payload's top 10 bits (a NaN still where those are 0) and its sign, as
// numpy and the host conversion give it (the hardware's gives one NaN for all); a
// bfloat16 NaN is the canonical quiet pattern, as the host conversion's.
__device__ inline unsigned short bits16_from_f32(int dtype, float v) {
    if (dtype == QD_CUDA_F16) {
        if (!isnan(v)) return __half_as_ushort(__float2half_rn(v));
        const uint32_t x = __float_as_uint(v), payload = (x & 0x7FFFFFu) >> 13;
        return (unsigned short)((x >> 16 & 0x8000u) | 0x7C00u | payload | (payload == 0));
    }
    return isnan(v) ? 0x7FC0 : __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// A float16's value as float32; a NaN keeps its sign and payload, as numpy's and the
// host conversion do (written out: the hardware's conversion need not keep them).
__device__ inline float f32_from_f16(__half h) {
    const uint32_t b = __half_as_ushort(h);
    if ((b & 0x7FFFu) <= 0x7C00u) return __half2float(h);
    return __uint_as_float((b & 0x8000u) << 16 | 0x7F800000u | (b & 0x3FFu) << 13);
}

// Element i of a float32 / float16 / bfloat16 array `src` as a float (exact).
__device__ inline float load_as_f32(const void *src, int dtype, int64_t i) {
    switch (dtype) {
        case QD_CUDA_F16: return f32_from_f16(static_cast<const __half *>(src)[i]);
        case QD_CUDA_BF16: return __bfloat162float(static_cast<const __nv_bfloat16 *>(src)[i]);
        default: return static_cast<const float *>(src)[i];
    }
}

// Element i of a float32 / float16 / bfloat16 array `dst` set from a float, as
// bits16_from_f32 rounds.
__device__ inline void store_from_f32(void *dst, int dtype, int64_t i, float v) {
    if (half_dtype(dtype)) static_cast<unsigned short *>(dst)[i] = bits16_from_f32(dtype, v);
    else static_cast<float *>(dst)[i] = v;
}

// 16 bytes at element i (dst + i 16-byte aligned): four float32 values of v, or
// eight float16 or bfloat16.
__device__ inline void store16_from_f32(void *dst, int dtype, int64_t i, const float *v) {
    if (!half_dtype(dtype)) {
        *reinterpret_cast<float4 *>(static_cast<float *>(dst) + i) = make_float4(v[0], v[1], v[2], v[3]);
        return;
    }
    uint32_t pairs[4];
    for (int j = 0; j < 4; ++j)
        pairs[j] = bits16_from_f32(dtype, v[2 * j]) | (uint32_t)bits16_from_f32(dtype, v[2 * j + 1]) << 16;
    *reinterpret_cast<uint4 *>(static_cast<unsigned short *>(dst) + i) = make_uint4(pairs[0], pairs[1], pairs[2],
                                                                                    pairs[3]);
}

// A grid for a grid-stride loop over n items.
inline unsigned grid_for(int64_t n, int threads) {
    int64_t blocks = ceil_div(n, threads);
    return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// ---- argument checks of the entry points (qd_checks.h holds those the CPU shares) ----
inline bool float_dtype(int dtype) { return dtype == QD_CUDA_F32 || half_dtype(dtype); }
inline size_t dtype_bytes(int dtype) { return half_dtype(dtype) ? 2 : dtype == QD_CUDA_S8 ? 1 : 4; }

// Bytes from the first element of `rows` rows of `cols` elements, `ld` apart, to
// past the last (0 when empty).  Sizes checked by qd_dims_fit(rows, ld, elem).
inline size_t span_bytes(int64_t rows, int64_t cols, int64_t ld, size_t elem) {
    return rows > 0 && cols > 0 ? (size_t)((rows - 1) * ld + cols) * elem : 0;
}

// A device array's bytes, for the overlap rule: no output may share a byte with
// an input or another output (the kernels would read what they had written).
struct Bytes {
    const void *p;
    size_t n;
};
inline bool overlaps_any(Bytes out, std::initializer_list<Bytes> others) {
    for (const Bytes &o : others)
        if (qd_overlap(out.p, out.n, o.p, o.n)) return true;
    return false;
}

// Quantized value range of a qd_value, as in the scheme table.
inline bool value_range(int value_kind, int *lo, int *hi) {
    static const int ranges[6][2] = {{-127, 127}, {-128, 127}, {-7, 7}, {-8, 7}, {-1, 1}, {-2, 1}};
    if (value_kind < 0 || value_kind > 5) return false;
    *lo = ranges[value_kind][0];
    *hi = ranges[value_kind][1];
    return true;
}

}  // namespace qd
