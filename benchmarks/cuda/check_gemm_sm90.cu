// Standalone check + timing of the sm_90a int8 GEMM (gemm_s8_sm90.cu).
//
// Build and run from the repo root (H100/H200):
//   mkdir -p build && nvcc -O3 -std=c++17 -DQD_WITH_CUDA --expt-relaxed-constexpr \
//     -gencode=arch=compute_90a,code=sm_90a -Isrc_c/include -Isrc_c/cuda \
//     benchmarks/cuda/check_gemm_sm90.cu src_c/cuda/gemm_s8_sm90.cu src_c/cuda/float_units.cu \
//     src_c/cuda/elementwise.cu src_c/cuda/runtime.cu \
//     -o build/check_gemm_sm90 && build/check_gemm_sm90
//
// gemm_s8.cu is included below so that the old mma.sync kernel can be launched
// directly (for the bitwise cross-check and the timing comparison).
#include "gemm_s8.cu"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "check.cuh"

namespace chk {

uint64_t splitmix(uint64_t &s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void fill_random(std::vector<int8_t> &v, uint64_t seed) {
    size_t i = 0;
    for (; i + 8 <= v.size(); i += 8) {
        uint64_t r = splitmix(seed);
        std::memcpy(&v[i], &r, 8);
    }
    for (; i < v.size(); ++i) v[i] = (int8_t)splitmix(seed);
}

template <typename F>
void parallel_for(int64_t n, F f) {
    int nt = (int)std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> ts;
    for (int t = 0; t < nt; ++t)
        ts.emplace_back([=] {
            for (int64_t i = t; i < n; i += nt) f(i);
        });
    for (auto &t : ts) t.join();
}

int32_t dot(const int8_t *a, const int8_t *b, int64_t K) {
    int32_t s = 0;
    for (int64_t k = 0; k < K; ++k) s += (int32_t)a[k] * (int32_t)b[k];
    return s;
}

const char *dtype_name(int dt) {
    switch (dt) {
    case QD_CUDA_F32: return "f32";
    case QD_CUDA_F16: return "f16";
    case QD_CUDA_BF16: return "bf16";
    default: return "int32";
    }
}
size_t dtype_size(int dt) { return dt == QD_CUDA_F16 || dt == QD_CUDA_BF16 ? 2 : 4; }

// The bits the GEMM must produce for one output.
uint32_t expected_bits(int32_t acc, float sa, float sb, int dt) {
    if (dt == QD_CUDA_S32) return (uint32_t)acc;
    float v = (sa * sb) * (float)acc;  // = __fmul_rn(__fmul_rn(sa, sb), (float)acc)
    if (dt == QD_CUDA_F32) {
        uint32_t u;
        std::memcpy(&u, &v, 4);
        return u;
    }
    uint16_t h;
    if (dt == QD_CUDA_F16) {
        __half x = __float2half_rn(v);
        std::memcpy(&h, &x, 2);
    } else {
        __nv_bfloat16 x = __float2bfloat16_rn(v);
        std::memcpy(&h, &x, 2);
    }
    return h;
}

uint32_t load_bits(const uint8_t *p, int64_t i, int dt) {
    if (dtype_size(dt) == 4) {
        uint32_t u;
        std::memcpy(&u, p + 4 * i, 4);
        return u;
    }
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return h;
}

// Poison byte per dtype: NaN for the float outputs, 0x80808080 for int32 (beyond
// any |dot| these random inputs reach).
int poison_byte(int dt) { return dt == QD_CUDA_S32 ? 0x80 : 0xFF; }

struct Shape {
    int64_t M, N, K;
    int64_t ld_extra;    // garbage bytes per row past Kp
    int64_t out_offset;  // output starts this many elements into its buffer (misaligned pairs)
    int64_t a_bm, b_bn;  // scale blocks (0: per row / per column)
    bool full;           // every output against the CPU, else a sample
};

struct Result {
    std::string what;
    int64_t checked = 0, bad = 0, unwritten = 0, guard = 0, vs_old = 0;
};

// The old mma.sync kernel (gemm_s8.cu), launched directly.
template <int MODE>
void old_gemm(const int8_t *a, const int8_t *bt, int64_t M, int64_t N, int64_t Kp, int64_t ld,
              void *out, int dt, const Scales &sc) {
    static bool configured = false;
    if (!configured) {
        CK(cudaFuncSetAttribute(gemm_s8_kernel<MODE, S8, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                smem_bytes(3)));
        configured = true;
    }
    const int64_t tiles = qd::ceil_div(M, BM) * qd::ceil_div(N, BN);
    gemm_s8_kernel<MODE, S8, 3><<<(unsigned)tiles, THREADS, smem_bytes(3)>>>(a, bt, (int)M, (int)N, Kp, ld, out, dt,
                                                                          sc);
    CK(cudaGetLastError());
}

bool g_fail = false;
std::vector<Result> g_results;

void check_shape(const Shape &s, uint64_t seed) {
    const int64_t M = s.M, N = s.N, K = s.K, Kp = (K + 15) / 16 * 16, ld = Kp + s.ld_extra;
    std::printf("shape M=%lld N=%lld K=%lld ld=%lld ...\n", (long long)M, (long long)N, (long long)K,
                (long long)ld);
    std::fflush(stdout);
    // Rows: K random values, zeros up to Kp, garbage past Kp (the kernel must not read it).
    std::vector<int8_t> ha(M * ld), hb(N * ld);
    fill_random(ha, seed);
    fill_random(hb, seed ^ 0x5555);
    for (int64_t r = 0; r < M; ++r) std::memset(&ha[r * ld + K], 0, Kp - K);
    for (int64_t r = 0; r < N; ++r) std::memset(&hb[r * ld + K], 0, Kp - K);

    const int64_t a_bm = s.a_bm ? s.a_bm : 1, b_bn = s.b_bn ? s.b_bn : 1;
    std::vector<float> hsa(M / a_bm), hsb(N / b_bn);
    uint64_t st = seed * 7 + 1;
    for (auto &x : hsa) x = std::ldexp(1.0f + (splitmix(st) >> 40) * 0x1p-24f, -14 + (int)(splitmix(st) % 5));
    for (auto &x : hsb) x = std::ldexp(1.0f + (splitmix(st) >> 40) * 0x1p-24f, -10 + (int)(splitmix(st) % 5));

    // Positions checked against the CPU: all, or a sample with the corners.
    std::vector<int64_t> pos;
    if (s.full) {
        pos.resize(M * N);
        for (int64_t i = 0; i < M * N; ++i) pos[i] = i;
    } else {
        pos = {0, N - 1, (M - 1) * N, M * N - 1};
        for (int i = 0; i < 20000; ++i) pos.push_back((int64_t)(splitmix(st) % (uint64_t)(M * N)));
    }
    std::vector<int32_t> ref(pos.size());
    parallel_for((int64_t)pos.size(), [&](int64_t i) {
        int64_t r = pos[i] / N, c = pos[i] % N;
        ref[i] = dot(&ha[r * ld], &hb[c * ld], K);
    });

    int8_t *da, *db;
    float *dsa, *dsb;
    CK(cudaMalloc(&da, ha.size()));
    CK(cudaMalloc(&db, hb.size()));
    CK(cudaMalloc(&dsa, hsa.size() * 4));
    CK(cudaMalloc(&dsb, hsb.size() * 4));
    CK(cudaMemcpy(da, ha.data(), ha.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, hb.data(), hb.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsa, hsa.data(), hsa.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dsb, hsb.data(), hsb.size() * 4, cudaMemcpyHostToDevice));
    const int64_t GUARD = 256;  // bytes after the output that must stay poisoned
    const size_t out_cap = (size_t)(M * N + s.out_offset) * 4 + GUARD;
    uint8_t *dout, *dold;
    CK(cudaMalloc(&dout, out_cap));
    CK(cudaMalloc(&dold, out_cap));
    std::vector<uint8_t> hout(out_cap), hold(out_cap);

    // One scale pair over all of K: a_ld = b_ld = 1 (K / block_k).
    Scales sc{dsa, 1, a_bm, K, dsb, 1, b_bn, K, qd::ceil_div(K, 32)};
    for (int dt : {QD_CUDA_S32, QD_CUDA_F32, QD_CUDA_BF16, QD_CUDA_F16}) {
        const GemmMode mode = dt == QD_CUDA_S32 ? INT32_OUT : ONE_GROUP;
        const size_t es = dtype_size(dt), bytes = (size_t)(M * N + s.out_offset) * es + GUARD;
        const int pb = poison_byte(dt);
        Result res;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%lldx%lldx%lld %s", (long long)M, (long long)N, (long long)K,
                      dtype_name(dt));
        res.what = buf;

        CK(cudaMemset(dout, pb, bytes));
        QK(qd::gemm_s8_sm90(da, db, M, N, Kp, ld, dout + s.out_offset * es, dt, sc, mode, S8, 0));
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(hout.data(), dout, bytes, cudaMemcpyDeviceToHost));

        CK(cudaMemset(dold, pb, bytes));
        if (mode == INT32_OUT) old_gemm<INT32_OUT>(da, db, M, N, Kp, ld, dold + s.out_offset * es, dt, sc);
        else old_gemm<ONE_GROUP>(da, db, M, N, Kp, ld, dold + s.out_offset * es, dt, sc);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(hold.data(), dold, bytes, cudaMemcpyDeviceToHost));

