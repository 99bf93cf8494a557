/*
 * CPU kernels of the model's forward (float32): decode attention read in place from the paged KV
 * pool; prefill attention (a cached prefix read the same way); RMSNorm, rotate-half RoPE and
 * SwiGLU's silu(gate) * up in one pass each; small-batch projections, and a whole decoder layer
 * of a decode step in one call; then their bfloat16 counterparts, and bfloat16 prefill
 * attention as a flash kernel on AVX512_BF16 (at the end).
 *
 * Decode attention.
 *
 * A decode step has one new query token per sequence. Torch's path gathers every
 * sequence's K and V rows into padded tensors (one copy of all the K/V a step reads) and
 * runs scaled_dot_product_attention per group of similar length; this reads the rows in
 * place through the request-to-token table, two passes per sequence:
 *   1. scores[hq, j] = scale * dot(q[hq], K[slot_j, hq / G])  (G query heads per kv head)
 *   2. out[hq] = sum_j softmax(scores[hq])[j] * V[slot_j, hq / G], two query heads at a
 *      time with their sums in registers
 * Keys are positions [start, len) of the sequence, start = len - window with a sliding
 * window, else 0: the same keys the torch path's masks keep.
 *
 * Layouts (float32, C-contiguous unless a stride is given):
 *   q        [n, H, D], token i at q + i * q_stride
 *   k, v     [slots, KV, D] (the pool of one layer)
 *   table    [rows, ctx] int64 pool slots (the runner's req_to_token)
 *   rows     [n] int64 table row of each sequence; lens [n] int64 its length incl. the new token
 *   scores   scratch of at least H * max(len) floats
 *   out      [n, H, D]
 * Built by sglang_admin/model/cpu_kernels.py with the machine's C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
/* glibc's vector expf (libmvec), 8 lanes */
extern __m256 _ZGVdN8v_expf(__m256);
#endif

/*
 * bfloat16: the upper 16 bits of a float32. Widening is a shift; narrowing rounds to nearest
 * even, every NaN to 0x7fc0, as torch's c10::BFloat16 does, so a value rounded here is the
 * value torch's bfloat16 op would give for the same float32 result.
 */
/* the threads a parallel region takes: OpenMP's team, at most `most` and at least one (one
 * without OpenMP) */
static inline int team_of(int64_t most) {
#ifdef _OPENMP
    int64_t team = omp_get_max_threads();
    team = team < most ? team : most;
    return team > 1 ? (int)team : 1;
#else
    (void)most;
    return 1;
#endif
}

/* this thread's number in its parallel region (0 without OpenMP) */
static inline int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline float bf16_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

static inline uint16_t f32_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* f rounded to bfloat16 and back: what a torch op in bfloat16 leaves of a float32 result */
static inline float bf16_round(float f) { return bf16_f32(f32_bf16(f)); }

#ifdef HAVE_AVX2
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 floats rounded to bfloat16, still in the upper halves of 32-bit lanes */
static inline __m256i round8_bits(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
}

/* bf16_round of 8 floats */
static inline __m256 round8_bf16(__m256 x) {
    return _mm256_castsi256_ps(_mm256_and_si256(round8_bits(x), _mm256_set1_epi32((int)0xffff0000u)));
}

static inline void store8_bf16(uint16_t *p, __m256 x) {
    const __m256i r = _mm256_srli_epi32(round8_bits(x), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

#if defined(HAVE_AVX2) && defined(__AVX512F__)
/* the same 16 lanes at a time where the CPU has AVX-512 (silu_mul_bf16's exp: the inline
 * exp16 below measured no faster there) */
#define HAVE_AVX512 1
extern __m512 _ZGVeN16v_expf(__m512);

static inline __m512 load16_bf16(const uint16_t *p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

static inline __m512i round16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc00000));
}

static inline __m512 round16_bf16(__m512 x) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(round16_bits(x), _mm512_set1_epi32((int)0xffff0000u)));
}

static inline void store16_bf16(uint16_t *p, __m512 x) {
    const __m512i r = _mm512_srli_epi32(round16_bits(x), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}

/* exp of 16 floats x <= 89 to within a few float32 ulps (2^n by the nearest n, then a degree-6
 * Taylor polynomial of the rest, |r| <= ln2 / 2: error below 2e-7 relative; past 88.7 it is
 * inf, as expf): the prefill softmax's exponentials, cheaper than glibc's vector expf */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f)); /* exp(-104) is 0 in float32; -inf too */
    x = _mm512_min_ps(x, _mm512_set1_ps(89.f));   /* inf from here (a NaN became -104) */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln2, high bits */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);  /* and the rest */
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
/* bfloat16 dot products (vdpbf16ps): decode and prefill attention's scores */
#define HAVE_AVX512BF16 1
#endif

#define PREFETCH_AHEAD 16 /* tokens: the slots are scattered, the hardware cannot guess */

static inline void prefetch_row(const float *base, int64_t row_floats) {
    const char *p = (const char *)base;
    for (int64_t b = 0; b < row_floats * (int64_t)sizeof(float); b += 64) __builtin_prefetch(p + b);
}

/* pass 1 for one token: the scores of all H query heads against its K row */
static inline void token_scores(const float *qi, const float *kr, int64_t H, int64_t KV,
                                int64_t D, float scale, float *sc, int64_t L) {
    const int64_t G = H / KV;
#ifdef HAVE_AVX2
    if (D % 8 == 0) { /* any group: 4 heads at a time, then the rest one by one */
        for (int64_t h = 0; h < KV; h++) {
            const float *kh = kr + h * D;
            int64_t g0 = 0;
            for (; g0 + 4 <= G; g0 += 4) {
                const int64_t hq = h * G + g0;
                const float *q0 = qi + hq * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 k8 = _mm256_loadu_ps(kh + d);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k8, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + D + d), k8, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * D + d), k8, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * D + d), k8, a3);
                }
                const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                const __m128 s = _mm_mul_ps(
                    _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)),
                    _mm_set1_ps(scale));
                float four[4];
                _mm_storeu_ps(four, s);
                sc[hq * L] = four[0];
                sc[(hq + 1) * L] = four[1];
                sc[(hq + 2) * L] = four[2];
                sc[(hq + 3) * L] = four[3];
            }
            for (; g0 < G; g0++) { /* a group of 3 or 7 (SmolLM2, Qwen2.5-0.5B): its tail */
                const int64_t hq = h * G + g0;
                const float *qh = qi + hq * D;
                __m256 a = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(kh + d), a);
                const __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(a),
                                             _mm256_extractf128_ps(a, 1));
                const __m128 q2 = _mm_hadd_ps(q4, q4);
                sc[hq * L] = _mm_cvtss_f32(_mm_hadd_ps(q2, q2)) * scale;
            }
        }
        return;
    }
#endif
    for (int64_t hq = 0; hq < H; hq++) {
        const float *qh = qi + hq * D;
        const float *kh = kr + (hq / G) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
        sc[hq * L] = s * scale;
    }
}

/* softmax of one row of scores, in place; returns 1 / sum of the exponentials */
static inline float softmax_row(float *s, int64_t L) {
    float m = s[0];
    int64_t j = 1;
#ifdef HAVE_AVX2
    if (L >= 16) { /* the max 8 lanes at a time: a scalar max waits on each compare */
        __m256 mx = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= L; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int k = 0; k < 8; k++) m = lanes[k] > m ? lanes[k] : m;
    }
#endif
    for (; j < L; j++) m = s[j] > m ? s[j] : m;
    j = 0;
    float sum = 0.f;
#ifdef HAVE_AVX2
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= L; j += 8) {
        const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) sum += lanes[k];
#endif
    for (; j < L; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return 1.f / sum;
}

#ifdef HAVE_AVX2
/* one value row's 32 dims weighted into two heads' sums: a += p0 * vr, b += p1 * vr */
static inline __attribute__((always_inline)) void values_pair(const float *vr, const float *p0,
                                                              const float *p1, __m256 *a,
                                                              __m256 *b) {
    const __m256 w0 = _mm256_broadcast_ss(p0), w1 = _mm256_broadcast_ss(p1);
    for (int i = 0; i < 4; i++) {
        const __m256 vi = _mm256_loadu_ps(vr + 8 * i);
        a[i] = _mm256_fmadd_ps(w0, vi, a[i]);
        b[i] = _mm256_fmadd_ps(w1, vi, b[i]);
    }
}

/* o[0..32) = inv * a */
static inline __attribute__((always_inline)) void store_scaled(float *o, const __m256 *a,
                                                               float inv) {
    const __m256 s = _mm256_set1_ps(inv);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(a[i], s));
}
#endif

/* pass 2: out[hq] = inv[hq] * sum_j scores[hq, j] * V[slot_j, hq / G] */
static void weighted_values(const float *scores, const float *v, const int64_t *slots,
                            int64_t L, int64_t H, int64_t KV, int64_t D, const float *inv,
                            float *oi, int64_t row) {
    const int64_t G = H / KV;
#ifdef HAVE_AVX2
    if (D % 32 == 0) {
        /* two query heads x 32 dims in 8 registers, over all the sequence's tokens; an odd
         * group's last head alone */
        for (int64_t h = 0; h < KV; h++) {
            int64_t g0 = 0;
            for (; g0 + 2 <= G; g0 += 2) {
                const int64_t hq = h * G + g0;
                const float *s0 = scores + hq * L, *s1 = s0 + L;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {
                    __m256 a[4], b[4];
                    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
                    for (int64_t j = 0; j < L; j++) {
                        if (j + PREFETCH_AHEAD < L)
                            __builtin_prefetch(v + slots[j + PREFETCH_AHEAD] * row + h * D + d0);
                        values_pair(v + slots[j] * row + h * D + d0, s0 + j, s1 + j, a, b);
                    }
                    store_scaled(oi + hq * D + d0, a, inv[hq]);
                    store_scaled(oi + (hq + 1) * D + d0, b, inv[hq + 1]);
                }
            }
            if (g0 < G) {
                const int64_t hq = h * G + g0;
                const float *s0 = scores + hq * L;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {
                    __m256 a[4];
                    for (int i = 0; i < 4; i++) a[i] = _mm256_setzero_ps();
                    for (int64_t j = 0; j < L; j++) {
                        if (j + PREFETCH_AHEAD < L)
                            __builtin_prefetch(v + slots[j + PREFETCH_AHEAD] * row + h * D + d0);
                        const float *vr = v + slots[j] * row + h * D + d0;
                        const __m256 w0 = _mm256_broadcast_ss(s0 + j);
                        for (int i = 0; i < 4; i++)
                            a[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(vr + 8 * i), a[i]);
                    }
                    store_scaled(oi + hq * D + d0, a, inv[hq]);
                }
            }
        }
        return;
    }
#endif
    for (int64_t x = 0; x < H * D; x++) oi[x] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        if (j + PREFETCH_AHEAD < L) prefetch_row(v + slots[j + PREFETCH_AHEAD] * row, row);
        const float *vr = v + slots[j] * row;
        for (int64_t hq = 0; hq < H; hq++) {
            const float p = scores[hq * L + j];
            const float *vh = vr + (hq / G) * D;
            float *o = oi + hq * D;
            for (int64_t d = 0; d < D; d++) o[d] += p * vh[d];
        }
    }
    for (int64_t hq = 0; hq < H; hq++)
        for (int64_t d = 0; d < D; d++) oi[hq * D + d] *= inv[hq];
}

void decode_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                      const int64_t *table, int64_t ctx, const int64_t *rows,
                      const int64_t *lens, int64_t n, int64_t H, int64_t KV, int64_t D,
                      float scale, int64_t window, float *scores, float *out) {
    const int64_t row = KV * D; /* floats per pool slot */
    for (int64_t i = 0; i < n; i++) {
        const int64_t len = lens[i];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const int64_t L = len - start;
        const int64_t *slots = table + rows[i] * ctx + start;
        const float *qi = q + i * q_stride;
        for (int64_t j = 0; j < L; j++) {
            if (j + PREFETCH_AHEAD < L) {
                prefetch_row(k + slots[j + PREFETCH_AHEAD] * row, row);
                prefetch_row(v + slots[j + PREFETCH_AHEAD] * row, row); /* for pass 2 */
            }
            token_scores(qi, k + slots[j] * row, H, KV, D, scale, scores + j, L);
        }
        float inv[H];
        for (int64_t hq = 0; hq < H; hq++) inv[hq] = softmax_row(scores + hq * L, L);
        float *oi = out + i * H * D;
        weighted_values(scores, v, slots, L, H, KV, D, inv, oi, row);
    }
}

/*
 * Prefill attention of one sequence: its n new tokens, at positions p..p+n-1, attend causally
 * to the keys of positions [0, p + n) (a cached prefix of p and themselves; with a sliding
 * window, each to its last `window`), read from the paged pool through the sequence's slots.
 * Torch's CPU flash attention reaches 15-22 GFLOP/s at head size 32 for these lengths; here
 * the kv head's keys are transposed once per call into blocks of 16 and its values copied
 * into contiguous rows, then per query token the scores of 4 query heads x 16 keys are
 * accumulated in registers (no horizontal sums), softmax, and the weighted values as in
 * decode, two heads at a time.
 *   q        [n, H, D], token i at q + i * q_stride (heads contiguous)
 *   k, v     [slots, KV, D] (the pool of one layer), the new tokens' rows already written
 *   slots    [p + n] int64 pool slots of positions 0..p+n-1 (the sequence's table row)
 *   scratch  D * L16 + D * L + G * L16 floats, L = p + n, L16 = L rounded up to 16
 *   out      [n, H, D]
 * Only where extend_attention_applies(D) (AVX2, D a multiple of 32); elsewhere it returns 0
 * with nothing written.
 */
