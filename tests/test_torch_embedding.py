"""qdispatch.torch's QEmbedding and quantize_embeddings: nn.Embedding with a quantized table."""
import copy
import io
import json
import pickle
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import qdispatch as qd  # noqa: E402
import qdispatch.torch as qtorch  # noqa: E402
from qdispatch import QuantScheme  # noqa: E402
from qdispatch.torch import (QEmbedding, QLinear, load_model, quantize_embeddings, quantize_linears,  # noqa: E402
                             save_model)

HOSTS = ["reference"] + (["cpu"] if "cpu" in qd.available_backends() else [])
PER_ROW = QuantScheme("q8s", axis=0)
INT4 = QuantScheme("q4s", block=(1, 32), store="packed_u32", scale_dtype="f16")


def _needs_cuda():
    if not torch.cuda.is_available() or "cuda" not in qd.available_backends():
        pytest.skip("needs a CUDA GPU and the qdispatch cuda backend")


class TinyLM(torch.nn.Module):
    """An embedding table, a hidden layer and an output layer."""

    def __init__(self, vocab=50, dim=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.hidden = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.embed(ids))))


@pytest.mark.parametrize("device", HOSTS)
@pytest.mark.parametrize("scheme", [PER_ROW, INT4], ids=["per row", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookups_are_rows_of_the_dequantized_table(device, scheme, dtype):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 64).to(dtype)
    q = QEmbedding.from_embedding(emb, scheme, device=device)
    assert q.weight.device == device and q.dtype == dtype and (q.num_embeddings, q.embedding_dim) == (50, 64)
    ids = torch.tensor([[0, 49, 7], [7, 7, 1]])
    out = q(ids)
    want = torch.nn.functional.embedding(ids, torch.from_numpy(q.weight.dequantize().numpy()).to(dtype))
    assert out.dtype == dtype and out.shape == (2, 3, 64) and not out.requires_grad
    assert torch.equal(out, want)
    assert torch.equal(q(ids.to(torch.int32)), want)


@pytest.mark.skipif("cpu" not in HOSTS, reason="needs the cpu backend")
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_cpu_lookups_are_the_references_for_ids_of_any_kind(dtype, transposed, monkeypatch):
    """On the cpu backend a lookup reads torch's ids and writes torch's rows in place
    (qd_dequantize_rows, no qdispatch Tensors): the reference backend's rows, bit for
    bit, for ids of any integer dtype, rank and stride; a transposed table takes
    qd.embedding's route."""
    torch.manual_seed(0)
    table = torch.randn(64, 40) if transposed else torch.randn(40, 64)
    w = qd.quantize(table.numpy(), INT4 if not transposed else QuantScheme("q4s", block=(32, 1), store="packed_u32"),
                    device="cpu")
    q = QEmbedding(w.T if transposed else w, dtype=dtype)
    spec = QEmbedding(q.weight.to("reference"), dtype=dtype)
    base = torch.tensor([[0, 39, 7, 7], [1, 2, 38, 5]])
    wanted = {}
    strided = (base[0, ::2], base[:, ::2], base[1, 2:3].expand(5))  # views reshape(-1) keeps strided
    for ids in (base, base.int(), base.to(torch.uint8), base.t(), base[0], base[0, 1], base[:, :0], *strided):
        wanted[ids] = spec(ids)
    embedding = qd.tensor_api.embedding
    if not transposed:  # the kernel in place: qd.embedding only names a bad id
        monkeypatch.setattr(qd.tensor_api, "embedding", lambda *a, **k: pytest.fail("qd.embedding's route ran"))
    for ids, want in wanted.items():
        out = q(ids)
        assert out.dtype == dtype and out.shape == (*ids.shape, 64)
        assert torch.equal(out.view(torch.int8) if dtype != torch.float64 else out,
                           want.view(torch.int8) if dtype != torch.float64 else want)
    monkeypatch.setattr(qd.tensor_api, "embedding", embedding)
    with pytest.raises(qd.OutOfRangeError, match=r"embedding id -3 at position \(1, 1\)"):
        q(torch.tensor([[0, 1], [2, -3]]))


def test_ids_must_be_integers_on_the_tables_device_and_inside_it():
    q = QEmbedding.from_embedding(torch.nn.Embedding(10, 32), PER_ROW, device=HOSTS[-1])
    with pytest.raises(TypeError, match="integer tensor of ids .torch.long, torch.int or another integer dtype; token ids are usually torch.long., got torch.float32"):
        q(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="got list"):
        q([1, 2])
    with pytest.raises(TypeError, match="got torch.bool"):  # a mask, not ids: True would read row 1
        q(torch.tensor([True, False]))
    with pytest.raises(TypeError, match=r"QEmbedding expects a dense torch tensor, got layout torch.sparse_coo: "
                                        r"convert it with x.to_dense\(\) first"):
        q(torch.tensor([1, 2]).to_sparse())  # was torch's "reshape is not implemented for sparse tensors"
    with pytest.raises(IndexError, match=r"embedding id 10 at position \(1,\) is outside the table's 10 rows"):
        q(torch.tensor([3, 10]))
    with pytest.raises(qd.OutOfRangeError, match="embedding id -1"):
        q(torch.tensor([-1]))
    q.check_ids = False  # host ids are checked whatever it says: reading them waits for nothing
    with pytest.raises(qd.OutOfRangeError, match="embedding id 10"):
        q(torch.tensor([10]))
    with pytest.raises(qd.BackendMismatchError, match="ids are on torch device 'meta'.*move the ids first"):
        q(torch.tensor([1], device="meta"))


def test_tracers_refuse_a_lookup_they_cannot_record():
    """torch.jit.trace recorded a lookup's rows as constants: the traced model gave the
    trace's rows for any ids.  Tracers now refuse it, as they refuse QLinear."""
    model = quantize_embeddings(TinyLM(), PER_ROW, device=HOSTS[-1])
    ids = torch.tensor([[1, 2, 3]])
    says = "can't record qdispatch's q_matmul \\(QLinear\\) or lookups \\(QEmbedding\\).*torch.compile"
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.jit.trace(model, (ids,))
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.export.export(model, (ids,), strict=False)
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.fx.symbolic_trace(model)
    with pytest.raises(qd.BackendUnavailableError, match=says):
        torch.jit.script(model)


def test_lookups_under_torch_func():
    """Under torch.func's transforms the ids reached the lookup as tensors without
    data: grad through a model with a QEmbedding, and vmap over its ids, now work."""
    layer = QEmbedding.from_embedding(torch.nn.Embedding(50, 16), PER_ROW, device=HOSTS[-1])
    ids = torch.tensor([[1, 2], [3, 49]])
    rows = layer(ids)
    v = torch.randn(16)
    grad = torch.func.grad(lambda v: (layer(torch.tensor([1, 2])) * v).sum())(v)
    torch.testing.assert_close(grad, rows[0].sum(0), rtol=0, atol=0)
    for in_dims, out_dims in ((0, 0), (1, 1)):
        mapped = torch.func.vmap(layer, in_dims=in_dims, out_dims=out_dims)(ids)
        torch.testing.assert_close(mapped, rows, rtol=0, atol=0)
    batched = torch.func.vmap(lambda v: layer(ids) * v)(torch.ones(3, 16))  # ids themselves not mapped
    torch.testing.assert_close(batched, rows.expand(3, *rows.shape), rtol=0, atol=0)


def test_a_table_quantize_embeddings_cannot_take_is_named():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Embedding(10, 8, max_norm=1.0))
    with pytest.raises(ValueError, match=r"layer '1' \(10 x 8\): QEmbedding can't take an nn.Embedding with "
                                         r"max_norm=1.0.*; keep it in float with skip=\['1'\]"):
        quantize_embeddings(model, PER_ROW)
    assert isinstance(quantize_embeddings(model, PER_ROW, skip=["1"])[0], QEmbedding)


