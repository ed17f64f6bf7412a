// fq on the tensor cores: x float32 [M <= 16, K] times integer weights [N, K].
//
// Integer weights of up to 8 bits are exact in bf16, so m16n8k16 bf16 mma with
// float32 accumulation computes their products exactly.  x is cut into up to
// three bf16 parts (hi + mid + lo holds a float32 exactly); a warp runs the
// extra parts only when some x value of the chunk needs them, so bf16 or f16
// activations cost one mma per tile.
//
// Each lane loads 16 bytes of one weight row per 64-byte step; the four lanes
// of a row swap words so that every mma reads one 16-byte chunk, which lies in
// one scale block (block_k is a multiple of a chunk).  Since the sum over K may
// be taken in any order, x is read in the same permuted order.
//
// Few weight rows leave SMs idle, so K is split over blockIdx.y; the last block
// of a row range adds the splits' partial sums in split order (no atomics on
// the values, so the result does not depend on scheduling).
#include <cuda_bf16.h>

#include <mutex>

#include "fq_mma.cuh"

namespace {

constexpr int WARPS = 8, NT = 4;      // a warp owns NT tiles of 8 weight rows
constexpr int ROWS = WARPS * NT * 8;  // weight rows per block
constexpr int UNROLL = 2;             // 64-byte steps loaded ahead of use
constexpr int MAX_TICKETS = 1 << 16;  // blocks along N that can split K

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Values i and i + PER/2 of a word whose fields carry a +2^(BITS-1) bias, as
// bf16x2: 8-bit fields through float (bf16 has 7 mantissa bits), narrower ones
// placed in the mantissa of 128.0 directly.  Exact either way.
template <int BITS>
__device__ __forceinline__ uint32_t weight_pair(uint32_t wb, int i) {
    if constexpr (BITS == 8) {
        const float lo = __uint_as_float(__byte_perm(wb, 0x4B000000u, 0x7440 | i)) - 8388736.0f;
        const float hi = __uint_as_float(__byte_perm(wb, 0x4B000000u, 0x7440 | (i + 2))) - 8388736.0f;
        return pack_bf16(lo, hi);
    } else {
        constexpr uint32_t mask = ((1u << BITS) - 1u) * 0x00010001u;
        constexpr uint32_t neg_bias = (0xC300u + (1u << (BITS - 1))) * 0x00010001u;  // -(128 + half)
        constexpr uint32_t one = 0x3F803F80u;  // bf16 1.0 in both halves
        uint32_t v = ((wb >> (BITS * i)) & mask) | 0x43004300u, r;
        // v * 1 - bias: exact; fma.bf16x2 exists from sm_80 on (sub.bf16x2 only from sm_90)
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(one), "r"(neg_bias));
        return r;
    }
}

// Lane t of each 4-lane group ends with word t of the group's chunk j in w[j].
__device__ __forceinline__ void transpose4(uint4 v, uint32_t (&w)[4], int t) {
    const bool hi = t & 2, odd = t & 1;
    uint32_t r0 = __shfl_xor_sync(~0u, hi ? v.x : v.z, 2), r1 = __shfl_xor_sync(~0u, hi ? v.y : v.w, 2);
    if (hi) { v.x = r0; v.y = r1; } else { v.z = r0; v.w = r1; }
    r0 = __shfl_xor_sync(~0u, odd ? v.x : v.y, 1);
    r1 = __shfl_xor_sync(~0u, odd ? v.z : v.w, 1);
    if (odd) { v.x = r0; v.z = r1; } else { v.y = r0; v.w = r1; }
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
}

struct Tile {  // what every step of a warp needs
    const float *x; int M; int64_t ld, N, n0;
    qd::FqScales sc;
};