int extend_attention_applies(int64_t D) {
#ifdef HAVE_AVX2
    return D > 0 && D % 32 == 0;
#else
    (void)D;
    return 0;
#endif
}

#ifdef HAVE_AVX2
/* scores of R (1..4) query heads against keys [j0, j1) (multiples of 16) of kt, the keys
 * transposed in blocks of 16: key j's dim d at kt[((j / 16) * D + d) * 16 + j % 16]; row r
 * of the scores at sc + r * stride */
static inline __attribute__((always_inline)) void score_block(
    const int R, const float *qr, int64_t D, const float *kt, int64_t stride, int64_t j0,
    int64_t j1, float scale, float *sc) {
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t j = j0; j < j1; j += 16) {
        __m256 a[4][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const float *kb = kt + j * D;  /* = ((j / 16) * D) * 16 */
        for (int64_t d = 0; d < D; d++) {
            const float *kd = kb + d * 16;
            const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
            for (int r = 0; r < R; r++) {
                const __m256 qb = _mm256_broadcast_ss(qr + r * D + d);
                a[r][0] = _mm256_fmadd_ps(qb, k0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(qb, k1, a[r][1]);
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_ps(sc + r * stride + j, _mm256_mul_ps(a[r][0], sv));
            _mm256_storeu_ps(sc + r * stride + j + 8, _mm256_mul_ps(a[r][1], sv));
        }
    }
}

/* o[g] = inv[g] * sum_{j in [lo, hi)} p[g, j] * v[j] for the G heads of one kv head (row g
 * of the probabilities at sc + g * stride) */
static void extend_values(const float *sc, int64_t stride, const float *v, int64_t v_stride,
                          int64_t lo, int64_t hi, int64_t G, int64_t D, const float *inv,
                          float *o) {
    for (int64_t g = 0; g < G; g += 2) {
        const int two = G - g >= 2;
        const float *s0 = sc + g * stride, *s1 = two ? s0 + stride : s0;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            __m256 a[4], b[4];
            for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
            for (int64_t j = lo; j < hi; j++)
                values_pair(v + j * v_stride + d0, s0 + j, s1 + j, a, b);
            store_scaled(o + g * D + d0, a, inv[g]);
            if (two) store_scaled(o + (g + 1) * D + d0, b, inv[g + 1]);
        }
    }
}
#endif

int extend_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                     const int64_t *slots, int64_t p, int64_t n, int64_t H, int64_t KV,
                     int64_t D, float scale, int64_t window, float *scratch, float *out) {
#ifdef HAVE_AVX2
    if (!extend_attention_applies(D) || KV <= 0 || H % KV != 0) return 0;
    const int64_t G = H / KV, L = p + n, L16 = (L + 15) & ~(int64_t)15, row = KV * D;
    float *kt = scratch;      /* one kv head's keys, transposed per block of 16 */
    float *vc = kt + D * L16; /* its values, one contiguous row per position */
    float *sc = vc + D * L;   /* [G][L16]: one token's scores, then probabilities */
    float inv[G];
    for (int64_t h = 0; h < KV; h++) {
        for (int64_t j = 0; j < L16; j++) {
            float *col = kt + (j & ~(int64_t)15) * D + (j & 15);
            if (j < L) {
                const float *kj = k + slots[j] * row + h * D;
                for (int64_t d = 0; d < D; d++) col[d * 16] = kj[d];
                memcpy(vc + j * D, v + slots[j] * row + h * D, (size_t)D * sizeof(float));
            } else {
                for (int64_t d = 0; d < D; d++) col[d * 16] = 0.f;
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const int64_t hi = p + t + 1, lo = (window > 0 && hi > window) ? hi - window : 0;
            const int64_t j0 = lo & ~(int64_t)15, j1 = (hi + 15) & ~(int64_t)15;
            const float *qt = q + t * q_stride + h * G * D;
            for (int64_t g = 0; g < G; g += 4) {
                switch (G - g >= 4 ? 4 : (int)(G - g)) {
                case 4: score_block(4, qt + g * D, D, kt, L16, j0, j1, scale, sc + g * L16); break;
                case 3: score_block(3, qt + g * D, D, kt, L16, j0, j1, scale, sc + g * L16); break;
                case 2: score_block(2, qt + g * D, D, kt, L16, j0, j1, scale, sc + g * L16); break;
                default: score_block(1, qt + g * D, D, kt, L16, j0, j1, scale, sc + g * L16);
                }
            }
            for (int64_t g = 0; g < G; g++) inv[g] = softmax_row(sc + g * L16 + lo, hi - lo);
            extend_values(sc, L16, vc, D, lo, hi, G, D, inv, out + (t * H + h * G) * D);
        }
    }
    return 1;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)slots; (void)p; (void)n; (void)H;
    (void)KV; (void)D; (void)scale; (void)window; (void)scratch; (void)out;
    return 0;
#endif
}

/*
 * Elementwise work of a layer in one pass each (torch spends an op and a memory pass per
 * step of these formulas, and a few microseconds of dispatch per op at decode batch sizes).
 */

/* out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)) for T rows of D floats (x rows contiguous) */
void rms_norm(const float *x, const float *w, int64_t T, int64_t D, float eps, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * D;
        int64_t d = 0;
        float sum = 0.f;
#ifdef HAVE_AVX2
        __m256 acc = _mm256_setzero_ps();
        for (; d + 8 <= D; d += 8) {
            const __m256 v8 = _mm256_loadu_ps(xt + d);
            acc = _mm256_fmadd_ps(v8, v8, acc);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
        for (; d < D; d++) sum += xt[d] * xt[d];
        const float rstd = 1.f / sqrtf(sum / (float)D + eps);
        float *ot = out + t * D;
        for (d = 0; d < D; d++) ot[d] = w[d] * (xt[d] * rstd);
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i]: the gate and up halves of a fused projection */
void silu_mul(const float *gu, int64_t T, int64_t I, float *out) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
#ifdef HAVE_AVX2
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 g8 = _mm256_loadu_ps(g + i);
            const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(zero, g8));
            const __m256 s = _mm256_div_ps(g8, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/*
 * out[r] = the index of the first largest value of row r of x [R, C] (rows contiguous), as
 * torch.argmax: a NaN counts as the largest (its first one wins). Torch's reduction costs
 * ~0.4 us a row at a small vocabulary and ~1 ns an element at a large one.
 */
/* argmax_rows' one row, of float32 (bf = 0) or bfloat16 (bf = 1) values */
static inline __attribute__((always_inline)) int64_t argmax_row(const void *x, int64_t C,
                                                                const int bf) {
#define AT(i) (bf ? bf16_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i])
#ifdef HAVE_AVX2
#define AT8(i) (bf ? load8_bf16((const uint16_t *)x + (i)) : _mm256_loadu_ps((const float *)x + (i)))
#endif
    int64_t best = 0, c = 0;
    float top = C ? AT(0) : 0.f;
    int nan = C && top != top;
#ifdef HAVE_AVX512
#define AT16(i) (bf ? load16_bf16((const uint16_t *)x + (i)) : _mm512_loadu_ps((const float *)x + (i)))
    if (!nan && C >= 64) {
        /* four running (largest, where) pairs of 16 lanes, 64 values an iteration: one pair
         * would wait on each compare; per lane the first largest (strict compares) */
        __m512 tops[4];
        __m512i where[4], at[4];
        __mmask16 unordered = 0;
        const __m512i step = _mm512_set1_epi32(64);
        for (int a = 0; a < 4; a++) {
            tops[a] = AT16(16 * a);
            unordered |= _mm512_cmp_ps_mask(tops[a], tops[a], _CMP_UNORD_Q);
            at[a] = where[a] = _mm512_add_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(16 * a));
        }
        for (c = 64; c + 64 <= C; c += 64) {
            for (int a = 0; a < 4; a++) {
                const __m512 v = AT16(c + 16 * a);
                at[a] = _mm512_add_epi32(at[a], step);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, tops[a], _CMP_GT_OQ);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                tops[a] = _mm512_mask_mov_ps(tops[a], gt, v);
                where[a] = _mm512_mask_mov_epi32(where[a], gt, at[a]);
            }
        }
        if (unordered) {
            c = 0; /* a NaN somewhere: the scalar loop below finds the first */
        } else {
            float t16[64];
            int32_t w16[64];
            for (int a = 0; a < 4; a++) {
                _mm512_storeu_ps(t16 + 16 * a, tops[a]);
                _mm512_storeu_si512(w16 + 16 * a, where[a]);
            }
            top = t16[0];
            best = w16[0];
            for (int l = 1; l < 64; l++)
                if (t16[l] > top || (t16[l] == top && w16[l] < best)) {
                    top = t16[l];
                    best = w16[l];
                }
        }
    }
#undef AT16
#elif defined(HAVE_AVX2)
    if (!nan && C >= 16) {
        /* per lane: its largest value and where it is (the first, as compares are strict) */
        __m256 tops = AT8(0);
        __m256 unordered = _mm256_cmp_ps(tops, tops, _CMP_UNORD_Q);
        __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = where;
        const __m256i step = _mm256_set1_epi32(8);
        for (c = 8; c + 8 <= C; c += 8) {
            const __m256 v = AT8(c);
            at = _mm256_add_epi32(at, step);
            const __m256 gt = _mm256_cmp_ps(v, tops, _CMP_GT_OQ);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            tops = _mm256_blendv_ps(tops, v, gt);
            where = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(where), _mm256_castsi256_ps(at), gt));
        }
        if (_mm256_movemask_ps(unordered)) {
            c = 0;  /* a NaN somewhere: the scalar loop below finds the first */
        } else {
            float t8[8];
            int32_t w8[8];
            _mm256_storeu_ps(t8, tops);
            _mm256_storeu_si256((__m256i *)w8, where);
            top = t8[0];
            best = w8[0];
            for (int l = 1; l < 8; l++)
                if (t8[l] > top || (t8[l] == top && w8[l] < best)) {
                    top = t8[l];
                    best = w8[l];
                }
        }
    }
#endif
#undef AT8
    for (; c < C && !nan; c++) {
        const float v = AT(c);
        if (v != v) {
            best = c;
            nan = 1;
        } else if (v > top) {
            top = v;
            best = c;
        }
    }
#undef AT
    return best;
}

/* rows spread over the calling thread's OpenMP team where there are a million values or more
 * (a real vocabulary at a decode batch: a step's logits are read once, at memory speed) */
#define ARGMAX_PARALLEL_VALUES (1 << 20)

void argmax_rows(const float *x, int64_t R, int64_t C, int64_t *out) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (R > 1 && R * C >= ARGMAX_PARALLEL_VALUES)
#endif
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * C, C, 0);
}

/* argmax_rows of bfloat16 rows (the logits of a bfloat16 model) */
void argmax_rows_bf16(const uint16_t *x, int64_t R, int64_t C, int64_t *out) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (R > 1 && R * C >= ARGMAX_PARALLEL_VALUES)
#endif
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row(x + r * C, C, 1);
}

/*
 * Rotate-half RoPE: out[t, h, i] = x[t, h, i] * cos[t, i] + x[t, h, (i + D/2) % D] * sin[t, i]
 * (sin carries the sign of rotate_half), for T tokens of H heads of D; token t of x starts
 * at x + t * x_stride (the q and k heads of a fused qkv row); out is contiguous.
 */
void rope(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
          int64_t T, int64_t H, int64_t D, float *out) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * D, *s = sin_t + t * D;
        for (int64_t h = 0; h < H; h++) {
            const float *xh = x + t * x_stride + h * D;
            float *oh = out + (t * H + h) * D;
            for (int64_t i = 0; i < half; i++) oh[i] = xh[i] * c[i] + xh[i + half] * s[i];
            for (int64_t i = half; i < D; i++) oh[i] = xh[i] * c[i] + xh[i - half] * s[i];
        }
    }
}

/*
 * Projections of a decode step: y[m, n] (+)= sum_k x[m, k] * w[n, k] + b[n].
 *
 * x [M, K] rows at x_stride, w [N, K] (a Linear's weight as it is: no packed copy to keep
 * in step with weight updates), b [N] or NULL, y [M, N] rows at y_stride; accumulate: y +=
 * the result (the residual add, in torch's order: the projection first, then the sum).
 * Decode batches are small, and torch's GEMM spends more on packing each weight matrix than
 * on arithmetic there. Two blockings:
 *   - under PACK_ROWS rows: each block of 4 weight rows stays in L1 while up to 3 input rows
 *     at a time are dotted with it, their 12 sums in registers (no packing at all);
 *   - from PACK_ROWS rows on (pack: scratch of 16 * ceil(M / 16) * K floats): x is copied into
 *     panels of 16 rows, k-major, and each weight element, broadcast, meets 16 rows at once:
 *     6 weight rows x 16 input rows of sums in registers, no horizontal sums. Rows past the
 *     last full panel: up to TAIL_ROWS go by row blocks against each block of 12 weight rows
 *     right after its panels (the weights still in cache), more fill a panel padded with
 *     zeros. A padded panel costs 16 rows' arithmetic, a row in row blocks about 1.6x a
 *     panel row's: the 16 projections of a decode step at 17 rows 1.5 ms against 2.3 padded,
 *     at 24 rows 2.3 against 2.4, at 25 rows 2.6 against 2.55.
 */
