// Host code only (runs without a GPU): every kernel_index() of the Hopper GEMM
// names the kernel instance built for that mode, operand type, output dtype and
// way of taking column scales.  Built and run by test_build_support.py.
#include "gemm_s8_sm90.cu"

#include <cstdio>

int main() {
    int wrong = 0;
    auto expect = [&](int k, Kernel want, const char *what) {
        if (k < 0 || KERNELS[k] != want) {
            std::printf("kernel_index(%s) = %d names another kernel\n", what, k);
            ++wrong;
        }
    };
    expect(kernel_index(INT32_OUT, QD_CUDA_S32, S8, false), gemm_s8_sm90_kernel<int32_t, S8, false>, "int32 out");
#define QD_EXPECT(MODE, OPS, ONE)                                                                           \
    expect(kernel_index(MODE, QD_CUDA_F32, OPS, ONE), gemm_s8_sm90_kernel<float, OPS, MODE == GROUPED, ONE>, \
           #MODE " " #OPS " float32 " #ONE);                                                              \
    expect(kernel_index(MODE, QD_CUDA_F16, OPS, ONE), gemm_s8_sm90_kernel<__half, OPS, MODE == GROUPED, ONE>, \
           #MODE " " #OPS " float16 " #ONE);                                                              \
    expect(kernel_index(MODE, QD_CUDA_BF16, OPS, ONE),                                                    \
           gemm_s8_sm90_kernel<__nv_bfloat16, OPS, MODE == GROUPED, ONE>, #MODE " " #OPS " bfloat16 " #ONE);
    QD_EXPECT(ONE_GROUP, S8, false) QD_EXPECT(ONE_GROUP, F16, false) QD_EXPECT(ONE_GROUP, BF16, false)
    QD_EXPECT(GROUPED, S8, false) QD_EXPECT(GROUPED, F16, false) QD_EXPECT(GROUPED, BF16, false)
    QD_EXPECT(GROUPED, S8, true)
#undef QD_EXPECT
    const int kernels = (int)(sizeof KERNELS / sizeof KERNELS[0]);
    for (int k = 0; k < kernels; ++k)
        if (grouped_kernel(k) != (k >= FIRST_GROUPED)) {
            std::printf("grouped_kernel(%d) is wrong\n", k);
            ++wrong;
        }
    if (!wrong) std::printf("%d kernels, each where kernel_index() looks\n", kernels);
    return wrong ? 1 : 0;
}
