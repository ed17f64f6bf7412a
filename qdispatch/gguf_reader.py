"""The tensor table of a GGUF file, read without reading its key-value metadata.

A model's metadata holds its tokenizer (hundreds of thousands of strings); the
gguf package's reader makes a numpy object of every item, which took seconds
and hundreds of MB for a file whose tensors qdispatch wanted.  Here each value
is only stepped over (an array of numbers in one step, strings by their
lengths), every size checked against the file before it is used.

Layout (GGUF v2 and v3, all numbers in the file's byte order): "GGUF", version
u32, tensor count u64, key-value count u64; each key-value: key (string), type
u32, value; each tensor: name (string), dim count u32, dims u64 (ggml order,
ne0 first), ggml type u32, data offset u64; then padding to the alignment and
the tensors' data.  A string is a u64 byte count and its bytes; an array an
item type u32, an item count u64 and the items.
"""
import math
import mmap
import struct
from typing import NamedTuple

from .errors import SerializationError

_STRING, _ARRAY = 8, 9
# value type -> bytes of one value, for the fixed-size ones
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32 = 4
_DEEPEST = 64  # arrays of arrays, nested: ggml's own files never nest
_ALIGNMENT_KEY = b"general.alignment"
_DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4   # ggml's GGML_MAX_DIMS: its loader refuses a whole file with a tensor of more
MAX_NAME = 63  # UTF-8 bytes: ggml's GGML_MAX_NAME (64) holds a name and its NUL, or refuses the file


class TensorInfo(NamedTuple):
    name: str
    dims: tuple       # ggml order: ne0 (the contiguous dim) first
    ggml_type: int
    offset: int       # of its first byte in the file
    nbytes: int


class GGUFFile(NamedTuple):
    tensors: list     # [TensorInfo], in the file's order
    swapped: bool     # the file's byte order is not the host's (a big-endian file here)
    data: mmap.mmap   # the whole file, read-only
    alignment: int
    data_start: int


class _Cursor:
    def __init__(self, path, data, order):
        self.path, self.data, self.order, self.at = path, data, order, 0

    def fail(self, what):
        raise SerializationError(f"{self.path} is not a readable GGUF file (truncated or corrupted?): {what}")

    def refuse(self, what):
        # whole files ggml can't load: a writer that doesn't check them (the gguf
        # package's writes long names) made them, or damage did
        raise SerializationError(f"{self.path} is a GGUF file that ggml refuses to load, and so does qdispatch: "
                                 f"{what} (written by a tool that doesn't check it, or damaged)")

    def skip(self, n, what):
        if n > len(self.data) - self.at:
            self.fail(f"{what} ({n} bytes) at byte {self.at} runs past the file's end at byte {len(self.data)}")
        self.at += n

    def number(self, code, what):
        size = struct.calcsize(code)
        start = self.at
        self.skip(size, what)
        return struct.unpack_from(self.order + code, self.data, start)[0]

    def string(self, what):
        n = self.number("Q", what)
        start = self.at
        self.skip(n, what)
        return self.data[start:self.at]

    def skip_value(self, kind, depth=0):
        """Steps over one value of type `kind`."""
        if kind in _FIXED_SIZES:
            self.skip(_FIXED_SIZES[kind], "a value")
        elif kind == _STRING:
            self.string("a string")
        elif kind == _ARRAY:
            if depth == _DEEPEST:
                self.fail(f"arrays nested more than {_DEEPEST} deep")
            item, count = self.number("I", "an array's item type"), self.number("Q", "an array's length")
            if item not in _FIXED_SIZES and item not in (_STRING, _ARRAY):  # ggml refuses it, items or none
                self.fail(f"an array of unknown value type {item} at byte {self.at - 12}")
            if item in _FIXED_SIZES:  # in one step: no work per item
                self.skip(count * _FIXED_SIZES[item], f"an array of {count} values")
                return
            least = 8 if item == _STRING else 12  # a string's length, or an array's type and length
            if count * least > len(self.data) - self.at:  # before a loop of `count` turns
                self.fail(f"an array claims {count} items, more than the rest of the file can hold")
            for _ in range(count):
                self.skip_value(item, depth + 1)
        else:
            self.fail(f"unknown value type {kind} at byte {self.at - 4}")