#define PACK_ROWS 12
#define TAIL_ROWS 8
#ifdef HAVE_AVX2
/* the sums of 4 vectors as one [s0 s1 s2 s3] */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

static inline float finish(float sum, const float *b, float *y, int accumulate) {
    const float out = b ? sum + *b : sum;
    return accumulate ? *y + out : out;
}

/* MR (1..3) rows of x against 4 rows of w, into y[0..MR)[0..4) */
static inline __attribute__((always_inline)) void dot_block(
    const int MR, const float *x, int64_t xs, int64_t K, const float *w, const float *b,
    float *y, int64_t ys, int accumulate) {
    __m256 a[3][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        __m256 v[4];
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < MR; i++) {
            const __m256 x8 = _mm256_loadu_ps(x + i * xs + k);
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_fmadd_ps(x8, v[j], a[i][j]);
        }
    }
    for (int i = 0; i < MR; i++) {
        float r[4];
        _mm_storeu_ps(r, hsum4(a[i][0], a[i][1], a[i][2], a[i][3]));
        for (int j = 0; j < 4; j++) {
            for (int64_t k = K8; k < K; k++) r[j] += x[i * xs + k] * w[j * K + k];
            y[i * ys + j] = finish(r[j], b ? b + j : 0, y + i * ys + j, accumulate);
        }
    }
}

/* NR (1..6) rows of w against a panel of 16 packed rows: yt[NR][16] */
static inline __attribute__((always_inline)) void panel_block(
    const int NR, const float *panel, int64_t K, const float *w, float *yt) {
    __m256 a[6][2];
    for (int i = 0; i < NR; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 x0 = _mm256_loadu_ps(panel + k * 16), x1 = _mm256_loadu_ps(panel + k * 16 + 8);
        for (int i = 0; i < NR; i++) {
            const __m256 wb = _mm256_broadcast_ss(w + i * K + k);
            a[i][0] = _mm256_fmadd_ps(wb, x0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(wb, x1, a[i][1]);
        }
    }
    for (int i = 0; i < NR; i++) {
        _mm256_storeu_ps(yt + i * 16, a[i][0]);
        _mm256_storeu_ps(yt + i * 16 + 8, a[i][1]);
    }
}

static void row_blocks(const float *x, int64_t xs, int64_t M, int64_t K, const float *w,
                       int64_t n0, int64_t n1, const float *b, float *y, int64_t ys,
                       int accumulate);

static void linear_packed(const float *x, int64_t xs, int64_t M, int64_t K, const float *w,
                          int64_t N, const float *b, float *y, int64_t ys, int accumulate,
                          float *pack) {
    const int64_t panels = M / 16 + (M % 16 > TAIL_ROWS);
    const int64_t paneled = panels * 16 < M ? panels * 16 : M;  /* rows the panels compute */
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t r = 0; r < 16; r++) {
                const int64_t m = p * 16 + r;
                pack[(p * K + k) * 16 + r] = m < M ? x[m * xs + k] : 0.f;
            }
    float yt[6 * 16];
    for (int64_t n0 = 0; n0 < N; n0 += 12) {
        const int64_t n1 = N - n0 >= 12 ? n0 + 12 : N;
        for (int64_t n = n0; n < n1; n += 6) {
            const int nr = n1 - n >= 6 ? 6 : (int)(n1 - n);
            for (int64_t p = 0; p < panels; p++) {
                const float *panel = pack + p * K * 16;
                if (nr == 6) panel_block(6, panel, K, w + n * K, yt);
                else
                    for (int i = 0; i < nr; i++)
                        panel_block(1, panel, K, w + (n + i) * K, yt + i * 16);
                const int64_t rows = M - p * 16 >= 16 ? 16 : M - p * 16;
                for (int i = 0; i < nr; i++)
                    for (int64_t r = 0; r < rows; r++) {
                        float *out = y + (p * 16 + r) * ys + n + i;
                        *out = finish(yt[i * 16 + r], b ? b + n + i : 0, out, accumulate);
                    }
            }
        }
        if (paneled < M)
            row_blocks(x + paneled * xs, xs, M - paneled, K, w, n0, n1, b, y + paneled * ys, ys,
                       accumulate);
    }
}
#endif

/* y[0..M)[n0..n1) of x against weight rows n0..n1: 4 weight rows at a time by dot_block
 * (AVX2), the rest one by one */
static void row_blocks(const float *x, int64_t xs, int64_t M, int64_t K, const float *w,
                       int64_t n0, int64_t n1, const float *b, float *y, int64_t ys,
                       int accumulate) {
    int64_t n = n0;
#ifdef HAVE_AVX2
    for (; n + 4 <= n1; n += 4) {
        const float *wn = w + n * K, *bn = b ? b + n : 0;
        int64_t m = 0;
        for (; m + 3 <= M; m += 3)
            dot_block(3, x + m * xs, xs, K, wn, bn, y + m * ys + n, ys, accumulate);
        if (M - m == 2) dot_block(2, x + m * xs, xs, K, wn, bn, y + m * ys + n, ys, accumulate);
        if (M - m == 1) dot_block(1, x + m * xs, xs, K, wn, bn, y + m * ys + n, ys, accumulate);
    }
#endif
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += x[m * xs + k] * w[n * K + k];
            const float out = b ? s + b[n] : s;
            y[m * ys + n] = accumulate ? y[m * ys + n] + out : out;
        }
}

void linear_nt(const float *x, int64_t xs, int64_t M, int64_t K, const float *w, int64_t N,
               const float *b, float *y, int64_t ys, int accumulate, float *pack) {
#ifdef HAVE_AVX2
    if (M >= PACK_ROWS && pack) {
        linear_packed(x, xs, M, K, w, N, b, y, ys, accumulate, pack);
        return;
    }
#else
    (void)pack;
#endif
    row_blocks(x, xs, M, K, w, 0, N, b, y, ys, accumulate);
}

/*
 * One decoder layer for a batch of M decode tokens, in one call (a layer through torch is ~15
 * ops of a few microseconds' dispatch each, most of a small batch's step):
 *   x += o_proj(attention(rope(q), rope(k) and v stored at out_slots)),  q/k/v from
 *        qkv_proj(rms_norm(x, ln1))
 *   x += down_proj(silu(gate) * up),  gate/up from gate_up_proj(rms_norm(x, ln2))
 * x [M, hidden] is the residual stream, updated in place. cos/sin [M, D] (sin signed, as
 * llama.RotaryEmbedding gives them). The attention arguments are decode_attention's.
 * scratch: M * (hidden + (H + 2 KV) D + (H + KV) D + H D + 3 I) floats, then 16 * ceil(M / 16)
 * * max(hidden, H D, I) for linear_nt's packed rows.
 */
void decode_layer(float *x, int64_t M, int64_t hidden, int64_t inter, float eps,
                  const float *ln1, const float *w_qkv, const float *b_qkv,
                  const float *w_o, const float *b_o, const float *ln2,
                  const float *w_gu, const float *b_gu, const float *w_down,
                  const float *b_down, const float *cos_t, const float *sin_t,
                  float *k_cache, float *v_cache, const int64_t *out_slots,
                  const int64_t *table, int64_t ctx, const int64_t *rows, const int64_t *lens,
                  int64_t H, int64_t KV, int64_t D, float scale, int64_t window,
                  float *scores, float *scratch) {
    const int64_t qkv_width = (H + 2 * KV) * D, row = KV * D;
    float *h = scratch;                        /* [M, hidden] */
    float *qkv = h + M * hidden;               /* [M, (H + 2 KV) D] */
    float *qk = qkv + M * qkv_width;           /* [M, H + KV, D] rotated */
    float *attn = qk + M * (H + KV) * D;       /* [M, H D] */
    float *gu = attn + M * H * D;              /* [M, 2 I] */
    float *act = gu + M * 2 * inter;           /* [M, I] */
    float *pack = act + M * inter;             /* linear_nt's */

    rms_norm(x, ln1, M, hidden, eps, h);
    linear_nt(h, hidden, M, hidden, w_qkv, qkv_width, b_qkv, qkv, qkv_width, 0, pack);
    rope(qkv, qkv_width, cos_t, sin_t, M, H + KV, D, qk);
    for (int64_t m = 0; m < M; m++) {
        const float *km = qk + (m * (H + KV) + H) * D, *vm = qkv + m * qkv_width + (H + KV) * D;
        float *kd = k_cache + out_slots[m] * row, *vd = v_cache + out_slots[m] * row;
        for (int64_t e = 0; e < row; e++) {
            kd[e] = km[e];
            vd[e] = vm[e];
        }
    }
    decode_attention(qk, (H + KV) * D, k_cache, v_cache, table, ctx, rows, lens, M, H, KV, D,
                     scale, window, scores, attn);
    linear_nt(attn, H * D, M, H * D, w_o, hidden, b_o, x, hidden, 1, pack);
    rms_norm(x, ln2, M, hidden, eps, h);
    linear_nt(h, hidden, M, hidden, w_gu, 2 * inter, b_gu, gu, 2 * inter, 0, pack);
    silu_mul(gu, M, inter, act);
    linear_nt(act, inter, M, inter, w_down, hidden, b_down, x, hidden, 1, pack);
}

/*
 * The per-op layer of a decode step (the path a bfloat16 model and any step with a
 * projection hook take: the projections stay the caller's): the new K/V written with RoPE,
 * and the residual add fused with the next norm. float32 versions first, then bfloat16.
 */

/* rope of R heads of each token (x as rope's), out [T, R, D]; with slots, the last KV
 * rotated heads go to k_cache[slots[t]] and the KV heads right after the R in x (the value
 * heads of a fused qkv row) to v_cache[slots[t]] (pools [slots, KV, D]) */
void rope_store(const float *x, int64_t x_stride, const float *cos_t, const float *sin_t,
                int64_t T, int64_t R, int64_t KV, int64_t D, float *out, float *k_cache,
                float *v_cache, const int64_t *slots) {
    rope(x, x_stride, cos_t, sin_t, T, R, D, out);
    if (!slots) return;
    const size_t bytes = (size_t)(KV * D) * sizeof(float);
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * KV * D, out + (t * R + R - KV) * D, bytes);
        memcpy(v_cache + slots[t] * KV * D, x + t * x_stride + R * D, bytes);
    }
}

/* x[t] += delta[t] (the residual add, in place), then out = rms_norm(x, w) */
void add_rms_norm(float *x, const float *delta, const float *w, int64_t T, int64_t D,
                  float eps, float *out) {
    for (int64_t e = 0; e < T * D; e++) x[e] += delta[e];
    rms_norm(x, w, T, D, eps, out);
}

/*
 * bfloat16 tensors, float32 inside, each result rounded where torch's bfloat16 ops (and
 * transformers') round it: RMSNorm normalises in float32, rounds, then multiplies by the
 * weight and rounds; RoPE rounds x * cos, rotate_half(x) * sin and their sum; SwiGLU rounds
 * silu(gate) and its product with up. Attention reads bfloat16 q, keys and values, computes
 * scores, softmax and the weighted sum in float32 and rounds the output.
 */

/* rms_norm of one row of D into out */
static void rms_row_bf16(const uint16_t *xt, const uint16_t *w, int64_t D, float eps,
                         uint16_t *ot) {
    int64_t d = 0;
    float sum = 0.f;
#ifdef HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; d + 8 <= D; d += 8) {
        const __m256 v8 = load8_bf16(xt + d);
        acc = _mm256_fmadd_ps(v8, v8, acc);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
          ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
#endif
    for (; d < D; d++) sum += bf16_f32(xt[d]) * bf16_f32(xt[d]);
    const float rstd = 1.f / sqrtf(sum / (float)D + eps);
    d = 0;
#ifdef HAVE_AVX2
    const __m256 r8 = _mm256_set1_ps(rstd);
    for (; d + 8 <= D; d += 8) {
        const __m256 n8 = round8_bf16(_mm256_mul_ps(load8_bf16(xt + d), r8));
        store8_bf16(ot + d, _mm256_mul_ps(load8_bf16(w + d), n8));
    }
#endif
    for (; d < D; d++) ot[d] = f32_bf16(bf16_f32(w[d]) * bf16_round(bf16_f32(xt[d]) * rstd));
}

/* rows spread over the calling thread's OpenMP team from ROWS_PARALLEL_MIN elements up (a
 * prefill's rows; a decode step's few rows stay on one thread: a parallel region costs more
 * than they do). Each row is computed as on one thread: the results are the same bits. */
#define ROWS_PARALLEL_MIN 65536

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, int64_t T, int64_t D, float eps,
                   uint16_t *out) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (T > 1 && T * D >= ROWS_PARALLEL_MIN)
#endif
    for (int64_t t = 0; t < T; t++) rms_row_bf16(x + t * D, w, D, eps, out + t * D);
}

