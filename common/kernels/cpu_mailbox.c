/* The CPU expert mailbox's native side: the worker loop, and the flag operations of the waiting side.
 *
 * Built into one library with cpu_fp4.c (common/kernels/cpu_mailbox.py, through cpu_fp4_build.build_native), so the
 * loop calls the FP4 expert kernel (its tile and work-claiming pool) directly. Layout and protocol:
 * cpu_mailbox.h and docs/device-step.md.
 *
 * Worker loop (one thread per segment, started once per placement): wait for dispatch_seq to pass the
 * last seq served (acquire load; a bounded spin, then sleeps doubling up to a cap, so on a host with
 * few shared cores the loop does not starve everything else), check the seq's layer and the slot, run
 * the owned (token, k) pairs of that layer through the FP4 experts, write the combine slot, write the
 * error word when something failed, store done_seq = seq (release). No Python, no allocation in the
 * steady state beyond the kernel's own scratch. The stop word ends the loop between layers.
 *
 * Ordering (C11): the waiting side writes the slot with plain stores and then stores dispatch_seq with
 * memory_order_release; the worker's acquire load of dispatch_seq makes the slot visible. The worker
 * writes the combine slot and the error words, then stores done_seq with memory_order_release; the
 * waiting side's acquire load of done_seq makes them visible. Each side reads the other's data only
 * after such an acquire, and writes its own region only when the protocol says the other side is done
 * with it (the waiting side rewrites the dispatch slot only after the previous done seq, or after a
 * timeout, in which case the worker's reply to the abandoned seq is never read).
 */
#define _GNU_SOURCE /* sched_setaffinity / pthread_setaffinity_np, nanosleep under -std=c11 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MB_PAUSE() _mm_pause()
#else
#define MB_PAUSE() ((void)0)
#endif

#include "cpu_mailbox.h"

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free to live in shared memory");
_Static_assert(sizeof(long long) == sizeof(int64_t), "int64 words");

typedef _Atomic int64_t atomic_word;

