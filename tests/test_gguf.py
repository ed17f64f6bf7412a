"""qdispatch.gguf: files built with the gguf package's writer load without
changing a value, and QTensors whose scheme fits export back."""
import argparse
import contextlib
import os
import struct
import threading

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import qdispatch as qd  # noqa: E402
from qdispatch import QuantScheme, SerializationError  # noqa: E402
from qdispatch import gguf as qgguf  # noqa: E402
from helpers import transient_bytes  # noqa: E402

T = gguf.GGMLQuantizationType
DEVICES = ["reference"] + (["cpu"] if "cpu" in qd.available_backends() else [])
SHAPES = [(64,), (4, 64), (2, 3, 96)]


def write_gguf(path, arrays):
    """arrays: {name: (raw data as gguf.quants.quantize returns it, ggml type)}."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in arrays.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_file(path, kinds, shape, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    write_gguf(path, {kind.name: (gguf.quants.quantize(x, kind), kind) for kind in kinds})
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}


def as_float32(t):
    return t.dequantize().numpy() if isinstance(t, qd.QTensor) else t.numpy().astype(np.float32)


def assert_bits_equal(a, b):
    np.testing.assert_array_equal(np.asarray(a, np.float32).view(np.uint32),
                                  np.asarray(b, np.float32).view(np.uint32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_load_matches_gguf_dequantize_bit_for_bit(tmp_path, device, shape):
    expected = quantized_file(tmp_path / "m.gguf", [T.Q8_0, T.Q4_0, T.F16, T.F32, T.BF16], shape)
    loaded = qgguf.load(tmp_path / "m.gguf", device=device)
    assert set(loaded) == set(expected)
    for name, t in loaded.items():
        assert t.shape == shape and t.device == device
        assert_bits_equal(as_float32(t), expected[name].reshape(shape))
    assert loaded["Q8_0"].scheme == qgguf.Q8_0_SCHEME
    assert loaded["Q4_0"].scheme == qgguf.Q4_0_SCHEME
    assert (loaded["F16"].dtype, loaded["F32"].dtype, loaded["BF16"].dtype) == ("float16", "float32", "bfloat16")


def test_q4_0_keeps_ggml_signed_scales(tmp_path):
    quantized_file(tmp_path / "m.gguf", [T.Q4_0], (8, 64))
    q = qgguf.load(tmp_path / "m.gguf", device="reference")["Q4_0"]
    assert (q.scales < 0).any() and (q.scales > 0).any()
    assert q.values.min() == -8  # the largest-magnitude element of every block


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_with_loaded_weights_is_matmul_with_gguf_values(tmp_path, device):
    expected = quantized_file(tmp_path / "m.gguf", [T.Q8_0, T.Q4_0], (64, 32))
    loaded = qgguf.load(tmp_path / "m.gguf", device=device)
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    for name, w in loaded.items():
        y = qd.q_matmul(x, w).numpy()
        np.testing.assert_allclose(y, x @ expected[name], rtol=1e-4, atol=1e-4)


def hand_block(scale, first_bytes):
    return np.concatenate([np.float16(scale).reshape(1).view(np.uint8), first_bytes]).reshape(1, -1)


def test_q4_0_nibble_order_and_offset(tmp_path):
    # byte j = (15 - j) << 4 | j: value j is j - 8, value j + 16 is 7 - j
    j = np.arange(16, dtype=np.uint8)
    write_gguf(tmp_path / "m.gguf", {"w": (hand_block(0.5, ((15 - j) << 4) | j), T.Q4_0)})
    q = qgguf.load(tmp_path / "m.gguf", device="reference")["w"]
    np.testing.assert_array_equal(q.values[0], np.concatenate([j - 8.0, 7.0 - j]).astype(np.int8))
    np.testing.assert_array_equal(q.scales, [[0.5]])


def test_q8_0_full_int8_range(tmp_path):
    values = np.array([-128, 127, -127, 0] * 8, dtype=np.int8)
    write_gguf(tmp_path / "m.gguf", {"w": (hand_block(-0.25, values.view(np.uint8)), T.Q8_0)})
    q = qgguf.load(tmp_path / "m.gguf", device="reference")["w"]
    np.testing.assert_array_equal(q.values[0], values)
    assert_bits_equal(q.dequantize().numpy()[0], values.astype(np.float32) * np.float32(-0.25))


def test_unsupported_type_names_the_tensor(tmp_path):
    quantized_file(tmp_path / "m.gguf", [T.Q4_1], (2, 32))
    with pytest.raises(SerializationError, match="'Q4_1'.*Q4_1.*Q8_0, Q4_0.*names="):
        qgguf.load(tmp_path / "m.gguf")


def test_names_load_the_tensors_asked_for_and_pass_over_the_rest(tmp_path):
    """A file mixing in a type qdispatch does not read (K-quants, Q4_1) loads the rest."""
    values = quantized_file(tmp_path / "m.gguf", [T.Q8_0, T.Q4_1, T.F32], (2, 64))
    loaded = qgguf.load(tmp_path / "m.gguf", names=["F32", "Q8_0"])
    assert list(loaded) == ["F32", "Q8_0"]
    assert_bits_equal(as_float32(loaded["Q8_0"]), values["Q8_0"])
    assert_bits_equal(as_float32(loaded["F32"]), values["F32"])
    with pytest.raises(KeyError, match="holds no tensor named 'Q4_0'; it holds 'Q8_0', 'Q4_1', 'F32'"):
        qgguf.load(tmp_path / "m.gguf", names=["Q4_0"])
    with pytest.raises(TypeError, match=r"names=\['F32'\]"):
        qgguf.load(tmp_path / "m.gguf", names="F32")


def test_big_endian_file_loads_the_same_values(tmp_path, monkeypatch):
    """A file byte-swapped by gguf's own converter holds its Q8_0/Q4_0 scales and BF16
    values big-endian: they were read little-endian, into wrong values, silently."""
    convert_endian = pytest.importorskip("gguf.scripts.gguf_convert_endian")
    expected = quantized_file(tmp_path / "m.gguf", [T.Q8_0, T.Q4_0, T.F16, T.F32, T.BF16], (2, 64))
    expected = {name: np.array(values) for name, values in expected.items()}  # not views of the file
    monkeypatch.setattr("builtins.input", lambda *args: "YES")  # the converter asks before it edits the file
    convert_endian.convert_byteorder(gguf.GGUFReader(str(tmp_path / "m.gguf"), "r+"),
                                     argparse.Namespace(order="big", dry_run=False))
    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).endianess.name == "BIG"
    loaded = qgguf.load(tmp_path / "m.gguf", device="reference")
    for name, values in expected.items():
        assert_bits_equal(as_float32(loaded[name]), values)


def test_empty_quantized_tensor_names_the_tensor(tmp_path):
    """A Q8_0 or Q4_0 tensor with no values loads as no QTensor, and the error says which."""
    for kind in (T.Q8_0, T.Q4_0):
        write_gguf(tmp_path / "m.gguf", {"w.empty": (gguf.quants.quantize(np.zeros((0, 32), np.float32), kind), kind)})
        with pytest.raises(SerializationError, match=f"'w.empty' in .*m.gguf is a {kind.name} tensor of shape "
                                                     r"\(0, 32\), with no values"):
            qgguf.load(tmp_path / "m.gguf")


def test_truncated_file(tmp_path):
    quantized_file(tmp_path / "m.gguf", [T.Q8_0], (4, 64))
    t = gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors[0]
    end = t.data_offset + t.n_bytes  # the file may continue with alignment padding
    (tmp_path / "m.gguf").write_bytes((tmp_path / "m.gguf").read_bytes()[:end - 5])
    with pytest.raises(SerializationError, match="not a readable GGUF file"):
        qgguf.load(tmp_path / "m.gguf")


def raw_gguf(path, tensors, kvs=b"", kv_count=0, data=b""):
    """A GGUF v3 file by hand: tensors [(name, dims, ggml type, offset)], then data."""
    def text(b):
        return struct.pack("<Q", len(b)) + b
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), kv_count + 1)
    head += text(b"general.architecture") + struct.pack("<I", 8) + text(b"llama") + kvs
    for name, dims, kind, offset in tensors:
        head += text(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", kind, offset)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + data)


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0], ids=lambda kind: kind.name)
def test_a_block_spanning_two_rows_is_refused(tmp_path, kind):
    """ggml's blocks run along ne0 and never span two rows: 8 rows of 16 values hold
    4 whole blocks of 32, yet none of them fits a row."""
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    raw_gguf(tmp_path / "m.gguf", [(b"w", [16, 8], kind, 0)], data=b"\0" * (4 * block_bytes))
    with pytest.raises(SerializationError, match="tensor 'w' has rows of 16 values, not whole blocks of 32"):
        qgguf.load(tmp_path / "m.gguf")


def test_tensors_that_overlap_or_start_off_their_place_are_refused(tmp_path):
    """ggml requires each tensor to start where the one before ends (aligned); the
    gguf reader does not check, so a small file naming one tensor's bytes many times
    would load as many copies, and a tensor inside another as garbage."""
    data = np.arange(1024, dtype=np.float32).tobytes()
    path = tmp_path / "m.gguf"
    raw_gguf(path, [(f"t{i}".encode(), [1024], int(T.F32), 0) for i in range(100)], data=data)
    with pytest.raises(SerializationError, match=r"'t1' in .*m.gguf starts at byte \d+ of the file, where the "
                                                 r"tensors before it end at \d+ \(aligned to 32 bytes\)"):
        qgguf.load(path)
    raw_gguf(path, [(b"a", [8], int(T.F32), 0), (b"b", [8], int(T.F32), 1)], data=data[:64])
    with pytest.raises(SerializationError, match="'b' in .*starts at byte"):
        qgguf.load(path)
    raw_gguf(path, [(b"a", [8], int(T.F32), 0), (b"b", [8], int(T.F32), 64)], data=data[:96])
    with pytest.raises(SerializationError, match="'b' in .*starts at byte"):  # past its place: a gap ggml never leaves
        qgguf.load(path)
    raw_gguf(path, [(b"a", [8], int(T.F32), 0), (b"b", [8], int(T.F32), 32)], data=data[:64])
    back = qgguf.load(path)  # in place: loads
    np.testing.assert_array_equal(back["b"].numpy(), np.arange(8, 16, dtype=np.float32))


def test_headers_ggml_refuses_are_refused(tmp_path):
    """Each would load without a check of its own: a second tensor of one name would drop
    the first, an alignment of 48 would read padding as values, version 1 (32-bit counts)
    would be read in version 2's layout."""
    path, data = tmp_path / "m.gguf", np.arange(24, dtype=np.float32).tobytes()
    raw_gguf(path, [(b"wa", [8], int(T.F32), 0), (b"wa", [8], int(T.F32), 32)], data=data[:64])
    with pytest.raises(SerializationError, match="two tensors are named 'wa'"):
        qgguf.load(path)
    alignment = struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, 48)
    raw_gguf(path, [(b"w", [2], int(T.F32), 0)], kvs=alignment, kv_count=1, data=data[:8])
    with pytest.raises(SerializationError, match="general.alignment is 48, not a power of two"):
        qgguf.load(path)
    # general.alignment twice (64, then 32): the reader took the last, ggml refuses the file
    twice = b"".join(struct.pack("<Q", 17) + b"general.alignment" + struct.pack("<II", 4, a) for a in (64, 32))
    raw_gguf(path, [(b"w", [2], int(T.F32), 0)], kvs=twice, kv_count=2, data=data[:8])
    with pytest.raises(SerializationError, match=r"the key 'general.alignment' appears twice \(written by a tool"):
        qgguf.load(path)
    empty_of_no_type = struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + struct.pack("<IQ", 77, 0)
    raw_gguf(path, [(b"w", [2], int(T.F32), 0)], kvs=empty_of_no_type, kv_count=1, data=data[:8])
    with pytest.raises(SerializationError, match="an array of unknown value type 77 at byte"):
        qgguf.load(path)  # with no items to read the type was never looked at
    raw_gguf(path, [(b"a\0x", [2], int(T.F32), 0), (b"a\0y", [2], int(T.F32), 32)], data=data[:40])
    with pytest.raises(SerializationError, match=r"the tensor name b'a\\x00x' holds a NUL byte"):
        qgguf.load(path)  # ggml reads both as 'a'
    for version in (1, 4):
        raw_gguf(path, [(b"w", [2], int(T.F32), 0)], data=data[:8])
        head = bytearray(path.read_bytes())
        head[4:8] = struct.pack("<I", version)
        path.write_bytes(bytes(head))
        with pytest.raises(SerializationError, match=f"GGUF version {version}; qdispatch reads versions 2 and 3"):
            qgguf.load(path)


