// fq for a few tens to a few hundred rows of bf16 or f16 x on Hopper (sm_90a).
//
// The weights' decode tiles (fq_tiles.cuh) stream through a ring of asynchronous
// copies per warp, as in the decode kernel (fq_matmul.cu), and each k16 step's
// values, turned into the A fragments of the warp's 16 weight rows, go from the
// registers into wgmma m64n64k16: a warpgroup's four warps are 64 weight rows, and
// 64 rows of x, staged in shared memory (K-major, 128-byte swizzle), are B.  The
// weights stream once per 64 rows of x (decode launches: once per 32), and one
// asynchronous wgmma per warpgroup replaces 8 mma.sync and 8 shared loads of x per
// warp and k16 step.
//
// Within a k16 step the tiles hold K in the decode kernel's order: lane t's A
// registers 0-1 hold K 4t, 4t + 1 of the step and registers 2-3 K 4t + 2, 4t + 3,
// where the MMA reads its k 2t, 2t + 1 and 2t + 8, 2t + 9.  So x goes into shared
// memory in that order: of each step's eight pairs of values, pairs 0, 2, 4, 6,
// then 1, 3, 5, 7.
//
// A block is 8 warps (two warpgroups: 8 bands of 16 weight rows) by 64 rows of x
// by a split of K; it stages x PHASE_CHUNKS x 64 values of K at a time.  A few
// hundred rows fill the GPU alone; fewer are cut into splits of K.  Up to 8 splits
// of a block's outputs run as one cluster and add their float32 sums through each
// other's shared memory; more go through device memory to add_split_sums
// (split_sums.cuh).  Both add them in split order.
//
// Launches start early (programmatic dependent launch), as the decode kernel's:
// a block copies its first tiles before it waits for the earlier grids, which
// may still be writing x.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

#include "fq_wide_sm90.cuh"
#include "mma_s8.cuh"
#include "split_sums.cuh"
#include "wgmma.cuh"

