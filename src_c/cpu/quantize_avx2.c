/* AVX2 quantize kernels (also used for AVX-VNNI): the same pinned formula as
 * quantize_base.c, eight floats per division. */
#include <immintrin.h>
#include "qd_internal.h"
#include "quantize_common.h"

static uint32_t absmax_bits(const float *x, int64_t n)
{
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                    _mm256_setzero_si256()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++)
            m[j] = _mm256_max_epu32(m[j], _mm256_and_si256(
                _mm256_loadu_si256((const __m256i *)(x + i + 8 * j)), mask));
    const __m256i m8 = _mm256_max_epu32(_mm256_max_epu32(m[0], m[1]), _mm256_max_epu32(m[2], m[3]));
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
    return qd_absmax_bits_tail(x, i, n, (uint32_t)_mm_cvtsi128_si32(m4));
}

static void absmax_each(const float *x, int64_t n, uint32_t *m)
{
    const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), mask);
        _mm256_storeu_si256((__m256i *)(m + i), _mm256_max_epu32(_mm256_loadu_si256((const __m256i *)(m + i)), a));
    }
    qd_absmax_each_tail(x, i, n, m);
}

/* Eight scales from scale + i * step: a broadcast (step 0) or a load (step 1). */
static inline __m256 scales8(const float *scale, int64_t i, int64_t step)
{
    return step ? _mm256_loadu_ps(scale + i) : _mm256_set1_ps(*scale);
}

static inline __m256i quantize8(const float *x, __m256 s, __m256 lo, __m256 hi)
{
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x), s);
    return _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(y, hi), lo));
}

/* One loop for both kernels: step is a constant after inlining. */
static inline void quantize_steps(const float *x, int64_t n, float lo, float hi, const float *scale,
                                  int64_t step, int8_t *q)
{
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    /* packs work per 128-bit lane; the permute puts the dwords back in order. */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = quantize8(x + i + 8 * j, scales8(scale, i + 8 * j, step), vlo, vhi);
        const __m256i a = _mm256_packs_epi32(v[0], v[1]), b = _mm256_packs_epi32(v[2], v[3]);
        _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order));
    }
    qd_quantize_tail(x, i, n, lo, hi, scale, step, q);
}

static void quantize(const float *x, int64_t n, float lo, float hi, float scale, int8_t *q)
{
    quantize_steps(x, n, lo, hi, &scale, 0, q);
}

static void quantize_each(const float *x, int64_t n, float lo, float hi, const float *scale, int8_t *q)
{
    quantize_steps(x, n, lo, hi, scale, 1, q);
}

const qd_quant_kernels qd_quant_kernels_avx2 = {absmax_bits, quantize, absmax_each, quantize_each};
