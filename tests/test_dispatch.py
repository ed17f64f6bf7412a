"""Mixed devices: typed errors that name both sides, and the transfer policies."""
import threading

import numpy as np
import pytest

import qdispatch as qd
from qdispatch import policy
from qdispatch._core import get_backend
from helpers import run_python

pytestmark = pytest.mark.skipif("cpu" not in qd.available_backends(),
                                reason="needs two host backends (reference and cpu)")


@pytest.fixture
def operands(rng):
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    xq = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference")
    wq = qd.quantize(w, qd.QuantScheme("q8s", axis=0), device="cpu")
    return xq, wq.T


def test_mismatch_names_both_devices_and_the_fix(operands):
    xq, wt = operands
    with pytest.raises(qd.BackendMismatchError) as err:
        qd.q_matmul(xq, wt)
    assert str(err.value) == (
        "q_matmul inputs are on different backends: lhs is on 'reference', rhs is on 'cpu'. "
        "Move one operand first (rhs.to('reference') or lhs.to('cpu')), or pass transfer='auto'.")
    assert isinstance(err.value, qd.QDispatchError) and isinstance(err.value, TypeError)


def test_a_linear_mismatch_names_linears_own_operands(operands):
    """It named q_matmul's lhs and rhs, and told to move rhs, which is w.T."""
    _, wt = operands
    x, w = qd.tensor(np.ones((2, 64), np.float32), device="reference"), wt.T
    with pytest.raises(qd.BackendMismatchError) as err:
        qd.linear(x, w)
    assert str(err.value) == (
        "linear inputs are on different backends: x is on 'reference', w is on 'cpu'. "
        "Move one operand first (w.to('reference') or x.to('cpu')), or pass transfer='auto'.")
    expect = qd.linear(x.to("cpu"), w).numpy()
    for mode, where in {"to_lhs": "reference", "to_rhs": "cpu", "auto": "cpu"}.items():
        out = qd.linear(x, w, transfer=mode)
        assert out.device == where, mode
        np.testing.assert_allclose(out.numpy(), expect, rtol=1e-5, atol=1e-5)
    with qd.transfer_policy("to_lhs"):
        assert qd.linear(x, w).device == "reference"


def test_mismatch_raises_before_any_kernel(operands, monkeypatch):
    xq, wt = operands
    for name in ("reference", "cpu"):
        for kernel in ("qq_matmul", "fq_matmul"):
            # on the class: pytest before 9 undid a patch of the object by leaving the bound method in its
            # __dict__, where it hid later tests' patches of the class
            monkeypatch.setattr(type(get_backend(name)), kernel,
                                lambda *a: pytest.fail("a kernel ran despite the mismatch"))
    with pytest.raises(qd.BackendMismatchError):
        qd.q_matmul(xq, wt)
    with pytest.raises(qd.BackendMismatchError):
        qd.q_matmul(qd.tensor(np.ones((2, 64), np.float32), device="reference"), wt)


def test_every_transfer_policy(operands):
    xq, wt = operands
    same = qd.q_matmul(xq.to("cpu"), wt).numpy()
    cases = {"to_lhs": "reference", "to_rhs": "cpu", "auto": "cpu"}
    for mode, where in cases.items():
        out = qd.q_matmul(xq, wt, transfer=mode)
        assert out.device == where, mode
        np.testing.assert_allclose(out.numpy(), same, rtol=1e-5, atol=1e-5)
        with qd.transfer_policy(mode):
            assert qd.q_matmul(xq, wt).device == where
    with qd.transfer_policy("auto"):
        with pytest.raises(qd.BackendMismatchError):
            qd.q_matmul(xq, wt, transfer="error")  # the argument wins over the context
    with pytest.raises(qd.BackendMismatchError):
        qd.q_matmul(xq, wt)  # the context is gone after the block
    with pytest.raises(ValueError, match="Unknown transfer policy"):
        qd.q_matmul(xq, wt, transfer="sometimes")
    with pytest.raises(ValueError, match=r"Unknown transfer policy array\(\['auto', 'error'\]"):
        qd.q_matmul(xq, wt, transfer=np.array(["auto", "error"]))  # was numpy's "truth value is ambiguous"


