"""Float tensors: numpy memory sharing, DLPack, devices and reprs."""
import ctypes
import re
import sys
import warnings

import numpy as np
import pytest

import qdispatch as qd
from helpers import run_python
from qdispatch._core import get_backend
from qdispatch.backends import host as host_backend


def test_host_tensor_shares_memory_with_numpy(device):
    if device == "cuda":
        pytest.skip("device memory")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = qd.tensor(a, device=device)
    assert np.shares_memory(np.asarray(t), a)
    a[0, 0] = 42
    assert np.asarray(t)[0, 0] == 42


@pytest.mark.skipif(np.lib.NumpyVersion(np.__version__) < "2.0.0", reason="numpy 1.x's asarray takes no copy=")
def test_asarray_copy_false_refuses_a_conversion_as_numpy_does(device):
    """numpy 2 hands __array__ its copy= argument: False promises a view, so a dtype
    change (or bfloat16, which the host reads as float32) must refuse, not copy."""
    if device == "cuda":
        pytest.skip("device memory")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = qd.tensor(a, device=device)
    assert np.shares_memory(np.asarray(t, dtype=np.float32, copy=False), a)
    assert not np.shares_memory(np.asarray(t, copy=True), a)
    np.testing.assert_array_equal(np.asarray(t, dtype=np.float64), a)
    with pytest.raises(ValueError, match="Can't view a float32 Tensor as float64 without a copy"):
        np.asarray(t, dtype=np.float64, copy=False)
    with pytest.raises(ValueError, match="Can't view a bfloat16 Tensor as float32 without a copy"):
        np.asarray(qd.tensor(a, device=device, dtype="bfloat16"), copy=False)


def test_dlpack_round_trip_without_copy():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = qd.from_dlpack(a)
    back = np.from_dlpack(t)
    assert np.shares_memory(back, a)
    np.testing.assert_array_equal(back, a)


def test_from_dlpack_of_data_without_dlpack_says_what_it_takes():
    for data in ([1.0, 2.0], np.float32(2.0)):
        with pytest.raises(TypeError, match=f"speaks DLPack.*got {type(data).__name__}: use qdispatch.tensor"):
            qd.from_dlpack(data)


def test_from_dlpack_of_data_dlpack_cannot_carry_says_what_to_do():
    """numpy exports no big-endian array: that was a bare BufferError."""
    a = np.arange(3, dtype=">f4")
    with pytest.raises(TypeError, match=r"from_dlpack can't view this ndarray without a copy \(.*byte order.*\): "
                                        r"copy it in with qdispatch.tensor"):
        qd.from_dlpack(a)
    np.testing.assert_array_equal(qd.tensor(a).numpy(), a)


def test_a_qtensor_given_as_data_says_where_its_values_are(rng):
    """It said "from_dlpack can't view this QTensor without a copy: copy it in with
    qdispatch.tensor(...)", which was the call that failed."""
    w = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), "q8s")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for take in (qd.tensor, qd.quantize, qd.from_dlpack, lambda q: qd.linear(x, w, bias=q)):
        with pytest.raises(qd.ArgumentTypeError, match=r"A QTensor is no float or integer data to take in: its "
                                                       r"float values are q.dequantize\(\)"):
            take(w)


class _Producer:
    """A DLPack producer that says what it is told to."""
    def __init__(self, device, capsule=5):
        self.device, self.capsule = device, capsule

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        return self.capsule


@pytest.mark.parametrize("take", [qd.from_dlpack, qd.tensor, lambda p: qd.quantize(p, "q8s"),
                                  lambda p: qd.tensor(p, dtype="float32")])
@pytest.mark.parametrize("device,match", [
    # numpy's ValueErrors, untyped: "PyCapsule_GetPointer called with invalid ...", "too many values to unpack"
    ((1, 0), r"can't read this _Producer: its __dlpack__ gave no DLPack tensor numpy reads"),
    ("cpu", r"_Producer.__dlpack_device__\(\) gave 'cpu', not DLPack's \(device type, device index\) pair"),
    ((1,), r"gave \(1,\), not DLPack's"),
    # every device but the CPU was taken for CUDA: "rebuild with QDISPATCH_CUDA=1"
    ((10, 0), r"memory is on DLPack device type 10 \(ROCm\), which qdispatch does not serve: it takes host "
              r"\(CPU\) and CUDA memory"),
    ((8, 0), r"device type 8 \(Metal\)"), ((99, 0), r"device type 99 \(an unknown device\)"),
])
def test_a_producer_that_breaks_dlpack_is_a_typed_error(take, device, match):
    with pytest.raises(qd.ArgumentTypeError, match=match):
        take(_Producer(device))


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(stream=5), qd.ArgumentError, r"__dlpack__ of a host Tensor: .*stream=None"),  # numpy's RuntimeError
    (dict(dl_device=(2, 0)), qd.DLPackExportError, r"A host Tensor can't be exported so: "),  # a bare BufferError
    (dict(max_version="x"), qd.ArgumentTypeError, r"__dlpack__ of a host Tensor: max_version"),
    (dict(copy="maybe"), qd.ArgumentError, r"__dlpack__ of a host Tensor: "),
])
@pytest.mark.parametrize("numpy_takes_them", [True, False])
def test_dlpack_export_arguments_numpy_refuses_are_typed_errors(monkeypatch, numpy_takes_them, kwargs, error, match):
    """numpy_takes_them=False: as with numpy before 2.1, which takes stream alone, so
    that qdispatch checks the protocol's later arguments itself."""
    _numpy_dlpack(monkeypatch, numpy_takes_them)
    with pytest.raises(error, match=match):
        qd.tensor(np.zeros(3, np.float32), device="reference").__dlpack__(**kwargs)


def _numpy_dlpack(monkeypatch, numpy_takes_them):
    """The host backend's export as with a numpy that takes max_version, dl_device and copy, or not."""
    if numpy_takes_them and not host_backend.NUMPY_DLPACK_1:
        pytest.skip("this numpy's __dlpack__ takes stream alone")
    monkeypatch.setattr(host_backend, "NUMPY_DLPACK_1", numpy_takes_them)


@pytest.mark.parametrize("numpy_takes_them", [True, False])
def test_dlpack_export_takes_the_protocols_arguments(monkeypatch, numpy_takes_them):
    """A versioned consumer's arguments on any numpy: before 2.1 numpy's __dlpack__
    refused them as unexpected keywords (torch then fell back, other consumers failed)."""
    _numpy_dlpack(monkeypatch, numpy_takes_them)
    a = np.arange(6, dtype=np.float32)
    t = qd.tensor(a, device="reference")

    class Exported:  # what t.__dlpack__ gave for these arguments, for np.from_dlpack
        def __init__(self, **kwargs):
            self.capsule = t.__dlpack__(**kwargs)

        def __dlpack__(self, **_):
            return self.capsule

        def __dlpack_device__(self):
            return (1, 0)

    assert np.shares_memory(np.from_dlpack(Exported(max_version=(1, 0), dl_device=(1, 0), copy=False)), a)
    copied = np.from_dlpack(Exported(stream=None, copy=True))
    assert not np.shares_memory(copied, a) and np.array_equal(copied, a)


def test_a_tensor_with_negative_strides_is_not_shared_through_dlpack():
    """torch's DLPack import aborts the process on negative strides, so such a Tensor
    refuses (a BufferError, the protocol's word) unless a copy is asked for."""
    a = np.arange(6, dtype=np.float32)[::-1]
    t = qd.tensor(a)
    with pytest.raises(BufferError, match=r"negative strides \(-4,\).*copy=True.*t\.numpy\(\)\.copy\(\), "
                                          r"dtype=t\.dtype"):
        t.__dlpack__()
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":  # from_dlpack's copy=
        copied = np.from_dlpack(t, copy=True)
        np.testing.assert_array_equal(copied, a)
        assert not np.shares_memory(copied, a)