def test_construction_checks():
    w = qd.quantize(np.ones((4, 8), np.float32), PER_ROW)
    with pytest.raises(TypeError, match="QEmbedding needs a QTensor weight, got Tensor: use QEmbedding.from_embedding"):
        QEmbedding(torch.ones(4, 8))
    with pytest.raises(TypeError, match=r"got int: .*; for an empty layer of given sizes, .* an nn.Embedding built "
                                        r"on torch's meta device \(nn.Embedding\(\.\.\., device='meta'\)\)"):
        QEmbedding(100, 16)
    with pytest.raises(qd.ShapeError, match=r"2-D weight \[num_embeddings, embedding_dim\]"):
        QEmbedding(qd.quantize(np.ones((2, 4, 8), np.float32), QuantScheme("q8s", block=8)))
    with pytest.raises(TypeError, match="dtype must be torch.float32, float16, bfloat16 or float64, got torch.int64"):
        QEmbedding(w, dtype=torch.int64)
    with pytest.raises(ValueError, match="max_norm=1.0: a quantized table can't be renormalized"):
        QEmbedding.from_embedding(torch.nn.Embedding(4, 8, max_norm=1.0), PER_ROW)
    with pytest.raises(TypeError, match="needs an nn.Embedding, got Linear"):
        QEmbedding.from_embedding(torch.nn.Linear(4, 8), PER_ROW)
    assert "10, 32, padding_idx=0, dtype=torch.float32" in repr(
        QEmbedding.from_embedding(torch.nn.Embedding(10, 32, padding_idx=0), PER_ROW))


def test_a_module_pickled_before_check_ids_checks_its_ids():
    q = QEmbedding(qd.quantize(np.ones((4, 8), np.float32), PER_ROW, device=HOSTS[-1]))
    del q.__dict__["check_ids"]  # as a pickle from before the setting holds the module
    old = pickle.loads(pickle.dumps(q))
    assert old.check_ids and "check_ids" not in repr(old)
    assert torch.equal(old(torch.tensor([3])), torch.ones(1, 8))
    with pytest.raises(qd.OutOfRangeError, match="embedding id 4"):
        old(torch.tensor([4]))


def test_quantize_embeddings_replaces_the_tables_and_skips_by_name():
    torch.manual_seed(0)
    model = TinyLM()
    table = model.embed.weight.detach().clone()
    quantized = quantize_embeddings(copy.deepcopy(model), PER_ROW)
    assert isinstance(quantized.embed, QEmbedding) and isinstance(quantized.head, torch.nn.Linear)
    assert quantized.embed.padding_idx == 0
    want = qd.quantize(table.numpy(), PER_ROW).dequantize().numpy()
    ids = torch.tensor([4, 0, 49])
    assert torch.equal(quantized.embed(ids), torch.from_numpy(want[ids.numpy()]))
    kept = quantize_embeddings(copy.deepcopy(model), PER_ROW, skip=["embed"])
    assert isinstance(kept.embed, torch.nn.Embedding)
    with pytest.raises(ValueError, match=r"skip names \['head'\] that are not nn.Embedding layers of the model, "
                                         r"nor modules holding some; its Embeddings are \['embed'\]"):
        quantize_embeddings(copy.deepcopy(model), PER_ROW, skip=["head"])
    with pytest.raises(qd.QuantSchemeError, match=r"layer 'embed' \(50 x 64\): .*skip=\['embed'\]"):
        quantize_embeddings(copy.deepcopy(model), QuantScheme("q8s", block=(1, 48)))
    single = quantize_embeddings(torch.nn.Embedding(5, 16), PER_ROW)
    assert isinstance(single, QEmbedding)
    with pytest.raises(TypeError, match="quantize_embeddings takes a torch.nn.Module, got dict"):
        quantize_embeddings({}, PER_ROW)


def test_state_dict_round_trip_and_float_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    source = quantize_linears(quantize_embeddings(copy.deepcopy(model), INT4), PER_ROW)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    with torch.device("meta"):
        empty = TinyLM()
    quantize_linears(quantize_embeddings(empty, INT4), PER_ROW)
    empty.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), assign=True)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(empty(ids), source(ids))
    np.testing.assert_array_equal(empty.embed.weight.values, source.embed.weight.values)
    # a float checkpoint quantizes as it loads
    fresh = quantize_linears(quantize_embeddings(TinyLM(), INT4), PER_ROW)
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(ids), source(ids))
    wrong = model.state_dict()
    wrong["embed.weight"] = torch.randn(51, 64)
    with pytest.raises(RuntimeError, match=r"size mismatch for embed.weight.*\(51, 64\).*QEmbedding's is \(50, 64\)"):
        fresh.load_state_dict(wrong)


def test_layers_made_on_the_meta_device_refuse_to_run_until_loaded(tmp_path):
    """A model built empty holds zeros in its quantized layers until a checkpoint
    loads: running it before (the bias-free head, the table) is refused, not zeros;
    a copy and a float or quantized checkpoint load are honoured."""
    torch.manual_seed(0)
    model = TinyLM()
    source = quantize_linears(quantize_embeddings(copy.deepcopy(model), INT4), PER_ROW)
    with torch.device("meta"):
        empty = TinyLM()
    quantize_linears(quantize_embeddings(empty, INT4), PER_ROW)
    ids, h = torch.tensor([[1, 2, 3]]), torch.randn(2, 64)
    unloaded = r"^this {} was made from a layer on torch's meta device.*load_state_dict\(state, assign=True\)"
    with torch.device("meta"):
        meta_float = TinyLM().state_dict()
    unsaved, buffer = copy.deepcopy(empty), io.BytesIO()
    torch.save(empty.state_dict(), buffer)
    buffer.seek(0)
    unsaved.load_state_dict(torch.load(buffer, weights_only=True))  # a state of no values loads none
    meta_loaded = copy.deepcopy(empty)
    meta_loaded.load_state_dict(meta_float, assign=True)  # nor does a float checkpoint on meta
    for unfilled in (empty, copy.deepcopy(empty), unsaved, meta_loaded):
        for layer, arg in ((unfilled.embed, ids), (unfilled.head, h)):
            with pytest.raises(qd.BackendUnavailableError, match=unloaded.format(type(layer).__name__)):
                layer(arg)
    assert empty.state_dict()["head._extra_state"]["qvalues"].is_meta
    with pytest.raises(qd.BackendUnavailableError, match="save_model can't save 'embed': .*meta device"):
        save_model(empty, tmp_path / "empty.safetensors")
    for load in (lambda m: m.load_state_dict(model.state_dict(), assign=True),
                 lambda m: m.load_state_dict(source.state_dict(), assign=True)):
        loaded = copy.deepcopy(empty)
        load(loaded)
        with torch.no_grad():
            assert torch.equal(loaded(ids), source(ids))
            assert torch.equal(loaded.head(h), source.head(h))


