/* The fq (float32 x dequantized weights) kernels' shared plan, independent of the
 * vector width.  Lanes are panel columns: dword n of a unit holds column n's bytes,
 * so k-step i of a unit (k = unit * KU + i) is the field at bit qd_fq_field_bit(i)
 * of every dword, and a vector of columns needs no lane reduction at the end.
 *
 * Fixed order per output element, the same for every row count: k-step i of a
 * unit goes to partial sum i % P (P fixed per kernel; independent chains hide the
 * FMA latency; with 8-bit units of 4 k-steps the AVX-512 kernel fills 4 of its 8,
 * and pairing units to fill all 8 measured no faster at one row); at the end of a
 * group the partials are added pairwise and scaled once by the group's weight scale
 * into the row's accumulator. */
#ifndef QD_FQ_COMMON_H
#define QD_FQ_COMMON_H

#include "qd_internal.h"
#include "simd_common.h"

/* Bit offset of k-step i (k = s * 4 + j: sub-step s of byte j) inside a dword. */
QD_INLINE int qd_fq_field_bit(int bits, int i)
{
    return 8 * (i % 4) + (i / 4) * bits;
}

/* Rows that one kernel call shares each dequantized weight vector across. */
#define QD_FQ_MR_ZMM 3   /* with 8 partials each: 27 of the 32 zmm */
#define QD_FQ_MR_YMM 2

/* The kernels (fq_avx512vnni.c, fq_avx2.c). */
void qd_fq_tile_avx512(const qd_fq_tile *t);
void qd_fq_tile_avx2(const qd_fq_tile *t);

/* Units (cache lines) ahead to prefetch, about 4 KB: the hardware prefetcher alone
 * leaves weights that stream from DRAM well short of the read bandwidth. */
#define QD_FQ_PREFETCH_UNITS 64

#endif