        // Nothing written outside [offset, offset + M*N).
        for (size_t i = 0; i < (size_t)s.out_offset * es; ++i) res.guard += hout[i] != pb;
        for (size_t i = (M * N + s.out_offset) * es; i < bytes; ++i) res.guard += hout[i] != pb;
        const uint8_t *o = hout.data() + s.out_offset * es, *ol = hold.data() + s.out_offset * es;
        // Every output written: no poison left (expected values are never the poison).
        const uint32_t poison = es == 4 ? 0x01010101u * pb : 0x0101u * pb;
        for (int64_t i = 0; i < M * N; ++i) res.unwritten += load_bits(o, i, dt) == poison;
        // Bitwise the same as the old kernel, everywhere.
        for (int64_t i = 0; i < M * N; ++i) res.vs_old += load_bits(o, i, dt) != load_bits(ol, i, dt);
        // Against the CPU.
        int shown = 0;
        for (size_t i = 0; i < pos.size(); ++i) {
            int64_t r = pos[i] / N, c = pos[i] % N;
            uint32_t want = expected_bits(ref[i], hsa[r / a_bm], hsb[c / b_bn], dt);
            uint32_t got = load_bits(o, pos[i], dt);
            if (got != want) {
                ++res.bad;
                if (shown++ < 5)
                    std::printf("  MISMATCH %s at (%lld, %lld): got 0x%08x want 0x%08x (dot %d)\n",
                                res.what.c_str(), (long long)r, (long long)c, got, want, ref[i]);
            }
        }
        res.checked = (int64_t)pos.size();
        if (res.bad || res.unwritten || res.guard || res.vs_old) g_fail = true;
        g_results.push_back(res);
    }

    // The public entry points take the same path (the dispatch in gemm_s8.cu).
    if (K <= QD_INT_MATMUL_MAX_K && s.out_offset == 0) {
        CK(cudaMemset(dold, 0x80, (size_t)M * N * 4));
        QK(qd_cuda_int_matmul_s8(da, db, M, N, K, ld, (int32_t *)dold, 0));
        CK(cudaDeviceSynchronize());
        QK(qd::gemm_s8_sm90(da, db, M, N, Kp, ld, dout, QD_CUDA_S32, sc, INT32_OUT, S8, 0));
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(hout.data(), dout, (size_t)M * N * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hold.data(), dold, (size_t)M * N * 4, cudaMemcpyDeviceToHost));
        Result res;
        res.what = "  public int_matmul == sm90";
        res.checked = M * N;
        res.vs_old = std::memcmp(hout.data(), hold.data(), (size_t)M * N * 4) != 0;
        if (res.vs_old) g_fail = true;
        g_results.push_back(res);
    }
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dsa));
    CK(cudaFree(dsb));
    CK(cudaFree(dout));
    CK(cudaFree(dold));
}

