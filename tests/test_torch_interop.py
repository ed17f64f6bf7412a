"""qdispatch.torch: q_matmul as an autograd.Function, QLinear, DLPack crossings."""
import copy
import os
import re
import signal
import warnings
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qdispatch as qd  # noqa: E402
from qdispatch import BackendMismatchError, QuantScheme, ShapeError  # noqa: E402
from qdispatch.torch import (QLinear, from_torch, load_model, q_matmul, quantize_linears,  # noqa: E402
                             save_model, to_torch)
from qdispatch.tensor_api import backend_for  # noqa: E402
from helpers import run_python, transient_bytes  # noqa: E402

DEVICES = ["reference"] + (["cpu"] if "cpu" in qd.available_backends() else [])

SCHEMES = [
    QuantScheme("q8s", axis=1),
    QuantScheme("q8f", block=(1, 8), scale_dtype="f16"),
    QuantScheme("q4f", block=(4, 8), store="packed_u32"),
]

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _needs_cuda():
    if not torch.cuda.is_available() or "cuda" not in qd.available_backends():
        pytest.skip("needs a CUDA GPU and the qdispatch cuda backend")


def weight(shape, scheme, device, seed=0):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return qd.quantize(w, scheme, device=device)


def dequantized(w, dtype=torch.float32):
    return torch.from_numpy(w.dequantize().numpy()).to(dtype)


def test_importing_qdispatch_does_not_import_torch():
    code = "import sys, qdispatch; assert 'torch' not in sys.modules, 'torch was imported'"
    out = run_python("-c", code)
    assert out.returncode == 0, out.stderr


# ---- forward and backward --------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
def test_forward_is_qdispatch_kernel(device, scheme):
    w = weight((16, 24), scheme, device)
    x = torch.randn(2, 3, 16)
    y = q_matmul(x, w)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float32
    expected = qd.q_matmul(x.numpy(), w).numpy()
    np.testing.assert_array_equal(y.numpy(), expected)
    torch.testing.assert_close(y, x @ dequantized(w), rtol=1e-5, atol=1e-5)


X_FORMS = {
    "row": lambda x: x[0, 0],
    "2-D": lambda x: x[0],
    "3-D": lambda x: x,
    "strided": lambda x: x.transpose(0, 1),
    "negative view": lambda x: torch.complex(torch.zeros_like(x), -x).conj().imag,
    "requires grad": lambda x: x.clone().requires_grad_(),
    "no rows": lambda x: x[:0],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", X_FORMS)
@pytest.mark.parametrize("dtype", DTYPE_NAMES, ids=str)
@pytest.mark.parametrize("act", [None, "q8s", QuantScheme("q8s")], ids=str)
def test_every_form_of_host_x_gives_qdispatchs_product(device, form, dtype, act):
    if form == "negative view" and dtype != torch.float32:
        pytest.skip("torch makes negative views of complex tensors' parts, and has no complex bfloat16")
    w = weight((16, 24), SCHEMES[0], device)
    x = X_FORMS[form](torch.randn(2, 3, 16, dtype=dtype) * 1e4)  # sums past float16's range: inf alike
    with torch.no_grad():
        y = q_matmul(x, w, act)
    assert y.shape == (*x.shape[:-1], 24) and y.dtype == dtype
    rows = from_torch(x.detach().resolve_neg().reshape(-1, 16), device=device)  # one scale per row or for all
    expected = to_torch(qd.q_matmul(rows, w, out_dtype=DTYPE_NAMES[dtype], activation_scheme=act))
    assert y.numel() == expected.numel() and np.array_equal(
        y.reshape(-1).view(torch.uint8).numpy(), expected.reshape(-1).view(torch.uint8).numpy())  # bit for bit


@pytest.mark.parametrize("device", DEVICES)
def test_w8a8_names_where_x_is_not_finite(device):
    x = torch.randn(2, 3, 16)
    x[1, 2, 5] = float("nan")
    # and says so as qd.q_matmul does (the cpu route gave quantize's words alone)
    with pytest.raises(qd.NonFiniteError, match=re.escape("activation_scheme='q8s' quantizes the float operand on "
                                                          "the fly (W8A8), which failed: ") + ".*" +
                       re.escape("nan at position (1, 2, 5)")):
        q_matmul(x, weight((16, 24), SCHEMES[0], device), "q8s")


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_dy_times_dequantized_w_transposed(device):
    w = weight((16, 24), SCHEMES[2], device)
    x = torch.randn(5, 16, requires_grad=True)
    dy = torch.randn(5, 24)
    q_matmul(x, w).backward(dy)
    np.testing.assert_array_equal(x.grad.numpy(), qd.q_matmul(dy.numpy(), w.T).numpy())
    torch.testing.assert_close(x.grad, dy @ dequantized(w).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
@pytest.mark.parametrize("transposed", [False, True])
def test_gradcheck_float64(device, scheme, transposed):
    w = weight((8, 16), scheme, device)
    w = w.T if transposed else w                       # [16, 8] or [8, 16]
    x = torch.randn(3, w.shape[0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: q_matmul(x, w), (x,))
    assert torch.autograd.gradcheck(lambda x: q_matmul(x, w), (x[0].detach().requires_grad_(),))


@pytest.mark.parametrize("device", DEVICES)
def test_float64_path_is_exact_dequantization(device):
    w = weight((8, 16), SCHEMES[1], device)
    x = torch.randn(4, 8, dtype=torch.float64)
    values = torch.from_numpy(w.values.astype(np.float64))
    scales = torch.from_numpy(np.repeat(w.scales.astype(np.float64), 8, axis=1))
    torch.testing.assert_close(q_matmul(x, w), x @ (values * scales), rtol=0, atol=1e-12)
    with pytest.raises(qd.ShapeError, match=r"shapes \(4, 6\) and \(8, 16\) don't fit: x needs a last dim of K=8"):
        q_matmul(x[:, :6], w)  # checked as for float32 x, before torch's own matmul


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_keep_their_dtype(dtype):
    w = weight((32, 8), SCHEMES[0], DEVICES[-1])
    x = torch.randn(4, 32, dtype=dtype, requires_grad=True)
    y = q_matmul(x, w)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), x.detach().float() @ dequantized(w), rtol=2e-2, atol=5e-2)
    y.sum().backward()
    assert x.grad.dtype == dtype and x.grad.shape == x.shape


def test_weight_gets_no_gradient():
    w = weight((8, 4), SCHEMES[0], "reference")
    x = torch.randn(2, 8, requires_grad=True)
    y = q_matmul(x, w)
    # autograd sees one input, x: the weight is not part of the graph
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions] == ["AccumulateGrad"]
    as_param = torch.nn.Parameter(torch.randn(8, 4))
    with pytest.raises(TypeError, match="QTensor weight.*no gradient"):
        q_matmul(x, as_param)


# ---- autocast, torch.func, forward mode, compile ----------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_gives_the_dtype_nn_linear_gives(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 8)
    layer = QLinear.from_linear(linear, SCHEMES[0], device=DEVICES[-1])
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        y, expected_dtype = layer(x), linear(x).dtype
        y64 = q_matmul(x.detach().double(), layer.weight.T)  # float64 is not autocast's to change
    assert y.dtype == expected_dtype == dtype and y64.dtype == torch.float64
    product = qd.q_matmul(from_torch(x.detach().to(dtype)), layer.weight.T, out_dtype=DTYPE_NAMES[dtype])
    expected = to_torch(product) + linear.bias.to(dtype)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    y.float().sum().backward()  # the gradient crosses the cast back to x's dtype
    assert x.grad.dtype == torch.float32 and x.grad.shape == x.shape


def _float64_linear(layer):
    """layer's float64 twin: torch's own ops on its values times its scales, each
    product exact in float64."""
    values, scales = layer.weight.values.astype(np.float64), layer.weight.scales.astype(np.float64)
    block = np.ones([v // s for v, s in zip(values.shape, scales.shape)])
    weight = torch.from_numpy(values * np.kron(scales, block))
    bias = layer.bias.double() if layer.bias is not None else None
    return lambda x: torch.nn.functional.linear(x, weight, bias)


def test_torch_func_transforms_match_the_dequantized_layer():
    torch.manual_seed(0)
    layer = QLinear.from_linear(torch.nn.Linear(16, 8).double(), SCHEMES[2], device=DEVICES[-1])
    twin = _float64_linear(layer)
    x, t = torch.randn(3, 16, dtype=torch.float64), torch.randn(3, 16, dtype=torch.float64)
    loss = lambda f: lambda x: f(x).pow(2).sum()  # noqa: E731
    func = torch.func
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
    close(func.grad(loss(layer))(x), func.grad(loss(twin))(x))
    close(func.jacrev(layer)(x[0]), func.jacrev(twin)(x[0]))
    close(func.jacfwd(layer)(x[0]), func.jacfwd(twin)(x[0]))
    close(func.hessian(loss(layer))(x[0]), func.hessian(loss(twin))(x[0]))
    close(func.jvp(layer, (x,), (t,))[1], func.jvp(twin, (x,), (t,))[1])
    batch = torch.randn(3, 5, 16, dtype=torch.float64)
    close(func.vmap(layer, in_dims=1)(batch), twin(batch.movedim(1, 0)))


def test_functional_call_takes_the_parameters_and_buffers_the_readme_names():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    quantize_linears(model, SCHEMES[0], device=DEVICES[-1])
    x = torch.randn(3, 16)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    torch.testing.assert_close(torch.func.functional_call(model, tensors, (x,)), model(x), rtol=0, atol=0)
    # swapped in for the call only: a bias of zeros changes the output, and the model keeps its own
    zeros = {name: torch.zeros_like(t) for name, t in tensors.items()}
    y = torch.func.functional_call(model, zeros, (x,))
    torch.testing.assert_close(y, torch.relu(x @ model[0].weight.T) @ model[2].weight.T, rtol=0, atol=0)
    assert torch.count_nonzero(model[0].bias) > 0
    # state_dict() holds each quantized layer's stored weight as a dict, which torch refuses
    with pytest.raises(TypeError, match="not an instance of torch.Tensor"):
        torch.func.functional_call(model, model.state_dict(), (x,))


def test_vmap_runs_the_kernel_over_the_batch():
    w = weight((16, 24), SCHEMES[1], DEVICES[-1])
    batch = torch.randn(4, 2, 16)
    y = torch.func.vmap(lambda x: q_matmul(x, w), in_dims=1, out_dims=1)(batch)
    np.testing.assert_array_equal(y.numpy(), qd.q_matmul(batch.numpy(), w).numpy())
    assert torch.func.vmap(lambda x, s: q_matmul(s * x, w), in_dims=(None, 0))(batch[0], torch.ones(3)).shape \
        == (3, 2, 24)  # x itself unbatched inside: the product has no batch dim of its own


def test_forward_mode_ad_carries_the_tangent():
    w = weight((16, 24), SCHEMES[0], DEVICES[-1])
    x, t = torch.randn(5, 16), torch.randn(5, 16)
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level():
        y = fwad.unpack_dual(q_matmul(fwad.make_dual(x, t), w))
    np.testing.assert_array_equal(y.primal.numpy(), qd.q_matmul(x.numpy(), w).numpy())
    np.testing.assert_array_equal(y.tangent.numpy(), qd.q_matmul(t.numpy(), w).numpy())
    x64 = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: q_matmul(x, w), (x64,), check_forward_ad=True)


def test_second_order_gradients():
    w = weight((16, 8), SCHEMES[2], DEVICES[-1])
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x: q_matmul(x, w), (x,))
    x32 = torch.randn(3, 16, requires_grad=True)
    (dx,) = torch.autograd.grad(q_matmul(x32, w).pow(2).sum(), x32, create_graph=True)
    (ddx,) = torch.autograd.grad(dx.sum(), x32)  # dx = 2 x W W^T, so this is 2 (1 W) W^T
    dense = dequantized(w)
    torch.testing.assert_close(ddx, 2 * (torch.ones(3, 16) @ dense) @ dense.T, rtol=1e-5, atol=1e-5)


def test_export_and_tracers_refuse_what_they_cannot_record():
    """torch.jit.trace recorded q_matmul's output as a constant (the traced model gave
    the first input's answer for every input), and torch.export and torch.fx failed
    in other words: they now refuse, saying what to use."""
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)), SCHEMES[0], device=DEVICES[-1])
    x = torch.randn(2, 16)
    says = "can't record qdispatch's q_matmul.*torch.compile"
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.jit.trace(model, (x,))
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.export.export(model, (x,), strict=False)
    with pytest.raises(Exception, match=says):  # torch's error for strict export quotes ours
        torch.export.export(model, (x,), strict=True)
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.fx.symbolic_trace(model)
    with pytest.raises(qd.BackendUnavailableError, match=says):  # it said only that a QTensor did not convert
        torch.jit.script(model)
    np.testing.assert_array_equal(model(x).detach().numpy(), qd.q_matmul(x.numpy(), model[0].weight.T).numpy()
                                  + model[0].bias.detach().numpy())


