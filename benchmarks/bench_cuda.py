"""cuda backend benchmarks against torch in the same run (pytest-benchmark).

    python -m pytest benchmarks/bench_cuda.py -q

Every figure is the median over repetitions of CUDA-event time per call, with
inputs rotated over enough buffers that each call reads them from HBM rather
than from the 50 MB L2.  Contenders: `torch._int_mm` (cuBLASLt int8) raw and
followed by the dequant epilogue in torch, and bf16 `torch.matmul`.  Results go
to benchmarks/results/cuda_h200.json (batched decode: cuda_h200_batched.json;
prefill-sized fq: cuda_h200_prefill.json; decode layers in CUDA graphs:
cuda_h200_graphs.json; qq with scale blocks along K: cuda_h200_qq_blocks.json;
fq with weight blocks too fine for the decode tiles: cuda_h200_fq_fine_blocks.json;
quantizing bf16 weights on the GPU: cuda_h200_quantize.json) with the GPU's name and clocks."""
import contextlib
import itertools
import json
import os
import subprocess
from typing import Callable, NamedTuple, Optional

import numpy as np
import pytest

import qdispatch as qd
from qdispatch._core import get_backend

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif("cuda" not in qd.available_backends() or not torch.cuda.is_available(),
                       reason="needs the cuda backend, torch and a GPU"),
]

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RESULTS = os.path.join(RESULTS_DIR, "cuda_h200.json")
PREFILL_RESULTS = os.path.join(RESULTS_DIR, "cuda_h200_prefill.json")
BATCHED_RESULTS = os.path.join(RESULTS_DIR, "cuda_h200_batched.json")
GRAPH_RESULTS = os.path.join(RESULTS_DIR, "cuda_h200_graphs.json")
QQ_BLOCK_RESULTS = os.path.join(RESULTS_DIR, "cuda_h200_qq_blocks.json")
FINE_RESULTS = os.path.join(RESULTS_DIR, "cuda_h200_fq_fine_blocks.json")
QUANTIZE_RESULTS = os.path.join(RESULTS_DIR, "cuda_h200_quantize.json")
L2_DEFEAT_BYTES = 200 << 20   # each rotation touches at least this much
QQ_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 4096, 11008)]
FQ_SHAPES = [(1, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096), (16, 4096, 11008)]
BATCHED_SHAPES = [(32, 4096, 4096), (64, 4096, 4096), (32, 4096, 11008), (64, 4096, 11008)]
PREFILL_SHAPES = [(256, 4096, 4096), (2048, 4096, 4096), (256, 4096, 11008), (2048, 4096, 11008)]
FQ_WEIGHTS = [
    ("int8_per_channel", qd.QuantScheme("q8s", axis=0)),
    ("int4_block128", qd.QuantScheme("q4s", block=128, store="packed_u32")),
    ("int4_block32", qd.QuantScheme("q4s", block=32, store="packed_u32")),
]
_records = {}
_BACKEND = get_backend("cuda")

# Every timed product is checked once, on one set, outside the timed calls:
# qdispatch's qq bit for bit against the reference backend (the same bits on every
# backend), the rest per output against float64 with these tolerances.
CHECK_ROWS = 8  # rows of M the host reference computes (it costs K x N per row)
# torch scales the same exact int32 sums in another order: a few float32 roundings of the output
TORCH_QQ_RTOL = 1e-6
# float32 sums in any order: near float32's eps of sum |x| |w| per output, 1e-5 leaves room
FLOAT_RTOL = 1e-5
# a bfloat16 output keeps 8 significant bits: rounding to it is within 2**-9 of the output
BF16_OUT_RTOL = 2 ** -8


def assert_within(name, got, expect, tolerance):
    """Fail naming `name` and the error unless every |got - expect| <= tolerance
    (per output; NaN never is).  Returns the error relative to expect's norm, for the record."""
    got, expect = got.double(), expect.double()
    error = (got - expect).abs()
    tolerance = torch.broadcast_to(torch.as_tensor(tolerance, dtype=torch.float64, device=error.device), error.shape)
    bad = ~(error <= tolerance)
    if bool(bad.any()):
        worst = int(torch.where(bad, error.nan_to_num(nan=float("inf")), -1.0).argmax())
        row, col = divmod(worst, error.shape[-1])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} outputs past their tolerance; the worst at ({row}, {col}): "
            f"{float(got.flatten()[worst]):.9g} where {float(expect.flatten()[worst]):.9g} was expected "
            f"(error {float(error.flatten()[worst]):.3g}, tolerance {float(tolerance.flatten()[worst]):.3g})")
    return float((error.norm() / expect.norm()).item())


