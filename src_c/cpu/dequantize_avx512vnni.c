/* AVX-512 dequantize kernels: dequantize_kernels.h compiled with AVX-512. */
#include "dequantize_kernels.h"

QD_DEQUANT_KERNELS(qd_dequant_kernels_avx512vnni);
