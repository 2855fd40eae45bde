/* FP4 (e2m1 + ue8m0 per 32 inputs) routed experts on the CPU: decode fused with the matmul.
 *
 * Built at first use by common/kernels/cpu_fp4_build.py (cc -O3 -march=native -fopenmp -shared -fPIC)
 * and called through ctypes from cpu_fp4.py, where the torch references are; tests in
 * tests/test_kernels_cpu_fp4.py. Parts: cpu_fp4_tile.h (the per-ISA register tile), cpu_fp4_pool.h
 * (the work-claiming thread pool), this file (activations, the linear and the experts drivers).
 *
 * Format (docs/model.md section 4.3): packed [N, K/2] bytes, low nibble = even column 2j, high
 * nibble = odd column 2j+1; scale [N, K/32] ue8m0 bytes; W[n, k] = LUT[code] * 2^(scale - 127) with
 * LUT = {0, .5, 1, 1.5, 2, 3, 4, 6} and codes 8..15 their negatives. K is a multiple of 32.
 *
 * Values: each weight is decoded to exactly the reference's fp32 value (an e2m1 value times a power
 * of two is exact, denormals included), and products are summed in fp32, so results differ from the
 * torch reference only by summation order.
 *
 * Layout trick: the decode yields the low nibbles of a run of bytes in one vector and the high nibbles
 * in another, i.e. the even columns and the odd columns. Instead of interleaving the decoded weights
 * (shuffles per block and per row), the activations are permuted once per call into the same order:
 * within each group of 2*VEC_LANES columns, the even columns first, then the odd ones ("xp" below).
 * One permutation of T x K activations replaces N x K/32 shuffles.
 *
 * Tiles: up to ROW_TILE weight rows x TOKEN_TILE tokens are accumulated in registers over the whole K;
 * a decoded block of weights is used for every token of the tile while in registers, and a loaded
 * block of activations for every row of the tile.
 *
 * Legend: T tokens (rows of x), K inputs, N outputs, R selected rows of a layer, D hidden, I expert width.
 */
#define _GNU_SOURCE /* syscall (futex), clock_gettime under -std=c11 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_fp4_pool.h"
#include "cpu_fp4_tile.h"

static pthread_once_t init_once = PTHREAD_ONCE_INIT;

void moemesh_fp4_init(void) {
    pthread_once(&init_once, pool_init_once);
    for (int s = 0; s < 255; ++s) scale_table[s] = ldexpf(1.0f, s - 127);
    scale_table[255] = NAN;
    for (int c = 0; c < 8; ++c) {
        code_table[c] = kMagnitudes[c];
        code_table[c + 8] = -kMagnitudes[c];
    }
}

const char *moemesh_fp4_isa(void) { return ISA_NAME; }

int moemesh_fp4_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int moemesh_fp4_perm_group(void) { return PERM_GROUP; }

/* How long an idle pool worker polls for the next call before it sleeps on a futex (a sleeping worker
 * joins a call some microseconds late; a polling one burns its core meanwhile). */
void moemesh_fp4_set_idle_ns(int64_t idle_ns) {
    atomic_store_explicit(&g_pool_idle_ns, idle_ns > 0 ? idle_ns : 0, memory_order_relaxed);
}

/* ------------------------------------------------------------------ activations */

ALWAYS_INLINE float load_act(const void *x, int is_bf16, int64_t i) {
    if (!is_bf16) return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* dst [K] (permuted fp32) <- src row (fp32 or bf16) */
static void permute_row(float *dst, const void *src, int is_bf16, int64_t src_offset, int64_t num_in) {
    for (int64_t k = 0; k < num_in; ++k) dst[perm_index(k)] = load_act(src, is_bf16, src_offset + k);
}

/* ------------------------------------------------------------------ executors */

enum { EXECUTOR_POOL = 0, EXECUTOR_OPENMP = 1 };

/* Runs chunk_fn over every chunk of every phase (phases in order) on num_threads threads. */
static int execute(int executor, pool_chunk_fn chunk_fn, const void *job, int num_phases, const int64_t *phase_chunks,
                   int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (executor == EXECUTOR_OPENMP) {
#pragma omp parallel num_threads(num_threads)
        for (int phase = 0; phase < num_phases; ++phase) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t chunk = 0; chunk < phase_chunks[phase]; ++chunk) chunk_fn(job, phase, chunk);
        }
        return 0;
    }
    return pool_run(chunk_fn, job, num_phases, phase_chunks, num_threads);
}

