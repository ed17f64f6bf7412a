"""qdispatch.save / qdispatch.load: bit-exact round trips, atomic writes, and
clear errors for files that can't be trusted."""
import json
import os
import re
import stat
import sys
import zlib

import numpy as np
import pytest

import qdispatch as qd
from qdispatch import QuantScheme, SerializationError
from qdispatch import io as qio
from qdispatch.layout import QLayout
from helpers import transient_bytes

HOST_DEVICES = ["reference"] + (["cpu"] if "cpu" in qd.available_backends() else [])

SCHEMES = [
    QuantScheme("q8s"),
    QuantScheme("q8f", axis=0, scale_dtype="f16"),
    QuantScheme("q8s", block=(1, 32), scale_dtype="bf16"),
    QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"),
    QuantScheme("q4s", axis=1, store="packed_u32"),
    QuantScheme("q2f", block=(4, 16), store="packed_u32", scale_dtype="bf16"),
    QuantScheme("q8s", store="packed_u32"),
]


def data(shape=(8, 64), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def assert_same_qtensor(a, b):
    assert a.shape == b.shape and a.scheme == b.scheme
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(a.scales.view(np.uint32), b.scales.view(np.uint32))
    np.testing.assert_array_equal(a.dequantize().numpy().view(np.uint32),
                                  b.dequantize().numpy().view(np.uint32))


@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
@pytest.mark.parametrize("transpose", [False, True])
def test_qtensor_round_trip_on_every_backend(tmp_path, scheme, transpose):
    q = qd.quantize(data(), scheme, device="reference")
    q = q.T if transpose else q
    path = tmp_path / "q.safetensors"
    qd.save(path, {"w": q})
    for device in HOST_DEVICES:
        loaded = qd.load(path, device=device)["w"]
        assert loaded.device == device
        assert_same_qtensor(loaded, q)


def test_3d_and_odd_shapes(tmp_path):
    q = qd.quantize(data((3, 5, 17)), QuantScheme("q4s", axis=2, store="packed_u32"), device="reference")
    qd.save(tmp_path / "q.st", {"x": q})
    assert_same_qtensor(qd.load(tmp_path / "q.st", device="reference")["x"], q)


def test_float_tensors_and_arrays(tmp_path):
    x = data((4, 6))
    items = {
        "f32": qd.tensor(x, device="reference"),
        "f16": qd.tensor(x.astype(np.float16), device="reference"),
        "bf16": qd.tensor(x, device="reference", dtype="bfloat16"),
        "i8": qd.tensor(np.arange(-5, 5, dtype=np.int8), device="reference"),
        "array": np.arange(12, dtype=np.int64).reshape(3, 4),
        "mask": np.array([True, False]),
        "scalar": np.float64(2.5),  # a numpy scalar, as a 0-d array
    }
    qd.save(tmp_path / "t.st", items)
    loaded = qd.load(tmp_path / "t.st", device="reference")
    assert set(loaded) == set(items)
    for name in ("f32", "f16", "bf16", "i8"):
        assert isinstance(loaded[name], qd.Tensor)
        assert loaded[name].dtype == items[name].dtype and loaded[name].shape == items[name].shape
        np.testing.assert_array_equal(loaded[name].numpy(), items[name].numpy())
    for name in ("array", "mask", "scalar"):
        assert isinstance(loaded[name], np.ndarray)
        assert loaded[name].dtype == np.asarray(items[name]).dtype and loaded[name].shape == np.shape(items[name])
        np.testing.assert_array_equal(loaded[name], items[name])


def test_file_is_plain_safetensors_with_described_metadata(tmp_path):
    safe_open = pytest.importorskip("safetensors").safe_open
    q = qd.quantize(data(), QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"),
                    device="reference")
    qd.save(tmp_path / "q.st", {"w": q})
    with safe_open(tmp_path / "q.st", framework="numpy") as f:
        meta = f.metadata()
        assert f.get_tensor("w.qvalues").dtype == np.uint32
        assert f.get_tensor("w.qvalues").shape == (8, 8)
        assert f.get_tensor("w.qscales").dtype == np.float16
    assert meta["qdispatch.format_version"] == "1"
    record = json.loads(meta["qdispatch.tensors"])["w"]
    assert record["scheme"] == {"value": "q4f", "block": [32], "axis": None,
                                "store": "packed_u32", "scale_dtype": "f16"}
    assert record["shape"] == [8, 64] and record["transposed"] is False


@pytest.mark.parametrize("device", HOST_DEVICES)
def test_an_object_under_several_names_is_stored_once_and_loads_as_one(tmp_path, device):
    """A tied weight (one QTensor under the embedding's and the output layer's names) is
    written once; the other names are aliases, and load gives one object for them."""
    q = qd.quantize(data((64, 32)), QuantScheme("q4s", block=32, store="packed_u32"), device="reference")
    t, a = qd.tensor(data((3, 4)), device="reference"), np.arange(6)
    path = tmp_path / "tied.st"
    qd.save(path, {"embed.weight": q, "lm_head.weight": q, "t": t, "t_again": t, "a": a, "a_again": a,
                   "other": qd.quantize(data((64, 32)), QuantScheme("q8s"), device="reference")})
    header, meta = read_header(path)
    assert sorted(header) == ["a", "embed.weight.qscales", "embed.weight.qvalues", "other.qscales",
                              "other.qvalues", "t"]
    assert meta["qdispatch.format_version"] == "2"  # readable by every qdispatch that reads aliases
    records = json.loads(meta["qdispatch.tensors"])
    assert records["lm_head.weight"] == {"kind": "alias", "of": "embed.weight"}
    assert records["t_again"] == {"kind": "alias", "of": "t"} and records["a_again"] == {"kind": "alias", "of": "a"}
    loaded = qd.load(path, device=device)
    assert loaded["lm_head.weight"] is loaded["embed.weight"]
    assert loaded["t_again"] is loaded["t"] and loaded["a_again"] is loaded["a"]
    assert loaded["other"] is not loaded["embed.weight"]
    assert_same_qtensor(loaded["embed.weight"], q)
    np.testing.assert_array_equal(loaded["t_again"].numpy(), t.numpy())
    np.testing.assert_array_equal(loaded["a_again"], a)
    assert_same_qtensor(qd.load(path, device=device, names=["lm_head.weight"])["lm_head.weight"], q)


def read_header(path):
    """(entries, metadata) of a safetensors file's header."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return header, header.pop("__metadata__")


@pytest.mark.parametrize("device", HOST_DEVICES)
@pytest.mark.parametrize("first_turned", [False, True], ids=["q-first", "q.T-first"])
def test_a_qtensor_beside_its_transpose_is_stored_once(tmp_path, device, first_turned):
    """q and q.T share one store: saved together, it is written once, under the first
    name; the transpose's name is an alias marked transposed (format version 3, which
    older readers refuse rather than misread), and load gives the first name's
    QTensor and its .T, one store between them."""
    q = qd.quantize(data((64, 32)), QuantScheme("q4s", block=32, store="packed_u32"), device="reference")
    first, turned = (q.T, q) if first_turned else (q, q.T)
    path = tmp_path / "turned.st"
    qd.save(path, {"first": first, "turned": turned, "turned_again": turned.T.T, "first_again": turned.T})
    header, meta = read_header(path)
    assert sorted(header) == ["first.qscales", "first.qvalues"]
    assert meta["qdispatch.format_version"] == "3"
    records = json.loads(meta["qdispatch.tensors"])
    assert records["turned"] == records["turned_again"] == {"kind": "alias", "of": "first", "transposed": True}
    assert records["first_again"] == {"kind": "alias", "of": "first"}
    loaded = qd.load(path, device=device)
    assert loaded["first_again"] is loaded["first"]
    assert loaded["turned"].storage is loaded["first"].storage and loaded["turned"].transposed != first.transposed
    for name, want in (("first", first), ("turned", turned), ("turned_again", turned)):
        assert_same_qtensor(loaded[name], want)
        assert loaded[name].transposed == want.transposed
    assert_same_qtensor(qd.load(path, device=device, names=["turned"])["turned"], turned)


@pytest.mark.parametrize("alias, match", [
    ({"kind": "alias", "of": "nowhere"}, "it is an alias of 'nowhere', which names no tensor stored in the file"),
    ({"kind": "alias", "of": "b"}, "it is an alias of 'b', which names no tensor stored in the file"),  # b: an alias
    ({"kind": "alias", "of": 5}, "its alias target is 5"),
    ({"kind": "alias"}, "its alias target is None"),
    ({"kind": "alias", "of": "a", "transposed": "yes"}, "its transposed flag is 'yes', expected true or false"),
    ({"kind": "alias", "of": "a", "transposed": True}, "it is the transpose of 'a', which is no QTensor"),
], ids=["missing", "alias-of-alias", "not-a-name", "no-target", "bad-flag", "turned-array"])
def test_an_alias_that_names_no_tensor_is_refused(tmp_path, alias, match):
    path = tmp_path / "tied.st"
    w = np.arange(4.0)
    qd.save(path, {"a": w, "b": w, "c": w})
    rewrite_record(path, "c", lambda record: alias)
    with pytest.raises(SerializationError, match=f"Tensor 'c' in .* has a corrupted record: {match}"):
        qd.load(path)


# ---- atomic writes ------------------------------------------------------------

def test_failed_write_leaves_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "w.st"
    old = {"a": np.arange(3, dtype=np.float32)}
    qd.save(path, old)
    before = path.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        qd.save(path, {"a": np.zeros(1000, dtype=np.float32)})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["w.st"]  # no temporary file left behind


def test_save_takes_a_bytes_path_as_open_does(tmp_path):
    """It raised "Can't mix bytes and non-bytes in path components"."""
    path = os.fsencode(tmp_path / "x.st")
    qd.save(path, {"a": np.arange(3)})
    np.testing.assert_array_equal(qd.load(path)["a"], np.arange(3))
    assert os.listdir(tmp_path) == ["x.st"]


def test_a_name_as_long_as_names_get_saves(tmp_path):
    """The temporary file beside it had the destination's name inside its own, so a
    name near the file system's limit failed with "File name too long"."""
    path = tmp_path / ("x" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 3) + ".st")
    qd.save(path, {"a": np.arange(3)})
    np.testing.assert_array_equal(qd.load(path)["a"], np.arange(3))
    assert os.listdir(tmp_path) == [path.name]


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_saving_through_a_symbolic_link_writes_its_target(tmp_path):
    """The link was replaced by a file of its own, its target left as it was."""
    target, link = tmp_path / "real.st", tmp_path / "link.st"
    qd.save(target, {"a": np.zeros(2)})
    link.symlink_to(target.name)
    qd.save(link, {"b": np.ones(2)})
    assert link.is_symlink() and list(qd.load(target)) == ["b"]
    assert sorted(os.listdir(tmp_path)) == ["link.st", "real.st"]