def test_the_torchscript_onnx_exporter_refuses_in_our_words(tmp_path):
    """torch.onnx.export's TorchScript exporter reads the state dict first, taking each
    layer's quantized state for a tensor: it failed with "'dict' object has no attribute
    'detach'", and now refuses as the tracers do.  Outside an export state_dict() is as before."""
    from qdispatch.torch import QEmbedding
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)), SCHEMES[0], device=DEVICES[-1])
    table = torch.nn.Sequential(QEmbedding.from_embedding(torch.nn.Embedding(10, 8), SCHEMES[0], device=DEVICES[-1]))
    says = "and torch.onnx.export can't record qdispatch's q_matmul \\(QLinear\\) or lookups"
    for m, arg in ((model, torch.randn(2, 16)), (table, torch.tensor([1, 2]))):
        with pytest.raises(qd.BackendUnavailableError, match=says):
            torch.onnx.export(m, (arg,), str(tmp_path / "m.onnx"), dynamo=False)
        assert "0._extra_state" in m.state_dict()
    assert not torch.onnx.is_in_onnx_export()


@pytest.mark.parametrize("tracing_mode", ["real", "fake", "symbolic"])
def test_make_fx_and_fake_tensors_refuse_what_they_cannot_run(tracing_mode):
    """make_fx recorded a QLinear's, q_matmul's and a lookup's output as a constant (the
    traced graph gave the first input's answer for any input); with fake tensors torch
    raised an untyped error naming .numpy().  Both now refuse, as the other tracers do."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from qdispatch.torch import QEmbedding
    layer = QLinear.from_linear(torch.nn.Linear(16, 8), SCHEMES[0], device=DEVICES[-1])
    table = QEmbedding.from_embedding(torch.nn.Embedding(10, 8), SCHEMES[0], device=DEVICES[-1])
    w = weight((16, 8), SCHEMES[0], DEVICES[-1])
    says = "can't record qdispatch's q_matmul \\(QLinear\\) or lookups \\(QEmbedding\\), nor run them on fake"
    for fn, arg in ((layer, torch.randn(2, 16)), (lambda x: q_matmul(x, w), torch.randn(2, 16)),
                    (table, torch.tensor([1, 2]))):
        with pytest.raises(qd.BackendUnavailableError, match=says):
            make_fx(fn, tracing_mode=tracing_mode)(arg)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(2, 16))
        with pytest.raises(qd.BackendUnavailableError, match=says):
            layer(fake)
    x = torch.randn(2, 16)  # eager calls are unchanged
    torch.testing.assert_close(layer(x), q_matmul(x, layer.weight.T) + layer.bias, rtol=0, atol=0)


REFERENCE_ONLY = """
import numpy as np, torch, qdispatch as qd
from qdispatch.torch import QEmbedding, QLinear, load_model, quantize_linears, save_model
import sys
assert "cpu" not in qd.available_backends()
torch.manual_seed(0)
linear, table = torch.nn.Linear(8, 4), torch.nn.Embedding(6, 4)
layer = QLinear.from_linear(linear, "q8s", device="reference")
model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)), "q8s", device="reference")
lookup = QEmbedding.from_embedding(table, "q8s", device="reference")
assert layer.weight.device == model[0].weight.device == lookup.weight.device == "reference"
layer.load_state_dict({"weight": linear.weight.detach() * 2, "bias": linear.bias.detach()})
w = qd.quantize(linear.weight.detach().numpy() * 2, "q8s", device="reference")
x = torch.randn(3, 8)
assert np.array_equal(layer(x).detach().numpy(), qd.q_matmul(x.numpy(), w.T).numpy() + linear.bias.detach().numpy())
model.register_parameter("gain", torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)))
save_model(model, sys.argv[1])
print("ok")
"""


def test_layers_asked_for_on_reference_need_no_cpu_backend(tmp_path):
    """With the cpu backend unusable (a bad QDISPATCH_ISA), layers asked for on the
    reference backend went through the default backend (cpu) and raised its error,
    and so did saving a bfloat16 parameter."""
    script = tmp_path / "reference_only.py"
    script.write_text(REFERENCE_ONLY)
    out = run_python(str(script), str(tmp_path / "model.safetensors"), QDISPATCH_ISA="bogus")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.cuda
def test_a_torch_gpu_tensor_stays_on_its_gpu_in_qdispatchs_own_calls():
    """qd.q_matmul and qd.linear copied a torch CUDA tensor to the other operand's device
    (through the host) as if it were numpy data: no BackendMismatchError next to a cpu
    weight, no DeviceMismatchError next to one on another GPU, transfer= ignored."""
    _needs_cuda()
    w = weight((4, 64), SCHEMES[0], "cpu")
    x = torch.randn(2, 64, device="cuda")
    with pytest.raises(qd.BackendMismatchError, match="lhs is on 'cuda:0', rhs is on 'cpu'"):
        qd.q_matmul(x, w.T)
    with pytest.raises(qd.BackendMismatchError, match="x is on 'cuda:0', w is on 'cpu'"):
        qd.linear(x, w)
    moved = qd.q_matmul(x, w.T, transfer="to_rhs")  # asked for: the move happens
    np.testing.assert_array_equal(moved.numpy(), qd.q_matmul(x.cpu().numpy(), w.T).numpy())
    with pytest.raises(qd.BackendMismatchError, match="linear's bias is on 'cuda:0' but the output is on 'cpu'"):
        qd.linear(x.cpu().numpy(), w, bias=torch.ones(4, device="cuda"))
    on_gpu = w.to("cuda:0")  # on its GPU, in place, as before
    torch.testing.assert_close(to_torch(qd.linear(x, on_gpu, bias=torch.ones(4, device="cuda"))),
                               x @ dequantized(w).cuda().T + 1, rtol=1e-5, atol=1e-5)
    if torch.cuda.device_count() > 1:
        with pytest.raises(qd.DeviceMismatchError):
            qd.q_matmul(x.to("cuda:1"), on_gpu.T)


@pytest.mark.cuda
def test_cuda_autocast_and_torch_func():
    _needs_cuda()
    w = weight((64, 32), SCHEMES[0], "cuda")
    x = torch.randn(4, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = q_matmul(x, w)
    expected = to_torch(qd.q_matmul(from_torch(x.to(torch.bfloat16)), w, out_dtype="bfloat16"))
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)
    batch = torch.randn(4, 3, 64, device="cuda")
    y = torch.func.vmap(lambda x: q_matmul(x, w), in_dims=1, out_dims=1)(batch)
    torch.testing.assert_close(y, batch @ dequantized(w).cuda(), rtol=1e-5, atol=1e-5)
    dx = torch.func.grad(lambda x: q_matmul(x, w).sum())(x)
    assert dx.is_cuda and torch.equal(dx, q_matmul(torch.ones(4, 32, device="cuda"), w.T))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_runs_qlinears(backend):
    torch.manual_seed(0)
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.GELU(),
                                                 torch.nn.Linear(16, 8)), SCHEMES[0], device=DEVICES[-1])
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 32)
    x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_eager, y_compiled = model(x_eager), compiled(x_compiled)
    np.testing.assert_array_equal(y_compiled.detach().numpy(), y_eager.detach().numpy())
    y_eager.sum().backward()
    y_compiled.sum().backward()
    np.testing.assert_array_equal(x_compiled.grad.numpy(), x_eager.grad.numpy())


def test_bad_inputs():
    w = weight((8, 4), SCHEMES[0], "reference")
    with pytest.raises(TypeError, match="torch tensor"):
        q_matmul(np.zeros((2, 8), np.float32), w)
    with pytest.raises(TypeError, match="int32"):
        q_matmul(torch.zeros(2, 8, dtype=torch.int32), w)
    with pytest.raises(ShapeError, match="K=8"):
        q_matmul(torch.zeros(2, 7), w)
    sparse = torch.zeros(2, 8).to_sparse()
    with pytest.raises(TypeError, match=r"dense torch tensor, got layout torch.sparse_coo: .*to_dense"):
        q_matmul(sparse, w)
    with pytest.raises(TypeError, match="from_torch expects a dense torch tensor"):
        from_torch(sparse)
    with pytest.raises(TypeError, match="got a nested one"):
        q_matmul(torch.nested.nested_tensor([torch.zeros(2, 8), torch.zeros(3, 8)], layout=torch.jagged), w)


# ---- DLPack and backends -----------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_crossings_share_memory(device):
    x = torch.randn(4, 8)
    t = from_torch(x, device=device)
    assert t.device == device and np.asarray(t).ctypes.data == x.data_ptr()
    back = to_torch(t)
    assert back.data_ptr() == x.data_ptr()
    bf = torch.randn(3, 5).to(torch.bfloat16)
    assert to_torch(from_torch(bf)).equal(bf)


def test_crossings_refuse_what_is_not_their_kind_of_tensor():
    with pytest.raises(TypeError, match="from_torch expects a torch tensor, got ndarray"):
        from_torch(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="to_torch expects a qdispatch Tensor, got ndarray"):
        to_torch(np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"got QTensor: dequantize it first"):
        to_torch(weight((8, 4), SCHEMES[0], "reference"))


@pytest.mark.parametrize("writeable", [True, False])
def test_to_torch_refuses_negative_strides(writeable):
    """torch tensors have no negative strides; torch's DLPack import of one aborts the
    process, so this runs in a child."""
    code = ("import numpy as np, qdispatch as qd\nfrom qdispatch.torch import to_torch\n"
            f"a = np.arange(6, dtype=np.float32)[::-1]\na.flags.writeable = {writeable}\n"
            "try:\n    to_torch(qd.tensor(a))\nexcept ValueError as exc:\n    print(exc)\n")
    child = run_python("-c", code)
    assert child.returncode == 0, child.stderr[-2000:]
    assert re.search(r"negative strides \(-4,\).*t\.numpy\(\)\.copy\(\)", child.stdout), child.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_negative_views_cross_with_their_values(dtype, shape):
    z = torch.complex(torch.zeros(shape, dtype=dtype), torch.full(shape, 3.0, dtype=dtype))
    imag = z.conj().imag                       # torch's lazy negation: its memory holds 3.0
    assert imag.is_neg() and imag.is_contiguous()
    np.testing.assert_array_equal(from_torch(imag).numpy(), np.full(shape, -3.0, np.float32))


def test_host_input_joins_the_weights_host_backend():
    for device in DEVICES:
        w = weight((8, 4), SCHEMES[0], device)
        assert q_matmul(torch.randn(2, 8), w).shape == (2, 4)


def test_input_on_a_device_without_backend_is_a_mismatch():
    w = weight((8, 4), SCHEMES[0], DEVICES[-1])
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(BackendMismatchError, match=f"lhs is on 'meta', rhs is on '{DEVICES[-1]}'. x is on torch's "
                                                   f"meta device, which holds no values"):
        q_matmul(x, w)


def test_cuda_input_with_host_weight_is_a_mismatch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w = weight((8, 4), SCHEMES[0], DEVICES[-1])
    with pytest.raises(BackendMismatchError, match="different backends"):
        q_matmul(torch.randn(2, 8, device="cuda"), w)


@pytest.mark.cuda
def test_cuda_round_trip_without_copies():
    _needs_cuda()
    w = weight((32, 16), SCHEMES[0], "cuda")
    x = torch.randn(4, 32, device="cuda", requires_grad=True)
    y = q_matmul(x, w)
    assert y.is_cuda
    y.sum().backward()
    torch.testing.assert_close(y.cpu(), x.detach().cpu() @ dequantized(w), rtol=1e-4, atol=1e-4)


# ---- QLinear -------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_qlinear_from_linear(device):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 12)
    layer = QLinear.from_linear(linear, QuantScheme("q8s", axis=0), device=device)
    assert layer.weight.shape == (12, 32) and layer.weight.device == device
    assert layer.scheme == QuantScheme("q8s", axis=0) == layer.weight.scheme
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    assert layer.bias.data_ptr() != linear.bias.data_ptr()
    x = torch.randn(3, 32, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ dequantized(layer.weight).T + linear.bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, linear(x), rtol=0, atol=0.05)  # q8 per channel is close
    y.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((12,), 3.0))
    torch.testing.assert_close(x.grad, torch.ones(3, 12) @ dequantized(layer.weight), rtol=1e-5, atol=1e-5)


W8A8_DEVICES = DEVICES + ["cuda"]


def _w8a8_device(device):
    if device == "cuda":
        _needs_cuda()
    return torch.device("cuda" if device == "cuda" else "cpu")


@pytest.mark.parametrize("device", [pytest.param(d, marks=pytest.mark.cuda) if d == "cuda" else d
                                    for d in W8A8_DEVICES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["q8s", QuantScheme("q8s", block=(1, 32))], ids=repr)
def test_w8a8_products_are_qdispatchs(device, dtype, act):
    """activation_scheme= quantizes x as qdispatch.q_matmul does: the same bits,
    through q_matmul, QLinear and quantize_linears alike; gradients go straight
    through x's rounding (dX = dY @ dequantize(W))."""
    where = _w8a8_device(device)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 24).to(where)
    layer = QLinear.from_linear(linear, QuantScheme("q8s", axis=0), activation_scheme=act)
    assert f"activation_scheme={act!r}" in repr(layer)
    x = torch.randn(5, 64, device=where).to(dtype)
    product = q_matmul(x, layer.weight.T, activation_scheme=act)
    assert torch.equal(product, to_torch(qd.q_matmul(from_torch(x), layer.weight.T, out_dtype=DTYPE_NAMES[dtype],
                                                     activation_scheme=act)))
    y = layer(x)  # the product in x's dtype, then the bias added, as nn.Linear's is
    assert y.dtype == dtype and y.device == x.device
    assert torch.equal(y, product + linear.bias.detach().to(dtype))
    assert not torch.equal(y, QLinear.from_linear(linear, layer.weight.scheme)(x))  # x was quantized
    model = quantize_linears(torch.nn.Sequential(linear), QuantScheme("q8s", axis=0), activation_scheme=act)
    assert model[0].activation_scheme == act and torch.equal(model(x), y)
    x.requires_grad_(True)
    dy = torch.randn(5, 24, device=where).to(dtype)
    layer(x).backward(dy)
    assert torch.equal(x.grad, q_matmul(dy, layer.weight))


