/*
 * Scalar kernels: the reference every SIMD path is tested against bit for bit, and the path used
 * on CPUs without AVX2 and on every non-x86 machine (aarch64: Grace, Graviton). One element at a
 * time, in exactly the order of the vector code; fmaf() is a single instruction where the CPU has
 * FMA and a correctly rounded libm routine where it does not, so the results are the same either
 * way.
 *
 * Written so that GCC -O3 vectorises it where FMA is part of the base ISA (aarch64: 4-wide NEON,
 * checked by native/check-arch.sh): each dtype pair gets its own loop (the dtype tests leave the
 * loop), the job's fields are copied into locals (a store through p could otherwise alias *j and
 * force a reload every iteration), and p/m/v are restrict (the Python binding checks they are
 * disjoint). grad and out stay plain pointers: out may be the gradient buffer itself, which GCC
 * handles with a runtime overlap check. Vectorising changes no bits: each element still goes
 * through the same correctly rounded operations, and lanes never mix.
 */
#include <math.h>
#include "kernels.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float load_one(const void *x, int64_t i, int dt)
{
    if (dt == ZF_F32)
        return ((const float *)x)[i];
    if (dt == ZF_BF16)
        return zf_bf16_to_f32(((const uint16_t *)x)[i]);
    return zf_f16_to_f32(((const uint16_t *)x)[i]);
}

/* The gradient of element i: the job's g, or (sum) the interval's sum of its slots, one fma per
 * slot in step order on top of the carry or +0: zf_accumulate's rounding, in a register. */
INLINE float sum_of(const float *carry, const void *const *slots, const float *coefs, int ns, int64_t i, int gdt)
{
    float a = carry ? carry[i] : 0.0f;
    for (int s = 0; s < ns; s++)
        a = fmaf(load_one(slots[s], i, gdt), coefs[s], a);
    return a;
}

/* nrep is the literal 1 for the one-step call (the training default): the r loop then disappears
 * at compile time and GCC vectorises the element loop (aarch64: NEON, native/check-arch.sh); it
 * does not vectorise an outer loop around a variable-count inner one (nor the sum's slot loop:
 * the sum variant stays scalar there, which costs arithmetic only in a loop that waits on memory). */
INLINE void adam_loop(const zf_adam_job *j, int64_t off, int64_t n, int gdt, int odt, int nrep, int sum)
{
    float *restrict pp = j->p, *restrict mp = j->m, *restrict vp = j->v;
    const void *gp = j->g;
    uint16_t *op = j->out;
    const int l2 = j->l2, small = j->lerp_small;
    const float scale = j->scale, decay = j->decay, wd = j->wd, w = j->w, wm1 = j->wm1;
    const float beta2 = j->beta2, omb2 = j->omb2, eps = j->eps;
    const float *bc2s = j->bc2s, *nstep = j->nstep;
    const float *carry = j->carry, *coefs = j->coefs;
    const void *const *slots = j->slots;
    const int ns = j->nslots;
    for (int64_t i = off; i < off + n; i++) {
        const float g0 = (sum ? sum_of(carry, slots, coefs, ns, i, gdt) : load_one(gp, i, gdt)) * scale;
        float p = pp[i], m = mp[i], v = vp[i];
        /* nrep steps with the same gradient: exactly nrep one-step calls, without the reloads. */
        for (int r = 0; r < nrep; r++) {
            float g = g0;
            p = p * decay;
            if (l2)
                g = fmaf(wd, p, g);
            float d = g - m;
            m = small ? fmaf(w, d, m) : fmaf(wm1, d, g);
            v = fmaf(omb2 * g, g, v * beta2);
            float denom = sqrtf(v) / bc2s[r] + eps;
            p = p + (nstep[r] * m) / denom;
        }
        pp[i] = p;
        mp[i] = m;
        vp[i] = v;
        if (odt == ZF_BF16)
            op[i] = zf_f32_to_bf16(p);
        else if (odt == ZF_F16)
            op[i] = zf_f32_to_f16(p);
    }
}

static void adam_scalar(const zf_adam_job *j, int64_t off, int64_t n)
{
#define CASE(G, O) \
    case (G) * 4 + (O): \
        if (j->sum) \
            adam_loop(j, off, n, G, O, j->nrep, 1); \
        else if (j->nrep == 1) \
            adam_loop(j, off, n, G, O, 1, 0); \
        else \
            adam_loop(j, off, n, G, O, j->nrep, 0); \
        break;
    switch (j->gdt * 4 + j->odt) {
        CASE(ZF_F32, ZF_NONE) CASE(ZF_F32, ZF_BF16) CASE(ZF_F32, ZF_F16)
        CASE(ZF_BF16, ZF_NONE) CASE(ZF_BF16, ZF_BF16) CASE(ZF_BF16, ZF_F16)
        CASE(ZF_F16, ZF_NONE) CASE(ZF_F16, ZF_BF16) CASE(ZF_F16, ZF_F16)
    }
#undef CASE
}

INLINE void acc_loop(float *acc, const void *g, int gdt, float scale, int64_t off, int64_t n)
{
    for (int64_t i = off; i < off + n; i++)
        acc[i] = fmaf(load_one(g, i, gdt), scale, acc[i]);
}

static void acc_scalar(float *acc, const void *g, int gdt, float scale, int64_t off, int64_t n)
{
    if (gdt == ZF_F32)
        acc_loop(acc, g, ZF_F32, scale, off, n);
    else if (gdt == ZF_BF16)
        acc_loop(acc, g, ZF_BF16, scale, off, n);
    else
        acc_loop(acc, g, ZF_F16, scale, off, n);
}

INLINE void sq_loop(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    double a[ZF_BLOCK];
    memcpy(a, lanes, sizeof a);
    for (int64_t i = off; i < off + n; i += ZF_BLOCK)
        for (int k = 0; k < ZF_BLOCK; k++) {
            double e = load_one(x, i + k, xdt);
            a[k] += e * e;
        }
    memcpy(lanes, a, sizeof a);
}

static void sq_scalar(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    if (xdt == ZF_F32)
        sq_loop(x, ZF_F32, off, n, lanes);
    else if (xdt == ZF_BF16)
        sq_loop(x, ZF_BF16, off, n, lanes);
    else
        sq_loop(x, ZF_F16, off, n, lanes);
}

const zf_kernels zf_kernels_scalar = {ZF_ISA_SCALAR, adam_scalar, acc_scalar, sq_scalar};
