// Shared by the CUDA kernels: status handling and small helpers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "qdispatch.h"

namespace qd {

// Records the CUDA error's text for qd_cuda_last_error(); out-of-memory maps to
// QD_ERR_NO_MEMORY so callers can tell it apart from a broken context.
qd_status cuda_failure(cudaError_t err);

// After a kernel launch: a launch error (bad configuration, no device) as a status.
inline qd_status launched() {
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? QD_OK : cuda_failure(err);
}

inline qd_status check(cudaError_t err) { return err == cudaSuccess ? QD_OK : cuda_failure(err); }

inline cudaStream_t as_stream(void *stream) { return static_cast<cudaStream_t>(stream); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Raises a kernel's dynamic shared-memory limit on the current device, once per
// device: `configured` holds a bit per device (setting it twice is harmless, so
// a racy bit is enough).
inline qd_status allow_dynamic_smem(const void *kernel, int bytes, unsigned long long *configured) {
    int device = 0;
    qd_status st = check(cudaGetDevice(&device));
    if (st != QD_OK) return st;
    const unsigned long long bit = 1ULL << (device & 63);
    if (device < 64 && (*configured & bit)) return QD_OK;
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

// Launches kernel<<<grid, block, smem, stream>>>(args...), early (see above) when `early`.
template <typename... Params, typename... Args>
qd_status launch(void (*kernel)(Params...), dim3 grid, dim3 block, int smem, cudaStream_t stream,
                 bool early, Args... args) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = (size_t)smem;
    config.stream = stream;
    config.attrs = &attr;
    config.numAttrs = early ? 1 : 0;
    return check(cudaLaunchKernelEx(&config, kernel, args...));
}

// Element i of a float32 / float16 / bfloat16 array `dst` set from a float,
// rounded to nearest even.  A bfloat16 NaN keeps a canonical quiet pattern, as
// the host conversion does.
__device__ inline void store_from_f32(void *dst, int dtype, int64_t i, float v) {
    switch (dtype) {
        case QD_CUDA_F16: static_cast<__half *>(dst)[i] = __float2half_rn(v); break;
        case QD_CUDA_BF16: {
            __nv_bfloat16_raw raw;
            raw.x = isnan(v) ? 0x7FC0 : __bfloat16_as_ushort(__float2bfloat16_rn(v));
            static_cast<__nv_bfloat16 *>(dst)[i] = raw;
            break;
        }
        default: static_cast<float *>(dst)[i] = v;
    }
}

// A grid for a grid-stride loop over n items.
inline unsigned grid_for(int64_t n, int threads) {
    int64_t blocks = ceil_div(n, threads);
    return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
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
