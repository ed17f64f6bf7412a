"""The mistakes a new user makes first get an error (or a warning) that names the fix,
and the conveniences they reach for work."""
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import qdispatch as qd


@pytest.fixture
def rng():
    return np.random.default_rng(5)


@pytest.fixture
def w(rng):
    return qd.quantize(rng.standard_normal((8, 16)).astype(np.float32), qd.QuantScheme("q8s", axis=0))


def test_a_linear_layout_weight_passed_to_q_matmul_is_told_to_transpose(rng, w):
    x = rng.standard_normal((2, 16)).astype(np.float32)
    with pytest.raises(qd.ShapeError, match=r"rhs\.T fits \(or qdispatch\.linear\(x, w\)"):
        qd.q_matmul(x, w)
    with pytest.raises(qd.ShapeError) as caught:  # no hint where the transpose would not fit either
        qd.q_matmul(rng.standard_normal((2, 5)).astype(np.float32), w)
    assert ".T fits" not in str(caught.value)
    with pytest.raises(qd.ShapeError, match=r"b\.T fits$"):
        qd.int_matmul(np.ones((2, 3), np.int8), np.ones((4, 3), np.int8))


def test_linear_names_itself_for_integer_x(w):
    with pytest.raises(qd.ArgumentTypeError, match="^linear expects float data, got int8"):
        qd.linear(np.ones((2, 16), np.int8), w)
    for dtype in ("int8", "int32"):  # a Tensor of integers: "q_matmul's float lhs must be ..."
        with pytest.raises(qd.ArgumentTypeError, match=f"^linear expects float data, got {dtype}"):
            qd.linear(qd.tensor(np.ones((2, 16)), dtype=dtype), w)


def test_linear_of_a_number_names_its_x():
    # it said "q_matmul multiplies matrices ...; got shapes () and (16, 8)": w.T's shape, not w's
    w = qd.quantize(np.ones((8, 16), np.float32), "q8s")
    for x in (3.0, np.float32(3.0), qd.tensor(np.float32(3.0))):
        with pytest.raises(qd.ShapeError, match=r"^linear's x must be a vector of 16 features or rows of them, "
                                                r"got a single number \(shape \(\)\)"):
            qd.linear(x, w)


def test_int_matmul_of_data_not_int8_says_what_to_do():
    # "use q_matmul for QTensors" where no QTensor was given
    a = np.ones((2, 3), np.int8)
    with pytest.raises(qd.ArgumentTypeError, match=r"b must be int8 data, got int32: convert integers that fit "
                                                   r"to int8 first \(qdispatch.tensor\(data, dtype='int8'\)\)"):
        qd.int_matmul(a, qd.tensor(np.ones((3, 2), np.int32), dtype="int32"))
    with pytest.raises(qd.ArgumentTypeError, match=r"a must be int8 data, got float32: it multiplies integers "
                                                   r"exactly; for float data quantize it and use q_matmul"):
        qd.int_matmul(qd.tensor(np.ones((2, 3), np.float32)), a.T)
    with pytest.raises(qd.ArgumentTypeError, match=r"b must be int8 data, got a QTensor: use q_matmul"):
        qd.int_matmul(a, qd.quantize(np.ones((3, 2), np.float32), "q8s"))
    # numpy float data was named as the float32 tensor it would have become
    for dtype in (np.float64, np.float16, np.complex64):
        with pytest.raises(qd.ArgumentTypeError, match=rf"a must be int8 data, got {np.dtype(dtype).name}: it "
                                                       r"multiplies integers exactly"):
            qd.int_matmul(np.ones((2, 3), dtype), a.T)
    with pytest.raises(qd.ArgumentTypeError, match=r"b must be int8 data, got float64: "):
        qd.int_matmul(a, np.ones((3, 2)))


def test_activation_scheme_with_two_qtensors_is_refused(rng, device):
    a = qd.quantize(rng.standard_normal((3, 16)).astype(np.float32), "q8s", device=device)
    b = qd.quantize(rng.standard_normal((16, 4)).astype(np.float32), "q8s", device=device)
    with pytest.raises(qd.ArgumentError, match="both operands are QTensors already"):
        qd.q_matmul(a, b, activation_scheme="q8s")
    with pytest.raises(qd.ArgumentError, match="^linear got activation_scheme='q8s', but x is a QTensor already"):
        qd.linear(a, b.T, activation_scheme="q8s")


