/* ISA selection, the per-ISA kernel tables, thread count and status strings. */
#define _POSIX_C_SOURCE 200112L
#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define QD_POSIX_THREADS 1 /* for qd_forked_child and team_that_starts */
#endif
#endif
#include "qd_internal.h"

static const char *const isa_names[QD_ISA_COUNT] = {
    "scalar", "avx2", "avxvnni", "avx512vnni", "neon_dotprod", "amx",
};

const char *qd_isa_name(qd_isa isa)
{
    return (unsigned)isa < QD_ISA_COUNT ? isa_names[isa] : "?";
}

static int name_equals(const char *a, const char *b)
{
    for (; *a && *b; a++, b++)
        if (tolower((unsigned char)*a) != tolower((unsigned char)*b))
            return 0;
    return *a == *b;
}

qd_status qd_isa_from_name(const char *name, qd_isa *out)
{
    if (!name || !out)
        return QD_ERR_NULL;
    for (int i = 0; i < QD_ISA_COUNT; i++) {
        if (name_equals(name, isa_names[i])) {
            *out = (qd_isa)i;
            return QD_OK;
        }
    }
    if (name_equals(name, "neon")) {
        *out = QD_ISA_NEON_DOTPROD;
        return QD_OK;
    }
    return QD_ERR_ARGUMENT;
}

int qd_isa_built(qd_isa isa)
{
    switch (isa) {
    case QD_ISA_SCALAR: return 1;
#if defined(__x86_64__) || defined(_M_X64)
    case QD_ISA_AVX2:
#ifndef QD_NO_AVXVNNI /* left out by a compiler without -mavxvnni */
    case QD_ISA_AVXVNNI:
#endif
#ifndef QD_NO_AMX /* left out by a compiler without -mamx-int8 */
    case QD_ISA_AMX:
#endif
    case QD_ISA_AVX512VNNI: return 1;
#endif
#if defined(__aarch64__) && !defined(QD_NO_NEON) /* left out by a compiler without +dotprod */
    case QD_ISA_NEON_DOTPROD: return 1;
#endif
    default: return 0;
    }
}

int qd_isa_supported(qd_isa isa)
{
    return (unsigned)isa < QD_ISA_COUNT && qd_cpu_has(isa);
}

const qd_kernels *qd_kernels_for(qd_isa isa)
{
    switch (isa) {
#if defined(__x86_64__) || defined(_M_X64)
    case QD_ISA_AVX2: return &qd_kernels_avx2;
#ifndef QD_NO_AVXVNNI
    case QD_ISA_AVXVNNI: return &qd_kernels_avxvnni;
#endif
    case QD_ISA_AVX512VNNI: return &qd_kernels_avx512vnni;
#ifndef QD_NO_AMX
    case QD_ISA_AMX: return &qd_kernels_amx;
#endif
#endif
#if defined(__aarch64__) && !defined(QD_NO_NEON)
    case QD_ISA_NEON_DOTPROD: return &qd_kernels_neon;
#endif
    default: return &qd_kernels_scalar;
    }
}

const qd_quant_kernels *qd_quant_kernels_active(void)
{
    switch (qd_isa_active()) {
#if defined(__x86_64__) || defined(_M_X64)
    case QD_ISA_AVX2:
    case QD_ISA_AVXVNNI: return &qd_quant_kernels_avx2;
    case QD_ISA_AVX512VNNI:
    case QD_ISA_AMX: /* AMX runs only qq on its tiles */
        return &qd_quant_kernels_avx512vnni;
#endif
    default: return &qd_quant_kernels_base;
    }
}

const qd_dequant_kernels *qd_dequant_kernels_active(void)
{
    switch (qd_isa_active()) {
#if defined(__x86_64__) || defined(_M_X64)
    case QD_ISA_AVX2:
    case QD_ISA_AVXVNNI: return &qd_dequant_kernels_avx2;
    case QD_ISA_AVX512VNNI:
    case QD_ISA_AMX:
        return &qd_dequant_kernels_avx512vnni;
#endif
    default: return &qd_dequant_kernels_base;
    }
}

