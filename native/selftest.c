/*
 * A Python-free test driver of the native kernels, for machines where the Python extension cannot
 * run: the aarch64 cross build runs it under qemu-user (native/check-arch.sh), and its output is
 * compared line by line with the x86 build's scalar path. Every line is "case digest", where the
 * digest is a 64-bit FNV-1a hash of the result bytes (or a double's bits), so two builds agree
 * only if every case is bit-identical. Lines starting with '#' are comments, not compared.
 *
 *     selftest [scalar|avx2|avx512]    exit 0: printed; 1: an internal check failed;
 *                                      77: this CPU or build lacks the path (a skip)
 *
 * Inputs come from splitmix64 and are converted to floats with integer arithmetic only, so they
 * are the same bits on every machine. The cases cover what the Python tests cover for the x86
 * paths: every grad/out dtype pair, AdamW and Adam-with-L2, both lerp formulas, the AdamW on an
 * interval's slots (zf_adamw_sum, also checked against accumulate + AdamW here), run lists with
 * odd offsets and lengths (tails through the padded path), every 16-bit pattern through the
 * conversions, and thread counts 1-4, unpinned and pinned, on buffers large enough to use the
 * pool (the driver checks those agree itself; cross-machine agreement is the script's job).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "zfnative.h"

static uint64_t g_rng;

static uint64_t next64(void)
{
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1) with 24 significant bits: an exact int-to-float conversion and a power-of-two
 * scale, so no rounding mode or libm is involved. */
static float uniform(void) { return (float)((int32_t)(next64() >> 40) - (1 << 23)) * 0x1p-23f; }

static uint64_t fnv(uint64_t h, const void *data, size_t n)
{
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001B3ull;
    return h;
}

#define FNV0 0xCBF29CE484222325ull

static void *xmalloc(size_t n)
{
    void *p = calloc(n ? n : 1, 1);
    if (!p) {
        fprintf(stderr, "selftest: out of memory\n");
        exit(1);
    }
    return p;
}

/* Gradients: fp32 straight from uniform(); bf16 the top half of such a float (truncated: any bf16
 * is a valid input); fp16 built as bits, so that no conversion under test produces its own input. */
static void fill_grad(void *g, int dt, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) {
        float x = uniform() * scale;
        if (dt == ZF_F32) {
            ((float *)g)[i] = x;
        } else if (dt == ZF_BF16) {
            uint32_t u;
            memcpy(&u, &x, 4);
            ((uint16_t *)g)[i] = (uint16_t)(u >> 16); /* truncation: any bf16 value is a valid input */
        } else { /* fp16: sign, exponent 0..15 (values below 2, denormals included), random mantissa */
            uint64_t r = next64();
            ((uint16_t *)g)[i] = (uint16_t)(((r >> 63) << 15) | (((r >> 40) % 16) << 10) | (r & 0x3FF));
        }
    }
}

static int64_t dsize(int dt) { return dt == ZF_F32 ? 4 : dt == ZF_NONE ? 0 : 2; }

static const char *dname(int dt) { return dt == ZF_F32 ? "f32" : dt == ZF_BF16 ? "bf16" : dt == ZF_F16 ? "f16" : "none"; }

typedef struct {
    int64_t n;
    float *p, *m, *v;
    void *g, *out;
} adam_bufs;

static adam_bufs adam_alloc(int64_t n, int gdt, int odt)
{
    adam_bufs b = {n, xmalloc(n * 4), xmalloc(n * 4), xmalloc(n * 4), xmalloc(n * dsize(gdt)), NULL};
    if (odt != ZF_NONE)
        b.out = xmalloc(n * dsize(odt));
    for (int64_t i = 0; i < n; i++)
        b.p[i] = uniform();
    return b;
}

static uint64_t adam_digest(const adam_bufs *b, int odt)
{
    uint64_t h = fnv(FNV0, b->p, b->n * 4);
    h = fnv(h, b->m, b->n * 4);
    h = fnv(h, b->v, b->n * 4);
    return b->out ? fnv(h, b->out, b->n * dsize(odt)) : h;
}

static void adam_free(adam_bufs *b)
{
    free(b->p), free(b->m), free(b->v), free(b->g), free(b->out);
}

/* Five steps with fresh gradients; odd steps use the run list, even ones the whole buffer. */
static uint64_t adam_case(int64_t n, int gdt, int odt, int adamw, double beta1, const int64_t *runs,
                          int64_t nruns, uint64_t seed)
{
    g_rng = seed;
    adam_bufs b = adam_alloc(n, gdt, odt);
    for (int step = 1; step <= 5; step++) {
        fill_grad(b.g, gdt, n, (float)(1 + step % 3));
        zf_adamw_step(b.p, b.g, gdt, b.m, b.v, b.out, odt, n, runs, step % 2 ? nruns : -1, step, 1e-3,
                      beta1, 0.999, 1e-8, 0.05, 0.5, adamw);
    }
    uint64_t h = adam_digest(&b, odt);
    adam_free(&b);
    return h;
}

