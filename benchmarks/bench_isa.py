"""The cpu backend's ISAs side by side on the integer paths (qq int8, qq with
int4 weights, W8A8, int_matmul): one group per shape, path and thread count, each ISA this CPU runs
forced in turn, in the same run.  extra_info holds GOP/s and the ratio to
`avx512vnni` (where it runs), the kernels the newer ISAs are measured against."""
import functools
import os

import pytest

import qdispatch as qd
from qdispatch import bench

INTEGER_PATHS = ("qq_int8", "qq_int4", "w8a8", "int_matmul")
BASE_ISA = "avx512vnni"
_BASE_GOPS = {}  # (group, threads) -> GOP/s of BASE_ISA, which runs first in its group


def _runnable_isas():
    cpu = qd.info()["backends"].get("cpu", {})
    runnable = [isa for isa in cpu.get("built", []) if isa in cpu.get("supported", []) and isa != "scalar"]
    return sorted(runnable, key=lambda isa: isa != BASE_ISA)


def pytest_generate_tests(metafunc):
    if "isa_case" in metafunc.fixturenames:
        config = metafunc.config
        cases = [c for c in bench.plan(config.getoption("bench_shapes"), INTEGER_PATHS, ["cpu"],
                                       config.getoption("bench_threads")) if not c.is_contender]
        pairs = [(c, isa) for c in cases for isa in _runnable_isas()]
        metafunc.parametrize("isa_case", pairs, ids=[f"{c.id}-{isa}" for c, isa in pairs])


@functools.lru_cache(maxsize=1)  # the ISAs of a case run one after another
def _built(case, budget_bytes):
    """The case's weight copies, built once for all ISAs (quantizing hundreds of copies
    takes longer than timing them); one case's copies are kept at a time."""
    return bench.build(case, budget_bytes=budget_bytes)


def _isa_in_force():
    """The ISA to go back to after a case: the one QDISPATCH_ISA forced (auto dropped it,
    so the suites after this one, and the run's machine_info, ran at another), else auto."""
    forced = os.environ.get("QDISPATCH_ISA") and qd.info()["backends"]["cpu"].get("isa")
    return forced or "auto"


def test_isa(benchmark, isa_case, rotation_budget_bytes):
    case, isa = isa_case
    reason = case.skip_reason()
    if reason:
        pytest.skip(reason)
    benchmark.group = f"{case.group} t{case.threads} isa"
    with bench.thread_limit(case.threads):
        b = _built(case, rotation_budget_bytes)
        before = _isa_in_force()
        qd.set_isa(isa)
        try:
            expected = bench.expected_results(case)
            for i, call in enumerate(b.calls):  # each copy checked on this ISA, and warmed up
                bench.check_result(case, call(), copy=i, expected=expected)
            benchmark(b.fn)
        finally:
            qd.set_isa(before)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    gops = bench.metrics(case, b, benchmark.stats.stats.min)["gops"]
    if isa == BASE_ISA:
        _BASE_GOPS[case.group, case.threads] = gops
    base = _BASE_GOPS.get((case.group, case.threads))
    versus = "the base" if isa == BASE_ISA else f"{gops / base:.2f}x {BASE_ISA}" if base else f"{BASE_ISA} not run"
    benchmark.extra_info.update(versus=f"{gops:.1f} GOP/s, {versus}", gops=gops, isa=isa, threads=case.threads, path=case.path,
                                rotated_bytes=b.rotated_bytes, rotation_defeats_cache=b.defeats_cache,
                                cache_multiple=bench.CACHE_MULTIPLE,
                                **{f"ratio_{BASE_ISA}": gops / base if base else None})