# the fused W8A8 kernel, and quantize then qq
@pytest.mark.parametrize("scheme", ["q8s", qd.QuantScheme("q4s", axis=0, store="packed_u32")])
def test_a_nan_in_activations_quantized_on_the_fly_says_so(rng, device, scheme):
    w = qd.quantize(rng.standard_normal((8, 16)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device=device)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    x[1, 5] = np.nan
    with pytest.raises(qd.NonFiniteError) as caught:
        qd.linear(x, w, activation_scheme=scheme)
    message = str(caught.value)
    assert message.startswith(f"activation_scheme={scheme!r} quantizes the float operand on the fly (W8A8)")
    assert "nan at position (1, 5)" in message
    out = qd.linear(x, w).numpy()  # weight-only: the NaN stays in its row, as the message says
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


def test_qtensor_indexing_points_at_a_way_that_works(w):
    with pytest.raises(qd.ArgumentTypeError, match=r"q\.dequantize\(\)\.numpy\(\)\[\.\.\.\]"):
        w[[1, 3]]
    assert w.dequantize().numpy()[[1, 3]].shape == (2, 16)


def test_a_qtensor_refuses_dlpack_with_the_fix(w):
    with pytest.raises(qd.DLPackExportError, match=r"export q\.dequantize\(\)"):
        np.from_dlpack(w)
    assert w.__dlpack_device__() == (1, 0)


def test_a_qtensor_refuses_torch_from_dlpack_with_the_fix(w):
    torch = pytest.importorskip("torch")
    with pytest.raises(qd.DLPackExportError, match=r"export q\.dequantize\(\)"):
        torch.from_dlpack(w)


def test_astype_converts_float_dtypes_on_the_device(rng, device):
    t = qd.tensor(rng.standard_normal((3, 4)).astype(np.float32), device=device)
    half = t.astype("float16")
    assert half.dtype == "float16" and half.device == t.device
    assert np.array_equal(half.numpy(), t.numpy().astype(np.float16))
    assert t.astype(np.float32) is t
    assert np.array_equal(t.astype("bfloat16").numpy(), qd.tensor(t.numpy(), dtype="bfloat16").numpy())
    with pytest.raises(qd.ArgumentTypeError, match="only float32, float16 and bfloat16 convert"):
        t.astype("int8")
    with pytest.raises(qd.ArgumentTypeError, match="Unsupported dtype"):
        t.astype(None)


def test_a_dtype_given_as_a_device_is_pointed_to_astype(rng):
    t = qd.tensor(np.ones(3, np.float32))
    with pytest.raises(qd.ArgumentError, match=r"got the dtype 'float16': t\.astype\('float16'\) converts its values"):
        t.to("float16")
    with pytest.raises(qd.ArgumentError, match=r"got the dtype 'FLOAT16': t\.astype\('float16'\)"):
        t.to("FLOAT16")
    for dtype in (np.float16, np.dtype("float16")):
        with pytest.raises(qd.ArgumentTypeError, match=r"Tensor\.to moves between devices .*t\.astype\('"):
            t.to(dtype)
    with pytest.raises(qd.ArgumentTypeError, match=r"for float64, convert t\.numpy\(\)"):
        t.to(np.float64)
    q = qd.quantize(np.ones((4, 32), np.float32), "q8s")
    with pytest.raises(qd.ArgumentTypeError, match=r"QTensor\.to .* dtype float16: its values as floats are "
                                                   r"q\.dequantize\(\), a float32 Tensor \(then \.astype\('float16'\)\)"):
        q.to(np.float16)
    with pytest.raises(qd.ArgumentTypeError, match=r"dtype int8: its stored values are q\.values"):
        q.to(np.int8)
    with pytest.raises(qd.ArgumentError, match=r"dtype 'float32': its values as floats are q\.dequantize\(\)"):
        q.to("float32")
    for not_float in ("tpu", "int8"):  # astype converts float dtypes only: no hint that would fail
        with pytest.raises(qd.ArgumentError) as caught:
            t.to(not_float)
        assert "astype" not in str(caught.value)


def test_out_of_memory_is_exported_and_a_memory_error():
    assert issubclass(qd.CudaOutOfMemoryError, qd.KernelError)
    assert issubclass(qd.CudaOutOfMemoryError, MemoryError)


def test_load_of_a_gguf_file_names_the_gguf_reader(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))
    with pytest.raises(qd.SerializationError, match=r"is a GGUF file, not a safetensors file: read it with "
                                                    r"qdispatch\.gguf\.load"):
        qd.load(str(path))


