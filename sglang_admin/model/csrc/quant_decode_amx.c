/* A batched decode step (5-64 rows, int4 projections in the AMX kernel's layout) with all
 * its decoder layers in ONE OpenMP parallel region.
 *
 * Built as one translation unit after csrc/cpu_kernels.c, csrc/quant_gemv.c,
 * csrc/quant_amx.c and csrc/quant_decode.c (sglang_admin/model/quant/decode_step.py joins
 * them). q4_decode_layers computes the same step with each kernel opening a parallel region
 * of its own (the projections, the attention, SwiGLU: ~6 a layer, ~180 a step of
 * SmolLM2-135M) and the norms and RoPE on the calling thread alone while the team waits.
 * Here the team enters once; each phase is an orphaned `omp for` (or a shared counter) over
 * its work and a barrier ends the phases whose output the next one reads:
 *
 *   own: h = add_rms_norm(x, delta, ln1)   every thread all rows, into its own copies of
 *                                          the residual and the normed rows (no barrier)
 *   qkv = h W_qkv                          16-column blocks, a static split: each thread
 *                                          the same contiguous weight columns every step
 *   RoPE + K/V write + attention           a sequence at a time, claimed from a shared
 *                                          counter (each thread claims its next one ahead,
 *                                          to prefetch its first keys)
 *   o = attn W_o                           blocks, static
 *   own: h = add_rms_norm(x, o, ln2)
 *   act = silu(h W_gate) * (h W_up)        a thread's gate blocks, the same up blocks,
 *                                          then the SwiGLU of those columns (no barrier
 *                                          between)
 *   delta = act W_down                     blocks, static
 *
 * and at the end x += delta. Each thread loads its AMX tile configuration once for the
 * region (again only where a step of more than 48 rows goes in two passes). Every value is
 * computed by the same function on the same inputs as in q4_decode_layers (block_rows for a
 * 16-column block, rms_row_bf16 / add_rms_row_bf16 for a row, rope_row_bf16 for a token,
 * silu_span_bf16 for columns of a row from a multiple of 16: the whole row's 16-wide path,
 * attend_sequence / attend_group for a sequence's heads): the same bits, whichever thread
 * computes them.
 *
 * Measured at 2 threads (docs/cpu-performance.md): the norms split over the rows (a barrier
 * each) were ~2% faster on a quiet machine and ~15% slower beside a busy neighbour (each
 * barrier waits for a thread the hypervisor took away); the sequences split by their keys
 * (a static share each) changed nothing measurable; both left out.
 *
 * A decode step has one row per sequence, and row i's new K/V goes to a slot no other
 * sequence of the step reads, so each sequence's RoPE and K/V write run just before its
 * attention, on the thread that attends it.
 */

#if defined(GEMV_KERNEL) && defined(HAVE_AVX512BF16) && defined(AMX_KERNEL)
#define AMX_TEAM 1

/* bytes of each thread's own part: its residual and normed rows (bfloat16 [M, hidden]) */
static int64_t amx_own_bytes(int64_t M, int64_t hidden) {
    return (4 * M * hidden + 63) / 64 * 64;
}

/* the thread's tile configuration for passes of `rows` rows (*cfg: the rows it holds) */
static inline void amx_configured(int64_t *cfg, int64_t rows) {
    if (*cfg != rows) {
        configure(rows);
        *cfg = rows;
    }
}

/* out [M, N] = x [M, K] W: the 16-column blocks split over the team (static: contiguous
 * ranges, the same ones each call), each pass of up to 48 rows as q4_amx_bf16's; ends with
 * the team's barrier */