def test_a_tensor_over_read_only_memory_is_not_shared_through_dlpack(tmp_path):
    """torch takes what DLPack gives as writable: a write through it changed a bytes
    object, and killed the process on a file mapped read-only."""
    path = tmp_path / "values"
    np.arange(3, dtype=np.float32).tofile(path)
    for data in (np.frombuffer(bytes(12), np.float32), np.memmap(path, dtype=np.float32, mode="r")):
        t = qd.tensor(data)
        with pytest.raises(BufferError, match=r"read-only memory .*copy=True.*t\.numpy\(\)\.copy\(\)"):
            t.__dlpack__()
        if np.lib.NumpyVersion(np.__version__) >= "2.1.0":  # from_dlpack's copy=
            copied = np.from_dlpack(t, copy=True)
            np.testing.assert_array_equal(copied, data)
            assert not np.shares_memory(copied, data)
            # writable, as a copy is, unless numpy reads all memory so (2.1 did)
            assert copied.flags.writeable or not np.from_dlpack(np.zeros(1)).flags.writeable
    np.from_dlpack(qd.tensor(np.zeros(3, np.float32)))  # writable memory is shared as before


def test_torch_takes_no_tensor_over_read_only_memory_and_lives(tmp_path):
    pytest.importorskip("torch")
    np.arange(3, dtype=np.float32).tofile(tmp_path / "values")
    code = ("import numpy as np, torch, qdispatch as qd, sys\n"
            "t = qd.tensor(np.memmap(sys.argv[1], dtype=np.float32, mode='r'))\n"
            "try:\n    torch.from_dlpack(t)[0] = 5\n"
            "except BufferError as exc:\n    print(exc)\n")
    child = run_python("-c", code, str(tmp_path / "values"))
    assert child.returncode == 0, child.stderr[-2000:]  # it was SIGSEGV
    assert "read-only memory" in child.stdout
    np.testing.assert_array_equal(np.fromfile(tmp_path / "values", np.float32), [0, 1, 2])


def test_torch_takes_no_tensor_with_negative_strides_and_lives():
    pytest.importorskip("torch")
    code = ("import numpy as np, torch, qdispatch as qd\n"
            "try:\n    torch.from_dlpack(qd.tensor(np.arange(6, dtype=np.float32)[::-1]))\n"
            "except BufferError as exc:\n    print(exc)\n")
    child = run_python("-c", code)
    assert child.returncode == 0, child.stderr[-2000:]  # it was SIGABRT
    assert "negative strides (-4,)" in child.stdout


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_from_dlpack_of_a_dtype_numpy_lacks_names_it():
    """float8 and complex32 were numpy's bare RuntimeError ('Unsupported dtype in DLTensor')."""
    torch = pytest.importorskip("torch")
    for dtype in (torch.float8_e4m3fn, torch.complex32):
        x = torch.zeros(4, 32, dtype=dtype)
        for take in (qd.from_dlpack, qd.tensor):
            with pytest.raises(TypeError, match=f"of dtype {dtype} .*convert it to float32, float16 or bfloat16"):
                take(x)
        with pytest.raises(TypeError, match=str(dtype).split(".")[1]):
            qd.quantize(x, "q8s")


@pytest.mark.parametrize("error", [RuntimeError, BufferError])
def test_a_dlpack_dtype_numpy_lacks_is_named_whichever_way_numpy_says_it(error):
    """"Unsupported dtype" comes as a RuntimeError here and as a BufferError with other
    numpy and torch versions; a BufferError about anything else means a view can't be had."""
    class Producer:
        dtype = "float8_e4m3fn"
        def __init__(self, message):
            self.message = message
        def __dlpack_device__(self):
            return (1, 0)
        def __dlpack__(self, **kwargs):
            raise error(self.message)
    with pytest.raises(TypeError, match=r"of dtype float8_e4m3fn \(Unsupported dtype in DLTensor.\): convert it"):
        qd.from_dlpack(Producer("Unsupported dtype in DLTensor."))
    if error is BufferError:
        with pytest.raises(TypeError, match=r"can't view this Producer without a copy \(big-endian\): copy it in"):
            qd.from_dlpack(Producer("big-endian"))


@pytest.mark.parametrize("data", [np.array([1, 300], complex), np.array([1, 300], "timedelta64[s]"),
                                  np.array(["2020-01-01"], "datetime64[D]"), np.array(["1.5"]),
                                  np.array([b"1.5"]), np.array([1.0, None])],
                         ids=["complex", "timedelta", "datetime", "text", "bytes", "objects"])
@pytest.mark.parametrize("dtype", ["int8", "int32", "float32", "float16", "bfloat16"])
def test_data_that_is_no_numbers_is_refused_whatever_the_dtype(data, dtype):
    """complex [1, 300] became int8 [1, 44], a date its day count wrapped; as float32,
    complex lost its imaginary part, text was parsed and None became NaN."""
    article = "an" if dtype.startswith("int") else "a"
    with pytest.raises(TypeError, match=f"Can't make {article} {dtype} tensor of .* data: only integers, floats "
                                        f"and bools"):
        qd.tensor(data, dtype=dtype, device="reference")


def test_a_torch_tensor_takes_dtype_as_numpy_data_does():
    """It became a dtype of qdispatch's own first: int64 [1, 300] was refused with the
    advice to pass dtype='int32', which the call did; float data refused int8."""
    torch = pytest.importorskip("torch")
    for values, dtype in (([1, 300], "int32"), ([1, 2], "int32"), ([1.0, -2.0], "int8")):
        t = qd.tensor(torch.tensor(values), dtype=dtype, device="reference")
        assert t.dtype == dtype and t.numpy().tolist() == values
    huge = qd.tensor(torch.tensor([1e300], dtype=torch.float64), dtype="float32", device="reference")
    assert huge.numpy().tolist() == [np.inf]  # as numpy's float64 is, with dtype given
    x = torch.ones(3)
    shared = qd.tensor(x, dtype="float32", device="reference")
    x[0] = 5
    assert shared.numpy()[0] == 5  # no conversion: still a view
    assert qd.tensor(torch.ones(2, dtype=torch.bfloat16), dtype="float32", device="reference").dtype == "float32"
    assert qd.tensor(torch.ones(2, requires_grad=True), dtype="float16", device="reference").dtype == "float16"
    with pytest.raises(TypeError, match="int8 tensor of int64 data: the value 300"):
        qd.tensor(torch.tensor([1, 300]), dtype="int8", device="reference")


def test_a_device_hashes_as_its_name_so_dicts_and_sets_find_it():
    """It equalled 'cpu' and hashed otherwise: `device in {'cpu'}` was False."""
    device = qd.tensor(np.ones(2, np.float32), device="reference").device
    assert device in {"reference"} and {"reference": 1}[device] == 1 and len({device, "reference"}) == 1
    assert hash(qd.Device.parse("cuda:1")) == hash("cuda:1")
    torch = pytest.importorskip("torch")
    assert qd.Device.parse("cpu") == torch.device("cpu") and qd.Device.parse("cuda:1") == torch.device("cuda:1")
    assert qd.Device.parse("cpu") != torch.device("cuda:0")


def test_device_parsing_and_repr(rng):
    assert qd.Device.parse("cuda:1").index == 1 and str(qd.Device.parse("cuda")) == "cuda:0"
    assert qd.Device.parse("cpu") == "cpu" and repr(qd.Device.parse("cpu")) == "Device('cpu')"
    with pytest.raises(ValueError, match="Unknown device"):
        qd.Device.parse("gpu")
    with pytest.raises(ValueError, match="Bad device index"):
        qd.Device.parse("cuda:x")
    q = qd.quantize(rng.standard_normal((4, 64)).astype(np.float32), qd.QuantScheme("q8s", block=32),
                    device="reference")
    assert repr(q) == "QTensor(shape=(4, 64), scheme=QuantScheme('q8s', block=(32,)), device='reference', nbytes=288)"
    assert q.backend == "reference" and q.device.kind == qd.BackendKind.REFERENCE


@pytest.mark.parametrize("spec,error,match", [
    ("cpu:99999999999999999999", ValueError, "Bad device index in 'cpu:99999999999999999999'"),
    (2**40, TypeError, "got the number 1099511627776: a GPU is 'cuda:1099511627776' here"),
    (-1, TypeError, "Expected a device like 'cpu' or 'cuda:0', got the number -1"),
    (0, TypeError, "got the number 0: a GPU is 'cuda:0' here"),  # it meant the reference backend
    (True, TypeError, "Expected a device like 'cpu' or 'cuda:0', got True"),
    ("cuda:\u00b2", ValueError, "Bad device index in 'cuda:\u00b2'"),        # a digit to isdigit, not to int
    ("cuda:\u0661", ValueError, "Bad device index in 'cuda:\u0661'"),        # an Arabic-Indic 1 read as cuda:1
])
def test_device_specs_out_of_range_say_what_is_wrong(spec, error, match):
    """Past C's int they overflowed (a bare OverflowError); True named the cpu backend,
    and a bare number a backend kind (0: reference, where torch's 0 is a GPU); a
    superscript digit failed int() with a bare ValueError.  A BackendKind names one."""
    assert qd.Device.parse(qd.BackendKind.CPU) == "cpu"
    t = qd.tensor(np.ones(3, np.float32), device="reference")
    for call in (lambda: qd.Device.parse(spec), lambda: t.to(spec), lambda: qd.quantize(t, "q8s").to(spec)):
        with pytest.raises(error, match=re.escape(match)):
            call()


