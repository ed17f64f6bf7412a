"""Shared fixtures: the backends to run on, a working C compiler."""
import os
import subprocess
import sys

import numpy as np
import pytest

import qdispatch as qd

# Tests import `helpers` from this folder (pytest runs them with importlib mode).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BACKENDS = qd.available_backends()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marks set here count there
def pytest_collection_modifyitems(config, items):
    for item in items:
        # the device fixture's cuda cases: marked at collection (its own mark, set as the
        # test starts, comes after `-m cuda` has left them out)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)
    if "cuda" in BACKENDS:
        return
    skip = pytest.mark.skip(reason="needs the cuda backend and a GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=BACKENDS)
def device(request):
    """Every backend that can run here, the reference included."""
    if request.param == "cuda":
        request.applymarker(pytest.mark.cuda)
    return request.param


@pytest.fixture(scope="session")
def c_compiler(tmp_path_factory):
    """Skips unless $CC (default cc) compiles and links a program."""
    cc = os.environ.get("CC") or "cc"
    d = tmp_path_factory.mktemp("cc")
    (d / "ok.c").write_text("int main(void) { return 0; }\n")
    try:
        ok = subprocess.run([cc, "ok.c", "-o", "ok"], cwd=d, capture_output=True).returncode == 0
    except OSError:
        ok = False
    if not ok:
        pytest.skip(f"no working C compiler (CC={cc})")
    return cc


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _runnable_isas():
    cpu = qd.info()["backends"]["cpu"]
    return [i for i in cpu.get("built", []) if i in cpu.get("supported", [])]


RUNNABLE_ISAS = _runnable_isas()


@pytest.fixture(params=RUNNABLE_ISAS)
def isa(request):
    """Each cpu ISA that is built and that this CPU runs, forced in turn."""
    qd.set_isa(request.param)
    yield request.param
    qd.set_isa("auto")
