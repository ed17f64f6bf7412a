# cython: language_level=3
"""The cuda backend's device memory and kernels: a thin layer over the CUDA
runtime and the qd_cuda_* entry points of qdispatch.h.

All work is queued on the legacy default stream of the array's device, with
the GIL released.  Every CUDA call is checked: a failure becomes KernelError
with CUDA's own text, and running out of device memory CudaOutOfMemoryError
(after the cached blocks were given back and the allocation retried)."""
from cpython.pycapsule cimport (PyCapsule_GetName, PyCapsule_GetPointer, PyCapsule_IsValid,
                                PyCapsule_New, PyCapsule_SetName)
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc

from .dlpack cimport (DLManagedTensor, DLTensor, kDLBfloat, kDLCUDA, kDLFloat, kDLInt,
                     kDLUInt)

import os
import sys

import numpy as np

from ._core import ITEMSIZE
from .errors import (NOT_IN_CUDA_GRAPHS, ArgumentError, ArgumentTypeError, BackendUnavailableError,
                     CudaOutOfMemoryError, KernelError, NonFiniteError, ScaleOverflowError)


# ---- the CUDA runtime (linked statically) ------------------------------------

cdef extern from "cuda_runtime_api.h" nogil:
    ctypedef int cudaError_t
    ctypedef void *cudaStream_t
    ctypedef void *cudaEvent_t
    ctypedef void *cudaMemPool_t
    cdef enum cudaMemPoolAttr:
        cudaMemPoolAttrReservedMemCurrent
    cdef enum cudaStreamCaptureStatus:
        cudaStreamCaptureStatusNone
        cudaStreamCaptureStatusActive
        cudaStreamCaptureStatusInvalidated
    cdef enum cudaStreamCaptureMode:
        cudaStreamCaptureModeRelaxed
    cdef int cudaSuccess
    cdef int cudaErrorMemoryAllocation
    cdef int cudaErrorInitializationError
    cdef int cudaMemcpyHostToDevice
    cdef int cudaMemcpyDeviceToHost
    cdef int cudaMemcpyDeviceToDevice
    cdef int cudaEventDisableTiming
    cdef struct cudaDeviceProp:
        char name[256]
        size_t totalGlobalMem
        int major
        int minor
        int multiProcessorCount
    cudaError_t cudaGetDeviceCount(int *count)
    cudaError_t cudaGetDevice(int *device)
    cudaError_t cudaSetDevice(int device)
    cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device)
    cudaError_t cudaDriverGetVersion(int *version)
    cudaError_t cudaRuntimeGetVersion(int *version)
    cudaError_t cudaMalloc(void **ptr, size_t size)
    cudaError_t cudaFree(void *ptr)
    cudaError_t cudaMemGetInfo(size_t *free, size_t *total)
    cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *pool, int device)
    cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep)
    cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value)
    cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind)
    cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t s)
    cudaError_t cudaStreamSynchronize(cudaStream_t s)
    cudaError_t cudaDeviceSynchronize()
    cudaError_t cudaGetLastError()
    cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags)
    cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t s)
    cudaError_t cudaEventDestroy(cudaEvent_t event)
    cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t event, unsigned flags)
    cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus *status)
    cudaError_t cudaEventQuery(cudaEvent_t event)
    cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode *mode)
    const char *cudaGetErrorString(cudaError_t err)
    const char *cudaGetErrorName(cudaError_t err)


from qdispatch.qdispatch_c cimport *


DTYPES = {"float32": QD_CUDA_F32, "float16": QD_CUDA_F16, "bfloat16": QD_CUDA_BF16,
          "int8": QD_CUDA_S8, "int32": QD_CUDA_S32, "uint32": -1, "int64": -1}  # -1: no kernel's data
# numpy form of each dtype on the host (bfloat16 travels as its uint16 bits)
HOST_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
               "int8": np.int8, "int32": np.int32, "uint32": np.uint32, "int64": np.int64}
VALUE_KINDS = {"q8s": 0, "q8f": 1, "q4s": 2, "q4f": 3, "q2s": 4, "q2f": 5}
SCALE_DTYPES = {"f32": 0, "f16": 1, "bf16": 2}


cdef str _cuda_text(cudaError_t err):
    return f"{cudaGetErrorName(err).decode()}: {cudaGetErrorString(err).decode()}"


cdef int _check(cudaError_t err, str what) except -1:
    if err == cudaSuccess:
        return 0
    cudaGetLastError()  # clear a non-sticky error so later calls start clean
    if err == cudaErrorMemoryAllocation:
        raise CudaOutOfMemoryError(f"CUDA out of memory in {what} ({_cuda_text(err)})")
    raise KernelError(f"CUDA error in {what}: {_cuda_text(err)}")


cdef int _status(qd_status st, str what) except -1:
    if st == QD_OK:
        return 0
    cdef int device = 0
    if st == QD_ERR_NO_MEMORY:  # a kernel's own scratch: the cached blocks go back, so that a retry may fit
        text = qd_cuda_last_error().decode()
        if cudaGetDevice(&device) == cudaSuccess:
            _release_cache(device)
        raise CudaOutOfMemoryError(f"CUDA out of memory in {what} ({text}); qdispatch's cached blocks were "
                                   f"given back, so the call may fit if repeated")
    if st == QD_ERR_CUDA:
        raise KernelError(f"CUDA error in {what}: {qd_cuda_last_error().decode()}")
    if st == QD_ERR_CUDA_UNAVAILABLE:
        raise BackendUnavailableError(f"{what} can't run: {qd_cuda_last_error().decode()}")
    raise KernelError(f"{what} rejected its arguments (qd_status {st})")


# ---- fork ----------------------------------------------------------------------
# CUDA does not survive fork: in a process forked after this one started CUDA, CUDA's
# calls fail, or wait forever on a lock some thread held at the fork.  Such a child
# refuses GPU work before any CUDA call, and leaves the parent's memory alone.

FORKED = ("this process was forked from one that had started CUDA (used the GPU or asked for its devices), "
          "and CUDA does not survive fork: "
          "start worker processes that use the GPU with multiprocessing's 'spawn' or 'forkserver' "
          "method (multiprocessing.get_context('spawn'))")

cdef bint _used = False  # CUDA was started here (cuInit: asked for devices, or made one current)
cdef set _devices_entered = set()  # every device made current for work: empty_cache trims their pools
cdef bint _forked_after_use = False
cdef bint _forked = False  # this process is a forked child (its parent may have started CUDA through another library)


def _mark_forked():
    global _forked_after_use, _forked, _cached_bytes
    _forked, _forked_after_use = True, _used
    if _used:  # the parent's cached blocks: not ours to free, and CUDA here can't reach them
        _free_blocks.clear()
        _cached_bytes = 0


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_mark_forked)


cdef inline int _refuse_if_forked() except -1:
    if _forked_after_use:
        raise BackendUnavailableError(f"The cuda backend is unavailable in this process: {FORKED}")
    return 0


def forked_after_use():
    """Whether this process was forked after its parent started CUDA (see FORKED)."""
    return bool(_forked_after_use)


# ---- devices -------------------------------------------------------------------