def test_a_transfer_policy_holds_for_the_thread_that_enters_it(operands):
    import asyncio
    xq, wt = operands
    seen = []
    def other_thread():
        try:
            qd.q_matmul(xq, wt)
        except qd.BackendMismatchError:
            seen.append("error")
    with qd.transfer_policy("auto"):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert qd.q_matmul(xq, wt).device == "cpu"
        # asyncio.to_thread runs in a copy of the caller's context, policy included
        moved = asyncio.run(asyncio.to_thread(lambda: qd.q_matmul(xq, wt)))
        assert moved.device == "cpu"
    assert seen == ["error"]


def test_a_bad_transfer_is_refused_even_when_nothing_moves(rng):
    x = rng.standard_normal((2, 32)).astype(np.float32)
    w = qd.quantize(rng.standard_normal((4, 32)).astype(np.float32), "q8s", device="cpu")
    for bad in ("yes", "AUTO", 123):
        with pytest.raises(ValueError, match="Unknown transfer policy"):
            qd.q_matmul(x, w.T, transfer=bad)
        with pytest.raises(ValueError, match="Unknown transfer policy"):
            qd.linear(x, w, transfer=bad)
        with pytest.raises(ValueError, match="Unknown transfer policy"):
            qd.int_matmul(np.ones((2, 3), np.int8), np.ones((3, 2), np.int8), transfer=bad)


def test_a_bias_on_another_backend_follows_the_transfer_policy(rng):
    x = rng.standard_normal((2, 32)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((4, 32)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
    bias = qd.tensor(rng.standard_normal(4).astype(np.float32), device="reference")
    expect = qd.linear(x, wq, bias.to("cpu")).numpy()
    with pytest.raises(qd.BackendMismatchError, match=r"bias is on 'reference' but the output is on 'cpu'.*"
                                                       r"bias.to\('cpu'\), or pass transfer='auto'"):
        qd.linear(x, wq, bias)
    out = qd.linear(x, wq, bias, transfer="auto")
    assert out.device == "cpu" and bias.device == "reference"
    np.testing.assert_array_equal(out.numpy(), expect)
    with qd.transfer_policy("to_lhs"):
        np.testing.assert_array_equal(qd.linear(x, wq, bias).numpy(), expect)


def test_auto_moves_towards_the_faster_backend(operands):
    """Whichever side it is on: the faster backend on the left is where to_lhs would go."""
    xq, wt = operands
    x = qd.tensor(np.ones((2, 64), np.float32))
    i8 = np.ones((2, 64), np.int8)
    for on in (("reference", "cpu"), ("cpu", "reference")):
        assert qd.q_matmul(xq.to(on[0]), wt.to(on[1]), transfer="auto").device == "cpu"
        assert qd.linear(x.to(on[0]), wt.T.to(on[1]), transfer="auto").device == "cpu"
        assert qd.int_matmul(qd.tensor(i8, device=on[0]), qd.tensor(i8.T, device=on[1]),
                             transfer="auto").device == "cpu"


def test_transfer_never_changes_a_value(rng):
    for scheme in (qd.QuantScheme("q8f", block=32), qd.QuantScheme("q4s", block=32, store="packed_u32"),
                   qd.QuantScheme("q2f", axis=0, store="packed_u32", scale_dtype="f16")):
        q = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), scheme, device="reference")
        moved = q.to("cpu").to("reference").to("cpu")
        assert moved.device == "cpu" and moved.scheme == q.scheme
        np.testing.assert_array_equal(moved.values, q.values)
        np.testing.assert_array_equal(moved.scales, q.scales)
        np.testing.assert_array_equal(moved.T.values, q.T.values)
    t = qd.tensor(rng.standard_normal((3, 5)).astype(np.float32), device="reference")
    np.testing.assert_array_equal(t.to("cpu").numpy(), t.numpy())


