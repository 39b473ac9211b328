/*
 * Entry points: fold the per-call constants, split the elements of a run list over threads, and
 * hand full blocks to the kernels of the selected ISA.
 *
 * The run list's concatenated elements are cut into fixed tiles that threads claim (pool.c), never
 * one parallel region per run or per tensor: each region costs a wake-up and a join, which is
 * what collapses when there are hundreds of tensors (docs/design.md, section "Defaults and the
 * numbers behind them"). Elementwise results do not depend on who runs a tile (kernels.h), and
 * the norm's reduction order is tied to fixed partitions of the data, not to threads. Nothing is allocated: scratch lives on the stack.
 */
#include <math.h>
#include "kernels.h"

/* Elementwise calls are cut into tiles of this many elements that threads claim one by one:
 * 32K fp32 AdamW elements are ~0.9 MB of traffic, ~35 us on one core, against one atomic add per
 * claim; small enough that threads finish within a tile of each other. */
#define ZF_TILE (1 << 15)
/* Calls smaller than this run on the caller alone. Waking a sleeping thread costs 50-100 us on
 * this VM: 256K-element accumulates were slower with 2 threads (101 vs 67 us), 1M-element ones
 * faster (275 vs 381 us). */
#define ZF_PARALLEL_MIN (1 << 19)
/* sq_norm partitions (its tiles): at most ZF_MAX_PARTS, each at least ZF_MIN_PART elements. */
#define ZF_MAX_PARTS 256
#define ZF_MIN_PART (1 << 14)

static const zf_kernels *g_kernels; /* NULL until first use: best supported */

int zf_isa_supported(int isa)
{
    if (isa == ZF_ISA_SCALAR)
        return 1;
#ifdef ZF_HAVE_X86
    __builtin_cpu_init();
    if (isa == ZF_ISA_AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == ZF_ISA_AVX512)
        return __builtin_cpu_supports("avx512f");
#endif
    return 0;
}

int zf_set_isa(int isa)
{
    if (!zf_isa_supported(isa))
        return -1;
    const zf_kernels *k = &zf_kernels_scalar;
#ifdef ZF_HAVE_X86
    if (isa == ZF_ISA_AVX2)
        k = &zf_kernels_avx2;
    else if (isa == ZF_ISA_AVX512)
        k = &zf_kernels_avx512;
#endif
    __atomic_store_n(&g_kernels, k, __ATOMIC_RELEASE);
    return 0;
}

/* Zero-padded copy of the last k < 16 elements of a 32-bit or 16-bit buffer; a union so that
 * the kernel reads it through a pointer of the member's own type. */
typedef union {
    float f[ZF_BLOCK];
    uint16_t h[ZF_BLOCK];
} zf_block;

static const void *zf_block_ptr(const zf_block *b, int dt) { return dt == ZF_F32 ? (const void *)b->f : (const void *)b->h; }

static const zf_kernels *kernels(void)
{
    const zf_kernels *k = __atomic_load_n(&g_kernels, __ATOMIC_ACQUIRE);
    if (!k) {
        if (zf_set_isa(ZF_ISA_AVX512) && zf_set_isa(ZF_ISA_AVX2))
            zf_set_isa(ZF_ISA_SCALAR);
        k = __atomic_load_n(&g_kernels, __ATOMIC_ACQUIRE);
    }
    return k;
}

int zf_isa(void) { return kernels()->isa; }

int64_t zf_check_runs(const int64_t *runs, int64_t nruns, int64_t numel)
{
    int64_t end = 0;
    for (int64_t r = 0; r < nruns; r++) {
        int64_t off = runs[2 * r], len = runs[2 * r + 1];
        if (off < end || len < 0 || len > numel - off) /* written so that nothing overflows */
            return r;
        end = off + len;
    }
    return -1;
}

/* ---- walking a run list ---- */

/* A position in the run list that only moves forward: run r starts at concatenated index pos. */
typedef struct {
    const int64_t *runs;
    int64_t nruns, r, pos;
} cursor;

typedef void (*piece_fn)(void *ctx, int64_t off, int64_t n);