/* Tiles per chunk: enough chunks that threads balance (~8 per thread), few enough that claims are rare. */
static int64_t tiles_per_chunk(int64_t num_tiles, int num_threads) {
    int64_t per = num_tiles / (8 * (int64_t)(num_threads > 0 ? num_threads : 1));
    return per < 1 ? 1 : (per > 8 ? 8 : per);
}

static float *alloc_floats(int64_t count) {
    size_t bytes = (size_t)(count > 0 ? count : 1) * sizeof(float);
    bytes = (bytes + 63) / 64 * 64;
    return (float *)aligned_alloc(64, bytes);
}

/* ------------------------------------------------------------------ one linear */

typedef struct {
    const void *x;
    int x_is_bf16;
    int64_t num_tokens, num_in, num_out, tiles_per_chunk;
    const uint8_t *packed, *scales;
    float *xp, *out;
} linear_job;

static void linear_chunk(const void *arg, int phase, int64_t chunk) {
    const linear_job *job = (const linear_job *)arg;
    const int64_t K = job->num_in, N = job->num_out;
    if (phase == 0) { /* one activation row */
        permute_row(job->xp + chunk * K, job->x, job->x_is_bf16, chunk * K, K);
        return;
    }
    const int64_t num_tiles = (N + ROW_TILE - 1) / ROW_TILE;
    const int64_t first = chunk * job->tiles_per_chunk;
    const int64_t last = first + job->tiles_per_chunk < num_tiles ? first + job->tiles_per_chunk : num_tiles;
    for (int64_t tile_index = first; tile_index < last; ++tile_index) {
        const int64_t n0 = tile_index * ROW_TILE;
        const int nr = (int)(N - n0 < ROW_TILE ? N - n0 : ROW_TILE);
        const uint8_t *wrows[ROW_TILE], *srows[ROW_TILE];
        for (int r = 0; r < nr; ++r) {
            wrows[r] = job->packed + (n0 + r) * (K / 2);
            srows[r] = job->scales + (n0 + r) * (K / FP4_BLOCK);
        }
        for (int64_t t0 = 0; t0 < job->num_tokens; t0 += TOKEN_TILE) {
            const int nt = (int)(job->num_tokens - t0 < TOKEN_TILE ? job->num_tokens - t0 : TOKEN_TILE);
            float acc[ROW_TILE][TOKEN_TILE];
            tile(job->xp + t0 * K, K, nt, wrows, srows, nr, K, acc);
            for (int t = 0; t < nt; ++t)
                for (int r = 0; r < nr; ++r) job->out[(t0 + t) * N + n0 + r] = acc[r][t];
        }
    }
}

/* out [T, N] fp32 = x [T, K] (fp32 or bf16, row-major) @ dequant(packed [N, K/2], scales [N, K/32])^T.
 * executor: 0 = the work-claiming pool (cpu_fp4_pool.h), 1 = OpenMP.
 * Returns 0, 1 when the scratch allocation failed, 2 when K is not a multiple of 32, 3 when too large. */
int moemesh_fp4_linear(const void *x, int x_is_bf16, int64_t num_tokens, int64_t num_in, const uint8_t *packed,
                       const uint8_t *scales, int64_t num_out, float *out, int num_threads, int executor) {
    if (num_in % FP4_BLOCK) return 2;
    linear_job job = {x, x_is_bf16, num_tokens, num_in, num_out, 1, packed, scales, alloc_floats(num_tokens * num_in),
                      out};
    if (!job.xp) return 1;
    const int64_t num_tiles = (num_out + ROW_TILE - 1) / ROW_TILE;
    job.tiles_per_chunk = tiles_per_chunk(num_tiles, num_threads);
    const int64_t phase_chunks[2] = {num_tokens, (num_tiles + job.tiles_per_chunk - 1) / job.tiles_per_chunk};
    const int status = execute(executor, linear_chunk, &job, 2, phase_chunks, num_threads);
    free(job.xp);
    return status;
}

