/* FP4 (e2m1 + ue8m0 per 32 inputs) routed experts on the CPU: decode fused with the matmul.
 *
 * Built at first use by common/kernels/cpu_fp4.py (cc -O3 -march=native -fopenmp -shared -fPIC) and
 * called through ctypes; the torch references and the tests are beside it (cpu_fp4.py,
 * tests/test_kernels_cpu_fp4.py).
 *
 * Format (spec dsv4-model.md section 4.3): packed [N, K/2] bytes, low nibble = even column 2j, high
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

#define FP4_BLOCK 32   /* inputs per ue8m0 scale */
#define ROW_TILE 4     /* weight rows per register tile */
#define TOKEN_TILE 4   /* tokens per register tile */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define VEC_LANES 16
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VEC_LANES 8
#define ISA_NAME "avx2"
#else
#define VEC_LANES 1
#define ISA_NAME "scalar"
#endif
#define PERM_GROUP (2 * VEC_LANES) /* columns per even/odd group of the permuted activations */

static const float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
static float scale_table[256]; /* ue8m0 byte -> 2^(byte - 127); 255 -> NaN (as float8_e8m0fnu) */
static float code_table[16];   /* e2m1 code -> value, sign in bit 3 */

void moemesh_fp4_init(void) {
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

/* ------------------------------------------------------------------ activations */

/* Position of column k in the permuted order (within its group: evens first, then odds). */
ALWAYS_INLINE int64_t perm_index(int64_t k) {
    int64_t base = k - k % PERM_GROUP, j = k % PERM_GROUP;
    return base + (j & 1) * VEC_LANES + (j >> 1);
}

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

/* ------------------------------------------------------------------ the register tile */

/* acc[r][t] = sum_k xp[t][k] * W_r[k] for nr rows (wrows/srows) and nt tokens (xp rows ldx apart). */
ALWAYS_INLINE void tile_body(const float *xp, int64_t ldx, const int nt, const uint8_t *const *wrows,
                             const uint8_t *const *srows, const int nr, int64_t num_in,
                             float acc_out[ROW_TILE][TOKEN_TILE]) {
    const int64_t num_blocks = num_in / FP4_BLOCK;
#if VEC_LANES == 16
    const __m512 table = _mm512_loadu_ps(code_table);
    __m512 acc[ROW_TILE][TOKEN_TILE];
    for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
        __m512 wlo[ROW_TILE], whi[ROW_TILE];
        for (int r = 0; r < nr; ++r) {
            __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wrows[r] + 16 * b)));
            __m512 scaled = _mm512_mul_ps(table, _mm512_set1_ps(scale_table[srows[r][b]]));  /* exact */
            wlo[r] = _mm512_permutexvar_ps(codes, scaled);  /* uses the low 4 bits: the low nibble */
            whi[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), scaled);
        }
        for (int t = 0; t < nt; ++t) {
            const __m512 xlo = _mm512_loadu_ps(xp + t * ldx + FP4_BLOCK * b);
            const __m512 xhi = _mm512_loadu_ps(xp + t * ldx + FP4_BLOCK * b + 16);
            for (int r = 0; r < nr; ++r) {
                acc[r][t] = _mm512_fmadd_ps(wlo[r], xlo, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(whi[r], xhi, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) acc_out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#elif VEC_LANES == 8
    const __m256 magnitudes = _mm256_loadu_ps(kMagnitudes);
    const __m256i sign_bit = _mm256_set1_epi32((int)0x80000000u);
    __m256 acc[ROW_TILE][TOKEN_TILE];
    for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) acc[r][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < num_blocks; ++b) {
        __m256 w[ROW_TILE][4]; /* per 16 columns: evens (low nibbles), odds (high nibbles) */
        for (int r = 0; r < nr; ++r) {
            const __m256 scaled = _mm256_mul_ps(magnitudes, _mm256_set1_ps(scale_table[srows[r][b]]));
            for (int h = 0; h < 2; ++h) {
                __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wrows[r] + 16 * b + 8 * h)));
                __m256i hi = _mm256_srli_epi32(codes, 4);
                /* magnitude from bits 0-2 (permutevar uses the low 3 bits), sign from bit 3 */
                __m256 lo_mag = _mm256_permutevar8x32_ps(scaled, codes);
                __m256 hi_mag = _mm256_permutevar8x32_ps(scaled, hi);
                __m256i lo_sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), sign_bit);
                __m256i hi_sign = _mm256_and_si256(_mm256_slli_epi32(codes, 24), sign_bit);
                w[r][2 * h] = _mm256_xor_ps(lo_mag, _mm256_castsi256_ps(lo_sign));
                w[r][2 * h + 1] = _mm256_xor_ps(hi_mag, _mm256_castsi256_ps(hi_sign));
            }
        }
        for (int t = 0; t < nt; ++t) {
            const float *xb = xp + t * ldx + FP4_BLOCK * b;
            for (int q = 0; q < 4; ++q) {
                const __m256 xq = _mm256_loadu_ps(xb + 8 * q);
                for (int r = 0; r < nr; ++r) acc[r][t] = _mm256_fmadd_ps(w[r][q], xq, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][t]), _mm256_extractf128_ps(acc[r][t], 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            s = _mm_add_ss(s, _mm_movehdup_ps(s));
            acc_out[r][t] = _mm_cvtss_f32(s);
        }
#else
    for (int r = 0; r < nr; ++r)
        for (int t = 0; t < nt; ++t) acc_out[r][t] = 0.0f;
    for (int64_t b = 0; b < num_blocks; ++b) {
        for (int r = 0; r < nr; ++r) {
            const float scale = scale_table[srows[r][b]];
            for (int j = 0; j < FP4_BLOCK / 2; ++j) {
                const uint8_t byte = wrows[r][16 * b + j];
                const float lo = code_table[byte & 15] * scale, hi = code_table[byte >> 4] * scale;
                for (int t = 0; t < nt; ++t) {
                    const float *xb = xp + t * ldx + FP4_BLOCK * b + 2 * j; /* PERM_GROUP 2: identity */
                    acc_out[r][t] += lo * xb[0] + hi * xb[1];
                }
            }
        }
    }
#endif
}

