/* Packing int8 / int4 / int2 weights [N, K] into the kernels' panel layout
 * (see qd_internal.h), and back. */
#include <stdlib.h>
#include <string.h>
#include "qd_internal.h"
#include "panel_layout.h"

/* Marks live packed weights; cleared by qd_packed_weights_free. */
#define QD_PACKED_MAGIC 0x71647061636b6564ull   /* "qdpacked" */

#if defined(__SSE2__)
#include <emmintrin.h>

/* Weights are packed 16 rows x 16 k at a time: sixteen 16-byte loads, a 4-byte
 * granular transpose into four 8-bit units (k quads t = 0..3), then for 4 and 2
 * bits the quads are biased and merged into 2 or 1 sub-byte units.  Each row is
 * read sequentially and each panel written once, in order. */
typedef struct {
    __m128i v[4][4];   /* [quad t][columns 4c..4c+3] */
} quads;

/* out[j]'s dword i is in[i]'s dword j: 16 bytes of 4 rows <-> 4 quads of k for
 * them, either way. */
static void transpose_dwords(const __m128i in[4], __m128i out[4])
{
    const __m128i ab_lo = _mm_unpacklo_epi32(in[0], in[1]), ab_hi = _mm_unpackhi_epi32(in[0], in[1]);
    const __m128i de_lo = _mm_unpacklo_epi32(in[2], in[3]), de_hi = _mm_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm_unpacklo_epi64(ab_lo, de_lo);
    out[1] = _mm_unpackhi_epi64(ab_lo, de_lo);
    out[2] = _mm_unpacklo_epi64(ab_hi, de_hi);
    out[3] = _mm_unpackhi_epi64(ab_hi, de_hi);
}

/* rows[n] + k0: 16 bytes of row n (rows past N and bytes past K read as 0). */
static void load_transposed(const int8_t *w, int64_t K, int nrows, int64_t row0, int64_t k0, quads *out)
{
    __m128i r[QD_NR];
    if (nrows == QD_NR && k0 + 16 <= K) {
        for (int n = 0; n < QD_NR; n++)
            r[n] = _mm_loadu_si128((const __m128i *)(w + (row0 + n) * K + k0));
    } else {
        int8_t tile[QD_NR][16] = {{0}};
        const int64_t kn = K - k0 < 16 ? K - k0 : 16;
        for (int n = 0; n < nrows; n++)
            memcpy(tile[n], w + (row0 + n) * K + k0, (size_t)kn);
        for (int n = 0; n < QD_NR; n++)
            r[n] = _mm_loadu_si128((const __m128i *)tile[n]);
    }
    /* Rows 4c..4c+3: a 4 x 4 transpose of dwords gives quad t's bytes for them. */
    for (int c = 0; c < 4; c++) {
        __m128i t[4];
        transpose_dwords(r + 4 * c, t);
        for (int q = 0; q < 4; q++)
            out->v[q][c] = t[q];
    }
}

/* Packs one panel; returns nonzero when a value does not fit in `bits`. */
static int pack_panel(const int8_t *w, int64_t N, int64_t K, int bits, int64_t p,
                      int64_t panel_units, uint8_t *panel)
{
    const int64_t row0 = p * QD_NR;
    const int nrows = N - row0 < QD_NR ? (int)(N - row0) : QD_NR;
    const int per_unit = 8 / bits;                   /* quads merged into one unit */
    const __m128i bias = _mm_set1_epi8((char)(bits == 8 ? 0 : 1 << (bits - 1)));
    const __m128i field = _mm_set1_epi8((char)((1 << bits) - 1));
    __m128i outside = _mm_setzero_si128();
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        quads t;
        load_transposed(w, K, nrows, row0, k0, &t);
        for (int i = 0; i < 4 / per_unit; i++) {
            const int64_t unit = k0 / QD_KU(bits) + i;
            if (unit >= panel_units)
                break;
            __m128i *dst = (__m128i *)(panel + unit * QD_UNIT_BYTES);
            for (int c = 0; c < 4; c++) {
                __m128i acc = bits == 8 ? t.v[i][c] : _mm_setzero_si128();
                for (int s = 0; bits != 8 && s < per_unit; s++) {
                    /* Biased values outside the field mark out-of-range input; the
                     * masked field shifted inside its 16-bit lane never crosses a byte. */
                    const __m128i v = _mm_add_epi8(t.v[i * per_unit + s][c], bias);
                    outside = _mm_or_si128(outside, _mm_andnot_si128(field, v));
                    acc = _mm_or_si128(acc, _mm_slli_epi16(_mm_and_si128(v, field), s * bits));
                }
                _mm_store_si128(dst + c, acc);
            }
        }
    }
    return _mm_movemask_epi8(_mm_cmpeq_epi8(outside, _mm_setzero_si128())) != 0xFFFF;
}

