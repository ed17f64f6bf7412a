// int8 x int8 GEMM for Hopper (sm_90a): wgmma on tiles brought in by TMA.
//
// A persistent CTA of three warpgroups walks 128x256 output tiles.  Warpgroup 0
// is the producer: one thread issues the TMA loads of 128-byte K slices of A and
// B into a ring of STAGES shared-memory slots, each guarded by a "full" mbarrier
// (the TMA bytes have landed) and an "empty" one (every consumer warp is done
// reading).  Warpgroups 1 and 2 are the consumers: each multiplies 64 rows of the
// tile by all 256 columns with wgmma m64n256k32 (both operands K-major in shared
// memory, exact int32 sums in 128 registers per thread), then stores its rows
// straight from the registers while the producer already loads the next tile.
// fq_gemm's 16-bit operands run the same kernel with wgmma m64n256k16 (the same
// 32 bytes of K per row) and float32 sums.  With scales per block of K (GROUPED),
// each block's sums are scaled (int8: by its row's and column's scales; 16-bit:
// by its column's) into a second set of float sums as the block ends; both sets
// fit in the registers at 128 columns a tile.  16-bit blocks of 64 or 128 values
// take a third set: two sets of sums in turn, one filled while the other is scaled.
// 16-bit products with too few tiles to fill the SMs (prefill of a few hundred
// rows) also cut K into splits, each a tile's range of K on a CTA of its own:
// the splits store their float32 sums apart and add_split_sums (split_sums.cuh)
// adds them in split order and scales them.
#include <cuda.h>          // CUtensorMap and its enums only: the driver is reached
#include <cudaTypedefs.h>  // through the runtime, libcuda is not linked
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <mutex>
#include <numeric>
#include <type_traits>

#include "gemm_s8_sm90.cuh"
#include "mma_s8.cuh"
#include "split_sums.cuh"
#include "wgmma.cuh"

namespace {

using namespace qd;

constexpr int BM = 128, BK = 128, STAGES = 4;
constexpr int KSTEP = 32;                    // K bytes per wgmma
constexpr int THREADS = 384;                 // producer + 2 consumer warpgroups
constexpr int A_BYTES = BM * BK;
// Columns of a tile: 256, or 128 when block sums are kept beside the wgmma's.
constexpr int tile_n(bool grouped) { return grouped ? 128 : 256; }
constexpr int stage_bytes(bool grouped) { return A_BYTES + tile_n(grouped) * BK; }
// Swizzled tiles start on 1024 bytes (the swizzle pattern repeats every 8 rows of
// 128 bytes); dynamic shared memory is only 16-byte aligned, so keep room to round up.
constexpr int smem_bytes(bool grouped) { return STAGES * stage_bytes(grouped) + 1024; }
static_assert(stage_bytes(false) % 1024 == 0 && stage_bytes(true) % 1024 == 0 && A_BYTES % 1024 == 0,
              "stages stay 1024-aligned");

// sm_90a only: wgmma and setmaxnreg exist nowhere else.  The other passes (sm_80..89
// and the compute_90 PTX) compile an empty kernel that the host never launches.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QD_SM90A_BODY 1

constexpr int CONSUMER_WARPS = 8;
constexpr int WG_ROWS = 64;                  // tile rows per consumer warpgroup
constexpr int GROUP_M = 16;                  // tile rows per raster group (L2 reuse of B)
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;  // 128*40 + 256*232 <= 64K registers

__device__ __forceinline__ void mbar_init(uint64_t *bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

// Waits until the barrier's phase of this parity has completed.  On a fresh
// barrier, parity 1 counts as completed (the phase "before" phase 0).
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    } while (!done);
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Arrives and announces `bytes` of TMA data that will complete on this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

// The box of `map` at (x = K byte, y = row) into shared memory; out-of-range
// parts are zero-filled, and the full box size is counted on `bar`.
__device__ __forceinline__ void tma_load(void *dst, const CUtensorMap *map, int x, int y,
                                         uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
        "l"(map), "r"(x), "r"(y), "r"(smem_addr(bar))
        : "memory");
}