def test_moving_to_the_device_a_tensor_is_on_is_no_copy(device, rng):
    """As torch's .to: the tensor itself (a weight's panels and cached tiles stay
    shared), under any spelling of its device."""
    q = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), "q8s", device=device)
    t = qd.tensor(rng.standard_normal((3, 5)).astype(np.float32), device=device)
    for spelling in (device, q.device, qd.Device(device)):
        assert q.to(spelling) is q and t.to(spelling) is t


def test_device_index_mismatch_is_its_own_error():
    payload = np.ones((2, 4), np.float32)
    a = qd.Tensor(payload, "float32", (2, 4), int(qd.BackendKind.REFERENCE), 0)
    b = qd.Tensor(payload.T.copy(), "float32", (4, 2), int(qd.BackendKind.REFERENCE), 1)
    with pytest.raises(qd.DeviceMismatchError, match=r"a is on 'reference', b is on 'reference:1'. Move one "
                                                     r"operand first \(b.to\('reference'\) or a.to\('reference:1'\)\)"):
        qd.int_matmul(a, b)
    with pytest.raises(qd.BackendUnavailableError, match="one device"):
        qd.tensor(payload, device="reference:1")


def test_numpy_operands_join_the_quantized_operands_device(operands, rng):
    _, wt = operands
    out = qd.q_matmul(rng.standard_normal((2, 64)).astype(np.float32), wt)
    assert out.device == "cpu"
    assert qd.q_matmul(rng.standard_normal((2, 64)).astype(np.float32), wt.T.to("reference").T).device == "reference"


def test_int_matmul_mismatch():
    a = qd.tensor(np.ones((2, 3), np.int8), device="reference")
    b = qd.tensor(np.ones((3, 2), np.int8), device="cpu")
    with pytest.raises(qd.BackendMismatchError, match="int_matmul inputs are on different backends"):
        qd.int_matmul(a, b)
    np.testing.assert_array_equal(qd.int_matmul(a, b, transfer="auto").numpy(), np.full((2, 2), 3))


def test_default_backend(monkeypatch):
    assert qd.default_device() == "cpu"
    try:
        qd.set_default_backend("reference")
        assert qd.quantize(np.ones((2, 2), np.float32)).device == "reference"
    finally:
        qd.set_default_backend("cpu")
    with pytest.raises(ValueError, match="Unknown device"):
        qd.set_default_backend("tpu")


def test_a_default_set_while_another_thread_first_chooses_one_holds(monkeypatch):
    # thread A's first lookup is choosing the default when set_default_backend runs
    # in thread B: B's choice must be the one that stays, not A's
    choosing, go = threading.Event(), threading.Event()
    best_host = policy._best_host

    def slow_best_host():
        choosing.set()
        go.wait(5)
        return best_host()

    monkeypatch.setattr(policy, "_default_device", None)
    monkeypatch.setattr(policy, "_best_host", slow_best_host)
    first = threading.Thread(target=qd.default_device)
    first.start()
    assert choosing.wait(5)
    setter = threading.Thread(target=qd.set_default_backend, args=("reference",))
    setter.start()
    setter.join(0.2)  # it waits for the choice in progress
    go.set()
    first.join(5)
    setter.join(5)
    assert qd.default_device() == "reference"
    assert qd.tensor(np.ones(2, np.float32)).device == "reference"


@pytest.mark.skipif("cuda" in qd.available_backends(), reason="cuda is built and present")
def test_cuda_unavailable_says_why_and_how_to_rebuild(rng):
    q = qd.quantize(rng.standard_normal((4, 8)).astype(np.float32), "q8s")
    with pytest.raises(qd.BackendUnavailableError, match="cuda") as err:
        q.to("cuda")
    assert "pip install" in str(err.value) or "GPU" in str(err.value) or "driver" in str(err.value)