static inline atomic_word *word_at(uint8_t *segment, int64_t offset) { return (atomic_word *)(segment + offset); }
static inline int64_t load_relaxed(uint8_t *segment, int64_t offset) {
    return atomic_load_explicit(word_at(segment, offset), memory_order_relaxed);
}
static inline void store_relaxed(uint8_t *segment, int64_t offset, int64_t value) {
    atomic_store_explicit(word_at(segment, offset), value, memory_order_relaxed);
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void sleep_ns(int64_t ns) {
    if (ns <= 0) {
        sched_yield();
        return;
    }
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    while (nanosleep(&t, &t) == -1 && errno == EINTR) {
    }
}

/* ------------------------------------------------------------------ layout, checked against Python */

static const int64_t kAbi[] = {
    MB_MAGIC, MB_VERSION, MB_PAGE, MB_CONTROL_BYTES, MB_LAYER_BITS,
    MB_OFF_MAGIC, MB_OFF_VERSION, MB_OFF_T_MAX, MB_OFF_HIDDEN_SIZE, MB_OFF_TOP_K, MB_OFF_HIDDEN_BF16,
    MB_OFF_COMBINE_SLOTS, MB_OFF_TOTAL_BYTES, MB_OFF_REGION_HIDDEN, MB_OFF_REGION_IDS, MB_OFF_REGION_WEIGHTS,
    MB_OFF_REGION_COMBINE, MB_OFF_WORKER_INDEX, MB_OFF_DISPATCH_SEQ, MB_OFF_NUM_ROWS, MB_OFF_DONE_SEQ,
    MB_OFF_WORKER_ERROR, MB_OFF_WORKER_ERROR_SEQ, MB_OFF_WORKER_ERROR_DETAIL, MB_OFF_WAIT_ERROR,
    MB_OFF_WAIT_ERROR_SEQ, MB_OFF_WAIT_ERROR_SEEN, MB_OFF_WAIT_ERROR_WORKER, MB_OFF_STOP, MB_OFF_WORKER_PID,
    MB_OFF_WORKER_STATE, MB_OFF_ATTACH_SEQ, MB_OFF_SERVED, MB_OFF_BUSY_NS, MB_OFF_LAST_BUSY_NS,
    MB_OK, MB_ERR_TIMEOUT, MB_ERR_BAD_LAYER, MB_ERR_BAD_ROWS, MB_ERR_BAD_EXPERT, MB_ERR_KERNEL, MB_ERR_PROTOCOL,
    MB_STATE_DETACHED, MB_STATE_WAITING, MB_STATE_COMPUTING, MB_STATE_STOPPED,
};

/* The constants above, in that order (cpu_mailbox.py compares them with its own); returns their count. */
int moemesh_mailbox_abi(int64_t *out, int capacity) {
    const int count = (int)(sizeof kAbi / sizeof kAbi[0]);
    for (int i = 0; i < count && i < capacity; ++i) out[i] = kAbi[i];
    return count;
}

static int64_t page_up(int64_t bytes) { return (bytes + MB_PAGE - 1) / MB_PAGE * MB_PAGE; }

/* out[0..4]: offsets of hidden, ids, weights, combine, and the total size; regions page aligned. */
void moemesh_mailbox_layout(int64_t t_max, int64_t hidden_size, int64_t top_k, int hidden_bf16, int combine_slots,
                            int64_t *out) {
    const int64_t hidden_bytes = t_max * hidden_size * (hidden_bf16 ? 2 : 4);
    const int64_t route_bytes = t_max * top_k * 4;
    const int64_t combine_bytes = t_max * (combine_slots ? top_k : 1) * hidden_size * 4;
    out[0] = MB_CONTROL_BYTES;
    out[1] = out[0] + page_up(hidden_bytes);
    out[2] = out[1] + page_up(route_bytes);
    out[3] = out[2] + page_up(route_bytes);
    out[4] = out[3] + page_up(combine_bytes);
}

/* ------------------------------------------------------------------ flag operations (both sides) */

void moemesh_mailbox_store_release(int64_t *word, int64_t value) {
    atomic_store_explicit((atomic_word *)word, value, memory_order_release);
}

int64_t moemesh_mailbox_load_acquire(const int64_t *word) {
    return atomic_load_explicit((atomic_word *)word, memory_order_acquire);
}

/* The waiting side's post: T (plain, the slot's row count), then dispatch_seq = seq (release). */
void moemesh_mailbox_post(uint8_t *segment, int64_t seq, int64_t num_rows) {
    store_relaxed(segment, MB_OFF_NUM_ROWS, num_rows);
    atomic_store_explicit(word_at(segment, MB_OFF_DISPATCH_SEQ), seq, memory_order_release);
}

/* How a side waits: spin (pause) for spin_ns, then sleep sleep_min_ns doubling up to sleep_max_ns
 * (sleep 0: sched_yield). */
typedef struct {
    int64_t spin_ns, sleep_min_ns, sleep_max_ns;
} backoff;

typedef struct {
    backoff config;
    int64_t start_ns, sleep_ns;
    unsigned spins;
    int spinning, manage_slack;
    long saved_slack; /* -1: not changed */
} backoff_state;

/* Linux lets a sleep end up to the thread's timer slack (default 50 us) late, which would make every
 * short sleep of the backoff a 50 us one; the sleeping phase runs with a 1 ns slack. */
static void timer_slack_fine(long *saved) {
#if defined(__linux__)
    if (saved) *saved = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
#else
    if (saved) *saved = -1;
#endif
}

static void timer_slack_restore(long saved) {
#if defined(__linux__)
    if (saved > 0) prctl(PR_SET_TIMERSLACK, (unsigned long)saved, 0, 0, 0);
#else
    (void)saved;
#endif
}

/* manage_slack: set a fine timer slack at the first sleep and restore it in backoff_end (a caller's
 * thread); the worker thread sets its own once instead. */
static void backoff_begin(backoff_state *state, backoff config, int manage_slack) {
    state->config = config;
    state->start_ns = now_ns();
    state->sleep_ns = config.sleep_min_ns;
    state->spins = 0;
    state->spinning = 1;
    state->manage_slack = manage_slack;
    state->saved_slack = -1;
}

static void backoff_end(backoff_state *state) {
    if (state->saved_slack > 0) timer_slack_restore(state->saved_slack);
}

/* One idle step; returns the time waited so far when it looked at the clock, else -1. */
static int64_t backoff_step(backoff_state *state) {
    if (state->spinning) {
        MB_PAUSE();
        if ((++state->spins & 63u) != 0) return -1;
        const int64_t waited = now_ns() - state->start_ns;
        if (waited >= state->config.spin_ns) state->spinning = 0;
        return waited;
    }
    if (state->manage_slack && state->saved_slack < 0) timer_slack_fine(&state->saved_slack);
    sleep_ns(state->sleep_ns);
    const int64_t next = state->sleep_ns * 2;
    state->sleep_ns = next < state->config.sleep_max_ns ? next : state->config.sleep_max_ns;
    return now_ns() - state->start_ns;
}

/* Waits until *word >= target (acquire loads) or timeout_ns passed (< 0: no bound).
 * Returns 0 when *word == target, 2 when it passed target, 1 on timeout; *seen = the last value read. */
int moemesh_mailbox_wait(const int64_t *word, int64_t target, int64_t timeout_ns, int64_t spin_ns,
                         int64_t sleep_min_ns, int64_t sleep_max_ns, int64_t *seen) {
    backoff_state state;
    backoff_begin(&state, (backoff){spin_ns, sleep_min_ns, sleep_max_ns}, 1);
    int status;
    for (;;) {
        const int64_t value = atomic_load_explicit((atomic_word *)word, memory_order_acquire);
        if (value >= target) {
            *seen = value;
            status = value == target ? 0 : 2;
            break;
        }
        const int64_t waited = backoff_step(&state);
        if (timeout_ns >= 0 && waited >= timeout_ns) {
            *seen = atomic_load_explicit((atomic_word *)word, memory_order_acquire);
            status = *seen >= target ? (*seen == target ? 0 : 2) : 1;
            break;
        }
    }
    backoff_end(&state);
    return status;
}

/* ------------------------------------------------------------------ the worker */

typedef struct {
    uint8_t *segment;
    int64_t t_max, hidden, top_k, hidden_bf16, combine_slots;
    int64_t region_hidden, region_ids, region_weights, region_combine;
    int64_t num_layers, num_experts, inter_size;
    int64_t *local;            /* [L, E] stack index, -1 where not owned */
    mb_layer_stacks *stacks;   /* [L] */
    int has_limit, route_before_w2, num_threads, executor, pin_cpu;
    float swiglu_limit;
    backoff wait;
    int64_t attach_seq;
    int64_t *ids;              /* [t_max * K] scratch */
    uint8_t *mask;             /* [t_max * K] */
    float *slot_out;           /* [t_max * K, D] (partial mode) */
    pthread_t thread;
    int64_t served, failed;
} mb_worker;

static int check_header(uint8_t *segment, int64_t segment_bytes, char *message, int message_bytes) {
    int64_t regions[5];
    if (segment_bytes < MB_CONTROL_BYTES || load_relaxed(segment, MB_OFF_MAGIC) != MB_MAGIC) {
        snprintf(message, (size_t)message_bytes, "segment has no mailbox header (magic)");
        return 0;
    }
    if (load_relaxed(segment, MB_OFF_VERSION) != MB_VERSION) {
        snprintf(message, (size_t)message_bytes, "segment version %lld, library %d",
                 (long long)load_relaxed(segment, MB_OFF_VERSION), MB_VERSION);
        return 0;
    }
    moemesh_mailbox_layout(load_relaxed(segment, MB_OFF_T_MAX), load_relaxed(segment, MB_OFF_HIDDEN_SIZE),
                           load_relaxed(segment, MB_OFF_TOP_K), (int)load_relaxed(segment, MB_OFF_HIDDEN_BF16),
                           (int)load_relaxed(segment, MB_OFF_COMBINE_SLOTS), regions);
    const int64_t offsets[5] = {MB_OFF_REGION_HIDDEN, MB_OFF_REGION_IDS, MB_OFF_REGION_WEIGHTS,
                                MB_OFF_REGION_COMBINE, MB_OFF_TOTAL_BYTES};
    for (int i = 0; i < 5; ++i)
        if (load_relaxed(segment, offsets[i]) != regions[i]) {
            snprintf(message, (size_t)message_bytes, "segment header word at %lld is %lld, expected %lld",
                     (long long)offsets[i], (long long)load_relaxed(segment, offsets[i]), (long long)regions[i]);
            return 0;
        }
    if (regions[4] > segment_bytes) {
        snprintf(message, (size_t)message_bytes, "segment of %lld bytes, layout needs %lld", (long long)segment_bytes,
                 (long long)regions[4]);
        return 0;
    }
    return 1;
}

/* Serves one dispatched seq; returns an error code (detail in *detail) or MB_OK. */
static int serve_layer(mb_worker *w, int64_t seq, int64_t *detail) {
    const int64_t layer = seq & (MB_MAX_LAYERS - 1);
    if (seq <= 0 || layer >= w->num_layers) {
        *detail = layer;
        return MB_ERR_BAD_LAYER;
    }
    const int64_t num_rows = load_relaxed(w->segment, MB_OFF_NUM_ROWS);
    if (num_rows < 0 || num_rows > w->t_max) {
        *detail = num_rows;
        return MB_ERR_BAD_ROWS;
    }
    const int64_t K = w->top_k, D = w->hidden, E = w->num_experts, num_slots = num_rows * K;
    const int32_t *slot_ids = (const int32_t *)(w->segment + w->region_ids);
    const float *slot_weights = (const float *)(w->segment + w->region_weights);
    const void *hidden = w->segment + w->region_hidden;
    float *combine = (float *)(w->segment + w->region_combine);
    const int64_t *local = w->local + layer * E;
    int64_t num_owned = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
        const int64_t id = slot_ids[s];
        if (id < 0 || id >= E) {
            *detail = s;
            return MB_ERR_BAD_EXPERT;
        }
        w->ids[s] = id;
        w->mask[s] = local[id] >= 0;
        num_owned += w->mask[s];
    }
    float *out = w->combine_slots ? combine : w->slot_out; /* [T * K, D] */
    if (w->combine_slots)
        for (int64_t s = 0; s < num_slots; ++s)
            if (!w->mask[s]) memset(out + s * D, 0, (size_t)D * sizeof(float));
    if (num_owned) {
        const mb_layer_stacks *st = &w->stacks[layer];
        const int status = moemesh_fp4_experts_routed(
            hidden, (int)w->hidden_bf16, D, w->inter_size, num_rows, K, w->ids, slot_weights, w->mask, local, E,
            st->w1, st->s1, st->w3, st->s3, st->w13_stride, st->s13_stride, st->w2, st->s2, st->w2_stride,
            st->s2_stride, w->has_limit, w->swiglu_limit, w->route_before_w2, out, w->num_threads, w->executor);
        if (status) {
            *detail = status;
            return MB_ERR_KERNEL;
        }
    }
    if (!w->combine_slots) /* partial sums: 0 + owned slot 0 + owned slot 1 + ... (slot order) */
        for (int64_t t = 0; t < num_rows; ++t) {
            float *row = combine + t * D;
            for (int64_t d = 0; d < D; ++d) row[d] = 0.0f;
            for (int64_t k = 0; k < K; ++k) {
                if (!w->mask[t * K + k]) continue;
                const float *src = out + (t * K + k) * D;
                for (int64_t d = 0; d < D; ++d) row[d] += src[d];
            }
        }
    return MB_OK;
}

