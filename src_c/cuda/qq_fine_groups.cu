// qq whose scale groups along K hold fewer than 8 values (a weight scaled per input
// channel, blocks of 4): too fine for the tensor cores, whose steps take 32 values
// of one group, and for qq_spread, which would copy every group to a 32-byte slot.
//
// A group's sum of at most 7 int8 products is an integer below 2^24, so float32
// computes it exactly, and the float units do: the operands go to shared memory as
// floats, a thread sums 4 x 4 outputs' groups with FMAs (exact on integers), then
// scales and adds each group as the reference does: the scales' product, times the
// sum, added to the output's running sum, each rounded (no FMA), in order of K.
// A block of 256 threads computes 64 x 64 outputs from slices of whole groups,
// the next slice's values and scales loaded into registers while this one is summed.
#include "qq_fine_groups.cuh"

namespace {

using qd::Scales;

constexpr int TILE = 64, THREADS = 256, PER = 4;  // outputs a block a side, a thread a side
constexpr int SLICE = 32;                         // K values a slice at most (whole groups)
constexpr int LD = TILE + 4;                      // floats a k row of a tile: 16-byte aligned rows
constexpr int VALUE_ROWS = THREADS / TILE;        // threads a tile row loads values for (8 each)
constexpr int SCALE_ROWS = THREADS / SLICE;       // rows whose scales one pass of the block loads

// Which scale along K group gk takes, kept as gk = index * per + offset and
// stepped by a slice's groups without a division.
struct GroupWalk {
    int64_t index, offset;
    int64_t per, step_index, step_offset, last;
    __device__ GroupWalk(int64_t first, int64_t per, int64_t step, int64_t last)
        : index(first / per), offset(first % per), per(per), step_index(step / per), step_offset(step % per),
          last(last) {}
    __device__ int64_t at() const { return min(index, last); }  // past K: the last scale (never summed)
    __device__ void next() {
        index += step_index;
        offset += step_offset;
        if (offset >= per) offset -= per, ++index;
    }
};

template <int G>
__global__ void __launch_bounds__(THREADS)
qq_fine_groups_kernel(const int8_t *__restrict__ a, const int8_t *__restrict__ bt, int M, int N, int64_t K,
                      int64_t ld, Scales sc, int tiles_n, void *out, int out_dtype) {
    constexpr int NG = SLICE / G, KS = NG * G;            // groups and K values a slice
    __shared__ __align__(16) float av[KS][LD], bv[KS][LD];  // values [k][row]
    __shared__ __align__(16) float as[NG][LD], bs[NG][LD];  // scales [group][row]
    __shared__ int64_t a_first[TILE], b_first[TILE];        // each row's first scale

    const int tid = threadIdx.x;
    const int m0 = blockIdx.x / tiles_n * TILE, n0 = blockIdx.x % tiles_n * TILE;
    // rows past M or N take the last row's scales and zero values: their outputs are not stored
    if (tid < TILE) a_first[tid] = min(m0 + tid, M - 1) / sc.a_bm * sc.a_ld;
    else if (tid < 2 * TILE) b_first[tid - TILE] = min(n0 + tid - TILE, N - 1) / sc.b_bn * sc.b_ld;

    // Values: row vr of both tiles, 8 bytes of K from vk.  Scales: group slot sg, rows
    // sr, sr + SCALE_ROWS, ...
    const int vr = tid / VALUE_ROWS, vk = tid % VALUE_ROWS * 8;
    const int8_t *a_row = a + (int64_t)min(m0 + vr, M - 1) * ld, *b_row = bt + (int64_t)min(n0 + vr, N - 1) * ld;
    const bool a_in = m0 + vr < M, b_in = n0 + vr < N;
    const int sg = tid % SLICE, sr = tid / SLICE;
    GroupWalk a_walk(sg, sc.a_bk / G, NG, sc.a_ld - 1), b_walk(sg, sc.b_bk / G, NG, sc.b_ld - 1);
    int8_t a_next[8], b_next[8];
    float as_next[TILE / SCALE_ROWS], bs_next[TILE / SCALE_ROWS];
    __syncthreads();  // a_first, b_first

    auto load = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int64_t k = k0 + vk + i;
            const bool in = vk + i < KS && k < K;
            a_next[i] = a_in && in ? a_row[k] : 0;
            b_next[i] = b_in && in ? b_row[k] : 0;
        }
        if (sg < NG) {
#pragma unroll
            for (int i = 0; i < TILE / SCALE_ROWS; ++i) {
                as_next[i] = sc.a[a_first[sr + SCALE_ROWS * i] + a_walk.at()];
                bs_next[i] = sc.b[b_first[sr + SCALE_ROWS * i] + b_walk.at()];
            }
        }
        a_walk.next();
        b_walk.next();
    };

    const int tm = tid / (TILE / PER) * PER, tn = tid % (TILE / PER) * PER;  // the thread's outputs
    float sum[PER][PER] = {};
    const int64_t groups = K / G;
    load(0);
    for (int64_t g0 = 0; g0 < groups; g0 += NG) {
        __syncthreads();  // the slice before is summed
        if (vk < KS) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (vk + i < KS) {
                    av[vk + i][vr] = a_next[i];
                    bv[vk + i][vr] = b_next[i];
                }
            }
        }
        if (sg < NG) {
#pragma unroll
            for (int i = 0; i < TILE / SCALE_ROWS; ++i) {
                as[sg][sr + SCALE_ROWS * i] = as_next[i];
                bs[sg][sr + SCALE_ROWS * i] = bs_next[i];
            }
        }
        __syncthreads();
        if (g0 + NG < groups) load((g0 + NG) * G);
        const int here = (int)min((int64_t)NG, groups - g0);
