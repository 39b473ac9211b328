/*
 * zfnative: the CPU side of ZenFlow's optimizer offload. Fused AdamW, gradient accumulation and a
 * deterministic squared norm over flat buffers.
 *
 * Every call works on the elements named by a run list: `runs` holds `nruns` (offset, length)
 * pairs of int64, sorted and non-overlapping, within [0, numel). This is how the CPU skips the
 * columns the GPU owns (a host buffer of a 2-D weight is column-major, so a column is one run).
 * `nruns < 0` means the whole buffer (runs is not read); `nruns == 0` means no element. The entry points trust their arguments: the Python
 * binding (zfctl/_native.py) checks dtypes, lengths and zf_check_runs() before calling.
 *
 * The block between the CDEF markers is read by native/build.py as the cffi declaration, so it
 * must stay plain C declarations (no macros, no includes).
 */
#ifndef ZFNATIVE_H
#define ZFNATIVE_H

#include <stdint.h>

/* CDEF-BEGIN */
/* Element types of the grad / out / x buffers. */
enum { ZF_F32 = 0, ZF_BF16 = 1, ZF_F16 = 2, ZF_NONE = 3 };

/* Code paths. */
enum { ZF_ISA_SCALAR = 0, ZF_ISA_AVX2 = 1, ZF_ISA_AVX512 = 2 };

/* One AdamW (adamw=1) or Adam-with-L2 (adamw=0) step, torch.optim's formula order:
 *   g  = grad * grad_scale                     (grad fp32, bf16 or fp16)
 *   p *= 1 - lr*wd           (adamw=1)     |    g += wd*p     (adamw=0)
 *   m  = lerp(m, g, 1-beta1);  v = beta2*v + (1-beta2)*g*g
 *   p += -lr/(1-beta1^step) * m / (sqrt(v)/sqrt(1-beta2^step) + eps)
 * If out_dtype is ZF_BF16 or ZF_F16, out[i] receives the new p[i] rounded to nearest even. */
void zf_adamw_step(float *param, const void *grad, int grad_dtype, float *exp_avg, float *exp_avg_sq,
                   void *out, int out_dtype, int64_t numel, const int64_t *runs, int64_t nruns,
                   int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, double grad_scale, int adamw);

/* nsteps >= 1 of the step above with the same gradient, steps step .. step+nsteps-1: the same bits as
 * nsteps calls of zf_adamw_step, with one pass over memory (ZenFlow's deferred columns: n AdamW
 * steps with an interval's mean gradient). */
void zf_adamw_steps(float *param, const void *grad, int grad_dtype, float *exp_avg, float *exp_avg_sq,
                    void *out, int out_dtype, int64_t numel, const int64_t *runs, int64_t nruns,
                    int64_t step, int64_t nsteps, double lr, double beta1, double beta2, double eps,
                    double weight_decay, double grad_scale, int adamw);

/* zf_adamw_steps on an interval's gradient sum, formed in the same pass from the interval's
 * per-step slots (ZenFlow's host path: each step's gradient columns land in their own slot and
 * nothing runs on the host per step). Per element, in registers:
 *   a = carry ? carry[i] : 0;  a = fma(slots[s][i], coefs[s], a) for s = 0 .. nslots-1, in order
 *   grad = a, then the AdamW steps above (grad_scale included)
 * which is zf_accumulate's rounding once per slot: the bits of accumulating the steps into an fp32
 * buffer (the first with overwrite, or starting from carry) and calling zf_adamw_steps on it.
 * slots: nslots (0..64) buffers of numel elements of slot_dtype; carry: fp32 or NULL (a partial
 * sum: a resumed interval's, or the device path's whole sum with nslots 0); at least one of them. */
void zf_adamw_sum(float *param, float *exp_avg, float *exp_avg_sq, void *out, int out_dtype, int64_t numel,
                  const int64_t *runs, int64_t nruns, const float *carry, const void *const *slots, int slot_dtype,
                  const float *coefs, int nslots, int64_t step, int64_t nsteps, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double grad_scale, int adamw);

/* acc[i] += scale * grad[i]; acc fp32, grad fp32/bf16/fp16. overwrite != 0: acc[i] = 0 + scale * grad[i]
 * (the first gradient of an interval: acc is not read from memory, its old contents do not matter). */
void zf_accumulate(float *acc, const void *grad, int grad_dtype, float scale, int64_t numel,
                   const int64_t *runs, int64_t nruns, int overwrite);

/* Sum of x[i]^2 in double; the reduction order depends only on the run list, never on threads. */
double zf_sq_norm(const void *x, int x_dtype, int64_t numel, const int64_t *runs, int64_t nruns);

/* -1 when the run list is valid for a buffer of numel elements, else the index of the first bad run
 * (negative offset or length, overlapping or unsorted, or past the end). */
int64_t zf_check_runs(const int64_t *runs, int64_t nruns, int64_t numel);

void zf_set_num_threads(int n);
int zf_get_num_threads(void);
/* The calling thread's share: its calls run on pool pool_index (0 default, 1 a second pool) with
 * at most max_threads participants (0: zf_get_num_threads()). Per thread, so the gradient
 * accumulation thread and the CPU update thread do not take each other's cores. 0 on success,
 * -1 for a bad argument. */
int zf_set_thread_role(int pool_index, int max_threads);
/* Participants the calling thread's calls may use: min(its cap, zf_get_num_threads()). */
int zf_thread_limit(void);
int zf_thread_pool(void);
/* How many times a pool thread joined a call since the library loaded (diagnostics, tests). */
int64_t zf_pool_joins(void);
/* Pin pool pool_index: its worker k runs on cpus[k % ncpus] only, a caller takes its tiles on
 * cpus[0] and gets its own CPUs back after the call (native/pool.c). ncpus 0: unpinned (workers go
 * back to the CPUs the process had when the library loaded). Workers apply it at their next
 * wake-up. 0 on success, -1 for a bad argument. */
int zf_set_pool_cpus(int pool_index, const int *cpus, int ncpus);
/* The pool's CPU list (at most cap into out); returns its length (0: unpinned), -1: bad pool. */
int zf_pool_cpus(int pool_index, int *out, int cap);
/* The CPU each started worker of the pool pinned itself to (-1: not pinned), at most cap into out;
 * returns the number of workers started, -1: bad pool (diagnostics, tests). */
int zf_pool_worker_cpus(int pool_index, int *out, int cap);
/* Prefer NUMA node `node` for the pages of [addr, addr + nbytes) (widened to whole pages) and move
 * those already touched: mbind(2), MPOL_PREFERRED | MPOL_MF_MOVE. 0 on success, else -errno. */
int zf_bind_node(void *addr, int64_t nbytes, int node);
int zf_isa(void);
int zf_isa_supported(int isa);
/* 0 on success, -1 when this CPU (or this build) lacks the path. */
int zf_set_isa(int isa);
/* CDEF-END */

#endif
