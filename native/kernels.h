/*
 * Internal interface between the dispatcher (api.c) and the per-ISA kernels (kern_*.c).
 *
 * A kernel only ever sees a count that is a multiple of ZF_BLOCK; the dispatcher runs the
 * remainder of a piece through the same kernel on zero-padded stack copies. So every element goes
 * through the same instruction sequence wherever a run or a thread's tile starts, which is what
 * makes results independent of thread count and run boundaries. All three paths use the same
 * operations in the same order (fused multiply-adds exactly where torch's vectorised CPU kernels
 * use them), and IEEE add/mul/div/sqrt/fma are correctly rounded, so the paths agree bit for bit.
 */
#ifndef ZF_KERNELS_H
#define ZF_KERNELS_H

#include <stdint.h>
#include <string.h>
#include "zfnative.h"

#define ZF_BLOCK 16

/* Software prefetch distance of the SIMD AdamW loops, in elements (1 KiB ahead on fp32 streams).
 * One core cannot keep enough cache misses in flight for 7 streams on its own: on this machine
 * (Xeon, 100M params, 1 thread) prefetching 128-1024 elements ahead took the step from ~158 ms
 * to ~143 ms; 2048 gained nothing. Prefetches never fault, so running past the end is harmless. */
#ifndef ZF_PREFETCH /* CFLAGS=-DZF_PREFETCH=0 native/build.py: without, to measure a machine (docs/design.md) */
#define ZF_PREFETCH 256
#endif

/* Per-call constants, folded in double and rounded to float once, as torch does with its Python
 * scalars. */
typedef struct {
    float *p, *m, *v;
    const void *g;
    void *out;
    int gdt, odt;
    int l2;            /* Adam-with-L2: g += wd*p */
    int lerp_small;    /* torch's lerp picks its formula on |weight| < 0.5 */
    float scale;       /* gradient multiplier (the interval mean's 1/n, a loss-scale unscale, clipping) */
    float decay;       /* 1 - lr*wd for AdamW, 1 otherwise (p*1 is exact) */
    float wd;          /* L2 coefficient */
    float w, wm1;      /* lerp weight 1-beta1, and weight-1 */
    float beta2, omb2; /* beta2 and 1-beta2 */
    float eps;
    /* The job is nrep >= 1 AdamW steps with the same gradient (zf_adamw_steps): element by element,
     * step r uses bc2s[r] = sqrt(1 - beta2^(step+r)) and nstep[r] = -lr / (1 - beta1^(step+r)). The
     * element stays in registers for all nrep steps, so the memory traffic is one step's. */
    int nrep;
    const float *bc2s, *nstep;
    /* zf_adamw_sum: the gradient is an interval's sum, built in registers from nslots per-step
     * slots (dtype gdt; g is not read) and an optional fp32 carry, element by element:
     *     a = carry ? carry[i] : +0;  a = fma(slots[s][i], coefs[s], a) for s = 0 .. nslots-1
     * which is zf_accumulate's rounding, once per step in step order (its overwrite is the fma
     * into +0), so the sum has the bits of accumulating the steps first. Then g0 = a * scale. */
    int sum;
    int nslots;
    const float *carry;
    const void *const *slots;
    const float *coefs;
} zf_adam_job;

/* Most slots one zf_adamw_sum call reads (the dispatcher copies a piece's tail of each onto its
 * stack): an interval of up to this many steps. */
#define ZF_MAX_SLOTS 64

/* Most steps one zf_adam_job holds (its per-step constants live on the dispatcher's stack); api.c
 * cuts longer repeats into jobs of at most this many, which gives the same bits. */
#define ZF_MAX_REPEAT 64

typedef struct {
    int isa; /* ZF_ISA_* */
    /* elements [off, off+n) of the job's buffers, n % ZF_BLOCK == 0 */
    void (*adam)(const zf_adam_job *j, int64_t off, int64_t n);
    void (*acc)(float *acc, const void *g, int gdt, float scale, int64_t off, int64_t n);
    /* lanes[k] += x[off+i]^2 for i % ZF_BLOCK == k, in double (the square of a float is exact) */
    void (*sq)(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK]);
} zf_kernels;

