/* AMX kernels (Sapphire Rapids and later): the qq tile on the tile registers.
 * tdpbssd sums s8 x s8 products into exact int32, and an 8-bit panel unit (4 k of
 * QD_NR columns, plain two's complement) is a row of B as AMX reads it, so 8-bit
 * weights need neither bias nor row sums; a sub-byte unit's fields, less their
 * bias, are 8 / bits such rows, unpacked once a step for all 32 rows.  A call
 * covers up to 32 rows and two panels: four accumulator tiles (rows 0-15 and 16-31
 * by panel), two A tiles, two B tiles.  Every other kernel (fq, quantize, packing),
 * scale groups that are not whole 64-value steps, and calls of 8 rows or fewer run
 * AVX-512 VNNI, whose sums are the same integers and whose epilogue (qq_zmm.h) this
 * one shares, so a row's result doesn't depend on which of the two ran it. */
#include <immintrin.h>
#include <string.h>
#include "qd_internal.h"
#include "simd_common.h"
#include "fq_common.h"
#include "qq_zmm.h"

#define AMX_MR 32
#define AMX_NP QD_ZMM_NP
#define STEP_K 64          /* k per tdpbssd: a row of A, 16 rows of B */
#define B_ROW_BYTES 64     /* a row of B: 4 k of QD_NR columns */
#define B_ROWS (STEP_K / 4)
#define TILE_ROWS 16

/* Tile registers (the intrinsics take their numbers as literals). */
#define C00 0   /* rows 0-15 x panel 0 */
#define C01 1   /* rows 0-15 x panel 1 */
#define C10 2   /* rows 16-31 x panel 0 */
#define C11 3   /* rows 16-31 x panel 1 */
#define A0 4
#define A1 5
#define B0 6
#define B1 7

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The tile intrinsics' asm tells the compiler only the address it reads, not the
 * memory, so stores to a buffer they read must be forced out first. */
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

static void set_tile(tile_config *cfg, int tile, int rows)
{
    cfg->rows[tile] = (uint8_t)rows;
    cfg->colsb[tile] = 64;
}

/* Tiles for rows0 + rows1 rows of A (rows1 = 0: one row tile) and one or two panels. */
static void configure_tiles(int rows0, int rows1, int two_panels)
{
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    set_tile(&cfg, A0, rows0);
    set_tile(&cfg, B0, B_ROWS);
    set_tile(&cfg, C00, rows0);
    if (two_panels) {
        set_tile(&cfg, B1, B_ROWS);
        set_tile(&cfg, C01, rows0);
    }
    if (rows1) {
        set_tile(&cfg, A1, rows1);
        set_tile(&cfg, C10, rows1);
        if (two_panels)
            set_tile(&cfg, C11, rows1);
    }
    MEMORY_BARRIER();
    _tile_loadconfig(&cfg);
}

/* One step: A rows from a (lda apart), each panel's rows of B from b0, b1. */
QD_INLINE void step(const int8_t *a, int64_t lda, const uint8_t *b0, const uint8_t *b1,
                    const int two_row_tiles, const int two_panels)
{
    _tile_loadd(A0, a, lda);
    _tile_loadd(B0, b0, B_ROW_BYTES);
    _tile_dpbssd(C00, A0, B0);
    if (two_panels) {
        _tile_loadd(B1, b1, B_ROW_BYTES);
        _tile_dpbssd(C01, A0, B1);
    }
    if (two_row_tiles) {
        _tile_loadd(A1, a + TILE_ROWS * lda, lda);
        _tile_dpbssd(C10, A1, B0);
        if (two_panels)
            _tile_dpbssd(C11, A1, B1);
    }
}

/* n_units sub-byte panel units as rows of B: field f of unit u holds k = 4f + j of
 * the unit's QD_KU(bits) (panel_layout.h), so it becomes row u * (8 / bits) + f,
 * each value its field less the bias. */
static void unpack_units(const uint8_t *units, int n_units, int bits, uint8_t *rows)
{
    const __m512i mask = _mm512_set1_epi8((char)((1 << bits) - 1));
    const __m512i bias = _mm512_set1_epi8((char)(1 << (bits - 1)));
    const int fields = 8 / bits;
    for (int u = 0; u < n_units; u++) {
        const __m512i v = _mm512_loadu_si512(units + u * QD_UNIT_BYTES);
        for (int f = 0; f < fields; f++) {
            const __m512i field = _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(f * bits)), mask);
            _mm512_store_si512(rows + (u * fields + f) * B_ROW_BYTES, _mm512_sub_epi8(field, bias));
        }
    }
}

/* The rows of B for a step of n_units units (fewer in K's last step, the rest of
 * the step's rows zero) of each panel from b: 8-bit units as they lie, unless the
 * step is short, which reads a zero-padded copy so no tile reads past the panel;
 * sub-byte units unpacked.  *b0 and *b1 point at them. */