/* Waits for a dispatch seq past `last`; returns 0 when the stop word is set instead. */
static int wait_dispatch(mb_worker *w, int64_t last, int64_t *seq) {
    backoff_state state;
    backoff_begin(&state, w->wait, 0);
    for (;;) {
        const int64_t value = atomic_load_explicit(word_at(w->segment, MB_OFF_DISPATCH_SEQ), memory_order_acquire);
        if (value > last) {
            *seq = value;
            return 1;
        }
        if (backoff_step(&state) >= 0 &&
            atomic_load_explicit(word_at(w->segment, MB_OFF_STOP), memory_order_acquire))
            return 0;
    }
}

static void *worker_main(void *arg) {
    mb_worker *w = (mb_worker *)arg;
    if (w->pin_cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(w->pin_cpu, &set);
        pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    }
    timer_slack_fine(NULL);
    uint8_t *seg = w->segment;
    int64_t last = w->attach_seq, seq;
    while (wait_dispatch(w, last, &seq)) {
        const int64_t start = now_ns();
        store_relaxed(seg, MB_OFF_WORKER_STATE, MB_STATE_COMPUTING);
        int64_t detail = 0;
        const int code = serve_layer(w, seq, &detail);
        if (code != MB_OK) { /* visible to the waiting side through the release below */
            store_relaxed(seg, MB_OFF_WORKER_ERROR, code);
            store_relaxed(seg, MB_OFF_WORKER_ERROR_SEQ, seq);
            store_relaxed(seg, MB_OFF_WORKER_ERROR_DETAIL, detail);
            ++w->failed;
        }
        const int64_t busy_ns = now_ns() - start;
        store_relaxed(seg, MB_OFF_LAST_BUSY_NS, busy_ns);
        store_relaxed(seg, MB_OFF_BUSY_NS, load_relaxed(seg, MB_OFF_BUSY_NS) + busy_ns);
        store_relaxed(seg, MB_OFF_SERVED, ++w->served);
        store_relaxed(seg, MB_OFF_WORKER_STATE, MB_STATE_WAITING);
        atomic_store_explicit(word_at(seg, MB_OFF_DONE_SEQ), seq, memory_order_release);
        last = seq;
    }
    atomic_store_explicit(word_at(seg, MB_OFF_WORKER_STATE), MB_STATE_STOPPED, memory_order_release);
    return NULL;
}

