/* Private declarations shared by the CPU kernel library. */
#ifndef QD_INTERNAL_H
#define QD_INTERNAL_H

#include <stdint.h>
#include <stddef.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h> /* the MXCSR of qd_fp_mode */
#endif
#include "qdispatch.h"
#include "qd_checks.h"

/* ---- panel layout (ISA-independent) ----
 * Weights are stored in panels of QD_NR output columns.  A panel is a run of
 * 64-byte units; each unit covers QD_KU(bits) consecutive k for the 16 columns.
 * Byte (n*4 + j) of a unit holds, for sub-step s = 0 .. 8/bits-1, the value of
 * column n at k = unit*KU + s*4 + j, biased to be unsigned (w + 2^(bits-1))
 * for 4 and 2 bits and stored as plain two's complement for 8 bits, at bit
 * offset s*bits.  One unit is exactly one zmm / two ymm / four q registers.
 * K is zero-padded to a whole number of units; N to a whole number of panels. */
#define QD_NR 16
#define QD_UNIT_BYTES 64
#define QD_KU(bits) (4 * (8 / (bits)))

struct qd_packed_weights {
    uint64_t magic;             /* QD_PACKED_MAGIC from creation until freed */
    int64_t n, k;               /* logical shape [N, K] */
    int64_t block_n, block_k;
    int bits;
    int64_t k_padded;           /* multiple of QD_KU(bits) */
    int64_t n_panels;
    int64_t panel_bytes;        /* k_padded / KU * 64 */
    uint8_t *panels;            /* n_panels * panel_bytes, 64-byte aligned */
    int64_t k_groups;           /* K / block_k */
    float *panel_scales;        /* [n_panels][k_groups][QD_NR], 64-byte aligned */
    float *scales;              /* the original grid [N/block_n, K/block_k] */
};

/* The int8 values of panel p's rows (QD_NR of them, fewer in the last panel), each
 * pw->k long, into rows [.][pw->k]. */
void qd_unpack_panel(const qd_packed_weights *pw, int64_t p, int8_t *rows);

/* QD_OK for packed weights that qd_pack_weights made; QD_ERR_NULL for NULL,
 * QD_ERR_ARGUMENT for other memory (a zeroed struct, say), which the entry points
 * refuse rather than read sizes and pointers from. */
qd_status qd_packed_check(const qd_packed_weights *pw);

/* The shape fields of packed weights (no buffers). */
void qd_packed_layout(qd_packed_weights *pw, int64_t N, int64_t K, int bits,
                      int64_t block_n, int64_t block_k);
/* A packed-weights object with its scales laid out (NULL scales: all 1) and its
 * panels allocated but not written; NULL when out of memory. */
qd_packed_weights *qd_packed_new(int64_t N, int64_t K, int bits, const float *scales,
                                 int64_t block_n, int64_t block_k);
/* Panels p0 .. p0 + np - 1 of int8 B [K, N] (row-major, the right operand of a
 * plain matmul) taken as 8-bit weights [N, K]; panel i goes to dst + i * panel_bytes. */
void qd_pack_s8_kn_panels(const int8_t *b, int64_t K, int64_t N, int64_t p0, int np,
                          int64_t panel_bytes, uint8_t *dst);

/* One microkernel call of the qq (int8 x int-n) family: up to the kernel's MR rows
 * of A against up to its NP consecutive panels, all of K.  Groups are group_k long; for each group the
 * exact int32 dot is scaled by a_scale * w_scale and accumulated in float32.
 * In integer mode (out_i32 != NULL) there is one group and the int32 dot is stored. */
typedef struct qd_qq_tile {
    const int8_t *a;            /* rows of A, zero-padded to k_padded */
    int64_t lda;
    int mr;                     /* rows in this tile, 1 .. kernel MR */
    const int32_t *a_rowsum;    /* [mr][rowsum_ld]: sum of A over each group */
    int64_t rowsum_ld;
    const float *a_scale;       /* a_scale[r * a_scale_ld + g / a_ratio] */
    int64_t a_scale_ld, a_ratio;
    const uint8_t *panel;       /* first panel; panel p at panel + p * panel_ld */
    int64_t panel_ld;
    int np;                     /* panels in this call, 1 .. kernel NP */
    const float *w_scale;       /* w_scale[p * w_scale_ld + (g / w_ratio) * QD_NR + n] */
    int64_t w_scale_ld;
    int64_t w_ratio;
    int bits;
    int nr;                     /* valid columns over the np panels, 1 .. np * QD_NR */
    int64_t k;                  /* logical K */
    int64_t group_k;            /* elements per group */
    int64_t ngroups;
    int64_t group_units;        /* units per group (SIMD kernels) */
    float *out;                 /* out[r * ldo + n] */
    int32_t *out_i32;
    int64_t ldo;
} qd_qq_tile;