def test_a_number_is_no_path_to_load():
    """open() takes a number for a file descriptor: qd.load(1) read stdout's and closed it."""
    for bad in (1, True, 3.5):
        with pytest.raises(TypeError, match="Expected a file path"):
            qd.load(bad)
    os.fstat(1)  # still open


def test_a_number_or_none_is_no_path_to_save():
    """os.fsdecode's own error ("expected str, bytes or os.PathLike object") named no call."""
    for bad in (None, 3):
        with pytest.raises(TypeError, match=rf"Expected a file path \(str, bytes or os.PathLike\), got "
                                            rf"{type(bad).__name__} {bad!r}"):
            qd.save(bad, {"a": np.zeros(2)})


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_saving_over_what_is_no_regular_file_is_refused(tmp_path):
    """A named pipe was replaced by a regular file (a device node too, as root)."""
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(SerializationError, match=r"pipe is not a regular file .*: save and export replace only files"):
        qd.save(tmp_path / "pipe", {"a": np.zeros(2)})
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode) and os.listdir(tmp_path) == ["pipe"]


def test_saving_to_a_folder_names_the_folder(tmp_path):
    """The error named the hidden temporary file renamed over it."""
    with pytest.raises(IsADirectoryError, match=f"{re.escape(str(tmp_path))} is a folder"):
        qd.save(tmp_path, {"a": np.zeros(2)})
    assert os.listdir(tmp_path) == []