#pragma unroll 2
        for (int j = 0; j < here; ++j) {
            float dot[PER][PER];
#pragma unroll
            for (int i = 0; i < G; ++i) {
                const float4 x = *reinterpret_cast<const float4 *>(&av[j * G + i][tm]);
                const float4 y = *reinterpret_cast<const float4 *>(&bv[j * G + i][tn]);
                const float xs[PER] = {x.x, x.y, x.z, x.w}, ys[PER] = {y.x, y.y, y.z, y.w};
#pragma unroll
                for (int r = 0; r < PER; ++r)
#pragma unroll
                    for (int c = 0; c < PER; ++c) dot[r][c] = i ? fmaf(xs[r], ys[c], dot[r][c]) : xs[r] * ys[c];
            }
            const float4 x = *reinterpret_cast<const float4 *>(&as[j][tm]);
            const float4 y = *reinterpret_cast<const float4 *>(&bs[j][tn]);
            const float xs[PER] = {x.x, x.y, x.z, x.w}, ys[PER] = {y.x, y.y, y.z, y.w};
#pragma unroll
            for (int r = 0; r < PER; ++r)
#pragma unroll
                for (int c = 0; c < PER; ++c)
                    sum[r][c] = __fadd_rn(sum[r][c], __fmul_rn(__fmul_rn(xs[r], ys[c]), dot[r][c]));
        }
    }
#pragma unroll
    for (int r = 0; r < PER; ++r)
#pragma unroll
        for (int c = 0; c < PER; ++c) {
            const int m = m0 + tm + r, n = n0 + tn + c;
            if (m < M && n < N) qd::store_from_f32(out, out_dtype, (int64_t)m * N + n, sum[r][c]);
        }
}

template <int G>
qd_status launch_groups_of(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K, int64_t ld, const Scales &sc,
                 void *out, int out_dtype, cudaStream_t s) {
    const int64_t tiles_n = qd::ceil_div(N, TILE), tiles = qd::ceil_div(M, TILE) * tiles_n;
    if (tiles > 0x7FFFFFFF) return QD_ERR_SHAPE;  // more outputs than any GPU holds
    qq_fine_groups_kernel<G><<<(unsigned)tiles, THREADS, 0, s>>>(a, bt, (int)M, (int)N, K, ld, sc, (int)tiles_n,
                                                                 out, out_dtype);
    return qd::launched();
}

}  // namespace

namespace qd {

qd_status qq_fine_groups(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t K, int64_t ld,
                         const Scales &sc, int64_t G, void *out, int out_dtype, cudaStream_t s) {
    switch (G) {
        case 1: return launch_groups_of<1>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        case 2: return launch_groups_of<2>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        case 3: return launch_groups_of<3>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        case 4: return launch_groups_of<4>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        case 5: return launch_groups_of<5>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        case 6: return launch_groups_of<6>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        case 7: return launch_groups_of<7>(a, bt, M, N, K, ld, sc, out, out_dtype, s);
        default: return QD_ERR_ARGUMENT;
    }
}

}  // namespace qd