def test_w8a8_refuses_float64_and_bad_schemes():
    w = weight((16, 8), SCHEMES[0], "reference")
    with pytest.raises(TypeError, match="float64 x and an activation_scheme"):
        q_matmul(torch.randn(2, 16, dtype=torch.float64), w, activation_scheme="q8s")
    with pytest.raises(qd.QuantSchemeError):
        QLinear(w.T, activation_scheme="q9s")
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 40))
    with pytest.raises(qd.QuantSchemeError):
        quantize_linears(model, SCHEMES[0], activation_scheme="int8")
    with pytest.raises(qd.QuantSchemeError, match="'1'"):  # no x of 8 values has blocks of 16 along K
        quantize_linears(model, SCHEMES[0], activation_scheme=QuantScheme("q8s", block=16))
    assert all(isinstance(layer, torch.nn.Linear) for layer in model)  # left as they were
    QLinear(w.T, activation_scheme=QuantScheme("q8s", block=(2, 8)))  # rows of x in pairs: fine for even batches
    per_channel = QLinear(w.T, activation_scheme=QuantScheme("q8s", axis=2))  # an x of three dims or more
    x = torch.randn(2, 3, 16)
    assert torch.equal(per_channel(x), q_matmul(x, w, activation_scheme=QuantScheme("q8s", axis=2)))


def test_w8a8_under_vmap_quantizes_each_sample_alone():
    """One scale for all of x (a scheme per tensor) means one per sample under vmap,
    as each sample would get called on its own; per-token names batch as they are."""
    w = weight((16, 8), SCHEMES[0], "reference")
    xs = torch.randn(3, 4, 16) * torch.tensor([1.0, 100.0, 0.01]).view(3, 1, 1)
    for act in (QuantScheme("q8s"), "q8s"):
        mapped = torch.func.vmap(lambda x: q_matmul(x, w, activation_scheme=act))(xs)
        assert torch.equal(mapped, torch.stack([q_matmul(x, w, activation_scheme=act) for x in xs]))


@pytest.mark.parametrize("device", DEVICES)
def test_the_matmul_operator_between_torch_and_a_qtensor_stays_in_torch(device):
    w = weight((16, 24), SCHEMES[0], device)
    x = torch.randn(3, 16, requires_grad=True)
    y = x @ w
    assert isinstance(y, torch.Tensor) and torch.equal(y, q_matmul(x, w))
    y.sum().backward()
    assert torch.equal(x.grad, q_matmul(torch.ones(3, 24), w.T))
    xt = torch.randn(24, 5, dtype=torch.bfloat16)
    left = w @ xt  # [16, 24] @ [24, 5]
    assert left.dtype == torch.bfloat16 and torch.equal(left, q_matmul(xt.mT, w.T).mT)
    column = torch.randn(24)
    assert torch.equal(w @ column, q_matmul(column, w.T))  # a vector on the right is a column
    batched = qd.quantize(np.ones((2, 16, 24), np.float32), "q8s", device=device)
    out = x.detach() @ batched  # a batch of weights: qdispatch's product, as before
    assert isinstance(out, qd.Tensor) and out.shape == (2, 3, 24)
    np.testing.assert_array_equal(out.numpy(), qd.q_matmul(x.detach().numpy(), batched).numpy())
    with pytest.raises(TypeError, match="needs a QTensor operand, got float32 and float32 dense data"):
        x @ qd.tensor(np.ones((16, 2), np.float32))


def test_torch_functions_multiply_by_a_layers_quantized_weight(device):
    """F.linear(x, layer.weight, layer.bias), as model code that reuses a layer's weight
    writes it (a tied output head), was torch's "must be Tensor, not QTensor": it is
    the layer's product, and so are torch.matmul and torch.mm; other torch functions
    say what to use."""
    at = torch.device("cuda" if device == "cuda" else "cpu")
    layer = QLinear.from_linear(torch.nn.Linear(16, 24), SCHEMES[0], device=device).to(at)
    x = torch.randn(3, 16, device=at, requires_grad=True)
    y = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert torch.equal(y, layer(x))
    y.sum().backward()
    assert torch.equal(x.grad, q_matmul(torch.ones(3, 24, device=at), layer.weight))
    assert torch.equal(torch.nn.functional.linear(x, layer.weight), q_matmul(x, layer.weight.T))
    bf16 = x.detach().bfloat16()
    assert torch.nn.functional.linear(bf16, layer.weight, layer.bias).dtype == torch.bfloat16  # as QLinear's
    w = layer.weight.T
    want = q_matmul(x, w)
    for product in (torch.matmul(x, w), torch.mm(x, w), x.matmul(w), x.mm(w), torch.matmul(w.T, x.mT).mT):
        assert torch.equal(product, want)
    with pytest.raises(ShapeError, match=r"mm multiplies 2-D matrices, got shapes \(16,\) and \(16, 24\)"):
        torch.mm(x[0], w)
    for call in (lambda: torch.add(x, w), lambda: torch.nn.functional.embedding(torch.tensor([1], device=at), layer.weight),
                 lambda: torch.einsum("ij,jk->ik", x, w), lambda: torch.nn.functional.linear(w, x)):
        with pytest.raises(qd.ArgumentTypeError, match=r"\(\) got a QTensor, which is not a torch tensor.*F.linear"
                                                       r"\(x, w\), torch.matmul, torch.mm and @ multiply by one.*"
                                                       r"qdispatch.torch.to_torch\(q.dequantize\(\)\)"):
            call()


def test_a_qlinear_keeps_its_shape():
    layer = QLinear(weight((6, 10), SCHEMES[0], "reference"))
    layer.weight = weight((6, 10), SCHEMES[0], "reference", seed=1)  # another of its shape: fine
    with pytest.raises(ShapeError, match=r"QLinear.weight must have shape \(6, 10\)"):
        layer.weight = weight((6, 12), SCHEMES[0], "reference")
    for other in (torch.nn.Parameter(torch.randn(6, 10)), None):
        with pytest.raises(TypeError, match="QLinear.weight must be a QTensor"):
            layer.weight = other
    assert layer.weight.shape == (6, 10) and layer.in_features == 10