def test_saving_to_no_path_or_under_a_file_says_so(tmp_path):
    """'' was taken as the working folder ("... is a folder"), and a file used as a
    folder was called a folder that does not exist."""
    with pytest.raises(FileNotFoundError, match="give a file's path, not ''"):
        qd.save("", {"a": np.zeros(2)})
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"its folder {re.escape(str(tmp_path / 'file'))} is a file, not a"):
        qd.save(tmp_path / "file" / "x.safetensors", {"a": np.zeros(2)})


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write in any folder")
def test_saving_into_a_read_only_folder_names_the_target(tmp_path):
    """The PermissionError named the hidden temporary file, not what was being saved."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"Can't write {re.escape(str(folder / 'x.st'))}: no permission "
                                                  f"to create files in"):
            qd.save(folder / "x.st", {"a": np.zeros(2)})
    finally:
        folder.chmod(0o755)


def test_saving_into_a_missing_folder_names_it(tmp_path):
    """The error named the temporary file beside the target."""
    target = tmp_path / "nowhere" / "x.safetensors"
    with pytest.raises(FileNotFoundError, match=f"its folder {re.escape(str(tmp_path / 'nowhere'))} does not exist"):
        qd.save(target, {"a": np.zeros(2)})


def test_overwrite_replaces_file(tmp_path):
    path = tmp_path / "w.st"
    qd.save(path, {"a": np.zeros(2, dtype=np.float32)})
    qd.save(path, {"b": np.ones(2, dtype=np.float32)})
    assert list(qd.load(path)) == ["b"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_new_file_gets_the_umasks_permissions_and_a_replaced_one_keeps_its_own(tmp_path):
    """The file is written beside its destination and renamed over it: it must not
    keep a temporary file's owner-only permissions."""
    path = tmp_path / "w.st"
    umask = os.umask(0o027)
    try:
        qd.save(path, {"a": np.zeros(2, dtype=np.float32)})
        assert os.stat(path).st_mode & 0o777 == 0o640
        os.chmod(path, 0o444)  # read-only: renamed over, as the folder allows, and read-only still
        qd.save(path, {"b": np.ones(2, dtype=np.float32)})
        assert os.stat(path).st_mode & 0o777 == 0o444 and list(qd.load(path)) == ["b"]
    finally:
        os.umask(umask)


# ---- bad files ----------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "q.st"
    q = qd.quantize(data(), QuantScheme("q8s", axis=0), device="reference")
    qd.save(path, {"small": np.zeros(2, dtype=np.float32), "weight": q})
    return path


def rewrite_metadata(path, change):
    """Edit the file's JSON header (data offsets are relative, so its length may change)."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + size])
    change(header)
    text = json.dumps(header).encode()
    text = text.ljust(-(-len(text) // 8) * 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size:])


def rewrite_record(path, name, change, crc=True):
    """Replace tensor `name`'s record in the metadata by change(record), and the
    records' CRC-32 with it (as a writer of a bad record would) when `crc`."""
    def edit(h):
        records = json.loads(h["__metadata__"]["qdispatch.tensors"])
        records[name] = change(records[name])
        h["__metadata__"]["qdispatch.tensors"] = json.dumps(records)
        if crc:
            h["__metadata__"]["qdispatch.tensors_crc32"] = f"{zlib.crc32(json.dumps(records).encode()):08x}"
    rewrite_metadata(path, edit)


def test_a_record_changed_behind_its_crc_is_refused(saved):
    """The entries' CRCs cover their bytes only: a flipped scheme (q8s read as q8f), an
    alias retargeted or a transposed flag flipped loaded as other values."""
    rewrite_scheme_without_crc = lambda record: {**record, "scheme": {**record["scheme"], "value": "q8f"}}
    rewrite_record(saved, "weight", rewrite_scheme_without_crc, crc=False)
    with pytest.raises(SerializationError, match="tensor records do not match their CRC-32"):
        qd.load(saved)
    rewrite_metadata(saved, lambda h: h["__metadata__"].pop("qdispatch.tensors_crc32"))  # a file of an older writer
    assert qd.load(saved)["weight"].scheme == QuantScheme("q8f", axis=0)


def test_a_record_with_crcs_for_other_entries_than_its_own_is_refused(tmp_path):
    path = tmp_path / "c.st"
    qd.save(path, {"x": np.arange(3, dtype=np.float32)})
    rewrite_record(path, "x", lambda record: {**record, "crc32": record["crc32"] + [0]})
    with pytest.raises(SerializationError, match=r"Tensor 'x' in .*c\.st has a corrupted record: its crc32 is "
                                                 r"\[\d+, 0\], expected a list of 1 CRC-32 values"):
        qd.load(path)


def test_a_quantized_part_whose_header_shape_was_edited_is_refused(tmp_path):
    """The same bytes under another shape: other safetensors readers see that shape."""
    path = tmp_path / "s.st"
    qd.save(path, {"q": qd.quantize(np.arange(8, dtype=np.float32).reshape(2, 4), "q8s", device="reference")})
    rewrite_metadata(path, lambda h: h["q.qvalues"].update({"shape": [4, 2]}))
    with pytest.raises(SerializationError, match=r"'q': entry 'q.qvalues' holds I8\[4, 2\] but its record says "
                                                 r"I8\[2, 4\]; the file does not match its metadata"):
        qd.load(path)


def rewrite_scheme(path, name, field, value):
    """Set one field of tensor `name`'s recorded scheme."""
    rewrite_record(path, name, lambda record: {**record, "scheme": {**record["scheme"], field: value}})


def test_truncated_file_names_the_tensor(saved):
    raw = saved.read_bytes()
    saved.write_bytes(raw[:-10])
    with pytest.raises(SerializationError, match="'weight'.*truncated"):
        qd.load(saved)


@pytest.mark.parametrize("short", [None, 1, 8], ids=["40 bytes", "1 byte short", "8 bytes short"])
def test_truncated_header(saved, short):
    raw = saved.read_bytes()
    end = 40 if short is None else 8 + int.from_bytes(raw[:8], "little") - short  # the header's end, less `short`
    saved.write_bytes(raw[:end])
    with pytest.raises(SerializationError, match=r"truncated or not a safetensors file: its header claims \d+ bytes"):
        qd.load(saved)


