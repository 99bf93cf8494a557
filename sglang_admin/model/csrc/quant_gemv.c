/* Few-row projections on weights kept quantized, bfloat16 activations (AVX512_BF16).
 *
 * The weights are laid out for the instruction (sglang_admin/model/quant/lut_gemv.py packs
 * them): 16 output rows side by side, so that each of a vector's 16 float32 lanes sums one
 * row. For two inputs k, k+1 (a "pair"), a 32-byte load holds the 16 rows' codes of the
 * pair; the codes (4 bits each) index a 16-entry table of bfloat16 values with vpermw, and
 * vdpbf16ps multiplies the table's values with the input pair broadcast to every lane
 * (bfloat16 products are exact in float32; the sums are float32). The scales apply once
 * per group of 32 inputs: one vector holds the 16 rows' scales.
 *
 * - int4 (GGUF Q4_0 / Q4_1 / Q4_K): w = (q - 8) * scale + zero, per group of 32 inputs,
 *   scale and zero in bfloat16 (the values torch's int4 kernel multiplies with). No table:
 *   a code placed in a bfloat16 mantissa is 1 + q / 16 (q4_gemv_bf16), the sums of x per
 *   group computed once per call. One 64-byte chunk holds four pairs of 16 rows.
 * - int8 in blocks of 32 (GGUF Q8_0): w = q * d, d the block's float16 scale as stored.
 *   The code u = q + 128 = 16 h + l splits into two 4-bit halves: q = 16 (h - 8) + l, two
 *   tables (16 (h - 8) and l, exact in bfloat16). One 32-byte chunk holds one pair of
 *   16 rows. Output float32 (the LM head's logits).
 *
 * Rows of the activations (M, a few) are computed from the same weights while they are in
 * the L1 cache; row blocks are spread over the OpenMP team (torch's: the library binds
 * to the libgomp torch has loaded).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LUT_GEMV 1
#include <immintrin.h>
#endif

int lut_gemv_applies(void) {
#ifdef LUT_GEMV
    return 1;
#else
    return 0;
#endif
}

#ifdef LUT_GEMV

/* blocks x inputs below which one thread computes it all (a team's start costs more) */
#define PARALLEL_MIN (16 * 1024)

static inline __m512 bf16x16_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512i lut16(const int16_t *bf16_bits) {
    /* a 32-entry vpermw table whose first 16 entries are the given bfloat16 values */
    return _mm512_inserti64x4(_mm512_castsi256_si512(
        _mm256_loadu_si256((const __m256i *)bf16_bits)), _mm256_setzero_si256(), 1);
}

static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* the table's values are exact in bfloat16 */
}

static inline __mmask16 valid_lanes(int64_t valid) {
    return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
}

#endif

/* x: bfloat16 [M, K] (row stride xs elements); w: uint16 [N16 / 16, K / 8, 32]; sz: bfloat16
 * [N16 / 16, K / 32, 2, 16] (scales, then zeros); out: bfloat16 [M, N] (row stride os).
 * Word 2j + e of chunk c holds row j's codes of inputs 8c + 2t + e in bits 4t..4t+3. A
 * code moved to the mantissa's bits 3..6 under the exponent of 1.0 is the bfloat16 value
 * 1 + q / 16 (a shift and one vpternlogd, no table): with S = sum((1 + q / 16) x) and
 * sx = sum(x) over a group, sum(((q - 8) scale + zero) x) = 16 scale S + (zero - 24 scale) sx. */
void q4_gemv_bf16(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint16_t *w,
                  const uint16_t *sz, int64_t N, uint16_t *out, int64_t os) {
#ifdef LUT_GEMV
    const int64_t G = K / 32, NB = (N + 15) / 16;
    float sx_stack[1024];
    float *sx = M * G <= 1024 ? sx_stack : (float *)malloc(sizeof(float) * (size_t)(M * G));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
            __m512 a = _mm512_add_ps(bf16x16_f32(x + m * xs + 32 * g),
                                     bf16x16_f32(x + m * xs + 32 * g + 16));
            sx[m * G + g] = _mm512_reduce_add_ps(a);
        }
    const __m512i field = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
    const __m512 sixteen = _mm512_set1_ps(16.0f), m24 = _mm512_set1_ps(-24.0f);
