"""Benchmark cases shared by `python -m qdispatch bench` and `benchmarks/` (pytest-benchmark).

One definition of the shapes, the paths and the contenders: a `Case` names
what to measure (shape, path, implementation, threads) and `build(case)` turns
it into a callable that computes a fresh result on every call.  Contenders
(numpy float32, FBGEMM through torch, onnxruntime) are optional imports; a case
whose library is missing reports why instead of running.  Each path's
contenders do that path's job: the same inputs, quantized or not, and the same
output type.

Weights rotate through enough copies to exceed 16x the last-level cache, as
in a model whose layers do not fit in cache: otherwise an M = 1 product reads
its weights from cache and the figure says nothing about memory.  The copies
stay within a memory budget (4 GiB, or half the available memory where that is
less); each result records the bytes rotated and whether they reach 16x the
cache, and a case that falls short warns.

The cases time host backends only (perf_counter around a call that returns a
finished result); CUDA is timed by benchmarks/bench_cuda.py, with events and
weights rotated past the GPU's L2.
"""
import argparse
import dataclasses
import itertools
import json
import math
import os
import platform
import sys
import time
import warnings
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

import qdispatch as qd
from qdispatch._core import get_backend
from qdispatch.errors import byte_size

# ---- what is measured ------------------------------------------------------------

DEFAULT_SHAPES = "1x4096x4096,16x4096x4096,128x4096x4096,512x4096x4096,64x4096x11008"
PATHS = ("qq_int8", "qq_int8_in", "fq_int8", "fq_int8_in", "w8a8", "int4", "qq_int4", "int_matmul", "quantize")
PATH_HELP = {
    "qq_int8": "q8s activations (per row) x q8s weights (per channel), float32 out",
    "qq_int8_in": "q8s activations (per row) x q8s weights with a scale per input channel, float32 out "
                  "(each k-step's product scaled as the reference scales it)",
    "fq_int8": "float32 activations x q8s weights, dequantized in registers (weight-only)",
    "fq_int8_in": "float32 activations x q8s weights with a scale per input channel (weight-only: "
                  "x takes the scales)",
    "w8a8": "float32 activations quantized per row in C, then the int8 kernel",
    "int4": "float32 activations x q4s weights in blocks of 32 (packed_u32)",
    "qq_int4": "q8s activations (per row) x q4s weights in blocks of 32 (packed_u32), float32 out",
    "int_matmul": "raw int8 x int8 -> int32, weights not pre-packed",
    "quantize": "quantize the [N, K] float32 weight per channel (GOP/s = G values/s)",
}

CONTENDERS = {
    "numpy_f32": "numpy float32 x @ w.T through BLAS, float32 in and out (the reference of every "
                 "product path); for quantize, the same per-channel formula in numpy",
    "fbgemm": "torch quantize_dynamic, engine fbgemm: float32 in and out, activations quantized "
              "per tensor to 7 bits inside every call (not exact), int8 weights per channel packed once",
    "ort_qq_u8u8": "onnxruntime MatMulInteger on pre-quantized activations x a constant weight, both "
                   "u8 with zero point 128 (exact), then Cast and Mul by row and channel scales: float32 out",
    "ort_qq_s8s8": "onnxruntime MatMulInteger on pre-quantized s8 activations x a constant s8 weight, "
                   "then Cast and Mul by row and channel scales: float32 out",
    "ort_w8a8": "onnxruntime DynamicQuantizeMatMul (com.microsoft): float32 in and out, activations "
                "quantized per tensor to u8 inside every call, constant s8 weights with per-channel scales",
    "ort_int_u8u8": "onnxruntime MatMulInteger, both operands graph inputs (nothing packed ahead), "
                    "u8 with zero point 128 (exact): int32 out",
    "ort_int_s8s8": "onnxruntime MatMulInteger, both operands graph inputs (nothing packed ahead), "
                    "s8: int32 out",
}
# The contenders that do each path's job (numpy float32 first: every ratio is to it).
# fq_int8, fq_int8_in and int4 are weight-only: no contender here keeps float activations;
# nor does any take qq_int8_in's weight, scaled per input channel.
PATH_CONTENDERS = {
    "qq_int8": ("numpy_f32", "ort_qq_u8u8", "ort_qq_s8s8"),
    "qq_int8_in": ("numpy_f32",),
    "fq_int8": ("numpy_f32",),
    "fq_int8_in": ("numpy_f32",),
    "w8a8": ("numpy_f32", "fbgemm", "ort_w8a8"),
    "int4": ("numpy_f32",),
    "qq_int4": ("numpy_f32",),
    "int_matmul": ("numpy_f32", "ort_int_u8u8", "ort_int_s8s8"),
    "quantize": ("numpy_f32",),
}
_REQUIRES = {"fbgemm": ("torch",), "numpy_f32": ("threadpoolctl",),
             **{name: ("onnxruntime", "onnx") for name in CONTENDERS if name.startswith("ort_")}}
# numpy's BLAS threads, left as they are, spin beside qdispatch's after each call:
# on 2 cores numpy's times came out 10-60x slow, and every ratio with them
_WHY_REQUIRED = {"threadpoolctl": " to set numpy's BLAS threads (left as they are, its times mean nothing)"}
# Each onnxruntime copy is a session with its own thread pool: past this many,
# the rotation falls short of CACHE_MULTIPLE x the cache (and says so) rather than pile up threads.
MAX_ORT_SESSIONS = 256

W8 = qd.QuantScheme("q8s", axis=0)  # [N, K] weight: one scale per output channel
A8 = qd.QuantScheme("q8s", axis=0)  # [M, K] activation: one scale per row (token)
W4 = qd.QuantScheme("q4s", block=(1, 32), store="packed_u32")
W8_IN = qd.QuantScheme("q8s", axis=1)  # [N, K] weight: one scale per input channel
# The weight scheme of each qdispatch path (int_matmul takes raw int8 values).
WEIGHT_SCHEMES = {"qq_int8": W8, "qq_int8_in": W8_IN, "fq_int8": W8, "fq_int8_in": W8_IN, "w8a8": W8, "int4": W4,
                  "qq_int4": W4, "quantize": W8}
# Paths whose weight is quantized in blocks along K: K must be a multiple of the block.
K_BLOCKS = {"int4": W4.block[-1], "qq_int4": W4.block[-1]}


# A shape with a larger operand is refused when it is parsed; a smaller one that does
# not fit this machine's memory is skipped when its operands are made (numpy refuses
# sizes near 2**63 with a ValueError, not the MemoryError that skips a case).
MOST_OPERAND_BYTES = 1 << 48


