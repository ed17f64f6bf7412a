/* AVX2 dequantize kernels (also used for AVX-VNNI): dequantize_kernels.h compiled
 * with AVX2 and F16C. */
#include "dequantize_kernels.h"

QD_DEQUANT_KERNELS(qd_dequant_kernels_avx2);
