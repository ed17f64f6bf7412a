"""What this copy of qdispatch is: version, build, backends, ISA and threads."""
import os

from ._core import BackendKind, get_backend
from ._version import __version__

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def build_config():
    try:
        from ._build_config import BUILD_CONFIG
        return BUILD_CONFIG
    except ImportError:
        return {}


def available_backends():
    """Names of the backends that can run here, fastest last."""
    return [k.name.lower() for k in BackendKind
            if get_backend(k).unavailable_reason(0) is None]


def info():
    """A dict describing the version, the build, each backend and the CPU kernels."""
    backends = {}
    for k in BackendKind:
        b = get_backend(k)
        reason = b.unavailable_reason(0)
        entry = {"available": reason is None}
        if reason:
            entry["reason"] = reason
        if hasattr(b, "describe"):
            entry.update(b.describe())
        backends[k.name.lower()] = entry
    return {"version": __version__, "build": build_config(), "backends": backends}


def _cpu():
    return get_backend("cpu")


def set_isa(name):
    """Force the cpu backend's kernels to an ISA ('scalar', 'avx2', ...) or 'auto'."""
    _cpu().set_isa(name)


def set_num_threads(n):
    """Threads for the cpu backend's kernels (n <= 0 means the default: OMP_NUM_THREADS's
    count where it is set, as torch reads it, else one per core; more than 4 per
    core count as 4 per core).  A build without OpenMP (see `qdispatch info`)
    runs them on one thread, whatever n is, and so does a process forked after qdispatch
    was loaded (OpenMP's threads do not survive fork: start workers by 'spawn')."""
    _cpu().set_num_threads(n)


def get_num_threads():
    """Threads the cpu backend's kernels use (set_num_threads, QDISPATCH_NUM_THREADS)."""
    return _cpu().get_num_threads()


def get_include():
    """The folder holding qdispatch.h, for C builds that embed the kernels."""
    return os.path.join(_PACKAGE_DIR, "include")


def get_library_dir():
    """The folder holding libqdispatch (.so and .a)."""
    return os.path.join(_PACKAGE_DIR, "lib")


def get_cmake_dir():
    """The folder holding qdispatchConfig.cmake: CMake's `qdispatch_DIR`, for
    find_package(qdispatch) and its targets qdispatch::qdispatch (shared) and
    qdispatch::qdispatch_static."""
    return os.path.join(get_library_dir(), "cmake", "qdispatch")
