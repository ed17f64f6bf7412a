/* AVX2 packing of row-major int8 B [K, N]: one 32-byte load per row covers two
 * panels; the byte/word interleaves run per 128-bit lane (one panel each) and a
 * lane swap puts each panel's unit together. */
#include <immintrin.h>
#include "pack_kn_common.h"

static void pack_full(const int8_t *b, int64_t N, int64_t units, int64_t p0, int np,
                      int64_t panel_bytes, uint8_t *dst)
{
    for (int64_t u = 0; u < units; u++) {
        int i = 0;
        for (; i + 2 <= np; i += 2) {
            const int8_t *src = b + 4 * u * N + (p0 + i) * QD_NR;
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)src);
            const __m256i r1 = _mm256_loadu_si256((const __m256i *)(src + N));
            const __m256i r2 = _mm256_loadu_si256((const __m256i *)(src + 2 * N));
            const __m256i r3 = _mm256_loadu_si256((const __m256i *)(src + 3 * N));
            const __m256i lo01 = _mm256_unpacklo_epi8(r0, r1), hi01 = _mm256_unpackhi_epi8(r0, r1);
            const __m256i lo23 = _mm256_unpacklo_epi8(r2, r3), hi23 = _mm256_unpackhi_epi8(r2, r3);
            /* Lane l of x0..x3 holds bytes 0-15, 16-31, 32-47, 48-63 of panel i + l's unit. */
            const __m256i x0 = _mm256_unpacklo_epi16(lo01, lo23), x1 = _mm256_unpackhi_epi16(lo01, lo23);
            const __m256i x2 = _mm256_unpacklo_epi16(hi01, hi23), x3 = _mm256_unpackhi_epi16(hi01, hi23);
            __m256i *d0 = (__m256i *)(dst + i * panel_bytes + u * QD_UNIT_BYTES);
            __m256i *d1 = (__m256i *)(dst + (i + 1) * panel_bytes + u * QD_UNIT_BYTES);
            _mm256_store_si256(d0, _mm256_permute2x128_si256(x0, x1, 0x20));
            _mm256_store_si256(d0 + 1, _mm256_permute2x128_si256(x2, x3, 0x20));
            _mm256_store_si256(d1, _mm256_permute2x128_si256(x0, x1, 0x31));
            _mm256_store_si256(d1 + 1, _mm256_permute2x128_si256(x2, x3, 0x31));
        }
        for (; i < np; i++)
            qd_pack_kn_unit(b, N, u, p0 + i, dst + i * panel_bytes + u * QD_UNIT_BYTES);
    }
}

const qd_pack_kn_fn qd_pack_kn_avx2 = pack_full;