/* Calls fn on the buffer ranges holding concatenated elements [lo, hi). */
static void walk(cursor *c, int64_t lo, int64_t hi, piece_fn fn, void *ctx)
{
    while (c->r < c->nruns && c->pos + c->runs[2 * c->r + 1] <= lo) {
        c->pos += c->runs[2 * c->r + 1];
        c->r++;
    }
    for (int64_t r = c->r, pos = c->pos; r < c->nruns && pos < hi; pos += c->runs[2 * r + 1], r++) {
        int64_t len = c->runs[2 * r + 1];
        int64_t a = lo > pos ? lo - pos : 0, b = hi - pos < len ? hi - pos : len;
        if (a < b)
            fn(ctx, c->runs[2 * r] + a, b - a);
    }
}

static int64_t total_of(const int64_t *runs, int64_t nruns)
{
    int64_t t = 0;
    for (int64_t r = 0; r < nruns; r++)
        t += runs[2 * r + 1];
    return t;
}

/* The calling thread's limit (zf_set_thread_role): the accumulation thread and the CPU update each
 * use their share of the cores. Only timing depends on it; the bits do not (see the top). */
static int threads_for(int64_t total) { return total < ZF_PARALLEL_MIN ? 1 : zf_thread_limit(); }

/* The common shape of an elementwise call: the kernels, the runs, and a piece function. */
typedef struct {
    const zf_kernels *k;
    const int64_t *runs;
    int64_t nruns, total;
    piece_fn piece;
    void *job;
} ew_call;

static void ew_task(void *ctx, zf_tiles *tiles)
{
    ew_call *c = ctx;
    cursor cur = {c->runs, c->nruns, 0, 0};
    for (int64_t t; (t = zf_next_tile(tiles)) >= 0;) {
        int64_t lo = t * ZF_TILE, hi = lo + ZF_TILE < c->total ? lo + ZF_TILE : c->total;
        walk(&cur, lo, hi, c->piece, c);
    }
}

static void ew_run(ew_call *c, const int64_t *runs, int64_t nruns, int64_t numel)
{
    int64_t whole[2] = {0, numel};
    if (nruns < 0) {
        runs = whole;
        nruns = 1;
    }
    c->runs = runs;
    c->nruns = nruns;
    c->total = total_of(runs, nruns);
    if (c->total > 0)
        zf_parallel(ew_task, c, (c->total + ZF_TILE - 1) / ZF_TILE, threads_for(c->total));
}

/* ---- AdamW ---- */

static void adam_piece(void *ctx, int64_t off, int64_t n)
{
    const ew_call *c = ctx;
    const zf_adam_job *j = c->job;
    int64_t body = n & ~(int64_t)(ZF_BLOCK - 1), k = n - body;
    if (body)
        c->k->adam(j, off, body);
    if (!k)
        return;
    /* The last k < 16 elements go through the same kernel on zero-padded copies (zf_adamw_sum:
     * every slot's tail and the carry's too; the padded lanes compute on zeros, never stored). */
    off += body;
    int64_t gs = zf_dtype_size(j->gdt), os = zf_dtype_size(j->odt);
    float p[ZF_BLOCK] = {0}, m[ZF_BLOCK] = {0}, v[ZF_BLOCK] = {0}, carry[ZF_BLOCK] = {0};
    zf_block g = {{0}}, slot[ZF_MAX_SLOTS];
    const void *slots[ZF_MAX_SLOTS];
    uint16_t o[ZF_BLOCK];
    memcpy(p, j->p + off, k * 4);
    memcpy(m, j->m + off, k * 4);
    memcpy(v, j->v + off, k * 4);
    zf_adam_job t = *j;
    if (j->sum) {
        for (int s = 0; s < j->nslots; s++) {
            memset(&slot[s], 0, sizeof slot[s]);
            memcpy(&slot[s], (const char *)j->slots[s] + off * gs, k * gs);
            slots[s] = zf_block_ptr(&slot[s], j->gdt);
        }
        if (j->carry) {
            memcpy(carry, j->carry + off, k * 4);
            t.carry = carry;
        }
        t.slots = slots;
    } else {
        memcpy(&g, (const char *)j->g + off * gs, k * gs);
        t.g = zf_block_ptr(&g, j->gdt);
    }
    t.p = p, t.m = m, t.v = v, t.out = o;
    c->k->adam(&t, 0, ZF_BLOCK);
    memcpy(j->p + off, p, k * 4);
    memcpy(j->m + off, m, k * 4);
    memcpy(j->v + off, v, k * 4);
    if (os)
        memcpy((char *)j->out + off * os, o, k * os);
}

