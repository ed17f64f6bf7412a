"""The cpu backend beside numpy float32, FBGEMM and onnxruntime, one group per
shape, path and thread count (each contender doing that path's job), plus the machine's two
reference ceilings, all in the same run: a streaming read with numpy on the
case's threads, and the qq int8 kernel's best over cache-resident shapes.

Figures in extra_info use the best round (pytest-benchmark's `min`)."""
import pytest

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
