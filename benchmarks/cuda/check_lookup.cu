// Checks the row lookup (qd_cuda_dequantize_rows) and the whole-table dequantize
// (qd_cuda_dequantize) against a host reference, bit for bit: int8 values and
// packed_u32 words of 8, 4 and 2 bits, rows from 4 to 4096 values, scale blocks of
// every width that divides them (narrower than a thread's values, or not aligned to
// them), float32, float16 and bfloat16 rows, ids outside the table (rows of NaN),
// no ids (every row in turn), and values and outputs a few bytes off their alignment.  Prints each failure and
// the count of cases; exits 1 on any failure.
//
// Build and run from the repo root:
//   mkdir -p build && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//     -Isrc_c/include -Isrc_c/cuda benchmarks/cuda/check_lookup.cu src_c/cuda/elementwise.cu \
//     src_c/cuda/runtime.cu -o build/check_lookup && build/check_lookup
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "check.cuh"

namespace {

// The bits of float v as out_dtype (2 or 4 bytes), as the kernels round.
uint32_t host_bits(float v, int dtype) {
    if (dtype == QD_CUDA_F16) return __half_as_ushort(__float2half_rn(v));
    if (dtype == QD_CUDA_BF16) return std::isnan(v) ? 0x7FC0 : __bfloat16_as_ushort(__float2bfloat16_rn(v));
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}

struct Case {
    int64_t rows, cols, block_rows, block_cols;
    int bits;  // 0: int8 values, else packed_u32 words of `bits`-bit fields
};

std::mt19937_64 rng(7);
int failures = 0, cases = 0;

// The store of q [rows, cols] (values in range for `bits`) as the kernels read it.
std::vector<uint8_t> stored(const std::vector<int> &q, const Case &c) {
    if (!c.bits) return std::vector<uint8_t>(q.begin(), q.end());
    const int per = 32 / c.bits;
    const int64_t wpr = (c.cols + per - 1) / per;
    std::vector<uint32_t> words(c.rows * wpr, 0);
    for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t k = 0; k < c.cols; ++k)
            words[r * wpr + k / per] |= ((uint32_t)q[r * c.cols + k] & ((1u << c.bits) - 1)) << (c.bits * (k % per));
    std::vector<uint8_t> bytes(words.size() * 4);
    std::memcpy(bytes.data(), words.data(), bytes.size());
    return bytes;
}

