// fq for small M (decode): x [M <= 32, K] in float32, float16 or bfloat16 times
// integer weights [N, K] dequantized as they stream in, on the 16-bit tensor cores.
//
// The weights are laid out once (qd_cuda_fq_tile_weights) in tiles of 16 rows
// by 256/bits values of K, 512 bytes: lane i of a warp owns the 16 bytes that
// hold exactly its mma A fragments, so a warp's copy is one contiguous 512-byte
// stretch and needs no shuffles.  Weights are the A operand (16 rows of N) and x
// the B operand (8 rows of M per mma), so M <= 8 wastes no tensor-core work.
// A launch takes up to 32 rows of 16-bit x (four n8 tiles: the weights stream
// once for a batch of 32), 16 of float32 x (whose three parts' fragments would
// not fit the registers at four tiles).
// Within each 16-value step of K, lane t's four values of x are adjacent (the
// weights are laid out in the same order), so one shared-memory load gives them.
//
// A block of WARPS warps covers WARPS / kw bands of 16 weight rows, kw warps per
// band splitting the block's range of K; their sums meet in shared memory in a
// fixed order.  The block's x slice is copied to shared memory once; each warp
// streams its tiles through a ring of RING asynchronous copies (cp.async: no
// registers held while they fly), so the memory system always has the next
// tiles in flight.
//
// Integer weights of up to 8 bits are exact in bf16 and f16, and products of
// 16-bit values are exact in the float32 accumulators.  f16 x multiplies in f16,
// bf16 x in bf16; float32 x is cut into up to three bf16 parts (hi + mid + lo
// holds a float32 exactly), the extra parts multiplied only when some value
// needs them.
//
// When K is also split over blockIdx.y, the splits' partial sums are added in
// split order, so the result does not depend on scheduling: on sm_90 two splits
// of a band group form a cluster and send their sums to each other's shared
// memory; otherwise every warp stores its sums to device memory as its lanes
// hold them, and the last warp of the band to finish adds them up.
//
// How K is cut follows M by default (the fastest cut for those rows), so a row's
// last bits may depend on the batch it comes in.  With batch invariance on
// (qd_cuda_set_batch_invariant) launches take up to INVARIANT_M rows, the cut
// into parts is that for INVARIANT_M rows whatever M, and their sums are added in
// part order, so they do not.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "common.cuh"
#include "fq_tiles.cuh"
#include "fq_wide_sm90.cuh"
#include "gemm_s8_sm90.cuh"
#include "mma_s8.cuh"

namespace {

using qd::ceil_div;
using namespace qd::fq;

constexpr int WARPS = 8, THREADS = WARPS * 32;
// Tiles per copy group (one wait, commit and step of the source per group) and
// tiles in flight per warp.  4-bit tiles at 9-16 rows of x (two n8 tiles) go in
// groups of two, two groups in flight: 1-3% less on an H200, where 8-bit tiles,
// M <= 8 and M = 32 took up to 4% more that way (benchmarks/cuda_notes.md,
// "Copies in groups of two tiles").
constexpr int group_tiles(int bits, int mt) { return bits == 4 && mt == 2 ? 2 : 1; }
// A deep ring keeps 8 8-bit tiles in flight: 2-10% less at 1-32 rows of 4096^2
// and 16 of 4096 x 11008, 15% less at 32 rows of 4096 x 11008, on an H100 ("Deeper
// rings for 8-bit tiles").  Only with sm_90 code, where half an SM holds
// DEEP_RING_SMEM: with 100 KB an SM (sm_86, sm_89) its 32 KB a block would leave x
// room for a few tiles of K, or none at 32 rows.
constexpr int ring_slots(int bits, int mt, bool deep) {
    return group_tiles(bits, mt) == 2 ? 4 : bits == 8 && deep ? 8 : ring_tiles(bits);
}
constexpr int ring_bytes(int ring) { return WARPS * ring * 512; }
constexpr int DEEP_RING_SMEM = 96 * 1024;
constexpr int MAX_M = 32;        // rows of 16-bit x per launch (four n8 mma tiles)
constexpr int MAX_M_F32 = 16;    // rows of float32 x per launch (two n8 tiles, three parts each)
constexpr int INVARIANT_M = 16;  // rows per launch, and whose cut every M keeps, when batch-invariant
// Rows of 16-bit x that go to wide_matmul on Hopper: from 41 (at 33-40 a launch of 32
// rows and a small one took 5-8% less on an H200, at 48 and 64 3-17% more) up to what
// its grid's y takes.
constexpr int64_t WIDE_MIN_M = 41, WIDE_MAX_M = 65535 * 64;
// n8 tiles of x for M rows: 1, 2 or 4.
__host__ __device__ constexpr int x_tiles(int M) { return M <= 8 ? 1 : M <= 16 ? 2 : 4; }
// Two blocks share an SM: one of this kernel and, while it finishes, one of the
// next decode step's kernel, which starts early.  Every launch takes half the
// SM's shared memory (the ring and the x slice in it) so that no SM ever holds
// a third: blocks go wherever room frees up as the kernel before ends, and an SM
// with three blocks of one kernel would take half as long again as the others.
constexpr int BLOCKS_PER_SM = 2;
constexpr int MAX_TICKETS = 1 << 18;  // bands of a launch whose splits meet in device memory
// On sm_90 two splits of K of a band group form one cluster and their sums meet
// in shared memory.  Clusters of 3 or 4 took 3-12 us longer when launched early
// (see qd::wait_for_prior_grids), and clusters of 3 or 8 launched without it
// took about twice as long.  Launched early and sized so that every cluster fits
// the GPU at once (7 splits, 32 clusters at 16 x 4096 x 4096), they were still
// about 40% slower: behind a kernel that holds every SM slot, a cluster waits until
// all of its slots are free at once.
constexpr int MAX_CLUSTER = 2;
// Bytes each block keeps for the other splits' sums: a share of the block's
// outputs (at most M x WARPS x 16) from each split, rounded up per split, and
// to 128 bytes (the x slice follows: its rows' bank pattern starts on a line).
__host__ __device__ constexpr int received_bytes(int M) { return (M * WARPS * 16 + MAX_CLUSTER + 31) / 32 * 128; }
// The kw parts of a band meet in shared memory after the tile loop, in the space
// of the ring, the x slice and the scales: one warp's sums are [x row][RS floats].
constexpr int RS = 20;  // floats per x row: lanes of one g store to distinct banks
constexpr int part_sums_bytes(int mt) { return WARPS * mt * 8 * RS * 4; }

// int8 values q [N, ld] <-> tiles: TO_TILES lays q out, otherwise the tiles are
// read back into q (positions past N or K, zero in the tiles, are not written).
template <int BITS, bool TO_TILES>
__global__ void tile_weights_kernel(int8_t *__restrict__ q, int64_t N, int64_t K, int64_t ld,
                                    TileOrder<BITS> order, int64_t words, uint32_t *__restrict__ tiles) {
    using T = Tiling<BITS>;
    constexpr int BIAS = 1 << (BITS - 1), MASK = (1 << BITS) - 1;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < words;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int wi = (int)(i & 3), lane = (int)((i >> 2) & 31);
        int64_t band, kt;
        order.locate(i >> 7, &band, &kt);
        uint32_t word = TO_TILES ? 0 : tiles[i];
#pragma unroll
        for (int f = 0; f < T::V; ++f) {
            int r, c;
            tile_position<BITS>(wi, f, lane >> 2, lane & 3, &r, &c);
            const int64_t row = 16 * band + r, k = T::KT * kt + c;
            const bool inside = row < N && k < K;
            // stored with a +2^(bits-1) bias: the kernel turns fields into floats without sign logic
            if constexpr (TO_TILES)
                word |= (uint32_t)(((inside ? q[row * ld + k] : 0) + BIAS) & MASK) << (BITS * f);
            else if (inside)
                q[row * ld + k] = (int8_t)((int)((word >> (BITS * f)) & MASK) - BIAS);
        }
        if constexpr (TO_TILES) tiles[i] = word;
    }
}