def test_a_device_or_thread_count_refuses_a_bool():
    """Device(True) was the cpu backend, and numpy before 2.3 gave np.True_ an index too."""
    for call in (lambda: qd.Device(True), lambda: qd.Device(np.True_), lambda: qd.Device("cuda", np.True_),
                 lambda: qd.set_num_threads(np.True_)):
        with pytest.raises(TypeError, match="is a truth value, not a whole number|takes a whole number"):
            call()


@pytest.mark.parametrize("index,error,match", [
    (2**40, ValueError, "Device index must lie in [0, 2**31), got 1099511627776"),
    (-1, ValueError, "Device index must lie in [0, 2**31), got -1"),
    (1.5, TypeError, "Device(<BackendKind.CUDA: 2>, 1.5): 'float' object cannot be interpreted as an integer; "
                     "give a device like 'cpu' or 'cuda:1', or a backend kind and an index (whole numbers)"),
])
def test_a_device_built_with_an_index_out_of_range_says_so(index, error, match):
    with pytest.raises(error, match=re.escape(match)):
        qd.Device(qd.BackendKind.CUDA, index)
    assert qd.Device(qd.BackendKind.CUDA, np.int64(1)) == qd.Device.parse("cuda:1")


def test_mT_swaps_the_last_two_dims_as_numpys_does(device, rng):
    """.T and .mT both swap the last two dims (numpy's .T of an N-d array reverses
    them all); .mT of a vector is refused, as numpy and torch refuse it."""
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    t = qd.tensor(x, device=device)
    np.testing.assert_array_equal(t.mT.numpy(), np.swapaxes(x, -1, -2))
    assert t.mT.shape == t.T.shape == (2, 64, 3)
    q = qd.quantize(x, qd.QuantScheme("q8s", block=32), device=device)
    assert q.mT.shape == (2, 64, 3) and q.mT.transposed
    np.testing.assert_array_equal(q.mT.dequantize().numpy(), np.swapaxes(q.dequantize().numpy(), -1, -2))
    for vector in (qd.tensor(x[0, 0], device=device), qd.quantize(x[0, 0], "q8s", device=device)):
        assert vector.T is vector or vector.T.shape == (64,)
        with pytest.raises(qd.ShapeError, match=r"\.mT swaps the last two dims, and a tensor of shape \(64,\) "
                                                r"has fewer .*\.T leaves a vector as it is"):
            vector.mT


def test_nbytes_counts_values_and_scales_in_their_dtype(rng):
    x = rng.standard_normal((64, 128)).astype(np.float32)
    assert qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference").nbytes == 64 * 128 + 64 * 4
    q4 = qd.quantize(x, qd.QuantScheme("q4s", block=32, store="packed_u32", scale_dtype="f16"), device="reference")
    assert q4.nbytes == 64 * 128 // 2 + 64 * 4 * 2


def test_bfloat16_tensor_round_trip():
    x = np.array([[1.0, -2.5, 3.140625]], np.float32)
    t = qd.tensor(x, dtype="bfloat16", device="reference")
    assert t.dtype == "bfloat16"
    np.testing.assert_array_equal(t.numpy(), x)


def test_float_data_past_bfloat16s_range_is_inf_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = qd.tensor(np.array([1e300, -1e39, 2.0]), dtype="bfloat16", device="reference")
    np.testing.assert_array_equal(t.numpy(), [np.inf, -np.inf, 2.0])


def test_scales_shape_per_granularity(rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    assert qd.quantize(x, "q8s", device="reference").scales.shape == ()
    assert qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference").scales.shape == (8,)
    assert qd.quantize(x, qd.QuantScheme("q8s", block=32), device="reference").scales.shape == (8, 2)


def test_scales_leave_packed_values_packed(device, rng, monkeypatch):
    """.scales unpacked every value first (2 ms for a 4096^2 int4 tensor, against
    0.06 for int8); the grid is the same, transposed with the tensor."""
    q = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32),
                    qd.QuantScheme("q4s", block=(2, 32), store="packed_u32"), device=device)
    want = q.scales
    backend = type(get_backend(q.kind))
    monkeypatch.setattr(backend, "qstorage_to_host", lambda *args: pytest.fail("the values were unpacked"))
    np.testing.assert_array_equal(q.scales, want)
    np.testing.assert_array_equal(q.T.scales, want.T)
    assert want.shape == (8, 2)


def test_float32_data_converts_to_16_bits_in_the_backend(device, rng, monkeypatch):
    """qd.tensor(x, dtype="bfloat16") rounded in numpy whatever the device (10x the
    cpu backend's own cast); the same bits as astype on the device."""
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, np.inf, -np.inf, 6e4, 7e4, 1e-8, 3.4e38], np.float32)])
    for dtype in ("bfloat16", "float16"):
        want = qd.tensor(x, device=device).astype(dtype).numpy()
        if device != "reference":
            monkeypatch.setattr(qd.quantmath, "f32_to_bf16_bits", lambda a: pytest.fail("numpy rounded"))
        got = qd.tensor(x, dtype=dtype, device=device)
        monkeypatch.undo()
        assert got.dtype == dtype and got.device == device
        np.testing.assert_array_equal(got.numpy(), want)
        scalar = qd.tensor(np.float32(1.5), device=device).astype(dtype)  # the C cast gave a 0-d payload 1 dim
        assert scalar.shape == () and float(scalar.numpy()) == 1.5