#define QD_D4(c, i) c(d[i]), c(d[i + 1]), c(d[i + 2]), c(d[i + 3])
#define QD_D16(c, i) QD_D4(c, i), QD_D4(c, i + 4), QD_D4(c, i + 8), QD_D4(c, i + 12)
#define QD_D64(c, i) QD_D16(c, i), QD_D16(c, i + 16), QD_D16(c, i + 32), QD_D16(c, i + 48)
// The operand lists of wgmma's 64 and 128 sum registers.
#define QD_WGMMA_D64                                                                                    \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                            \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                  \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                  \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QD_WGMMA_D                                                                                      \
    QD_WGMMA_D64 ", "                                                                                   \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "                  \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "                  \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "      \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// One wgmma on the sum registers d (64 or 128 a thread; their operand list D_LIST),
// `accumulate` = 0 overwriting them.  TAIL: the scale and transpose operands that
// 16-bit types take (both operands K-major, unscaled).
#define QD_WGMMA(SHAPE_TYPES, D_LIST, A, B, P, TAIL, ...)                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                                      \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {" D_LIST "}, " A ", " B ", p" TAIL ";\n}\n" \
                 : __VA_ARGS__                                                                         \
                 : "l"(a), "l"(b), "r"(accumulate))
#define QD_WGMMA_256(SHAPE_TYPES, TAIL, C) \
    QD_WGMMA(SHAPE_TYPES, QD_WGMMA_D, "%128", "%129", "%130", TAIL, QD_D64(C, 0), QD_D64(C, 64))
#define QD_WGMMA_128(SHAPE_TYPES, TAIL, C) QD_WGMMA(SHAPE_TYPES, QD_WGMMA_D64, "%64", "%65", "%66", TAIL, QD_D64(C, 0))
#define QD_16BIT ", 1, 1, 0, 0"

// d[64 x 2*DR] (+)= a[64 x 32 bytes] * b[2*DR x 32 bytes]^T: 256 columns, or 128
// where block sums are kept beside (GROUPED).
template <int OPS, int DR>
__device__ __forceinline__ void wgmma_step(typename Sums<OPS>::type (&d)[DR], uint64_t a, uint64_t b,
                                           int accumulate) {
    static_assert(DR == 128 || DR == 64, "tiles of 256 or 128 columns");
    if constexpr (DR == 128) {
        if constexpr (OPS == S8) QD_WGMMA_256("m64n256k32.s32.s8.s8", "", "+r");
        else if constexpr (OPS == F16) QD_WGMMA_256("m64n256k16.f32.f16.f16", QD_16BIT, "+f");
        else QD_WGMMA_256("m64n256k16.f32.bf16.bf16", QD_16BIT, "+f");
    } else {
        if constexpr (OPS == S8) QD_WGMMA_128("m64n128k32.s32.s8.s8", "", "+r");
        else if constexpr (OPS == F16) QD_WGMMA_128("m64n128k16.f32.f16.f16", QD_16BIT, "+f");
        else QD_WGMMA_128("m64n128k16.f32.bf16.bf16", QD_16BIT, "+f");
    }
}
#undef QD_16BIT
#undef QD_WGMMA_128
#undef QD_WGMMA_256
#undef QD_WGMMA
#undef QD_WGMMA_D
#undef QD_WGMMA_D64
#undef QD_D64
#undef QD_D16
#undef QD_D4


template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// Output element conversions: one value, or an adjacent pair as one store.
template <typename T> struct Out;
template <> struct Out<int32_t> {
    using Pair = int2;
    static __device__ int32_t one(int32_t x) { return x; }
    static __device__ int2 two(int32_t x, int32_t y) { return make_int2(x, y); }
};
template <> struct Out<float> {
    using Pair = float2;
    static __device__ float one(float x) { return x; }
    static __device__ float2 two(float x, float y) { return make_float2(x, y); }
};
template <> struct Out<__half> {
    using Pair = __half2;
    static __device__ __half one(float x) { return __float2half_rn(x); }
    static __device__ __half2 two(float x, float y) { return __floats2half2_rn(x, y); }
};
template <> struct Out<__nv_bfloat16> {
    using Pair = __nv_bfloat162;
    static __device__ __nv_bfloat16 one(float x) { return __float2bfloat16_rn(x); }
    static __device__ __nv_bfloat162 two(float x, float y) { return __floats2bfloat162_rn(x, y); }
};

// p[0] = x and, when `both`, p[1] = y; one store when the pair is aligned.
template <typename T, typename V>
__device__ __forceinline__ void store2(T *p, V x, V y, bool both, bool vec) {
    if (both && vec) {
        *reinterpret_cast<typename Out<T>::Pair *>(p) = Out<T>::two(x, y);
    } else {
        p[0] = Out<T>::one(x);
        if (both) p[1] = Out<T>::one(y);
    }
}