// Checks the arguments and launches tile_weights_kernel over all of a weight's tiles.
template <bool TO_TILES>
qd_status tile_weights(const int8_t *values, int64_t N, int64_t K, int64_t ld, int bits, const void *tile_words,
                       cudaStream_t s) {
    if (!values || !tile_words) return QD_ERR_NULL;
    if (bits != 8 && bits != 4 && bits != 2) return QD_ERR_SCHEME;
    if (N <= 0 || K <= 0) return QD_ERR_SHAPE;
    if (ld < K || !qd_dims_fit(N, ld, 1)) return QD_ERR_ARGUMENT;
    if (qd::overlaps_any({values, qd::span_bytes(N, K, ld, 1)}, {{tile_words, (size_t)qd_cuda_fq_tiles_bytes(N, K, bits)}}))
        return QD_ERR_ARGUMENT;
    // one kernel for both directions: the side it writes is the side it was given to write
    int8_t *q = const_cast<int8_t *>(values);
    uint32_t *tiles = static_cast<uint32_t *>(const_cast<void *>(tile_words));
    const int64_t words = qd_cuda_fq_tiles_bytes(N, K, bits) / 4;
    const int64_t bands = ceil_div(N, 16), tpb = ceil_div(K, tile_k(bits));
    const unsigned grid = qd::grid_for(words, 256);
    if (bits == 8) tile_weights_kernel<8, TO_TILES><<<grid, 256, 0, s>>>(q, N, K, ld, {bands, tpb}, words, tiles);
    else if (bits == 4) tile_weights_kernel<4, TO_TILES><<<grid, 256, 0, s>>>(q, N, K, ld, {bands, tpb}, words, tiles);
    else tile_weights_kernel<2, TO_TILES><<<grid, 256, 0, s>>>(q, N, K, ld, {bands, tpb}, words, tiles);
    return qd::launched();
}

// A weight value as a float16 or bfloat16 (exact: |v| <= 128).
template <typename V> __device__ inline V from_int(int v);
template <> __device__ inline __half from_int<__half>(int v) { return __int2half_rn(v); }
template <> __device__ inline __nv_bfloat16 from_int<__nv_bfloat16>(int v) { return __int2bfloat16_rn(v); }

// Tiles -> rows out [N, ld] of 16-bit values.  A warp takes a tile at a time: one
// 16-byte load a lane (its own fragments), the values into shared memory in row
// order, then whole 16-byte row pieces out.  Columns past K are zero in the tiles.
constexpr int EXPAND_WARPS = 8;
template <int BITS, typename V>
__global__ void __launch_bounds__(EXPAND_WARPS * 32)
expand_weights_kernel(const uint32_t *__restrict__ tiles, int64_t N, int64_t ld, TileOrder<BITS> order,
                      V *__restrict__ out) {
    using T = Tiling<BITS>;
    constexpr int BIAS = 1 << (BITS - 1), MASK = (1 << BITS) - 1, PIECES = T::KT / 8;  // 16-byte pieces a row
    __shared__ __align__(16) V rows[EXPAND_WARPS][16][T::KT];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int64_t count = order.bands * order.tiles_per_band;
    for (int64_t tile = blockIdx.x * (int64_t)EXPAND_WARPS + warp; tile < count;
         tile += (int64_t)gridDim.x * EXPAND_WARPS) {
        const uint4 w = __ldg(reinterpret_cast<const uint4 *>(tiles) + tile * 32 + lane);
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int wi = 0; wi < 4; ++wi)
#pragma unroll
            for (int f = 0; f < T::V; ++f) {
                int r, c;
                tile_position<BITS>(wi, f, g, t, &r, &c);
                rows[warp][r][c] = from_int<V>((int)((words[wi] >> (BITS * f)) & MASK) - BIAS);
            }
        __syncwarp();
        int64_t band, kt;
        order.locate(tile, &band, &kt);
        for (int piece = lane; piece < 16 * PIECES; piece += 32) {
            const int r = piece / PIECES, c = piece % PIECES * 8;
            const int64_t row = 16 * band + r, k = kt * T::KT + c;
            if (row < N && k < ld)
                *reinterpret_cast<uint4 *>(out + row * ld + k) = *reinterpret_cast<const uint4 *>(&rows[warp][r][c]);
        }
        __syncwarp();  // the pieces are read before the next tile's values land
    }
}

template <typename V>
qd_status expand_weights(const void *tiles, int64_t N, int64_t K, int bits, V *out, int64_t ld, cudaStream_t s) {
    const int64_t bands = ceil_div(N, 16), tpb = ceil_div(K, tile_k(bits));
    const unsigned grid = qd::grid_for(bands * tpb, EXPAND_WARPS);
    const uint32_t *w = static_cast<const uint32_t *>(tiles);
    constexpr int threads = EXPAND_WARPS * 32;
    if (bits == 8) expand_weights_kernel<8, V><<<grid, threads, 0, s>>>(w, N, ld, {bands, tpb}, out);
    else if (bits == 4) expand_weights_kernel<4, V><<<grid, threads, 0, s>>>(w, N, ld, {bands, tpb}, out);
    else expand_weights_kernel<2, V><<<grid, threads, 0, s>>>(w, N, ld, {bands, tpb}, out);
    return qd::launched();
}

// Scale tiles: [band][block along K][g][rows g, g + 8], rows past N as row N - 1.
__global__ void tile_scales_kernel(const float *__restrict__ s, int64_t N, int64_t bn, int64_t blocks,
                                   int64_t count, float *__restrict__ out) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < count;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = std::min<int64_t>(16 * (i / (16 * blocks)) + ((i >> 1) & 7) + 8 * (i & 1), N - 1);
        out[i] = s[row / bn * blocks + (i >> 4) % blocks];
    }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }


// c[16x8] += a[16x16] * b[16x8], 16-bit operands, float32 accumulators.
template <int MODE>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    qd::mma_16bit<MODE == F16>(c, a, b0, b1);
}

// The lane's rows of the x slice, one per n8 tile: row 8 mt + g, or for rows past
// M (not in the slice) row M - 1.  Those rows meet only outputs past M, which
// are never stored, and the loads need no predicate.
template <int MT>
struct XRows {
    const unsigned char *row[MT];
    __device__ XRows(const unsigned char *xs, int row_bytes, int g, int M) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) row[mt] = xs + min(8 * mt + g, M - 1) * row_bytes;
    }
};

// B fragments of one k16 step for MT n8 tiles of x from the shared slice:
// b[part][tile][reg], from the lane's 4 adjacent values (index `at`) of its rows.
// Returns whether parts 1 and 2 are needed (only float32 x has them).
template <int MODE, int MT>
__device__ __forceinline__ bool x_fragments(const XRows<MT> &xr, int at,
                                            uint32_t (&b)[MODE == SPLIT ? 3 : 1][MT][2]) {
    if constexpr (MODE != SPLIT) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const uint2 v = *reinterpret_cast<const uint2 *>(xr.row[mt] + 2 * at);
            b[0][mt][0] = v.x;
            b[0][mt][1] = v.y;
        }
        return false;
    } else {
        float v[MT][4];
        bool residue = false;  // left in v: what the hi parts miss
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float4 f = *reinterpret_cast<const float4 *>(xr.row[mt] + 4 * at);
            v[mt][0] = f.x; v[mt][1] = f.y; v[mt][2] = f.z; v[mt][3] = f.w;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float &x0 = v[mt][2 * h], &x1 = v[mt][2 * h + 1];
                const uint32_t top = b[0][mt][h] = pack_bf16(x0, x1);
                x0 -= bf_lo(top);
                x1 -= bf_hi(top);
                x0 = isfinite(x0) ? x0 : 0.f;  // inf or NaN x: the hi part carries it
                x1 = isfinite(x1) ? x1 : 0.f;
                residue |= x0 != 0.f || x1 != 0.f;
            }
        }
        if (!__any_sync(~0u, residue)) return false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float x0 = v[mt][2 * h], x1 = v[mt][2 * h + 1];
                const uint32_t mid = b[1][mt][h] = pack_bf16(x0, x1);
                b[2][mt][h] = pack_bf16(x0 - bf_lo(mid), x1 - bf_hi(mid));
            }
        return true;
    }
}

