# Declarations of the public C header qdispatch.h, for Cython code to cimport.
from libc.stdint cimport int8_t, int32_t, int64_t, uint16_t, uint32_t

cdef extern from "qdispatch.h" nogil:
    cpdef enum qd_backend:
        QD_BACKEND_REFERENCE
        QD_BACKEND_CPU
        QD_BACKEND_CUDA
        QD_BACKEND_COUNT

    ctypedef enum qd_status:
        QD_OK
        QD_ERR_NULL
        QD_ERR_SHAPE
        QD_ERR_ARGUMENT
        QD_ERR_SCHEME
        QD_ERR_ISA_NOT_BUILT
        QD_ERR_ISA_NOT_SUPPORTED
        QD_ERR_NO_MEMORY
        QD_ERR_K_TOO_LARGE
        QD_ERR_NOT_FINITE
        QD_ERR_SCALE_OVERFLOW
        QD_ERR_CUDA_UNAVAILABLE
        QD_ERR_CUDA

    int QD_ABI_VERSION
    int qd_abi_version() noexcept
    const char *qd_version() noexcept

    const char *qd_status_string(qd_status status) noexcept
    int QD_INT_MATMUL_MAX_K

    ctypedef enum qd_isa:
        QD_ISA_SCALAR
        QD_ISA_AVX2
        QD_ISA_AVXVNNI
        QD_ISA_AVX512VNNI
        QD_ISA_NEON_DOTPROD
        QD_ISA_AMX
        QD_ISA_COUNT

    const char *qd_isa_name(qd_isa isa) noexcept
    qd_status qd_isa_from_name(const char *name, qd_isa *out) noexcept
    int qd_isa_built(qd_isa isa) noexcept
    int qd_isa_supported(qd_isa isa) noexcept
    qd_isa qd_isa_active() noexcept
    qd_status qd_isa_set(qd_isa isa) noexcept
    void qd_isa_reset() noexcept

    void qd_set_num_threads(int n) noexcept
    int qd_get_num_threads() noexcept
    int qd_thread_cap() noexcept
    int qd_forked_child() noexcept

    ctypedef enum qd_value:
        QD_Q8S
        QD_Q8F
        QD_Q4S
        QD_Q4F
        QD_Q2S
        QD_Q2F

    ctypedef enum qd_scale_dtype:
        QD_SCALE_F32
        QD_SCALE_F16
        QD_SCALE_BF16

    qd_status qd_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                              int64_t block_rows, int64_t block_cols, int scale_dtype,
                              float *scales, int8_t *q, int64_t *bad_index) noexcept
    qd_status qd_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits, uint32_t *words) noexcept
    qd_status qd_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols, int bits, int8_t *q) noexcept

    ctypedef enum qd_float_dtype:
        QD_FLOAT32
        QD_FLOAT16
        QD_BFLOAT16

    qd_status qd_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols, int value_kind,
                          int64_t block_rows, int64_t block_cols, int scale_dtype,
                          float *scales, int8_t *q, int64_t *bad_index) noexcept

    qd_status qd_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols,
                                 const float *scales, int64_t block_rows, int64_t block_cols,
                                 const int64_t *ids, int64_t n, void *out, int out_dtype) noexcept

    ctypedef struct qd_packed_weights:
        pass

    qd_status qd_pack_weights(const int8_t *w, int64_t N, int64_t K, int bits,
                              const float *scales, int64_t block_n, int64_t block_k,
                              qd_packed_weights **out) noexcept
    void qd_packed_weights_free(qd_packed_weights *pw) noexcept
    size_t qd_packed_weights_nbytes(const qd_packed_weights *pw) noexcept
    qd_status qd_packed_weights_info(const qd_packed_weights *pw, int64_t *N, int64_t *K, int *bits,
                                     int64_t *block_n, int64_t *block_k) noexcept
    qd_status qd_unpack_weights(const qd_packed_weights *pw, int8_t *w_out, float *scales_out) noexcept
    qd_status qd_dequantize_packed(const qd_packed_weights *pw, void *out, int out_dtype) noexcept

    qd_status qd_int_matmul_s8(const int8_t *a, int64_t M, int64_t K, const int8_t *b, int64_t N,
                               int32_t *c) noexcept
    qd_status qd_int_matmul_packed(const int8_t *a, int64_t M, int64_t K,
                                   const qd_packed_weights *w, int32_t *c) noexcept
    qd_status qd_qq_matmul(const int8_t *a, int64_t M, int64_t K, const float *a_scales,
                           int64_t a_block_m, int64_t a_block_k, const qd_packed_weights *w,
                           float *out) noexcept
    qd_status qd_fq_matmul_f32(const float *x, int64_t M, int64_t K, const qd_packed_weights *w,
                               float *out) noexcept
    int qd_fq_fold_scales(const float *scales, int64_t n, float *x_scales, float *power) noexcept
    qd_status qd_w8a8_matmul_f32(const float *x, int64_t M, int64_t K, int act_value_kind,
                                 int64_t act_block_k, const qd_packed_weights *w, float *out) noexcept

    qd_status qd_convert_f16_to_f32(const uint16_t *src, int64_t n, float *dst) noexcept
    qd_status qd_convert_bf16_to_f32(const uint16_t *src, int64_t n, float *dst) noexcept
    qd_status qd_convert_f32_to_f16(const float *src, int64_t n, uint16_t *dst) noexcept
    qd_status qd_convert_f32_to_bf16(const float *src, int64_t n, uint16_t *dst) noexcept

    # ---- CUDA (device pointers; `stream` a cudaStream_t, NULL the legacy default stream).
    # A library built without CUDA has them all, returning QD_ERR_CUDA_UNAVAILABLE. ----
    ctypedef enum qd_cuda_dtype:
        QD_CUDA_F32
        QD_CUDA_F16
        QD_CUDA_BF16
        QD_CUDA_S8
        QD_CUDA_S32
    int QD_CUDA_QUANTIZE_SCRATCH

    int qd_cuda_available() noexcept
    const char *qd_cuda_last_error() noexcept
    qd_status qd_cuda_cast(const void *src, int src_dtype, void *dst, int dst_dtype, int64_t n,
                           void *stream) noexcept
    qd_status qd_cuda_split_bf16(const float *x, int64_t rows, int64_t cols, int64_t ldx, void *parts,
                                 int64_t ld, void *stream) noexcept
    qd_status qd_cuda_scale_columns(const void *x, int x_dtype, int64_t rows, int64_t cols, int64_t ldx,
                                    const float *scales, float *out, int64_t ld, void *stream) noexcept
    qd_status qd_cuda_sum3_f32(const float *a, int64_t n, void *out, int out_dtype, void *stream) noexcept
    qd_status qd_cuda_add_bias_f32(const float *x, int64_t rows, int64_t cols, const float *bias,
                                   float *out, void *stream) noexcept
    qd_status qd_cuda_transpose(const void *src, int64_t batch, int64_t rows, int64_t cols,
                                int elem_size, void *dst, void *stream) noexcept
    qd_status qd_cuda_pad_s8(const int8_t *src, int64_t rows, int64_t cols, int8_t *dst,
                             int64_t dst_ld, void *stream) noexcept
    qd_status qd_cuda_pack_u32(const int8_t *q, int64_t rows, int64_t cols, int bits,
                               uint32_t *words, void *stream) noexcept
    qd_status qd_cuda_unpack_u32(const uint32_t *words, int64_t rows, int64_t cols, int bits,
                                 int8_t *q, void *stream) noexcept
    qd_status qd_cuda_quantize_f32(const float *x, int64_t rows, int64_t cols, int value_kind,
                                   int64_t block_rows, int64_t block_cols, int scale_dtype,
                                   float *scales, int8_t *q, void *scratch, int64_t *bad_index,
                                   void *stream) noexcept
    qd_status qd_cuda_quantize(const void *x, int x_dtype, int64_t rows, int64_t cols, int value_kind,
                               int64_t block_rows, int64_t block_cols, int scale_dtype, float *scales,
                               int8_t *q, void *scratch, int64_t *bad_index, void *stream) noexcept
    qd_status qd_cuda_largest_magnitude(const float *x, int64_t n, float *largest, void *scratch,
                                        void *stream) noexcept
    qd_status qd_cuda_dequantize(const void *values, int bits, int64_t rows, int64_t cols,
                                 const float *scales, int64_t block_rows, int64_t block_cols,
                                 float *out, void *stream) noexcept
    qd_status qd_cuda_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols,
                                      const float *scales, int64_t block_rows, int64_t block_cols,
                                      const int64_t *ids, int64_t n, void *out, int out_dtype,
                                      void *stream) noexcept
    qd_status qd_cuda_int_matmul_s8(const int8_t *a, const int8_t *bt, int64_t M, int64_t N,
                                    int64_t K, int64_t ld, int32_t *c, void *stream) noexcept
    qd_status qd_cuda_qq_matmul(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K,
                                int64_t ld, const float *a_scales, int64_t a_block_m,
                                int64_t a_block_k, const float *b_scales, int64_t b_block_n,
                                int64_t b_block_k, void *out, int out_dtype, void *stream) noexcept
    int64_t qd_cuda_tiles_size(int64_t row_groups, int64_t k_tiles, int64_t tile_bytes) noexcept
    int64_t qd_cuda_fq_tiles_bytes(int64_t N, int64_t K, int bits) noexcept
    int64_t qd_cuda_fq_scale_tiles_bytes(int64_t N, int64_t K, int64_t block_k) noexcept
    qd_status qd_cuda_fq_tile_weights(const int8_t *q, int64_t N, int64_t K, int64_t ld, int bits,
                                      void *tiles, void *stream) noexcept
    qd_status qd_cuda_fq_tile_scales(const float *scales, int64_t N, int64_t K, int64_t block_n,
                                     int64_t block_k, void *scale_tiles, void *stream) noexcept
    qd_status qd_cuda_fq_untile_weights(const void *tiles, int64_t N, int64_t K, int bits, int8_t *q,
                                        int64_t ld, void *stream) noexcept
    qd_status qd_cuda_fq_dequantize_rows(const void *tiles, int bits, int64_t N, int64_t K,
                                         const float *scales, int64_t block_rows, int64_t block_cols,
                                         const int64_t *ids, int64_t n, void *out, int out_dtype,
                                         void *stream) noexcept
    qd_status qd_cuda_fq_matmul(const void *x, int x_dtype, int64_t M, int64_t ldx,
                                const void *tiles, const void *scale_tiles, int bits, int64_t N,
                                int64_t K, int64_t block_k, void *out, int out_dtype, void *stream) noexcept
    qd_status qd_cuda_fq_expand_weights(const void *tiles, int64_t N, int64_t K, int bits, int dtype,
                                        void *w16, int64_t ld, void *stream) noexcept
    qd_status qd_cuda_fq_gemm(const void *x, const void *w16, int dtype, int64_t M, int64_t N, int64_t K,
                              int64_t ld, const float *scales, int64_t block_n, int64_t block_k, void *out,
                              int out_dtype, void *stream) noexcept
    qd_status qd_cuda_fq_values(const void *x, int x_dtype, int64_t M, int64_t ldx, const int8_t *w, int64_t N,
                                int64_t K, int64_t ldw, const float *scales, int64_t block_n, int64_t block_k,
                                void *out, int out_dtype, void *stream) noexcept
    int qd_cuda_fq_supported(int bits, int64_t K, int64_t block_k) noexcept
    int qd_cuda_fq_wide_supported() noexcept
    void qd_cuda_set_batch_invariant(int on) noexcept
    int qd_cuda_batch_invariant() noexcept
