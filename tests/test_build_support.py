"""The build helpers beside the tests (build_support/, used by setup.py): the CUDA
target flags, when objects are rebuilt, when the extension is relinked, and the
CPU kernels or OpenMP that a compiler leaves out.
They are loaded from their files; without a source tree beside the tests
(an installed copy of the tests) these skip."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("setuptools")
from setuptools import Extension  # noqa: E402

BUILD_SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build_support")
CUDA_BUILD = os.path.join(BUILD_SUPPORT, "cuda.py")


@pytest.fixture
def cuda_build(monkeypatch):
    if not os.path.exists(CUDA_BUILD):
        pytest.skip("no build_support/ beside the tests")
    monkeypatch.delenv("QDISPATCH_CUDA_ARCHS", raising=False)
    spec = importlib.util.spec_from_file_location("qdispatch_build_cuda", CUDA_BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_interpreters_run_paths_are_left_out_of_the_link():
    """pyenv's LDSHARED carries -Wl,-rpath,<its lib>: the shipped library named that
    folder to every program that loaded it.  Every spelling goes, the rest stays in order."""
    path = os.path.join(BUILD_SUPPORT, "link.py")
    if not os.path.exists(path):
        pytest.skip("no build_support/ beside the tests")
    spec = importlib.util.spec_from_file_location("qdispatch_build_link", path)
    link = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(link)
    command = ["gcc", "-shared", "-L/py/lib", "-Wl,-rpath,/py/lib", "-Wl,-rpath=/a", "-Wl,-rpath", "-Wl,/b",
               "-Wl,--rpath=/c", "-Wl,-R/d", "-Wl,-R", "-Wl,/e", "-Wl,-Bsymbolic", "-Wl,--as-needed"]
    assert link.without_run_paths(command) == ["gcc", "-shared", "-L/py/lib", "-Wl,-Bsymbolic", "-Wl,--as-needed"]


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


def test_blank_targets_are_the_defaults(cuda_build, monkeypatch):
    monkeypatch.setenv("QDISPATCH_CUDA_ARCHS", "  ")
    assert cuda_build.gencode_flags()[-1] == "-gencode=arch=compute_90,code=compute_90"
    assert cuda_build.archs() == cuda_build.DEFAULT_ARCHS


@pytest.mark.parametrize("env,says", [
    ("80;90a", "'80;90a' is not an architecture"),
    ("9.0", "'9.0' is not an architecture"),
    ("garbage", "'garbage' is not an architecture"),
    ("75", "'75' is older than the kernels run on: they need sm_80"),
    ("sm_70,90a", "'sm_70' is older"),
    (",", "names no architecture"),
])
def test_targets_nvcc_cant_build_are_refused_before_compiling(cuda_build, monkeypatch, env, says):
    """nvcc's own error came after minutes of compiling, and under QDISPATCH_CUDA=auto the
    build went on without the backend, its message naming neither the setting nor the fix."""
    monkeypatch.setenv("QDISPATCH_CUDA_ARCHS", env)
    monkeypatch.setenv("QDISPATCH_CUDA", "auto")
    with pytest.raises(cuda_build.BuildSettingError, match="QDISPATCH_CUDA_ARCHS=.*" + re.escape(says)):
        cuda_build.configure()


@pytest.mark.parametrize("setting,value", [("QDISPATCH_CUDA", "yes"), ("QDISPATCH_CUDA", ""),
                                           ("QDISPATCH_BUILD_JOBS", "abc")])
def test_a_bad_setting_stops_the_build_whether_or_not_cuda_is_built(cuda_build, monkeypatch, setting, value):
    monkeypatch.setenv("QDISPATCH_CUDA", "0")
    monkeypatch.setenv(setting, value)
    with pytest.raises(cuda_build.BuildSettingError, match=setting + "=" + re.escape(repr(value))):
        cuda_build.configure()


def test_a_bad_setting_ends_the_build_with_its_message_alone(monkeypatch):
    setup_py = os.path.join(os.path.dirname(BUILD_SUPPORT), "setup.py")
    if not os.path.exists(setup_py):
        pytest.skip("no setup.py beside the tests")
    env = {**os.environ, "QDISPATCH_CUDA": "yes"}
    done = subprocess.run([sys.executable, setup_py, "--name"], cwd=os.path.dirname(setup_py), env=env,
                          capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error: QDISPATCH_CUDA='yes': expected auto") and "Traceback" not in done.stderr


def _toolkit(root):
    """A CUDA toolkit's files as the build looks for them, nvcc answering --dryrun as nvcc does."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "lib64").mkdir()
    (root / "include" / "cuda_runtime_api.h").write_text("")
    (root / "lib64" / "libcudart_static.a").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '#$ _HERE_={root / 'bin'}'\n")
    nvcc.chmod(0o755)
    return root