// Where a warp's stream of K stands against the scale blocks: the products of
// each block collect in c and are added into acc times the block's scales when
// the block ends.
// The scales come in tiles (qd_cuda_fq_tile_scales): for each band and block
// along K, the 16 rows' scales as 8 pairs (rows g and g + 8), 64 bytes.  A block
// copies its bands' scales for its range of K into shared memory with its first
// copies, so a block's end reads them there.  Read from device memory at each
// block's end, they cost int4 block 32 6.7 us of 23 at (16, 4096, 11008) on an
// H200: the load's latency, exposed every few steps.
template <int MT>
struct ScaleRun {
    const float2 *pair;   // this lane's scale pairs (weight rows g and g + 8) in shared memory
    unsigned block, last; // the current block along K, and the last, counted from the slice's first
    float scale[2];       // the current block's scales
    unsigned left;        // k16 steps until the current block ends
    float c[MT][4], acc[MT][4];

    __device__ __forceinline__ void load() {
        const float2 v = pair[8 * block];
        scale[0] = v.x;
        scale[1] = v.y;
    }
    __device__ __forceinline__ void flush() {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                    acc[mt][e] = fmaf(scale[h], c[mt][e], acc[mt][e]);
                    c[mt][e] = 0.f;
                }
    }
    // `steps` k16 steps are done: at most to the end of the current block.
    // No branch on whether a block follows (with one, the compiler copied the
    // sums' registers on both paths: 49 instructions per block end, now 35):
    // steps past K (zero tiles) keep the last block.
    __device__ __forceinline__ void next_block() {
        flush();
        block = min(block + 1, last);
        load();
    }
    __device__ __forceinline__ void steps_done(unsigned steps, unsigned steps_per_block) {
        left -= steps;
        if (left) return;
        left = steps_per_block;
        next_block();
    }
};

// Where the stream checks for the end of a scale block: after every k16 step,
// only after a tile's last (when blocks hold whole tiles), or never (one block
// along K: the sums are scaled once, after the stream).  A positive value k:
// tiles hold whole blocks of k steps, which end after every k-th step of a tile,
// known when compiled (no count, no check).
enum BlockEnds { EACH_STEP = -3, EACH_TILE = -2, NONE = -1 };

// One tile of the warp's stream: its STEPS k16 steps into run.c.
template <int BITS, int MODE, int MT, int ENDS>
__device__ __forceinline__ void tile_product(const Operand &op, int local_k, uint4 wv, const XRows<MT> &xr,
                                             int t, ScaleRun<MT> &run) {
    using T = Tiling<BITS>;
    const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int s = 0; s < T::STEPS; ++s) {
        uint32_t b[MODE == SPLIT ? 3 : 1][MT][2];
        const bool parts = x_fragments<MODE, MT>(xr, local_k + 16 * s + 4 * t, b);
        uint32_t a[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int P = 4 * s + r;
            a[r] = weight_pair<BITS, MODE>(words[P / T::HALF], P % T::HALF);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma<MODE>(run.c[mt], a, b[0][mt][0], b[0][mt][1]);
            if constexpr (MODE == SPLIT) {
                if (parts) {
                    mma<MODE>(run.c[mt], a, b[1][mt][0], b[1][mt][1]);
                    mma<MODE>(run.c[mt], a, b[2][mt][0], b[2][mt][1]);
                }
            }
        }
        if constexpr (ENDS == EACH_STEP) run.steps_done(1, op.steps_per_block);
        if constexpr (ENDS > 0) {
            if ((s + 1) % ENDS == 0) run.next_block();
        }
    }
    if constexpr (ENDS == EACH_TILE) run.steps_done(T::STEPS, op.steps_per_block);
}

// The 16 bytes of x that hold the end of K: the first `bytes` (a multiple of SIZE,
// less than 16) read, the rest zero.  x is read with plain loads, not cp.async:
// waiting for copies waits for the ring's too, and x arrived 1.5 us sooner
// this way on average (0.5-2.3 us less per call).
template <int SIZE>
__device__ __forceinline__ uint4 x_tail(const char *src, int bytes) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if constexpr (SIZE == 4) {
            w[i] = 4 * i < bytes ? __ldcg(reinterpret_cast<const unsigned *>(src) + i) : 0u;
        } else {
            const unsigned short *h = reinterpret_cast<const unsigned short *>(src) + 2 * i;
            w[i] = (4 * i < bytes ? __ldcg(h) : 0u) | (4 * i + 2 < bytes ? (uint32_t)__ldcg(h + 1) << 16 : 0u);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// Counts a finished block in: release for this block's writes (ordered before by
// a barrier), acquire for the other blocks' when this is the last one.
__device__ __forceinline__ unsigned ticket_arrive(unsigned *ticket) {
    unsigned old;
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(ticket) : "memory");
    return old;
}

// When K is split over blocks (and they do not form a cluster), each warp is one
// split of its band: split blockIdx.y * kw + part of gridDim.y * kw.  A warp
// stores its sums as its lanes hold them (one 16-byte store per n8 tile, no pass
// through shared memory, no wait for the block's other warps), and the band's
// last warp to finish adds every split's sums in split order and stores the
// outputs.  At (16, 4096, 11008) the block-wide pass this replaces took 2 us after
// the slowest warp's tiles.
template <int MT>
__device__ __forceinline__ void band_split_sums(const float (&acc)[MT][4], const Operand &op, int64_t band,
                                                int split, int splits, int lane, void *out, int out_dtype,
                                                float *__restrict__ partial, unsigned *__restrict__ tickets) {
    float4 *band_sums = reinterpret_cast<float4 *>(partial) + band * splits * 32 * MT + lane;  // [split][mt][lane]
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        band_sums[(split * MT + mt) * 32] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
    __syncwarp();  // the lanes' sums are written; lane 0's ticket releases them
    unsigned last = 0;
    if (lane == 0) last = ticket_arrive(&tickets[band]) == (unsigned)splits - 1;
    __syncwarp();  // ... and acquires the other warps' for every lane
    if (!__shfl_sync(~0u, last, 0)) return;
    // Four splits' loads in flight at a time (a trip to L2 each otherwise); the
    // zeros past the last split change no sum.
    float total[MT][4] = {};
#pragma unroll 1
    for (int y0 = 0; y0 < splits; y0 += 4) {
        float4 v[4][MT];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                v[j][mt] = y0 + j < splits ? __ldcg(band_sums + ((y0 + j) * MT + mt) * 32) : float4{};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                total[mt][0] += v[j][mt].x;
                total[mt][1] += v[j][mt].y;
                total[mt][2] += v[j][mt].z;
                total[mt][3] += v[j][mt].w;
            }
    }
    // Lane (g, t) holds weight rows g, g + 8 and x rows 2t, 2t + 1 of each n8 tile.
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int m = 8 * mt + 2 * t + (e & 1);
            const int64_t n = 16 * band + g + 8 * (e >> 1);
            if (m < op.M && n < op.N) qd::store_from_f32(out, out_dtype, m * op.N + n, total[mt][e]);
        }
    if (lane == 0) tickets[band] = 0;  // ready for the next launch
}

// Whether the launch's splits of K form one cluster (read afresh where needed,
// not held in a register through the tile loop).
__device__ __forceinline__ bool splits_in_cluster() { return gridDim.y > 1 && qd::cluster_blocks() == gridDim.y; }

