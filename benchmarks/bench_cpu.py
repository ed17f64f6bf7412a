"""The cpu backend beside numpy float32, FBGEMM and onnxruntime, one group per
shape, path and thread count (each contender doing that path's job), plus the machine's two
reference ceilings, all in the same run: a streaming read with numpy on the
case's threads, and the qq int8 kernel's best over cache-resident shapes.  Also a
16-bit weight quantized in place against the float32 copy it went through before, and a
quantized weight dequantized against numpy's formula on its values.

Figures in extra_info use the best round (pytest-benchmark's `min`)."""
import itertools

import numpy as np
import pytest

import qdispatch as qd
from qdispatch import bench

# numpy float32's GOP/s per (group, threads): it runs first in every group, and
# the other cases of the group report their ratio to it.
_NUMPY_GOPS = {}


def _record(benchmark, case, b):
    stats = benchmark.stats
    if stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    row = bench.metrics(case, b, stats.stats.min)
    if case.impl == "numpy_f32":
        _NUMPY_GOPS[case.group, case.threads] = row["gops"]
    ref = _NUMPY_GOPS.get((case.group, case.threads))
    versus = ("the contender" if case.impl == "numpy_f32" else
              f"{row['gops'] / ref:.2f}x numpy_f32" if ref else "numpy_f32 not timed")
    unit = "G values/s" if case.path == "quantize" else "GOP/s"
    benchmark.extra_info.update(versus=f"{row['gops']:.1f} {unit}, {versus}",
        gops=row["gops"], weight_gbs=row["weight_gbs"], weight_bytes=b.weight_bytes,
        weight_copies=b.copies, rotated_bytes=b.rotated_bytes,
        rotation_defeats_cache=b.defeats_cache, cache_multiple=bench.CACHE_MULTIPLE,
        ratio_numpy_f32=row["gops"] / ref if ref else None,
        impl=case.impl, backend=row["backend"], isa=bench.machine()["isa"], threads=case.threads)


def test_matmul(benchmark, cpu_case, rotation_budget_bytes):
    reason = cpu_case.skip_reason()
    if reason:
        pytest.skip(reason)
    benchmark.group = f"{cpu_case.group} t{cpu_case.threads}"
    with bench.thread_limit(cpu_case.threads):
        b = bench.build(cpu_case, budget_bytes=rotation_budget_bytes)
        for _ in range(b.copies):  # warm-up: first-use costs stay out of the rounds
            b.fn()
        benchmark(b.fn)
    _record(benchmark, cpu_case, b)


def test_read_bandwidth(benchmark, threads, bandwidth_bytes):
    benchmark.group = f"ceiling: streaming read t{threads}"
    with bench.streaming_read(bandwidth_bytes, threads) as (fn, nbytes):
        benchmark(fn)
    if benchmark.stats is not None:
        benchmark.extra_info.update(
            read_gbs=nbytes / benchmark.stats.stats.min / 1e9, buffer_bytes=nbytes, threads=threads,
            buffer_defeats_cache=bench.exceeds_cache(nbytes))


@pytest.mark.parametrize("shape", bench.PEAK_SHAPES, ids=str)
def test_int8_peak(benchmark, threads, shape):
    benchmark.group = f"ceiling: qq int8 peak t{threads}"
    with bench.thread_limit(threads):
        fn = bench.int8_peak_fn(shape)
        fn()
        benchmark(fn)
    if benchmark.stats is not None:
        ops = 2 * shape.m * shape.k * shape.n
        benchmark.extra_info.update(int8_peak_gops=ops / benchmark.stats.stats.min / 1e9,
                                    isa=bench.machine()["isa"], threads=threads)


# ---- a 16-bit weight quantized: read in place, against a float32 copy ----------

# the float32 copy runs first in its group, and the in-place case reports its ratio to it
HALF_QUANTIZE = {"float32_copy": lambda w: qd.quantize(w.astype("float32"), bench.W8),
                 "in_place": lambda w: qd.quantize(w, bench.W8)}
_COPY_SECONDS = {}


def _half_weights(shape, copies, dtype):
    """`copies` weights [N, K] of a 16-bit dtype on cpu, copy i rolled by i rows, and
    the reference's quantization of the first."""
    w = np.random.default_rng(0).standard_normal((shape.n, shape.k), dtype=np.float32)
    weights = [qd.tensor(np.roll(w, i, axis=0), device="cpu", dtype=dtype) for i in range(copies)]
    return weights, qd.quantize(weights[0].to("reference"), bench.W8)