def test_save_model_and_load_model_carry_the_table(tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    source = quantize_linears(quantize_embeddings(TinyLM().to(torch.bfloat16), INT4), PER_ROW)
    save_model(source, tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = TinyLM().to(torch.bfloat16)
    load_model(quantize_linears(quantize_embeddings(model, INT4), PER_ROW), tmp_path / "model.safetensors")
    ids = torch.tensor([[5, 6], [7, 49]])
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))
    assert model.embed.dtype == torch.bfloat16
    unquantized = quantize_linears(TinyLM(), PER_ROW)  # its table still an nn.Embedding
    with pytest.raises(qd.SerializationError, match="'embed' is not a QLinear or QEmbedding.*quantize_embeddings"):
        load_model(unquantized, tmp_path / "model.safetensors")


@pytest.mark.parametrize("device", HOSTS)
def test_dtype_follows_module_to(device):
    q = QEmbedding.from_embedding(torch.nn.Embedding(10, 32), PER_ROW, device=device)
    values = q.weight.values
    q.to(torch.float16)
    assert q.dtype == torch.float16 and q(torch.tensor([3])).dtype == torch.float16
    np.testing.assert_array_equal(q.weight.values, values)  # the table is left as it is
    assert q.weight.device == device


def test_float64_rows_and_a_float_checkpoints_dtype(device):
    """model.double() left a QEmbedding's rows float32 (the float layers after it then
    refused them), and a float checkpoint loaded with assign=True left its dtype as
    it was while the other layers took the checkpoint's: both follow, as
    nn.Embedding's weight does."""
    q = QEmbedding.from_embedding(torch.nn.Embedding(10, 32), PER_ROW, device=device)
    ids = torch.tensor([[3, 9]], device="cuda" if device == "cuda" else "cpu")
    rows = q(ids)
    q.double()
    assert q.dtype == torch.float64 and torch.equal(q(ids), rows.double())
    assert QEmbedding.from_embedding(torch.nn.Embedding(10, 32).double(), PER_ROW, device=device).dtype == torch.float64
    if device == "cuda":
        return  # the load below is a host model's
    float_model = TinyLM().to(torch.bfloat16)
    with torch.device("meta"):
        empty = TinyLM()
    quantize_linears(quantize_embeddings(empty, PER_ROW, device=device), PER_ROW, device=device)
    empty.load_state_dict(float_model.state_dict(), assign=True)
    assert empty.embed.dtype == torch.bfloat16 and empty(ids).dtype == torch.bfloat16


def test_a_quantized_checkpoint_carries_the_tables_dtype(tmp_path):
    """save_model of a bfloat16 model, loaded into one built on the meta device, gave its
    QEmbedding float32 rows while the other layers took bfloat16 (the model then failed
    on mixed dtypes).  The table's dtype is in its state and in the file now, and a load
    with assign=True takes it, as torch's takes a float checkpoint's; a load into a model
    with values keeps the layer's, as torch's copies into a Parameter do.  A state or
    file without it (an earlier release's) loads as before, and a bad one is named."""
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    source = quantize_linears(quantize_embeddings(TiedLM(), INT4), INT4).to(torch.bfloat16)
    ids = torch.tensor([[5, 6], [7, 49]])
    with torch.no_grad():
        want = source(ids)
    path = tmp_path / "model.safetensors"
    save_model(source, path)
    state = source.state_dict()
    assert state["embed._extra_state"]["dtype"] == "bfloat16"

    def empty():
        with torch.device("meta"):
            model = TiedLM()
        return quantize_linears(quantize_embeddings(model, INT4), INT4)
    for load in (lambda model: load_model(model, path), lambda model: model.load_state_dict(state, assign=True)):
        model = empty()
        load(model)
        assert model.embed.dtype == torch.bfloat16 and model.head.weight is model.embed.weight
        with torch.no_grad():
            assert torch.equal(model(ids), want)
    with_values = quantize_linears(quantize_embeddings(TiedLM(), INT4), INT4)
    with_values.load_state_dict(source.state_dict())  # a state of its own: torch keeps assign=True in one's metadata
    assert with_values.embed.dtype == with_values.hidden.bias.dtype == torch.float32
    earlier_state = {key: value for key, value in state["embed._extra_state"].items() if key != "dtype"}
    earlier_file = tmp_path / "earlier.safetensors"
    qd.save(earlier_file, {key: value for key, value in qd.load(path).items() if key != "embed.dtype"})
    for load in (lambda model: load_model(model, earlier_file),
                 lambda model: model.load_state_dict({**state, "embed._extra_state": earlier_state,
                                                      "head._extra_state": earlier_state}, assign=True)):
        model = empty()
        load(model)
        assert model.embed.dtype == torch.float32 and model.hidden.bias.dtype == torch.bfloat16
    with pytest.raises(qd.SerializationError, match=r"^embed\._extra_state: a QEmbedding's _extra_state 'dtype' .*"
                                                     r"'bfloat16'.*got 'int8'"):
        empty().load_state_dict({**state, "embed._extra_state": {**earlier_state, "dtype": "int8"}}, assign=True)
    bad_file = tmp_path / "bad.safetensors"
    qd.save(bad_file, {**qd.load(path), "embed.dtype": np.zeros(0, np.int32)})
    with pytest.raises(qd.SerializationError, match=r"'embed\.dtype' holds a QEmbedding's dtype.*got int32"):
        load_model(empty(), bad_file)
    # a model of quantized layers alone, built on meta: no float tensor says it is one
    tables = quantize_embeddings(torch.nn.Sequential(torch.nn.Embedding(50, 64)), INT4).to(torch.float16)
    save_model(tables, tmp_path / "tables.safetensors")
    with torch.device("meta"):
        bare = torch.nn.Sequential(torch.nn.Embedding(50, 64))
    bare = load_model(quantize_embeddings(bare, INT4), tmp_path / "tables.safetensors")
    assert bare[0].dtype == torch.float16
    assert torch.equal(bare(ids), tables(ids))
    # beside float layers that hold values, those keep their own tensors and dtype (no assign)
    source = quantize_embeddings(torch.nn.Sequential(torch.nn.Embedding(50, 64), torch.nn.LayerNorm(64)), INT4)
    save_model(source.to(torch.float16), tmp_path / "mixed.safetensors")
    mixed = torch.nn.Sequential(torch.nn.Embedding(50, 64, device="meta"), torch.nn.LayerNorm(64).double())
    mixed = quantize_embeddings(mixed, INT4)
    norm = mixed[1].weight
    load_model(mixed, tmp_path / "mixed.safetensors")
    assert mixed[1].weight is norm and norm.dtype == torch.float64 and mixed[0].dtype == torch.float16
    # a table tied to an output layer before it: the one state of their weight holds the table's dtype
    pair = torch.nn.Sequential(torch.nn.Linear(64, 50, bias=False), torch.nn.Embedding(50, 64))
    pair[0].weight = pair[1].weight
    shared = quantize_embeddings(quantize_linears(pair, INT4), INT4).to(torch.float16).state_dict()
    assert shared["0._extra_state"]["qvalues"] is shared["1._extra_state"]["qvalues"]  # one weight, stored once
    assert shared["1._extra_state"]["dtype"] == "float16"
    # two tables sharing one weight, in two dtypes: each state says its own (both said the last one's)
    def two_tied_tables():
        tables = torch.nn.Sequential(torch.nn.Embedding(50, 64), torch.nn.Embedding(50, 64))
        tables[1].weight = tables[0].weight
        return tables
    tables = quantize_embeddings(two_tied_tables(), INT4)
    tables[1].to(torch.float16)
    state = tables.state_dict()
    with torch.device("meta"):
        bare = quantize_embeddings(two_tied_tables(), INT4)
    bare.load_state_dict(state, assign=True)
    assert (bare[0].dtype, bare[1].dtype) == (torch.float32, torch.float16) and bare[0].weight is bare[1].weight


