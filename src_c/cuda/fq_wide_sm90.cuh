// fq for a few tens to a few hundred rows of 16-bit x on Hopper (sm_90a): the
// decode tiles' values go from registers straight into wgmma.
#pragma once
#include "fq_tiles.cuh"

namespace qd {
namespace fq {

// out[M, N] (out_dtype) = x @ dequantize(w)^T for bf16 or f16 x of any M, the
// `bits`-bit weights streamed once per 64 rows, on the current device (`device`,
// with `sms` multiprocessors).  The caller checks that the sm_90a kernels run
// here (gemm_s8_sm90_usable) and that x is not float32.
qd_status wide_matmul(const Operand &op, int bits, void *out, int out_dtype, int device, int sms,
                      cudaStream_t stream);

}  // namespace fq
}  // namespace qd