@pytest.mark.parametrize("mode", ["auto", "1"])
@pytest.mark.parametrize("variable", ["CUDA_HOME", "CUDA_PATH"])
def test_a_cuda_home_that_is_no_toolkit_is_not_stepped_over(cuda_build, monkeypatch, tmp_path, capsys, mode, variable):
    """It named the toolkit to use, so another one found on PATH or in /usr/local/cuda
    must not be built with in its place."""
    if os.name != "posix":
        pytest.skip("the fake nvcc is a shell script")
    monkeypatch.setenv("PATH", str(_toolkit(tmp_path / "elsewhere") / "bin") + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("QDISPATCH_CUDA", mode)
    for root, lacks in ((tmp_path / "missing", "no such folder"),
                        (tmp_path, "no bin/nvcc, cuda_runtime_api.h, libcudart_static.a")):
        monkeypatch.setenv(variable, str(root))
        says = f"{variable}={root} is not a CUDA toolkit ({lacks}): set it to the toolkit's root"
        if mode == "1":
            with pytest.raises(cuda_build.BuildSettingError, match=re.escape("QDISPATCH_CUDA=1 but " + says)):
                cuda_build.configure()
        else:
            assert cuda_build.configure() is None
            assert cuda_build.skipped_reason().startswith(says)
            assert "without the cuda backend: " + says in capsys.readouterr().err
    monkeypatch.setenv(variable, str(tmp_path / "elsewhere"))
    assert cuda_build.configure().root == str(tmp_path / "elsewhere")


def test_no_toolkit_anywhere_builds_without_the_backend_quietly(cuda_build, monkeypatch, tmp_path, capsys):
    """The usual case on a machine without CUDA: info says why, the build log stays clean."""
    monkeypatch.delenv("CUDA_HOME", raising=False)  # a machine with CUDA may name its toolkit so
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cuda_build, "_candidates", lambda: iter([("/usr/local/cuda", str(tmp_path / "cuda"))]))
    monkeypatch.setenv("QDISPATCH_CUDA", "auto")
    assert cuda_build.configure() is None
    assert cuda_build.skipped_reason() == f"no CUDA toolkit found (looked in /usr/local/cuda ({tmp_path / 'cuda'}: " \
                                          f"no such folder))"
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("QDISPATCH_CUDA", "1")
    with pytest.raises(cuda_build.BuildSettingError, match="install the CUDA toolkit or set CUDA_HOME to it"):
        cuda_build.configure()


def test_nvcc_on_path_through_a_wrapper_finds_its_toolkit(cuda_build, monkeypatch, tmp_path):
    """A script on PATH that runs the toolkit's nvcc (as /usr/local/bin/nvcc often is)
    lies in no toolkit: nvcc itself says where it is."""
    if os.name != "posix":
        pytest.skip("the fake nvcc is a shell script")
    root = _toolkit(tmp_path / "cuda-13.0")
    wrapper = tmp_path / "wrappers" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {root / "bin" / "nvcc"} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(wrapper.parent) + os.pathsep + os.environ["PATH"])
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    found, _ = cuda_build.find_toolkit()
    assert found[0] == str(root) and found[1] == str(root / "bin" / "nvcc")


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_a_cross_build_leaves_the_cuda_backend_out(cuda_build, monkeypatch, capsys, mode):
    """nvcc and the CUDA runtime here build for this machine, not the cross build's."""
    monkeypatch.setenv("QDISPATCH_CUDA", mode)
    if mode == "1":
        with pytest.raises(cuda_build.BuildSettingError, match="a cross build for aarch64.*QDISPATCH_CUDA=0"):
            cuda_build.configure(cross_target="aarch64")
    else:
        assert cuda_build.configure(cross_target="aarch64") is None
        assert "a cross build for aarch64" in cuda_build.skipped_reason()
        assert "without the cuda backend" in capsys.readouterr().err


def test_objects_rebuild_when_a_source_or_the_flags_change(cuda_build, tmp_path):
    source = tmp_path / "kernel.cu"
    source.write_text("// one")
    first = cuda_build._stamp([str(source)], ["-O3"])
    assert cuda_build._stamp([str(source)], ["-O3"]) == first
    assert cuda_build._stamp([str(source)], ["-O2"]) != first
    source.write_text("// two")
    assert cuda_build._stamp([str(source)], ["-O3"]) != first