def test_a_tied_float_checkpoint_loads_into_one_qtensor():
    """A float checkpoint of a tied model names its table twice (one storage): it is
    quantized once, and the layers stay tied.  Two tensors under the two names (a
    state dict each of whose entries was copied) still load as one weight, the last
    one loaded, as torch's copies into one tied Parameter do, with a warning that
    names both (a mixed-scheme checkpoint of a tied model gave its table the output
    layer's int4 weight without a word)."""
    class Tied(TinyLM):
        def __init__(self):
            super().__init__()
            self.head.weight = self.embed.weight

    float_model = Tied()
    with torch.device("meta"):
        empty = Tied()
    quantize_linears(quantize_embeddings(empty, PER_ROW), PER_ROW)
    assert empty.embed.weight is empty.head.weight
    for assign in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one storage under two names: nothing gives way
            empty.load_state_dict(float_model.state_dict(), assign=assign)
        assert empty.embed.weight is empty.head.weight
        want = qd.quantize(float_model.embed.weight.detach().numpy(), PER_ROW)
        np.testing.assert_array_equal(empty.head.weight.values, want.values)
    other = float_model.state_dict()
    other["head.weight"] = other["head.weight"].clone() * 2  # two tensors, the head's loaded last
    with pytest.warns(UserWarning, match=r"^embed.weight and head.weight hold different weights, but the two layers "
                                         r"share one quantized weight here .* both now use the one loaded last, "
                                         r"head.weight"):
        empty.load_state_dict(other)
    assert empty.embed.weight is empty.head.weight
    np.testing.assert_array_equal(empty.embed.weight.values, qd.quantize(other["head.weight"].numpy(), PER_ROW).values)


@pytest.mark.parametrize("quantized", [False, True], ids=["float checkpoint", "quantized checkpoint"])
def test_a_checkpoint_naming_a_tied_weight_once_loads_it_into_every_layer_that_shares_it(quantized):
    """Tied embeddings are often stored under one name only: as torch's copy into the
    shared Parameter reaches both layers, the table's new QTensor goes to the output
    layer too, which is not then missing; an untied checkpoint keeps two."""
    torch.manual_seed(0)
    source = TiedLM()
    with torch.no_grad():
        source.embed.weight.mul_(2)
    if quantized:
        quantize_linears(quantize_embeddings(source, PER_ROW), PER_ROW)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("head.")}  # one name
    model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    with torch.device("meta"):
        empty = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    h = torch.randn(2, 64)
    want = qd.quantize(source.embed.weight.detach().numpy() if not quantized
                       else source.embed.weight.dequantize().numpy(), PER_ROW)
    for target, assign in ((model, False), (empty, True)):
        missing = target.load_state_dict(state, assign=assign).missing_keys  # strict: nothing missing
        assert missing == [] and target.head.weight is target.embed.weight
        np.testing.assert_array_equal(target.head.weight.values, want.values)
        with torch.no_grad():
            torch.testing.assert_close(target.head(h), h @ torch.from_numpy(want.dequantize().numpy()).T)


def test_a_table_tied_to_the_output_layer_on_cuda():
    """One QTensor as the output layer's weight and the table: the decode kernel lays
    it out (and frees its store) on the first product; lookups still give its rows."""
    _needs_cuda()
    torch.manual_seed(0)
    head = QLinear.from_linear(torch.nn.Linear(256, 1000, bias=False), INT4, device="cuda")
    table = QEmbedding(head.weight, dtype=torch.bfloat16)
    want = torch.from_numpy(head.weight.dequantize().numpy()).to(torch.bfloat16)
    ids = torch.tensor([[3, 999, 0]], device="cuda")
    x = table(ids)
    assert x.is_cuda and x.dtype == torch.bfloat16
    logits = head(x)  # lays out the weight's tiles
    assert logits.shape == (1, 3, 1000)
    assert torch.equal(table(ids).cpu(), want[ids.cpu()])
    with pytest.raises(qd.BackendMismatchError, match="ids are on torch device 'cpu'.*ids.to\\('cuda:0'\\)"):
        table(ids.cpu())
    if torch.cuda.device_count() > 1:  # one backend, two GPUs: a device mismatch, as q_matmul's
        with pytest.raises(qd.DeviceMismatchError, match="ids are on torch device 'cuda:1'"):
            table(ids.to("cuda:1"))


def test_moves_between_cpu_and_cuda():
    _needs_cuda()
    model = quantize_embeddings(TinyLM(), PER_ROW, device=HOSTS[-1])
    ids = torch.tensor([1, 2])
    want = model.embed(ids)
    model.cuda()
    assert str(model.embed.weight.device) == "cuda:0"
    assert torch.equal(model.embed(ids.cuda()).cpu(), want)
    model.cpu()
    assert model.embed.weight.device.is_host and torch.equal(model.embed(ids), want)


class TiedLM(TinyLM):
    """TinyLM whose output layer is its table (tied embeddings, as many small LMs have)."""

    def __init__(self, vocab=50, dim=64):
        super().__init__(vocab, dim)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("linears_first", [True, False], ids=["linears first", "embeddings first"])
def test_tied_weights_stay_tied_through_quantization(linears_first):
    """One float weight under the table and the output layer becomes one QTensor, in
    whichever order the two are quantized, where the schemes and devices agree."""
    torch.manual_seed(0)
    model = TiedLM()
    want = qd.quantize(model.embed.weight.detach().numpy(), PER_ROW).dequantize().numpy()
    steps = [quantize_linears, quantize_embeddings]
    for step in steps if linears_first else steps[::-1]:
        step(model, PER_ROW)
    assert isinstance(model.head, QLinear) and isinstance(model.embed, QEmbedding)
    assert model.head.weight is model.embed.weight
    assert model.hidden.weight is not model.embed.weight
    ids = torch.tensor([4, 0, 49])
    assert torch.equal(model.embed(ids), torch.from_numpy(want[ids.numpy()]))
    for again in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # copies keep the tie
        assert again.head.weight is again.embed.weight


