/* A work-claiming thread pool for cpu_fp4.c: the caller never waits for a thread that has no work.
 *
 * Why not only OpenMP: a parallel region (and every `omp for`) ends in a barrier that waits for every
 * thread of the team, including threads the OS has not even scheduled yet. The CPU expert worker shares
 * its host with the attention worker and the GPU expert worker (each busy-waits on its GPU), so some of
 * its threads are often descheduled; each such thread then stalls the whole call for a scheduler
 * quantum (on a loaded 2-core host: 2 OpenMP threads ran an expert 10-25x slower than 1 thread).
 * Here work is split into chunks that threads claim from one atomic ticket; the caller claims chunks
 * too, and waits only until every chunk is *done*. A thread that wakes late finds nothing to claim and
 * goes back to sleep; only a thread descheduled in the middle of a chunk delays the call, by one chunk.
 *
 * Phases: chunk numbers are global across up to MAX_PHASES phases, in phase order; a chunk of phase p
 * may start only when every chunk of the phases before it is done (the gate/up outputs are the down
 * projection's inputs). A thread that claims such a chunk early spins until the phase before is done;
 * that wait is on chunks other threads are running, never on idle threads.
 *
 * Ticket word: generation (16 bits) | number of chunks (24 bits) | next chunk (24 bits), published in
 * one store, so a claim (one fetch-and-add) always names the chunk count of the job it claims from.
 * The job's description is read only after a successful claim, and the caller does not return (or
 * start another job) before that chunk is done, so the description is still the one the claim was for.
 *
 * Idle workers poll for a short while (MOEMESH_CPU_KERNEL_SPIN_US, default 50 us), then sleep on a
 * futex; a new job wakes them as a tree (the caller wakes two, each of those two more, ...).
 * One job at a time per process: callers serialise on a mutex. Linux only (futex); elsewhere the
 * caller runs every chunk itself.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#define POOL_HAS_FUTEX 1
#else
#define POOL_HAS_FUTEX 0
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

#define MAX_PHASES 3
#define POOL_MAX_CHUNKS ((1u << 24) - (1u << 16)) /* room for one overshooting claim per thread */
#define POOL_DEFAULT_IDLE_NS 50000 /* an idle worker polls this long before it sleeps (settable) */
#define POOL_SPINS_BEFORE_YIELD 2000

typedef void (*pool_chunk_fn)(const void *job, int phase, int64_t chunk_in_phase);

typedef struct {
    pool_chunk_fn fn;
    const void *job;
    int num_phases;
    uint32_t phase_end[MAX_PHASES]; /* cumulative chunk counts */
} pool_job;

typedef struct {
    pthread_mutex_t call_lock; /* one job at a time */
    pthread_t *threads;
    int num_workers;
    _Atomic uint64_t ticket;
    _Atomic uint32_t wake_word; /* futex: bumped on every publish and on shutdown */
    _Atomic int quit;
    _Atomic int sleeping; /* workers in (or about to enter) a futex wait */
    _Atomic uint32_t done[MAX_PHASES];
    pool_job current;
    uint32_t generation;
    uint32_t spawn_wake; /* wake_word when the workers were created: their first "last seen" value */
} pool_t;

static pool_t g_pool = {.call_lock = PTHREAD_MUTEX_INITIALIZER};
static _Atomic int64_t g_pool_idle_ns = POOL_DEFAULT_IDLE_NS;

static inline int64_t pool_now_ns(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
}

/* Waits until *counter >= target: polls, then yields the core (the thread being waited for may need it). */
static void pool_wait_count(_Atomic uint32_t *counter, uint32_t target) {
    for (int spins = 0; atomic_load_explicit(counter, memory_order_acquire) < target; ++spins) {
        if (spins < POOL_SPINS_BEFORE_YIELD) POOL_PAUSE();
        else sched_yield();
    }
}