def test_values_and_scales_are_copies(device, rng):
    """Editing what .values or .scales returned leaves the QTensor as it was, for
    dequantize and for every product (the cpu backend's packed panels included)."""
    x = rng.standard_normal((3, 64)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((8, 64)).astype(np.float32), qd.QuantScheme("q8s", block=32), device=device)
    deq, out = wq.dequantize().numpy(), qd.linear(x, wq).numpy()
    values, scales = wq.values, wq.scales
    values[:] = 0
    scales[:] = 0
    wq.T.values[:] = 1
    np.testing.assert_array_equal(wq.dequantize().numpy(), deq)
    np.testing.assert_array_equal(qd.linear(x, wq).numpy(), out)
    assert np.any(wq.values != 0) and np.all(wq.scales > 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_qtensor_from_parts_refuses_scales_that_are_not_finite(bad):
    scales = np.ones((2, 2), np.float32)
    scales[1, 0] = bad
    with pytest.raises(qd.NonFiniteError, match=r"scale at \(1, 0\) of the scale grid is (nan|inf|-inf)"):
        qd.qtensor_from_parts(np.ones((2, 64), np.int8), scales, qd.QuantScheme("q8s", block=32), device="reference")


@pytest.mark.parametrize("scale_dtype, scale", [("f16", 0.1), ("f16", 1e5), ("bf16", 0.1), ("bf16", 3e38)],
                         ids=["between-f16-values", "past-f16s-range", "between-bf16-values", "past-bf16s-range"])
def test_qtensor_from_parts_refuses_scales_its_scale_dtype_does_not_hold(tmp_path, scale_dtype, scale):
    """A QTensor whose scheme stores f16 scales, built from parts holding 0.1 (no f16
    value), computed with 0.1 but could not be saved or exported, and counted 2 bytes a
    scale: such scales are refused when it is built.  Scales the dtype holds pass,
    and save and load keep them bit for bit."""
    scheme = qd.QuantScheme("q8s", block=32, scale_dtype=scale_dtype)
    scales = np.ones((2, 1), np.float32)
    scales[1, 0] = scale
    with pytest.raises(qd.QuantSchemeError, match=rf"scale at \(1, 0\) of the scale grid, {re.escape(str(np.float32(scale)))}, "
                                                   rf"is no {scale_dtype} value.*or use scale_dtype='f32'"):
        qd.qtensor_from_parts(np.ones((2, 32), np.int8), scales, scheme, device="reference")
    scales[1, 0] = 0.099975586 if scale_dtype == "f16" else 0.5  # f16's nearest to 0.1; a bf16 value
    q = qd.qtensor_from_parts(np.ones((2, 32), np.int8), scales, scheme, device="reference")
    qd.save(tmp_path / "q.st", {"q": q})
    np.testing.assert_array_equal(qd.load(tmp_path / "q.st")["q"].scales, scales)


@pytest.mark.parametrize("scales", [np.array([1 + 2j, 1.0]), np.array(["0.5", "1"]), [None, 1.0]],
                         ids=["complex", "text", "object"])
def test_qtensor_from_parts_refuses_scales_that_are_no_real_numbers(device, scales):
    """Complex scales lost their imaginary part (with only numpy's warning) and text
    was parsed as numbers: both are refused, as are objects."""
    with pytest.raises(TypeError, match="scales must be real numbers"):
        qd.qtensor_from_parts(np.ones((2, 8), np.int8), scales, qd.QuantScheme("q8s", axis=0), device=device)
    with np.errstate(over="raise"):  # a float64 scale past float32's range is named, not warned about
        with pytest.raises(qd.NonFiniteError, match=r"scale at \(0, 0\) of the scale grid is inf"):
            qd.qtensor_from_parts(np.ones((2, 8), np.int8), np.array([1e300, 1.0]), qd.QuantScheme("q8s", axis=0),
                                  device=device)

def test_qtensor_from_parts_takes_a_strided_view_of_values(device):
    """A transposed view is copied to the layout the kernels read (without the copy the
    cpu backend's dequantize would refuse it)."""
    v = np.random.default_rng(0).integers(-127, 128, (8, 6)).astype(np.int8)
    q = qd.qtensor_from_parts(v.T, np.float32(0.5), "q8s", device=device)
    np.testing.assert_array_equal(q.dequantize().numpy(), v.T.astype(np.float32) * 0.5)
    np.testing.assert_array_equal(qd.embedding([1, 3], q).numpy(), v.T[[1, 3]].astype(np.float32) * 0.5)


def test_qtensor_from_parts_takes_flat_values_with_their_shape(device):
    """shape= is the tensor's shape, values come flat as a loader reads them."""
    scheme = qd.QuantScheme("q8s", block=32)
    wq = qd.quantize(np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32), scheme, device=device)
    back = qd.qtensor_from_parts(wq.values.ravel(), wq.scales.ravel(), scheme, device=device, shape=[4, 64])
    assert back.shape == (4, 64)
    np.testing.assert_array_equal(back.values, wq.values)
    np.testing.assert_array_equal(back.dequantize().numpy(), wq.dequantize().numpy())
    with pytest.raises(qd.ShapeError, match=r"shape \(4, 32\) holds 128 elements but the values hold 256"):
        qd.qtensor_from_parts(wq.values.ravel(), wq.scales, scheme, device=device, shape=(4, 32))


@pytest.mark.parametrize("shape,error,match", [
    ((2.5, 2), TypeError, "shape must be a tuple of ints, got (2.5, 2)"),  # was taken as (2, 2)
    (("2", "2"), TypeError, "shape must be a tuple of ints, got ('2', '2')"),  # was taken as (2, 2)
    ((True, 4), TypeError, "shape must be a tuple of ints, got (True, 4)"),  # was taken as (1, 4)
    (4, TypeError, "shape must be a tuple of ints, got 4"),  # was "'int' object is not iterable"
    ((-1, -4), qd.ShapeError, "shape (-1, -4) has a negative size"),  # was numpy's reshape error
    ((2**70,), qd.ShapeError, "shape (1180591620717411303424,) holds 1180591620717411303424 elements "
                              "but the values hold 4"),  # was an OverflowError
])
def test_qtensor_from_parts_refuses_a_shape_that_is_no_shape(device, shape, error, match):
    with pytest.raises(error, match=re.escape(match)):
        qd.qtensor_from_parts(np.ones(4, np.int8), np.float32(1), "q8s", device=device, shape=shape)
    q = qd.qtensor_from_parts(np.ones(4, np.int8), np.float32(1), "q8s", device=device, shape=np.array([2, 2]))
    assert q.shape == (2, 2) and all(type(d) is int for d in q.shape)


def test_qtensor_from_parts_checks_the_range():
    values = np.full((2, 8), 7, np.int8)
    values[1, 3] = 8
    # a QuantSchemeError, so a ValueError too, as every error of bad input is
    with pytest.raises(qd.QuantSchemeError, match=r"outside q4s's range \[-7, 7\]: 8 at position \(1, 3\); clip"):
        qd.qtensor_from_parts(values, np.ones(()), qd.QuantScheme("q4s", store="packed_u32"))
    q = qd.qtensor_from_parts(np.full((2, 8), 7, np.int8), np.float32(0.5), qd.QuantScheme("q4s", store="packed_u32"))
    np.testing.assert_array_equal(q.dequantize().numpy(), 3.5)


def test_qtensor_from_parts_names_the_scale_grid_it_takes():
    scheme = qd.QuantScheme("q8s", axis=0)
    with pytest.raises(qd.ShapeError, match=r"QuantScheme\('q8s', axis=0\) on values of shape \(2, 4\) takes a "
                                            r"scale grid of shape \(2, 1\) .*got scales of shape \(3,\)"):
        qd.qtensor_from_parts(np.ones((2, 4), np.int8), np.ones(3, np.float32), scheme)
    q = qd.qtensor_from_parts(np.ones((2, 4), np.int8), [0.5, 2.0], scheme, device="reference")
    np.testing.assert_array_equal(q.dequantize().numpy(), [[0.5] * 4, [2.0] * 4])


def test_qtensor_from_parts_keeps_copies_of_what_it_checked(device):
    values, scales = np.full((4, 2), 5, np.int8), np.ones((4, 1), np.float32)
    q = qd.qtensor_from_parts(values, scales, qd.QuantScheme("q8s", axis=0), device=device)
    values[:] = -128  # outside q8s's [-127, 127], written after the check
    scales[:] = 2.0
    np.testing.assert_array_equal(q.values, np.full((4, 2), 5, np.int8))
    np.testing.assert_array_equal(q.scales, np.ones(4, np.float32))
    np.testing.assert_array_equal(qd.linear(np.ones((1, 2), np.float32), q).numpy(), [[10.0] * 4])


@pytest.mark.parametrize("data,dtype,match", [
    ([[200, -300, 127]], "int8", r"the value 200 at position \(0, 0\) is outside int8's range \[-128, 127\]"),
    ([2**40 + 5], "int32", r"the value 1099511627781 at position \(0,\) is outside int32's range"),
    (np.array([2.0**31], np.float32), "int32", r"the value 2147483648.0 .* is outside int32's range"),
    (np.array([255], np.uint8), "int8", r"the value 255 .* is outside int8's range"),
    ([[1.0, 2.7]], "int8", r"the value 2.7 at position \(0, 1\) is not a whole number"),
    ([3.0, np.nan], "int8", r"the value nan at position \(1,\) is not finite"),
    ([-np.inf], "int32", r"the value -inf .* is not finite"),
])
def test_integer_dtype_refuses_data_the_cast_would_change(data, dtype, match):
    with pytest.raises(TypeError, match=match) as info:
        qd.tensor(data, dtype=dtype, device="reference")
    assert f"Can't make an {dtype} tensor" in str(info.value)
    assert "quantize float data instead, or round and clip it" in str(info.value)


@pytest.mark.parametrize("data", [[1, 2, 300], np.array([[0, 255]], np.uint8), np.array([-129], np.int16)],
                         ids=["list", "uint8", "int16"])
def test_integers_of_another_dtype_become_int8_or_name_the_value_and_int32(data):
    """Integer data of a dtype qdispatch does not hold becomes int8 when every value
    fits; otherwise the error named no value and no way to keep the integers."""
    with pytest.raises(TypeError, match=r"Can't make an int8 tensor of \w+ data: the value -?\d+ at position") as info:
        qd.tensor(data, device="reference")
    assert "pass dtype='int32' for an int32 tensor" in str(info.value)
    wide = qd.tensor(data, dtype="int32", device="reference")
    assert wide.dtype == "int32"
    np.testing.assert_array_equal(wide.numpy(), np.asarray(data))
    small = np.asarray(data).astype(np.int64) % 100
    fits = qd.tensor(small.astype(np.asarray(data).dtype), device="reference")
    assert fits.dtype == "int8"
    np.testing.assert_array_equal(fits.numpy(), small)