def test_a_mixed_scheme_checkpoint_of_a_tied_model_warns_where_the_tie_keeps_one():
    """The source's table and output layer parted (int8 and int4); a model quantized
    with one scheme ties them, so one of the two weights must give way: the warning
    says which.  A tied checkpoint loads into it without one."""
    torch.manual_seed(0)
    source = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), INT4)
    assert source.head.weight is not source.embed.weight
    tied = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    with pytest.warns(UserWarning, match=r"^embed._extra_state and head._extra_state hold different weights.* "
                                         r"the one loaded last, head._extra_state"):
        tied.load_state_dict(source.state_dict())
    assert tied.embed.weight is tied.head.weight and tied.embed.weight.scheme == INT4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tied.load_state_dict(quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW).state_dict())
        quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), INT4).load_state_dict(source.state_dict())  # untied


def test_tied_weights_part_where_the_schemes_or_devices_differ():
    torch.manual_seed(0)
    model = quantize_embeddings(quantize_linears(TiedLM(), INT4), PER_ROW)
    assert model.head.weight.scheme == INT4 and model.embed.weight.scheme == PER_ROW
    # the same values in another store, and a model on meta (no values to compare): still the scheme asked for
    packed = QuantScheme(PER_ROW.value, axis=PER_ROW.axis, store="packed_u32")
    model = quantize_embeddings(quantize_linears(TiedLM(), PER_ROW), packed)
    assert model.head.weight.scheme == PER_ROW and model.embed.weight.scheme == packed
    with torch.device("meta"):
        on_meta = TiedLM()
    assert quantize_embeddings(quantize_linears(on_meta, PER_ROW), INT4).embed.weight.scheme == INT4
    if len(HOSTS) > 1:
        model = quantize_embeddings(quantize_linears(TiedLM(), PER_ROW, device="reference"), PER_ROW, device="cpu")
        assert model.head.weight.device == "reference" and model.embed.weight.device == "cpu"
    kept = quantize_embeddings(quantize_linears(TiedLM(), PER_ROW, skip=["head"]), PER_ROW)
    assert isinstance(kept.head, torch.nn.Linear) and isinstance(kept.embed, QEmbedding)


@pytest.mark.parametrize("change", ["data.mul_", "data.copy_", "data ="])
def test_a_tied_weight_changed_through_data_is_quantized_anew(change):
    """A change through .data bumps no version counter: quantize_embeddings took the
    output layer's QTensor, quantized from the values before, and the table's rows
    were not its weight's.  The values now decide whether the two share one."""
    torch.manual_seed(0)
    model = quantize_linears(TiedLM(), PER_ROW)
    weight = model.embed.weight
    if change == "data.mul_":
        weight.data.mul_(2)
    elif change == "data.copy_":
        weight.data.copy_(torch.randn_like(weight))
    else:
        weight.data = torch.randn_like(weight)
    want = qd.quantize(weight.detach().numpy(), PER_ROW).dequantize().numpy()
    quantize_embeddings(model, PER_ROW)
    assert model.embed.weight is not model.head.weight
    ids = torch.tensor([4, 0, 49])
    assert torch.equal(model.embed(ids), torch.from_numpy(want[ids.numpy()]))


def test_a_tied_model_saves_its_weight_once_and_loads_tied(tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    source = quantize_linears(quantize_embeddings(TiedLM(), INT4), INT4)
    path = tmp_path / "tied.safetensors"
    save_model(source, path)
    stored = qd.load(path)
    assert stored["head.weight"] is stored["embed.weight"]  # one copy in the file, an alias beside it
    raw = path.read_bytes()
    entries = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert "embed.weight.qvalues" in entries and "head.weight.qvalues" not in entries
    with torch.device("meta"):
        model = TiedLM()
    load_model(quantize_linears(quantize_embeddings(model, INT4), INT4), path)
    assert model.head.weight is model.embed.weight
    ids = torch.tensor([[5, 6], [7, 49]])
    with torch.no_grad():
        assert torch.equal(model(ids), source(ids))
    untied = load_model(quantize_linears(quantize_embeddings(TinyLM(), INT4), INT4), path)
    assert untied.head.weight is not untied.embed.weight  # the alias reads as a weight of its own there
    with torch.no_grad():
        assert torch.equal(untied(ids), source(ids))


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_tied_state_dict_holds_the_weight_once_and_loads_tied(tmp_path, weights_only, monkeypatch):
    """state_dict() puts one extra state under both names, so torch.save pickles the
    shared weight once; load_state_dict, in memory or from that file, gives a tied
    pair one QTensor again (read once), and an untied pair two."""
    torch.manual_seed(0)
    source = quantize_linears(quantize_embeddings(TiedLM(), INT4), INT4)
    state = source.state_dict()
    assert state["head._extra_state"] is state["embed._extra_state"]
    assert state["hidden._extra_state"] is not state["embed._extra_state"]
    torch.save(state, tmp_path / "tied.pt")
    from_file = torch.load(tmp_path / "tied.pt", weights_only=weights_only)
    assert from_file["head._extra_state"] is from_file["embed._extra_state"]
    reads = []
    read = qtorch._weight_from_state
    monkeypatch.setattr(qtorch, "_weight_from_state", lambda *args, **kwargs: reads.append(1) or read(*args, **kwargs))
    for loaded in (state, from_file):
        model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)  # other values and scheme
        reads.clear()
        model.load_state_dict(loaded)
        assert len(reads) == 2  # the tied table once, the hidden layer's weight
        assert model.head.weight is model.embed.weight and model.head.weight.scheme == INT4
        assert model.hidden.weight is not model.embed.weight
        ids = torch.tensor([[5, 6], [7, 49]])
        with torch.no_grad():
            assert torch.equal(model(ids), source(ids))
        # a model whose layers are not tied keeps them apart, as torch keeps two Parameters
        untied = quantize_linears(quantize_embeddings(TinyLM(), PER_ROW), PER_ROW)
        untied.load_state_dict(loaded)
        assert untied.head.weight is not untied.embed.weight
        np.testing.assert_array_equal(untied.head.weight.values, source.head.weight.values)
        with torch.no_grad():
            assert torch.equal(untied(ids), source(ids))


def test_a_state_dict_into_a_plain_dict_holds_a_tied_weight_once():
    """state_dict(destination={}): a dict takes no weak reference, and the tied weight
    still goes in once, so it saves once and loads tied; a second call makes its own."""
    torch.manual_seed(0)
    source = quantize_linears(quantize_embeddings(TiedLM(), INT4), INT4)
    state = source.state_dict(destination={})
    assert type(state) is dict and state["head._extra_state"] is state["embed._extra_state"]
    again = source.state_dict(destination={})
    assert again["head._extra_state"] is again["embed._extra_state"] is not state["embed._extra_state"]
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    model.load_state_dict(torch.load(buffer, weights_only=True))
    assert model.head.weight is model.embed.weight
    with torch.no_grad():
        ids = torch.tensor([[5, 6], [7, 49]])
        assert torch.equal(model(ids), source(ids))


