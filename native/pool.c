/*
 * A small pthread pool that sleeps instead of spinning.
 *
 * Why not OpenMP: torch loads its own libgomp before we are imported, so OMP_WAIT_POLICY is read
 * before we could set it, and libgomp's default is to spin after every parallel region. Measured
 * on this 2-core machine (30M params, 2 threads, 400 calls per step, torch imported first, load
 * average 7-9 from other jobs): the same kernels under OpenMP took 2.9-3.2 s per step with the
 * default policy and 84-186 ms with OMP_WAIT_POLICY=PASSIVE set before python started; this
 * pool took 57-186 ms with no setting at all (a scratch experiment; the setting zfctl applies is in
 * docs/design.md, section "Threads and buffer ownership").
 * And two Python threads calling in at once (the CPU worker's AdamW and the main thread's
 * gradient accumulation) would each start a full OpenMP team and oversubscribe the cores.
 * (torch's own intra-op threads still spin after torch CPU ops; only the process can stop that,
 * by setting OMP_WAIT_POLICY=PASSIVE before torch is imported.)
 *
 * Here workers block on a condition variable (a futex: no CPU while idle; waking one took
 * 50-100 us on this VM, which is why api.c keeps calls under 512K elements on the caller). A call's work is cut into tiles that participants claim from an atomic counter, the
 * caller included, and the caller waits only for workers that actually joined: if the OS does
 * not run a worker (a busy machine), the caller simply takes its tiles, instead of a static split
 * stalling on the missing thread. Only one call uses a pool at a time: a second concurrent
 * caller of the same pool does not wait for it but runs its own tiles on its own thread. There
 * are two pools (below), so the accumulation thread and the CPU update each get their share. Kernels produce the same
 * bits whichever thread runs a tile, so all of this changes timing only. Cost per call: one
 * broadcast, one join, one atomic add per tile.
 *
 * Pinning (zf_set_pool_cpus; zfctl/offload/cpu/cores.py decides the CPUs). A pinned pool's worker k
 * runs only on cpus[k % n], and its caller runs its share of the tiles on cpus[0], moved there for
 * the call and back after: the caller may be the training thread (the step() path's accumulate),
 * which must neither stay on a pool core nor run pool work on its own reserved core. The move
 * costs two sched_setaffinity calls per parallel call: 5-6 us at best, 32-37 us on average on
 * this 2-core VM under a load of ~10, against calls of >= 512K elements (>= ~0.3 ms). So the
 * cores zfctl reserves for the training thread never run pool work, and the two pools never share
 * a core. A worker applies a new CPU list itself, at its next wake-up (no thread handles kept).
 */
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT, pthread_setaffinity_np */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "kernels.h"

#define ZF_MAX_THREADS 256

/* Two pools: 0 serves every caller by default (the CPU update's AdamW, tests), 1 serves a thread
 * that chose it with zf_set_thread_role (the gradient accumulation thread, stream.py). With one
 * pool, whichever of the two callers came second ran on its own thread alone; with two, each
 * gets the share of the cores zfctl gave it (docs/design.md, "Threads and buffer ownership"). */
#define ZF_POOLS 2

typedef struct {
    pthread_mutex_t mu;   /* guards everything below */
    pthread_cond_t wake;  /* gen moved on: a new task */
    pthread_cond_t done;  /* active reached 0 */
    pthread_mutex_t busy; /* held by the one caller whose task the pool is running */
    int nworkers;         /* started workers; worker ids are 1..nworkers */
    uint64_t gen;         /* task counter */
    uint64_t start_gen[ZF_MAX_THREADS];
    zf_task_fn fn;
    void *ctx;
    zf_tiles *tiles;
    int nt;     /* participants wanted, caller included */
    int open;   /* workers may still join the task */
    int active; /* workers inside fn */
    int64_t joins; /* workers that joined a task, ever (diagnostics) */
    int ncpus;     /* 0: not pinned */
    int cpus[ZF_MAX_THREADS];
    int pin_gen;   /* bumped by zf_set_pool_cpus; a worker re-pins itself when it differs */
    int applied[ZF_MAX_THREADS]; /* the CPU worker id pinned itself to, -1: none (diagnostics) */
} pool;

#define POOL_INIT {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, \
                   PTHREAD_MUTEX_INITIALIZER, 0, 0, {0}, 0, 0, 0, 0, 0, 0, 0, 0, {0}, 0, {0}}
static pool g_pools[ZF_POOLS] = {POOL_INIT, POOL_INIT};

/* The calling thread's pool and its cap on participants (0: zf_get_num_threads()). */
static __thread int t_pool;
static __thread int t_cap;

static int g_nthreads; /* 0: not chosen yet, see zf_get_num_threads */

/* The CPUs the process may run on when the library loaded: where an unpinned worker goes back to. */
static cpu_set_t g_allowed;
static int g_have_allowed;
__attribute__((constructor)) static void read_allowed(void)
{
    g_have_allowed = sched_getaffinity(0, sizeof g_allowed, &g_allowed) == 0;
}