void check(const Case &c) {
    const int lo = c.bits ? -(1 << (c.bits - 1)) : -128, span = c.bits ? 1 << c.bits : 256;
    std::vector<int> q(c.rows * c.cols);
    for (auto &v : q) v = lo + (int)(rng() % span);
    const int64_t gr = c.rows / c.block_rows, gc = c.cols / c.block_cols;
    std::vector<float> scales(gr * gc);
    for (auto &s : scales) s = std::ldexp(1.0f + (rng() % 997) / 997.0f, -(int)(rng() % 12));
    const std::vector<uint8_t> store = stored(q, c);
    std::vector<int64_t> ids = {c.rows - 1, 0, -1, c.rows, (int64_t)1 << 32};
    for (int i = 0; i < 40; ++i) ids.push_back((int64_t)(rng() % c.rows));
    const int64_t n = (int64_t)ids.size();
    auto want = [&](int64_t r, int64_t k) {
        return (float)q[r * c.cols + k] * scales[(r / c.block_rows) * gc + k / c.block_cols];
    };
    uint8_t *values;
    float *d_scales;
    int64_t *d_ids;
    void *out;
    const size_t out_bytes = (size_t)(std::max(n, c.rows) * c.cols + 16) * 4;
    CK(cudaMalloc(&values, store.size() + 8));
    CK(cudaMalloc(&d_scales, scales.size() * 4));
    CK(cudaMalloc(&d_ids, n * 8));
    CK(cudaMalloc(&out, out_bytes));
    CK(cudaMemcpy(d_scales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_ids, ids.data(), n * 8, cudaMemcpyHostToDevice));
    std::vector<uint8_t> got(out_bytes);
    // int8 values may sit a few bytes off (a view); packed words stay 4-byte aligned
    for (int value_at : c.bits ? std::vector<int>{0} : std::vector<int>{0, 3, 4}) {
        CK(cudaMemcpy(values + value_at, store.data(), store.size(), cudaMemcpyHostToDevice));
        for (int dtype : {QD_CUDA_F32, QD_CUDA_F16, QD_CUDA_BF16})
        for (bool with_ids : {true, false}) {  // no ids: every row in turn
            const int size = dtype == QD_CUDA_F32 ? 4 : 2;
            const int64_t n_out = with_ids ? n : c.rows;
            for (int out_at : {0, 1}) {  // elements
                uint8_t *at = static_cast<uint8_t *>(out) + out_at * size;
                QK(qd_cuda_dequantize_rows(values + value_at, c.bits, c.rows, c.cols, d_scales, c.block_rows,
                                           c.block_cols, with_ids ? d_ids : nullptr, n_out, at, dtype, nullptr));
                CK(cudaMemcpy(got.data(), at, n_out * c.cols * size, cudaMemcpyDeviceToHost));
                ++cases;
                int64_t bad = 0;
                for (int64_t i = 0; i < n_out; ++i)
                    for (int64_t k = 0; k < c.cols; ++k) {
                        uint32_t g = 0;
                        std::memcpy(&g, got.data() + (i * c.cols + k) * size, size);
                        const int64_t r = with_ids ? ids[i] : i;
                        const bool inside = r >= 0 && r < c.rows;
                        const float as_float =
                            dtype == QD_CUDA_F32 ? *reinterpret_cast<float *>(&g)
                            : dtype == QD_CUDA_F16 ? __half2float(__ushort_as_half((unsigned short)g))
                                                   : __bfloat162float(__ushort_as_bfloat16((unsigned short)g));
                        if (inside ? g != host_bits(want(r, k), dtype) : !std::isnan(as_float)) ++bad;
                    }
                if (bad) {
                    ++failures;
                    std::printf("FAIL rows %lld x %lld, blocks %lld x %lld, bits %d, dtype %d, %s, values +%d, "
                                "out +%d: %lld wrong values\n",
                                (long long)c.rows, (long long)c.cols, (long long)c.block_rows,
                                (long long)c.block_cols, c.bits, dtype, with_ids ? "ids" : "no ids", value_at,
                                out_at, (long long)bad);
                }
            }
        }
        QK(qd_cuda_dequantize(values + value_at, c.bits, c.rows, c.cols, d_scales, c.block_rows, c.block_cols,
                              static_cast<float *>(out), nullptr));
        CK(cudaMemcpy(got.data(), out, c.rows * c.cols * 4, cudaMemcpyDeviceToHost));
        ++cases;
        int64_t bad = 0;
        for (int64_t r = 0; r < c.rows; ++r)
            for (int64_t k = 0; k < c.cols; ++k) {
                uint32_t g;
                std::memcpy(&g, got.data() + (r * c.cols + k) * 4, 4);
                bad += g != host_bits(want(r, k), QD_CUDA_F32);
            }
        if (bad) {
            ++failures;
            std::printf("FAIL whole table %lld x %lld, blocks %lld x %lld, bits %d, values +%d: %lld wrong values\n",
                        (long long)c.rows, (long long)c.cols, (long long)c.block_rows, (long long)c.block_cols,
                        c.bits, value_at, (long long)bad);
        }
    }
    CK(cudaFree(values));
    CK(cudaFree(d_scales));
    CK(cudaFree(d_ids));
    CK(cudaFree(out));
}

}  // namespace

int main() {
    for (int64_t cols : {4, 8, 12, 36, 100, 136, 4096})
        for (int bits : {0, 8, 4, 2})
            for (int64_t bc : {(int64_t)1, (int64_t)4, (int64_t)12, (int64_t)8, cols})
                if (cols % bc == 0) check({66, cols, bc == 4 ? 2 : 1, bc, bits});
    std::printf("%d cases, %d failures\n", cases, failures);
    return failures ? 1 : 0;
}
