"""ONNX Runtime's MatMulNBits weights: bytes by hand, round trips on every backend,
refusals, and onnxruntime's own kernel reading what export writes."""
import numpy as np
import pytest

import qdispatch as qd
from qdispatch import matmulnbits

SCHEMES = [
    ((64, 128), qd.QuantScheme("q4f", block=32, store="packed_u32")),
    ((16, 256), qd.QuantScheme("q4s", block=128, store="packed_u32", scale_dtype="f16")),
    ((64, 100), qd.QuantScheme("q4s", axis=0, store="packed_u32")),
    ((24, 64), qd.QuantScheme("q4f", store="packed_u32", scale_dtype="bf16")),
    ((48, 256), qd.QuantScheme("q8s", block=64)),
    ((48, 96), qd.QuantScheme("q8f", block=(1, 48))),
    ((48, 256), qd.QuantScheme("q2f", block=(1, 32), store="packed_u32")),
    ((8, 96), qd.QuantScheme("q4f", block=(2, 48), store="packed_u32", scale_dtype="f16")),
]


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def test_codes_are_value_plus_zero_point_packed_lowest_bits_first():
    values = np.array([[-8, 7, 0, 1] + [0] * 12, [-1, -2, 3, -4] + [0] * 12], dtype=np.int8)
    q = qd.qtensor_from_parts(values, np.array([[0.5], [2.0]], np.float32),
                              qd.QuantScheme("q4f", block=16, store="packed_u32"))
    w = matmulnbits.export(q)
    assert w.B.shape == (2, 1, 8) and w.B.dtype == np.uint8
    # codes 0, 15, 8, 9 -> bytes 0xF0, 0x98; codes 7, 6, 11, 4 -> 0x67, 0x4B; code 8 pads
    assert list(w.B[0, 0]) == [0xF0, 0x98] + [0x88] * 6
    assert list(w.B[1, 0]) == [0x67, 0x4B] + [0x88] * 6
    assert w.scales.tolist() == [0.5, 2.0] and w.scales.dtype == np.float32
    assert w.attributes == {"K": 16, "N": 2, "bits": 4, "block_size": 16}
    eight = matmulnbits.export(qd.qtensor_from_parts(np.resize(np.array([-128, 127, 0, 1], np.int8), (1, 16)),
                                                     np.float32(1), qd.QuantScheme("q8f")))
    assert list(eight.B[0, 0, :4]) == [0, 255, 128, 129]
    two = matmulnbits.export(qd.qtensor_from_parts(np.resize(np.array([-2, 1, 0, -1], np.int8), (1, 16)),
                                                   np.float32(1), qd.QuantScheme("q2f", store="packed_u32")))
    assert two.B[0, 0, 0] == 0b01_10_11_00  # codes 0, 3, 2, 1, lowest bits first