def test_dtypes_another_library_gave_numpy_are_taken_as_numpy_refused_them(monkeypatch, tmp_path):
    """numpy 2.5 reads bfloat16 and float8 by DLPack in ml_dtypes' dtypes once that is
    imported (onnx and JAX import it): saving a torch bfloat16 tensor then said "Can't
    save array 'h' of dtype bfloat16", and float8 got words meant for numpy data."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    numpy_reads = np.from_dlpack

    def as_numpy_2_5_reads(obj, *args, **kwargs):
        name = str(getattr(obj, "dtype", "")).removeprefix("torch.")
        if name in ("bfloat16", "float8_e4m3fn"):
            return np.zeros(tuple(obj.shape), getattr(ml_dtypes, name))
        return numpy_reads(obj, *args, **kwargs)

    monkeypatch.setattr(np, "from_dlpack", as_numpy_2_5_reads)
    halves = torch.randn(2, 32, dtype=torch.bfloat16)
    qd.save(tmp_path / "t.safetensors", {"h": halves})
    assert torch.equal(to_torch(qd.load(tmp_path / "t.safetensors")["h"]), halves)
    for take in (qd.from_dlpack, qd.tensor):
        with pytest.raises(TypeError, match="of dtype torch.float8_e4m3fn .*convert it to float32, float16 or bfloat16"):
            take(torch.zeros(4, 32, dtype=torch.float8_e4m3fn))


def test_torch_tensors_save_and_export_as_they_are(tmp_path):
    """qdispatch.save and gguf.export read a torch tensor's values (by DLPack), as the
    safetensors library would save them."""
    plain, halves = torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.randn(2, 32, dtype=torch.bfloat16)
    qd.save(tmp_path / "t.safetensors", {"ids": plain, "h": halves})
    loaded = qd.load(tmp_path / "t.safetensors")
    np.testing.assert_array_equal(loaded["ids"], plain.numpy())
    assert loaded["h"].dtype == "bfloat16" and torch.equal(to_torch(loaded["h"]), halves)
    negated = torch.complex(torch.zeros(2, 32), torch.arange(64.0).view(2, 32)).conj().imag  # torch's lazy -x
    qd.save(tmp_path / "n.safetensors", {"n": negated})
    assert negated.is_neg() and torch.equal(torch.from_numpy(qd.load(tmp_path / "n.safetensors")["n"]), negated)
    if hasattr(torch, "float8_e4m3fn"):
        with pytest.raises(TypeError, match="Can't save 'f8', a Tensor of dtype torch.float8_e4m3fn"):
            qd.save(tmp_path / "f.safetensors", {"f8": torch.zeros(2, dtype=torch.float8_e4m3fn)})
    parameter = torch.nn.Linear(3, 2).weight  # requires grad: its values are saved
    # a float64 one was saved through qdispatch.tensor, as float32 (1e-300 became 0), and both as Tensors
    doubles = torch.nn.Parameter(torch.tensor([0.1, 1 / 3, 1e-300, 123456789.123], dtype=torch.float64))
    qd.save(tmp_path / "p.safetensors", {"p": parameter, "d": doubles})
    loaded = qd.load(tmp_path / "p.safetensors")
    assert isinstance(loaded["p"], np.ndarray) and isinstance(loaded["d"], np.ndarray)
    np.testing.assert_array_equal(loaded["p"], parameter.detach().numpy())
    assert loaded["d"].dtype == np.float64 and np.array_equal(loaded["d"], doubles.detach().numpy())
    pytest.importorskip("gguf")
    from qdispatch import gguf as qgguf
    qgguf.export(tmp_path / "t.gguf", {"h": halves, "n": negated})
    assert torch.equal(to_torch(qgguf.load(tmp_path / "t.gguf")["h"]), halves)
    assert torch.equal(to_torch(qgguf.load(tmp_path / "t.gguf")["n"]), negated)


def test_torch_devices_name_qdispatch_devices():
    assert qd.Device("cuda:1") == qd.Device.parse("cuda:1") == qd.Device("cuda", 1) and qd.Device("reference") == "reference"
    assert qd.Device.parse(torch.device("cuda", 1)) == "cuda:1" == qd.Device(torch.device("cuda", 1))
    with pytest.raises(ValueError, match="the index twice"):
        qd.Device("cuda:1", 2)
    if "cpu" not in qd.available_backends():
        pytest.skip("needs the cpu backend")
    w = qd.quantize(np.ones((4, 8), np.float32), "q8s", device=torch.device("cpu"))
    assert w.device == "cpu"
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)), SCHEMES[0], device=torch.device("cpu"))
    assert model[0].weight.device == "cpu"
    # torch's t.to(dtype) habit: .to here moves between devices, and says how to convert
    with pytest.raises(qd.ArgumentTypeError, match=r"QTensor\.to .* dtype float32: its values as floats are "
                                                   r"q\.dequantize\(\)"):
        model[0].weight.to(torch.float32)
    with pytest.raises(qd.ArgumentTypeError, match=r"dtype bfloat16: t\.astype\('bfloat16'\) converts its values"):
        qd.tensor(np.ones(2, np.float32)).to(torch.bfloat16)


def test_torchs_tensor_methods_on_qdispatch_tensors_say_where_they_are():
    """layer.weight.numel(), .detach(), .float(): a bare "no attribute" said nothing of
    how to multiply by a QTensor or get a torch tensor of it."""
    q = quantize_linears(torch.nn.Sequential(torch.nn.Linear(8, 4)), SCHEMES[0], device="reference")[0].weight
    for name in ("numel", "detach", "float", "clone", "element_size", "is_cuda"):
        with pytest.raises(AttributeError, match=rf"^'QTensor' object has no attribute '{name}': a QTensor is not a "
                                                 rf"torch tensor. Multiply by it with x @ q .*"
                                                 rf"qdispatch.torch.to_torch\(q.dequantize\(\)\), which has .{name}$"):
            getattr(q, name)
        with pytest.raises(AttributeError, match=rf"^'Tensor' object has no attribute '{name}': a qdispatch Tensor "
                                                 rf"is not a torch tensor. qdispatch.torch.to_torch\(t\) is one"):
            getattr(qd.tensor(np.ones(2, np.float32), device="reference"), name)
    assert torch.equal(to_torch(q.dequantize()), torch.from_numpy(q.dequantize().numpy()))


def test_qlinear_gradcheck_and_no_bias():
    layer = QLinear(weight((8, 16), SCHEMES[2], "reference"))
    assert layer.bias is None and "bias=False" in repr(layer)
    x = torch.randn(2, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))


def test_qlinear_bad_input():
    with pytest.raises(TypeError, match="from_linear") as refused:
        QLinear(torch.randn(4, 4))
    assert "meta" not in str(refused.value)
    # sizes, as nn.Linear takes them: the way to an empty layer to load into
    with pytest.raises(TypeError, match=r"got int: use QLinear.from_linear\(linear, scheme\) .*; for an empty "
                                        r"layer of given sizes, .* an nn.Linear built on torch's meta device"):
        QLinear(64, 32)
    with pytest.raises(TypeError, match="from_linear needs an nn.Linear, got ReLU"):
        QLinear.from_linear(torch.nn.ReLU(), SCHEMES[0])
    with pytest.raises(ShapeError, match=r"\(6,\)"):
        QLinear(weight((6, 10), SCHEMES[0], "reference"), bias=torch.zeros(5))
    with pytest.raises(TypeError, match="bias must be a float tensor, got torch.int64"):
        QLinear(weight((6, 10), SCHEMES[0], "reference"), bias=[0] * 6)
    for bad in ("abc", [[0.0], [0.0, 1.0]]):  # torch's own errors: "new(): invalid data type 'str'"
        with pytest.raises(TypeError, match=rf"QLinear bias must be a float tensor \(or array\), got "
                                            rf"{type(bad).__name__} "):
            QLinear(weight((6, 10), SCHEMES[0], "reference"), bias=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_qlinear_host_moves_and_dtype_changes_keep_the_weight(device):
    layer = QLinear(weight((6, 10), SCHEMES[0], device), bias=torch.zeros(6))
    w = layer.weight
    model = torch.nn.Sequential(layer).to("cpu").cpu().double()
    assert model[0].weight is w  # already on the host: not moved, not converted
    assert layer.bias.dtype == torch.float64
    x = torch.randn(2, 10)
    torch.testing.assert_close(model(x), x @ dequantized(w).T, rtol=1e-5, atol=1e-5)


def test_qlinear_refused_move_leaves_the_layer_as_it_was():
    layer = QLinear(weight((6, 10), SCHEMES[0], DEVICES[-1]), bias=torch.zeros(6))
    w = layer.weight
    with pytest.raises(qd.BackendUnavailableError, match="can't move to torch device 'meta'"):
        layer.to("meta")
    assert layer.weight is w and layer.bias.device.type == "cpu"


@pytest.mark.cuda
def test_qlinear_moves_its_weight_with_the_module():
    _needs_cuda()
    torch.manual_seed(0)
    host = QLinear.from_linear(torch.nn.Linear(64, 24), QuantScheme("q4s", block=32, store="packed_u32"),
                               device=DEVICES[-1])
    values, scales = host.weight.values, host.weight.scales
    x = torch.randn(3, 64)
    want = host(x)
    model = torch.nn.Sequential(host).cuda()  # as a model is moved: every submodule
    assert str(host.weight.device) == "cuda:0" and host.bias.is_cuda
    torch.testing.assert_close(model(x.cuda()).cpu(), want, rtol=1e-5, atol=1e-5)
    model.to("cpu")
    assert host.weight.device.is_host and not host.bias.is_cuda
    np.testing.assert_array_equal(host.weight.values, values)  # a move never changes values
    np.testing.assert_array_equal(host.weight.scales, scales)


def test_qlinear_state_dict_round_trip_through_torch_save(tmp_path):
    torch.manual_seed(0)
    scheme = QuantScheme("q4f", block=(1, 16), store="packed_u32", scale_dtype="bf16")
    layer = QLinear.from_linear(torch.nn.Linear(32, 12), scheme, device=DEVICES[-1])
    model = torch.nn.Sequential(layer)
    assert sorted(model.state_dict()) == ["0._extra_state", "0.bias"]
    torch.save(model.state_dict(), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)  # torch's safe loader takes it
    fresh = torch.nn.Sequential(QLinear.from_linear(torch.nn.Linear(32, 12), QuantScheme("q8s"),
                                                    device=DEVICES[0]))
    fresh.load_state_dict(state)
    got = fresh[0].weight
    assert got.device == DEVICES[0] and got.scheme == scheme  # where the replaced weight was
    np.testing.assert_array_equal(got.values, layer.weight.values)
    np.testing.assert_array_equal(got.scales, layer.weight.scales)
    x = torch.randn(5, 32)
    torch.testing.assert_close(fresh(x), model(x), rtol=1e-5, atol=1e-5)  # another backend's sums
    narrow = torch.nn.Sequential(QLinear(weight((12, 16), SCHEMES[0], DEVICES[0])))
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\._extra_state: .*shape \(12, 32\).*\(12, 16\)"):
        narrow.load_state_dict({"0._extra_state": state["0._extra_state"]})  # reported as torch reports a size
    foreign = {**state["0._extra_state"], "qvalues": state["0._extra_state"]["qvalues"].numpy()}
    for bad, named in ((None, "got NoneType"), (foreign, "'qvalues': 'ndarray'"),
                       ({"weight": torch.zeros(12, 32)}, "got {'weight': 'Tensor'}")):
        with pytest.raises(qd.SerializationError, match=f"dict of tensors 'qvalues' and 'qscales'.*{named}"):
            fresh.load_state_dict({**state, "0._extra_state": bad})


STORED = [  # (scheme, torch dtypes of the stored values and scales)
    (QuantScheme("q4f", block=(1, 4), store="packed_u32", scale_dtype="bf16"), torch.int32, torch.bfloat16),
    (QuantScheme("q2s", block=(4, 4), store="packed_u32", scale_dtype="f16"), torch.int32, torch.float16),
    (QuantScheme("q8s", axis=1), torch.int8, torch.float32),
]


@pytest.mark.parametrize("scheme, values_dtype, scales_dtype", STORED, ids=["int4 bf16", "int2 f16", "int8"])
@pytest.mark.parametrize("transposed", [False, True], ids=["", "transposed"])
def test_state_dict_holds_the_weight_as_qdispatch_stores_it(tmp_path, scheme, values_dtype, scales_dtype,
                                                             transposed):
    """The extra state is as compact as a save_model file: packed words and 16-bit
    scales as they are stored (a 4-bit weight in half an int8 one's bytes), and it
    loads back bit for bit, a K that does not fill the last word included."""
    torch.manual_seed(0)
    w = qd.quantize(np.random.default_rng(1).standard_normal((36, 24) if transposed else (24, 36)).astype(np.float32),
                    scheme, device=DEVICES[-1])
    layer = QLinear(w.T if transposed else w)
    state = layer.state_dict()["_extra_state"]
    values, scales = state["qvalues"], state["qscales"]
    per_word = 32 // scheme.bits if scheme.store == "packed_u32" else 1
    assert values.dtype == values_dtype and tuple(values.shape) == (w.shape[0], -(-w.shape[1] // per_word))
    assert scales.dtype == scales_dtype and state["shape"] == list(layer.weight.shape)
    torch.save(layer.state_dict(), tmp_path / "layer.pt")
    fresh = QLinear(qd.quantize(np.zeros(layer.weight.shape, np.float32), "q8s", device=DEVICES[0]))
    fresh.load_state_dict(torch.load(tmp_path / "layer.pt", weights_only=True))
    assert fresh.weight.scheme == layer.weight.scheme and fresh.weight.transposed == transposed
    np.testing.assert_array_equal(fresh.weight.values, layer.weight.values)
    np.testing.assert_array_equal(fresh.weight.scales, layer.weight.scales)


def test_a_state_dict_of_the_earlier_format_still_loads():
    """A state dict saved by earlier releases (int8 values, float32 scales, no
    format) loads bit for bit."""
    scheme = QuantScheme("q4f", block=(1, 8), store="packed_u32", scale_dtype="bf16")
    layer = QLinear.from_linear(torch.nn.Linear(40, 12), scheme, device=DEVICES[-1])
    values, scales, stored_scheme, transposed = qd.tensor_api.qtensor_stored(layer.weight)
    earlier = {"qvalues": torch.tensor(values), "qscales": torch.tensor(scales),
               "scheme": stored_scheme.to_record(), "transposed": transposed}
    fresh = QLinear.from_linear(torch.nn.Linear(40, 12), "q8s", device=DEVICES[0])
    fresh.load_state_dict({"_extra_state": earlier, "bias": layer.bias.detach()})
    np.testing.assert_array_equal(fresh.weight.values, layer.weight.values)
    np.testing.assert_array_equal(fresh.weight.scales, layer.weight.scales)


@pytest.mark.parametrize("scheme", [QuantScheme("q4f", block=(1, 4), store="packed_u32", scale_dtype="bf16"),
                                    QuantScheme("q8s", axis=0, scale_dtype="bf16")], ids=["packed", "bf16 scales"])
def test_a_state_dict_that_lost_its_format_is_refused_by_name(scheme):
    """A state without "format" is read as the earlier format's int8 values and float32
    scales.  A current one that lost the key raised a bare TypeError for its packed
    words, or took its bfloat16 scales' bits for numbers; now it is a
    SerializationError naming the layer, and the layer is left as it was."""
    model = torch.nn.Sequential(QLinear.from_linear(torch.nn.Linear(12, 8), scheme, device=DEVICES[-1]))
    state = model.state_dict()
    state["0._extra_state"] = {key: value for key, value in state["0._extra_state"].items() if key != "format"}
    part, stored = ("qvalues", "torch.int32") if scheme.store == "packed_u32" else ("qscales", "torch.bfloat16")
    fresh = QLinear.from_linear(torch.nn.Linear(12, 8), "q8s", device=DEVICES[0])
    before = fresh.weight
    with pytest.raises(qd.SerializationError, match=rf"^0\._extra_state: a QLinear's _extra_state {part!r} without "
                                                     rf"a 'format' .*; got {stored} .*'format': 2"):
        torch.nn.Sequential(fresh).load_state_dict(state)
    assert fresh.weight is before


def test_a_damaged_state_dict_is_refused_by_name():
    scheme = QuantScheme("q4f", block=(1, 4), store="packed_u32", scale_dtype="bf16")
    layer = QLinear.from_linear(torch.nn.Linear(36, 12), scheme, device=DEVICES[-1])
    state = layer.state_dict()["_extra_state"]
    stray = {**state, "qvalues": state["qvalues"].clone()}
    stray["qvalues"][0, -1] = -1  # the last word holds 4 of its 36 values, in 16 bits: set the rest
    unpacked = {**state, "qvalues": torch.zeros(12, 36, dtype=torch.int8)}
    nan = {**state, "qscales": state["qscales"].clone().fill_(float("nan"))}
    future = {**state, "format": 3}
    turned = {**state, "qscales": state["qscales"].T.contiguous()}  # as many scales, in another grid
    fresh = QLinear.from_linear(torch.nn.Linear(36, 12), scheme, device=DEVICES[0])
    for bad, said in ((stray, "packed words have bits set outside their 36 values"),
                      (turned, r"'qscales' .*of shape \(12, 9\); got torch\.\w+ \(9, 12\)"),
                      (unpacked, r"'qvalues' .*is a torch.int32 tensor of shape \(12, 5\); got torch.int8 \(12, 36\)"),
                      (nan, "scales hold NaN"), (future, "'format' 2.*'format': 'int'")):
        with pytest.raises(qd.SerializationError, match=said):
            fresh.load_state_dict({"_extra_state": bad, "bias": layer.bias.detach()})


@pytest.mark.parametrize("device", DEVICES)
def test_qlinear_loaded_from_a_state_dict_owns_its_weight(device):
    torch.manual_seed(0)
    source = QLinear.from_linear(torch.nn.Linear(16, 8), SCHEMES[0], device=device)
    state = copy.deepcopy(source.state_dict())
    layer = QLinear.from_linear(torch.nn.Linear(16, 8), SCHEMES[0], device=device)
    layer.load_state_dict(state)
    x = torch.randn(3, 16)
    expected = source(x)
    state["_extra_state"]["qvalues"].zero_()   # the caller's tensors, edited after the load
    state["_extra_state"]["qscales"].fill_(100)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    np.testing.assert_array_equal(layer.weight.values, source.weight.values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", [SCHEMES[0], QuantScheme("q8s", axis=0),
                                    QuantScheme("q4f", block=16, store="packed_u32", scale_dtype="f16")], ids=repr)
def test_qlinear_state_dict_is_a_copy_of_its_weight(device, scheme):
    """Parts the state dict shares with no one (packed words, converted scales) go
    to torch without a copy; those that would share the weight's storage are copied."""
    torch.manual_seed(0)
    layer = QLinear.from_linear(torch.nn.Linear(16, 8), scheme, device=device)
    values, scales = layer.weight.values, layer.weight.scales
    x = torch.randn(3, 16)
    expected = layer(x)
    state = layer.state_dict()["_extra_state"]
    state["qvalues"].zero_()
    state["qscales"].zero_()
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)
    np.testing.assert_array_equal(layer.weight.values, values)
    np.testing.assert_array_equal(layer.weight.scales, scales)


