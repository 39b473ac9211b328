/*
 * Scalar kernels: the reference every SIMD path is tested against bit for bit, and the path used
 * on CPUs without AVX2 (and on non-x86 machines). One element at a time, in exactly the order of
 * the vector code; fmaf() is a single instruction where the CPU has FMA and a correctly rounded
 * libm routine where it does not, so the results are the same either way.
 */
#include <math.h>
#include "kernels.h"

static inline float load_one(const void *x, int64_t i, int dt)
{
    if (dt == ZF_F32)
        return ((const float *)x)[i];
    if (dt == ZF_BF16)
        return zf_bf16_to_f32(((const uint16_t *)x)[i]);
    return zf_f16_to_f32(((const uint16_t *)x)[i]);
}

static void adam_scalar(const zf_adam_job *j, int64_t off, int64_t n)
{
    for (int64_t i = off; i < off + n; i++) {
        float g = load_one(j->g, i, j->gdt) * j->scale;
        float p = j->p[i] * j->decay;
        if (j->l2)
            g = fmaf(j->wd, p, g);
        float d = g - j->m[i];
        float m = j->lerp_small ? fmaf(j->w, d, j->m[i]) : fmaf(j->wm1, d, g);
        float v = fmaf(j->omb2 * g, g, j->v[i] * j->beta2);
        float denom = sqrtf(v) / j->bc2s + j->eps;
        p = p + (j->nstep * m) / denom;
        j->p[i] = p;
        j->m[i] = m;
        j->v[i] = v;
        if (j->odt == ZF_BF16)
            ((uint16_t *)j->out)[i] = zf_f32_to_bf16(p);
        else if (j->odt == ZF_F16)
            ((uint16_t *)j->out)[i] = zf_f32_to_f16(p);
    }
}

static void acc_scalar(float *acc, const void *g, int gdt, float scale, int64_t off, int64_t n)
{
    for (int64_t i = off; i < off + n; i++)
        acc[i] = fmaf(load_one(g, i, gdt), scale, acc[i]);
}

static void sq_scalar(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    for (int64_t i = off; i < off + n; i += ZF_BLOCK)
        for (int k = 0; k < ZF_BLOCK; k++) {
            double e = load_one(x, i + k, xdt);
            lanes[k] += e * e;
        }
}

const zf_kernels zf_kernels_scalar = {ZF_ISA_SCALAR, adam_scalar, acc_scalar, sq_scalar};
