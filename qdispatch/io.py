"""Saving and loading tensors in the safetensors format (written and read here,
with numpy only).

    qdispatch.save("model.safetensors", {"w": qtensor, "b": tensor, "meta": ndarray})
    tensors = qdispatch.load("model.safetensors", device="cpu")

A loaded QTensor holds exactly the values and scales that were saved, on any
backend, so everything computed from it is bit-identical to the original.

File layout (format versions 1 to 3), readable by any safetensors reader:

- A QTensor `name` is two entries: `name.qvalues` holds its values in the
  scheme's store and in storage orientation (int8, or uint32 words packed along
  the last dim), `name.qscales` its scale grid in the scale dtype (F32, F16, or
  BF16 as raw 16-bit).
- A Tensor or numpy array `name` is one entry under its own name (a bfloat16
  Tensor as BF16).
- One object saved under several names (a weight shared by two layers) is
  stored once, under its first name; each other name's record is an alias,
  {"kind": "alias", "of": that name}, and `load` gives one object for all of
  them.  A QTensor saved beside its transpose (`q` and `q.T`, one store) is
  stored once too: the other name's alias adds "transposed": true, and `load`
  gives the first name's QTensor and its `.T`.
- The header's metadata holds `qdispatch.format_version` and
  `qdispatch.tensors`, a JSON object with one record per name: its kind
  ("qtensor", "tensor", "array" or "alias"), a CRC-32 of each entry's bytes, and
  for a QTensor its scheme (value, block, axis, store, scale_dtype; storage
  orientation, as the bytes are), logical shape and transposed flag.  Version
  3 is a file with a transposed alias, 2 one with aliases only, 1 one without
  (each file the oldest version that describes it, for older readers).

Writes are atomic: the file is written next to its destination, synced, then
renamed over it, so a crash mid-write leaves the old file intact.
"""
import contextlib
import errno
import json
import math
import os
import secrets
import stat
import zlib
from collections.abc import Mapping

import numpy as np

from . import packing, quantmath
from ._core import QTensor, Tensor
from .errors import ArgumentTypeError, NotFoundError, QDispatchError, SerializationError
from .layout import QLayout, swap_last2
from .scheme import QuantScheme
from .tensor_api import (backend_for, numpy_from_dlpack, qtensor_from_stored, qtensor_stored, tensor,
                         tensor_stored)

FORMAT_VERSION = 3   # what this qdispatch writes at most and reads
_FIRST_WITH_ALIASES = 2
_FIRST_WITH_TRANSPOSED_ALIASES = 3
_VERSION_KEY = "qdispatch.format_version"
_TENSORS_KEY = "qdispatch.tensors"
# CRC-32 of the records' text: the entries' CRCs cover their bytes only, so a damaged
# record (a scheme, an alias's target) would load as other values.  Optional, so that
# files without it (older writers') load, and older readers read files with it.
_RECORDS_CRC_KEY = "qdispatch.tensors_crc32"
_SUFFIXES = (".qvalues", ".qscales")
_METADATA = "__metadata__"  # the header's own key: no entry may take it
_MAX_HEADER = 100_000_000  # bytes, as the safetensors library reads: a larger claim is a damaged file

# safetensors dtype code -> numpy dtype of the raw bytes (BF16 stays as its bits)
_NUMPY_OF = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64,
}
_CODE_OF_NUMPY = {np.dtype(v): k for k, v in _NUMPY_OF.items() if k != "BF16"}
_SCALE_CODES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
_TENSOR_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int8": "I8", "int32": "I32"}
_KINDS = ("qtensor", "tensor", "array", "alias")
_RECORD_KEYS = {"qtensor": {"kind", "scheme", "shape", "transposed", "crc32"},
                "tensor": {"kind", "dtype", "shape", "crc32"}, "array": {"kind", "dtype", "shape", "crc32"},
                "alias": {"kind", "of", "transposed"}}


def _is_numpy_code(code):
    """Whether `code` (any JSON value a header holds) names a dtype this reader takes."""
    return isinstance(code, str) and code in _NUMPY_OF


# ---- atomic writes -------------------------------------------------------------

@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path next to `path`; on success sync it and rename it
    over `path`, on failure remove it.  Either way `path` is never half-written."""
    # a bytes path too: the temporary name is str.  A symbolic link stays one: its
    # target is what is written, as open(path, "wb") would.
    given = os.fsdecode(_checked_path(path))
    if not given:  # realpath would make it the working folder
        raise FileNotFoundError(errno.ENOENT, "save and export write a file, so give a file's path, not ''", given)
    path = os.path.realpath(given)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a folder: save and export write a file, so give a file's path")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):  # the rename would put a file in its place
        raise SerializationError(f"{path} is not a regular file (a pipe or a device?): save and export replace "
                                 f"only files, so give a file's path")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):  # else the error would name the temporary file
        what = "is a file, not a folder" if os.path.exists(folder) else "does not exist; create it first"
        raise FileNotFoundError(f"Can't write {path}: its folder {folder} {what}")
    try:
        tmp = _new_file(folder, ".qdispatch.", ".tmp")  # short: the target's name may be as long as names get
    except PermissionError:  # the temporary file's name would mean nothing to the caller
        raise PermissionError(errno.EACCES, f"Can't write {path}: no permission to create files in {folder}",
                              path) from None
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):  # a file replaced keeps its permissions, as one overwritten would
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def _new_file(folder, prefix, suffix):
    """The path of a new empty file in `folder`, made with the permissions any new
    file gets (0666 less the umask), where tempfile's are the owner's alone."""
    while True:
        path = os.path.join(folder, prefix + secrets.token_hex(8) + suffix)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return path
        except FileExistsError:  # another's name, drawn by chance: draw again
            continue


def _fsync_dir(folder):
    """Make the rename itself durable (POSIX only; Windows has no directory fds)."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- encoding --------------------------------------------------------------------

