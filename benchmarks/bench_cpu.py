"""The cpu backend beside numpy float32, FBGEMM and onnxruntime, one group per
shape and path, plus the machine's two ceilings, all in the same run.

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
    benchmark.extra_info.update(
        gops=row["gops"], weight_gbs=row["weight_gbs"], weight_bytes=b.weight_bytes,
        weight_copies=b.copies, ratio_numpy_f32=row["gops"] / ref if ref else None,
        impl=case.impl, backend=row["backend"], isa=bench.machine()["isa"], threads=case.threads)


def test_matmul(benchmark, cpu_case):
    reason = cpu_case.skip_reason()
    if reason:
        pytest.skip(reason)
    benchmark.group = cpu_case.group
    with bench.thread_limit(cpu_case.threads):
        b = bench.build(cpu_case)
        for _ in range(b.copies):  # warm-up: first-use costs stay out of the rounds
            b.fn()
        benchmark(b.fn)
    _record(benchmark, cpu_case, b)


def test_read_bandwidth(benchmark, threads, bandwidth_bytes):
    benchmark.group = "ceilings"
    with bench.thread_limit(threads):
        fn, nbytes = bench.read_bandwidth_fn(bandwidth_bytes)
        benchmark(fn)
    if benchmark.stats is not None:
        benchmark.extra_info.update(read_gbs=nbytes / benchmark.stats.stats.min / 1e9,
                                    buffer_bytes=nbytes, threads=threads)


@pytest.mark.parametrize("shape", bench.PEAK_SHAPES, ids=str)
def test_int8_peak(benchmark, threads, shape):
    benchmark.group = "ceilings"
    with bench.thread_limit(threads):
        fn = bench.int8_peak_fn(shape)
        fn()
        benchmark(fn)
    if benchmark.stats is not None:
        ops = 2 * shape.m * shape.k * shape.n
        benchmark.extra_info.update(int8_peak_gops=ops / benchmark.stats.stats.min / 1e9,
                                    isa=bench.machine()["isa"], threads=threads)