def test_importing_an_unbuilt_copy_says_what_it_is(tmp_path):
    package = os.path.dirname(qd.__file__)
    shutil.copytree(package, tmp_path / "qdispatch", ignore=shutil.ignore_patterns("*.so", "*.pyd", "lib"))
    done = subprocess.run([sys.executable, "-c", "import qdispatch"], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode != 0
    assert "ImportError: qdispatch's compiled modules are missing from" in done.stderr
    assert "pip install ." in done.stderr


def _encoder_layer(torch):
    return torch.nn.TransformerEncoderLayer(32, 4, 64)


def test_quantize_linears_warns_when_it_quantizes_nothing():
    torch = pytest.importorskip("torch")
    from qdispatch.torch import quantize_embeddings, quantize_linears
    scheme = qd.QuantScheme("q8s", axis=0)
    with pytest.warns(UserWarning, match=r"quantized nothing in TransformerEncoderLayer: its Linear layers "
                                         r"\(linear1, linear2, self_attn\.out_proj\) are read as tensors"):
        quantize_linears(_encoder_layer(torch), scheme)
    with pytest.warns(UserWarning, match="quantized nothing in ReLU: it holds no nn.Linear"):
        quantize_linears(torch.nn.Sequential(torch.nn.ReLU())[0], scheme)
    with pytest.warns(UserWarning, match="quantize_embeddings quantized nothing in Sequential: it holds no "
                                         "nn.Embedding"):
        quantize_embeddings(torch.nn.Sequential(torch.nn.Linear(4, 4)), scheme)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), scheme, skip=["0"])  # the user's choice
        model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(16, 4)), scheme)
        quantize_linears(model, scheme)  # quantized already: nothing left to say
        quantize_linears(model, scheme, device=str(model[0].weight.device))


def test_quantize_linears_says_it_left_earlier_layers_as_they_were():
    """A second call that asks for another scheme, device or activation scheme of
    layers an earlier call quantized changes nothing; it did so silently."""
    torch = pytest.importorskip("torch")
    from qdispatch.torch import quantize_linears
    scheme = qd.QuantScheme("q8s", axis=0)
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(16, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4)),
                             scheme, device="reference")
    weights = [model[0].weight, model[2].weight]
    for kwargs, said in [({"scheme": qd.QuantScheme("q4s", axis=0, store="packed_u32")}, "'0' has scheme"),
                         ({"scheme": scheme, "device": "cpu"}, "'0' has its weight on 'reference'"),
                         ({"scheme": scheme, "activation_scheme": "q8s"}, "'0' has activation_scheme=None")]:
        with pytest.warns(UserWarning, match=rf"quantize_linears left 2 QLinear layer\(s\) quantized earlier as "
                                             rf"they were \({said}.*quantizes float nn.Linear layers only"):
            quantize_linears(model, **kwargs)
        assert model[0].weight is weights[0] and model[2].weight is weights[1]


def test_mixed_schemes_quantize_in_two_calls_without_a_warning():
    """An int8 head and int4 elsewhere: the head first, then the rest with skip naming it.
    The second call warned that it left the head as it was, which it was asked to."""
    torch = pytest.importorskip("torch")
    from qdispatch.torch import quantize_linears
    int4, int8 = qd.QuantScheme("q4s", block=(1, 16), store="packed_u32"), qd.QuantScheme("q8s", axis=0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    quantize_linears(model, int8, skip=["0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_linears(model, int4, skip=["2"])
    assert model[0].scheme == int4 and model[2].scheme == int8
    # asked of both layers again: the one of another scheme is said
    with pytest.warns(UserWarning, match=r"left 1 QLinear layer\(s\) quantized earlier as they were \('0' has"):
        quantize_linears(model, int8)


def test_saving_a_quantized_models_state_dict_names_save_model(tmp_path):
    torch = pytest.importorskip("torch")
    from qdispatch.torch import quantize_linears
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(16, 4)), qd.QuantScheme("q8s", axis=0))
    with pytest.raises(qd.ArgumentTypeError, match=r"Can't save '0._extra_state' of type dict: .*"
                                                   r"qdispatch.torch.save_model\(model, path\)"):
        qd.save(tmp_path / "model.safetensors", model.state_dict())
    assert not os.path.exists(tmp_path / "model.safetensors")
