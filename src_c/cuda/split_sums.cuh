// K cut into splits over blocks whose float32 sums meet in device memory: a
// temporary from the stream's memory pool, and the splits' sums added in split
// order, so that the result does not depend on scheduling.  Used by the kernels
// that split K when their output tiles are too few to fill the GPU.
#pragma once
#include "common.cuh"

namespace qd {

// out [M, N] (out_dtype) = partial [splits][M][N] added in split order, each column
// then times col_scales[col / bn * ld] when col_scales is given; queued on stream.
qd_status add_split_sums(const float *partial, int splits, int64_t M, int64_t N, const float *col_scales,
                         int64_t bn, int64_t ld, void *out, int out_dtype, cudaStream_t stream);

// launch(partial), with partial [splits][M][N] float32 taken from the stream's pool,
// then add_split_sums into out; the temporary goes back in stream order.
template <typename Launch>
qd_status with_split_sums(int splits, int64_t M, int64_t N, const float *col_scales, int64_t bn, int64_t ld,
                          void *out, int out_dtype, cudaStream_t stream, Launch launch) {
    float *partial = nullptr;
    qd_status st = check(cudaMallocAsync(reinterpret_cast<void **>(&partial), sizeof(float) * splits * M * N, stream));
    if (st != QD_OK) return st;
    st = launch(partial);
    if (st == QD_OK) st = add_split_sums(partial, splits, M, N, col_scales, bn, ld, out, out_dtype, stream);
    const qd_status freed = check(cudaFreeAsync(partial, stream));
    return st != QD_OK ? st : freed;
}

}  // namespace qd