static void worker_free(mb_worker *w) {
    if (!w) return;
    free(w->local);
    free(w->stacks);
    free(w->ids);
    free(w->mask);
    free(w->slot_out);
    free(w);
}

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;

/* Attaches a worker to `segment` and starts its thread. local [L * E]: stack index of each (layer, expert)
 * this worker owns, -1 elsewhere; stacks [L]: the owned experts' FP4 stacks (pointers stay owned by the
 * caller and must outlive the thread). Both tables are copied. Serves only seqs posted after this call
 * (a seq posted before belongs to a step the waiting side has given up on). Returns a handle, or NULL
 * with the reason in `message`. */
void *moemesh_mailbox_start(uint8_t *segment, int64_t segment_bytes, int64_t num_layers, int64_t num_experts,
                            int64_t inter_size, const int64_t *local, const mb_layer_stacks *stacks, int has_limit,
                            float swiglu_limit, int route_before_w2, int num_threads, int executor, int pin_cpu,
                            int64_t spin_ns, int64_t sleep_min_ns, int64_t sleep_max_ns, char *message,
                            int message_bytes) {
    pthread_once(&g_init_once, moemesh_fp4_init);
    if (!check_header(segment, segment_bytes, message, message_bytes)) return NULL;
    if (num_layers <= 0 || num_layers > MB_MAX_LAYERS || num_experts <= 0) {
        snprintf(message, (size_t)message_bytes, "bad placement: %lld layers, %lld experts", (long long)num_layers,
                 (long long)num_experts);
        return NULL;
    }
    mb_worker *w = (mb_worker *)calloc(1, sizeof(mb_worker));
    if (!w) goto no_memory;
    w->segment = segment;
    w->t_max = load_relaxed(segment, MB_OFF_T_MAX);
    w->hidden = load_relaxed(segment, MB_OFF_HIDDEN_SIZE);
    w->top_k = load_relaxed(segment, MB_OFF_TOP_K);
    w->hidden_bf16 = load_relaxed(segment, MB_OFF_HIDDEN_BF16);
    w->combine_slots = load_relaxed(segment, MB_OFF_COMBINE_SLOTS);
    w->region_hidden = load_relaxed(segment, MB_OFF_REGION_HIDDEN);
    w->region_ids = load_relaxed(segment, MB_OFF_REGION_IDS);
    w->region_weights = load_relaxed(segment, MB_OFF_REGION_WEIGHTS);
    w->region_combine = load_relaxed(segment, MB_OFF_REGION_COMBINE);
    w->num_layers = num_layers;
    w->num_experts = num_experts;
    w->inter_size = inter_size;
    w->has_limit = has_limit;
    w->swiglu_limit = swiglu_limit;
    w->route_before_w2 = route_before_w2;
    w->num_threads = num_threads > 0 ? num_threads : 1;
    w->executor = executor;
    w->pin_cpu = pin_cpu;
    w->wait = (backoff){spin_ns, sleep_min_ns, sleep_max_ns};
    const int64_t num_slots = w->t_max * w->top_k;
    w->local = (int64_t *)malloc((size_t)(num_layers * num_experts) * sizeof(int64_t));
    w->stacks = (mb_layer_stacks *)malloc((size_t)num_layers * sizeof(mb_layer_stacks));
    w->ids = (int64_t *)malloc((size_t)(num_slots > 0 ? num_slots : 1) * sizeof(int64_t));
    w->mask = (uint8_t *)malloc((size_t)(num_slots > 0 ? num_slots : 1));
    w->slot_out = w->combine_slots ? NULL : (float *)malloc((size_t)(num_slots * w->hidden + 1) * sizeof(float));
    if (!w->local || !w->stacks || !w->ids || !w->mask || (!w->combine_slots && !w->slot_out)) goto no_memory;
    memcpy(w->local, local, (size_t)(num_layers * num_experts) * sizeof(int64_t));
    memcpy(w->stacks, stacks, (size_t)num_layers * sizeof(mb_layer_stacks));
    for (int64_t l = 0; l < num_layers; ++l)
        for (int64_t e = 0; e < num_experts; ++e)
            if (w->local[l * num_experts + e] >= 0 && !w->stacks[l].w1) {
                snprintf(message, (size_t)message_bytes, "layer %lld owns expert %lld but has no stacks",
                         (long long)l, (long long)e);
                worker_free(w);
                return NULL;
            }
    atomic_store_explicit(word_at(segment, MB_OFF_STOP), 0, memory_order_release);
    w->attach_seq = atomic_load_explicit(word_at(segment, MB_OFF_DISPATCH_SEQ), memory_order_acquire);
    store_relaxed(segment, MB_OFF_ATTACH_SEQ, w->attach_seq);
    store_relaxed(segment, MB_OFF_SERVED, 0);
    store_relaxed(segment, MB_OFF_BUSY_NS, 0);
    store_relaxed(segment, MB_OFF_LAST_BUSY_NS, 0);
    store_relaxed(segment, MB_OFF_WORKER_PID, (int64_t)getpid());
    atomic_store_explicit(word_at(segment, MB_OFF_WORKER_STATE), MB_STATE_WAITING, memory_order_release);
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
        store_relaxed(segment, MB_OFF_WORKER_STATE, MB_STATE_DETACHED);
        snprintf(message, (size_t)message_bytes, "pthread_create failed");
        worker_free(w);
        return NULL;
    }
    return w;
no_memory:
    snprintf(message, (size_t)message_bytes, "out of memory");
    worker_free(w);
    return NULL;
}

/* Sets the stop word, joins the thread, frees the handle; out[0] layers served, out[1] layers failed. */
void moemesh_mailbox_stop(void *handle, int64_t *out) {
    mb_worker *w = (mb_worker *)handle;
    atomic_store_explicit(word_at(w->segment, MB_OFF_STOP), 1, memory_order_release);
    pthread_join(w->thread, NULL);
    out[0] = w->served;
    out[1] = w->failed;
    worker_free(w);
}
