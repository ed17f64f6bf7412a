"""Benchmark cases shared by `python -m qdispatch bench` and `benchmarks/` (pytest-benchmark).

One definition of the shapes, the paths and the contenders: a `Case` names
what to measure (shape, path, implementation, threads) and `build(case)` turns
it into a callable that computes a fresh result on every call.  Contenders
(numpy float32, FBGEMM through torch, onnxruntime's MatMulInteger) are optional
imports; a case whose library is missing reports why instead of running.

Weights rotate through enough copies to exceed 4x the last-level cache, as
in a model whose layers do not fit in cache: otherwise an M = 1 product reads
its weights from cache and the figure says nothing about memory.
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

# ---- what is measured ------------------------------------------------------------

DEFAULT_SHAPES = "1x4096x4096,16x4096x4096,128x4096x4096,512x4096x4096,64x4096x11008"
PATHS = ("qq_int8", "fq_int8", "w8a8", "int4", "int_matmul", "quantize")
PATH_HELP = {
    "qq_int8": "q8s activations (per row) x q8s weights (per channel), float32 out",
    "fq_int8": "float32 activations x q8s weights, dequantized in registers (weight-only)",
    "w8a8": "float32 activations quantized per row in C, then the int8 kernel",
    "int4": "float32 activations x q4s weights in blocks of 32 (packed_u32)",
    "int_matmul": "raw int8 x int8 -> int32, weights not pre-packed",
    "quantize": "quantize the [N, K] float32 weight per channel (GOP/s = G values/s)",
}

CONTENDERS = {
    "numpy_f32": "numpy float32 (BLAS) doing the same job in float32",
    "fbgemm": "torch quantize_dynamic, engine fbgemm (activations in 7 bits: not exact)",
    "ort_u8u8": "onnxruntime MatMulInteger u8 x u8, int32 out (exact)",
    "ort_s8s8": "onnxruntime MatMulInteger s8 x s8, int32 out",
}
# The contenders that do each path's job (numpy float32 first: every ratio is to it).
PATH_CONTENDERS = {
    "qq_int8": ("numpy_f32", "fbgemm", "ort_u8u8", "ort_s8s8"),
    "fq_int8": ("numpy_f32", "fbgemm"),
    "w8a8": ("numpy_f32", "fbgemm", "ort_u8u8", "ort_s8s8"),
    "int4": ("numpy_f32",),
    "int_matmul": ("numpy_f32", "ort_u8u8", "ort_s8s8"),
    "quantize": ("numpy_f32",),
}
_REQUIRES = {"fbgemm": ("torch",), "ort_u8u8": ("onnxruntime", "onnx"),
             "ort_s8s8": ("onnxruntime", "onnx")}

W8 = qd.QuantScheme("q8s", axis=0)  # [N, K] weight: one scale per output channel
A8 = qd.QuantScheme("q8s", axis=0)  # [M, K] activation: one scale per row (token)
W4 = qd.QuantScheme("q4s", block=(1, 32), store="packed_u32")
# Paths whose weight is quantized in blocks along K: K must be a multiple of the block.
K_BLOCKS = {"int4": W4.block[-1]}


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
        for module in _REQUIRES.get(self.impl, ()):
            if not _importable(module):
                return f"{self.impl} needs `pip install {module}`"
        if not self.is_contender and self.impl not in qd.available_backends():
            return f"backend {self.impl!r} is not available here"
        return None


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

@dataclasses.dataclass
class Bench:
    fn: object  # zero-argument callable; a fresh result each call
    weight_bytes: int  # weight bytes one call reads
    copies: int  # weight sets the calls rotate through


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


def weight_copies(weight_bytes, max_copies=16):
    """How many weight sets keep the calls reading memory, not cache."""
    return max(1, min(max_copies, math.ceil(4 * last_level_cache_bytes() / max(weight_bytes, 1))))


def build(case, copies=None):
    """A Bench for `case`; `copies=None` picks enough weight sets to defeat the cache."""
    reason = case.skip_reason()
    if reason:
        raise RuntimeError(reason)
    x, w = operands(case.shape)
    maker = _CONTENDER_BUILDERS[case.impl] if case.is_contender else _PATH_BUILDERS[case.path]
    first, nbytes = maker(case, x, w)
    copies = copies or weight_copies(nbytes)
    fns = [first] + [maker(case, x, np.roll(w, i, axis=0))[0] for i in range(1, copies)]
    return Bench(_rotate(fns), nbytes, copies)


def _rotate(fns):
    if len(fns) == 1:
        return fns[0]
    it = itertools.cycle(fns)
    return lambda: next(it)()


def _done(t):
    """A qdispatch result, complete: host tensors are; a device one is copied back."""
    return t if t.device.is_host else t.numpy()


def _qd_qq_int8(case, x, w):
    wq = qd.quantize(w, W8, device=case.impl)
    xq = qd.quantize(x, A8, device=case.impl)
    return (lambda: _done(qd.linear(xq, wq))), wq.nbytes


def _qd_fq_int8(case, x, w):
    wq = qd.quantize(w, W8, device=case.impl)
    xt = qd.tensor(x, device=case.impl)
    return (lambda: _done(qd.linear(xt, wq))), wq.nbytes


def _qd_w8a8(case, x, w):
    wq = qd.quantize(w, W8, device=case.impl)
    xt = qd.tensor(x, device=case.impl)
    return (lambda: _done(qd.linear(xt, wq, activation_scheme="q8s"))), wq.nbytes


def _qd_int4(case, x, w):
    wq = qd.quantize(w, W4, device=case.impl)
    xt = qd.tensor(x, device=case.impl)
    return (lambda: _done(qd.linear(xt, wq))), wq.nbytes


def _qd_int_matmul(case, x, w):
    a = qd.tensor(np_quantize_rows(x)[0], device=case.impl)
    b = qd.tensor(np.ascontiguousarray(np_quantize_rows(w)[0].T), device=case.impl)
    return (lambda: _done(qd.int_matmul(a, b))), w.size


def _qd_quantize(case, x, w):
    wt = qd.tensor(w, device=case.impl)
    return (lambda: qd.quantize(wt, W8)), w.nbytes


_PATH_BUILDERS = {"qq_int8": _qd_qq_int8, "fq_int8": _qd_fq_int8, "w8a8": _qd_w8a8,
                  "int4": _qd_int4, "int_matmul": _qd_int_matmul, "quantize": _qd_quantize}


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


def _ort(signed):
    def make(case, x, w):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
        a, b = np_quantize_rows(x)[0], np.ascontiguousarray(np_quantize_rows(w)[0].T)
        inits = []
        if not signed:  # u8 with zero point 128 holds the same int8 values exactly
            a, b = (a.astype(np.int16) + 128).astype(np.uint8), (b.astype(np.int16) + 128).astype(np.uint8)
            inits = [numpy_helper.from_array(np.array(128, np.uint8), n) for n in ("za", "zb")]
        inits.append(numpy_helper.from_array(b, "B"))
        elem = TensorProto.INT8 if signed else TensorProto.UINT8
        node = helper.make_node("MatMulInteger", ["A", "B"] + ([] if signed else ["za", "zb"]), ["Y"])
        graph = helper.make_graph([node], "matmul_integer",
                                  [helper.make_tensor_value_info("A", elem, list(a.shape))],
                                  [helper.make_tensor_value_info("Y", TensorProto.INT32, None)], inits)
        # IR version 8 with opset 13: readable by every onnxruntime since 1.10, whatever
        # newer IR version the installed onnx package would stamp by default
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
        options = ort.SessionOptions()
        options.intra_op_num_threads = case.threads
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        return (lambda: session.run(None, {"A": a})[0]), b.size
    return make


_CONTENDER_BUILDERS = {"numpy_f32": _numpy_f32, "fbgemm": _fbgemm,
                       "ort_u8u8": _ort(signed=False), "ort_s8s8": _ort(signed=True)}


# ---- threads and timing ----------------------------------------------------------

def blas_threads_controlled():
    return _importable("threadpoolctl")


@contextmanager
def thread_limit(n):
    """qdispatch's kernels and numpy's BLAS on `n` threads for the block (torch and
    onnxruntime cases set theirs when built).  Without threadpoolctl numpy's BLAS
    threads are left as they are, and results say so."""
    before = qd.get_num_threads()
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

# Shapes whose operands stay in L1 / L2: the kernel's compute peak, not memory.
PEAK_SHAPES = (Shape(64, 256, 64), Shape(256, 1024, 256))


def read_bandwidth_fn(nbytes):
    """(callable, bytes): a float32 matrix-vector product streaming a large buffer
    once.  BLAS's gemv reads faster than numpy's reductions (which run out of
    arithmetic first); its threads follow `thread_limit`."""
    rows = max(1, nbytes // (4 * 4096))
    matrix = np.ones((rows, 4096), np.float32)  # np.ones: pages touched now
    vector = np.ones(4096, np.float32)
    return (lambda: matrix @ vector), matrix.nbytes


def int8_peak_fn(shape, backend="cpu"):
    """A qq int8 product on cache-resident operands: the exact-int8 compute ceiling
    of the kernel's instruction mix (a lower bound: scale epilogue and call included)."""
    x, w = operands(shape)
    xq, wq = qd.quantize(x, A8, device=backend), qd.quantize(w, W8, device=backend)
    return lambda: _done(qd.linear(xq, wq))