/* pack_panel reversed: per 16 k the units' fields as quads, unbiased, then the same
 * transpose back to rows. */
void qd_unpack_panel(const qd_packed_weights *pw, int64_t p, int8_t *rows_out)
{
    const uint8_t *panel = pw->panels + p * pw->panel_bytes;
    const int64_t K = pw->k, panel_units = pw->panel_bytes / QD_UNIT_BYTES;
    const int bits = pw->bits, nrows = pw->n - p * QD_NR < QD_NR ? (int)(pw->n - p * QD_NR) : QD_NR;
    const int per_unit = 8 / bits;
    const __m128i bias = _mm_set1_epi8((char)(bits == 8 ? 0 : 1 << (bits - 1)));
    const __m128i field = _mm_set1_epi8((char)((1 << bits) - 1));
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        __m128i quad[4][4] = {{_mm_setzero_si128()}};  /* [columns 4c..4c+3][quad t] */
        for (int i = 0; i < 4 / per_unit && k0 / QD_KU(bits) + i < panel_units; i++) {
            const __m128i *src = (const __m128i *)(panel + (k0 / QD_KU(bits) + i) * QD_UNIT_BYTES);
            for (int c = 0; c < 4; c++) {
                const __m128i unit = _mm_load_si128(src + c);
                for (int s = 0; s < per_unit; s++)  /* the mask drops what the shift brings in from the next byte */
                    quad[c][i * per_unit + s] =
                        bits == 8 ? unit : _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(unit, s * bits), field), bias);
            }
        }
        __m128i rows[QD_NR];
        for (int c = 0; c < 4; c++)
            transpose_dwords(quad[c], rows + 4 * c);
        const int64_t kn = K - k0 < 16 ? K - k0 : 16;
        for (int n = 0; n < nrows; n++) {
            int8_t *dst = rows_out + n * K + k0;
            if (kn == 16) {
                _mm_storeu_si128((__m128i *)dst, rows[n]);
            } else {
                int8_t tail[16];
                _mm_storeu_si128((__m128i *)tail, rows[n]);
                memcpy(dst, tail, (size_t)kn);
            }
        }
    }
}
#else
static int value_fits(int v, int bits)
{
    const int lo = -(1 << (bits - 1)), hi = (1 << (bits - 1)) - 1;
    return v >= lo && v <= hi;
}

/* Portable fallback: one element at a time. */
static int pack_panel(const int8_t *w, int64_t N, int64_t K, int bits, int64_t p,
                      int64_t panel_units, uint8_t *panel)
{
    int outside = 0;
    memset(panel, qd_panel_zero_byte(bits), (size_t)(panel_units * QD_UNIT_BYTES));
    for (int n = 0; n < QD_NR && p * QD_NR + n < N; n++) {
        const int8_t *row = w + (p * QD_NR + n) * K;
        for (int64_t k = 0; k < K; k++) {
            outside |= !value_fits(row[k], bits);
            qd_panel_put(panel, bits, k, n, row[k]);
        }
    }
    return outside;
}

/* Portable fallback, unit by unit: column n's four bytes of a unit hold 8 / bits
 * fields each, field f the values at k = f * 4 + j of the unit. */
