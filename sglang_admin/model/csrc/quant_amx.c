/* Batched projections (a few dozen rows) on int4 weights kept quantized, through AMX tiles.
 *
 * At 16-48 rows a bfloat16 GEMM on this class of CPU is bound by reading its weights, not
 * by AMX's arithmetic: oneDNN's packed bfloat16 copy reads 2 bytes a weight. Here the
 * weights stay 4-bit (sglang_admin/model/quant/amx.py packs them): each tile of 16 output
 * rows x 32 inputs (one group, one scale and zero per output row) is dequantized once per
 * call into a bfloat16 B tile in the VNNI order TDPBF16PS reads, then multiplied with every
 * 16-row block of the activations (up to 3 blocks, 48 rows, per pass over the weights).
 *
 * Dequantizing: w = (q - 8) * scale + zero in float32 (one FMA, scale and zero the bfloat16
 * values torch's int4 kernel multiplies with), rounded to bfloat16 to nearest even: the
 * values of the dense bfloat16 copy the model holds (model/quant/linear.py), so this and
 * oneDNN's GEMM multiply the same weights; the sums are float32 (AMX's), out in bfloat16.
 *
 * Layout of one weight [N, K] (N a multiple of 16, K of 32): codes uint8
 * [N / 16, K / 32, 16, 16]: tile row r (inputs 2r and 2r + 1 of the group), byte i holds lane
 * i (low nibble) and lane 16 + i (high nibble), lane L being output row L / 2 of the block,
 * input 2r + L % 2; scales and zeros bfloat16 [N / 16, K / 32, 2, 16].
 *
 * A tile load waits for the vector stores it reads to reach the cache (and a vector load for
 * a tile store's), so each loop writes the next group's B tile (two buffers) before it
 * loads the current one, and the Q8_0 loop scales the previous group's sums while the
 * current group's are in flight; the codes are prefetched PREFETCH_BYTES ahead. Same
 * arithmetic in the same order: the same bits.
 *
 * Output row blocks are spread over the OpenMP team (torch's libgomp); each thread loads
 * its own tile configuration. amx_init asks Linux for the tile state (arch_prctl).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__linux__)
#define AMX_KERNEL 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

int amx_applies(void) {
#ifdef AMX_KERNEL
    return 1;
#else
    return 0;
#endif
}

/* 0 when this process may use the tiles (Linux grants XTILEDATA on request). */
int amx_init(void) {
#ifdef AMX_KERNEL
    /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA */
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
#else
    return -1;
#endif
}

#ifdef AMX_KERNEL

#define MAX_BLOCKS 3 /* 16-row activation blocks per pass over the weights */
#define PREFETCH_BYTES 2048 /* of a block's int4 codes (its scales: a quarter of that) */
/* blocks x inputs below which one thread computes it all: ~80 ns a 16 x 32 tile at 32 rows,
 * so every projection of a small model (576 x 576: 648 tiles) is worth a team */
#define AMX_PARALLEL_MIN (4 * 1024)

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tiles 0-2: C (float32, block i), 3-5: A (bfloat16 activations, block i), 6: B */
static void configure(int64_t rows) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < MAX_BLOCKS; i++) {
        int64_t r = rows - 16 * i;
        r = r > 16 ? 16 : (r < 0 ? 0 : r);
        if (r == 0) continue;
        cfg.rows[i] = (uint8_t)r;
        cfg.colsb[i] = 64;
        cfg.rows[3 + i] = (uint8_t)r;
        cfg.colsb[3 + i] = 64;
    }
    cfg.rows[6] = 16;
    cfg.colsb[6] = 64;
    _tile_loadconfig(&cfg);
}

/* One group's B tile (16 rows of 32 bfloat16) from its codes and the block's scales; q - 8
 * as float32 through a table (vpermps reads an index's low 4 bits: the low nibble needs no
 * mask), the same values as a conversion and a subtraction, two instructions fewer a row. */
