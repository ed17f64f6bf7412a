// What the int8 GEMM kernels (gemm_s8.cu, gemm_s8_sm90.cu) share: the scale
// operands, what is done with the exact int32 sums, and the tile order.
#pragma once
#include "common.cuh"

namespace qd {

struct Scales {
    const float *a; int64_t a_ld, a_bm, a_bk;  // a: [M/a_bm, a_ld]
    const float *b; int64_t b_ld, b_bn, b_bk;  // b: [N/b_bn, b_ld]
    int64_t group_steps;                      // k-steps per exact group
};

// What a GEMM multiplies: int8 (exact int32 sums) or 16-bit floats (float32 sums;
// fq_gemm's weights are integers, exact in them).  Either way an mma step reads 32
// bytes of K per row with its fragments laid out alike in bytes, so the kernels
// move bytes, and only the mma and the sums' type differ.
enum Operands { S8 = 0, F16 = 1, BF16 = 2 };
// The sums of an mma step: exact int32 for int8 operands, float32 otherwise.
template <int OPS> struct Sums { using type = float; };
template <> struct Sums<S8> { using type = int32_t; };

// What a kernel does with its exact int32 sums: store them (int_matmul), scale
// them once by the pair of one K group covering all of K, or flush per K group.
enum GemmMode { INT32_OUT = 0, ONE_GROUP = 1, GROUPED = 2 };

// Which of a row's (or a column's) scales along K the current block of K takes,
// without a division a block: `per` blocks to a scale, counted down; past the
// last scale (blocks beyond K, which sum zeros) the index stays on it.
struct BlockWalk {
    int per, left, index, last;
    __host__ __device__ BlockWalk(int per, int last, int block)
        : per(per), left(per - block % per), index(min(block / per, last)), last(last) {}
    __host__ __device__ void next() {
        if (--left == 0) {
            left = per;
            index = min(index + 1, last);
        }
    }
};

// Grouped rasterization: tile t of a tiles_m x tiles_n grid, visiting group_m
// tile rows column by column so that they share the B tiles they read in L2.
__host__ __device__ inline void raster(int t, int tiles_m, int tiles_n, int group_m, int &tm,
                                       int &tn) {
    const int per_group = group_m * tiles_n, first_m = t / per_group * group_m;
    const int rows = tiles_m - first_m < group_m ? tiles_m - first_m : group_m, i = t % per_group;
    tm = first_m + i % rows;
    tn = i / rows;
}

}  // namespace qd