@pytest.mark.parametrize("data", [[2**40], np.array([1, 2**63], np.uint64)], ids=["list", "uint64"])
def test_integers_past_int32_are_not_told_to_become_int32(data):
    """The advice to pass dtype='int32' came whatever the values."""
    with pytest.raises(TypeError, match=r"the value \d+ at position \(\d,\) is outside int8's range") as info:
        qd.tensor(data, device="reference")
    assert "int32" not in str(info.value)


def test_integer_dtype_keeps_data_that_fits(device):
    t = qd.tensor(np.array([[-128.0, 5.0, 127.0]]), dtype="int8", device=device)
    assert t.dtype == "int8" and t.numpy().dtype == np.int8
    np.testing.assert_array_equal(t.numpy(), [[-128, 5, 127]])
    wide = qd.tensor(np.array([2**31 - 1, -2**31]), dtype="int32", device=device)
    np.testing.assert_array_equal(wide.numpy(), np.array([2**31 - 1, -2**31], np.int32))
    a = qd.tensor([[100, -100, 127]], dtype="int8", device=device)
    b = np.array([[1], [2], [3]], np.int8)
    np.testing.assert_array_equal(qd.int_matmul(a, b).numpy(), [[100 - 200 + 381]])


def test_dtype_converts_a_tensor_as_asarray_does(device):
    """qd.tensor(t, dtype=...) gives t in that dtype (a float Tensor converts, on
    its device); asked for the dtype t has, it is t itself."""
    x = np.array([[1.0, -2.5, 3.0e5], [0.1, 65520.0, -7.0]], np.float32)
    t = qd.tensor(x, device=device)
    assert qd.tensor(t, dtype="float32") is t
    for dtype in ("bfloat16", "float16"):
        got = qd.tensor(t, dtype=dtype)
        assert got.dtype == dtype and got.device == t.device and got.shape == t.shape
        np.testing.assert_array_equal(got.numpy(), qd.tensor(x, dtype=dtype, device="reference").numpy())
    back = qd.tensor(qd.tensor(t, dtype="bfloat16"), dtype="float32")
    np.testing.assert_array_equal(back.numpy(), qd.tensor(x, dtype="bfloat16", device="reference").numpy())
    with pytest.raises(TypeError, match="Can't convert a float32 Tensor to int8: only float32, float16 and bfloat16"):
        qd.tensor(t, dtype="int8")
    with pytest.raises(TypeError, match="Can't convert a int8 Tensor to float32"):
        qd.tensor(qd.tensor(np.ones(3, np.int8), device=device), dtype="float32")


@pytest.mark.parametrize("name", [np.str_("bfloat16"), np.array(["float16"])[0], np.float16, np.dtype("float16")],
                         ids=["str_", "str_ from an array", "np.float16", "np.dtype"])
def test_dtype_names_from_numpy(device, rng, name):
    """Dtype names read out of numpy (np.str_) and numpy's own dtypes name dtypes
    wherever a dtype is asked for, and come back as plain str."""
    want = "bfloat16" if "bfloat16" in str(name) else "float16"
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = qd.quantize(rng.standard_normal((8, 16)).astype(np.float32), "q8s", device=device)
    results = [qd.tensor(x, device=device, dtype=name), qd.tensor(qd.tensor(x, device=device), dtype=name),
               qd.q_matmul(qd.tensor(x, device=device), w.T, out_dtype=name),
               qd.linear(qd.tensor(x, device=device), w, np.ones(8, np.float32), out_dtype=name),
               w.dequantize(name)]
    for got in results:
        assert type(got.dtype) is str and got.dtype == want
    np.testing.assert_array_equal(results[2].numpy(), qd.q_matmul(qd.tensor(x, device=device), w.T,
                                                                  out_dtype=want).numpy())
    with pytest.raises(TypeError, match="Unsupported dtype None: expected one of float32, float16, bfloat16"):
        qd.q_matmul(x, w.T, out_dtype=None)
    with pytest.raises(TypeError, match="Unsupported dtype <class 'numpy.float64'>"):
        qd.q_matmul(x, w.T, out_dtype=np.float64)

@pytest.mark.parametrize("copier", ["pickle", "deepcopy", "save"])
def test_0d_tensor_keeps_its_shape_when_copied(device, tmp_path, copier):
    import copy
    import pickle
    t = qd.tensor(np.float32(3.0), device=device)
    if copier == "save":
        qd.save(tmp_path / "step.safetensors", {"step": t})
        twin = qd.load(tmp_path / "step.safetensors", device=device)["step"]
    else:
        twin = pickle.loads(pickle.dumps(t)) if copier == "pickle" else copy.deepcopy(t)
    assert twin.shape == () and twin.dtype == "float32" and twin.device == device
    assert twin.numpy().shape == () and twin.numpy() == np.float32(3.0)


def test_0d_bfloat16_tensor_stays_0d(device):
    t = qd.tensor(np.float32(1.5), device=device, dtype="bfloat16")
    assert t.shape == () and t.numpy().shape == () and t.numpy() == np.float32(1.5)
    assert qd.tensor(np.float32(2.0), device=device).shape == ()


@pytest.mark.parametrize("key", [(), Ellipsis])
def test_0d_tensor_indexed_by_nothing_is_itself(device, key):
    """As numpy's a[()]: it said "a Tensor has at least one axis", of a 0-d Tensor."""
    t = qd.tensor(np.float32(2.5), device=device)
    view = t[key]
    assert view.shape == () and view.device == device and view.numpy() == np.float32(2.5)
    if device != "cuda":  # a host view shares the memory
        assert np.shares_memory(np.asarray(view), np.asarray(t))
    with pytest.raises(IndexError, match=r"Too many indices \(1\) for a Tensor of shape \(\)"):
        t[0]


def test_0d_bfloat16_tensor_reads_back_as_an_array(device):
    """Its float32 values are a 0-d array, not a numpy scalar: np.asarray refused a
    scalar from __array__, and a float32 Tensor converted from it held one."""
    t = qd.tensor(np.float32(1.5), device=device, dtype="bfloat16")
    reads = [t.numpy(), qd.tensor(t, dtype="float32").numpy()]
    if device != "cuda":  # np.asarray reads host memory only
        reads += [np.asarray(t), np.asarray(qd.tensor(t, dtype="float32"))]
    for got in reads:
        assert type(got) is np.ndarray and got.shape == () and got.dtype == np.float32 and got == 1.5


def test_qtensor_parts_of_no_values_are_a_shape_error(device):
    """quantize refuses such data; building the QTensor from parts does too (an empty
    dim used to divide by zero, a 0-d QTensor to come back from a pickle 1-d)."""
    from qdispatch.tensor_api import qtensor_zeros
    for shape in ((0, 64), (4, 0), ()):
        with pytest.raises(qd.ShapeError, match=re.escape(f"at least one dim and one value, got shape {shape}")):
            qd.qtensor_from_parts(np.zeros(shape, np.int8), np.ones(1, np.float32), "q8s", device=device)
        with pytest.raises(qd.ShapeError, match="at least one dim and one value"):
            qtensor_zeros(shape, "q8s", device=device)


def test_synchronize_without_a_device_runs_on_any_build():
    """It meant 'cuda', and raised BackendUnavailableError where CUDA can't run."""
    assert qd.synchronize() is None and qd.synchronize("cpu") is None


def test_len_of_a_0d_tensor_is_a_type_error_as_in_numpy():
    with pytest.raises(TypeError, match=r"len\(\) of a 0-d tensor"):
        len(qd.tensor(3.0, device="reference"))
    assert len(qd.tensor(np.zeros((3, 2), np.float32), device="reference")) == 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_truth_value_follows_numpy(device, dtype):
    """It came from __len__: `if t:` was True for [[0.0]] and for any row count."""
    for value in (0, 1):
        for shape in ((), (1,), (1, 1)):
            t = qd.tensor(np.full(shape, value, np.float32).astype(np.int8 if dtype == "int8" else np.float32),
                          dtype=dtype, device=device)
            assert bool(t) is bool(value)
    with pytest.raises(ValueError, match="The truth value of a Tensor of more than one value is ambiguous: "
                                         r"use t.numpy\(\).any\(\)"):
        bool(qd.tensor(np.ones((2, 1), np.float32), dtype=dtype, device=device))
    with pytest.raises(ValueError, match="The truth value of an empty Tensor is ambiguous"):
        bool(qd.tensor(np.ones((0, 3), np.float32), dtype=dtype, device=device))