namespace {

using namespace qd;
using namespace qd::fq;

constexpr int WARPS = 8, THREADS = WARPS * 32;
constexpr int TM = 64;               // rows of x per block: wgmma's n
constexpr int CHUNK = TM * 128;      // bytes of x per 64 values of K (one swizzled 128-byte row each)
constexpr int PHASE_CHUNKS = 10;     // x staged 640 values of K (80 KB) at a time: two blocks an SM
constexpr int smem_bytes(int bits) { return PHASE_CHUNKS * CHUNK + WARPS * ring_tiles(bits) * 512 + 1024; }
// Splits of K that meet in a cluster (the portable cluster size), and the floats per
// row of x of a block's sums there: a multiple of 4 (rows of float4), and a store's
// lanes (rows 2t, weight rows g) fall in distinct banks.
constexpr int MAX_CLUSTER_SPLITS = 8;
constexpr int SUM_ROW = WARPS * 16 + 4;
static_assert(TM * SUM_ROW * 4 <= PHASE_CHUNKS * CHUNK, "a block's sums fit where x was staged");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QD_WIDE_BODY 1

#define QD_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define QD_WGMMA_RS(TYPE)                                                                                     \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                              \
    "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " \
    "%10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "     \
    "%30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
// d[64 weight rows x 64 rows of x] (+)= a (this warp's 16 rows x 16 of K, registers)
// * b (64 rows of x x 16 of K, shared memory); accumulate = 0 overwrites d.
template <int MODE>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    if constexpr (MODE == F16)
        asm volatile(QD_WGMMA_RS("f16")
                     : QD_D8(0), QD_D8(8), QD_D8(16), QD_D8(24)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
    else
        asm volatile(QD_WGMMA_RS("bf16")
                     : QD_D8(0), QD_D8(8), QD_D8(16), QD_D8(24)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}
#undef QD_WGMMA_RS
#undef QD_D8

// Values of row m, K [k, k + 16), as pairs in the tiles' order: p[0..3] the even
// pairs, p[4..7] the odd ones; zeros past K or when the row is past M.
__device__ __forceinline__ void step_pairs_tail(const Operand &op, int m, int64_t k, uint32_t (&p)[8]) {
    const unsigned short *row = static_cast<const unsigned short *>(op.x) + (int64_t)min(m, op.M - 1) * op.ldx;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int64_t kk = k + 2 * q;
        const uint32_t lo = m < op.M && kk < op.K ? row[kk] : 0u;
        const uint32_t hi = m < op.M && kk + 1 < op.K ? row[kk + 1] : 0u;
        p[(q & 1) * 4 + q / 2] = lo | hi << 16;
    }
}

// x rows m0 .. m0 + TM - 1, K values [k0, k0 + 64 * chunks), into shared memory as
// wgmma's B: chunk c (64 values) at xs + c * CHUNK, row r's 128 bytes at r * 128,
// 16-byte unit u at (u ^ (r % 8)) * 16 (128-byte swizzle), each k16 step's pairs in
// the tiles' order (even pairs in its first unit, odd in its second).  Thread
// (row tid / 4, step tid % 4 of every chunk) writes the same two units of each
// chunk: two 16-byte loads and two stores a chunk, two chunks' loads in flight.
__device__ __forceinline__ void stage_x(const Operand &op, int m0, int64_t k0, int chunks, unsigned char *xs) {
    static_assert(THREADS == 4 * TM, "four threads a row of x");
    const int r = threadIdx.x >> 2, so = threadIdx.x & 3, m = m0 + r;
    unsigned char *dst = xs + r * 128;
    const int u0 = ((2 * so) ^ (r & 7)) << 4, u1 = ((2 * so + 1) ^ (r & 7)) << 4;
    const int64_t k = k0 + 16 * so;  // this thread's step of chunk 0
    // chunks whose step lies wholly inside K, read as 16-byte pieces
    const int whole = m < op.M && op.K >= k + 16 ? (int)min((int64_t)chunks, (op.K - k - 16) / 64 + 1) : 0;
    const uint4 *src = reinterpret_cast<const uint4 *>(static_cast<const unsigned short *>(op.x) +
                                                       (int64_t)min(m, op.M - 1) * op.ldx + k);
    auto put = [&](int c, uint4 lo, uint4 hi) {
        *reinterpret_cast<uint4 *>(dst + c * CHUNK + u0) = make_uint4(lo.x, lo.z, hi.x, hi.z);
        *reinterpret_cast<uint4 *>(dst + c * CHUNK + u1) = make_uint4(lo.y, lo.w, hi.y, hi.w);
    };
    int c = 0;
    for (; c + 2 <= whole; c += 2) {  // a chunk is 64 values: 8 uint4 further along the row
        const uint4 a = __ldg(src + 8 * c), b = __ldg(src + 8 * c + 1);
        const uint4 e = __ldg(src + 8 * c + 8), f = __ldg(src + 8 * c + 9);
        put(c, a, b);
        put(c + 1, e, f);
    }
    if (c < whole) {
        put(c, __ldg(src + 8 * c), __ldg(src + 8 * c + 1));
        ++c;
    }
    for (; c < chunks; ++c) {  // past M, or the end of K
        uint32_t p[8];
        step_pairs_tail(op, m, k + 64 * c, p);
        *reinterpret_cast<uint4 *>(dst + c * CHUNK + u0) = make_uint4(p[0], p[1], p[2], p[3]);
        *reinterpret_cast<uint4 *>(dst + c * CHUNK + u1) = make_uint4(p[4], p[5], p[6], p[7]);
    }
}

// The splits of K of a block's outputs are one cluster, rank = split: each block
// puts its sums in its shared memory (where x was staged), then adds up its share
// of the outputs from every block in split order, as add_split_sums does, and
// stores them.
__device__ __forceinline__ void meet_in_cluster(const float (&acc)[32], const Operand &op, int m0, void *out,
                                                int out_dtype, float *sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    __syncthreads();  // both warpgroups' wgmmas are done with the staged x
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            sums[(8 * j + 2 * t + (e & 1)) * SUM_ROW + 16 * warp + g + 8 * (e >> 1)] = acc[4 * j + e];
    cluster_arrive<true>();
    cluster_wait();
    constexpr int GROUPS = TM * WARPS * 4;  // outputs of a block, four weight rows a group
    // the cluster is the grid's z: a block's rank in it is its split
    const int splits = (int)gridDim.z, share = (GROUPS + splits - 1) / splits, first = (int)blockIdx.z * share;
    const int64_t n0 = (int64_t)blockIdx.x * WARPS * 16;
    for (int i = first + threadIdx.x; i < min(GROUPS, first + share); i += THREADS) {
        const int r = i / (WARPS * 4), c = 4 * (i % (WARPS * 4));  // row of x, first weight row of four
        const float4 *p = reinterpret_cast<const float4 *>(sums + r * SUM_ROW + c);
        float4 v[MAX_CLUSTER_SPLITS];
#pragma unroll
        for (int z = 0; z < MAX_CLUSTER_SPLITS; ++z)
            if (z < splits) v[z] = load_from_block(p, z);
        float4 total = v[0];
#pragma unroll
        for (int z = 1; z < MAX_CLUSTER_SPLITS; ++z)
            if (z < splits)
                total = make_float4(__fadd_rn(total.x, v[z].x), __fadd_rn(total.y, v[z].y),
                                    __fadd_rn(total.z, v[z].z), __fadd_rn(total.w, v[z].w));
        const int64_t m = m0 + r, n = n0 + c;
        if (m >= op.M) continue;
        const float four[4] = {total.x, total.y, total.z, total.w};
#pragma unroll
        for (int e = 0; e < 4; ++e)
            if (n + e < op.N) store_from_f32(out, out_dtype, m * op.N + n + e, four[e]);
    }
    cluster_arrive<false>();  // no block leaves while another still reads its sums
    cluster_wait();
}
#endif  // sm_90a

// Block (band group x, rows of x y, split z): k tiles [z * kt_per, + kt_per) of 8
// bands times 64 rows of x.  BLOCKS: scale blocks along K (each block's sums
// scaled as it ends), else one scale per weight row over all of K.  With splits,
// each split's scaled sums go to partial [splits][M][N], or with no partial the
// splits are a cluster and meet there; without splits the sums go to out.
template <int BITS, int MODE, bool BLOCKS>
__global__ void __launch_bounds__(THREADS, 2)
wide_kernel(Operand op, int kt_per, void *__restrict__ out, int out_dtype, float *__restrict__ partial) {
#ifdef QD_WIDE_BODY
    using T = Tiling<BITS>;
    constexpr int RING = ring_tiles(BITS);
    constexpr int PHASE_TILES = PHASE_CHUNKS * 64 / T::KT;  // whole chunks: KT divides 64 or 64 divides KT
    extern __shared__ unsigned char smem_raw[];
    unsigned char *xs = smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024;  // swizzle atoms: 1024 bytes
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int64_t band = (int64_t)blockIdx.x * WARPS + warp, my_band = band < op.bands ? band : op.bands - 1;
    const int m0 = blockIdx.y * TM;
    const int kt_begin = blockIdx.z * kt_per;
    const int tiles = (int)min((int64_t)kt_per, op.tiles_per_band - kt_begin);

    // This warp's tiles, RING of them in flight from the start.  Plain copies: with
    // the decode kernel's evict-first cache hint the copies faulted (illegal
    // instruction) in this kernel.
    const TileOrder<BITS> order{op.bands, op.tiles_per_band};
    const int64_t stride = order.stride() * 32;
    const uint4 *src = op.w + order.index(my_band, kt_begin) * 32 + lane;
    uint4 *slots = reinterpret_cast<uint4 *>(xs + PHASE_CHUNKS * CHUNK) + warp * RING * 32 + lane;
    // The next launch may start now and copy its first tiles while this one
    // finishes (see qd::wait_for_prior_grids): 4-9% less time a call back to back.
    allow_dependent_launch();
#pragma unroll
    for (int d = 0; d < RING; ++d) {
        cp_async16(slots + d * 32, src + d * stride, d < tiles);
        cp_async_commit();
    }

    float d[32], acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = acc[i] = 0.f;
    const int64_t k_first = (int64_t)kt_begin * T::KT;
    unsigned in_block = (unsigned)(k_first / 16) % op.steps_per_block;  // k16 steps into the scale block
    unsigned blk = (unsigned)(k_first / op.bk);
    float2 scale = __ldg(op.s + (my_band * op.blocks + blk) * 8 + g);  // rows g and g + 8
    int accumulate = 0;
    // x and every output may belong to earlier kernels: from here on.  (The tiles
    // and scales are complete before any launch.)
    wait_for_prior_grids();
    uint32_t a[2][4];  // two steps' A fragments: one may still be read by its wgmma
    // The ring slot and the next copy's source walk with the tiles (no division or
    // 64-bit multiply per tile); copies past the warp's last tile reread it, empty.
    int slot = 0;
    const uint4 *next = src + RING * stride, *last = src + (int64_t)(tiles - 1) * stride;
    const uint64_t base_desc = sw128_desc_at(smem_addr(xs));
    for (int p0 = 0; p0 < tiles; p0 += PHASE_TILES) {
        const int p1 = min(p0 + PHASE_TILES, tiles);
        if (p0) {  // every wgmma that reads the staged x is done before it is replaced
            wgmma_wait<0>();
            __syncthreads();
        }
        stage_x(op, m0, k_first + (int64_t)p0 * T::KT, ((p1 - p0) * T::KT + 63) / 64, xs);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma
        __syncthreads();
        for (int i = p0; i < p1; ++i) {
            cp_async_wait<RING - 1>();  // tile i (copied by this lane)
            const uint4 wv = slots[slot * 32];
            const bool more = i + RING < tiles;
            cp_async16(slots + slot * 32, more ? next : last, more);
            cp_async_commit();
            next += stride;
            slot = slot + 1 == RING ? 0 : slot + 1;
            // The B descriptor of the tile's first step: descriptors count 16-byte units,
            // a step is 32 bytes into its chunk, four steps a chunk.  A tile's steps never
            // cross a chunk unless the tile holds whole chunks.
            static_assert(4 % T::STEPS == 0 || T::STEPS % 4 == 0, "a tile's steps straddle a chunk");
            const unsigned first = (unsigned)(i - p0) * T::STEPS;
            const uint64_t tile_desc = base_desc + (first / 4) * (CHUNK / 16) + (first % 4) * 2;
            const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
            for (int s = 0; s < T::STEPS; ++s) {
                const int buf = s & 1;
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int P = 4 * s + r;
                    a[buf][r] = weight_pair<BITS, MODE>(words[P / T::HALF], P % T::HALF);
                }
                const uint64_t b = tile_desc + (s / 4) * (CHUNK / 16) + (s % 4) * 2;
                wgmma_fence();  // the A registers written above
                wgmma_rs<MODE>(d, a[buf], b, accumulate);
                wgmma_commit();
                wgmma_wait<1>();                // the step before is done with its A registers
                fence_registers(a[buf ^ 1]);
                accumulate = 1;
                if constexpr (BLOCKS) {
                    if (++in_block == op.steps_per_block) {  // the block ends: its sums, scaled
                        wgmma_wait<0>();
                        fence_registers(d);
#pragma unroll
                        for (int e = 0; e < 32; ++e) acc[e] = fmaf((e & 2) ? scale.y : scale.x, d[e], acc[e]);
                        in_block = 0;
                        blk = min(blk + 1, op.blocks - 1);  // steps past K (zero tiles) keep the last
                        scale = __ldg(op.s + (my_band * op.blocks + blk) * 8 + g);
                        accumulate = 0;
                    }
                }
            }
        }
    }
    wgmma_wait<0>();
    fence_registers(d);
    cp_async_wait<0>();
    if (!BLOCKS || in_block != 0)  // the block the split ends in
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[e] = fmaf((e & 2) ? scale.y : scale.x, d[e], acc[e]);
    if (gridDim.z > 1 && !partial) {
        meet_in_cluster(acc, op, m0, out, out_dtype, reinterpret_cast<float *>(xs));
        return;
    }
    if (band >= op.bands) return;
    // Warp w of its warpgroup holds weight rows 16w + g (+8 when e & 2) of the 64, and
    // rows 8j + 2t (+1 when e & 1) of x.
    const int64_t n = band * 16 + g;
    const int rows = min(TM, op.M - m0) - 2 * t;  // of this lane's rows 8j + 2t (+1), those below M
    const int64_t first = (partial ? (int64_t)blockIdx.z * op.M : 0) + m0 + 2 * t;  // row of out or partial
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = 8 * j + (e & 1), col = 8 * (e >> 1);
            if (row >= rows || n + col >= op.N) continue;
            const int64_t i = (first + row) * op.N + n + col;
            if (partial) partial[i] = acc[4 * j + e];
            else store_from_f32(out, out_dtype, i, acc[4 * j + e]);
        }
