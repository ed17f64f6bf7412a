"""Find the CUDA toolkit and compile the `.cu` kernels for the `qdispatch._cuda` extension.

`QDISPATCH_CUDA=auto` (default) builds the cuda backend when a toolkit is found and
compiles the kernels (a toolkit too old for the targets, or a host compiler that
nvcc refuses, leaves the backend out and says why), `1` requires it, `0` skips it.
The CUDA runtime is linked statically, so the extension imports on machines
without a driver (it then reports "no driver")."""
import concurrent.futures
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension

# Target architectures, each with why it is in the list.  `QDISPATCH_CUDA_ARCHS`
# overrides it with a comma list such as "80,90a"; an entry "compute_80" embeds
# PTX for that virtual architecture instead of machine code (newer GPUs compile it
# when the module loads, so an H100 can run the sm_80 code paths).
DEFAULT_ARCHS = [
    "80",   # A100 / A30: int8 mma.sync m16n8k32, cp.async
    "86",   # RTX 30xx / A10 / A40: same instructions as sm_80, smaller shared memory
    "89",   # L4 / RTX 40xx / L40
    "90a",  # H100 / H200: Hopper's own instructions (wgmma) need the "a" target
]
# PTX for the newest listed arch, so GPUs newer than the list still run (JIT at load).
PTX_ARCH = "90"

NVCC_FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-DQD_WITH_CUDA",
              "--expt-relaxed-constexpr", "-lineinfo"]  # never --use_fast_math: quantize is bit-exact
SOURCES = os.path.join("src_c", "cuda", "*.cu")
INCLUDE = os.path.join("src_c", "include")

_skipped = None


class CudaCompileError(RuntimeError):
    """nvcc failed on a kernel source: the message names the source and nvcc's first error."""