// Copies of weight tiles.  8-bit tiles leave L2 first: every byte of them is read
// once, and x and the splits' sums, read again, stay (0.3 us less at
// N = 11008 on an H200).  4-bit tiles measured no better that way.
template <int BITS>
struct TileCopy {
    uint64_t policy;
    __device__ __forceinline__ TileCopy() {
        if constexpr (BITS == 8) policy = qd::l2_evict_first();
    }
    __device__ __forceinline__ void operator()(uint4 *dst, const uint4 *src, bool valid) const {
        if constexpr (BITS == 8) qd::cp_async16(dst, src, valid, policy);
        else qd::cp_async16(dst, src, valid);
    }
};

// The warp's tiles through its ring of RING slots, copied G at a time, RING ahead of use.
template <int BITS, int MODE, int MT, int RING, int ENDS>
__device__ __forceinline__ void stream_tiles(const Operand &op, int tiles, const uint4 *src, uint4 *slots,
                                             const XRows<MT> &xr, int local0, int t, ScaleRun<MT> &run,
                                             const TileCopy<BITS> &copy) {
    using T = Tiling<BITS>;
    constexpr int G = group_tiles(BITS, MT), GROUPS = RING / G;
    const int64_t step = TileOrder<BITS>{op.bands, op.tiles_per_band}.stride() * 32;
    // The next copy's source walks with the tiles (no 64-bit multiply per tile).
    const uint4 *next = src + RING * step, *const last = src + (int64_t)(tiles - 1) * step;
    // Tiles i .. i + count - 1 (count <= G) from ring group d (constant offsets),
    // and the group refilled.
    auto group = [&](int i, int d, int count) {
        qd::cp_async_wait<GROUPS - 1>();  // group d (copied by this lane)
#pragma unroll
        for (int j = 0; j < G; ++j)
            if (j < count) tile_product<BITS, MODE, MT, ENDS>(op, local0 + (i + j) * T::KT, slots[(d * G + j) * 32], xr,
                                                              t, run);
#pragma unroll
        for (int j = 0; j < G; ++j) {
            // past the warp's tiles: an empty copy (no branch), from its last tile
            const bool more = i + j + RING < tiles;
            copy(slots + (d * G + j) * 32, more ? next + j * step : last, more);
        }
        qd::cp_async_commit();
        next += G * step;
    };
    int i0 = 0;
    for (; i0 + RING <= tiles; i0 += RING)  // whole turns of the ring: no test per tile
#pragma unroll
        for (int d = 0; d < GROUPS; ++d) group(i0 + d * G, d, G);
#pragma unroll
    for (int d = 0; d < (RING + G - 2) / G; ++d)  // the rest: fewer than RING tiles
        if (i0 + d * G < tiles) group(i0 + d * G, d, tiles - (i0 + d * G));
}

// The stream for blocks of `steps_per_block` k16 steps that tiles hold whole (K: 1, 2, 4, ...).
template <int BITS, int MODE, int MT, int RING, int K = 1>
__device__ __forceinline__ void stream_blocks_within_tiles(unsigned steps_per_block, const Operand &op, int tiles,
                                                           const uint4 *src, uint4 *slots, const XRows<MT> &xr,
                                                           int local0, int t, ScaleRun<MT> &run,
                                                           const TileCopy<BITS> &copy) {
    if constexpr (K < Tiling<BITS>::STEPS) {
        if (steps_per_block == K)
            stream_tiles<BITS, MODE, MT, RING, K>(op, tiles, src, slots, xr, local0, t, run, copy);
        else stream_blocks_within_tiles<BITS, MODE, MT, RING, 2 * K>(steps_per_block, op, tiles, src, slots, xr,
                                                                         local0, t, run, copy);
    }
}

// XIN: x's dtype (QD_CUDA_BF16, QD_CUDA_F16 or QD_CUDA_F32).  A block's warps are
// WARPS / kw bands times kw parts of the block's K range (kw: 1, 2, 4 or 8), of
// tiles_per_part tiles each (0: the range spread evenly).  RING: tiles in flight per warp.
template <int BITS, int XIN, int MT, int RING>
__global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
fq_kernel(Operand op, int tiles_per_split, int tiles_per_part, int kw, int row_bytes, void *__restrict__ out,
          int out_dtype, float *__restrict__ partial, unsigned *__restrict__ tickets) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    // never launched: the deep ring goes with sm_90 code (DeviceState::deep_ring); no time compiling it
    if constexpr (RING != ring_slots(BITS, MT, false)) return;
#endif
    using T = Tiling<BITS>;
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int G = group_tiles(BITS, MT);
    float *received = reinterpret_cast<float *>(smem);                       // [split][share]
    uint4 *ring = reinterpret_cast<uint4 *>(smem + received_bytes(op.M));    // [WARPS][RING][32 lanes]
    unsigned char *xs = smem + received_bytes(op.M) + ring_bytes(RING);      // [M][row_bytes]: x slice, zero past K
    float2 *scales = reinterpret_cast<float2 *>(xs + op.M * row_bytes);      // [band][block][8 pairs]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int bands_per_block = WARPS / kw, part = warp % kw;
    const int64_t band = (int64_t)blockIdx.x * bands_per_block + warp / kw;
    const int kt_begin = blockIdx.y * tiles_per_split;
    const int kt_end = (int)min((int64_t)kt_begin + tiles_per_split, op.tiles_per_band);
    const int per_part = tiles_per_part ? tiles_per_part : (kt_end - kt_begin + kw - 1) / kw;
    const int my_begin = min(kt_begin + part * per_part, kt_end);
    const int tiles = band < op.bands ? min(per_part, kt_end - my_begin) : 0;

    // The next decode step's kernel may start now: it streams its first tiles
    // while this one finishes (see qd::wait_for_prior_grids).
    qd::allow_dependent_launch();
    // Splits in one cluster write their sums into each other's shared memory,
    // which may be written only once every block has started: this block has.
    if (splits_in_cluster()) qd::cluster_arrive<false>();

    // The scale tiles of the block's bands and range of K (scale_blocks blocks from
    // first_block on), in a copy group of their own ahead of the ring's.
    // They and the weight tiles are complete before any launch (qd_cuda_fq_tile_scales,
    // qd_cuda_fq_tile_weights), so they may be read before earlier grids finish.
    const unsigned first_block = (unsigned)kt_begin * T::KT / op.bk;
    const unsigned scale_blocks = min(((unsigned)kt_end * T::KT + op.bk - 1) / op.bk, op.blocks) - first_block;
    {
        const int chunks = bands_per_block * scale_blocks * 4;  // 16-byte pieces
        const int64_t band0 = (int64_t)blockIdx.x * bands_per_block;
        for (int c = threadIdx.x; c < chunks; c += THREADS) {
            const int b = c / (scale_blocks * 4), piece = c - b * scale_blocks * 4;
            const int64_t src_band = min(band0 + b, op.bands - 1);
            qd::cp_async16(reinterpret_cast<uint4 *>(scales) + c,
                           reinterpret_cast<const uint4 *>(op.s + (src_band * op.blocks + first_block) * 8) + piece,
                           true);
        }
        qd::cp_async_commit();
    }
    // This warp's tiles, RING of them in flight from the start, in groups of G.
    const TileOrder<BITS> order{op.bands, op.tiles_per_band};
    const uint4 *src = op.w + order.index(band < op.bands ? band : 0, my_begin) * 32 + lane;
    uint4 *slots = ring + warp * RING * 32 + lane;
    const TileCopy<BITS> copy;