static const int64_t RUNS[] = {0, 1, 3, 17, 40, 1000, 1041, 2, 2000, 2099}; /* 5 runs in 4099 */

static void adam_cases(void)
{
    const int dts[] = {ZF_F32, ZF_BF16, ZF_F16}, odts[] = {ZF_NONE, ZF_BF16, ZF_F16};
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int adamw = 0; adamw < 2; adamw++)
                for (int k = 0; k < 2; k++) { /* beta1 0.9: lerp's small-weight formula; 0.3: the other */
                    double beta1 = k ? 0.3 : 0.9;
                    uint64_t h = adam_case(4099, dts[a], odts[b], adamw, beta1, RUNS, 5, 1000 + a * 10 + b);
                    printf("adam/%s-%s/%s/beta1=%.1f %016llx\n", dname(dts[a]), dname(odts[b]),
                           adamw ? "adamw" : "l2", beta1, (unsigned long long)h);
                }
}

/* lr = 0 makes the step an identity on p, so `out` is the pure fp32 -> half rounding of random
 * bit patterns: every exponent (zeros, denormals, overflow, inf, NaN) and exact ties. */
static void narrowing_cases(void)
{
    const int64_t n = 1 << 16;
    for (int odt = ZF_BF16; odt <= ZF_F16; odt++) {
        g_rng = 77;
        adam_bufs b = adam_alloc(n, ZF_F32, odt);
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)next64();
            if (i % 97 == 7)
                u = 0x3F800000u | (uint32_t)(i % 128) << 16 | 0x8000u; /* a bf16 tie */
            memcpy(&b.p[i], &u, 4);
        }
        zf_adamw_step(b.p, b.g, ZF_F32, b.m, b.v, b.out, odt, n, NULL, -1, 1, 0.0, 0.9, 0.999, 1e-8, 0.0, 1.0, 1);
        printf("narrow/f32-%s %016llx\n", dname(odt), (unsigned long long)fnv(FNV0, b.out, n * 2));
        adam_free(&b);
    }
}

/* acc = 0 + 1*g for all 65536 patterns is the exact widening (written, overwrite=1, over a
 * non-zero buffer: its old contents must not matter); then scaled accumulation, the first call of
 * each series writing (an interval's first gradient) and the rest adding. */
static void accumulate_cases(void)
{
    const int64_t n = 1 << 16;
    uint16_t *all = xmalloc(n * 2);
    for (int64_t i = 0; i < n; i++)
        all[i] = (uint16_t)i;
    for (int dt = ZF_BF16; dt <= ZF_F16; dt++) {
        float *acc = xmalloc(n * 4);
        memset(acc, 0x7f, n * 4); /* garbage the overwrite must ignore */
        zf_accumulate(acc, all, dt, 1.0f, n, NULL, -1, 1);
        printf("widen/%s-f32 %016llx\n", dname(dt), (unsigned long long)fnv(FNV0, acc, n * 4));
        free(acc);
    }
    free(all);
    for (int dt = ZF_F32; dt <= ZF_F16; dt++) {
        g_rng = 200 + dt;
        int64_t m = 4099;
        float *acc = xmalloc(m * 4);
        void *g = xmalloc(m * dsize(dt));
        for (int64_t i = 0; i < m; i++)
            acc[i] = uniform();
        const float scales[] = {1.0f, 0.25f, -3.0f, 0.1f};
        for (int s = 0; s < 4; s++) {
            fill_grad(g, dt, m, 1.0f);
            zf_accumulate(acc, g, dt, scales[s], m, s % 2 ? RUNS : NULL, s % 2 ? 5 : -1, s == 0);
        }
        printf("accumulate/%s %016llx\n", dname(dt), (unsigned long long)fnv(FNV0, acc, m * 4));
        free(acc), free(g);
    }
}

/* zf_adamw_sum over 3 slots (with and without an fp32 carry, repeat 1 and 3, every slot dtype):
 * printed for the cross-machine comparison, and checked here against accumulating the slots into
 * an fp32 buffer and calling zf_adamw_steps on it, which it must equal bit for bit. */