// x fragments of one chunk in bf16 parts: a[part][mma][reg], in the order of weight_pair.
template <int BITS, int MT>
__device__ __forceinline__ bool x_parts(const Tile &tl, int64_t k, int g, uint32_t (&a)[3][8 / BITS][4]) {
    constexpr int PER = 32 / BITS, Q = PER / 4, HALF = PER / 2;
    float xv[2][PER];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int m = g + 8 * r;
        const bool live = r < MT && m < tl.M;
        const float4 *p = reinterpret_cast<const float4 *>(tl.x + m * tl.ld + k);
#pragma unroll
        for (int q = 0; q < PER / 4; ++q) {
            const float4 f = live ? __ldg(p + q) : make_float4(0.f, 0.f, 0.f, 0.f);
            xv[r][4 * q] = f.x; xv[r][4 * q + 1] = f.y; xv[r][4 * q + 2] = f.z; xv[r][4 * q + 3] = f.w;
        }
    }
    bool residue = false;  // left in xv: what the hi parts miss
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 2 * q + h, reg = r + 2 * h;
                float &lo = xv[r][i], &hi = xv[r][i + HALF];
                a[0][q][reg] = pack_bf16(lo, hi);
                lo -= bf_lo(a[0][q][reg]);
                hi -= bf_hi(a[0][q][reg]);
                lo = isfinite(lo) ? lo : 0.0f;  // inf or NaN x: the hi part carries it
                hi = isfinite(hi) ? hi : 0.0f;
                residue |= lo != 0.0f || hi != 0.0f;
            }
    if (!__any_sync(~0u, residue)) return false;
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = 2 * q + h, reg = r + 2 * h;
                const float lo = xv[r][i], hi = xv[r][i + HALF];
                a[1][q][reg] = pack_bf16(lo, hi);
                a[2][q][reg] = pack_bf16(lo - bf_lo(a[1][q][reg]), hi - bf_hi(a[1][q][reg]));
            }
    return true;
}

// One 64-byte step of NT weight tiles: four chunks, each one scale block.
template <int BITS, int MT>
__device__ __forceinline__ void step(const Tile &tl, int64_t k_step, int64_t chunks_left,
                                     const uint4 (&wv)[NT], const float *(&srow)[NT][2],
                                     float (&acc)[NT][4], int g, int t) {
    constexpr int PER = 32 / BITS, CH = 4 * PER, Q = PER / 4;
    constexpr uint32_t FLIP = BITS == 8 ? 0x80808080u : BITS == 4 ? 0x88888888u : 0xAAAAAAAAu;
    uint32_t wj[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) transpose4(wv[nt], wj[nt], t);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (j >= chunks_left) break;
        const int64_t kc = k_step + j * CH;
        uint32_t a[3][Q][4];
        const bool split = x_parts<BITS, MT>(tl, kc + t * PER, g, a);
        // Chunks past K (rows are zero padded to whole steps) reuse the last block's
        // scale: reading past the scale row could meet a NaN, and NaN * 0 is NaN.
        const unsigned kb = tl.sc.per_chunk ? min((unsigned)kc / (unsigned)tl.sc.bk, (unsigned)tl.sc.ld - 1u) : 0u;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint32_t wb = wj[nt][j] ^ FLIP;
            float part[4] = {0.f, 0.f, 0.f, 0.f};
            float (&c)[4] = tl.sc.per_chunk ? part : acc[nt];
#pragma unroll
            for (int q = 0; q < Q; ++q) {
                const uint32_t b0 = weight_pair<BITS>(wb, 2 * q), b1 = weight_pair<BITS>(wb, 2 * q + 1);
                mma(c, a[0][q], b0, b1);
                if (split) { mma(c, a[1][q], b0, b1); mma(c, a[2][q], b0, b1); }
            }
            if (tl.sc.per_chunk) {
                const float s0 = srow[nt][0][kb], s1 = srow[nt][1][kb];
                acc[nt][0] = fmaf(s0, part[0], acc[nt][0]); acc[nt][1] = fmaf(s1, part[1], acc[nt][1]);
                acc[nt][2] = fmaf(s0, part[2], acc[nt][2]); acc[nt][3] = fmaf(s1, part[3], acc[nt][3]);
            }
        }
    }
}