#endif  // sm_90a

// How GROUPED ends a block of K: its sums are scaled in place once its wgmmas are
// done (IN_PLACE); so, with one column scale for the whole tile (int8 whose weight
// scale blocks span whole tiles, ONE_COLUMN_SCALE_ENDS); or two sets of sums take
// turns, a block's wgmmas filling one while the block before's are scaled
// (TWO_SETS_ENDS: 16-bit operands whose blocks are one or two k tiles; at 2048 x
// 4096 x 4096 on an H200, blocks of 64 took 204 us against 236 in place, of 128
// 158 against 167, while blocks of 256 took 364 against 354 at N = 11008).
enum BlockEnds { IN_PLACE = 0, ONE_COLUMN_SCALE_ENDS = 1, TWO_SETS_ENDS = 2 };

// T int32_t: INT32_OUT; float / __half / __nv_bfloat16: ONE_GROUP in that dtype,
// or GROUPED (scales per block of K, sc.group_steps wgmma steps long; a scales only
// for int8 operands).
// OPS: the operands' type (Operands).  ENDS: how GROUPED ends its blocks (BlockEnds).
// With splits > 1, tile t of the walk is split t / (tiles_m * tiles_n) of its
// output tile, k tiles [split * kt_per, +kt_per), and the split's sums (for
// ONE_GROUP unscaled, for GROUPED its blocks' scaled sums) go to partial
// [splits][M][N] instead of out.
template <typename T, int OPS, bool GROUPED_, int ENDS = IN_PLACE>
__global__ void __launch_bounds__(THREADS, 1)
gemm_s8_sm90_kernel(const __grid_constant__ CUtensorMap map_a,
                    const __grid_constant__ CUtensorMap map_b, int M, int N, int64_t Kp,
                    void *out, Scales sc, int splits, int kt_per, float *__restrict__ partial) {
#ifdef QD_SM90A_BODY
    // Static, so that only this body has static shared memory: the host reads that
    // off the kernel to tell an sm_90a build from the empty ones (see probe()).
    __shared__ uint64_t full[STAGES], empty[STAGES];
    constexpr int TN = tile_n(GROUPED_), STAGE_BYTES = stage_bytes(GROUPED_);
    // GROUPED: each consumer warpgroup's column scales of the block of K that ends,
    // two buffers in turn (the barrier at one block's end then keeps the reads of
    // the block before apart from the writes of the block after)
    __shared__ __align__(16) float block_scales[GROUPED_ ? 2 * 2 * TN : 1];
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024;

    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + TN - 1) / TN;
    const int64_t per_split = (int64_t)tiles_m * tiles_n, tiles = per_split * splits;
    const int ktiles = (int)((Kp + BK - 1) / BK);
    // Output tile (tm, tn) and k tiles [kt0, kt1) of walk tile t.
    auto locate = [&](int64_t t, int &tm, int &tn, int &kt0, int &kt1) {
        raster((int)(t % per_split), tiles_m, tiles_n, GROUP_M, tm, tn);
        kt0 = (int)(t / per_split) * kt_per;
        kt1 = min(kt0 + kt_per, ktiles);
    };
    const int warpgroup = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);                // the producer's arrive; TMA adds the bytes
            // One arrive per consumer warp, each after its own wgmma.wait_group: no
            // warp's wait has to speak for the others of its warpgroup.
            mbar_init(&empty[s], CONSUMER_WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // visible to TMA
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_a) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"(&map_b) : "memory");
    }
    __syncthreads();

    // Both roles walk the same tiles and the same ring of slots: slot `stage` is on
    // its `phase`-parity use, counting on across tiles.
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            int stage = 0;
            uint32_t phase = 0;
            for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
                int tm, tn, kt0, kt1;
                locate(t, tm, tn, kt0, kt1);
                for (int kt = kt0; kt < kt1; ++kt) {
                    mbar_wait(&empty[stage], phase ^ 1);  // the slot's previous use is read
                    uint8_t *s = smem + stage * STAGE_BYTES;
                    mbar_arrive_expect_tx(&full[stage], STAGE_BYTES);
                    tma_load(s, &map_a, kt * BK, tm * BM, &full[stage]);
                    tma_load(s + A_BYTES, &map_b, kt * BK, tn * TN, &full[stage]);
                    if (++stage == STAGES) { stage = 0; phase ^= 1; }
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        constexpr bool SCALED = !std::is_same<T, int32_t>::value;
        const unsigned a_bm = (unsigned)sc.a_bm, b_bn = (unsigned)sc.b_bn;  // <= M, N: 32 bits
        T *o = static_cast<T *>(out);
        const bool vec = N % 2 == 0 && reinterpret_cast<uintptr_t>(out) % (2 * sizeof(T)) == 0;
        using Sum = typename Sums<OPS>::type;
        constexpr bool ONE_COLUMN_SCALE = ENDS == ONE_COLUMN_SCALE_ENDS, TWO_SETS = ENDS == TWO_SETS_ENDS;
        static_assert(!ONE_COLUMN_SCALE || (GROUPED_ && OPS == S8), "int8 block sums only");
        static_assert(!TWO_SETS || (GROUPED_ && OPS != S8), "16-bit block sums only");
        constexpr int DR = TN / 2;  // sums a thread holds: 64 x TN over 128 threads
        Sum d[DR], d2[TWO_SETS ? DR : 1];     // TWO_SETS: every other block's sums go to d2
        float block_sums[GROUPED_ ? DR : 1];  // GROUPED: the scaled sums of the blocks so far
#pragma unroll
        for (int i = 0; i < DR; ++i) d[i] = Sum(0);
        int stage = 0;
        uint32_t phase = 0;
        int turn = 0;  // GROUPED: which block_scales buffer the next block's end takes
        // GROUPED: blocks of K (group_steps wgmma steps each) to one scale of a row
        // and of a column; the scales' blocks are whole multiples of them
        const int64_t block_bytes = sc.group_steps * KSTEP;
        const int a_per = GROUPED_ && OPS == S8 ? (int)(sc.a_bk / block_bytes) : 1;
        const int b_per = GROUPED_ ? (int)(sc.b_bk / block_bytes) : 1;
        // ONE_COLUMN_SCALE: every column of a tile takes the thread's own column
        // scale, and a row's product of scales serves all its sums.  A kernel of its
        // own: the code of both ways in one loop ran slower from the instruction
        // cache (blocks of 32 at 4096^3: 789 us, against 613 alone).
        for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
            int tm, tn, kt0, kt1;
            locate(t, tm, tn, kt0, kt1);
            // wgmma's D layout: warp w of the warpgroup holds rows 16w..16w+15; for
            // 8-column chunk j, d[4j], d[4j+1] sit at row lane/4, columns
            // 8j + 2*(lane%4) + {0, 1}, and d[4j+2], d[4j+3] eight rows further down.
            const int r0 = tm * BM + wg * WG_ROWS + warp * 16 + lane / 4;
            const int c0 = tn * TN + 2 * (lane % 4);

            // The scales of those rows and columns (clamped to the last one), loaded
            // ahead so that their latency hides behind the wgmmas.
            float sa[2], sb[TN / 8][2];
            if constexpr (SCALED && !GROUPED_) {
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    sa[h] = sc.a ? __ldg(sc.a + (unsigned)min(r0 + 8 * h, M - 1) / a_bm * sc.a_ld) : 1.0f;
#pragma unroll
                for (int j = 0; j < TN / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        sb[j][e] = __ldg(sc.b + (unsigned)min(c0 + 8 * j + e, N - 1) / b_bn * sc.b_ld);
            }
            // GROUPED: each thread loads one column's scale of each block a block
            // ahead (a tile's K range starts on a block), and the warpgroup shares
            // them through shared memory as the block ends (with ONE_COLUMN_SCALE
            // each thread's is every column's); int8 operands also take the scales
            // of the thread's two rows, loaded a block ahead as well.
            const int group_steps = GROUPED_ ? (int)sc.group_steps : 1;
            int left = group_steps;  // wgmma steps left in this block of K
            const int block = GROUPED_ ? kt0 * (BK / KSTEP) / group_steps : 0;
            BlockWalk b_walk(b_per, (int)sc.b_ld - 1, block), a_walk(a_per, (int)sc.a_ld - 1, block);
            const float *column_scales = nullptr, *row_scales[2] = {nullptr, nullptr};
            float next_scale = 0.0f, next_row_scale[2] = {1.0f, 1.0f};
            if constexpr (GROUPED_) {
                const int col = min(tn * TN + (int)(threadIdx.x % 128), N - 1);
                column_scales = sc.b + (int64_t)((unsigned)col / b_bn) * sc.b_ld;
                next_scale = __ldg(column_scales + b_walk.index);
                if constexpr (OPS == S8) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        row_scales[h] = sc.a + (int64_t)((unsigned)min(r0 + 8 * h, M - 1) / a_bm) * sc.a_ld;
                        next_row_scale[h] = __ldg(row_scales[h] + a_walk.index);
                    }
                }
#pragma unroll
                for (int i = 0; i < DR; ++i) block_sums[i] = 0.0f;
            }

            // A block of K ends: its sums, once their wgmmas are done, scaled into
            // block_sums as gemm_s8.cu's GROUPED adds them (steps past K add zeros),
            // and the next block's scales loaded.
            auto end_block = [&](Sum (&sums)[DR]) {
                if constexpr (!GROUPED_) return;
                fence_registers(sums);
                const float row_scale[2] = {next_row_scale[0], next_row_scale[1]}, column_scale = next_scale;
                float *shared = nullptr;  // the warpgroup's column scales of the block
                if constexpr (!ONE_COLUMN_SCALE) {
                    shared = block_scales + (2 * (warpgroup - 1) + turn) * TN;
                    turn ^= 1;
                    shared[threadIdx.x % 128] = next_scale;
                    // the warpgroup's 128 threads (barrier 0 is the whole block's)
                    asm volatile("bar.sync %0, 128;\n" ::"r"(warpgroup) : "memory");
                }
                b_walk.next();
                next_scale = __ldg(column_scales + b_walk.index);
                if constexpr (OPS == S8) {
                    a_walk.next();
#pragma unroll
                    for (int h = 0; h < 2; ++h) next_row_scale[h] = __ldg(row_scales[h] + a_walk.index);
                }
                // Each sum times scale_of(j, e), its pair of scales' product, into block_sums.
                auto add_block = [&](auto scale_of) {
#pragma unroll
                    for (int j = 0; j < TN / 8; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            block_sums[4 * j + e] =
                                __fadd_rn(block_sums[4 * j + e], __fmul_rn(scale_of(j, e), (float)sums[4 * j + e]));
                };
                if constexpr (ONE_COLUMN_SCALE) {
                    const float scale[2] = {__fmul_rn(row_scale[0], column_scale),
                                            __fmul_rn(row_scale[1], column_scale)};
                    add_block([&](int, int e) { return scale[e >> 1]; });
                } else {
                    // sums[4j + e]: row + 8 * (e / 2), column e % 2 of pair j in shared
                    add_block([&](int j, int e) {
                        const float2 pair = *reinterpret_cast<const float2 *>(shared + 8 * j + 2 * (lane % 4));
                        const float scale = e & 1 ? pair.y : pair.x;
                        return OPS == S8 ? __fmul_rn(row_scale[e >> 1], scale) : scale;
                    });
                }
            };

            int prev = 0;
            // After a k tile's wgmmas are committed: the tile before is done, so its
            // slot goes back to the producer (this k tile's group stays in flight).
            auto release_previous = [&](int kt) {
                wgmma_wait<1>();
                if (kt > kt0 && lane == 0) mbar_arrive(&empty[prev]);
                prev = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            };
            if constexpr (TWO_SETS) {
                // The blocks' sums go to d and d2 in turn: after the first k tile of
                // a block is committed, the block before's wgmmas are done and its
                // sums are scaled while the tensor cores work on the new block.
                const int ktiles_per_block = group_steps / (BK / KSTEP);
                int done = 0;                          // k tiles of the block so far
                bool second = false, pending = false;  // block in d2; a block's sums to scale
                auto ktile_steps = [&](Sum (&sums)[DR], uint64_t da, uint64_t db) {
#pragma unroll
                    for (int ks = 0; ks < BK / KSTEP; ++ks)  // a block's first step overwrites
                        wgmma_step<OPS>(sums, da + ks * KSTEP / 16, db + ks * KSTEP / 16, done > 0 || ks > 0);
                };
                for (int kt = kt0; kt < kt1; ++kt) {
                    mbar_wait(&full[stage], phase);
                    const uint8_t *s = smem + stage * STAGE_BYTES;
                    const uint64_t da = sw128_desc(s + wg * WG_ROWS * BK), db = sw128_desc(s + A_BYTES);
                    wgmma_fence();  // orders the scaling's register reads before the new sums
                    if (second) ktile_steps(d2, da, db);
                    else ktile_steps(d, da, db);
                    wgmma_commit();
                    release_previous(kt);
                    if (pending) {  // the other set's block
                        pending = false;
                        if (second) end_block(d);
                        else end_block(d2);
                    }
                    if (++done == ktiles_per_block) {
                        done = 0;
                        pending = true;
                        second = !second;
                    }
                }
                wgmma_wait<0>();
                if (lane == 0) mbar_arrive(&empty[prev]);
                if (pending) {
                    if (second) end_block(d);
                    else end_block(d2);
                }
            } else {
                for (int kt = kt0; kt < kt1; ++kt) {
                    mbar_wait(&full[stage], phase);
                    const uint8_t *s = smem + stage * STAGE_BYTES;
                    const uint64_t da = sw128_desc(s + wg * WG_ROWS * BK), db = sw128_desc(s + A_BYTES);
                    wgmma_fence();  // orders the epilogue's register reads before the new sums
                    // int8 GROUPED: one copy of the block's end, not one per step.  Four
                    // copies of its end (converts, row scales) ran slower from the
                    // instruction cache: blocks of 32 took 766 us at 4096^3, against 613.
#pragma unroll(GROUPED_ && OPS == S8 ? 1 : BK / KSTEP)
                    for (int ks = 0; ks < BK / KSTEP; ++ks) {  // start field counts 16 bytes
                        if constexpr (GROUPED_) {
                            // a block's first step overwrites the sums of the block before
                            wgmma_step<OPS>(d, da + ks * KSTEP / 16, db + ks * KSTEP / 16, left != group_steps);
                            if (--left == 0) {
                                left = group_steps;
                                wgmma_commit();
                                wgmma_wait<0>();
                                end_block(d);
                                wgmma_fence();  // the registers read above before the next wgmma writes them
                            }
                        } else {
                            wgmma_step<OPS>(d, da + ks * KSTEP / 16, db + ks * KSTEP / 16, kt > kt0 || ks > 0);
                        }
                    }
                    wgmma_commit();
                    release_previous(kt);
                }
                wgmma_wait<0>();
                if (lane == 0) mbar_arrive(&empty[prev]);
                fence_registers(d);
            }

            // Epilogue straight from the registers, pairs of columns per store.
#pragma unroll
            for (int j = 0; j < TN / 8; ++j) {
                const int c = c0 + 8 * j;
                if (c >= N) continue;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = r0 + 8 * h;
                    if (r >= M) continue;
                    const Sum x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
                    T *p = o + (int64_t)r * N + c;
                    if (partial) {  // a split's sums, added and scaled by add_split_sums
                        float *q = partial + (t / per_split * M + r) * N + c;
                        if constexpr (GROUPED_)
                            store2(q, block_sums[4 * j + 2 * h], block_sums[4 * j + 2 * h + 1], c + 1 < N, N % 2 == 0);
                        else
                            store2(q, (float)x, (float)y, c + 1 < N, N % 2 == 0);
                    } else if constexpr (GROUPED_)
                        store2(p, block_sums[4 * j + 2 * h], block_sums[4 * j + 2 * h + 1], c + 1 < N, vec);
                    else if constexpr (SCALED)  // as gemm_s8.cu's ONE_GROUP, bit for bit
                        store2(p, __fmul_rn(__fmul_rn(sa[h], sb[j][0]), (float)x),
                               __fmul_rn(__fmul_rn(sa[h], sb[j][1]), (float)y), c + 1 < N, vec);
                    else
                        store2(p, x, y, c + 1 < N, vec);
                }
            }
        }
    }