/* Rows r .. r + mr - 1 of tile t, as a tile of their own. */
static inline qd_qq_tile qd_qq_tile_rows(const qd_qq_tile *t, int64_t r, int mr)
{
    qd_qq_tile rows = *t;
    rows.mr = mr;
    rows.a = t->a + r * t->lda;
    rows.a_rowsum = t->a_rowsum ? t->a_rowsum + r * t->rowsum_ld : NULL;
    rows.a_scale = t->a_scale ? t->a_scale + r * t->a_scale_ld : NULL;
    rows.out = t->out ? t->out + r * t->ldo : NULL;
    rows.out_i32 = t->out_i32 ? t->out_i32 + r * t->ldo : NULL;
    return rows;
}

/* The fq (float32 x dequantized weights) microkernel: float32 accumulation. */
typedef struct qd_fq_tile {
    const float *x;             /* rows of x, zero-padded to k_padded */
    int64_t ldx;
    int mr;
    const uint8_t *panel;
    const float *w_scale;       /* w_scale[g * QD_NR + n] */
    int bits;
    int nr;
    int64_t k;
    int64_t group_k, ngroups, group_units;
    float *out;
    int64_t ldo;
} qd_fq_tile;

/* Scale groups along K that are no whole panel units (a [K, N] weight scaled per row
 * of K): the kernels with fq_short_groups take them, the others leave them to scalar. */
static inline int qd_fq_short_groups(int64_t ngroups, int64_t group_k, int bits)
{
    return ngroups > 1 && group_k % QD_KU(bits) != 0;
}

/* qq's likewise, where a group's sum stays exact in float32: |a * w| <= 2^14 a term,
 * so fewer than 2^10 terms keep every partial sum a whole number below 2^24. */
static inline int qd_qq_short_groups(int64_t ngroups, int64_t group_k, int bits)
{
    return qd_fq_short_groups(ngroups, group_k, bits) && group_k < 1024;
}

/* Where a kernel that runs group by group stands in the scales: the group's weight
 * scales (QD_NR columns) and, for qq, the column of the activations' scales.
 * Counted down as groups end, not divided out of the group's index: at groups of
 * one value (a weight scaled per input channel) the divisions set qq's pace, 1.5-1.7x
 * the time of the AVX2 kernel at 16 and 64 x 4096 x 4096 on Zen 4, and at qq int4's
 * blocks of 32 they cost the AVX2 kernel 1.2-1.3x.  `qt` NULL: fq's scales, a block
 * per group. */
typedef struct {
    const float *w;
    int64_t w_ratio, w_left;         /* groups per block of weight scales, and to its end */
    int64_t a_at, a_ratio, a_left;   /* likewise for the activations' scales (qq) */
} qd_group_scales;

static inline qd_group_scales qd_group_scales_start(const float *w_scale, const qd_qq_tile *qt)
{
    const int64_t w_ratio = qt ? qt->w_ratio : 1, a_ratio = qt ? qt->a_ratio : 1;
    return (qd_group_scales){.w = w_scale, .w_ratio = w_ratio, .w_left = w_ratio,
                             .a_at = 0, .a_ratio = a_ratio, .a_left = a_ratio};
}

static inline void qd_group_scales_next(qd_group_scales *s)
{
    if (--s->w_left == 0) {
        s->w += QD_NR;
        s->w_left = s->w_ratio;
    }
    if (--s->a_left == 0) {
        s->a_at++;
        s->a_left = s->a_ratio;
    }
}

typedef struct qd_kernels {
    void (*qq_tile)(const qd_qq_tile *t);
    void (*fq_tile)(const qd_fq_tile *t);
    int qq_mr;                  /* rows one qq_tile call handles at most */
    int qq_np;                  /* panels one qq_tile call handles at most (0: one) */
    int fq_mr;
    int fq_short_groups;        /* fq_tile takes scale groups that are no whole units */
    int needs_rowsum;           /* qq_tile reads a_rowsum */
    /* qq for scale groups that are no whole units (qd_qq_short_groups); NULL: scalar */
    const struct qd_kernels *qq_short_groups;
} qd_kernels;