FAKE_NVCC = """#!{python}
# Stands in for nvcc: notes its source and --threads, meets the other compilers
# started with it, and writes the object (or fails for a source named bad*).
import glob, os, sys, time
args = sys.argv[1:]
src, obj = args[args.index("-c") + 1], args[args.index("-o") + 1]
name = os.path.basename(src)
log = os.environ["FAKE_NVCC_DIR"]
open(os.path.join(log, "started-" + name), "w").close()
waited = 0.0
while len(glob.glob(os.path.join(log, "started-*"))) < int(os.environ["FAKE_NVCC_MEET"]) and waited < 20:
    time.sleep(0.01)
    waited += 0.01
met = len(glob.glob(os.path.join(log, "started-*")))
with open(os.path.join(log, "ran-" + name), "w") as f:
    f.write("%d %s" % (met, args[args.index("--threads") + 1]))
if name.startswith("bad"):
    print("note: compiling " + name)
    print(name + "(7): error: identifier 'x' is undefined")
    sys.exit(3)
with open(obj, "w") as f:
    f.write("object")
"""


@pytest.fixture
def fake_tree(cuda_build, tmp_path, monkeypatch):
    """A source tree of three .cu files and a fake nvcc, as the current directory."""
    if os.name != "posix":
        pytest.skip("the fake nvcc is a script run through its #! line")
    (tmp_path / "src_c" / "cuda").mkdir(parents=True)
    (tmp_path / "src_c" / "include").mkdir()
    (tmp_path / "src_c" / "include" / "qdispatch.h").write_text("// header")
    for name in ("a.cu", "b.cu", "c.cu"):
        (tmp_path / "src_c" / "cuda" / name).write_text("// " + name)
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(0o755)
    logs = tmp_path / "logs"
    logs.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAKE_NVCC_DIR", str(logs))
    monkeypatch.setenv("FAKE_NVCC_MEET", "1")
    return cuda_build.CudaBuild(str(tmp_path), str(nvcc), str(tmp_path), str(tmp_path)), logs


def ran(logs):
    return {p.name[4:]: p.read_text().split() for p in logs.glob("ran-*")}


def test_sources_compile_at_once_and_only_when_stale(fake_tree, monkeypatch):
    build, logs = fake_tree
    monkeypatch.setenv("QDISPATCH_BUILD_JOBS", "3")
    monkeypatch.setenv("FAKE_NVCC_MEET", "3")  # each waits until all three have started
    objects = build.compile_objects("build")
    assert [os.path.basename(o) for o in objects] == ["a.cu.o", "b.cu.o", "c.cu.o"]
    assert all(Path(o).read_text() == "object" for o in objects)
    assert ran(logs) == {name: ["3", "2"] for name in ("a.cu", "b.cu", "c.cu")}  # three at once
    for p in logs.iterdir():
        p.unlink()
    monkeypatch.setenv("FAKE_NVCC_MEET", "1")
    assert build.compile_objects("build") == objects and ran(logs) == {}  # nothing stale
    with open("src_c/cuda/b.cu", "a") as f:
        f.write("// changed")
    build.compile_objects("build")
    assert list(ran(logs)) == ["b.cu"]


@pytest.mark.parametrize("jobs,archs,threads", [
    ("8", None, "5"),     # a thread for each of the five default targets (four architectures, PTX)
    ("7", None, "4"),     # three files: up to two compilers a core
    ("3", None, "2"),
    ("7", "90a", "1"),    # one target
    ("2", "80,90a", "2"),  # two of the three files at a time
])
def test_nvcc_threads_per_file(fake_tree, monkeypatch, jobs, archs, threads):
    build, logs = fake_tree
    monkeypatch.setenv("QDISPATCH_BUILD_JOBS", jobs)
    if archs:
        monkeypatch.setenv("QDISPATCH_CUDA_ARCHS", archs)
    build.compile_objects("build")
    assert {t for _, t in ran(logs).values()} == {threads}


def test_a_failed_compile_raises_and_is_retried_next_time(cuda_build, fake_tree, monkeypatch):
    """A CompileError: setuptools ends the build with its message, without a traceback."""
    from setuptools.errors import CompileError
    build, logs = fake_tree
    monkeypatch.setenv("QDISPATCH_BUILD_JOBS", "1")
    os.rename("src_c/cuda/b.cu", "src_c/cuda/bad.cu")
    with pytest.raises(CompileError, match=r"could not compile src_c/cuda/bad\.cu \(exit 3\): "
                                           r"bad\.cu\(7\): error: identifier"):
        build.compile_objects("build")
    assert not os.path.exists("build/cuda/bad.cu.o.stamp")
    for p in logs.iterdir():
        p.unlink()
    with pytest.raises(cuda_build.CudaCompileError, match="bad.cu"):
        build.compile_objects("build")
    assert "bad.cu" in ran(logs)