#endif  // QD_SM90A_BODY
}

using Kernel = decltype(&gemm_s8_sm90_kernel<int32_t, S8, false>);
// The three output dtypes (float32, float16, bfloat16) of one kind of kernel.
#define QD_OUTS(OPS, ...)                                                                        \
    gemm_s8_sm90_kernel<float, OPS, __VA_ARGS__>, gemm_s8_sm90_kernel<__half, OPS, __VA_ARGS__>, \
        gemm_s8_sm90_kernel<__nv_bfloat16, OPS, __VA_ARGS__>
// Indexed by kernel_index(): int32 out; ONE_GROUP, then GROUPED, for int8, float16
// and bfloat16 operands; int8 GROUPED with one column scale a tile; 16-bit GROUPED
// with two sets of sums, for float16 and bfloat16.
constexpr Kernel KERNELS[] = {gemm_s8_sm90_kernel<int32_t, S8, false>,
                              QD_OUTS(S8, false), QD_OUTS(F16, false), QD_OUTS(BF16, false),
                              QD_OUTS(S8, true),  QD_OUTS(F16, true), QD_OUTS(BF16, true),
                              QD_OUTS(S8, true, ONE_COLUMN_SCALE_ENDS),
                              QD_OUTS(F16, true, TWO_SETS_ENDS), QD_OUTS(BF16, true, TWO_SETS_ENDS)};
