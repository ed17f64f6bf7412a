"""`QLayout`: how a quantized tensor's values sit in storage.

Storage is always in one orientation; a QTensor's `.T` only flips a flag, so
the layout records shapes and blocks in storage orientation and maps them to
the logical (user-visible) orientation on demand."""
from dataclasses import dataclass
from typing import Tuple

from .errors import ShapeError
from .scheme import QuantScheme


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
            return s.with_(axis=swap.get(ax, ax))
        if s.granularity == "block":
            return s.with_(block=swap_last2(self.block))
        return s
