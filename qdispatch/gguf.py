"""GGUF import and export (optional extra `gguf`, built on the `gguf` package).

    tensors = qdispatch.gguf.load("model.gguf", device="cpu")
    qdispatch.gguf.export("out.gguf", tensors)

`load` reads a file's tensors without changing any value: each QTensor
dequantizes to exactly (bit for bit, float32) what `gguf.quants.dequantize`
gives for a little-endian file.  The mapping, for a tensor of numpy shape
[..., K] (GGUF's ne0 is K):

| GGUF  | qdispatch                                                                 |
|-------|---------------------------------------------------------------------------|
| Q8_0  | QTensor, QuantScheme("q8f", block=32, scale_dtype="f16")                   |
| Q4_0  | QTensor, QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16") |
| F32   | float32 Tensor                                                            |
| F16   | float16 Tensor                                                            |
| BF16  | bfloat16 Tensor                                                           |

- Blocks are 32 consecutive values along the last dim, each with one f16 scale
  `d`, kept exactly (an f16 value is exact in the float32 scale grid).
- Q8_0 stores int8 values; ggml's own quantizer writes [-127, 127] but the
  format admits -128, so the full-range `q8f` covers every file.
- Q4_0 stores nibbles `n` with value `n - 8` (range [-8, 7], so `q4f`).  Byte
  j of a block's 16 bytes holds value j in its low nibble and value j + 16 in
  its high nibble.
- Q4_0 scales are signed: ggml picks `d = max / -8` with `max` the element of
  largest magnitude, so `d` is negative whenever that element is positive.
  Folding the sign into the values is impossible there (that element's value is
  -8, and 8 is out of range), so the QTensor keeps ggml's signed scale;
  dequantize is `value * scale` either way.

`export` writes QTensors whose scheme fits a GGUF type (Q8_0: q8s or q8f,
block 32 along the last dim, f16 scales; Q4_0: q4s or q4f likewise) and float
Tensors or arrays (F32, F16, BF16), of 1 to 4 dims, atomically.  Anything else raises
`SerializationError` naming the tensor: requantize or dequantize it first.
Only tensors cross; GGUF key-value metadata other than the architecture is not
read or written.
"""
import math

import numpy as np

from ._core import QTensor, Tensor, get_backend
from .errors import ArgumentTypeError, SerializationError
from . import gguf_reader
from .io import SAVABLE, atomic_path, check_tensor_dict, encode_scales, opened_regular_file, selected_names
from .scheme import QuantScheme
from .tensor_api import backend_for, qtensor_from_parts, qtensor_host, tensor

__all__ = ["load", "export", "Q8_0_SCHEME", "Q4_0_SCHEME"]

BLOCK = 32
Q8_0_SCHEME = QuantScheme("q8f", block=BLOCK, scale_dtype="f16")
Q4_0_SCHEME = QuantScheme("q4f", block=BLOCK, store="packed_u32", scale_dtype="f16")
_SCALE_BYTES = 2
_MAX_DIMS, _MAX_NAME = gguf_reader.MAX_DIMS, gguf_reader.MAX_NAME  # export writes what ggml reads


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("GGUF support needs the gguf package: pip install 'qdispatch[gguf]'") from None
    return gguf


# ---- block codecs ----------------------------------------------------------------
# A block is its f16 scale's 2 bytes followed by the packed values.

def _split_blocks(data, block_bytes, swapped=False):
    """swapped: the file's byte order is not the host's, so are its scales' bytes."""
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    f16 = np.dtype(np.float16).newbyteorder("S" if swapped else "=")
    scales = blocks[:, :_SCALE_BYTES].copy().view(f16).astype(np.float32)
    return scales.reshape(-1), blocks[:, _SCALE_BYTES:]


def _join_blocks(scales, payload, shape):
    """scales: f16 values (as encode_scales gives them)."""
    d = np.ascontiguousarray(scales, dtype=np.float16).view(np.uint8)
    blocks = np.concatenate([d.reshape(-1, _SCALE_BYTES), payload], axis=1)
    return blocks.reshape(tuple(shape[:-1]) + (-1,))


def _decode_q8_0(blocks):
    return blocks.view(np.int8)


def _encode_q8_0(values):
    return values.reshape(-1, BLOCK).view(np.uint8)


