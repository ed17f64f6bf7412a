/* AVX-VNNI kernels (256-bit vpdpbusd, u8 x s8): weights made unsigned (w + bias),
 * exact dot = dpbusd - bias * sum(a over the group). */
#include "simd_ymm.h"
#include "fq_common.h"

/* acc += dot4(w, a) in place: through the intrinsic GCC copies the accumulators
 * every k-step. */
QD_INLINE __m256i dpbusd(__m256i acc, __m256i w, __m256i a)
{
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(a));
    return acc;
}

QD_DEFINE_YMM_QQ_BIASED(qq_units, dpbusd)

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int bits, const int mr)
{
    qd_ymm_qq_acc acc;
    memset(&acc, 0, sizeof acc);
    qq_units(t, &acc, bits, mr);
    qd_ymm_qq_store(t, &acc, mr);
}

#define QQ_CASE(MR) qq_tile_impl(t, bits, (MR) > QD_YMM_QQ_MR ? QD_YMM_QQ_MR : (MR))
QD_DEFINE_QQ_TILE(qq_tile_avxvnni, QQ_CASE)

const qd_kernels qd_kernels_avxvnni = {
    .qq_tile = qq_tile_avxvnni,
    .fq_tile = qd_fq_tile_avx2,
    .qq_mr = QD_YMM_QQ_MR,
    .fq_mr = QD_FQ_MR_YMM,
    .fq_short_groups = 1,
    .qq_short_groups = &qd_kernels_qq_short_groups_avx2,
    .needs_rowsum = 1,
};