def ceilings(threads, repeat, bandwidth_bytes, backend="cpu"):
    with thread_limit(threads):
        fn, nbytes = read_bandwidth_fn(bandwidth_bytes)
        bandwidth = nbytes / measure(fn, repeat)[0] / 1e9
        peak = max(2 * s.m * s.k * s.n / measure(int8_peak_fn(s, backend), repeat)[0] / 1e9
                   for s in PEAK_SHAPES)
    return {"threads": threads, "read_gbs": bandwidth, "int8_peak_gops": peak,
            "read_buffer_bytes": nbytes, "peak_shapes": [str(s) for s in PEAK_SHAPES]}


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

def _csv(kind):
    def parse(text):
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def count(text):
    """A whole number of at least 1 (argparse's int takes 0 and -3)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is no count: give a whole number of at least 1")
    return value


def default_threads():
    return sorted({1, os.cpu_count() or 1})


def add_arguments(parser):
    backends = [b for b in qd.available_backends() if b != "reference"]
    parser.add_argument("--backend", type=_csv(str), default=backends,
                        help=f"qdispatch backends, comma-separated (default: {','.join(backends)}; "
                             f"'reference' only when named)")
    parser.add_argument("--shapes", type=_csv(Shape.parse), default=_csv(Shape.parse)(DEFAULT_SHAPES),
                        help=f"MxKxN list (default: {DEFAULT_SHAPES})")
    parser.add_argument("--threads", type=_csv(count), default=default_threads(),
                        help="thread counts (default: 1 and the machine's core count)")
    parser.add_argument("--paths", type=_csv(str), default=list(PATHS),
                        help="; ".join(f"{p}: {h}" for p, h in PATH_HELP.items()))
    parser.add_argument("--contenders", type=_csv(str), default=["numpy_f32"],
                        help=f"contenders, or 'all' (default: numpy_f32); one of {', '.join(CONTENDERS)}")
    parser.add_argument("--repeat", type=count, default=5, help="samples per case; the best is kept")
    parser.add_argument("--bandwidth-mb", type=count, default=1024,
                        help="buffer size of the read-bandwidth ceiling (default: 1024)")
    parser.add_argument("--plot", metavar="OUT.png", help="draw GOP/s per shape and backend (needs matplotlib)")
    parser.add_argument("--json", metavar="OUT.json", help="write the results and the machine description")


def _check_arguments(args):
    """Every mistake in the arguments, found before anything is measured; the contenders to run."""
    contenders = list(CONTENDERS) if args.contenders == ["all"] else args.contenders
    for name, given, known in (("path", args.paths, PATHS), ("contender", contenders, CONTENDERS)):
        unknown = [v for v in given if v not in known]
        if unknown:
            raise SystemExit(f"unknown {name} {', '.join(unknown)}: choose from {', '.join(known)}")
    missing = [b for b in args.backend if b not in qd.available_backends()]
    if missing:
        raise SystemExit(f"backend {', '.join(missing)} not available here "
                         f"(available: {', '.join(qd.available_backends())})")
    for shape, path in itertools.product(args.shapes, args.paths):
        problem = shape.problem(path)
        if problem:
            raise SystemExit(f"shape {shape} can't be run: {problem} (or leave {path} out of --paths)")
    for option, out in (("--json", args.json), ("--plot", args.plot)):
        if out:
            _check_writable(option, out)
    return contenders


def _check_writable(option, path):
    """Refuse an output file that can't be written before minutes of measuring, not after."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"{option} {path}: folder {folder} does not exist; create it or choose another path")
    if os.path.isdir(path) or not os.access(path if os.path.exists(path) else folder, os.W_OK):
        raise SystemExit(f"{option} {path}: can't write there; choose another path")


