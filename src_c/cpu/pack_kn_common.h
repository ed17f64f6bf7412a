/* The 4 x 16 byte transpose of one 8-bit unit from row-major B [K, N], shared by
 * the pack_kn files (each compiles it with its own ISA flags). */
#ifndef QD_PACK_KN_COMMON_H
#define QD_PACK_KN_COMMON_H

#include "qd_internal.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Unit u of panel p when all its 4 rows and 16 columns lie inside B. */
static inline void qd_pack_kn_unit(const int8_t *b, int64_t N, int64_t u, int64_t p, uint8_t *unit)
{
    const int8_t *src = b + 4 * u * N + p * QD_NR;
#if defined(__SSE2__)
    const __m128i r0 = _mm_loadu_si128((const __m128i *)src);
    const __m128i r1 = _mm_loadu_si128((const __m128i *)(src + N));
    const __m128i r2 = _mm_loadu_si128((const __m128i *)(src + 2 * N));
    const __m128i r3 = _mm_loadu_si128((const __m128i *)(src + 3 * N));
    /* Bytes of rows 0,1 and 2,3 paired, then the pairs paired: 4 k per column. */
    const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
    const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
    _mm_store_si128((__m128i *)unit, _mm_unpacklo_epi16(lo01, lo23));
    _mm_store_si128((__m128i *)(unit + 16), _mm_unpackhi_epi16(lo01, lo23));
    _mm_store_si128((__m128i *)(unit + 32), _mm_unpacklo_epi16(hi01, hi23));
    _mm_store_si128((__m128i *)(unit + 48), _mm_unpackhi_epi16(hi01, hi23));
#else
    for (int n = 0; n < QD_NR; n++)
        for (int j = 0; j < 4; j++)
            unit[n * 4 + j] = (uint8_t)src[j * N + n];
#endif
}

#endif