#pragma unroll
    for (int d = 0; d < RING; ++d) {
        if (d < tiles) copy(slots + d * 32, src + d * order.stride() * 32, true);
        if (d % G == G - 1) qd::cp_async_commit();
    }
    const int64_t kw0 = (int64_t)my_begin * T::KT;  // first K value of this warp's run
    const int local0 = (my_begin - kt_begin) * T::KT;  // ... in the slice

    ScaleRun<MT> run;
    {
        // K is below 2^31 (checked on entry): 32-bit division is enough
        run.last = scale_blocks - 1;
        run.block = min((unsigned)kw0 / op.bk - first_block, run.last);
        run.pair = scales + (warp / kw) * scale_blocks * 8 + g;
        run.left = op.steps_per_block - ((unsigned)kw0 / 16) % op.steps_per_block;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) run.c[mt][e] = run.acc[mt][e] = 0.f;
    }

    // x and every output may belong to earlier kernels: from here on.
    qd::wait_for_prior_grids();
    // The x slice: the block's K range from kt_begin on, values past K zero.
    // Thread c copies chunk c of every row: K arithmetic once, then row strides.
    // Chunks wholly inside K first, in a loop of plain 16-byte loads (with the
    // end-of-K cases in the same loop, M = 16 took 2-5 us longer).
    constexpr int x_size = XIN == QD_CUDA_F32 ? 4 : 2, per_chunk = 16 / x_size;
    const int64_t k0 = (int64_t)kt_begin * T::KT;
    const int chunks = (kt_end - kt_begin) * T::KT / per_chunk;
    const int64_t inside = (op.K - k0) / per_chunk;  // k0 < K
    const int whole = inside < chunks ? (int)inside : chunks;
    const int64_t row_stride = op.ldx * x_size;
    for (int c = threadIdx.x; c < whole; c += THREADS) {
        const char *xsrc = static_cast<const char *>(op.x) + (k0 + (int64_t)c * per_chunk) * x_size;
        unsigned char *dst = xs + 16 * c;
        for (int m = 0; m < op.M; ++m, dst += row_bytes, xsrc += row_stride)
            *reinterpret_cast<uint4 *>(dst) = __ldcg(reinterpret_cast<const uint4 *>(xsrc));
    }
    for (int c = whole + threadIdx.x; c < chunks; c += THREADS) {  // K's last values, then zeros
        const int64_t k = k0 + (int64_t)c * per_chunk, left = (op.K - k) * x_size;
        const int bytes = left < 0 ? 0 : (int)left;
        const char *xsrc = static_cast<const char *>(op.x) + (bytes ? k * x_size : 0);
        unsigned char *dst = xs + 16 * c;
        for (int m = 0; m < op.M; ++m, dst += row_bytes, xsrc += bytes ? row_stride : 0)
            *reinterpret_cast<uint4 *>(dst) = x_tail<x_size>(xsrc, bytes);
    }
    qd::cp_async_wait<RING / G>();  // this thread's copies of the scales
    __syncthreads();                // x and the scales are in
    run.load();
    constexpr int MODE = XIN == QD_CUDA_F32 ? SPLIT : XIN == QD_CUDA_F16 ? F16 : BF16;
    const XRows<MT> xr(xs, row_bytes, g, op.M);
    // A warp's run starts on a tile: when blocks hold whole tiles they end on one.
    if (op.blocks == 1)
        stream_tiles<BITS, MODE, MT, RING, NONE>(op, tiles, src, slots, xr, local0, t, run, copy);
    else if (op.steps_per_block % T::STEPS == 0)
        stream_tiles<BITS, MODE, MT, RING, EACH_TILE>(op, tiles, src, slots, xr, local0, t, run, copy);
    else if (T::STEPS % op.steps_per_block == 0)
        stream_blocks_within_tiles<BITS, MODE, MT, RING>(op.steps_per_block, op, tiles, src, slots, xr, local0, t,
                                                         run, copy);
    else
        stream_tiles<BITS, MODE, MT, RING, EACH_STEP>(op, tiles, src, slots, xr, local0, t, run, copy);
    qd::cp_async_wait<0>();
    run.flush();  // the block the stream ends in
    const auto &acc = run.acc;
    const bool split = gridDim.y > 1, in_cluster = splits_in_cluster();
    if (split && !in_cluster) {
        if (band < op.bands)
            band_split_sums<MT>(acc, op, band, blockIdx.y * kw + part, gridDim.y * kw, lane, out, out_dtype,
                                partial, tickets);
        return;
    }

    // The kw parts of a band meet in shared memory (from the ring's space on; the
    // launch checks that they fit), in part order.
    // Lane (g, t) holds weight rows g, g + 8 and x rows 2t, 2t + 1 of each n8 tile.
    constexpr int RED = MT * 8 * RS;  // one warp's sums: [m][row]
    float *red = reinterpret_cast<float *>(ring);
    __syncthreads();  // every warp is done with its ring
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            red[warp * RED + (8 * mt + 2 * t + (e & 1)) * RS + g + 8 * (e >> 1)] = acc[mt][e];
    __syncthreads();
    // Output o of the block is x row o / rows and weight row o % rows (rows: a
    // power of two, at most 128 < THREADS).  Thread i adds up outputs i, i + THREADS,
    // ...: weight row r = i % rows of x rows m0, m0 + m_step, ..., so stores coalesce.
    // In a cluster, block y adds up outputs y * share ... (y + 1) * share - 1 of the
    // group (every split's sums for them are sent to it).
    // The loops from here on run once per block and stay rolled where they can:
    // their code is fetched cold at the kernel's end, and unrolled copies of it
    // made each block's end 1-2 us longer.
    static_assert(WARPS * 16 <= THREADS, "every thread keeps one weight row");
    const int rows = bands_per_block * 16, shift = __ffs(rows) - 1, outputs = op.M * rows;
    const int share = (outputs + gridDim.y - 1) / gridDim.y;
    const int r = threadIdx.x & (rows - 1), m0 = threadIdx.x >> shift, m_step = THREADS >> shift;
    const int64_t n = (int64_t)blockIdx.x * rows + r;
    const int my_rows = n < op.N ? op.M : 0;  // x rows m < my_rows have an output in row n
    if (in_cluster) qd::cluster_wait();  // every block of the cluster has started
    const float *sums = red + (r >> 4) * kw * RED + (r & 15);  // row r's sums from its band's part 0
#pragma unroll 1
    for (int m = m0; m < my_rows; m += m_step) {
        float sum = 0.f;
#pragma unroll 1
        for (int p = 0; p < kw; ++p) sum += sums[p * RED + m * RS];
        const int64_t at = m * op.N + n;
        const int o = m * rows + r;
        if (in_cluster) qd::store_in_block(received + blockIdx.y * share + o % share, o / share, sum);
        else qd::store_from_f32(out, out_dtype, at, sum);
    }
    if (!in_cluster) return;

    // The cluster: the block's share of the outputs, from every split in split order.
    qd::cluster_arrive<true>();
    qd::cluster_wait();
    for (int i = threadIdx.x; i < share; i += THREADS) {
        const int o = blockIdx.y * share + i;
        const int64_t col = (int64_t)blockIdx.x * rows + (o & (rows - 1));
        if (o >= outputs || col >= op.N) continue;
        float total = 0.f;
        for (unsigned y = 0; y < gridDim.y; ++y) total += received[y * share + i];
        qd::store_from_f32(out, out_dtype, (o >> shift) * op.N + col, total);
    }
}

// The split-K scratch (partial sums and tickets) of one stream.  Kernels touch it
// only after earlier grids finish, so launches on one stream never share it at
// once; each stream has its own, so launches on two streams (eager calls beside a
// CUDA graph's replay, say) don't either.  A launch captured into a graph keeps
// the scratch's address in the graph: from then on it is never freed.
struct StreamScratch {
    cudaStream_t stream = nullptr;
    float *partial = nullptr;
    size_t cap = 0;
    unsigned *tickets = nullptr;  // zero between launches: each band's last warp resets its own
    bool captured = false;
};

