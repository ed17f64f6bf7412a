"""Compile the C kernel library with per-ISA flags chosen by file name.

A wheel must run on any x86-64 CPU, so nothing is built with -march=native:
each ISA's kernels live in their own files and get that ISA's flags; the
baseline files (CPU detection, scalar kernels, dispatch) get none, and the
best kernel is chosen at run time.

An ISA that an older compiler does not know (-mavxvnni, -mamx-int8: GCC 11, clang 12) is left
out of the build, with a warning: its files are not compiled, the dispatcher is told
(QD_NO_<ISA>), and the next best kernels run on CPUs that have it.  OpenMP is left
out the same way when the compiler cannot build an OpenMP program (a clang without
libomp): the kernels' parallel loops then run on the calling thread.
"""
import glob
import os
import platform
import re
import shlex
import sys
import sysconfig

from setuptools.errors import CompileError, LinkError

# -Wno-unknown-pragmas: a build without OpenMP leaves the `#pragma omp` lines in place.
# -ffp-contract=off: no multiply and add fused where the source rounds each (clang
# fuses within an expression by default), so every ISA rounds as the reference.
# -fno-trapping-math: no code reads the floating-point exception flags, so gcc may
# compute both sides of a select and vectorize it (clang's default; the values are
# IEEE's either way): the branch-free float16 conversion vectorizes only so.
# -fvisibility=hidden: the shipped library exports only what qdispatch.h declares.
COMMON_FLAGS = ["-O3", "-std=c11", "-fno-fast-math", "-fno-trapping-math", "-ffp-contract=off", "-fPIC",
                "-fvisibility=hidden", "-Wall", "-Wno-unknown-pragmas"]
OPENMP_FLAGS = ["-fopenmp"]
# Linked, not only compiled: a clang without libomp takes -fopenmp for code that
# does not include omp.h, and then fails to find omp.h or to link -lomp.
OPENMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_num_procs() > 0 ? 0 : 1; }\n"