@pytest.mark.parametrize("alignment", [1, 8, 32, 4096])
def test_a_file_that_names_its_alignment_loads(tmp_path, alignment):
    """With general.alignment the reader gives it as numpy's uint32, whose arithmetic
    with negative numbers failed as an OverflowError."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_custom_alignment(alignment)
    x = np.arange(96, dtype=np.float32).reshape(3, 32)
    writer.add_tensor("f", x)
    writer.add_tensor("q", gguf.quants.quantize(x, T.Q8_0), raw_dtype=T.Q8_0)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    loaded = qgguf.load(tmp_path / "m.gguf", device="reference")
    np.testing.assert_array_equal(loaded["f"].numpy(), x)
    np.testing.assert_array_equal(as_float32(loaded["q"]), gguf.quants.dequantize(
        gguf.quants.quantize(x, T.Q8_0), T.Q8_0))


@pytest.mark.parametrize("add", ["add_uint64", "add_int32"])
def test_an_alignment_of_another_type_than_uint32_is_refused(tmp_path, add):
    """general.alignment of another type was stepped over and the data read at the
    default alignment 32; llama.cpp refuses it ("general.alignment must be type u32")."""
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    getattr(writer, add)("general.alignment", 64)
    writer.add_tensor("w", np.arange(32, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(SerializationError, match=r"general.alignment has value type \d+, not uint32 \(4\) \(written "
                                                 r"by a tool that doesn't check it, or damaged\)"):
        qgguf.load(tmp_path / "m.gguf")


def test_a_tensor_of_more_than_4_dims_is_refused(tmp_path):
    """ggml's GGML_MAX_DIMS is 4: its loader refuses a file holding a tensor of more."""
    data = np.arange(64, dtype=np.float32).tobytes()
    raw_gguf(tmp_path / "m.gguf", [(b"w", [32, 1, 1, 2, 1], int(T.F32), 0)], data=data)
    with pytest.raises(SerializationError, match=r"tensor 'w' has 5 dims, more than ggml's 4 \(written"):
        qgguf.load(tmp_path / "m.gguf")
    raw_gguf(tmp_path / "m.gguf", [(b"w", [32, 1, 1, 2], int(T.F32), 0)], data=data)  # 4: loads
    assert qgguf.load(tmp_path / "m.gguf", device="reference")["w"].shape == (2, 1, 1, 32)


