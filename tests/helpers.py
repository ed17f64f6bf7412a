"""Error measures, probes and schemes shared by the tests."""
import os
import subprocess
import sys

import numpy as np

import qdispatch as qd

# Schemes every quantizing backend is checked on against the reference: each value
# kind and store, per tensor, per row and per column, blocks along rows and 2-D blocks,
# each scale dtype.
QUANTIZE_SCHEMES = [
    qd.QuantScheme("q8s"), qd.QuantScheme("q8f"), qd.QuantScheme("q8s", axis=0),
    qd.QuantScheme("q8s", axis=1), qd.QuantScheme("q8f", block=32),
    qd.QuantScheme("q8s", block=64, scale_dtype="f16"), qd.QuantScheme("q8s", block=128, scale_dtype="bf16"),
    qd.QuantScheme("q8s", block=(4, 32)), qd.QuantScheme("q4s", block=32, store="packed_u32"),
    qd.QuantScheme("q4f", axis=0, store="packed_u32", scale_dtype="f16"),
    qd.QuantScheme("q2s", block=64, store="packed_u32"), qd.QuantScheme("q2f", store="packed_u32"),
]


def sqnr_db(reference, approx):
    reference = np.asarray(reference, dtype=np.float64)
    noise = reference - np.asarray(approx, dtype=np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / max(np.sum(noise ** 2), 1e-300))


def rel_err(reference, approx):
    reference = np.asarray(reference, dtype=np.float64)
    return np.linalg.norm(reference - np.asarray(approx, dtype=np.float64)) / max(
        np.linalg.norm(reference), 1e-300)


def product_err(a, b, approx):
    """Error of approx against a @ b, relative to |a| @ |b|: float sums are accurate to
    that size, not to the result's own, which cancellation can make as small as it likes."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a @ b - np.asarray(approx, dtype=np.float64)) / max(
        np.linalg.norm(np.abs(a) @ np.abs(b)), 1e-300)


def built_with_openmp():
    """Whether the installed kernels were built with OpenMP; without it they run on one thread."""
    import qdispatch
    return not qdispatch.info()["build"].get("openmp_left_out")


def run_python(*args, stdout=subprocess.PIPE, **env):
    """A fresh interpreter that imports the same qdispatch as the tests: it runs
    beside the package under test, never in a source tree that would shadow it.
    `stdout`: where its output goes (by default captured, as its errors are)."""
    import qdispatch
    where = os.path.dirname(os.path.dirname(os.path.abspath(qdispatch.__file__)))
    return subprocess.run([sys.executable, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600,
                          cwd=where, env={**os.environ, "PYTHONPATH": where, **env})


def transient_bytes(fn):
    """Host memory that fn() takes while it runs and gives back by its end (tracemalloc's
    peak less what is still held), e.g. what a writer holds of its tensors at once."""
    import tracemalloc
    tracemalloc.start()
    try:
        fn()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - held
