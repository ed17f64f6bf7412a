// The Hopper (sm_90a) GEMM: wgmma fed by TMA, for every mode of gemm_s8.cu.
#pragma once
#include "gemm_s8.cuh"

namespace qd {

// True when the current device is compute capability 9.0 and this build carries
// the sm_90a kernel for it.
bool gemm_s8_sm90_usable();

// C = A * Bt^T as gemm_s8.cu's kernel computes it, for mode INT32_OUT (out int32,
// int8 operands), ONE_GROUP, or GROUPED (a scales with int8 operands, none with
// 16-bit ones; Kp whole blocks of sc.group_steps steps) (out_dtype QD_CUDA_F32 /
// F16 / BF16).  A [M, ld] and
// Bt [N, ld] of `ops`, 16-byte aligned, ld and the K extent Kp (a multiple of 16)
// in bytes.
qd_status gemm_s8_sm90(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t Kp,
                       int64_t ld, void *out, int out_dtype, const Scales &sc, GemmMode mode, Operands ops,
                       cudaStream_t stream);

}  // namespace qd
