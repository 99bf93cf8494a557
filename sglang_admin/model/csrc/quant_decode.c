/* A bfloat16 decode step's decoder layers, all of them in one call, on projections kept
 * quantized: steps of a few rows (batch 1 and 2) through the few-row kernel (int4 groups of
 * 32, or GGUF Q8_0 blocks), and steps of 5-64 rows through the AMX kernel (int4).
 *
 * Built as one translation unit after csrc/cpu_kernels.c, csrc/quant_gemv.c and
 * csrc/quant_amx.c (sglang_admin/model/quant/decode_step.py joins the four sources), so it
 * calls their functions directly: the same ones, in the same order, on the same buffers as
 * LlamaForCausalLM.decode_bf16 with those kernels (model/llama.py), so its outputs are
 * the same bits; what it saves is that loop's Python, its ctypes calls and its tensors
 * (about 9 calls a layer), which run on one thread while the others of the OpenMP team wait.
 *
 * Per layer l, rows x [M, hidden] (bfloat16, updated in place):
 *   h = add_rms_norm(x, delta, ln1)      (the first layer: rms_norm(x, ln1))
 *   qkv = h W_qkv;  rope_attend_bf16 (RoPE, the new K/V into the layer's pools, attention)
 *   o = attn W_o;   h = add_rms_norm(x, o, ln2)
 *   gu = h W_gate_up;  delta = silu_mul(gu) W_down
 * and at the end x += delta (rounded to bfloat16, as torch's add).
 *
 * A Q8_0 projection's float32 outputs are rounded to bfloat16 (as torch's .to()) into the
 * same buffer an int4 one writes.
 */

#include <stdlib.h>

enum { DL_LN1, DL_QKV_W, DL_QKV_S, DL_O_W, DL_O_S, DL_LN2, DL_GU_W, DL_GU_S, DL_DOWN_W,
       DL_DOWN_S, DL_K, DL_V, DL_PTRS };

int q4_decode_applies(void) {
#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16)
    return 1;
#else
    return 0;
#endif
}

/* bfloat16 scratch elements q4_decode_layers needs for M rows */
int64_t q4_decode_scratch(int64_t M, int64_t hidden, int64_t inter, int64_t H, int64_t KV,
                          int64_t D) {
    return M * (3 * hidden + (H + 2 * KV) * D + (H + KV) * D + H * D + 3 * inter);
}

#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16)
/* one projection: kind 0 int4 (bfloat16 out), 1 Q8_0 (float32 out, rounded here), 2 int4
 * in the AMX kernel's layout (bfloat16 out) */
static void project(int kind, const uint16_t *x, int64_t M, int64_t K, const void *w,
                    const void *s, int64_t N, uint16_t *out, float *f32) {
    if (kind == 2) {
        q4_amx_bf16(x, M, K, K, (const uint8_t *)w, (const uint16_t *)s, N, out, N);
        return;
    }
    if (kind == 0) {
        q4_gemv_bf16(x, M, K, K, (const uint8_t *)w, (const uint16_t *)s, N, out, N);
        return;
    }
    q8_gemv_bf16(x, M, K, K, (const uint8_t *)w, (const uint16_t *)s, N, f32, N);
    for (int64_t i = 0; i < M * N; ++i) out[i] = f32_bf16(f32[i]);
}
#endif

#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16)
/* A few-row step (int4 / Q8_0 projections) in one OpenMP parallel region: the team splits
 * each projection's 16-row blocks (an orphaned `omp for`, its barrier the only wait between
 * the dependent stages) and each thread keeps its own copy of the small per-row vectors (the
 * residual, the normed rows, the SwiGLU product and the activations' int8 parts), computed
 * alike from the same shared inputs, so no other barrier is needed; the attention (RoPE, the
 * K/V write, a few kv heads' tasks) runs on one thread of the team (`omp single`; its own
 * parallel loop is then a nested region: one thread where nesting is off, libgomp's
 * default, else a nested team, each thread its own scores as before). Where a region starts
 * costs more than the work in it (a qkv projection of SmolLM2-135M: ~6 us), ~150 of them a
 * token were a third of the layers' time. The same functions on the same values as the loop
 * (project, the norms, silu_mul_bf16): the same bits. */

