"""qdispatch.torch and transformers' Conv1D (GPT-2's layers): y = x @ W + b, W [in, out].

Conv1D is matched by its name and module, so qdispatch never imports transformers;
`Conv1D` below is that class as transformers writes it.  The last test runs a real
GPT-2 where transformers is installed."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qdispatch as qd  # noqa: E402
from qdispatch import QuantScheme  # noqa: E402
from qdispatch.torch import QConv1D, QLinear, load_model, quantize_linears, save_model  # noqa: E402

SCHEMES = [QuantScheme("q8s", axis=0), QuantScheme("q4s", block=(1, 32), store="packed_u32", scale_dtype="f16")]


class Conv1D(torch.nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer whose weight is [nx, nf]."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.empty(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"


class Block(torch.nn.Module):
    """GPT-2's MLP: two Conv1Ds, and a Linear head beside them."""

    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj, self.head = Conv1D(128, 64), Conv1D(64, 128), torch.nn.Linear(64, 48)

    def forward(self, x):
        return self.head(self.c_proj(torch.nn.functional.gelu(self.c_fc(x))))


def _block(seed=0):
    torch.manual_seed(seed)
    block = Block()
    with torch.no_grad():
        for conv in (block.c_fc, block.c_proj):
            conv.bias.normal_()
    return block


@pytest.mark.parametrize("scheme", SCHEMES, ids=str)
def test_quantize_linears_takes_conv1d_as_the_linear_of_its_transposed_weight(scheme, device):
    """GPT-2's Conv1Ds stayed in float, silently: 3/4 of its weights."""
    where = "cuda" if device == "cuda" else "cpu"
    model = _block().to(where)
    float_fc = model.c_fc
    quantize_linears(model, scheme, device=device)
    assert type(model.c_fc) is QConv1D and type(model.c_proj) is QConv1D and type(model.head) is QLinear
    assert (model.c_fc.in_features, model.c_fc.out_features) == (64, 128) and model.c_fc.weight.shape == (128, 64)
    assert model.c_fc.weight.backend == device
    # the product is a QLinear's of weight W.T, bit for bit
    linear = torch.nn.Linear(64, 128).to(where)
    with torch.no_grad():
        linear.weight.copy_(float_fc.weight.T)
        linear.bias.copy_(float_fc.bias)
    expected = QLinear.from_linear(linear, scheme, device=device)
    np.testing.assert_array_equal(model.c_fc.weight.to("reference").values, expected.weight.to("reference").values)
    x = torch.randn(2, 5, 64, device=where)
    with torch.no_grad():
        torch.testing.assert_close(model.c_fc(x), expected(x), rtol=0, atol=0)
        w = torch.from_numpy(qd.dequantize(model.c_fc.weight.to("reference")).numpy()).double().to(where)
        torch.testing.assert_close(model.c_fc(x).double(), x.double() @ w.T + float_fc.bias, rtol=1e-5, atol=1e-5)
        assert model(x).shape == (2, 5, 48)
    assert "QConv1D(in_features=64, out_features=128" in repr(model)


def test_a_float_gpt2_checkpoint_loads_into_a_model_built_on_meta():
    """A float checkpoint holds Conv1D's W [in, out]: each QConv1D quantizes W.T as it loads."""
    scheme = SCHEMES[1]
    source = _block(1)
    with torch.device("meta"):
        model = _block()
    quantize_linears(model, scheme)
    model.load_state_dict(source.state_dict(), assign=True)
    expected = quantize_linears(_block(1), scheme)
    for name in ("c_fc", "c_proj", "head"):
        np.testing.assert_array_equal(getattr(model, name).weight.values, getattr(expected, name).weight.values)
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected(x), rtol=0, atol=0)
    wrong = {**source.state_dict(), "c_fc.weight": source.c_fc.weight.T.detach()}  # [out, in]: a Linear's
    with pytest.raises(RuntimeError, match=r"size mismatch for c_fc.weight: a float weight of shape \(128, 64\), "
                                           r"but this QConv1D's is \(64, 128\)"):
        quantize_linears(_block(), scheme).load_state_dict(wrong)


def test_quantized_conv1d_state_and_files_round_trip(tmp_path):
    scheme = SCHEMES[0]
    model = quantize_linears(_block(2), scheme)
    fresh = quantize_linears(_block(3), scheme)
    fresh.load_state_dict(model.state_dict())
    save_model(model, tmp_path / "m.safetensors")
    with torch.device("meta"):
        empty = _block()
    load_model(quantize_linears(empty, scheme), tmp_path / "m.safetensors")
    x = torch.randn(4, 64)
    with torch.no_grad():
        for loaded in (fresh, empty):
            torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_conv1d_refusals_name_the_way():
    with pytest.raises(TypeError, match="QLinear.from_linear needs an nn.Linear, got Conv1D: use QConv1D.from_conv1d"):
        QLinear.from_linear(Conv1D(8, 16), SCHEMES[0])
    with pytest.raises(TypeError, match="QConv1D.from_conv1d needs a transformers Conv1D, got Linear"):
        QConv1D.from_conv1d(torch.nn.Linear(16, 8), SCHEMES[0])
    assert type(QConv1D.from_conv1d(Conv1D(8, 16), SCHEMES[0])) is QConv1D

    class OwnForward(Conv1D):
        def forward(self, x):
            return super().forward(x) * 2

    model = torch.nn.Sequential(OwnForward(8, 16))
    with pytest.raises(qd.ArgumentError, match=r"layers \['0'\] are subclasses of Conv1D with a forward of their own"):
        quantize_linears(model, SCHEMES[0])
    assert type(model[0]) is OwnForward


def test_gpt2_from_transformers_quantizes_every_layer():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=300, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    quantize_linears(model, SCHEMES[0])
    kinds = {type(m).__name__ for name, m in model.named_modules() if name.endswith(("c_attn", "c_proj", "c_fc"))}
    assert kinds == {"QConv1D"} and type(model.lm_head) is QLinear
    # the same model in float with each weight dequantized gives the same logits
    reference = transformers.GPT2LMHeadModel(config).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    for name, m in model.named_modules():
        if isinstance(m, QLinear):
            w = torch.from_numpy(qd.dequantize(m.weight).numpy())
            state[f"{name}.weight"] = w.T if isinstance(m, QConv1D) else w
    head = state.pop("lm_head.weight")
    reference.load_state_dict(state, strict=False)
    reference.lm_head.weight = torch.nn.Parameter(head)  # untied: the table stays float, the head is quantized
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