/* one row of add_rms_norm_bf16: xt += dt rounded (in place), then ot = rms_norm(xt, w) */
static void add_rms_row_bf16(uint16_t *xt, const uint16_t *dt, const uint16_t *w, int64_t D,
                             float eps, uint16_t *ot) {
    int64_t d = 0;
#ifdef HAVE_AVX2
    for (; d + 8 <= D; d += 8)
        store8_bf16(xt + d, _mm256_add_ps(load8_bf16(xt + d), load8_bf16(dt + d)));
#endif
    for (; d < D; d++) xt[d] = f32_bf16(bf16_f32(xt[d]) + bf16_f32(dt[d]));
    rms_row_bf16(xt, w, D, eps, ot);
}

/* x[t] = x[t] + delta[t] rounded (in place), then out[t] = rms_norm(x[t], w) */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *w, int64_t T,
                       int64_t D, float eps, uint16_t *out) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (T > 1 && T * D >= ROWS_PARALLEL_MIN)
#endif
    for (int64_t t = 0; t < T; t++)
        add_rms_row_bf16(x + t * D, delta + t * D, w, D, eps, out + t * D);
}

/* o[j] = silu(g[j]) * u[j] for j in [i, I), each rounded: 16 at a time (AVX-512), then 8, then
 * one; a span starting at a multiple of 16 goes through the same paths as the whole row */
static inline void silu_span_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t i,
                                  int64_t I) {
#ifdef HAVE_AVX512
    const __m512 one16 = _mm512_set1_ps(1.f), zero16 = _mm512_setzero_ps();
    for (; i + 16 <= I; i += 16) {
        const __m512 g16 = load16_bf16(g + i);
        const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(zero16, g16));
        const __m512 s = round16_bf16(_mm512_div_ps(g16, _mm512_add_ps(one16, e)));
        store16_bf16(o + i, _mm512_mul_ps(s, load16_bf16(u + i)));
    }
#endif
#ifdef HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= I; i += 8) {
        const __m256 g8 = load8_bf16(g + i);
        const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(zero, g8));
        const __m256 s = round8_bf16(_mm256_div_ps(g8, _mm256_add_ps(one, e)));
        store8_bf16(o + i, _mm256_mul_ps(s, load8_bf16(u + i)));
    }
#endif
    for (; i < I; i++) {
        const float gi = bf16_f32(g[i]);
        o[i] = f32_bf16(bf16_round(gi / (1.f + expf(-gi))) * bf16_f32(u[i]));
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i], each rounded; rows spread over the calling
 * thread's OpenMP team when there are enough of them (an exp per element: the costliest of
 * these elementwise kernels) */
void silu_mul_bf16(const uint16_t *gu, int64_t T, int64_t I, uint16_t *out) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (T > 1 && T * I >= 32768)
#endif
    for (int64_t t = 0; t < T; t++)
        silu_span_bf16(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, 0, I);
}

/* rope_store_bf16 of one token: xt's R heads rotated into ot [R, D] (its cos c and sin s),
 * where slot is not NULL the last KV of them (k) and the KV heads after them (v) written to
 * the pools at *slot */
static void rope_row_bf16(const uint16_t *xt, const uint16_t *c, const uint16_t *s, int64_t R,
                          int64_t KV, int64_t D, uint16_t *ot, uint16_t *k_cache,
                          uint16_t *v_cache, const int64_t *slot) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < R; h++) {
        const uint16_t *xh = xt + h * D;
        uint16_t *oh = ot + h * D;
        int64_t i = 0;
#ifdef HAVE_AVX2
        for (; i + 8 <= half; i += 8) {
            const __m256 lo = load8_bf16(xh + i), hi = load8_bf16(xh + half + i);
            const __m256 a = round8_bf16(_mm256_mul_ps(lo, load8_bf16(c + i)));
            const __m256 b = round8_bf16(_mm256_mul_ps(hi, load8_bf16(s + i)));
            store8_bf16(oh + i, _mm256_add_ps(a, b));
            const __m256 a2 = round8_bf16(_mm256_mul_ps(hi, load8_bf16(c + half + i)));
            const __m256 b2 = round8_bf16(_mm256_mul_ps(lo, load8_bf16(s + half + i)));
            store8_bf16(oh + half + i, _mm256_add_ps(a2, b2));
        }
#endif
        for (; i < half; i++) {
            const float lo = bf16_f32(xh[i]), hi = bf16_f32(xh[half + i]);
            oh[i] = f32_bf16(bf16_round(lo * bf16_f32(c[i])) +
                             bf16_round(hi * bf16_f32(s[i])));
            oh[half + i] = f32_bf16(bf16_round(hi * bf16_f32(c[half + i])) +
                                    bf16_round(lo * bf16_f32(s[half + i])));
        }
    }
    if (slot) {
        const size_t bytes = (size_t)(KV * D) * sizeof(uint16_t);
        memcpy(k_cache + *slot * KV * D, ot + (R - KV) * D, bytes);
        memcpy(v_cache + *slot * KV * D, xt + R * D, bytes);
    }
}

/* rope_store in bfloat16: out = round(round(x * cos) + round(x_rolled * sin)) */
void rope_store_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos_t,
                     const uint16_t *sin_t, int64_t T, int64_t R, int64_t KV, int64_t D,
                     uint16_t *out, uint16_t *k_cache, uint16_t *v_cache,
                     const int64_t *slots) {
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (T > 1 && T * R * D >= ROWS_PARALLEL_MIN)
#endif
    for (int64_t t = 0; t < T; t++)
        rope_row_bf16(x + t * x_stride, cos_t + t * D, sin_t + t * D, R, KV, D,
                      out + t * R * D, k_cache, v_cache, slots ? slots + t : NULL);
}

static inline void prefetch_bytes(const void *base, int64_t bytes) {
    const char *p = (const char *)base;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

/* pass 1 in bfloat16: the scores of all H query heads (float32 qi) against one K row */
static inline void token_scores_bf16(const float *qi, const uint16_t *kr, int64_t H,
                                     int64_t KV, int64_t D, float scale, float *sc, int64_t L) {
    const int64_t G = H / KV;
#ifdef HAVE_AVX2
    if (D % 8 == 0) {
        for (int64_t h = 0; h < KV; h++) {
            const uint16_t *kh = kr + h * D;
            int64_t g0 = 0;
            for (; g0 + 4 <= G; g0 += 4) {
                const int64_t hq = h * G + g0;
                const float *q0 = qi + hq * D;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t d = 0; d < D; d += 8) {
                    const __m256 k8 = load8_bf16(kh + d);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), k8, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + D + d), k8, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 2 * D + d), k8, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + 3 * D + d), k8, a3);
                }
                const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
                const __m128 s = _mm_mul_ps(
                    _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)),
                    _mm_set1_ps(scale));
                float four[4];
                _mm_storeu_ps(four, s);
                sc[hq * L] = four[0];
                sc[(hq + 1) * L] = four[1];
                sc[(hq + 2) * L] = four[2];
                sc[(hq + 3) * L] = four[3];
            }
            for (; g0 < G; g0++) {
                const int64_t hq = h * G + g0;
                const float *qh = qi + hq * D;
                __m256 a = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8_bf16(kh + d), a);
                const __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(a),
                                             _mm256_extractf128_ps(a, 1));
                const __m128 q2 = _mm_hadd_ps(q4, q4);
                sc[hq * L] = _mm_cvtss_f32(_mm_hadd_ps(q2, q2)) * scale;
            }
        }
        return;
    }
#endif
    for (int64_t hq = 0; hq < H; hq++) {
        const float *qh = qi + hq * D;
        const uint16_t *kh = kr + (hq / G) * D;
        float s = 0.f;
        for (int64_t d = 0; d < D; d++) s += qh[d] * bf16_f32(kh[d]);
        sc[hq * L] = s * scale;
    }
}

#ifdef HAVE_AVX2
/* values_pair of a bfloat16 value row */
static inline __attribute__((always_inline)) void values_pair_bf16(
    const uint16_t *vr, const float *p0, const float *p1, __m256 *a, __m256 *b) {
    const __m256 w0 = _mm256_broadcast_ss(p0), w1 = _mm256_broadcast_ss(p1);
    for (int i = 0; i < 4; i++) {
        const __m256 vi = load8_bf16(vr + 8 * i);
        a[i] = _mm256_fmadd_ps(w0, vi, a[i]);
        b[i] = _mm256_fmadd_ps(w1, vi, b[i]);
    }
}
#endif

/* pass 2 in bfloat16: oi[hq] (float32) = inv[hq] * sum_j scores[hq, j] * V[slot_j, hq / G] */
static void weighted_values_bf16(const float *scores, const uint16_t *v, const int64_t *slots,
                                 int64_t L, int64_t H, int64_t KV, int64_t D, const float *inv,
                                 float *oi, int64_t row) {
    const int64_t G = H / KV;
#ifdef HAVE_AVX2
    if (D % 32 == 0) {
        for (int64_t h = 0; h < KV; h++) {
            for (int64_t g0 = 0; g0 < G; g0 += 2) {
                const int64_t hq = h * G + g0;
                const int two = G - g0 >= 2;
                const float *s0 = scores + hq * L, *s1 = two ? s0 + L : s0;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {
                    __m256 a[4], b[4];
                    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
                    for (int64_t j = 0; j < L; j++) {
                        if (j + PREFETCH_AHEAD < L)
                            __builtin_prefetch(v + slots[j + PREFETCH_AHEAD] * row + h * D + d0);
                        values_pair_bf16(v + slots[j] * row + h * D + d0, s0 + j, s1 + j, a, b);
                    }
                    store_scaled(oi + hq * D + d0, a, inv[hq]);
                    if (two) store_scaled(oi + (hq + 1) * D + d0, b, inv[hq + 1]);
                }
            }
        }
        return;
    }
#endif
    for (int64_t x = 0; x < H * D; x++) oi[x] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const uint16_t *vr = v + slots[j] * row;
        for (int64_t hq = 0; hq < H; hq++) {
            const float p = scores[hq * L + j];
            const uint16_t *vh = vr + (hq / G) * D;
            float *o = oi + hq * D;
            for (int64_t d = 0; d < D; d++) o[d] += p * bf16_f32(vh[d]);
        }
    }
    for (int64_t hq = 0; hq < H; hq++)
        for (int64_t d = 0; d < D; d++) oi[hq * D + d] *= inv[hq];
}

/* one sequence's queries of one kv head: G query heads (qi, bfloat16) against the keys and
 * values of kv head h at `slots` (L of them), into oi (bfloat16, G heads); scores: G * L */
static void attend_group_bf16(const uint16_t *qi, const uint16_t *k, const uint16_t *v,
                              const int64_t *slots, int64_t L, int64_t G, int64_t D,
                              int64_t row, float scale, float *scores, uint16_t *oi) {
    float qf[G * D], of[G * D], inv[G];
    for (int64_t e = 0; e < G * D; e++) qf[e] = bf16_f32(qi[e]);
    for (int64_t j = 0; j < L; j++) {
        if (j + PREFETCH_AHEAD < L) {
            prefetch_bytes(k + slots[j + PREFETCH_AHEAD] * row, D * 2);
            prefetch_bytes(v + slots[j + PREFETCH_AHEAD] * row, D * 2);
        }
        token_scores_bf16(qf, k + slots[j] * row, G, 1, D, scale, scores + j, L);
    }
    for (int64_t g = 0; g < G; g++) {
        /* as torch's flash attention in bfloat16: the sum of the float32 exponentials, the
         * values weighted by the exponentials rounded to bfloat16 */
        float *sg = scores + g * L;
        inv[g] = softmax_row(sg, L);
        int64_t j = 0;
#ifdef HAVE_AVX2
        for (; j + 8 <= L; j += 8) _mm256_storeu_ps(sg + j, round8_bf16(_mm256_loadu_ps(sg + j)));
#endif
        for (; j < L; j++) sg[j] = bf16_round(sg[j]);
    }
    weighted_values_bf16(scores, v, slots, L, G, 1, D, inv, of, row);
    int64_t e = 0;
#ifdef HAVE_AVX2
    for (; e + 8 <= G * D; e += 8) store8_bf16(oi + e, _mm256_loadu_ps(of + e));
#endif
    for (; e < G * D; e++) oi[e] = f32_bf16(of[e]);
}

#ifdef HAVE_AVX512BF16
/*
 * attend_group_bf16 on AVX512_BF16 (G <= 16 query heads, D a multiple of 32 up to 256), with
 * the same roundings (the float32 sums in another order):
 *   scores: 16 keys at a time, lane j holding key j. The 16 key rows (read in place through
 *   the slots) are transposed in registers 32 dims at a time, so that one vector holds dims
 *   2i, 2i+1 of the 16 keys (the pair layout vdpbf16ps wants), then multiplied with every
 *   query head's dims 2i, 2i+1 (bfloat16 products, float32 sums): each key row is read once
 *   for all G heads, and no sum is reduced across lanes (a gather of the pairs instead was
 *   1.5x slower: Zen 4's gathers). Each head sums even and odd pairs in two accumulators
 *   (added at the end): one chain of 32 dependent vdpbf16ps a head was the scores' bound;
 *   softmax: the exponentials 16 at a time (exp16), rounded to bfloat16 as they are summed;
 *   values: up to 64 dims of up to 4 heads (32 of more) summed in registers in one pass over
 *   the keys, two keys at a time (their rows interleaved into pairs, the two weights of each
 *   head as one pair: vdpbf16ps again).
 */