static inline uint64_t ticket_make(uint32_t generation, uint32_t num_chunks, uint32_t next) {
    return ((uint64_t)(generation & 0xFFFF) << 48) | ((uint64_t)num_chunks << 24) | next;
}

/* Claims and runs chunks of the current job until none is left. A claim is one fetch-and-add on the
 * ticket (wait-free, unlike a compare-and-swap loop, which retries under contention with many threads).
 * A thread whose add finds the job exhausted has overshot `next` by one and stops; every thread does that
 * at most once per job, so `next` stays far below the 24 bits it has (POOL_MAX_CHUNKS leaves room). A
 * late thread may add to a newer job's ticket: that claim is valid for the job it names, and that job
 * cannot finish (nor its description change) before the claimed chunk is done. */
static void pool_work(pool_t *pool) {
    for (;;) {
        const uint64_t claimed = atomic_fetch_add_explicit(&pool->ticket, 1, memory_order_acq_rel);
        const uint32_t num_chunks = (uint32_t)(claimed >> 24) & 0xFFFFFF, next = (uint32_t)claimed & 0xFFFFFF;
        if (next >= num_chunks) return;
        const pool_job *job = &pool->current;
        int phase = 0;
        while (next >= job->phase_end[phase]) ++phase;
        if (phase > 0) /* the inputs of this phase are the outputs of the one before */
            pool_wait_count(&pool->done[phase - 1],
                            job->phase_end[phase - 1] - (phase > 1 ? job->phase_end[phase - 2] : 0));
        job->fn(job->job, phase, (int64_t)next - (phase > 0 ? job->phase_end[phase - 1] : 0));
        atomic_fetch_add_explicit(&pool->done[phase], 1, memory_order_acq_rel);
    }
}

/* Wakes up to two sleeping workers; each woken worker wakes two more before it works (a wake tree):
 * waking all at once from the caller costs one wake-up (an inter-processor interrupt, slow in a VM)
 * per worker in the caller's own syscall before it can start working. */
static void pool_wake_some(pool_t *pool) {
#if POOL_HAS_FUTEX
    if (atomic_load_explicit(&pool->sleeping, memory_order_seq_cst) > 0)
        syscall(SYS_futex, (uint32_t *)&pool->wake_word, FUTEX_WAKE_PRIVATE, 2, NULL, NULL, 0);
#else
    (void)pool;
#endif
}

static void *pool_worker_main(void *arg) {
    pool_t *pool = (pool_t *)arg;
    /* not the current wake_word: a worker that starts late must still see the wakes made since its
     * creation (a shutdown in particular, or it would sleep through it) */
    uint32_t last_wake = pool->spawn_wake;
    for (;;) {
        uint32_t wake = atomic_load_explicit(&pool->wake_word, memory_order_acquire);
        const int64_t idle_since_ns = pool_now_ns();
        for (int spins = 0; wake == last_wake; ++spins) {
            POOL_PAUSE();
            wake = atomic_load_explicit(&pool->wake_word, memory_order_acquire);
            if ((spins & 63) == 63 && pool_now_ns() - idle_since_ns >
                                          atomic_load_explicit(&g_pool_idle_ns, memory_order_relaxed))
                break;
        }
#if POOL_HAS_FUTEX
        if (wake == last_wake) {
            /* seq_cst with the caller's bump-then-check: either it sees us sleeping, or we see its bump */
            atomic_fetch_add_explicit(&pool->sleeping, 1, memory_order_seq_cst);
            wake = atomic_load_explicit(&pool->wake_word, memory_order_seq_cst);
            while (wake == last_wake) {
                syscall(SYS_futex, (uint32_t *)&pool->wake_word, FUTEX_WAIT_PRIVATE, last_wake, NULL, NULL, 0);
                wake = atomic_load_explicit(&pool->wake_word, memory_order_acquire);
            }
            atomic_fetch_sub_explicit(&pool->sleeping, 1, memory_order_seq_cst);
            pool_wake_some(pool); /* pass the wake on down the tree */
        }
#endif
        last_wake = wake;
        if (atomic_load_explicit(&pool->quit, memory_order_acquire)) return NULL;
        pool_work(pool);
    }
}