def test_a_tensor_name_of_64_bytes_is_refused(tmp_path):
    """ggml's GGML_MAX_NAME (64) holds a name and its NUL: names are at most 63 bytes,
    and its loader refuses a file holding a longer one.  (The gguf writer does not check.)"""
    data = np.arange(32, dtype=np.float32).tobytes()
    raw_gguf(tmp_path / "m.gguf", [(b"n" * 64, [32], int(T.F32), 0)], data=data)
    with pytest.raises(SerializationError, match=r"the tensor name b'n{32}'\.\.\. is 64 bytes long, more than "
                                                 r"ggml's 63 \(written by a tool that doesn't check it"):
        qgguf.load(tmp_path / "m.gguf")
    raw_gguf(tmp_path / "m.gguf", [(b"n" * 63, [32], int(T.F32), 0)], data=data)  # 63: loads
    assert list(qgguf.load(tmp_path / "m.gguf", device="reference")) == ["n" * 63]


def test_an_array_longer_than_the_file_is_refused_at_once(tmp_path):
    """A key's array claiming 2**40 items in a 49-byte file: the reader took the bytes
    past the end as empty values and looped, its memory growing without end."""
    path = tmp_path / "m.gguf"
    raw_gguf(path, [], kvs=struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + struct.pack("<IQ", 0, 2**40),
             kv_count=1)
    with pytest.raises(SerializationError, match=r"not a readable GGUF file .*: an array of 1099511627776 values "
                                                 r"\(1099511627776 bytes\) at byte \d+ runs past the file's end"):
        qgguf.load(path)


