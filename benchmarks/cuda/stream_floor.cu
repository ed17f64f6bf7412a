// The floor under the decode kernel: how long reading 8, 16 and 45 MB once takes,
// per launch back to back, for a plain vectorized read, the per-warp cp.async ring
// of 512-byte tiles that fq_matmul.cu uses, and per-warp bulk (TMA 1-D) copies.
//
//   mkdir -p build && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//     benchmarks/cuda/stream_floor.cu -o build/stream_floor && build/stream_floor
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(2); } } while (0)

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// (a) grid-stride, U uint4 per thread in flight
template <int U>
__global__ void plain(const uint4 *__restrict__ p, int64_t n, unsigned *sink) {
    uint32_t acc = 0;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = i + u * stride < n ? __ldcs(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x12345678) *sink = acc;
}

// (b) per-warp contiguous runs of 512-byte tiles, cp.async ring of R per lane
template <int R>
__global__ void ring_cpasync(const uint4 *__restrict__ p, int64_t tiles_per_warp, unsigned *sink) {
    extern __shared__ uint4 sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t gw = blockIdx.x * (int64_t)(blockDim.x / 32) + warp;
    const uint4 *src = p + gw * tiles_per_warp * 32 + lane;
    uint4 *slots = sm + warp * R * 32 + lane;
    for (int d = 0; d < R; ++d) {
        if (d < tiles_per_warp)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(slots + d * 32)), "l"(src + d * 32));
        asm volatile("cp.async.commit_group;\n");
    }
    uint32_t acc = 0;
    for (int64_t i = 0; i < tiles_per_warp; ++i) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(R - 1));
        uint4 v = slots[(i % R) * 32];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
        if (i + R < tiles_per_warp)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(slots + (i % R) * 32)), "l"(src + (i + R) * 32));
        asm volatile("cp.async.commit_group;\n");
    }
    if (acc == 0x12345678) *sink = acc;
}

// (c) per-warp bulk copies (TMA, 1-D) of CH tiles into S stages, one mbarrier per stage
template <int CH, int S>
__global__ void ring_bulk(const uint4 *__restrict__ p, int64_t tiles_per_warp, unsigned *sink) {
    extern __shared__ __align__(128) uint4 sm[];
    __shared__ __align__(8) uint64_t bar[32][S];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t gw = blockIdx.x * (int64_t)(blockDim.x / 32) + warp;
    const uint4 *src = p + gw * tiles_per_warp * 32;
    uint4 *stage = sm + warp * S * CH * 32;
    constexpr unsigned BYTES = CH * 512;
    if (lane == 0)
        for (int s = 0; s < S; ++s)
            asm volatile("mbarrier.init.shared.b64 [%0], 1;\n" ::"r"(smem_addr(&bar[warp][s])));
    asm volatile("fence.mbarrier_init.release.cluster;\n");
    __syncwarp();
    const int64_t chunks = tiles_per_warp / CH;
    auto issue = [&](int64_t c, int s) {
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;\n" ::"r"(smem_addr(&bar[warp][s])), "r"(BYTES));
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                     ::"r"(smem_addr(stage + s * CH * 32)), "l"(src + c * CH * 32), "r"(BYTES), "r"(smem_addr(&bar[warp][s])) : "memory");
    };
    if (lane == 0)
        for (int s = 0; s < S && s < chunks; ++s) issue(s, s);
    uint32_t acc = 0;
    for (int64_t c = 0; c < chunks; ++c) {
        const int s = c % S;
        const uint32_t parity = (c / S) & 1;
        uint32_t done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
                         : "=r"(done) : "r"(smem_addr(&bar[warp][s])), "r"(parity));
#pragma unroll
        for (int t = 0; t < CH; ++t) {
            uint4 v = stage[(s * CH + t) * 32 + lane];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncwarp();
        if (lane == 0 && c + S < chunks) issue(c + S, s);
    }
    if (acc == 0x12345678) *sink = acc;
}

template <typename F>
float time_us(F launch, int reps = 30) {
    launch(0);
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    std::vector<float> ts;
    for (int r = 0; r < 5; ++r) {
        cudaEventRecord(a);
        for (int i = 0; i < reps; ++i) launch(i);
        cudaEventRecord(b);
        CK(cudaEventSynchronize(b));
        float ms; cudaEventElapsedTime(&ms, a, b);
        ts.push_back(ms * 1000 / reps);
    }
    std::sort(ts.begin(), ts.end());
    CK(cudaGetLastError());
    return ts[2];
}

int main() {
    int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    unsigned *sink; CK(cudaMalloc(&sink, 4));
    for (int64_t bytes : {(int64_t)16 << 20, (int64_t)45 << 20, (int64_t)8 << 20}) {
        const int NB = (int)std::max<int64_t>(4, (400LL << 20) / bytes);
        std::vector<uint4 *> bufs(NB);
        for (auto &b : bufs) { CK(cudaMalloc(&b, bytes)); CK(cudaMemset(b, 1, bytes)); }
        const int64_t n = bytes / 16, tiles = bytes / 512;
        printf("%5.1f MB:", bytes / 1048576.0);
        auto report = [&](const char *name, float us) { printf("  %s %.1fus %.0fGB/s", name, us, bytes / us / 1e3); };
        report("plain4", time_us([&](int i) { plain<4><<<sms * 8, 256>>>(bufs[i % NB], n, sink); }));
        report("plain8", time_us([&](int i) { plain<8><<<sms * 4, 256>>>(bufs[i % NB], n, sink); }));
        for (int tpw : {8, 16, 32}) {
            const int warps = (int)(tiles / tpw), blocks = warps / 8;
            char nm[64];
            snprintf(nm, 64, "cpasync6/t%d", tpw);
            CK(cudaFuncSetAttribute(ring_cpasync<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 6 * 512));
            report(nm, time_us([&](int i) { ring_cpasync<6><<<blocks, 256, 8 * 6 * 512>>>(bufs[i % NB], tpw, sink); }));
            snprintf(nm, 64, "bulk2x3/t%d", tpw);
            CK(cudaFuncSetAttribute(ring_bulk<2, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 3 * 2 * 512));
            report(nm, time_us([&](int i) { ring_bulk<2, 3><<<blocks, 256, 8 * 3 * 2 * 512>>>(bufs[i % NB], tpw, sink); }));
            snprintf(nm, 64, "bulk4x3/t%d", tpw);
            CK(cudaFuncSetAttribute(ring_bulk<4, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 3 * 4 * 512));
            report(nm, time_us([&](int i) { ring_bulk<4, 3><<<blocks, 256, 8 * 3 * 4 * 512>>>(bufs[i % NB], tpw, sink); }));
        }
        printf("\n");
        for (auto b : bufs) cudaFree(b);
    }
    return 0;
}
