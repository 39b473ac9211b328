/*
 * AVX-512F kernels, 16 floats per vector. Compiled for this target with a pragma and only called
 * when __builtin_cpu_supports("avx512f") said yes (api.c). Same operations, same order as
 * kern_scalar.c.
 *
 * bf16 is converted with integer ops rather than AVX512-BF16's VCVTNEPS2BF16: that instruction
 * flushes denormals to zero, so it would disagree with torch and with the scalar path, and the
 * four extra integer ops are free in a loop that waits on memory anyway.
 */
#include "kernels.h"

#ifdef ZF_HAVE_X86
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* Address arithmetic in integers: the prefetch may point past the buffer, a pointer must not. */
INLINE void ahead(const void *base, int64_t i, int64_t esize)
{
    if (ZF_PREFETCH) /* a constant: 0 compiles the prefetches out */
        _mm_prefetch((const char *)((uintptr_t)base + (uintptr_t)((i + ZF_PREFETCH) * esize)), _MM_HINT_T0);
}

INLINE __m512 load16(const void *x, int64_t i, int dt)
{
    if (dt == ZF_F32)
        return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (dt == ZF_BF16) /* widen u16 -> u32 and shift into the top half */
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

INLINE void store16(void *o, int64_t i, __m512 x, int dt)
{
    __m256i h;
    if (dt == ZF_BF16) { /* see zf_f32_to_bf16 */
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
        h = _mm512_cvtepi32_epi16(r);
    } else {
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256((__m256i *)((uint16_t *)o + i), h);
}

/* The interval's sum of element block i (zf_adamw_sum): as kern_scalar.c ``sum_of``, one fma per
 * slot in step order on top of the carry or +0. */
INLINE __m512 sum16(const float *carry, const void *const *slots, const float *coefs, int ns, int64_t i, int gdt)
{
    __m512 a = carry ? _mm512_loadu_ps(carry + i) : _mm512_setzero_ps();
    for (int s = 0; s < ns; s++) {
        ahead(slots[s], i, zf_dtype_size(gdt));
        a = _mm512_fmadd_ps(load16(slots[s], i, gdt), _mm512_set1_ps(coefs[s]), a);
    }
    return a;
}

/* gdt/odt are constants at every call site below, so each combination compiles to its own loop. */
INLINE void adam_loop(const zf_adam_job *j, int64_t off, int64_t n, int gdt, int odt, int sum)
{
    const __m512 scale = _mm512_set1_ps(j->scale), decay = _mm512_set1_ps(j->decay);
    const __m512 wd = _mm512_set1_ps(j->wd), w = _mm512_set1_ps(j->w), wm1 = _mm512_set1_ps(j->wm1);
    const __m512 beta2 = _mm512_set1_ps(j->beta2), omb2 = _mm512_set1_ps(j->omb2);
    const __m512 eps = _mm512_set1_ps(j->eps);
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
    for (int64_t i = off; i < off + n; i += 16) {
        ahead(pp, i, 4);
        ahead(mp, i, 4);
        ahead(vp, i, 4);
        if (!sum)
            ahead(gp, i, zf_dtype_size(gdt));
        else if (carry)
            ahead(carry, i, 4);
        const __m512 gin = sum ? sum16(carry, slots, coefs, ns, i, gdt) : load16(gp, i, gdt);
        const __m512 g0 = _mm512_mul_ps(gin, scale);
        __m512 p = _mm512_loadu_ps(pp + i), m = _mm512_loadu_ps(mp + i), v = _mm512_loadu_ps(vp + i);
        for (int r = 0; r < nrep; r++) { /* as kern_scalar.c: nrep steps, one load and store */
            __m512 g = g0;
            p = _mm512_mul_ps(p, decay);
            if (l2)
                g = _mm512_fmadd_ps(wd, p, g);
            __m512 d = _mm512_sub_ps(g, m);
            m = small ? _mm512_fmadd_ps(w, d, m) : _mm512_fmadd_ps(wm1, d, g);
            v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g, _mm512_mul_ps(v, beta2));
            __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(bc2s[r])), eps);
            p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(nstep[r]), m), denom));
        }
        _mm512_storeu_ps(pp + i, p);
        _mm512_storeu_ps(mp + i, m);
        _mm512_storeu_ps(vp + i, v);
        if (odt != ZF_NONE)
            store16(op, i, p, odt);
    }
}

static void adam_avx512(const zf_adam_job *j, int64_t off, int64_t n)
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
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = off; i < off + n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(load16(g, i, gdt), s, _mm512_loadu_ps(acc + i)));
}

static void acc_avx512(float *acc, const void *g, int gdt, float scale, int64_t off, int64_t n)
{
    if (gdt == ZF_F32)
        acc_loop(acc, g, ZF_F32, scale, off, n);
    else if (gdt == ZF_BF16)
        acc_loop(acc, g, ZF_BF16, scale, off, n);
    else
        acc_loop(acc, g, ZF_F16, scale, off, n);
}

/* lanes 0-7 live in a0, lanes 8-15 in a1; element off+16*r+k always lands in lane k. */
INLINE void sq_loop(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    __m512d a0 = _mm512_loadu_pd(lanes), a1 = _mm512_loadu_pd(lanes + 8);
    for (int64_t i = off; i < off + n; i += 16) {
        __m512 e = load16(x, i, xdt);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
        __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
        a0 = _mm512_add_pd(a0, _mm512_mul_pd(lo, lo));
        a1 = _mm512_add_pd(a1, _mm512_mul_pd(hi, hi));
    }
    _mm512_storeu_pd(lanes, a0);
    _mm512_storeu_pd(lanes + 8, a1);
}

static void sq_avx512(const void *x, int xdt, int64_t off, int64_t n, double lanes[ZF_BLOCK])
{
    if (xdt == ZF_F32)
        sq_loop(x, ZF_F32, off, n, lanes);
    else if (xdt == ZF_BF16)
        sq_loop(x, ZF_BF16, off, n, lanes);
    else
        sq_loop(x, ZF_F16, off, n, lanes);
}

const zf_kernels zf_kernels_avx512 = {ZF_ISA_AVX512, adam_avx512, acc_avx512, sq_avx512};
#endif