static void pool_stop_workers(pool_t *pool) {
    if (!pool->num_workers) return;
    atomic_store_explicit(&pool->quit, 1, memory_order_release);
    atomic_fetch_add_explicit(&pool->wake_word, 1, memory_order_acq_rel);
#if POOL_HAS_FUTEX
    syscall(SYS_futex, (uint32_t *)&pool->wake_word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
#endif
    for (int i = 0; i < pool->num_workers; ++i) pthread_join(pool->threads[i], NULL);
    free(pool->threads);
    pool->threads = NULL;
    pool->num_workers = 0;
    atomic_store_explicit(&pool->quit, 0, memory_order_release);
}

/* (Re)starts workers so that num_threads threads (the caller included) work; returns how many do. */
static int pool_ensure_workers(pool_t *pool, int num_threads) {
    const int wanted = POOL_HAS_FUTEX && num_threads > 1 ? num_threads - 1 : 0;
    if (wanted == pool->num_workers) return wanted + 1;
    pool_stop_workers(pool);
    if (!wanted) return 1;
    pool->threads = (pthread_t *)calloc((size_t)wanted, sizeof(pthread_t));
    if (!pool->threads) return 1;
    pool->spawn_wake = atomic_load_explicit(&pool->wake_word, memory_order_acquire);
    for (int i = 0; i < wanted; ++i) {
        if (pthread_create(&pool->threads[i], NULL, pool_worker_main, pool) != 0) break;
        pool->num_workers = i + 1;
    }
    return pool->num_workers + 1;
}

/* In a child forked while workers existed: they do not exist there; start afresh (new workers at the
 * next call; the caller lock may have been held by another thread of the parent). */
static void pool_after_fork_in_child(void) {
    g_pool.threads = NULL; /* the parent's array; not freed: another thread may have been using it */
    g_pool.num_workers = 0;
    pthread_mutex_init(&g_pool.call_lock, NULL);
}

static void pool_init_once(void) { pthread_atfork(NULL, NULL, pool_after_fork_in_child); }

/* Runs every chunk of `phase_chunks` (chunks per phase) on num_threads threads, the caller included;
 * returns when all are done. Returns 3 when the job has more chunks than a ticket can count. */
static int pool_run(pool_chunk_fn fn, const void *job, int num_phases, const int64_t *phase_chunks,
                    int num_threads) {
    pool_t *pool = &g_pool;
    uint64_t total = 0;
    pool_job described = {.fn = fn, .job = job, .num_phases = num_phases};
    for (int p = 0; p < num_phases; ++p) {
        total += (uint64_t)phase_chunks[p];
        described.phase_end[p] = (uint32_t)total;
    }
    if (total > POOL_MAX_CHUNKS) return 3;
    pthread_mutex_lock(&pool->call_lock);
    pool_ensure_workers(pool, num_threads);
    pool->current = described;
    for (int p = 0; p < MAX_PHASES; ++p) atomic_store_explicit(&pool->done[p], 0, memory_order_relaxed);
    pool->generation = (pool->generation + 1) & 0xFFFF;
    atomic_store_explicit(&pool->ticket, ticket_make(pool->generation, (uint32_t)total, 0), memory_order_release);
    if (pool->num_workers) {
        atomic_fetch_add_explicit(&pool->wake_word, 1, memory_order_seq_cst);
        pool_wake_some(pool);
    }
    pool_work(pool);
    for (int p = 0; p < num_phases; ++p) { /* wait for chunks other threads still run */
        const uint32_t count = described.phase_end[p] - (p > 0 ? described.phase_end[p - 1] : 0);
        pool_wait_count(&pool->done[p], count);
    }
    pthread_mutex_unlock(&pool->call_lock);
    return 0;
}