@pytest.mark.parametrize("shape, scheme", SCHEMES, ids=[repr(s) for _, s in SCHEMES])
def test_round_trip_keeps_every_value(device, rng, shape, scheme):
    q = qd.quantize(rng.standard_normal(shape).astype(np.float32), scheme, device=device)
    w = matmulnbits.export(q)
    N, K = shape
    assert (w.N, w.K, w.bits) == (N, K, scheme.bits)
    assert w.B.shape == (N, -(-K // w.block_size), w.block_size * scheme.bits // 8)
    back = matmulnbits.load(*w, device=device)
    assert back.device == q.device and back.shape == q.shape
    assert np.array_equal(back.values, q.values)
    assert np.array_equal(back.dequantize().numpy(), q.dequantize().numpy())
    assert back.scheme.value == f"q{scheme.bits}f"


def test_block_size_choice_and_float16_scales(rng):
    w = rng.standard_normal((8, 100)).astype(np.float32)
    per_row = qd.quantize(w, qd.QuantScheme("q4s", axis=0, store="packed_u32"))
    assert matmulnbits.export(per_row).block_size == 64  # none divides 100: the largest within it
    assert matmulnbits.export(per_row, block_size=16).block_size == 16
    divides = qd.quantize(rng.standard_normal((8, 96)).astype(np.float32), qd.QuantScheme("q4s", axis=0, store="packed_u32"))
    assert matmulnbits.export(divides).block_size == 32  # cuts K = 96 evenly, where 64 would pad it
    per_block = qd.quantize(rng.standard_normal((8, 384)).astype(np.float32),
                            qd.QuantScheme("q4s", block=96, store="packed_u32", scale_dtype="f16"))
    exported = matmulnbits.export(per_block, dtype="float16")
    assert exported.block_size == 32 and exported.scales.dtype == np.float16
    back = matmulnbits.load(*exported)
    assert back.scheme.scale_dtype == "f16"
    assert np.array_equal(back.dequantize().numpy(), per_block.dequantize().numpy())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_k_that_block_size_does_not_divide_exports_back_as_it_came(rng, bits):
    """load gives such a weight blocks of gcd(K, block_size) along K (4 for K = 100 and
    32), whose scales repeat over each of the file's blocks: export refused it, since
    no power of two fits blocks of 4.  It now finds blocks whose scales agree, and gives
    back the bytes it was loaded from."""
    N, K, size = 6, 100, 32
    k_blocks, zero, per_byte = -(-K // size), 1 << (bits - 1), 8 // bits
    values = np.zeros((N, k_blocks * size), np.int64)  # padding past K: value 0, code `zero`
    values[:, :K] = rng.integers(-zero, zero, size=(N, K))
    codes = (values + zero).reshape(N, -1, per_byte) << (np.arange(per_byte) * bits)  # lowest bits first
    B = codes.sum(axis=-1).astype(np.uint8).reshape(N, k_blocks, size * bits // 8)
    scales = rng.uniform(0.5, 2, N * k_blocks).astype(np.float32)
    q = matmulnbits.load(B, scales, K, N, bits, size)
    assert q.scheme.block == (1, 4)
    for asked in (None, 32):
        w = matmulnbits.export(q, block_size=asked)
        assert (w.block_size, w.K, w.N) == (32, K, N)
        assert np.array_equal(w.B, B) and np.array_equal(w.scales, scales)
    with pytest.raises(qd.ArgumentError, match="block_size=64 doesn't fit .*; 32 fits"):
        matmulnbits.export(q, block_size=64)
    # scales that agree over pairs of the file's blocks: blocks of 64 see one scale each
    paired = np.repeat(scales.reshape(N, k_blocks)[:, ::2], 2, axis=1).reshape(-1)
    w = matmulnbits.export(matmulnbits.load(B, paired, K, N, bits, size))
    assert w.block_size == 64
    assert np.array_equal(matmulnbits.load(*w).dequantize().numpy(),
                          matmulnbits.load(B, paired, K, N, bits, size).dequantize().numpy())


def test_a_file_whose_block_size_is_not_the_default_exports_back_given_it(rng):
    """K = 96 in blocks of 64: export's own choice is 32 (it cuts K evenly), the same
    values in smaller blocks; the file's block_size gives back its bytes."""
    N, K, size = 4, 96, 64
    values = np.zeros((N, 2 * size), np.int64)
    values[:, :K] = rng.integers(-8, 8, size=(N, K))
    codes = (values + 8).reshape(N, -1, 2) << np.array([0, 4])
    B = codes.sum(axis=-1).astype(np.uint8).reshape(N, 2, size // 2)
    scales = rng.uniform(0.5, 2, N * 2).astype(np.float32)
    q = matmulnbits.load(B, scales, K, N, 4, size)
    given = matmulnbits.export(q, block_size=size)
    assert np.array_equal(given.B, B) and np.array_equal(given.scales, scales)
    chosen = matmulnbits.export(q)
    assert chosen.block_size == 32 and chosen.scales.shape == (N * 3,)
    assert np.array_equal(matmulnbits.load(*chosen).dequantize().numpy(), q.dequantize().numpy())


def test_a_transposed_weight_exports_as_seen(rng):
    w = rng.standard_normal((128, 32)).astype(np.float32)  # [K, N], for q_matmul(x, w)
    q = qd.quantize(w, qd.QuantScheme("q4f", block=(32, 1), store="packed_u32"))
    exported = matmulnbits.export(q.T)
    assert (exported.N, exported.K, exported.block_size) == (32, 128, 32)
    assert np.array_equal(matmulnbits.load(*exported).dequantize().numpy(), q.T.dequantize().numpy())


def test_default_zero_points_are_accepted_and_others_refused(rng):
    q = qd.quantize(rng.standard_normal((3, 48)).astype(np.float32),
                    qd.QuantScheme("q4f", block=16, store="packed_u32"))
    w = matmulnbits.export(q)  # 3 blocks a row: packed zero points take 2 bytes a row
    packed_default = np.full((3, 2), 0x88, np.uint8)
    packed_default[:, 1] = 0x08  # the high nibble past the last block is padding
    assert np.array_equal(matmulnbits.load(*w, zero_points=packed_default.ravel()).values, q.values)
    assert np.array_equal(matmulnbits.load(*w, zero_points=np.full(9, 8, np.float32)).values, q.values)
    for other in (np.full(6, 0x77, np.uint8), np.full(9, 7.5, np.float32)):
        with pytest.raises(qd.ArgumentError, match="zero points other than 8"):
            matmulnbits.load(*w, zero_points=other)
    with pytest.raises(qd.ShapeError, match="2 bytes a row"):
        matmulnbits.load(*w, zero_points=np.full(5, 0x88, np.uint8))


def _load_with(**changes):
    """matmulnbits.load of a 4 x 64 weight of 4 bits in blocks of 32, with `changes`."""
    args = dict(B=np.zeros(128, np.uint8), scales=np.ones(8, np.float32), K=64, N=4, bits=4, block_size=32)
    return matmulnbits.load(**{**args, **changes})


def _normal(shape):  # data whose scales differ (equal ones would fit any block size)
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("make, error, words", [
    (lambda q: matmulnbits.export(np.ones((4, 32), np.float32)), qd.ArgumentTypeError, "takes a QTensor"),
    (lambda q: matmulnbits.export(qd.quantize(np.ones((2, 4, 32), np.float32), "q8s")), qd.ShapeError, "2-D"),
    (lambda q: matmulnbits.export(qd.quantize(np.ones((4, 48), np.float32), qd.QuantScheme("q8s", block=24))),
     qd.QuantSchemeError, "scale groups of 24 along K"),
    (lambda q: matmulnbits.export(qd.quantize(_normal((4, 32)), qd.QuantScheme("q8s", axis=1))),
     qd.QuantSchemeError, r"scale groups of 1 along K.*\(a weight laid out \[K, N\], for x @ w, exports as w.T\)"),
    (lambda q: matmulnbits.export(qd.quantize(_normal((4, 64)), qd.QuantScheme("q8s", block=32)),
                                  block_size=64), qd.ArgumentError, "block_size=64 doesn't fit .* 32 fits"),
    (lambda q: matmulnbits.export(q, block_size=24), qd.ArgumentError, "powers of two"),
    (lambda q: matmulnbits.export(q, dtype="bfloat16"), qd.ArgumentTypeError, "float32 or float16"),
    (lambda q: matmulnbits.export(q, dtype="float16"), qd.ArgumentError, "no float16 values"),
    (lambda q: _load_with(B=np.zeros(10, np.uint8)), qd.ShapeError, "128 bytes"),
    (lambda q: _load_with(scales=np.ones(8, np.float64)), qd.ArgumentTypeError, "float32 or float16"),
    (lambda q: _load_with(B=np.zeros(128, np.int8)), qd.ArgumentTypeError, "must be uint8"),
    (lambda q: _load_with(B=np.zeros(96, np.uint8), bits=3), qd.ArgumentError, "2, 4 or 8 bits"),
    (lambda q: _load_with(block_size=8), qd.ArgumentError, "16 or more"),
    (lambda q: _load_with(K=64.5), qd.ArgumentTypeError, "K must be a positive int"),
    (lambda q: _load_with(N=0), qd.ArgumentTypeError, "N must be a positive int"),
    (lambda q: _load_with(zero_points=np.full(7, 8, np.float32)), qd.ShapeError, "one per block, 8; got shape \\(7,\\)"),
    (lambda q: _load_with(scales=np.full(8, np.nan, np.float32)), qd.NonFiniteError, "scale"),
])
def test_refusals_say_what_to_do(make, error, words):
    q = qd.quantize(np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32),
                    qd.QuantScheme("q4s", block=32, store="packed_u32"))
    with pytest.raises(error, match=words):
        make(q)


def _model(graph):
    """`graph` as a model of opset 21 and com.microsoft's ops, at IR version 10: onnx writes
    its newest by default, which an older ONNX Runtime refuses ("Unsupported model IR version")."""
    from onnx import helper
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                  helper.make_opsetid("com.microsoft", 1)])


def _run_matmulnbits(weight, A):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper
    float_type = TensorProto.FLOAT if A.dtype == np.float32 else TensorProto.FLOAT16
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft", **weight.attributes)
    graph = helper.make_graph([node], "layer", [helper.make_tensor_value_info("A", float_type, list(A.shape))],
                              [helper.make_tensor_value_info("Y", float_type, [A.shape[0], weight.N])],
                              initializer=[numpy_helper.from_array(weight.B, "B"),
                                           numpy_helper.from_array(weight.scales, "scales")])
    model = _model(graph)
    onnx.checker.check_model(model)
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types
        if weight.attributes["bits"] == 2 and "Only 4b and 8b" in str(exc):
            pytest.skip(f"onnxruntime {ort.__version__} runs no 2-bit MatMulNBits")
        raise
    return session.run(None, {"A": A})[0]


@pytest.mark.parametrize("shape, scheme", SCHEMES, ids=[repr(s) for _, s in SCHEMES])
def test_onnxruntime_reads_the_exact_weights(rng, shape, scheme):
    q = qd.quantize(rng.standard_normal(shape).astype(np.float32), scheme)
    weight = matmulnbits.export(q)
    identity = np.eye(shape[1], dtype=np.float32)  # each output row is one weight column, exactly
    assert np.array_equal(_run_matmulnbits(weight, identity).T, q.dequantize().numpy())
    x = rng.standard_normal((5, shape[1])).astype(np.float32)
    np.testing.assert_allclose(_run_matmulnbits(weight, x), qd.linear(x, q).numpy(), rtol=1e-5, atol=1e-4)


def test_onnxruntime_float16_model(rng):
    q = qd.quantize(rng.standard_normal((32, 64)).astype(np.float32),
                    qd.QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"))
    weight = matmulnbits.export(q, dtype="float16")
    identity = np.eye(64, dtype=np.float16)
    assert np.array_equal(_run_matmulnbits(weight, identity).T, q.dequantize("float16").numpy())


def _model_of(nodes, initializers):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    graph = helper.make_graph(nodes, "model", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes],
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return onnx, _model(graph)


def test_load_model_reads_every_matmulnbits_node(rng, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    q4 = qd.quantize(rng.standard_normal((32, 64)).astype(np.float32), qd.QuantScheme("q4f", block=32, store="packed_u32"))
    q8 = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0))
    w4, w8 = matmulnbits.export(q4), matmulnbits.export(q8)
    nodes = [helper.make_node("MatMulNBits", ["A", "B4", "S4", "Z4"], ["Y4"], name="up", domain="com.microsoft",
                              **w4.attributes),
             helper.make_node("MatMulNBits", ["A", "B8", "S8"], ["Y8"], domain="com.microsoft", **w8.attributes),
             helper.make_node("Relu", ["A"], ["R"])]
    _, model = _model_of(nodes, {"B4": w4.B, "S4": w4.scales, "Z4": np.full(32, 0x88, np.uint8),
                                 "B8": w8.B, "S8": w8.scales})
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    weights = matmulnbits.load_model(tmp_path / "m.onnx", device="cpu")
    assert sorted(weights) == ["Y8", "up"]  # a node without a name goes by its output
    assert np.array_equal(weights["up"].dequantize().numpy(), q4.dequantize().numpy())
    assert np.array_equal(weights["Y8"].dequantize().numpy(), q8.dequantize().numpy())
    assert weights["up"].device == "cpu"


def test_load_model_of_a_model_without_matmulnbits_says_so(rng, tmp_path):
    """A float model gave {} without a word, as if it had no layers."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    _, model = _model_of([helper.make_node("MatMul", ["A", "W"], ["Y"])],
                         {"W": rng.standard_normal((64, 8)).astype(np.float32)})
    onnx.save(model, str(tmp_path / "float.onnx"))
    with pytest.warns(UserWarning, match=r"float.onnx holds no MatMulNBits node \(com.microsoft\) to load"):
        assert matmulnbits.load_model(tmp_path / "float.onnx") == {}


def test_load_model_refuses_what_it_cannot_hold(rng, tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    w = matmulnbits.export(qd.quantize(rng.standard_normal((16, 64)).astype(np.float32),
                                       qd.QuantScheme("q4f", block=32, store="packed_u32")))
    act_order = helper.make_node("MatMulNBits", ["A", "B", "S", "", "G"], ["Y"], domain="com.microsoft", **w.attributes)
    _, model = _model_of([act_order], {"B": w.B, "S": w.scales, "G": np.zeros(64, np.int32)})
    onnx.save(model, str(tmp_path / "g.onnx"))
    with pytest.raises(qd.SerializationError, match="g_idx input"):
        matmulnbits.load_model(tmp_path / "g.onnx")
    computed = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], name="computed", domain="com.microsoft",
                                **w.attributes)
    _, model = _model_of([computed], {"S": w.scales})
    onnx.save(model, str(tmp_path / "c.onnx"))
    with pytest.raises(qd.SerializationError, match="'computed' reads B from the graph"):
        matmulnbits.load_model(tmp_path / "c.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"not a model" * 10)
    with pytest.raises(qd.SerializationError, match="no ONNX model"):
        matmulnbits.load_model(tmp_path / "junk.onnx")
    for content in (b"", b"\x08\x07"):  # they parse, as models without a graph: {} passed for none found
        (tmp_path / "empty.onnx").write_bytes(content)
        with pytest.raises(qd.SerializationError, match="holds no ONNX graph"):
            matmulnbits.load_model(tmp_path / "empty.onnx")


def test_load_model_turns_every_lying_node_into_a_serialization_error(rng, tmp_path):
    """A node without its attributes was a KeyError, B's dims past its bytes and a
    scales initializer of another type numpy's ValueErrors."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    w = matmulnbits.export(qd.quantize(rng.standard_normal((16, 64)).astype(np.float32),
                                       qd.QuantScheme("q4f", block=32, store="packed_u32")))
    cases = {"no attributes": (helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], name="n", domain="com.microsoft"),
                               "lacks the attribute\\(s\\) K, N, block_size"),
             "no scales": (helper.make_node("MatMulNBits", ["A", "B", ""], ["Y"], name="n", domain="com.microsoft",
                                            **w.attributes), "has no B or no scales input")}
    for what, (node, words) in cases.items():
        _, model = _model_of([node], {"B": w.B, "S": w.scales})
        onnx.save(model, str(tmp_path / "m.onnx"))
        with pytest.raises(qd.SerializationError, match=words):
            matmulnbits.load_model(tmp_path / "m.onnx")
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], name="n", domain="com.microsoft", **w.attributes)
    for lie in ("dims", "data_type"):
        _, model = _model_of([node], {"B": w.B, "S": w.scales})
        initializer = {t.name: t for t in model.graph.initializer}
        if lie == "dims":
            initializer["B"].dims[0] = 1 << 40
        else:
            initializer["S"].data_type = TensorProto.DOUBLE
        onnx.save(model, str(tmp_path / "m.onnx"))
        with pytest.raises(qd.SerializationError, match="Can't load MatMulNBits node 'n' from"):
            matmulnbits.load_model(tmp_path / "m.onnx")