qd_pack_kn_fn qd_pack_kn_active(void)
{
    switch (qd_isa_active()) {
#if defined(__x86_64__) || defined(_M_X64)
    case QD_ISA_AVX2:
    case QD_ISA_AVXVNNI: return qd_pack_kn_avx2;
    case QD_ISA_AVX512VNNI:
    case QD_ISA_AMX:
        return qd_pack_kn_avx512vnni;
#endif
    default: return qd_pack_kn_base;
    }
}

/* -1: no override.  Written with atomics so concurrent readers see a whole value. */
static int isa_override = -1;

static qd_isa best_isa(void)
{
    static const qd_isa preference[] = {QD_ISA_AMX, QD_ISA_AVX512VNNI, QD_ISA_AVXVNNI, QD_ISA_AVX2,
                                        QD_ISA_NEON_DOTPROD};
    for (size_t i = 0; i < sizeof preference / sizeof preference[0]; i++)
        if (qd_isa_built(preference[i]) && qd_isa_supported(preference[i]))
            return preference[i];
    return QD_ISA_SCALAR;
}

qd_isa qd_isa_active(void)
{
    const int forced = __atomic_load_n(&isa_override, __ATOMIC_RELAXED);
    return forced >= 0 ? (qd_isa)forced : best_isa();
}

qd_status qd_isa_set(qd_isa isa)
{
    if ((unsigned)isa >= QD_ISA_COUNT)
        return QD_ERR_ARGUMENT;
    if (!qd_isa_built(isa))
        return QD_ERR_ISA_NOT_BUILT;
    if (!qd_isa_supported(isa))
        return QD_ERR_ISA_NOT_SUPPORTED;
    __atomic_store_n(&isa_override, (int)isa, __ATOMIC_RELAXED);
    return QD_OK;
}

void qd_isa_reset(void)
{
    __atomic_store_n(&isa_override, -1, __ATOMIC_RELAXED);
}

/* ---- threads ---- */
static int thread_setting;   /* <= 0: default */
/* More threads than this per processor only add switching, and OpenMP must not see
 * a count like INT_MAX: it takes stack in proportion to a team's size and exits the
 * process when it cannot start a thread. */
#define THREADS_PER_PROC_MAX 4

/* Counted once: omp_get_num_procs asks the kernel for the affinity mask, a system
 * call as long as a small product, and every product asks for its thread count. */
static int processors(void)
{
#ifdef _OPENMP
    static int counted;
    int procs = __atomic_load_n(&counted, __ATOMIC_RELAXED);
    if (procs == 0) {
        procs = omp_get_num_procs();
        procs = procs > 0 ? procs : 1;
        __atomic_store_n(&counted, procs, __ATOMIC_RELAXED);
    }
    return procs;
#else
    return 1;
#endif
}

/* The default thread count: OMP_NUM_THREADS's (its first entry, a whole number
 * above 0, at most 4 per processor), read once as OpenMP reads it, else one per
 * processor.  Worker processes sized by OMP_NUM_THREADS=1 (as torch and the BLAS
 * libraries take it) would otherwise each spin a team of every core. */
static int default_threads(void)
{
#ifdef _OPENMP
    static int counted;
    int n = __atomic_load_n(&counted, __ATOMIC_RELAXED);
    if (n == 0) {
        const char *text = getenv("OMP_NUM_THREADS");
        char *end = NULL;
        errno = 0;
        const long named = text ? strtol(text, &end, 10) : 0;
        const int cap = THREADS_PER_PROC_MAX * processors();
        const int whole = text && end != text && !errno && (*end == '\0' || *end == ',' || isspace((unsigned char)*end));
        n = whole && named > 0 ? (named < cap ? (int)named : cap) : processors();
        __atomic_store_n(&counted, n, __ATOMIC_RELAXED);
    }
    return n;
#else
    return 1;
#endif
}

