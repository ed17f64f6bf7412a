// Weight-streaming fq product on the tensor cores (bf16 mma, sm_80 and later).
#pragma once
#include "common.cuh"

namespace qd {

struct FqScales {
    const float *s; int64_t ld, bn, bk;
    bool per_chunk;  // more than one scale block along K
    // k past K (zero padding) reads the last block's scale, never past the row.
    __device__ float at(int64_t n, int64_t k) const {
        return s[(n / bn) * ld + (per_chunk ? min(k / bk, ld - 1) : 0)];
    }
};

// 1 when the current device runs the tensor-core path.
bool fq_mma_usable();

// x float32 [M <= 16, ld] times w [N, ld] (int8, or packed int4/int2 words).
qd_status fq_mma(const float *x, int M, const void *w, int bits, int64_t N, int64_t ld,
                 const FqScales &sc, float *out, cudaStream_t s);

}  // namespace qd
