// GPU time per call of qq (qd_cuda_qq_matmul, int8 x int8, float32 out) with scale
// blocks along K, without Python in the way: operands rotated over more than 200 MB,
// and a checksum of each output's bits, so that two builds of the kernel can be
// compared bit for bit.  With --check it runs small shapes once instead, and checks
// that float16 and bfloat16 outputs are the float32 output rounded once (run it
// under compute-sanitizer).
//
// Build and run from the repo root (H100/H200):
//   mkdir -p build && nvcc -O3 -std=c++17 -DQD_WITH_CUDA --expt-relaxed-constexpr \
//     -gencode=arch=compute_90a,code=sm_90a -Isrc_c/include -Isrc_c/cuda \
//     benchmarks/cuda/time_qq_blocks.cu src_c/cuda/gemm_s8.cu src_c/cuda/gemm_s8_sm90.cu \
//     src_c/cuda/float_units.cu src_c/cuda/elementwise.cu src_c/cuda/runtime.cu \
//     -o build/time_qq_blocks && build/time_qq_blocks
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "check.cuh"

namespace {

struct Blocking {
    const char *name;
    int64_t a_block_m, a_block_k, b_block_n, b_block_k;  // 0: all of the dimension
};

const Blocking BLOCKINGS[] = {
    {"per row x per column", 1, 0, 1, 0},
    {"1x128 x 128x128", 1, 128, 128, 128},
    {"per row x 1x32", 1, 0, 1, 32},
    {"1x128 x 1x128", 1, 128, 1, 128},
    {"1x256 x 128x256", 1, 256, 128, 256},
    // blocks off the mma's 32-byte steps, spread to whole steps
    {"per row x 1x16", 1, 0, 1, 16},
    {"1x48 x 1x48", 1, 48, 1, 48},
    {"1x8 x per column", 1, 8, 1, 0},
    // groups of fewer than 8 values, on the float units
    {"per row x per in-chan", 1, 0, 0, 1},
    {"1x2 x per column", 1, 2, 1, 0},
    {"1x4 x 1x4", 1, 4, 1, 4},
};

uint64_t next_random(uint64_t &state) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
}

// Device operands: `sets` copies of the same values at different addresses, so that
// back-to-back calls read them from HBM rather than from the 50 MB L2.
struct Operands {
    std::vector<int8_t *> a, b;
    std::vector<float *> sa, sb;
    Operands(int sets, int64_t M, int64_t N, int64_t K, size_t na, size_t nb) {
        std::vector<int8_t> values(std::max(M, N) * K + 8);
        std::vector<float> scales(std::max(na, nb));
        uint64_t state = 1;
        for (size_t i = 0; i + 4 <= values.size(); i += 4) {
            const uint32_t r = (uint32_t)next_random(state);
            std::memcpy(&values[i], &r, 4);
        }
        for (float &s : scales) s = 0.5f + (float)(next_random(state) % 1000) / 1000.0f;
        for (int s = 0; s < sets; ++s) {
            a.push_back(static_cast<int8_t *>(upload(values.data(), M * K)));
            b.push_back(static_cast<int8_t *>(upload(values.data() + 7, N * K)));
            sa.push_back(static_cast<float *>(upload(scales.data(), na * 4)));
            sb.push_back(static_cast<float *>(upload(scales.data(), nb * 4)));
        }
    }
    ~Operands() {
        for (size_t s = 0; s < a.size(); ++s) {
            cudaFree(a[s]); cudaFree(b[s]); cudaFree(sa[s]); cudaFree(sb[s]);
        }
    }
    static void *upload(const void *p, size_t bytes) {
        void *d = nullptr;
        CK(cudaMalloc(&d, bytes));
        CK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
        return d;
    }
};