@pytest.mark.parametrize("impl", HALF_QUANTIZE)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quantize_16bit_weight(benchmark, bench_shape, threads, dtype, impl, rotation_budget_bytes):
    """The [N, K] weight of each shape, in bfloat16 or float16, quantized per output
    channel on cpu (panels included): read in place, widened in C a piece at a time,
    against quantizing its float32 copy (the cpu backend's C cast), how 16-bit data went
    before.  extra_info's `ratio_float32_copy`: the copy's time over this case's."""
    shape = bench_shape
    benchmark.group = f"quantize {dtype} [{shape.n}, {shape.k}] t{threads}"
    nbytes = shape.n * shape.k * 2
    copies = bench.weight_copies(nbytes, rotation_budget_bytes)
    bench.warn_if_cached(benchmark.group, nbytes, copies)
    weights, want = _half_weights(shape, copies, dtype)
    quantize, turn = HALF_QUANTIZE[impl], itertools.count()
    with bench.thread_limit(threads):
        got = quantize(weights[0])  # and the warm-up
        if not (np.array_equal(got.values, want.values) and np.array_equal(got.scales, want.scales)):
            raise AssertionError(f"{benchmark.group}, {impl}: not the reference's values and scales")
        benchmark(lambda: quantize(weights[next(turn) % copies]))
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    seconds = benchmark.stats.stats.min
    ratio, versus = bench.versus_contender(benchmark, seconds, impl, "float32_copy", _COPY_SECONDS)
    benchmark.extra_info.update(versus=f"{shape.n * shape.k / seconds / 1e9:.2f} G values/s, {versus}",
                                ms=seconds * 1e3, ratio_float32_copy=ratio,
                                weight_bytes=nbytes, dtype=dtype, weight_copies=copies, rotated_bytes=nbytes * copies,
                                rotation_defeats_cache=bench.exceeds_cache(nbytes * copies),
                                impl=impl, isa=bench.machine()["isa"], threads=threads)


# ---- a quantized weight read back as floats, against numpy's formula -------------

DEQUANTIZE_SCHEMES = {"int8": bench.W8, "int4": bench.W4}
_FORMULA_SECONDS = {}


def _numpy_dequantize(values, scales, dtype):
    """dequantize's formula in numpy: each int8 value times its block's float32 scale,
    in float32, then rounded to `dtype` (blocks are runs of a row along K: scales
    [N] or [N, K / block]).  The scales broadcast over their blocks, not repeated to
    the full shape as quantmath.dequantize_array does it: the faster numpy, so the
    stronger contender."""
    n, k = values.shape
    scales = scales.reshape(n, -1)
    blocked = values.reshape(n, scales.shape[1], -1).astype(np.float32) * scales[:, :, None]
    return blocked.reshape(n, k).astype(dtype, copy=False)


@pytest.mark.parametrize("impl", ["numpy_formula", "qdispatch"])
@pytest.mark.parametrize("scheme", list(DEQUANTIZE_SCHEMES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dequantize_weight(benchmark, bench_shape, threads, dtype, scheme, impl, rotation_budget_bytes):
    """The [N, K] weight of each shape quantized on cpu (int8 per output channel, int4
    in blocks of 32), dequantized into `dtype`: qdispatch reads its values back from the
    panels the weight keeps and scales them in C; the contender is numpy's formula on the
    int8 values and scales, unpacked before the rounds.  extra_info's `ratio_numpy_formula`:
    the formula's time over this case's."""
    shape = bench_shape
    block = DEQUANTIZE_SCHEMES[scheme].block
    if block and shape.k % block[-1]:
        pytest.skip(f"K = {shape.k} is no multiple of {scheme}'s block of {block[-1]}")
    benchmark.group = f"dequantize {scheme} to {dtype} [{shape.n}, {shape.k}] t{threads}"
    nbytes = shape.n * shape.k * np.dtype(dtype).itemsize  # what each call writes
    copies = bench.weight_copies(nbytes, rotation_budget_bytes)
    bench.warn_if_cached(benchmark.group, nbytes, copies)
    w = np.random.default_rng(0).standard_normal((shape.n, shape.k), dtype=np.float32)
    weights = [qd.quantize(qd.tensor(np.roll(w, i, axis=0), device="cpu"), DEQUANTIZE_SCHEMES[scheme])
               for i in range(copies)]
    want = _numpy_dequantize(weights[0].values, weights[0].scales, dtype)
    if impl == "numpy_formula":
        stores = [(q.values, q.scales) for q in weights]
        call = lambda i: _numpy_dequantize(*stores[i], dtype)  # noqa: E731
    else:
        call = lambda i: qd.dequantize(weights[i], dtype).numpy()  # noqa: E731
    turn = itertools.count()
    with bench.thread_limit(threads):
        if not np.array_equal(call(0).view(np.uint8), want.view(np.uint8)):  # and the warm-up
            raise AssertionError(f"{benchmark.group}, {impl}: not numpy's bits")
        benchmark(lambda: call(next(turn) % copies))
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    seconds = benchmark.stats.stats.min
    ratio, versus = bench.versus_contender(benchmark, seconds, impl, "numpy_formula", _FORMULA_SECONDS)
    benchmark.extra_info.update(versus=f"{shape.n * shape.k / seconds / 1e9:.2f} G values/s, {versus}",
                                ms=seconds * 1e3, ratio_numpy_formula=ratio, output_bytes=nbytes, dtype=dtype,
                                scheme=scheme, weight_copies=copies, impl=impl, isa=bench.machine()["isa"],
                                threads=threads)