def test_a_file_the_reader_chokes_on_is_a_serialization_error(tmp_path):
    path = tmp_path / "m.gguf"
    deep = struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 2000
    raw_gguf(path, [], kvs=deep + struct.pack("<IQ", 4, 0), kv_count=1)  # arrays of arrays, 2000 deep
    with pytest.raises(SerializationError, match="not a readable GGUF file .*: arrays nested more than 64 deep"):
        qgguf.load(path)
    raw_gguf(path, [(b"bf", [0, 2**62], int(T.BF16), 0)])  # no values, a dim numpy can't hold
    with pytest.raises(SerializationError, match=r"'bf' in .*has shape \(4611686018427387904, 0\), which its 0 values"):
        qgguf.load(path)


def tokenizer_like_file(path, strings, numbers):
    """A GGUF file whose metadata holds `strings` short strings and an array of
    `numbers` int32s (a tokenizer's vocabulary, merges and token types), and one tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"t{i}".encode() for i in range(strings)])
    writer.add_token_types([1] * numbers)
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()


def test_metadata_is_stepped_over_not_read(tmp_path):
    """The gguf package's reader made a numpy object of every metadata item: a model's
    tokenizer (400k strings) cost 10 s and 670 MB before the first tensor loaded."""
    import tracemalloc
    tokenizer_like_file(tmp_path / "m.gguf", strings=200_000, numbers=1_000_000)
    tracemalloc.start()
    try:
        loaded = qgguf.load(tmp_path / "m.gguf", device="reference")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(loaded["w"].numpy(), np.arange(64, dtype=np.float32).reshape(2, 32))
    assert peak < 8 << 20, f"loading one 256-byte tensor allocated {peak >> 20} MB"


def test_a_lowered_tensor_count_is_refused(tmp_path):
    """With its tensor count lowered, a file's second tensor entry was read as the
    first tensor's data: garbage values, loaded without a word."""
    path = tmp_path / "m.gguf"
    quantized_file(path, [T.Q8_0, T.F32], (2, 64))
    raw = bytearray(path.read_bytes())
    assert struct.unpack_from("<Q", raw, 8)[0] == 2
    struct.pack_into("<Q", raw, 8, 1)
    path.write_bytes(bytes(raw))
    with pytest.raises(SerializationError, match=r"holds \d+ bytes past its last tensor's data .*corrupted"):
        qgguf.load(path)