// Per device: multiprocessor count, shared memory per block, whether the kernels
// may launch early (they run sm_90 code), and the streams' split-K scratch.
struct DeviceState {
    std::atomic<int> sms{0};  // set last: nonzero once the rest is
    int device = 0;           // its index
    int block_smem = 0;       // dynamic shared memory per block: half an SM's
    bool deep_ring = false;   // 8-bit tiles take the deep ring (ring_slots)
    bool early = false;
    std::vector<StreamScratch> scratch;
    std::vector<float *> kept;  // outgrown partial sums that graphs still hold
};
DeviceState states[qd::MAX_DEVICES];
// Guards the states' set-up and the scratch: a launch that uses the scratch is
// queued under it, so that another thread growing the scratch frees the old
// buffer only after that launch is queued (cudaFree waits for queued work).
std::mutex state_mutex;

qd_status device_state(DeviceState **out) {
    int dev = 0;
    qd_status st = qd::check(cudaGetDevice(&dev));
    if (st != QD_OK) return st;
    if (dev < 0 || dev >= qd::MAX_DEVICES) return QD_ERR_ARGUMENT;
    DeviceState &d = states[dev];
    if (d.sms.load(std::memory_order_acquire) == 0) {
        std::lock_guard<std::mutex> lock(state_mutex);
        int sms = 0, per_sm = 0, reserved = 0, per_block = 0;
        if ((st = qd::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev))) != QD_OK ||
            (st = qd::check(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev))) !=
                QD_OK ||
            (st = qd::check(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev))) !=
                QD_OK ||
            (st = qd::check(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))) !=
                QD_OK)
            return st;
        // less the runtime's reserve and room for the kernel's static shared memory
        d.block_smem = std::min(per_sm / BLOCKS_PER_SM - reserved - 1024, per_block);
        d.early = qd::runs_sm90_code((const void *)fq_kernel<8, QD_CUDA_BF16, 1, ring_slots(8, 1, false)>);
        d.deep_ring = d.early && d.block_smem >= DEEP_RING_SMEM;  // measured on sm_90 only
        d.device = dev;
        d.sms.store(sms, std::memory_order_release);
    }
    *out = &d;
    return QD_OK;
}

// While alive, this thread may allocate and free while a stream captures a CUDA
// graph (in the default, global capture mode those calls would end the capture).
struct RelaxedCaptureMode {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode); }
    ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode); }
};

// `bytes` of zeros in new device memory, zeroed on a stream of its own: the
// legacy stream would join a capture on a blocking stream, and the launch's
// stream, if capturing, would zero it only when the graph runs.
qd_status zeroed(void **out, size_t bytes) {
    cudaStream_t own = nullptr;
    qd_status st = qd::check(cudaMalloc(out, bytes));
    if (st != QD_OK) return st;
    if ((st = qd::check(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking))) == QD_OK) {
        if ((st = qd::check(cudaMemsetAsync(*out, 0, bytes, own))) == QD_OK) st = qd::check(cudaStreamSynchronize(own));
        cudaStreamDestroy(own);
    }
    if (st != QD_OK) cudaFree(*out);
    return st;
}

// Stream s's split-K scratch with room for `floats` partial sums; the caller
// holds state_mutex and queues its launch before letting go of it (so another
// thread growing the scratch frees the old buffer only after that launch).
qd_status stream_scratch(DeviceState &d, cudaStream_t s, size_t floats, StreamScratch **out) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    qd_status st = qd::check(cudaStreamIsCapturing(s, &capture));
    if (st != QD_OK) return st;
    StreamScratch *sc = nullptr;
    for (StreamScratch &each : d.scratch)
        if (each.stream == s) sc = &each;
    if (!sc || sc->cap < floats) {
        RelaxedCaptureMode relaxed;
        if (!sc) {
            StreamScratch fresh;
            fresh.stream = s;
            if ((st = zeroed(reinterpret_cast<void **>(&fresh.tickets), MAX_TICKETS * sizeof(unsigned))) != QD_OK)
                return st;
            d.scratch.push_back(fresh);
            sc = &d.scratch.back();
        }
        const size_t cap = std::max(floats, 2 * sc->cap);  // doubling: few outgrown buffers to keep
        float *grown = nullptr;
        if ((st = qd::check(cudaMalloc(&grown, cap * sizeof(float)))) != QD_OK) return st;
        // cudaFree synchronizes (no launch still reads the old buffer), which a capture can't
        if (sc->partial && (sc->captured || capture != cudaStreamCaptureStatusNone)) d.kept.push_back(sc->partial);
        else if (sc->partial) cudaFree(sc->partial);
        sc->partial = grown;
        sc->cap = cap;
    }
    sc->captured |= capture != cudaStreamCaptureStatusNone;
    *out = sc;
    return QD_OK;
}

// How a launch cuts K: kw warps per band, splits over blocks, tiles per split and
// per warp (0: a split's tiles spread evenly over its kw warps).
struct Cut {
    int64_t kw, splits, tiles_per_split, tiles_per_part;
};

// How a launch cuts the work: grid (band groups x splits of K), the cut, bytes
// per x slice row, whether the splits form a cluster, and the split-K scratch
// (null unless the splits meet in device memory).  Every launch takes the
// device's block_smem of dynamic shared memory.
struct Plan {
    dim3 grid;
    int tiles_per_split, tiles_per_part, kw, row_bytes;
    bool cluster;
    float *partial;
    unsigned *tickets;
};

template <int BITS, int XIN, int MT, int RING>
qd_status launch_ring(const Plan &p, const Operand &op, void *out, int out_dtype, DeviceState &d, cudaStream_t s) {
    static unsigned long long configured = 0;
    auto kernel = fq_kernel<BITS, XIN, MT, RING>;
    qd_status st = qd::allow_dynamic_smem((const void *)kernel, d.block_smem, &configured);
    if (st != QD_OK) return st;
    const dim3 cluster(1, p.cluster ? p.grid.y : 1);
    return qd::launch(kernel, p.grid, THREADS, d.block_smem, s, d.early, cluster, op, p.tiles_per_split,
                      p.tiles_per_part, p.kw, p.row_bytes, out, out_dtype, p.partial, p.tickets);
}

template <int BITS, int XIN, int MT>
qd_status launch(const Plan &p, const Operand &op, void *out, int out_dtype, DeviceState &d, cudaStream_t s) {
    constexpr int SHALLOW = ring_slots(BITS, MT, false), DEEP = ring_slots(BITS, MT, true);
    if constexpr (DEEP != SHALLOW)
        if (d.deep_ring) return launch_ring<BITS, XIN, MT, DEEP>(p, op, out, out_dtype, d, s);
    return launch_ring<BITS, XIN, MT, SHALLOW>(p, op, out, out_dtype, d, s);
}

template <int BITS, int XIN>
qd_status launch_rows(const Plan &p, const Operand &op, void *out, int out_dtype, DeviceState &d,
                      cudaStream_t s) {
    if (op.M <= 8) return launch<BITS, XIN, 1>(p, op, out, out_dtype, d, s);
    if constexpr (XIN != QD_CUDA_F32)  // float32 x comes in launches of MAX_M_F32 rows
        if (op.M > 16) return launch<BITS, XIN, 4>(p, op, out, out_dtype, d, s);
    return launch<BITS, XIN, 2>(p, op, out, out_dtype, d, s);
}

template <int BITS>
qd_status launch_x(const Plan &p, const Operand &op, void *out, int out_dtype, DeviceState &d, cudaStream_t s) {
    if (op.x_dtype == QD_CUDA_BF16) return launch_rows<BITS, QD_CUDA_BF16>(p, op, out, out_dtype, d, s);
    if (op.x_dtype == QD_CUDA_F16) return launch_rows<BITS, QD_CUDA_F16>(p, op, out, out_dtype, d, s);
    return launch_rows<BITS, QD_CUDA_F32>(p, op, out, out_dtype, d, s);
}