def test_a_state_dict_shares_only_what_is_one_weight():
    """Two weights of equal values, or a state edited between two loads, load as
    weights of their own."""
    torch.manual_seed(0)
    model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW, skip=["head"])
    model.head = QLinear.from_linear(model.head, PER_ROW)  # its own QTensor of the same values
    assert model.head.weight is not model.embed.weight
    state = model.state_dict()
    assert state["head._extra_state"] is not state["embed._extra_state"]
    again = quantize_linears(quantize_embeddings(TinyLM(), PER_ROW), PER_ROW)
    again.load_state_dict(state)
    first = again.head.weight
    assert first is not again.embed.weight and np.array_equal(first.values, again.embed.weight.values)
    stored = state["head._extra_state"]["qvalues"]
    stored[0, 0] = 5 if stored[0, 0] != 5 else 6  # edited in place: read anew
    again.load_state_dict(state)
    assert again.head.weight is not first and again.head.weight.values[0, 0] == stored[0, 0]
    assert again.embed.weight.values[0, 0] == first.values[0, 0]


@pytest.mark.parametrize("quantized", [False, True], ids=["float checkpoint", "quantized checkpoint"])
def test_each_load_reads_the_state_afresh(quantized):
    """A tied weight is read once within one load_state_dict() call, not across calls:
    an edit that torch does not count (through numpy, or .data) shows in the next load,
    and two models loaded from one state dict hold weights of their own."""
    torch.manual_seed(0)
    source = TiedLM()
    if quantized:
        quantize_linears(quantize_embeddings(source, PER_ROW), PER_ROW)
    state = source.state_dict()
    first, second = (quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW) for _ in range(2))
    first.load_state_dict(state)
    before = first.embed.weight.values.copy()
    table = state["embed._extra_state"]["qvalues"] if quantized else state["embed.weight"]
    table.numpy()[0, :] = -table.numpy()[0, :]  # in place, unseen by torch's version counter
    table.data[1, :] = 0
    second.load_state_dict(state)
    assert second.embed.weight is second.head.weight and second.embed.weight is not first.embed.weight
    np.testing.assert_array_equal(first.embed.weight.values, before)
    want = (qd.quantize(table.numpy(), PER_ROW).values if not quantized
            else np.concatenate([-before[:1], np.zeros_like(before[1:2]), before[2:]]))
    np.testing.assert_array_equal(second.embed.weight.values, want)


class GPTLike(torch.nn.Module):
    """The table inside a submodule, tied to an output layer beside it (GPT-2's layout)."""

    def __init__(self, vocab=50, dim=32):
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(vocab, dim),
                                                    h=torch.nn.Linear(dim, dim)))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids):
        return self.lm_head(self.transformer.h(self.transformer.wte(ids)))


