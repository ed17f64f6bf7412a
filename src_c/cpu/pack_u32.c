/* The packed_u32 store on the host: 32 / bits values a uint32 along each row,
 * lowest bits first, the last word of a row zero-padded.  Packing keeps each value's
 * low `bits` bits (two's complement); unpacking sign-extends them back. */
#include "qd_internal.h"

static int packed_bits(int bits)
{
    return bits == 2 || bits == 4 || bits == 8;
}

static int64_t row_words(int64_t cols, int bits)
{
    const int per_word = 32 / bits;
    return (cols + per_word - 1) / per_word;
}

/* The checks both directions share. */
static qd_status check_store(const void *q, const void *words, int64_t rows, int64_t cols, int bits)
{
    if (!q || !words)
        return QD_ERR_NULL;
    if (!packed_bits(bits))
        return QD_ERR_SCHEME;
    if (rows <= 0 || cols <= 0)
        return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, 1) || !qd_dims_fit(rows, row_words(cols, bits), sizeof(uint32_t)))
        return QD_ERR_ARGUMENT;
    if (qd_overlap(q, (size_t)(rows * cols), words, (size_t)(rows * row_words(cols, bits)) * sizeof(uint32_t)))
        return QD_ERR_ARGUMENT;
    return QD_OK;
}

/* `bits` is a constant in each instance (see the switches): the loops unroll. */
static inline void pack_row(const int8_t *q, int64_t cols, int bits, uint32_t *words)
{
    const int per_word = 32 / bits;
    const uint32_t mask = bits == 8 ? 0xFFu : (1u << bits) - 1;
    int64_t c = 0, w = 0;
    for (; c + per_word <= cols; c += per_word, w++) {
        uint32_t word = 0;
        for (int i = 0; i < per_word; i++)
            word |= ((uint32_t)(uint8_t)q[c + i] & mask) << (i * bits);
        words[w] = word;
    }
    if (c < cols) {
        uint32_t word = 0;
        for (int i = 0; c + i < cols; i++)
            word |= ((uint32_t)(uint8_t)q[c + i] & mask) << (i * bits);
        words[w] = word;
    }
}

static inline int8_t field(uint32_t word, int i, int bits)
{
    /* the field at the top of a byte, then an arithmetic shift sign-extends it */
    return (int8_t)((int8_t)(uint8_t)((word >> (i * bits)) << (8 - bits)) >> (8 - bits));
}

static inline void unpack_row(const uint32_t *words, int64_t cols, int bits, int8_t *q)
{
    const int per_word = 32 / bits;
    int64_t c = 0, w = 0;
    for (; c + per_word <= cols; c += per_word, w++)
        for (int i = 0; i < per_word; i++)
            q[c + i] = field(words[w], i, bits);
    for (int i = 0; c + i < cols; i++)
        q[c + i] = field(words[w], i, bits);
}

/* Every row one way or the other (`pack`), `bits` a constant in each case of the
 * switch, so that the row loops unroll.  q and words are only read on their way in. */
static qd_status convert(int pack, int8_t *q, int64_t rows, int64_t cols, int bits, uint32_t *words)
{
    const qd_status st = check_store(q, words, rows, cols, bits);
    if (st != QD_OK)
        return st;
    const int64_t ld = row_words(cols, bits);
#define CONVERT_ROWS(BITS)                                                                          \
    QD_PARALLEL_FOR(qd_threads_for(rows * cols / (1 << 20) + 1), rows, ,                            \
    for (int64_t r = 0; r < rows; r++) {                                                            \
        if (pack)                                                                                   \
            pack_row(q + r * cols, cols, BITS, words + r * ld);                                     \
        else                                                                                        \
            unpack_row(words + r * ld, cols, BITS, q + r * cols);                                   \
    })
    switch (bits) {
    case 2: CONVERT_ROWS(2); break;
    case 4: CONVERT_ROWS(4); break;
    default: CONVERT_ROWS(8); break;
    }
#undef CONVERT_ROWS
    return QD_OK;
}

qd_status qd_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits, uint32_t *words)
{
    return convert(1, (int8_t *)q, rows, cols, bits, words);
}

qd_status qd_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols, int bits, int8_t *q)
{
    return convert(0, q, rows, cols, bits, (uint32_t *)words);
}