extern const qd_kernels qd_kernels_scalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const qd_kernels qd_kernels_avx2;
extern const qd_kernels qd_kernels_avxvnni;
extern const qd_kernels qd_kernels_avx512vnni;
extern const qd_kernels qd_kernels_amx;
extern const qd_kernels qd_kernels_qq_short_groups_avx2;
#endif
#if defined(__aarch64__)
extern const qd_kernels qd_kernels_neon;
#endif

/* Quantize kernels of one ISA.  absmax_bits: the largest |x| as float bits, at
 * or above 0x7F800000 when x holds NaN or Inf.  quantize: q = clamp(rint(x /
 * scale), lo, hi) by the pinned formula (x finite).  The _each forms serve blocks
 * a few columns wide, a row at a time: m[i] = max(m[i], |x[i]| as bits), and
 * quantize with scale[i] for x[i]. */
typedef struct qd_quant_kernels {
    uint32_t (*absmax_bits)(const float *x, int64_t n);
    void (*quantize)(const float *x, int64_t n, float lo, float hi, float scale, int8_t *q);
    void (*absmax_each)(const float *x, int64_t n, uint32_t *m);
    void (*quantize_each)(const float *x, int64_t n, float lo, float hi, const float *scale, int8_t *q);
} qd_quant_kernels;

extern const qd_quant_kernels qd_quant_kernels_base;
#if defined(__x86_64__) || defined(_M_X64)
extern const qd_quant_kernels qd_quant_kernels_avx2;
extern const qd_quant_kernels qd_quant_kernels_avx512vnni;
#endif
/* The quantize kernels of the active ISA. */
const qd_quant_kernels *qd_quant_kernels_active(void);

/* One qd_dequantize_rows call, as its row kernel reads it. */
typedef struct qd_dequantize_job {
    const void *values;         /* rows first_row, first_row + 1, ... of the matrix */
    int bits;                   /* 0: one int8 a value; else packed_u32 of this width */
    int64_t cols, words_per_row;
    const float *scales;
    int64_t block_rows, block_cols;
    void *out;
    int out_dtype;
    int64_t first_row;
} qd_dequantize_job;

/* Dequantize and conversion kernels of one ISA (dequantize_kernels.h): row(job, r,
 * i) writes row r of the matrix to row i of the output; the conversions to 16 bits
 * round to nearest even, NaN to the quiet NaN (with its sign for float16); those to
 * float32 are exact, a NaN keeping its payload. */
typedef struct qd_dequant_kernels {
    void (*row)(const qd_dequantize_job *job, int64_t r, int64_t i);
    void (*f32_to_f16)(const float *src, int64_t n, uint16_t *dst);
    void (*f32_to_bf16)(const float *src, int64_t n, uint16_t *dst);
    void (*f16_to_f32)(const uint16_t *src, int64_t n, float *dst);
    void (*bf16_to_f32)(const uint16_t *src, int64_t n, float *dst);
} qd_dequant_kernels;

extern const qd_dequant_kernels qd_dequant_kernels_base;
#if defined(__x86_64__) || defined(_M_X64)
extern const qd_dequant_kernels qd_dequant_kernels_avx2;
extern const qd_dequant_kernels qd_dequant_kernels_avx512vnni;
#endif
const qd_dequant_kernels *qd_dequant_kernels_active(void);

/* Packs units 0 .. units-1 of panels p0 .. p0+np-1 of row-major int8 B [K, N],
 * all inside B, into dst (panel i at dst + i * panel_bytes). */
typedef void (*qd_pack_kn_fn)(const int8_t *b, int64_t N, int64_t units, int64_t p0, int np,
                              int64_t panel_bytes, uint8_t *dst);
extern const qd_pack_kn_fn qd_pack_kn_base;
#if defined(__x86_64__) || defined(_M_X64)
extern const qd_pack_kn_fn qd_pack_kn_avx2;
extern const qd_pack_kn_fn qd_pack_kn_avx512vnni;
#endif
qd_pack_kn_fn qd_pack_kn_active(void);

/* The kernel table of an ISA (must be built). */
const qd_kernels *qd_kernels_for(qd_isa isa);
/* Raw CPU feature check, without looking at what was built. */
int qd_cpu_has(qd_isa isa);
int qd_threads_for(int64_t work_items);
/* a parallel product gives each thread at least this many multiply-adds (see dispatch.c) */
#define QD_MACS_PER_THREAD (1 << 17)
int qd_threads_for_product(int64_t work_items, int64_t M, int64_t K, int64_t N);