def test_a_header_whose_json_outgrows_memory_is_a_serialization_error(saved, monkeypatch):
    """A 99 MB header of nested empty lists takes 3.4 GB as Python objects: where that
    much was not free the load raised a bare MemoryError."""
    def out_of_memory(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(qio.json, "loads", out_of_memory)
    with pytest.raises(SerializationError, match=r"has a safetensors header of \d+ bytes whose JSON takes more "
                                                 r"memory than is free"):
        qd.load(saved)


def test_a_header_larger_than_safetensors_reads_is_refused_unread(tmp_path):
    """A sparse file claiming a 1.5 GB header had all of it read before it failed."""
    path = tmp_path / "big.st"
    with open(path, "wb") as f:
        f.write((1_500_000_000).to_bytes(8, "little"))
        f.truncate(8 + 1_500_000_000 + 8)
    with pytest.raises(SerializationError, match="header claims 1500000000 bytes, where safetensors "
                                                 "headers hold at most 100000000"):
        qd.load(path)


def test_corrupted_bytes_name_the_tensor(saved):
    raw = bytearray(saved.read_bytes())
    raw[-3] ^= 0x40  # a bit flip inside the last entry's data
    saved.write_bytes(bytes(raw))
    with pytest.raises(SerializationError, match="'weight'.*corrupted"):
        qd.load(saved)


def test_unknown_version(saved):
    from qdispatch.io import FORMAT_VERSION
    for newer in (FORMAT_VERSION + 1, 9):  # the next version too, not only one far past it
        rewrite_metadata(saved, lambda h: h["__metadata__"].update({"qdispatch.format_version": str(newer)}))
        with pytest.raises(SerializationError, match=f"version '{newer}'.*upgrade qdispatch"):
            qd.load(saved)
    rewrite_metadata(saved, lambda h: h["__metadata__"].update({"qdispatch.format_version": "<"}))
    with pytest.raises(SerializationError, match="version '<'.*: the file is corrupted"):  # no upgrade reads it
        qd.load(saved)


def _plain_file(path, entry, data):
    header = json.dumps({"x": entry}).encode()
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)


def test_a_plain_entry_of_other_bytes_than_its_shape_or_offsets_no_numbers_is_refused(tmp_path):
    """Without their checks F32[2] over 12 bytes would load (the safetensors library
    refuses it), and so would an offset of false."""
    path = tmp_path / "o.st"
    _plain_file(path, {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}, bytes(12))
    with pytest.raises(SerializationError, match=r"entry 'x' spans bytes 0 to 12 of the data section, but F32\[2\] "
                                                 r"takes 8; the file does not match its header"):
        qd.load(path)
    _plain_file(path, {"dtype": "F32", "shape": [2], "data_offsets": [False, 8]}, bytes(8))
    with pytest.raises(SerializationError, match=r"data_offsets \[False, 8\], expected \[begin, end\] byte offsets"):
        qd.load(path)


def test_saved_headers_keep_safetensors_8_byte_alignment(tmp_path):
    """The data section starts 8-byte aligned, as safetensors' writer leaves it."""
    for objects in ({"x": np.arange(3, dtype=np.float32)}, {"w": qd.quantize(np.ones((2, 4), np.float32), "q8s")},
                    {"name_of_odd_length": np.zeros(1, np.int8)}):
        qd.save(tmp_path / "h.st", objects)
        assert int.from_bytes((tmp_path / "h.st").read_bytes()[:8], "little") % 8 == 0


def test_a_file_of_another_writer_loads_as_its_header_says(tmp_path):
    """A safetensors file without qdispatch's metadata (torch's or numpy's writer made
    it): Tensors where the dtype is one, numpy arrays otherwise."""
    x, ids = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.int64)
    qd.save(tmp_path / "plain.st", {"x": x, "ids": ids, "h": qd.tensor(np.ones(1, np.float32), dtype="bfloat16")})
    rewrite_metadata(tmp_path / "plain.st", lambda h: h.pop("__metadata__"))
    loaded = qd.load(tmp_path / "plain.st", device="reference")
    assert isinstance(loaded["x"], qd.Tensor) and loaded["x"].dtype == "float32"
    np.testing.assert_array_equal(loaded["x"].numpy(), x)
    assert isinstance(loaded["ids"], np.ndarray) and loaded["ids"].dtype == np.int64
    np.testing.assert_array_equal(loaded["ids"], ids)
    assert loaded["h"].dtype == "bfloat16" and loaded["h"].numpy().tolist() == [1.0]
    assert list(qd.load(tmp_path / "plain.st", names=["ids"])) == ["ids"]
    rewrite_metadata(tmp_path / "plain.st", lambda h: h["x"].update({"dtype": "F8_E4M3"}))
    with pytest.raises(SerializationError, match=r"plain\.st: Tensor 'x' has dtype 'F8_E4M3', which qdispatch does "
                                                 r"not read .*: load the others with names=\[\.\.\.\]"):
        qd.load(tmp_path / "plain.st")
    # an entry numpy can't hold (FP8 in many checkpoints) kept the others from loading at all
    assert sorted(qd.load(tmp_path / "plain.st", names=["ids", "h"])) == ["h", "ids"]
    for code in (["F32"], {"F": 32}):  # JSON that names no dtype: once a bare TypeError (unhashable)
        rewrite_metadata(tmp_path / "plain.st", lambda h: h["x"].update({"dtype": code}))
        with pytest.raises(SerializationError, match=r"Tensor 'x' has dtype .*, which qdispatch does not read"):
            qd.load(tmp_path / "plain.st")


@pytest.mark.parametrize("metadata", [None, 0, "", False])
def test_a_metadata_that_is_no_json_object_is_refused(tmp_path, metadata):
    """A damaged __metadata__ (null, 0, "") read as none: qdispatch's own file then
    loaded its QTensors' parts as plain entries, with no error."""
    qd.save(tmp_path / "w.st", {"w": qd.quantize(np.ones((4, 32), np.float32), "q8s")})
    rewrite_metadata(tmp_path / "w.st", lambda h: h.update({"__metadata__": metadata}))
    says = ("has entries named as a QTensor's parts \\('w.qscales', 'w.qvalues'\\) but no __metadata__ "
            "\\(absent or null\\).*safetensors.numpy.load_file" if metadata is None
            else "its __metadata__ is .*, not a JSON object")
    with pytest.raises(SerializationError, match=says):
        qd.load(tmp_path / "w.st")
    if metadata is None:  # no __metadata__ at all: the same
        rewrite_metadata(tmp_path / "w.st", lambda h: h.pop("__metadata__"))
        with pytest.raises(SerializationError, match=says):
            qd.load(tmp_path / "w.st")


