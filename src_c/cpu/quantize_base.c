/* Baseline quantize kernels: SSE2 on x86-64 (no AVX here), scalar elsewhere.
 * The formula is pinned (see quantize.c); cvtps2dq rounds half to even in the
 * default MXCSR mode, as the scalar path does. */
#include "qd_internal.h"
#include "quantize_common.h"
#if defined(__SSE2__)
#include <emmintrin.h>

/* SSE2 has no pmaxsd: compare and select (abs bits are non-negative int32). */
static inline __m128i max_epi32(__m128i a, __m128i b)
{
    const __m128i gt = _mm_cmpgt_epi32(a, b);
    return _mm_or_si128(_mm_and_si128(gt, a), _mm_andnot_si128(gt, b));
}

static uint32_t absmax_bits(const float *x, int64_t n)
{
    const __m128i mask = _mm_set1_epi32(0x7FFFFFFF);
    __m128i m0 = _mm_setzero_si128(), m1 = m0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        m0 = max_epi32(m0, _mm_and_si128(_mm_loadu_si128((const __m128i *)(x + i)), mask));
        m1 = max_epi32(m1, _mm_and_si128(_mm_loadu_si128((const __m128i *)(x + i + 4)), mask));
    }
    uint32_t lanes[4];
    _mm_storeu_si128((__m128i *)lanes, max_epi32(m0, m1));
    uint32_t m = 0;
    for (int j = 0; j < 4; j++)
        m = lanes[j] > m ? lanes[j] : m;
    return qd_absmax_bits_tail(x, i, n, m);
}

static void absmax_each(const float *x, int64_t n, uint32_t *m)
{
    const __m128i mask = _mm_set1_epi32(0x7FFFFFFF);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const __m128i a = _mm_and_si128(_mm_loadu_si128((const __m128i *)(x + i)), mask);
        _mm_storeu_si128((__m128i *)(m + i), max_epi32(_mm_loadu_si128((const __m128i *)(m + i)), a));
    }
    qd_absmax_each_tail(x, i, n, m);
}

/* Four scales from scale + i * step: a broadcast (step 0) or a load (step 1). */
static inline __m128 scales4(const float *scale, int64_t i, int64_t step)
{
    return step ? _mm_loadu_ps(scale + i) : _mm_set1_ps(*scale);
}

static inline __m128i quantize4(const float *x, __m128 s, __m128 lo, __m128 hi)
{
    const __m128 y = _mm_div_ps(_mm_loadu_ps(x), s);
    return _mm_cvtps_epi32(_mm_max_ps(_mm_min_ps(y, hi), lo));
}

/* One loop for both kernels: step is a constant after inlining. */
static inline void quantize_steps(const float *x, int64_t n, float lo, float hi, const float *scale,
                                  int64_t step, int8_t *q)
{
    const __m128 vlo = _mm_set1_ps(lo), vhi = _mm_set1_ps(hi);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m128i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = quantize4(x + i + 4 * j, scales4(scale, i + 4 * j, step), vlo, vhi);
        _mm_storeu_si128((__m128i *)(q + i), _mm_packs_epi16(_mm_packs_epi32(v[0], v[1]),
                                                             _mm_packs_epi32(v[2], v[3])));
    }
    qd_quantize_tail(x, i, n, lo, hi, scale, step, q);
}
#else
static uint32_t absmax_bits(const float *x, int64_t n)
{
    return qd_absmax_bits_tail(x, 0, n, 0);
}

static void absmax_each(const float *x, int64_t n, uint32_t *m)
{
    qd_absmax_each_tail(x, 0, n, m);
}

static inline void quantize_steps(const float *x, int64_t n, float lo, float hi, const float *scale,
                                  int64_t step, int8_t *q)
{
    qd_quantize_tail(x, 0, n, lo, hi, scale, step, q);
}
#endif

static void quantize(const float *x, int64_t n, float lo, float hi, float scale, int8_t *q)
{
    quantize_steps(x, n, lo, hi, &scale, 0, q);
}

static void quantize_each(const float *x, int64_t n, float lo, float hi, const float *scale, int8_t *q)
{
    quantize_steps(x, n, lo, hi, scale, 1, q);
}

const qd_quant_kernels qd_quant_kernels_base = {absmax_bits, quantize, absmax_each, quantize_each};