@dataclasses.dataclass(frozen=True)
class Shape:
    m: int
    k: int
    n: int

    @classmethod
    def parse(cls, text):
        try:
            m, k, n = (int(v) for v in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {text!r} is not MxKxN, e.g. 1x4096x4096") from None
        if min(m, k, n) <= 0:
            raise ValueError(f"shape {text!r} has a dimension <= 0")
        if max(m * k, k * n, m * n) * 4 > MOST_OPERAND_BYTES:
            raise ValueError(f"shape {text!r} has a float32 operand past {MOST_OPERAND_BYTES >> 40} TiB, "
                             f"more memory than any machine runs it in")
        return cls(m, k, n)

    def __str__(self):
        return f"{self.m}x{self.k}x{self.n}"

    def problem(self, path):
        """Why `path` can't run on this shape, or None."""
        block = K_BLOCKS.get(path)
        if block and self.k % block:
            return f"the {path} path quantizes K in blocks of {block}, so K={self.k} must be a multiple of {block}"
        return None


@dataclasses.dataclass(frozen=True)
class Case:
    """One measurement: `impl` is a qdispatch backend name or a contender name."""
    shape: Shape
    path: str
    impl: str
    threads: int

    @property
    def is_contender(self):
        return self.impl in CONTENDERS

    @property
    def group(self):
        return f"{self.shape} {self.path}"

    @property
    def id(self):
        return f"{self.shape}-{self.path}-{self.impl}-t{self.threads}"

    @property
    def ops(self):
        """Operations per call: 2*M*K*N for a product, one per value quantized."""
        s = self.shape
        return s.n * s.k if self.path == "quantize" else 2 * s.m * s.k * s.n

    def skip_reason(self):
        problem = self.shape.problem(self.path)
        if problem:
            return problem
        for module in _REQUIRES.get(self.impl, ()):
            if not _importable(module):
                return f"{self.impl} needs `pip install {module}`{_WHY_REQUIRED.get(module, '')}"
        if not self.is_contender and self.impl not in qd.available_backends():
            return f"backend {self.impl!r} is not available here"
        if not self.is_contender and is_device_backend(self.impl):
            return f"backend {self.impl!r} is a device: {CUDA_ELSEWHERE}"
        return None


CUDA_ELSEWHERE = ("these benchmarks time host backends only; time CUDA with "
                  "`pytest benchmarks/bench_cuda.py` (CUDA events, weights rotated past the GPU's L2)")


def is_device_backend(name):
    """'cuda' (or 'cuda:N'): a backend whose results live off the host."""
    try:
        return not qd.Device.parse(name).is_host
    except (TypeError, ValueError):
        return False


def _importable(module):
    from importlib.util import find_spec
    return find_spec(module) is not None


def plan(shapes, paths, backends, threads, contenders=tuple(CONTENDERS), share_contenders=False):
    """Cases in run order: per shape, per thread count, per path group, the
    contenders first (numpy float32 leading), then each qdispatch backend.

    `share_contenders` measures a contender once per shape and job (the CLI);
    pytest-benchmark groups instead repeat it beside every path."""
    seen = set()
    for shape, n, path in itertools.product(shapes, threads, paths):
        for impl in PATH_CONTENDERS[path]:
            if impl not in contenders:
                continue
            key = (shape, n, impl, job(path))
            if share_contenders and key in seen:
                continue
            seen.add(key)
            yield Case(shape, path, impl, n)
        for backend in backends:
            yield Case(shape, path, backend, n)


def job(path):
    """What a contender computes for a path: the same numpy call serves every product."""
    return "quantize" if path == "quantize" else "matmul"


# ---- building cases --------------------------------------------------------------

# Rotated weights must exceed this many times the last-level cache.  4x was not
# enough: on a 2-core EPYC guest (32 MiB L3) qq int8 at 1x4096x4096 read 15-19%
# faster through 128 MiB of copies than through 512 MiB or 1 GiB, which agreed.
CACHE_MULTIPLE = 16


@dataclasses.dataclass
class Bench:
    calls: list  # one zero-argument callable per weight copy, copy i's weight rolled by i rows
    weight_bytes: int  # weight bytes one call reads

    def __post_init__(self):
        self.fn = _rotate(self.calls)  # the copies in turn; a fresh result each call

    @property
    def copies(self):
        return len(self.calls)

    @property
    def rotated_bytes(self):
        return self.weight_bytes * self.copies

    @property
    def defeats_cache(self):
        return exceeds_cache(self.rotated_bytes)


def exceeds_cache(nbytes):
    """Whether `nbytes` read in turn come from memory: CACHE_MULTIPLE x the last-level cache."""
    return nbytes >= CACHE_MULTIPLE * last_level_cache_bytes()


@lru_cache(maxsize=2)
def operands(shape):
    """Activations x [M, K] and weights w [N, K], float32, the same for every case of a shape."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((shape.m, shape.k), dtype=np.float32)
    w = (0.02 * rng.standard_normal((shape.n, shape.k), dtype=np.float32))
    return x, w


def last_level_cache_bytes():
    """The largest CPU cache, from sysfs; 32 MiB where it cannot be read."""
    best = 0
    root = "/sys/devices/system/cpu/cpu0/cache"
    for entry in (os.listdir(root) if os.path.isdir(root) else ()):
        try:
            with open(os.path.join(root, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KM")) * scale)
    return best or 32 << 20


def available_memory_bytes():
    """MemAvailable from /proc/meminfo (Linux); None where it can't be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


# Bytes a case holds at its peak per operand element (x and w, float32): the operands
# twice (the call's and the check's), the check's float64 copies and products, and
# the quantized weights; its weight copies come out of the rotation budget.
CASE_BYTES_PER_ELEMENT = 32


def case_memory_bytes(shape):
    """About the most memory a case of `shape` holds, its weight copies aside."""
    return CASE_BYTES_PER_ELEMENT * (shape.m + shape.n) * shape.k




def default_rotation_budget():
    """Bytes the weight copies may take: 4 GiB, or half the available memory where that is less."""
    available = available_memory_bytes()
    return min(4 << 30, available // 2) if available else 4 << 30


def weight_copies(weight_bytes, budget_bytes=None, max_copies=None):
    """How many weight sets keep the calls reading memory, not cache: enough to
    exceed CACHE_MULTIPLE x the last-level cache, as many as the budget holds."""
    weight_bytes = max(weight_bytes, 1)
    wanted = math.ceil(CACHE_MULTIPLE * last_level_cache_bytes() / weight_bytes)
    affordable = (budget_bytes or default_rotation_budget()) // weight_bytes
    return max(1, min(wanted, affordable, max_copies or wanted))


def build(case, copies=None, budget_bytes=None):
    """A Bench for `case`; `copies=None` picks enough weight sets to defeat the
    cache within `budget_bytes` (None: `default_rotation_budget()`), and warns
    when they fall short."""
    reason = case.skip_reason()
    if reason:
        raise RuntimeError(reason)
    x, w = operands(case.shape)
    maker = _CONTENDER_BUILDERS[case.impl] if case.is_contender else _PATH_BUILDERS[case.path]
    first, nbytes = maker(case, x, w)
    expected = expected_results(case)
    check_result(case, first(), expected=expected)  # before building more copies: a wrong product stops at once
    limit = MAX_ORT_SESSIONS if case.impl.startswith("ort_") else None
    copies = copies or weight_copies(nbytes, budget_bytes, limit)
    fns = [first]
    for i in range(1, copies):  # every copy timed is checked once, before any timing
        fns.append(maker(case, x, np.roll(w, i, axis=0))[0])
        check_result(case, fns[i](), copy=i, expected=expected)
    bench = Bench(fns, nbytes)
    warn_if_cached(case.id, nbytes, copies)
    return bench


def warn_if_cached(label, weight_bytes, copies):
    """Warn that `label`'s timings may come from cache: its `copies` of `weight_bytes`
    each, read in turn, don't defeat it."""
    if not exceeds_cache(weight_bytes * copies):
        warnings.warn(f"{label}: its weights rotate through {weight_bytes * copies / 2**20:.1f} MiB "
                      f"({copies} copies), less than {CACHE_MULTIPLE}x the last-level cache "
                      f"({last_level_cache_bytes() / 2**20:.0f} MiB): calls may read them from cache",
                      stacklevel=3)


def versus_contender(benchmark, seconds, impl, contender, times):
    """This case's ratio to its group's contender and words saying so.  `times` keeps
    the contender's `seconds` per group: the contender runs first in its group."""
    if impl == contender:
        times[benchmark.group] = seconds
        return 1.0, "the contender"
    ref = times.get(benchmark.group)
    return (ref / seconds, f"{ref / seconds:.2f}x {contender}") if ref else (None, f"{contender} not timed")


def _rotate(fns):
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _qd_qq(case, x, w):
    """qq: activations quantized per row ahead of the calls, weights in the path's scheme."""
    wq = qd.quantize(w, WEIGHT_SCHEMES[case.path], device=case.impl)
    xq = qd.quantize(x, A8, device=case.impl)
    return (lambda: qd.linear(xq, wq)), wq.nbytes


def _qd_fq(case, x, w):
    """fq: float32 activations, weights in the path's scheme (weight-only)."""
    wq = qd.quantize(w, WEIGHT_SCHEMES[case.path], device=case.impl)
    xt = qd.tensor(x, device=case.impl)
    return (lambda: qd.linear(xt, wq)), wq.nbytes


def _qd_w8a8(case, x, w):
    wq = qd.quantize(w, WEIGHT_SCHEMES[case.path], device=case.impl)
    xt = qd.tensor(x, device=case.impl)
    return (lambda: qd.linear(xt, wq, activation_scheme="q8s")), wq.nbytes


def _qd_int_matmul(case, x, w):
    a = qd.tensor(np_quantize_rows(x)[0], device=case.impl)
    b = qd.tensor(np.ascontiguousarray(np_quantize_rows(w)[0].T), device=case.impl)
    return (lambda: qd.int_matmul(a, b)), w.size


def _qd_quantize(case, x, w):
    wt = qd.tensor(w, device=case.impl)
    return (lambda: qd.quantize(wt, WEIGHT_SCHEMES[case.path])), w.nbytes


_PATH_BUILDERS = {"qq_int8": _qd_qq, "qq_int8_in": _qd_qq, "fq_int8": _qd_fq, "fq_int8_in": _qd_fq, "w8a8": _qd_w8a8,
                  "int4": _qd_fq, "qq_int4": _qd_qq, "int_matmul": _qd_int_matmul, "quantize": _qd_quantize}


def np_quantize_rows(x, lo=-127, hi=127):
    """Symmetric int8 per row in numpy float32 (the numpy side of the quantize path)."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32((hi - lo) / 2), np.float32(1))
    return np.clip(np.rint(x / scale), lo, hi).astype(np.int8), scale


def _numpy_f32(case, x, w):
    if case.path == "quantize":
        return (lambda: np_quantize_rows(w)), w.nbytes
    wt = w.T  # x @ w.T: BLAS reads the [N, K] weight in place
    return (lambda: x @ wt), w.nbytes


def _fbgemm(case, x, w):
    import torch
    torch.backends.quantized.engine = "fbgemm"
    torch.set_num_threads(case.threads)
    linear = torch.nn.Linear(case.shape.k, case.shape.n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(w))
    with warnings.catch_warnings():  # torch.ao.quantization warns that it is deprecated
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
        model = quantize_dynamic(torch.nn.Sequential(linear),
                                 {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    xt = torch.from_numpy(x)

    def fn():
        with torch.inference_mode():
            return model(xt)
    return fn, w.size


# onnxruntime graphs: IR version 8 with opset 13 (and com.microsoft 1) is readable by
# every onnxruntime since 1.10, whatever newer IR version onnx would stamp by default.
def _ort_session(case, nodes, inputs, initializers, output_type):
    import onnxruntime as ort
    from onnx import helper, numpy_helper
    graph = helper.make_graph(
        nodes, case.impl,
        [helper.make_tensor_value_info(name, _onnx_type(a), list(a.shape)) for name, a in inputs.items()],
        [helper.make_tensor_value_info("Y", output_type, None)],
        [numpy_helper.from_array(a, name) for name, a in initializers.items()])
    model = helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = case.threads
    options.inter_op_num_threads = 1
    # idle sessions of the other weight copies must not spin on the cores
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return lambda: session.run(None, inputs)[0]


def _onnx_type(array):
    from onnx import helper
    return helper.np_dtype_to_tensor_dtype(array.dtype)


def _as_u8(q):
    """int8 values as u8 with zero point 128: the same values, exactly."""
    return (q.astype(np.int16) + 128).astype(np.uint8)


def _int8_operands(x, w, signed):
    """Activations [M, K] and the transposed weight [K, N] quantized per row /
    channel as qdispatch does, their scales, and MatMulInteger's zero points."""
    (a, a_scale), (b, b_scale) = np_quantize_rows(x), np_quantize_rows(w)
    b = np.ascontiguousarray(b.T)
    zero_points = {}
    if not signed:
        a, b = _as_u8(a), _as_u8(b)
        zero_points = {"za": np.array(128, np.uint8), "zb": np.array(128, np.uint8)}
    return a, a_scale, b, b_scale.ravel(), zero_points


def _matmul_integer(zero_points, out="Yi"):
    from onnx import helper
    return helper.make_node("MatMulInteger", ["A", "B"] + list(zero_points), [out])


def _ort_qq(signed):
    """Pre-quantized activations x a constant weight, scaled to float32 after."""
    def make(case, x, w):
        from onnx import TensorProto, helper
        a, a_scale, b, b_scale, zero_points = _int8_operands(x, w, signed)
        nodes = [_matmul_integer(zero_points),
                 helper.make_node("Cast", ["Yi"], ["Yf"], to=TensorProto.FLOAT),
                 helper.make_node("Mul", ["Yf", "a_scale"], ["Ya"]),
                 helper.make_node("Mul", ["Ya", "b_scale"], ["Y"])]
        fn = _ort_session(case, nodes, {"A": a, "a_scale": a_scale},
                          {"B": b, "b_scale": b_scale, **zero_points}, TensorProto.FLOAT)
        return fn, b.size
    return make


def _ort_w8a8(case, x, w):
    """float32 in and out: onnxruntime quantizes the activations inside the call."""
    from onnx import TensorProto, helper
    _, _, b, b_scale, _ = _int8_operands(x, w, signed=True)
    node = helper.make_node("DynamicQuantizeMatMul", ["X", "B", "b_scale"], ["Y"], domain="com.microsoft")
    fn = _ort_session(case, [node], {"X": x}, {"B": b, "b_scale": b_scale}, TensorProto.FLOAT)
    return fn, b.size


def _ort_int(signed):
    """int8 x int8 -> int32 with both operands graph inputs: like qdispatch's
    int_matmul, nothing is packed ahead of the call."""
    def make(case, x, w):
        from onnx import TensorProto
        a, _, b, _, zero_points = _int8_operands(x, w, signed)
        fn = _ort_session(case, [_matmul_integer(zero_points, out="Y")], {"A": a, "B": b},
                          zero_points, TensorProto.INT32)
        return fn, b.size
    return make


_CONTENDER_BUILDERS = {"numpy_f32": _numpy_f32, "fbgemm": _fbgemm,
                       "ort_qq_u8u8": _ort_qq(signed=False), "ort_qq_s8s8": _ort_qq(signed=True),
                       "ort_w8a8": _ort_w8a8,
                       "ort_int_u8u8": _ort_int(signed=False), "ort_int_s8s8": _ort_int(signed=True)}


# ---- checking results ------------------------------------------------------------
#
# One output of every case is compared, outside the timed calls, with a value
# computed apart from the code timed: numpy in float64 from the same operands (the
# same quantized values and scales), or qdispatch's reference backend (numpy, the
# executable specification).  Big shapes compare a sample of rows.

# float32 sums in any order: the error of random-signed terms stays near float32's
# eps (6e-8) of sum |x| |w| per output; 1e-5 leaves two orders of magnitude of room.
FLOAT_RTOL = 1e-5
# Contenders that quantize the activations inside the call differ from the float
# product by their rounding noise: independent errors, uniform over a step.  Eight
# standard deviations of that noise are never reached by chance (far below 1e-12 per
# output), while a zeroed, shifted or permuted output lies dozens of them away.
NOISE_SIGMAS = 8
SAMPLE_ROWS = 16  # rows of M compared (every row of a decode batch): the float64 reference costs K x N per row


class WrongResultError(AssertionError):
    """A case's output is not what its path computes: its figures would time a wrong product."""


@dataclasses.dataclass
class Expected:
    value: np.ndarray  # float64, the rows compared
    tolerance: object  # per element (broadcast), 0: bit for bit
    basis: str  # what value and tolerance are, for the message
    rows: np.ndarray = None  # the rows of the output compared; None: all


def sample_rows(m):
    """At most SAMPLE_ROWS rows spread over M, the first and the last included."""
    return np.unique(np.linspace(0, m - 1, min(m, SAMPLE_ROWS)).round().astype(np.intp))


def check_result(case, out, copy=0, expected=None):
    """Raise WrongResultError, naming the case and the error, unless `out` (a call of
    `case` on weight copy `copy`, the weight rolled by `copy` rows) is its path's result
    (`expected`: expected_results(case), when the caller has it already)."""
    expected = expected or expected_results(case)
    got = _quantized_parts(out) if case.path == "quantize" else [_as_array(out)]
    # a weight rolled by `copy` rows rolls the output's columns (quantize: its rows)
    axis = 0 if case.path == "quantize" else -1
    for (what, e), g in zip(expected, got):
        assert_matches(case, what, np.roll(g, -copy, axis=axis), e)


def assert_matches(case, what, got, expected):
    """The one comparison: every element within its tolerance (NaN never is)."""
    got = np.asarray(got)
    want_shape = expected.value.shape if expected.rows is None else (case.shape.m,) + expected.value.shape[1:]
    if got.shape != want_shape:
        raise WrongResultError(f"{case.id}: {case.impl} gave {what} of shape {got.shape}, not {want_shape}")
    if expected.rows is not None:
        got = got[expected.rows]
    error = np.abs(got.astype(np.float64) - expected.value)
    tolerance = np.broadcast_to(expected.tolerance, error.shape)
    bad = ~(error <= tolerance)
    if bad.any():
        worst = np.unravel_index(np.where(bad, np.nan_to_num(error, nan=np.inf), -1).argmax(), error.shape)
        where = worst if expected.rows is None else (int(expected.rows[worst[0]]),) + worst[1:]
        raise WrongResultError(
            f"{case.id}: {case.impl} gave a wrong {what}: {bad.sum()} of {bad.size} values compared are off, "
            f"the worst at {tuple(map(int, where))}: {float(got[worst]):.9g} where {expected.value[worst]:.9g} "
            f"was expected (error {error[worst]:.3g}, tolerance {tolerance[worst]:.3g}); expected: {expected.basis}")


def expected_results(case):
    """[(what, Expected)]: the output a case's call must give, computed apart from it."""
    if case.path == "quantize":
        return _expected_quantize(case)
    x, w = operands(case.shape)
    maker = _CONTENDER_EXPECTED[case.impl] if case.is_contender else _PATH_EXPECTED[case.path]
    return [("output", maker(case, x, w, sample_rows(case.shape.m)))]


@lru_cache(maxsize=4)
def reference_weight(shape, scheme):
    """The shape's weight quantized by the reference backend (cached: numpy's quantize is slow)."""
    return qd.quantize(operands(shape)[1], scheme, device="reference")


def _expected_quantize(case):
    ref = reference_weight(case.shape, WEIGHT_SCHEMES[case.path])
    basis = ("the reference backend's quantize, bit for bit (the same on every backend; "
             "numpy's is the same float32 formula)")
    return [("values", Expected(np.asarray(ref.values, np.float64), 0, basis)),
            ("scales", Expected(np.asarray(ref.scales, np.float64).ravel(), 0, basis))]


def _expected_qq(case, x, w, rows):
    """qq and W8A8 (activations quantized per row, as A8 does): the reference backend's bits."""
    xq = qd.quantize(x[rows], A8, device="reference")  # per-row scales: the rows' own
    value = qd.linear(xq, reference_weight(case.shape, WEIGHT_SCHEMES[case.path])).numpy()
    return Expected(value.astype(np.float64), 0, "the reference backend's qq product, bit for bit "
                                                 "(the same bits on every backend and ISA)", rows)


def _expected_fq(case, x, w, rows):
    wd = reference_weight(case.shape, WEIGHT_SCHEMES[case.path]).dequantize().numpy()
    return float_product(x, wd, rows, "float64 x @ dequantize(w).T")


def _expected_int(case, x, w, rows):
    """int8 x int8: exact in float64 (every partial sum an integer below 2**53)."""
    a, b = np_quantize_rows(x)[0], np_quantize_rows(w)[0]
    return Expected(a[rows].astype(np.float64) @ b.astype(np.float64).T, 0,
                    "the exact integer product of the int8 operands", rows)


def float_product(x, w, rows, basis, x_step=0.0, w_step=0.0):
    """x[rows] @ w.T in float64, within float32 rounding (FLOAT_RTOL of sum |x| |w|) and,
    where `x_step` / `w_step` (one per tensor, or per row of x / of w) are the steps of a
    quantization done inside the call, NOISE_SIGMAS standard deviations of its noise."""
    x = x[rows]
    value = x.astype(np.float64) @ w.astype(np.float64).T
    tolerance = FLOAT_RTOL * (np.abs(x) @ np.abs(w).T)  # a bound needs no float64
    if np.any(x_step) or np.any(w_step):
        sx2, sw2 = np.square(np.broadcast_to(x_step, (len(x), 1))), np.square(np.broadcast_to(w_step, (len(w), 1)))
        x2, w2 = np.square(x).sum(axis=1, keepdims=True), np.square(w).sum(axis=1, keepdims=True)
        # errors uniform over a step have variance step**2 / 12: those of (x + ex) . (w + ew) - x . w
        variance = (sx2 * w2.T + x2 * sw2.T + x.shape[1] * sx2 * sw2.T / 12) / 12
        tolerance = tolerance + NOISE_SIGMAS * np.sqrt(variance)
        basis += f", within {NOISE_SIGMAS} standard deviations of the noise of its quantization"
    return Expected(value, tolerance, f"{basis} (within {FLOAT_RTOL:g} of sum |x||w| for float rounding)", rows)


def np_dequantize_rows(v):
    """v quantized by np_quantize_rows and multiplied back: the values a contender is given."""
    q, scale = np_quantize_rows(v)
    return q * scale.astype(np.float64)


def per_tensor_step(x, levels):
    """The step of a per-tensor u8 quantization over [min(x, 0), max(x, 0)] in `levels` steps."""
    return (max(float(x.max()), 0.0) - min(float(x.min()), 0.0)) / levels


def _expected_numpy_f32(case, x, w, rows):
    return float_product(x, w, rows, "float64 x @ w.T")


def _expected_ort_qq(case, x, w, rows):
    # the exact integer product, scaled in float32 afterwards
    return float_product(np_dequantize_rows(x), np_dequantize_rows(w), rows,
                         "float64 (a * a_scale) @ (b * b_scale).T of its int8 operands")


def _expected_ort_w8a8(case, x, w, rows):
    # the weight is given quantized; the activations are quantized per tensor to 255 steps inside
    return float_product(x, np_dequantize_rows(w), rows, "float64 x @ (b * b_scale).T",
                         x_step=per_tensor_step(x, 255))


def _expected_fbgemm(case, x, w, rows):
    # activations per tensor to 7 bits (127 steps), weights per channel to int8, both inside
    w_step = np.abs(w).max(axis=1, keepdims=True) / 127
    return float_product(x, w, rows, "float64 x @ w.T", x_step=per_tensor_step(x, 127), w_step=w_step)


_PATH_EXPECTED = {"qq_int8": _expected_qq, "qq_int8_in": _expected_qq, "w8a8": _expected_qq,
                  "qq_int4": _expected_qq, "fq_int8": _expected_fq, "fq_int8_in": _expected_fq,
                  "int4": _expected_fq, "int_matmul": _expected_int}
_CONTENDER_EXPECTED = {"numpy_f32": _expected_numpy_f32, "fbgemm": _expected_fbgemm,
                       "ort_qq_u8u8": _expected_ort_qq, "ort_qq_s8s8": _expected_ort_qq,
                       "ort_w8a8": _expected_ort_w8a8,
                       "ort_int_u8u8": _expected_int, "ort_int_s8s8": _expected_int}


def _as_array(result):
    """A case's result as numpy: qdispatch and torch tensors have .numpy()."""
    return np.asarray(result.numpy() if hasattr(result, "numpy") else result)


def _quantized_parts(result):
    """(values, scales) of a quantize case: a QTensor's, or numpy's pair."""
    values, scales = (result.values, result.scales) if hasattr(result, "values") else result
    return np.asarray(values), np.asarray(scales).ravel()


# ---- threads and timing ----------------------------------------------------------

def blas_threads_controlled():
    return _importable("threadpoolctl")


@contextmanager
def thread_limit(n):
    """qdispatch's kernels and numpy's BLAS on `n` threads for the block (torch and
    onnxruntime cases set theirs when built; torch's count is restored after, so that
    later torch code runs on its default).  Without threadpoolctl numpy's BLAS
    threads are left as they are, and numpy's cases are not run."""
    before = qd.get_num_threads()
    torch = sys.modules.get("torch")
    torch_before = torch.get_num_threads() if torch is not None else None
    qd.set_num_threads(n)
    try:
        if blas_threads_controlled():
            from threadpoolctl import threadpool_limits
            with threadpool_limits(limits=n, user_api="blas"):
                yield
        else:
            yield
    finally:
        qd.set_num_threads(before)
        if torch_before is not None:
            torch.set_num_threads(torch_before)


def measure(fn, repeat=5, calls=1, min_sample_s=0.02, max_case_s=5.0):
    """(best seconds per call, samples): `calls` warm-up calls first (one per
    weight copy, so first-use costs stay out); each sample loops enough calls to
    last about `min_sample_s`; a case slower than `max_case_s / repeat` per call
    takes fewer samples."""
    for _ in range(calls):
        fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    inner = max(1, calls, int(min_sample_s / max(once, 1e-9)))
    samples = max(1, min(repeat, int(max_case_s / (once * inner))))
    best = once
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return best, samples


def metrics(case, bench, seconds, samples=None):
    """The figures of one measured case (ratio filled in later, by `add_ratios`)."""
    return {
        "shape": str(case.shape), "path": case.path, "impl": case.impl,
        "backend": None if case.is_contender else case.impl, "threads": case.threads,
        "ms": seconds * 1e3, "gops": case.ops / seconds / 1e9,
        "weight_gbs": bench.weight_bytes / seconds / 1e9,
        "weight_bytes": bench.weight_bytes, "weight_copies": bench.copies,
        "rotated_bytes": bench.rotated_bytes, "rotation_defeats_cache": bench.defeats_cache,
        "cache_multiple": CACHE_MULTIPLE,
        "samples": samples, "ratio_numpy_f32": None,
    }


def add_ratios(rows):
    """ratio_numpy_f32 = GOP/s over numpy float32's on the same shape, threads and job."""
    base = {(r["shape"], r["threads"], job(r["path"])): r["gops"]
            for r in rows if r["impl"] == "numpy_f32"}
    for r in rows:
        ref = base.get((r["shape"], r["threads"], job(r["path"])))
        r["ratio_numpy_f32"] = r["gops"] / ref if ref else None
    return rows


# ---- the machine's ceilings ------------------------------------------------------
#
# Two reference figures measured beside the cases, not limits from a datasheet:
# a kernel with better prefetching can beat the read, and a shape that blocks
# better can beat the peak (by a little; by much means noise or a wrong figure).

# qq int8 shapes whose operands (int8 x and w, float32 out: 2.3, 8 and 14 MiB)
# stay in L2 / L3, each call long enough (0.5-9 GOP) that its overhead is small.
PEAK_SHAPES = (Shape(256, 1024, 1024), Shape(512, 4096, 1024), Shape(1024, 2048, 2048))


def default_bandwidth_bytes():
    """The streaming read's buffer: CACHE_MULTIPLE x the last-level cache, at least 1 GiB,
    and at most half the memory free now (a large cache asked for 4.8 GB)."""
    wanted = max(1 << 30, CACHE_MULTIPLE * last_level_cache_bytes())
    free = available_memory_bytes()
    return wanted if free is None else max(1 << 20, min(wanted, free // 2))


@contextmanager
def streaming_read(nbytes, threads):
    """(callable, bytes): `threads` threads each reduce (max) their slice of a
    u8 buffer, read once.  numpy releases the GIL in the reduction, and its SIMD
    max keeps up with memory where a float sum or BLAS gemv runs out of
    arithmetic first."""
    from concurrent.futures import ThreadPoolExecutor
    buffer = np.ones(nbytes, np.uint8)  # np.ones: pages touched now, not in the first read
    if not exceeds_cache(buffer.nbytes):
        warnings.warn(f"the streaming read's buffer ({buffer.nbytes / 2**20:.0f} MiB) is less than "
                      f"{CACHE_MULTIPLE}x the last-level cache: it measures the cache, not memory",
                      stacklevel=3)
    slices = np.array_split(buffer, threads)
    with ThreadPoolExecutor(threads) as pool:
        yield (lambda: list(pool.map(np.max, slices))), buffer.nbytes


def int8_peak_fn(shape, backend="cpu"):
    """qdispatch's qq int8 product on cache-resident operands (scale epilogue and call included)."""
    x, w = operands(shape)
    xq, wq = qd.quantize(x, A8, device=backend), qd.quantize(w, W8, device=backend)
    return lambda: qd.linear(xq, wq)


def ceilings(threads, repeat, bandwidth_bytes=None, backend="cpu"):
    """The streaming read (GB/s) on `threads` threads and the best qq int8 GOP/s over PEAK_SHAPES."""
    with streaming_read(bandwidth_bytes or default_bandwidth_bytes(), threads) as (fn, nbytes):
        bandwidth = nbytes / measure(fn, repeat)[0] / 1e9
    with thread_limit(threads):
        peaks = {str(s): 2 * s.m * s.k * s.n / measure(int8_peak_fn(s, backend), repeat)[0] / 1e9
                 for s in PEAK_SHAPES}
    return {"threads": threads, "read_gbs": bandwidth, "int8_peak_gops": max(peaks.values()),
            "read_buffer_bytes": nbytes, "read_buffer_defeats_cache": exceeds_cache(nbytes),
            "read_method": "numpy max over a u8 buffer, split across the threads",
            "peak_shapes": list(peaks), "peak_gops_per_shape": peaks,
            "peak_method": "qdispatch qq int8 on cache-resident operands, best shape"}


# ---- the machine -----------------------------------------------------------------

def cpuinfo():
    """CPU model and flags from /proc/cpuinfo (Linux), else what platform knows."""
    model, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name":
                    model = value.strip()
                elif key in ("flags", "Features"):
                    flags = value.split()
                elif not line.strip() and flags:
                    break  # the first processor says it all
    except OSError:
        pass
    return model, flags


def _version(dist):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine():
    model, flags = cpuinfo()
    cpu = qd.info()["backends"].get("cpu", {})
    return {
        "cpu_model": model, "cpu_flags": flags, "cores": os.cpu_count(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "platform": platform.platform(), "python": platform.python_version(),
        "qdispatch": qd.__version__, "isa": cpu.get("isa"),
        "isa_built": cpu.get("built"), "isa_supported": cpu.get("supported"),
        "numpy": np.__version__, "blas_threads_controlled": blas_threads_controlled(),
        # without OpenMP the cpu kernels run on one thread, whatever the case's threads say
        "cpu_openmp": not qd.info()["build"].get("openmp_left_out"),
        "torch": _version("torch"), "onnxruntime": _version("onnxruntime"),
    }


# ---- the command line ------------------------------------------------------------

def comma_list(kind):
    """A comma-separated list of `kind`, spaces around items allowed, each item once."""
    def parse(text):
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r} names nothing: give a comma-separated list")
        return list(dict.fromkeys(values))  # a case named twice would run and print twice
    return parse


def count(text):
    """A whole number of at least 1 (argparse's int takes 0 and -3)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no count: give a whole number of at least 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is no count: give a whole number of at least 1")
    return value


# The kernels' own cap (qd.set_num_threads): more threads would be figures labelled
# with a count that never ran.
MOST_THREADS_PER_CORE = 4


def thread_count(text):
    value = count(text)
    most = MOST_THREADS_PER_CORE * (os.cpu_count() or 1)
    if value > most:
        raise argparse.ArgumentTypeError(f"{value} threads: the kernels run at most {most} here "
                                         f"({MOST_THREADS_PER_CORE} per core)")
    return value


def default_threads():
    return sorted({1, os.cpu_count() or 1})


def add_arguments(parser):
    backends = [b for b in qd.available_backends() if b != "reference" and not is_device_backend(b)]
    parser.add_argument("--backend", type=comma_list(str), default=backends,
                        help=f"qdispatch host backends, comma-separated (default: {','.join(backends)}; "
                             f"'reference' only when named; for cuda see benchmarks/bench_cuda.py)")
    parser.add_argument("--shapes", type=comma_list(Shape.parse), default=comma_list(Shape.parse)(DEFAULT_SHAPES),
                        help=f"MxKxN list (default: {DEFAULT_SHAPES})")
    parser.add_argument("--threads", type=comma_list(thread_count), default=default_threads(),
                        help="thread counts (default: 1 and the machine's core count)")
    parser.add_argument("--paths", type=comma_list(str), default=list(PATHS),
                        help="; ".join(f"{p}: {h}" for p, h in PATH_HELP.items()))
    parser.add_argument("--contenders", type=comma_list(str), default=["numpy_f32"],
                        help=f"contenders, or 'all' (default: numpy_f32); one of {', '.join(CONTENDERS)}")
    parser.add_argument("--repeat", type=count, default=5, help="samples per case; the best is kept")
    parser.add_argument("--bandwidth-mb", type=count,
                        help="buffer of the streaming-read ceiling (default: 16x the last-level cache, "
                             "at least 1024)")
    parser.add_argument("--rotation-mb", type=count,
                        help="memory for rotated weight copies (default: 4096, or half the available "
                             "memory where that is less)")
    parser.add_argument("--plot", metavar="OUT.png", help="draw GOP/s per shape and backend (needs matplotlib)")
    parser.add_argument("--json", metavar="OUT.json", help="write the results and the machine description")


def _check_arguments(args):
    """Every mistake in the arguments, found before anything is measured; the contenders to run."""
    contenders = list(CONTENDERS) if "all" in args.contenders else args.contenders
    named = [c for c in args.contenders if c != "all"]
    for name, given, known in (("path", args.paths, PATHS), ("contender", named, CONTENDERS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            raise SystemExit(f"unknown {name} {', '.join(unknown)}: choose from {', '.join(known)}")
    for name in named if "all" not in args.contenders else ():  # one for no path given would not run
        if not any(name in PATH_CONTENDERS[path] for path in args.paths):
            timed = [path for path in PATHS if name in PATH_CONTENDERS[path]]
            raise SystemExit(f"contender {name} times none of --paths {','.join(args.paths)}: it times "
                             f"{', '.join(timed)}; add that to --paths")
    if not args.backend:  # the default list is empty where the cpu backend can't run
        raise SystemExit(f"no qdispatch host backend to time: the cpu backend can't run here "
                         f"({get_backend('cpu').unavailable_reason(0)}); fix that, or name "
                         f"--backend reference to time the reference backend")
    devices = [b for b in args.backend if is_device_backend(b)]
    if devices:
        raise SystemExit(f"qdispatch bench can't time {', '.join(devices)}: {CUDA_ELSEWHERE}")
    missing = [b for b in args.backend if b not in qd.available_backends()]
    if missing:
        raise SystemExit(f"backend {', '.join(missing)} not available here "
                         f"(available: {', '.join(qd.available_backends())})")
    for shape, path in itertools.product(args.shapes, args.paths):
        problem = shape.problem(path)
        if problem:
            raise SystemExit(f"shape {shape} can't be run: {problem} (or leave {path} out of --paths)")
    plotted = args.plot if not args.plot or os.path.isdir(args.plot) else plot_file(args.plot)  # what is written
    for option, out in (("--json", args.json), ("--plot", plotted)):
        if out is not None:  # '' too: a path that names no file
            _check_writable(option, out)
    if args.plot:
        _check_plot_format(args.plot)
    available = available_memory_bytes()
    if args.bandwidth_mb and available and args.bandwidth_mb << 20 > available:
        raise SystemExit(f"--bandwidth-mb {args.bandwidth_mb}: the streaming read's buffer would take more "
                         f"than the {available >> 20} MiB of memory available; give at most that")
    return contenders


def plot_file(path):
    """The file matplotlib writes for `path`: one without an extension ("out", "out.")
    gets ".png", its default format."""
    return path if os.path.splitext(path)[1][1:] else path.rstrip(".") + ".png"


def _check_plot_format(path):
    """A file type matplotlib can write, before minutes of measuring (it says so only at the end)."""
    kind = os.path.splitext(path)[1][1:].lower() or "png"  # matplotlib's default for no extension
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # run() says what to install
    if kind not in FigureCanvasBase.get_supported_filetypes():
        raise SystemExit(f"--plot {path}: matplotlib can't write .{kind} files; use one of "
                         f"{', '.join(sorted(FigureCanvasBase.get_supported_filetypes()))}")


def _check_writable(option, path):
    """Refuse an output file that can't be written before minutes of measuring, not
    after: by opening it (os.access says yes to root, and on /proc or a read-only
    mount), leaving no file behind that was not there."""
    if not path:
        raise SystemExit(f"{option} '': that names no file; give the file's path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"{option} {path}: folder {folder} does not exist; create it or choose another path")
    existed = os.path.exists(path)
    if existed and not os.path.isfile(path) and not os.path.isdir(path):
        return  # a pipe or /dev/stdout, written in place at the end: opening one now would wait, or end its reader
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise SystemExit(f"{option} {path}: can't write there ({exc.strerror}); choose another path") from None
    if not existed:
        os.unlink(path)


def _progress(done, total, label, stream=sys.stderr):
    width = 30
    filled = width * done // total
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"
    if stream.isatty():
        stream.write("\r" + line.ljust(100)[:100] + ("\n" if done == total else ""))
    else:
        stream.write(line + "\n")
    stream.flush()


def _megabytes(mb):
    return mb << 20 if mb else None


def _run_cases(cases, repeat, budget_bytes=None):
    rows, skipped = [], []
    for i, case in enumerate(cases):
        _progress(i, len(cases), case.id)
        reason = case.skip_reason()
        if reason:
            skipped.append({"case": case.id, "reason": reason})
            continue
        need, free = case_memory_bytes(case.shape), available_memory_bytes()
        if free is not None and need > free:  # past it the OS kills the process, with no MemoryError
            skipped.append({"case": case.id, "reason": f"it needs about {byte_size(need)} (its operands and the "
                                                        f"float64 check of its result), more than the "
                                                        f"{byte_size(free)} free here"})
            continue
        with thread_limit(case.threads):
            try:
                bench = build(case, budget_bytes=budget_bytes)
            except MemoryError:  # the shape's operands alone: the other cases still run
                skipped.append({"case": case.id, "reason": "its operands need more memory than is free here"})
                continue
            rows.append(metrics(case, bench, *measure(bench.fn, repeat, calls=bench.copies)))
    _progress(len(cases), len(cases), "done")
    return add_ratios(rows), skipped


def format_table(rows):
    head = ("shape", "path", "backend", "threads", "ms", "GOP/s", "GB/s", "x np f32")
    lines = [head]
    for r in rows:
        ratio = r["ratio_numpy_f32"]
        # numpy's one row of a shape is every path's base: named by its job, not the first path's name
        path = job(r["path"]) if r["impl"] == "numpy_f32" else r["path"]
        lines.append((r["shape"], path, r["impl"], str(r["threads"]), f"{r['ms']:.3f}",
                      f"{r['gops']:.1f}", f"{r['weight_gbs']:.1f}",
                      f"{ratio:.2f}" if ratio is not None else "-"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = lambda line: "  ".join(v.ljust(w) if i < 3 else v.rjust(w)
                                 for i, (v, w) in enumerate(zip(line, widths)))
    return "\n".join([fmt(lines[0]), fmt(["-" * w for w in widths])] + [fmt(l) for l in lines[1:]])


def run(args):
    contenders = _check_arguments(args)
    if args.plot:
        require_matplotlib()  # fail before minutes of measuring, not after
    cases = list(plan(args.shapes, args.paths, args.backend, args.threads, contenders,
                      share_contenders=True))
    try:
        rows, skipped = _run_cases(cases, args.repeat, _megabytes(args.rotation_mb))
    except WrongResultError as exc:  # no figures for a run that timed a wrong product
        raise SystemExit(f"wrong result, nothing reported: {exc}") from None
    ceiling = [ceilings(n, args.repeat, _megabytes(args.bandwidth_mb)) for n in args.threads] \
        if rows and "cpu" in qd.available_backends() else []  # nothing measured: nothing to set beside
    desc = machine()
    print(f"qdispatch {desc['qdispatch']} on {desc['cpu_model']} ({desc['cores']} cores, ISA {desc['isa']})")
    if "cpu" in args.backend and not desc["cpu_openmp"]:
        print("note: this qdispatch was built without OpenMP (see `qdispatch info`), "
              "so its cpu kernels ran on one thread in every case")
    for c in ceiling:
        print(f"ceilings at {c['threads']} threads: streaming read {c['read_gbs']:.1f} GB/s "
              f"(numpy, {c['read_buffer_bytes'] >> 20} MiB), qq int8 peak {c['int8_peak_gops']:.1f} GOP/s "
              f"(best of {', '.join(c['peak_shapes'])}, in cache)")
    if rows:
        print(format_table(rows))
    for line in beyond_ceilings(rows, ceiling):
        print(line)
    for s in skipped:
        print(f"skipped {s['case']}: {s['reason']}")
    result = {"machine": desc, "ceilings": ceiling, "results": rows, "skipped": skipped,
              "settings": {"repeat": args.repeat,
                           "statistic": "best of `samples` (repeat, fewer for slow cases)"}}
    if args.json:
        _write_json(args.json, result)
    if not rows:  # a script that runs the command learns that it measured nothing
        print("nothing was measured: every case was skipped (above)", file=sys.stderr)
        return 1
    if args.plot:
        try:
            plot(rows, args.plot)
        except (OSError, RuntimeError) as exc:  # a full disk, or a format whose tools are missing
            raise SystemExit(f"--plot {args.plot}: the plot could not be written ({exc})") from None
        print(f"plot written to {plot_file(args.plot)}")
    return 0


def _write_json(path, result):
    """The results written beside `path`, then renamed onto it: a run that fails to
    write (a full disk) leaves the file as it was, and says so.  Anything but a
    regular file (a pipe, /dev/stdout) is written in place: a rename would replace it."""
    text = json.dumps(result, indent=1)
    in_place = os.path.exists(path) and not os.path.isfile(path)
    target = path if in_place else os.path.join(os.path.dirname(os.path.abspath(path)),
                                                f".{os.path.basename(path)}.partial")
    try:
        with open(target, "w") as f:
            f.write(text)
        if not in_place:
            os.replace(target, path)
    except OSError as exc:
        if not in_place and os.path.exists(target):
            os.unlink(target)
        kept = "" if in_place else "; the file is as it was"
        raise SystemExit(f"--json {path}: the results could not be written ({exc.strerror or exc}){kept}") from None


# Paths on qdispatch's exact int8 kernel, whose speed the int8 peak bounds.
INT8_PATHS = ("qq_int8", "w8a8", "int_matmul")


def beyond_ceilings(rows, ceiling):
    """Notes on figures above the same run's ceilings: a ceiling measured too low,
    or a case that read its weights from cache."""
    by_threads = {c["threads"]: c for c in ceiling}
    for r in rows:
        c = by_threads.get(r["threads"])
        if not c or r["impl"] in CONTENDERS or r["path"] == "quantize":
            continue
        if r["weight_gbs"] > c["read_gbs"]:
            yield (f"note: {r['shape']} {r['path']} {r['impl']} t{r['threads']} read weights at "
                   f"{r['weight_gbs']:.1f} GB/s, above the streaming read's {c['read_gbs']:.1f}")
        if r["path"] in INT8_PATHS and r["gops"] > c["int8_peak_gops"]:
            yield (f"note: {r['shape']} {r['path']} {r['impl']} t{r['threads']} ran at "
                   f"{r['gops']:.1f} GOP/s, above the qq int8 peak's {c['int8_peak_gops']:.1f}")


# ---- the plot --------------------------------------------------------------------

MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install 'qdispatch[plot]' (or pip install matplotlib)"


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MATPLOTLIB_MISSING) from None
    return matplotlib


def plot(rows, out):
    """GOP/s per shape, one panel per (threads, path), each implementation a bar."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    threads = sorted({r["threads"] for r in rows})
    paths = [p for p in PATHS if any(r["path"] == p and r["impl"] not in CONTENDERS for r in rows)]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    # One colour per implementation in every panel; qdispatch's backends first.
    order = [b for b in dict.fromkeys(r["impl"] for r in rows) if b not in CONTENDERS] + list(CONTENDERS)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(len(threads), len(paths), squeeze=False,
                             figsize=(3.6 * len(paths), 3.2 * len(threads)))
    for (ti, n), (pi, path) in itertools.product(enumerate(threads), enumerate(paths)):
        ax = axes[ti][pi]
        mine = [r for r in rows if r["threads"] == n and
                (r["path"] == path or (r["impl"] in PATH_CONTENDERS[path] and job(r["path"]) == job(path)))]
        impls = sorted({r["impl"] for r in mine}, key=order.index)
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            gops = {r["shape"]: r["gops"] for r in mine if r["impl"] == impl}
            ax.bar([i + j * width for i in range(len(shapes))], [gops.get(s, 0) for s in shapes],
                   width, color=colors[order.index(impl) % len(colors)],
                   label=impl.replace("_", " ") if impl in CONTENDERS else f"qdispatch {impl}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, rotation=30, fontsize=7)
        ax.set_title(f"{path}, {n} thread{'s' if n > 1 else ''}", fontsize=9)
        ax.set_yscale("log")  # M = 1 and M = 512 differ by 10x and more
        ax.set_ylabel("G values/s" if path == "quantize" else "GOP/s", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