/* one thread's vectors: M rows of the residual, the normed rows and the SwiGLU product
 * (bfloat16), split_row's parts of up to kmax inputs a row, its scales, sums and parts' sums */
typedef struct {
    uint16_t *x, *normed, *act;
    int8_t *parts;
    float *dx, *sx;
    int32_t *psum;
} own_t;

static int64_t own_bytes(int64_t M, int64_t hidden, int64_t inter, int64_t kmax) {
    const int64_t G = kmax / 32;
    int64_t b = 2 * M * (2 * hidden + inter) + 3 * M * kmax + 4 * (2 * M * G) + 4 * (3 * M * G);
    return (b + 63) / 64 * 64;
}

static own_t own_at(char *base, int64_t M, int64_t hidden, int64_t inter, int64_t kmax) {
    const int64_t G = kmax / 32;
    own_t o;
    o.dx = (float *)base;
    o.sx = o.dx + M * G;
    o.psum = (int32_t *)(o.sx + M * G);
    o.x = (uint16_t *)(o.psum + 3 * M * G);
    o.normed = o.x + M * hidden;
    o.act = o.normed + M * hidden;
    o.parts = (int8_t *)(o.act + M * inter);
    return o;
}

/* the thread's split of M rows of x [M, K] (the parts' sums too for a Q8_0 projection) */
static void split_own(const own_t *o, const uint16_t *x, int64_t M, int64_t K, int kind) {
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; ++m)
        split_row(x + m * K, K, o->parts + 3 * m * K, o->dx + m * G, o->sx + m * G,
                  kind == 1 ? o->psum + 3 * m * G : NULL);
}

/* one projection of the thread's split rows, its blocks spread over the team (the caller is
 * in the parallel region; the `omp for`'s barrier ends it): as project() */
static void project_team(int kind, const own_t *o, int64_t M, int64_t K, const void *w,
                         const void *s, int64_t N, uint16_t *out, float *f32) {
    const int64_t NB = (N + 15) / 16;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t b = 0; b < NB; ++b) {
        if (kind == 0) {
            q4_block(o->parts, o->dx, o->sx, M, K, (const uint8_t *)w, (const uint16_t *)s, N,
                     b, out, N);
            continue;
        }
        q8_block(o->parts, o->dx, o->psum, M, K, (const uint8_t *)w, (const uint16_t *)s, N,
                 b, f32, N);
        const int64_t end = 16 * b + 16 < N ? 16 * b + 16 : N;
        for (int64_t m = 0; m < M; ++m)
            for (int64_t i = 16 * b; i < end; ++i) out[m * N + i] = f32_bf16(f32[m * N + i]);
    }
}
#endif

/* bytes of scratch q4_decode_team needs for M rows on a team of `threads` */
int64_t q4_decode_team_scratch(int64_t M, int64_t hidden, int64_t inter, int64_t H, int64_t KV,
                               int64_t D, int64_t threads) {
#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16)
    int64_t kmax = hidden > inter ? hidden : inter;
    kmax = kmax > H * D ? kmax : H * D;
    const int64_t shared = 2 * M * ((H + 2 * KV) * D + (H + KV) * D + H * D + 2 * hidden +
                                    2 * inter);
    return (shared + 63) / 64 * 64 + threads * own_bytes(M, hidden, inter, kmax);
#else
    (void)M; (void)hidden; (void)inter; (void)H; (void)KV; (void)D; (void)threads;
    return 0;
#endif
}

/*
 * q4_decode_layers for projections of the few-row kinds (0 and 1) in one parallel region
 * (above): the same arguments, but scratch is q4_decode_team_scratch(..., threads) bytes
 * (64-byte aligned); the team is the calling thread's OpenMP team, at most `threads`.
 * Where head_w is not NULL, then the final norm (weight norm_w) of the last layer's output
 * and a Q8_0 LM head of `vocab` rows (head_w, head_d: q8_gemv_bf16's layout) into logits
 * (float32 [M, vocab]), as the model's final_norm and q8_gemv_bf16 compute them.
 */