QD_INLINE void b_rows(const qd_qq_tile *t, const uint8_t *b, int n_units, int full, int np,
                      uint8_t buf[AMX_NP][B_ROWS * B_ROW_BYTES], const uint8_t **b0, const uint8_t **b1)
{
    if (t->bits == 8 && full) {
        *b0 = b;
        *b1 = np > 1 ? b + t->panel_ld : b;  /* no second panel: not past the buffer's end */
        return;
    }
    for (int p = 0; p < np; p++) {
        if (!full)
            memset(buf[p], 0, sizeof buf[p]);
        if (t->bits == 8)
            memcpy(buf[p], b + p * t->panel_ld, (size_t)n_units * QD_UNIT_BYTES);
        else
            unpack_units(b + p * t->panel_ld, n_units, t->bits, buf[p]);
    }
    MEMORY_BARRIER();
    *b0 = buf[0];
    *b1 = buf[1];
}

QD_INLINE void qq_tile_impl(const qd_qq_tile *t, const int two_row_tiles, const int two_panels)
{
    const int mr = t->mr, np = two_panels ? 2 : 1;
    const int rows0 = mr < TILE_ROWS ? mr : TILE_ROWS;
    const int step_units = STEP_K / QD_KU(t->bits);
    configure_tiles(rows0, mr - rows0, two_panels);
    /* A group is whole steps, but for the one group over all of K, whose last
     * units (k_padded % 64) go through zero-padded copies. */
    const int64_t steps = t->group_units / step_units;
    const int tail_units = (int)(t->group_units % step_units);
    __m512i sums[AMX_MR][AMX_NP];   /* a group's int32 sums, [row][panel], from the C tiles */
    __m512 acc[AMX_MR][AMX_NP];
    uint8_t buf[AMX_NP][B_ROWS * B_ROW_BYTES] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    const uint8_t *b = t->panel, *b0, *b1;
    qd_group_scales sc = qd_group_scales_start(t->w_scale, t);
    int64_t k0 = 0;
    for (int64_t g = 0; g < t->ngroups; g++) {
        _tile_zero(C00);
        if (two_panels)
            _tile_zero(C01);
        if (two_row_tiles) {
            _tile_zero(C10);
            if (two_panels)
                _tile_zero(C11);
        }
        for (int64_t s = 0; s < steps; s++, k0 += STEP_K, b += step_units * QD_UNIT_BYTES) {
            b_rows(t, b, step_units, 1, np, buf, &b0, &b1);
            step(t->a + k0, t->lda, b0, b1, two_row_tiles, two_panels);
        }
        if (tail_units) {
            int8_t a_tail[AMX_MR][STEP_K] __attribute__((aligned(64)));
            memset(a_tail, 0, sizeof a_tail);
            for (int r = 0; r < mr; r++)
                memcpy(a_tail[r], t->a + r * t->lda + k0, (size_t)tail_units * QD_KU(t->bits));
            b_rows(t, b, tail_units, 0, np, buf, &b0, &b1);
            step(&a_tail[0][0], STEP_K, b0, b1, two_row_tiles, two_panels);
        }
        _tile_stored(C00, &sums[0][0], sizeof sums[0]);
        if (two_panels)
            _tile_stored(C01, &sums[0][1], sizeof sums[0]);
        if (two_row_tiles) {
            _tile_stored(C10, &sums[TILE_ROWS][0], sizeof sums[0]);
            if (two_panels)
                _tile_stored(C11, &sums[TILE_ROWS][1], sizeof sums[0]);
        }
        MEMORY_BARRIER();   /* the tile stores' asm names only the address, not the memory */
        if (t->out_i32) {   /* integer mode: one group */
            qd_zmm_store_sums(t, mr, np, sums);
            _tile_release();
            return;
        }
        qd_zmm_add_group(t, &sc, mr, np, acc, sums);
        qd_group_scales_next(&sc);
    }
    _tile_release();
    qd_zmm_store_out(t, mr, np, acc);
}

/* The tile in calls of the VNNI kernel's rows. */
static void qq_tile_vnni(const qd_qq_tile *t)
{
    const int mr = qd_kernels_avx512vnni.qq_mr;
    for (int r = 0; r < t->mr; r += mr) {
        const qd_qq_tile rows = qd_qq_tile_rows(t, r, t->mr - r < mr ? t->mr - r : mr);
        qd_kernels_avx512vnni.qq_tile(&rows);
    }
}

static void qq_tile_amx(const qd_qq_tile *t)
{
    if (t->mr <= qd_kernels_avx512vnni.qq_mr || (t->ngroups > 1 && t->group_k % STEP_K)) {
        qq_tile_vnni(t);
        return;
    }
    const int two_row_tiles = t->mr > TILE_ROWS, two_panels = t->np > 1;
    if (two_row_tiles)
        two_panels ? qq_tile_impl(t, 1, 1) : qq_tile_impl(t, 1, 0);
    else
        two_panels ? qq_tile_impl(t, 0, 1) : qq_tile_impl(t, 0, 0);
}

const qd_kernels qd_kernels_amx = {
    .qq_tile = qq_tile_amx,
    .fq_tile = qd_fq_tile_avx512,
    .qq_mr = AMX_MR,
    .qq_np = AMX_NP,
    .fq_mr = QD_FQ_MR_ZMM,
    .fq_short_groups = 1,
    .qq_short_groups = &qd_kernels_qq_short_groups_avx2,
    .needs_rowsum = 1,   /* the VNNI kernel's, for the calls handed on */
};
