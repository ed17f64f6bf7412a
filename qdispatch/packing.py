"""The packed_u32 store's codec for everything but the reference backend: the C
library's where it is built (quantmath's words, the spec's, about 10x sooner: 4096^2
int4 values take 0.9 ms each way against 10-13 ms in numpy), numpy's otherwise."""
from . import quantmath

try:
    from ._cpu import pack_u32, unpack_u32
except ImportError:  # a build without the C library
    pack_u32, unpack_u32 = quantmath.pack_u32, quantmath.unpack_u32

__all__ = ["pack_u32", "unpack_u32"]
