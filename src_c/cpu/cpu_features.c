/* CPU feature detection: cpuid + xgetbv on x86-64, hwcaps on aarch64.
 * Baseline code only: no AVX instructions here. */
#define _GNU_SOURCE /* syscall() */
#include "qd_internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef struct {
    int avx2, avxvnni, avx512vnni, amx;
} x86_features;

static uint64_t read_xcr0(void)
{
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

/* Linux hands out the tile registers' 8 KB of state only to a process that asks
 * (once, for all its threads); the first tile instruction of one that didn't dies
 * of SIGILL.  Other systems: not used. */
static int amx_permitted(void)
{
#if defined(__linux__) && defined(SYS_arch_prctl)
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

static x86_features detect_x86(void)
{
    x86_features f = {0};
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return f;
    const int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!osxsave || !avx)
        return f;
    const uint64_t xcr0 = read_xcr0();
    const int ymm_state = (xcr0 & 0x6) == 0x6;            /* SSE + AVX state */
    const int zmm_state = (xcr0 & 0xE6) == 0xE6;          /* + opmask, ZMM_Hi256, Hi16_ZMM */
    if (__get_cpuid_max(0, 0) < 7)
        return f;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = (b >> 5) & 1;
    const int avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
              avx512vl = (b >> 31) & 1, avx512vnni = (c >> 11) & 1;
    unsigned a1, b1, c1, d1;
    __cpuid_count(7, 1, a1, b1, c1, d1);
    const int avxvnni = (a1 >> 4) & 1;
    f.avx2 = ymm_state && avx2 && fma && f16c;
    f.avxvnni = f.avx2 && avxvnni;
    f.avx512vnni = f.avx2 && zmm_state && avx512f && avx512dq && avx512bw && avx512vl && avx512vnni;
    const int amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1;
    const int tile_state = (xcr0 & 0x60000) == 0x60000;  /* XTILECFG, XTILEDATA */
    f.amx = f.avx512vnni && amx_tile && amx_int8 && tile_state && amx_permitted();
#ifdef QD_AMX_EMULATED   /* a test build whose tiles are software (tests/amx_emulator.h) */
    f.amx = f.avx512vnni;
#endif
    return f;
}

static int features_ready;   /* 0: not yet, 1: detected */
static x86_features features;

int qd_cpu_has(qd_isa isa)
{
    if (!__atomic_load_n(&features_ready, __ATOMIC_ACQUIRE)) {
        /* Detection is idempotent, so racing threads all compute the same answer. */
        x86_features f = detect_x86();
        __atomic_store_n(&features.avx2, f.avx2, __ATOMIC_RELAXED);
        __atomic_store_n(&features.avxvnni, f.avxvnni, __ATOMIC_RELAXED);
        __atomic_store_n(&features.avx512vnni, f.avx512vnni, __ATOMIC_RELAXED);
        __atomic_store_n(&features.amx, f.amx, __ATOMIC_RELAXED);
        __atomic_store_n(&features_ready, 1, __ATOMIC_RELEASE);
    }
    switch (isa) {
    case QD_ISA_SCALAR: return 1;
    case QD_ISA_AVX2: return __atomic_load_n(&features.avx2, __ATOMIC_RELAXED);
    case QD_ISA_AVXVNNI: return __atomic_load_n(&features.avxvnni, __ATOMIC_RELAXED);
    case QD_ISA_AVX512VNNI: return __atomic_load_n(&features.avx512vnni, __ATOMIC_RELAXED);
    case QD_ISA_AMX: return __atomic_load_n(&features.amx, __ATOMIC_RELAXED);
    default: return 0;
    }
}

#elif defined(__aarch64__)
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

int qd_cpu_has(qd_isa isa)
{
    switch (isa) {
    case QD_ISA_SCALAR: return 1;
    case QD_ISA_NEON_DOTPROD:
#if defined(__linux__)
        return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
        return 1;
#else
        return 0;
#endif
    default: return 0;
    }
}

#else
int qd_cpu_has(qd_isa isa)
{
    return isa == QD_ISA_SCALAR;
}
#endif
