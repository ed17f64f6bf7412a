"""pytest-benchmark setup for `benchmarks/`: collects bench_*.py and picks the
shapes and thread counts (the issue's list by default, small ones for smoke
runs and the committed baseline)."""
import pytest

from qdispatch import bench


def pytest_addoption(parser):
    group = parser.getgroup("qdispatch benchmarks")
    group.addoption("--bench-shapes", default=bench.DEFAULT_SHAPES, help="MxKxN list")
    group.addoption("--bench-threads", default=",".join(map(str, bench.default_threads())),
                    help="thread counts (default: 1 and the machine's core count)")
    group.addoption("--bench-bandwidth-mb", type=int, default=1024,
                    help="buffer size of the read-bandwidth ceiling")


def pytest_collect_file(file_path, parent):
    # The benchmarks are named bench_*.py so that the test run never picks them up.
    # A file named on the command line pytest collects itself (twice with this hook).
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_generate_tests(metafunc):
    config = metafunc.config
    shapes = [bench.Shape.parse(s) for s in config.getoption("bench_shapes").split(",")]
    threads = [int(n) for n in config.getoption("bench_threads").split(",")]
    if "cpu_case" in metafunc.fixturenames:
        cases = list(bench.plan(shapes, bench.PATHS, ["cpu"], threads))
        metafunc.parametrize("cpu_case", cases, ids=[c.id for c in cases])
    if "threads" in metafunc.fixturenames:
        metafunc.parametrize("threads", threads, ids=[f"t{n}" for n in threads])


@pytest.fixture
def bandwidth_bytes(request):
    return request.config.getoption("bench_bandwidth_mb") << 20


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["qdispatch"] = bench.machine()