def test_a_failed_compile_under_auto_builds_without_the_backend(cuda_build, fake_tree, monkeypatch, capsys):
    build, logs = fake_tree
    os.rename("src_c/cuda/b.cu", "src_c/cuda/bad.cu")
    monkeypatch.setenv("QDISPATCH_CUDA", "auto")
    assert cuda_build.compile_or_skip(build, "build") is None
    reason = cuda_build.skipped_reason()
    assert "could not compile src_c/cuda/bad.cu" in reason and "identifier 'x' is undefined" in reason
    assert "QDISPATCH_CUDA=1 makes this a build error" in reason
    assert "building qdispatch without the cuda backend" in capsys.readouterr().err
    monkeypatch.setenv("QDISPATCH_CUDA", "1")  # asked for: the failure is the build's
    with pytest.raises(cuda_build.CudaCompileError, match="bad.cu"):
        cuda_build.compile_or_skip(build, "build")
    os.rename("src_c/cuda/bad.cu", "src_c/cuda/b.cu")  # fixed: the objects, nothing skipped anew
    assert len(cuda_build.compile_or_skip(build, "build")) == 3


def test_first_error_picks_the_line_that_says_what_failed(cuda_build):
    out = "ptxas info : Used 30 registers\nnvcc fatal   : Unsupported gpu architecture 'compute_90a'\n"
    assert cuda_build.first_error(out) == "nvcc fatal   : Unsupported gpu architecture 'compute_90a'"
    assert cuda_build.first_error("\n  just this  \n") == "just this"
    assert cuda_build.first_error("") == "no message"
    assert len(cuda_build.first_error("error: " + "x" * 1000)) == 300


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_build_jobs_must_be_a_positive_number(cuda_build, monkeypatch, value):
    monkeypatch.setenv("QDISPATCH_BUILD_JOBS", value)
    with pytest.raises(RuntimeError, match="QDISPATCH_BUILD_JOBS"):
        cuda_build.build_jobs()


def test_build_jobs_default_to_the_usable_cores(cuda_build, monkeypatch):
    monkeypatch.delenv("QDISPATCH_BUILD_JOBS", raising=False)
    assert cuda_build.build_jobs() >= 1
    monkeypatch.setenv("QDISPATCH_BUILD_JOBS", "5")
    assert cuda_build.build_jobs() == 5