def device_count():
    """Number of CUDA devices, 0 when there is no driver or no GPU."""
    global _used
    if _forked_after_use:
        return 0
    _used = True
    cdef int n = 0
    if cudaGetDeviceCount(&n) != cudaSuccess:
        cudaGetLastError()
        return 0
    return n


def unavailable_reason():
    """None when a device can run, else what CUDA said (or FORKED)."""
    global _used, _forked_after_use
    if _forked_after_use:
        return FORKED
    _used = True
    cdef int n = 0
    cdef cudaError_t err = cudaGetDeviceCount(&n)
    if err != cudaSuccess:
        cudaGetLastError()
        if err == cudaErrorInitializationError and _forked:  # another library started CUDA in the parent
            _forked_after_use = True
            return FORKED
        return _cuda_text(err)
    return None if n > 0 else "no CUDA device present"


def versions():
    cdef int driver = 0, runtime = 0
    cudaDriverGetVersion(&driver)
    cudaRuntimeGetVersion(&runtime)
    return {"driver": driver, "runtime": runtime}


def device_properties(int index):
    global _used
    cdef cudaDeviceProp prop
    _refuse_if_forked()
    _used = True
    _check(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties")
    return {"name": prop.name.decode(), "memory": int(prop.totalGlobalMem),
            "capability": f"{prop.major}.{prop.minor}", "multiprocessors": prop.multiProcessorCount}


cdef class on_device:
    """Makes `index` the current device for a block, restoring the previous one."""
    cdef int index, previous

    def __cinit__(self, int index):
        self.index = index

    def __enter__(self):
        self.previous = _switch_device(self.index)

    def __exit__(self, *exc):
        _restore_device(self.previous, self.index)
        return False


cdef int _switch_device(int device) except -1:
    """Makes `device` current and returns the device that was (on_device without an
    object, for calls made per decode step)."""
    global _used
    _refuse_if_forked()
    cdef int previous = 0
    _check(cudaGetDevice(&previous), "cudaGetDevice")
    if previous != device:
        _check(cudaSetDevice(device), f"cudaSetDevice({device})")
    _used = True
    _devices_entered.add(device)
    return previous


cdef void _restore_device(int previous, int device) noexcept:
    if previous != device:
        cudaSetDevice(previous)


# ---- memory --------------------------------------------------------------------
# Freed blocks are kept per (device, size) and reused, as framework allocators do:
# cudaMalloc/cudaFree synchronise the device and would dominate small calls.
# All work runs on each device's default stream, so reuse is ordered after use.

cdef dict _free_blocks = {}
cdef size_t _cached_bytes = 0
cdef size_t CACHE_LIMIT = 8 << 30


cdef size_t _bin(size_t nbytes):
    return max(512, (nbytes + 511) // 512 * 512)


cdef void _release_cache(int device, bint wait=False):
    """The cached blocks of `device` back to the driver, and the unused part of its
    pool: all of it after `wait` (the device's queued work done first), which no
    call that may run inside a CUDA graph capture asks for."""
    global _cached_bytes
    for key in list(_free_blocks):
        if key[0] != device:
            continue
        blocks = _free_blocks.pop(key)
        kept = [p for p in blocks if not _freed(<void *><uintptr_t>p, device)]  # one refused stays cached
        if kept:
            _free_blocks[key] = kept
        _cached_bytes -= key[1] * (len(blocks) - len(kept))
    _trim_pool(device, wait)


cdef void _trim_pool(int device, bint wait) noexcept nogil:
    """The kernels' temporaries (split sums, spread operands) come from the device's
    stream-ordered pool, which keeps what they gave back, up to its release
    threshold (another library, such as CuPy, may have raised it): the unused part
    goes back to the driver.  Memory freed in stream order counts as unused only
    once a synchronizing call has seen the free (a copy back to the host does not)."""
    cdef cudaMemPool_t pool
    cdef QuietScope scope
    _enter_quietly(&scope, device)
    if wait and cudaDeviceSynchronize() != cudaSuccess:
        cudaGetLastError()  # a sticky fault is the next call's to report
    if cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess or cudaMemPoolTrimTo(pool, 0) != cudaSuccess:
        cudaGetLastError()  # a pool that can't be asked holds nothing of ours to give back
    _leave_quietly(&scope)


def pool_reserved_bytes(int device):
    """Bytes the device's stream-ordered pool holds (in use or kept)."""
    cdef cudaMemPool_t pool
    cdef uint64_t reserved = 0
    with on_device(device):
        _check(cudaDeviceGetDefaultMemPool(&pool, device), "cudaDeviceGetDefaultMemPool")
        _check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved),
               "cudaMemPoolGetAttribute")
    return int(reserved)


def empty_cache(int device=-1):
    """Give the cached blocks of one device back to the driver, and the unused part
    of its pool; -1: of every device that holds blocks or ran work, and of the current one."""
    cdef int current = 0
    if _forked_after_use:  # the parent's memory, which CUDA here can't reach
        return
    devices = {device} if device >= 0 else {k[0] for k in _free_blocks} | _devices_entered
    if device < 0 and _used:
        if cudaGetDevice(&current) == cudaSuccess:
            devices.add(current)
        else:
            cudaGetLastError()
    for dev in devices:
        with on_device(dev):
            _release_cache(dev, True)


def cached_bytes(int device):
    """Bytes of freed blocks kept for reuse on one device."""
    return sum(size * len(blocks) for (dev, size), blocks in _free_blocks.items() if dev == device)


# ---- ordering streams ------------------------------------------------------------
# What runs when memory is released (possibly while another library captures a CUDA
# graph, possibly with another GPU current) runs in a quiet scope: relaxed capture
# mode, so that its event calls don't disturb that capture, on the memory's device.

cdef struct QuietScope:
    int device, previous
    cudaStreamCaptureMode mode


cdef void _enter_quietly(QuietScope *scope, int device) noexcept nogil:
    scope.mode = cudaStreamCaptureModeRelaxed
    cudaThreadExchangeStreamCaptureMode(&scope.mode)
    scope.device = device
    cudaGetDevice(&scope.previous)
    if scope.previous != device:
        cudaSetDevice(device)


cdef void _leave_quietly(QuietScope *scope) noexcept nogil:
    cudaGetLastError()  # what failed in the scope was handled there
    if scope.previous != scope.device:
        cudaSetDevice(scope.previous)
    cudaThreadExchangeStreamCaptureMode(&scope.mode)


cdef cudaError_t _order_after(cudaStream_t waiter, cudaStream_t producer) noexcept nogil:
    """`waiter` waits for the work queued on `producer` so far (an event between them)."""
    cdef cudaEvent_t ev
    cdef cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)
    if err != cudaSuccess:
        return err
    err = cudaEventRecord(ev, producer)
    if err == cudaSuccess:
        err = cudaStreamWaitEvent(waiter, ev, 0)
    cudaEventDestroy(ev)
    return err


# ---- memory lent by other libraries ----------------------------------------------
# A DLPack producer's (or a viewed torch tensor's) memory goes back to its owner when
# our Tensor over it dies, but our kernels reading it may still be queued.  The
# owner's allocator could then give it to a new tensor on another stream, written
# before our kernel reads.  So it goes back once our stream has passed an event
# recorded at release; until then `_lent` holds it.  When the producer's stream is
# known (a viewed torch tensor), that stream waits for the event too, so that the
# owner's own later writes to the memory come after our reads.

