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

/* Prefetches the weight unit (cache line) that the stream reaches later: the
 * hardware prefetcher alone leaves weights that stream from DRAM well short of the
 * read bandwidth.  8-bit units go to L2, 8 KB ahead; 4- and 2-bit units, with twice
 * the arithmetic per byte or more, to L1, 4 KB ahead.  On Zen 4, one thread at
 * 1 and 3 x 4096 x 4096: 8-bit 15-20% faster than L1 4 KB ahead (as it was), 4-bit
 * 8% slower in L2. */
QD_INLINE void qd_fq_prefetch(const uint8_t *unit, int bits)
{
    /* The address may lie past the panels' end, where pointer arithmetic is undefined:
     * it is formed as an integer (a prefetch never faults). */
    if (bits == 8)
        __builtin_prefetch((const void *)((uintptr_t)unit + 128 * QD_UNIT_BYTES), 0, 2);  /* prefetcht1 */
    else
        __builtin_prefetch((const void *)((uintptr_t)unit + 64 * QD_UNIT_BYTES), 0, 3);   /* prefetcht0 */
}

#endif