void qd_unpack_panel(const qd_packed_weights *pw, int64_t p, int8_t *rows_out)
{
    const uint8_t *panel = pw->panels + p * pw->panel_bytes;
    const int64_t K = pw->k;
    const int bits = pw->bits, ku = QD_KU(bits), bias = 1 << (bits - 1);
    const unsigned mask = (1u << bits) - 1;
    for (int n = 0; n < QD_NR && p * QD_NR + n < pw->n; n++) {
        const uint8_t *bytes = panel + n * 4;
        int8_t *row = rows_out + n * K;
        for (int64_t k0 = 0; k0 < K; k0 += ku, bytes += QD_UNIT_BYTES) {
            const int in_unit = K - k0 < ku ? (int)(K - k0) : ku;
            for (int i = 0; i < in_unit; i++) {
                const int f = i / 4, j = i % 4;
                row[k0 + i] = bits == 8 ? (int8_t)bytes[j] : (int8_t)((int)((bytes[j] >> (f * bits)) & mask) - bias);
            }
        }
    }
}
#endif

/* Whether *out's slot lies in w or the scales, where their dims are sound (other
 * dims are an error found after). */
static int out_in_inputs(qd_packed_weights *const *out, const int8_t *w, int64_t N, int64_t K,
                         const float *scales, int64_t block_n, int64_t block_k)
{
    if (N <= 0 || K <= 0 || !qd_dims_fit(N, K, sizeof(float)))
        return 0;
    if (w && qd_overlap(out, sizeof *out, w, (size_t)(N * K)))
        return 1;
    if (!scales || block_n <= 0 || block_k <= 0 || N % block_n || K % block_k)
        return 0;
    return qd_overlap(out, sizeof *out, scales, (size_t)((N / block_n) * (K / block_k)) * sizeof(float));
}

qd_status qd_pack_weights(const int8_t *w, int64_t N, int64_t K, int bits,
                          const float *scales, int64_t block_n, int64_t block_k,
                          qd_packed_weights **out)
{
    if (!out)
        return QD_ERR_NULL;
    if (out_in_inputs(out, w, N, K, scales, block_n, block_k))
        return QD_ERR_ARGUMENT;   /* the NULL below would change an input */
    *out = NULL;   /* on every other error, so a caller may free *out unconditionally */
    if (!w)
        return QD_ERR_NULL;
    if (bits != 8 && bits != 4 && bits != 2)
        return QD_ERR_SCHEME;
    if (N <= 0 || K <= 0 || block_n <= 0 || block_k <= 0 || N % block_n || K % block_k)
        return QD_ERR_SHAPE;
    if (!qd_dims_fit(N, K, sizeof(float)))   /* float: the scales may be [N, K] */
        return QD_ERR_ARGUMENT;
    qd_packed_weights *pw = qd_packed_new(N, K, bits, scales, block_n, block_k);
    if (!pw)
        return QD_ERR_NO_MEMORY;
    /* Range errors are found while packing (one pass over w), then reported. */
    int outside = 0;
    const int64_t panel_units = pw->panel_bytes / QD_UNIT_BYTES;
    QD_PARALLEL_FOR(qd_threads_for(N * K / 65536 + 1), pw->n_panels, reduction(|: outside),
    for (int64_t p = 0; p < pw->n_panels; p++)
        outside |= pack_panel(w, N, K, bits, p, panel_units, pw->panels + p * pw->panel_bytes););
    if (bits != 8 && outside) {
        qd_packed_weights_free(pw);
        return QD_ERR_ARGUMENT;
    }
    *out = pw;
    return QD_OK;
}

void qd_packed_layout(qd_packed_weights *pw, int64_t N, int64_t K, int bits,
                      int64_t block_n, int64_t block_k)
{
    const int ku = QD_KU(bits);
    pw->n = N;
    pw->k = K;
    pw->bits = bits;
    pw->block_n = block_n;
    pw->block_k = block_k;
    pw->k_padded = (K + ku - 1) / ku * ku;
    pw->n_panels = (N + QD_NR - 1) / QD_NR;
    pw->panel_bytes = pw->k_padded / ku * QD_UNIT_BYTES;
    pw->k_groups = K / block_k;
}