cdef list _lent = []  # (event, DLManagedTensor address or 0, owner or None)


cdef void _give_back_after_our_stream(int device, uintptr_t managed, object owner,
                                      cudaStream_t producer) noexcept:
    if _lent is None:  # the module never finished its import: nothing waits
        _give_back(managed)
        return
    cdef cudaEvent_t ev = NULL
    cdef cudaStreamCaptureStatus status
    cdef QuietScope scope
    _enter_quietly(&scope, device)
    if cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess:
        if cudaEventRecord(ev, NULL) != cudaSuccess:
            cudaEventDestroy(ev)
            ev = NULL
        # a capturing producer ran nothing yet, and an outside event would invalidate its capture
        elif producer != NULL and cudaStreamIsCapturing(producer, &status) == cudaSuccess and \
                status == cudaStreamCaptureStatusNone and cudaStreamWaitEvent(producer, ev, 0) != cudaSuccess:
            cudaDeviceSynchronize()
    if ev == NULL:  # no event to wait on: the device waits
        cudaDeviceSynchronize()
    _leave_quietly(&scope)
    if ev == NULL:
        _give_back(managed)
        return
    _lent.append((<uintptr_t>ev, managed, owner))
    _give_back_passed()


cdef void _give_back(uintptr_t managed) noexcept:
    cdef DLManagedTensor *m = <DLManagedTensor *>managed
    if m != NULL and m.deleter != NULL:
        m.deleter(m)


cdef void _give_back_passed() noexcept:
    """Gives back the lent memory whose events our stream has passed."""
    global _lent
    cdef cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed
    pending, _lent = _lent, []  # an owner's deleter may free more of ours, which lands in _lent
    still = []
    cudaThreadExchangeStreamCaptureMode(&mode)
    for entry in pending:
        if cudaEventQuery(<cudaEvent_t><uintptr_t>entry[0]) == cudaSuccess:
            cudaEventDestroy(<cudaEvent_t><uintptr_t>entry[0])
            _give_back(entry[1])  # an owner goes with the entry
        else:
            still.append(entry)
    cudaGetLastError()  # "not ready" is no error
    cudaThreadExchangeStreamCaptureMode(&mode)
    _lent = still + _lent


def lent_count():
    """How many lent blocks wait for our stream before going back to their owners."""
    return len(_lent)


cdef object _torch_raw_stream = None  # torch's current stream of a GPU, once torch's CUDA state exists


cdef int _refuse_inside_torch_capture(int device) except -1:
    """qdispatch's own calls run on our stream at once.  Inside a torch graph capture
    they would run now, outside the graph, and a replay would not repeat them: stale
    results later.  Every such call allocates its output, so allocation refuses it.
    torch can only be capturing once its CUDA state exists (never set up here)."""
    global _torch_raw_stream
    if _torch_raw_stream is None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return 0
        from .torch import _current_raw_stream  # qdispatch.torch's getter: one place knows torch's API
        _torch_raw_stream = _current_raw_stream
    cdef uintptr_t stream = _torch_raw_stream(device)
    if stream != 0 and capturing(stream):
        raise KernelError(f"torch is capturing a CUDA graph on cuda:{device}: this qdispatch call would run "
                          f"now, outside the graph, and a replay would not repeat it. In a graph, multiply torch "
                          f"tensors with qdispatch.torch (q_matmul, QLinear); run other qdispatch calls outside "
                          f"the captured region. The capture is left as it was.")
    return 0


cdef bint _freed(void *ptr, int device) noexcept nogil:
    """cudaFree, in a quiet scope: another library may be capturing a graph now."""
    cdef QuietScope scope
    _enter_quietly(&scope, device)
    cdef bint ok = cudaFree(ptr) == cudaSuccess
    _leave_quietly(&scope)
    return ok


cdef class DeviceBuffer:
    """Device memory: owned (from the cache or cudaMalloc), borrowed from a DLPack
    producer and handed back through its deleter, or viewed in a Python object
    that owns it (`owner`, kept alive meanwhile)."""
    cdef void *ptr
    cdef readonly size_t nbytes
    cdef readonly int device
    cdef DLManagedTensor *borrowed
    cdef object owner
    cdef bint viewed  # a flag, not `owner is None`: a collector may clear owner first
    cdef cudaStream_t producer  # viewed memory's producer stream when it is not ours, else NULL

    @staticmethod
    cdef DeviceBuffer allocate(size_t nbytes, int device):
        global _cached_bytes
        _refuse_if_forked()
        _refuse_inside_torch_capture(device)
        cdef DeviceBuffer b = DeviceBuffer.__new__(DeviceBuffer)
        cdef size_t size = _bin(nbytes)
        cdef void *p = NULL
        cdef cudaError_t err
        cdef size_t free_b = 0, total_b = 0
        b.nbytes, b.device = size, device
        if _lent:
            _give_back_passed()
        blocks = _free_blocks.get((device, size))
        if blocks:
            b.ptr = <void *><uintptr_t>blocks.pop()
            _cached_bytes -= size
            return b
        err = cudaMalloc(&p, size)
        if err == cudaErrorMemoryAllocation:  # (refused above inside a torch capture: may wait)
            cudaGetLastError()
            _release_cache(device, True)
            err = cudaMalloc(&p, size)
        if err == cudaErrorMemoryAllocation:
            cudaGetLastError()
            cudaMemGetInfo(&free_b, &total_b)
            raise CudaOutOfMemoryError(
                f"CUDA out of memory on cuda:{device}: tried to allocate {size / 2**20:.1f} MiB with "
                f"{free_b / 2**20:.1f} MiB free of {total_b / 2**20:.1f} MiB. Free tensors you no "
                f"longer need or use smaller operands; the process can go on.")
        _check(err, f"cudaMalloc({size})")
        b.ptr = p
        return b

    def __dealloc__(self):
        global _cached_bytes
        if _forked_after_use:  # the parent's memory, which CUDA here can't reach
            if self.borrowed != NULL:
                _give_back(<uintptr_t>self.borrowed)
            return
        if self.borrowed != NULL:  # a DLPack producer's stream is unknown: always after ours
            _give_back_after_our_stream(self.device, <uintptr_t>self.borrowed, None, NULL)
            return
        if self.viewed:  # the owner frees it
            if self.producer != NULL and self.owner is not None:
                _give_back_after_our_stream(self.device, 0, self.owner, self.producer)
            return
        if self.ptr == NULL:
            return
        if _cached_bytes + self.nbytes > CACHE_LIMIT and _freed(self.ptr, self.device):
            return
        # kept for reuse (also a block the driver would not free now: empty_cache tries again)
        _free_blocks.setdefault((self.device, self.nbytes), []).append(<uintptr_t>self.ptr)
        _cached_bytes += self.nbytes


