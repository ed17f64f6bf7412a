// Availability, the text of the last CUDA failure, and the process's setting of
// batch invariance (which the fq kernels read).
#include <atomic>
#include <cstdio>
#include <cstring>

#include "common.cuh"

namespace {
thread_local char last_error[256] = "";
// Whether fq's launches cut K the same way for every M (fq_matmul.cu, float_units.cu).
std::atomic<bool> batch_invariant{false};
}

namespace qd {
qd_status cuda_failure(cudaError_t err) {
    std::snprintf(last_error, sizeof last_error, "%s: %s", cudaGetErrorName(err),
                  cudaGetErrorString(err));
    // Reported now: cleared, so that the next launch's check does not report it
    // again (a sticky error stays with the context whatever is cleared here).
    cudaGetLastError();
    if (err == cudaErrorMemoryAllocation) return QD_ERR_NO_MEMORY;
    // A CUDA build on a machine without a GPU or driver: unavailable, as the header says
    if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return QD_ERR_CUDA_UNAVAILABLE;
    return QD_ERR_CUDA;
}
}  // namespace qd

extern "C" int qd_cuda_available(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

extern "C" const char *qd_cuda_last_error(void) { return last_error; }

extern "C" void qd_cuda_set_batch_invariant(int on) { batch_invariant.store(on != 0); }

extern "C" int qd_cuda_batch_invariant(void) { return batch_invariant.load(std::memory_order_relaxed) ? 1 : 0; }
