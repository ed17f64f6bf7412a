// The fq weight tiles and what every fq kernel reads from them: the tile layout
// (qd_cuda_fq_tile_weights), a tile's values as 16-bit pairs in a lane's mma A
// fragment order, and the operands of a launch.  Shared by the decode kernel
// (fq_matmul.cu) and the Hopper kernel for a few hundred rows (fq_wide_sm90.cu).
#pragma once
#include <cuda_fp16.h>

#include <cstdint>

#include "common.cuh"

namespace qd {
namespace fq {

// Tiles in flight per warp.  An int8 tile is 2 k16 steps of work, a 4-bit one 4
// (2-bit: 8), so narrower weights keep the memory as busy with fewer: 4 and 3
// measured best (2, 5, 6, 8 and 10 slower).
constexpr int ring_tiles(int bits) { return bits == 8 ? 4 : 3; }

// Tile geometry for `bits`-bit weights: a lane's 16 bytes are 4 words of V values.
template <int BITS>
struct Tiling {
    static constexpr int V = 32 / BITS;   // values per word
    static constexpr int HALF = V / 2;    // value pairs per word
    static constexpr int STEPS = V / 2;   // mma k16 steps per tile (8 values per lane each)
    static constexpr int KT = 16 * STEPS; // K values per tile
};

// Where value f of word `wi` of lane (g, t) sits in its tile: pair P of the lane
// is A-fragment register P % 4 of k-step P / 4; a register holds (row, k) and
// (row, k + 1), the first in field `slot`, the second in field `slot + HALF`.
// Registers 0, 1 meet x's first B register (mma k 2t, 2t + 1), 2, 3 its second
// (k 2t + 8, 2t + 9); both are read from x at 4t .. 4t + 3 of the step.
template <int BITS>
__host__ __device__ inline void tile_position(int wi, int f, int g, int t, int *row, int *k) {
    using T = Tiling<BITS>;
    const int P = wi * T::HALF + f % T::HALF, s = P / 4, r = P % 4;
    *row = g + 8 * (r & 1);
    *k = 16 * s + 4 * t + 2 * (r >> 1) + f / T::HALF;
}

// The order of the tiles in memory.  8-bit tiles go k tile by k tile ([k tile][band]):
// the warps of neighbouring bands read neighbouring tiles at the same time (0.7-0.9
// us less at N = 11008 on an H200).  Narrower tiles go band by band ([band][k tile]),
// each warp's run of K one stretch (0.1-0.35 us less than the other order).
template <int BITS>
struct TileOrder {
    static constexpr bool K_MAJOR = BITS == 8;
    int64_t bands, tiles_per_band;
    // Tile kt of band `band`, and the distance between a band's consecutive tiles,
    // in tiles.
    __host__ __device__ int64_t index(int64_t band, int64_t kt) const {
        return K_MAJOR ? kt * bands + band : band * tiles_per_band + kt;
    }
    __host__ __device__ int64_t stride() const { return K_MAJOR ? bands : 1; }
    // The band and k tile of tile `tile` in memory order.
    __device__ void locate(int64_t tile, int64_t *band, int64_t *kt) const {
        const int64_t inner = K_MAJOR ? bands : tiles_per_band, major = tile / inner, minor = tile % inner;
        *band = K_MAJOR ? minor : major;
        *kt = K_MAJOR ? major : minor;
    }
};

// Value (row, k) of a weight read from its tiles (values past N or K are zero
// there): tile_position inverted, to find the lane, word and field that hold it.
template <int BITS>
__device__ inline int tile_value(const uint32_t *tiles, TileOrder<BITS> order, int64_t row, int64_t k) {
    using T = Tiling<BITS>;
    const int rr = (int)(row & 15), kk = (int)(k % T::KT), rem = kk & 15;
    const int P = 4 * (kk >> 4) + ((rr >> 3) | (rem & 2));  // register: row half, then k half
    const int lane = 4 * (rr & 7) + (rem >> 2), f = (rem & 1) * T::HALF + P % T::HALF;
    const uint32_t word = tiles[order.index(row >> 4, k / T::KT) * 128 + 4 * lane + P / T::HALF];
    return (int)((word >> (BITS * f)) & ((1u << BITS) - 1u)) - (1 << (BITS - 1));  // less the stored bias
}

inline int64_t tile_k(int bits) { return 16 * (16 / bits); }  // K values per tile

// How a kernel multiplies: bf16 or f16 operands (x read as it is), or float32 x
// cut into three bf16 parts.
enum Mode { BF16 = 0, F16 = 1, SPLIT = 2 };

// (a & b) | c and (a & b) ^ c, one instruction each (given two constants, the
// compiler spends two).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Fields i and i + HALF of a biased word as a 16-bit pair (low half first), exact.
// In f16 any field goes into the mantissa of 1024.0 (10 bits) and the bias comes
// off in one half2 subtraction.  In bf16 (7 mantissa bits) a field goes into the
// mantissa of 128.0, 4- and 2-bit fields whole, less their constant bias; of an
// 8-bit field u the low 7 bits, less 256 or, when u's top bit is set, 128.
template <int BITS, int MODE>
__device__ __forceinline__ uint32_t weight_pair(uint32_t wb, int i) {
    constexpr uint32_t half = 1u << (BITS - 1);
    if constexpr (MODE == F16) {
        uint32_t v;
        if constexpr (BITS == 8) v = __byte_perm(wb, 0x6464u, 0x5040 | i | ((i + 2) << 8));
        else v = and_or(wb >> (BITS * i), ((1u << BITS) - 1u) * 0x00010001u, 0x64006400u);
        const __half2 r = __hsub2(*reinterpret_cast<const __half2 *>(&v), __half2half2(__ushort_as_half(
                                      (unsigned short)(0x6400u + half))));
        return *reinterpret_cast<const uint32_t *>(&r);
    } else {
        constexpr int LOW = BITS < 8 ? BITS : 7;  // bits that go into the mantissa
        const uint32_t f = wb >> (BITS * i);     // the pair's fields at bits 0 and 16
        const uint32_t v = and_or(f, ((1u << LOW) - 1u) * 0x00010001u, 0x43004300u);
        const uint32_t bias = BITS == 8 ? and_xor(f, 0x00800080u, 0xC380C380u)  // -256, or -128
                                        : (0xC300u + half) * 0x00010001u;        // -(128 + half)
        uint32_t r;
        // v * 1 + bias: fma.bf16x2 exists from sm_80 on (sub.bf16x2 only from sm_90)
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(bias));
        return r;
    }
}

// The operands every step reads.
struct Operand {
    const void *x; int x_dtype, M; int64_t ldx, K;
    const uint4 *w; int64_t bands, tiles_per_band, N;
    const float2 *s;                       // scale tiles (qd_cuda_fq_tile_scales)
    unsigned blocks, bk, steps_per_block;  // K < 2^31: block arithmetic in 32 bits
};

}  // namespace fq
}  // namespace qd