cdef class DeviceArray:
    """A C-contiguous array in device memory: a buffer, a byte offset, a shape
    and a dtype name (float32/float16/bfloat16/int8/int32/uint32)."""
    cdef readonly DeviceBuffer buffer
    cdef readonly size_t offset
    cdef readonly tuple shape
    cdef readonly str dtype

    def __cinit__(self, DeviceBuffer buffer, size_t offset, tuple shape, str dtype):
        self.buffer, self.offset, self.shape, self.dtype = buffer, offset, shape, dtype

    @property
    def device(self):
        return self.buffer.device

    @property
    def size(self):
        cdef int64_t n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self):
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self):
        return self.size * ITEMSIZE[self.dtype]

    @property
    def ptr(self):
        return <uintptr_t>self.buffer.ptr + self.offset

    def view(self, shape, dtype=None):
        """The same memory with another shape (and dtype of the same total size)."""
        shape = tuple(int(d) for d in shape)
        out = DeviceArray(self.buffer, self.offset, shape, dtype or self.dtype)
        if out.nbytes != self.nbytes:
            raise ArgumentError(f"Can't view {self.shape} {self.dtype} as {shape} {dtype or self.dtype}")
        return out

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device=cuda:{self.device})"


cdef inline void *P(DeviceArray a):
    return <void *>(<uintptr_t>a.buffer.ptr + a.offset)


def empty(shape, str dtype, int device):
    shape = tuple(int(d) for d in shape)
    cdef int64_t n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    with on_device(device):
        return DeviceArray(DeviceBuffer.allocate(n, device), 0, shape, dtype)


def from_host(array, str dtype, int device):
    """Copy a numpy array (bfloat16 as uint16 bits) to a new device array."""
    host = np.asarray(array, dtype=HOST_DTYPES[dtype], order="C")  # a 0-d array stays 0-d
    out = empty(host.shape, dtype, device)
    cdef size_t n = host.nbytes
    cdef uintptr_t src = host.ctypes.data
    cdef void *dst = P(out)
    cdef cudaError_t err
    if n:
        with on_device(device):
            with nogil:
                err = cudaMemcpy(dst, <void *>src, n, cudaMemcpyHostToDevice)
            _check(err, "copy to device")
    return out


def to_host(DeviceArray a):
    """A numpy copy of a device array (waits for the work that writes it)."""
    host = np.empty(a.shape, dtype=HOST_DTYPES[a.dtype])
    cdef size_t n = host.nbytes
    cdef uintptr_t dst = host.ctypes.data
    cdef void *src = P(a)
    cdef cudaError_t err
    if n:
        with on_device(a.device):
            with nogil:
                err = cudaMemcpy(<void *>dst, src, n, cudaMemcpyDeviceToHost)
            _check(err, "copy to host")
    return host


def copy_into(DeviceArray dst, size_t dst_offset, DeviceArray src):
    """dst's bytes from dst_offset on = src's bytes (same device)."""
    cdef size_t n = src.nbytes
    cdef void *d = <void *>(<uintptr_t>P(dst) + dst_offset)
    cdef void *s = P(src)
    cdef cudaError_t err
    if dst_offset + n > dst.nbytes:
        raise ArgumentError("copy_into: source does not fit")
    with on_device(dst.device):
        with nogil:
            err = cudaMemcpyAsync(d, s, n, cudaMemcpyDeviceToDevice, NULL)
        _check(err, "device copy")


def synchronize(int device):
    cdef cudaError_t err
    with on_device(device):
        with nogil:
            err = cudaDeviceSynchronize()
        _check(err, "cudaDeviceSynchronize")
    _give_back_passed()


def memory_info(int device):
    cdef size_t free_b = 0, total_b = 0
    with on_device(device):
        _check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo")
    return {"free": int(free_b), "total": int(total_b), "cached": cached_bytes(device)}


# ---- dense kernels -------------------------------------------------------------

def cast(DeviceArray a, str dtype):
    out = empty(a.shape, dtype, a.device)
    cdef void *src = P(a)
    cdef void *dst = P(out)
    cdef int sd = DTYPES[a.dtype], dd = DTYPES[dtype]
    cdef int64_t n = a.size
    cdef qd_status st
    if n == 0:  # nothing to convert (an empty torch tensor's view has no address)
        return out
    with on_device(a.device):
        with nogil:
            st = qd_cuda_cast(src, sd, dst, dd, n, NULL)
        _status(st, "cast")
    return out


def transpose2(DeviceArray a):
    """Swap the last two dims (a copy: device arrays stay C-contiguous)."""
    shape = a.shape
    rows, cols = shape[-2], shape[-1]
    out = empty(shape[:-2] + (cols, rows), a.dtype, a.device)
    cdef int64_t batch = a.size // max(1, rows * cols)
    cdef int64_t r = rows, c = cols
    cdef int es = ITEMSIZE[a.dtype]
    cdef void *src = P(a)
    cdef void *dst = P(out)
    cdef qd_status st = QD_OK
    cdef int64_t b0, nb
    if a.size == 0:
        return out
    with on_device(a.device):
        b0 = 0
        while b0 < batch and st == QD_OK:  # the grid's z dimension holds 65535 matrices
            nb = min(batch - b0, 65535)
            with nogil:
                st = qd_cuda_transpose(<char *>src + b0 * r * c * es, nb, r, c, es,
                                       <char *>dst + b0 * r * c * es, NULL)
            b0 += nb
        _status(st, "transpose")
    return out


def pad_rows(DeviceArray a, int64_t ld):
    """[rows, cols] -> [rows, ld], zero beyond cols (any dtype: padding is by bytes)."""
    rows, cols = a.shape
    es = ITEMSIZE[a.dtype]
    out = empty((rows, ld), a.dtype, a.device)
    cdef int64_t r = rows, cb = cols * es, ldb = ld * es
    cdef void *src = P(a)
    cdef void *dst = P(out)
    cdef qd_status st
    with on_device(a.device):
        with nogil:
            st = qd_cuda_pad_s8(<int8_t *>src, r, cb, <int8_t *>dst, ldb, NULL)
        _status(st, "pad")
    return out


def add_bias(DeviceArray x, DeviceArray bias):
    out = empty(x.shape, "float32", x.device)
    if out.size == 0:  # no rows (or no columns): nothing to add, no launch
        return out
    cdef int64_t cols = x.shape[-1]
    cdef int64_t rows = x.size // cols
    cdef void *px = P(x)
    cdef void *pb = P(bias)
    cdef void *po = P(out)
    cdef qd_status st
    with on_device(x.device):
        with nogil:
            st = qd_cuda_add_bias_f32(<float *>px, rows, cols, <float *>pb, <float *>po, NULL)
        _status(st, "add_bias")
    return out