def test_load_model_finds_nodes_in_subgraphs_and_gives_their_bias(rng, tmp_path):
    """Nodes in an If's branches were skipped ({}), and a node's bias input dropped:
    a layer rebuilt from the weight alone gave other outputs than the model."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    q = qd.quantize(rng.standard_normal((4, 64)).astype(np.float32), qd.QuantScheme("q4f", block=32, store="packed_u32"))
    w, bias = matmulnbits.export(q), rng.standard_normal(4).astype(np.float32)

    def branch(name, inputs):
        node = helper.make_node("MatMulNBits", inputs, [f"Y_{name}"], name=name, domain="com.microsoft",
                                **w.attributes)
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(f"Y_{name}", TensorProto.FLOAT,
                                                                                  [None, 4])])
    choice = helper.make_node("If", ["c"], ["Y"], then_branch=branch("then", ["A", "B", "S"]),
                              else_branch=branch("else", ["A", "B", "S", "", "", "bias"]))
    graph = helper.make_graph([choice], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, 64]),
                                              helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 4])],
                              [numpy_helper.from_array(w.B, "B"), numpy_helper.from_array(w.scales, "S"),
                               numpy_helper.from_array(bias, "bias")])
    onnx.save(_model(graph), str(tmp_path / "m.onnx"))
    loaded = matmulnbits.load_model(tmp_path / "m.onnx")
    assert sorted(loaded) == ["else", "else.bias", "then"]
    assert np.array_equal(loaded["then"].dequantize().numpy(), q.dequantize().numpy())
    assert np.array_equal(loaded["else"].dequantize().numpy(), q.dequantize().numpy())
    assert np.array_equal(loaded["else.bias"].numpy(), bias)
    with pytest.raises(OSError):
        matmulnbits.load_model(tmp_path / "missing.onnx")