def test_a_tensor_count_of_zero_is_refused_and_a_file_of_metadata_alone_loads(tmp_path):
    """A tensor count lowered to 0 (or a header followed by garbage) loaded as {}:
    the check for bytes past the last tensor ran only when there was one."""
    path = tmp_path / "m.gguf"
    quantized_file(path, [T.Q8_0], (2, 64))
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 8, 0)
    path.write_bytes(bytes(raw))
    with pytest.raises(SerializationError, match=r"holds \d+ bytes past its header and padding .*corrupted"):
        qgguf.load(path)
    write_gguf(tmp_path / "vocab.gguf", {})  # metadata alone (a vocabulary file, say): no tensors, no error
    assert qgguf.load(tmp_path / "vocab.gguf") == {}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_loaders_refuse_what_is_no_regular_file(tmp_path):
    """A named pipe blocked the open for ever (waiting for a writer); a device gave
    a bare OSError."""
    os.mkfifo(tmp_path / "pipe")
    with _writer_after(tmp_path / "pipe", seconds=10):
        for load in (qgguf.load, qd.load):
            for path in (tmp_path / "pipe", "/dev/null"):
                with pytest.raises(SerializationError, match="is not a regular file"):
                    load(path)


@contextlib.contextmanager
def _writer_after(pipe, seconds):
    """While the block runs, a pipe that a loader opened and waits on gets a
    writer after `seconds`, and bytes that are no file: a loader that opens
    pipes then fails the test instead of hanging it.  Nobody waiting: no writer."""
    done = threading.Event()

    def unblock():
        while not done.wait(seconds):
            try:
                fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while no reader waits
            except OSError:
                continue
            os.write(fd, b"no gguf")
            os.close(fd)

    writer = threading.Thread(target=unblock, daemon=True)
    writer.start()
    try:
        yield
    finally:
        done.set()
        writer.join()