void q4_decode_team(uint16_t *x, int64_t M, int64_t L, int64_t hidden, int64_t inter,
                    int64_t H, int64_t KV, int64_t D, float eps, float scale,
                    const void *const *ptrs, const int32_t *kinds, const int64_t *windows,
                    const uint16_t *cos_t, const uint16_t *sin_t, const int64_t *out_slots,
                    const int64_t *table, int64_t ctx, const int64_t *rows,
                    const int64_t *lens, float *scores, int64_t scores_len,
                    char *scratch, int64_t threads, float *f32, const uint16_t *norm_w,
                    const void *head_w, const void *head_d, int64_t vocab, float *logits) {
#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16)
    const int64_t nqkv = (H + 2 * KV) * D;
    int64_t kmax = hidden > inter ? hidden : inter;
    kmax = kmax > H * D ? kmax : H * D;
    uint16_t *qkv = (uint16_t *)scratch, *rotated = qkv + M * nqkv;
    uint16_t *attn = rotated + M * (H + KV) * D, *o = attn + M * H * D, *gu = o + M * hidden;
    uint16_t *delta = gu + M * 2 * inter;
    const int64_t shared = 2 * M * (nqkv + (H + KV) * D + H * D + 2 * hidden + 2 * inter);
    char *own_base = scratch + (shared + 63) / 64 * 64;
    const int64_t per = own_bytes(M, hidden, inter, kmax);
    const int team = team_of(threads);
    (void)team;
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        const int tid = thread_id();
        const own_t me = own_at(own_base + tid * per, M, hidden, inter, kmax);
        memcpy(me.x, x, (size_t)(2 * M * hidden));
        for (int64_t l = 0; l < L; ++l) {
            const void *const *p = ptrs + l * DL_PTRS;
            const int32_t *kind = kinds + 4 * l;
            if (l == 0)
                rms_norm_bf16(me.x, (const uint16_t *)p[DL_LN1], M, hidden, eps, me.normed);
            else
                add_rms_norm_bf16(me.x, delta, (const uint16_t *)p[DL_LN1], M, hidden, eps,
                                  me.normed);
            split_own(&me, me.normed, M, hidden, kind[0]);
            project_team(kind[0], &me, M, hidden, p[DL_QKV_W], p[DL_QKV_S], nqkv, qkv, f32);
#ifdef _OPENMP
#pragma omp single
#endif
            rope_attend_bf16(qkv, nqkv, cos_t, sin_t, M, H, KV, D, rotated,
                             (uint16_t *)p[DL_K], (uint16_t *)p[DL_V], out_slots, table, ctx,
                             rows, lens, scale, windows[l], scores, scores_len, attn);
            split_own(&me, attn, M, H * D, kind[1]);
            project_team(kind[1], &me, M, H * D, p[DL_O_W], p[DL_O_S], hidden, o, f32);
            add_rms_norm_bf16(me.x, o, (const uint16_t *)p[DL_LN2], M, hidden, eps, me.normed);
            split_own(&me, me.normed, M, hidden, kind[2]);
            project_team(kind[2], &me, M, hidden, p[DL_GU_W], p[DL_GU_S], 2 * inter, gu, f32);
            silu_mul_bf16(gu, M, inter, me.act);
            split_own(&me, me.act, M, inter, kind[3]);
            project_team(kind[3], &me, M, inter, p[DL_DOWN_W], p[DL_DOWN_S], hidden, delta,
                         f32);
        }
        if (L > 0)
            for (int64_t i = 0; i < M * hidden; ++i)
                me.x[i] = f32_bf16(bf16_f32(me.x[i]) + bf16_f32(delta[i]));
        if (tid == 0) memcpy(x, me.x, (size_t)(2 * M * hidden));
        if (head_w) { /* the final norm and the Q8_0 LM head's float32 logits */
            rms_norm_bf16(me.x, norm_w, M, hidden, eps, me.normed);
            split_own(&me, me.normed, M, hidden, 1);
            const int64_t NB = (vocab + 15) / 16;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t b = 0; b < NB; ++b)
                q8_block(me.parts, me.dx, me.psum, M, hidden, (const uint8_t *)head_w,
                         (const uint16_t *)head_d, vocab, b, logits, vocab);
        }
    }