#undef QD_OUTS
constexpr int FIRST_GROUPED = 10, ONE_COLUMN_SCALE_GROUPED = 19, TWO_SETS_GROUPED = 22;
bool grouped_kernel(int k) { return k >= FIRST_GROUPED; }

// GROUPED's way of ending blocks for these operands and scales (see BlockEnds).
BlockEnds block_ends(Operands ops, const Scales &sc) {
    if (ops == S8) return sc.b_bn % tile_n(true) == 0 ? ONE_COLUMN_SCALE_ENDS : IN_PLACE;
    const int64_t ktiles_per_block = sc.group_steps / (BK / KSTEP);
    return sc.group_steps % (BK / KSTEP) == 0 && ktiles_per_block <= 2 ? TWO_SETS_ENDS : IN_PLACE;
}

// ends: GROUPED's way of ending blocks (IN_PLACE for the other modes).
int kernel_index(GemmMode mode, int out_dtype, Operands ops, BlockEnds ends) {
    if (mode == INT32_OUT) return ops == S8 && ends == IN_PLACE ? 0 : -1;
    if ((mode == ONE_GROUP && ends != IN_PLACE) || (ends == ONE_COLUMN_SCALE_ENDS && ops != S8) ||
        (ends == TWO_SETS_ENDS && ops == S8))
        return -1;
    const int base = mode == ONE_GROUP                ? 1 + 3 * (int)ops
                     : ends == ONE_COLUMN_SCALE_ENDS ? ONE_COLUMN_SCALE_GROUPED
                     : ends == TWO_SETS_ENDS         ? TWO_SETS_GROUPED + 3 * ((int)ops - F16)
                                                     : FIRST_GROUPED + 3 * (int)ops;
    switch (out_dtype) {
    case QD_CUDA_F32: return base;
    case QD_CUDA_F16: return base + 1;
    case QD_CUDA_BF16: return base + 2;
    default: return -1;
    }
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (the driver
// library is loaded by the runtime anyway), looked up once.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                           cudaEnableDefault, &found);
#else
        cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &found);
#endif
        if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();  // not the caller's error: leave none behind
            p = nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
    }();
    return fn;
}