def _little_endian(a):
    """`a` C-contiguous in the file's byte order, little-endian, whatever the host's
    or the array's own (a big-endian array read from another format included)."""
    a = np.asarray(a, order="C")  # ascontiguousarray would make a 0-d array 1-d
    little = a.dtype.newbyteorder("<")
    return a if a.dtype == little else a.astype(little)


def _crc_text(text):
    """A text's CRC-32 as 8 hex digits: one width whatever the value, as the header's
    room is reserved before the entries' CRCs are known."""
    return f"{_crc(text.encode('utf-8', 'surrogatepass')):08x}"


def _crc(data):
    view = memoryview(data)
    return zlib.crc32(view.cast("B") if view.nbytes else b"")  # a view with a zero in its shape can't cast


def encode_scales(name, scales, scale_dtype, op="save"):
    """The scale grid as stored: raw 16-bit for f16/bf16.  A QTensor's scales are
    values of its scale dtype (qtensor_from_parts refuses others); checked again
    here, so that nothing is ever rounded on its way to a file."""
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    if quantmath.first_scale_off_dtype(scales, scale_dtype) is not None:
        raise SerializationError(
            f"Can't {op} tensor {name!r}: its scales are not all {scale_dtype} values, as its "
            f"scheme says; rebuild it with qdispatch.quantize or qtensor_from_parts using {scale_dtype} scales")
    if scale_dtype == "f32":
        return scales
    if scale_dtype == "f16":
        return scales.astype(np.float16)
    return quantmath.f32_to_bf16_bits(scales)


def encode_qtensor(name, q, op="save"):
    """QTensor q's values and scales as qdispatch stores them, in storage
    orientation: int8, or uint32 words for `packed_u32`; the scales in their scale
    dtype (raw 16-bit for f16/bf16).  decode_qtensor is the inverse."""
    scheme = q.layout.scheme
    values, scales, _, _ = qtensor_stored(q)
    if scheme.store == "packed_u32":
        values = packing.pack_u32(values, scheme.bits)
    return values, encode_scales(name, scales, scheme.scale_dtype, op)