qd_status launch_bits(int bits, const Plan &p, const Operand &op, void *out, int out_dtype, DeviceState &d,
                      cudaStream_t s) {
    if (bits == 8) return launch_x<8>(p, op, out, out_dtype, d, s);
    if (bits == 4) return launch_x<4>(p, op, out, out_dtype, d, s);
    return launch_x<2>(p, op, out, out_dtype, d, s);
}

// The most tiles of K a block's slice holds for `rows` rows of x: the ring, the
// sums received, the x slice (rows padded by up to 191 bytes, see row_bytes) and
// up to WARPS bands' scales (64 bytes a block along K; the slice may start and
// end inside a block) in the device's block_smem.
int64_t slice_tiles(const Operand &op, int rows, int bits, const DeviceState &d) {
    const int64_t kt = tile_k(bits), x_size = (int64_t)qd::dtype_bytes(op.x_dtype);
    auto smem_for = [&](int64_t tiles) {
        const int64_t blocks = std::min<int64_t>(op.blocks, ceil_div(tiles * kt, op.bk) + 1);
        return ring_bytes(ring_slots(bits, x_tiles(rows), d.deep_ring)) + received_bytes(rows) +
               rows * (tiles * kt * x_size + 191) + WARPS * 64 * blocks;
    };
    int64_t fit = 0;
    for (int64_t step = int64_t(1) << 40; step; step >>= 1)
        if (fit + step <= op.tiles_per_band && smem_for(fit + step) <= d.block_smem) fit += step;
    return fit;
}

// Each block reads its slice of x from L2: fewer bands per block (more warps per
// band) multiply that traffic, so it stays under a quarter of the weight bytes,
// except that fewer splits are worth more at few rows of x.  Measured at
// K = N = 4096 on an H200: at M = 4, eight warps per band and no split take
// 0.2 us less than four and two splits, and those 0.2-0.4 us less than one and
// eight; at M = 16 one warp per band and eight splits take 0.4 us less than
// four and two (the x traffic costs more than the splits' sums).
int64_t max_warps_per_band(const Operand &op, int bits) {
    const int64_t x_size = (int64_t)qd::dtype_bytes(op.x_dtype), x_bound = 4 * bits / (op.M * x_size);
    return std::max<int64_t>(op.M <= 4 ? 8 : op.M <= 8 ? 4 : 1, x_bound);
}

// The fastest cut for these rows.  Of the ways to cut the work into kw warps per
// band and splits of K, the one with the most warps at work while every block has
// an SM slot of its own (so every SM gets the same work); ties go to fewer splits,
// whose sums cost more than those of one block.  When no cut fits the slots, the
// fewest blocks.
Cut fastest_cut(const Operand &op, int bits, int64_t fit, int64_t slots) {
    const int64_t tpb = op.tiles_per_band, min_splits = ceil_div(tpb, fit), kw_max = max_warps_per_band(op, bits);
    int64_t kw = 1, splits = min_splits, best_warps = -1, best_blocks = 0;
    for (int64_t k = 1; k <= WARPS && k <= kw_max; k *= 2) {
        const int64_t per_split = ceil_div(op.bands, WARPS / k);
        int64_t sp = std::min(tpb, std::max(min_splits, slots / per_split));
        sp = ceil_div(tpb, ceil_div(tpb, sp));  // whole tiles per split
        if (k > 1 && k > ceil_div(tpb, sp)) break;  // every warp of a band needs a tile
        const int64_t blocks = per_split * sp, warps = blocks <= slots ? op.bands * k * sp : 0;
        const bool better = warps > best_warps || (warps == best_warps && (warps ? sp < splits : blocks < best_blocks));
        if (better) {
            kw = k;
            splits = sp;
            best_warps = warps;
            best_blocks = blocks;
        }
    }
    return {kw, splits, ceil_div(tpb, splits), 0};  // ceil_div(tpb, tps) == splits: normalized above
}

// The batch-invariant cut: the parts (one warp's run of tiles each) are those of
// fastest_cut for INVARIANT_M rows (one warp per band), whatever M; M only deals them
// out, kw parts of a band to one block and parts / kw splits.  Their sums are
// added in part order on every path (two splits meet in a cluster only as single
// parts), so a row's result does not depend on M.
Cut invariant_cut(const Operand &op, int bits, int64_t fit_max, int64_t fit, int64_t slots) {
    Operand most = op;
    most.M = INVARIANT_M;
    const Cut c = fastest_cut(most, bits, fit_max, slots);  // kw == 1 at INVARIANT_M rows
    const int64_t parts = c.splits, per_part = c.tiles_per_split, kw_max = max_warps_per_band(op, bits);
    int64_t kw = 1;
    for (int64_t k = 2; k <= WARPS && k <= kw_max; k *= 2)
        if (parts % k == 0 && k * per_part <= fit) kw = k;
    return {kw, parts / kw, kw * per_part, per_part};
}

// One launch for up to MAX_M rows of x (MAX_M_F32, INVARIANT_M).
qd_status fq_slice(Operand op, void *out, int out_dtype, int bits, bool invariant, cudaStream_t s) {
    DeviceState *d = nullptr;
    qd_status st = device_state(&d);
    if (st != QD_OK) return st;
    const int64_t kt = tile_k(bits), x_size = (int64_t)qd::dtype_bytes(op.x_dtype);
    const int64_t fit = slice_tiles(op, op.M, bits, *d), slots = (int64_t)BLOCKS_PER_SM * d->sms;
    // a device with too little shared memory for these rows
    if (fit < 1 || received_bytes(op.M) + part_sums_bytes(x_tiles(op.M)) > d->block_smem) return QD_ERR_SHAPE;
    Cut cut;
    if (invariant) {  // the parts of INVARIANT_M rows, whatever M
        const int64_t fit_max = op.M == INVARIANT_M ? fit : slice_tiles(op, INVARIANT_M, bits, *d);
        if (fit_max < 1) return QD_ERR_SHAPE;
        cut = invariant_cut(op, bits, fit_max, fit, slots);
    } else {
        cut = fastest_cut(op, bits, fit, slots);
    }
    const int64_t kw = cut.kw, splits = cut.splits, tps = cut.tiles_per_split;
    // Two splits form a cluster on sm_90 (batch-invariant: of one part each).
    const bool cluster = d->early && splits > 1 && splits <= MAX_CLUSTER && (!invariant || kw == 1);
    const int64_t blocks = ceil_div(op.bands, WARPS / kw);
    const bool split_in_memory = splits > 1 && !cluster;  // a ticket per band
    // splits are the grid's y, at most 65535 (a K of tens of millions at few columns)
    if (blocks > 0x7FFFFFFF || splits > 65535 || (split_in_memory && op.bands > MAX_TICKETS)) return QD_ERR_SHAPE;
    // Rows of the slice start 32 (64 for float32) bytes past a 128-byte line, so a
    // warp's loads of 8 rows x 4 lanes hit distinct banks.
    const int row_bytes = (int)(ceil_div(tps * kt * x_size, 128) * 128) + (x_size == 4 ? 64 : 32);
    Plan plan{dim3((unsigned)blocks, (unsigned)splits), (int)tps, (int)cut.tiles_per_part, (int)kw,
              row_bytes, cluster, nullptr, nullptr};
    if (!split_in_memory) return launch_bits(bits, plan, op, out, out_dtype, *d, s);
    // every warp's sums as its lanes hold them: 32 x 4 floats per n8 tile of x
    const size_t partial_floats = (size_t)(op.bands * splits * kw) * 32 * 4 * x_tiles(op.M);
    std::lock_guard<std::mutex> lock(state_mutex);  // queued before the scratch can move
    StreamScratch *sc = nullptr;
    if ((st = stream_scratch(*d, s, partial_floats, &sc)) != QD_OK) return st;
    plan.partial = sc->partial;
    plan.tickets = sc->tickets;
    return launch_bits(bits, plan, op, out, out_dtype, *d, s);
}

}  // namespace