// Times (or, with check, checks) one blocking at one shape; returns false on a mismatch.
bool run(const Blocking &bl, int64_t M, int64_t K, int64_t N, bool check) {
    const int64_t abk = bl.a_block_k ? bl.a_block_k : K, bbk = bl.b_block_k ? bl.b_block_k : K;
    const int64_t abm = bl.a_block_m ? bl.a_block_m : M, bbn = bl.b_block_n ? bl.b_block_n : N;
    const size_t na = M / abm * (K / abk), nb = N / bbn * (K / bbk);
    const int sets = check ? 1 : (int)std::max<int64_t>(3, (200 << 20) / (M * K + N * K) + 1);
    Operands ops(sets, M, N, K, na, nb);
    void *out = nullptr;
    CK(cudaMalloc(&out, M * N * 4));
    auto call = [&](int s, int dtype) {
        QK(qd_cuda_qq_matmul(ops.a[s], ops.b[s], M, N, K, K, ops.sa[s], abm, abk, ops.sb[s], bbn, bbk, out, dtype,
                             nullptr));
    };
    call(0, QD_CUDA_F32);
    std::vector<float> got(M * N);
    CK(cudaMemcpy(got.data(), out, M * N * 4, cudaMemcpyDeviceToHost));
    uint64_t checksum = 0;
    for (float v : got) {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        checksum = checksum * 31 + u;
    }
    bool ok = true;
    std::string what;
    if (check) {
        std::vector<uint16_t> half(M * N);
        int64_t wrong = 0;
        for (int dtype : {QD_CUDA_F16, QD_CUDA_BF16}) {
            call(0, dtype);
            CK(cudaMemcpy(half.data(), out, M * N * 2, cudaMemcpyDeviceToHost));
            for (int64_t i = 0; i < M * N; ++i) {
                uint16_t want;
                if (dtype == QD_CUDA_F16) {
                    const __half h = __float2half_rn(got[i]);
                    std::memcpy(&want, &h, 2);
                } else {
                    const __nv_bfloat16 h = __float2bfloat16_rn(got[i]);
                    std::memcpy(&want, &h, 2);
                }
                wrong += half[i] != want;
            }
        }
        ok = wrong == 0;
        what = "16-bit outputs " + std::string(ok ? "agree" : "DIFFER: " + std::to_string(wrong));
    } else {
        cudaEvent_t start, end;
        CK(cudaEventCreate(&start));
        CK(cudaEventCreate(&end));
        auto time_calls = [&](int calls) {
            CK(cudaEventRecord(start));
            for (int i = 0; i < calls; ++i) call(i % sets, QD_CUDA_F32);
            CK(cudaEventRecord(end));
            CK(cudaEventSynchronize(end));
            float ms = 0.0f;
            CK(cudaEventElapsedTime(&ms, start, end));
            return ms / calls;
        };
        // 5 x 20 calls, or 3 calls where one takes more than 10 ms
        float best = time_calls(1);
        for (int rep = 0; rep < (best > 10.0f ? 1 : 5); ++rep) best = std::min(best, time_calls(best > 10.0f ? 3 : 20));
        char line[64];
        std::snprintf(line, sizeof line, "%8.1f us %6.0f TOPS", best * 1e3, 2.0 * M * N * K / best / 1e9);
        what = line;
        cudaEventDestroy(start);
        cudaEventDestroy(end);
    }
    std::printf("%-22s %5ld x %5ld x %5ld  %s  checksum %016llx\n", bl.name, (long)M, (long)K, (long)N,
                what.c_str(), (unsigned long long)checksum);
    CK(cudaFree(out));
    return ok;
}

}  // namespace

int main(int argc, char **argv) {
    const bool check = argc > 1 && std::string(argv[1]) == "--check";
    const int64_t timed[][3] = {{4096, 4096, 4096}, {2048, 4096, 11008}, {2048, 4800, 4096}};
    // tails in M, several tiles; K = 960 ends inside a k tile (blockings that divide K only)
    const int64_t checked[][3] = {{260, 1024, 384}, {130, 512, 256}, {130, 960, 200}};
    bool ok = true;
    for (const auto &shape : check ? checked : timed)
        for (const Blocking &bl : BLOCKINGS)
            if (shape[1] % std::max<int64_t>(bl.a_block_k, 1) == 0 && shape[1] % std::max<int64_t>(bl.b_block_k, 1) == 0 &&
                shape[0] % std::max<int64_t>(bl.a_block_m, 1) == 0 && shape[2] % std::max<int64_t>(bl.b_block_n, 1) == 0)
                ok &= run(bl, shape[0], shape[1], shape[2], check);
    return ok ? 0 : 1;
}
