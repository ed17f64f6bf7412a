# `cimport qdispatch` gives Cython code the tensor types and the C kernels:
#
#     cimport qdispatch
#     def kind(qdispatch.QTensor t): return t.kind        # a C field read
#     with nogil: st = qdispatch.qd_int_matmul_s8(a, M, K, b, N, c)
#
# The kernels are declared `noexcept nogil`; link libqdispatch from
# qdispatch.get_library_dir() to call them.
from qdispatch._core cimport Device, TensorBase, Tensor, QTensor
from qdispatch.qdispatch_c cimport *
