"""The cuda backend.  Without the compiled `qdispatch._cuda` module it stays
registered, so every use says why it can't run and how to rebuild."""
from .._core import BackendKind, register_backend
from .base import Backend

try:
    from .. import _cuda
    _IMPORT_ERROR = None
except ImportError as exc:  # built without CUDA
    _cuda = None
    _IMPORT_ERROR = exc


def _build_reason():
    try:
        from .._build_config import BUILD_CONFIG
        return BUILD_CONFIG.get("cuda_skipped_reason") or "the CUDA extension failed to import"
    except ImportError:
        return "no build configuration found"


class UnbuiltCudaBackend(Backend):
    kind = BackendKind.CUDA
    name = "cuda"

    def unavailable_reason(self, index=0):
        return (f"The cuda backend is unavailable: qdispatch was built without CUDA: {_build_reason()}. "
                f"To rebuild with it, install the CUDA toolkit (nvcc) and run "
                f"QDISPATCH_CUDA=1 pip install --no-build-isolation --force-reinstall .")

    def device_count(self):
        return 0


if _cuda is None:
    register_backend(UnbuiltCudaBackend())