/* Run the calling thread on `cpu` only (cpu < 0: on the CPUs allowed at load). 0 on success. */
static int pin_self(int cpu)
{
    cpu_set_t set;
    if (cpu < 0) {
        if (!g_have_allowed)
            return -1;
        set = g_allowed;
    } else {
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
    }
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/* arg = pool index * ZF_MAX_THREADS + worker id */
static void *worker(void *arg)
{
    int id = (int)((intptr_t)arg % ZF_MAX_THREADS);
    pool *P = &g_pools[(intptr_t)arg / ZF_MAX_THREADS];
    int pinned_gen = 0; /* the pool's pin_gen this thread last applied; 0: never pinned */
    pthread_mutex_lock(&P->mu);
    uint64_t seen = P->start_gen[id];
    for (;;) {
        while (P->gen == seen)
            pthread_cond_wait(&P->wake, &P->mu);
        seen = P->gen;
        if (P->pin_gen != pinned_gen) { /* a new CPU list: apply it outside the lock */
            int gen = P->pin_gen, cpu = P->ncpus ? P->cpus[id % P->ncpus] : -1;
            pthread_mutex_unlock(&P->mu);
            int ok = pin_self(cpu) == 0;
            pthread_mutex_lock(&P->mu);
            pinned_gen = gen;
            P->applied[id] = ok ? cpu : -1;
        }
        if (!P->open || id >= P->nt) /* woke too late (the caller took every tile), or not needed */
            continue;
        P->active++;
        P->joins++;
        zf_task_fn fn = P->fn;
        void *ctx = P->ctx;
        zf_tiles *tiles = P->tiles;
        pthread_mutex_unlock(&P->mu);
        fn(ctx, tiles);
        pthread_mutex_lock(&P->mu);
        if (--P->active == 0)
            pthread_cond_signal(&P->done);
    }
    return NULL;
}

/* A forked child has none of the parent's threads: start from an empty pool. (DataLoader workers
 * fork; they do not normally call in, but must not deadlock if they do.) */
static void reset_after_fork(void)
{
    for (int i = 0; i < ZF_POOLS; i++) {
        pool *P = &g_pools[i];
        pthread_mutex_init(&P->mu, NULL);
        pthread_mutex_init(&P->busy, NULL);
        pthread_cond_init(&P->wake, NULL);
        pthread_cond_init(&P->done, NULL);
        P->nworkers = 0;
        P->gen = 0;
        P->open = 0;
        P->active = 0;
        P->pin_gen = P->ncpus ? 1 : 0; /* the child's new workers pin themselves to the same list */
    }
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void init_once(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

/* Called with P->mu held. Workers block all signals so that Ctrl-C reaches Python's thread. */
static int spawn(pool *P, int id)
{
    pthread_t t;
    pthread_attr_t attr;
    sigset_t all, old;
    P->start_gen[id] = P->gen;
    P->applied[id] = -1;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)((P - g_pools) * ZF_MAX_THREADS + id));
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

void zf_parallel(zf_task_fn fn, void *ctx, int64_t ntiles, int nt)
{
    /* The counter lives on this stack frame: only participants that joined while the task was
     * open touch it, and we wait for all of them before returning. */
    int64_t next = 0;
    zf_tiles tiles = {&next, ntiles};
    if (nt > ntiles)
        nt = (int)ntiles;
    if (nt > ZF_MAX_THREADS)
        nt = ZF_MAX_THREADS;
    pool *P = &g_pools[t_pool];
    if (nt > 1 && pthread_mutex_trylock(&P->busy) == 0) {
        pthread_once(&g_once, init_once);
        pthread_mutex_lock(&P->mu);
        /* A pinned pool: the caller takes its tiles on cpus[0] (the top of the file), then goes
         * back to the CPUs it had. Workers spawned meanwhile inherit this mask and re-pin at once. */
        cpu_set_t saved;
        int moved = 0;
        if (P->ncpus && pthread_getaffinity_np(pthread_self(), sizeof saved, &saved) == 0) {
            int cpu = P->cpus[0];
            moved = !(CPU_COUNT(&saved) == 1 && CPU_ISSET(cpu, &saved)) && pin_self(cpu) == 0;
        }
        while (P->nworkers < nt - 1 && spawn(P, P->nworkers + 1) == 0)
            P->nworkers++;
        P->fn = fn;
        P->ctx = ctx;
        P->tiles = &tiles;
        P->nt = nt;
        P->open = 1;
        P->gen++;
        pthread_cond_broadcast(&P->wake);
        pthread_mutex_unlock(&P->mu);
        fn(ctx, &tiles);
        /* Every tile is claimed. Close the task, then wait only for workers that joined (they are
         * finishing their last tile), never for one the OS has not scheduled yet. */
        pthread_mutex_lock(&P->mu);
        P->open = 0;
        while (P->active)
            pthread_cond_wait(&P->done, &P->mu);
        pthread_mutex_unlock(&P->mu);
        if (moved)
            pthread_setaffinity_np(pthread_self(), sizeof saved, &saved);
        pthread_mutex_unlock(&P->busy);
        return;
    }
    fn(ctx, &tiles);
}

/* Default: OMP_NUM_THREADS when set (torchrun sets it to 1 per rank when several ranks share a
 * node, which is also right for us), else the CPUs this process may run on. */
static int default_threads(void)
{
    const char *env = getenv("OMP_NUM_THREADS");
    if (env) {
        int n = atoi(env);
        if (n > 0)
            return n < ZF_MAX_THREADS ? n : ZF_MAX_THREADS;
    }
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set) < ZF_MAX_THREADS ? CPU_COUNT(&set) : ZF_MAX_THREADS;
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (n < ZF_MAX_THREADS ? (int)n : ZF_MAX_THREADS) : 1;
}

void zf_set_num_threads(int n)
{
    __atomic_store_n(&g_nthreads, n < 1 ? 1 : n > ZF_MAX_THREADS ? ZF_MAX_THREADS : n, __ATOMIC_RELAXED);
}

int zf_get_num_threads(void)
{
    int n = __atomic_load_n(&g_nthreads, __ATOMIC_RELAXED);
    if (n == 0) {
        n = default_threads();
        __atomic_store_n(&g_nthreads, n, __ATOMIC_RELAXED);
    }
    return n;
}

int64_t zf_pool_joins(void)
{
    int64_t n = 0;
    for (int i = 0; i < ZF_POOLS; i++) {
        pthread_mutex_lock(&g_pools[i].mu);
        n += g_pools[i].joins;
        pthread_mutex_unlock(&g_pools[i].mu);
    }
    return n;
}

int zf_set_thread_role(int pool_index, int max_threads)
{
    if (pool_index < 0 || pool_index >= ZF_POOLS || max_threads < 0)
        return -1;
    t_pool = pool_index;
    t_cap = max_threads > ZF_MAX_THREADS ? ZF_MAX_THREADS : max_threads;
    return 0;
}

int zf_thread_limit(void)
{
    int n = zf_get_num_threads();
    return t_cap && t_cap < n ? t_cap : n;
}

int zf_thread_pool(void) { return t_pool; }

int zf_set_pool_cpus(int pool_index, const int *cpus, int ncpus)
{
    if (pool_index < 0 || pool_index >= ZF_POOLS || ncpus < 0 || ncpus > ZF_MAX_THREADS)
        return -1;
    for (int i = 0; i < ncpus; i++)
        if (cpus[i] < 0 || cpus[i] >= CPU_SETSIZE)
            return -1;
    pool *P = &g_pools[pool_index];
    pthread_mutex_lock(&P->mu);
    for (int i = 0; i < ncpus; i++)
        P->cpus[i] = cpus[i];
    P->ncpus = ncpus;
    P->pin_gen++; /* never back to 0: 0 means "never pinned" to a worker */
    pthread_mutex_unlock(&P->mu);
    return 0;
}

int zf_pool_cpus(int pool_index, int *out, int cap)
{
    if (pool_index < 0 || pool_index >= ZF_POOLS)
        return -1;
    pool *P = &g_pools[pool_index];
    pthread_mutex_lock(&P->mu);
    int n = P->ncpus;
    for (int i = 0; i < n && i < cap; i++)
        out[i] = P->cpus[i];
    pthread_mutex_unlock(&P->mu);
    return n;
}

int zf_pool_worker_cpus(int pool_index, int *out, int cap)
{
    if (pool_index < 0 || pool_index >= ZF_POOLS)
        return -1;
    pool *P = &g_pools[pool_index];
    pthread_mutex_lock(&P->mu);
    int n = P->nworkers;
    for (int i = 0; i < n && i < cap; i++)
        out[i] = P->applied[i + 1];
    pthread_mutex_unlock(&P->mu);
    return n;
}

/* mbind(2) through syscall(): no libnuma needed. The constants are the kernel's ABI
 * (include/uapi/linux/mempolicy.h). MPOL_PREFERRED, not MPOL_BIND: a full node spills to the
 * others instead of failing the allocation; MPOL_MF_MOVE moves the pages already touched (by
 * whichever thread zeroed them: torch's intra-op threads run anywhere), and silently leaves pages
 * it cannot move (page-locked ones: those were first touched by the registering thread). */
#define ZF_MPOL_PREFERRED 1
#define ZF_MPOL_MF_MOVE (1 << 1)

int zf_bind_node(void *addr, int64_t nbytes, int node)
{
#ifdef SYS_mbind
    if (node < 0 || node >= 1024 || nbytes <= 0)
        return -EINVAL;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)addr & ~(uintptr_t)(page - 1);
    uintptr_t hi = ((uintptr_t)addr + (uintptr_t)nbytes + (uintptr_t)page - 1) & ~(uintptr_t)(page - 1);
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {0};
    mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
    long rc = syscall(SYS_mbind, (void *)lo, (unsigned long)(hi - lo), ZF_MPOL_PREFERRED, mask,
                      (unsigned long)1024, (unsigned)ZF_MPOL_MF_MOVE);
    return rc == 0 ? 0 : -errno;
#else
    (void)addr, (void)nbytes, (void)node;
    return -ENOSYS;
#endif
}
