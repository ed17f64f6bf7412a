// Standalone check of the decode C calls (qd_cuda_fq_tile_weights,
// qd_cuda_fq_tile_scales, qd_cuda_fq_matmul) against a float64 reference on the
// host: random bf16 x, random integer weights and scales, for decode shapes,
// scale blocks that end inside a weight tile and scales shared by several rows.
// Exits non-zero if any shape is off by more than float32 accumulation allows.
//
// Build and run from the repo root (sm_80 or later):
//   mkdir -p build && nvcc -O3 -std=c++17 -DQD_WITH_CUDA --expt-relaxed-constexpr \
//     -gencode=arch=compute_90a,code=sm_90a -Isrc_c/include -Isrc_c/cuda \
//     benchmarks/cuda/check_fq.cu src_c/cuda/fq_matmul.cu src_c/cuda/fq_wide_sm90.cu \
//     src_c/cuda/gemm_s8_sm90.cu src_c/cuda/elementwise.cu src_c/cuda/runtime.cu \
//     -o build/check_fq && build/check_fq
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.cuh"

namespace {

uint16_t to_bf16(float f) {  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

struct Case {
    int64_t M, K, N;
    int bits;
    int64_t block_n, block_k;
};

// Worst error of out against the float64 product, relative to the sum of the
// products' magnitudes (so cancellation does not inflate it).
double worst_error(const Case &c, const std::vector<uint16_t> &x, const std::vector<int8_t> &q,
                   const std::vector<float> &s, const std::vector<float> &out) {
    const int64_t blocks = c.K / c.block_k;
    double worst = 0;
    for (int64_t m = 0; m < c.M; ++m)
        for (int64_t n = 0; n < c.N; ++n) {
            double sum = 0, magnitude = 0;
            for (int64_t k = 0; k < c.K; ++k) {
                const double p = (double)from_bf16(x[m * c.K + k]) * q[n * c.K + k] *
                                 s[n / c.block_n * blocks + k / c.block_k];
                sum += p;
                magnitude += std::fabs(p);
            }
            worst = std::fmax(worst, std::fabs(out[m * c.N + n] - sum) / (magnitude + 1e-30));
        }
    return worst;
}

bool check(const Case &c) {
    const int hi = (1 << (c.bits - 1)) - 1;
    std::vector<int8_t> q(c.N * c.K);
    for (auto &v : q) v = (int8_t)(std::rand() % (2 * hi + 2) - hi - 1);
    std::vector<float> s(c.N / c.block_n * (c.K / c.block_k));
    for (auto &v : s) v = 0.001f * (1 + std::rand() % 50);
    std::vector<uint16_t> x(c.M * c.K);
    for (auto &v : x) v = to_bf16((std::rand() % 2001 - 1000) / 250.f);

    int8_t *dq;
    float *ds, *dout;
    void *tiles, *scale_tiles, *dx;
    CK(cudaMalloc(&dq, q.size()));
    CK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&ds, s.size() * 4));
    CK(cudaMemcpy(ds, s.data(), s.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dx, x.size() * 2));
    CK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&dout, c.M * c.N * 4));
    CK(cudaMalloc(&tiles, qd_cuda_fq_tiles_bytes(c.N, c.K, c.bits)));
    CK(cudaMalloc(&scale_tiles, qd_cuda_fq_scale_tiles_bytes(c.N, c.K, c.block_k)));
    QK(qd_cuda_fq_tile_weights(dq, c.N, c.K, c.K, c.bits, tiles, nullptr));
    QK(qd_cuda_fq_tile_scales(ds, c.N, c.K, c.block_n, c.block_k, scale_tiles, nullptr));
    for (int rep = 0; rep < 3; ++rep)  // back to back: each call starts while the one before ends
        QK(qd_cuda_fq_matmul(dx, QD_CUDA_BF16, c.M, c.K, tiles, scale_tiles, c.bits, c.N, c.K, c.block_k,
                             dout, QD_CUDA_F32, nullptr));
    std::vector<float> out(c.M * c.N);
    CK(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost));
    for (void *p : {(void *)dq, (void *)ds, dx, (void *)dout, tiles, scale_tiles}) CK(cudaFree(p));

    const double worst = worst_error(c, x, q, s, out);
    const bool ok = worst < 1e-5;
    std::printf("M=%-3lld K=%-5lld N=%-6lld bits=%d block %lld x %-5lld worst rel err %.2e %s\n",
                (long long)c.M, (long long)c.K, (long long)c.N, c.bits, (long long)c.block_n,
                (long long)c.block_k, worst, ok ? "ok" : "BAD");
    return ok;
}

}  // namespace

int main() {
    const Case cases[] = {
        {1, 4096, 4096, 8, 1, 4096},  {4, 4096, 4096, 8, 1, 4096},   {16, 4096, 4096, 8, 1, 4096},
        {16, 4096, 11008, 8, 1, 4096}, {5, 4096, 4096, 8, 1, 128},    {2, 4096, 512, 8, 1, 16},
        {3, 1040, 48, 8, 1, 1040},     {1, 4096, 4096, 4, 1, 128},    {16, 4096, 11008, 4, 1, 128},
        {1, 4096, 4096, 4, 1, 32},     {16, 4096, 11008, 4, 1, 32},   {7, 960, 300, 4, 1, 64},
        {12, 4096, 4096, 4, 1, 64},    {9, 2048, 1000, 2, 1, 32},     {4, 480, 40, 8, 1, 48},
        {16, 512, 200, 8, 200, 512},   {1, 512, 200, 4, 8, 64},       {16, 1024, 96, 8, 4, 32},
        {32, 4096, 4096, 8, 1, 4096},  {32, 4096, 11008, 4, 1, 128},  {24, 4096, 4096, 4, 1, 32},
        {19, 960, 300, 4, 1, 64},      {40, 2048, 1000, 2, 1, 32},    {64, 1024, 96, 8, 4, 32},
        {100, 4096, 4096, 4, 1, 128}, {64, 4096, 11008, 8, 1, 4096}, {48, 4096, 4096, 4, 1, 32},
        {77, 1000, 300, 8, 1, 1000},   {200, 2048, 520, 2, 1, 64},    {130, 3000, 600, 4, 1, 3000},
    };
    int bad = 0;
    for (const Case &c : cases) bad += !check(c);
    return bad;
}