def test_a_null_metadata_of_a_plain_file_is_none(tmp_path):
    """safetensors reads "__metadata__": null as no metadata; where no QTensor's
    parts lost their records by it, so does load (it refused the file)."""
    qd.save(tmp_path / "x.st", {"x": np.arange(6, dtype=np.float32).reshape(2, 3)})
    rewrite_metadata(tmp_path / "x.st", lambda h: h.update({"__metadata__": None}))
    np.testing.assert_array_equal(qd.load(tmp_path / "x.st", device="reference")["x"].numpy(),
                                  np.arange(6, dtype=np.float32).reshape(2, 3))


def test_complex64_entries_load_as_numpy_arrays(tmp_path):
    """safetensors' C64, as torch writes complex64: refused, where the README says
    entries of other dtypes load as numpy arrays."""
    z = (np.arange(4) + 1j * np.arange(4)[::-1]).astype(np.complex64)
    qd.save(tmp_path / "z.st", {"z": z})
    loaded = qd.load(tmp_path / "z.st")["z"]
    assert loaded.dtype == np.complex64
    np.testing.assert_array_equal(loaded, z)


def test_a_header_in_another_encoding_than_utf8_is_refused(tmp_path):
    """json guessed the encoding: a UTF-16 header, or one after a byte-order mark,
    loaded, where safetensors readers refuse it."""
    qd.save(tmp_path / "x.st", {"x": np.ones(3, np.float32)})
    raw = (tmp_path / "x.st").read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + size].decode("utf-8")
    for encoded in (header.encode("utf-16-le"), b"\xef\xbb\xbf" + header.encode("utf-8")):
        (tmp_path / "y.st").write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + size:])
        with pytest.raises(SerializationError, match="corrupted safetensors header"):
            qd.load(tmp_path / "y.st")


def test_a_file_of_the_safetensors_library_loads(tmp_path):
    save_file = pytest.importorskip("safetensors.numpy").save_file
    save_file({"x": np.arange(3, dtype=np.float16)}, str(tmp_path / "plain.st"))
    np.testing.assert_array_equal(qd.load(tmp_path / "plain.st")["x"].numpy(), np.arange(3, dtype=np.float16))


def test_half_of_qdispatchs_metadata_is_corrupted(saved):
    rewrite_metadata(saved, lambda h: h["__metadata__"].pop("qdispatch.tensors"))
    with pytest.raises(SerializationError, match="without the other"):
        qd.load(saved)


def test_scheme_that_does_not_match_the_bytes(saved):
    rewrite_scheme(saved, "weight", "store", "packed_u32")
    with pytest.raises(SerializationError, match="'weight'.*I8.*U32"):
        qd.load(saved)


def test_values_outside_the_scheme_range(tmp_path):
    q = qd.qtensor_from_parts(np.full((2, 4), -128, np.int8), np.ones(1), QuantScheme("q8f"),
                              device="reference")
    path = tmp_path / "q.st"
    qd.save(path, {"w": q})
    rewrite_scheme(path, "w", "value", "q8s")
    with pytest.raises(SerializationError, match="'w'.*range"):
        qd.load(path)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="dict"):
        qd.save(tmp_path / "x.st", [np.zeros(1)])
    with pytest.raises(TypeError, match="'x'.*list"):
        qd.save(tmp_path / "x.st", {"x": [1, 2]})
    q = qd.quantize(data(), "q8s", device="reference")
    with pytest.raises(SerializationError, match="collides"):
        qd.save(tmp_path / "x.st", {"w": q, "w.qvalues": np.zeros(1)})
    a = np.zeros(1)  # an alias of "a" has no entry of its own, yet its name is still taken
    with pytest.raises(SerializationError, match="its entry 'w.qvalues' collides with another name; rename one"):
        qd.save(tmp_path / "x.st", {"a": a, "w": q, "w.qvalues": a})
    assert not os.listdir(tmp_path)


def test_save_refuses_a_name_that_is_no_utf8(tmp_path):
    """A lone surrogate went into the header as a JSON escape that safetensors'
    own reader refuses ("unexpected end of hex escape")."""
    with pytest.raises(SerializationError, match=r"save tensor 'w\\udcff': its name is no UTF-8 text.*rename it"):
        qd.save(tmp_path / "x.st", {"ok": np.zeros(2), b"w\xff".decode("utf-8", "surrogateescape"): np.zeros(2)})
    assert not os.listdir(tmp_path)


def test_save_refuses_the_name_of_the_headers_metadata(tmp_path):
    """safetensors keeps its metadata under "__metadata__": an entry of that name
    was written over by it, and the file could not be loaded."""
    for obj in (np.zeros(3), qd.tensor(data((2, 3)), device="reference")):
        with pytest.raises(SerializationError, match="'__metadata__'.*reserves.*rename it"):
            qd.save(tmp_path / "x.st", {"w": qd.quantize(data(), "q8s", device="reference"), "__metadata__": obj})
    assert not os.listdir(tmp_path)
    q = qd.quantize(data(), "q8s", device="reference")  # its entries are __metadata__.qvalues and .qscales
    qd.save(tmp_path / "x.st", {"__metadata__": q})
    assert_same_qtensor(qd.load(tmp_path / "x.st", device="reference")["__metadata__"], q)


def test_numpy_string_names_are_plain_names(tmp_path):
    """Names read out of a numpy array (np.str_) save, load and show as plain str."""
    names = np.array(["w", "b"])
    qd.save(tmp_path / "x.st", {names[0]: qd.quantize(data(), "q8s", device="reference"), names[1]: np.zeros(3)})
    got = qd.load(tmp_path / "x.st", device="reference", names=[names[1]])
    assert [type(name) for name in got] == [str]
    with pytest.raises(KeyError, match=r"named 'v'; it holds 'w', 'b'"):
        qd.load(tmp_path / "x.st", names=[np.str_("v")])
    with pytest.raises(TypeError, match=r"Can't save array 'x' of dtype object"):
        qd.save(tmp_path / "y.st", {np.str_("x"): np.zeros(2, dtype=object)})