_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"]
# File-name suffix -> (machines it is built for, the flags that enable the ISA).
ISA_FLAGS = {
    "_avx2": ("x86_64", ["-mavx2", "-mfma", "-mf16c"]),
    "_avxvnni": ("x86_64", ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "_avx512vnni": ("x86_64", _AVX512_FLAGS),
    # the AMX kernels' epilogue and the calls they hand on are AVX-512's
    "_amx": ("x86_64", _AVX512_FLAGS + ["-mamx-tile", "-mamx-int8"]),
    "_neon": ("aarch64", ["-march=armv8.2-a+dotprod"]),
}


# ISAs the build may leave out when the compiler refuses their flags (the others
# are ones that every supported compiler knows).
OPTIONAL_ISAS = ("avxvnni", "amx", "neon")  # -mavxvnni, -mamx-int8: gcc 11; +dotprod: gcc 8
_left_out = {}  # an ISA or "openmp" -> why, set by compile_objects


def machine():
    """The machine the build is for.  sysconfig names it, and a cross build sets it
    there (_PYTHON_HOST_PLATFORM: crossenv, or arm64 wheels built on an x86-64 Mac):
    the machine the build runs on may not run what it builds.  A universal2 build (one
    object for two machines) gets no ISA files: their flags are for one machine."""
    return _normalized(sysconfig.get_platform().rsplit("-", 1)[-1])


def cross_target():
    """The machine a cross build is for, or None when the build is for this one."""
    target = machine()
    return target if target != _normalized(platform.machine()) else None


def _normalized(name):
    name = name.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def isa_of(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    for suffix in ISA_FLAGS:
        if stem.endswith(suffix):
            return suffix[1:]
    return "baseline"


def sources(root):
    """(path, extra flags) for every C file that this machine's build includes."""
    out = []
    for path in sorted(glob.glob(os.path.join(root, "src_c", "cpu", "*.c"))):
        isa = isa_of(path)
        if isa == "baseline":
            out.append((path, []))
            continue
        arch, flags = ISA_FLAGS["_" + isa]
        if arch == machine() and isa not in _left_out:
            out.append((path, flags))
    return out


def openmp_flags():
    """The flags that compile and link the kernels with OpenMP; none in a build without it."""
    return [] if "openmp" in _left_out else list(OPENMP_FLAGS)


def common_flags():
    """The flags every kernel file is compiled with."""
    return COMMON_FLAGS + openmp_flags()


def flags_by_isa():
    """The compile flags of each ISA built here, for `qdispatch info`."""
    table = {"baseline": common_flags()}
    for suffix, (arch, flags) in ISA_FLAGS.items():
        if arch == machine() and suffix[1:] not in _left_out:
            table[suffix[1:]] = common_flags() + flags
    return table


def left_out():
    """The ISAs this build left out, and why (for `qdispatch info`)."""
    return {isa: why for isa, why in _left_out.items() if isa in OPTIONAL_ISAS}


def openmp_left_out():
    """Why this build has no OpenMP, or None when it has (for `qdispatch info`)."""
    return _left_out.get("openmp")


PROBE = "int qd_probe(void) { return 0; }\n"


def probe(compiler, flags, build_temp, program=PROBE, link=False):
    """Compiles `program` with the common flags and `flags` and, with `link`, links it
    into an executable too; the compiler's error is raised."""
    probe_dir = os.path.join(build_temp, "flag_probe")
    os.makedirs(probe_dir, exist_ok=True)
    src = os.path.join(probe_dir, "probe.c")
    with open(src, "w") as f:
        f.write(program)
    objects = compiler.compile([src], output_dir=probe_dir, extra_postargs=COMMON_FLAGS + flags)
    if link:
        # LDFLAGS too: setuptools adds them to the extension's link, not to an executable's,
        # and a build may need them to link at all (a sanitizer, libomp in a folder of its own)
        compiler.link_executable(objects, "probe", output_dir=probe_dir,
                                 extra_postargs=flags + shlex.split(os.environ.get("LDFLAGS", "")))


def accepts(compiler, flags, build_temp, program=PROBE, link=False):
    """Whether the C compiler takes `flags` (see `probe`)."""
    try:
        probe(compiler, flags, build_temp, program, link)
        return True
    except (CompileError, LinkError):
        return False


def _leave_out(part, what, why):
    """Builds without `part` (an ISA, or "openmp"), and says so in the build log."""
    _left_out[part] = why
    print(f"warning: building qdispatch without {what}: {why}", file=sys.stderr, flush=True)


def package_version(root):
    """The version from qdispatch/_version.py, the one place it is written."""
    with open(os.path.join(root, "qdispatch", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def compile_objects(compiler, root, build_temp):
    """Compile the kernel library; returns the object files."""
    objects = []
    include = os.path.join(root, "src_c", "include")
    _left_out.clear()
    # A compiler that is missing or broken fails here, with its own error, before the
    # probes below take its failures for flags it does not know.
    probe(compiler, [], build_temp)
    if not accepts(compiler, OPENMP_FLAGS, build_temp, OPENMP_PROBE, link=True):
        _leave_out("openmp", "OpenMP", f"the C compiler cannot compile and link an OpenMP program with "
                                       f"{' '.join(OPENMP_FLAGS)}; the CPU kernels will run on one thread")
    for isa in OPTIONAL_ISAS:
        arch, flags = ISA_FLAGS["_" + isa]
        if arch == machine() and not accepts(compiler, flags, build_temp):
            _leave_out(isa, f"its {isa} kernels", f"the C compiler does not accept {' '.join(flags)}")
    macros = [("QD_VERSION_STRING", f'"{package_version(root)}"')]  # what qd_version() returns
    macros += [("QD_NO_" + isa.upper(), "1") for isa in left_out()]
    for path, extra in sources(root):
        objects += compiler.compile([path], output_dir=build_temp, macros=macros,
                                    include_dirs=[include, os.path.join(root, "src_c", "cpu")],
                                    extra_postargs=common_flags() + extra)
    return objects


def link_objects(ext, objects):
    """Links compiled objects into an extension, and makes them its dependencies too:
    setuptools relinks an extension only when a dependency is newer, so without
    them a rebuilt object (other flags, an ISA left out) would not reach it."""
    ext.extra_objects = list(objects)
    ext.depends = list(ext.depends) + list(objects)