extern "C" int qd_cuda_fq_wide_supported(void) { return qd::gemm_s8_sm90_usable() ? 1 : 0; }

extern "C" int qd_cuda_fq_supported(int bits, int64_t K, int64_t block_k) {
    if (bits != 8 && bits != 4 && bits != 2) return 0;
    return block_k == K || (block_k > 0 && block_k % 16 == 0);
}

extern "C" qd_status qd_cuda_fq_tile_weights(const int8_t *q, int64_t N, int64_t K, int64_t ld,
                                             int bits, void *tiles, void *stream) {
    cudaStream_t s = qd::as_stream(stream);
    const qd_status st = tile_weights<true>(q, N, K, ld, bits, tiles, s);
    if (st != QD_OK) return st;
    // fq kernels read tiles before they wait for earlier grids: the tiles are
    // finished here, once per weight.
    return qd::check(cudaStreamSynchronize(s));
}

extern "C" qd_status qd_cuda_fq_untile_weights(const void *tiles, int64_t N, int64_t K, int bits, int8_t *q,
                                               int64_t ld, void *stream) {
    return tile_weights<false>(q, N, K, ld, bits, tiles, qd::as_stream(stream));
}

extern "C" qd_status qd_cuda_fq_expand_weights(const void *tiles, int64_t N, int64_t K, int bits, int dtype,
                                               void *w16, int64_t ld, void *stream) {
    if (!tiles || !w16) return QD_ERR_NULL;
    if (bits != 8 && bits != 4 && bits != 2) return QD_ERR_SCHEME;
    if (N <= 0 || K <= 0) return QD_ERR_SHAPE;
    if (ld < K || !qd_dims_fit(N, ld, 2)) return QD_ERR_ARGUMENT;
    // The zeros past K come from the tiles, which hold them up to a whole tile of K.
    if (ld % 8 || ld > ceil_div(K, tile_k(bits)) * tile_k(bits) || reinterpret_cast<uintptr_t>(w16) % 16 ||
        reinterpret_cast<uintptr_t>(tiles) % 16)  // both read and written 16 bytes at a time
        return QD_ERR_ARGUMENT;
    if (qd::overlaps_any({w16, (size_t)(N * ld) * 2}, {{tiles, (size_t)qd_cuda_fq_tiles_bytes(N, K, bits)}}))
        return QD_ERR_ARGUMENT;
    cudaStream_t s = qd::as_stream(stream);
    if (dtype == QD_CUDA_F16) return expand_weights(tiles, N, K, bits, static_cast<__half *>(w16), ld, s);
    if (dtype == QD_CUDA_BF16) return expand_weights(tiles, N, K, bits, static_cast<__nv_bfloat16 *>(w16), ld, s);
    return QD_ERR_ARGUMENT;
}

extern "C" qd_status qd_cuda_fq_tile_scales(const float *scales, int64_t N, int64_t K, int64_t block_n,
                                            int64_t block_k, void *scale_tiles, void *stream) {
    if (!scales || !scale_tiles) return QD_ERR_NULL;
    if (N <= 0 || K <= 0 || block_n <= 0 || block_k <= 0 || N % block_n || K % block_k) return QD_ERR_SHAPE;
    if (!qd_dims_fit(N, K / block_k, sizeof(float))) return QD_ERR_ARGUMENT;
    const int64_t count = qd_cuda_fq_scale_tiles_bytes(N, K, block_k) / 4;
    if (qd::overlaps_any({scale_tiles, count * sizeof(float)},
                         {{scales, (size_t)(N / block_n * (K / block_k)) * sizeof(float)}}))
        return QD_ERR_ARGUMENT;
    cudaStream_t s = qd::as_stream(stream);
    tile_scales_kernel<<<qd::grid_for(count, 256), 256, 0, s>>>(scales, N, block_n, K / block_k, count,
                                                                static_cast<float *>(scale_tiles));
    qd_status st = qd::launched();  // the sync below does not report a launch that never ran
    if (st != QD_OK) return st;
    // fq kernels read them before they wait for earlier grids, as the weight tiles
    return qd::check(cudaStreamSynchronize(s));
}

extern "C" qd_status qd_cuda_fq_matmul(const void *x, int x_dtype, int64_t M, int64_t ldx,
                                       const void *tiles, const void *scale_tiles, int bits, int64_t N,
                                       int64_t K, int64_t block_k, void *out, int out_dtype, void *stream) {
    if (!x || !tiles || !scale_tiles || !out) return QD_ERR_NULL;
    if (bits != 8 && bits != 4 && bits != 2) return QD_ERR_SCHEME;
    if (M <= 0 || N <= 0 || K <= 0 || block_k <= 0 || K % block_k) return QD_ERR_SHAPE;
    const int x_size = (int)qd::dtype_bytes(x_dtype), out_size = (int)qd::dtype_bytes(out_dtype);
    // x, the tiles and their scales are copied in 16-byte pieces: a misaligned one would be
    // a fault that ends the CUDA context, not an error
    if (!qd_dims_fit(M, ldx, x_size) || !qd_dims_fit(M, N, out_size) || !qd::float_dtype(x_dtype) ||
        !qd::float_dtype(out_dtype) || ldx < K || ldx * x_size % 16 || reinterpret_cast<uintptr_t>(x) % 16 ||
        reinterpret_cast<uintptr_t>(tiles) % 16 || reinterpret_cast<uintptr_t>(scale_tiles) % 16 ||
        !qd_cuda_fq_supported(bits, K, block_k))
        return QD_ERR_ARGUMENT;
    if (K > 0x7FFFFFFF || N > 0x7FFFFFFF) return QD_ERR_SHAPE;  // the kernels' limit, past sizes no array has
    if (qd::overlaps_any({out, (size_t)(M * N) * out_size},
                         {{x, qd::span_bytes(M, K, ldx, x_size)},
                          {tiles, (size_t)qd_cuda_fq_tiles_bytes(N, K, bits)},
                          {scale_tiles, (size_t)qd_cuda_fq_scale_tiles_bytes(N, K, block_k)}}))
        return QD_ERR_ARGUMENT;
    Operand op{x, x_dtype, 0, ldx, K,
               static_cast<const uint4 *>(tiles), ceil_div(N, 16), ceil_div(K, tile_k(bits)), N,
               static_cast<const float2 *>(scale_tiles), (unsigned)(K / block_k), (unsigned)block_k,
               (unsigned)ceil_div(block_k, 16)};  // one block along K: never counted
    cudaStream_t s = qd::as_stream(stream);
    const bool invariant = qd_cuda_batch_invariant();
    if (!invariant && x_dtype != QD_CUDA_F32 && M >= WIDE_MIN_M && M <= WIDE_MAX_M && qd::gemm_s8_sm90_usable()) {
        // Rows for more than one decode launch: on Hopper one launch (fq_wide_sm90.cu)
        DeviceState *d = nullptr;
        qd_status st = device_state(&d);
        if (st != QD_OK) return st;
        op.M = (int)M;
        return wide_matmul(op, bits, out, out_dtype, d->device, d->sms, s);
    }
    const int rows = invariant ? INVARIANT_M : x_dtype == QD_CUDA_F32 ? MAX_M_F32 : MAX_M;
    for (int64_t m = 0; m < M; m += rows) {  // each slice streams the weights once
        op.M = (int)(M - m < rows ? M - m : rows);
        op.x = static_cast<const char *>(x) + m * ldx * x_size;
        qd_status st = fq_slice(op, static_cast<char *>(out) + m * N * out_size, out_dtype, bits, invariant, s);
        if (st != QD_OK) return st;
    }
    return QD_OK;
}

