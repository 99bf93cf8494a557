/* Few-row projections on weights kept quantized, bfloat16 activations in, on AVX512_VNNI
 * (and AVX512_BF16 for the bfloat16 output).
 *
 * The weights are laid out for the instruction (sglang_admin/model/quant/gemv.py packs
 * them): 16 output rows side by side, so that each of a vector's 16 int32 lanes sums one
 * row; vpdpbusd multiplies 4 unsigned weight bytes by 4 signed activation bytes a lane (64
 * products an instruction, exact in int32). The activations become 24-bit fixed point per
 * group of 32 inputs, as three int8 parts (split_row: an error of at most 2^-24 of the
 * group's largest |x|, float32's own rounding), so the sums are those of float32 arithmetic
 * to its rounding; the scales apply once per group (one vector holds the 16 rows').
 *
 * - int4 (GGUF Q4_0 / Q4_1 / Q4_K): w = (q - 8) * scale + zero, per group of 32 inputs,
 *   scale and zero in bfloat16 (the values torch's int4 kernel multiplies with); bfloat16
 *   out. One 64-byte chunk: 16 rows x 8 inputs, the codes as nibbles (q4_gemv_bf16).
 * - int8 in blocks of 32 (GGUF Q8_0): w = q * d, d the block's float16 scale as stored,
 *   q + 128 as the unsigned bytes; float32 out (the LM head's logits). One 64-byte chunk:
 *   16 rows x 4 inputs (q8_gemv_bf16).
 *
 * Rows of the activations (M, a few) are computed from the same weights while they are in
 * the L1 cache; row blocks are spread over the OpenMP team (torch's: the library binds
 * to the libgomp torch has loaded), small matrices on the calling thread alone.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define GEMV_KERNEL 1
#include <immintrin.h>
#endif

int gemv_applies(void) {
#ifdef GEMV_KERNEL
    return 1;
#else
    return 0;
#endif
}

#ifdef GEMV_KERNEL

/* blocks x inputs below which one thread computes it all (a team's start costs more) */
#define PARALLEL_MIN (16 * 1024)
/* bytes prefetched ahead of those read: the int4 codes 32 groups ahead and their scales 16
 * (a batch-1 step's layers, weights from the L3 cache: 1.89-2.01 ms against 2.19-2.31 with
 * the codes 8 groups ahead and no scales), the int8 values 16 groups ahead and their scales
 * (the LM head: 0.62 against 0.70 ms at 8 groups, none) */
#ifndef Q4_AHEAD
#define Q4_AHEAD 8192
#endif
#ifndef Q4_SZ_AHEAD
#define Q4_SZ_AHEAD 1024
#endif
#ifndef Q8_AHEAD
#define Q8_AHEAD 8192
#endif
#ifndef Q8_D_AHEAD
#define Q8_D_AHEAD 512
#endif

static inline __m512 bf16x16_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __mmask16 valid_lanes(int64_t valid) {
    return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << valid) - 1);
}


/* The activations of one row as three int8 parts per 32-input group g: x ~= dx[g] (65536 h
 * + 256 m + l), |X| <= 127 * 65536 (24-bit fixed point per group: an error of at most
 * 2^-24 of the group's largest |x|, float32's own); sx[g]: the exact sum of the bfloat16 x
 * over the group (float32). */
