// The standalone CUDA tools' error checks: a failed CUDA call (CK) or qdispatch
// call (QK) prints where and why, and exits.
#pragma once
#include <cstdio>
#include <cstdlib>

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