#else
    (void)x; (void)M; (void)L; (void)hidden; (void)inter; (void)H; (void)KV; (void)D;
    (void)eps; (void)scale; (void)ptrs; (void)kinds; (void)windows; (void)cos_t; (void)sin_t;
    (void)out_slots; (void)table; (void)ctx; (void)rows; (void)lens; (void)scores;
    (void)scores_len; (void)scratch; (void)threads; (void)f32; (void)norm_w; (void)head_w;
    (void)head_d; (void)vocab; (void)logits;
#endif
}

/*
 * x        bfloat16 [M, hidden], the embeddings in, the last layer's output out
 * ptrs     [L][DL_PTRS]: per layer the two norms' weights, each projection's packed weight
 *          and scales (in its kind's layout) and the layer's K and V pools [slots, KV, D]
 * kinds    [L][4]: the projections' kinds (qkv, o, gate_up, down): 0 int4, 1 Q8_0 (their
 *          few-row layouts, quant/gemv.py), 2 int4 in the AMX layout (quant/amx.py)
 * windows  [L]: each layer's sliding window (0: none)
 * cos_t, sin_t, out_slots, table, ctx, rows, lens, scores, scores_len: as rope_attend_bf16
 * scratch  bfloat16, q4_decode_scratch(...) elements; f32: float32, M * max(projection N)
 *          elements where a projection is Q8_0 (else unused)
 */
void q4_decode_layers(uint16_t *x, int64_t M, int64_t L, int64_t hidden, int64_t inter,
                      int64_t H, int64_t KV, int64_t D, float eps, float scale,
                      const void *const *ptrs, const int32_t *kinds, const int64_t *windows,
                      const uint16_t *cos_t, const uint16_t *sin_t, const int64_t *out_slots,
                      const int64_t *table, int64_t ctx, const int64_t *rows,
                      const int64_t *lens, float *scores, int64_t scores_len,
                      uint16_t *scratch, float *f32) {
#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16)
    const int64_t nqkv = (H + 2 * KV) * D;
    uint16_t *normed = scratch, *qkv = normed + M * hidden, *rotated = qkv + M * nqkv;
    uint16_t *attn = rotated + M * (H + KV) * D, *o = attn + M * H * D, *gu = o + M * hidden;
    uint16_t *act = gu + M * 2 * inter, *delta = act + M * inter;
    for (int64_t l = 0; l < L; ++l) {
        const void *const *p = ptrs + l * DL_PTRS;
        const int32_t *kind = kinds + 4 * l;
        if (l == 0)
            rms_norm_bf16(x, (const uint16_t *)p[DL_LN1], M, hidden, eps, normed);
        else
            add_rms_norm_bf16(x, delta, (const uint16_t *)p[DL_LN1], M, hidden, eps, normed);
        project(kind[0], normed, M, hidden, p[DL_QKV_W], p[DL_QKV_S], nqkv, qkv, f32);
        rope_attend_bf16(qkv, nqkv, cos_t, sin_t, M, H, KV, D, rotated, (uint16_t *)p[DL_K],
                         (uint16_t *)p[DL_V], out_slots, table, ctx, rows, lens, scale,
                         windows[l], scores, scores_len, attn);
        project(kind[1], attn, M, H * D, p[DL_O_W], p[DL_O_S], hidden, o, f32);
        add_rms_norm_bf16(x, o, (const uint16_t *)p[DL_LN2], M, hidden, eps, normed);
        project(kind[2], normed, M, hidden, p[DL_GU_W], p[DL_GU_S], 2 * inter, gu, f32);
        silu_mul_bf16(gu, M, inter, act);
        project(kind[3], act, M, inter, p[DL_DOWN_W], p[DL_DOWN_S], hidden, delta, f32);
    }
    if (L > 0)
        for (int64_t i = 0; i < M * hidden; ++i) x[i] = f32_bf16(bf16_f32(x[i]) + bf16_f32(delta[i]));
#else
    (void)x; (void)M; (void)L; (void)hidden; (void)inter; (void)H; (void)KV; (void)D;
    (void)eps; (void)scale; (void)ptrs; (void)kinds; (void)windows; (void)cos_t; (void)sin_t;
    (void)out_slots; (void)table; (void)ctx; (void)rows; (void)lens; (void)scores;
    (void)scores_len; (void)scratch; (void)f32;
#endif
}