@pytest.mark.skipif("cuda" in qd.available_backends(), reason="cuda is built and present")
def test_gpu_memory_calls_without_cuda():
    with pytest.raises(qd.BackendUnavailableError, match="cuda"):
        qd.memory_info("cuda")
    qd.empty_cache()  # nothing is cached: a no-op, as on any machine without a GPU
    with pytest.raises(qd.BackendUnavailableError, match="cuda"):
        qd.empty_cache("cuda:0")


def test_synchronize_host_devices_is_a_no_op():
    for device in ("cpu", "reference"):
        assert qd.synchronize(device) is None


@pytest.mark.skipif("cuda" in qd.available_backends(), reason="cuda is built and present")
def test_synchronize_without_cuda_says_why():
    with pytest.raises(qd.BackendUnavailableError, match="cuda"):
        qd.synchronize("cuda")


def test_gpu_memory_calls_refuse_host_devices():
    for call in (qd.memory_info, qd.empty_cache):
        with pytest.raises(ValueError, match="'cpu' is host memory.*'cuda'"):
            call("cpu")
    with pytest.raises(ValueError, match="Unknown device"):
        qd.memory_info("gpu")


def test_batch_invariance_setting():
    assert not qd.batch_invariant()  # off by default: the fastest cut of K for each batch size
    try:
        qd.set_batch_invariant(True)
        assert qd.batch_invariant()
        try:
            from qdispatch import _cuda
        except ImportError:  # built without CUDA: the setting is kept on the Python side only
            _cuda = None
        shown = qd.info()["backends"]["cuda"]
        if _cuda is not None:  # shown where CUDA is built
            assert shown["batch_invariant"] is True
        else:
            assert "batch_invariant" not in shown
        assert _cuda is None or _cuda.batch_invariant()  # the C library's, which the kernels read
    finally:
        qd.set_batch_invariant(False)
    assert not qd.batch_invariant()
    code = "import qdispatch as qd; print(qd.batch_invariant())"
    for value, on in (("1", True), (" On ", True), ("yes", True), ("0", False), ("off", False), ("", False)):
        child = run_python("-W", "error", "-c", code, QDISPATCH_BATCH_INVARIANT=value)
        assert child.stdout.strip() == str(on), (value, child.stderr[-2000:])
    for typo in ("2", "enabled", "abc"):  # were off without a word
        child = run_python("-c", code, QDISPATCH_BATCH_INVARIANT=typo)
        assert child.stdout.strip() == "False"
        assert f"QDISPATCH_BATCH_INVARIANT={typo!r} is neither 1 nor 0" in child.stderr


@pytest.mark.parametrize("value", ["false", "0", 1, None, np.array([True])])
def test_batch_invariance_takes_a_bool(value):
    """set_batch_invariant("false") turned it on: bool() of any non-empty string is True."""
    with pytest.raises(TypeError, match=r"set_batch_invariant takes True or False, got "):
        qd.set_batch_invariant(value)
    assert not qd.batch_invariant()
    qd.set_batch_invariant(np.bool_(True))  # numpy's bool is one
    try:
        assert qd.batch_invariant()
    finally:
        qd.set_batch_invariant(False)


@pytest.mark.parametrize("device", [d for d in ("reference", "cpu") if d in qd.available_backends()])
def test_host_backends_batch_invariant(rng, device):
    # The cpu backend always; the reference one when asked (numpy's BLAS sums a
    # product's rows in an order that depends on how many there are).
    x = rng.standard_normal((40, 512)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((96, 512)).astype(np.float32), "q4s", device=device)
    try:
        qd.set_batch_invariant(True)
        full = qd.q_matmul(qd.tensor(x, device=device), wq.T).numpy()
        for M in (1, 2, 5, 16, 17, 39):
            np.testing.assert_array_equal(qd.q_matmul(qd.tensor(x[:M], device=device), wq.T).numpy(), full[:M])
    finally:
        qd.set_batch_invariant(False)


def test_default_backend_from_the_environment():
    code = "import numpy as np, qdispatch as qd; print(qd.quantize(np.ones((2, 2), np.float32)).device)"
    out = run_python("-c", code, QDISPATCH_BACKEND="reference")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reference"