/* Iterations a worker takes when `items` are shared among `workers` (at least 1):
 * the chunk of a schedule(static, chunk) that hands each of them one run. */
static inline int64_t qd_run_length(int64_t items, int workers)
{
    return items > workers ? (items + workers - 1) / workers : 1;
}

/* A thread's floating-point controls: rounding direction, flush-to-zero and the
 * exception masks.  Not the sticky exception flags: those a thread raises stay its
 * own, so the caller's thread keeps the ones its share of a loop raised. */
#if defined(__x86_64__) || defined(_M_X64)
#define QD_MXCSR_FLAGS 0x3Fu
typedef unsigned int qd_fp_mode;
static inline qd_fp_mode qd_fp_mode_get(void) { return _mm_getcsr() & ~QD_MXCSR_FLAGS; }
static inline void qd_fp_mode_set(qd_fp_mode mode) { _mm_setcsr(mode | (_mm_getcsr() & QD_MXCSR_FLAGS)); }
#elif defined(__aarch64__)
typedef uint64_t qd_fp_mode; /* FPCR, read and written in place: the flags are FPSR's (and fenv is libm's) */
static inline qd_fp_mode qd_fp_mode_get(void) { uint64_t fpcr; __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr)); return fpcr; }
static inline void qd_fp_mode_set(qd_fp_mode mode) { __asm__ volatile("msr fpcr, %0" : : "r"(mode)); }
#else
typedef int qd_fp_mode; /* elsewhere each thread keeps its own mode */
static inline qd_fp_mode qd_fp_mode_get(void) { return 0; }
static inline void qd_fp_mode_set(qd_fp_mode mode) { (void)mode; }
#endif

/* An OpenMP loop over the loop given after CLAUSES, its `items` iterations shared
 * among `workers` threads, a run each: `#pragma omp parallel CLAUSES` (reductions),
 * then `#pragma omp for` inside it.  The loop runs on the
 * calling thread when workers is 1: libgomp's region of one thread still costs about
 * 0.4 us (it wakes the team at its end), as much as a small layer's kernel.
 * Every region's team is the thread setting's size, whatever `workers` is, and the
 * threads past `workers` take no run: libgomp ends the threads a smaller team leaves
 * out and starts new ones when a larger team follows: on a 16-core Xeon a quantize
 * on 2 threads, then a product on 16, took 0.59 ms, where alone they take 0.04 and 0.14.
 * Each thread runs its share in the caller's floating-point mode and then goes back to
 * its own: pool threads keep the mode they started in, so in a process that set
 * another (fesetround, flush-to-zero) the rows of other threads were rounded otherwise.
 * CLAUSES (reductions) may be empty. */
#define QD_PRAGMA(text) _Pragma(#text)
#define QD_PARALLEL_FOR(workers, items, CLAUSES, ...)                                     \
    do {                                                                                 \
        const int qd_workers_ = (workers);                                               \
        if (qd_workers_ > 1) {                                                           \
            const int64_t qd_run_ = qd_run_length((items), qd_workers_);                 \
            const qd_fp_mode qd_callers_mode_ = qd_fp_mode_get();                        \
            QD_PRAGMA(omp parallel num_threads(qd_get_num_threads()) CLAUSES)            \
            {                                                                            \
                const qd_fp_mode qd_own_mode_ = qd_fp_mode_get();                        \
                qd_fp_mode_set(qd_callers_mode_);                                        \
                QD_PRAGMA(omp for schedule(static, qd_run_))                             \
                __VA_ARGS__                                                              \
                qd_fp_mode_set(qd_own_mode_);                                            \
            }                                                                            \
        } else {                                                                         \
            __VA_ARGS__                                                                  \
        }                                                                                \
    } while (0)

/* Quantizes one row segment of n floats with the given range; returns the stored
 * float32 scale through *scale.  Input must be finite (checked by the caller). */
void qd_quantize_segment(const float *x, int64_t n, int lo, int hi, float scale, int8_t *q);
float qd_segment_scale(const float *x, int64_t n, int lo, int hi);
qd_status qd_value_range(int value_kind, int *lo, int *hi);

void *qd_aligned_alloc(size_t bytes);
void qd_aligned_free(void *p);

#endif
