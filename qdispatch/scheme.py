"""`QuantScheme`: what a quantized tensor's values and scales mean.

A scheme is validated when it is built, so a bad combination fails at the line
that wrote it rather than deep inside a kernel."""
import math
import operator
from dataclasses import dataclass, fields
from typing import Optional, Tuple, Union

import numpy as np

from .errors import ArgumentTypeError, QuantSchemeError

# value -> (lowest, highest, bits)
VALUE_RANGES = {
    "q8s": (-127, 127, 8),
    "q8f": (-128, 127, 8),
    "q4s": (-7, 7, 4),
    "q4f": (-8, 7, 4),
    "q2s": (-1, 1, 2),
    "q2f": (-2, 1, 2),
}
STORES = ("native", "packed_u32")
SCALE_DTYPES = ("f32", "f16", "bf16")


def index_of(v):
    """operator.index(v): v as a Python int when it is a whole number (an int or a
    numpy integer, a size read off an array's shape), else TypeError; a bool too
    (Python's, and numpy's, which numpy before 2.3 still gives an index)."""
    if isinstance(v, (bool, np.bool_)):
        raise ArgumentTypeError(f"{v!r} is a truth value, not a whole number")
    return operator.index(v)


def _whole_number(v):
    """index_of(v), or None where v is no whole number."""
    try:
        return index_of(v)
    except TypeError:
        return None


