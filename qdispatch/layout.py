"""`QLayout`: how a quantized tensor's values sit in storage.

Storage is always in one orientation; a QTensor's `.T` only flips a flag, so
the layout records shapes and blocks in storage orientation and maps them to
the logical (user-visible) orientation on demand."""
import math
from dataclasses import dataclass
from typing import Tuple

from .errors import ShapeError
from .scheme import QuantScheme


def as_2d_block(shape, block):
    """(rows, cols, block_rows, block_cols) when an N-d blocking is a 2-D
    blocking of the tensor viewed as [prod(shape[:-1]), shape[-1]], else None."""
    if len(shape) == 1:
        return 1, shape[0], 1, block[0]
    lead, lead_block = shape[:-1], block[:-1]
    # Leading block dims must be 1...1, then one partial dim, then full dims.
    j = 0
    while j < len(lead) and lead_block[j] == 1:
        j += 1
    if any(lead_block[i] != lead[i] for i in range(j + 1, len(lead))):
        return None
    block_rows = math.prod(lead_block[j:]) if j < len(lead) else 1  # math's: numpy's costs a microsecond
    return math.prod(lead), shape[-1], block_rows, block[-1]


def swap_last2(t):
    t = tuple(t)
    return t[:-2] + (t[-1], t[-2]) if len(t) >= 2 else t


@dataclass(frozen=True)
class QLayout:
    scheme: QuantScheme          # the scheme in storage orientation
    shape: Tuple[int, ...]       # storage shape
    block: Tuple[int, ...]       # full-rank block in storage orientation

    @classmethod
    def for_shape(cls, scheme: QuantScheme, shape) -> "QLayout":
        shape = tuple(int(d) for d in shape)
        if not shape or 0 in shape:  # no block grid to lay out, as quantize says of such data
            raise ShapeError(f"A QTensor needs at least one dim and one value, got shape {shape}")
        return cls(scheme, shape, scheme.block_shape(shape))

    @property
    def bits(self):
        return self.scheme.bits

    @property
    def grid(self):
        return tuple(n // b for n, b in zip(self.shape, self.block))

    def logical_shape(self, transposed):
        return swap_last2(self.shape) if transposed else self.shape

    def logical_block(self, transposed):
        return swap_last2(self.block) if transposed else self.block

    def logical_scheme(self, transposed) -> QuantScheme:
        """The scheme as the user sees the (possibly transposed) tensor."""
        s = self.scheme
        if not transposed:
            return s
        ndim = len(self.shape)
        if s.granularity == "axis":
            ax = s.axis % ndim
            swap = {ndim - 1: ndim - 2, ndim - 2: ndim - 1}
            ax = swap.get(ax, ax)
            return s.with_(axis=ax - ndim if s.axis < 0 else ax)  # counted as the user counts it
        if s.granularity == "block":
            return s.with_(block=swap_last2(self.block))
        return s

    def as_rows(self):
        """This layout with the leading dims folded into the rows, [prod(shape[:-1]),
        shape[-1]], where every value keeps its scale (as_2d_block); None where the
        blocks don't fold so, or there are no leading dims to fold."""
        flat = as_2d_block(self.shape, self.block) if len(self.shape) > 2 else None
        if flat is None:
            return None
        rows, cols, block_rows, block_cols = flat
        block = (block_rows, block_cols)
        return QLayout(self.scheme.with_(block=block, axis=None), (rows, cols), block)
