/* Element access to the panel layout described in qd_internal.h (scalar code:
 * packing, unpacking and the portable kernels). */
#ifndef QD_PANEL_LAYOUT_H
#define QD_PANEL_LAYOUT_H

#include "qd_internal.h"

static inline int64_t qd_panel_byte_index(int bits, int64_t k, int n, int *shift)
{
    const int ku = QD_KU(bits);
    const int64_t unit = k / ku;
    const int rem = (int)(k % ku);
    *shift = (rem / 4) * bits;
    return unit * QD_UNIT_BYTES + n * 4 + (rem % 4);
}

/* The signed weight value of column n at depth k. */
static inline int qd_panel_get(const uint8_t *panel, int bits, int64_t k, int n)
{
    int shift;
    const uint8_t byte = panel[qd_panel_byte_index(bits, k, n, &shift)];
    if (bits == 8)
        return (int8_t)byte;
    return ((byte >> shift) & ((1 << bits) - 1)) - (1 << (bits - 1));
}

/* Stores a signed value (already in range); the panel must start zeroed for
 * sub-byte widths, except that biased zero padding is written by the packer. */
static inline void qd_panel_put(uint8_t *panel, int bits, int64_t k, int n, int value)
{
    int shift;
    uint8_t *byte = &panel[qd_panel_byte_index(bits, k, n, &shift)];
    if (bits == 8) {
        *byte = (uint8_t)(int8_t)value;
        return;
    }
    const int mask = (1 << bits) - 1;
    const int field = (value + (1 << (bits - 1))) & mask;
    *byte = (uint8_t)((*byte & ~(mask << shift)) | (field << shift));
}

/* A byte whose every field holds the biased encoding of 0. */
static inline uint8_t qd_panel_zero_byte(int bits)
{
    return bits == 8 ? 0x00 : bits == 4 ? 0x88 : 0xAA;
}

#endif