#ifdef QD_POSIX_THREADS
/* GNU OpenMP ends the process when the system refuses one of a team's threads (a
 * container's limit on tasks, RLIMIT_NPROC, no address space for a stack). So before
 * a calling thread's first team of a size, the threads that team needs are started
 * here and let go at once; when the system refuses some, every team takes one more
 * thread than it let start, until the setting changes. The probe counts none of the
 * threads the caller's earlier teams left waiting, so near the limit it caps early
 * rather than late. */
static int setting_changes;              /* qd_set_num_threads calls */
static int team_cap;                     /* 0, or the most threads a team may have */
static __thread int team_started = 1;    /* this thread's largest team that could start... */
static __thread int team_started_at = -1; /* ...at this count of setting changes */

static void *no_work(void *arg)
{
    return arg;
}

/* A stack size as GNU OpenMP reads OMP_STACKSIZE: kilobytes, or a number with a
 * B, K, M or G suffix, spaces around; 0 if `text` is no such size. */
static size_t stack_size_named(const char *text)
{
    char *end;
    while (isspace((unsigned char)*text))
        text++;
    errno = 0;
    const unsigned long long value = strtoull(text, &end, 10);
    if (errno || end == text || *text == '-')
        return 0;
    while (isspace((unsigned char)*end))
        end++;
    int shift = 10;
    if (*end) {
        const char unit = (char)tolower((unsigned char)*end++);
        shift = unit == 'b' ? 0 : unit == 'k' ? 10 : unit == 'm' ? 20 : unit == 'g' ? 30 : -1;
        while (isspace((unsigned char)*end))
            end++;
        if (shift < 0 || *end)
            return 0;
    }
    if (value > (unsigned long long)SIZE_MAX >> shift)
        return 0;
    return (size_t)value << shift;
}

/* How many of `wanted` threads the system lets start now, each with the stack GNU
 * OpenMP gives its own (OMP_STACKSIZE, else GOMP_STACKSIZE, else the default); each
 * ends at once. */
static int threads_that_start(int wanted)
{
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return 0;
    const char *named = getenv("OMP_STACKSIZE");
    size_t stack = named ? stack_size_named(named) : 0;
    if (!stack && (named = getenv("GOMP_STACKSIZE")) != NULL)
        stack = stack_size_named(named);
    if (stack)
        pthread_attr_setstacksize(&attr, stack);  /* a size it refuses, OpenMP ignores too */
    pthread_t *ids = malloc((size_t)wanted * sizeof *ids);
    int started = 0;
    if (ids) {
        while (started < wanted && pthread_create(&ids[started], &attr, no_work, NULL) == 0)
            started++;
        for (int i = 0; i < started; i++)
            pthread_join(ids[i], NULL);
        free(ids);
    }
    pthread_attr_destroy(&attr);
    return started;
}

/* n, or fewer where the system would not start a team of n for this thread. */
static int team_that_starts(int n)
{
    const int changes = __atomic_load_n(&setting_changes, __ATOMIC_RELAXED);
    const int cap = __atomic_load_n(&team_cap, __ATOMIC_RELAXED);
    if (cap > 0 && n > cap)
        n = cap;
    if (team_started_at != changes) {
        team_started = 1;
        team_started_at = changes;
    }
    if (n <= team_started || omp_in_parallel())
        return n;
    const int started = 1 + threads_that_start(n - 1);
    if (started < n) {
        n = started;
        __atomic_store_n(&team_cap, n, __ATOMIC_RELAXED);
    }
    team_started = n;
    return n;
}
#endif

void qd_set_num_threads(int n)
{
    /* capped here, once a setting, not once a product */
    const int cap = THREADS_PER_PROC_MAX * processors();
    __atomic_store_n(&thread_setting, n <= 0 ? 0 : n < cap ? n : cap, __ATOMIC_RELAXED);
#ifdef QD_POSIX_THREADS
    __atomic_store_n(&team_cap, 0, __ATOMIC_RELAXED);
    __atomic_add_fetch(&setting_changes, 1, __ATOMIC_RELAXED);
#endif
}