extern const zf_kernels zf_kernels_scalar;
#if defined(__x86_64__) || defined(__i386__)
#define ZF_HAVE_X86 1
extern const zf_kernels zf_kernels_avx2;
extern const zf_kernels zf_kernels_avx512;
#endif

/* Thread pool (pool.c). A task is cut into ntiles tiles; each of up to nt participants (the
 * caller is one) runs fn(ctx, tiles) once, and fn claims tiles with zf_next_tile until none is
 * left. One participant claims increasing indices, so fn may keep a forward-only cursor. */
typedef struct {
    int64_t *next;
    int64_t ntiles;
} zf_tiles;
typedef void (*zf_task_fn)(void *ctx, zf_tiles *tiles);
void zf_parallel(zf_task_fn fn, void *ctx, int64_t ntiles, int nt);

static inline int64_t zf_next_tile(zf_tiles *t)
{
    int64_t i = __atomic_fetch_add(t->next, 1, __ATOMIC_RELAXED);
    return i < t->ntiles ? i : -1;
}

static inline int64_t zf_dtype_size(int dt) { return dt == ZF_F32 ? 4 : dt == ZF_NONE ? 0 : 2; }

/* ---- scalar conversions, the reference the SIMD paths are tested against ---- */

static inline float zf_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t zf_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bf16 is the top half of a float: widening is a shift. */
static inline float zf_bf16_to_f32(uint16_t h) { return zf_bits_f32((uint32_t)h << 16); }

/* Round to nearest even by adding 0x7FFF plus the lowest kept bit, then truncating; the carry
 * walks into the exponent correctly (up to inf). NaN must not round into inf: it becomes the
 * canonical quiet NaN 0x7FC0, as torch's scalar conversion does. Denormals are kept (the
 * VCVTNEPS2BF16 instruction would flush them, which is why the SIMD paths use integer ops too). */
static inline uint16_t zf_f32_to_bf16(float f)
{
    uint32_t u = zf_f32_bits(f);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

/* The fp16 conversions compute every case and select at the end, with no early return: branch-free
 * code is what lets GCC vectorise the scalar kernels (kern_scalar.c) on machines with no SIMD path
 * of their own. The extra arithmetic is free in loops that wait on memory. */
static inline float zf_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t special = sign | 0x7F800000u | (man << 13);       /* inf / NaN, payload kept */
    uint32_t normal = sign | ((exp + 112u) << 23) | (man << 13); /* rebias the exponent 15 -> 127 */
    uint32_t small = sign | zf_f32_bits((float)man * 0x1p-24f); /* zero or subnormal: exact in float */
    return zf_bits_f32(exp == 0x1F ? special : exp ? normal : small);
}

/* Same results as F16C's VCVTPS2PH with round-to-nearest-even, NaN payloads included. */
static inline uint16_t zf_f32_to_f16(float f)
{
    uint32_t u = zf_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    /* NaN: quiet it, keep sign and the top payload bits */
    uint32_t nan = sign | 0x7E00u | ((a >> 13) & 0x1FFu);
    /* >= 65520 (max half + half an ulp) rounds to inf; inf stays inf */
    uint32_t inf = sign | 0x7C00u;
    /* normal half (>= 2^-14): RNE at bit 13, rebias 127 -> 15 */
    uint32_t normal = sign | ((a + 0xFFFu + ((a >> 13) & 1u) - 0x38000000u) >> 13);
    /* Subnormal half or zero: adding 0.5 leaves a float whose ulp is 2^-24, so the FPU's own
     * round-to-nearest-even produces the half's mantissa in the low bits. */
    uint32_t small = sign | (zf_f32_bits(zf_bits_f32(a) + 0.5f) - 0x3F000000u);
    return (uint16_t)(a > 0x7F800000u ? nan : a >= 0x477FF000u ? inf : a >= 0x38800000u ? normal : small);
}

#endif