def test_an_array_of_a_dtype_safetensors_lacks_names_those_it_has(tmp_path):
    # complex64 saved while complex128 was refused as "not a numeric dtype"
    qd.save(tmp_path / "c64.st", {"c": np.array([1 + 2j], np.complex64)})
    np.testing.assert_array_equal(qd.load(tmp_path / "c64.st")["c"], np.array([1 + 2j], np.complex64))
    for dtype in (np.complex128, np.float128 if hasattr(np, "float128") else np.clongdouble):
        with pytest.raises(qd.ArgumentTypeError, match=rf"dtype {np.dtype(dtype)}: a safetensors file holds "
                                                       r"bool, complex64, float16, .*uint8 .*convert it"):
            qd.save(tmp_path / "x.st", {"c": np.zeros(2, dtype)})
    assert not (tmp_path / "x.st").exists()


@pytest.mark.parametrize("entry", [{"shape": [10**12]}, {"shape": [-2]}, {"shape": "2"},
                                   {"data_offsets": ["0", 8]}, {"data_offsets": [8, 0]}, {"data_offsets": [0]}],
                         ids=["huge shape", "negative shape", "shape not a list", "offset not a number",
                              "offsets reversed", "one offset"])
def test_entry_that_lies_about_its_bytes(saved, entry):
    """An entry whose shape or offsets don't describe its bytes: a clear error that
    names the tensor, raised before anything of the claimed size is allocated."""
    rewrite_metadata(saved, lambda h: h["small"].update(entry))
    with pytest.raises(SerializationError, match="'small'"):
        qd.load(saved)


def test_load_holds_no_second_copy_of_the_file(tmp_path):
    """Entries are read from the file into their own arrays, one at a time: the
    memory load allocates stays near what it returns (reading the whole file and
    then splitting it took twice the file's size)."""
    import tracemalloc
    weights = {"w8": qd.quantize(data((512, 1024)), QuantScheme("q8s", axis=0), device="reference"),
               "w4": qd.quantize(data((512, 1024)), QuantScheme("q4f", block=32, store="packed_u32"),
                                 device="reference")}
    path = tmp_path / "big.st"
    qd.save(path, {**weights, **{f"a{i}": data((256, 256), seed=i) for i in range(4)}})
    tracemalloc.start()
    try:
        loaded = qd.load(path, device="reference")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.6 * os.path.getsize(path)
    for name, q in weights.items():
        assert_same_qtensor(loaded[name], q)


def test_load_only_the_named_tensors(tmp_path, monkeypatch):
    items = {f"w{i}": qd.quantize(data(seed=i), QuantScheme("q8s", axis=0), device="reference") for i in range(10)}
    qd.save(tmp_path / "m.st", {**items, "step": np.array([7])})
    read = []
    decode = qio.StoredFile.decode
    monkeypatch.setattr(qio.StoredFile, "decode", lambda self, name, dev: read.append(name) or decode(self, name, dev))
    got = qd.load(tmp_path / "m.st", device="reference", names=["w3", "step"])
    assert list(got) == ["w3", "step"] and read == ["w3", "step"]  # nothing else is read
    assert_same_qtensor(got["w3"], items["w3"])
    np.testing.assert_array_equal(got["step"], [7])
    with pytest.raises(KeyError, match=r"no tensor named 'w10'; it holds 'w0', .*\(11 in all\)"):
        qd.load(tmp_path / "m.st", names=["w10"])
    with pytest.raises(TypeError, match=r"names=\['w3'\]"):
        qd.load(tmp_path / "m.st", names="w3")


def test_load_takes_names_from_any_iterable(tmp_path):
    qd.save(tmp_path / "m.st", {"w": np.ones(3, np.float32), "v": np.zeros(2, np.float32)})
    got = qd.load(tmp_path / "m.st", device="reference", names=(name for name in ["w"]))
    assert list(got) == ["w"]  # a generator was spent checking the names, and nothing came back
    np.testing.assert_array_equal(got["w"], np.ones(3, np.float32))


@pytest.mark.parametrize("names", [5, [["w"]], ["w", 1]])
def test_load_says_what_names_takes(tmp_path, names):
    """A name that is no str was "unhashable type: 'list'", a number "'int' object is not iterable"."""
    qd.save(tmp_path / "m.st", {"w": np.ones(3, np.float32)})
    with pytest.raises(TypeError, match=r"load's names= takes a list of tensor names \(str\), got "):
        qd.load(tmp_path / "m.st", names=names)


def test_save_and_load_need_no_package_beyond_numpy(saved, monkeypatch):
    want = qd.load(saved, device="reference")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    got = qd.load(saved, device="reference")
    assert_same_qtensor(got["weight"], want["weight"])
    qd.save(saved, got)
    assert_same_qtensor(qd.load(saved, device="reference")["weight"], want["weight"])


