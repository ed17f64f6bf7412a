/* Argument checks shared by the CPU and CUDA entry points (internal: not installed).
 * Sizes past what memory can hold come only from bad arguments; checked once at
 * each entry point, they let the kernels' size arithmetic stay unchecked. */
#ifndef QD_CHECKS_H
#define QD_CHECKS_H

#include <stddef.h>
#include <stdint.h>

/* The kernels' copies pad each dimension by less than this. */
#define QD_PAD_MAX 64

/* 1 when an array of rows x cols elements of elem_size bytes (dims >= 0) can exist,
 * padded copies included: its byte count fits ptrdiff_t. */
static inline int qd_dims_fit(int64_t rows, int64_t cols, size_t elem_size)
{
    int64_t bytes;
    return rows <= INT64_MAX - QD_PAD_MAX && cols <= INT64_MAX - QD_PAD_MAX &&
           !__builtin_mul_overflow(rows + QD_PAD_MAX, cols + QD_PAD_MAX, &bytes) &&
           !__builtin_mul_overflow(bytes, (int64_t)elem_size, &bytes) && bytes <= PTRDIFF_MAX;
}

/* 1 when two byte ranges share a byte: an output that overlaps an input (or another
 * output) is refused, as the kernels would read what they had already written. */
static inline int qd_overlap(const void *a, size_t a_bytes, const void *b, size_t b_bytes)
{
    const uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + b_bytes && y < x + a_bytes;
}

#endif