static void split_row(const uint16_t *x, int64_t K, int8_t *parts, float *dx, float *sx,
                      int32_t *psum) {
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    for (int64_t g = 0; g < K / 32; ++g) {
        __m512 a = bf16x16_f32(x + 32 * g), b = bf16x16_f32(x + 32 * g + 16);
        sx[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax > 0.0f ? amax / 8323072.0f : 1.0f;
        dx[g] = d;
        if (psum) psum[3 * g] = psum[3 * g + 1] = psum[3 * g + 2] = 0;
        __m512 inv = _mm512_set1_ps(1.0f / d);
        __m512 h[2] = {a, b};
        for (int t = 0; t < 2; ++t) {
            __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(h[t], inv));
            X = _mm512_max_epi32(_mm512_min_epi32(X, _mm512_set1_epi32(8323072)),
                                 _mm512_set1_epi32(-8323072));
            /* l = X mod 256 in -128..127, then m likewise of (X - l) / 256, h the rest */
            __m512i L = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(X, c128), c255), c128);
            __m512i Y = _mm512_srai_epi32(_mm512_sub_epi32(X, L), 8);
            __m512i Mi = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(Y, c128), c255), c128);
            __m512i H = _mm512_srai_epi32(_mm512_sub_epi32(Y, Mi), 8);
            _mm_storeu_si128((__m128i *)(parts + 32 * g + 16 * t), _mm512_cvtepi32_epi8(H));
            _mm_storeu_si128((__m128i *)(parts + K + 32 * g + 16 * t), _mm512_cvtepi32_epi8(Mi));
            _mm_storeu_si128((__m128i *)(parts + 2 * K + 32 * g + 16 * t),
                             _mm512_cvtepi32_epi8(L));
            if (psum) {
                psum[3 * g] += _mm512_reduce_add_epi32(H);
                psum[3 * g + 1] += _mm512_reduce_add_epi32(Mi);
                psum[3 * g + 2] += _mm512_reduce_add_epi32(L);
            }
        }
    }
}

/* q4_gemv_bf16's 16 output rows of block b for the M rows split by split_row (parts: [M][3][K]
 * int8, dx and sx: [M][K / 32]) */
static inline void q4_block(const int8_t *parts, const float *dx, const float *sx, int64_t M,
                            int64_t K, const uint8_t *w, const uint16_t *sz, int64_t N,
                            int64_t b, uint16_t *out, int64_t os) {
    const int64_t G = K / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512 m8 = _mm512_set1_ps(-8.0f), c65536 = _mm512_set1_ps(65536.0f);
    const uint8_t *wb = w + b * (K / 8) * 64;
    const uint16_t *sb = sz + b * G * 32;
    for (int64_t m = 0; m < M; ++m) {
        const int8_t *ph = parts + 3 * m * K, *pm = ph + K, *pl = ph + 2 * K;
        __m512 acc = _mm512_setzero_ps(), zacc = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
            __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
            __m512i l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512();
            const uint8_t *wg = wb + g * 4 * 64;
            _mm_prefetch((const char *)(wg + Q4_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(wg + Q4_AHEAD + 64), _MM_HINT_T0);
            _mm_prefetch((const char *)(wg + Q4_AHEAD + 128), _MM_HINT_T0);
            _mm_prefetch((const char *)(wg + Q4_AHEAD + 192), _MM_HINT_T0);
            _mm_prefetch((const char *)(sb + g * 32) + Q4_SZ_AHEAD, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int c = 0; c < 4; ++c) {
                __m512i v = _mm512_loadu_si512((const void *)(wg + 64 * c));
                __m512i qa = _mm512_and_si512(v, low);
                __m512i qb = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                int64_t k0 = 32 * g + 8 * c;
                int32_t xa[3], xb[3];
                memcpy(&xa[0], ph + k0, 4);
                memcpy(&xb[0], ph + k0 + 4, 4);
                memcpy(&xa[1], pm + k0, 4);
                memcpy(&xb[1], pm + k0 + 4, 4);
                memcpy(&xa[2], pl + k0, 4);
                memcpy(&xb[2], pl + k0 + 4, 4);
                h0 = _mm512_dpbusd_epi32(h0, qa, _mm512_set1_epi32(xa[0]));
                h1 = _mm512_dpbusd_epi32(h1, qb, _mm512_set1_epi32(xb[0]));
                m0 = _mm512_dpbusd_epi32(m0, qa, _mm512_set1_epi32(xa[1]));
                m1 = _mm512_dpbusd_epi32(m1, qb, _mm512_set1_epi32(xb[1]));
                l0 = _mm512_dpbusd_epi32(l0, qa, _mm512_set1_epi32(xa[2]));
                l1 = _mm512_dpbusd_epi32(l1, qb, _mm512_set1_epi32(xb[2]));
            }
            /* 256 sum(q m) + sum(q l) < 2^24: exact in int32 and in float32 */
            __m512i ml = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(m0, m1), 8),
                                          _mm512_add_epi32(l0, l1));
            __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)), c65536,
                                       _mm512_cvtepi32_ps(ml));
            __m512 scale = bf16x16_f32(sb + g * 32);
            acc = _mm512_fmadd_ps(t, _mm512_mul_ps(scale, _mm512_set1_ps(dx[m * G + g])), acc);
            __m512 zs = _mm512_fmadd_ps(scale, m8, bf16x16_f32(sb + g * 32 + 16));
            zacc = _mm512_fmadd_ps(zs, _mm512_set1_ps(sx[m * G + g]), zacc);
        }
        _mm256_mask_storeu_epi16(out + m * os + 16 * b, valid_lanes(N - 16 * b),
                                 (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc, zacc)));
    }
}
#endif

