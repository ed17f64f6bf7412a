// GPU time per call of fq's GEMM (qd_cuda_fq_gemm: bf16 x times the weight's
// values expanded to bf16, float32 sums per scale block of K, scaled, bf16 out),
// without Python and without the expansion.  x and the weights are rotated over
// more than 200 MB so that no call finds them in L2.  Before timing, each shape's
// result is checked against a float64 reference on its first rows, and a hash of
// the output's bits is printed (equal hashes: the same bits from two builds).
//
// Arguments M,K,N,block_k time those shapes instead of the usual ones (block_k 0:
// one scale over all of K).
//
// Build and run from the repo root (H100/H200):
//   mkdir -p build && nvcc -O3 -std=c++17 -DQD_WITH_CUDA --expt-relaxed-constexpr \
//     -gencode=arch=compute_90a,code=sm_90a -Isrc_c/include -Isrc_c/cuda \
//     benchmarks/cuda/time_fq_gemm.cu src_c/cuda/gemm_s8.cu src_c/cuda/gemm_s8_sm90.cu \
//     src_c/cuda/float_units.cu src_c/cuda/elementwise.cu src_c/cuda/runtime.cu \
//     -o build/time_fq_gemm && build/time_fq_gemm
#include <cuda_bf16.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.cuh"

namespace {

struct Shape {
    int64_t M, K, N, bk;  // bk == K: one scale over all of K
};

uint64_t next_random(uint64_t &s) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return s >> 33;
}

// Host values: x in [-1, 1) as bf16, weights the integers -8..7, scales in [0.5, 1.5).
std::vector<__nv_bfloat16> random_x(int64_t n, uint64_t seed) {
    std::vector<__nv_bfloat16> v(n);
    for (auto &e : v) e = __float2bfloat16((float)(next_random(seed) % 2048) / 1024.0f - 1.0f);
    return v;
}
std::vector<__nv_bfloat16> random_weights(int64_t n, uint64_t seed) {
    std::vector<__nv_bfloat16> v(n);
    for (auto &e : v) e = __float2bfloat16((float)((int)(next_random(seed) % 16) - 8));
    return v;
}

template <typename T>
T *to_device(const std::vector<T> &h) {
    T *d = nullptr;
    CK(cudaMalloc(&d, h.size() * sizeof(T)));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// Times one shape; returns false when its check fails.
bool run(const Shape &sh) {
    const int64_t M = sh.M, K = sh.K, N = sh.N, bk = sh.bk ? sh.bk : sh.K, blocks = K / bk;
    const size_t set_bytes = (size_t)(M + N) * K * 2;
    const int sets = (int)std::max<size_t>(2, (200u << 20) / set_bytes + 1);
    std::vector<__nv_bfloat16 *> xs(sets), ws(sets);
    std::vector<__nv_bfloat16> hx = random_x(M * K, 1), hw = random_weights(N * K, 2);
    std::vector<float> hs(N * blocks);
    uint64_t seed = 3;
    for (auto &e : hs) e = 0.5f + (float)(next_random(seed) % 1024) / 1024.0f;
    for (int i = 0; i < sets; ++i) {
        xs[i] = to_device(hx);
        ws[i] = to_device(hw);
    }
    float *scales = to_device(hs);
    __nv_bfloat16 *out = nullptr;
    CK(cudaMalloc(&out, M * N * 2));
    auto call = [&](int i) {
        QK(qd_cuda_fq_gemm(xs[i], ws[i], QD_CUDA_BF16, M, N, K, K, scales, 1, bk, out, QD_CUDA_BF16, nullptr));
    };
    call(0);
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> ho(M * N);
    CK(cudaMemcpy(ho.data(), out, ho.size() * 2, cudaMemcpyDeviceToHost));
    uint64_t hash = 1469598103934665603ull;  // FNV-1a over the output's bits
    for (const auto &e : ho) {
        uint16_t bits;
        std::memcpy(&bits, &e, 2);
        hash = (hash ^ bits) * 1099511628211ull;
    }
    // float64 reference on the first rows; one bf16 rounding of the output apart
    double worst = 0.0;
    for (int64_t m = 0; m < std::min<int64_t>(M, 4); ++m)
        for (int64_t n = 0; n < N; ++n) {
            double ref = 0.0, mag = 0.0;
            for (int64_t b = 0; b < blocks; ++b) {
                double part = 0.0;
                for (int64_t k = b * bk; k < (b + 1) * bk; ++k)
                    part += (double)__bfloat162float(hx[m * K + k]) * __bfloat162float(hw[n * K + k]);
                ref += part * hs[n * blocks + b];
                mag += std::fabs(part * hs[n * blocks + b]);
            }
            worst = std::max(worst, std::fabs(__bfloat162float(ho[m * N + n]) - ref) / (mag + 1e-30));
        }
    const double us = 1000.0 * median_ms(call, sets, 10);
    std::printf("%6" PRId64 " x %5" PRId64 " x %5" PRId64 "  block_k %5" PRId64 "  %9.1f us  %7.1f TFLOPS  "
                "hash %016" PRIx64 "  err %.1e\n",
                M, K, N, bk, us, 2.0 * M * N * K / us * 1e-6, hash, worst);
    for (int i = 0; i < sets; ++i) {
        CK(cudaFree(xs[i]));
        CK(cudaFree(ws[i]));
    }
    CK(cudaFree(scales));
    CK(cudaFree(out));
    return worst < 1e-2;  // bf16 output: within 2^-8 of the sums' magnitude
}

}  // namespace

int main(int argc, char **argv) {
    std::vector<Shape> shapes;
    for (int i = 1; i < argc; ++i) {
        Shape s{};
        if (std::sscanf(argv[i], "%" SCNd64 ",%" SCNd64 ",%" SCNd64 ",%" SCNd64, &s.M, &s.K, &s.N, &s.bk) != 4 ||
            s.M <= 0 || s.K <= 0 || s.N <= 0 || s.bk < 0 || (s.bk && (s.K % s.bk || s.bk % 16)) || s.K % 8) {
            std::fprintf(stderr, "bad shape '%s': expected M,K,N,block_k (K a multiple of 8, block_k of 16 "
                                 "dividing K, or 0)\n", argv[i]);
            return 2;
        }
        shapes.push_back(s);
    }
    if (shapes.empty())
        shapes = {{2048, 4096, 4096, 128}, {2048, 4096, 11008, 128}, {512, 4096, 11008, 128},
                  {2048, 4096, 4096, 64},  {2048, 4096, 11008, 256}, {2048, 4096, 11008, 32},
                  {4096, 4096, 4096, 128}, {2048, 4096, 11008, 0}};
    bool ok = true;
    for (const Shape &s : shapes) ok &= run(s);
    std::printf(ok ? "all checks passed\n" : "FAIL: a result is off the reference\n");
    return ok ? 0 : 1;
}
