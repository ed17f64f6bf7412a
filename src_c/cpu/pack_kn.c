/* Packing a row-major int8 B [K, N] straight into the 8-bit panel layout, a few
 * panels at a time, for matmuls whose right operand comes unpacked on every call:
 * no transposed copy, and each unit is a 4 x 16 byte transpose. */
#include <string.h>
#include "qd_internal.h"
#include "panel_layout.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Unit u of panel p when all its 4 rows and 16 columns lie inside B. */
static void pack_full_unit(const int8_t *b, int64_t N, int64_t u, int64_t p, uint8_t *unit)
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

/* A unit on the edge of B: zero padding beyond K and N. */
static void pack_edge_unit(const int8_t *b, int64_t K, int64_t N, int64_t u, int64_t p, uint8_t *unit)
{
    memset(unit, 0, QD_UNIT_BYTES);
    for (int n = 0; n < QD_NR && p * QD_NR + n < N; n++)
        for (int j = 0; j < 4 && 4 * u + j < K; j++)
            unit[n * 4 + j] = (uint8_t)b[(4 * u + j) * N + p * QD_NR + n];
}

void qd_pack_s8_kn_panels(const int8_t *b, int64_t K, int64_t N, int64_t p0, int np,
                          int64_t panel_bytes, uint8_t *dst)
{
    const int64_t units = (K + 3) / 4, full_units = K / 4, full_panels = N / QD_NR;
    for (int64_t u = 0; u < units; u++)
        for (int i = 0; i < np; i++) {
            uint8_t *unit = dst + i * panel_bytes + u * QD_UNIT_BYTES;
            if (u < full_units && p0 + i < full_panels)
                pack_full_unit(b, N, u, p0 + i, unit);
            else
                pack_edge_unit(b, K, N, u, p0 + i, unit);
        }
}
