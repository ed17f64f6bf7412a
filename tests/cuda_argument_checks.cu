// Host code only (runs without a GPU): pointers the kernels would copy 16 or 8 bytes at a
// time must be aligned so, or the entry point refuses them (QD_ERR_ARGUMENT) before any
// CUDA call; a misaligned copy would be a fault that ends the CUDA context.  The pointers
// are never read.  Built and run by test_build_support.py.
#include <cstdint>
#include <cstdio>

#include "qdispatch.h"

static int wrong = 0;

static void expect(const char *what, qd_status got, qd_status want) {
    if (got != want) std::printf("%s: status %d, want %d\n", what, (int)got, (int)want), ++wrong;
}

int main() {
    alignas(16) static unsigned char memory[1 << 16];
    unsigned char *aligned = memory, *off = memory + 4;
    const int64_t M = 1, N = 32, K = 64;
    expect("fq_matmul, misaligned tiles",
           qd_cuda_fq_matmul(aligned, QD_CUDA_F32, M, K, off, aligned + 8192, 8, N, K, K, aligned + 16384,
                             QD_CUDA_F32, nullptr),
           QD_ERR_ARGUMENT);
    expect("fq_matmul, misaligned scale tiles",
           qd_cuda_fq_matmul(aligned, QD_CUDA_F32, M, K, aligned + 4096, off + 8192, 8, N, K, K, aligned + 16384,
                             QD_CUDA_F32, nullptr),
           QD_ERR_ARGUMENT);
    expect("fq_values, misaligned weight rows",
           qd_cuda_fq_values(aligned, QD_CUDA_F32, M, K, reinterpret_cast<const int8_t *>(off + 4096), N, K, K,
                             reinterpret_cast<const float *>(aligned + 8192), 1, 1, aligned + 16384, QD_CUDA_F32,
                             nullptr),
           QD_ERR_ARGUMENT);
    expect("fq_values, weight rows not 16 bytes apart",
           qd_cuda_fq_values(aligned, QD_CUDA_F32, M, K, reinterpret_cast<const int8_t *>(aligned + 4096), N, K,
                             K + 4, reinterpret_cast<const float *>(aligned + 8192), 1, 1, aligned + 20480,
                             QD_CUDA_F32, nullptr),
           QD_ERR_ARGUMENT);
    int64_t bad = -1;
    expect("quantize, misaligned scratch",
           qd_cuda_quantize_f32(reinterpret_cast<const float *>(aligned), 2, 32, 0, 1, 32, 0,
                                reinterpret_cast<float *>(aligned + 1024), reinterpret_cast<int8_t *>(aligned + 2048),
                                off + 4096, &bad, nullptr),
           QD_ERR_ARGUMENT);
    expect("quantize of bfloat16 x, misaligned scratch",
           qd_cuda_quantize(aligned, QD_CUDA_BF16, 2, 32, 0, 1, 32, 0, reinterpret_cast<float *>(aligned + 1024),
                            reinterpret_cast<int8_t *>(aligned + 2048), off + 4096, &bad, nullptr),
           QD_ERR_ARGUMENT);
    expect("quantize of int8 x (no float dtype)",
           qd_cuda_quantize(aligned, QD_CUDA_S8, 2, 32, 0, 1, 32, 0, reinterpret_cast<float *>(aligned + 1024),
                            reinterpret_cast<int8_t *>(aligned + 2048), aligned + 4096, &bad, nullptr),
           QD_ERR_ARGUMENT);
    expect("quantize of bfloat16 x, q over x's 128 bytes",
           qd_cuda_quantize(aligned, QD_CUDA_BF16, 2, 32, 0, 1, 32, 0, reinterpret_cast<float *>(aligned + 1024),
                            reinterpret_cast<int8_t *>(aligned + 96), aligned + 4096, &bad, nullptr),
           QD_ERR_ARGUMENT);
    if (!wrong) std::printf("every misaligned pointer is refused\n");
    return wrong ? 1 : 0;
}