def test_qlinear_deepcopy_and_pickle(tmp_path):
    layer = QLinear(weight((16, 8), SCHEMES[2], DEVICES[-1]).T, bias=torch.randn(8))  # a transposed view
    twin = copy.deepcopy(layer)
    assert twin.weight is not layer.weight and twin.weight.device == layer.weight.device
    x = torch.randn(2, 16)
    torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)
    torch.save(layer, tmp_path / "layer.pt")  # the whole module, pickled
    again = torch.load(tmp_path / "layer.pt", weights_only=False)
    torch.testing.assert_close(again(x), layer(x), rtol=0, atol=0)


# ---- whole models ----------------------------------------------------------------------

class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 64)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(), _Block(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 48))


def test_quantize_linears_replaces_every_linear_in_place():
    scheme, device = QuantScheme("q8s", axis=0), DEVICES[-1]
    model, x = _model(), torch.randn(5, 32)
    expected = copy.deepcopy(model)  # each layer replaced by hand
    for block in expected[:2]:
        block.up = QLinear.from_linear(block.up, scheme, device=device)
        block.down = QLinear.from_linear(block.down, scheme, device=device)
    expected[3] = QLinear.from_linear(expected[3], scheme, device=device)
    with torch.no_grad():
        float_out = model(x)
        assert quantize_linears(model, scheme, device=device) is model
        assert [n for n, m in model.named_modules() if isinstance(m, QLinear)] == \
            ["0.up", "0.down", "1.up", "1.down", "3"]
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert model[3].weight.device == device and model[0].down.bias is None
        torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)
        torch.testing.assert_close(model(x), float_out, rtol=0, atol=0.05)


def test_a_float64_layer_past_float32_range_is_named_by_its_value():
    """A float64 weight is narrowed to the float32 quantize works in: a finite value
    past its range is named as it is, with the layer, not as an inf it never held;
    values within it quantize as the float32 weight does."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 4)).double()
    expected = QLinear.from_linear(copy.deepcopy(model[0]).float(), SCHEMES[0], device=DEVICES[-1])
    np.testing.assert_array_equal(QLinear.from_linear(model[0], SCHEMES[0], device=DEVICES[-1]).weight.values,
                                  expected.weight.values)
    with torch.no_grad():
        model[1].weight[1, 2] = -1e300
    with pytest.raises(qd.NonFiniteError, match=r"^layer '1' \(4 -> 4 features\): .*holding -1e\+300 at position "
                                                r"\(1, 2\).*scale the data down"):
        quantize_linears(model, SCHEMES[0])


def test_quantize_linears_skips_layers_by_name_or_predicate():
    scheme = QuantScheme("q8s", axis=0)
    model = quantize_linears(_model(), scheme, skip=["3", "0.down"])
    assert type(model[3]) is torch.nn.Linear and type(model[0].down) is torch.nn.Linear
    assert isinstance(model[0].up, QLinear) and isinstance(model[1].down, QLinear)
    assert type(quantize_linears(_model(), scheme, skip="3")[3]) is torch.nn.Linear  # one name
    model = quantize_linears(_model(), scheme, skip=["0"])  # a block's name keeps all its Linears
    assert type(model[0].up) is torch.nn.Linear and type(model[0].down) is torch.nn.Linear
    assert isinstance(model[1].up, QLinear) and isinstance(model[1].down, QLinear) and isinstance(model[3], QLinear)
    for holds_none in (["2"], ["0.act"]):  # a LayerNorm, a GELU: modules holding no Linear
        with pytest.raises(qd.ArgumentError, match=re.escape(f"skip names {holds_none} that are not nn.Linear "
                                                             f"layers of the model, nor modules holding some")):
            quantize_linears(_model(), scheme, skip=holds_none)
    model = _model()
    with pytest.raises(ValueError, match=r"skip names \['0.dwn'\] that are not nn.Linear.*'0.down'"):
        quantize_linears(model, scheme, skip=["0.dwn"])  # misspelt: refused, nothing changed
    assert not any(isinstance(m, QLinear) for m in model.modules())
    with pytest.raises(ValueError, match=r"skip names \[0, '0.dwn'\] that are not"):
        quantize_linears(_model(), scheme, skip=(name for name in ["0.dwn", 0, "3"]))  # a generator
    with pytest.raises(TypeError, match=r"skip takes layer names or a function .* got int"):
        quantize_linears(_model(), scheme, skip=3)
    assert isinstance(quantize_linears(_model(), scheme, skip=None)[3], QLinear)  # None: no layer kept
    with pytest.raises(TypeError, match="quantize_linears takes a torch.nn.Module, got list"):
        quantize_linears([torch.nn.Linear(8, 4)], scheme)
    model = quantize_linears(_model(), scheme, skip=lambda name, linear: linear.out_features == 64)
    assert type(model[0].up) is torch.nn.Linear and isinstance(model[0].down, QLinear)
    linear = torch.nn.Linear(32, 8)
    assert isinstance(quantize_linears(linear, scheme), QLinear)  # a model that is one Linear
    assert quantize_linears(linear, scheme, skip=lambda *_: True) is linear
    assert quantize_linears(linear, scheme, skip=[""]) is linear  # its own name
    with pytest.raises(qd.ArgumentError, match=r"skip names \['lm_haed'\] that are not nn.Linear layers"):
        quantize_linears(linear, scheme, skip=["lm_haed"])  # was quantized, the misspelling unseen


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_a_layer_under_the_old_weight_norm_is_refused_until_folded(norm):
    """The hook of torch.nn.utils.weight_norm (spectral_norm) went onto the QLinear,
    where it rebuilt the float weight at each call from parameters the QLinear does not
    have: quantizing passed, every call then failed with an AttributeError."""
    import warnings
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the hook versions
        layer = getattr(torch.nn.utils, norm)(torch.nn.Linear(8, 4))
    model = torch.nn.Sequential(layer)
    with pytest.raises(qd.ArgumentError, match=rf"layer '0' \(8 -> 4 features\): QLinear can't take a layer "
                                               rf"under torch.nn.utils.{norm}: fold it into the weight first with "
                                               rf"torch.nn.utils.remove_{norm}\(layer\).*skip=\['0'\]"):
        quantize_linears(model, QuantScheme("q8s", axis=0))
    assert model[0] is layer  # nothing replaced
    getattr(torch.nn.utils, f"remove_{norm}")(layer)
    x = torch.randn(2, 8)
    want = layer(x)
    quantize_linears(model, QuantScheme("q8s", axis=0))
    torch.testing.assert_close(model(x), want, rtol=0.05, atol=0.05)
    parametrized = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(8, 4))
    want = parametrized(x)
    torch.testing.assert_close(quantize_linears(parametrized, QuantScheme("q8s", axis=0))(x), want,
                               rtol=0.05, atol=0.05)


def test_quantize_linears_keeps_shared_layers_shared():
    shared = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    quantize_linears(model, QuantScheme("q8s", axis=0))
    assert isinstance(model[0], QLinear) and model[0] is model[2]


def test_a_shared_layer_skipped_by_one_of_its_names_stays_float_and_shared():
    """named_modules() names a shared layer once ('0'): skipping it by that name
    quantized its other place ('2') and split the sharing."""
    shared = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    for skip in (["0"], ["2"]):
        quantize_linears(model, QuantScheme("q8s", axis=0), skip=skip)
        assert model[0] is model[2] is shared


class _Scaled(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 10


def test_a_linear_with_a_forward_of_its_own_is_not_replaced_silently():
    """A subclass's forward (here, times 10) was dropped by the QLinear put in its place."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _Scaled(16, 8))
    with pytest.raises(ValueError, match=r"layers \['1'\] are subclasses of nn.Linear with a forward of their "
                                         r"own, which QLinear would not run: keep them in float with skip=\['1'\]"):
        quantize_linears(model, QuantScheme("q8s", axis=0))
    assert type(model[0]) is torch.nn.Linear  # nothing replaced
    quantize_linears(model, QuantScheme("q8s", axis=0), skip=["1"])
    assert isinstance(model[0], QLinear) and type(model[1]) is _Scaled
    with pytest.raises(ValueError, match="forward of their own"):
        quantize_linears(_Scaled(16, 8), QuantScheme("q8s", axis=0))


def test_a_lazy_linear_not_sized_yet_is_named_and_nothing_is_replaced():
    """torch's "Attempted to use an uninitialized parameter", untyped and naming no layer."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LazyLinear(3))
    for target in (model, model[1]):
        with pytest.raises(qd.ArgumentError, match=r"layers \['(1)?'\] are lazy \(nn.LazyLinear\) and have no weight "
                                                   r"yet: run the model on an input once"):
            quantize_linears(target, "q8s")
    assert type(model[0]) is torch.nn.Linear  # nothing replaced
    x = torch.randn(2, 4)
    expected = model(x)  # sizes the lazy layer
    quantize_linears(model, "q8s")
    assert all(isinstance(layer, QLinear) for layer in model)
    assert torch.allclose(model(x), expected, rtol=0.05, atol=0.05)


def test_a_frozen_bias_stays_frozen():
    linear = torch.nn.Linear(16, 8)
    linear.bias.requires_grad_(False)
    assert not QLinear.from_linear(linear, QuantScheme("q8s", axis=0)).bias.requires_grad
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(16, 8)), QuantScheme("q8s", axis=0))
    assert model[0].bias.requires_grad


def test_quantize_linears_names_the_layer_that_does_not_fit_and_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 30))
    scheme = QuantScheme("q4f", block=(1, 32), store="packed_u32")  # 32 along in_features
    with pytest.raises(qd.QuantSchemeError, match=r"layer '1' \(8 -> 30 features\).*skip=\['1'\]"):
        quantize_linears(model, scheme)
    assert all(type(m) is torch.nn.Linear for m in model)
    quantize_linears(model, scheme, skip=["1"])
    assert isinstance(model[0], QLinear) and type(model[1]) is torch.nn.Linear


def test_quantize_linears_refuses_a_bad_scheme_and_weights_without_values():
    with pytest.raises(qd.QuantSchemeError, match="Expected a QuantScheme.*got 42"):
        quantize_linears(_model(), 42)
    # a device that is no device, or one this build or machine lacks, is no layer's fault:
    # the error is the device's own, not one naming a layer and telling to skip it
    missing = "cuda:7" if "cuda" in qd.available_backends() else "cuda"
    for device in ("bogus", missing):
        model = _model()
        with pytest.raises(qd.QDispatchError) as refused:
            quantize_linears(model, "q8s", device=device)
        assert "layer" not in str(refused.value) and "skip" not in str(refused.value)
        with pytest.raises(type(refused.value), match=re.escape(str(refused.value))):
            qd.tensor(np.ones(2, np.float32), device=device)
        assert not any(isinstance(m, QLinear) for m in model.modules())
    with pytest.raises(qd.BackendUnavailableError, match="'meta' has no values.*load"):
        from_torch(torch.empty(3, 4, device="meta"))


def test_quantize_linears_of_an_empty_model_then_load_state_dict(tmp_path):
    """A model built on torch's meta device (no float weights in memory), made quantized
    and loaded from a quantized checkpoint: the same layers as the saved ones."""
    scheme = QuantScheme("q4f", block=(1, 32), store="packed_u32")
    source = quantize_linears(_model(), scheme)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    with torch.device("meta"):
        model = _model()
    quantize_linears(model, scheme)
    assert [type(m).__name__ for m in model[0].children()] == ["QLinear", "GELU", "QLinear"]
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), assign=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    np.testing.assert_array_equal(model[3].weight.values, source[3].weight.values)


class _WithComputedBuffer(torch.nn.Module):
    """A buffer no checkpoint holds (persistent=False), as rotary embeddings' inv_freq."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(32, 16)
        self.register_buffer("inv_freq", torch.arange(1.0, 17.0), persistent=False)

    def forward(self, x):
        return self.linear(x) * self.inv_freq