def check_rows(m):
    """At most CHECK_ROWS rows spread over M, the first and the last included."""
    n = min(m, CHECK_ROWS)
    return sorted({round(i * (m - 1) / max(n - 1, 1)) for i in range(n)})


def assert_qq_bits(name, xq, wq, out):
    """`out` = q_matmul(xq, wq.T) bit for bit, on sampled rows, against the reference
    backend (scales with one row per block: a row's scales are its own)."""
    rows = check_rows(xq.shape[0])
    x_rows = qd.qtensor_from_parts(np.asarray(xq.values)[rows], np.asarray(xq.scales)[rows], xq.scheme,
                                   device="reference")
    expect = torch.from_numpy(qd.q_matmul(x_rows, wq.to("reference").T).numpy())
    got = torch.from_dlpack(out)[rows].cpu() if not isinstance(out, torch.Tensor) else out[rows].cpu()
    assert_within(f"{name} (rows {rows})", got, expect, 0)


def assert_fq_close(name, x, w, out):
    """bf16 `out` = x @ dequantize(w).T: float64 on the GPU, within the bf16 output's
    rounding and float32's (per output).  Returns the norm-relative error, for the record."""
    x = torch.from_dlpack(x).double()
    wd = torch.from_dlpack(w.dequantize()).double()
    expect = x @ wd.t()
    tolerance = BF16_OUT_RTOL * expect.abs() + FLOAT_RTOL * (x.abs() @ wd.abs().t())
    return assert_within(name, torch.from_dlpack(out), expect, tolerance)


class Contender(NamedTuple):
    """One contender of gpu_ms_each: fn(*set) over `sets` in turn; `calls` per
    repetition where it is not the run's; `during`, a context manager factory,
    around its warm-up and each of its timed stretches (a setting of its own)."""
    fn: Callable
    sets: list
    calls: Optional[int] = None
    during: Callable = contextlib.nullcontext


def gpu_ms_each(contenders, reps=5, calls=20):
    """{name: median ms per call} of contenders {name: Contender or (fn, sets)},
    each calling fn(*set) through its `sets` in turn.  The turn goes on across
    repetitions, and across contenders that read the same sets, so every set is
    read and none is read again while it may still be in L2.  The contenders take
    turns repetition by repetition, the first of each round moving on, so that a
    drift of clocks or of host load during the run reaches them all alike."""
    contenders = {name: Contender(*c) for name, c in contenders.items()}
    names = list(contenders)
    for c in contenders.values():
        with c.during():
            for s in c.sets[:2]:
                c.fn(*s)
    torch.cuda.synchronize()
    times, turn = {name: [] for name in names}, {}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            c = contenders[name]
            n, first = c.calls or calls, turn.get(id(c.sets), 0)
            with c.during():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for i in range(first, first + n):
                    c.fn(*c.sets[i % len(c.sets)])
                end.record()
                end.synchronize()
            turn[id(c.sets)] = first + n
            times[name].append(start.elapsed_time(end) / n)
    return {name: float(np.median(t)) for name, t in times.items()}


def time_each_set(benchmark, fn, sets, rounds=3):
    """pytest-benchmark's timing, per call: each round calls fn(*set) once per set in
    turn (so its figures too come from memory rather than from the L2), waits for the
    GPU after the last, and counts as len(sets) calls (its figures were per pass)."""
    turn = itertools.count()

    def call():
        i = next(turn) % len(sets)
        fn(*sets[i])
        if i == len(sets) - 1:
            torch.cuda.synchronize()
    benchmark.pedantic(call, rounds=rounds, iterations=len(sets))