static int sum_cases(void)
{
    const int64_t n = 4099;
    int bad = 0;
    for (int dt = ZF_F32; dt <= ZF_F16; dt++)
        for (int carried = 0; carried < 2; carried++)
            for (int rep = 1; rep <= 3; rep += 2) {
                g_rng = 500 + dt * 4 + carried * 2 + rep;
                const float coefs[3] = {0.37f, 0x1p-14f, 1.0f};
                void *slots[3];
                float *carry = xmalloc(n * 4), *acc = xmalloc(n * 4);
                for (int s = 0; s < 3; s++) {
                    slots[s] = xmalloc(n * dsize(dt));
                    fill_grad(slots[s], dt, n, (float)(1 + s));
                }
                for (int64_t i = 0; i < n; i++)
                    carry[i] = uniform();
                adam_bufs a = adam_alloc(n, ZF_F32, ZF_BF16), b = adam_alloc(n, ZF_F32, ZF_BF16);
                memcpy(b.p, a.p, n * 4);
                zf_adamw_sum(a.p, a.m, a.v, a.out, ZF_BF16, n, RUNS, 5, carried ? carry : NULL,
                             (const void *const *)slots, dt, coefs, 3, 4, rep, 1e-3, 0.9, 0.999, 1e-8, 0.05, 1.0 / 3, 1);
                memcpy(acc, carry, n * 4);
                for (int s = 0; s < 3; s++)
                    zf_accumulate(acc, slots[s], dt, coefs[s], n, RUNS, 5, !carried && s == 0);
                zf_adamw_steps(b.p, acc, ZF_F32, b.m, b.v, b.out, ZF_BF16, n, RUNS, 5, 4, rep, 1e-3, 0.9, 0.999, 1e-8,
                               0.05, 1.0 / 3, 1);
                uint64_t h = adam_digest(&a, ZF_BF16);
                if (h != adam_digest(&b, ZF_BF16)) {
                    fprintf(stderr, "selftest: adamw_sum/%s carry=%d repeat=%d differs from accumulate + adamw\n",
                            dname(dt), carried, rep);
                    bad = 1;
                }
                printf("adamw_sum/%s/carry=%d/repeat=%d %016llx\n", dname(dt), carried, rep, (unsigned long long)h);
                for (int s = 0; s < 3; s++)
                    free(slots[s]);
                free(carry), free(acc);
                adam_free(&a), adam_free(&b);
            }
    return bad;
}

static void sq_norm_cases(void)
{
    for (int dt = ZF_F32; dt <= ZF_F16; dt++) {
        g_rng = 300 + dt;
        int64_t n = 70001;
        void *x = xmalloc(n * dsize(dt));
        fill_grad(x, dt, n, 1000.0f);
        const int64_t runs[] = {1, 2, 7, 33000, 40000, 30001};
        double whole = zf_sq_norm(x, dt, n, NULL, -1), part = zf_sq_norm(x, dt, n, runs, 3);
        uint64_t h = fnv(fnv(FNV0, &whole, 8), &part, 8);
        printf("sq_norm/%s %016llx\n", dname(dt), (unsigned long long)h);
        free(x);
    }
}

/* 1M + 5 elements (the pool is used from 512K), run boundaries inside tiles: the result of every
 * thread count, unpinned and with the pool pinned to CPU 0 (native/pool.c; where CPU 0 is not
 * allowed the pinning fails and the threads run where they were), must equal the single-threaded
 * one. Returns 0 when they all agree. */
static int thread_cases(void)
{
    const int64_t n = (1 << 20) + 5;
    const int64_t runs[] = {5, 500001, 500010, 3, 500020, 548553};
    const int cpu0[] = {0};
    int bad = 0;
    uint64_t first = 0;
    double first_norm = 0;
    for (int k = 1; k <= 7; k++) {
        int nt = k <= 4 ? k : k - 3; /* 1 2 3 4, then 2 3 4 pinned */
        zf_set_pool_cpus(0, cpu0, k <= 4 ? 0 : 1);
        zf_set_num_threads(nt);
        uint64_t h = adam_case(n, ZF_F16, ZF_BF16, 1, 0.9, runs, 3, 400);
        g_rng = 401;
        float *x = xmalloc(n * 4);
        for (int64_t i = 0; i < n; i++)
            x[i] = uniform() * 1e3f;
        double norm = zf_sq_norm(x, ZF_F32, n, runs, 3);
        free(x);
        if (nt == 1) {
            first = h, first_norm = norm;
            uint64_t d = fnv(fnv(FNV0, &h, 8), &norm, 8);
            printf("threads/adam+sq_norm-1M %016llx\n", (unsigned long long)d);
        } else if (h != first || memcmp(&norm, &first_norm, 8) != 0) {
            fprintf(stderr, "selftest: %d threads%s gave different bits than 1 thread\n", nt, k > 4 ? " (pinned)" : "");
            bad = 1;
        }
    }
    zf_set_pool_cpus(0, cpu0, 0);
    printf("# pool joins over the thread cases: %lld\n", (long long)zf_pool_joins());
    return bad;
}

int main(int argc, char **argv)
{
    const char *names[] = {"scalar", "avx2", "avx512"};
    int isa = -1;
    if (argc == 2)
        for (int i = 0; i < 3; i++)
            if (!strcmp(argv[1], names[i]))
                isa = i;
    if (argc != 2 || isa < 0) {
        fprintf(stderr, "usage: %s scalar|avx2|avx512\n", argv[0]);
        return 2;
    }
    if (zf_set_isa(isa) != 0) {
        printf("# %s: not supported by this CPU or build\n", names[isa]);
        return 77;
    }
    printf("# zfnative selftest, path %s, %d threads by default\n", names[isa], zf_get_num_threads());
    adam_cases();
    narrowing_cases();
    accumulate_cases();
    int bad = sum_cases();
    sq_norm_cases();
    return thread_cases() | bad;
}