#define DEC_MAX_G 16

/* a 16 x 16 matrix of 32-bit words transposed in registers: r[p] lane j <- r[j] lane p */
static inline __attribute__((always_inline)) void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 2; i++)
        for (int c = 0; c < 4; c++) {
            t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
            t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xdd);
        }
    for (int c = 0; c < 8; c++) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
    }
}

/* rows to prefetch while a block's scores go, one for each of the block's first n keys:
 * `bytes` at k + slots[j] * row and at v + slots[j] * row */
typedef struct {
    const uint16_t *k, *v;
    const int64_t *slots;
    int64_t n, row, bytes;
} RowsAhead;

static const RowsAhead no_rows_ahead = {0, 0, 0, 0, 0, 0};

static inline __attribute__((always_inline)) void prefetch_row_of(const RowsAhead *a,
                                                                  int64_t j) {
    const char *pk = (const char *)(a->k + a->slots[j] * a->row);
    const char *pv = (const char *)(a->v + a->slots[j] * a->row);
    for (int64_t b = 0; b < a->bytes; b += 64) {
        __builtin_prefetch(pk + b);
        __builtin_prefetch(pv + b);
    }
}

/* the scores of n <= 16 keys (at `slots`, kv head base k) for G query heads (q32: their dims as
 * pairs): each 32 dims of the 16 key rows transposed in registers into 16 vectors, vector p
 * holding dims 2p, 2p+1 of every key (the pair layout vdpbf16ps wants, a key a lane); even
 * and odd p in two sums a head */
static inline __attribute__((always_inline)) void scores16_bf16(
    const int32_t *q32, const uint16_t *k, const int64_t *slots, int64_t n, int64_t row,
    int64_t D2, const int G, float scale, float *sc, int64_t L, const RowsAhead *ahead) {
    __m512 acc[8], odd[8];
    for (int g = 0; g < G; g++) acc[g] = odd[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D2; c += 16) {
        __m512i r[16];
        for (int64_t j = 0; j < 16; j++) {
            r[j] = j < n ? _mm512_loadu_si512(k + slots[j] * row + 2 * c) : _mm512_setzero_si512();
            if (c == 0 && j < ahead->n) prefetch_row_of(ahead, j);
        }
        transpose16_epi32(r);
        for (int p = 0; p < 16; p += 2)
            for (int g = 0; g < G; g++) {
                acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)r[p],
                                          (__m512bh)_mm512_set1_epi32(q32[g * D2 + c + p]));
                odd[g] = _mm512_dpbf16_ps(odd[g], (__m512bh)r[p + 1],
                                          (__m512bh)_mm512_set1_epi32(q32[g * D2 + c + p + 1]));
            }
    }
    const __m512 s = _mm512_set1_ps(scale);
    const __mmask16 m = (__mmask16)((1u << n) - 1);
    for (int g = 0; g < G; g++)
        _mm512_mask_storeu_ps(sc + g * L, m, _mm512_mul_ps(_mm512_add_ps(acc[g], odd[g]), s));
}

/* NB x 32 dims of the weighted values of G heads (G * NB <= 8): two keys' rows at a time
 * interleaved into pairs (dim d of keys j, j+1 side by side), times each head's two weights
 * (pw: the bfloat16 weights of head g at pw + g * Lp, keys as pairs, a zero past the last
 * key) with vdpbf16ps; the interleave leaves dims 0-3, 8-11, 16-19, 24-27 of each 32 in lo
 * and 4-7, ... in hi, put back in order when stored (out = sum * inv[g], rounded) */
static inline __attribute__((always_inline)) void values32_bf16(
    const int32_t *pw, int64_t Lp, const uint16_t *v, const int64_t *slots, int64_t L,
    int64_t row, const int G, const int NB, const float *inv, uint16_t *o, int64_t D) {
    __m512 lo[8], hi[8];
    for (int a = 0; a < G * NB; a++) lo[a] = hi[a] = _mm512_setzero_ps();
    for (int64_t j = 0; j < L; j += 2) {
        const uint16_t *v0 = v + slots[j] * row;
        const uint16_t *v1 = j + 1 < L ? v + slots[j + 1] * row : 0;
        __m512bh a[2], b[2];
        for (int x = 0; x < NB; x++) {
            const __m512i r0 = _mm512_loadu_si512(v0 + 32 * x);
            const __m512i r1 = v1 ? _mm512_loadu_si512(v1 + 32 * x) : _mm512_setzero_si512();
            a[x] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            b[x] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
        for (int g = 0; g < G; g++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[g * Lp + j / 2]);
            for (int x = 0; x < NB; x++) {
                lo[g * NB + x] = _mm512_dpbf16_ps(lo[g * NB + x], a[x], w);
                hi[g * NB + x] = _mm512_dpbf16_ps(hi[g * NB + x], b[x], w);
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                             30, 31);
    for (int g = 0; g < G; g++) {
        const __m512 s = _mm512_set1_ps(inv[g]);
        for (int x = 0; x < NB; x++) {
            const __m512 l = lo[g * NB + x], h = hi[g * NB + x];
            store16_bf16(o + g * D + 32 * x, _mm512_mul_ps(_mm512_permutex2var_ps(l, first, h), s));
            store16_bf16(o + g * D + 32 * x + 16,
                         _mm512_mul_ps(_mm512_permutex2var_ps(l, second, h), s));
        }
    }
}

/* the scores of keys [j0, j0 + 16) for G heads, G a constant where it is small */
static void scores_block_bf16(const int32_t *q32, const uint16_t *k, const int64_t *slots,
                              int64_t n, int64_t row, int64_t D2, int64_t G, float scale,
                              float *sc, int64_t L, const RowsAhead *ahead) {
    switch (G) {
#define SC_CASE(c) case c: scores16_bf16(q32, k, slots, n, row, D2, c, scale, sc, L, ahead); return;
        SC_CASE(1) SC_CASE(2) SC_CASE(3) SC_CASE(4) SC_CASE(5) SC_CASE(6) SC_CASE(7)
        SC_CASE(8)
#undef SC_CASE
        default:
            for (int64_t g0 = 0; g0 < G; g0 += 8) {
                const int64_t m = G - g0 < 8 ? G - g0 : 8;
                scores_block_bf16(q32 + g0 * D2, k, slots, n, row, D2, m, scale, sc + g0 * L, L,
                                  g0 ? &no_rows_ahead : ahead);
            }
    }
}

/* the weighted values of G heads, all D dims: 64 dims a pass over the keys for up to 4 heads
 * a pass, 32 dims for up to 8 */
static void values_block_bf16(const int32_t *pw, int64_t Lp, const uint16_t *v,
                              const int64_t *slots, int64_t L, int64_t row, int64_t G,
                              const float *inv, uint16_t *o, int64_t D) {
    for (int64_t g0 = 0; g0 < G; g0 += 8) {
        const int64_t m = G - g0 < 8 ? G - g0 : 8;
        const int32_t *pg = pw + g0 * Lp;
        const float *ig = inv + g0;
        uint16_t *og = o + g0 * D;
        int64_t d0 = 0;
        if (m <= 4)
            for (; d0 + 64 <= D; d0 += 64) switch (m) {
#define VA2(c) case c: values32_bf16(pg, Lp, v + d0, slots, L, row, c, 2, ig, og + d0, D); break;
                VA2(1) VA2(2) VA2(3) VA2(4)
#undef VA2
            }
        for (; d0 < D; d0 += 32) switch (m) {
#define VA1(c) case c: values32_bf16(pg, Lp, v + d0, slots, L, row, c, 1, ig, og + d0, D); break;
            VA1(1) VA1(2) VA1(3) VA1(4) VA1(5) VA1(6) VA1(7) VA1(8)
#undef VA1
        }
    }
}

/* softmax of one head's L scores in place as torch's flash attention in bfloat16 does it: the
 * float32 exponentials summed, each written back rounded to bfloat16 over the float32 scores
 * (pb = sg as uint16: behind what is still to read), a zero weight past an odd last key;
 * returns 1 / the sum */
static float softmax_bf16_weights(float *sg, int64_t L) {
    uint16_t *pb = (uint16_t *)sg;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + j));
    const __mmask16 tail = (__mmask16)((1u << (L - j)) - 1);
    if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, sg + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= L; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m));
        sum = _mm512_add_ps(sum, e);
        store16_bf16(pb + j, e);
    }
    if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(
            tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sg + j), m)));
        sum = _mm512_add_ps(sum, e);
        const __m512i r = _mm512_srli_epi32(round16_bits(e), 16);
        _mm256_mask_storeu_epi16(pb + j, tail, _mm512_cvtepi32_epi16(r));
    }
    if (L % 2) pb[L] = 0;
    return 1.f / _mm512_reduce_add_ps(sum);
}

/* the rows of keys [from, to) (`bytes` from each row start at `slots`) on their way to the cache */
static inline __attribute__((always_inline)) void prefetch_keys(
    const uint16_t *base, const int64_t *slots, int64_t from, int64_t to, int64_t row,
    int64_t bytes) {
    for (int64_t j = from; j < to; j++) {
        const char *p = (const char *)(base + slots[j] * row);
        for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
    }
}

/* the softmax of G heads' scores (head g's L at scores + g * Lp floats) and their weighted
 * values, into oi (G heads of D) */
static void weigh_values_avx512bf16(const uint16_t *v, const int64_t *slots, int64_t L,
                                    int64_t Lp, int64_t G, int64_t D, int64_t row,
                                    float *scores, uint16_t *oi) {
    float inv[DEC_MAX_G];
    for (int64_t g = 0; g < G; g++) inv[g] = softmax_bf16_weights(scores + g * Lp, L);
    values_block_bf16((const int32_t *)scores, Lp, v, slots, L, row, G, inv, oi, D);
}

/* attend_group_bf16's task on AVX512_BF16: the keys prefetched a block ahead, the values a
 * block at a time as the scores go */
static void attend_group_avx512bf16(const uint16_t *qi, const uint16_t *k, const uint16_t *v,
                                   const int64_t *slots, int64_t L, int64_t G, int64_t D,
                                   int64_t row, float scale, float *scores, uint16_t *oi) {
    const int64_t D2 = D / 2;
    const int32_t *q32 = (const int32_t *)qi;
    prefetch_keys(k, slots, 0, L < 16 ? L : 16, row, 2 * D);
    for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const int64_t n = L - j0 < 16 ? L - j0 : 16;
        prefetch_keys(k, slots, j0 + 16 < L ? j0 + 16 : L, j0 + 32 < L ? j0 + 32 : L, row, 2 * D);
        prefetch_keys(v, slots, j0, j0 + n, row, 2 * D);
        scores_block_bf16(q32, k, slots + j0, n, row, D2, G, scale, scores + j0, L,
                          &no_rows_ahead);
    }
    weigh_values_avx512bf16(v, slots, L, L, G, D, row, scores, oi);
}

/*
 * decode_attention_bf16 for a batch of sequences: a task is a sequence, all its kv heads.
 * Its keys go 16 at a time, each block's scores for every kv head in turn, so each K row
 * is read whole (every kv head's 128 bytes at SmolLM2's shape) while the rows of the next
 * block, K and V, are prefetched between the loads of this one's (kv head h's part of them
 * while head h's scores go): the loads of a decode step's attention wait on the pool, not on
 * the arithmetic, and scattered whole rows arrive at about twice the rate of one head's
 * part. Each thread claims its next sequence before it starts the current one, so that the
 * last block's prefetches fetch the next sequence's first rows. The softmax and values of
 * each (sequence, kv head) are then attend_group_avx512bf16's (the same sums: the same
 * bits), the V rows already in the cache. A sequence's scores (H of them per key) live in a
 * buffer of its thread's own.
 */
static _Thread_local float *seq_scores;
static _Thread_local int64_t seq_scores_len;

/* the start and length of sequence i's keys */
static inline int64_t seq_keys(const int64_t *lens, int64_t i, int64_t window, int64_t *start) {
    const int64_t len = lens[i];
    *start = (window > 0 && len > window) ? len - window : 0;
    return len - *start;
}

/* sequence i's attention, the first rows of sequence `next` (if < n) prefetched at its end;
 * `cold`: nothing of i's prefetched yet. 0 where its scores buffer could not be had (nothing
 * written) */