@dataclass(frozen=True)
class QuantScheme:
    """How a tensor is quantized.

    value: one of q8s, q8f, q4s, q4f, q2s, q2f (symmetric, no zero point).
    block: None (per tensor or per axis), an int (that many along the last dim),
        or a tuple of block sizes over the trailing dims.
    axis: one scale per index along this dim (per channel); excludes `block`.
    store: "native" (one int8 per value) or "packed_u32" (32/bits values per
        uint32 along the last dim, lowest bits first).
    scale_dtype: "f32", "f16" or "bf16"; scales are rounded up into it.
    """
    value: str = "q8s"
    block: Union[None, int, Tuple[int, ...]] = None
    axis: Optional[int] = None
    store: str = "native"
    scale_dtype: str = "f32"

    def __post_init__(self):
        for field, valid in (("value", tuple(VALUE_RANGES)), ("store", STORES), ("scale_dtype", SCALE_DTYPES)):
            name = getattr(self, field)
            if not isinstance(name, str) or name not in valid:
                raise QuantSchemeError(
                    f"Unknown {field} {name!r}: valid {field}s are {', '.join(valid)}")
            # a str subclass (numpy's str_, read off an array of names) is kept as
            # a plain str, as the compiled backends take it
            object.__setattr__(self, field, str(name))
        if self.bits < 8 and self.store == "native":
            raise QuantSchemeError(
                f"Can't store native sub-byte values: {self.value} needs store='packed_u32'")
        block = self.block
        if block is not None:
            if not isinstance(block, (tuple, list)) and _whole_number(block) is None:
                raise QuantSchemeError(
                    f"block must be None, an int or a tuple of ints, got {block!r}")
            sizes = [_whole_number(b) for b in (block if isinstance(block, (tuple, list)) else (block,))]
            if not sizes or any(b is None or b < 1 for b in sizes):
                raise QuantSchemeError(
                    f"block sizes must be positive ints, got {self.block!r}: e.g. block=32 or block=(1, 32)")
            object.__setattr__(self, "block", tuple(sizes))
        if self.axis is not None:
            axis = _whole_number(self.axis)
            if axis is None:
                raise QuantSchemeError(f"axis must be an int or None, got {self.axis!r}")
            object.__setattr__(self, "axis", axis)
            if self.block is not None:
                raise QuantSchemeError(
                    "Choose one granularity: axis= (per channel) or block= (per block), not both")

    @property
    def bits(self) -> int:
        """Bits per value: 8, 4 or 2."""
        return VALUE_RANGES[self.value][2]

    @property
    def qrange(self) -> Tuple[int, int]:
        """The values' (lo, hi): (-127, 127) for q8s, (-8, 7) for q4f, ..."""
        lo, hi, _ = VALUE_RANGES[self.value]
        return lo, hi

    @property
    def granularity(self) -> str:
        """'tensor' (one scale), 'axis' (one per index of `axis`) or 'block'."""
        if self.block is not None:
            return "block"
        return "tensor" if self.axis is None else "axis"

    def block_shape(self, shape) -> Tuple[int, ...]:
        """The block as a full-rank tuple over `shape`: every granularity is a
        block (per tensor = the whole shape, per axis = 1 along the axis)."""
        shape = tuple(int(d) for d in shape)
        ndim = len(shape)
        if self.granularity == "tensor":
            return shape
        if self.granularity == "axis":
            if not -ndim <= self.axis < ndim:
                raise QuantSchemeError(
                    f"axis={self.axis} is out of range for a {ndim}-d tensor of shape {shape}")
            ax = self.axis % ndim
            return tuple(1 if d == ax else n for d, n in enumerate(shape))
        if len(self.block) > ndim:
            raise QuantSchemeError(
                f"block={self.block} has {len(self.block)} dims but the tensor of shape {shape} has {ndim}")
        full = (1,) * (ndim - len(self.block)) + self.block
        for d, (n, b) in enumerate(zip(shape, full)):
            if n % b:
                raise QuantSchemeError(
                    f"block size {b} does not divide dim {d} of size {n} (shape {shape}): "
                    f"choose a block that divides it, e.g. {_divisor_hint(n, b)}")
        return full

    def with_(self, **changes) -> "QuantScheme":
        """This scheme with the given fields changed: s.with_(scale_dtype="f16")."""
        fields = self.to_record()
        fields.update(changes)
        return QuantScheme(**fields)

    def to_record(self) -> dict:
        """The fields as plain JSON values (block as a list), for files and state dicts."""
        return {"value": self.value, "block": list(self.block) if self.block else None,
                "axis": self.axis, "store": self.store, "scale_dtype": self.scale_dtype}

    @classmethod
    def from_record(cls, record) -> "QuantScheme":
        """The scheme `to_record` wrote, checked as any other.  Every field must be
        there: a record missing its value would otherwise read as the default q8s."""
        missing = [f.name for f in fields(cls) if f.name not in record]
        if missing:
            raise QuantSchemeError(f"A scheme record needs every field to_record writes; it lacks "
                                   f"{', '.join(missing)}")
        return cls(**record)

    def __repr__(self):
        parts = [repr(self.value)]
        if self.block is not None:
            parts.append(f"block={self.block}")
        if self.axis is not None:
            parts.append(f"axis={self.axis}")
        if self.store != "native":
            parts.append(f"store={self.store!r}")
        if self.scale_dtype != "f32":
            parts.append(f"scale_dtype={self.scale_dtype!r}")
        return f"QuantScheme({', '.join(parts)})"


_HINT_STEPS = 4096  # how far either side of the block the hint looks: any dim costs the same


def _divisor_hint(n, b):
    """A block that divides `n`: the one nearest `b` (the larger on a tie).

    1 always divides and lies b - 1 below `b`, so no nearer divisor is further
    than that: the search walks out from `b` and, for blocks up to _HINT_STEPS,
    finds the nearest one whatever `n` is (a dim read from a damaged file may be
    in the billions).  A larger block falls back to gcd(n, b), which divides."""
    for step in range(min(b, _HINT_STEPS)):
        for d in (b + step, b - step):
            if 0 < d <= n and n % d == 0:
                return d
    return math.gcd(n, b)


def as_scheme(scheme) -> QuantScheme:
    """Accept a QuantScheme or a bare value name: 'q8s' means per tensor, and a sub-byte
    one ('q4s') packed_u32, the only store its values have (QuantScheme('q4s') names
    the store it lacks)."""
    if isinstance(scheme, QuantScheme):
        return scheme
    if isinstance(scheme, str):
        if scheme in VALUE_RANGES and VALUE_RANGES[scheme][2] < 8:
            return QuantScheme(scheme, store="packed_u32")
        return QuantScheme(scheme)
    raise QuantSchemeError(f"Expected a QuantScheme or a value name like 'q8s', got {scheme!r}")