def n_sets(bytes_per_set):
    return max(3, -(-L2_DEFEAT_BYTES // bytes_per_set))


def gpu_info():
    fields = "name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,driver_version,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        return [dict(zip(fields.split(","), (v.strip() for v in line.split(",")))) for line in out]
    except (OSError, subprocess.SubprocessError):
        return [{"name": torch.cuda.get_device_name(0)}]


def record(benchmark, kind, shape, figures, extra=None, results=RESULTS):
    entry = {"kind": kind, "shape": list(shape), "ms": figures, **(extra or {})}
    ours = next(name for name in figures if name.startswith("qdispatch"))
    benchmark.extra_info["versus"] = ", ".join(
        [f"{figures[ours] * 1e3:.1f} us"] + [f"{ms / figures[ours]:.2f}x {name}" for name, ms in figures.items()
                                             if not name.startswith("qdispatch")])
    if not benchmark.disabled:  # --benchmark-disable: a check that the cases run, its figures kept nowhere
        _records.setdefault(results, {})[(kind, tuple(shape))] = entry
    benchmark.extra_info.update(entry)


def results_path(path, gpu_name):
    """The results file of this GPU: the committed cuda_h200*.json on an H200, a file
    named after any other GPU, so that a run elsewhere does not replace them."""
    if "H200" in gpu_name:
        return path
    slug = "".join(c if c.isalnum() else "_" for c in gpu_name.lower()).strip("_")
    return path.replace("cuda_h200", f"cuda_{slug}")


@pytest.fixture(scope="module", autouse=True)
def write_results():
    yield
    gpu = gpu_info()
    for path, records in _records.items():
        path = results_path(path, gpu[0].get("name", ""))
        kept = {}
        if os.path.exists(path):  # a run of some benchmarks updates theirs and keeps the rest
            with open(path) as f:
                kept = {(r["kind"], tuple(r["shape"])): r for r in json.load(f)["results"]}
        kept.update(records)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "qdispatch": qd.__version__,
                       "build": qd.info()["build"].get("cuda"), "results": list(kept.values())}, f, indent=1)


def _qq_sets(M, K, N, count):
    sets = []
    for _ in range(count):
        a = torch.randint(-127, 128, (M, K), dtype=torch.int8, device="cuda")
        w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda")
        sa = torch.rand(M, device="cuda") + 0.5
        sw = torch.rand(N, device="cuda") + 0.5
        aq = qd.qtensor_from_parts(a.cpu().numpy(), sa.cpu().numpy(), qd.QuantScheme("q8s", axis=0), device="cuda")
        wq = qd.qtensor_from_parts(w.cpu().numpy(), sw.cpu().numpy(), qd.QuantScheme("q8s", axis=0), device="cuda")
        sets.append((a, w, sa, sw, aq, wq))
    return sets


@pytest.mark.parametrize("M,K,N", QQ_SHAPES)
def test_qq_int8_per_row_per_col(benchmark, M, K, N):
    """Scaled int8 GEMM: out[M, N] float32 = (a @ w.T) * sa[:, None] * sw[None, :]."""
    sets = _qq_sets(M, K, N, n_sets(M * K + N * K))
    bf = [(a.to(torch.bfloat16), w.to(torch.bfloat16)) for a, w, *_ in sets]
    contenders = {
        "qdispatch": (lambda a, w, sa, sw, aq, wq: qd.q_matmul(aq, wq.T), sets),
        "qdispatch_kernel": (lambda a, w, sa, sw, aq, wq: _BACKEND.qq_matmul(aq, wq.T), sets),
        "torch_int_mm": (lambda a, w, sa, sw, aq, wq: torch._int_mm(a, w.t()), sets),
        "torch_int_mm_dequant": (lambda a, w, sa, sw, aq, wq:
                                 torch._int_mm(a, w.t()).float() * sa[:, None] * sw[None, :], sets),
        "torch_bf16_matmul": (lambda a, w: torch.matmul(a, w.t()), bf)}
    ms = gpu_ms_each(contenders)
    ours, raw, deq = ms["qdispatch"], ms["torch_int_mm"], ms["torch_int_mm_dequant"]
    # one set checked: qdispatch bit for bit, torch's dequant within a few roundings of qdispatch's
    a, w, sa, sw, aq, wq = sets[-1]
    ours_out = qd.q_matmul(aq, wq.T)
    assert_qq_bits(f"qq_int8_rowcol {M}x{K}x{N} qdispatch", aq, wq, ours_out)
    assert_within(f"qq_int8_rowcol {M}x{K}x{N} torch_int_mm", torch._int_mm(a, w.t()),
                  a.double() @ w.double().t(), 0)  # exact int32 sums
    ours_t = torch.from_dlpack(ours_out)
    expect = torch._int_mm(a, w.t()).float() * sa[:, None] * sw[None, :]
    assert_within(f"qq_int8_rowcol {M}x{K}x{N} torch_int_mm_dequant", expect, ours_t, TORCH_QQ_RTOL * ours_t.abs().double())
    err = float(((ours_t - expect).abs().max() / expect.abs().max()).item())
    bf_a, bf_w = bf[-1]
    assert_within(f"qq_int8_rowcol {M}x{K}x{N} torch_bf16_matmul", torch.matmul(bf_a, bf_w.t()),
                  a.double() @ w.double().t(), BF16_OUT_RTOL * (a.double().abs() @ w.double().abs().t()))
    record(benchmark, "qq_int8_rowcol_f32out", (M, K, N), ms, {
        "tops": {k: 2 * M * N * K / v / 1e9 for k, v in ms.items()},
        "speedup_vs_int_mm_dequant": deq / ours, "ratio_vs_raw_int_mm": raw / ours,
        "max_rel_diff_vs_torch": err})
    time_each_set(benchmark, *contenders["qdispatch"])


