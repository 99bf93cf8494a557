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
 *   scale and zero in bfloat16 (the values torch's int4 kernel multiplies with). The
 *   table holds q - 8; a group's sum is scale * sum((q - 8) x) + zero * sum(x), the sums of
 *   x per group computed once per call. One 32-byte chunk holds two pairs (low nibbles:
 *   inputs 4c, 4c+1; high nibbles: 4c+2, 4c+3) of 16 rows.
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

/* x: bfloat16 [M, K] (row stride xs elements); w: uint8 [N16 / 16, K / 4, 32]; sz: bfloat16
 * [N16 / 16, K / 32, 2, 16] (scales, then zeros); out: bfloat16 [M, N] (row stride os). */
void q4_gemv_bf16(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint8_t *w,
                  const uint16_t *sz, int64_t N, uint16_t *out, int64_t os) {
#ifdef LUT_GEMV
    const int64_t G = K / 32, NB = (N + 15) / 16;
    float *sx = (float *)malloc(sizeof(float) * (size_t)(M * G));
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
            __m512 a = _mm512_add_ps(bf16x16_f32(x + m * xs + 32 * g),
                                     bf16x16_f32(x + m * xs + 32 * g + 16));
            sx[m * G + g] = _mm512_reduce_add_ps(a);
        }
    int16_t vals[16];
    for (int i = 0; i < 16; ++i) vals[i] = (int16_t)bf16_bits((float)(i - 8));
    const __m512i lut = lut16(vals);
    const __m512i low = _mm512_set1_epi16(0x0F);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < NB; ++b) {
        const uint8_t *wb = w + b * (K / 4) * 32;
        const uint16_t *sb = sz + b * G * 32;
        for (int64_t m = 0; m < M; ++m) {
            const uint16_t *xm = x + m * xs;
            __m512 acc = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
            for (int64_t g = 0; g < G; ++g) {
                __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
                const uint8_t *wg = wb + g * 8 * 32;
                const uint16_t *xg = xm + 32 * g;
                _mm_prefetch((const char *)(wg + 2048), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + 2048 + 64), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + 2048 + 128), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + 2048 + 192), _MM_HINT_T0);
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c) {
                    __m512i v = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(wg + 32 * c)));
                    __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(v, low), lut);
                    __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut);
                    uint32_t p0, p1;
                    memcpy(&p0, xg + 4 * c, 4);
                    memcpy(&p1, xg + 4 * c + 2, 4);
                    t0 = _mm512_dpbf16_ps(t0, (__m512bh)lo, (__m512bh)_mm512_set1_epi32((int)p0));
                    t1 = _mm512_dpbf16_ps(t1, (__m512bh)hi, (__m512bh)_mm512_set1_epi32((int)p1));
                }
                acc = _mm512_fmadd_ps(_mm512_add_ps(t0, t1), bf16x16_f32(sb + g * 32), acc);
                zacc = _mm512_fmadd_ps(bf16x16_f32(sb + g * 32 + 16),
                                       _mm512_set1_ps(sx[m * G + g]), zacc);
            }
            _mm256_mask_storeu_epi16(out + m * os + 16 * b, valid_lanes(N - 16 * b),
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, zacc)));
        }
    }
    free(sx);
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
#pragma omp parallel for schedule(static)
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
