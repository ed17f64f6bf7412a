/* AVX2 kernels.  8-bit weights: sign-extend to int16 (vpmovsxbw) and vpmaddwd,
 * exact for every int8 pair.  4- and 2-bit weights: the unsigned stored fields
 * (0..15 / 0..3) times s8 activations through vpmaddubsw cannot saturate
 * (|2 * 15 * -128| < 2^15), then vpmaddwd by ones widens to int32; the bias is
 * removed with the group sums of A as in the VNNI kernels. */
#include "simd_ymm.h"
#include "fq_common.h"

/* 8-bit: 16 bytes = columns 4c..4c+3 x 4 k become 16 int16; vpmaddwd against
 * a[k..k+3] repeated gives int32 pair sums (column, k-pair).  Two rows at a time. */
#define PAIR_ROWS 2

QD_INLINE __m256i pairs_to_columns(__m256i p0, __m256i p1)
{
    /* hadd gives columns 0,1,4,5 | 2,3,6,7; the permute puts them in order. */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(p0, p1), _MM_SHUFFLE(3, 1, 2, 0));
}

QD_INLINE void qq8_rows(const qd_qq_tile *t, qd_ymm_qq_acc *acc, int r0, const int rows)
{
    const uint8_t *wp = t->panel;
    qd_group_scales sc = qd_group_scales_start(t->w_scale, t);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        __m256i pacc[PAIR_ROWS][4];
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < 4; c++)
                pacc[r][c] = _mm256_setzero_si256();
        for (int64_t u = 0; u < t->group_units; u++, wp += QD_UNIT_BYTES, k0 += 4) {
            __m256i w16[4];
            for (int c = 0; c < 4; c++)
                w16[c] = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(wp + 16 * c)));
            for (int r = 0; r < rows; r++) {
                const __m256i a16 = _mm256_cvtepi8_epi16(
                    _mm_set1_epi32(qd_load_i32(t->a + (r0 + r) * t->lda + k0)));
                for (int c = 0; c < 4; c++)
                    pacc[r][c] = _mm256_add_epi32(pacc[r][c], _mm256_madd_epi16(w16[c], a16));
            }
        }
        for (int r = 0; r < rows; r++)
            qd_ymm_qq_group_end(t, acc, r0 + r, g, &sc, pairs_to_columns(pacc[r][0], pacc[r][1]),
                                pairs_to_columns(pacc[r][2], pacc[r][3]), 8, 0);
        qd_group_scales_next(&sc);
    }
}

/* Sub-byte fields (0..15 / 0..3) x s8 through vpmaddubsw cannot saturate. */
QD_INLINE __m256i dot_small_fields(__m256i acc, __m256i w, __m256i a)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));
}

QD_DEFINE_YMM_QQ_BIASED(qq_subbyte_impl, dot_small_fields)

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int bits, const int mr)
{
    qd_ymm_qq_acc acc;
    memset(&acc, 0, sizeof acc);
    if (bits == 8) {
        int r0 = 0;
        for (; r0 + PAIR_ROWS <= mr; r0 += PAIR_ROWS)
            qq8_rows(t, &acc, r0, PAIR_ROWS);
        if (r0 < mr)
            qq8_rows(t, &acc, r0, 1);
    } else {
        qq_subbyte_impl(t, &acc, bits, mr);
    }
    qd_ymm_qq_store(t, &acc, mr);
}

#define QQ_CASE(MR) qq_tile_impl(t, bits, (MR) > QD_YMM_QQ_MR ? QD_YMM_QQ_MR : (MR))
QD_DEFINE_QQ_TILE(qq_tile_avx2, QQ_CASE)

const qd_kernels qd_kernels_avx2 = {
    .qq_tile = qq_tile_avx2,
    .fq_tile = qd_fq_tile_avx2,
    .qq_mr = QD_YMM_QQ_MR,
    .fq_mr = QD_FQ_MR_YMM,
    .fq_short_groups = 1,
    .qq_short_groups = &qd_kernels_qq_short_groups_avx2,
    .needs_rowsum = 1,
};
