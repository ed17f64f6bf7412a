/* AVX-512 quantize kernels: the same pinned formula as quantize_base.c, sixteen
 * floats per division; masked loads cover the tail. */
#include <immintrin.h>
#include "qd_internal.h"
#include "quantize_common.h"

static uint32_t absmax_bits(const float *x, int64_t n)
{
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_loadu_si512(x + i), mask));
        m1 = _mm512_max_epu32(m1, _mm512_and_si512(_mm512_loadu_si512(x + i + 16), mask));
    }
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i < 16 ? n - i : 16)) - 1);
        m0 = _mm512_max_epu32(m0, _mm512_and_si512(_mm512_maskz_loadu_epi32(k, x + i), mask));
        i += 16;
    }
    const uint32_t m = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
    return qd_absmax_bits_tail(x, i, n, m);
}

static void absmax_each(const float *x, int64_t n, uint32_t *m)
{
    const __m512i mask = _mm512_set1_epi32(0x7FFFFFFF);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = (__mmask16)((1u << (n - i < 16 ? n - i : 16)) - 1);
        const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi32(k, x + i), mask);
        _mm512_mask_storeu_epi32(m + i, k, _mm512_max_epu32(_mm512_maskz_loadu_epi32(k, m + i), a));
    }
}

/* Sixteen scales (the k lanes) from scale + i * step: a broadcast (step 0) or a
 * load (step 1), 1 in lanes past the end, where 0 / 0 would raise the invalid flag. */
static inline __m512 scales16(const float *scale, int64_t i, int64_t step, __mmask16 k)
{
    return step ? _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), k, scale + i) : _mm512_set1_ps(*scale);
}

static inline __m128i quantize16(__m512 v, __m512 s, __m512 lo, __m512 hi)
{
    const __m512 y = _mm512_div_ps(v, s);
    /* values lie in [lo, hi], so the saturating narrow is exact */
    return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(y, hi), lo)));
}

/* One loop for both kernels: step is a constant after inlining. */
static inline void quantize_steps(const float *x, int64_t n, float lo, float hi, const float *scale,
                                  int64_t step, int8_t *q)
{
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm_storeu_si128((__m128i *)(q + i),
                         quantize16(_mm512_loadu_ps(x + i), scales16(scale, i, step, 0xFFFF), vlo, vhi));
    if (i < n) {
        const __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        _mm_mask_storeu_epi8(q + i, k, quantize16(_mm512_maskz_loadu_ps(k, x + i), scales16(scale, i, step, k),
                                                  vlo, vhi));
    }
}

static void quantize(const float *x, int64_t n, float lo, float hi, float scale, int8_t *q)
{
    quantize_steps(x, n, lo, hi, &scale, 0, q);
}

static void quantize_each(const float *x, int64_t n, float lo, float hi, const float *scale, int8_t *q)
{
    quantize_steps(x, n, lo, hi, scale, 1, q);
}

const qd_quant_kernels qd_quant_kernels_avx512vnni = {absmax_bits, quantize, absmax_each, quantize_each};