def test_indexing_a_qtensor_names_the_ways_to_its_rows():
    """It was Python's bare "object is not subscriptable", and iterating "not iterable"."""
    q = qd.quantize(np.ones((4, 32), np.float32), "q8s", device="reference")
    for get in (lambda: q[0], lambda: q[1:3], lambda: q[1, 2:4], lambda: list(q)):
        with pytest.raises(TypeError, match=r"A QTensor can't be indexed: its rows come dequantized through "
                                            r"qdispatch.embedding\(ids, q\)"):
            get()
    np.testing.assert_array_equal(qd.embedding([1], q).numpy(), q.dequantize().numpy()[[1]])


def test_a_bfloat16_tensor_comes_to_numpy_as_a_float32_copy():
    t = qd.tensor(np.ones(3, np.float32), device="reference", dtype="bfloat16")
    a = t.numpy()
    assert a.dtype == np.float32 and not np.shares_memory(a, t.numpy())
    f = qd.tensor(np.ones(3, np.float32), device="reference")
    assert np.shares_memory(f.numpy(), f.numpy())


def test_qtensor_is_no_array_for_numpy():
    """np.asarray(q) was a 0-d object array holding q."""
    q = qd.quantize(np.ones((4, 32), np.float32), "q8s", device="reference")
    for convert in (np.asarray, np.array, lambda q: np.asarray(q, dtype=np.float32), lambda q: np.stack([q, q])):
        with pytest.raises(TypeError, match=r"A QTensor is no dense array: use q.dequantize\(\).numpy\(\)"):
            convert(q)


def test_qtensor_says_it_has_no_gradient():
    q = qd.quantize(np.ones((2, 4), np.float32), "q8s", device="reference")
    assert q.requires_grad is False
    with pytest.raises(AttributeError, match="gradients flow to the float operand only"):
        q.grad


def _dlpack_dtype(capsule):
    """(code, bits, lanes) of a DLPack capsule's tensor, read through ctypes."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    versioned = ctypes.pythonapi.PyCapsule_IsValid(ctypes.py_object(capsule), b"dltensor_versioned")
    name = b"dltensor_versioned" if versioned else b"dltensor"
    # DLTensor's dtype sits after data (8), device (8) and ndim (4); a versioned
    # capsule's DLTensor after version (8), manager_ctx, deleter and flags (8 each)
    offset = (32 if versioned else 0) + 20
    raw = ctypes.string_at(get(capsule, name) + offset, 4)
    return raw[0], raw[1], int.from_bytes(raw[2:], "little")


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_host_bfloat16_leaves_by_dlpack_as_bfloat16(device, max_version):
    """numpy exported its bits as uint16, so the export was refused; now the capsule
    says bfloat16 (DLPack type code 4) over the same memory."""
    if device == "cuda":
        pytest.skip("host tensors only")
    t = qd.tensor(np.array([[1.5, -2.0], [3.0, 0.25]], np.float32), dtype="bfloat16", device=device)
    asked = {} if max_version is None else {"max_version": max_version}
    assert _dlpack_dtype(t.__dlpack__(**asked)) == (4, 16, 1)
    assert _dlpack_dtype(qd.tensor(np.ones(2, np.float16), device=device).__dlpack__(**asked)) == (2, 16, 1)
    try:
        back = np.from_dlpack(t)
    except (RuntimeError, BufferError) as exc:  # numpy has no bfloat16 of its own
        assert "Unsupported dtype" in str(exc)
    else:  # numpy 2.5 reads it in ml_dtypes' bfloat16 once that is imported (onnx imports it)
        assert str(back.dtype) == "bfloat16" and back.astype(np.float32).tolist() == [[1.5, -2.0], [3.0, 0.25]]
    torch = pytest.importorskip("torch")
    view = torch.from_dlpack(t)
    assert view.dtype == torch.bfloat16 and view.tolist() == [[1.5, -2.0], [3.0, 0.25]]
    view[0, 0] = 8.0  # the same memory
    assert t.numpy()[0, 0] == 8.0


class _BFloat16Producer:
    """Some library's host bfloat16 tensor, known to qdispatch by DLPack alone."""
    dtype = "bfloat16"

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, **kwargs):
        return self.t.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_host_bfloat16_comes_in_by_dlpack_without_torch(monkeypatch):
    """A bfloat16 producer other than torch needed torch to come in (ModuleNotFoundError
    without it), and qd.from_dlpack of qdispatch's own bfloat16 Tensor was refused."""
    monkeypatch.setitem(sys.modules, "torch", None)  # no torch to lean on
    t = qd.tensor(np.array([[1.5, -2.0], [3.0, 0.25]], np.float32), dtype="bfloat16", device="cpu")
    assert qd.from_dlpack(t) is t
    came = qd.from_dlpack(_BFloat16Producer(t))
    assert came.dtype == "bfloat16" and came.numpy().tolist() == [[1.5, -2.0], [3.0, 0.25]]
    t.payload[0, 0] = 0x4100  # bfloat16's bits of 8.0
    assert came.numpy()[0, 0] == 8.0  # the same memory


def test_ml_dtypes_bfloat16_arrays_are_taken_as_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.array([1.5, -2.0, 3.0], dtype=ml_dtypes.bfloat16)
    t = qd.tensor(a, device="reference")
    assert t.dtype == "bfloat16" and t.numpy().tolist() == [1.5, -2.0, 3.0]


def test_tensors_compare_value_by_value_as_numpy(device):
    """== compared identity: two tensors of equal values were unequal, and
    int_matmul(v, v) == 14 was False."""
    if device == "cuda":
        pytest.skip("host tensors compare on the host")
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    t, same = qd.tensor(a, device=device), qd.tensor(a.copy(), device=device)
    np.testing.assert_array_equal(t == same, np.ones((2, 2), bool))
    np.testing.assert_array_equal(t != 2.0, a != 2.0)
    np.testing.assert_array_equal(t < same.T, a < a.T)
    np.testing.assert_array_equal(t >= a, np.ones((2, 2), bool))
    v = qd.tensor(np.array([1, 2, 3], np.int8), device=device)
    assert qd.int_matmul(v, v) == 14
    assert len({t, same}) == 2  # hashed by identity still
    b = qd.tensor(a, dtype="bfloat16", device=device)
    np.testing.assert_array_equal(b == t, np.ones((2, 2), bool))
    q = qd.quantize(a, "q8s", device=device)
    # ordering between QTensors, or with None, was Python's untyped TypeError
    for compare in (lambda: t == q, lambda: a == q, lambda: q == 1.0, lambda: q < 1, lambda: q < q,
                    lambda: q >= None, lambda: None < q, lambda: q > "a"):
        with pytest.raises(qd.ArgumentTypeError, match="QTensors are not compared value by value"):
            compare()
    twin = qd.quantize(a, "q8s", device=device)  # between QTensors, identity: a weight is a handle
    assert q == q and q != twin and q in [twin, q] and twin not in [q] and q != None  # noqa: E711
    assert len({q, q.T}) == 2


def test_a_qtensor_is_no_number(device):
    q = qd.quantize(np.full((1, 1), 2.0, np.float32), "q8s", device=device)
    for convert in (float, int):
        with pytest.raises(qd.ArgumentTypeError, match=r"A QTensor is no number for float\(\) or int\(\): its "
                                                       r"values as floats are q.dequantize\(\).numpy\(\)"):
            convert(q)
    assert float(q.dequantize().numpy()[0, 0]) == 2.0


