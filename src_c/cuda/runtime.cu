// Availability and the text of the last CUDA failure.
#include <cstdio>
#include <cstring>

#include "common.cuh"

namespace {
thread_local char last_error[256] = "";
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
