"""Compile the C kernel library with per-ISA flags chosen by file name.

A wheel must run on any x86-64 CPU, so nothing is built with -march=native:
each ISA's kernels live in their own files and get that ISA's flags; the
baseline files (CPU detection, scalar kernels, dispatch) get none, and the
best kernel is chosen at run time.
"""
import glob
import os
import platform
import re

COMMON_FLAGS = ["-O3", "-std=c11", "-fno-fast-math", "-fPIC", "-fopenmp",
                "-Wall", "-Wno-unknown-pragmas"]

# File-name suffix -> (machines it is built for, the flags that enable the ISA).
ISA_FLAGS = {
    "_avx2": ("x86_64", ["-mavx2", "-mfma", "-mf16c"]),
    "_avxvnni": ("x86_64", ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "_avx512vnni": ("x86_64", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                               "-mavx512vnni", "-mfma", "-mf16c"]),
    "_neon": ("aarch64", ["-march=armv8.2-a+dotprod"]),
}


def machine():
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


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
        if arch == machine():
            out.append((path, flags))
    return out


def flags_by_isa():
    """The compile flags of each ISA built here, for `qdispatch info`."""
    table = {"baseline": list(COMMON_FLAGS)}
    for suffix, (arch, flags) in ISA_FLAGS.items():
        if arch == machine():
            table[suffix[1:]] = COMMON_FLAGS + flags
    return table


def package_version(root):
    """The version from qdispatch/_version.py, the one place it is written."""
    with open(os.path.join(root, "qdispatch", "_version.py")) as f:
        return re.search(r'__version__ = "([^"]+)"', f.read()).group(1)


def compile_objects(compiler, root, build_temp):
    """Compile the kernel library; returns the object files."""
    objects = []
    include = os.path.join(root, "src_c", "include")
    version = [("QD_VERSION_STRING", f'"{package_version(root)}"')]  # what qd_version() returns
    for path, extra in sources(root):
        objects += compiler.compile([path], output_dir=build_temp, macros=version,
                                    include_dirs=[include, os.path.join(root, "src_c", "cpu")],
                                    extra_postargs=COMMON_FLAGS + extra)
    return objects