@pytest.mark.parametrize("copied", [False, True], ids=["model", "deepcopy"])
@pytest.mark.parametrize("quantized", [False, True], ids=["float checkpoint", "quantized checkpoint"])
def test_a_load_into_a_submodule_reaches_a_tied_layer_outside_it(quantized, copied):
    """model.transformer.load_state_dict(...) replaces the table's QTensor: the output
    layer beside the submodule shares it, and must follow, as a tied Parameter does."""
    torch.manual_seed(0)
    source = GPTLike()
    if quantized:
        quantize_linears(quantize_embeddings(source, PER_ROW), PER_ROW)
    model = quantize_linears(quantize_embeddings(GPTLike(), PER_ROW), PER_ROW)
    if copied:
        model = copy.deepcopy(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    result = model.transformer.load_state_dict(source.transformer.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.tensor([[1, 2, 3]])
    want = qd.quantize(source.transformer.wte.weight.detach().numpy() if not quantized
                       else source.transformer.wte.weight.dequantize().numpy(), PER_ROW)
    np.testing.assert_array_equal(model.lm_head.weight.values, want.values)
    with torch.no_grad():
        if quantized:
            assert torch.equal(model(ids), source(ids))
        else:
            quantize_linears(quantize_embeddings(source, PER_ROW), PER_ROW)
            torch.testing.assert_close(model(ids), source(ids))


def test_a_layer_of_another_shape_is_reported_with_the_rest_and_ties_hold():
    """A quantized layer whose checkpoint entry has another shape is a size mismatch,
    as torch reports one: the other layers still load (the tied pair as one), and a
    later load naming the tied weight once reaches both layers."""
    torch.manual_seed(0)

    def model(width):
        m = TiedLM()
        m.hidden = torch.nn.Linear(64, width)
        m.tail = torch.nn.Linear(64, 64)  # after the mismatch, in the model's order
        return quantize_linears(quantize_embeddings(m, PER_ROW), PER_ROW)

    target, wider = model(64), model(48)
    with pytest.raises(RuntimeError, match=r"size mismatch for hidden\._extra_state: .*\(48, 64\).*\(64, 64\)"):
        target.load_state_dict(wider.state_dict(), strict=False)
    assert target.head.weight is target.embed.weight
    for name in ("embed", "tail"):  # loaded beside it
        np.testing.assert_array_equal(getattr(target, name).weight.values, getattr(wider, name).weight.values)
    good = model(64)
    once = {k: v for k, v in good.state_dict().items() if not k.startswith("head.")}
    assert target.load_state_dict(once).missing_keys == []
    assert target.head.weight is target.embed.weight
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(target(ids), good(ids))


class TwoLinears(torch.nn.Module):
    """Two layers of one shape, not tied."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64, bias=False)
        self.b = torch.nn.Linear(64, 64, bias=False)


def test_layers_that_are_not_tied_never_come_to_share_a_weight():
    """One tensor under two untied layers' names (or a float weight each, converted
    by a hook and freed as its layer loads) loads into two QTensors, each layer its
    own values, and a later load of one leaves the other as it was, as torch's two
    Parameters would."""
    torch.manual_seed(0)
    model = quantize_linears(TwoLinears(), PER_ROW)
    same = torch.randn(64, 64)
    model.load_state_dict({"a.weight": same, "b.weight": same})
    assert model.a.weight is not model.b.weight
    b_before = model.b.weight
    model.load_state_dict({"a.weight": torch.randn(64, 64)}, strict=False)
    assert model.b.weight is b_before

    def to_float32(module, state_dict, prefix, *_):  # a copy each layer frees once it has loaded
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"].float()
    for layer in (model.a, model.b):
        layer.register_load_state_dict_pre_hook(to_float32)
    half = {name: torch.randn(64, 64, dtype=torch.float16) for name in ("a.weight", "b.weight")}
    model.load_state_dict(half)
    for name in ("a", "b"):
        want = qd.quantize(half[name + ".weight"].float().numpy(), PER_ROW)
        np.testing.assert_array_equal(getattr(model, name).weight.values, want.values)


def test_a_load_started_from_another_loads_hook_keeps_its_own_account():
    """A load run from inside another load (a hook filling a second model) does not
    make the first forget which layer was given the tied weight."""
    torch.manual_seed(0)
    good = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    once = {k: v for k, v in good.state_dict().items() if not k.startswith("head.")}
    aux = quantize_linears(TwoLinears(), PER_ROW)
    aux_state = aux.state_dict()
    for head_first in (False, True):
        model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
        if head_first:  # the tied layer without an entry loads before the one with it
            model._modules["embed"] = model._modules.pop("embed")
        model.hidden.register_load_state_dict_pre_hook(lambda *_: [aux.load_state_dict(aux_state) for _ in range(8)])
        assert model.load_state_dict(once).missing_keys == []
        assert model.head.weight is model.embed.weight
        np.testing.assert_array_equal(model.head.weight.values, good.embed.weight.values)


def test_a_tied_weight_changed_by_a_hook_between_its_layers_loads_is_read_again():
    """One tensor under both names of a tied weight, changed in place by a hook
    before the second layer loads: the pair takes the changed values, as torch's
    float model would, not the first read's."""
    torch.manual_seed(0)
    source = TiedLM()
    state = {k: v.clone() for k, v in source.state_dict().items()}
    state["head.weight"] = state["embed.weight"]

    model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    model.hidden.register_load_state_dict_pre_hook(lambda *_: state["embed.weight"].mul_(2))  # after embed's read
    model.load_state_dict(state)
    assert model.head.weight is model.embed.weight
    want = qd.quantize(2 * source.embed.weight.detach().numpy(), PER_ROW)
    np.testing.assert_array_equal(model.head.weight.dequantize().numpy(), want.dequantize().numpy())


def test_an_untied_layer_between_a_tied_pair_keeps_the_pair_read_once(monkeypatch):
    """One extra state under three names, two of them tied and one not, the untied
    one loaded between them: the pair reads it once, the other layer its own."""
    class Three(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c, self.b = (torch.nn.Linear(64, 64, bias=False) for _ in range(3))
            self.b.weight = self.a.weight
    source = quantize_linears(Three(), PER_ROW)
    entry = source.state_dict()["a._extra_state"]
    reads = []
    read = qtorch._weight_from_state
    monkeypatch.setattr(qtorch, "_weight_from_state", lambda *args, **kwargs: reads.append(1) or read(*args, **kwargs))
    model = quantize_linears(Three(), PER_ROW)
    model.load_state_dict({name + "._extra_state": entry for name in "acb"})
    assert len(reads) == 2 and model.a.weight is model.b.weight and model.c.weight is not model.a.weight
    for name in "acb":
        np.testing.assert_array_equal(getattr(model, name).weight.values, source.a.weight.values)


def test_set_extra_state_called_by_a_hook_on_another_layer_is_its_own_call():
    """A hook of one layer's load calling set_extra_state on a layer outside the load:
    that call raises its own ShapeError, and the load's layer is not blamed."""
    model = quantize_linears(TwoLinears(), PER_ROW)
    outside = QLinear.from_linear(torch.nn.Linear(64, 64, bias=False), PER_ROW)
    narrow = QLinear.from_linear(torch.nn.Linear(32, 64, bias=False), PER_ROW).state_dict()["_extra_state"]
    refused = []

    def hook(*_):
        with pytest.raises(qd.ShapeError, match=r"\(64, 32\)"):
            outside.set_extra_state(narrow)
        refused.append(True)
    model.a.register_load_state_dict_pre_hook(hook)
    model.load_state_dict(model.state_dict())
    assert refused == [True]


def test_a_size_mismatch_leaves_the_rest_of_the_layers_keys_reported():
    """The mismatch goes to torch's error list and torch's own scan of the layer's
    keys goes on: a stray key beside it is still unexpected."""
    target = quantize_linears(TwoLinears(), PER_ROW)
    narrow = QLinear.from_linear(torch.nn.Linear(32, 64, bias=False), PER_ROW)
    state = {"a._extra_state": narrow.state_dict()["_extra_state"], "a.stray": torch.zeros(1),
             "b._extra_state": target.b.state_dict()["_extra_state"]}
    with pytest.raises(RuntimeError, match=r'(?s)Unexpected key\(s\) in state_dict: "a\.stray".*size mismatch '
                                           r'for a\._extra_state: .*\(64, 32\)'):
        target.load_state_dict(state)
    result = target.load_state_dict({k: v for k, v in state.items() if k != "a._extra_state"}, strict=False)
    assert result.unexpected_keys == ["a.stray"]


def test_state_dicts_made_on_several_threads_at_once():
    """Each state_dict() call knows its own destination: eight threads at once get
    whole state dicts, a tied weight's state under both names."""
    import threading
    torch.manual_seed(0)
    model = quantize_linears(quantize_embeddings(TiedLM(), PER_ROW), PER_ROW)
    want = model.embed.weight.values
    failures = []

    def work():
        try:
            for _ in range(50):
                state = model.state_dict()
                assert state["head._extra_state"] is state["embed._extra_state"]
                assert np.array_equal(state["embed._extra_state"]["qvalues"].numpy(), want)
        except Exception as exc:  # noqa: BLE001 - reported below, with the thread's error
            failures.append(repr(exc))
    threads = [threading.Thread(target=work) for _ in range(8)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, where the calls interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert failures == []


def test_a_destination_written_again_gets_the_weights_state_anew():
    """state_dict(destination=d) twice: the second call writes the weight's state
    again, as torch overwrites a destination, not what the first left (edited since)."""
    layer = QLinear.from_linear(torch.nn.Linear(64, 64), PER_ROW)
    d = {}
    layer.state_dict(destination=d)
    first = d["_extra_state"]
    first["qscales"] = first["qscales"] * 2  # edited in the destination
    layer.state_dict(destination=d)
    assert d["_extra_state"] is not first
    np.testing.assert_array_equal(d["_extra_state"]["qscales"].numpy(), layer.weight.scales.reshape(-1, 1))


def test_tied_float_weights_are_saved_once(tmp_path):
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    source = quantize_linears(TiedLM(), PER_ROW, skip=["head"])  # the tied pair stays in float
    save_model(source, tmp_path / "float.safetensors")
    stored = qd.load(tmp_path / "float.safetensors")
    assert stored["head.weight"] is stored["embed.weight"]
    model = quantize_linears(TiedLM(), PER_ROW, skip=["head"])
    load_model(model, tmp_path / "float.safetensors")
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, source.embed.weight)


def test_a_tied_model_moves_as_one_weight():
    _needs_cuda()
    torch.manual_seed(0)
    model = quantize_embeddings(quantize_linears(TiedLM(), INT4, device=HOSTS[-1]), INT4, device=HOSTS[-1])
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = model(ids)
    model.cuda()
    assert model.head.weight is model.embed.weight and str(model.embed.weight.device) == "cuda:0"
    with torch.no_grad():
        logits = model(ids.cuda())  # the decode kernel lays the weight out; lookups read its tiles
        torch.testing.assert_close(logits.cpu(), want, rtol=2e-5, atol=2e-5)
        assert torch.equal(model.embed(ids.cuda()).cpu(), model.cpu().embed(ids))
    assert model.head.weight is model.embed.weight and model.embed.weight.device.is_host


def test_lookups_replay_inside_a_cuda_graph():
    """A lookup captured in torch.cuda.graph reads the ids in place: each replay gives
    the rows an eager lookup gives; an id outside the table, which an eager lookup
    refuses, gives a row of NaN there (a graph can't check on the host).  The table's
    store, which the graph reads, stays after a product that lays out its tiles."""
    _needs_cuda()
    torch.manual_seed(0)
    table = QEmbedding.from_embedding(torch.nn.Embedding(1000, 256), INT4, device="cuda").to(torch.bfloat16)
    head = QLinear(table.weight)  # tied, not multiplied yet: the lookup reads the store
    static_ids = torch.zeros((2, 3), dtype=torch.long, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_rows = table(static_ids)
    assert static_rows.shape == (2, 3, 256) and static_rows.dtype == torch.bfloat16
    for ids in ([[5, 999, 5], [0, 1, 2]], [[3, 0, 7], [998, 4, 4]]):
        static_ids.copy_(torch.tensor(ids))
        graph.replay()
        assert torch.equal(static_rows, table(static_ids))
    with torch.no_grad():
        head(static_rows[0].float())  # lays out the tiles; the store is kept for the graph
    assert table.weight.storage.holds_values
    static_ids.copy_(torch.tensor([[-1, 1000, 4], [2**32 + 4, 4, -2**40]]))  # 2^32 + 4 is no row 4
    graph.replay()
    rows = static_rows.float().cpu()
    assert torch.isnan(rows[0, :2]).all() and torch.isnan(rows[1, 0]).all() and torch.isnan(rows[1, 2]).all()
    assert torch.equal(static_rows[0, 2], table(torch.tensor([4], device="cuda"))[0])
    with pytest.raises(qd.OutOfRangeError):
        table(static_ids)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "columns"])
def test_unchecked_lookups_leave_the_ids_on_the_gpu(monkeypatch, transposed):
    """check_ids=False: CUDA ids are never read on the host (torch's sync debug mode
    would raise on a copy), eager lookups give the checked rows in every dtype and for
    int32 and 2-D ids, an id outside gives a row of NaN, and lookups on a side stream
    come in that stream's order.  A table stored as columns is turned for the call."""
    _needs_cuda()
    from qdispatch import tensor_api
    rng = np.random.default_rng(0)
    if transposed:
        stored = qd.quantize(rng.standard_normal((64, 300)).astype(np.float32), QuantScheme("q8s", axis=1),
                             device="cuda")
        table = QEmbedding(stored.T, check_ids=False)
    else:
        table = QEmbedding(qd.quantize(rng.standard_normal((300, 64)).astype(np.float32), INT4, device="cuda"),
                           check_ids=False)
    assert "check_ids=False" in repr(table)
    full = torch.from_numpy(table.weight.dequantize().numpy()).cuda()
    ids = torch.tensor([[299, 0, 5], [5, 17, 2]], device="cuda")
    ids32, outside_ids = ids.int(), torch.tensor([-1, 300, 7, 2**32 + 7], device="cuda")
    no_ids = torch.zeros((0, 4), dtype=torch.long, device="cuda")

    def read_on_host(*args, **kwargs):
        raise AssertionError("the ids were read on the host")
    monkeypatch.setattr(tensor_api, "embedding", read_on_host)
    monkeypatch.setattr(tensor_api, "embedding_ids", read_on_host)
    got = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            table.dtype = dtype
            got[dtype] = table(ids), table(ids32)
        outside, empty = table(outside_ids), table(no_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for dtype, (rows, rows32) in got.items():
        assert rows.dtype == dtype and rows.shape == (2, 3, 64) and rows.device == ids.device
        assert torch.equal(rows, torch.nn.functional.embedding(ids, full).to(dtype))
        assert torch.equal(rows32, rows)
    outside = outside.float().cpu()
    assert torch.isnan(outside[[0, 1, 3]]).all()
    assert torch.equal(outside[2], full[7].cpu().to(torch.float16).float())  # the table's dtype by then
    assert empty.shape == (0, 4, 64) and empty.dtype == torch.float16
    side = torch.cuda.Stream()
    big = torch.randint(0, 300, (4096,), device="cuda")
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream())
        ids_there = big.flip(0) * 1  # written on the side stream just before the lookup reads it
        rows = table(ids_there)
        del ids_there  # its memory may go to torch's next tensor on that stream, after the lookup
        later = torch.randint(0, 300, (4096,), device="cuda")
    side.synchronize()
    assert torch.equal(rows, torch.nn.functional.embedding(big.flip(0), full).to(table.dtype))
    assert later.shape == (4096,)
    monkeypatch.undo()
    table.check_ids = True  # the same kernel on the same ids, once they were looked at on the host
    assert torch.equal(table(ids), got[torch.float16][0]) and torch.equal(table(ids32), got[torch.float16][0])
    with pytest.raises(qd.OutOfRangeError, match=r"embedding id -1 at position \(0,\)"):
        table(outside_ids)


def test_a_tied_decode_step_replays_inside_a_cuda_graph():
    """Lookup, layers and the tied output layer in one graph, after the warm-up laid the
    weight out in tiles (its store freed): replays give the eager step's logits."""
    _needs_cuda()
    torch.manual_seed(0)
    model = TiedLM(vocab=1000, dim=256)
    quantize_embeddings(quantize_linears(model, INT4, device="cuda"), INT4, device="cuda")
    model.to("cuda", torch.bfloat16)  # the biases follow the weights
    assert model.head.weight is model.embed.weight
    static_ids = torch.tensor([[1, 2, 3]], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        model(static_ids)  # warm-up: lays out the tiles of every weight
        assert not model.embed.weight.storage.holds_values
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_logits = model(static_ids)
        for ids in ([[7, 999, 0]], [[42, 42, 5]]):
            static_ids.copy_(torch.tensor(ids))
            graph.replay()
            assert torch.equal(static_logits, model(static_ids))


def test_a_cuda_graph_refuses_a_lookup_it_cannot_hold():
    """A table stored as columns (a transposed QTensor) is turned for each lookup, which a
    graph can't hold: a clear error, the capture ends cleanly, and eager lookups work."""
    _needs_cuda()
    stored = qd.quantize(np.random.default_rng(0).standard_normal((64, 100)).astype(np.float32),
                         QuantScheme("q8s", axis=1), device="cuda")
    table = QEmbedding(stored.T)  # [100, 64], each row's scale along the stored columns
    ids = torch.tensor([3, 99], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(qd.KernelError, match="can't hold this lookup: the table's rows are stored as columns"):
        with torch.cuda.graph(graph):
            table(ids)
    want = torch.from_numpy(stored.T.dequantize().numpy()[[3, 99]])
    assert torch.equal(table(ids).cpu(), want)


def test_a_float_weight_changed_since_is_quantized_anew():
    """A tied weight loaded in place after its output layer was quantized (a checkpoint
    that holds only the table, as tied checkpoints do): the table is quantized from
    its new values, not tied to the output layer's stale QTensor."""
    torch.manual_seed(0)
    model = quantize_linears(TiedLM(), PER_ROW)
    new = torch.randn(50, 64)
    model.load_state_dict({"embed.weight": new}, strict=False)
    quantize_embeddings(model, PER_ROW)
    assert model.embed.weight is not model.head.weight
    np.testing.assert_array_equal(model.embed.weight.dequantize().numpy(),
                                  qd.quantize(new.numpy(), PER_ROW).dequantize().numpy())