#define TILE_CASE(NR, NT) \
    case (NR) * 8 + (NT): tile_body(xp, ldx, NT, wrows, srows, NR, num_in, acc); break;

/* The tile with nr, nt known at compile time (so the accumulators stay in registers). */
static void tile(const float *xp, int64_t ldx, int nt, const uint8_t *const *wrows, const uint8_t *const *srows,
                 int nr, int64_t num_in, float acc[ROW_TILE][TOKEN_TILE]) {
    switch (nr * 8 + nt) {
        TILE_CASE(1, 1) TILE_CASE(1, 2) TILE_CASE(1, 3) TILE_CASE(1, 4)
        TILE_CASE(2, 1) TILE_CASE(2, 2) TILE_CASE(2, 3) TILE_CASE(2, 4)
        TILE_CASE(3, 1) TILE_CASE(3, 2) TILE_CASE(3, 3) TILE_CASE(3, 4)
        TILE_CASE(4, 1) TILE_CASE(4, 2) TILE_CASE(4, 3) TILE_CASE(4, 4)
        default: break;
    }
}

static float *alloc_floats(int64_t count) {
    size_t bytes = (size_t)(count > 0 ? count : 1) * sizeof(float);
    bytes = (bytes + 63) / 64 * 64;
    return (float *)aligned_alloc(64, bytes);
}

/* ------------------------------------------------------------------ one linear */

/* out [T, N] fp32 = x [T, K] (fp32 or bf16, row-major) @ dequant(packed [N, K/2], scales [N, K/32])^T.
 * Returns 0, or 1 when the scratch allocation failed, 2 when K is not a multiple of 32. */
int moemesh_fp4_linear(const void *x, int x_is_bf16, int64_t num_tokens, int64_t num_in, const uint8_t *packed,
                       const uint8_t *scales, int64_t num_out, float *out, int num_threads) {
    if (num_in % FP4_BLOCK) return 2;
    float *xp = alloc_floats(num_tokens * num_in);
    if (!xp) return 1;
    const int64_t num_tiles = (num_out + ROW_TILE - 1) / ROW_TILE;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) permute_row(xp + t * num_in, x, x_is_bf16, t * num_in, num_in);
#pragma omp for schedule(static)
        for (int64_t tile_index = 0; tile_index < num_tiles; ++tile_index) {
            const int64_t n0 = tile_index * ROW_TILE;
            const int nr = (int)(num_out - n0 < ROW_TILE ? num_out - n0 : ROW_TILE);
            const uint8_t *wrows[ROW_TILE], *srows[ROW_TILE];
            for (int r = 0; r < nr; ++r) {
                wrows[r] = packed + (n0 + r) * (num_in / 2);
                srows[r] = scales + (n0 + r) * (num_in / FP4_BLOCK);
            }
            for (int64_t t0 = 0; t0 < num_tokens; t0 += TOKEN_TILE) {
                const int nt = (int)(num_tokens - t0 < TOKEN_TILE ? num_tokens - t0 : TOKEN_TILE);
                float acc[ROW_TILE][TOKEN_TILE];
                tile(xp + t0 * num_in, num_in, nt, wrows, srows, nr, num_in, acc);
                for (int t = 0; t < nt; ++t)
                    for (int r = 0; r < nr; ++r) out[(t0 + t) * num_out + n0 + r] = acc[r][t];
            }
        }
    }
    free(xp);
    return 0;
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

/* Every selected row of one layer through its expert, in one parallel region with two phases:
 * (1) gate/up: tiles of 2 rows of w1 and the same 2 rows of w3 over every group's rows, SwiGLU in
 *     the epilogue, written permuted into act [R, I]; (2) down: tiles of 4 rows of w2 into out.
 * Groups (one per expert with rows) are rows group_offsets[g] .. group_offsets[g+1] of the selection,
 * stack index group_stack[g] into the stacked weights (w*_stride / s*_stride bytes apart). Row r reads
 * hidden[row_tokens[r]] (fp32 or bf16, D wide) and writes out[row_dest[r]] (fp32, D wide), multiplied
 * by row_weights[r] before w2 (route_before_w2) or after. Work within a phase is split over (group,
 * tile) pairs, so a call over several experts has two barriers in all, not two per expert.
 * Returns 0, 1 when scratch allocation failed, 2 when D or I is not a multiple of 32. */
