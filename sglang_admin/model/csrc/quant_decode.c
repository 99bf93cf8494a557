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