// rows x Kp bytes, rows `ld` apart, read in boxes of box_rows x BK with 128-byte
// swizzle; everything past Kp or past the last row reads as zeros.
bool encode(CUtensorMap *map, const int8_t *p, int64_t rows, int64_t Kp, int64_t ld, int box_rows) {
    const cuuint64_t dims[2] = {(cuuint64_t)Kp, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)ld};
    const cuuint32_t box[2] = {BK, (cuuint32_t)box_rows}, elem_strides[2] = {1, 1};
    return encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<int8_t *>(p), dims,
                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

struct Device {
    qd_status status = QD_OK;
    bool usable = false;
    int sms = 0;
};
Device devices[MAX_DEVICES];
std::once_flag probed[MAX_DEVICES];

// Whether the device runs the sm_90a kernel, and its launch setup, once per device.
//
// Compute capability 9.0 alone is not enough: a build without the sm_90a target
// runs the compute_90 PTX (or sm_90 code) there, whose kernel body is empty, and
// binaryVersion reads 90 either way.  Only the sm_90a body has static shared
// memory (its barriers), so the kernel the runtime picked for this device says.
qd_status probe(int dev, Device &d) {
    int major = 0, minor = 0, smem_optin = 0;
    qd_status st;
    if ((st = check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev))) != QD_OK ||
        (st = check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev))) != QD_OK ||
        (st = check(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev))) != QD_OK ||
        (st = check(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))) != QD_OK)
        return st;
    if (major != 9 || minor != 0 || !encode_tiled()) return QD_OK;
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, KERNELS[0]) != cudaSuccess) {  // no code for this device
        cudaGetLastError();
        return QD_OK;
    }
    if (attr.sharedSizeBytes == 0 || attr.sharedSizeBytes + smem_bytes(false) > (size_t)smem_optin) return QD_OK;
    for (int k = 0; k < (int)(sizeof KERNELS / sizeof KERNELS[0]); ++k)
        if ((st = check(cudaFuncSetAttribute(KERNELS[k], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             smem_bytes(grouped_kernel(k))))) != QD_OK)
            return st;
    d.usable = true;
    return QD_OK;
}