__global__ void fill_kernel(int8_t *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n / 8; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        reinterpret_cast<uint64_t *>(p)[i] = z ^ (z >> 31);
    }
}

struct Timing {
    int64_t M, N, K;
    double new_ms, old_ms;
};

Timing time_shape(int64_t M, int64_t N, int64_t K) {
    const size_t set_bytes = (size_t)(M + N) * K;
    const int sets = (int)std::max<size_t>(2, (200u << 20) / set_bytes + 1);
    std::vector<int8_t *> as(sets), bs(sets);
    for (int i = 0; i < sets; ++i) {
        CK(cudaMalloc(&as[i], (size_t)M * K));
        CK(cudaMalloc(&bs[i], (size_t)N * K));
        fill_kernel<<<1024, 256>>>(as[i], (size_t)M * K, 2 * i + 1);
        fill_kernel<<<1024, 256>>>(bs[i], (size_t)N * K, 2 * i + 2);
    }
    float *sa, *sb, *out;
    CK(cudaMalloc(&sa, M * 4));
    CK(cudaMalloc(&sb, N * 4));
    CK(cudaMalloc(&out, (size_t)M * N * 4));
    std::vector<float> ones(std::max(M, N), 1.0f / 1024);
    CK(cudaMemcpy(sa, ones.data(), M * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(sb, ones.data(), N * 4, cudaMemcpyHostToDevice));
    Scales sc{sa, 1, 1, K, sb, 1, 1, K, qd::ceil_div(K, 32)};
    Timing t{M, N, K, 0, 0};
    t.new_ms = median_ms([&](int i) { QK(qd::gemm_s8_sm90(as[i], bs[i], M, N, K, K, out, QD_CUDA_F32, sc, ONE_GROUP, S8, 0)); }, sets);
    t.old_ms = median_ms([&](int i) { old_gemm<ONE_GROUP>(as[i], bs[i], M, N, K, K, out, QD_CUDA_F32, sc); }, sets);
    for (int i = 0; i < sets; ++i) {
        CK(cudaFree(as[i]));
        CK(cudaFree(bs[i]));
    }
    CK(cudaFree(sa));
    CK(cudaFree(sb));
    CK(cudaFree(out));
    return t;
}

}  // namespace chk

