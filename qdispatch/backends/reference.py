"""The reference backend: numpy code that is the executable specification.

Integer products are computed in float64, which is exact for int8 operands as
long as K * 128 * 128 < 2**53 (numpy's own integer matmul does not use BLAS and
is far slower)."""
import numpy as np

from .. import quantmath
from .._core import BackendKind, register_backend
from .base import k_group
from .host import HostBackend


def exact_int_dot(a, b):
    """Exact int8 matmul as float64 (every partial sum is an integer < 2**53)."""
    return a.astype(np.float64) @ b.astype(np.float64)


def group_scales(scales, block_rows, block_k, rows, K, G, k_axis):
    """Scale of each (row, K-group) pair as a [rows, K/G] float32 array, for a
    scale grid whose K dim is `k_axis` (1 for lhs [M,K], 0 for rhs [K,N])."""
    grid = scales if k_axis == 1 else scales.T
    row_idx = np.arange(rows) // block_rows
    group_idx = (np.arange(K // G) * G) // block_k
    return grid[row_idx][:, group_idx].astype(np.float32)


class ReferenceBackend(HostBackend):
    kind = BackendKind.REFERENCE
    name = "reference"

    def int_matmul(self, a, b):
        return exact_int_dot(a, b).astype(np.int32)

    def qq_matmul(self, lhs, rhs):
        a, sa = self.logical(lhs)
        b, sb = self.logical(rhs)
        M, K = a.shape
        N = b.shape[1]
        bm, bka = lhs.layout.logical_block(lhs.transposed)
        bkb, bn = rhs.layout.logical_block(rhs.transposed)
        G = k_group(bka, bkb)
        sa_g = group_scales(sa, bm, bka, M, K, G, k_axis=1)      # [M, K/G]
        sb_g = group_scales(sb, bn, bkb, N, K, G, k_axis=0)      # [N, K/G]
        out = np.zeros((M, N), dtype=np.float32)
        # a sum past float32's range is inf (and inf - inf NaN), as on the other
        # backends, without numpy's warnings (errors under `-W error`)
        with np.errstate(invalid="ignore", over="ignore"):
            for g in range(K // G):
                ks = slice(g * G, (g + 1) * G)
                acc = exact_int_dot(a[:, ks], b[ks, :]).astype(np.float32)
                scale = sa_g[:, g:g + 1] * sb_g[:, g][None, :]
                out += scale * acc
        return out

    def fq_matmul(self, x, w, out_dtype="float32"):  # fq_dtypes: float32 only
        from ..policy import batch_invariant
        x, deq = np.asarray(x, dtype=np.float32), self.dequantize(w)
        # inf and NaN in x propagate as on the other backends, without numpy's
        # warnings for inf * 0 or an overflow (errors under `-W error`)
        with np.errstate(invalid="ignore", over="ignore"):
            if batch_invariant() and len(x) > 1:
                # BLAS sums a matrix product in an order that depends on its rows; one
                # row at a time, every row takes the same path.
                return np.stack([row @ deq for row in x])
            return x @ deq


register_backend(ReferenceBackend())