#endif
}

using Kernel = void (*)(Operand, int, void *, int, float *);

// A kernel with its shared memory allowed on the current device, and per device
// and cluster size how many clusters of it fit the GPU at once (0: not asked yet).
struct Configured {
    Kernel kernel;
    std::atomic<int> *max_clusters;  // [device][splits]
};

template <int BITS, int MODE, bool BLOCKS>
qd_status configured(Configured *c) {
    static unsigned long long allowed = 0;
    static std::atomic<int> max_clusters[MAX_DEVICES][MAX_CLUSTER_SPLITS + 1];
    c->kernel = wide_kernel<BITS, MODE, BLOCKS>;
    c->max_clusters = &max_clusters[0][0];
    return allow_dynamic_smem((const void *)c->kernel, smem_bytes(BITS), &allowed);
}

template <int BITS>
qd_status configured_bits(int x_dtype, bool blocks, Configured *c) {
    if (x_dtype == QD_CUDA_F16) return blocks ? configured<BITS, F16, true>(c) : configured<BITS, F16, false>(c);
    return blocks ? configured<BITS, BF16, true>(c) : configured<BITS, BF16, false>(c);
}

// How many clusters of `size` blocks of the kernel fit `device` at once (0: none).
int max_clusters(const Configured &c, int device, unsigned size, int smem) {
    if (device < 0 || device >= MAX_DEVICES) return 0;
    std::atomic<int> &known = c.max_clusters[device * (MAX_CLUSTER_SPLITS + 1) + size];
    int fit = known.load(std::memory_order_relaxed);
    if (fit == 0) {
        cudaLaunchAttribute attr{};
        attr.id = cudaLaunchAttributeClusterDimension;
        attr.val.clusterDim = {1, 1, size};
        cudaLaunchConfig_t config{};
        config.gridDim = dim3(1, 1, size);
        config.blockDim = THREADS;
        config.dynamicSmemBytes = (size_t)smem;
        config.attrs = &attr;
        config.numAttrs = 1;
        if (cudaOccupancyMaxActiveClusters(&fit, c.kernel, &config) != cudaSuccess || fit < 1) {
            cudaGetLastError();  // no clusters here: the device-memory path serves
            fit = -1;
        }
        known.store(fit, std::memory_order_relaxed);
    }
    return fit > 0 ? fit : 0;
}

}  // namespace