def test_numpys_methods_say_where_they_are(device):
    """t.reshape, t.sum, q.item: "object has no attribute" and nothing more; t[0] = 1
    was Python's bare "does not support item assignment"."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = qd.tensor(a, device=device)
    q = qd.quantize(a, "q8s", device=device)
    for name in ("reshape", "sum", "item", "tolist", "flatten"):
        with pytest.raises(AttributeError, match=rf"^'Tensor' object has no attribute '{name}': a qdispatch "
                                                 rf"Tensor is not a numpy array. t.numpy\(\) is one .*has .{name}$"):
            getattr(t, name)
        with pytest.raises(AttributeError, match=rf"^'QTensor' object has no attribute '{name}': a QTensor is not "
                                                 rf"a numpy array. Its values as floats are q.dequantize\(\).numpy\(\)"):
            getattr(q, name)
    assert not hasattr(t, "reshape") and hasattr(t, "shape") and hasattr(q, "scales")
    # names numpy lacks, and protocol probes, get the plain message
    for name in ("no_such_thing", "__array_interface__", "_private"):
        with pytest.raises(AttributeError, match=rf"^'Tensor' object has no attribute '{name}'$"):
            getattr(t, name)
    with pytest.raises(qd.ArgumentTypeError, match=r"A Tensor's values are not assigned in place: change them in "
                                                   r"numpy .* qdispatch.tensor\(array, device=t.device\)"):
        t[0] = 1
    with pytest.raises(TypeError):  # a TypeError still, as Python's was
        t[0, 1] = 2.0
    np.testing.assert_array_equal(t.numpy(), a)  # nothing written


def test_arithmetic_operators_are_numpys_on_the_values(device):
    """`np.add(t, 1)` and `np.ones(2) + t` worked, but `t + 1`, `-t` and `2 * t` raised
    Python's bare "unsupported operand type(s)"; `t += 1` would have rebound t to an
    array while other names kept the tensor."""
    if device == "cuda":
        pytest.skip("host tensors compute on the host")
    a = np.array([[1.0, -2.0], [3.0, 4.5]], np.float32)
    t = qd.tensor(a, device=device)
    for got, want in ((t + 1, a + 1), (1 + t, 1 + a), (t - a, a - a), (2.0 - t, 2.0 - a), (t * t, a * a),
                      (3 * t, 3 * a), (t / 2, a / 2), (1 / t, 1 / a), (t // 2, a // 2), (7 // t, 7 // a),
                      (t % 2, a % 2), (5 % t, 5 % a), (t ** 2, a ** 2), (2 ** t, 2 ** a),
                      (-t, -a), (+t, +a), (abs(t), abs(a))):
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, want)
    b = qd.tensor(a, dtype="bfloat16", device=device)  # bfloat16 values, as np.asarray(b) gives them
    np.testing.assert_array_equal(b + t, a + a)
    held = t
    for in_place in ("+=", "-=", "*=", "/=", "//=", "%=", "**=", "@="):
        with pytest.raises(TypeError, match=f"not changed in place by `{re.escape(in_place)}`"):
            exec(f"held {in_place} 1")
    assert held is t
    np.testing.assert_array_equal(t.numpy(), a)
    q = qd.quantize(a, "q8s", device=device)
    for op in (lambda: q + 1, lambda: 1 - q, lambda: -q, lambda: t * q, lambda: abs(q)):
        with pytest.raises(TypeError, match="A QTensor has no arithmetic operators .* q.dequantize"):
            op()


def test_numpy_style_size_bytes_numbers_and_copies(device):
    """Attributes and conversions a numpy user reaches for: size and nbytes were
    missing, float(t) of one value raised, copy.copy shared a contiguous tensor's memory."""
    import copy
    if device == "cuda":
        pytest.skip("host memory checks")
    t = qd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    assert (t.size, t.nbytes) == (6, 24)
    assert qd.tensor(np.ones(5, np.int8), device=device).nbytes == 5
    assert qd.tensor(np.ones(5, np.float32), dtype="bfloat16", device=device).nbytes == 10
    one = qd.tensor(np.array(2.5, np.float32), device=device)
    assert (float(one), int(one)) == (2.5, 2)
    with pytest.raises(TypeError, match="Only a Tensor of one value converts to a Python number; this one holds 6"):
        float(t)
    with pytest.raises(TypeError, match="iteration over a 0-d Tensor"):
        iter(one)
    twin = copy.copy(t)
    twin.numpy()[0, 0] = 7.0
    assert t.numpy()[0, 0] == 0.0 and twin.device == t.device
    with pytest.raises(qd.ShapeError, match="tensor takes an array of numbers"):
        qd.tensor([[1.0, 2.0], [3.0]], device=device)
    q = qd.quantize(t, "q8s")
    with pytest.raises(TypeError, match="A QTensor has no truth value: test `q is not None`"):
        bool(q)


