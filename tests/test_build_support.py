"""The build helpers beside the tests (build_support/, used by setup.py): the CUDA
target flags, when objects are rebuilt, and when the extension is relinked.
They are loaded from their files; without a source tree beside the tests
(an installed copy of the tests) these skip."""
import importlib.util
import os

import pytest

pytest.importorskip("setuptools")
from setuptools import Extension  # noqa: E402

CUDA_BUILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build_support", "cuda.py")


@pytest.fixture
def cuda_build(monkeypatch):
    if not os.path.exists(CUDA_BUILD):
        pytest.skip("no build_support/ beside the tests")
    monkeypatch.delenv("QDISPATCH_CUDA_ARCHS", raising=False)
    spec = importlib.util.spec_from_file_location("qdispatch_build_cuda", CUDA_BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_targets_and_ptx_for_newer_gpus(cuda_build):
    flags = cuda_build.gencode_flags()
    for arch in ("80", "86", "89", "90a"):
        assert f"-gencode=arch=compute_{arch},code=sm_{arch}" in flags
    assert flags[-1] == "-gencode=arch=compute_90,code=compute_90"


@pytest.mark.parametrize("env,expect", [
    ("90a", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("sm_80, 90a", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]),
    ("compute_80", ["-gencode=arch=compute_80,code=compute_80"]),
    ("86,compute_90", ["-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_90,code=compute_90"]),
])
def test_targets_from_the_environment(cuda_build, monkeypatch, env, expect):
    monkeypatch.setenv("QDISPATCH_CUDA_ARCHS", env)
    assert cuda_build.gencode_flags() == expect


def test_objects_rebuild_when_a_source_or_the_flags_change(cuda_build, tmp_path):
    source = tmp_path / "kernel.cu"
    source.write_text("// one")
    first = cuda_build._stamp([str(source)], ["-O3"])
    assert cuda_build._stamp([str(source)], ["-O3"]) == first
    assert cuda_build._stamp([str(source)], ["-O2"]) != first
    source.write_text("// two")
    assert cuda_build._stamp([str(source)], ["-O3"]) != first


def test_a_rebuilt_object_relinks_the_extension(cuda_build):
    ext = Extension("qdispatch._cuda", ["qdispatch/_cuda.pyx"], depends=["src_c/include/qdispatch.h"])
    objects = ["build/cuda/fq_matmul.cu.o", "build/cuda/gemm_s8.cu.o"]
    cuda_build.CudaBuild.link_into(ext, objects)
    assert ext.extra_objects == objects
    assert set(objects) <= set(ext.depends) and "src_c/include/qdispatch.h" in ext.depends