int moemesh_fp4_experts(const void *hidden, int hidden_is_bf16, int64_t hidden_size, int64_t inter_size,
                        int64_t num_groups, const int64_t *group_offsets, const int64_t *group_stack,
                        const int64_t *row_tokens, const float *row_weights, const int64_t *row_dest,
                        const uint8_t *w1, const uint8_t *s1, const uint8_t *w3, const uint8_t *s3,
                        int64_t w13_stride, int64_t s13_stride, const uint8_t *w2, const uint8_t *s2,
                        int64_t w2_stride, int64_t s2_stride, int has_limit, float swiglu_limit,
                        int route_before_w2, float *out, int num_threads) {
    const int64_t D = hidden_size, I = inter_size;
    if (D % FP4_BLOCK || I % FP4_BLOCK) return 2;
    const int64_t num_rows = group_offsets[num_groups] - group_offsets[0];
    const int64_t row_base = group_offsets[0];
    float *xp = alloc_floats(num_rows * D);
    float *act = alloc_floats(num_rows * I);
    if (!xp || !act) {
        free(xp);
        free(act);
        return 1;
    }
    const int64_t up_tiles = (I + 1) / 2, down_tiles = (D + ROW_TILE - 1) / ROW_TILE;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; ++r)
            permute_row(xp + r * D, hidden, hidden_is_bf16, row_tokens[row_base + r] * D, D);

#pragma omp for schedule(dynamic, 8)
        for (int64_t item = 0; item < num_groups * up_tiles; ++item) {
            const int64_t g = item / up_tiles, i0 = 2 * (item % up_tiles);
            const int half = (int)(I - i0 < 2 ? I - i0 : 2);
            const uint8_t *wrows[ROW_TILE], *srows[ROW_TILE];
            for (int h = 0; h < half; ++h) {
                wrows[h] = w1 + group_stack[g] * w13_stride + (i0 + h) * (D / 2);
                srows[h] = s1 + group_stack[g] * s13_stride + (i0 + h) * (D / FP4_BLOCK);
                wrows[half + h] = w3 + group_stack[g] * w13_stride + (i0 + h) * (D / 2);
                srows[half + h] = s3 + group_stack[g] * s13_stride + (i0 + h) * (D / FP4_BLOCK);
            }
            const int64_t begin = group_offsets[g] - row_base, end = group_offsets[g + 1] - row_base;
            for (int64_t t0 = begin; t0 < end; t0 += TOKEN_TILE) {
                const int nt = (int)(end - t0 < TOKEN_TILE ? end - t0 : TOKEN_TILE);
                float acc[ROW_TILE][TOKEN_TILE];
                tile(xp + t0 * D, D, nt, wrows, srows, 2 * half, D, acc);
                for (int t = 0; t < nt; ++t)
                    for (int h = 0; h < half; ++h) {
                        float value = swiglu(acc[h][t], acc[half + h][t], has_limit, swiglu_limit);
                        if (route_before_w2) value *= row_weights[row_base + t0 + t];
                        act[(t0 + t) * I + perm_index(i0 + h)] = value;
                    }
            }
        }
        /* implicit barrier: every act row is complete */

#pragma omp for schedule(dynamic, 8)
        for (int64_t item = 0; item < num_groups * down_tiles; ++item) {
            const int64_t g = item / down_tiles, n0 = ROW_TILE * (item % down_tiles);
            const int nr = (int)(D - n0 < ROW_TILE ? D - n0 : ROW_TILE);
            const uint8_t *wrows[ROW_TILE], *srows[ROW_TILE];
            for (int r = 0; r < nr; ++r) {
                wrows[r] = w2 + group_stack[g] * w2_stride + (n0 + r) * (I / 2);
                srows[r] = s2 + group_stack[g] * s2_stride + (n0 + r) * (I / FP4_BLOCK);
            }
            const int64_t begin = group_offsets[g] - row_base, end = group_offsets[g + 1] - row_base;
            for (int64_t t0 = begin; t0 < end; t0 += TOKEN_TILE) {
                const int nt = (int)(end - t0 < TOKEN_TILE ? end - t0 : TOKEN_TILE);
                float acc[ROW_TILE][TOKEN_TILE];
                tile(act + t0 * I, I, nt, wrows, srows, nr, I, acc);
                for (int t = 0; t < nt; ++t) {
                    const int64_t row = row_base + t0 + t;
                    const float route = route_before_w2 ? 1.0f : row_weights[row];
                    for (int r = 0; r < nr; ++r) {
                        float value = acc[r][t];
                        out[row_dest[row] * D + n0 + r] = route_before_w2 ? value : value * route;
                    }
                }
            }
        }
    }
    free(xp);
    free(act);
    return 0;
}
