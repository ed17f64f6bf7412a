/* qd_dequantize_rows: its checks and its threads.  The row kernel, of the active
 * ISA, is in dequantize_kernels.h. */
#include <stdlib.h>

#include "qd_internal.h"

static size_t dtype_size(int out_dtype)
{
    return out_dtype == QD_FLOAT32 ? 4 : 2;
}

static qd_status check_rows(int bits, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                            const int64_t *ids, int64_t n, int out_dtype)
{
    if (bits != 0 && bits != 2 && bits != 4 && bits != 8)
        return QD_ERR_SCHEME;
    if (out_dtype != QD_FLOAT32 && out_dtype != QD_FLOAT16 && out_dtype != QD_BFLOAT16)
        return QD_ERR_ARGUMENT;
    if (rows <= 0 || cols <= 0 || n < 0 || block_rows <= 0 || block_cols <= 0 ||
        rows % block_rows || cols % block_cols)
        return QD_ERR_SHAPE;
    if (!qd_dims_fit(rows, cols, 4) || !qd_dims_fit(n, cols, 4))
        return QD_ERR_ARGUMENT;
    if (!ids && n != rows)
        return QD_ERR_SHAPE;
    for (int64_t i = 0; ids && i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows)
            return QD_ERR_ARGUMENT;
    return QD_OK;
}

qd_status qd_dequantize_rows(const void *values, int bits, int64_t rows, int64_t cols, const float *scales,
                             int64_t block_rows, int64_t block_cols, const int64_t *ids, int64_t n,
                             void *out, int out_dtype)
{
    if (!values || !scales || (n > 0 && !out))
        return QD_ERR_NULL;
    const qd_status st = check_rows(bits, rows, cols, block_rows, block_cols, ids, n, out_dtype);
    if (st != QD_OK || n == 0)
        return st;
    /* the kernels read packed words as uint32 and write out as its dtype: misaligned
     * pointers would be undefined behaviour there */
    if ((bits && (uintptr_t)values % 4) || (uintptr_t)out % dtype_size(out_dtype))
        return QD_ERR_ARGUMENT;
    const int64_t per_word = bits ? 32 / bits : 1;
    const int64_t words_per_row = (cols + per_word - 1) / per_word;
    const size_t value_bytes = (size_t)(rows * (bits ? words_per_row * 4 : cols));
    const size_t out_bytes = (size_t)(n * cols) * dtype_size(out_dtype);
    const size_t scale_bytes = (size_t)((rows / block_rows) * (cols / block_cols)) * sizeof(float);
    if (qd_overlap(out, out_bytes, values, value_bytes) || qd_overlap(out, out_bytes, scales, scale_bytes) ||
        (ids && qd_overlap(out, out_bytes, ids, (size_t)n * sizeof *ids)))
        return QD_ERR_ARGUMENT;
    const qd_dequantize_job job = {values, bits, cols, words_per_row, scales, block_rows, block_cols, out, out_dtype, 0};
    /* memory-bound: a thread per row, each worth its start from about a hundred
     * thousand values (n x cols counted as a product's multiply-adds) */
    const int threads = qd_threads_for_product(n, n, cols, 1);
    const qd_dequant_kernels *kern = qd_dequant_kernels_active();
    QD_PARALLEL_FOR(threads, n, ,
        for (int64_t i = 0; i < n; i++)
            kern->row(&job, ids ? ids[i] : i, i);
    );
    return QD_OK;
}

qd_status qd_dequantize_packed(const qd_packed_weights *pw, void *out, int out_dtype)
{
    const qd_status st = qd_packed_check(pw);
    if (st != QD_OK)
        return st;
    if (!out)
        return QD_ERR_NULL;
    if (out_dtype != QD_FLOAT32 && out_dtype != QD_FLOAT16 && out_dtype != QD_BFLOAT16)
        return QD_ERR_ARGUMENT;
    if ((uintptr_t)out % dtype_size(out_dtype))
        return QD_ERR_ARGUMENT;
    const int64_t N = pw->n, K = pw->k;
    /* Each worker takes a run of panels: a panel's rows are unpacked into the
     * worker's piece of one buffer (16 rows, in cache), then dequantized as
     * qd_dequantize_rows does, with no int8 copy of the whole matrix in between. */
    const int workers = qd_threads_for_product(pw->n_panels, N, K, 1);
    const int64_t run = (pw->n_panels + workers - 1) / workers, rows_bytes = QD_NR * K;
    int8_t *buffers = malloc((size_t)(workers * rows_bytes));
    if (!buffers)
        return QD_ERR_NO_MEMORY;
    const qd_dequant_kernels *kern = qd_dequant_kernels_active();
    QD_PARALLEL_FOR(workers, workers, ,
        for (int w = 0; w < workers; w++) {
            int8_t *rows = buffers + w * rows_bytes;
            for (int64_t p = w * run; p < (w + 1) * run && p < pw->n_panels; p++) {
                qd_unpack_panel(pw, p, rows);
                const qd_dequantize_job job = {rows, 0, K, K, pw->scales, pw->block_n, pw->block_k, out, out_dtype,
                                               p * QD_NR};
                for (int64_t r = p * QD_NR; r < (p + 1) * QD_NR && r < N; r++)
                    kern->row(&job, r, r);
            }
        }
    );
    free(buffers);
    return QD_OK;
}