# ---- export ---------------------------------------------------------------------------

FITTING = {
    "Q8_0": [QuantScheme("q8s", block=32, scale_dtype="f16"), QuantScheme("q8f", block=(1, 32), scale_dtype="f16")],
    "Q4_0": [QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"),
             QuantScheme("q4s", block=(1, 1, 32), store="packed_u32", scale_dtype="f16")],
}


@pytest.mark.parametrize("kind,scheme", [(k, s) for k, ss in FITTING.items() for s in ss], ids=repr)
def test_export_fitting_schemes(tmp_path, kind, scheme):
    x = np.random.default_rng(2).standard_normal((2, 3, 64)).astype(np.float32)
    q = qd.quantize(x, scheme, device="reference")
    qgguf.export(tmp_path / "o.gguf", {"w": q, "f": qd.tensor(x, device="reference", dtype="bfloat16"),
                                       "a": x[0].astype(np.float16)})
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "o.gguf")).tensors}
    assert tensors["w"].tensor_type.name == kind
    assert_bits_equal(gguf.quants.dequantize(tensors["w"].data, tensors["w"].tensor_type), q.dequantize().numpy())
    assert [tensors[n].tensor_type.name for n in ("f", "a")] == ["BF16", "F16"]
    back = qgguf.load(tmp_path / "o.gguf", device="reference")
    np.testing.assert_array_equal(back["w"].values, q.values)
    np.testing.assert_array_equal(back["w"].scales, q.scales)
    np.testing.assert_array_equal(back["f"].numpy(), qd.tensor(x, device="reference", dtype="bfloat16").numpy())


def test_load_then_export_reproduces_the_bytes(tmp_path):
    quantized_file(tmp_path / "m.gguf", [T.Q8_0, T.Q4_0, T.F16, T.F32], (4, 64))
    qgguf.export(tmp_path / "o.gguf", qgguf.load(tmp_path / "m.gguf"), arch="llama")
    original = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    again = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tmp_path / "o.gguf")).tensors}
    assert original.keys() == again.keys()
    for name in original:
        np.testing.assert_array_equal(original[name].view(np.uint8), again[name].view(np.uint8))


@pytest.mark.parametrize("arch, error, says", [
    ("\udcff", SerializationError, "export's arch= is written as UTF-8 text without NULs"),
    ("a\0b", SerializationError, "export's arch= is written as UTF-8 text without NULs"),
    (7, qd.ArgumentTypeError, "export's arch= takes a str \\(written as general.architecture\\), got int 7"),
])
def test_export_refuses_an_arch_it_cannot_write(tmp_path, arch, error, says):
    """A lone surrogate leaked the writer's UnicodeEncodeError, after the file was begun."""
    with pytest.raises(error, match=says):
        qgguf.export(tmp_path / "o.gguf", {"x": np.ones(4, np.float32)}, arch=arch)
    assert not os.listdir(tmp_path)