template <int BITS, int MT>
__global__ void __launch_bounds__(WARPS * 32, 2)  // two blocks per SM: the wave size
fq_mma_kernel(Tile tl, const uint8_t *__restrict__ w, int64_t steps_per_split,
              float *__restrict__ out, float *__restrict__ partial, unsigned *__restrict__ tickets) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int64_t row_bytes = tl.ld * BITS / 8, nchunks = row_bytes / 16, nsteps = (nchunks + 3) / 4;
    const int64_t n_warp = (int64_t)blockIdx.x * ROWS + warp * NT * 8;
    const int64_t s0 = blockIdx.y * steps_per_split;
    const int64_t s1 = s0 + steps_per_split < nsteps ? s0 + steps_per_split : nsteps;
    constexpr int CH = 128 / BITS;
    tl.n0 = n_warp;

    const float *srow[NT][2];  // scale rows of this lane's output columns
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int64_t n = n_warp + nt * 8 + 2 * t + h;
            n = n < tl.N ? n : tl.N - 1;
            srow[nt][h] = tl.sc.s + (n / tl.sc.bn) * tl.sc.ld;
        }
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;

    for (int64_t st = s0; st < s1; st += UNROLL) {
        uint4 wv[UNROLL][NT];  // every load of the unrolled steps issued before any use
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int64_t c = (st + u) * 4 + t, n = n_warp + nt * 8 + g;
                wv[u][nt] = st + u < s1 && c < nchunks && n < tl.N
                                ? __ldcs(reinterpret_cast<const uint4 *>(w + n * row_bytes) + c)
                                : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (st + u >= s1) break;
            step<BITS, MT>(tl, (st + u) * 4 * CH, nchunks - (st + u) * 4, wv[u], srow, acc, g, t);
        }
    }

    // Lane (g, t) holds rows g, g + 8 and columns 2t, 2t + 1 of each tile.
    float *dst = gridDim.y == 1 ? out : partial + blockIdx.y * tl.M * tl.N;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = g + 8 * (i >> 1);
            const int64_t n = n_warp + nt * 8 + 2 * t + (i & 1);
            if (m < tl.M && n < tl.N)
                dst[m * tl.N + n] = tl.sc.per_chunk ? acc[nt][i] : acc[nt][i] * srow[nt][i & 1][0];
        }
    if (gridDim.y == 1) return;

    __shared__ bool last;
    __threadfence();  // this block's partial sums before its ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&tickets[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Four columns a thread, every split's loads of all its items in flight together.
    constexpr int ITEMS = 16 * ROWS / 4 / (WARPS * 32);  // enough for M = 16
    const int64_t n_base = (int64_t)blockIdx.x * ROWS;
    float4 sum[ITEMS];
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) sum[it] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (unsigned s = 0; s < gridDim.y; ++s)
#pragma unroll
        for (int it = 0; it < ITEMS; ++it) {
            const int i = threadIdx.x + it * WARPS * 32, m = i / (ROWS / 4);
            const int64_t n = n_base + 4 * (i % (ROWS / 4));
            if (m >= tl.M || n >= tl.N) continue;
            const float *p = partial + (s * tl.M + m) * tl.N + n;
            if (tl.N % 4 == 0) {
                const float4 v = __ldcg(reinterpret_cast<const float4 *>(p));
                sum[it].x += v.x; sum[it].y += v.y; sum[it].z += v.z; sum[it].w += v.w;
            } else {  // rows of partial not 16-byte aligned
                sum[it].x += __ldcg(p);
                if (n + 1 < tl.N) sum[it].y += __ldcg(p + 1);
                if (n + 2 < tl.N) sum[it].z += __ldcg(p + 2);
                if (n + 3 < tl.N) sum[it].w += __ldcg(p + 3);
            }
        }
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
        const int i = threadIdx.x + it * WARPS * 32, m = i / (ROWS / 4);
        const int64_t n = n_base + 4 * (i % (ROWS / 4));
        if (m >= tl.M || n >= tl.N) continue;
        float *o = out + m * tl.N + n;
        o[0] = sum[it].x;
        if (n + 1 < tl.N) o[1] = sum[it].y;
        if (n + 2 < tl.N) o[2] = sum[it].z;
        if (n + 3 < tl.N) o[3] = sum[it].w;
    }
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;  // ready for the next launch
}