def test_load_model_names_the_buffers_a_meta_build_left_without_values(tmp_path):
    """A Llama built under torch.device('meta') and loaded kept its rotary buffers on
    meta, silently, and its forward failed with torch's "Cannot copy out of meta tensor"."""
    from torch.nn.modules.module import register_module_parameter_registration_hook
    scheme = QuantScheme("q8s", axis=0)
    source = quantize_linears(_WithComputedBuffer(), scheme)
    save_model(source, tmp_path / "m.safetensors")
    with torch.device("meta"):
        everything_on_meta = quantize_linears(_WithComputedBuffer(), scheme)
    with pytest.warns(UserWarning, match=r"load_model left 1 tensor\(s\) of the model on torch's meta device, which "
                                         r"the file does not hold: inv_freq\. A buffer made with persistent=False"):
        load_model(everything_on_meta, tmp_path / "m.safetensors")
    # the README's way: parameters on meta, buffers computed
    to_meta = register_module_parameter_registration_hook(
        lambda module, name, p: None if p is None else torch.nn.Parameter(p.to("meta"), p.requires_grad))
    try:
        model = _WithComputedBuffer()
    finally:
        to_meta.remove()
    assert model.linear.weight.is_meta and not model.inv_freq.is_meta
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(quantize_linears(model, scheme), tmp_path / "m.safetensors")
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)


def test_a_quantized_checkpoint_brings_its_weights_scheme():
    """A layer takes the checkpoint's quantized weight as it is, scheme and all (a model
    of mixed schemes loads into layers made with any one), as the README says."""
    state = quantize_linears(_model(), QuantScheme("q8s", axis=0)).state_dict()
    model = quantize_linears(_model(), QuantScheme("q4f", block=(1, 32), store="packed_u32"))
    model.load_state_dict(state)
    assert model[3].scheme == QuantScheme("q8s", axis=0)


def test_a_meta_built_model_loaded_without_assign_names_its_meta_bias():
    """Without assign=True torch copies nothing into the meta bias (it only warns), while
    the quantized weight took its values: the layer then failed in forward with torch's
    'Tensor on device meta' error, naming neither the layer nor the fix."""
    scheme = QuantScheme("q8s", axis=0)
    state = quantize_linears(_model(), scheme).state_dict()
    with torch.device("meta"):
        model = _model()
    quantize_linears(model, scheme)
    with pytest.warns(UserWarning), \
            pytest.raises(RuntimeError, match=r"Cannot load 0\.up\.bias: this QLinear was made on torch's meta device, "
                                              r"and a load without assign=True copies nothing into its meta bias"):
        model.load_state_dict(state)
    model.load_state_dict(state, assign=True)
    assert not model[3].bias.is_meta


def test_a_qlinears_input_errors_name_what_the_layer_takes():
    layer = quantize_linears(torch.nn.Sequential(torch.nn.Linear(64, 24)), QuantScheme("q8s", axis=0))[0]
    with pytest.raises(ShapeError, match=r"^QLinear\(in_features=64, out_features=24\) got x of shape \(5, 32\) "
                                         r"and dtype torch\.float32: "):
        layer(torch.randn(5, 32))
    with pytest.raises(TypeError, match=r"^QLinear\(in_features=64, out_features=24\) got x of shape \(5, 64\) "
                                        r"and dtype torch\.int64: "):
        layer(torch.ones(5, 64, dtype=torch.long))


def test_a_float_checkpoint_loads_into_qlinears_quantizing_as_it_goes():
    """A model built empty and made quantized takes an nn.Linear checkpoint: each
    layer quantizes its float weight as it loads (the float model never exists whole)."""
    scheme = QuantScheme("q4f", block=(1, 32), store="packed_u32")
    float_model = _model()
    expected = quantize_linears(copy.deepcopy(float_model), scheme)
    with torch.device("meta"):
        model = _model()
    quantize_linears(model, scheme)
    model.load_state_dict(float_model.state_dict(), assign=True)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)
    assert model[3].weight.scheme == expected[3].weight.scheme
    wrong = float_model.state_dict()
    wrong["3.weight"] = torch.randn(48, 31)
    with pytest.raises(RuntimeError, match=r"size mismatch for 3.weight.*\(48, 31\).*\(48, 32\)"):
        quantize_linears(_model(), scheme).load_state_dict(wrong)
    wrong["3.weight"] = torch.full((48, 32), float("nan"))
    with pytest.raises(qd.NonFiniteError, match=r"^3\.weight: .*nan"):
        quantize_linears(_model(), scheme).load_state_dict(wrong)


