/*
 * CPU kernels of the model's forward (float32): decode attention read in place from the paged KV
 * pool; RMSNorm, rotate-half RoPE and SwiGLU's silu(gate) * up in one pass each.
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
/* glibc's vector expf (libmvec), 8 lanes */
extern __m256 _ZGVdN8v_expf(__m256);
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
    if (D % 8 == 0 && G % 4 == 0) {
        for (int64_t h = 0; h < KV; h++) {
            const float *kh = kr + h * D;
            for (int64_t g0 = 0; g0 < G; g0 += 4) {
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
    for (int64_t j = 1; j < L; j++) m = s[j] > m ? s[j] : m;
    int64_t j = 0;
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

/* pass 2: out[hq] = inv[hq] * sum_j scores[hq, j] * V[slot_j, hq / G] */
static void weighted_values(const float *scores, const float *v, const int64_t *slots,
                            int64_t L, int64_t H, int64_t KV, int64_t D, const float *inv,
                            float *oi, int64_t row) {
    const int64_t G = H / KV;
#ifdef HAVE_AVX2
    if (D % 32 == 0 && G % 2 == 0) {
        /* two query heads x 32 dims in 8 registers, over all the sequence's tokens */
        for (int64_t h = 0; h < KV; h++) {
            for (int64_t g0 = 0; g0 < G; g0 += 2) {
                const int64_t hq = h * G + g0;
                const float *s0 = scores + hq * L, *s1 = s0 + L;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {
                    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                    for (int64_t j = 0; j < L; j++) {
                        if (j + PREFETCH_AHEAD < L)
                            __builtin_prefetch(v + slots[j + PREFETCH_AHEAD] * row + h * D + d0);
                        const float *vr = v + slots[j] * row + h * D + d0;
                        const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
                        const __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
                        const __m256 p0 = _mm256_broadcast_ss(s0 + j), p1 = _mm256_broadcast_ss(s1 + j);
                        a0 = _mm256_fmadd_ps(p0, v0, a0); a1 = _mm256_fmadd_ps(p0, v1, a1);
                        a2 = _mm256_fmadd_ps(p0, v2, a2); a3 = _mm256_fmadd_ps(p0, v3, a3);
                        b0 = _mm256_fmadd_ps(p1, v0, b0); b1 = _mm256_fmadd_ps(p1, v1, b1);
                        b2 = _mm256_fmadd_ps(p1, v2, b2); b3 = _mm256_fmadd_ps(p1, v3, b3);
                    }
                    const __m256 i0 = _mm256_set1_ps(inv[hq]), i1 = _mm256_set1_ps(inv[hq + 1]);
                    float *o0 = oi + hq * D + d0, *o1 = o0 + D;
                    _mm256_storeu_ps(o0, _mm256_mul_ps(a0, i0));
                    _mm256_storeu_ps(o0 + 8, _mm256_mul_ps(a1, i0));
                    _mm256_storeu_ps(o0 + 16, _mm256_mul_ps(a2, i0));
                    _mm256_storeu_ps(o0 + 24, _mm256_mul_ps(a3, i0));
                    _mm256_storeu_ps(o1, _mm256_mul_ps(b0, i1));
                    _mm256_storeu_ps(o1 + 8, _mm256_mul_ps(b1, i1));
                    _mm256_storeu_ps(o1 + 16, _mm256_mul_ps(b2, i1));
                    _mm256_storeu_ps(o1 + 24, _mm256_mul_ps(b3, i1));
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
    const int64_t G = H / KV;
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
