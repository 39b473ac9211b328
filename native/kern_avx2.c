/*
 * AVX2 + F16C + FMA kernels, 8 floats per vector, for x86 CPUs without AVX-512. Same operations,
 * same order as kern_scalar.c, so the three paths agree bit for bit.
 */
#include "kernels.h"

#ifdef ZF_HAVE_X86
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* Address arithmetic in integers: the prefetch may point past the buffer, a pointer must not. */
INLINE void ahead(const void *base, int64_t i, int64_t esize)
{
    if (ZF_PREFETCH) /* a constant: 0 compiles the prefetches out */
        _mm_prefetch((const char *)((uintptr_t)base + (uintptr_t)((i + ZF_PREFETCH) * esize)), _MM_HINT_T0);
}

INLINE __m256 load8(const void *x, int64_t i, int dt)
{
    if (dt == ZF_F32)
        return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (dt == ZF_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

INLINE void store8(void *o, int64_t i, __m256 x, int dt)
{
    __m128i h;
    if (dt == ZF_BF16) { /* see zf_f32_to_bf16 */
        __m256i u = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        /* packus works within 128-bit lanes; the permute puts the two halves next to each other */
        h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
    } else {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)o + i), h);
}

/* The interval's sum of element block i (zf_adamw_sum): as kern_scalar.c ``sum_of``, one fma per
 * slot in step order on top of the carry or +0. */
INLINE __m256 sum8(const float *carry, const void *const *slots, const float *coefs, int ns, int64_t i, int gdt)
{
    __m256 a = carry ? _mm256_loadu_ps(carry + i) : _mm256_setzero_ps();
    for (int s = 0; s < ns; s++) {
        ahead(slots[s], i, zf_dtype_size(gdt));
        a = _mm256_fmadd_ps(load8(slots[s], i, gdt), _mm256_set1_ps(coefs[s]), a);
    }
    return a;
}

INLINE void adam_loop(const zf_adam_job *j, int64_t off, int64_t n, int gdt, int odt, int sum)
{
    const __m256 scale = _mm256_set1_ps(j->scale), decay = _mm256_set1_ps(j->decay);
    const __m256 wd = _mm256_set1_ps(j->wd), w = _mm256_set1_ps(j->w), wm1 = _mm256_set1_ps(j->wm1);
    const __m256 beta2 = _mm256_set1_ps(j->beta2), omb2 = _mm256_set1_ps(j->omb2);
    const __m256 eps = _mm256_set1_ps(j->eps);
    /* Locals, not j->...: the intrinsics' stores may alias anything, so fields read through j would
     * be reloaded on every iteration. */
    float *pp = j->p, *mp = j->m, *vp = j->v;
    const void *gp = j->g;
    void *op = j->out;
    const int l2 = j->l2, small = j->lerp_small, nrep = j->nrep;
    const float *bc2s = j->bc2s, *nstep = j->nstep;
    const float *carry = j->carry, *coefs = j->coefs;
    const void *const *slots = j->slots;
    const int ns = j->nslots;
    for (int64_t i = off; i < off + n; i += 8) {
        ahead(pp, i, 4);
        ahead(mp, i, 4);
        ahead(vp, i, 4);
        if (!sum)
            ahead(gp, i, zf_dtype_size(gdt));
        else if (carry)
            ahead(carry, i, 4);
        const __m256 gin = sum ? sum8(carry, slots, coefs, ns, i, gdt) : load8(gp, i, gdt);
        const __m256 g0 = _mm256_mul_ps(gin, scale);
        __m256 p = _mm256_loadu_ps(pp + i), m = _mm256_loadu_ps(mp + i), v = _mm256_loadu_ps(vp + i);
        for (int r = 0; r < nrep; r++) { /* as kern_scalar.c: nrep steps, one load and store */
            __m256 g = g0;
            p = _mm256_mul_ps(p, decay);
            if (l2)
                g = _mm256_fmadd_ps(wd, p, g);
            __m256 d = _mm256_sub_ps(g, m);
            m = small ? _mm256_fmadd_ps(w, d, m) : _mm256_fmadd_ps(wm1, d, g);
            v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(v, beta2));
            __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), _mm256_set1_ps(bc2s[r])), eps);
            p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(nstep[r]), m), denom));
        }
        _mm256_storeu_ps(pp + i, p);
        _mm256_storeu_ps(mp + i, m);
        _mm256_storeu_ps(vp + i, v);
        if (odt != ZF_NONE)
            store8(op, i, p, odt);
    }
}

static void adam_avx2(const zf_adam_job *j, int64_t off, int64_t n)
{
#define CASE(G, O) \
    case (G) * 4 + (O): \
        if (j->sum) \
            adam_loop(j, off, n, G, O, 1); \
        else \
            adam_loop(j, off, n, G, O, 0); \
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
    const __m256 s = _mm256_set1_ps(scale);
    for (int64_t i = off; i < off + n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(load8(g, i, gdt), s, _mm256_loadu_ps(acc + i)));
}

static void acc_avx2(float *acc, const void *g, int gdt, float scale, int64_t off, int64_t n)
{
    if (gdt == ZF_F32)
        acc_loop(acc, g, ZF_F32, scale, off, n);
    else if (gdt == ZF_BF16)
        acc_loop(acc, g, ZF_BF16, scale, off, n);
    else
        acc_loop(acc, g, ZF_F16, scale, off, n);
}

/* Four accumulators of four doubles hold lanes 0-3, 4-7, 8-11, 12-15 (as in the other paths). */
INLINE void sq_loop(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    __m256d a[4];
    for (int k = 0; k < 4; k++)
        a[k] = _mm256_loadu_pd(lanes + 4 * k);
    for (int64_t i = off; i < off + n; i += 16) {
        __m256 e0 = load8(x, i, xdt), e1 = load8(x, i + 8, xdt);
        __m256d q[4] = {_mm256_cvtps_pd(_mm256_castps256_ps128(e0)), _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)),
                        _mm256_cvtps_pd(_mm256_castps256_ps128(e1)), _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1))};
        for (int k = 0; k < 4; k++)
            a[k] = _mm256_add_pd(a[k], _mm256_mul_pd(q[k], q[k]));
    }
    for (int k = 0; k < 4; k++)
        _mm256_storeu_pd(lanes + 4 * k, a[k]);
}

static void sq_avx2(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    if (xdt == ZF_F32)
        sq_loop(x, ZF_F32, off, n, lanes);
    else if (xdt == ZF_BF16)
        sq_loop(x, ZF_BF16, off, n, lanes);
    else
        sq_loop(x, ZF_F16, off, n, lanes);
}

const zf_kernels zf_kernels_avx2 = {ZF_ISA_AVX2, adam_avx2, acc_avx2, sq_avx2};
#endif
