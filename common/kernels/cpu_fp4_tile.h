/* cpu_fp4.c's register tile: e2m1 decode fused with the FMAs, per ISA (AVX-512, AVX2+FMA, scalar).
 *
 * acc[r][t] = sum_k xp[t][k] * W_r[k] over a whole row, for up to ROW_TILE weight rows and TOKEN_TILE
 * tokens, accumulators in registers. Decoding: the 16 bytes of a 32-input block are widened to one
 * 32-bit lane per byte; a permute by the low bits of each lane looks the code up in a 16-entry (AVX-512)
 * or 8-entry magnitude table (AVX2, sign from bit 3 by shift and xor) that was multiplied by the block's
 * ue8m0 factor first (exact: a power of two). Low nibbles give the even columns, high nibbles (after a
 * shift by 4) the odd ones, which is why activations come permuted (see perm_index in cpu_fp4.c).
 * Included once, by cpu_fp4.c.
 */
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

/* Position of column k in the permuted order (within its group: evens first, then odds). */
ALWAYS_INLINE int64_t perm_index(int64_t k) {
    int64_t base = k - k % PERM_GROUP, j = k % PERM_GROUP;
    return base + (j & 1) * VEC_LANES + (j >> 1);
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