INDEX_KEYS = [1, -1, slice(1, 3), slice(None, 2), slice(-2, None), slice(3, 1), (2, slice(1, 4)), (0, 3),
              (slice(1, 3), slice(None)), (1, Ellipsis), np.int64(2),
              # slices that take whole axes however they are written (they were refused after a slice)
              (slice(1, 3), slice(0, 5), slice(None, None, 1)), (1, slice(0, 99)), (Ellipsis, slice(0, 6)),
              (slice(1, 3), Ellipsis, slice(None, 6, 1)), (slice(np.int64(1), np.int64(3)), slice(-5, None))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_indexing_leading_axes_gives_views(device, rng, dtype):
    a = rng.standard_normal((4, 5, 6)).astype(np.float32)
    if dtype == "int8":
        a = rng.integers(-128, 128, (4, 5, 6)).astype(np.int8)
    t = qd.tensor(a, device=device, dtype=dtype)
    full = t.numpy()
    for key in INDEX_KEYS:
        got = t[key]
        assert got.shape == full[key].shape and got.dtype == dtype and got.device == t.device, key
        np.testing.assert_array_equal(got.numpy(), full[key])
    if device != "cuda" and dtype != "bfloat16":
        assert np.shares_memory(np.asarray(t[1:3]), a)  # a view, not a copy
    rows = list(t)
    assert len(rows) == 4 and all(r.shape == (5, 6) for r in rows)
    np.testing.assert_array_equal(rows[3].numpy(), full[3])
    with pytest.raises(TypeError, match="iterate over t.numpy"):
        iter(t[0, 0])


def test_rows_of_a_tensor_feed_a_product(device, rng):
    # K = 6: a row is 24 bytes, so rows 1.. of a device tensor start off a 16-byte boundary.
    x = rng.standard_normal((5, 6)).astype(np.float32)
    w = qd.quantize(rng.standard_normal((8, 6)).astype(np.float32), "q8s", device=device)
    xt = qd.tensor(x, device=device)
    got = qd.q_matmul(xt[1:4], w.T).numpy()
    np.testing.assert_array_equal(got, qd.q_matmul(qd.tensor(x[1:4], device=device), w.T).numpy())
    np.testing.assert_array_equal(qd.q_matmul(xt[4], w.T).numpy(), qd.q_matmul(qd.tensor(x[4], device=device), w.T).numpy())


@pytest.mark.parametrize("key,match", [
    ((slice(None), 1), "may only be followed by whole axes"), (slice(None, None, 2), "step 2"),
    ([0, 2], "not supported"), (np.array([True, False, True]), "not supported"), (None, "not supported"),
    (5, "out of range for axis 0 of size 3"), (3, "Index 3 is out of range for axis 0 of size 3"),
    (-4, "out of range"), ((0, 1), "one element.*numpy"),
    ((0, 0, 0), "Too many indices"),
    # whole axes past the last one, and a second ellipsis, were taken as if absent (numpy refuses them)
    ((0, slice(None), slice(None)), r"Too many indices \(3\)"), ((Ellipsis, Ellipsis), "single ellipsis"),
    ((Ellipsis, slice(None), slice(None), slice(None)), r"Too many indices \(3\)"),
    # it said "Ellipsis is not supported", though t[0, ...] is; and None counted as an index too many
    ((Ellipsis, 0), r"ellipsis may only follow the leading indices \(t\[i, \.\.\.\]\)"),
    ((0, None), r"None \(np.newaxis\) is not supported"),
])
def test_indexing_beyond_views_says_what_works(device, key, match):
    t = qd.tensor(np.zeros((3, 4), np.float32), device=device)
    with pytest.raises(IndexError, match=match) as info:
        t[key]
    if "not supported" in match or "step" in match:
        assert "t.numpy()[" in str(info.value)


@pytest.mark.parametrize("key", [slice(1.5, None), slice("a", None), (slice(None), slice(0, 2.0)),
                                 slice(0, 2, 1.0)])
def test_a_slice_bound_that_is_no_integer_is_a_typed_error(device, key):
    t = qd.tensor(np.zeros((3, 4), np.float32), device=device)
    with pytest.raises(qd.ArgumentTypeError, match=r"bounds that are not integers: slice bounds and steps are "
                                                   r"integers or None"):
        t[key]  # it was Python's TypeError, no QDispatchError


def test_an_element_of_a_vector_is_named_as_it_was_asked_for(device):
    with pytest.raises(IndexError, match=r"^Index 2 picks one element, a number rather than a view"):
        qd.tensor(np.zeros(5, np.float32), device=device)[2]  # it named the key (2,)


@pytest.mark.parametrize("data", [(x for x in [1.0, 2.0]), [2**70]], ids=["generator", "past-int64"])
def test_data_numpy_holds_as_python_objects_is_refused_by_what_it_is(data):
    with pytest.raises(TypeError, match=r"numpy holds as Python objects \(a generator, say, or integers past "
                                        r"int64\): pass a list or array of numbers"):
        qd.tensor(data, device="reference")


@pytest.mark.parametrize("copier", ["pickle", "deepcopy"])
def test_pickle_and_deepcopy_keep_values_device_and_scheme(device, rng, copier):
    import copy
    import pickle
    again = (lambda obj: pickle.loads(pickle.dumps(obj))) if copier == "pickle" else copy.deepcopy
    w = rng.standard_normal((2, 16, 24)).astype(np.float32)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    for scheme in (qd.QuantScheme("q4f", block=(8, 8), store="packed_u32", scale_dtype="bf16"),
                   qd.QuantScheme("q8s", axis=-1, scale_dtype="f16")):
        q = qd.quantize(w, scheme, device=device)
        for original in (q, q.T):  # a transposed view comes back transposed
            twin = again(original)
            assert twin.device == device and twin.shape == original.shape
            assert twin.scheme == original.scheme and twin.nbytes == original.nbytes
            np.testing.assert_array_equal(twin.values, original.values)
            np.testing.assert_array_equal(twin.scales, original.scales)
        q2d = qd.quantize(w[0], scheme, device=device)  # products with the copy: the same bits
        np.testing.assert_array_equal(qd.q_matmul(x, again(q2d)).numpy(), qd.q_matmul(x, q2d).numpy())
    for dtype in ("float32", "float16", "bfloat16", "int8"):
        t = qd.tensor(rng.integers(-8, 8, (3, 5)).astype(np.float32), device=device, dtype=dtype)
        twin = again(t)
        assert twin.device == device and twin.dtype == dtype and twin.shape == t.shape
        np.testing.assert_array_equal(twin.numpy(), t.numpy())
    assert again(qd.Device.parse(device)) == device


def test_a_pickled_qtensor_keeps_its_store_as_a_file_does(device, rng):
    """4-bit values in their packed words and f16 scales as f16: 4096 values of q4 in
    blocks of 32 pickle to about 2 KiB + 256 B, not 4 KiB + 512 B; pickles made before,
    of int8 values and float32 scales, still load."""
    import pickle
    from qdispatch import tensor_api
    q = qd.quantize(rng.standard_normal((64, 64)).astype(np.float32),
                    qd.QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"), device=device)
    assert len(pickle.dumps(q)) < 4096 // 2 + 128 * 2 + 1024
    twin = pickle.loads(pickle.dumps(q))
    np.testing.assert_array_equal(twin.values, q.values)
    np.testing.assert_array_equal(twin.scales, q.scales)
    old_style = tensor_api.qtensor_from_stored(*tensor_api.qtensor_stored(q), device)
    np.testing.assert_array_equal(old_style.dequantize().numpy(), q.dequantize().numpy())


def test_bfloat16_from_uint16_is_bit_patterns(device):
    """numpy has no bfloat16: uint16 data with dtype="bfloat16" holds its bit
    patterns (as files and numpy code keep it); other integers are numbers."""
    bits = np.array([0x3F80, 0xC040, 0x7F80], np.uint16)  # 1.0, -3.0, inf
    np.testing.assert_array_equal(qd.tensor(bits, device=device, dtype="bfloat16").numpy(), [1.0, -3.0, np.inf])
    np.testing.assert_array_equal(qd.tensor(np.array([1, -3], np.int16), device=device, dtype="bfloat16").numpy(),
                                  [1.0, -3.0])


def test_big_endian_data_is_read_as_the_numbers_it_holds(device):
    """A big-endian array holds the same numbers as a little-endian one: the same
    dtype, the same values (uint16 as bfloat16 bits too)."""
    for data in (np.array([1, -2, 1000], ">i4"), np.array([1.5, -2.0], ">f2"), np.array([1.5, 3e38], ">f4"),
                 np.array([[-128, 127]], ">i1")):
        t = qd.tensor(data, device=device)
        assert t.dtype == qd.tensor(data.astype(data.dtype.newbyteorder("="))).dtype
        np.testing.assert_array_equal(t.numpy(), data)
    bits = np.array([0x3F80, 0xC040], ">u2")  # 1.0, -3.0
    np.testing.assert_array_equal(qd.tensor(bits, device=device, dtype="bfloat16").numpy(), [1.0, -3.0])


def test_float64_past_float32s_range_is_refused_where_it_would_become_inf(device):
    """float64 data becomes float32 unasked: a finite value that would be inf there
    is named, in tensor() and as q_matmul's float side; dtype="float32" asks for
    IEEE's rounding, inf."""
    data = np.array([[1.0, -1e300], [2.0, 3.0]])
    with pytest.raises(qd.NonFiniteError, match=re.escape("holding -1e+300 at position (0, 1): float64 data "
                                                          "becomes float32 here")):
        qd.tensor(data, device=device)
    w = qd.quantize(np.ones((2, 2), np.float32), qd.QuantScheme("q8s"), device=device)
    with pytest.raises(qd.NonFiniteError, match=re.escape("at position (0, 1)")):
        qd.q_matmul(data, w)
    np.testing.assert_array_equal(qd.tensor(data, device=device, dtype="float32").numpy()[0], [1.0, -np.inf])
    np.testing.assert_array_equal(qd.tensor(data[1:], device=device).numpy(), [[2.0, 3.0]])  # in range: as ever


def test_tensors_take_weak_references(device):
    """Weak caches may key on any qdispatch tensor, dense ones as QTensors."""
    import gc
    import weakref
    q = qd.quantize(np.ones((2, 32), np.float32), "q8s", device=device)
    t = q.dequantize()
    refs = [weakref.ref(t), weakref.ref(q)]
    assert refs[0]() is t and refs[1]() is q
    del t, q
    gc.collect()
    assert [ref() for ref in refs] == [None, None]


def test_the_constructors_refuse_what_is_no_tensor():
    """Tensor() and QTensor() are exported (for isinstance): a payload of another shape
    than the one named gave q_matmul results whose shape and values disagreed, and a
    bad kind or dtype failed later with an IndexError or KeyError."""
    payload = np.zeros((3, 16), np.float32)
    cpu = int(qd.BackendKind.CPU)
    for shape, dtype, data in (((5, 16), "float32", payload), ((3, 16), "float32", payload.astype(np.int64)),
                               ((3, 16), "bfloat16", payload), ((3, 16), "float32", [[0.0] * 16] * 3)):
        with pytest.raises(qd.ShapeError, match=r"A host Tensor's payload must be a numpy array of its shape .*: "
                                                r"make tensors with qdispatch.tensor\(data, dtype=...\)"):
            qd.Tensor(data, dtype, shape, cpu)
    for dtype, kind, index in (("weird", cpu, 0), ("float32", 7, 0), ("float32", -1, 0), ("float32", cpu, -1)):
        with pytest.raises(ValueError, match=r"names no dtype and device: make tensors with qdispatch.tensor"):
            qd.Tensor(payload, dtype, (3, 16), kind, index)
    with pytest.raises(ValueError, match=r"QTensor\(NoneType, NoneType, ...\) names no layout and device: make "
                                         r"QTensors with qdispatch.quantize\(\) or qdispatch.qtensor_from_parts\(\)"):
        qd.QTensor(None, None, False, 1)
    t = qd.Tensor(payload, "float32", (3, 16), cpu)  # a consistent one is a tensor, as qd.tensor's
    np.testing.assert_array_equal(t.numpy(), payload)