// How many splits of K a 16-bit product of `tiles` output tiles takes: enough to
// give most SMs a tile when the tiles alone fill at most half of them, each split
// at least MIN_SPLIT_KTILES k tiles and, with scale blocks along K (group_steps
// wgmma steps each), whole blocks.  Returns the splits and sets *kt_per.
constexpr int MIN_SPLIT_KTILES = 8;
int k_splits(int64_t tiles, int ktiles, int sms, GemmMode mode, int64_t group_steps, int *kt_per) {
    *kt_per = ktiles;
    if (2 * tiles > sms) return 1;
    const int64_t steps = BK / KSTEP;
    const int64_t unit = mode == GROUPED ? group_steps / std::gcd(group_steps, steps) : 1;  // k tiles per whole blocks
    int64_t per = ceil_div(ktiles, sms / tiles);
    per = ceil_div(std::max<int64_t>(per, MIN_SPLIT_KTILES), unit) * unit;
    if (per >= ktiles) return 1;
    *kt_per = (int)per;
    return (int)ceil_div(ktiles, per);
}

qd_status current_device(Device **out) {
    int dev = 0;
    qd_status st = check(cudaGetDevice(&dev));
    if (st != QD_OK) return st;
    if (dev < 0 || dev >= MAX_DEVICES) return QD_ERR_ARGUMENT;
    std::call_once(probed[dev], [dev] { devices[dev].status = probe(dev, devices[dev]); });
    *out = &devices[dev];
    return devices[dev].status;
}

}  // namespace