// Per device: multiprocessor count and the split-K scratch (partial sums and
// tickets).  Work is queued on one stream per device, so launches never share it.
struct DeviceState {
    int sms = 0, major = 0;
    float *partial = nullptr;
    size_t cap = 0;
    unsigned *tickets = nullptr;
};
constexpr int MAX_DEVICES = 64;
DeviceState states[MAX_DEVICES];
std::mutex state_mutex;

qd_status device_state(DeviceState **out) {
    int dev = 0;
    qd_status st = qd::check(cudaGetDevice(&dev));
    if (st != QD_OK) return st;
    if (dev < 0 || dev >= MAX_DEVICES) return QD_ERR_ARGUMENT;
    DeviceState &d = states[dev];
    if (d.sms == 0) {
        std::lock_guard<std::mutex> lock(state_mutex);
        int sms = 0, major = 0;
        if ((st = qd::check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev))) != QD_OK ||
            (st = qd::check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev))) != QD_OK)
            return st;
        d.major = major;
        d.sms = sms;
    }
    *out = &d;
    return QD_OK;
}

qd_status scratch(DeviceState &d, size_t floats) {
    std::lock_guard<std::mutex> lock(state_mutex);
    qd_status st;
    if (!d.tickets) {
        if ((st = qd::check(cudaMalloc(&d.tickets, MAX_TICKETS * sizeof(unsigned)))) != QD_OK) return st;
        if ((st = qd::check(cudaMemset(d.tickets, 0, MAX_TICKETS * sizeof(unsigned)))) != QD_OK) return st;
    }
    if (d.cap < floats) {
        if (d.partial) cudaFree(d.partial);  // synchronizes: no launch still reads it
        d.partial = nullptr;
        d.cap = 0;
        if ((st = qd::check(cudaMalloc(&d.partial, floats * sizeof(float)))) != QD_OK) return st;
        d.cap = floats;
    }
    return QD_OK;
}

template <int BITS>
void launch(dim3 grid, const Tile &tl, const uint8_t *w, int64_t sps, float *out, DeviceState &d,
            cudaStream_t s) {
    if (tl.M <= 8) fq_mma_kernel<BITS, 1><<<grid, WARPS * 32, 0, s>>>(tl, w, sps, out, d.partial, d.tickets);
    else fq_mma_kernel<BITS, 2><<<grid, WARPS * 32, 0, s>>>(tl, w, sps, out, d.partial, d.tickets);
}

}  // namespace

namespace qd {

bool fq_mma_usable() {
    DeviceState *d = nullptr;
    return device_state(&d) == QD_OK && d->major >= 8;
}

qd_status fq_mma(const float *x, int M, const void *w, int bits, int64_t N, int64_t ld,
                 const FqScales &sc, float *out, cudaStream_t s) {
    DeviceState *d = nullptr;
    qd_status st = device_state(&d);
    if (st != QD_OK) return st;
    const int64_t nchunks = ld * bits / 8 / 16, nsteps = (nchunks + 3) / 4;
    const int64_t blocks = ceil_div(N, ROWS);
    // Split K to fill one wave of two blocks per SM (a second, partial wave would
    // double the time), keeping at least two steps per split.
    int64_t splits = 1;
    if (2 * blocks <= 2 * d->sms && blocks <= MAX_TICKETS) {
        splits = 2 * d->sms / blocks;
        if (splits > nsteps / 2) splits = nsteps / 2 > 1 ? nsteps / 2 : 1;
    }
    const int64_t sps = ceil_div(nsteps, splits);
    splits = ceil_div(nsteps, sps);
    if (splits > 1 && (st = scratch(*d, (size_t)(splits * M * N))) != QD_OK) return st;
    const dim3 grid((unsigned)blocks, (unsigned)splits);
    const Tile tl{x, M, ld, N, 0, sc};
    const auto *wb = static_cast<const uint8_t *>(w);
    if (bits == 8) launch<8>(grid, tl, wb, sps, out, *d, s);
    else if (bits == 4) launch<4>(grid, tl, wb, sps, out, *d, s);
    else launch<2>(grid, tl, wb, sps, out, *d, s);
    return launched();
}

}  // namespace qd