def _progress(done, total, label, stream=sys.stderr):
    width = 30
    filled = width * done // total
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"
    if stream.isatty():
        stream.write("\r" + line.ljust(100)[:100] + ("\n" if done == total else ""))
    else:
        stream.write(line + "\n")
    stream.flush()


def _run_cases(cases, repeat):
    rows, skipped = [], []
    for i, case in enumerate(cases):
        _progress(i, len(cases), case.id)
        reason = case.skip_reason()
        if reason:
            skipped.append({"case": case.id, "reason": reason})
            continue
        with thread_limit(case.threads):
            bench = build(case)
            rows.append(metrics(case, bench, *measure(bench.fn, repeat, calls=bench.copies)))
    _progress(len(cases), len(cases), "done")
    return add_ratios(rows), skipped


def format_table(rows):
    head = ("shape", "path", "backend", "threads", "ms", "GOP/s", "GB/s", "x np f32")
    lines = [head]
    for r in rows:
        ratio = r["ratio_numpy_f32"]
        lines.append((r["shape"], r["path"], r["impl"], str(r["threads"]), f"{r['ms']:.3f}",
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
    rows, skipped = _run_cases(cases, args.repeat)
    ceiling = [ceilings(n, args.repeat, args.bandwidth_mb << 20) for n in args.threads] \
        if "cpu" in qd.available_backends() else []
    desc = machine()
    print(f"qdispatch {desc['qdispatch']} on {desc['cpu_model']} ({desc['cores']} cores, ISA {desc['isa']})")
    if not desc["blas_threads_controlled"]:
        print("note: threadpoolctl is not installed, so numpy's BLAS threads were not controlled")
    if "cpu" in args.backend and not desc["cpu_openmp"]:
        print("note: this qdispatch was built without OpenMP (see `qdispatch info`), "
              "so its cpu kernels ran on one thread in every case")
    for c in ceiling:
        print(f"ceilings at {c['threads']} threads: read bandwidth {c['read_gbs']:.1f} GB/s, "
              f"exact int8 peak {c['int8_peak_gops']:.1f} GOP/s")
    print(format_table(rows))
    for s in skipped:
        print(f"skipped {s['case']}: {s['reason']}")
    result = {"machine": desc, "ceilings": ceiling, "results": rows, "skipped": skipped,
              "settings": {"repeat": args.repeat,
                           "statistic": "best of `samples` (repeat, fewer for slow cases)"}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0


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
        ax.set_ylabel("GOP/s", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