namespace qd {
namespace fq {

qd_status wide_matmul(const Operand &op, int bits, void *out, int out_dtype, int device, int sms,
                      cudaStream_t s) {
    const int64_t kt = tile_k(bits), blocks_xy = ceil_div(op.bands, WARPS) * ceil_div(op.M, TM);
    if (ceil_div(op.M, TM) > 65535) return QD_ERR_SHAPE;
    Configured c{};
    const bool blocks = op.blocks > 1;
    qd_status st = bits == 8   ? configured_bits<8>(op.x_dtype, blocks, &c)
                   : bits == 4 ? configured_bits<4>(op.x_dtype, blocks, &c)
                               : configured_bits<2>(op.x_dtype, blocks, &c);
    if (st != QD_OK) return st;
    const int smem = smem_bytes(bits);
    // Splits only to fill the GPU (two blocks an SM), of at least 256 values of K,
    // starting on a staged chunk of x (64 values).
    const int64_t unit = std::max<int64_t>(1, 64 / kt);
    auto cut = [&](int64_t ways) {  // tiles per split
        return ceil_div(std::max(ceil_div(op.tiles_per_band, ways), 256 / kt), unit) * unit;
    };
    // Splits as clusters: as many as let every cluster fit the GPU at once (a second
    // wave would cost more than it saves).  They save the device-memory path's
    // temporary and second kernel, worth more on an H200 than one split in eight
    // (64 rows of 4096^2: 7 splits in clusters 9% faster than 8 through device
    // memory) but not one in four or three (3 against 4: 0-4% slower, 2 against 3:
    // 8-15% slower).  With blocks so few that more than 8 splits would fill the
    // GPU, 8 in clusters beat 16 through device memory (25% less time at 64 x 4096
    // x 1024), not 32 (5% more at 64 x 14336 x 1024).
    const int64_t want = std::max<int64_t>(1, 2 * sms / blocks_xy);
    int64_t in_cluster = std::min<int64_t>(want, MAX_CLUSTER_SPLITS);
    while (in_cluster > 1 && blocks_xy > max_clusters(c, device, (unsigned)in_cluster, smem)) --in_cluster;
    const int64_t base_splits = ceil_div(op.tiles_per_band, cut(want));
    const int64_t cluster_splits = ceil_div(op.tiles_per_band, cut(in_cluster));
    const bool cluster = in_cluster > 1 && (8 * cluster_splits >= 7 * base_splits ||
                                            (want > MAX_CLUSTER_SPLITS && 2 * cluster_splits >= base_splits));
    const int64_t per = cut(cluster ? in_cluster : want), splits = ceil_div(op.tiles_per_band, per);
    if (blocks_xy * splits > 0x7FFFFFFF || splits > 65535) return QD_ERR_SHAPE;
    const dim3 grid((unsigned)ceil_div(op.bands, WARPS), (unsigned)ceil_div(op.M, TM), (unsigned)splits);
    auto run = [&](float *partial, unsigned cluster_size) {  // each split's sums to partial, or out
        return qd::launch(c.kernel, grid, THREADS, smem, s, true, dim3(1, 1, cluster_size), op, (int)per, out,
                          out_dtype, partial);
    };
    if (splits == 1) return run(nullptr, 1);
    if (cluster) return run(nullptr, grid.z);
    return with_split_sums((int)splits, op.M, op.N, nullptr, 1, 0, out, out_dtype, s,
                           [&](float *partial) { return run(partial, 1); });
}

}  // namespace fq
}  // namespace qd