def test_export_rejects_schemes_without_a_gguf_type(tmp_path):
    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    for scheme in [QuantScheme("q8s", block=32), QuantScheme("q8s", axis=0, scale_dtype="f16"),
                   QuantScheme("q4f", block=16, store="packed_u32", scale_dtype="f16"),
                   QuantScheme("q2f", block=32, store="packed_u32", scale_dtype="f16")]:
        with pytest.raises(SerializationError, match="'w'.*no type"):
            qgguf.export(tmp_path / "o.gguf", {"w": qd.quantize(x, scheme, device="reference")})
    # a transposed block-32 tensor has blocks along its first dim: no GGUF type either
    q = qd.quantize(x, FITTING["Q8_0"][0], device="reference").T
    with pytest.raises(SerializationError, match="'w'"):
        qgguf.export(tmp_path / "o.gguf", {"w": q})
    with pytest.raises(SerializationError, match="'i'.*int8"):
        qgguf.export(tmp_path / "o.gguf", {"i": qd.tensor(np.zeros(4, np.int8), device="reference")})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["w" * 64, "é" * 32, "a\0b"], ids=["64 bytes", "64 bytes of UTF-8", "NUL"])
def test_export_refuses_names_ggml_cannot_read(tmp_path, name):
    """ggml refuses a file with a tensor name of 64 bytes or more; a NUL would cut the
    name short."""
    with pytest.raises(SerializationError, match="ggml reads names of UTF-8 text without NULs, at most 63 bytes"):
        qgguf.export(tmp_path / "o.gguf", {"ok": np.ones(2, np.float32), name: np.ones(2, np.float32)})
    assert os.listdir(tmp_path) == []
    qgguf.export(tmp_path / "o.gguf", {"w" * 63: np.ones(2, np.float32), "é" * 31: np.ones(2, np.float32)})
    assert set(qgguf.load(tmp_path / "o.gguf", device="reference")) == {"w" * 63, "é" * 31}


@pytest.mark.parametrize("device", ["reference", "cpu"])
def test_a_nan_scale_names_the_file_and_the_tensor(tmp_path, device):
    """Not a NonFiniteError from deep in the quantized tensor's checks, which names neither."""
    data = gguf.quants.quantize(np.ones((1, 32), np.float32), T.Q8_0).copy()
    data[0, :2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)  # block 0's f16 scale
    write_gguf(tmp_path / "n.gguf", {"w": (data, T.Q8_0)})
    with pytest.raises(SerializationError, match=r"Tensor 'w' in .*n\.gguf has NaN scales .*names=\[\.\.\.\]"):
        qgguf.load(tmp_path / "n.gguf", device=device)
    inf = gguf.quants.quantize(np.full((1, 32), 1e7, np.float32), T.Q8_0)  # gguf's own quantizer: an inf scale
    write_gguf(tmp_path / "i.gguf", {"w": (inf, T.Q8_0)})
    with pytest.raises(SerializationError, match=r"Tensor 'w' in .*i\.gguf has Inf scales \(values past float16's "
                                                 r"range, or damage\)"):
        qgguf.load(tmp_path / "i.gguf", device=device)


def test_export_refuses_a_0d_tensor_and_blocks_across_rows(tmp_path):
    """Without their checks, a 0-d array would reach an internal error, and scale blocks
    over two rows numpy's own."""
    with pytest.raises(SerializationError, match="Can't export tensor 's': GGUF tensors need at least one dim"):
        qgguf.export(tmp_path / "o.gguf", {"s": np.array(3.5, np.float32)})
    q = qd.quantize(np.ones((2, 64), np.float32), QuantScheme("q8s", block=(2, 32), scale_dtype="f16"),
                    device="reference")
    with pytest.raises(SerializationError, match=r"Can't export tensor 'w': GGUF has no type for QuantScheme\('q8s', "
                                                 r"block=\(2, 32\)"):
        qgguf.export(tmp_path / "o.gguf", {"w": q})
    assert os.listdir(tmp_path) == []


