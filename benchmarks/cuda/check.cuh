// The standalone CUDA tools' error checks: a failed CUDA call (CK) or qdispatch
// call (QK) prints where and why, and exits; and their timing of back-to-back calls.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "qdispatch.h"

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(2);                                                                      \
        }                                                                                      \
    } while (0)
#define QK(x)                                                                                  \
    do {                                                                                       \
        qd_status s_ = (x);                                                                    \
        if (s_ != QD_OK) {                                                                     \
            std::fprintf(stderr, "%s:%d: %s -> status %d (%s)\n", __FILE__, __LINE__, #x, (int)s_, \
                         qd_cuda_last_error());                                                \
            std::exit(2);                                                                      \
        }                                                                                      \
    } while (0)

// ms per call: the median over 7 runs of `calls` back-to-back launch(i), i rotating
// over `sets` sets of inputs (each tool sizes them past L2), after 3 warm-up calls.
template <typename Launch>
double median_ms(Launch launch, int sets, int calls = 20) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) launch(i % sets);
    CK(cudaDeviceSynchronize());
    std::vector<float> runs;
    int it = 0;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < calls; ++i) launch(it++ % sets);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        runs.push_back(ms / calls);
    }
    std::sort(runs.begin(), runs.end());
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return runs[runs.size() / 2];
}
