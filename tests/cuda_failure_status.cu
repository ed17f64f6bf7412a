// Host code only (runs without a GPU): each CUDA failure comes back as the status
// the header names for it, with its text in qd_cuda_last_error(); and where this
// machine has no GPU or driver, an entry point given valid arguments reports
// QD_ERR_CUDA_UNAVAILABLE.  Built and run by test_build_support.py.
#include <cstdio>
#include <cstring>

#include "common.cuh"

static int wrong = 0;

static void expect(cudaError_t err, qd_status want) {
    const qd_status got = qd::cuda_failure(err);
    if (got != want || !std::strstr(qd_cuda_last_error(), cudaGetErrorName(err)))
        std::printf("%s: status %d, want %d; last error \"%s\"\n", cudaGetErrorName(err), (int)got, (int)want,
                    qd_cuda_last_error()), ++wrong;
}

int main() {
    expect(cudaErrorNoDevice, QD_ERR_CUDA_UNAVAILABLE);
    expect(cudaErrorInsufficientDriver, QD_ERR_CUDA_UNAVAILABLE);
    expect(cudaErrorMemoryAllocation, QD_ERR_NO_MEMORY);
    expect(cudaErrorInvalidValue, QD_ERR_CUDA);
    if (!qd_cuda_available()) {
        static float x[16], bias[8];
        const qd_status st = qd_cuda_add_bias_f32(x, 2, 8, bias, x, nullptr);
        if (st != QD_ERR_CUDA_UNAVAILABLE)
            std::printf("qd_cuda_add_bias_f32 without a GPU: status %d (%s)\n", (int)st, qd_cuda_last_error()), ++wrong;
    }
    if (!wrong) std::printf("every failure maps to its status\n");
    return wrong ? 1 : 0;
}
