# cython: language_level=3
# DLPack's C structs (dlpack.h, versions 0.8 and 1.x), declared once for the modules
# that make or read capsules.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef struct DLDevice:
    int32_t device_type
    int32_t device_id

cdef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

cdef struct DLTensor:
    void *data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset

cdef struct DLManagedTensor:  # a "dltensor" capsule's
    DLTensor dl_tensor
    void *manager_ctx
    void (*deleter)(DLManagedTensor *) noexcept nogil

cdef struct DLPackVersion:
    uint32_t major
    uint32_t minor

cdef struct DLManagedTensorVersioned:  # a "dltensor_versioned" capsule's (DLPack 1.0)
    DLPackVersion version
    void *manager_ctx
    void (*deleter)(DLManagedTensorVersioned *) noexcept nogil
    uint64_t flags
    DLTensor dl_tensor

cdef enum:
    kDLCPU = 1
    kDLCUDA = 2
    kDLInt = 0
    kDLUInt = 1
    kDLFloat = 2
    kDLBfloat = 4