/* GNU OpenMP's team of threads does not survive fork(): in the child, the first
 * parallel loop of more than one thread waits forever for threads that are gone.
 * So a process forked after this library was loaded runs its loops on its own
 * thread; workers that want threads start by spawn, not fork. */
#ifdef QD_POSIX_THREADS
static int forked;

static void note_fork_in_child(void)
{
    forked = 1;
}

__attribute__((constructor)) static void watch_forks(void)
{
    pthread_atfork(NULL, NULL, note_fork_in_child);
}
#endif

int qd_forked_child(void)
{
#ifdef QD_POSIX_THREADS
    return forked;
#else
    return 0;
#endif
}

int qd_thread_cap(void)
{
#ifdef QD_POSIX_THREADS
    return __atomic_load_n(&team_cap, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

int qd_get_num_threads(void)
{
#ifdef _OPENMP
    if (qd_forked_child())
        return 1;
    const int n = __atomic_load_n(&thread_setting, __ATOMIC_RELAXED);
#ifdef QD_POSIX_THREADS
    return team_that_starts(n > 0 ? n : default_threads());
#else
    return n > 0 ? n : default_threads();
#endif
#else
    return 1; /* built without OpenMP: the parallel loops run on the calling thread */
#endif
}

/* Threads for a parallel loop of work_items independent items. */
int qd_threads_for(int64_t work_items)
{
    const int n = qd_get_num_threads();
    if (work_items < 1)
        return 1;
    return work_items < n ? (int)work_items : n;
}

/* Threads for an M x K x N product cut into work_items items: at least
 * QD_MACS_PER_THREAD multiply-adds each, since a parallel region's start and end
 * cost more than a small product (a 256 x 256 layer at one row), and far more on a
 * busy machine, where a thread may wait a scheduler slice to run. */
int qd_threads_for_product(int64_t work_items, int64_t M, int64_t K, int64_t N)
{
    const double worth = (double)M * (double)K * (double)N / QD_MACS_PER_THREAD + 1;  /* no int64 overflow */
    return qd_threads_for(worth < (double)work_items ? (int64_t)worth : work_items);
}

/* ---- memory ---- */
void *qd_aligned_alloc(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    return p;
}

void qd_aligned_free(void *p)
{
    free(p);
}

/* ---- version ---- */
#ifndef QD_VERSION_STRING
#define QD_VERSION_STRING "unknown" /* built outside setup.py, which passes the release */
#endif

int qd_abi_version(void)
{
    return QD_ABI_VERSION;
}

const char *qd_version(void)
{
    return QD_VERSION_STRING;
}

/* ---- status ---- */
const char *qd_status_string(qd_status status)
{
    switch (status) {
    case QD_OK: return "success";
    case QD_ERR_NULL: return "a required pointer argument is NULL";
    case QD_ERR_SHAPE: return "a dimension is not positive, does not match another argument's (such as the K of "
                              "packed weights), or is not divided by its block size";
    case QD_ERR_ARGUMENT: return "an argument is out of range or invalid, such as an output that overlaps an input";
    case QD_ERR_SCHEME: return "unknown quantization value kind, scale dtype or bit width";
    case QD_ERR_ISA_NOT_BUILT: return "the requested instruction set was not compiled into this library";
    case QD_ERR_ISA_NOT_SUPPORTED: return "this CPU does not support the requested instruction set";
    case QD_ERR_NO_MEMORY: return "out of memory";
    case QD_ERR_K_TOO_LARGE: return "K is larger than 131071, the largest depth an exact int32 int8 product allows";
    case QD_ERR_NOT_FINITE: return "the input holds NaN or Inf";
    case QD_ERR_SCALE_OVERFLOW: return "a scale overflows its scale dtype";
    case QD_ERR_CUDA_UNAVAILABLE: return "CUDA is not available (not built, or no device)";
    case QD_ERR_CUDA: return "a CUDA call failed";
    }
    return "unknown status";
}