@pytest.mark.parametrize("quantized", [True, False])
def test_a_meta_state_into_a_layer_with_values_is_an_error_as_torch_gives(quantized):
    """A state of meta tensors (a quantized model not yet loaded, or a float one built on
    the meta device) has no values: loaded into a model with values, its QLinears took
    them as zeros that refuse to run, where torch's parameters raise. Now they raise too,
    keep their weights, and take it under assign=True."""
    scheme = QuantScheme("q8s", axis=0)
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False))
    state = (quantize_linears(empty, scheme) if quantized else empty).state_dict()
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)), scheme)
    x, before = torch.randn(2, 8), model[0].weight
    with torch.no_grad():
        want = model(x)
    key = "0._extra_state" if quantized else "0.weight"
    with pytest.raises(RuntimeError, match=re.escape(f"Cannot load {key}: it holds meta tensors, with no values "
                                                     f"to copy into this QLinear's weight")):
        model.load_state_dict(state)
    assert model[0].weight is before
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    model.load_state_dict(state, assign=True)  # replaces it, as torch's assign does
    with pytest.raises(qd.BackendUnavailableError, match="holds no values until a checkpoint loads"):
        model(x)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_a_thread_held_the_layers_lock_makes_layers():
    """The lock over which layers share a weight, held by another thread at a fork,
    stayed held in the child: its first QLinear waited forever."""
    import qdispatch.torch as qtorch
    scheme = QuantScheme("q8s", axis=0)
    with qtorch._HOLDERS_LOCK:  # as a thread inside it at the fork would
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)  # a hang fails the test instead of stalling it
                layer = quantize_linears(torch.nn.Linear(8, 4), scheme)
                code = 0 if isinstance(layer, QLinear) else 1
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_quantize_linears_carries_the_layers_hooks():
    """Forward and backward hooks on a Linear went with it when its QLinear took its
    place: the quantized model lost what they did."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    calls = []
    layer.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    layer.register_forward_hook(lambda module, args, out: out + 100)
    layer.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(type(module).__name__))
    scheme = QuantScheme("q8s", axis=0)
    model = quantize_linears(torch.nn.Sequential(layer), scheme)
    assert isinstance(model[0], QLinear)
    x = torch.randn(3, 8, requires_grad=True)
    w = dequantized(model[0].weight)
    torch.testing.assert_close(model(x), (2 * x) @ w.T + layer.bias + 100, rtol=1e-5, atol=1e-4)
    model(x).sum().backward()
    assert calls == ["QLinear"]


def test_to_torch_copies_read_only_memory():
    """torch has no read-only tensors: its alias of an immutable bytes object was
    written through (and of a read-only mmap, the write killed the process)."""
    data = np.arange(4, dtype=np.float32).tobytes()
    for dtype in ("float32", "bfloat16"):
        t = qd.tensor(np.frombuffer(data, np.float32), dtype=dtype) if dtype == "float32" else \
            qd.tensor(np.frombuffer(data, np.uint16), dtype="bfloat16")
        view = to_torch(t)
        view.zero_()
        assert data == np.arange(4, dtype=np.float32).tobytes()
    writable = qd.tensor(np.arange(4, dtype=np.float32))
    assert to_torch(writable).data_ptr() == np.asarray(writable).ctypes.data  # shared where it may be


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_writable_torch_tensor_crosses_writable_both_ways(dtype):
    """bfloat16 crossed by DLPack's unversioned capsule, which numpy reads as read-only:
    to_torch then copied (writes no longer reached x) and torch.from_dlpack refused it."""
    x = torch.zeros(4, dtype=dtype)
    for t in (from_torch(x), qd.from_dlpack(x)):
        back = to_torch(t)
        assert back.data_ptr() == x.data_ptr()
        back[1] = 3
        assert x[1] == 3
        assert torch.from_dlpack(t).data_ptr() == x.data_ptr()
        x.zero_()
    shared = torch.zeros(4, dtype=dtype)
    shared.share_memory_()
    assert to_torch(from_torch(shared)).data_ptr() == shared.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_model_and_load_model_through_safetensors(tmp_path, dtype):
    """A quantized model as one safetensors file (no pickle), loaded into the same
    structure built empty: the same outputs, bit for bit."""
    safetensors = pytest.importorskip("safetensors")
    scheme = QuantScheme("q4f", block=(1, 32), store="packed_u32", scale_dtype="f16")
    source = quantize_linears(_model().to(dtype), scheme)
    source.register_buffer("steps", torch.arange(5))
    source.register_buffer("imag", torch.complex(torch.zeros(3), torch.ones(3)).conj().imag)  # a negative view
    path = tmp_path / "model.safetensors"
    save_model(source, path)
    with safetensors.safe_open(path, "np") as f:  # any safetensors reader sees the parts
        assert {"0.up.weight.qvalues", "0.up.weight.qscales", "0.up.bias", "2.weight", "steps"} <= set(f.keys())
    with torch.device("meta"):
        model = _model().to(dtype)
        model.register_buffer("steps", torch.empty(5, dtype=torch.long))
        model.register_buffer("imag", torch.empty(3))
    assert load_model(quantize_linears(model, scheme), path) is model
    x = torch.randn(3, 32, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)
    assert torch.equal(model.steps, source.steps) and model[2].weight.dtype == dtype
    assert model.imag.tolist() == [-1.0] * 3
    loaded_in_place = quantize_linears(_model().to(dtype), scheme)  # a model with values: copied into
    loaded_in_place.register_buffer("steps", torch.zeros(5, dtype=torch.long))
    loaded_in_place.register_buffer("imag", torch.zeros(3))
    load_model(loaded_in_place, path)
    with torch.no_grad():
        torch.testing.assert_close(loaded_in_place(x), source(x), rtol=0, atol=0)


def test_save_model_and_load_model_keep_a_shared_layer(tmp_path):
    def tied():
        torch.manual_seed(0)
        layer = torch.nn.Linear(32, 32)
        return quantize_linears(torch.nn.Sequential(layer, torch.nn.GELU(), layer), SCHEMES[0])

    source, path = tied(), tmp_path / "model.safetensors"
    save_model(source, path)
    with torch.device("meta"):
        model = tied()
    load_model(model, path)
    assert model[0] is model[2]
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_model_built_empty_loads_float_and_quantized_checkpoints(tmp_path):
    """The GPU flow: a model built on the meta device, made quantized on cuda, filled
    from a float checkpoint or a save_model file, then moved with .to('cuda')."""
    _needs_cuda()
    scheme = QuantScheme("q4f", block=(1, 32), store="packed_u32")
    float_model = _model()
    expected = quantize_linears(copy.deepcopy(float_model), scheme, device="cuda").to("cuda")
    path = tmp_path / "model.safetensors"
    save_model(expected, path)
    x = torch.randn(3, 32, device="cuda")
    with torch.no_grad():
        want = expected(x)
    for fill in (lambda m: m.load_state_dict(float_model.state_dict(), assign=True),
                 lambda m: load_model(m, path)):
        with torch.device("meta"):
            model = _model()
        fill(quantize_linears(model, scheme, device="cuda"))
        model.to("cuda")
        assert str(model[3].weight.device) == "cuda:0" and model[3].bias.is_cuda
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=0, atol=0)


# ---- CUDA graphs and torch's default stream --------------------------------------------

GRAPH_SCHEMES = {"int8 per channel": QuantScheme("q8s", axis=0),
                 "int4 block 128": QuantScheme("q4s", block=(1, 128), store="packed_u32"),
                 "int4 block 32": QuantScheme("q4f", block=(1, 32), store="packed_u32"),
                 "int8 blocks of 8": QuantScheme("q8f", block=(1, 8)),  # on the float units: too fine for tiles
                 "int8 per input channel": QuantScheme("q8s", axis=1)}  # x scaled first, into the graph's pool


def _cuda_qlinear(K, N, scheme, seed=0):
    torch.manual_seed(seed)
    return QLinear.from_linear(torch.nn.Linear(K, N), scheme, device="cuda").to("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 16, 64, 300, 400])
@pytest.mark.parametrize("scheme", list(GRAPH_SCHEMES))
def test_cuda_qlinear_replays_inside_a_cuda_graph(monkeypatch, scheme, rows, dtype):
    """A QLinear captured in torch.cuda.graph, replayed on new inputs: each replay's
    output is what the layer computes eagerly, bit for bit: the same kernels run,
    the decode kernel or, from the backend's threshold of rows, the GEMM with its
    temporaries from the graph's pool."""
    _needs_cuda()
    if dtype != torch.bfloat16 and rows not in (1, 16, 400):
        pytest.skip("other dtypes at 1, 16 and 400 rows only")
    K, N = (4096, 4096) if rows == 16 else (512, 384)  # 16 x 4096^2: splits of K in device memory
    layer = _cuda_qlinear(K, N, GRAPH_SCHEMES[scheme])
    static_x = torch.randn(rows, K, device="cuda", dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        layer(static_x)  # warm-up: lays out the weight's tiles
        torch.cuda.synchronize()
        from qdispatch import _cuda
        gemm_calls, gemm = [], _cuda.fq_gemm_into
        monkeypatch.setattr(_cuda, "fq_gemm_into", lambda *args: gemm_calls.append(args) or gemm(*args))
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        monkeypatch.undo()
        _, backend = backend_for("cuda")
        assert bool(gemm_calls) == backend.fq_runs_as_gemm(backend.fq_prepared(layer.weight.T), rows,
                                                           DTYPE_NAMES[dtype])
        if scheme == "int8 per channel" and rows >= 300:  # past every GPU's threshold of rows
            assert gemm_calls, "the graph holds the decode kernel where eager calls take the GEMM"
        for seed in range(3):
            x = torch.randn(rows, K, device="cuda", dtype=dtype, generator=torch.Generator(device="cuda").manual_seed(seed))
            static_x.copy_(x)
            graph.replay()
            eager = layer(x)
            assert torch.equal(static_y, eager), f"replay {seed} differs from the eager call"
            want = x.float() @ dequantized(layer.weight).cuda().T + layer.bias.float()
            tol = 2e-2 if dtype != torch.float32 else 1e-4
            torch.testing.assert_close(static_y.float(), want, rtol=tol, atol=tol * 4)


@pytest.mark.cuda
def test_cuda_graph_replays_beside_eager_calls_on_another_stream():
    """A graph holds the split-K scratch of the stream it was captured on: replays on a
    side stream and eager calls on the default stream, at once, each get their own."""
    _needs_cuda()
    layer = _cuda_qlinear(4096, 4096, GRAPH_SCHEMES["int8 per channel"])
    inputs = [torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        want = [layer(x) for x in inputs]
        static_x = inputs[0].clone()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        side, replays, eager = torch.cuda.Stream(), [], []
        side.wait_stream(torch.cuda.current_stream())
        for _ in range(20):
            with torch.cuda.stream(side):
                graph.replay()
                replays.append(static_y.clone())
            eager.append(layer(inputs[1]))  # on torch's default stream, while `side` replays
        torch.cuda.synchronize()
    for got in replays:
        assert torch.equal(got, want[0])
    for got in eager:
        assert torch.equal(got, want[1])


_CAPTURE_REFUSALS = {
    "not run yet": (qd.KernelError, "not been multiplied yet.*Run the model once before capturing"),
    "weight on the CPU": (qd.BackendMismatchError,
                          r"lhs is on 'cuda:0', rhs is on 'cpu'.*capturing a CUDA graph on cuda:0.*before capturing"),
    "weight on another GPU": (qd.DeviceMismatchError,
                              r"lhs is on 'cuda:0', rhs is on 'cuda:1'.*capturing a CUDA graph on cuda:0"),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(_CAPTURE_REFUSALS))
def test_cuda_graph_capture_refuses_what_it_cannot_hold(case):
    """A weight not multiplied yet (its first product lays out its tiles, and
    synchronizes), or on another device than x (a graph can't hold the move; the
    mismatch error comes first, as an eager call raises it): a clear error, torch's
    capture ends cleanly, and the layer works after."""
    _needs_cuda()
    if case == "weight on another GPU" and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    layer = _cuda_qlinear(256, 128, GRAPH_SCHEMES["int4 block 32"])
    x = torch.randn(2, 256, device="cuda:0")
    graph, doubled = torch.cuda.CUDAGraph(), torch.empty_like(x)
    error, says = _CAPTURE_REFUSALS[case]
    with torch.no_grad():
        if case != "not run yet":
            layer(x)  # warmed up
        if case.startswith("weight on"):
            layer.weight = layer.weight.to("cpu" if case == "weight on the CPU" else "cuda:1")
        with pytest.raises(error, match=says):
            with torch.cuda.graph(graph):
                doubled.copy_(x * 2)
                layer(x)
        graph.replay()  # the capture ended cleanly: what torch recorded runs
        torch.testing.assert_close(doubled, x * 2)
        layer.weight = layer.weight.to("cuda:0")
        want = x @ dequantized(layer.weight).cuda().T + layer.bias
        torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [6, 80])
def test_cuda_captured_q_matmul_takes_any_row_layout(dtype, batch):
    """In a graph the kernels read x in place: rows of any length and offset, strided
    inputs, leading batch dims and empty batches give what eager calls give, on the
    decode kernel and (4 x 80 rows) on the GEMM."""
    _needs_cuda()
    w = weight((37, 40), QuantScheme("q8s", axis=1), "cuda")
    big = torch.randn(4, batch, 48, device="cuda", dtype=dtype)
    layouts = (lambda: big[..., 1:38],                   # rows of 37 values, one value in: unaligned
               lambda: big[:, :, :37].transpose(0, 1),  # strided
               lambda: big[0, :5, 3:40].contiguous(),   # dense rows of 37 values
               lambda: big[:, :0, :37])                 # no rows
    with torch.no_grad():
        q_matmul(big[0, :, :37], w)  # warm-up: lays out the weight's tiles
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = [q_matmul(x(), w) for x in layouts]
        big.copy_(torch.randn_like(big))
        graph.replay()
        for x, got in zip(layouts, captured):
            assert got.shape == (*x().shape[:-1], 40) and got.dtype == dtype
            assert torch.equal(got, q_matmul(x(), w))


def test_load_model_holds_one_quantized_weight_at_a_time(tmp_path):
    """load_model reads each QLinear's weight from the file as its layer loads it,
    so the host holds one weight's stored values at a time, not the whole model's."""
    scheme = QuantScheme("q4s", block=(1, 64), store="packed_u32")
    layers, K = 12, 1024  # one weight's decode takes about three weights' bytes a moment

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(K, K, bias=False) for _ in range(layers)])

    source = quantize_linears(build(), scheme)
    path = tmp_path / "model.safetensors"
    save_model(source, path)
    with torch.device("meta"):
        model = quantize_linears(build(), scheme)
    transient = transient_bytes(lambda: load_model(model, path))
    one_weight = K * K  # its values as int8, what a QTensor's stored values take on the host
    assert transient < 6 * one_weight, f"load_model held {transient / one_weight:.1f} weights at once"
    x = torch.randn(3, K)
    with torch.no_grad():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0)


def test_load_model_names_a_corrupted_weight(tmp_path):
    scheme = QuantScheme("q8s", axis=0)
    path = tmp_path / "model.safetensors"
    save_model(quantize_linears(_model(), scheme), path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a bit flip inside the last entry's data
    path.write_bytes(bytes(raw))
    with pytest.raises(qd.SerializationError, match=r"Tensor '[\w.]+': the bytes of .* are corrupted"):
        load_model(quantize_linears(_model(), scheme), path)


def test_save_model_and_load_model_take_a_module(tmp_path):
    state = quantize_linears(_model(), SCHEMES[0]).state_dict()
    with pytest.raises(TypeError, match=r"save_model takes a torch.nn.Module, got OrderedDict: .*qdispatch.save"):
        save_model(state, tmp_path / "model.safetensors")
    with pytest.raises(TypeError, match=r"load_model takes a torch.nn.Module, got dict: .*qdispatch.load"):
        load_model({}, tmp_path / "model.safetensors")


def test_save_model_keeps_every_buffer_dtype_a_file_holds_and_names_the_others(tmp_path):
    pytest.importorskip("safetensors")
    held = (torch.bool, torch.uint8, torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float64)
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), SCHEMES[0])
    for i, dtype in enumerate(held):
        model.register_buffer(f"b{i}", torch.arange(3).to(dtype))
    save_model(model, tmp_path / "model.safetensors")
    twin = quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), SCHEMES[0])
    for i, dtype in enumerate(held):
        twin.register_buffer(f"b{i}", torch.zeros(3, dtype=dtype))
    load_model(twin, tmp_path / "model.safetensors")
    for i, dtype in enumerate(held):
        assert getattr(twin, f"b{i}").dtype == dtype and torch.equal(getattr(twin, f"b{i}"), getattr(model, f"b{i}"))
    for buffer, what in ((torch.zeros(3, dtype=torch.complex64), "torch.complex64"),
                         (torch.zeros(3, dtype=torch.float8_e4m3fn), "torch.float8_e4m3fn"),
                         (torch.zeros(3).to_sparse(), "sparse_coo"), (torch.zeros(3, device="meta"), "meta")):
        odd = quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), SCHEMES[0])
        odd.register_buffer("odd", buffer)
        with pytest.raises(TypeError, match=f"save_model can't save 'odd', a {what} tensor: .*use torch.save"):
            save_model(odd, tmp_path / "odd.safetensors")
        assert not (tmp_path / "odd.safetensors").exists()


def test_load_model_into_a_float_model_says_to_quantize_first(tmp_path):
    path = tmp_path / "model.safetensors"
    save_model(quantize_linears(_model(), QuantScheme("q8s", axis=0)), path)
    with pytest.raises(qd.SerializationError, match="'0.up' is not a QLinear.*quantize_linears"):
        load_model(_model(), path)
    narrower = quantize_linears(torch.nn.Sequential(*list(_model())[:2]), QuantScheme("q8s", axis=0))  # no '2', '3'
    with pytest.raises(qd.SerializationError, match="weight of a layer '3', which this model does not have"):
        load_model(narrower, path)


def test_quantize_linears_leaves_the_linears_torchs_fused_layers_read_as_tensors():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                             batch_first=True, dropout=0.0).eval()
    model = torch.nn.Sequential(layer, torch.nn.Linear(32, 8))
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        float_out = model(x)  # torch's fused path
        quantize_linears(model, QuantScheme("q8s", axis=0))
        assert isinstance(model[1], QLinear)
        assert not any(isinstance(m, QLinear) for m in layer.modules())
        torch.testing.assert_close(model(x), float_out, rtol=0, atol=0.05)