def test_every_entry_reads_back_through_safetensors(tmp_path):
    """qdispatch writes the format itself: safetensors' own reader opens every kind
    of entry (sub-byte words, 16-bit scales, a transposed view, bools, empty and 0-d arrays) with
    the bytes qdispatch reads."""
    safe_open = pytest.importorskip("safetensors").safe_open
    items = {"w4": qd.quantize(data((16, 64)), QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"),
                               device="reference"),
             "w8t": qd.quantize(data((32, 8)), QuantScheme("q8s", axis=0), device="reference").T,
             "bf16": qd.tensor(data((3, 5)), device="reference", dtype="bfloat16"),
             "f16": qd.tensor(data((4,)), device="reference", dtype="float16"),
             "i32": qd.tensor(np.arange(6, dtype=np.int32).reshape(2, 3), device="reference"),
             "mask": np.array([True, False, True]), "f64": np.linspace(0, 1, 7), "empty": np.zeros((0, 3), np.int16),
             "scalar": np.array(2.5, np.float32)}
    path = tmp_path / "all.st"
    qd.save(path, items)
    loaded = qd.load(path, device="reference")
    with safe_open(path, framework="numpy") as f:
        header_keys = set(f.keys())
        for name, obj in items.items():
            if isinstance(obj, qd.QTensor):
                assert_same_qtensor(loaded[name], obj)
                stored = qio._plan(name, obj)[2]()  # the arrays save wrote
                for suffix, want in zip((".qvalues", ".qscales"), stored):
                    assert f.get_tensor(name + suffix).tobytes() == want.tobytes()
            elif name == "bf16":  # numpy has no bfloat16 to read it into (safe_open checked its entry)
                continue
            else:
                raw = obj if isinstance(obj, np.ndarray) else loaded[name].numpy()
                got = f.get_tensor(name)
                assert got.shape == raw.shape and got.dtype == raw.dtype and got.tobytes() == raw.tobytes()
    assert header_keys == {"w4.qvalues", "w4.qscales", "w8t.qvalues", "w8t.qscales", "bf16", "f16", "i32", "mask",
                           "f64", "empty", "scalar"}


def test_save_holds_one_tensor_at_a_time(tmp_path):
    """save fetches and writes each tensor in turn: saving many costs the host no
    more than saving one (before, every tensor's stored bytes were gathered first)."""
    scheme = QuantScheme("q4f", block=32, store="packed_u32")
    weights = {f"w{i}": qd.quantize(data((256, 1024), seed=i), scheme, device="reference") for i in range(24)}

    def transient(items):
        return transient_bytes(lambda: qd.save(tmp_path / "w.st", items))

    one_weight = 256 * 1024 // 2  # its packed words
    assert transient(weights) < transient({"w0": weights["w0"]}) + 2 * one_weight


def test_invalid_scheme_record(saved):
    rewrite_scheme(saved, "weight", "value", "q9z")
    with pytest.raises(SerializationError, match="'weight'.*q9z"):
        qd.load(saved)


def without(field):
    return lambda record: {k: v for k, v in record.items() if k != field}


def test_scheme_record_without_its_value(saved):
    """Not read as the default q8s: a q4s weight would come back as q8s values."""
    rewrite_record(saved, "weight", lambda r: {**r, "scheme": without("value")(r["scheme"])})
    with pytest.raises(SerializationError, match="'weight'.*lacks value"):
        qd.load(saved)


@pytest.mark.parametrize("name,change,message", [
    ("weight", lambda r: "qtensor", "expected a JSON object, got 'qtensor'"),
    ("weight", lambda r: [r], "expected a JSON object, got \\[{"),
    ("weight", lambda r: {**r, "kind": "qtensr"}, "unknown kind 'qtensr' \\(expected one of 'qtensor'"),
    ("weight", without("kind"), "unknown kind None"),
    ("weight", without("crc32"), "its crc32 is None, expected a list of 2 CRC-32 values"),
    ("small", lambda r: {**r, "crc32": "123"}, "its crc32 is '123', expected a list of 1 CRC-32 values"),
    ("small", lambda r: {**r, "crc32": [-1]}, "its crc32 is \\[-1\\]"),
    ("weight", lambda r: {**r, "scheme": ["q8s"]}, "its scheme is \\['q8s'\\], expected a JSON object"),
    ("weight", without("shape"), "its shape is None, expected a list of sizes"),
    ("weight", lambda r: {**r, "shape": "864"}, "its shape is '864', expected a list of sizes"),
    ("weight", lambda r: {**r, "shape": [8, 64.5]}, "its shape is \\[8, 64.5\\]"),
    ("weight", lambda r: {**r, "transposed": "false"}, "its transposed flag is 'false', expected true or false"),
    ("small", lambda r: {**r, "kind": "tensor", "dtype": ["float32"]},
     "its dtype is \\['float32'\\], expected one of float32"),
    ("small", lambda r: {**r, "kind": "array", "dtype": ["F32"]}, "its dtype is \\['F32'\\], expected one of F64"),
], ids=["string", "list", "unknown kind", "no kind", "no crc32", "crc32 a string", "negative crc32",
        "scheme a list", "no shape", "shape a string", "shape of floats", "transposed a string", "dtype a list",
        "array dtype a list"])
def test_malformed_record_names_the_tensor_and_the_field(saved, name, change, message):
    """Every record is checked when the file is opened: a damaged one is a
    SerializationError that says which tensor and what is wrong with it."""
    rewrite_record(saved, name, change)
    with pytest.raises(SerializationError, match=f"Tensor '{name}' in .* has a corrupted record: {message}"):
        qd.load(saved)


@pytest.mark.parametrize("change,message", [
    (lambda h: h.update({"__metadata__": ["qdispatch"]}), "its __metadata__ is \\['qdispatch'\\], not a JSON object"),
    (lambda h: h["__metadata__"].update({"qdispatch.tensors": {"small": {}}}), "corrupted qdispatch metadata"),
    (lambda h: h["small"].update({"data_offsets": 8}), "'small'.*has data_offsets 8, expected \\[begin, end\\]"),
    (lambda h: h["small"].update({"dtype": "F8_E4M3"}), "'small'.*has dtype 'F8_E4M3', expected one of F64"),
    (lambda h: h["small"].update({"shape": 2}), "'small'.*has no valid shape \\(2\\)"),
], ids=["metadata a list", "records not a string", "offsets a number", "unknown dtype", "shape a number"])
def test_malformed_header_is_a_serialization_error(saved, change, message):
    rewrite_metadata(saved, change)
    with pytest.raises(SerializationError, match=message):
        qd.load(saved)