/* ------------------------------------------------------------------ a layer's experts */

/* The SwiGLU of the routed experts (spec section 2.9): silu(min(gate, limit)) * clamp(up, -limit, limit). */
ALWAYS_INLINE float swiglu(float gate, float up, int has_limit, float limit) {
    if (has_limit) {
        gate = gate < limit ? gate : limit;
        up = up < -limit ? -limit : (up > limit ? limit : up);
    }
    return gate / (1.0f + expf(-gate)) * up;
}

typedef struct {
    const void *hidden;
    int hidden_is_bf16, has_limit, route_before_w2;
    float swiglu_limit;
    int64_t D, I, num_groups, row_base, tiles_per_chunk[2];
    const int64_t *group_offsets, *group_stack, *row_tokens, *row_dest;
    const float *row_weights;
    const uint8_t *w1, *s1, *w3, *s3, *w2, *s2;
    int64_t w13_stride, s13_stride, w2_stride, s2_stride;
    float *xp, *act, *out;
} experts_job;

/* Gate/up tile `item` (group, 2 rows of w1 and the same 2 rows of w3): SwiGLU into act (permuted). */
static void gate_up_item(const experts_job *job, int64_t item) {
    const int64_t D = job->D, I = job->I, up_tiles = (I + 1) / 2;
    const int64_t g = item / up_tiles, i0 = 2 * (item % up_tiles);
    const int half = (int)(I - i0 < 2 ? I - i0 : 2);
    const uint8_t *wrows[ROW_TILE], *srows[ROW_TILE];
    for (int h = 0; h < half; ++h) {
        wrows[h] = job->w1 + job->group_stack[g] * job->w13_stride + (i0 + h) * (D / 2);
        srows[h] = job->s1 + job->group_stack[g] * job->s13_stride + (i0 + h) * (D / FP4_BLOCK);
        wrows[half + h] = job->w3 + job->group_stack[g] * job->w13_stride + (i0 + h) * (D / 2);
        srows[half + h] = job->s3 + job->group_stack[g] * job->s13_stride + (i0 + h) * (D / FP4_BLOCK);
    }
    const int64_t begin = job->group_offsets[g] - job->row_base, end = job->group_offsets[g + 1] - job->row_base;
    for (int64_t t0 = begin; t0 < end; t0 += TOKEN_TILE) {
        const int nt = (int)(end - t0 < TOKEN_TILE ? end - t0 : TOKEN_TILE);
        float acc[ROW_TILE][TOKEN_TILE];
        tile(job->xp + t0 * D, D, nt, wrows, srows, 2 * half, D, acc);
        for (int t = 0; t < nt; ++t)
            for (int h = 0; h < half; ++h) {
                float value = swiglu(acc[h][t], acc[half + h][t], job->has_limit, job->swiglu_limit);
                if (job->route_before_w2) value *= job->row_weights[job->row_base + t0 + t];
                job->act[(t0 + t) * I + perm_index(i0 + h)] = value;
            }
    }
}

/* Down tile `item` (group, 4 rows of w2) into out, route weight after w2 unless applied before. */
static void down_item(const experts_job *job, int64_t item) {
    const int64_t D = job->D, I = job->I, down_tiles = (D + ROW_TILE - 1) / ROW_TILE;
    const int64_t g = item / down_tiles, n0 = ROW_TILE * (item % down_tiles);
    const int nr = (int)(D - n0 < ROW_TILE ? D - n0 : ROW_TILE);
    const uint8_t *wrows[ROW_TILE], *srows[ROW_TILE];
    for (int r = 0; r < nr; ++r) {
        wrows[r] = job->w2 + job->group_stack[g] * job->w2_stride + (n0 + r) * (I / 2);
        srows[r] = job->s2 + job->group_stack[g] * job->s2_stride + (n0 + r) * (I / FP4_BLOCK);
    }
    const int64_t begin = job->group_offsets[g] - job->row_base, end = job->group_offsets[g + 1] - job->row_base;
    for (int64_t t0 = begin; t0 < end; t0 += TOKEN_TILE) {
        const int nt = (int)(end - t0 < TOKEN_TILE ? end - t0 : TOKEN_TILE);
        float acc[ROW_TILE][TOKEN_TILE];
        tile(job->act + t0 * I, I, nt, wrows, srows, nr, I, acc);
        for (int t = 0; t < nt; ++t) {
            const int64_t row = job->row_base + t0 + t;
            const float route = job->route_before_w2 ? 1.0f : job->row_weights[row];
            for (int r = 0; r < nr; ++r) job->out[job->row_dest[row] * D + n0 + r] = acc[r][t] * route;
        }
    }
}