static void amx_project_team(const uint16_t *x, int64_t M, int64_t K, const void *w,
                             const void *s, int64_t N, uint16_t *out, int64_t *cfg,
                             uint16_t *bt, float *cbuf) {
    const int64_t NB = N / 16;
    for (int64_t r0 = 0; r0 < M; r0 += 16 * MAX_BLOCKS) {
        const int64_t rows = M - r0 < 16 * MAX_BLOCKS ? M - r0 : 16 * MAX_BLOCKS;
        amx_configured(cfg, rows);
#ifdef _OPENMP
#pragma omp for schedule(static) nowait
#endif
        for (int64_t nb = 0; nb < NB; nb++)
            block_rows(x + r0 * K, rows, K, K, (const uint8_t *)w, (const uint16_t *)s, nb,
                       out + r0 * N, N, bt, cbuf);
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* act [M, I] = silu(x W_gate) * (x W_up): the thread's static share of the gate blocks
 * (contiguous: [p0, p1) of I / 16), then the same up blocks (I / 16 + [p0, p1)), into gu
 * [M, 2 I] as the projection writes them, then the SwiGLU of those columns of every row:
 * no other thread reads them, so no barrier between. (Gate and up block of a column
 * alternating, the SwiGLU after each pair, was ~6% slower at 2 threads: two streams of
 * codes, each block's prefetch ahead landing a block early.) Ends with the team's barrier. */
static void amx_gate_up_team(const uint16_t *x, int64_t M, int64_t K, const void *w,
                             const void *s, int64_t I, uint16_t *gu, uint16_t *act,
                             int64_t *cfg, uint16_t *bt, float *cbuf) {
    const int64_t NB = I / 16;
    int nt = 1, id = 0;
#ifdef _OPENMP
    nt = omp_get_num_threads();
    id = omp_get_thread_num();
#endif
    const int64_t p0 = NB * id / nt, p1 = NB * (id + 1) / nt;
    for (int64_t r0 = 0; r0 < M; r0 += 16 * MAX_BLOCKS) {
        const int64_t rows = M - r0 < 16 * MAX_BLOCKS ? M - r0 : 16 * MAX_BLOCKS;
        amx_configured(cfg, rows);
        for (int64_t half = 0; half < 2; half++)
            for (int64_t nb = p0; nb < p1; nb++)
                block_rows(x + r0 * K, rows, K, K, (const uint8_t *)w, (const uint16_t *)s,
                           half * NB + nb, gu + r0 * 2 * I, 2 * I, bt, cbuf);
    }
    for (int64_t m = 0; m < M; m++)
        silu_span_bf16(gu + m * 2 * I, gu + m * 2 * I + I, act + m * I, 16 * p0, 16 * p1);
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* the calling thread's scores buffer (attend_sequence_avx512bf16's) of at least n floats,
 * or NULL */
static float *amx_thread_scores(int64_t n) {
    if (n > seq_scores_len) {
        float *grown = (float *)realloc(seq_scores, (size_t)n * sizeof(float));
        if (!grown) return NULL;
        seq_scores = grown;
        seq_scores_len = n;
    }
    return seq_scores;
}

/* sequence i's heads one kv head at a time (decode_attention_bf16's tasks) into out, with
 * scores (G * its keys floats) */
static void amx_attend_groups(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                              const uint16_t *v, const int64_t *table, int64_t ctx,
                              const int64_t *rows, const int64_t *lens, int64_t i, int64_t H,
                              int64_t KV, int64_t D, float scale, int64_t window,
                              float *scores, uint16_t *out) {
    const int64_t G = H / KV;
    int64_t start;
    const int64_t L = seq_keys(lens, i, window, &start);
    const int64_t *slots = table + rows[i] * ctx + start;
    for (int64_t h = 0; h < KV; h++) {
        const uint16_t *qi = q + i * q_stride + h * G * D;
        uint16_t *oi = out + (i * H + h * G) * D;
        if (D % 32 == 0 && D <= 256 && G <= DEC_MAX_G)
            attend_group_avx512bf16(qi, k + h * D, v + h * D, slots, L, G, D, KV * D, scale,
                                    scores, oi);
        else
            attend_group_bf16(qi, k + h * D, v + h * D, slots, L, G, D, KV * D, scale, scores,
                              oi);
    }
}

/* the layer's RoPE, K/V write and attention (rope_attend_bf16's values), the team's threads
 * claiming sequences from *claimed (0 on entry); ends with the team's barrier */
static void amx_attend_team(const uint16_t *qkv, int64_t nqkv, const uint16_t *cos_t,
                            const uint16_t *sin_t, int64_t M, int64_t H, int64_t KV, int64_t D,
                            uint16_t *rotated, uint16_t *k, uint16_t *v,
                            const int64_t *out_slots, const int64_t *table, int64_t ctx,
                            const int64_t *rows, const int64_t *lens, float scale,
                            int64_t window, float *scores, int64_t *claimed, uint16_t *out) {
    const int64_t G = H / KV, R = H + KV, qs = R * D;
    const int by_sequence = D % 32 == 0 && D <= 256 && G <= DEC_MAX_G;
    int64_t i = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED);
    int cold = 1;
    while (i < M) {
        const int64_t next = __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED);
        rope_row_bf16(qkv + i * nqkv, cos_t + i * D, sin_t + i * D, R, KV, D,
                      rotated + i * qs, k, v, out_slots + i);
        if (!by_sequence || !attend_sequence_avx512bf16(rotated, qs, k, v, table, ctx, rows,
                                                        lens, i, next, M, H, KV, D, scale,
                                                        window, cold, out)) {
            int64_t start;
            const int64_t L = seq_keys(lens, i, window, &start);
            float *sc = amx_thread_scores(G * L);
            if (sc)
                amx_attend_groups(rotated, qs, k, v, table, ctx, rows, lens, i, H, KV, D,
                                  scale, window, sc, out);
            else { /* no buffer of its own: the caller's (room for one group) in turn */
#ifdef _OPENMP
#pragma omp critical(amx_attend_scores)
#endif
                amx_attend_groups(rotated, qs, k, v, table, ctx, rows, lens, i, H, KV, D,
                                  scale, window, scores, out);
            }
        }
        cold = 0;
        i = next;
    }
#ifdef _OPENMP
#pragma omp barrier
#endif
}
#endif

/* bytes of scratch q4_decode_amx_team needs for M rows, L layers, a team of `threads` */
int64_t q4_decode_amx_team_scratch(int64_t M, int64_t hidden, int64_t inter, int64_t H,
                                   int64_t KV, int64_t D, int64_t L, int64_t threads) {
#ifdef AMX_TEAM
    const int64_t shared = 2 * M * ((H + 2 * KV) * D + (H + KV) * D + H * D + 2 * hidden +
                                    3 * inter) + 8 * L;
    return (shared + 63) / 64 * 64 + threads * amx_own_bytes(M, hidden);
#else
    (void)M; (void)hidden; (void)inter; (void)H; (void)KV; (void)D; (void)L; (void)threads;
    return 0;
#endif
}

/* 1 where q4_decode_amx_team is built (AMX and the few-row kernel's CPU features) */
int q4_decode_amx_team_applies(void) {
#ifdef AMX_TEAM
    return 1;
#else
    return 0;
#endif
}

/*
 * q4_decode_layers for projections all of kind 2 (int4, the AMX layout; inter a multiple of
 * 16) in one parallel region (above): the same arguments but for kinds and f32, and scratch
 * is q4_decode_amx_team_scratch(..., L, threads) bytes (64-byte aligned); the team is the
 * calling thread's OpenMP team, at most `threads`.
 */
void q4_decode_amx_team(uint16_t *x, int64_t M, int64_t L, int64_t hidden, int64_t inter,
                        int64_t H, int64_t KV, int64_t D, float eps, float scale,
                        const void *const *ptrs, const int64_t *windows,
                        const uint16_t *cos_t, const uint16_t *sin_t,
                        const int64_t *out_slots, const int64_t *table, int64_t ctx,
                        const int64_t *rows, const int64_t *lens, float *scores,
                        char *scratch, int64_t threads) {
#ifdef AMX_TEAM
    const int64_t nqkv = (H + 2 * KV) * D;
    uint16_t *qkv = (uint16_t *)scratch, *rotated = qkv + M * nqkv;
    uint16_t *attn = rotated + M * (H + KV) * D, *o = attn + M * H * D, *gu = o + M * hidden;
    uint16_t *act = gu + M * 2 * inter, *delta = act + M * inter;
    int64_t *claims = (int64_t *)(delta + M * hidden);
    const int64_t shared = 2 * M * (nqkv + (H + KV) * D + H * D + 2 * hidden + 3 * inter) +
                           8 * L;
    char *own_base = scratch + (shared + 63) / 64 * 64;
    const int64_t per = amx_own_bytes(M, hidden);
    memset(claims, 0, (size_t)(8 * L));
    const int team = team_of(threads);
    (void)team;
#ifdef _OPENMP
#pragma omp parallel num_threads(team) if (team > 1)
#endif
    {
        const int tid = thread_id();
        uint16_t bt[1024] __attribute__((aligned(64)));
        float cbuf[768] __attribute__((aligned(64)));
        int64_t cfg = -1;
        uint16_t *me = (uint16_t *)(own_base + tid * per), *normed = me + M * hidden;
        memcpy(me, x, (size_t)(2 * M * hidden));
        for (int64_t l = 0; l < L; ++l) {
            const void *const *p = ptrs + l * DL_PTRS;
            const uint16_t *ln1 = (const uint16_t *)p[DL_LN1];
            for (int64_t m = 0; m < M; ++m) {
                if (l == 0)
                    rms_row_bf16(me + m * hidden, ln1, hidden, eps, normed + m * hidden);
                else
                    add_rms_row_bf16(me + m * hidden, delta + m * hidden, ln1, hidden, eps,
                                     normed + m * hidden);
            }
            amx_project_team(normed, M, hidden, p[DL_QKV_W], p[DL_QKV_S], nqkv, qkv, &cfg, bt,
                             cbuf);
            amx_attend_team(qkv, nqkv, cos_t, sin_t, M, H, KV, D, rotated, (uint16_t *)p[DL_K],
                            (uint16_t *)p[DL_V], out_slots, table, ctx, rows, lens, scale,
                            windows[l], scores, claims + l, attn);
            amx_project_team(attn, M, H * D, p[DL_O_W], p[DL_O_S], hidden, o, &cfg, bt, cbuf);
            for (int64_t m = 0; m < M; ++m)
                add_rms_row_bf16(me + m * hidden, o + m * hidden, (const uint16_t *)p[DL_LN2],
                                 hidden, eps, normed + m * hidden);
            amx_gate_up_team(normed, M, hidden, p[DL_GU_W], p[DL_GU_S], inter, gu, act, &cfg,
                             bt, cbuf);
            amx_project_team(act, M, inter, p[DL_DOWN_W], p[DL_DOWN_S], hidden, delta, &cfg, bt,
                             cbuf);
        }
        _tile_release();
        if (L > 0) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t m = 0; m < M; ++m)
                for (int64_t i = m * hidden; i < (m + 1) * hidden; ++i)
                    x[i] = f32_bf16(bf16_f32(me[i]) + bf16_f32(delta[i]));
        }
    }
#else
    (void)x; (void)M; (void)L; (void)hidden; (void)inter; (void)H; (void)KV; (void)D;
    (void)eps; (void)scale; (void)ptrs; (void)windows; (void)cos_t; (void)sin_t;
    (void)out_slots; (void)table; (void)ctx; (void)rows; (void)lens; (void)scores;
    (void)scratch; (void)threads;
#endif
}
