// GPU time per call of the row lookup (qd_cuda_dequantize_rows, what
// qdispatch.embedding runs) and of the whole-table dequantize (qd_cuda_dequantize)
// on a 32000 x 4096 table, int8 per row and int4 in blocks of 32: 1, 16 and 2048
// ids (ids rotated over 8 random sets; at 2048 ids of int4 rows the rows read, about
// 32 MB, fit the 50 MB L2, so those figures may come partly from it), bf16
// and float32 rows, launched back to back.  The whole table to bf16 too: in one
// pass (the lookup without ids), and as float32 then cast (qd_cuda_cast).
//
// Build and run from the repo root:
//   mkdir -p build && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//     -Isrc_c/include -Isrc_c/cuda benchmarks/cuda/time_lookup.cu src_c/cuda/elementwise.cu \
//     src_c/cuda/runtime.cu -o build/time_lookup && build/time_lookup
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "check.cuh"

int main() {
    const int64_t rows = 32000, cols = 4096, sets = 8;
    struct Table {
        const char *name;
        int bits;  // 0: int8 values; 4: packed_u32 words of 4-bit values
        int64_t block_rows, block_cols;
    };
    const Table tables[] = {{"int8 per row", 0, 1, cols}, {"int4 block 32", 4, 1, 32}};
    std::mt19937_64 rng(0);
    for (const Table &t : tables) {
        const size_t value_bytes = t.bits ? rows * cols * t.bits / 8 : rows * cols;
        const size_t n_scales = rows / t.block_rows * (cols / t.block_cols);
        std::vector<uint8_t> host_values(value_bytes);
        for (auto &v : host_values) v = (uint8_t)rng();
        std::vector<float> host_scales(n_scales);
        for (auto &s : host_scales) s = 0.001f + (rng() % 1000) * 1e-5f;
        std::vector<int64_t> host_ids(sets * 2048);
        for (auto &id : host_ids) id = (int64_t)(rng() % rows);
        void *values, *out, *out16;
        float *scales;
        int64_t *ids;
        CK(cudaMalloc(&values, value_bytes));
        CK(cudaMalloc(&scales, n_scales * sizeof(float)));
        CK(cudaMalloc(&out, rows * cols * sizeof(float)));
        CK(cudaMalloc(&out16, rows * cols * 2));
        CK(cudaMalloc(&ids, host_ids.size() * sizeof(int64_t)));
        CK(cudaMemcpy(values, host_values.data(), value_bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(scales, host_scales.data(), n_scales * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ids, host_ids.data(), host_ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
        const double whole = median_ms(
            [&](int) {
                QK(qd_cuda_dequantize(values, t.bits, rows, cols, scales, t.block_rows, t.block_cols,
                                      static_cast<float *>(out), nullptr));
            },
            1, 5);
        std::printf("%s, whole table to float32: %.1f us (%.0f GB/s written)\n", t.name, whole * 1e3,
                    rows * cols * sizeof(float) / (whole * 1e-3) / 1e9);
        const double one_pass = median_ms(
            [&](int) {
                QK(qd_cuda_dequantize_rows(values, t.bits, rows, cols, scales, t.block_rows, t.block_cols, nullptr,
                                           rows, out16, QD_CUDA_BF16, nullptr));
            },
            1, 5);
        const double two_passes = median_ms(
            [&](int) {
                QK(qd_cuda_dequantize(values, t.bits, rows, cols, scales, t.block_rows, t.block_cols,
                                      static_cast<float *>(out), nullptr));
                QK(qd_cuda_cast(out, QD_CUDA_F32, out16, QD_CUDA_BF16, rows * cols, nullptr));
            },
            1, 5);
        std::printf("%s, whole table to bf16: %.1f us in one pass, %.1f us as float32 then cast\n", t.name,
                    one_pass * 1e3, two_passes * 1e3);
        for (int dtype : {QD_CUDA_BF16, QD_CUDA_F32}) {
            std::printf("%s, rows to %s:", t.name, dtype == QD_CUDA_BF16 ? "bf16" : "float32");
            for (int64_t n : {1, 16, 2048}) {
                const double ms = median_ms(
                    [&](int set) {
                        QK(qd_cuda_dequantize_rows(values, t.bits, rows, cols, scales, t.block_rows, t.block_cols,
                                                   ids + set * 2048, n, out, dtype, nullptr));
                    },
                    sets, 200);
                std::printf(" %lld ids %.1f us", (long long)n, ms * 1e3);
            }
            std::printf("\n");
        }
        CK(cudaFree(values));
        CK(cudaFree(scales));
        CK(cudaFree(out));
        CK(cudaFree(out16));
        CK(cudaFree(ids));
    }
    return 0;
}
