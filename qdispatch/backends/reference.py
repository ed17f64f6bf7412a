"""The reference backend: numpy code that is the executable specification.

Integer products are computed in float64, which is exact for int8 operands as
long as K * 128 * 128 < 2**53 (numpy's own integer matmul does not use BLAS and
is far slower)."""
import numpy as np

from .._core import BackendKind, register_backend
from .host import HostBackend


def exact_int_dot(a, b):
    """Exact int8 matmul as float64 (every partial sum is an integer < 2**53)."""
    return a.astype(np.float64) @ b.astype(np.float64)


class ReferenceBackend(HostBackend):
    kind = BackendKind.REFERENCE
    name = "reference"

    def int_matmul(self, a, b):
        return exact_int_dot(a, b).astype(np.int32)

    def qq_matmul(self, lhs, rhs):
        return self.qq_in_groups(lhs, rhs, exact_int_dot)

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
