/* The fq (float32 x dequantized weights) kernels' shared plan, independent of the
 * vector width.  Lanes are panel columns: dword n of a unit holds column n's bytes,
 * so k-step i of a unit (k = unit * KU + i) is the field at bit qd_fq_field_bit(i)
 * of every dword, and a vector of columns needs no lane reduction at the end.
 *
 * Fixed order per output element, the same for every row count: k-step i of a
 * group goes to partial sum i % P (P fixed per kernel; independent chains hide the
 * FMA latency); at the end of a group the partials are added pairwise and scaled
 * once by the group's weight scale into the row's accumulator. */
#ifndef QD_FQ_COMMON_H
#define QD_FQ_COMMON_H

#include "qd_internal.h"
#include "simd_common.h"

/* Bit offset of k-step i (k = s * 4 + j: sub-step s of byte j) inside a dword. */
QD_INLINE int qd_fq_field_bit(int bits, int i)
{
    return 8 * (i % 4) + (i / 4) * bits;
}

/* Panels one call takes: a one-row tile runs them together for independent
 * chains (each column's order is unchanged); more rows go panel by panel. */
#define QD_FQ_NP 2

/* Panel i of a multi-panel tile, as a one-panel tile. */
QD_INLINE qd_fq_tile qd_fq_panel_of(const qd_fq_tile *t, int i)
{
    qd_fq_tile s = *t;
    s.np = 1;
    s.panel += i * t->panel_stride;
    s.w_scale += i * t->ngroups * QD_NR;
    s.out += i * QD_NR;
    s.nr = i == t->np - 1 ? t->nr : QD_NR;
    return s;
}

/* Rows that one kernel call shares each dequantized weight vector across. */
#define QD_FQ_MR_ZMM 4
#define QD_FQ_MR_YMM 2

/* The kernels (fq_avx512vnni.c, fq_avx2.c). */
void qd_fq_tile_avx512(const qd_fq_tile *t);
void qd_fq_tile_avx2(const qd_fq_tile *t);

/* Units (cache lines) ahead to prefetch, about 4 KB: the hardware prefetcher alone
 * leaves weights that stream from DRAM well short of the read bandwidth. */
#define QD_FQ_PREFETCH_UNITS 64

#endif