def read(path, f, type_sizes):
    """The GGUFFile of an open file `f`.  type_sizes: {ggml type: (values per block,
    bytes per block)}, the gguf package's GGML_QUANT_SIZES."""
    try:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (ValueError, OSError) as exc:  # an empty file can't be mapped
        raise SerializationError(f"{path} is not a readable GGUF file: {exc}") from None
    try:
        return _read(path, data, type_sizes)
    except BaseException:
        data.close()
        raise


def _read(path, data, type_sizes):
    if data[:4] != b"GGUF":
        raise SerializationError(f"{path} is not a GGUF file: it starts with {bytes(data[:4])!r}, not b'GGUF'")
    version = struct.unpack_from("<I", data, 4)[0] if len(data) >= 8 else 0
    swapped = version & 0xFFFF == 0  # a big-endian file: its version reads as a multiple of 65536 here
    cursor = _Cursor(path, data, ">" if swapped else "<")
    cursor.skip(4, "the magic")
    version = cursor.number("I", "the version")
    if version not in (2, 3):
        cursor.fail(f"GGUF version {version}; qdispatch reads versions 2 and 3")
    n_tensors, n_kv = cursor.number("Q", "the tensor count"), cursor.number("Q", "the key-value count")
    alignment = _DEFAULT_ALIGNMENT
    keys = set()
    for _ in range(n_kv):
        key, kind = cursor.string("a key"), cursor.number("I", "a value type")
        if key in keys:  # ggml refuses it; which of the two would count (general.alignment's, say)?
            cursor.refuse(f"the key {key.decode('utf-8', 'replace')!r} appears twice")
        keys.add(key)
        if key == _ALIGNMENT_KEY:
            if kind != _UINT32:  # llama.cpp refuses it; skipping it would read the data at the wrong alignment
                cursor.refuse(f"general.alignment has value type {kind}, not uint32 ({_UINT32})")
            alignment = cursor.number("I", "the alignment")
            if alignment == 0 or alignment & (alignment - 1):
                cursor.fail(f"general.alignment is {alignment}, not a power of two")
        else:
            cursor.skip_value(kind)
    if n_tensors * 24 > len(data) - cursor.at:  # a name's length, a dim count, a type and an offset
        cursor.fail(f"it claims {n_tensors} tensors, more than the rest of the file can describe")
    entries = []
    for _ in range(n_tensors):
        raw_name = cursor.string("a tensor name")
        if b"\0" in raw_name:  # ggml's names end at a NUL: two such names could be one
            cursor.refuse(f"the tensor name {raw_name[:64]!r} holds a NUL byte")
        if len(raw_name) > MAX_NAME:
            cursor.refuse(f"the tensor name {raw_name[:32]!r}... is {len(raw_name)} bytes long, more than ggml's "
                          f"{MAX_NAME}")
        n_dims = cursor.number("I", "a dim count")
        if n_dims * 8 > len(data) - cursor.at:
            cursor.fail(f"a tensor claims {n_dims} dims")
        if n_dims > MAX_DIMS:
            cursor.refuse(f"tensor {raw_name.decode('utf-8', 'replace')!r} has {n_dims} dims, more than ggml's "
                          f"{MAX_DIMS}")
        dims = tuple(cursor.number("Q", "a dim") for _ in range(n_dims))
        entries.append((raw_name, dims, cursor.number("I", "a tensor type"), cursor.number("Q", "an offset")))
    data_start = -(-cursor.at // alignment) * alignment
    tensors, seen = [], set()
    for raw_name, dims, ggml_type, offset in entries:
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            cursor.fail(f"the tensor name {raw_name[:64]!r} is no UTF-8 text")
        if name in seen:
            cursor.fail(f"two tensors are named {name!r}")
        seen.add(name)
        if ggml_type not in type_sizes:
            cursor.fail(f"tensor {name!r} has ggml type number {ggml_type}, which the gguf package does not know")
        per_block, block_bytes = type_sizes[ggml_type]
        count = math.prod(dims)
        row = dims[0] if dims else 1  # ggml's ne0: blocks run along it and never span two rows
        if row % per_block:
            cursor.fail(f"tensor {name!r} has rows of {row} values, not whole blocks of {per_block}")
        tensors.append(TensorInfo(name, dims, ggml_type, data_start + offset, count // per_block * block_bytes))
    return GGUFFile(tensors, swapped, data, alignment, data_start)
