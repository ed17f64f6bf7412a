// Host code only (runs without a GPU): the mma.sync GEMM's pipeline depth fits the
// shared memory each GPU gives a block: 3 stages where they fit, 2 on sm_86 and
// sm_89 (99 KB), whose launches failed when 3 (108 KB) were asked for everywhere.
// Built and run by test_build_support.py.
#include "gemm_s8.cu"

#include <cstdio>

int main() {
    struct Gpu {
        const char *name;
        int optin, stages;
    };
    const Gpu gpus[] = {{"sm_80 (A100)", 166912, 3}, {"sm_86 (A10, RTX 30xx)", 101376, 2},
                        {"sm_89 (L4, RTX 40xx)", 101376, 2}, {"sm_90 (H100)", 232448, 3}};
    int wrong = 0;
    for (const Gpu &g : gpus) {
        const int stages = stages_for(g.optin);
        if (stages != g.stages || smem_bytes(stages) > g.optin) {
            std::printf("%s: %d stages (%d bytes) for %d bytes a block; want %d\n", g.name, stages,
                        smem_bytes(stages), g.optin, g.stages);
            ++wrong;
        }
    }
    if (wrong == 0) std::printf("ok\n");
    return wrong != 0;
}