def run_host_cuda_program(cuda_build, tmp_path, source, *library_sources):
    """Builds tests/<source> (with src_c/cuda's library_sources) for the host with
    nvcc and runs it: GEMM code checked wherever a toolkit is, GPU or not."""
    found, _ = cuda_build.find_toolkit()
    if found is None or not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
        pytest.skip("no CUDA toolkit with a host compiler")
    cuda_dir = os.path.join(ROOT, "src_c", "cuda")
    exe = str(tmp_path / os.path.splitext(source)[0])
    built = subprocess.run([found[1], "-std=c++17", "-DQD_WITH_CUDA", "--expt-relaxed-constexpr", "-arch=sm_80",
                            "-I", os.path.join(ROOT, "src_c", "include"), "-I", cuda_dir,
                            os.path.join(os.path.dirname(os.path.abspath(__file__)), source),
                            *(os.path.join(cuda_dir, name) for name in library_sources),
                            "-o", exe], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout


def test_each_hopper_gemm_kernel_index_names_its_kernel(cuda_build, tmp_path):
    """The Hopper GEMM's kernel table: for every mode, operand type, output dtype and
    way of ending blocks of K, kernel_index() names the kernel built for it, and
    block_ends() picks the way each blocking takes."""
    run_host_cuda_program(cuda_build, tmp_path, "gemm_kernel_table.cu", "runtime.cu", "elementwise.cu")


def test_gemm_block_walk_finds_the_scales_a_division_finds(cuda_build, tmp_path):
    """Both int8 GEMMs find each block of K's scales by counting blocks down
    (BlockWalk); from any starting block it takes the index min(block / per, last)."""
    run_host_cuda_program(cuda_build, tmp_path, "gemm_block_walk.cu")


def test_the_gemm_fits_each_gpus_shared_memory_and_refuses_misaligned_operands(cuda_build, tmp_path):
    """The mma.sync GEMM (int_matmul, qq and fq prefill off Hopper) asked every GPU for
    3 stages, 108 KB a block; sm_86 and sm_89 give at most 99 KB, so every launch there
    failed. The depth now follows the device's limit. And the C API took operands that
    were not 16-byte aligned, whose copies fault and end the CUDA context: now
    QD_ERR_ARGUMENT, before any CUDA call."""
    run_host_cuda_program(cuda_build, tmp_path, "gemm_host_rules.cu", "gemm_s8_sm90.cu", "float_units.cu",
                          "runtime.cu", "elementwise.cu")


def test_cuda_failures_map_to_the_documented_statuses(cuda_build, tmp_path):
    """No GPU or driver is QD_ERR_CUDA_UNAVAILABLE, out of memory QD_ERR_NO_MEMORY, any
    other failure QD_ERR_CUDA; an entry point run without a GPU says unavailable."""
    run_host_cuda_program(cuda_build, tmp_path, "cuda_failure_status.cu", "runtime.cu", "elementwise.cu")


def test_cuda_entry_points_refuse_misaligned_pointers(cuda_build, tmp_path):
    """The decode call's weight tiles and scale tiles (16-byte copies), quantize's
    scratch (64-bit atomics) and fq_values's weight rows (4-byte reads) taken at any
    address would be a fault that ends the CUDA context where the other entry points
    return QD_ERR_ARGUMENT."""
    run_host_cuda_program(cuda_build, tmp_path, "cuda_argument_checks.cu", "fq_matmul.cu", "fq_wide_sm90.cu",
                          "gemm_s8_sm90.cu", "float_units.cu", "quantize.cu", "runtime.cu", "elementwise.cu")


# ---- the C kernel library (build_support/cpu.py) ----

CPU_BUILD = os.path.join(os.path.dirname(CUDA_BUILD), "cpu.py")
ROOT = os.path.dirname(os.path.dirname(CUDA_BUILD))


@pytest.fixture
def cpu_build():
    if not os.path.exists(CPU_BUILD):
        pytest.skip("no build_support/ beside the tests")
    spec = importlib.util.spec_from_file_location("qdispatch_build_cpu", CPU_BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def x86_only(cpu_build):
    if cpu_build.machine() != "x86_64":
        pytest.skip("the optional ISA is an x86-64 one")


class RefusingCompiler:
    """Compiles and links nothing and notes each compile; refuses one flag, as an older
    gcc would, or fails to link with one, as a clang without libomp does with -fopenmp."""

    def __init__(self, refused=None, unlinkable=None, links_only_with=None):
        self.refused, self.unlinkable, self.links_only_with = refused, unlinkable, links_only_with
        self.calls, self.flags = [], set()  # the kernel files compiled; every flag they got

    def compile(self, sources, output_dir=None, macros=None, include_dirs=None, extra_postargs=None):
        from setuptools.errors import CompileError
        if self.refused == "everything":
            raise CompileError("command '/usr/bin/gcc-12' failed: No such file or directory")
        if self.refused in (extra_postargs or []):
            raise CompileError(f"gcc: error: unrecognized command-line option '{self.refused}'")
        if not sources[0].endswith("probe.c"):
            self.calls.append((os.path.basename(sources[0]), dict(macros or [])))
            self.flags.update(extra_postargs or [])
        return [os.path.join(output_dir, os.path.basename(sources[0]) + ".o")]

    def link_executable(self, objects, name, output_dir=None, extra_postargs=None):
        from setuptools.errors import LinkError
        needs = [self.links_only_with] if self.links_only_with else []
        if self.unlinkable in (extra_postargs or []) or not set(needs) <= set(extra_postargs or []):
            raise LinkError("ld: cannot find -lomp: No such file or directory")


@pytest.mark.parametrize("flag, isa", [("-mavxvnni", "avxvnni"), ("-mamx-int8", "amx")])
def test_an_isa_the_compiler_refuses_is_left_out(cpu_build, tmp_path, capsys, flag, isa):
    x86_only(cpu_build)
    compiler = RefusingCompiler(flag)
    cpu_build.compile_objects(compiler, ROOT, str(tmp_path))
    compiled = [name for name, _ in compiler.calls]
    assert f"gemm_{isa}.c" not in compiled
    assert {"dispatch.c", "gemm_avx2.c", "gemm_avx512vnni.c"} <= set(compiled)
    assert all(macros.get(f"QD_NO_{isa.upper()}") == "1" for _, macros in compiler.calls)  # the dispatcher knows
    assert isa not in cpu_build.flags_by_isa() and "avx512vnni" in cpu_build.flags_by_isa()
    flags = " ".join(cpu_build.ISA_FLAGS["_" + isa][1])
    assert cpu_build.left_out() == {isa: f"the C compiler does not accept {flags}"}
    assert f"building qdispatch without its {isa} kernels" in capsys.readouterr().err


def test_a_missing_compiler_is_named_before_any_flag_is_blamed(cpu_build, tmp_path, capsys):
    """It failed every probe, so the build first warned that OpenMP and each optional
    ISA were left out for flags the compiler refused, and only then said it was missing."""
    from setuptools.errors import CompileError
    with pytest.raises(CompileError, match="gcc-12' failed: No such file"):
        cpu_build.compile_objects(RefusingCompiler("everything"), ROOT, str(tmp_path))
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("platform, isas", [
    ("linux-x86_64", {"baseline", "avx2", "avxvnni", "avx512vnni", "amx"}),
    ("win-amd64", {"baseline", "avx2", "avxvnni", "avx512vnni", "amx"}),
    ("linux-aarch64", {"baseline", "neon"}),
    ("macosx-11.0-arm64", {"baseline", "neon"}),
    ("macosx-10.9-universal2", {"baseline"}),
    ("linux-ppc64le", {"baseline"}),
])
def test_isa_files_follow_the_platform_the_build_is_for(cpu_build, monkeypatch, platform, isas):
    """A cross build (crossenv, arm64 wheels made on an x86-64 Mac) names its target in
    _PYTHON_HOST_PLATFORM: the ISA files are that machine's, not the build host's."""
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", platform)
    assert {cpu_build.isa_of(path) for path, _ in cpu_build.sources(ROOT)} == isas
    assert set(cpu_build.flags_by_isa()) == isas


@pytest.mark.parametrize("host, target, cross", [
    ("x86_64", "linux-x86_64", None), ("AMD64", "win-amd64", None), ("aarch64", "linux-aarch64", None),
    ("x86_64", "linux-aarch64", "aarch64"), ("x86_64", "macosx-11.0-arm64", "aarch64"),
])
def test_a_cross_build_is_told_from_the_platform_the_build_is_for(cpu_build, monkeypatch, host, target, cross):
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", target)
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: host)
    assert cpu_build.cross_target() == cross


def test_neon_is_left_out_by_a_compiler_without_dotprod(cpu_build, tmp_path, monkeypatch, capsys):
    """On aarch64 a compiler that refuses +dotprod (gcc before 8) builds the library
    without the NEON kernels, as x86-64 builds go without avxvnni; the dispatcher
    is told (QD_NO_NEON) and runs the scalar kernels there."""
    monkeypatch.setattr(cpu_build, "machine", lambda: "aarch64")
    compiler = RefusingCompiler(cpu_build.ISA_FLAGS["_neon"][1][-1])
    cpu_build.compile_objects(compiler, ROOT, str(tmp_path))
    compiled = [name for name, _ in compiler.calls]
    assert "gemm_neon.c" not in compiled and {"dispatch.c", "gemm_scalar.c"} <= set(compiled)
    assert not any(name.endswith(("_avx2.c", "_avx512vnni.c")) for name in compiled)
    assert all(macros.get("QD_NO_NEON") == "1" for _, macros in compiler.calls)
    assert set(cpu_build.left_out()) == {"neon"} and "neon" not in cpu_build.flags_by_isa()
    assert "building qdispatch without its neon kernels" in capsys.readouterr().err


def test_every_isa_is_built_when_the_compiler_takes_its_flags(cpu_build, tmp_path):
    x86_only(cpu_build)
    compiler = RefusingCompiler()
    cpu_build.compile_objects(compiler, ROOT, str(tmp_path))
    assert "gemm_avxvnni.c" in [name for name, _ in compiler.calls]
    assert not any("QD_NO_AVXVNNI" in macros for _, macros in compiler.calls)
    assert cpu_build.left_out() == {} and "avxvnni" in cpu_build.flags_by_isa()


@pytest.mark.parametrize("compiler", [RefusingCompiler("-fopenmp"), RefusingCompiler(unlinkable="-fopenmp")],
                         ids=["refused", "unlinkable"])
def test_openmp_is_left_out_when_the_compiler_cannot_build_with_it(cpu_build, tmp_path, capsys, compiler):
    cpu_build.compile_objects(compiler, ROOT, str(tmp_path))  # a refused flag would raise
    assert "dispatch.c" in [name for name, _ in compiler.calls] and "-fopenmp" not in compiler.flags
    assert cpu_build.openmp_flags() == []  # what setup.py links the extension and libqdispatch.so with
    assert not any("-fopenmp" in flags for flags in cpu_build.flags_by_isa().values())
    why = "the C compiler cannot compile and link an OpenMP program with -fopenmp"
    assert cpu_build.openmp_left_out().startswith(why)
    assert "openmp" not in cpu_build.left_out()  # not an ISA: no isas_left_out entry, no QD_NO_ macro
    assert not any(name.startswith("QD_NO_") for _, macros in compiler.calls for name in macros)
    assert f"building qdispatch without OpenMP: {why}" in capsys.readouterr().err


def test_the_openmp_probe_links_with_ldflags(cpu_build, tmp_path, monkeypatch):
    """A build whose links need LDFLAGS (libomp in a folder of its own, a sanitizer's
    runtime) lost OpenMP: setuptools gives them to the extension's link, not the probe's."""
    monkeypatch.setenv("LDFLAGS", "-fsanitize=address -L/opt/libomp/lib")
    compiler = RefusingCompiler(links_only_with="-L/opt/libomp/lib")
    cpu_build.compile_objects(compiler, ROOT, str(tmp_path))
    assert cpu_build.openmp_left_out() is None and cpu_build.openmp_flags() == ["-fopenmp"]


def test_openmp_is_built_when_the_compiler_can(cpu_build, tmp_path):
    compiler = RefusingCompiler()
    cpu_build.compile_objects(compiler, ROOT, str(tmp_path))
    assert "-fopenmp" in compiler.flags and cpu_build.openmp_flags() == ["-fopenmp"]
    assert all("-fopenmp" in flags for flags in cpu_build.flags_by_isa().values())
    assert cpu_build.openmp_left_out() is None


def real_compiler():
    """The C compiler that a build gets: from the distutils that setuptools installs, whose
    errors are the ones setuptools.errors names (setuptools._distutils raises others)."""
    from distutils.ccompiler import new_compiler
    from distutils.sysconfig import customize_compiler
    compiler = new_compiler()
    customize_compiler(compiler)
    return compiler


def test_the_probe_links_when_asked(cpu_build, c_compiler, tmp_path):
    """A flag that compiles but does not link passes a compile-only probe, not a linking one."""
    unlinkable = ["-lqd_no_such_library"]
    assert cpu_build.accepts(real_compiler(), unlinkable, str(tmp_path / "compile"))
    assert not cpu_build.accepts(real_compiler(), unlinkable, str(tmp_path / "link"),
                                 "int main(void) { return 0; }\n", link=True)


def compile_dispatcher(cpu_build, tmp_path, macros=(), flags=()):
    """The bytes of dispatch.c's object, compiled by the real C compiler."""
    obj, = real_compiler().compile([os.path.join(ROOT, "src_c", "cpu", "dispatch.c")], output_dir=str(tmp_path),
                                   macros=list(macros), include_dirs=[os.path.join(ROOT, "src_c", "include")],
                                   extra_postargs=cpu_build.COMMON_FLAGS + list(flags))
    with open(obj, "rb") as f:
        return f.read()


@pytest.mark.parametrize("left_out", [False, True])
def test_the_dispatcher_refers_to_the_avxvnni_kernels_only_when_built(cpu_build, c_compiler, tmp_path, left_out):
    x86_only(cpu_build)
    macros = [("QD_NO_AVXVNNI", "1")] if left_out else []
    assert (b"qd_kernels_avxvnni" in compile_dispatcher(cpu_build, tmp_path, macros)) != left_out


@pytest.mark.parametrize("openmp", [False, True])
def test_the_dispatcher_calls_openmp_only_when_built_with_it(cpu_build, c_compiler, tmp_path, openmp):
    if openmp and not cpu_build.accepts(real_compiler(), cpu_build.OPENMP_FLAGS, str(tmp_path),
                                        cpu_build.OPENMP_PROBE, link=True):
        pytest.skip("the C compiler cannot build OpenMP programs")
    flags = cpu_build.OPENMP_FLAGS if openmp else []
    assert (b"omp_get_num_procs" in compile_dispatcher(cpu_build, tmp_path, flags=flags)) == openmp


def test_a_rebuilt_object_relinks_the_extension(cpu_build):
    ext = Extension("qdispatch._cuda", ["qdispatch/_cuda.pyx"], depends=["src_c/include/qdispatch.h"])
    objects = ["build/cuda/fq_matmul.cu.o", "build/cuda/gemm_s8.cu.o"]
    cpu_build.link_objects(ext, objects)
    assert ext.extra_objects == objects
    assert set(objects) <= set(ext.depends) and "src_c/include/qdispatch.h" in ext.depends


def build_isa_check(cpu_build, tmp_path, cc, extra_flags=lambda path: [], link_flags=()):
    """The C kernel library as cpu.py builds it for the machine it names (each file with
    its ISA's flags, and extra_flags(path)), compiled with `cc` and linked into
    tests/isa_check.c: the executable's path."""
    sources = cpu_build.sources(ROOT)
    include = ["-I", os.path.join(ROOT, "src_c", "include"), "-I", os.path.join(ROOT, "src_c", "cpu")]
    compiles = [(path, subprocess.Popen([cc, *cpu_build.common_flags(), *flags, *extra_flags(path), *include, "-c",
                                         path, "-o", str(tmp_path / (os.path.basename(path) + ".o"))],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                for path, flags in sources]
    for path, job in compiles:
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0 and "warning" not in out, f"{os.path.basename(path)}:\n{out}"
    exe = str(tmp_path / "isa_check")
    linked = subprocess.run([cc, "-O2", "-std=c11", "-fopenmp", *link_flags, *include,
                             os.path.join(os.path.dirname(os.path.abspath(__file__)), "isa_check.c"),
                             *sorted(str(p) for p in tmp_path.glob("*.o")), "-lm", "-o", exe],
                            capture_output=True, text=True, timeout=300)
    assert linked.returncode == 0, linked.stderr
    return exe


def test_the_neon_kernels_match_exact_references_under_qemu(cpu_build, tmp_path, monkeypatch):
    """The library as cpu.py builds it on an aarch64 machine (baseline files plain, the
    _neon files with their flags, no x86 files), cross-compiled with tests/isa_check.c
    and run under qemu-aarch64: on a CPU with dotprod the NEON kernels are chosen and
    give the exact references' results at their tile edges, on one thread and three;
    on an armv8.0 CPU they are built but not chosen.  Needs an aarch64 cross compiler
    and qemu-aarch64 on PATH, as no CI machine is aarch64."""
    cc = shutil.which("aarch64-linux-gnu-gcc")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if not cc or not qemu:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 on PATH")
    # The check links statically (qemu then needs no aarch64 sysroot): a cross
    # toolchain without static libc and libgomp cannot run it, which is not a failure of ours.
    probe = tmp_path / "probe.c"
    probe.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    probed = subprocess.run([cc, "-fopenmp", "-static", str(probe), "-o", str(tmp_path / "probe")],
                            capture_output=True, text=True, timeout=300)
    if probed.returncode != 0:
        pytest.skip(f"the aarch64 cross toolchain cannot link a static OpenMP program:\n{probed.stderr}")
    probe.unlink()
    (tmp_path / "probe").unlink()
    monkeypatch.setenv("_PYTHON_HOST_PLATFORM", "linux-aarch64")  # how a cross build names its target
    sources = cpu_build.sources(ROOT)
    neon_flags = cpu_build.ISA_FLAGS["_neon"][1]
    assert {cpu_build.isa_of(path) for path, _ in sources} == {"baseline", "neon"}
    assert all(flags == (neon_flags if cpu_build.isa_of(path) == "neon" else []) for path, flags in sources)
    exe = build_isa_check(cpu_build, tmp_path, cc, link_flags=["-static"])
    for cpu, has in (("max", "supported"), ("cortex-a53", "unsupported")):
        run = subprocess.run([qemu, "-cpu", cpu, exe, "neon_dotprod", has], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0 and " 0 failures" in run.stdout, f"-cpu {cpu}:\n{run.stdout}{run.stderr}"


def test_the_amx_kernels_match_exact_references_on_software_tiles(cpu_build, tmp_path):
    """The library as cpu.py builds it for x86-64, its AMX kernels' tile instructions done
    in software (tests/amx_emulator.h, which faults on tile shapes as the CPU does) and
    AMX reported wherever AVX-512 VNNI is: linked with tests/isa_check.c, the AMX kernels
    are chosen and give the exact references' results (qq and W8A8 the scalar ISA's
    bits) at their tile edges, 8-bit and unpacked sub-byte weights, on one thread and
    three.  So CPUs without AMX check its kernels; those with it run them in the
    suite.  Needs AVX-512 VNNI, on which the kernels' epilogue runs."""
    x86_only(cpu_build)
    import qdispatch
    if "avx512vnni" not in qdispatch.info()["backends"].get("cpu", {}).get("supported", []):
        pytest.skip("needs a CPU with AVX-512 VNNI")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        pytest.skip("needs a C compiler")
    probe = tmp_path / "probe.c"
    probe.write_text(cpu_build.OPENMP_PROBE)
    amx_flags = cpu_build.ISA_FLAGS["_amx"][1] + cpu_build.OPENMP_FLAGS
    if subprocess.run([cc, *amx_flags, str(probe), "-o", str(tmp_path / "probe")],
                      capture_output=True, timeout=300).returncode != 0:
        pytest.skip(f"the C compiler does not link a program with {' '.join(amx_flags)}")
    probe.unlink()
    (tmp_path / "probe").unlink()
    emulator = os.path.join(os.path.dirname(os.path.abspath(__file__)), "amx_emulator.h")

    def software_tiles(path):
        name = os.path.basename(path)
        return (["-include", emulator] if name == "gemm_amx.c" else
                ["-DQD_AMX_EMULATED"] if name == "cpu_features.c" else [])

    exe = build_isa_check(cpu_build, tmp_path, cc, extra_flags=software_tiles)
    run = subprocess.run([exe, "amx", "supported"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and " 0 failures" in run.stdout, f"{run.stdout}{run.stderr}"
