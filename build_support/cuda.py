"""Find the CUDA toolkit and compile the `.cu` kernels for the `qdispatch._cuda` extension.

`QDISPATCH_CUDA=auto` (default) builds the cuda backend when a toolkit is found and
compiles the kernels (a toolkit too old for the targets, or a host compiler that
nvcc refuses, leaves the backend out and says why), `1` requires it, `0` skips it.
A setting the build can't use (a mode, a target list, a job count, a CUDA_HOME that
is no toolkit under `1`) stops the build at once with what to set instead.
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
from setuptools.errors import CompileError

# Target architectures, each with why it is in the list.  `QDISPATCH_CUDA_ARCHS`
# overrides it with a comma list such as "80,90a"; an entry "compute_80" embeds
# PTX for that virtual architecture instead of machine code (newer GPUs compile it
# when the module loads, so an H100 can run the sm_80 code paths).  None may be
# older than MIN_ARCH.
DEFAULT_ARCHS = [
    "80",   # A100 / A30: int8 mma.sync m16n8k32, cp.async
    "86",   # RTX 30xx / A10 / A40: same instructions as sm_80, smaller shared memory
    "89",   # L4 / RTX 40xx / L40
    "90a",  # H100 / H200: Hopper's own instructions (wgmma) need the "a" target
]
# PTX for the newest listed arch, so GPUs newer than the list still run (JIT at load).
PTX_ARCH = "90"
MIN_ARCH = 80  # the kernels use cp.async and int8 mma.sync m16n8k32
ARCH_FORM = re.compile(r"(sm_|compute_)?([0-9]+)([af]?)")

NVCC_FLAGS = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-DQD_WITH_CUDA",
              "--expt-relaxed-constexpr", "-lineinfo"]  # never --use_fast_math: quantize is bit-exact
SOURCES = os.path.join("src_c", "cuda", "*.cu")
INCLUDE = os.path.join("src_c", "include")

_skipped = None


class CudaCompileError(CompileError):
    """nvcc failed on a kernel source: the message names the source and nvcc's first error
    (a CompileError, so setuptools ends the build with the message, not a traceback)."""


class BuildSettingError(RuntimeError):
    """A build setting has a value the build can't use: the message names it and what to set."""


