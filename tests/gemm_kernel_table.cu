// Host code only (runs without a GPU): every kernel_index() of the Hopper GEMM
// names the kernel instance built for that mode, operand type, output dtype and
// way of ending blocks of K, and block_ends() picks each way where it belongs.
// Built and run by test_build_support.py.
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
    expect(kernel_index(INT32_OUT, QD_CUDA_S32, S8, IN_PLACE), gemm_s8_sm90_kernel<int32_t, S8, false>, "int32 out");
#define QD_EXPECT(MODE, OPS, ENDS)                                                                           \
    expect(kernel_index(MODE, QD_CUDA_F32, OPS, ENDS), gemm_s8_sm90_kernel<float, OPS, MODE == GROUPED, ENDS>, \
           #MODE " " #OPS " float32 " #ENDS);                                                              \
    expect(kernel_index(MODE, QD_CUDA_F16, OPS, ENDS), gemm_s8_sm90_kernel<__half, OPS, MODE == GROUPED, ENDS>, \
           #MODE " " #OPS " float16 " #ENDS);                                                              \
    expect(kernel_index(MODE, QD_CUDA_BF16, OPS, ENDS),                                                    \
           gemm_s8_sm90_kernel<__nv_bfloat16, OPS, MODE == GROUPED, ENDS>, #MODE " " #OPS " bfloat16 " #ENDS);
    QD_EXPECT(ONE_GROUP, S8, IN_PLACE) QD_EXPECT(ONE_GROUP, F16, IN_PLACE) QD_EXPECT(ONE_GROUP, BF16, IN_PLACE)
    QD_EXPECT(GROUPED, S8, IN_PLACE) QD_EXPECT(GROUPED, F16, IN_PLACE) QD_EXPECT(GROUPED, BF16, IN_PLACE)
    QD_EXPECT(GROUPED, S8, ONE_COLUMN_SCALE_ENDS)
    QD_EXPECT(GROUPED, F16, TWO_SETS_ENDS) QD_EXPECT(GROUPED, BF16, TWO_SETS_ENDS)
#undef QD_EXPECT
    // no kernel for a way of ending blocks that the mode or the operands don't take
    if (kernel_index(ONE_GROUP, QD_CUDA_F32, S8, ONE_COLUMN_SCALE_ENDS) >= 0 ||
        kernel_index(GROUPED, QD_CUDA_F32, S8, TWO_SETS_ENDS) >= 0 ||
        kernel_index(GROUPED, QD_CUDA_F32, BF16, ONE_COLUMN_SCALE_ENDS) >= 0) {
        std::printf("kernel_index() names a kernel for a way of ending blocks its operands don't take\n");
        ++wrong;
    }
    // block_ends(): int8 with weight blocks of whole 128-column tiles take one
    // column scale; 16-bit blocks of one or two k tiles (64 or 128 values) two sets.
    auto ends = [](Operands ops, int64_t b_bn, int64_t group_steps) {
        Scales sc{};
        sc.b_bn = b_bn;
        sc.group_steps = group_steps;
        return block_ends(ops, sc);
    };
    const struct { Operands ops; int64_t b_bn, group_steps; BlockEnds want; } cases[] = {
        {S8, 128, 1, ONE_COLUMN_SCALE_ENDS}, {S8, 256, 4, ONE_COLUMN_SCALE_ENDS}, {S8, 1, 4, IN_PLACE},
        {S8, 64, 8, IN_PLACE},               {BF16, 1, 4, TWO_SETS_ENDS},         {F16, 1, 8, TWO_SETS_ENDS},
        {BF16, 1, 2, IN_PLACE},              {BF16, 1, 6, IN_PLACE},              {F16, 1, 16, IN_PLACE},
    };
    for (const auto &c : cases)
        if (ends(c.ops, c.b_bn, c.group_steps) != c.want) {
            std::printf("block_ends(operands %d, b_bn %lld, group_steps %lld) = %d, want %d\n", (int)c.ops,
                        (long long)c.b_bn, (long long)c.group_steps, (int)ends(c.ops, c.b_bn, c.group_steps),
                        (int)c.want);
            ++wrong;
        }
    const int kernels = (int)(sizeof KERNELS / sizeof KERNELS[0]);
    for (int k = 0; k < kernels; ++k)
        if (grouped_kernel(k) != (k >= FIRST_GROUPED)) {
            std::printf("grouped_kernel(%d) is wrong\n", k);
            ++wrong;
        }
    if (!wrong) std::printf("%d kernels, each where kernel_index() looks\n", kernels);
    return wrong ? 1 : 0;
}