static inline void dequant_tile(const uint8_t *codes, __m512 s_lo, __m512 z_lo, __m512 s_hi,
                                __m512 z_hi, uint16_t *bt) {
    const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f,
                                        2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
    for (int r = 0; r < 16; r++) {
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * r)));
        __m512 lo = _mm512_permutexvar_ps(v, table);
        __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        lo = _mm512_fmadd_ps(lo, s_lo, z_lo);
        hi = _mm512_fmadd_ps(hi, s_hi, z_hi);
        _mm512_store_si512((__m512i *)(bt + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void dequant_group(const uint8_t *c, const uint16_t *s, __m512i pair_lo,
                                 __m512i pair_hi, uint16_t *bt) {
    __m512 sc = bf16x16(s), ze = bf16x16(s + 16);
    dequant_tile(c, _mm512_permutexvar_ps(pair_lo, sc), _mm512_permutexvar_ps(pair_lo, ze),
                 _mm512_permutexvar_ps(pair_hi, sc), _mm512_permutexvar_ps(pair_hi, ze), bt);
}

/* Output rows [16 nb, 16 nb + 16) for activation rows [0, rows), rows <= 48. */
static void block_rows(const uint16_t *x, int64_t rows, int64_t ldx, int64_t k,
                       const uint8_t *codes, const uint16_t *sz, int64_t nb, uint16_t *out,
                       int64_t ldo, uint16_t *bt, float *cbuf) {
    const int64_t groups = k / 32;
    const int blocks = (int)((rows + 15) / 16);
    const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i pair_hi =
        _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const uint8_t *c = codes + nb * groups * 256;
    const uint16_t *s = sz + nb * groups * 32;
    _tile_zero(0);
    if (blocks > 1) _tile_zero(1);
    if (blocks > 2) _tile_zero(2);
    dequant_group(c, s, pair_lo, pair_hi, bt);
    for (int64_t g = 0; g < groups; g++) {
        /* the codes and scales stream from memory once a step: asked for PREFETCH_BYTES
         * ahead (the hardware's prefetch alone left the loads waiting, ~20% of the time) */
        for (int l = 0; l < 256; l += 64)
            _mm_prefetch((const char *)(c + 256 * g + PREFETCH_BYTES + l), _MM_HINT_T0);
        _mm_prefetch((const char *)(s + 32 * g + PREFETCH_BYTES / 4), _MM_HINT_T0);
        if (g + 1 < groups)
            dequant_group(c + 256 * (g + 1), s + 32 * (g + 1), pair_lo, pair_hi,
                          bt + 512 * ((g + 1) & 1));
        _tile_loadd(6, bt + 512 * (g & 1), 64);
        const uint16_t *xa = x + 32 * g;
        _tile_loadd(3, xa, ldx * 2);
        _tile_dpbf16ps(0, 3, 6);
        if (blocks > 1) {
            _tile_loadd(4, xa + 16 * ldx, ldx * 2);
            _tile_dpbf16ps(1, 4, 6);
        }
        if (blocks > 2) {
            _tile_loadd(5, xa + 32 * ldx, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
        }
    }
    for (int i = 0; i < blocks; i++) {
        if (i == 0) _tile_stored(0, cbuf, 64);
        if (i == 1) _tile_stored(1, cbuf + 256, 64);
        if (i == 2) _tile_stored(2, cbuf + 512, 64);
    }
    for (int64_t r = 0; r < rows; r++) {
        __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(cbuf + 16 * r));
        _mm256_storeu_si256((__m256i *)(out + r * ldo + 16 * nb), v);
    }
}

/* group g's int8 values into a B tile (exact in bfloat16) */
static inline void q8_tile(const int8_t *cg, uint16_t *bt) {
    for (int r = 0; r < 16; r++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(cg + 32 * r));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
        _mm512_store_si512((__m512i *)(bt + 32 * r), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

/* acc [rows, 16] += the group's sums (cb) times its scales */
static inline void q8_scale(float *acc, const float *cb, const float *scales, int64_t rows) {
    const __m512 scale = _mm512_loadu_ps(scales);
    for (int64_t r = 0; r < rows; r++)
        _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(cb + 16 * r), scale,
                                                      _mm512_load_ps(acc + 16 * r)));
}

/* int8 blocks (GGUF Q8_0): output rows [16 nb, 16 nb + 16) of float32 logits for
 * activation rows [0, rows), rows <= 48. Each group's B tile holds the int8 values
 * themselves (exact in bfloat16), its sums go through cbuf and are scaled there by the
 * group's scales into acc (float32 [rows, 16]), in the groups' order. A tile load waits for
 * the stores it reads to reach the cache, and so does a vector load of what a tile store
 * wrote: group g + 1's B tile is written (bt, two of them) and group g - 1's sums scaled
 * (cbuf, two) while group g's tiles are in flight. */
static void block_rows_q8(const uint16_t *x, int64_t rows, int64_t ldx, int64_t k,
                          const int8_t *codes, const float *d, int64_t nb, float *out,
                          int64_t ldo, uint16_t *bt, float *cbuf, float *acc) {
    const int64_t groups = k / 32;
    const int blocks = (int)((rows + 15) / 16);
    const int8_t *c = codes + nb * groups * 512;
    const float *s = d + nb * groups * 16;
    memset(acc, 0, (size_t)rows * 16 * sizeof(float));
    q8_tile(c, bt);
    for (int64_t g = 0; g < groups; g++) {
        uint16_t *bg = bt + 512 * (g & 1);
        float *cb = cbuf + 768 * (g & 1);
        if (g + 1 < groups) q8_tile(c + 512 * (g + 1), bt + 512 * ((g + 1) & 1));
        _tile_loadd(6, bg, 64);
        const uint16_t *xa = x + 32 * g;
        _tile_zero(0);
        _tile_loadd(3, xa, ldx * 2);
        _tile_dpbf16ps(0, 3, 6);
        _tile_stored(0, cb, 64);
        if (blocks > 1) {
            _tile_zero(1);
            _tile_loadd(4, xa + 16 * ldx, ldx * 2);
            _tile_dpbf16ps(1, 4, 6);
            _tile_stored(1, cb + 256, 64);
        }
        if (blocks > 2) {
            _tile_zero(2);
            _tile_loadd(5, xa + 32 * ldx, ldx * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_stored(2, cb + 512, 64);
        }
        if (g > 0) q8_scale(acc, cbuf + 768 * ((g - 1) & 1), s + 16 * (g - 1), rows);
    }
    q8_scale(acc, cbuf + 768 * ((groups - 1) & 1), s + 16 * (groups - 1), rows);
    for (int64_t r = 0; r < rows; r++)
        _mm512_storeu_ps(out + r * ldo + 16 * nb, _mm512_load_ps(acc + 16 * r));
}

#endif

/* bfloat16 x [m, k] (row stride ldx) times the packed int8-block weight of n rows
 * (n % 16 == 0, k % 32 == 0): float32 out [m, n] (row stride ldo), the blocks' values as
 * stored (codes int8 [n / 16, k / 32, 16, 32] in the int4 layout's lane order, scales
 * float32 [n / 16, k / 32, 16]). */
void q8_amx_f32(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const int8_t *codes,
                const float *d, int64_t n, float *out, int64_t ldo) {
#ifdef AMX_KERNEL
    const int64_t nblocks = n / 16;
    for (int64_t r0 = 0; r0 < m; r0 += 16 * MAX_BLOCKS) {
        int64_t rows = m - r0 < 16 * MAX_BLOCKS ? m - r0 : 16 * MAX_BLOCKS;
#pragma omp parallel if (nblocks * k >= AMX_PARALLEL_MIN)
        {
            uint16_t bt[1024] __attribute__((aligned(64)));
            float cbuf[1536] __attribute__((aligned(64)));
            float acc[768] __attribute__((aligned(64)));
            configure(rows);
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < nblocks; nb++)
                block_rows_q8(x + r0 * ldx, rows, ldx, k, codes, d, nb, out + r0 * ldo, ldo, bt,
                              cbuf, acc);
            _tile_release();
        }
    }
#else
    (void)x; (void)m; (void)ldx; (void)k; (void)codes; (void)d; (void)n; (void)out; (void)ldo;
#endif
}

/* bfloat16 x [m, k] (row stride ldx) times the packed int4 weight of n rows (n % 16 == 0,
 * k % 32 == 0): bfloat16 out [m, n] (row stride ldo). */
void q4_amx_bf16(const uint16_t *x, int64_t m, int64_t ldx, int64_t k, const uint8_t *codes,
                 const uint16_t *sz, int64_t n, uint16_t *out, int64_t ldo) {
#ifdef AMX_KERNEL
    const int64_t nblocks = n / 16;
    for (int64_t r0 = 0; r0 < m; r0 += 16 * MAX_BLOCKS) {
        int64_t rows = m - r0 < 16 * MAX_BLOCKS ? m - r0 : 16 * MAX_BLOCKS;
#pragma omp parallel if (nblocks * k >= AMX_PARALLEL_MIN)
        {
            uint16_t bt[1024] __attribute__((aligned(64)));
            float cbuf[768] __attribute__((aligned(64)));
            configure(rows);
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < nblocks; nb++)
                block_rows(x + r0 * ldx, rows, ldx, k, codes, sz, nb, out + r0 * ldo, ldo, bt,
                           cbuf);
            _tile_release();
        }
    }
#else
    (void)x; (void)m; (void)ldx; (void)k; (void)codes; (void)sz; (void)n; (void)out; (void)ldo;
#endif
}
