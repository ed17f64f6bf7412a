// GPU time per call of the decode kernel (qd_cuda_fq_matmul) without Python in
// the way: bf16 x, bf16 out (float16 with --f16), weights rotated over more than
// 200 MB, launched back to back with and without early launch (programmatic
// dependent launch), and the host time per call.
//
// Arguments M,K,N,bits[,block_k] time those shapes instead of the usual ones;
// options before them: --batch-invariant times the batch-invariant cut of K.
//
// Build and run from the repo root (H100/H200):
//   mkdir -p build && nvcc -O3 -std=c++17 -DQD_WITH_CUDA --expt-relaxed-constexpr \
//     -gencode=arch=compute_90a,code=sm_90a -Isrc_c/include -Isrc_c/cuda \
//     benchmarks/cuda/time_fq.cu src_c/cuda/fq_wide_sm90.cu src_c/cuda/gemm_s8_sm90.cu \
//     src_c/cuda/elementwise.cu src_c/cuda/runtime.cu -o build/time_fq && build/time_fq
//
// fq_matmul.cu is included so that early launch can be switched off.
#include "fq_matmul.cu"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.cuh"

namespace {

struct Weight {
    void *tiles;
    void *scales;  // scale tiles
};

// `count` weights laid out as the kernel reads them (the same random values in
// each: only their addresses need to differ), with scales of one block_k.
std::vector<Weight> make_weights(int count, int64_t N, int64_t K, int bits, int64_t block_k) {
    std::vector<int8_t> q(N * K);
    const int hi = (1 << (bits - 1)) - 1;
    for (auto &v : q) v = (int8_t)(std::rand() % (2 * hi + 1) - hi);
    std::vector<float> s(N * (K / block_k));
    for (auto &v : s) v = 0.01f + 0.001f * (std::rand() % 7);
    int8_t *dq;
    float *ds;
    CK(cudaMalloc(&dq, q.size()));
    CK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&ds, s.size() * 4));
    CK(cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
    std::vector<Weight> ws(count);
    for (Weight &w : ws) {
        CK(cudaMalloc(&w.tiles, qd_cuda_fq_tiles_bytes(N, K, bits)));
        QK(qd_cuda_fq_tile_weights(dq, N, K, K, bits, w.tiles, nullptr));
        CK(cudaMalloc(&w.scales, qd_cuda_fq_scale_tiles_bytes(N, K, block_k)));
        QK(qd_cuda_fq_tile_scales(ds, N, K, 1, block_k, w.scales, nullptr));
    }
    CK(cudaFree(dq));
    CK(cudaFree(ds));
    return ws;
}

// Median us per call over 5 runs of `calls` back-to-back calls.
template <typename F>
float time_us(F call, int calls = 50) {
    call(0);
    CK(cudaDeviceSynchronize());
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < calls; ++i) call(i);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        ts.push_back(ms * 1000 / calls);
    }
    std::sort(ts.begin(), ts.end());
    return ts[2];
}

// Host us per call, queued without waiting (the GPU drains the queue afterwards).
template <typename F>
float host_us(F call, int calls = 400) {
    CK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) call(i);
    const auto t1 = std::chrono::steady_clock::now();
    CK(cudaDeviceSynchronize());
    return std::chrono::duration<float, std::micro>(t1 - t0).count() / calls;
}

}  // namespace

int main(int argc, char **argv) {
    struct Case { int64_t M, K, N; int bits; int64_t block_k; const char *name; };
    std::vector<Case> cases = {
        {1, 4096, 4096, 8, 4096, "int8"},   {4, 4096, 4096, 8, 4096, "int8"},
        {16, 4096, 4096, 8, 4096, "int8"},  {1, 4096, 11008, 8, 4096, "int8"},
        {16, 4096, 11008, 8, 4096, "int8"},
        {1, 4096, 4096, 4, 128, "int4 b128"}, {4, 4096, 4096, 4, 128, "int4 b128"},
        {16, 4096, 4096, 4, 128, "int4 b128"}, {1, 4096, 11008, 4, 128, "int4 b128"},
        {16, 4096, 11008, 4, 128, "int4 b128"},
        {1, 4096, 4096, 4, 32, "int4 b32"},  {16, 4096, 11008, 4, 32, "int4 b32"},
    };
    // Other shapes instead: arguments M,K,N,bits[,block_k] (block_k: K by default);
    // --batch-invariant times the batch-invariant cut of K, --f16 float16 x and out.
    int first = 1, dtype = QD_CUDA_BF16;
    for (; first < argc && argv[first][0] == '-'; ++first) {
        if (std::strcmp(argv[first], "--batch-invariant") == 0) {
            qd_cuda_set_batch_invariant(1);
        } else if (std::strcmp(argv[first], "--f16") == 0) {
            dtype = QD_CUDA_F16;
        } else {
            std::fprintf(stderr, "unknown option %s (expected --batch-invariant or --f16)\n", argv[first]);
            return 2;
        }
    }
    if (argc > first) cases.clear();
    for (int i = first; i < argc; ++i) {
        long long M, K, N, block_k = 0;
        int bits;
        if (std::sscanf(argv[i], "%lld,%lld,%lld,%d,%lld", &M, &K, &N, &bits, &block_k) < 4) {
            std::fprintf(stderr, "expected M,K,N,bits[,block_k], got %s\n", argv[i]);
            return 2;
        }
        cases.push_back({M, K, N, bits, block_k ? block_k : K, bits == 8 ? "int8" : bits == 4 ? "int4" : "int2"});
    }
    std::printf("%-10s %-18s %10s %10s %10s %10s\n", "weights", "M,K,N", "us", "us early", "GB/s early",
                "host us");
    for (const Case &c : cases) {
        // the weight's bytes a call reads: its values' tiles and its scales' (as the README counts them)
        const int64_t wbytes = qd_cuda_fq_tiles_bytes(c.N, c.K, c.bits) +
                               qd_cuda_fq_scale_tiles_bytes(c.N, c.K, c.block_k);
        const int count = (int)std::max<int64_t>(3, (200LL << 20) / wbytes + 1);
        std::vector<Weight> ws = make_weights(count, c.N, c.K, c.bits, c.block_k);
        std::vector<uint16_t> hx(c.M * c.K, dtype == QD_CUDA_F16 ? 0x3C00 : 0x3F80);  // 1.0
        void *x, *out;
        CK(cudaMalloc(&x, hx.size() * 2));
        CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&out, c.M * c.N * 2));
        auto call = [&](int i) {
            const Weight &w = ws[i % count];
            QK(qd_cuda_fq_matmul(x, dtype, c.M, c.K, w.tiles, w.scales, c.bits, c.N, c.K,
                                 c.block_k, out, dtype, nullptr));
        };
        DeviceState *d = nullptr;
        QK(device_state(&d));
        const bool early = d->early;
        d->early = false;
        const float plain = time_us(call);
        d->early = early;
        const float fast = time_us(call), host = host_us(call);
        char shape[32];
        std::snprintf(shape, sizeof shape, "%lld,%lld,%lld", (long long)c.M, (long long)c.K, (long long)c.N);
        std::printf("%-10s %-18s %10.2f %10.2f %10.0f %10.2f%s\n", c.name, shape, plain, fast,
                    wbytes / fast / 1e3, host, early ? "" : "  (no early launch on this device)");
        for (auto &w : ws) { cudaFree(w.tiles); cudaFree(w.scales); }
        cudaFree(x);
        cudaFree(out);
    }
    return 0;
}