def decode_qtensor(name, values, raw_scales, scheme, layout):
    """(int8 values, float32 scales) of what encode_qtensor gave, in storage
    orientation `layout`; stray bits in packed words, scales that are not finite
    and values that times their scale overflow float32 are refused."""
    if scheme.store == "packed_u32":
        words = values
        values = packing.unpack_u32(words, scheme.bits, layout.shape[-1])
        used = layout.shape[-1] % (32 // scheme.bits) * scheme.bits  # bits of a row's last word that hold values
        if used and np.any(words[..., -1] >> np.uint32(used)):  # every other bit is some value's
            raise SerializationError(
                f"Tensor {name!r}: packed words have bits set outside their {layout.shape[-1]} values")
    scales = (quantmath.bf16_bits_to_f32(raw_scales) if scheme.scale_dtype == "bf16"
              else raw_scales.astype(np.float32))
    if not np.all(np.isfinite(scales)):
        raise SerializationError(f"Tensor {name!r}: its scales hold NaN or Inf")
    past = quantmath.first_block_past_float32(scales, lambda: values, layout.shape, scheme.qrange, layout.block)
    if past is not None:  # such a tensor can't be made: a writer that allowed it, or a damaged file
        raise SerializationError(f"Tensor {name!r}: " + str(quantmath.dequantize_overflow_error(
            past, "quantize its float weights again, scaled down")))
    return values, scales


def qtensor_reduced(q):
    """QTensor.__reduce__'s arguments: q's store as a file keeps it (4- and 2-bit
    values in their packed words, scales in their dtype: half or less the bytes of
    int8 values and float32 scales), its storage shape, scheme, orientation and device."""
    values, scales = encode_qtensor("a pickled QTensor", q, op="pickle")
    return values, scales, tuple(q.layout.shape), q.layout.scheme, bool(q.transposed), str(q.device)


def qtensor_unpickled(values, raw_scales, shape, scheme, transposed, device):
    """The QTensor qtensor_reduced took apart.  (Pickles made before kept int8 values
    and float32 scales: tensor_api.qtensor_from_stored still rebuilds those.)"""
    layout = QLayout.for_shape(scheme, shape)
    values, scales = decode_qtensor("a pickled QTensor", np.asarray(values), np.asarray(raw_scales), scheme, layout)
    return qtensor_from_stored(values, scales, scheme, transposed, device)


def stored_shapes(scheme, layout):
    """The shapes of a QTensor's two entries, in storage orientation: its values
    (int8, or uint32 words packed along the last dim) and its scale grid."""
    values = tuple(layout.shape)
    if scheme.store == "packed_u32":
        values = values[:-1] + (-(-values[-1] // (32 // scheme.bits)),)
    return values, tuple(layout.grid)


def _plan(name, obj):
    """(record, [(entry key, dtype code, shape)], fetch) for one object: what its
    entries hold, known before any of its bytes are fetched, and fetch() -> their
    little-endian arrays in that order (a device tensor comes to the host only as
    it is written)."""
    if isinstance(obj, QTensor):
        scheme = obj.layout.scheme  # in storage orientation, as the bytes are (obj.scheme is logical)
        packed = scheme.store == "packed_u32"
        values_shape, scales_shape = stored_shapes(scheme, obj.layout)
        entries = [(name + _SUFFIXES[0], "U32" if packed else "I8", values_shape),
                   (name + _SUFFIXES[1], _SCALE_CODES[scheme.scale_dtype], scales_shape)]

        def fetch():
            return [_little_endian(part) for part in encode_qtensor(name, obj)]
        record = {"kind": "qtensor", "scheme": scheme.to_record(), "shape": list(obj.shape),
                  "transposed": bool(obj.transposed)}
        return record, entries, fetch
    if isinstance(obj, Tensor):
        return ({"kind": "tensor", "dtype": obj.dtype, "shape": list(obj.shape)},
                [(name, _TENSOR_CODES[obj.dtype], tuple(obj.shape))], lambda: [_little_endian(tensor_stored(obj)[0])])
    if isinstance(obj, np.ndarray):
        code = _CODE_OF_NUMPY.get(obj.dtype.newbyteorder("="))
        if code is None:
            kept = ", ".join(sorted(str(dtype) for dtype in _CODE_OF_NUMPY))
            raise ArgumentTypeError(f"Can't save array {name!r} of dtype {obj.dtype}: a safetensors file holds "
                                    f"{kept} (and qdispatch's bfloat16 tensors); convert it with .astype() first")
        return ({"kind": "array", "dtype": code, "shape": list(obj.shape)}, [(name, code, obj.shape)],
                lambda: [_little_endian(obj)])
    hint = ""
    if isinstance(obj, dict) and name.endswith("._extra_state"):  # a state_dict() of qdispatch.torch's layers
        hint = ("; a model's state_dict() with QLinear or QEmbedding layers saves with "
                "qdispatch.torch.save_model(model, path) (or torch.save(model.state_dict(), path))")
    raise ArgumentTypeError(f"Can't save {name!r} of type {type(obj).__name__}: expected {SAVABLE}{hint}")


def _entry_keys(name, record):
    kind = record.get("kind")
    return [name + s for s in _SUFFIXES] if kind == "qtensor" else [] if kind == "alias" else [name]


def check_tensor_dict(tensors, caller):
    """`tensors` with its names as plain str (numpy's np.str_ names among them), or
    an error for anything but {name: tensor} with non-empty str names, before any
    work (a bad name would otherwise fail deep inside a writer, in its own words)."""
    if not isinstance(tensors, Mapping):
        hint = "; for (name, tensor) pairs pass dict(pairs)" if isinstance(tensors, (list, tuple)) else ""
        raise ArgumentTypeError(f"{caller} expects a dict of name -> tensor, got {type(tensors).__name__}{hint}")
    for name in tensors:
        if not isinstance(name, str) or not name:
            raise ArgumentTypeError(f"Tensor names must be non-empty strings, got {name!r} of type "
                                    f"{type(name).__name__}")
        try:
            name.encode("utf-8")  # files hold names as UTF-8, which has no lone surrogates
        except UnicodeEncodeError:
            raise SerializationError(f"Can't {caller} tensor {name!r}: its name is no UTF-8 text (it holds a lone "
                                     f"surrogate, as bytes decoded with errors='surrogateescape' do); rename it") from None
    return {_plain(name): _ours(_plain(name), tensor, caller) for name, tensor in tensors.items()}


# what save and export take, as their errors say
SAVABLE = ("a qdispatch QTensor or Tensor, a numpy array or scalar, or a tensor of a library that speaks DLPack "
           "(torch, CuPy)")


def _ours(name, obj, caller):
    """A tensor of another library that speaks DLPack (torch, CuPy, JAX) as a numpy
    array, or as a qdispatch Tensor where numpy has no such dtype (bfloat16) or the
    data is on a GPU; a numpy scalar as a 0-d array; anything else as it is (the
    writers name what they refuse)."""
    if isinstance(obj, np.generic):  # np.float32(3), as qdispatch.tensor takes it
        return np.asarray(obj)
    if isinstance(obj, (QTensor, Tensor, np.ndarray)) or not hasattr(obj, "__dlpack__"):
        return obj
    resolve_neg = getattr(obj, "resolve_neg", None)
    if resolve_neg is not None:  # torch's lazy negation (x.conj().imag), which DLPack does not carry
        obj = resolve_neg()
    if getattr(obj, "requires_grad", False):  # torch exports no such tensor (a Parameter): its values
        obj = obj.detach()
    try:
        return numpy_from_dlpack(obj)
    except (BufferError, TypeError, ValueError, RuntimeError):
        pass
    given = str(getattr(obj, "dtype", "?"))
    try:
        held = tensor(obj)
    except (TypeError, ValueError, RuntimeError, BufferError) as exc:
        raise ArgumentTypeError(f"Can't {caller} {name!r}, a {type(obj).__name__} of dtype {given}: {exc}") from None
    if held.dtype != given.removeprefix("torch."):  # qdispatch.tensor converts (float64 to float32): a file keeps values as given
        raise ArgumentTypeError(f"Can't {caller} {name!r}, a {type(obj).__name__} of dtype {given} that numpy can't "
                                f"view (on a GPU, say): a qdispatch Tensor holds float32, float16, bfloat16, int8 or "
                                f"int32; move it to the host first (x.cpu() in torch, x.get() in CuPy), which saves "
                                f"it as a numpy array of its dtype")
    return held


def _plain(name):
    """A str subclass's text as str: messages and files show 'w', not np.str_('w')."""
    return str.__str__(name)


def save(path, tensors):
    """Write `{name: QTensor | Tensor | ndarray}` to `path` as one safetensors
    file, atomically.  `qdispatch.load` reads it back bit for bit.  Tensors are
    fetched and written one at a time, so the host holds one tensor's bytes at a
    time (a model on the GPU is never on the host whole).  An object under several
    names (a tied weight) is written once; `load` gives it back as one object.  So is
    a QTensor beside its transpose (`q` and `q.T`): `load` gives one and its `.T`."""
    tensors = check_tensor_dict(tensors, "save")
    plans, keys, first_names = [], set(), {}
    for name, obj in tensors.items():
        first, first_obj = first_names.setdefault(_held_bytes(obj), (name, obj))
        record, entries, fetch = (_alias(first, first_obj, obj), [], list) if first != name else _plan(name, obj)
        for key, _, _ in entries:
            if key == _METADATA:
                raise SerializationError(
                    f"Can't save tensor {name!r}: safetensors reserves the name {_METADATA!r} for "
                    f"the header's metadata; rename it")
            if key in keys or (key != name and key in tensors):
                raise SerializationError(
                    f"Can't save tensor {name!r}: its entry {key!r} collides with another name; rename one")
            keys.add(key)
        plans.append((record, entries, fetch))
    header, offset = {}, 0
    for _, entries, _ in plans:
        for key, code, shape in entries:
            end = offset + math.prod(shape) * np.dtype(_NUMPY_OF[code]).itemsize
            header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
    records = {name: record for name, (record, _, _) in zip(tensors, plans)}
    for record, entries, _ in plans:
        if entries:  # an alias has none, and no CRC
            record["crc32"] = [0xFFFFFFFF] * len(entries)  # the widest CRC: the header's room is reserved
    room = -(-len(_header_json(header, records)) // 8) * 8  # safetensors pads its header to 8 bytes
    if room > _MAX_HEADER:
        raise SerializationError(
            f"Can't save {len(tensors)} tensors in one file: their header takes {room} bytes, past the "
            f"{_MAX_HEADER} that safetensors reads; save them in several files")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.seek(8 + room)
        for record, entries, fetch in plans:
            arrays = fetch()
            for (key, code, shape), a in zip(entries, arrays):
                if a.dtype.str != np.dtype(_NUMPY_OF[code]).newbyteorder("<").str or a.shape != tuple(shape):
                    raise RuntimeError(f"qdispatch bug: entry {key!r} holds {a.dtype}{a.shape}, "
                                       f"planned {code}{list(shape)}")
                f.write(memoryview(a).cast("B") if a.nbytes else b"")
            if entries:
                record["crc32"] = [_crc(a) for a in arrays]
            del arrays  # before the next tensor's bytes arrive
        f.seek(0)
        f.write(room.to_bytes(8, "little") + _header_json(header, records).ljust(room, b" "))


def _held_bytes(obj):
    """What names the bytes `obj` would write: the object, or a QTensor's store and
    layout, which its transpose shares (the dict being saved keeps them alive, so
    their ids stay unique)."""
    return (id(obj.storage), id(obj.layout)) if isinstance(obj, QTensor) else (id(obj),)


def _alias(first, first_obj, obj):
    """The record of `obj`, whose bytes `first_obj` (saved as `first`) holds."""
    record = {"kind": "alias", "of": first}
    if isinstance(obj, QTensor) and obj.transposed != first_obj.transposed:
        record["transposed"] = True
    return record


def _header_json(header, records):
    # the oldest version that describes the file, so that older readers read what they can
    aliases = [record for record in records.values() if record["kind"] == "alias"]
    version = (_FIRST_WITH_TRANSPOSED_ALIASES if any(alias.get("transposed") for alias in aliases)
               else _FIRST_WITH_ALIASES if aliases else 1)
    text = json.dumps(records)
    metadata = {_VERSION_KEY: str(version), _TENSORS_KEY: text, _RECORDS_CRC_KEY: _crc_text(text)}
    return json.dumps({**header, _METADATA: metadata}, separators=(",", ":")).encode()


# ---- decoding ----------------------------------------------------------------------

def _read_header(path, f):
    """The parsed JSON header, the data section's size and where it starts."""
    file_size = os.fstat(f.fileno()).st_size
    if file_size < 8:
        raise SerializationError(f"{path} is not a safetensors file: it holds only {file_size} bytes")
    first = f.read(8)
    if first[:4] == b"GGUF":  # llama.cpp's format: its own reader takes it
        raise SerializationError(f"{path} is a GGUF file, not a safetensors file: read it with "
                                 f"qdispatch.gguf.load({str(path)!r})")
    size = int.from_bytes(first, "little")
    if size > _MAX_HEADER:
        raise SerializationError(
            f"{path} is corrupted or not a safetensors file: its header claims {size} bytes, where "
            f"safetensors headers hold at most {_MAX_HEADER}")
    if 8 + size > file_size:
        raise SerializationError(
            f"{path} is truncated or not a safetensors file: its header claims {size} bytes "
            f"but the file holds {file_size}")
    try:
        # UTF-8 as safetensors requires (json would guess UTF-16 or take a byte-order mark)
        header = json.loads(f.read(size).decode("utf-8"), object_pairs_hook=_without_repeats)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (ValueError, RecursionError) as exc:
        raise SerializationError(f"{path} has a corrupted safetensors header ({exc})") from None
    except MemoryError:  # a header near the limit of small JSON values takes gigabytes as Python objects
        raise SerializationError(f"{path} has a safetensors header of {size} bytes whose JSON takes more memory "
                                 f"than is free: it is corrupted, or no file of tensors") from None
    return header, file_size - 8 - size, 8 + size


def _without_repeats(pairs):
    """A JSON object's dict, refusing a key given twice (json keeps the last one, so
    a damaged name could hide a tensor)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"the key {brief(twice)} appears twice in one object")
    return obj


def _metadata(path, header):
    """The records of a file's tensors, each checked to have the fields its kind needs."""
    meta = header.get(_METADATA)
    parts = sorted(key for key in header if key.endswith(_SUFFIXES))
    if meta is None and not parts:
        meta = {}  # null: none, as safetensors reads it, in a file with no QTensor's parts to lose records of
    if meta is None:  # read as plain arrays, a QTensor's parts would pass for its values
        raise SerializationError(
            f"{path} has entries named as a QTensor's parts ({', '.join(map(repr, parts[:3]))}"
            f"{', ...' if len(parts) > 3 else ''}) but no __metadata__ (absent or null) to say their schemes: a "
            f"qdispatch file whose metadata was lost, or another writer's whose names end so; its entries read "
            f"as plain arrays with safetensors.numpy.load_file")
    if not isinstance(meta, dict):  # 0 or "" too: safetensors refuses them, and they hid qdispatch's records
        raise SerializationError(
            f"{path} has a corrupted safetensors header: its __metadata__ is {brief(meta)}, not a JSON object")
    version = meta.get(_VERSION_KEY)
    if version is None and _TENSORS_KEY not in meta:
        return _plain_records(path, header)
    if version is None or _TENSORS_KEY not in meta:
        raise SerializationError(
            f"{path} has corrupted qdispatch metadata: it holds {_VERSION_KEY!r} or {_TENSORS_KEY!r} "
            f"without the other")
    if version not in [str(v) for v in range(1, FORMAT_VERSION + 1)]:
        newer = (isinstance(version, str) and version.isascii() and version.isdecimal()
                 and int(version) > FORMAT_VERSION)
        raise SerializationError(
            f"{path} has qdispatch format version {version!r}; this qdispatch reads versions 1 to "
            f"{FORMAT_VERSION}: " + ("upgrade qdispatch to read it" if newer else "the file is corrupted"))
    said, text = meta.get(_RECORDS_CRC_KEY), meta[_TENSORS_KEY]
    if said is not None and isinstance(text, str) and said != _crc_text(text):
        raise SerializationError(f"{path} has corrupted qdispatch metadata: its tensor records do not match "
                                 f"their CRC-32")
    try:
        records = json.loads(text, object_pairs_hook=_without_repeats)
        if not isinstance(records, dict):
            raise ValueError("not a JSON object")
    except (TypeError, ValueError, RecursionError) as exc:  # TypeError: the metadata is not a string
        raise SerializationError(f"{path} has corrupted qdispatch metadata ({exc})") from None
    for name, record in records.items():
        problem = _record_problem(record)
        if problem is None and record["kind"] == "alias":
            target = records.get(record["of"])
            if not isinstance(target, dict) or target.get("kind") == "alias":
                problem = f"it is an alias of {brief(record['of'])}, which names no tensor stored in the file"
            elif record.get("transposed") and target.get("kind") != "qtensor":
                problem = f"it is the transpose of {brief(record['of'])}, which is no QTensor"
        if problem:
            raise SerializationError(f"Tensor {name!r} in {path} has a corrupted record: {problem}")
    return records


def _plain_records(path, header):
    """The records of a safetensors file that another writer made (torch's, numpy's):
    each entry a Tensor where its dtype is one (F32, F16, BF16, I8, I32), else a numpy
    array, as the header gives it; no CRC-32 to check (None).  An entry of a dtype
    numpy lacks (FP8, say) is refused only when it is read, so names= loads the rest."""
    records = {}
    for key, entry in header.items():
        if key == _METADATA:
            continue
        code = entry.get("dtype") if isinstance(entry, dict) else None
        tensor_dtype = next((dtype for dtype, c in _TENSOR_CODES.items() if c == code), None)
        records[key] = ({"kind": "tensor", "dtype": tensor_dtype, "crc32": [None]} if tensor_dtype
                        else {"kind": "array", "dtype": code, "crc32": [None]} if _is_numpy_code(code)
                        else {"kind": "unread", "dtype": code})
    return records


def _record_problem(record):
    """What is wrong with one tensor's record, or None: checked when the file is
    opened, so that decoding can trust the record's fields and their types."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {brief(record)}"
    kind = record.get("kind")
    if kind not in _KINDS:
        return f"unknown kind {brief(kind)} (expected one of {', '.join(map(repr, _KINDS))})"
    unknown = sorted(set(record) - _RECORD_KEYS[kind])
    if unknown:
        return f"it has the field {brief(unknown[0])}, which a {kind} record does not hold"
    if kind == "alias":
        if not isinstance(record.get("of"), str):
            return f"its alias target is {brief(record.get('of'))}"
        turned = record.get("transposed", False)
        return None if isinstance(turned, bool) else f"its transposed flag is {brief(turned)}, expected true or false"
    crcs, entries = record.get("crc32"), len(_SUFFIXES) if kind == "qtensor" else 1
    if not (isinstance(crcs, list) and len(crcs) == entries and all(_is_crc(c) for c in crcs)):
        return f"its crc32 is {brief(crcs)}, expected a list of {entries} CRC-32 values"
    if kind == "tensor" and not (isinstance(record.get("dtype"), str) and record["dtype"] in _TENSOR_CODES):
        return f"its dtype is {brief(record.get('dtype'))}, expected one of {', '.join(_TENSOR_CODES)}"
    if kind == "array" and "dtype" in record and not _is_numpy_code(record["dtype"]):
        return f"its dtype is {brief(record['dtype'])}, expected one of {', '.join(_NUMPY_OF)}"
    shape = record.get("shape")  # always in a QTensor's record; in files of later releases, in the others'
    if (kind == "qtensor" or shape is not None) and not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        return f"its shape is {brief(shape)}, expected a list of sizes"
    if kind != "qtensor":
        return None
    if not isinstance(record.get("scheme"), dict):
        return f"its scheme is {brief(record.get('scheme'))}, expected a JSON object"
    if not isinstance(record.get("transposed"), bool):
        return f"its transposed flag is {brief(record.get('transposed'))}, expected true or false"
    return None


def brief(value, limit=60):
    """repr(value), cut short: a damaged field may hold anything, of any length."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_complete(path, header, data_size, records):
    """Every record's entries are there, and the entries tile the data section, in
    some order, as safetensors requires: no overlap (a small file that names its
    bytes many times would load as a large one), no hole, no entry no record names."""
    spans = []
    for name, record in records.items():
        for key in _entry_keys(name, record):
            info = header.get(key)
            if not isinstance(info, dict):
                raise SerializationError(f"Tensor {name!r} in {path} is missing its entry {key!r}")
            begin, end = _offsets(info)
            if not (_is_count(begin) and _is_count(end) and begin <= end):
                raise SerializationError(f"Tensor {name!r} in {path}: entry {key!r} has data_offsets "
                                         f"{brief(info.get('data_offsets'))}, expected [begin, end] byte offsets")
            if end > data_size:
                raise SerializationError(
                    f"Tensor {name!r} in {path} is truncated: its data ends at byte {end} of the "
                    f"data section but the file holds {data_size}; the file is incomplete, write it again")
            spans.append((begin, end, key))
    named = {key for _, _, key in spans}
    stray = sorted(key for key in header if key != _METADATA and key not in named)
    if stray:
        raise SerializationError(f"{path} has the entry {stray[0]!r}, which no tensor record names: the "
                                 f"header does not match its metadata")
    reached, last = 0, None
    for begin, end, key in sorted(spans):
        if begin != reached:
            before = f"the entry before it, {last!r}, ends at byte {reached}" if last is not None else \
                "the data section starts at byte 0"
            gap = "they overlap" if begin < reached else f"bytes {reached} to {begin} belong to no entry"
            raise SerializationError(
                f"{path}: entry {key!r} begins at byte {begin} of the data section, but {before}: {gap}. A file "
                f"whose entries don't cover its data one after another, without overlap or holes, is damaged "
                f"or was not written as safetensors are")
        reached, last = end, key
    if reached != data_size:
        raise SerializationError(f"{path}: its entries cover {reached} bytes of a data section of {data_size}; "
                                 f"the file does not match its header")


def load(path, device=None, names=None):
    """Read a file written by `save`: {name: QTensor | Tensor | ndarray}, the
    tensors on `device` (default: the default backend); with `names`, only those
    tensors (the rest of the file is not read).  A safetensors file of another
    writer (torch's, numpy's) loads too: float32/float16/bfloat16/int8/int32 entries
    as Tensors, others as numpy arrays.  Each entry is read from the file
    straight into its own array, so loading holds no second copy of the file in
    memory (and needs no package beyond numpy)."""
    dev, _ = backend_for(device) if device is not None else (None, None)
    with reading(path) as stored:
        return {name: stored.decode(name, dev) for name in selected_names(path, names, stored.records)}


def selected_names(path, names, held):
    """A loader's names= as a list of the names of `held` (the file's tensors) to
    read: all of them for None, else those given, or an error naming what is wrong."""
    if names is None:
        return list(held)
    if isinstance(names, str):
        raise ArgumentTypeError(f"load's names= takes a list of tensor names, got the string {names!r}: "
                                f"write names=[{names!r}]")
    try:
        listed = list(names)
    except TypeError:
        listed = [None]
    if not all(isinstance(name, str) for name in listed):
        raise ArgumentTypeError(f"load's names= takes a list of tensor names (str), got {brief(names)}")
    listed = [_plain(name) for name in listed]
    missing = [name for name in listed if name not in held]
    if missing:
        held = list(held)
        some = ", ".join(map(repr, held[:8])) + (f", ... ({len(held)} in all)" if len(held) > 8 else "")
        raise NotFoundError(f"{path} holds no tensor named {', '.join(map(repr, missing))}; it holds {some}")
    return listed


@contextlib.contextmanager
def reading(path):
    """A file written by `save`, open for reading one tensor at a time (a
    `StoredFile`), so that a loader holds one tensor's bytes at a time."""
    with opened_regular_file(path) as f:
        yield StoredFile(path, f)


def _checked_path(path):
    """`path`, if it is one: open() would take a number for a file descriptor (and close
    it), and os.fsdecode's error names no call."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise ArgumentTypeError(f"Expected a file path (str, bytes or os.PathLike), got {type(path).__name__} {path!r}")
    return path


@contextlib.contextmanager
def opened_regular_file(path):
    """`path` open for binary reading, refused unless it names a regular file: a pipe
    would block the open until a writer came, and a device has no size to check."""
    mode = os.stat(_checked_path(path)).st_mode  # FileNotFoundError and PermissionError name the path
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", os.fsdecode(path))
    if not stat.S_ISREG(mode):
        raise SerializationError(f"{os.fsdecode(path)} is not a regular file (a pipe or a device?): load reads "
                                 f"files written to disk")
    with open(path, "rb") as f:
        yield f


class StoredFile:
    """An open file written by `save`: `records` ({name: its record}) and
    `decode(name, dev)` for one tensor, as `load` returns it."""

    def __init__(self, path, f):
        header, data_size, data_start = _read_header(path, f)
        self.path, self.records = path, _metadata(path, header)
        _check_complete(path, header, data_size, self.records)
        self._entries = _Entries(f, header, data_start, data_size)
        self._targets = {r["of"] for r in self.records.values() if r["kind"] == "alias"}
        self._shared = {}  # (name, device) -> the object, for the names in _targets

    def held_record(self, name):
        """The record of the tensor that `name` holds (an alias's target's)."""
        record = self.records[name]
        return self.records[record["of"]] if record["kind"] == "alias" else record

    def decode(self, name, dev, shared=True):
        """Tensor `name` read from the file, on qdispatch device `dev` (None: the
        default backend).  An alias and its target, on one device, give one object (a
        transposed alias its `.T`), unless not `shared`: then an object of its own."""
        record = self.records[name]
        turned = record["kind"] == "alias" and record.get("transposed", False)
        if record["kind"] == "alias":
            name = record["of"]
        key = (name, None if dev is None else str(dev))
        obj = self._shared.get(key) if shared else None
        if obj is None:
            obj = self._decode(name, dev)
            if shared and name in self._targets:
                self._shared[key] = obj
        return obj.T if turned else obj

    def _decode(self, name, dev):
        try:
            return _decode(name, self.records[name], self._entries, dev)
        except SerializationError as exc:  # the entries' checks know the tensor, not the file
            raise SerializationError(f"{self.path}: {exc}") from None
        except (QDispatchError, ValueError, TypeError, LookupError) as exc:  # a record that lies
            raise SerializationError(f"Can't load tensor {name!r} from {self.path}: {exc}") from exc


def _is_count(n):
    """A size or offset: a non-negative integer (JSON's true is not one)."""
    return isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0


def _is_crc(n):
    return _is_count(n) and n <= 0xFFFFFFFF


def _offsets(entry):
    """An entry's (begin, end) in the data section, unchecked; (None, None) when it has no pair."""
    offsets = entry.get("data_offsets")
    return tuple(offsets) if isinstance(offsets, list) and len(offsets) == 2 else (None, None)


class _Entries:
    """The file's entries by key: `format` for one's dtype and shape, `read` for its bytes."""

    def __init__(self, f, header, data_start, data_size):
        self.f, self.header = f, header
        self.data_start, self.data_size = data_start, data_size

    def format(self, name, key):
        """Entry `key`'s (dtype code, shape) as its header gives them, checked: a
        dtype this reader knows and a list of sizes."""
        entry = self.header[key]
        code, shape = entry.get("dtype"), entry.get("shape")
        if not _is_numpy_code(code):
            raise SerializationError(f"Tensor {name!r}: entry {key!r} has dtype {brief(code)}, "
                                     f"expected one of {', '.join(_NUMPY_OF)}")
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise SerializationError(f"Tensor {name!r}: entry {key!r} has no valid shape ({brief(shape)})")
        return code, shape

    def read(self, name, key, code, shape, crc):
        """Entry `key` of tensor `name` as a new array of `code` [shape] (little-endian),
        after checking it against the record and its CRC-32."""
        held_code, held_shape = self.format(name, key)
        if held_code != code or held_shape != list(shape):
            raise SerializationError(
                f"Tensor {name!r}: entry {key!r} holds {held_code}{held_shape} but "
                f"its record says {code}{list(shape)}; the file does not match its metadata")
        dtype = np.dtype(_NUMPY_OF[code]).newbyteorder("<")
        shape = tuple(shape)
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize  # checked before allocating
        begin, end = _offsets(self.header[key])
        if not (_is_count(begin) and _is_count(end) and begin <= end <= self.data_size and end - begin == nbytes):
            raise SerializationError(
                f"Tensor {name!r}: entry {key!r} spans bytes {begin} to {end} of the data section, but "
                f"{code}{list(shape)} takes {nbytes}; the file does not match its header")
        arr = np.empty(shape, dtype=dtype)
        raw = arr.reshape(-1).view(np.uint8)  # its bytes, read in place
        self.f.seek(self.data_start + begin)
        if self.f.readinto(raw) != nbytes:
            raise SerializationError(f"Tensor {name!r}: the file ended inside entry {key!r}; write it again")
        if crc is not None and _crc(raw) != crc:  # None: a file of another writer, which has none
            raise SerializationError(f"Tensor {name!r}: the bytes of {key!r} are corrupted (CRC-32 mismatch)")
        return arr


def _decode(name, record, entries, dev):
    """One tensor from its record, which `_metadata` checked."""
    kind = record["kind"]
    if kind == "unread":
        raise SerializationError(f"Tensor {name!r} has dtype {brief(record['dtype'])}, which qdispatch does not "
                                 f"read (it reads {', '.join(_NUMPY_OF)}): load the others with names=[...]")
    crcs = record["crc32"]
    if kind == "qtensor":
        return _decode_qtensor(name, record, entries, dev, crcs)
    code, shape = entries.format(name, name)
    said = (record.get("dtype", code) if kind == "array" else code, record.get("shape", shape))
    if said != (code, shape):
        raise SerializationError(f"Tensor {name!r}: its entry holds {code}{shape} but its record says "
                                 f"{said[0]}{said[1]}; the file does not match its metadata")
    if kind == "tensor":
        dtype = record["dtype"]
        arr = entries.read(name, name, _TENSOR_CODES[dtype], shape, crcs[0])
        return tensor(arr.astype(arr.dtype.newbyteorder("="), copy=False), device=dev, dtype=dtype)
    arr = entries.read(name, name, code, shape, crcs[0])
    return arr.astype(arr.dtype.newbyteorder("="), copy=False)


def _decode_qtensor(name, record, entries, dev, crcs):
    scheme = QuantScheme.from_record(record["scheme"])
    shape = tuple(record["shape"])
    transposed = record["transposed"]
    layout = QLayout.for_shape(scheme, swap_last2(shape) if transposed else shape)
    vkey, skey = _entry_keys(name, record)
    values_shape, scales_shape = stored_shapes(scheme, layout)
    values = entries.read(name, vkey, "U32" if scheme.store == "packed_u32" else "I8", values_shape, crcs[0])
    raw = entries.read(name, skey, _SCALE_CODES[scheme.scale_dtype], scales_shape, crcs[1])
    values, scales = decode_qtensor(name, values, raw, scheme, layout)
    return qtensor_from_stored(values, scales, scheme, transposed, device=dev)