namespace qd {

bool gemm_s8_sm90_usable() {
    Device *d = nullptr;
    return current_device(&d) == QD_OK && d->usable;
}

qd_status gemm_s8_sm90(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t Kp,
                       int64_t ld, void *out, int out_dtype, const Scales &sc, GemmMode mode, Operands ops,
                       cudaStream_t stream) {
    Device *d = nullptr;
    qd_status st = current_device(&d);
    if (st != QD_OK) return st;
    if (!d->usable) return QD_ERR_CUDA_UNAVAILABLE;
    const bool grouped = mode == GROUPED;
    const int k = kernel_index(mode, out_dtype, ops, grouped ? block_ends(ops, sc) : IN_PLACE);
    // GROUPED: blocks end on whole blocks only; a scales for int8 (qq) and none for 16-bit operands (fq)
    if (k < 0 || Kp % 16 ||
        (mode == GROUPED && (Kp % (sc.group_steps * KSTEP) || (ops == S8) != (sc.a != nullptr))))
        return QD_ERR_ARGUMENT;
    const int64_t tiles = ceil_div(M, BM) * ceil_div(N, tile_n(grouped));
    if (M > INT_MAX || N > INT_MAX || tiles > INT_MAX) return QD_ERR_SHAPE;
    CUtensorMap map_a, map_b;  // the encoder checks alignment (16 bytes) and strides
    if (!encode(&map_a, a, M, Kp, ld, BM) || !encode(&map_b, bt, N, Kp, ld, tile_n(grouped)))
        return QD_ERR_ARGUMENT;
    const int ktiles = (int)ceil_div(Kp, BK);
    int kt_per = ktiles;
    const int splits = ops == S8 ? 1 : k_splits(tiles, ktiles, d->sms, mode, sc.group_steps, &kt_per);
    const int64_t walk = tiles * splits;
    const unsigned grid = (unsigned)(walk < d->sms ? walk : d->sms);  // persistent
    if (splits == 1) {
        KERNELS[k]<<<grid, THREADS, smem_bytes(grouped), stream>>>(map_a, map_b, (int)M, (int)N, Kp, out, sc, 1,
                                                                  ktiles, nullptr);
        return launched();
    }
    // With one scale over all of K the column's scale comes after the sum, as in the
    // ONE_GROUP epilogue (no a scales); GROUPED splits store their blocks' scaled sums.
    return with_split_sums(splits, M, N, mode == ONE_GROUP ? sc.b : nullptr, sc.b_bn, sc.b_ld, out, out_dtype,
                           stream, [&](float *partial) {
                               KERNELS[k]<<<grid, THREADS, smem_bytes(grouped), stream>>>(
                                   map_a, map_b, (int)M, (int)N, Kp, out, sc, splits, kt_per, partial);
                               return launched();
                           });
}

}  // namespace qd
