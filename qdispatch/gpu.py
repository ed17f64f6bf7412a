"""GPU housekeeping: waiting for queued work, free memory, the block cache.

Kernels are queued on each GPU's default stream and a call returns before they
finish (reading a result back waits for them); `synchronize` waits, for timing
or before handing memory to code that does not order itself after that stream.
Device memory a tensor frees stays in qdispatch's cache (up to 8 GiB) and is
reused by the next allocation of its size, as framework allocators do:
cudaMalloc and cudaFree synchronise the device.  `empty_cache` gives it back
to the driver, for other libraries or processes sharing the GPU."""
from ._core import BackendKind, Device, get_backend
from .errors import ArgumentError
from .tensor_api import backend_for


def _gpu(device):
    dev = Device.parse(device)
    if dev.is_host:
        raise ArgumentError(f"'{dev}' is host memory: memory_info and empty_cache take a GPU, "
                            f"such as 'cuda' or 'cuda:1'")
    return dev


def synchronize(device=None):
    """Wait until the work queued on `device` is done (host devices: nothing to wait
    for).  Without a device, on every GPU, and where no GPU can run there is nothing
    to wait for: timing code runs as it is on any build.  A GPU named where none can
    run is a BackendUnavailableError saying why."""
    if device is None:
        cuda = get_backend(BackendKind.CUDA)
        if cuda.unavailable_reason(0) is None:
            for index in range(cuda.device_count()):
                cuda.synchronize(index)
        return
    dev = Device.parse(device)
    if dev.is_host:
        return
    _, backend = backend_for(dev)
    backend.synchronize(dev.index)


def memory_info(device="cuda"):
    """{'free', 'total', 'cached'} in bytes for one GPU: the driver's free and total
    memory, and what qdispatch holds freed for reuse (counted as used by the driver)."""
    dev, backend = backend_for(_gpu(device))
    return backend.memory_info(dev.index)


def empty_cache(device=None):
    """Give the freed device memory qdispatch keeps for reuse back to the driver, on
    every GPU or on `device`, with the unused part of the device's stream-ordered
    pool (the kernels' temporaries).  Tensors in use are untouched.  Without a usable cuda
    backend nothing is cached, and a call naming no device does nothing; one naming a
    GPU is a BackendUnavailableError saying why."""
    if device is None:
        get_backend(BackendKind.CUDA).empty_cache()
        return
    dev, backend = backend_for(_gpu(device))
    backend.empty_cache(dev.index)