def _mode():
    mode = os.environ.get("QDISPATCH_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise BuildSettingError(f"QDISPATCH_CUDA={mode!r}: expected auto (the default: build the cuda backend "
                                f"when a CUDA toolkit is found), 1 (require it) or 0 (leave it out)")
    return mode


def _named_root():
    """The toolkit root that CUDA_HOME (or else CUDA_PATH) names, as (variable, root), or None."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var, "").strip():
            return var, os.environ[var].strip()
    return None


def _nvcc_root(nvcc):
    """The root of the toolkit an nvcc belongs to, as nvcc itself reports it: the
    nvcc on PATH may be a link or a wrapper script in another folder."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        here = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    except (OSError, subprocess.SubprocessError):
        here = None
    return os.path.dirname(here.group(1).strip() if here else os.path.dirname(os.path.realpath(nvcc)))


def _candidates():
    """(where it came from, toolkit root) in the documented search order.  A root
    that CUDA_HOME or CUDA_PATH names is the only one: the setting chose it."""
    named = _named_root()
    if named:
        yield f"${named[0]}", named[1]
        return
    nvcc = shutil.which("nvcc")
    if nvcc:
        yield "nvcc on PATH", _nvcc_root(nvcc)
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


def _lacks(root):
    """What of a toolkit `root` lacks, in words; empty when it has all the build needs."""
    if not os.path.isdir(root):
        return "no such folder"
    missing = [name for name, found in (("bin/nvcc", os.path.exists(os.path.join(root, "bin", "nvcc"))),
                                        ("cuda_runtime_api.h", _include_dir(root)),
                                        ("libcudart_static.a", _library_dir(root))) if not found]
    return "no " + ", ".join(missing) if missing else ""


def find_toolkit():
    """(root, nvcc, include dir, library dir) of the first complete toolkit, or
    (None, list of places looked at, each with what it lacked)."""
    looked = []
    for origin, root in _candidates():
        lacks = _lacks(root)
        if not lacks:
            return (root, os.path.join(root, "bin", "nvcc"), _include_dir(root), _library_dir(root)), looked
        looked.append(f"{origin} ({root}: {lacks})")
    return None, looked


def _listed_archs():
    """QDISPATCH_CUDA_ARCHS's entries, or None when it is unset or blank (the defaults)."""
    env = os.environ.get("QDISPATCH_CUDA_ARCHS", "")
    if not env.strip():
        return None
    listed = [a.strip().lower() for a in env.split(",") if a.strip()]
    if not listed:
        raise BuildSettingError(f"QDISPATCH_CUDA_ARCHS={env!r} names no architecture: give a comma list "
                                f"such as 80,90a, or unset it for the defaults ({','.join(DEFAULT_ARCHS)})")
    for entry in listed:
        form = ARCH_FORM.fullmatch(entry)
        if form is None:
            raise BuildSettingError(f"QDISPATCH_CUDA_ARCHS={env!r}: {entry!r} is not an architecture; give a "
                                    f"comma list such as 80,90a (sm_90a, and compute_80 for PTX, work too)")
        if int(form.group(2)) < MIN_ARCH:
            raise BuildSettingError(f"QDISPATCH_CUDA_ARCHS={env!r}: {entry!r} is older than the kernels run on: "
                                    f"they need sm_{MIN_ARCH} or newer")
    return [a.replace("sm_", "") for a in listed]


def archs():
    return _listed_archs() or list(DEFAULT_ARCHS)


def gencode_flags():
    listed = _listed_archs()
    flags = [f"-gencode=arch={a},code={a}" if a.startswith("compute_") else
             f"-gencode=arch=compute_{a},code=sm_{a}" for a in listed or DEFAULT_ARCHS]
    if listed is None:
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
            raise BuildSettingError(f"QDISPATCH_BUILD_JOBS={env!r}: expected a positive whole number "
                                    f"(the cores the build may use), or unset for all of them")
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


def configure(cross_target=None):
    """The CUDA build configuration, or None when the cuda backend is not built.
    `cross_target`: the machine a cross build is for (None: this one).  Every
    setting is checked first, so a bad one stops the build before anything compiles."""
    global _skipped
    mode = _mode()
    build_jobs()
    if mode == "0":
        _skipped = "QDISPATCH_CUDA=0"
        return None
    archs()
    if cross_target:
        _skipped = (f"a cross build for {cross_target}: the cuda backend builds only on the machine it is for "
                    f"(nvcc here compiles for this one)")
        return _leave_out(mode, "set QDISPATCH_CUDA=0, or build on that machine")
    found, looked = find_toolkit()
    if found is None:
        named = _named_root()
        if named:
            _skipped = (f"{named[0]}={named[1]} is not a CUDA toolkit ({_lacks(named[1])}): set it to the "
                        f"toolkit's root, the folder of bin/nvcc, or unset it to look for nvcc on PATH and in "
                        f"/usr/local/cuda")
            return _leave_out(mode)  # the reason says what to set
        _skipped = "no CUDA toolkit found (looked in " + ", ".join(looked) + ")"
        return _leave_out(mode, "install the CUDA toolkit or set CUDA_HOME to it", quietly=True)  # the usual case
    _skipped = None
    return CudaBuild(*found)


def _leave_out(mode, fix=None, quietly=False):
    """Build without the backend, saying why (`_skipped`) in the build log unless
    `quietly` (`info` says it either way); under QDISPATCH_CUDA=1 refuse to."""
    if mode == "1":
        raise BuildSettingError(f"QDISPATCH_CUDA=1 but {_skipped}" + (f": {fix}" if fix else ""))
    if not quietly:
        _warn_left_out()
    return None


def _warn_left_out():
    print(f"warning: building qdispatch without the cuda backend: {_skipped}", file=sys.stderr, flush=True)


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
        _warn_left_out()
        return None


def skipped_reason():
    """Why the cuda backend was not built (shown by `python -m qdispatch info`)."""
    return _skipped or "the CUDA backend is not part of this build"
