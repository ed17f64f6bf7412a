"""pytest-benchmark setup for `benchmarks/`: collects bench_*.py and picks the
shapes and thread counts (the issue's list by default, small ones for smoke
runs and the committed baseline)."""
import pytest

from qdispatch import bench


def pytest_addoption(parser):
    group = parser.getgroup("qdispatch benchmarks")
    # checked by `qdispatch bench`'s own parsers, so both refuse the same values alike
    group.addoption("--bench-shapes", type=bench.comma_list(bench.Shape.parse), default=bench.DEFAULT_SHAPES,
                    help="MxKxN list")
    group.addoption("--bench-threads", type=bench.comma_list(bench.thread_count),
                    default=",".join(map(str, bench.default_threads())),
                    help="thread counts (default: 1 and the machine's core count)")
    group.addoption("--bench-bandwidth-mb", type=bench.count,
                    help="buffer of the streaming-read ceiling (default: 16x the last-level cache, at least 1024)")
    group.addoption("--bench-rotation-mb", type=bench.count,
                    help="memory for rotated weight copies (default: 4096, or half the available memory)")


def pytest_collect_file(file_path, parent):
    # The benchmarks are named bench_*.py so that the test run never picks them up.
    # A file named on the command line pytest collects itself (twice with this hook).
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_generate_tests(metafunc):
    config = metafunc.config
    shapes, threads = config.getoption("bench_shapes"), config.getoption("bench_threads")
    if "cpu_case" in metafunc.fixturenames:
        cases = list(bench.plan(shapes, bench.PATHS, ["cpu"], threads))
        metafunc.parametrize("cpu_case", cases, ids=[c.id for c in cases])
    if "bench_shape" in metafunc.fixturenames:
        metafunc.parametrize("bench_shape", shapes, ids=[str(s) for s in shapes])
    if "threads" in metafunc.fixturenames:
        metafunc.parametrize("threads", threads, ids=[f"t{n}" for n in threads])


def _megabytes(config, option):
    mb = config.getoption(option)
    return mb << 20 if mb else None  # None: bench's default


@pytest.fixture
def bandwidth_bytes(request):
    return _megabytes(request.config, "bench_bandwidth_mb") or bench.default_bandwidth_bytes()


@pytest.fixture
def rotation_budget_bytes(request):
    return _megabytes(request.config, "bench_rotation_mb")


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["qdispatch"] = bench.machine()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """After pytest-benchmark's tables, whose "(x.xx)" columns compare each case with
    its group's fastest: each case beside the contender it is measured against, from
    the "versus" its benchmark put in extra_info."""
    session = getattr(config, "_benchmarksession", None)  # pytest-benchmark's; absent when disabled
    rows = [(b.name, b.extra_info["versus"]) for b in getattr(session, "benchmarks", ())
            if "versus" in b.extra_info]
    if rows:
        terminalreporter.section("each case against its contender, timed in this run")
        width = max(len(name) for name, _ in rows)
        for name, versus in rows:
            terminalreporter.write_line(f"{name:<{width}}  {versus}")