def _decode_q4_0(blocks):
    nibbles = np.empty((blocks.shape[0], BLOCK), np.uint8)  # low nibbles first, in place: no temporaries
    np.bitwise_and(blocks, 0x0F, out=nibbles[:, :BLOCK // 2])
    np.right_shift(blocks, 4, out=nibbles[:, BLOCK // 2:])
    np.subtract(nibbles, 8, out=nibbles)  # n - 8 modulo 256: the int8 value's bits
    return nibbles.view(np.int8)


def _encode_q4_0(values):
    nibbles = (values.reshape(-1, BLOCK) + 8).astype(np.uint8)
    half = BLOCK // 2
    return nibbles[:, :half] | (nibbles[:, half:] << 4)


# ggml type name -> (scheme, bytes per block, decode, encode)
_QUANT_TYPES = {
    "Q8_0": (Q8_0_SCHEME, _SCALE_BYTES + BLOCK, _decode_q8_0, _encode_q8_0),
    "Q4_0": (Q4_0_SCHEME, _SCALE_BYTES + BLOCK // 2, _decode_q4_0, _encode_q4_0),
}
_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_FLOAT_TYPE_OF = {v: k for k, v in _FLOAT_TYPES.items()}


# ---- load ------------------------------------------------------------------------

def load(path, device=None, names=None):
    """{name: QTensor | Tensor} for the Q8_0, Q4_0, F32, F16 and BF16 tensors of
    the GGUF file at `path`, on `device` (default: the default backend); with
    `names`, only those tensors (a file that also holds types qdispatch does not
    read, K-quants say, loads the rest this way).  The key-value metadata (the
    tokenizer, say) is stepped over, not read."""
    gguf = _gguf()
    if device is not None:
        backend_for(device)  # an unavailable device fails before any reading
    with opened_regular_file(path) as f:
        file = gguf_reader.read(path, f, gguf.GGML_QUANT_SIZES)
        try:
            _check_offsets(path, file)
            by_name = {t.name: t for t in file.tensors}
            return {name: _load_tensor(path, gguf, file, by_name[name], device)
                    for name in selected_names(path, names, by_name)}
        finally:
            file.data.close()


def _check_offsets(path, file):
    """Each tensor's data starts where the one before it ends, rounded up to the
    file's alignment, as ggml requires, and the last ends with the file: tensors that
    overlap would load one file's bytes many times over, or as another's garbage, and
    a wrong tensor count would read a header as data."""
    expected = file.data_start
    for t in file.tensors:
        if t.offset != expected:
            raise SerializationError(
                f"Tensor {t.name!r} in {path} starts at byte {t.offset} of the file, where the "
                f"tensors before it end at {expected} (aligned to {file.alignment} bytes): the file is corrupted")
        end = t.offset + t.nbytes
        if end > len(file.data):
            raise SerializationError(f"{path} is not a readable GGUF file (truncated or corrupted?): tensor "
                                     f"{t.name!r} ends at byte {end}, past the file's end at byte {len(file.data)}")
        expected += -(-t.nbytes // file.alignment) * file.alignment
    if len(file.data) > expected:  # the last tensor's padding is optional (past its end: checked above)
        what = "its last tensor's data and alignment padding" if file.tensors else "its header and padding"
        raise SerializationError(f"{path} holds {len(file.data) - expected} bytes past {what} (which end at "
                                 f"byte {expected}): the file is corrupted (its tensor count, say)")


def _load_tensor(path, gguf, file, t, device):
    kind = gguf.GGMLQuantizationType(t.ggml_type).name
    shape = tuple(reversed(t.dims))
    raw = np.frombuffer(file.data, np.uint8, t.nbytes, t.offset).copy()  # not a view: the map closes
    if kind in _FLOAT_TYPES:
        dtype = _FLOAT_TYPES[kind]
        held = np.dtype({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind])  # bfloat16 as its bits
        data = raw.view(held.newbyteorder("S") if file.swapped else held).astype(held)  # in the host's order
        try:
            data = data.reshape(shape)
        except ValueError as exc:  # an empty tensor with a dim numpy can't hold, say
            raise SerializationError(f"Tensor {t.name!r} in {path} has shape {shape}, which its {data.size} values "
                                     f"can't take ({exc}): the file is corrupted") from None
        return tensor(data, device=device, dtype=dtype)
    if kind not in _QUANT_TYPES:
        raise SerializationError(
            f"Tensor {t.name!r} in {path} is {kind}, which qdispatch does not read: supported "
            f"types are Q8_0, Q4_0, F32, F16 and BF16 (requantize the model to one of them, or load the "
            f"others with names=[...])")
    if 0 in shape:  # a GGUF tensor may be empty, a QTensor can't
        raise SerializationError(
            f"Tensor {t.name!r} in {path} is a {kind} tensor of shape {shape}, with no values: qdispatch's "
            f"QTensors hold at least one value; remove it from the file or store it as F32")
    scheme, block_bytes, decode, _ = _QUANT_TYPES[kind]
    scales, payload = _split_blocks(raw, block_bytes, file.swapped)
    if not np.all(np.isfinite(scales)):  # gguf's own quantizer writes inf for blocks past float16's range
        bad = "NaN" if np.isnan(scales).any() else "Inf"
        raise SerializationError(
            f"Tensor {t.name!r} in {path} has {bad} scales (values past float16's range, or damage), and a QTensor's "
            f"scales are finite: requantize it from finite floats, or load the others with names=[...]")
    grid = shape[:-1] + (shape[-1] // BLOCK,)
    return qtensor_from_parts(decode(payload).reshape(shape), scales.reshape(grid), scheme, device=device)


# ---- export ----------------------------------------------------------------------

def _quant_type(q):
    """The GGUF type a QTensor's scheme maps to, or None."""
    scheme = q.scheme
    block = q.layout.logical_block(q.transposed)
    if scheme.scale_dtype != "f16" or block[-1] != BLOCK or any(b != 1 for b in block[:-1]):
        return None
    return {8: "Q8_0", 4: "Q4_0"}.get(scheme.bits)


def _plan(name, obj):
    """(byte-or-value shape, numpy dtype, ggml type name, fetch) for one object:
    what the gguf writer is told before any bytes are fetched (every check is
    here), and fetch() -> the array it writes."""
    if len(name.encode("utf-8")) > _MAX_NAME or "\0" in name:  # a NUL would end ggml's name early
        raise SerializationError(
            f"Can't export tensor {name!r}: ggml reads names of UTF-8 text without NULs, at most {_MAX_NAME} "
            f"bytes long, and refuses a file holding another; rename it")
    if isinstance(obj, (QTensor, Tensor, np.ndarray)) and len(obj.shape) > _MAX_DIMS:
        raise SerializationError(
            f"Can't export tensor {name!r} of shape {tuple(obj.shape)}: GGUF tensors have at most {_MAX_DIMS} "
            f"dims (ggml refuses a file holding one with more); reshape it first")
    if isinstance(obj, QTensor):
        kind = _quant_type(obj)
        if kind is None:
            raise SerializationError(
                f"Can't export tensor {name!r}: GGUF has no type for {obj.scheme!r}. Q8_0 needs "
                f"QuantScheme('q8s' or 'q8f', block=32, scale_dtype='f16'), Q4_0 needs "
                f"QuantScheme('q4s' or 'q4f', block=32, store='packed_u32', scale_dtype='f16'); "
                f"or export its dequantize() as F32")
        _, block_bytes, _, encode = _QUANT_TYPES[kind]
        shape = tuple(obj.shape[:-1]) + (obj.shape[-1] // BLOCK * block_bytes,)

        def fetch():
            values, scales = qtensor_host(obj)
            # checked as save checks them: f16 would round a scale from qtensor_from_parts
            scales = encode_scales(name, scales, "f16", op="export")
            return _join_blocks(scales, encode(np.ascontiguousarray(values)), obj.shape)
        return shape, np.dtype(np.uint8), kind, fetch
    if isinstance(obj, Tensor):
        dtype, fetch = obj.dtype, lambda: get_backend(obj.kind).to_host(obj.payload)
    elif isinstance(obj, np.ndarray):
        native = obj.dtype.newbyteorder("=")  # a big-endian array goes out in the host's (the file's) order
        dtype = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(native)
        fetch = lambda: obj.astype(native, copy=False)
    else:
        raise ArgumentTypeError(f"Can't export {name!r} of type {type(obj).__name__}: expected {SAVABLE}")
    if dtype not in _FLOAT_TYPE_OF:
        raise SerializationError(f"Can't export tensor {name!r} of dtype {dtype or obj.dtype}: GGUF "
                                 f"export takes float32, float16 or bfloat16 data; convert it first "
                                 f"(np.asarray(x, np.float32), or qd.quantize it)")
    if len(obj.shape) == 0:
        raise SerializationError(f"Can't export tensor {name!r}: GGUF tensors need at least one dim")
    if dtype == "bfloat16":  # raw 16-bit patterns, handed over as bytes
        shape = tuple(obj.shape[:-1]) + (obj.shape[-1] * 2,)
        return shape, np.dtype(np.uint8), "BF16", lambda: np.ascontiguousarray(fetch()).view(np.uint8).reshape(shape)
    return tuple(obj.shape), np.dtype(dtype), _FLOAT_TYPE_OF[dtype], lambda: np.ascontiguousarray(fetch())


def _is_utf8(text):
    try:
        text.encode("utf-8")  # a lone surrogate (from a bytes name decoded with surrogateescape) has none
        return True
    except UnicodeEncodeError:
        return False


def export(path, tensors, arch="qdispatch"):
    """Write `{name: QTensor | Tensor | ndarray}` (str names) to a GGUF file, atomically.
    `arch` is written as general.architecture.  Every tensor is checked first;
    then they are fetched and written one at a time, so the host holds one
    tensor's bytes at a time (a model on the GPU is never on the host whole)."""
    gguf = _gguf()
    if not isinstance(arch, str):
        raise ArgumentTypeError(f"export's arch= takes a str (written as general.architecture), got "
                                f"{type(arch).__name__} {arch!r}")
    if "\0" in arch or not _is_utf8(arch):
        raise SerializationError(f"export's arch= is written as UTF-8 text without NULs, got {arch!r}")
    tensors = check_tensor_dict(tensors, "export")
    plans = [(name, *_plan(name, obj)) for name, obj in tensors.items()]  # all checks first
    with atomic_path(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for name, shape, dtype, kind, _ in plans:
                raw = gguf.GGMLQuantizationType[kind] if dtype == np.uint8 else None
                writer.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize, raw_dtype=raw)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for name, shape, dtype, _, fetch in plans:
                data = fetch()
                if data.shape != shape or data.dtype != dtype:
                    raise RuntimeError(f"qdispatch bug: tensor {name!r} holds {data.dtype}{data.shape}, "
                                       f"planned {dtype}{shape}")
                writer.write_tensor_data(data)
                del data  # before the next tensor's bytes arrive
        finally:
            writer.close()
