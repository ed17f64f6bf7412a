/* Scalar pieces shared by the quantize kernel files: the per-element formula
 * (used for tails and on machines without a SIMD version) and the absmax
 * reductions over float bits. */
#ifndef QD_QUANTIZE_COMMON_H
#define QD_QUANTIZE_COMMON_H

#include <stdint.h>
#include <string.h>

/* rint for |y| <= 2^22 in the current rounding mode (half to even by default),
 * the same mode the SIMD conversions (cvtps2dq) use. */
static inline float qd_round_half_even(float y)
{
    const float magic = 12582912.0f;   /* 1.5 * 2^23 pushes the fraction bits out */
    return (y + magic) - magic;
}

/* Clamping before rounding equals clamping after: lo and hi are integers. */
static inline int8_t qd_quantize_one(float x, float scale, float lo, float hi)
{
    float y = x / scale;                 /* true IEEE division, never a reciprocal */
    y = y < hi ? y : hi;
    y = y > lo ? y : lo;
    return (int8_t)qd_round_half_even(y);
}

/* scale[i * scale_step]: one scale for all (step 0) or a scale per element (step 1). */
static inline void qd_quantize_tail(const float *x, int64_t i, int64_t n, float lo, float hi,
                                    const float *scale, int64_t scale_step, int8_t *q)
{
    for (; i < n; i++)
        q[i] = qd_quantize_one(x[i], scale[i * scale_step], lo, hi);
}

/* |x| as bits: finite values order as unsigned integers, and Inf and NaN sort
 * above every finite value, so one integer max gives amax and finiteness. */
static inline uint32_t qd_abs_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return u & 0x7FFFFFFFu;
}

static inline uint32_t qd_absmax_bits_tail(const float *x, int64_t i, int64_t n, uint32_t m)
{
    for (; i < n; i++) {
        const uint32_t a = qd_abs_bits(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

/* m[i] = max(m[i], |x[i]|) as bits: the maxima of columns, a row at a time. */
static inline void qd_absmax_each_tail(const float *x, int64_t i, int64_t n, uint32_t *m)
{
    for (; i < n; i++) {
        const uint32_t a = qd_abs_bits(x[i]);
        m[i] = a > m[i] ? a : m[i];
    }
}

#endif