static void experts_chunk(const void *arg, int phase, int64_t chunk) {
    const experts_job *job = (const experts_job *)arg;
    if (phase == 0) { /* one selected row's activations */
        permute_row(job->xp + chunk * job->D, job->hidden, job->hidden_is_bf16,
                    job->row_tokens[job->row_base + chunk] * job->D, job->D);
        return;
    }
    const int64_t num_items = job->num_groups * (phase == 1 ? (job->I + 1) / 2 : (job->D + ROW_TILE - 1) / ROW_TILE);
    const int64_t per = job->tiles_per_chunk[phase - 1], first = chunk * per;
    const int64_t last = first + per < num_items ? first + per : num_items;
    for (int64_t item = first; item < last; ++item) {
        if (phase == 1) gate_up_item(job, item);
        else down_item(job, item);
    }
}

/* Every selected row of one layer through its expert, in three phases: (0) activations gathered and
 * permuted; (1) gate/up: tiles of 2 rows of w1 and the same 2 rows of w3 over every group's rows, SwiGLU
 * in the epilogue, written permuted into act [R, I]; (2) down: tiles of 4 rows of w2 into out.
 * Groups (one per expert with rows) are rows group_offsets[g] .. group_offsets[g+1] of the selection,
 * stack index group_stack[g] into the stacked weights (w*_stride / s*_stride bytes apart). Row r reads
 * hidden[row_tokens[r]] (fp32 or bf16, D wide) and writes out[row_dest[r]] (fp32, D wide), multiplied
 * by row_weights[r] before w2 (route_before_w2) or after. Work within a phase is split over (group,
 * tile) pairs, so a call over several experts waits between phases twice in all, not twice per expert.
 * executor: 0 = the work-claiming pool, 1 = OpenMP.
 * Returns 0, 1 when scratch allocation failed, 2 when D or I is not a multiple of 32, 3 when too large. */
int moemesh_fp4_experts(const void *hidden, int hidden_is_bf16, int64_t hidden_size, int64_t inter_size,
                        int64_t num_groups, const int64_t *group_offsets, const int64_t *group_stack,
                        const int64_t *row_tokens, const float *row_weights, const int64_t *row_dest,
                        const uint8_t *w1, const uint8_t *s1, const uint8_t *w3, const uint8_t *s3,
                        int64_t w13_stride, int64_t s13_stride, const uint8_t *w2, const uint8_t *s2,
                        int64_t w2_stride, int64_t s2_stride, int has_limit, float swiglu_limit,
                        int route_before_w2, float *out, int num_threads, int executor) {
    const int64_t D = hidden_size, I = inter_size;
    if (D % FP4_BLOCK || I % FP4_BLOCK) return 2;
    const int64_t num_rows = group_offsets[num_groups] - group_offsets[0];
    experts_job job = {hidden, hidden_is_bf16, has_limit, route_before_w2, swiglu_limit, D, I, num_groups,
                       group_offsets[0], {1, 1}, group_offsets, group_stack, row_tokens, row_dest, row_weights,
                       w1, s1, w3, s3, w2, s2, w13_stride, s13_stride, w2_stride, s2_stride,
                       alloc_floats(num_rows * D), alloc_floats(num_rows * I), out};
    if (!job.xp || !job.act) {
        free(job.xp);
        free(job.act);
        return 1;
    }
    const int64_t up_items = num_groups * ((I + 1) / 2), down_items = num_groups * ((D + ROW_TILE - 1) / ROW_TILE);
    job.tiles_per_chunk[0] = tiles_per_chunk(up_items, num_threads);
    job.tiles_per_chunk[1] = tiles_per_chunk(down_items, num_threads);
    const int64_t phase_chunks[3] = {num_rows, (up_items + job.tiles_per_chunk[0] - 1) / job.tiles_per_chunk[0],
                                     (down_items + job.tiles_per_chunk[1] - 1) / job.tiles_per_chunk[1]};
    const int status = execute(executor, experts_chunk, &job, 3, phase_chunks, num_threads);
    free(job.xp);
    free(job.act);
    return status;
}