def _mode():
    mode = os.environ.get("QDISPATCH_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"QDISPATCH_CUDA={mode!r}: expected auto, 0 or 1")
    return mode


def _candidates():
    """(where it came from, toolkit root) in the documented search order."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield f"${var}", os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        yield "nvcc on PATH", os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    yield "/usr/local/cuda", "/usr/local/cuda"


def _library_dir(root):
    for sub in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                os.path.join("targets", "sbsa-linux", "lib")):
        d = os.path.join(root, sub)
        if os.path.exists(os.path.join(d, "libcudart_static.a")):
            return d
    return None


def _include_dir(root):
    for sub in ("include", os.path.join("targets", "x86_64-linux", "include"),
                os.path.join("targets", "sbsa-linux", "include")):
        d = os.path.join(root, sub)
        if os.path.exists(os.path.join(d, "cuda_runtime_api.h")):
            return d
    return None


def find_toolkit():
    """(root, nvcc, include dir, library dir) of the first complete toolkit, or
    (None, list of places looked at)."""
    looked = []
    for origin, root in _candidates():
        looked.append(f"{origin} ({root})")
        nvcc = os.path.join(root, "bin", "nvcc")
        inc, lib = _include_dir(root), _library_dir(root)
        if os.path.exists(nvcc) and inc and lib:
            return (root, nvcc, inc, lib), looked
    return None, looked


def archs():
    env = os.environ.get("QDISPATCH_CUDA_ARCHS")
    listed = [a.strip().replace("sm_", "") for a in env.split(",")] if env else DEFAULT_ARCHS
    return [a for a in listed if a]


def gencode_flags():
    flags = [f"-gencode=arch={a},code={a}" if a.startswith("compute_") else
             f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs()]
    if not os.environ.get("QDISPATCH_CUDA_ARCHS"):
        flags.append(f"-gencode=arch=compute_{PTX_ARCH},code=compute_{PTX_ARCH}")
    return flags


# What a link of the CUDA objects needs.  The static runtime: loading needs no
# libcudart.so, only the driver at run time.
LIBRARIES = ["cudart_static", "dl", "rt", "pthread", "stdc++"]


class CudaBuild:
    def __init__(self, root, nvcc, include_dir, library_dir):
        self.root, self.nvcc = root, nvcc
        self.include_dir, self.library_dir = include_dir, library_dir

    def extension(self, common_kwargs):
        kw = dict(common_kwargs)
        kw["include_dirs"] = list(kw.get("include_dirs", [])) + [self.include_dir]
        kw["define_macros"] = list(kw.get("define_macros", [])) + [("QD_WITH_CUDA", "1")]
        # The kernels come from the package's libqdispatch.so (setup.py links it and
        # adds its folder), found beside the module at run time; the module's own
        # calls into the runtime need a runtime of its own.
        return Extension(
            "qdispatch._cuda", ["qdispatch/_cuda.pyx"],
            library_dirs=[self.library_dir],
            libraries=["qdispatch"] + LIBRARIES,
            extra_link_args=["-Wl,-rpath,$ORIGIN/lib"],
            **kw)

    def compile_objects(self, build_temp):
        out_dir = os.path.join(build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        headers = sorted(glob.glob(os.path.join("src_c", "cuda", "*.cuh"))) + sorted(glob.glob(os.path.join(INCLUDE, "*.h")))
        objects, stale = [], []
        for src in sorted(glob.glob(SOURCES)):
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            # Rebuild on any change of source, headers or flags (contents, not mtimes:
            # a copied tree keeps stale build folders with newer times).
            stamp = _stamp([src] + headers, self.flags())
            if not os.path.exists(obj) or _read(obj + ".stamp") != stamp:
                stale.append((src, obj, stamp))
            objects.append(obj)
        self._compile(stale)
        return objects

    def _compile(self, stale):
        """nvcc over the stale sources, several at once, largest first, each compiling
        its targets on threads of its own (one file and one target at a time took
        4 minutes on two cores).  Up to two compilers a core keep the cores busy
        while the largest file's targets finish; each takes up to about 0.5 GB."""
        if not stale:
            return
        cores = build_jobs()
        files = min(cores, len(stale))
        flags = self.flags()
        threads = max(1, min(len(gencode_flags()), 2 * cores // files))
        flags += ["--threads", str(threads)]  # changes no object: not in the stamp
        stale = sorted(stale, key=lambda item: -os.path.getsize(item[0]))

        def run(item):
            src, obj, stamp = item
            cmd = [self.nvcc, "-c", src, "-o", obj, "-I", INCLUDE] + flags
            print(" ".join(cmd), flush=True)
            # each compiler's messages in one piece: several run at once
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
            sys.stdout.write(done.stdout)
            sys.stdout.flush()
            if done.returncode != 0:
                version = nvcc_version(self.nvcc)
                raise CudaCompileError(f"nvcc{' ' + version if version else ''} ({self.nvcc}) could not compile "
                                       f"{src} (exit {done.returncode}): {first_error(done.stdout)}")
            with open(obj + ".stamp", "w") as f:  # written only once the object is whole
                f.write(stamp)

        with concurrent.futures.ThreadPoolExecutor(max_workers=files) as pool:
            jobs = [pool.submit(run, item) for item in stale]
            for job in concurrent.futures.as_completed(jobs):
                if job.exception() is not None:  # stop what has not started, report it
                    pool.shutdown(cancel_futures=True)
                    raise job.exception()

    def flags(self):
        return NVCC_FLAGS + gencode_flags()

    def describe(self):
        return {"nvcc": self.nvcc, "nvcc_version": nvcc_version(self.nvcc), "archs": archs(),
                "flags": self.flags(), "runtime": "cudart_static",
                "library_dir": self.library_dir, "libraries": LIBRARIES}


def build_jobs():
    """Compilers run at once: `QDISPATCH_BUILD_JOBS`, else the cores this process may use."""
    env = os.environ.get("QDISPATCH_BUILD_JOBS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise RuntimeError(f"QDISPATCH_BUILD_JOBS={env!r}: expected a positive whole number")
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _stamp(paths, flags):
    h = hashlib.sha256(" ".join(flags).encode())
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def first_error(output):
    """The line of a compiler's output that says what went wrong first."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b|fatal", line, re.IGNORECASE)]
    line = (errors or lines or ["no message"])[0]
    return line if len(line) <= 300 else line[:297] + "..."


def nvcc_version(nvcc):
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    m = re.search(r"release ([0-9.]+)", text)
    return m.group(1) if m else None


def configure():
    """The CUDA build configuration, or None when the cuda backend is not built."""
    global _skipped
    mode = _mode()
    if mode == "0":
        _skipped = "QDISPATCH_CUDA=0"
        return None
    found, looked = find_toolkit()
    if found is None:
        _skipped = "no CUDA toolkit found (looked in " + ", ".join(looked) + ")"
        if mode == "1":
            raise RuntimeError(f"QDISPATCH_CUDA=1 but {_skipped}: install the CUDA toolkit "
                               f"or set CUDA_HOME to it")
        return None
    _skipped = None
    return CudaBuild(*found)


def compile_or_skip(build, build_temp):
    """The kernels' objects, or None when nvcc fails under QDISPATCH_CUDA=auto: the
    package then builds without the cuda backend and records why (QDISPATCH_CUDA=1
    makes the failure a build error)."""
    global _skipped
    try:
        return build.compile_objects(build_temp)
    except CudaCompileError as err:
        if _mode() == "1":
            raise
        _skipped = f"{err}; QDISPATCH_CUDA=1 makes this a build error"
        print(f"warning: building qdispatch without the cuda backend: {_skipped}", file=sys.stderr, flush=True)
        return None


def skipped_reason():
    """Why the cuda backend was not built (shown by `python -m qdispatch info`)."""
    return _skipped or "the CUDA backend is not part of this build"
