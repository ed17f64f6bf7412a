/* Small helpers shared by the SIMD kernel files (no ISA-specific code). */
#ifndef QD_SIMD_COMMON_H
#define QD_SIMD_COMMON_H

#include <stdint.h>
#include <string.h>

#define QD_INLINE static inline __attribute__((always_inline))

/* Four bytes of A as one int32 lane pattern (alias-safe unaligned load). */
QD_INLINE int32_t qd_load_i32(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Keeps a loaded vector in a register: otherwise GCC may fold the load into every
 * use, one full-width load per k-step instead of one per unit (slower). */
#define QD_KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))

/* The value added to a stored weight to make it unsigned: weights are stored
 * biased by this for sub-byte widths and biased in registers for 8 bits. */
#define QD_WEIGHT_BIAS(bits) ((bits) == 8 ? 128 : 1 << ((bits) - 1))

/* bias * rowsum in wrapping 32-bit arithmetic (the corrected dot fits int32 even
 * when this product does not). */
QD_INLINE int32_t qd_bias_correction(int bits, int32_t rowsum)
{
    return (int32_t)((uint32_t)QD_WEIGHT_BIAS(bits) * (uint32_t)rowsum);
}

/* Expands a kernel template over the row counts 1..8 as a switch. */
#define QD_SWITCH_MR(mr, CALL)                                                        \
    switch (mr) {                                                                     \
    case 1: CALL(1); break;                                                           \
    case 2: CALL(2); break;                                                           \
    case 3: CALL(3); break;                                                           \
    case 4: CALL(4); break;                                                           \
    case 5: CALL(5); break;                                                           \
    case 6: CALL(6); break;                                                           \
    case 7: CALL(7); break;                                                           \
    default: CALL(8); break;                                                          \
    }

/* Defines `static void NAME(const qd_qq_tile *t)`, which dispatches on t->bits and
 * t->mr to CASE(MR) (an expression using `t` and `bits`), so every (bits, rows)
 * pair gets its own fully unrolled copy of the tile kernel. */
#define QD_DEFINE_QQ_TILE(NAME, CASE)                                                 \
    QD_INLINE void NAME##_bits(const qd_qq_tile *t, const int bits)                   \
    {                                                                                 \
        QD_SWITCH_MR(t->mr, CASE)                                                     \
    }                                                                                 \
    static void NAME(const qd_qq_tile *t)                                             \
    {                                                                                 \
        switch (t->bits) {                                                            \
        case 8: NAME##_bits(t, 8); break;                                             \
        case 4: NAME##_bits(t, 4); break;                                             \
        default: NAME##_bits(t, 2); break;                                            \
        }                                                                             \
    }

#endif
