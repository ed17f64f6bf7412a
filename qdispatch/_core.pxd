# The tensor types and the dispatch table, for other Cython code to cimport.
# A tensor's backend kind is a C int field (a qd_backend value from qdispatch.h),
# so checking that two operands share a backend is one integer compare.

cdef class Device:
    cdef readonly int kind
    cdef readonly int index


cdef class TensorBase:
    cdef readonly int kind      # qd_backend
    cdef readonly int index     # device index within the kind
    cdef readonly tuple shape


cdef class Tensor(TensorBase):
    cdef readonly object payload  # the backend's buffer (a numpy array on host backends)
    cdef readonly str dtype
    cdef object __weakref__       # weak caches may key on a Tensor, as on a QTensor


cdef class QTensor(TensorBase):
    cdef readonly object storage  # the backend's storage of values and scales
    cdef readonly object layout   # qdispatch.layout.QLayout, storage orientation
    cdef readonly bint transposed
    cdef object __weakref__       # weak caches may key on a QTensor (qdispatch.torch's ties)


cdef object backend_of(int kind)
cdef bint same_device(TensorBase a, TensorBase b) noexcept