#pragma omp parallel for schedule(static) if (NB * K >= PARALLEL_MIN)
    for (int64_t b = 0; b < NB; ++b) {
        const uint16_t *wb = w + b * (K / 8) * 32;
        const uint16_t *sb = sz + b * G * 32;
        for (int64_t m = 0; m < M; ++m) {
            const uint16_t *xm = x + m * xs;
            __m512 acc = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
            for (int64_t g = 0; g < G; ++g) {
                __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
                __m512 t2 = _mm512_setzero_ps(), t3 = _mm512_setzero_ps();
                const uint16_t *wg = wb + g * 4 * 32;
                const uint16_t *xg = xm + 32 * g;
                _mm_prefetch((const char *)(wg + 1024), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + 1024 + 32), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + 1024 + 64), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + 1024 + 96), _MM_HINT_T0);
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c) {
                    __m512i v = _mm512_loadu_si512((const void *)(wg + 32 * c));
                    __m512i q0 = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), field, one, 0xEA);
                    __m512i q1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), field, one, 0xEA);
                    __m512i q2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), field, one, 0xEA);
                    __m512i q3 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), field, one, 0xEA);
                    uint32_t p[4];
                    memcpy(p, xg + 8 * c, 16);
                    t0 = _mm512_dpbf16_ps(t0, (__m512bh)q0, (__m512bh)_mm512_set1_epi32((int)p[0]));
                    t1 = _mm512_dpbf16_ps(t1, (__m512bh)q1, (__m512bh)_mm512_set1_epi32((int)p[1]));
                    t2 = _mm512_dpbf16_ps(t2, (__m512bh)q2, (__m512bh)_mm512_set1_epi32((int)p[2]));
                    t3 = _mm512_dpbf16_ps(t3, (__m512bh)q3, (__m512bh)_mm512_set1_epi32((int)p[3]));
                }
                __m512 scale = bf16x16_f32(sb + g * 32);
                __m512 t = _mm512_add_ps(_mm512_add_ps(t0, t1), _mm512_add_ps(t2, t3));
                acc = _mm512_fmadd_ps(t, _mm512_mul_ps(scale, sixteen), acc);
                __m512 zs = _mm512_fmadd_ps(scale, m24, bf16x16_f32(sb + g * 32 + 16));
                zacc = _mm512_fmadd_ps(zs, _mm512_set1_ps(sx[m * G + g]), zacc);
            }
            _mm256_mask_storeu_epi16(out + m * os + 16 * b, valid_lanes(N - 16 * b),
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, zacc)));
        }
    }
    if (sx != sx_stack) free(sx);
#else
    (void)x; (void)M; (void)xs; (void)K; (void)w; (void)sz; (void)N; (void)out; (void)os;
#endif
}

/* x: bfloat16 [M, K] (row stride xs); w: uint8 [N16 / 16, K / 2, 32] (q + 128); d: float16
 * bits [N16 / 16, K / 32, 16]; out: float32 [M, N] (row stride os). */
void q8_gemv_bf16(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint8_t *w,
                  const uint16_t *d, int64_t N, float *out, int64_t os) {
#ifdef LUT_GEMV
    const int64_t G = K / 32, NB = (N + 15) / 16;
    int16_t hv[16], lv[16];
    for (int i = 0; i < 16; ++i) {
        hv[i] = (int16_t)bf16_bits((float)(16 * (i - 8)));
        lv[i] = (int16_t)bf16_bits((float)i);
    }
    const __m512i lut_h = lut16(hv), lut_l = lut16(lv);
    const __m512i low = _mm512_set1_epi16(0x0F);
#pragma omp parallel for schedule(static) if (NB * K >= PARALLEL_MIN)
    for (int64_t b = 0; b < NB; ++b) {
        const uint8_t *wb = w + b * (K / 2) * 32;
        const uint16_t *db = d + b * G * 16;
        for (int64_t m = 0; m < M; ++m) {
            const uint16_t *xm = x + m * xs;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t g = 0; g < G; ++g) {
                __m512 h0 = _mm512_setzero_ps(), h1 = _mm512_setzero_ps();
                __m512 l0 = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
                const uint8_t *wg = wb + g * 16 * 32;
                const uint16_t *xg = xm + 32 * g;
                for (int pf = 0; pf < 512; pf += 64)
                    _mm_prefetch((const char *)(wg + 4096 + pf), _MM_HINT_T0);
#pragma GCC unroll 8
                for (int p = 0; p < 16; p += 2) {
                    __m512i v0 = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(wg + 32 * p)));
                    __m512i v1 = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(wg + 32 * p + 32)));
                    uint32_t p0, p1;
                    memcpy(&p0, xg + 2 * p, 4);
                    memcpy(&p1, xg + 2 * p + 2, 4);
                    __m512bh x0 = (__m512bh)_mm512_set1_epi32((int)p0);
                    __m512bh x1 = (__m512bh)_mm512_set1_epi32((int)p1);
                    h0 = _mm512_dpbf16_ps(h0, (__m512bh)_mm512_permutexvar_epi16(
                        _mm512_srli_epi16(v0, 4), lut_h), x0);
                    l0 = _mm512_dpbf16_ps(l0, (__m512bh)_mm512_permutexvar_epi16(
                        _mm512_and_si512(v0, low), lut_l), x0);
                    h1 = _mm512_dpbf16_ps(h1, (__m512bh)_mm512_permutexvar_epi16(
                        _mm512_srli_epi16(v1, 4), lut_h), x1);
                    l1 = _mm512_dpbf16_ps(l1, (__m512bh)_mm512_permutexvar_epi16(
                        _mm512_and_si512(v1, low), lut_l), x1);
                }
                __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(db + g * 16)));
                acc = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(h0, h1),
                                                    _mm512_add_ps(l0, l1)), s, acc);
            }
            _mm512_mask_storeu_ps(out + m * os + 16 * b, valid_lanes(N - 16 * b), acc);
        }
    }
#else
    (void)x; (void)M; (void)xs; (void)K; (void)w; (void)d; (void)N; (void)out; (void)os;
#endif
}
