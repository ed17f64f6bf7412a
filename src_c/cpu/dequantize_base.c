/* Baseline dequantize kernels: SSE2 on x86-64, NEON on aarch64, as the compiler
 * vectorizes dequantize_kernels.h for them. */
#include "dequantize_kernels.h"

QD_DEQUANT_KERNELS(qd_dequant_kernels_base);