/* The AdamW job of both entry points: the constants folded once, then at most ZF_MAX_REPEAT steps
 * per pass (each element's arithmetic is the same either way; a sum is re-formed each pass, to the
 * same bits). */
static void adamw_run(zf_adam_job *j, const int64_t *runs, int64_t nruns, int64_t numel, int64_t step,
                      int64_t nsteps, double lr, double beta1, double beta2, double eps, double weight_decay,
                      double grad_scale, int adamw)
{
    /* Folded in double and rounded once, like torch's Python-side scalars. */
    double w = 1.0 - beta1;
    float bc2s[ZF_MAX_REPEAT], nstep[ZF_MAX_REPEAT];
    j->odt = j->out ? j->odt : ZF_NONE;
    j->l2 = !adamw && weight_decay != 0.0;
    j->lerp_small = fabs(w) < 0.5;
    j->scale = (float)grad_scale;
    j->decay = adamw ? (float)(1.0 - lr * weight_decay) : 1.0f;
    j->wd = (float)weight_decay;
    j->w = (float)w;
    j->wm1 = (float)w - 1.0f;
    j->beta2 = (float)beta2;
    j->omb2 = (float)(1.0 - beta2);
    j->eps = (float)eps;
    j->bc2s = bc2s;
    j->nstep = nstep;
    ew_call c = {.k = kernels(), .piece = adam_piece, .job = j};
    for (int64_t done = 0; done < nsteps; done += j->nrep) {
        j->nrep = (int)(nsteps - done < ZF_MAX_REPEAT ? nsteps - done : ZF_MAX_REPEAT);
        for (int r = 0; r < j->nrep; r++) {
            double t = (double)(step + done + r);
            bc2s[r] = (float)pow(1.0 - pow(beta2, t), 0.5); /* torch: bc2 ** 0.5 */
            nstep[r] = (float)(-(lr / (1.0 - pow(beta1, t))));
        }
        ew_run(&c, runs, nruns, numel);
    }
}

void zf_adamw_steps(float *param, const void *grad, int grad_dtype, float *exp_avg, float *exp_avg_sq,
                    void *out, int out_dtype, int64_t numel, const int64_t *runs, int64_t nruns,
                    int64_t step, int64_t nsteps, double lr, double beta1, double beta2, double eps,
                    double weight_decay, double grad_scale, int adamw)
{
    zf_adam_job j = {.p = param, .m = exp_avg, .v = exp_avg_sq, .g = grad, .out = out, .gdt = grad_dtype,
                     .odt = out_dtype};
    adamw_run(&j, runs, nruns, numel, step, nsteps, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw);
}

void zf_adamw_step(float *param, const void *grad, int grad_dtype, float *exp_avg, float *exp_avg_sq,
                   void *out, int out_dtype, int64_t numel, const int64_t *runs, int64_t nruns,
                   int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, double grad_scale, int adamw)
{
    zf_adamw_steps(param, grad, grad_dtype, exp_avg, exp_avg_sq, out, out_dtype, numel, runs, nruns, step, 1, lr,
                   beta1, beta2, eps, weight_decay, grad_scale, adamw);
}

void zf_adamw_sum(float *param, float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, int64_t numel,
                  const int64_t *runs, int64_t nruns, const float *carry, const void *const *slots, int slot_dtype,
                  const float *coefs, int nslots, int64_t step, int64_t nsteps, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double grad_scale, int adamw)
{
    zf_adam_job j = {.p = param, .m = exp_avg, .v = exp_avg_sq, .out = out, .gdt = slot_dtype, .odt = out_dtype,
                     .sum = 1, .nslots = nslots, .carry = carry, .slots = slots, .coefs = coefs};
    adamw_run(&j, runs, nruns, numel, step, nsteps, lr, beta1, beta2, eps, weight_decay, grad_scale, adamw);
}

/* ---- accumulate ---- */

typedef struct {
    float *acc;
    const void *g;
    int gdt;
    float scale;
    int overwrite;
} acc_job;