static int attend_sequence_avx512bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                                      const uint16_t *v, const int64_t *table, int64_t ctx,
                                      const int64_t *rows, const int64_t *lens, int64_t i,
                                      int64_t next, int64_t n, int64_t H, int64_t KV,
                                      int64_t D, float scale, int64_t window, int cold,
                                      uint16_t *out) {
    const int64_t G = H / KV, row = KV * D, D2 = D / 2;
    int64_t start;
    const int64_t L = seq_keys(lens, i, window, &start), Lp = L + 1;
    if (H * Lp > seq_scores_len) {
        float *grown = (float *)realloc(seq_scores, (size_t)(H * Lp) * sizeof(float));
        if (!grown) return 0;
        seq_scores = grown;
        seq_scores_len = H * Lp;
    }
    const int64_t *slots = table + rows[i] * ctx + start;
    if (cold) {
        prefetch_keys(k, slots, 0, L < 16 ? L : 16, row, 2 * row);
        prefetch_keys(v, slots, 0, L < 16 ? L : 16, row, 2 * row);
    }
    for (int64_t p0 = 0; p0 < L; p0 += 16) {
        const int64_t nk = L - p0 < 16 ? L - p0 : 16;
        RowsAhead ahead = {k, v, slots + p0 + 16, L - p0 - 16 < 16 ? L - p0 - 16 : 16, row,
                           2 * D};
        if (ahead.n <= 0) { /* the next sequence's first block */
            ahead.n = 0;
            if (next < n) {
                int64_t nstart;
                const int64_t nL = seq_keys(lens, next, window, &nstart);
                ahead.slots = table + rows[next] * ctx + nstart;
                ahead.n = nL < 16 ? nL : 16;
            }
        }
        for (int64_t h = 0; h < KV; h++) {
            RowsAhead part = ahead;
            part.k += h * D;
            part.v += h * D;
            scores_block_bf16((const int32_t *)(q + i * q_stride + h * G * D), k + h * D,
                              slots + p0, nk, row, D2, G, scale, seq_scores + h * G * Lp + p0,
                              Lp, &part);
        }
    }
    for (int64_t h = 0; h < KV; h++)
        weigh_values_avx512bf16(v + h * D, slots, L, Lp, G, D, row, seq_scores + h * G * Lp,
                                out + (i * H + h * G) * D);
    return 1;
}

/* decode_attention_bf16's batch path: sequences spread over the team, each thread claiming
 * its next one ahead; 0 where a scores buffer could not be had */
static int attend_sequences_avx512bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                                       const uint16_t *v, const int64_t *table, int64_t ctx,
                                       const int64_t *rows, const int64_t *lens, int64_t n,
                                       int64_t H, int64_t KV, int64_t D, float scale,
                                       int64_t window, int64_t team, uint16_t *out) {
    int64_t claimed = 0;
    int ok = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads((int)team) if (team > 1) reduction(& : ok)
#endif
    {
        int64_t i = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        int cold = 1;
        while (i < n) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            ok &= attend_sequence_avx512bf16(q, q_stride, k, v, table, ctx, rows, lens, i, next,
                                             n, H, KV, D, scale, window, cold, out);
            cold = 0;
            i = next;
        }
    }
    return ok;
}
#endif

/*
 * decode_attention over a bfloat16 pool: q [n, H, D] and out [n, H, D] bfloat16, the rest as
 * decode_attention. Each (sequence, kv head) pair is a task of its own, spread over the
 * calling thread's OpenMP team where the build has OpenMP (torch's own runtime: the library
 * binds to the libgomp torch loaded, so torch.set_num_threads sizes the team, and its
 * threads, spinning after torch's last op, start at once); each thread uses its own
 * G * max(L) floats of scores, so the team is at most scores_len / (G * max(L)).
 */
void decode_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                           const uint16_t *v, const int64_t *table, int64_t ctx,
                           const int64_t *rows, const int64_t *lens, int64_t n, int64_t H,
                           int64_t KV, int64_t D, float scale, int64_t window,
                           float *scores, int64_t scores_len, uint16_t *out) {
    const int64_t G = H / KV, row = KV * D, tasks = n * KV;
    int64_t longest = 1;
    for (int64_t i = 0; i < n; i++) {
        const int64_t L = (window > 0 && lens[i] > window) ? window : lens[i];
        longest = L > longest ? L : longest;
    }
    const int64_t stride = G * longest;
    int64_t team = scores_len / stride;
#ifdef _OPENMP
    const int64_t most = omp_get_max_threads();
    team = team < most ? team : most;
#else
    team = 1;
#endif
    team = team < tasks ? team : tasks;
    team = team > 1 ? team : 1;
#ifdef HAVE_AVX512BF16
    if (D % 32 == 0 && D <= 256 && G <= DEC_MAX_G &&
        n >= 4 * team &&
        attend_sequences_avx512bf16(q, q_stride, k, v, table, ctx, rows, lens, n, H, KV, D,
                                    scale, window, team, out))
        return;
#endif
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads((int)team) if (team > 1)
#endif
    for (int64_t task = 0; task < tasks; task++) {
#ifdef _OPENMP
        float *sc = scores + (int64_t)omp_get_thread_num() * stride;
#else
        float *sc = scores;
#endif
        const int64_t i = task / KV, h = task % KV, len = lens[i];
        const int64_t start = (window > 0 && len > window) ? len - window : 0;
        const uint16_t *qi = q + i * q_stride + h * G * D;
        const int64_t *slots = table + rows[i] * ctx + start;
        uint16_t *oi = out + (i * H + h * G) * D;
#ifdef HAVE_AVX512BF16
        if (D % 32 == 0 && D <= 256 && G <= DEC_MAX_G) {
            attend_group_avx512bf16(qi, k + h * D, v + h * D, slots, len - start, G, D, row,
                                    scale, sc, oi);
            continue;
        }
#endif
        attend_group_bf16(qi, k + h * D, v + h * D, slots, len - start, G, D, row, scale, sc,
                          oi);
    }
}

/*
 * A bfloat16 decode step's attention in one call: rope_store_bf16 of the fused qkv [n, H + 2 KV,
 * D] (q and k rotated into `rotated` [n, H + KV, D], the rotated k and the v written to the
 * pools at `out_slots`), then decode_attention_bf16 of the rotated q heads into out [n, H, D].
 */
void rope_attend_bf16(const uint16_t *qkv, int64_t qkv_stride, const uint16_t *cos_t,
                      const uint16_t *sin_t, int64_t n, int64_t H, int64_t KV, int64_t D,
                      uint16_t *rotated, uint16_t *k, uint16_t *v, const int64_t *out_slots,
                      const int64_t *table, int64_t ctx, const int64_t *rows,
                      const int64_t *lens, float scale, int64_t window, float *scores,
                      int64_t scores_len, uint16_t *out) {
    rope_store_bf16(qkv, qkv_stride, cos_t, sin_t, n, H + KV, KV, D, rotated, k, v, out_slots);
    decode_attention_bf16(rotated, (H + KV) * D, k, v, table, ctx, rows, lens, n, H, KV, D,
                          scale, window, scores, scores_len, out);
}

/*
 * Prefill attention in bfloat16: extend_attention's task (one sequence's n new tokens at
 * positions p..p+n-1, causal over the keys of positions [0, p + n) read from the pool through
 * `slots`, a sliding window keeping each query's last `window`) as a flash-attention kernel
 * on AVX512_BF16, with the numerics of torch's CPU flash kernel in bfloat16: scores in float32
 * (bfloat16 products, float32 sums), the online softmax in float32, the probabilities rounded
 * to bfloat16 for the P.V product, the output accumulated in float32 and rounded once.
 *
 * First every kv head's keys are packed, once per call, in blocks of EXT_BK (key j's dims 2i,
 * 2i+1 side by side, 16 keys a vector: the pair layout _mm512_dpbf16_ps wants; values likewise
 * with keys 2i, 2i+1 side by side): reading through the slots costs nothing extra there. A
 * task is then one kv head x a block of EXT_BQ query tokens; its rows are (token, query head)
 * pairs, the G query heads of the kv head together, so each packed block serves G * EXT_BQ
 * query rows.
 * Rows go EXT_R at a time against the whole key block with their sums in registers; the
 * running output of the task's rows lives in a float32 buffer per thread. Tasks are spread
 * over the calling thread's OpenMP team (torch's libgomp, as decode_attention_bf16), dynamic,
 * the longest (last) query blocks first: causal blocks are uneven.
 *   q      [n, H, D] bfloat16, token i at q + i * q_stride (heads contiguous)
 *   k, v   [slots, KV, D] bfloat16 (the pool of one layer), the new tokens' rows written
 *   slots  [p + n] int64 pool slots of positions 0..p+n-1
 *   out    [n, H, D] bfloat16
 * Returns 1; 0 where !extend_attention_bf16_applies(D) (nothing written) or a thread's buffer
 * could not be allocated (out incomplete).
 */
int extend_attention_bf16_applies(int64_t D) {
#ifdef HAVE_AVX512BF16
    return D > 0 && D % 32 == 0 && D <= 256;
#else
    (void)D;
    return 0;
#endif
}

#ifdef HAVE_AVX512BF16
#include <stdlib.h>

#define EXT_BQ 64 /* query tokens of a task */
#define EXT_BK 64 /* keys of a packed block: 4 vectors of 16 scores a row */
#define EXT_R 6   /* query rows a register block: 24 accumulators */


/* keys [j0, j0 + EXT_BK) of kv head h packed: kp32[(jv * D/2 + i) * 16 + jj] holds dims
 * 2i, 2i+1 of key 16 jv + jj; values: vp32[(i * D/16 + dv) * 16 + dd] holds dim 16 dv + dd of
 * keys 2i, 2i+1. Keys at or past L are zeros. */
static void pack_block_bf16(const uint16_t *k, const uint16_t *v, const int64_t *slots,
                            int64_t j0, int64_t L, int64_t D, int64_t row, int64_t h,
                            uint32_t *kp32, uint32_t *vp32) {
    const int64_t D2 = D / 2, DV = D / 16;
    for (int64_t j = 0; j < EXT_BK; j++) {
        uint32_t *dst = kp32 + (j / 16) * D2 * 16 + (j % 16);
        if (j0 + j < L) {
            const uint32_t *src = (const uint32_t *)(k + slots[j0 + j] * row + h * D);
            for (int64_t i = 0; i < D2; i++) dst[i * 16] = src[i];
        } else {
            for (int64_t i = 0; i < D2; i++) dst[i * 16] = 0;
        }
    }
    for (int64_t i = 0; i < EXT_BK / 2; i++) {
        const int64_t ja = j0 + 2 * i, jb = ja + 1;
        uint32_t *dst = vp32 + i * DV * 16;
        if (jb < L) {
            const uint16_t *va = v + slots[ja] * row + h * D, *vb = v + slots[jb] * row + h * D;
            for (int64_t dv = 0; dv < DV; dv++) {
                const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(va + dv * 16)));
                const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vb + dv * 16)));
                _mm512_storeu_si512(dst + dv * 16, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        } else if (ja < L) {
            const uint16_t *va = v + slots[ja] * row + h * D;
            for (int64_t dv = 0; dv < DV; dv++)
                _mm512_storeu_si512(dst + dv * 16, _mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)(va + dv * 16))));
        } else {
            for (int64_t dv = 0; dv < DV; dv++) _mm512_storeu_si512(dst + dv * 16, _mm512_setzero_si512());
        }
    }
}

/* raw scores of R rows (qr[r]: D bfloat16) against the packed key block: s[r][0..EXT_BK) */
static inline __attribute__((always_inline)) void block_scores_bf16(
    const int R, const uint16_t *const *qr, const uint32_t *kp32, int64_t D, float *s) {
    const int64_t D2 = D / 2;
    __m512 acc[EXT_R][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D2; i++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp32 + (0 * D2 + i) * 16);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp32 + (1 * D2 + i) * 16);
        const __m512bh k2 = (__m512bh)_mm512_loadu_si512(kp32 + (2 * D2 + i) * 16);
        const __m512bh k3 = (__m512bh)_mm512_loadu_si512(kp32 + (3 * D2 + i) * 16);
        for (int r = 0; r < R; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32(((const int32_t *)qr[r])[i]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qb, k2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qb, k3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * EXT_BK + c * 16, acc[r][c]);
}

