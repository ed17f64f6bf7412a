"""Every error qdispatch raises on purpose is a QDispatchError and also the builtin a
Python user would catch, for arguments a call doesn't take as for the named failures."""
import mmap
import sys

import numpy as np
import pytest

import qdispatch as qd
from helpers import run_python


@pytest.fixture
def x():
    return qd.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), device="cpu")


@pytest.fixture
def w():
    return qd.quantize(np.ones((5, 4), np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")


@pytest.fixture
def saved(tmp_path, w):
    path = str(tmp_path / "w.st")
    qd.save(path, {"w": w})
    return path


def _read_only_tensor():
    region = mmap.mmap(-1, 16, prot=mmap.PROT_READ)
    return qd.from_dlpack(np.frombuffer(region, np.float32))


CASES = {  # id: (call, qdispatch class, builtin)
    "unknown dtype": (lambda x, w, p: qd.tensor([1.0], dtype="float64"), qd.ArgumentTypeError, TypeError),
    "unknown device": (lambda x, w, p: qd.Device("tpu"), qd.ArgumentError, ValueError),
    "device of a float": (lambda x, w, p: qd.tensor([1.0], device=1.5), qd.ArgumentTypeError, TypeError),
    "ISA of a number": (lambda x, w, p: qd.set_isa(3), qd.ArgumentTypeError, TypeError),
    "unknown ISA": (lambda x, w, p: qd.set_isa("sse9"), qd.ArgumentError, ValueError),
    "threads of a str": (lambda x, w, p: qd.set_num_threads("2"), qd.ArgumentTypeError, TypeError),
    "too many threads": (lambda x, w, p: qd.set_num_threads(2 ** 40), qd.ArgumentError, ValueError),
    "batch invariance of a str": (lambda x, w, p: qd.set_batch_invariant("no"), qd.ArgumentTypeError, TypeError),
    "unknown transfer policy": (lambda x, w, p: qd.transfer_policy("sideways").__enter__(), qd.ArgumentError,
                                ValueError),
    "dequantize of a Tensor": (lambda x, w, p: qd.dequantize(x), qd.ArgumentTypeError, TypeError),
    "quantize of integers": (lambda x, w, p: qd.quantize(np.ones((2, 4), np.int32)), qd.ArgumentTypeError,
                             TypeError),
    "two dense operands": (lambda x, w, p: qd.q_matmul(x, x.T), qd.ArgumentTypeError, TypeError),
    "float64 out_dtype": (lambda x, w, p: qd.q_matmul(x, w.T, out_dtype="float64"), qd.ArgumentTypeError,
                          TypeError),
    "requantize to float16": (lambda x, w, p: qd.q_matmul(x, w.T, out_dtype="float16",
                                                          requantize=qd.QuantScheme("q8s")),
                              qd.ArgumentError, ValueError),
    "int_matmul of floats": (lambda x, w, p: qd.int_matmul(x, x.T), qd.ArgumentTypeError, TypeError),
    "linear of a dense weight": (lambda x, w, p: qd.linear(x, x), qd.ArgumentTypeError, TypeError),
    "in-place matmul": (lambda x, w, p: x.__imatmul__(w.T), qd.ArgumentTypeError, TypeError),
    "QTensor arithmetic": (lambda x, w, p: np.add(w, 1), qd.ArgumentTypeError, TypeError),
    "QTensor indexing": (lambda x, w, p: w[0], qd.ArgumentTypeError, TypeError),
    "len of a 0-d tensor": (lambda x, w, p: len(qd.tensor(np.float32(1))), qd.ArgumentTypeError, TypeError),
    "truth of many values": (lambda x, w, p: bool(x), qd.ArgumentError, ValueError),
    "slice step": (lambda x, w, p: x[::2], qd.UnsupportedIndexError, IndexError),
    "new axis": (lambda x, w, p: x[None], qd.UnsupportedIndexError, IndexError),
    "too many indices": (lambda x, w, p: x[0, 0, 0], qd.UnsupportedIndexError, IndexError),
    "index past the axis": (lambda x, w, p: x[3], qd.OutOfRangeError, IndexError),
    "float embedding ids": (lambda x, w, p: qd.embedding(np.array([0.5]), w), qd.ArgumentTypeError, TypeError),
    "from_dlpack of an object": (lambda x, w, p: qd.from_dlpack(object()), qd.ArgumentTypeError, TypeError),
    "qtensor_from_parts shape": (lambda x, w, p: qd.qtensor_from_parts(np.zeros((2, 2), np.int8),
                                                                       np.ones(1, np.float32), qd.QuantScheme("q8s"),
                                                                       shape="2x2"),
                                 qd.ArgumentTypeError, TypeError),
    "read-only memory out by DLPack": (lambda x, w, p: _read_only_tensor().__dlpack__(), qd.DLPackExportError,
                                       BufferError),
    "memory_info of the host": (lambda x, w, p: qd.memory_info("cpu"), qd.ArgumentError, ValueError),
    "save of an object": (lambda x, w, p: qd.save(p + ".2", {"a": object()}), qd.ArgumentTypeError, TypeError),
    "load names of a str": (lambda x, w, p: qd.load(p, names="w"), qd.ArgumentTypeError, TypeError),
    "load of a missing name": (lambda x, w, p: qd.load(p, names=["v"]), qd.NotFoundError, KeyError),
    "load of a number": (lambda x, w, p: qd.load(3.5), qd.ArgumentTypeError, TypeError),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_each_refusal_is_a_qdispatch_error_and_its_builtin(case, x, w, saved):
    call, kind, builtin = CASES[case]
    with pytest.raises(qd.QDispatchError) as err:
        call(x, w, saved)
    assert type(err.value) is kind, f"{case}: {type(err.value).__name__}: {err.value}"
    assert isinstance(err.value, builtin)
    assert str(err.value)  # a message, not a bare class


def test_a_missing_name_reads_as_its_message():
    """KeyError's str() quotes its argument; NotFoundError's is the sentence itself."""
    err = qd.NotFoundError("f.st holds no tensor named 'v'; it holds 'w'")
    assert str(err) == "f.st holds no tensor named 'v'; it holds 'w'"


def test_the_error_classes_are_exported_and_documented():
    import qdispatch.errors as errors
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    for cls in classes:
        assert getattr(qd, cls.__name__) is cls and cls.__name__ in qd.__all__ and cls.__doc__
        assert issubclass(cls, UserWarning if issubclass(cls, Warning) else qd.QDispatchError)
    assert qd.ScaleUnderflowWarning in classes


@pytest.mark.parametrize("cls, parents", [
    (qd.ScaleOverflowError, (qd.QuantSchemeError, ValueError)),
    (qd.CudaOutOfMemoryError, (qd.OutOfMemoryError, qd.KernelError, MemoryError, RuntimeError)),
    (qd.OutOfMemoryError, (qd.KernelError, MemoryError, RuntimeError)),
    (qd.ArgumentTypeError, (TypeError,)),
    (qd.ArgumentError, (ValueError,)),
    (qd.NotFoundError, (KeyError,)),
    (qd.DLPackExportError, (BufferError,)),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_the_errors_subclass_what_the_readme_says(cls, parents):
    """`except qd.QuantSchemeError` catches a scale overflow, `except MemoryError` a GPU
    out of memory: callers rely on the README's hierarchy, so a class may not leave it."""
    for parent in parents:
        assert issubclass(cls, parent), f"{cls.__name__} is no {parent.__name__}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
@pytest.mark.skipif("cpu" not in qd.available_backends(), reason="needs the cpu backend")
def test_a_kernel_out_of_host_memory_is_a_memory_error():
    """A C kernel that could not allocate its scratch raised a plain KernelError, which
    `except MemoryError` (numpy's and the GPU's out of memory) misses."""
    code = """if 1:
        import resource, numpy as np, qdispatch as qd
        x = np.ones((1024, 16384), np.float32)
        w = qd.quantize(np.ones((64, 16384), np.float32), qd.QuantScheme("q8s", axis=0), device="cpu")
        qd.q_matmul(x[:2], w.T, activation_scheme="q8s")  # loaded and packed
        held = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (held + (4 << 20), resource.RLIM_INFINITY))
        try:
            qd.q_matmul(x, w.T, activation_scheme="q8s")  # x's 16 MB of int8 values don't fit
        except MemoryError as exc:
            print(type(exc).__name__, exc)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print(qd.q_matmul(x, w.T, activation_scheme="q8s").numpy()[0, 0])  # the process goes on
    """
    out = run_python("-c", code, QDISPATCH_NUM_THREADS="1")  # no thread stacks to map past the limit
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OutOfMemoryError ") and "out of memory" in out.stdout
    assert out.stdout.endswith("\n16384.0\n")