def test_entries_must_tile_the_data_section(tmp_path):
    """Entries that overlap (a tiny file naming its bytes many times would load as a
    large one), leave a hole, or that no record names are refused when the file opens."""
    path = tmp_path / "a.st"
    qd.save(path, {f"a{i}": np.full(1024, i, np.uint8) for i in range(3)})

    def all_at_start(h):
        for key in ("a1", "a2"):
            h[key]["data_offsets"] = [0, 1024]
        meta = json.loads(h["__metadata__"]["qdispatch.tensors"])
        for key in ("a1", "a2"):  # their CRCs made right: only the overlap is wrong
            meta[key]["crc32"] = meta["a0"]["crc32"]
        h["__metadata__"]["qdispatch.tensors"] = json.dumps(meta)
        h["__metadata__"]["qdispatch.tensors_crc32"] = f"{zlib.crc32(json.dumps(meta).encode()):08x}"
    for change, message in (
            (all_at_start, r"entry 'a1' begins at byte 0 of the data section, but the entry before it, 'a0', ends "
                           r"at byte 1024: they overlap\. A file whose entries"),
            (lambda h: h["a0"].update({"data_offsets": [0, 1000], "shape": [1000]}),
             r"entry 'a1' begins at byte 1024 .*the entry before it, 'a0', ends at byte 1000: bytes 1000 to 1024 "
             r"belong to no entry\. .*without overlap or holes"),
            (lambda h: h.update({"stray": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}),
             r"the entry 'stray', which no tensor record names")):
        broken = tmp_path / "broken.st"
        broken.write_bytes(path.read_bytes())
        rewrite_metadata(broken, change)
        with pytest.raises(SerializationError, match=message):
            qd.load(broken)
    broken.write_bytes(path.read_bytes() + b"\0" * 8)  # bytes past the last entry
    with pytest.raises(SerializationError, match="entries cover 3072 bytes of a data section of 3080"):
        qd.load(broken)


def test_a_header_or_record_edit_that_would_change_what_loads_is_refused(tmp_path):
    """The CRCs cover the data, not the header: a record holds every field a load
    reads (a tensor's shape, an array's dtype too), refuses fields it does not know
    and names given twice, so a damaged header can't change what loads."""
    path = tmp_path / "s.st"
    q = qd.quantize(data(), QuantScheme("q8s", block=(1, 32)), device="reference")
    qd.save(path, {"t": qd.tensor(np.arange(15, dtype=np.float32).reshape(3, 5)), "a": np.arange(4),
                   "w": q, "wT": q.T})
    raw = path.read_bytes()
    for old, new, message in (
            (b'"shape":[3,5]', b'"shape":[5,3]', r"'t': its entry holds F32\[5, 3\] but its record says F32\[3, 5\]"),
            (b'"dtype":"I64"', b'"dtype":"F64"', r"'a': its entry holds F64\[4\] but its record says I64\[4\]"),
            (b'transposed\\": true', b'uransposed\\": true', r"'wT' .*has the field 'uransposed', which an? alias"),
            (b'\\"t\\":', b'\\"a\\":', r"the key '\"?a\"?' appears twice")):
        assert raw.count(old) == 1, old
        broken = tmp_path / "broken.st"
        broken.write_bytes(raw.replace(old, new))
        in_records = b'\\"' in old  # an escaped quote: inside the records' JSON text
        with pytest.raises(SerializationError, match="tensor records do not match their CRC-32" if in_records
                           else message):
            qd.load(broken)
        if in_records:  # checked field by field too, as in a file without the CRC (an older writer's)
            rewrite_metadata(broken, lambda h: h["__metadata__"].pop("qdispatch.tensors_crc32"))
            with pytest.raises(SerializationError, match=message):
                qd.load(broken)


def test_files_whose_records_lack_the_later_fields_still_load(tmp_path):
    """Files of earlier releases: tensor and array records without shape or dtype."""
    path = tmp_path / "old.st"
    qd.save(path, {"t": qd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), "a": np.arange(4)})
    for name in ("t", "a"):
        rewrite_record(path, name, lambda r: {k: v for k, v in r.items() if k not in ("shape", "dtype")}
                       | ({"dtype": r["dtype"]} if r["kind"] == "tensor" else {}))
    back = qd.load(path)
    np.testing.assert_array_equal(back["t"].numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(back["a"], np.arange(4))


def test_damaged_dim_fails_at_once(tmp_path):
    """A dim of 2**31 - 1 that a block of 32 does not divide: an error naming the
    tensor straight away (its hint for a block that divides never walks the whole dim)."""
    path = tmp_path / "q.st"
    qd.save(path, {"w": qd.quantize(data((4, 64)), QuantScheme("q8s", block=32), device="reference")})
    rewrite_record(path, "w", lambda r: {**r, "shape": [4, 2**31 - 1]})
    with pytest.raises(SerializationError, match=r"'w'.*block size 32 does not divide dim 1 of size 2147483647"):
        qd.load(path)


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">u2", ">f2", "<i8"])
def test_big_endian_arrays_are_stored_little_endian(tmp_path, dtype):
    """The file's byte order is little-endian whatever the array's: the same values
    come back (in the host's order), and the bytes are what any safetensors reader expects."""
    a = np.arange(6).reshape(2, 3).astype(dtype)
    path = tmp_path / "a.st"
    qd.save(path, {"a": a})
    loaded = qd.load(path)["a"]
    assert loaded.dtype == a.dtype.newbyteorder("=") and loaded.dtype.isnative
    np.testing.assert_array_equal(loaded, a)
    assert path.read_bytes().endswith(a.astype(a.dtype.newbyteorder("<")).tobytes())


def test_a_stored_qtensor_that_would_dequantize_past_float32s_range_is_refused():
    """quantize and qtensor_from_parts refuse such a QTensor, but a file or a pickle
    may hold one (from a writer that allowed it, or damaged): reading it names the
    tensor and the block."""
    scheme = QuantScheme("q8f", axis=0)
    values, scales = np.array([[1, 2], [-128, 3]], np.int8), np.array([[1.0], [2.7e36]], np.float32)
    with pytest.raises(SerializationError, match=r"^Tensor 'w': Block \(1, 0\) dequantizes past float32's range: a "
                                                 r"value of magnitude 128 .*; quantize its float weights again"):
        qio.decode_qtensor("w", values, scales, scheme, QLayout.for_shape(scheme, (2, 2)))
    with pytest.raises(SerializationError, match=r"^Tensor 'a pickled QTensor': Block \(1, 0\)"):
        qio.qtensor_unpickled(values, scales, (2, 2), scheme, False, "cpu")
    scales[1] = 2.6e36  # 128 x 2.6e36 = 3.33e38: finite
    assert np.isfinite(qio.qtensor_unpickled(values, scales, (2, 2), scheme, False, "cpu").dequantize().numpy()).all()
