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

/* Every case is computed and one is selected, with no branches, so that loops of
 * conversions vectorize; the same bits as the branching form for all 2^32 inputs. */
static inline uint16_t qd_f32_to_f16_bits(float f)
{
    /* |f|'s bits fit int32: signed compares, which every SIMD ISA has */
    const uint32_t x = qd_f32_bits(f), sign = (x >> 16) & 0x8000u;
    const int32_t absx = (int32_t)(x & 0x7FFFFFFFu);
    /* at or past 65536: Inf, or NaN (below, 65520 and up carry into Inf themselves); a
     * NaN keeps its payload's top 10 bits, and stays a NaN where those are 0, as numpy
     * (the reference) converts it */
    const uint32_t payload = ((uint32_t)absx & 0x7FFFFFu) >> 13;
    const uint32_t special = absx > 0x7F800000 ? 0x7C00u | payload | (payload == 0) : 0x7C00u;
    /* below 2^-14, a half subnormal: |f| / 2^-24 rounded to nearest even, in integers
     * (a float add would round as the caller's rounding mode says); a float32
     * subnormal, shifted as one of exponent 0, rounds to 0 as it should */
    const uint32_t mant = ((uint32_t)absx & 0x7FFFFFu) | 0x800000u;
    const int32_t drop = 126 - (absx >> 23);  /* bits below 2^-24: 14 and up where selected */
    const uint32_t shift = (uint32_t)(drop < 1 ? 1 : drop > 31 ? 31 : drop);  /* every lane's shift defined */
    const uint32_t kept = mant >> shift, rest = mant << (32 - shift);  /* rest: the dropped bits, at the top */
    const uint32_t tiny = kept + (rest > 0x80000000u - (kept & 1u));  /* past half, or half and odd */
    /* normal: exponent rebased 127 -> 15, then round to nearest even at bit 13; a
     * carry into the exponent is right */
    const uint32_t normal = ((uint32_t)absx + 0xC8000FFFu + (((uint32_t)absx >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | (absx >= 0x47800000 ? special : absx < 0x38800000 ? tiny : normal));
}

static inline float qd_f16_bits_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    /* a subnormal (or zero) half is mant * 2^-24, exact in float32 */
    const uint32_t tiny = sign | qd_f32_bits((float)mant * 5.9604644775390625e-8f);
    const uint32_t special = sign | 0x7F800000u | (mant << 13);          /* Inf, NaN with its payload */
    const uint32_t normal = sign | ((exp + 112u) << 23) | (mant << 13);  /* exponent bias 15 -> 127 */
    return qd_bits_f32(exp == 0 ? tiny : exp == 31 ? special : normal);  /* selects: loops vectorize */
}

static inline uint16_t qd_f32_to_bf16_bits(float f)
{
    const uint32_t x = qd_f32_bits(f);
    const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;  /* to nearest even */
    return (int32_t)(x & 0x7FFFFFFFu) > 0x7F800000 ? 0x7FC0u : (uint16_t)rounded;  /* NaN: the quiet one */
}

static inline float qd_bf16_bits_to_f32(uint16_t b)
{
    return qd_bits_f32((uint32_t)b << 16);
}

#endif
