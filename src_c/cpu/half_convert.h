/* Scalar float16 / bfloat16 <-> float32 bit conversions, round to nearest even. */
#ifndef QD_HALF_CONVERT_H
#define QD_HALF_CONVERT_H

#include <stdint.h>
#include <string.h>

static inline uint32_t qd_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float qd_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t qd_f32_to_f16_bits(float f)
{
    const uint32_t x = qd_f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t absx = x & 0x7FFFFFFFu;
    if (absx >= 0x7F800000u)                       /* Inf or NaN */
        return sign | (absx > 0x7F800000u ? 0x7E00u : 0x7C00u);
    if (absx >= 0x477FF000u)                       /* >= 65520 rounds to Inf */
        return sign | 0x7C00u;
    if (absx < 0x38800000u) {                      /* below 2^-14: half subnormal */
        if (absx <= 0x33000000u)                   /* <= 2^-25 rounds to 0 */
            return sign;
        const uint32_t m = (absx & 0x7FFFFFu) | 0x800000u;
        const int shift = 126 - (int)(absx >> 23);
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1)))
            q++;
        return sign | (uint16_t)q;
    }
    const uint32_t rebased = absx - 0x38000000u;   /* exponent bias 127 -> 15 */
    uint32_t q = rebased >> 13;
    const uint32_t rem = rebased & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1)))
        q++;                                       /* a carry into the exponent is right */
    return sign | (uint16_t)q;
}

static inline float qd_f16_bits_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) {
        const float v = (float)mant * 5.9604644775390625e-8f;   /* mant * 2^-24, exact */
        return sign ? -v : v;
    }
    if (exp == 31)
        return qd_bits_f32(sign | 0x7F800000u | (mant << 13));
    return qd_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline uint16_t qd_f32_to_bf16_bits(float f)
{
    const uint32_t x = qd_f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0u;
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline float qd_bf16_bits_to_f32(uint16_t b)
{
    return qd_bits_f32((uint32_t)b << 16);
}

#endif
