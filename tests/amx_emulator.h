/* The AMX tile instructions that gemm_amx.c uses, done in software, so that the AMX
 * kernels can be checked on an x86-64 CPU without AMX (their epilogue still needs
 * AVX-512).  test_build_support.py compiles gemm_amx.c with `-include` of this file,
 * and cpu_features.c with QD_AMX_EMULATED, which reports AMX wherever AVX-512 VNNI
 * is.  Each instruction checks the tile shapes as the CPU would fault on them: a
 * tile used before a configuration or outside it, an A tile's bytes per row that
 * are not B's rows times 4, a result tile whose shape is not A's rows by B's bytes.
 * Rows past a tile's configured rows read as zeros, as the CPU's do. */
#ifndef QD_AMX_EMULATOR_H
#define QD_AMX_EMULATOR_H

#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QD_AMX_EMULATED 1

enum { EMU_TILES = 8, EMU_ROWS = 16, EMU_BYTES = 64 };

typedef struct {
    uint8_t data[EMU_TILES][EMU_ROWS][EMU_BYTES];
    uint8_t rows[EMU_TILES];
    uint16_t bytes[EMU_TILES];
    int configured;
} emu_tiles;

static __thread emu_tiles emu;   /* tile state is per thread, as the CPU's is */

static void emu_fault(const char *what, int tile)
{
    fprintf(stderr, "amx_emulator: %s (tile %d)\n", what, tile);
    abort();
}

static void emu_check(int t)
{
    if (!emu.configured)
        emu_fault("a tile used with no configuration loaded", t);
    if (t < 0 || t >= EMU_TILES || emu.rows[t] == 0 || emu.bytes[t] == 0)
        emu_fault("a tile the configuration leaves out", t);
}

/* The 64-byte configuration: palette (byte 0), bytes per row (bytes 16-47, one
 * uint16 a tile), rows (bytes 48-63, one a tile).  Loading it zeroes every tile. */
static void emu_loadconfig(const void *config)
{
    const uint8_t *c = config;
    if (c[0] != 1)
        emu_fault("a configuration of a palette other than 1", -1);
    memset(&emu, 0, sizeof emu);
    for (int t = 0; t < EMU_TILES; t++) {
        memcpy(&emu.bytes[t], c + 16 + 2 * t, 2);
        emu.rows[t] = c[48 + t];
        if (emu.rows[t] > EMU_ROWS || emu.bytes[t] > EMU_BYTES || (emu.rows[t] == 0) != (emu.bytes[t] == 0))
            emu_fault("a configured tile past 16 rows of 64 bytes", t);
    }
    emu.configured = 1;
}

static void emu_release(void)
{
    memset(&emu, 0, sizeof emu);
}

static void emu_loadd(int t, const void *base, long stride)
{
    emu_check(t);
    memset(emu.data[t], 0, sizeof emu.data[t]);
    for (int r = 0; r < emu.rows[t]; r++)
        memcpy(emu.data[t][r], (const uint8_t *)base + r * stride, emu.bytes[t]);
}

static void emu_stored(int t, void *base, long stride)
{
    emu_check(t);
    for (int r = 0; r < emu.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emu.data[t][r], emu.bytes[t]);
}

static void emu_zero(int t)
{
    emu_check(t);
    memset(emu.data[t], 0, sizeof emu.data[t]);
}

/* c[m][n] += sum over k of a[m][k] * b[k / 4][4n + k % 4], int8 x int8 into int32,
 * wrapping as the CPU's adds do. */
static void emu_dpbssd(int c, int a, int b)
{
    emu_check(c), emu_check(a), emu_check(b);
    if (emu.bytes[a] != 4 * emu.rows[b])
        emu_fault("tdpbssd: A's bytes per row are not 4 x B's rows", a);
    if (emu.rows[c] != emu.rows[a] || emu.bytes[c] != emu.bytes[b])
        emu_fault("tdpbssd: C is not A's rows by B's bytes", c);
    for (int m = 0; m < emu.rows[c]; m++)
        for (int n = 0; n < emu.bytes[c] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &emu.data[c][m][4 * n], 4);
            uint32_t acc = (uint32_t)sum;
            for (int k = 0; k < emu.bytes[a]; k++)
                acc += (uint32_t)((int32_t)(int8_t)emu.data[a][m][k] * (int8_t)emu.data[b][k / 4][4 * n + k % 4]);
            sum = (int32_t)acc;
            memcpy(&emu.data[c][m][4 * n], &sum, 4);
        }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#define _tile_loadconfig emu_loadconfig
#define _tile_release emu_release
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_zero(t) emu_zero(t)
#define _tile_dpbssd(c, a, b) emu_dpbssd(c, a, b)

#endif