/* moemesh_fp4_experts with the grouping done here, from the routing of T tokens x K slots: ids and
 * weights [T*K] (slot t*K + k), slot_mask [T*K] bytes (NULL: every slot), local [num_routed] global
 * expert id -> stack index. Groups come in ascending expert id, each expert's slots ascending (the
 * reference's order); row r of a group reads hidden[slot / K] and writes out[slot]. Doing this in C
 * saves ~10 small torch ops (~0.1 ms) per call, which matters when a call has one or two experts.
 * Returns as moemesh_fp4_experts, or 4 when a selected id is outside 0..num_routed-1. */
int moemesh_fp4_experts_routed(const void *hidden, int hidden_is_bf16, int64_t hidden_size, int64_t inter_size,
                               int64_t num_tokens, int64_t top_k, const int64_t *ids, const float *weights,
                               const uint8_t *slot_mask, const int64_t *local, int64_t num_routed,
                               const uint8_t *w1, const uint8_t *s1, const uint8_t *w3, const uint8_t *s3,
                               int64_t w13_stride, int64_t s13_stride, const uint8_t *w2, const uint8_t *s2,
                               int64_t w2_stride, int64_t s2_stride, int has_limit, float swiglu_limit,
                               int route_before_w2, float *out, int num_threads, int executor) {
    const int64_t num_slots = num_tokens * top_k;
    int64_t *position = (int64_t *)calloc((size_t)num_routed + 1, sizeof(int64_t)); /* count, then next row */
    int64_t *rows = (int64_t *)malloc(((size_t)3 * num_slots + 2 * (size_t)num_routed + 2) * sizeof(int64_t));
    float *row_weights = alloc_floats(num_slots);
    if (!position || !rows || !row_weights) {
        free(position);
        free(rows);
        free(row_weights);
        return 1;
    }
    int status = 0;
    for (int64_t s = 0; s < num_slots; ++s) {
        if (slot_mask && !slot_mask[s]) continue;
        if (ids[s] < 0 || ids[s] >= num_routed) {
            status = 4;
            break;
        }
        ++position[ids[s]];
    }
    if (status == 0) {
        int64_t *row_tokens = rows, *row_dest = rows + num_slots, *group_offsets = rows + 2 * num_slots;
        int64_t *group_stack = group_offsets + num_routed + 1, num_groups = 0, running = 0;
        for (int64_t e = 0; e < num_routed; ++e) {
            const int64_t count = position[e];
            if (!count) continue;
            group_offsets[num_groups] = running;
            group_stack[num_groups++] = local[e];
            position[e] = running;
            running += count;
        }
        group_offsets[num_groups] = running;
        for (int64_t s = 0; s < num_slots; ++s) {
            if (slot_mask && !slot_mask[s]) continue;
            const int64_t r = position[ids[s]]++;
            row_tokens[r] = s / top_k;
            row_dest[r] = s;
            row_weights[r] = weights[s];
        }
        if (num_groups)
            status = moemesh_fp4_experts(hidden, hidden_is_bf16, hidden_size, inter_size, num_groups, group_offsets,
                                         group_stack, row_tokens, row_weights, row_dest, w1, s1, w3, s3, w13_stride,
                                         s13_stride, w2, s2, w2_stride, s2_stride, has_limit, swiglu_limit,
                                         route_before_w2, out, num_threads, executor);
    }
    free(position);
    free(rows);
    free(row_weights);
    return status;
}
