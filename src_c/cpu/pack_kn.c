/* Packing a row-major int8 B [K, N] straight into the 8-bit panel layout, a few
 * panels at a time, for matmuls whose right operand comes unpacked on every call:
 * no transposed copy, and each unit is a 4 x 16 byte transpose. */
#include <string.h>
#include "qd_internal.h"
#include "panel_layout.h"
#include "pack_kn_common.h"

/* Units 0 .. units-1 of panels p0 .. p0+np-1, all inside B. */
static void pack_full(const int8_t *b, int64_t N, int64_t units, int64_t p0, int np,
                      int64_t panel_bytes, uint8_t *dst)
{
    for (int64_t u = 0; u < units; u++)
        for (int i = 0; i < np; i++)
            qd_pack_kn_unit(b, N, u, p0 + i, dst + i * panel_bytes + u * QD_UNIT_BYTES);
}

/* A unit on the edge of B: zero padding beyond K and N. */
static void pack_edge_unit(const int8_t *b, int64_t K, int64_t N, int64_t u, int64_t p, uint8_t *unit)
{
    memset(unit, 0, QD_UNIT_BYTES);
    for (int n = 0; n < QD_NR && p * QD_NR + n < N; n++)
        for (int j = 0; j < 4 && 4 * u + j < K; j++)
            unit[n * 4 + j] = (uint8_t)b[(4 * u + j) * N + p * QD_NR + n];
}

const qd_pack_kn_fn qd_pack_kn_base = pack_full;

void qd_pack_s8_kn_panels(const int8_t *b, int64_t K, int64_t N, int64_t p0, int np,
                          int64_t panel_bytes, uint8_t *dst)
{
    const int64_t units = (K + 3) / 4, full_units = K / 4, full_panels = N / QD_NR;
    const int nfull = p0 >= full_panels ? 0 : full_panels - p0 < np ? (int)(full_panels - p0) : np;
    /* The inside of B by the ISA's kernel, then the edges element by element. */
    qd_pack_kn_active()(b, N, full_units, p0, nfull, panel_bytes, dst);
    for (int i = 0; i < np; i++)
        for (int64_t u = i < nfull ? full_units : 0; u < units; u++)
            pack_edge_unit(b, K, N, u, p0 + i, dst + i * panel_bytes + u * QD_UNIT_BYTES);
}