static void acc_piece(void *ctx, int64_t off, int64_t n)
{
    const ew_call *c = ctx;
    const acc_job *j = c->job;
    int64_t body = n & ~(int64_t)(ZF_BLOCK - 1), k = n - body, gs = zf_dtype_size(j->gdt);
    /* Overwrite: zero the piece first, so the kernel's fma adds to +0 (the same bits as adding into
     * a zeroed buffer). The piece is a tile that stays in L1, so the accumulator costs one write to
     * memory instead of a separate zeroing pass plus a read. */
    if (j->overwrite)
        memset(j->acc + off, 0, (size_t)n * sizeof(float));
    if (body)
        c->k->acc(j->acc, j->g, j->gdt, j->scale, off, body);
    if (!k)
        return;
    off += body;
    float a[ZF_BLOCK] = {0};
    zf_block g = {{0}};
    memcpy(a, j->acc + off, k * 4);
    memcpy(&g, (const char *)j->g + off * gs, k * gs);
    c->k->acc(a, zf_block_ptr(&g, j->gdt), j->gdt, j->scale, 0, ZF_BLOCK);
    memcpy(j->acc + off, a, k * 4);
}

void zf_accumulate(float *acc, const void *grad, int grad_dtype, float scale, int64_t numel,
                   const int64_t *runs, int64_t nruns, int overwrite)
{
    acc_job j = {acc, grad, grad_dtype, scale, overwrite};
    ew_call c = {.k = kernels(), .piece = acc_piece, .job = &j};
    ew_run(&c, runs, nruns, numel);
}

/* ---- squared norm ----
 * The concatenated elements are cut into P <= 256 partitions whose size depends only on the
 * total. Within a partition each piece (a run's part in it) is summed into 16 double lanes,
 * element k of the piece into lane k % 16; the lanes are folded in a fixed tree, and the P sums
 * are added in order. Threads take whole partitions, so the bits never depend on thread count. */

typedef struct {
    const zf_kernels *k;
    const void *x;
    int xdt;
    const int64_t *runs;
    int64_t nruns, total, part, nparts;
    double sums[ZF_MAX_PARTS];
} sq_call;

typedef struct {
    const sq_call *c;
    double lanes[ZF_BLOCK];
} sq_acc;

static void sq_piece(void *ctx, int64_t off, int64_t n)
{
    sq_acc *a = ctx;
    const sq_call *c = a->c;
    int64_t body = n & ~(int64_t)(ZF_BLOCK - 1), k = n - body, xs = zf_dtype_size(c->xdt);
    if (body)
        c->k->sq(c->x, c->xdt, off, body, a->lanes);
    if (k) { /* zero padding adds +0.0 to the unused lanes: no change */
        zf_block buf = {{0}};
        memcpy(&buf, (const char *)c->x + (off + body) * xs, k * xs);
        c->k->sq(zf_block_ptr(&buf, c->xdt), c->xdt, 0, ZF_BLOCK, a->lanes);
    }
}

/* Tiles are the partitions: whoever sums partition p writes sums[p]. */
static void sq_task(void *ctx, zf_tiles *tiles)
{
    sq_call *c = ctx;
    cursor cur = {c->runs, c->nruns, 0, 0};
    for (int64_t p; (p = zf_next_tile(tiles)) >= 0;) {
        sq_acc a = {.c = c, .lanes = {0}};
        int64_t lo = p * c->part, hi = lo + c->part < c->total ? lo + c->part : c->total;
        walk(&cur, lo, hi, sq_piece, &a);
        for (int w = ZF_BLOCK / 2; w >= 1; w /= 2)
            for (int i = 0; i < w; i++)
                a.lanes[i] += a.lanes[i + w];
        c->sums[p] = a.lanes[0];
    }
}

double zf_sq_norm(const void *x, int x_dtype, int64_t numel, const int64_t *runs, int64_t nruns)
{
    int64_t whole[2] = {0, numel};
    if (nruns < 0) {
        runs = whole;
        nruns = 1;
    }
    sq_call c = {.k = kernels(), .x = x, .xdt = x_dtype, .runs = runs, .nruns = nruns};
    c.total = total_of(runs, nruns);
    if (c.total == 0)
        return 0.0;
    int64_t part = (c.total + ZF_MAX_PARTS - 1) / ZF_MAX_PARTS;
    c.part = part < ZF_MIN_PART ? ZF_MIN_PART : (part + ZF_BLOCK - 1) & ~(int64_t)(ZF_BLOCK - 1);
    c.nparts = (c.total + c.part - 1) / c.part;
    zf_parallel(sq_task, &c, c.nparts, threads_for(c.total));
    double s = 0.0;
    for (int64_t p = 0; p < c.nparts; p++)
        s += c.sums[p];
    return s;
}