QQ_BLOCKINGS = [  # (name, scheme of x [M, K], scheme of w [N, K])
    ("x_1x128_w_128x128", qd.QuantScheme("q8s", block=128), qd.QuantScheme("q8s", block=(128, 128))),
    ("x_per_row_w_blocks_32", qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", block=32)),
]


@pytest.mark.parametrize("M,K,N", [QQ_SHAPES[0], QQ_SHAPES[2]])
@pytest.mark.parametrize("blocking,x_scheme,w_scheme", QQ_BLOCKINGS, ids=[b[0] for b in QQ_BLOCKINGS])
def test_qq_int8_blocks_along_k(benchmark, M, K, N, blocking, x_scheme, w_scheme):
    """Scaled int8 GEMM with scale blocks along K: each block's int32 sums scaled by
    its x and w scales and added.  torch has no such kernel: its contender for
    blocks of 128 is one `torch._int_mm` per block, scaled and added in torch."""
    count = n_sets(M * K + N * K)
    sets = [(qd.quantize(torch.randn(M, K, device="cuda"), x_scheme),
             qd.quantize(torch.randn(N, K, device="cuda"), w_scheme)) for _ in range(count)]
    on_gpu = lambda a: torch.as_tensor(np.asarray(a), device="cuda")
    raw_sets = [(on_gpu(xq.values), on_gpu(wq.values)) for xq, wq in sets]
    contenders = {"qdispatch": (lambda xq, wq: qd.q_matmul(xq, wq.T), sets),
                  "torch_int_mm": (lambda a, w: torch._int_mm(a, w.t()), raw_sets)}
    if blocking == "x_1x128_w_128x128":
        def blockwise(a, w, sa, sw):
            out = torch.zeros(M, N, device="cuda")
            for b in range(K // 128):
                ks = slice(128 * b, 128 * (b + 1))
                out += torch._int_mm(a[:, ks], w[:, ks].t()).float() * sa[:, b:b + 1] * sw[:, b][None, :]
            return out
        scaled = [(a, w, on_gpu(xq.scales).float(), on_gpu(wq.scales).float().repeat_interleave(128, dim=0)[:N])
                  for (a, w), (xq, wq) in zip(raw_sets, sets)]
        contenders["torch_int_mm_per_block_dequant"] = Contender(blockwise, scaled, calls=3)
    figures = gpu_ms_each(contenders)
    ours, raw = figures["qdispatch"], figures["torch_int_mm"]
    if blocking == "x_1x128_w_128x128":
        a, w, sa, sw = scaled[-1]
        expect = blockwise(a, w, sa, sw)
        got = torch.from_dlpack(qd.q_matmul(sets[-1][0], sets[-1][1].T))
        # the same int32 sums scaled and added in order of K: float32 roundings of each block's term
        terms = sum((torch._int_mm(a[:, 128 * b:128 * (b + 1)], w[:, 128 * b:128 * (b + 1)].t()).double().abs()
                     * sa[:, b:b + 1] * sw[:, b][None, :]) for b in range(K // 128))
        rel_diff = assert_within(f"qq_int8_{blocking} {M}x{K}x{N} torch_int_mm_per_block_dequant", expect, got,
                                 FLOAT_RTOL * terms)
    else:
        rel_diff = None  # torch has no contender for these blocks: qdispatch is checked below
    xq, wq = sets[-1]
    assert_qq_bits(f"qq_int8_{blocking} {M}x{K}x{N} qdispatch", xq, wq, qd.q_matmul(xq, wq.T))
    a, w = raw_sets[-1]
    assert_within(f"qq_int8_{blocking} {M}x{K}x{N} torch_int_mm", torch._int_mm(a, w.t()),
                  a.double() @ w.double().t(), 0)  # exact int32 sums
    tops = lambda ms: 2 * M * N * K / ms / 1e9
    record(benchmark, f"qq_int8_{blocking}_f32out", (M, K, N), figures, {
        "tops": {k: tops(v) for k, v in figures.items()},
        "ratio_vs_raw_int_mm": raw / ours, "rel_diff_vs_torch_per_block": rel_diff},
        results=QQ_BLOCK_RESULTS)
    time_each_set(benchmark, lambda xq, wq: qd.q_matmul(xq, wq.T), sets)


def _weights(N, K, scheme, count):
    return [qd.quantize(torch.randn(N, K, device="cuda") * 0.05, scheme) for _ in range(count)]


def host_us(fn, sets, calls=200):
    """Host time per call (no synchronization): above the GPU time, launches starve the GPU."""
    import time
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(*sets[i % len(sets)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def _fq(x, w):
    return qd.q_matmul(x, w.T, out_dtype="bfloat16")


def _decode_sets(M, K, N, scheme):
    """(x, w) pairs, bf16 x, over enough weights to defeat L2, each laid out."""
    probe = _weights(N, K, scheme, 1)[0]
    count = n_sets(probe.nbytes)
    ws = [probe] + _weights(N, K, scheme, count - 1)
    xs = [qd.from_dlpack(torch.randn(M, K, device="cuda").to(torch.bfloat16)) for _ in range(count)]
    sets = list(zip(xs, ws))
    for x, w in sets:  # lay out the weights once, before timing
        _fq(x, w)
    return sets


def _torch_bf16_sets(M, K, N, extra_bytes=0):
    """bf16 torch.matmul, the contender: its function and sets."""
    tb = [(torch.randn(M, K, device="cuda").to(torch.bfloat16),
           torch.randn(N, K, device="cuda").to(torch.bfloat16)) for _ in range(n_sets(N * K * 2 + extra_bytes))]
    return (lambda x, w: torch.matmul(x, w.t())), tb


@pytest.mark.parametrize("M,K,N", FQ_SHAPES)
@pytest.mark.parametrize("wname,scheme", FQ_WEIGHTS)
def test_fq_bf16_activations(benchmark, M, K, N, wname, scheme):
    """Decode-shaped products: bf16 x [M, K] @ dequantize(w [N, K]).T -> bf16, as torch's."""
    sets = _decode_sets(M, K, N, scheme)
    ours_fn = _fq
    kernel_fn = lambda x, w: _BACKEND.fq_matmul(x.payload, w.T, "bfloat16")
    torch_fn, tb = _torch_bf16_sets(M, K, N)
    ms = gpu_ms_each({"qdispatch": (ours_fn, sets), "qdispatch_kernel": (kernel_fn, sets),
                      "torch_bf16_matmul": (torch_fn, tb)}, calls=50)
    ours, kernel, bf16 = ms["qdispatch"], ms["qdispatch_kernel"], ms["torch_bf16_matmul"]
    x, w = sets[0]
    err = assert_fq_close(f"fq_bf16_x_{wname} {M}x{K}x{N} qdispatch", x, w, _fq(x, w))
    tx, tw = tb[0]
    assert_within(f"fq_bf16_x_{wname} {M}x{K}x{N} torch_bf16_matmul", torch_fn(tx, tw), tx.double() @ tw.double().t(),
                  BF16_OUT_RTOL * (tx.double().abs() @ tw.double().abs().t()))
    wbytes = w.nbytes
    figures = {"qdispatch": ours, "qdispatch_kernel": kernel, "torch_bf16_matmul": bf16}
    record(benchmark, f"fq_bf16_x_{wname}", (M, K, N), figures, {
        "weight_bytes": wbytes,
        "weight_GBps": {k: wbytes / v / 1e6 for k, v in figures.items() if k != "torch_bf16_matmul"},
        "torch_bf16_weight_GBps": N * K * 2 / bf16 / 1e6,
        "host_us_per_call": {"qdispatch": host_us(ours_fn, sets), "qdispatch_kernel": host_us(kernel_fn, sets),
                             "torch_bf16_matmul": host_us(torch_fn, tb)},
        "speedup_vs_bf16": bf16 / ours, "kernel_speedup_vs_bf16": bf16 / kernel, "rel_err": err})
    time_each_set(benchmark, ours_fn, sets)


FINE_WEIGHTS = [  # blockings along K that the decode tiles can't take
    ("int8_per_input_channel", qd.QuantScheme("q8s", axis=1)),  # x takes the scales: the decode kernel
    ("int4_blocks_of_8", qd.QuantScheme("q4s", block=8, store="packed_u32")),  # the float units
]


@pytest.mark.parametrize("M,K,N", FQ_SHAPES + [(64, 4096, 4096)])
@pytest.mark.parametrize("wname,scheme", FINE_WEIGHTS)
def test_fq_blocks_too_fine_for_the_tiles(benchmark, M, K, N, wname, scheme):
    """bf16 x @ dequantize(w).T -> bf16 for weights blocked along K in no multiple of
    16 values, against bf16 torch.matmul: a scale per input channel scales x (float32)
    for the decode kernel, other blockings run on the float units (qd_cuda_fq_values)."""
    sets = _decode_sets(M, K, N, scheme)
    torch_fn, tb = _torch_bf16_sets(M, K, N)
    ms = gpu_ms_each({"qdispatch": (_fq, sets), "torch_bf16_matmul": (torch_fn, tb)})
    x, w = sets[0]
    err = assert_fq_close(f"fq_fine_{wname} {M}x{K}x{N} qdispatch", x, w, _fq(x, w))
    figures = {"qdispatch": ms["qdispatch"], "torch_bf16_matmul": ms["torch_bf16_matmul"]}
    record(benchmark, f"fq_fine_{wname}", (M, K, N), figures, {
        "weight_bytes": w.nbytes, "weight_GBps": w.nbytes / ms["qdispatch"] / 1e6,
        "speedup_vs_bf16": ms["torch_bf16_matmul"] / ms["qdispatch"], "rel_err": err}, results=FINE_RESULTS)
    time_each_set(benchmark, _fq, sets)


def _torch_quantize(w, qrange, block):
    """torch's per-block absmax quantize of w [N, K] along K (the scale amax / (range / 2)
    in float32, round half to even): int8 values and float32 scales."""
    lo, hi = qrange
    blocks = w.float().view(w.shape[0], -1, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    scales = torch.where(amax == 0, torch.ones_like(amax), amax / ((hi - lo) / 2))
    return torch.round(blocks / scales).clamp_(lo, hi).to(torch.int8).view(w.shape), scales.view(w.shape[0], -1)


@pytest.mark.parametrize("N,K", [(4096, 4096), (11008, 4096)])
@pytest.mark.parametrize("wname,scheme", FQ_WEIGHTS[:2])
def test_quantize_bf16_weights(benchmark, N, K, wname, scheme):
    """Quantizing a bf16 weight [N, K] already on the GPU (a torch tensor, read in place):
    qdispatch (which waits for its checks of the values before returning) against the
    same quantization in torch ops, and against qdispatch on a float32 copy, the way
    16-bit data went before."""
    block = scheme.block_shape((N, K))[-1]
    tw = [torch.randn(N, K, device="cuda").to(torch.bfloat16) for _ in range(n_sets(N * K * 2))]
    sets = [(qd.from_dlpack(w),) for w in tw]
    ours_fn = lambda w: qd.quantize(w, scheme)
    copy_fn = lambda w: qd.quantize(w.astype("float32"), scheme)
    torch_fn = lambda w: _torch_quantize(w, scheme.qrange, block)
    ms = gpu_ms_each({"qdispatch": (ours_fn, sets), "qdispatch_float32_copy": (copy_fn, sets),
                      "torch": (torch_fn, [(w,) for w in tw])}, calls=10)
    q, (values, scales) = ours_fn(*sets[0]), torch_fn(tw[0])
    spec = qd.quantize(sets[0][0].to("reference"), scheme)
    assert np.array_equal(q.values, spec.values) and np.array_equal(q.scales, spec.scales), \
        f"{wname} {N}x{K}: not the reference's bits"
    same = bool(np.array_equal(values.cpu().numpy(), spec.values)
                and np.array_equal(scales.cpu().numpy().reshape(spec.scales.shape), spec.scales))
    record(benchmark, f"quantize_bf16_{wname}", (N, K), ms, {"weight_bytes_bf16": N * K * 2,
           "torch_gives_the_same_values": same}, results=QUANTIZE_RESULTS)
    time_each_set(benchmark, ours_fn, sets)


@contextlib.contextmanager
def _batch_invariant():
    """Launches of 16 rows, as the batch-invariant setting runs any batch."""
    qd.set_batch_invariant(True)
    try:
        yield
    finally:
        qd.set_batch_invariant(False)


@pytest.mark.parametrize("M,K,N", BATCHED_SHAPES)
@pytest.mark.parametrize("wname,scheme", FQ_WEIGHTS)
def test_fq_batched_decode_bf16_activations(benchmark, M, K, N, wname, scheme):
    """Batched decode (a few tens of rows): launches of 32 rows, against launches of
    16 rows (the batch-invariant setting's, how every batch ran before) and bf16
    torch.matmul, same run."""
    sets = _decode_sets(M, K, N, scheme)
    ms = gpu_ms_each({"qdispatch": (_fq, sets),
                      "qdispatch_launches_of_16_rows": Contender(_fq, sets, during=_batch_invariant),
                      "torch_bf16_matmul": _torch_bf16_sets(M, K, N)}, calls=50)
    ours, sixteen, bf16 = ms["qdispatch"], ms["qdispatch_launches_of_16_rows"], ms["torch_bf16_matmul"]
    x, w = sets[0]
    with _batch_invariant():
        assert_fq_close(f"fq_batched_bf16_x_{wname} {M}x{K}x{N} qdispatch_launches_of_16_rows", x, w, _fq(x, w))
    record(benchmark, f"fq_batched_bf16_x_{wname}", (M, K, N), ms, {
        "weight_bytes": w.nbytes, "speedup_vs_bf16": bf16 / ours, "speedup_vs_launches_of_16_rows": sixteen / ours,
        "rel_err": assert_fq_close(f"fq_batched_bf16_x_{wname} {M}x{K}x{N} qdispatch", x, w, _fq(x, w))},
        results=BATCHED_RESULTS)
    time_each_set(benchmark, _fq, sets)


@pytest.mark.parametrize("M,K,N", PREFILL_SHAPES)
@pytest.mark.parametrize("wname,scheme", FQ_WEIGHTS)
def test_fq_prefill_bf16_activations(benchmark, monkeypatch, M, K, N, wname, scheme):
    """Prefill-sized products, bf16 out: qdispatch as it runs them (a GEMM on the
    weight's values, or where that is slower the path for fewer rows: on an
    H100/H200 one launch that streams the weights once per 64 rows, elsewhere
    decode launches of 32 rows), that path alone, and bf16 torch.matmul."""
    from qdispatch import _cuda
    from qdispatch.backends import cuda as cuda_backend
    count = n_sets(M * K * 2 + N * K)
    ws = _weights(N, K, scheme, count)
    xs = [qd.from_dlpack(torch.randn(M, K, device="cuda").to(torch.bfloat16)) for _ in range(count)]
    sets = list(zip(xs, ws))
    ours_fn = _fq
    for x, w in sets:  # lay out the weights once, before timing
        ours_fn(x, w)
    gemm_rows = w.storage.cache[("fq_call", True)][1][0]  # for 16-bit x
    for table in ("FQ_GEMM_MIN_ROWS", "FQ_GEMM_MIN_ROWS_WIDE"):
        monkeypatch.setattr(cuda_backend, table, dict.fromkeys(getattr(cuda_backend, table), None))
    decode_ws = _weights(N, K, scheme, count)  # weights first used now: never the GEMM
    decode_sets = list(zip(xs, decode_ws))
    for x, w in decode_sets:
        ours_fn(x, w)
    # the weights laid out before keep their path: both take turns in one run
    ms = gpu_ms_each({"qdispatch": (ours_fn, sets), "qdispatch_without_gemm": Contender(ours_fn, decode_sets, calls=5),
                      "torch_bf16_matmul": _torch_bf16_sets(M, K, N, extra_bytes=M * K * 2)})
    ours, decode, bf16 = ms["qdispatch"], ms["qdispatch_without_gemm"], ms["torch_bf16_matmul"]
    assert_fq_close(f"fq_prefill_bf16_x_{wname} {M}x{K}x{N} qdispatch_without_gemm", *decode_sets[0],
                    ours_fn(*decode_sets[0]))
    x, w = sets[0]
    err = assert_fq_close(f"fq_prefill_bf16_x_{wname} {M}x{K}x{N} qdispatch", x, w, ours_fn(x, w))
    fewer_rows = "one launch" if _cuda.fq_wide_supported() else "decode launches"
    record(benchmark, f"fq_prefill_bf16_x_{wname}", (M, K, N), ms, {
        "path": "gemm" if M >= gemm_rows else fewer_rows, "path_without_gemm": fewer_rows,
        "tflops": {k: 2 * M * N * K / v / 1e9 for k, v in ms.items()},
        "ratio_vs_bf16": bf16 / ours, "speedup_vs_without_gemm": decode / ours, "rel_err": err},
        results=PREFILL_RESULTS)
    time_each_set(benchmark, ours_fn, sets)


def captured(layers, x):
    """`layers` (functions of x), each applied to x in turn, captured in one CUDA
    graph, and their outputs: replayed, it runs them with no host time between
    launches."""
    with torch.no_grad():
        for layer in layers:  # warm-up (lays out qdispatch weights)
            layer(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [layer(x) for layer in layers]
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


@pytest.mark.parametrize("M,K,N", FQ_SHAPES)
@pytest.mark.parametrize("wname,scheme", FQ_WEIGHTS)
def test_fq_decode_layers_in_a_cuda_graph(benchmark, M, K, N, wname, scheme):
    """Decode layers captured in a CUDA graph: qdispatch.torch.q_matmul (QLinear's
    product) on bf16 x over enough weights to defeat L2, against bf16 torch.matmul
    captured the same way, and eager bf16 torch.matmul, same run."""
    from qdispatch.torch import q_matmul
    probe = _weights(N, K, scheme, 1)[0]
    ws = [probe] + _weights(N, K, scheme, n_sets(probe.nbytes) - 1)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    ours_graph, outs = captured([lambda x, w=w: q_matmul(x, w.T) for w in ws], x)
    tw = [torch.randn(N, K, device="cuda").to(torch.bfloat16) for _ in range(n_sets(N * K * 2))]
    bf16_graph, _ = captured([lambda x, w=w: torch.matmul(x, w.t()) for w in tw], x)
    ms = gpu_ms_each({"qdispatch_in_graph": Contender(ours_graph.replay, [()], calls=2),
                      "torch_bf16_matmul_in_graph": Contender(bf16_graph.replay, [()], calls=2),
                      "torch_bf16_matmul": Contender(*_torch_bf16_sets(M, K, N), calls=50)})
    ours = ms["qdispatch_in_graph"] / len(ws)  # a replay runs every layer
    bf16_graph, bf16 = ms["torch_bf16_matmul_in_graph"] / len(tw), ms["torch_bf16_matmul"]
    err = assert_fq_close(f"fq_graph_bf16_x_{wname} {M}x{K}x{N} qdispatch_in_graph", x, ws[-1], outs[-1])
    figures = {"qdispatch_in_graph": ours, "torch_bf16_matmul_in_graph": bf16_graph, "torch_bf16_matmul": bf16}
    record(benchmark, f"fq_graph_bf16_x_{wname}", (M, K, N), figures, {
        "weight_bytes": probe.nbytes, "weight_GBps_in_graph": probe.nbytes / ours / 1e6,
        "speedup_vs_bf16_in_graph": bf16_graph / ours, "speedup_vs_bf16": bf16 / ours, "rel_err": err},
        results=GRAPH_RESULTS)
    time_each_set(benchmark, lambda w: q_matmul(x, w.T), [(w,) for w in ws])  # eager, each weight from memory
