/* AVX-512 packing of row-major int8 B [K, N]: one 64-byte load per row covers
 * four panels; the byte/word interleaves run per 128-bit lane (one panel each)
 * and a 4 x 4 transpose of lanes puts each panel's unit together. */
#include <immintrin.h>
#include "pack_kn_common.h"

static void pack_full(const int8_t *b, int64_t N, int64_t units, int64_t p0, int np,
                      int64_t panel_bytes, uint8_t *dst)
{
    for (int64_t u = 0; u < units; u++) {
        int i = 0;
        for (; i + 4 <= np; i += 4) {
            const int8_t *src = b + 4 * u * N + (p0 + i) * QD_NR;
            const __m512i r0 = _mm512_loadu_si512(src), r1 = _mm512_loadu_si512(src + N);
            const __m512i r2 = _mm512_loadu_si512(src + 2 * N), r3 = _mm512_loadu_si512(src + 3 * N);
            const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
            const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
            /* Lane l of x0..x3 holds bytes 0-15, 16-31, 32-47, 48-63 of panel i + l's unit. */
            const __m512i x0 = _mm512_unpacklo_epi16(lo01, lo23), x1 = _mm512_unpackhi_epi16(lo01, lo23);
            const __m512i x2 = _mm512_unpacklo_epi16(hi01, hi23), x3 = _mm512_unpackhi_epi16(hi01, hi23);
            const __m512i t0 = _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));
            const __m512i t1 = _mm512_shuffle_i32x4(x2, x3, _MM_SHUFFLE(1, 0, 1, 0));
            const __m512i t2 = _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));
            const __m512i t3 = _mm512_shuffle_i32x4(x2, x3, _MM_SHUFFLE(3, 2, 3, 2));
            uint8_t *d = dst + i * panel_bytes + u * QD_UNIT_BYTES;
            _mm512_store_si512(d, _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)));
            _mm512_store_si512(d + panel_bytes, _mm512_shuffle_i32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
            _mm512_store_si512(d + 2 * panel_bytes, _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(2, 0, 2, 0)));
            _mm512_store_si512(d + 3 * panel_bytes, _mm512_shuffle_i32x4(t2, t3, _MM_SHUFFLE(3, 1, 3, 1)));
        }
        for (; i < np; i++)
            qd_pack_kn_unit(b, N, u, p0 + i, dst + i * panel_bytes + u * QD_UNIT_BYTES);
    }
}

const qd_pack_kn_fn qd_pack_kn_avx512vnni = pack_full;
