// Host code only (runs without a GPU): the int8 GEMM's rules that need no device.
// - The mma.sync GEMM's pipeline depth fits the shared memory each GPU gives a block:
//   3 stages where they fit, 2 on sm_86 and sm_89 (99 KB), whose launches failed
//   when 3 (108 KB) were asked for everywhere.
// - Operands that are not 16-byte aligned are refused (QD_ERR_ARGUMENT) before any
//   CUDA call: the kernels copy rows 16 bytes at a time, and a misaligned copy is a
//   fault that ends the CUDA context.
// Built and run by test_build_support.py.
#include "gemm_s8.cu"

#include <cstdio>

static int wrong = 0;

static void check_stages() {
    struct Gpu {
        const char *name;
        int optin, stages;
    };
    const Gpu gpus[] = {{"sm_80 (A100)", 166912, 3}, {"sm_86 (A10, RTX 30xx)", 101376, 2},
                        {"sm_89 (L4, RTX 40xx)", 101376, 2}, {"sm_90 (H100)", 232448, 3}};
    for (const Gpu &g : gpus) {
        const int stages = stages_for(g.optin);
        if (stages != g.stages || smem_bytes(stages) > g.optin)
            std::printf("%s: %d stages (%d bytes) for %d bytes a block; want %d\n", g.name, stages,
                        smem_bytes(stages), g.optin, g.stages), ++wrong;
    }
}

static void expect_refused(const char *what, qd_status st) {
    if (st != QD_ERR_ARGUMENT) std::printf("%s: status %d, want QD_ERR_ARGUMENT\n", what, (int)st), ++wrong;
}

static void check_alignment() {
    // 16 x 16 operands, rows 16 bytes apart; never read: the checks come first
    alignas(16) static int8_t a[16 * 16 + 16], b[16 * 16 + 16];
    alignas(16) static float out[16 * 16], sa[16], sb[16];
    alignas(16) static int32_t c[16 * 16];
    for (int shift : {1, 4, 8}) {
        expect_refused("int_matmul, a misaligned", qd_cuda_int_matmul_s8(a + shift, b, 16, 16, 16, 16, c, nullptr));
        expect_refused("int_matmul, bt misaligned", qd_cuda_int_matmul_s8(a, b + shift, 16, 16, 16, 16, c, nullptr));
        expect_refused("qq, a misaligned", qd_cuda_qq_matmul(a + shift, b, 16, 16, 16, 16, sa, 1, 16, sb, 1, 16, out,
                                                            QD_CUDA_F32, nullptr));
        expect_refused("fq_gemm, w16 misaligned", qd_cuda_fq_gemm(a, b + shift, QD_CUDA_BF16, 16, 16, 8, 8, sb, 1, 8,
                                                                  out, QD_CUDA_F32, nullptr));
    }
}

int main() {
    check_stages();
    check_alignment();
    if (wrong == 0) std::printf("ok\n");
    return wrong != 0;
}