/* o[r][d0 .. d0 + 16 NV) = alpha[r] * o[r][...] + sum_{pairs i < np} P[r][2i, 2i+1] . V pairs */
static inline __attribute__((always_inline)) void block_values_bf16(
    const int R, const int NV, const uint16_t *p, const uint32_t *vp32, int64_t DV, int64_t d0,
    int64_t np, const float *alpha, float *const *o) {
    __m512 acc[EXT_R][4];
    for (int r = 0; r < R; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int c = 0; c < NV; c++) acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o[r] + d0 + c * 16));
    }
    const uint32_t *vb = vp32 + (d0 / 16) * 16;
    for (int64_t i = 0; i < np; i++) {
        __m512bh vv[4];
        for (int c = 0; c < NV; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vb + (i * DV + c) * 16);
        for (int r = 0; r < R; r++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(((const int32_t *)(p + r * EXT_BK))[i]);
            for (int c = 0; c < NV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(o[r] + d0 + c * 16, acc[r][c]);
}

static void block_values_any(int R, const uint16_t *p, const uint32_t *vp32, int64_t D,
                             int64_t np, const float *alpha, float *const *o) {
    const int64_t DV = D / 16;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int NV = D - d0 >= 64 ? 4 : 2; /* D is a multiple of 32 */
#define EXT_VALUES(RR)                                                                    \
    (NV == 4 ? block_values_bf16(RR, 4, p, vp32, DV, d0, np, alpha, o)                    \
             : block_values_bf16(RR, 2, p, vp32, DV, d0, np, alpha, o))
        switch (R) {
        case 6: EXT_VALUES(6); break;
        case 5: EXT_VALUES(5); break;
        case 4: EXT_VALUES(4); break;
        case 3: EXT_VALUES(3); break;
        case 2: EXT_VALUES(2); break;
        default: EXT_VALUES(1);
        }
#undef EXT_VALUES
    }
}

/* one task: query tokens [t0, t1) of kv head h against its packed key and value blocks
 * (kpk, vpk: EXT_BK * D / 2 words a block); buf: the thread's buffer */
static void extend_task_bf16(const uint16_t *q, int64_t q_stride, const uint32_t *kpk,
                             const uint32_t *vpk, int64_t p, int64_t t0, int64_t t1, int64_t H,
                             int64_t KV, int64_t D, float scale, int64_t window, int64_t h,
                             void *buf, uint16_t *out) {
    const int64_t G = H / KV, rows = (t1 - t0) * G, L = p + t1;
    float *o = (float *)buf;                          /* rows * D */
    float *m = o + rows * D, *l = m + rows;           /* rows each */
    float *s = l + rows;                              /* EXT_R * EXT_BK */
    uint16_t *pr = (uint16_t *)(s + EXT_R * EXT_BK);  /* EXT_R * EXT_BK */
    for (int64_t r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.f; }
    memset(o, 0, (size_t)(rows * D) * sizeof(float));
    /* the task's keys: from the first query's window start to the last query's position */
    const int64_t first_lo = (window > 0 && p + t0 + 1 > window) ? p + t0 + 1 - window : 0;
    const __m512 sv = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j0 = first_lo / EXT_BK * EXT_BK; j0 < L; j0 += EXT_BK) {
        const uint32_t *kp32 = kpk + (j0 / EXT_BK) * EXT_BK * D / 2;
        const uint32_t *vp32 = vpk + (j0 / EXT_BK) * EXT_BK * D / 2;
        for (int64_t r0 = 0; r0 < rows; r0 += EXT_R) {
            const int R = rows - r0 >= EXT_R ? EXT_R : (int)(rows - r0);
            /* rows r0.. are tokens (r0 + r) / G, heads (r0 + r) % G */
            const int64_t t_first = t0 + r0 / G, t_last = t0 + (r0 + R - 1) / G;
            const int64_t lo_first = (window > 0 && p + t_first + 1 > window) ? p + t_first + 1 - window : 0;
            if (p + t_last + 1 <= j0 || lo_first >= j0 + EXT_BK) continue; /* none of its keys here */
            const uint16_t *qr[EXT_R];
            float *orow[EXT_R], alpha[EXT_R];
            for (int r = 0; r < R; r++) {
                const int64_t rr = r0 + r;
                qr[r] = q + (t0 + rr / G) * q_stride + (h * G + rr % G) * D;
                orow[r] = o + rr * D;
            }
            switch (R) {
            case 6: block_scores_bf16(6, qr, kp32, D, s); break;
            case 5: block_scores_bf16(5, qr, kp32, D, s); break;
            case 4: block_scores_bf16(4, qr, kp32, D, s); break;
            case 3: block_scores_bf16(3, qr, kp32, D, s); break;
            case 2: block_scores_bf16(2, qr, kp32, D, s); break;
            default: block_scores_bf16(1, qr, kp32, D, s);
            }
            int64_t used = 0; /* keys of the block any row uses: [0, used) */
            for (int r = 0; r < R; r++) {
                const int64_t rr = r0 + r, pos = p + t0 + rr / G;
                const int64_t lo = (window > 0 && pos + 1 > window) ? pos + 1 - window : 0;
                const int64_t a = lo > j0 ? lo - j0 : 0, b = pos + 1 - j0 < EXT_BK ? pos + 1 - j0 : EXT_BK;
                float *sr = s + r * EXT_BK;
                uint16_t *pp = pr + r * EXT_BK;
                if (b <= a) { /* no key of this row in the block: it stays as it was */
                    alpha[r] = 1.f;
                    memset(pp, 0, EXT_BK * sizeof(uint16_t));
                    continue;
                }
                used = b > used ? b : used;
                __m512 x[4];
                __mmask16 keep[4];
                __m512 mx = _mm512_set1_ps(-INFINITY);
                for (int c = 0; c < 4; c++) {
                    const __m512i jj = _mm512_add_epi32(lane, _mm512_set1_epi32(c * 16));
                    keep[c] = _mm512_cmpge_epi32_mask(jj, _mm512_set1_epi32((int)a))
                              & _mm512_cmplt_epi32_mask(jj, _mm512_set1_epi32((int)b));
                    x[c] = _mm512_mul_ps(_mm512_loadu_ps(sr + c * 16), sv);
                    mx = _mm512_mask_max_ps(mx, keep[c], mx, x[c]);
                }
                const float bmax = _mm512_reduce_max_ps(mx);
                const float mnew = bmax > m[rr] ? bmax : m[rr];
                alpha[r] = expf(m[rr] - mnew); /* 0 at the row's first block */
                const __m512 mv = _mm512_set1_ps(mnew);
                __m512 sum = _mm512_setzero_ps();
                for (int c = 0; c < 4; c++) {
                    const __m512 e = _mm512_maskz_mov_ps(keep[c], exp16(_mm512_sub_ps(x[c], mv)));
                    sum = _mm512_add_ps(sum, e);
                    _mm256_storeu_si256((__m256i *)(pp + c * 16), (__m256i)_mm512_cvtneps_pbh(e));
                }
                l[rr] = l[rr] * alpha[r] + _mm512_reduce_add_ps(sum);
                m[rr] = mnew;
            }
            block_values_any(R, pr, vp32, D, (used + 1) / 2, alpha, orow);
        }
    }
    for (int64_t rr = 0; rr < rows; rr++) {
        const int64_t t = t0 + rr / G;
        uint16_t *dst = out + (t * H + h * G + rr % G) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[rr]);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + rr * D + d), inv)));
    }
}
#endif

/*
 * The same task on AMX tiles where the CPU has them (TDPBF16PS: a 16 x 16 float32 tile of sums
 * of 32 bfloat16 products each, one instruction), transposed: a task's rows go 16 at a time as
 * the 16 lanes of a vector. The scores S^T = K.Q^T (keys as they lie in the A operand, the 16
 * rows' q in the pair layout as B), so each key's scores for the 16 rows are one vector: the
 * online softmax's max and sum run across keys lane by lane (no horizontal reductions), the
 * 16 rescale factors are one exp16, the probabilities go to bfloat16 pairs (the B operand of
 * O^T = V^T.P^T, the values packed transposed as A), and the running output is D vectors of
 * 16 rows in float32, turned back to rows once at the end. The arithmetic of the vector path
 * (float32 scores and softmax over the same blocks of EXT_BK keys, the probabilities rounded
 * to bfloat16, the output rounded once) but the order of the float32 sums (the tiles' own)
 * and the rescale factors' exp (exp16, not expf).
 * Tiles: 0-3 sums (scores, then P.V), 4 the A operand, 5 the B operand; all 16 x 64 bytes.
 */
#if defined(HAVE_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define HAVE_EXT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* whether Linux granted this process the tiles (-1: not asked yet); whether they are used */
static int ext_amx_granted = -1, ext_amx_on = 1;

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ExtTileConfig;

static void ext_amx_configure(void) {
    ExtTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 6; i++) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
}

/* keys [j0, j0 + EXT_BK) of kv head h for the tiles: kt [EXT_BK][D] as they are (the A operand
 * of K.Q^T), vt [D][EXT_BK] transposed (the A operand of V^T.P^T: keys 2i, 2i+1 interleaved
 * into 32-bit words, then 16 x 16 words transposed at a time); zeros at or past L */
static void pack_block_amx(const uint16_t *k, const uint16_t *v, const int64_t *slots,
                           int64_t j0, int64_t L, int64_t D, int64_t row, int64_t h,
                           uint16_t *kt, uint16_t *vt) {
    for (int64_t j = 0; j < EXT_BK; j++) {
        if (j0 + j < L)
            memcpy(kt + j * D, k + slots[j0 + j] * row + h * D, (size_t)D * sizeof(uint16_t));
        else
            memset(kt + j * D, 0, (size_t)D * sizeof(uint16_t));
    }
    uint32_t *vt32 = (uint32_t *)vt; /* [D][EXT_BK / 2] words */
    for (int64_t ib = 0; ib < EXT_BK / 32; ib++)
        for (int64_t dc = 0; dc < D / 16; dc++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t ja = j0 + 2 * (16 * ib + i), jb = ja + 1;
                const __m512i va = ja < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                (const __m256i *)(v + slots[ja] * row + h * D + 16 * dc)))
                                          : _mm512_setzero_si512();
                const __m512i vb = jb < L ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                (const __m256i *)(v + slots[jb] * row + h * D + 16 * dc)))
                                          : _mm512_setzero_si512();
                r[i] = _mm512_or_si512(va, _mm512_slli_epi32(vb, 16));
            }
            transpose16_epi32(r);
            for (int dd = 0; dd < 16; dd++)
                _mm512_storeu_si512(vt32 + (16 * dc + dd) * (EXT_BK / 2) + 16 * ib, r[dd]);
        }
}

/* one task on the tiles, transposed: 16 rows are the 16 lanes of a vector, so a key's scores
 * for all of them are one vector (S^T = K.Q^T), the softmax's max and sum run across keys
 * lane by lane (no horizontal reductions, one exp16 for the 16 rescale factors), and the
 * output is kept transposed too (O^T = V^T.P^T, D vectors of 16 rows), turned back at the end. */
