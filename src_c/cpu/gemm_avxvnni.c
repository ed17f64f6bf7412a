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

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int bits, const int mr)
{
    const int ku = QD_KU(bits), substeps = 8 / bits;
    const uint8_t *wp = t->panel;
    qd_ymm_qq_acc acc;
    memset(&acc, 0, sizeof acc);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        __m256i lo[QD_YMM_QQ_MR], hi[QD_YMM_QQ_MR];
        for (int r = 0; r < mr; r++)
            lo[r] = hi[r] = _mm256_setzero_si256();
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += ku) {
            const __m256i v_lo = _mm256_load_si256((const __m256i *)wp);
            const __m256i v_hi = _mm256_load_si256((const __m256i *)(wp + 32));
            for (int s = 0; s < substeps; s++) {
                const __m256i w_lo = qd_ymm_unpack_biased(v_lo, bits, s);
                const __m256i w_hi = qd_ymm_unpack_biased(v_hi, bits, s);
                for (int r = 0; r < mr; r++) {
                    const __m256i a4 = _mm256_set1_epi32(qd_load_i32(t->a + r * t->lda + k0 + 4 * s));
                    lo[r] = dpbusd(lo[r], w_lo, a4);
                    hi[r] = dpbusd(hi[r], w_hi, a4);
                }
            }
        }
        for (int r = 0; r < mr; r++)
            qd_ymm_qq_group_end(t, &acc, r, g, lo[r], hi[r], bits, 1);
    }
    qd_ymm_qq_store(t, &acc, mr);
}

#define QQ_CASE(MR) qq_tile_impl(t, bits, (MR) > QD_YMM_QQ_MR ? QD_YMM_QQ_MR : (MR))
QD_DEFINE_QQ_TILE(qq_tile_avxvnni, QQ_CASE)

const qd_kernels qd_kernels_avxvnni = {
    .qq_tile = qq_tile_avxvnni,
    .fq_tile = qd_fq_tile_avx2,
    .qq_mr = QD_YMM_QQ_MR,
    .fq_mr = QD_FQ_MR_YMM,
    .needs_rowsum = 1,
};