/* x: bfloat16 [M, K] (row stride xs elements); w: uint8 [N16 / 16, K / 8, 64]; sz: bfloat16
 * [N16 / 16, K / 32, 2, 16] (scales, then zeros); out: bfloat16 [M, N] (row stride os).
 * Bytes 4j..4j+3 of chunk c hold row j's codes of inputs 8c..8c+3 (low nibbles) and
 * 8c+4..8c+7 (high nibbles): vpdpbusd multiplies 4 codes (unsigned) by 4 int8 activations
 * a lane, 64 products an instruction, exact in int32; a group's sum of q x is
 * dx (65536 sum(q h) + 256 sum(q m) + sum(q l)), and sum(((q - 8) scale + zero) x) = scale sum(q x) +
 * (zero - 8 scale) sx. */
void q4_gemv_bf16(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint8_t *w,
                  const uint16_t *sz, int64_t N, uint16_t *out, int64_t os) {
#ifdef GEMV_KERNEL
    const int64_t G = K / 32, NB = (N + 15) / 16;
    enum { STACK = 8192 };
    int8_t stack_b[3 * STACK];
    float stack_f[2 * STACK / 32];
    int big = M * K > STACK;
    int8_t *parts = big ? (int8_t *)malloc((size_t)(3 * M * K)) : stack_b;
    float *dx = big ? (float *)malloc(sizeof(float) * (size_t)(2 * M * G)) : stack_f;
    float *sx = dx + M * G;
    for (int64_t m = 0; m < M; ++m)
        split_row(x + m * xs, K, parts + 3 * m * K, dx + m * G, sx + m * G, NULL);
#pragma omp parallel for schedule(static) if (NB * K >= PARALLEL_MIN)
    for (int64_t b = 0; b < NB; ++b) q4_block(parts, dx, sx, M, K, w, sz, N, b, out, os);
    if (big) {
        free(parts);
        free(dx);
    }
#else
    (void)x; (void)M; (void)xs; (void)K; (void)w; (void)sz; (void)N; (void)out; (void)os;
#endif
}

#ifdef GEMV_KERNEL
/* q8_gemv_bf16's 16 output rows of block b for the M rows split by split_row (psum: [M][K /
 * 32][3], the parts' sums) */
