// Products whose scale blocks along K are too fine for the tensor-core kernels, on
// the float units (float_units.cu): qq's here, fq's through qd_cuda_fq_values.
#pragma once
#include "common.cuh"
#include "gemm_s8.cuh"

namespace qd {

// qq blocks along K of at most this many values (products summed below 2^24, exact
// in float32) run here.
constexpr int64_t FINE_GROUP_MAX = 7;

// out [M, N] = a [M, ld] x bt [N, ld]^T over K, in groups of G (1 <= G <= FINE_GROUP_MAX)
// values scaled by sc, the reference's bits.  The operands are checked by the caller.
qd_status qq_fine_groups(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K, int64_t ld,
                         const Scales &sc, int64_t G, void *out, int out_dtype, cudaStream_t s);

}  // namespace qd
