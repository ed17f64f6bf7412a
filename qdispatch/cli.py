"""The commands behind `qdispatch` (and `python -m qdispatch`)."""
import json
import os
import re
import sys
import time

import numpy as np

import qdispatch as qd
from .info import build_config


def info(args=None):
    data = qd.info()
    print(f"qdispatch {data['version']}")
    build = data["build"]
    if build:
        print(f"  compiler: {build.get('compiler')} ({build.get('machine')})")
        if build.get("compiler_flags"):
            print(f"  compiler flags (every file, ahead of those below): {' '.join(build['compiler_flags'])}")
        for isa, flags in build.get("flags_by_isa", {}).items():
            print(f"  flags[{isa}]: {' '.join(flags)}")
        for isa, why in (build.get("isas_left_out") or {}).items():
            print(f"  {isa}: not built ({why})")
        if build.get("openmp_left_out"):
            print(f"  openmp: not built ({build['openmp_left_out']})")
        cuda = build.get("cuda")
        print(f"  cuda: {json.dumps(cuda) if cuda else 'not built (' + str(build.get('cuda_skipped_reason')) + ')'}")
    try:
        print(f"default backend: {qd.default_device()}")
    except qd.QDispatchError as exc:  # a bad QDISPATCH_BACKEND: said here, not first at some later call
        print(f"default backend: none: {exc}")
    print("backends:")
    for name, entry in data["backends"].items():
        state = "available" if entry["available"] else "unavailable"
        extra = {k: v for k, v in entry.items() if k not in ("available", "reason")}
        print(f"  {name:9s} {state}" + (f"  {extra}" if extra else ""))
        if not entry["available"]:
            print(f"            {entry['reason']}")


def _measure(fn, repeat=3, min_seconds=0.3):
    """fn's result and its best time over `repeat` calls or more, for `min_seconds` at
    least: numpy's BLAS threads spin for a while after its last call, and calls made
    then, on the same cores, took 10-40x as long."""
    fn()  # warm-up: first-use packing and page faults stay out of the figure
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < repeat or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return out, best


def demo(args=None):
    info()
    rng = np.random.default_rng(0)
    n = k = 4096
    m = 16
    w = (0.02 * rng.standard_normal((n, k))).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    scheme = qd.QuantScheme("q8s", axis=0)
    print(f"\nlayer: w[{n}, {k}] quantized {scheme!r}; x[{m}, {k}] float32; y = x @ w.T")
    _, t_np = _measure(lambda: x @ w.T)
    print(f"  numpy float32 matmul: {t_np * 1e3:8.2f} ms")
    for device in qd.available_backends():
        wq = qd.quantize(w, scheme, device=device)
        xt = qd.tensor(x, device=device)
        xq = qd.quantize(xt, qd.QuantScheme("q8s", axis=0))
        for arm, fn in (("fq (float x q8 weight)", lambda: qd.q_matmul(xt, wq.T)),
                        ("qq (q8 x q8)", lambda: qd.q_matmul(xq, wq.T))):
            out, t = _measure(fn)
            error = qd.error_report(want, out)
            print(f"  {device:9s} {arm:24s} {t * 1e3:8.2f} ms   rel err {error.relative_error:.2e}   "
                  f"SQNR {error.sqnr_db:5.1f} dB")
    backends = qd.available_backends()
    if len(backends) >= 2:
        a, b = backends[0], backends[-1]
        print(f"\nmixing backends: x on {a!r}, w on {b!r}")
        try:
            qd.q_matmul(qd.quantize(x, scheme, device=a), qd.quantize(w, scheme, device=b).T)
        except qd.BackendMismatchError as exc:
            print(f"  caught {type(exc).__name__}: {exc}")
        out = qd.q_matmul(qd.tensor(x, device=a), qd.quantize(w, scheme, device=b).T, transfer="auto")
        print(f"  with transfer='auto' the result is on {str(out.device)!r}")


def _escaped(path):
    """A path as pkg-config writes one: a backslash before each character a shell or
    make would split or expand at (a space, a quote, `$`), so a folder such as
    "My Projects" stays one word in a makefile's command or after `eval`."""
    return re.sub(r"([^\w@%+=:,./-])", r"\\\1", str(path))


def _static_runtime():
    """What linking libqdispatch.a brings besides: the OpenMP runtime, when the kernels
    were built with it, libm, and the CUDA kernels' runtime from the toolkit they were
    built with."""
    parts = ([] if build_config().get("openmp_left_out") else ["-fopenmp"]) + ["-lm"]
    cuda = build_config().get("cuda")
    if cuda:
        parts += [f"-L{_escaped(cuda['library_dir'])}"] + [f"-l{name}" for name in cuda["libraries"]]
    return parts


def _shared_libs(lib):
    return f"-L{lib} -Wl,-rpath,{lib} -lqdispatch"


def config(args):
    if args.pc:
        return _pkg_config_file()
    if args.cmake:
        return _cmake_dir()
    if not (args.cflags or args.libs):
        args.cflags = args.libs = True
    parts = []
    if args.cflags:  # the same with --static: the header is one
        parts.append(f"-I{_escaped(qd.get_include())}")
    if args.libs:
        lib = _escaped(qd.get_library_dir())
        parts += [f"{lib}/libqdispatch.a", *_static_runtime()] if args.static else [_shared_libs(lib)]
    print(" ".join(parts))


def _pkg_config_file():
    """A pkg-config file for this install: the shared library, found at run time
    through an rpath (as `config --libs` links it); a static link names the
    archive (`config --libs --static`), which -lqdispatch would not pick."""
    print(f"includedir={_escaped(qd.get_include())}\n"
          f"libdir={_escaped(qd.get_library_dir())}\n\n"
          f"Name: qdispatch\n"
          f"Description: int8 and int4 quantized matrix kernels (CPU SIMD, CUDA)\n"
          f"Version: {qd.__version__}\n"
          f"Cflags: -I${{includedir}}\n"
          f"Libs: {_shared_libs('${libdir}')}\n"
          f"Libs.private: {' '.join(_static_runtime())}")


def _cmake_dir():
    folder = qd.get_cmake_dir()
    if not os.path.isfile(os.path.join(folder, "qdispatchConfig.cmake")):
        sys.exit(f"qdispatch config: {folder} holds no qdispatchConfig.cmake: this copy of qdispatch was "
                 "built before it shipped one; reinstall it (pip install --force-reinstall qdispatch), or use "
                 "`qdispatch config --pc` with CMake's pkg_check_modules")
    print(folder)


def add_bench_arguments(parser):
    from . import bench
    bench.add_arguments(parser)


def bench(args):
    from . import bench as bench_module
    return bench_module.run(args)