static inline void q8_block(const int8_t *parts, const float *dx, const int32_t *psum,
                            int64_t M, int64_t K, const uint8_t *w, const uint16_t *d,
                            int64_t N, int64_t b, float *out, int64_t os) {
    const int64_t G = K / 32;
    const __m512 c256 = _mm512_set1_ps(256.0f), c65536 = _mm512_set1_ps(65536.0f);
    const uint8_t *wb = w + b * (K / 4) * 64;
    const uint16_t *db = d + b * G * 16;
    for (int64_t m = 0; m < M; ++m) {
        const int8_t *ph = parts + 3 * m * K, *pm = ph + K, *pl = ph + 2 * K;
        const int32_t *ps = psum + 3 * m * G;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; ++g) {
            __m512i h0 = _mm512_setzero_si512(), h1 = _mm512_setzero_si512();
            __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
            __m512i l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512();
            const uint8_t *wg = wb + g * 8 * 64;
            for (int pf = 0; pf < 512; pf += 64)
                _mm_prefetch((const char *)(wg + Q8_AHEAD + pf), _MM_HINT_T0);
            if (Q8_D_AHEAD && (g & 1) == 0)
                _mm_prefetch((const char *)(db + g * 16) + Q8_D_AHEAD, _MM_HINT_T0);
#pragma GCC unroll 4
            for (int c = 0; c < 8; c += 2) {
                __m512i v0 = _mm512_loadu_si512((const void *)(wg + 64 * c));
                __m512i v1 = _mm512_loadu_si512((const void *)(wg + 64 * c + 64));
                int64_t k0 = 32 * g + 4 * c;
                int32_t a[3], bb[3];
                memcpy(&a[0], ph + k0, 4);
                memcpy(&bb[0], ph + k0 + 4, 4);
                memcpy(&a[1], pm + k0, 4);
                memcpy(&bb[1], pm + k0 + 4, 4);
                memcpy(&a[2], pl + k0, 4);
                memcpy(&bb[2], pl + k0 + 4, 4);
                h0 = _mm512_dpbusd_epi32(h0, v0, _mm512_set1_epi32(a[0]));
                h1 = _mm512_dpbusd_epi32(h1, v1, _mm512_set1_epi32(bb[0]));
                m0 = _mm512_dpbusd_epi32(m0, v0, _mm512_set1_epi32(a[1]));
                m1 = _mm512_dpbusd_epi32(m1, v1, _mm512_set1_epi32(bb[1]));
                l0 = _mm512_dpbusd_epi32(l0, v0, _mm512_set1_epi32(a[2]));
                l1 = _mm512_dpbusd_epi32(l1, v1, _mm512_set1_epi32(bb[2]));
            }
            __m512i th = _mm512_sub_epi32(_mm512_add_epi32(h0, h1),
                                          _mm512_set1_epi32(128 * ps[3 * g]));
            __m512i tm = _mm512_sub_epi32(_mm512_add_epi32(m0, m1),
                                          _mm512_set1_epi32(128 * ps[3 * g + 1]));
            __m512i tl = _mm512_sub_epi32(_mm512_add_epi32(l0, l1),
                                          _mm512_set1_epi32(128 * ps[3 * g + 2]));
            __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(th), c65536,
                                       _mm512_fmadd_ps(_mm512_cvtepi32_ps(tm), c256,
                                                       _mm512_cvtepi32_ps(tl)));
            __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(db + g * 16)));
            acc = _mm512_fmadd_ps(t, _mm512_mul_ps(s, _mm512_set1_ps(dx[m * G + g])), acc);
        }
        _mm512_mask_storeu_ps(out + m * os + 16 * b, valid_lanes(N - 16 * b), acc);
    }
}
#endif

/* x: bfloat16 [M, K] (row stride xs); w: uint8 [N16 / 16, K / 4, 64] (q + 128; bytes
 * 4j..4j+3 of chunk c: row j's inputs 4c..4c+3); d: float16 bits [N16 / 16, K / 32, 16];
 * out: float32 [M, N] (row stride os). vpdpbusd on u = q + 128 and each int8 part p of the
 * activations (split_row): sum(q p) = sum(u p) - 128 sum(p), exact in int32. */
void q8_gemv_bf16(const uint16_t *x, int64_t M, int64_t xs, int64_t K, const uint8_t *w,
                  const uint16_t *d, int64_t N, float *out, int64_t os) {
#ifdef GEMV_KERNEL
    const int64_t G = K / 32, NB = (N + 15) / 16;
    int8_t *parts = (int8_t *)malloc((size_t)(3 * M * K));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(2 * M * G));
    int32_t *psum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(3 * M * G));
    float *sx = dx + M * G;
    for (int64_t m = 0; m < M; ++m)
        split_row(x + m * xs, K, parts + 3 * m * K, dx + m * G, sx + m * G, psum + 3 * m * G);
#pragma omp parallel for schedule(static) if (NB * K >= PARALLEL_MIN)
    for (int64_t b = 0; b < NB; ++b) q8_block(parts, dx, psum, M, K, w, d, N, b, out, os);
    free(parts);
    free(dx);
    free(psum);
#else
    (void)x; (void)M; (void)xs; (void)K; (void)w; (void)d; (void)N; (void)out; (void)os;
#endif
}