def pack_u32(DeviceArray q, int bits):
    """int8 [..., n] -> uint32 words [..., ceil(n / (32/bits))]."""
    n = q.shape[-1]
    per = 32 // bits
    out = empty(q.shape[:-1] + (-(-n // per),), "uint32", q.device)
    if q.size == 0:
        return out
    cdef int64_t cols = n, rows = q.size // n
    cdef void *src = P(q)
    cdef void *dst = P(out)
    cdef qd_status st
    with on_device(q.device):
        with nogil:
            st = qd_cuda_pack_u32(<int8_t *>src, rows, cols, bits, <uint32_t *>dst, NULL)
        _status(st, "pack_u32")
    return out


def unpack_u32(DeviceArray words, int bits, int64_t n):
    """uint32 words [..., w] -> int8 [..., n]."""
    out = empty(words.shape[:-1] + (n,), "int8", words.device)
    if out.size == 0:
        return out
    cdef int64_t rows = out.size // n
    cdef void *src = P(words)
    cdef void *dst = P(out)
    cdef qd_status st
    with on_device(words.device):
        with nogil:
            st = qd_cuda_unpack_u32(<uint32_t *>src, rows, n, bits, <int8_t *>dst, NULL)
        _status(st, "unpack_u32")
    return out


def element(DeviceArray a, int64_t flat):
    """One element, copied to the host (for error messages)."""
    return to_host(DeviceArray(a.buffer, a.offset + flat * ITEMSIZE[a.dtype], (1,), a.dtype))[0]


# ---- quantization --------------------------------------------------------------

def quantize(DeviceArray x, str value, int64_t block_rows, int64_t block_cols, str scale_dtype):
    """x float32, float16 or bfloat16 [rows, cols] -> (int8 values, float32 scales
    [rows/br, cols/bc]), as quantizing x's float32 copy gives them.

    Raises NonFiniteError(flat index in .index) or ScaleOverflowError(.index)."""
    rows, cols = x.shape
    q = empty((rows, cols), "int8", x.device)
    scales = empty((rows // block_rows, cols // block_cols), "float32", x.device)
    scratch = empty((QD_CUDA_QUANTIZE_SCRATCH,), "int8", x.device)
    cdef int64_t r = rows, c = cols, bad = -1
    cdef int vk = VALUE_KINDS[value], sd = SCALE_DTYPES[scale_dtype], xd = DTYPES[x.dtype]
    cdef void *px = P(x)
    cdef void *pq = P(q)
    cdef void *ps = P(scales)
    cdef void *pw = P(scratch)
    cdef qd_status st
    with on_device(x.device):
        with nogil:
            st = qd_cuda_quantize(px, xd, r, c, vk, block_rows, block_cols, sd, <float *>ps, <int8_t *>pq, pw,
                                  &bad, NULL)
    if st == QD_ERR_NOT_FINITE:
        err = NonFiniteError("non-finite input")
        err.index = bad
        raise err
    if st == QD_ERR_SCALE_OVERFLOW:
        err = ScaleOverflowError("scale overflow")
        err.index = bad
        raise err
    _status(st, "quantize")
    return q, scales


def largest_magnitude(DeviceArray a):
    """The largest |value| of a float32 device array (0.0 for an empty one), found on
    the device: 4 bytes come to the host, not the array."""
    if a.dtype != "float32":
        raise ArgumentTypeError(f"largest_magnitude takes float32, got {a.dtype}")
    cdef int64_t n = a.size
    if n == 0:
        return 0.0
    scratch = empty((QD_CUDA_QUANTIZE_SCRATCH,), "int8", a.device)
    cdef float largest = 0.0
    cdef void *pa = P(a)
    cdef void *pw = P(scratch)
    cdef qd_status st
    with on_device(a.device):
        with nogil:
            st = qd_cuda_largest_magnitude(<const float *>pa, n, &largest, pw, NULL)
    if st == QD_ERR_NOT_FINITE:
        raise NonFiniteError("a NaN or an infinity among the values")
    _status(st, "largest_magnitude")
    return float(largest)


def dequantize(DeviceArray values, int bits, int64_t rows, int64_t cols, DeviceArray scales,
               int64_t block_rows, int64_t block_cols, str dtype="float32", bint tiled=False):
    """dtype [rows, cols] = values * scales (the float32 product, rounded once to a
    16-bit dtype); bits = 0 for int8 values, else packed words, or with `tiled` the
    weight's fq tiles of `bits`."""
    out = empty((rows, cols), dtype, values.device)
    dequantize_rows_into(values, bits, rows, cols, scales, block_rows, block_cols, 0, rows, <uintptr_t>P(out),
                         dtype, tiled, 0)
    return out


def dequantize_rows(DeviceArray values, int bits, int64_t rows, int64_t cols, DeviceArray scales,
                    int64_t block_rows, int64_t block_cols, DeviceArray ids, str dtype, bint tiled=False):
    """Rows `ids` (int64 [n]) of dequantize's product, as dtype [n, cols].  With
    `tiled`, `values` are the weight's fq tiles (fq_tile_weights) of `bits`."""
    out = empty((ids.shape[0], cols), dtype, values.device)
    dequantize_rows_into(values, bits, rows, cols, scales, block_rows, block_cols, <uintptr_t>P(ids),
                         ids.shape[0], <uintptr_t>P(out), dtype, tiled, 0)
    return out


def dequantize_rows_into(DeviceArray values, int bits, int64_t rows, int64_t cols, DeviceArray scales,
                         int64_t block_rows, int64_t block_cols, uintptr_t ids, int64_t n, uintptr_t out,
                         str dtype, bint tiled, uintptr_t stream):
    """dequantize_rows on ids and out another library may own (device addresses: int64
    ids [n], or 0 for every row in turn; out [n, cols] of dtype, dense), queued on
    `stream` (0: ours).  Nothing here allocates or synchronizes, so a CUDA graph can
    capture it."""
    cdef void *pv = P(values)
    cdef void *ps = P(scales)
    cdef int code = DTYPES[dtype]
    cdef qd_status st
    cdef int device = values.buffer.device
    cdef int previous = _switch_device(device)
    try:
        with nogil:
            if tiled:
                st = qd_cuda_fq_dequantize_rows(pv, bits, rows, cols, <float *>ps, block_rows, block_cols,
                                                <const int64_t *>ids, n, <void *>out, code, <void *>stream)
            else:
                st = qd_cuda_dequantize_rows(pv, bits, rows, cols, <float *>ps, block_rows, block_cols,
                                             <const int64_t *>ids, n, <void *>out, code, <void *>stream)
        _status(st, "dequantize_rows")
    finally:
        _restore_device(previous, device)


# ---- matmuls -------------------------------------------------------------------

def int_matmul(DeviceArray a, DeviceArray bt, int64_t K):
    """a [M, ld] int8 @ bt [N, ld]^T over the first K -> int32 [M, N]."""
    M, ld = a.shape
    N = bt.shape[0]
    out = empty((M, N), "int32", a.device)
    cdef int64_t m = M, n = N, l = ld
    cdef void *pa = P(a)
    cdef void *pb = P(bt)
    cdef void *po = P(out)
    cdef qd_status st
    with on_device(a.device):
        with nogil:
            st = qd_cuda_int_matmul_s8(<int8_t *>pa, <int8_t *>pb, m, n, K, l, <int32_t *>po, NULL)
        _status(st, "int_matmul")
    return out


def qq_matmul(DeviceArray a, DeviceArray bt, int64_t K, DeviceArray sa, int64_t a_block_m,
              int64_t a_block_k, DeviceArray sb, int64_t b_block_n, int64_t b_block_k,
              str out_dtype="float32"):
    """Scaled int8 product: a [M, ld], bt [N, ld]; sa [M/bm, K/bka], sb [N/bn, K/bkb]."""
    M, ld = a.shape
    N = bt.shape[0]
    out = empty((M, N), out_dtype, a.device)
    cdef int64_t m = M, n = N, l = ld
    cdef int od = DTYPES[out_dtype]
    cdef void *pa = P(a)
    cdef void *pb = P(bt)
    cdef void *psa = P(sa)
    cdef void *psb = P(sb)
    cdef void *po = P(out)
    cdef qd_status st
    with on_device(a.device):
        with nogil:
            st = qd_cuda_qq_matmul(<int8_t *>pa, <int8_t *>pb, m, n, K, l, <float *>psa, a_block_m,
                                   a_block_k, <float *>psb, b_block_n, b_block_k, po, od, NULL)
        _status(st, "qq_matmul")
    return out


def fq_supported(int bits, int64_t K, int64_t block_k):
    return bool(qd_cuda_fq_supported(bits, K, block_k))


def fq_wide_supported():
    return bool(qd_cuda_fq_wide_supported())


def set_batch_invariant(bint on):
    qd_cuda_set_batch_invariant(on)


def batch_invariant():
    return bool(qd_cuda_batch_invariant())


def fq_tile_weights(DeviceArray q, int64_t K, int bits):
    """int8 q [N, ld] (K-contiguous) -> the tiled form fq_matmul streams (uint32 words)."""
    N, ld = q.shape
    out = empty((qd_cuda_fq_tiles_bytes(N, K, bits) // 4,), "uint32", q.device)
    cdef int64_t n = N, l = ld
    cdef void *pq = P(q)
    cdef void *po = P(out)
    cdef qd_status st
    with on_device(q.device):
        with nogil:
            st = qd_cuda_fq_tile_weights(<int8_t *>pq, n, K, l, bits, po, NULL)
        _status(st, "fq_tile_weights")
    return out


def fq_untile_weights(DeviceArray tiles, int64_t N, int64_t K, int bits):
    """The tiled form back to int8 q [N, K] (the inverse of fq_tile_weights)."""
    out = empty((N, K), "int8", tiles.device)
    cdef void *pt = P(tiles)
    cdef void *po = P(out)
    cdef qd_status st
    with on_device(tiles.device):
        with nogil:
            st = qd_cuda_fq_untile_weights(pt, N, K, bits, <int8_t *>po, K, NULL)
        _status(st, "fq_untile_weights")
    return out


def fq_tile_scales(DeviceArray scales, int64_t N, int64_t K, int64_t block_n, int64_t block_k):
    """float32 scales [N/block_n, K/block_k] (row-major) -> the tiled form fq_matmul reads."""
    out = empty((qd_cuda_fq_scale_tiles_bytes(N, K, block_k) // 4,), "float32", scales.device)
    cdef void *ps = P(scales)
    cdef void *po = P(out)
    cdef qd_status st
    with on_device(scales.device):
        with nogil:
            st = qd_cuda_fq_tile_scales(<float *>ps, N, K, block_n, block_k, po, NULL)
        _status(st, "fq_tile_scales")
    return out


cpdef DeviceArray aligned_rows(DeviceArray x):
    """x, or a copy whose rows are whole 16-byte pieces on 16-byte bounds (zeros past its columns)."""
    cdef int64_t per16 = 16 // ITEMSIZE[x.dtype]
    if x.shape[1] % per16 or <uintptr_t>P(x) % 16:
        return pad_rows(x, -(-x.shape[1] // per16) * per16)
    return x


# The many-rows path of fq (the GEMM on the weight's values expanded to 16 bits) as
# calls on device addresses queued on `stream`: its temporaries come from the caller
# (our block cache, or another library's allocator while it captures a CUDA graph).

def fq_expand_weights_into(DeviceArray tiles, int64_t N, int64_t K, int bits, str dtype, uintptr_t w16,
                           int64_t ld, uintptr_t stream):
    """The tiled form's values as float16/bfloat16 rows w16 [N, ld] (ld: a multiple of 8,
    K <= ld, zeros past K), exact integers: fq_gemm_into's weight operand."""
    cdef void *pt = P(tiles)
    cdef int d = DTYPES[dtype]
    cdef qd_status st
    with on_device(tiles.device):
        with nogil:
            st = qd_cuda_fq_expand_weights(pt, N, K, bits, d, <void *>w16, ld, <void *>stream)
        _status(st, "fq_expand_weights")


def split_bf16_into(uintptr_t x, int64_t rows, int64_t cols, int64_t ldx, uintptr_t parts, int64_t ld,
                    int device, uintptr_t stream):
    """float32 x [rows, cols] (rows ldx apart) -> its three bfloat16 parts [3 * rows, ld]
    (hi rows, then mid, then lo; zeros past cols)."""
    cdef qd_status st
    with on_device(device):
        with nogil:
            st = qd_cuda_split_bf16(<float *>x, rows, cols, ldx, <void *>parts, ld, <void *>stream)
        _status(st, "split_bf16")


def scale_columns_into(uintptr_t x, str x_dtype, int64_t rows, int64_t cols, int64_t ldx, DeviceArray scales,
                       uintptr_t out, int64_t ld, uintptr_t stream):
    """float32 out [rows, ld] = x [rows, cols] (rows ldx apart) times scales[c] (float32
    [cols]) per column, rounded once; zeros past cols."""
    cdef void *ps = P(scales)
    cdef int xd = DTYPES[x_dtype]
    cdef qd_status st
    with on_device(scales.device):
        with nogil:
            st = qd_cuda_scale_columns(<void *>x, xd, rows, cols, ldx, <float *>ps, <float *>out, ld,
                                       <void *>stream)
        _status(st, "scale_columns")


def scale_columns(DeviceArray x, DeviceArray scales):
    """float32 [M, ld] = x [M, K] times scales[k] per column, ld = K rounded up to 4
    (rows of whole 16-byte pieces, zeros past K)."""
    cdef int64_t M = x.shape[0], K = x.shape[1], ld = (K + 3) // 4 * 4
    out = empty((M, ld), "float32", x.device)
    scale_columns_into(<uintptr_t>P(x), x.dtype, M, K, K, scales, <uintptr_t>P(out), ld, 0)
    return out


def sum3_into(uintptr_t a, int64_t n, uintptr_t out, str out_dtype, int device, uintptr_t stream):
    """float32 a [3][n] -> out[i] = a[i] + a[n + i] + a[2n + i] as out_dtype."""
    cdef int od = DTYPES[out_dtype]
    cdef qd_status st
    with on_device(device):
        with nogil:
            st = qd_cuda_sum3_f32(<float *>a, n, <void *>out, od, <void *>stream)
        _status(st, "sum3")


def fq_gemm_into(uintptr_t x, uintptr_t w16, str dtype, int64_t m, int64_t N, int64_t K, int64_t ld,
                 DeviceArray scales, int64_t block_n, int64_t block_k, uintptr_t out, str out_dtype,
                 uintptr_t stream):
    """out [m, N] (out_dtype) = x [m, ld] @ (w16 [N, ld] * scales)^T, x and w16 of one 16-bit
    dtype on 16-byte bounds, zeros past K; w16 from fq_expand_weights_into, scales
    [N/block_n, K/block_k] float32."""
    cdef void *ps = P(scales)
    cdef int d = DTYPES[dtype], od = DTYPES[out_dtype]
    cdef qd_status st
    with on_device(scales.device):
        with nogil:
            st = qd_cuda_fq_gemm(<void *>x, <void *>w16, d, m, N, K, ld, <float *>ps, block_n, block_k,
                                 <void *>out, od, <void *>stream)
        _status(st, "fq_gemm")


def fq_matmul(DeviceArray x, DeviceArray tiles, DeviceArray scale_tiles, int bits, int64_t N,
              int64_t K, int64_t block_k, str out_dtype="float32"):
    """x [M, ldx] (float32/float16/bfloat16) @ dequantize(w [N, K])^T -> out_dtype [M, N];
    `tiles` from fq_tile_weights, `scale_tiles` from fq_tile_scales."""
    x = aligned_rows(x)  # rows are copied in aligned 16-byte pieces
    # The call runs per decode step: no context-manager object, a direct allocation.
    cdef int device = x.buffer.device
    cdef int previous = _switch_device(device)
    try:
        out = DeviceArray(DeviceBuffer.allocate(x.shape[0] * N * ITEMSIZE[out_dtype], device), 0,
                          (x.shape[0], N), out_dtype)
        _fq_launch(P(x), DTYPES[x.dtype], x.shape[0], x.shape[1], tiles, scale_tiles, bits, N, K,
                   block_k, P(out), DTYPES[out_dtype], NULL)
    finally:
        _restore_device(previous, device)
    return out


def fq_matmul_into(uintptr_t x, str x_dtype, int64_t m, int64_t ldx, DeviceArray tiles,
                   DeviceArray scale_tiles, int bits, int64_t N, int64_t K, int64_t block_k,
                   uintptr_t out, str out_dtype, uintptr_t stream):
    """fq_matmul on memory another library owns, queued on its `stream` (a torch tensor's
    on torch's current stream, which may be capturing a CUDA graph): x [m, ldx] rows on
    16-byte bounds, ldx a multiple of 16 bytes, out [m, N] dense.  Nothing here
    allocates or synchronizes, so the call can be captured."""
    cdef int device = tiles.buffer.device
    cdef int previous = _switch_device(device)
    try:
        _fq_launch(<void *>x, DTYPES[x_dtype], m, ldx, tiles, scale_tiles, bits, N, K, block_k,
                   <void *>out, DTYPES[out_dtype], <void *>stream)
    finally:
        _restore_device(previous, device)


cdef int _fq_launch(void *px, int xd, int64_t m, int64_t ldx, DeviceArray tiles,
                    DeviceArray scale_tiles, int bits, int64_t N, int64_t K, int64_t block_k,
                    void *po, int od, void *stream) except -1:
    """The decode kernel's C call, on the current device, without the GIL."""
    cdef void *pw = P(tiles)
    cdef void *ps = P(scale_tiles)
    cdef qd_status st
    with nogil:
        st = qd_cuda_fq_matmul(px, xd, m, ldx, pw, ps, bits, N, K, block_k, po, od, stream)
    return _status(st, "fq_matmul")


def fq_values(DeviceArray x, DeviceArray w, DeviceArray scales, int64_t K, int64_t block_n, int64_t block_k,
              str out_dtype="float32"):
    """x [M, ldx] (float32/float16/bfloat16) @ (w * scales)^T -> out_dtype [M, N], w the
    weight's int8 values [N, ldw], scales [N/block_n, K/block_k]: any blocking along K."""
    cdef int device = x.buffer.device
    cdef int previous = _switch_device(device)
    try:
        out = DeviceArray(DeviceBuffer.allocate(x.shape[0] * w.shape[0] * ITEMSIZE[out_dtype], device), 0,
                          (x.shape[0], w.shape[0]), out_dtype)
        _fq_values_launch(P(x), DTYPES[x.dtype], x.shape[0], x.shape[1], w, scales, K, block_n, block_k,
                          P(out), DTYPES[out_dtype], NULL)
    finally:
        _restore_device(previous, device)
    return out


def fq_values_into(uintptr_t x, str x_dtype, int64_t m, int64_t ldx, DeviceArray w, DeviceArray scales,
                   int64_t K, int64_t block_n, int64_t block_k, uintptr_t out, str out_dtype, uintptr_t stream):
    """fq_values on memory another library owns, queued on its `stream` (which may be
    capturing a CUDA graph): x [m, ldx], out [m, N] dense.  Nothing here allocates or
    synchronizes."""
    cdef int device = w.buffer.device
    cdef int previous = _switch_device(device)
    try:
        _fq_values_launch(<void *>x, DTYPES[x_dtype], m, ldx, w, scales, K, block_n, block_k, <void *>out,
                          DTYPES[out_dtype], <void *>stream)
    finally:
        _restore_device(previous, device)


cdef int _fq_values_launch(void *px, int xd, int64_t m, int64_t ldx, DeviceArray w, DeviceArray scales,
                           int64_t K, int64_t block_n, int64_t block_k, void *po, int od,
                           void *stream) except -1:
    cdef void *pw = P(w)
    cdef void *ps = P(scales)
    cdef int64_t n = w.shape[0], ldw = w.shape[1]
    cdef qd_status st
    with nogil:
        st = qd_cuda_fq_values(px, xd, m, ldx, <int8_t *>pw, n, K, ldw, <float *>ps, block_n, block_k, po, od,
                               stream)
    return _status(st, "fq_values")


# ---- DLPack --------------------------------------------------------------------

_DL_CODES = {"float32": (kDLFloat, 32), "float16": (kDLFloat, 16), "bfloat16": (kDLBfloat, 16),
             "int8": (kDLInt, 8), "int32": (kDLInt, 32), "uint32": (kDLUInt, 32)}
_DL_NAMES = {v: k for k, v in _DL_CODES.items()}


cdef struct Export:
    DLManagedTensor managed  # first, so that the consumer's pointer is the export's
    uintptr_t consumer_stream  # the stream the consumer reads on, as DLPack's `stream` named it
    int device
    # the shape follows, in the same allocation


cdef void _export_deleter(DLManagedTensor *self) noexcept nogil:
    cdef Export *export = <Export *>self
    if export.consumer_stream > 2:  # not the legacy default stream nor one that syncs with it
        _wait_for_consumer(export.device, <cudaStream_t>export.consumer_stream)
    with gil:
        Py_DECREF(<object>self.manager_ctx)
    free(self)


cdef void _wait_for_consumer(int device, cudaStream_t consumer) noexcept nogil:
    """Our stream waits for what the consumer queued on its stream before it let go:
    the memory goes back to our block cache, whose next user runs on our stream.
    A capturing stream ran nothing yet (captured work runs at replay; torch syncs
    before a capture).  A stream that can't be queried is gone: then the device waits."""
    cdef cudaStreamCaptureStatus status
    cdef QuietScope scope
    _enter_quietly(&scope, device)
    if cudaStreamIsCapturing(consumer, &status) != cudaSuccess or \
            (status == cudaStreamCaptureStatusNone and _order_after(NULL, consumer) != cudaSuccess):
        cudaGetLastError()
        cudaDeviceSynchronize()
    _leave_quietly(&scope)


cdef void _capsule_destructor(object capsule) noexcept:
    # Only a capsule nobody consumed still owns its tensor.
    if PyCapsule_IsValid(capsule, b"dltensor"):
        (<DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")).deleter(
            <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor"))


def capturing(uintptr_t stream):
    """Whether `stream` (another library's, on any GPU) is capturing a CUDA graph."""
    cdef cudaStreamCaptureStatus status
    _check(cudaStreamIsCapturing(<cudaStream_t>stream, &status), "cudaStreamIsCapturing")
    return status != cudaStreamCaptureStatusNone


cdef int _stream_waits(int device, cudaStream_t waiter, cudaStream_t producer) except -1:
    """`waiter` waits for the work queued on `producer` so far; one of the two is
    ours (the legacy default stream, NULL), the other another library's.  A wait
    involving a stream that captures a CUDA graph would invalidate the capture:
    refused first, the capture left as it was."""
    cdef cudaStreamCaptureStatus status
    with on_device(device):
        _check(cudaStreamIsCapturing(producer if waiter == NULL else waiter, &status),
               "cudaStreamIsCapturing")
        if status != cudaStreamCaptureStatusNone:
            raise KernelError(f"A stream on cuda:{device} is capturing a CUDA graph; "
                              f"{NOT_IN_CUDA_GRAPHS}. The capture is left as it was.")
        _check(_order_after(waiter, producer), "an event ordering two streams")
    return 0


def stream_waits(int device, uintptr_t waiter, uintptr_t producer):
    """`waiter` waits for the work queued on `producer` so far, without the host
    waiting: raw handles, one of them 0 (ours, the legacy default stream)."""
    _stream_waits(device, <cudaStream_t>waiter, <cudaStream_t>producer)


cdef int _sync_consumer(int device, object stream) except -1:
    """DLPack's stream contract: work queued on our stream (the legacy default)
    must be visible to the consumer's stream before it reads."""
    if stream is None or stream == 1 or stream == -1:  # legacy default (ours), or "don't sync"
        return 0
    if stream == 0:
        raise ArgumentError("stream=0 is ambiguous for CUDA in DLPack: pass 1 for the legacy default stream")
    # 2 is the per-thread default stream, whose handle is cudaStreamPerThread (0x2)
    return _stream_waits(device, <cudaStream_t><uintptr_t>int(stream), NULL)


def view(uintptr_t ptr, tuple shape, str dtype, int device, object owner, uintptr_t producer_stream):
    """A DeviceArray over C-contiguous device memory that `owner` (a torch tensor,
    say) holds, kept alive meanwhile: what from_dlpack gives, without the protocol's
    negotiation, which costs more than a decode kernel.  Work queued before now on
    `producer_stream` (a raw handle; 0 or 1: the legacy default, ours) becomes
    visible to our stream first; when that is another stream, `owner` is let go
    only once our stream has passed our reads, and work queued on that stream after
    the view's release waits for them (see "memory lent by other libraries")."""
    if producer_stream > 1:
        _stream_waits(device, NULL, <cudaStream_t>producer_stream)
    cdef DeviceBuffer b = DeviceBuffer.__new__(DeviceBuffer)
    b.ptr = <void *>ptr
    b.device = device
    b.owner = owner
    b.viewed = True
    b.producer = <cudaStream_t>producer_stream if producer_stream > 1 else NULL
    b.nbytes = ITEMSIZE[dtype]
    for d in shape:
        b.nbytes *= d
    return DeviceArray(b, 0, shape, dtype)


def to_dlpack(DeviceArray a, stream=None):
    """A "dltensor" capsule viewing `a` (no copy); it keeps `a` alive."""
    _sync_consumer(a.device, stream)
    cdef int ndim = len(a.shape)
    cdef Export *export = <Export *>malloc(sizeof(Export) + max(ndim, 1) * sizeof(int64_t))
    if export == NULL:
        raise MemoryError()
    export.consumer_stream = <uintptr_t>int(stream) if stream is not None and stream > 0 else 0
    export.device = a.device
    cdef DLManagedTensor *m = &export.managed
    cdef int64_t *shape = <int64_t *>(<char *>export + sizeof(Export))
    for i, d in enumerate(a.shape):
        shape[i] = d
    code, bits = _DL_CODES[a.dtype]
    m.dl_tensor.data = P(a)
    m.dl_tensor.device.device_type = kDLCUDA
    m.dl_tensor.device.device_id = a.device
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype.code = code
    m.dl_tensor.dtype.bits = bits
    m.dl_tensor.dtype.lanes = 1
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = NULL  # C-contiguous
    m.dl_tensor.byte_offset = 0
    Py_INCREF(a)
    m.manager_ctx = <void *>a
    m.deleter = _export_deleter
    return PyCapsule_New(m, b"dltensor", _capsule_destructor)


def from_dlpack(obj):
    """A DeviceArray viewing a CUDA DLPack producer's memory (torch, CuPy) without
    a copy.  The producer's work is made visible to our stream first."""
    # producers (torch, CuPy) order their current stream of the *current* device
    # before the stream we name: their device must be current while they export
    with on_device(int(obj.__dlpack_device__()[1])):
        capsule = obj.__dlpack__(stream=1)
    if not PyCapsule_IsValid(capsule, b"dltensor"):
        raise ArgumentTypeError("from_dlpack expects an unconsumed 'dltensor' capsule")
    cdef DLManagedTensor *m = <DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
    cdef DLTensor *t = &m.dl_tensor
    if t.device.device_type != kDLCUDA:
        raise ArgumentTypeError(f"from_dlpack: memory is on DLPack device type {t.device.device_type}, not CUDA")
    key = (t.dtype.code, t.dtype.bits)
    if key not in _DL_NAMES or _DL_NAMES[key] == "uint32" or t.dtype.lanes != 1:  # uint32: packed words only
        kind = {kDLInt: "int", kDLUInt: "uint", kDLFloat: "float", kDLBfloat: "bfloat"}.get(t.dtype.code, "")
        what = f"{kind}{t.dtype.bits}" if kind else f"DLPack type code {t.dtype.code}, {t.dtype.bits} bits"
        raise ArgumentTypeError(f"from_dlpack: a CUDA tensor of {what}{'' if t.dtype.lanes == 1 else ' vectors'} data; "
                                f"qdispatch's CUDA tensors hold float32, float16, bfloat16, int8 or int32: convert "
                                f"it to one of them first")
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if t.strides != NULL and 0 not in shape:  # no values: any strides describe them
        expected = 1
        for i in reversed(range(t.ndim)):
            if shape[i] != 1 and t.strides[i] != expected:
                raise ArgumentTypeError("from_dlpack needs a C-contiguous tensor: call .contiguous() first")
            expected *= shape[i]
    cdef DeviceBuffer b = DeviceBuffer.__new__(DeviceBuffer)
    b.ptr = <void *>(<uintptr_t>t.data + t.byte_offset)
    b.device = t.device.device_id
    b.borrowed = m
    name = _DL_NAMES[key]
    b.nbytes = ITEMSIZE[name]
    for d in shape:
        b.nbytes *= d
    PyCapsule_SetName(capsule, b"used_dltensor")
    return DeviceArray(b, 0, shape, name)