qd_packed_weights *qd_packed_new(int64_t N, int64_t K, int bits, const float *scales,
                                 int64_t block_n, int64_t block_k)
{
    qd_packed_weights *pw = calloc(1, sizeof *pw);
    if (!pw)
        return NULL;
    pw->magic = QD_PACKED_MAGIC;
    qd_packed_layout(pw, N, K, bits, block_n, block_k);
    const int64_t grid = (N / block_n) * pw->k_groups;
    pw->panels = qd_aligned_alloc((size_t)(pw->n_panels * pw->panel_bytes));
    pw->panel_scales = qd_aligned_alloc((size_t)(pw->n_panels * pw->k_groups * QD_NR) * sizeof(float));
    pw->scales = malloc((size_t)grid * sizeof(float));
    if (!pw->panels || !pw->panel_scales || !pw->scales) {
        qd_packed_weights_free(pw);
        return NULL;
    }
    for (int64_t i = 0; i < grid; i++)
        pw->scales[i] = scales ? scales[i] : 1.0f;
    for (int64_t col = 0; col < pw->n_panels * QD_NR; col++) {
        float *pscale = pw->panel_scales + (col / QD_NR) * pw->k_groups * QD_NR + col % QD_NR;
        for (int64_t g = 0; g < pw->k_groups; g++)
            pscale[g * QD_NR] = col < N ? pw->scales[(col / block_n) * pw->k_groups + g] : 0.0f;
    }
    return pw;
}

qd_status qd_packed_check(const qd_packed_weights *pw)
{
    if (!pw)
        return QD_ERR_NULL;
    return pw->magic == QD_PACKED_MAGIC ? QD_OK : QD_ERR_ARGUMENT;
}

void qd_packed_weights_free(qd_packed_weights *pw)
{
    if (qd_packed_check(pw) != QD_OK)
        return;   /* not ours to free */
    pw->magic = 0;
    qd_aligned_free(pw->panels);
    qd_aligned_free(pw->panel_scales);
    free(pw->scales);
    free(pw);
}

size_t qd_packed_weights_nbytes(const qd_packed_weights *pw)
{
    if (qd_packed_check(pw) != QD_OK)
        return 0;
    return (size_t)(pw->n_panels * pw->panel_bytes) +
           (size_t)(pw->n_panels * pw->k_groups * QD_NR) * sizeof(float) +
           (size_t)((pw->n / pw->block_n) * pw->k_groups) * sizeof(float);
}

qd_status qd_packed_weights_info(const qd_packed_weights *pw, int64_t *N, int64_t *K, int *bits,
                                 int64_t *block_n, int64_t *block_k)
{
    const qd_status st = qd_packed_check(pw);
    if (st != QD_OK)
        return st;
    if (N) *N = pw->n;
    if (K) *K = pw->k;
    if (bits) *bits = pw->bits;
    if (block_n) *block_n = pw->block_n;
    if (block_k) *block_k = pw->block_k;
    return QD_OK;
}

qd_status qd_unpack_weights(const qd_packed_weights *pw, int8_t *w_out, float *scales_out)
{
    const qd_status st = qd_packed_check(pw);
    if (st != QD_OK)
        return st;
    const size_t scale_bytes = (size_t)((pw->n / pw->block_n) * pw->k_groups) * sizeof(float);
    if (w_out && scales_out && qd_overlap(w_out, (size_t)(pw->n * pw->k), scales_out, scale_bytes))
        return QD_ERR_ARGUMENT;
    if (w_out) {
        /* The python package reads a weight's values back this way wherever they are
         * asked for, so this loop matters: a column at a time, each 64-byte unit read
         * for its 4 bytes, took 2-2.6x as long (4096 x 4096, one thread). */
        QD_PARALLEL_FOR(qd_threads_for(pw->n * pw->k / 65536 + 1), pw->n_panels, ,
        for (int64_t p = 0; p < pw->n_panels; p++)
            qd_unpack_panel(pw, p, w_out + p * QD_NR * pw->k););
    }
    if (scales_out)
        memcpy(scales_out, pw->scales, scale_bytes);
    return QD_OK;
}