static void extend_task_amx(const uint16_t *q, int64_t q_stride, const uint16_t *ktk,
                            const uint16_t *vtk, int64_t p, int64_t t0, int64_t t1, int64_t H,
                            int64_t KV, int64_t D, float scale, int64_t window, int64_t h,
                            void *buf, uint16_t *out) {
    const int64_t G = H / KV, rows = (t1 - t0) * G;
    const int64_t DC = D / 32;                       /* 32-dim chunks */
    float *ot = (float *)buf;                        /* [D][16] per 16 rows */
    float *s = ot + D * 16;                          /* [EXT_BK][16] */
    float *pvt = s + EXT_BK * 16;                    /* [D][16] */
    uint16_t *pt = (uint16_t *)(pvt + D * 16);       /* [EXT_BK / 2][16][2] */
    uint32_t *qt = (uint32_t *)(pt + EXT_BK * 16);   /* [DC][16 pairs][16 rows] per 16 rows */
    ext_amx_configure();
    const __m512 sv = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    /* bfloat16 pairs (key 2i, key 2i + 1) of each row, from the two keys' 16 rows */
    static const uint16_t zip_index[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i zip = _mm512_loadu_si512(zip_index);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int R = rows - r0 >= 16 ? 16 : (int)(rows - r0);
        /* Q^T of the 16 rows in the pair layout (B operand): qt[(c * 16 + i) * 16 + r] holds
         * dims 32 c + 2 i, +1 of row r; rows past R zeros */
        int32_t posl[16], lol[16];
        const uint16_t *qrow[16];
        for (int r = 0; r < 16; r++) {
            const int64_t rr = r0 + r;
            if (r < R) {
                qrow[r] = q + (t0 + rr / G) * q_stride + (h * G + rr % G) * D;
                const int64_t pos = p + t0 + rr / G;
                posl[r] = (int32_t)pos;
                lol[r] = (int32_t)((window > 0 && pos + 1 > window) ? pos + 1 - window : 0);
            } else {
                qrow[r] = NULL;
                posl[r] = -1; /* sees no key */
                lol[r] = 0;
            }
        }
        for (int64_t c = 0; c < DC; c++) { /* 16 rows x 16 dim pairs, transposed */
            __m512i w[16];
            for (int r = 0; r < 16; r++)
                w[r] = qrow[r] ? _mm512_loadu_si512(qrow[r] + 32 * c) : _mm512_setzero_si512();
            transpose16_epi32(w);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(qt + (c * 16 + i) * 16, w[i]);
        }
        const int64_t t_first = t0 + r0 / G, t_last = t0 + (r0 + R - 1) / G;
        const int64_t lo_first = lol[0], lo_last = lol[R - 1];
        const int64_t pos_first = p + t_first, hi = p + t_last + 1; /* keys [lo_first, hi) */
        const __m512i posv = _mm512_loadu_si512(posl), lov = _mm512_loadu_si512(lol);
        __m512 m = ninf, l = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) _mm512_storeu_ps(ot + d * 16, _mm512_setzero_ps());
        for (int64_t j0 = lo_first / EXT_BK * EXT_BK; j0 < hi; j0 += EXT_BK) {
            const uint16_t *kt = ktk + (j0 / EXT_BK) * EXT_BK * D;
            const uint16_t *vt = vtk + (j0 / EXT_BK) * EXT_BK * D;
            const int64_t span = hi - j0 < EXT_BK ? hi - j0 : EXT_BK;
            const int nk = (int)((span + 15) / 16); /* score tiles of 16 keys in use */
            _tile_zero(0);
            if (nk > 1) _tile_zero(1);
            if (nk > 2) _tile_zero(2);
            if (nk > 3) _tile_zero(3);
            for (int64_t c = 0; c < DC; c++) {
                _tile_loadd(5, qt + c * 256, 64);
                _tile_loadd(4, kt + 0 * 16 * D + 32 * c, D * 2);
                _tile_dpbf16ps(0, 4, 5);
                if (nk > 1) { _tile_loadd(4, kt + 1 * 16 * D + 32 * c, D * 2); _tile_dpbf16ps(1, 4, 5); }
                if (nk > 2) { _tile_loadd(4, kt + 2 * 16 * D + 32 * c, D * 2); _tile_dpbf16ps(2, 4, 5); }
                if (nk > 3) { _tile_loadd(4, kt + 3 * 16 * D + 32 * c, D * 2); _tile_dpbf16ps(3, 4, 5); }
            }
            _tile_stored(0, s, 64);
            if (nk > 1) _tile_stored(1, s + 256, 64);
            if (nk > 2) _tile_stored(2, s + 512, 64);
            if (nk > 3) _tile_stored(3, s + 768, 64);
            const int keys = nk * 16;
            /* every row sees every key of the block: no masks */
            const int full = R == 16 && lo_last <= j0 && pos_first >= j0 + EXT_BK - 1;
            const __m512i pj = _mm512_sub_epi32(posv, _mm512_set1_epi32((int)j0));
            const __m512i lj = _mm512_sub_epi32(lov, _mm512_set1_epi32((int)j0));
            __m512 mx = m;
            for (int j = 0; j < keys; j++) {
                __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j * 16), sv);
                if (!full) {
                    const __m512i jj = _mm512_set1_epi32(j);
                    const __mmask16 keep = _mm512_cmple_epi32_mask(jj, pj) & _mm512_cmpge_epi32_mask(jj, lj);
                    x = _mm512_mask_mov_ps(ninf, keep, x);
                }
                _mm512_storeu_ps(s + j * 16, x);
                mx = _mm512_max_ps(mx, x);
            }
            /* alpha = exp(m - mnew): 0 where the row had no key yet, 1 where it has none here */
            const __m512 alpha = exp16(_mm512_sub_ps(m, mx));
            m = mx;
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < keys; j += 2) {
                const __m512 x0 = _mm512_loadu_ps(s + j * 16), x1 = _mm512_loadu_ps(s + (j + 1) * 16);
                /* -inf - m, or NaN where the row has no key yet: exp16 gives ~0; zeroed */
                const __m512 e0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x0, ninf, _CMP_NEQ_OQ),
                                                      exp16(_mm512_sub_ps(x0, mx)));
                const __m512 e1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x1, ninf, _CMP_NEQ_OQ),
                                                      exp16(_mm512_sub_ps(x1, mx)));
                sum = _mm512_add_ps(_mm512_add_ps(sum, e0), e1);
                const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
                _mm512_storeu_si512(pt + j * 16, _mm512_permutexvar_epi16(zip, pair));
            }
            l = _mm512_fmadd_ps(l, alpha, sum);
            if (keys % 32) /* the last 32-key chunk's unscored half: no weight */
                memset(pt + keys * 16, 0, 16 * 16 * sizeof(uint16_t));
            const int np = (keys + 31) / 32; /* key chunks of 32 (P^T tiles) */
            for (int64_t d0 = 0; d0 < D; d0 += 64) {
                const int nt = D - d0 >= 64 ? 4 : 2; /* D is a multiple of 32 */
                _tile_zero(0);
                _tile_zero(1);
                if (nt > 2) { _tile_zero(2); _tile_zero(3); }
                for (int kc = 0; kc < np; kc++) {
                    const uint16_t *va = vt + d0 * EXT_BK + 32 * kc;
                    _tile_loadd(5, pt + kc * 512, 64);
                    _tile_loadd(4, va, EXT_BK * 2);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(4, va + 16 * EXT_BK, EXT_BK * 2);
                    _tile_dpbf16ps(1, 4, 5);
                    if (nt > 2) {
                        _tile_loadd(4, va + 32 * EXT_BK, EXT_BK * 2);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(4, va + 48 * EXT_BK, EXT_BK * 2);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, pvt + d0 * 16, 64);
                _tile_stored(1, pvt + (d0 + 16) * 16, 64);
                if (nt > 2) { _tile_stored(2, pvt + (d0 + 32) * 16, 64); _tile_stored(3, pvt + (d0 + 48) * 16, 64); }
            }
            for (int64_t d = 0; d < D; d++)
                _mm512_storeu_ps(ot + d * 16, _mm512_fmadd_ps(alpha, _mm512_loadu_ps(ot + d * 16),
                                                              _mm512_loadu_ps(pvt + d * 16)));
        }
        /* O^T / l, rounded once, back to rows */
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
        for (int64_t dc = 0; dc < D / 16; dc++) { /* 16 dims x 16 rows, transposed */
            __m512i w[16];
            for (int i = 0; i < 16; i++)
                w[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(ot + (16 * dc + i) * 16), inv));
            transpose16_epi32(w);
            for (int r = 0; r < R; r++) {
                const int64_t rr = r0 + r, t = t0 + rr / G;
                _mm256_storeu_si256((__m256i *)(out + (t * H + h * G + rr % G) * D + 16 * dc),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(w[r])));
            }
        }
    }
}
#endif

/* 1 where the prefill kernel multiplies on AMX tiles (the CPU has them and Linux granted them
 * to this process); use < 0 asks, 0 turns them off, 1 back on where they are granted */
int extend_attention_bf16_amx(int use) {
#ifdef HAVE_EXT_AMX
    int granted = __atomic_load_n(&ext_amx_granted, __ATOMIC_ACQUIRE);
    if (granted < 0) { /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: asking twice is harmless */
        granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
        __atomic_store_n(&ext_amx_granted, granted, __ATOMIC_RELEASE);
    }
    if (use >= 0) __atomic_store_n(&ext_amx_on, use ? 1 : 0, __ATOMIC_RELEASE);
    return granted && __atomic_load_n(&ext_amx_on, __ATOMIC_ACQUIRE);
#else
    (void)use;
    return 0;
#endif
}

/*
 * Every prefill chunk of a step in one call: the tasks of all sequences (kv head x block of
 * EXT_BQ query tokens, extend_task_bf16) share one OpenMP region, the costliest first, so a
 * step of 32 short prompts is one fork and one pack instead of 32.
 *   seqs   [nseq, 4] int64: (q_start, n, p, slot_off) of each sequence: its queries are
 *          tokens q_start .. q_start + n - 1 of q (and of out), after p cached positions, its
 *          slots slots[slot_off .. slot_off + p + n)
 *   q_rows, slots_len: q's tokens and slots' length, for the bounds checks
 * Returns 1; 0 where the kernel does not apply (nothing written) or a buffer could not be
 * allocated (out incomplete); -1 where seqs is malformed (n < 1, p < 0, a range outside q or
 * slots, or query ranges out of order or overlapping; nothing written).
 */
#ifdef HAVE_AVX512BF16
typedef struct { int64_t cost; int32_t s, b, h, pad; } ExtTask;

static int ext_task_cmp(const void *a, const void *b) {
    const int64_t ca = ((const ExtTask *)a)->cost, cb = ((const ExtTask *)b)->cost;
    return ca < cb ? 1 : (ca > cb ? -1 : 0);
}
#endif

int extend_attention_bf16_seqs(const uint16_t *q, int64_t q_stride, int64_t q_rows,
                               const uint16_t *k, const uint16_t *v, const int64_t *slots,
                               int64_t slots_len, const int64_t *seqs, int64_t nseq, int64_t H,
                               int64_t KV, int64_t D, float scale, int64_t window,
                               uint16_t *out) {
    int64_t prev_end = 0;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t a = seqs[4 * s], n = seqs[4 * s + 1], p = seqs[4 * s + 2], off = seqs[4 * s + 3];
        if (n < 1 || p < 0 || a < prev_end || a > q_rows - n || off < 0 || p > slots_len - n
            || off > slots_len - p - n)
            return -1;
        prev_end = a + n;
    }
#ifdef HAVE_AVX512BF16
    if (!extend_attention_bf16_applies(D) || KV <= 0 || H % KV != 0 || nseq <= 0) return 0;
    const int64_t G = H / KV, words = EXT_BK * D / 2;
    /* per sequence: its first packed block (kv head 0) and its first task */
    int64_t *first = malloc((size_t)(2 * nseq + 2) * sizeof(int64_t));
    if (first == NULL) return 0;
    int64_t *first_task = first + nseq + 1;
    int64_t blocks_all = 0, tasks = 0, bq = 1;
    for (int64_t s = 0; s < nseq; s++) {
        const int64_t n = seqs[4 * s + 1], L = seqs[4 * s + 2] + n;
        first[s] = blocks_all;
        first_task[s] = tasks;
        blocks_all += KV * ((L + EXT_BK - 1) / EXT_BK);
        tasks += KV * ((n + EXT_BQ - 1) / EXT_BQ);
        bq = n < EXT_BQ ? (n > bq ? n : bq) : EXT_BQ;
    }
    first[nseq] = blocks_all;
    first_task[nseq] = tasks;
    uint32_t *kpk = aligned_alloc(64, (size_t)(2 * blocks_all * words) * sizeof(uint32_t));
    ExtTask *order = malloc((size_t)tasks * sizeof(ExtTask));
    if (kpk == NULL || order == NULL) {
        free(kpk); free(order); free(first);
        return 0;
    }
    uint32_t *vpk = kpk + blocks_all * words;
    for (int64_t s = 0, t = 0; s < nseq; s++) {
        const int64_t n = seqs[4 * s + 1], p = seqs[4 * s + 2];
        for (int64_t b = 0; b * EXT_BQ < n; b++) {
            const int64_t t0 = b * EXT_BQ, t1 = t0 + EXT_BQ < n ? t0 + EXT_BQ : n;
            const int64_t lo = (window > 0 && p + t0 + 1 > window) ? p + t0 + 1 - window : 0;
            for (int64_t h = 0; h < KV; h++, t++)
                order[t] = (ExtTask){(t1 - t0) * (p + t1 - lo), (int32_t)s, (int32_t)b, (int32_t)h, 0};
        }
    }
    qsort(order, (size_t)tasks, sizeof(ExtTask), ext_task_cmp); /* the longest first */
    const int amx = extend_attention_bf16_amx(-1) == 1;
    const size_t bytes = amx ? (size_t)16 * (2 * D + EXT_BK) * sizeof(float)
                                   + (size_t)16 * (EXT_BK + D) * sizeof(uint16_t) + 64
                             : (size_t)bq * G * (D + 2) * sizeof(float)
                                   + (size_t)EXT_R * EXT_BK * (sizeof(float) + sizeof(uint16_t)) + 64;
    int failed = 0;
    const int team = team_of(tasks + blocks_all);
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        void *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (buf == NULL) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            failed = 1;
        }
        int64_t s = 0;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t blk = 0; blk < blocks_all; blk++) {
            while (first[s + 1] <= blk) s++;  /* ascending within a thread's chunk */
            while (first[s] > blk) s--;
            const int64_t kb = (first[s + 1] - first[s]) / KV;
            const int64_t local = blk - first[s], L = seqs[4 * s + 2] + seqs[4 * s + 1];
#ifdef HAVE_EXT_AMX
            if (amx) {
                pack_block_amx(k, v, slots + seqs[4 * s + 3], (local % kb) * EXT_BK, L, D, KV * D,
                               local / kb, (uint16_t *)(kpk + blk * words),
                               (uint16_t *)(vpk + blk * words));
                continue;
            }
#endif
            pack_block_bf16(k, v, slots + seqs[4 * s + 3], (local % kb) * EXT_BK, L, D, KV * D,
                            local / kb, kpk + blk * words, vpk + blk * words);
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t i = 0; i < tasks; i++) {
            const ExtTask t = order[i];
            const int64_t *sq = seqs + 4 * t.s, n = sq[1], p = sq[2];
            const int64_t kb = (first[t.s + 1] - first[t.s]) / KV;
            const int64_t t0 = (int64_t)t.b * EXT_BQ, t1 = t0 + EXT_BQ < n ? t0 + EXT_BQ : n;
            const int64_t pk = (first[t.s] + t.h * kb) * words;
            if (buf == NULL) continue;
#ifdef HAVE_EXT_AMX
            if (amx) {
                extend_task_amx(q + sq[0] * q_stride, q_stride, (const uint16_t *)(kpk + pk),
                                (const uint16_t *)(vpk + pk), p, t0, t1,
                                H, KV, D, scale, window, t.h, buf, out + sq[0] * H * D);
                continue;
            }
#endif
            extend_task_bf16(q + sq[0] * q_stride, q_stride, kpk + pk, vpk + pk, p, t0, t1,
                             H, KV, D, scale, window, t.h, buf, out + sq[0] * H * D);
        }
#ifdef HAVE_EXT_AMX
        if (amx) _tile_release();
#endif
        free(buf);
    }
    free(kpk);
    free(order);
    free(first);
    return failed ? 0 : 1;
#else
    (void)q; (void)q_stride; (void)k; (void)v; (void)slots; (void)H; (void)KV; (void)D;
    (void)scale; (void)window; (void)out;
    return 0;
#endif
}

/* one sequence (extend_attention_bf16_seqs of one row): slots [p + n], out [n, H, D] */
int extend_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                          const uint16_t *v, const int64_t *slots, int64_t p, int64_t n,
                          int64_t H, int64_t KV, int64_t D, float scale, int64_t window,
                          uint16_t *out) {
    const int64_t seq[4] = {0, n, p, 0};
    if (n <= 0 || p < 0) return 0;
    const int r = extend_attention_bf16_seqs(q, q_stride, n, k, v, slots, p + n, seq, 1, H, KV,
                                             D, scale, window, out);
    return r > 0 ? r : 0;
}