int main(int argc, char **argv) {
    using namespace chk;
    const bool skip_timing = argc > 1 && std::string(argv[1]) == "--no-timing";
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, cc %d.%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
    if (!qd::gemm_s8_sm90_usable()) {
        std::printf("FAIL: gemm_s8_sm90_usable() is false on this device/build (%s)\n", qd_cuda_last_error());
        return 3;
    }

    const Shape shapes[] = {
        {4096, 4096, 4096, 0, 0, 0, 0, false},
        {8192, 8192, 8192, 0, 0, 0, 0, false},
        {2048, 11008, 4096, 0, 0, 0, 0, false},
        {1, 4096, 4096, 0, 0, 0, 0, true},
        {17, 300, 1040, 32, 0, 0, 0, true},
        {130, 257, 48, 16, 0, 13, 257, true},   // block scales, N odd
        {256, 256, 16, 48, 1, 256, 0, true},    // per-tensor A scale, misaligned output pairs
        {1000, 1000, 2000, 0, 0, 0, 0, true},
        {33, 65, 100, 16, 0, 0, 0, true},       // K % 16 != 0: zero padding up to Kp
        {130, 260, 131056, 0, 0, 0, 0, true},   // longest exact K: 1024 k-tiles, phases wrap
    };
    uint64_t seed = 12345;
    for (const Shape &s : shapes) check_shape(s, seed++);

    std::vector<Timing> timings;
    if (!skip_timing)
        for (auto mnk : {std::vector<int64_t>{4096, 4096, 4096}, {8192, 8192, 8192}, {2048, 11008, 4096}})
            timings.push_back(time_shape(mnk[0], mnk[1], mnk[2]));

    std::printf("\n%-28s %10s %8s %10s %6s %8s\n", "case", "checked", "cpu_bad", "unwritten", "guard", "vs_old");
    for (const Result &r : g_results)
        std::printf("%-28s %10lld %8lld %10lld %6lld %8lld\n", r.what.c_str(), (long long)r.checked,
                    (long long)r.bad, (long long)r.unwritten, (long long)r.guard, (long long)r.vs_old);
    if (!timings.empty()) {
        std::printf("\nONE_GROUP f32 out, median of 7 x 20 launches\n%-22s %10s %8s %10s %8s %8s\n", "MxNxK",
                    "sm90 ms", "TOPS", "mma.sync", "TOPS", "speedup");
        for (const Timing &t : timings) {
            const double ops = 2.0 * t.M * t.N * t.K;
            char mnk[64];
            std::snprintf(mnk, sizeof mnk, "%lldx%lldx%lld", (long long)t.M, (long long)t.N, (long long)t.K);
            std::printf("%-22s %10.3f %8.1f %10.3f %8.1f %8.2f\n", mnk, t.new_ms, ops / t.new_ms / 1e9,
                        t.old_ms, ops / t.old_ms / 1e9, t.old_ms / t.new_ms);
        }
    }
    std::printf("\n%s\n", g_fail ? "FAIL" : "ALL OK");
    return g_fail ? 1 : 0;
}