def test_torch_compile_runs_around_qdispatch():
    """torch.compile can't trace qdispatch's kernels: q_matmul runs as it is, between
    graph breaks (tracing into it failed inside torch before)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        QLinear.from_linear(torch.nn.Linear(32, 24), QuantScheme("q8s", axis=0), device=DEVICES[-1]),
        torch.nn.ReLU(),
        QLinear.from_linear(torch.nn.Linear(24, 8), SCHEMES[2], device=DEVICES[-1]))
    x = torch.randn(4, 32, requires_grad=True)
    want = model(x)
    want.sum().backward()
    want_grad, x.grad = x.grad, None
    got = torch.compile(model, backend="aot_eager")(x)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want_grad, rtol=0, atol=0)


def test_torch_compile_fullgraph_says_why_it_cannot():
    """Dynamo stopped at torch._C._is_tracing, inside q_matmul's checks, with a message
    that named nothing of qdispatch's. Now it meets the call torch.compile must run
    outside its graph: torch 2.13 says so with qdispatch's reason; torch 2.11 traces into
    it under fullgraph=True and stops inside qdispatch's code, which its message shows.
    (A QLinear on the CPU stays in the graph: the test after this one.)"""
    w = weight((8, 4), QuantScheme("q8s", axis=1), DEVICES[-1])
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: q_matmul(x, w), fullgraph=True, backend="eager")(torch.randn(2, 8))
    message = str(info.value)
    assert "_is_tracing" not in message and "qdispatch" in message
    reason = "qdispatch's kernels run outside torch, between graph breaks: compile the model without fullgraph=True"
    try:  # where torch.compiler.disable takes a reason, fullgraph=True must give it
        torch.compiler.disable(lambda: None, reason="probe")
        takes_reason = True
    except TypeError:
        takes_reason = False
    assert (reason if takes_reason else "qdispatch/torch.py") in message


needs_custom_ops = pytest.mark.skipif(not hasattr(torch.library, "custom_op"), reason="needs torch >= 2.4")


@needs_custom_ops
@pytest.mark.parametrize("act", [None, "q8s"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_compile_keeps_cpu_qlinears_in_its_graph(act, dtype):
    """fullgraph=True compiles a model of QLinears on the CPU whole (the layers are a
    custom op in the graph), with the eager model's values and gradients bit for bit,
    over several batch sizes."""
    torch._dynamo.reset()  # dynamo recompiles a code object for each model: the suite's others count
    torch.manual_seed(0)
    model = quantize_linears(torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)),
                             QuantScheme("q8s", axis=0), device=DEVICES[-1], activation_scheme=act).to(dtype)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for rows in (1, 3, 7):
        x = torch.randn(rows, 32, dtype=dtype)
        x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = model(x_eager), compiled(x_compiled)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


@needs_custom_ops
def test_a_compiled_backward_refuses_a_weight_replaced_after_its_forward():
    """The graph's backward finds the layer, not the forward's weight: a weight
    replaced in between is refused (it gave the new weight's gradient), a move of
    the same values is not, and the next forward takes the new weight's gradient."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    scheme = QuantScheme("q8s", axis=0)
    layer = QLinear.from_linear(torch.nn.Linear(16, 8), scheme, device=DEVICES[-1])
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 16, requires_grad=True)
    y = compiled(x)
    layer.to(torch.float32)  # moves nothing: the weight keeps its number
    y.sum().backward()
    torch.testing.assert_close(x.grad, to_torch(layer.weight.dequantize()).sum(0).expand(2, 16))
    y = compiled(x)
    layer.weight = qd.quantize(torch.randn(8, 16), scheme, device=DEVICES[-1])
    with pytest.raises(qd.KernelError, match="weight was replaced between a compiled forward and its backward"):
        y.sum().backward()
    x.grad = None
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, to_torch(layer.weight.dequantize()).sum(0).expand(2, 16))
    del layer.__dict__["_weight_version"]  # as a layer pickled by an older release comes back
    x.grad = None
    compiled(x).sum().backward()
    torch.testing.assert_close(x.grad, to_torch(layer.weight.dequantize()).sum(0).expand(2, 16))


@needs_custom_ops
def test_a_compiled_qlinear_raises_the_eager_error_and_each_copy_is_its_own():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = QLinear.from_linear(torch.nn.Linear(8, 4), QuantScheme("q8s", axis=0), device=DEVICES[-1])
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(ShapeError, match=re.escape("QLinear(in_features=8, out_features=4) got x of shape (2, 7)")):
        compiled(torch.randn(2, 7))
    with pytest.raises(TypeError, match="QLinear.*float32/float16/bfloat16/float64"):
        compiled(torch.ones(2, 8, dtype=torch.int32))
    unloaded = QLinear.from_linear(torch.nn.Linear(8, 4, device="meta"), QuantScheme("q8s", axis=0))
    with pytest.raises(qd.BackendUnavailableError, match="made from a layer on torch's meta device"):
        torch.compile(unloaded, fullgraph=True, backend="aot_eager")(torch.randn(2, 8))  # was torch's Unsupported
    twin = copy.deepcopy(layer)
    twin.weight = qd.quantize(torch.randn(4, 8), QuantScheme("q8s", axis=0), device=DEVICES[-1])
    x = torch.randn(2, 8)
    torch.testing.assert_close(torch.compile(twin, fullgraph=True, backend="aot_eager")(x), twin(x), rtol=0, atol=0)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0, atol=0)  # the original kept its own weight


def test_torch_compile_runs_a_qembedding_lookup():
    """A compiled QEmbedding under inference_mode: torch's tracer in the lookup's
    host code failed a guard before.  On the CPU the lookup is an op in the graph, so
    a small language model compiles whole, and an id outside the table raises the
    eager error."""
    from qdispatch.torch import QEmbedding
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(QEmbedding.from_embedding(torch.nn.Embedding(20, 16), QuantScheme("q8s", axis=0),
                                                          device=DEVICES[-1]), torch.nn.ReLU(),
                                QLinear.from_linear(torch.nn.Linear(16, 20), QuantScheme("q8s", axis=0),
                                                    device=DEVICES[-1]))
    ids = torch.tensor([[1, 2, 3], [19, 0, 4]])
    want = model(ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.inference_mode():
        torch.testing.assert_close(compiled(ids), want, rtol=0, atol=0)
    torch.testing.assert_close(compiled(ids), want, rtol=0, atol=0)
    torch.testing.assert_close(compiled(ids[:, ::2]), want[:, ::2], rtol=0, atol=0)  # strided ids, as eager takes
    torch.testing.assert_close(compiled(ids[1, 2:3].expand(2, 3)), want[1, 2].expand(2, 3, 20), rtol=0, atol=0)
    with pytest.raises(qd.OutOfRangeError, match="embedding id 20 at position"):
        compiled(torch.tensor([[1, 20, 3], [19, 0, 4]]))
    for bad in (ids.float(), ids > 2):  # the eager TypeError (raised while tracing, torch's Unsupported)
        with pytest.raises(qd.ArgumentTypeError, match="QEmbedding takes a torch integer tensor of ids"):
            compiled(bad)


def test_a_float_checkpoint_weight_that_is_no_float_tensor_is_named():
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)))
    quantize_linears(model, SCHEMES[0])
    for weight, got in ((qd.quantize(np.ones((4, 8), np.float32), "q8s"), "QTensor"), (np.ones((4, 8)), "ndarray"),
                        (None, "NoneType"), (torch.ones(4, 8, dtype=torch.int32), "torch.int32"),
                        (torch.ones(4, 8).to(torch.float8_e4m3fn), "torch.float8_e4m3fn")):
        with pytest.raises(TypeError, match=rf"^0\.0\.weight: a float checkpoint's weight is a float32, .* got {got} "
                                            rf"\(a quantized checkpoint holds 0\.0\._extra_state"):
            model.load_state_dict({"0.0.weight": weight})


def test_a_damaged_extra_state_is_named_by_its_layer():
    """Every error of a damaged extra state says which layer's, in a nested model,
    and a record that does not hold what state_dict() writes is a SerializationError."""
    scheme = QuantScheme("q4f", block=(1, 4), store="packed_u32", scale_dtype="bf16")
    model = torch.nn.Sequential(torch.nn.Sequential(QLinear.from_linear(torch.nn.Linear(12, 8, bias=False), scheme)))
    state = model.state_dict()["0.0._extra_state"]
    stray = {**state, "qvalues": state["qvalues"].clone().fill_(-1)}
    for bad, error, said in (
            ({**state, "qscales": state["qscales"].clone().fill_(float("nan"))}, qd.SerializationError, "NaN or Inf"),
            (stray, qd.SerializationError, "bits set outside"),
            ({**state, "transposed": "False"}, qd.SerializationError, "a 'transposed' flag"),
            ({**state, "scheme": {**state["scheme"], "zero_point": 3}}, qd.SerializationError, "holds no scheme"),
            ({**state, "shape": [8, 9]}, qd.QuantSchemeError, "")):
        with pytest.raises(error, match=rf"^0\.0\._extra_state: .*{said}"):
            model.load_state_dict({"0.0._extra_state": bad})


def test_quantize_takes_a_parameter_by_its_values():
    linear = torch.nn.Linear(32, 8)
    scheme = QuantScheme("q8s", axis=0)
    q = qd.quantize(linear.weight, scheme, device=DEVICES[-1])  # refused by DLPack before
    np.testing.assert_array_equal(q.values, qd.quantize(linear.weight.detach().numpy(), scheme).values)
    assert linear.weight.requires_grad  # the module is untouched


@pytest.mark.cuda
def test_cuda_q_matmul_is_ordered_with_torchs_current_stream():
    """x written on a side stream after a long wait, the product read there at once:
    qdispatch's kernel waits for the write and the read waits for the kernel."""
    _needs_cuda()
    w = weight((1024, 512), SCHEMES[0], "cuda")
    want = torch.ones(8, 1024) @ dequantized(w)
    side = torch.cuda.Stream()
    x = torch.zeros(8, 1024, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for step in range(1, 4):
            torch.cuda._sleep(20_000_000)  # about 10 ms on this stream before the write
            x.fill_(step)
            y = q_matmul(x, w) * 1  # the read, queued on `side` right after our kernel
            torch.testing.assert_close(y.cpu(), want * step, rtol=1e-5, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("then", ["freed", "written"])
@pytest.mark.parametrize("cross", [from_torch, qd.from_dlpack, qd.tensor])
def test_cuda_input_lent_on_a_side_stream_waits_for_our_kernel(cross, then):
    """x made on a side stream, lent for one call, then freed or written there: torch
    must not give its memory to the next tensor on that stream, nor write it, while
    our kernel, queued behind a long wait on our stream, has yet to read x."""
    _needs_cuda()
    w = weight((1024, 512), SCHEMES[0], "cuda")
    ones = np.ones((8, 1024), np.float32)
    want = qd.q_matmul(qd.tensor(ones, device="cuda"), w).numpy()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.ones(8, 1024, device="cuda")
    torch.cuda._sleep(50_000_000)  # about 25 ms on torch's default stream, which is ours
    with torch.cuda.stream(side):
        y = qd.q_matmul(cross(x), w)  # stays in qdispatch: nothing on `side` waits for it
        x_alive = weakref.ref(x)
        if then == "written":
            x.fill_(7.0)
        else:
            del x
            torch.full((8, 1024), 7.0, device="cuda")  # a write that would take x's block at once
    np.testing.assert_array_equal(y.numpy(), want)
    qd.synchronize("cuda:0")
    assert (x_alive() is None) == (then == "freed")  # once our kernel is done, x goes back to torch


@pytest.mark.cuda
def test_cuda_memory_freed_inside_a_graph_capture_leaves_it_intact():
    """A view of a torch tensor lent on a side stream and a result read there, both let
    go while torch captures a CUDA graph: what their release does on the streams must
    not touch the capture."""
    _needs_cuda()
    w = weight((256, 128), SCHEMES[0], "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.randn(4, 256, device="cuda")
        view = from_torch(x)  # lent to qdispatch on `side`
        y = to_torch(qd.q_matmul(view, w))  # read by torch on `side`
    torch.cuda.synchronize()
    graph, a = torch.cuda.CUDAGraph(), torch.randn(64, device="cuda")
    b = torch.empty_like(a)
    with torch.cuda.graph(graph):
        b.copy_(a * 2)
        del view, y
    graph.replay()
    torch.testing.assert_close(b, a * 2)
    qd.synchronize("cuda:0")
    from qdispatch import _cuda
    assert _cuda.lent_count() == 0


@pytest.mark.cuda
def test_cuda_result_freed_on_a_side_stream_waits_for_its_readers():
    """A result read on a side stream after a long wait there, then freed: its memory
    goes back to qdispatch's cache, and the next qdispatch call must not overwrite
    it before that read has run."""
    _needs_cuda()
    w = weight((1024, 512), SCHEMES[0], "cuda")
    x, x3 = (qd.tensor(np.full((8, 1024), v, np.float32), device="cuda") for v in (1, 3))
    want, want3 = qd.q_matmul(x, w).numpy(), qd.q_matmul(x3, w).numpy()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        y = to_torch(qd.q_matmul(x, w))  # `side` waits for our kernel
        torch.cuda._sleep(50_000_000)  # about 25 ms on `side`
        read = y.clone()  # runs after the wait
        del y
    later = [qd.q_matmul(x3, w) for _ in range(3)]  # results of y's size, from qdispatch's cache
    torch.cuda.synchronize()
    np.testing.assert_array_equal(read.cpu().numpy(), want)
    for z in later:
        np.testing.assert_array_equal(z.numpy(), want3)