def test_export_refuses_more_dims_than_ggml_reads(tmp_path):
    """ggml's loader refuses a whole file holding a tensor of more than 4 dims."""
    x = np.ones((2, 1, 2, 1, 64), np.float32)
    for obj in (x, qd.tensor(x, device="reference"), qd.quantize(x, FITTING["Q8_0"][0], device="reference")):
        with pytest.raises(SerializationError, match=r"export tensor 'w' of shape \(2, 1, 2, 1, 64\): GGUF "
                                                     r"tensors have at most 4 dims.*reshape it first"):
            qgguf.export(tmp_path / "o.gguf", {"ok": x[0], "w": obj})
    assert os.listdir(tmp_path) == []
    qgguf.export(tmp_path / "o.gguf", {"w": qd.quantize(x[0], FITTING["Q4_0"][0], device="reference")})
    assert qgguf.load(tmp_path / "o.gguf", device="reference")["w"].shape == (1, 2, 1, 64)


def test_export_refuses_a_name_that_is_no_utf8(tmp_path):
    """A lone surrogate failed the writer with a UnicodeEncodeError."""
    with pytest.raises(SerializationError, match=r"export tensor '\\ud800': its name is no UTF-8 text"):
        qgguf.export(tmp_path / "o.gguf", {"ok": np.ones(2, np.float32), "\ud800": np.ones(2, np.float32)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tensors,message", [
    ([("w", np.ones(3, np.float32))], r"export expects a dict of name -> tensor, got list; "
                                      r"for \(name, tensor\) pairs pass dict\(pairs\)"),
    ({1: np.ones(3, np.float32)}, "Tensor names must be non-empty strings, got 1 of type int"),
    ({"": np.ones(3, np.float32)}, "Tensor names must be non-empty strings, got '' of type str"),
], ids=["list of pairs", "int name", "empty name"])
def test_export_wants_a_dict_of_str_names(tmp_path, tensors, message):
    with pytest.raises(TypeError, match=message):
        qgguf.export(tmp_path / "o.gguf", tensors)
    assert os.listdir(tmp_path) == []

@pytest.mark.parametrize("dtype", [">f4", ">f2"])
def test_export_writes_big_endian_arrays_in_the_files_order(tmp_path, dtype):
    data = np.arange(-6, 6, dtype=np.float32).reshape(3, 4).astype(dtype)
    qgguf.export(tmp_path / "o.gguf", {"a": data})
    back = qgguf.load(tmp_path / "o.gguf", device="reference")["a"]
    assert back.dtype == np.dtype(dtype).newbyteorder("=").name
    np.testing.assert_array_equal(back.numpy(), data)


def test_export_holds_one_tensor_at_a_time(tmp_path):
    """export checks every tensor, then fetches and writes them one at a time:
    exporting many costs the host no more than exporting one (before, every
    tensor's blocks were gathered first)."""
    scheme = FITTING["Q4_0"][0]
    weights = {f"w{i}": qd.quantize(np.random.default_rng(i).standard_normal((256, 1024)).astype(np.float32),
                                    scheme, device="reference") for i in range(24)}

    def transient(items):
        return transient_bytes(lambda: qgguf.export(tmp_path / "o.gguf", items))

    one_weight = 256 * 1024 // 32 * 18  # its Q4_0 blocks
    many = transient(weights)
    back = qgguf.load(tmp_path / "o.gguf", device="reference")
    np.testing.assert_array_equal(back["w23"].values, weights["w23"].values)
    assert many < transient({"w0": weights["w0"]}) + 2 * one_weight
