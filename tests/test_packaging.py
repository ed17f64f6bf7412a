"""The installed build: portable baseline code, ISA override, single-sourced version, license."""
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

import qdispatch as qd

ISA_SUFFIXES = ("_avx2", "_avxvnni", "_avx512vnni", "_amx", "_neon")
ALL_ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "neon_dotprod", "amx")
# Instruction prefixes objdump prints before the mnemonic.
PREFIXES = {"rep", "repz", "repe", "repnz", "repne", "lock", "notrack", "bnd", "data16", "addr32", "cs", "ds"}
# A wide register, an AVX-512 mask register, or a VEX/EVEX mnemonic (all start with v).
AVX = re.compile(r"%[yz]mm\d|%k[0-7]\b")

on_x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                            reason="checks x86-64 code")


def disassembly_by_member(archive):
    """{member name: [instruction text]} from `objdump -d` of a static library."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", archive],
                         capture_output=True, text=True, check=True).stdout
    members, current = {}, None
    for line in out.splitlines():
        header = re.match(r"^(\S+\.o):\s+file format", line)
        if header:
            current = members.setdefault(header.group(1), [])
        elif current is not None and re.match(r"^\s+[0-9a-f]+:\t", line):
            current.append(line.split("\t", 1)[1].strip())
    return members


def uses_avx(instruction):
    words = instruction.split()
    mnemonic = next((w for w in words if w not in PREFIXES), "")
    return bool(AVX.search(instruction)) or (mnemonic.startswith("v") and mnemonic not in ("verr", "verw"))


def is_baseline(member):
    return not os.path.splitext(member)[0].endswith(ISA_SUFFIXES)


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf is not installed")
@pytest.mark.skipif(sys.platform != "linux", reason="reads ELF run paths")
def test_shipped_binaries_carry_no_run_path_of_the_build_machine():
    """The interpreter's link flags (pyenv's) put its own lib folder into every binary's
    RUNPATH, libqdispatch.so included: a folder of the build machine, searched by every
    program that embeds the library.  Only folders relative to the binary may stay."""
    package = os.path.dirname(qd.__file__)
    binaries = [os.path.join(d, f) for d, _, files in os.walk(package) for f in files if ".so" in f]
    assert any(b.endswith("libqdispatch.so") for b in binaries), binaries
    for binary in binaries:
        dynamic = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout
        paths = [p for line in re.findall(r"\((?:RPATH|RUNPATH)\).*\[(.*)\]", dynamic) for p in line.split(":")]
        assert all(p.startswith("$ORIGIN") for p in paths), f"{os.path.relpath(binary, package)}: run path {paths}"


@on_x86
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump is not installed")
def test_baseline_objects_have_no_avx():
    members = disassembly_by_member(os.path.join(qd.get_library_dir(), "libqdispatch.a"))
    baseline = [m for m in members if is_baseline(m)]
    assert baseline, f"no baseline objects among {sorted(members)}"
    for member in baseline:
        avx = [i for i in members[member] if uses_avx(i)]
        assert not avx, f"{member} is baseline code but uses AVX: {avx[:5]}"
    # The check can see AVX: the AVX2 kernels do use it.
    avx2 = [m for m in members if os.path.splitext(m)[0].endswith("_avx2")]
    assert avx2 and any(uses_avx(i) for m in avx2 for i in members[m])


def run_python(*args, **env):
    """`python args` outside any source tree, so that it imports the package under test."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(qd.__file__)), env=dict(os.environ, **env))


INT_MATMUL_CHECK = """
import numpy as np, qdispatch as qd
print(qd.info()["backends"]["cpu"]["isa"])
rng = np.random.default_rng(0)
a = rng.integers(-128, 128, size=(17, 300), dtype=np.int8)
b = rng.integers(-128, 128, size=(300, 33), dtype=np.int8)
a[0] = b[:, 0] = -128  # (-128) * (-128) pairs: int16 saturation would show
got = qd.int_matmul(qd.tensor(a, device="cpu"), qd.tensor(b, device="cpu")).numpy()
assert (got == a.astype(np.int64) @ b.astype(np.int64)).all(), "int_matmul is not exact"
"""


def test_forced_scalar_isa_is_used_and_exact():
    proc = run_python("-c", INT_MATMUL_CHECK, QDISPATCH_ISA="scalar")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["scalar"]


def test_unusable_isa_is_a_clear_error():
    usable = set(qd.info()["backends"]["cpu"]["built"]) & set(qd.info()["backends"]["cpu"]["supported"])
    unusable = [isa for isa in ALL_ISAS if isa not in usable]
    for name in ["no_such_isa"] + unusable[:1]:
        proc = run_python("-c", INT_MATMUL_CHECK, QDISPATCH_ISA=name)
        assert proc.returncode != 0, f"QDISPATCH_ISA={name} was accepted"
        last_line = proc.stderr.strip().splitlines()[-1]
        assert "BackendUnavailableError" in last_line and repr(name) in last_line, proc.stderr
        assert "scalar" in last_line, "the error should name the usable ISAs"


def test_version_is_single_sourced():
    try:
        installed = importlib.metadata.version("qdispatch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("qdispatch is not installed (no distribution metadata)")
    proc = run_python("-m", "qdispatch", "info")
    assert proc.returncode == 0, proc.stderr
    assert qd.__version__ == installed
    assert proc.stdout.splitlines()[0] == f"qdispatch {installed}"


def test_install_declares_and_ships_its_license():
    try:
        dist = importlib.metadata.distribution("qdispatch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("qdispatch is not installed (no distribution metadata)")
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    shipped = [f for f in dist.files or () if f.name == "LICENSE"]
    assert shipped, "the wheel should carry the LICENSE file its metadata names"
    assert "Apache License" in shipped[0].read_text() and "Version 2.0" in shipped[0].read_text()


def test_info_shows_the_build_configuration():
    build = qd.info()["build"]
    assert build, "no build configuration recorded"
    flags = build["flags_by_isa"]
    assert not any(f.startswith(("-mavx", "-march", "-mf16c", "-mfma")) for f in flags["baseline"])
    out = run_python("-m", "qdispatch", "info").stdout
    assert f"compiler: {build['compiler']}" in out
    # CFLAGS reach every file, the baseline's too: info shows the flags the compiler ran with
    assert f"compiler flags (every file, ahead of those below): {' '.join(build['compiler_flags'])}" in out
    for isa, isa_flags in flags.items():
        assert f"flags[{isa}]: {' '.join(isa_flags)}" in out
    for isa, why in (build.get("isas_left_out") or {}).items():  # a compiler without their flags
        assert f"{isa}: not built ({why})" in out and isa not in flags
    no_openmp = build.get("openmp_left_out")  # a compiler that cannot build OpenMP programs
    assert (f"openmp: not built ({no_openmp})" in out) if no_openmp else ("openmp:" not in out)
    assert all(("-fopenmp" in isa_flags) != bool(no_openmp) for isa_flags in flags.values())
    # the kernels the dispatcher was built with are those the build compiled
    built = set(qd.info()["backends"]["cpu"]["built"]) - {"scalar"}
    assert built == {"neon_dotprod" if isa == "neon" else isa for isa in flags if isa != "baseline"}
    assert "cuda:" in out
