# The cpu backend's packed weights, for other Cython code to cimport.
from qdispatch.qdispatch_c cimport qd_packed_weights

cdef class PackedWeights:
    cdef qd_packed_weights *ptr
    cdef readonly tuple shape      # (N, K)
    cdef readonly int bits
    cdef readonly tuple block      # (block_n, block_k)
