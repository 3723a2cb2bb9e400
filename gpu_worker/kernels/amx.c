/* The AMX kernels (level amx; compiled empty elsewhere): the bf16 matmul, Moondream's attention on
 * tiles (layers.c runs Llama's layers on this matmul).
 *
 *   linear_bf16          y = x @ W^T (+ bias) on AMX tiles, each row's result independent of the batch
 *                        (linear_gelu_bf16: then gelu_tanh, on the float32 sum)
 *   full_attention_bf16  Moondream's vision encoder's attention, each crop alone
 *   paged_attention_amx_bf16  Moondream's text attention over the paged cache
 *
 * Linux grants AMX's tile state per process on request (arch_prctl(ARCH_REQ_XCOMP_PERM)):
 * gpu_worker/cpu_kernels.py asks before it picks this level.
 */
#include "kv_cache.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && VW == 16
/* ---- The bf16 matmul on AMX: y [M, N] = x [M, K] @ W^T (+ bias), W an nn.Linear weight [N, K].
 *
 * Why our own: oneDNN's per-call overhead and its blocking for few rows read the weights at about
 * half the memory bandwidth at 1 and 32 rows (BENCHMARKS.md "The AMX matmul and the layers in
 * one C call"), and a row's result must not depend on the batch around it (a request's tokens
 * would then depend on the schedule).
 * Here every output element is one fp32 accumulation over K in blocks of 32, in the same order
 * whatever M is and whichever thread computes it, then rounded to bf16 once: batch invariant by
 * construction. Threads split the output columns (contiguous ranges, so each streams its part of
 * the weight); the weight is read once per pass of up to 256 rows, with software prefetch a few
 * tiles ahead (without it the tile loads wait on memory: 1.4x slower at 1 row).
 *
 * Packed layout (linear_pack_bf16): for each block of 16 output columns, for each block of 32 k,
 * one 1 KB tile in AMX's pair-interleaved (VNNI) form: row r holds W[n][k0 + 2r], W[n][k0 + 2r + 1]
 * for n = 0..15; N and K are zero-padded to multiples of 32 (a padded weight is +0, and x's last
 * K % 32 columns go through a zero-padded copy, so a tile never reads past a row and the sums are
 * the unpadded ones: x + 0 = x). */
void linear_pack_bf16(const bf16 *w, bf16 *out, int64_t N, int64_t K) {
    const int64_t kbs = (K + 31) / 32;
#pragma omp parallel for
    for (int64_t nb = 0; nb < (N + 31) / 32 * 2; nb++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            bf16 *tile = out + (nb * kbs + kb) * 512;
            for (int r = 0; r < 16; r++)
                for (int n = 0; n < 16; n++)
                    for (int i = 0; i < 2; i++) {
                        const int64_t row = nb * 16 + n, k = kb * 32 + 2 * r + i;
                        tile[r * 32 + 2 * n + i] = row < N && k < K ? w[row * K + k] : 0; /* +0.0: the padding */
                    }
        }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tiles: 0-3 C (fp32 16 x 16: rows 0-15 x columns 0-15 / 16-31, then rows 16-31), 4-5 A (rows of
 * x, 32 k), 6-7 B (weight tiles). `rows` rows of x in this block (1..32). */
static void configure_tiles(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const uint8_t top = (uint8_t)(rows < 16 ? rows : 16), bottom = (uint8_t)(rows > 16 ? rows - 16 : 1);
    const uint8_t tile_rows[8] = {top, top, bottom, bottom, top, bottom, 16, 16};
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = tile_rows[t];
    }
    _tile_loadconfig(&c);
}

static inline void prefetch_tile(const bf16 *p) {
    for (int line = 0; line < 16; line++) _mm_prefetch((const char *)(p + line * 32), _MM_HINT_T0);
}

/* rows x 16 fp32 accumulators (+ bias, then gelu if `gelu`) -> bf16, rounded to nearest even once. */
static inline void store_block(const float *acc, const bf16 *bias, bf16 *y, int64_t ldy, int rows, int cols,
                               int gelu) {
    if (cols <= 0) return;
    const vf b = bias ? v_load(bias, 0, cols, 1) : v_set(0.f);
    for (int r = 0; r < rows; r++) {
        const vf v = v_add(_mm512_loadu_ps(acc + r * 16), b);
        v_store(y + r * ldy, 0, cols, gelu ? v_gelu_tanh(v) : v, 1);
    }
}

#define PREFETCH_TILES 4 /* ahead, per weight stream: 4 KB (2-6 measured alike, 16 slower) */

/* One step of 32 k: 16 rows of x (row stride lda), and 16 more if `both`, times two weight tiles,
 * added into accumulators 0-1 (and 2-3). */
static inline __attribute__((always_inline)) void k_step(const bf16 *a, int64_t lda, const bf16 *b0,
                                                         const bf16 *b1, int both) {
    _tile_loadd(4, a, lda * 2);
    if (both) _tile_loadd(5, a + 16 * lda, lda * 2);
    _tile_loadd(6, b0, 64);
    _tile_loadd(7, b1, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (both) {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* One block of 1..32 rows of x (row stride K) times one pair of 16-column weight streams b0, b1
 * -> `cols` (1..32) columns of y (row stride N). `tail`: the block's rows' last K % 32 values of x,
 * zero-padded to 32 (row stride 32), for the last k step (NULL when K % 32 == 0). */
static inline void linear_block(const bf16 *a, const bf16 *tail, const bf16 *b0, const bf16 *b1,
                                const bf16 *bias0, bf16 *out, int64_t K, int64_t N, int rows, int cols,
                                int prefetch, int gelu) {
    const int64_t kbs = K / 32;
    const int top = rows < 16 ? rows : 16;
    const bf16 *bias1 = bias0 ? bias0 + 16 : NULL;
    float acc[4][256] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kbs; kb++) {
            if (prefetch) {
                prefetch_tile(b0 + (kb + PREFETCH_TILES) * 512);
                prefetch_tile(b1 + (kb + PREFETCH_TILES) * 512);
            }
            k_step(a + kb * 32, K, b0 + kb * 512, b1 + kb * 512, 1);
        }
        if (tail) k_step(tail, 32, b0 + kbs * 512, b1 + kbs * 512, 1);
    } else {
        for (int64_t kb = 0; kb < kbs; kb++) {
            if (prefetch) {
                prefetch_tile(b0 + (kb + PREFETCH_TILES) * 512);
                prefetch_tile(b1 + (kb + PREFETCH_TILES) * 512);
            }
            k_step(a + kb * 32, K, b0 + kb * 512, b1 + kb * 512, 0);
        }
        if (tail) k_step(tail, 32, b0 + kbs * 512, b1 + kbs * 512, 0);
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    const int cols0 = cols < 16 ? cols : 16, cols1 = cols - 16;
    store_block(acc[0], bias0, out, N, top, cols0, gelu);
    store_block(acc[1], bias1, out + 16, N, top, cols1, gelu);
    if (rows > 16) {
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
        store_block(acc[2], bias0, out + 16 * N, N, rows - 16, cols0, gelu);
        store_block(acc[3], bias1, out + 16 * N + 16, N, rows - 16, cols1, gelu);
    }
}

/* Rows of x per pass over the weight: a chunk of x (256 x K bf16, 288 KB at K = 576) stays in the
 * core's L2 while the weight streams by; the weight is read once per chunk. */
#define ROWS_PER_PASS 256

static void linear_amx(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t K, int64_t N,
                       int nthreads, int gelu) {
    const int64_t pairs = (N + 31) / 32, kbs = (K + 31) / 32, k_tail = K % 32;
#pragma omp parallel num_threads(nthreads)
    {
        int configured = -1;
        bf16 tail[32 * 32] __attribute__((aligned(64)));
        for (int64_t chunk = 0; chunk < M; chunk += ROWS_PER_PASS) {
            const int64_t chunk_end = M - chunk < ROWS_PER_PASS ? M : chunk + ROWS_PER_PASS;
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < pairs; p++) {
                const bf16 *b0 = wp + 2 * p * kbs * 512, *b1 = b0 + kbs * 512;
                for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) {
                    const int rows = (int)(chunk_end - m0 < 32 ? chunk_end - m0 : 32);
                    if (rows != configured) configure_tiles(configured = rows);
                    if (k_tail) { /* x's last K % 32 columns, zero-padded: a tile never reads past a row */
                        memset(tail, 0, sizeof tail);
                        for (int r = 0; r < rows; r++)
                            memcpy(tail + r * 32, x + (m0 + r) * K + K - k_tail, (size_t)k_tail * 2);
                    }
                    const int cols = (int)(N - 32 * p < 32 ? N - 32 * p : 32);
                    /* The chunk's first row block streams the weight in; the others find it in cache. */
                    linear_block(x + m0 * K, k_tail ? tail : NULL, b0, b1, bias ? bias + 32 * p : NULL,
                                 y + m0 * N + 32 * p, K, N, rows, cols, m0 == chunk, gelu);
                }
            }
        }
        _tile_release(); /* leaves the thread's tile state clean for oneDNN and cheap to context-switch */
    }
}

void linear_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t K, int64_t N,
                 int nthreads) {
    linear_amx(x, wp, bias, y, M, K, N, nthreads, 0);
}

/* gelu_tanh(x @ W^T + bias), the gelu on the float32 sum: one rounding to bf16 where the eager
 * pair rounds the matmul, then the gelu (Moondream's MLPs). */
void linear_gelu_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t K, int64_t N,
                      int nthreads) {
    linear_amx(x, wp, bias, y, M, K, N, nthreads, 1);
}

/* Attention on AMX, one head at a time (Moondream: the vision encoder's crops, and the text
 * model's rows over the paged cache). A head's keys and values come in groups of 16 rows (one
 * crop's consecutive tokens, or one page's keys), packed into tiles zero-padded to multiples of
 * 32 keys and 32 dims; its queries go 32 at a time: S = q k^T in float32, softmax(scale S) in
 * float32 over each row's own keys (exp(s - max), the sum kept), P rounded to bf16 (as torch's
 * flash attention rounds it for its second matmul), P v, divided by the sum and rounded to bf16
 * once. A row's keys past its own last one get P = 0, so the extra steps a longer row in its
 * block needs add exact zeros: every row's result is the same bits whatever rows it is computed
 * with (the batch and the schedule never change a token). Keys fit in L2 (a block's scores are
 * 32 x keys floats), so no online softmax is needed. */
static inline void pack_b_cols(const bf16 *const *groups, int64_t ld, int64_t rows, int64_t cols, bf16 *out) {
    /* B tiles for "out[n] = sum_k A[k] src[n][k]" (n < rows, k < cols, cols even; row n is
     * groups[n / 16] + (n % 16) ld): tile row r = the 32-bit pairs src[n][k0 + 2r .. + 1],
     * n = 0..15 (the linear_pack_bf16 layout), zero beyond. */
    const int64_t kbs = (cols + 31) / 32, nbs = (rows + 31) / 32 * 2;
    const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)(ld / 2)));
    for (int64_t nb = 0; nb < nbs; nb++) {
        const __mmask16 m = mask16(rows - nb * 16 > 0 ? rows - nb * 16 : 0);
        const int *base = m ? (const int *)groups[nb] : NULL;
        for (int64_t kb = 0; kb < kbs; kb++) {
            __m512i *tile = (__m512i *)(out + (nb * kbs + kb) * 512);
            for (int r = 0; r < 16; r++) {
                const int64_t pair = kb * 16 + r;
                tile[r] = m && 2 * pair < cols
                              ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m,
                                                            _mm512_add_epi32(lanes, _mm512_set1_epi32((int)pair)), base, 4)
                              : _mm512_setzero_si512();
            }
        }
    }
}

static inline void pack_b_rows(const bf16 *const *groups, int64_t ld, int64_t rows, int64_t cols, bf16 *out) {
    /* B tiles for "out[n] = sum_k A[k] src[k][n]" (k < rows, n < cols; row k as above): for each
     * 16 columns, for each 32 k, a tile whose row r pairs src[k0 + 2r][n], src[k0 + 2r + 1][n]. */
    const int64_t kbs = (rows + 31) / 32, nbs = (cols + 31) / 32 * 2;
    for (int64_t nb = 0; nb < nbs; nb++) {
        const __mmask16 m = mask16(cols - nb * 16 > 0 ? cols - nb * 16 : 0);
        for (int64_t kb = 0; kb < kbs; kb++) {
            __m512i *tile = (__m512i *)(out + (nb * kbs + kb) * 512);
            for (int r = 0; r < 16; r++) {
                const int64_t k = kb * 32 + 2 * r; /* k and k + 1 are in one group of 16 */
                const bf16 *row = k < rows ? groups[k / 16] + (k % 16) * ld + nb * 16 : NULL;
                const __m256i lo = row ? _mm256_maskz_loadu_epi16(m, row) : _mm256_setzero_si256();
                const __m256i hi = k + 1 < rows ? _mm256_maskz_loadu_epi16(m, row + ld) : _mm256_setzero_si256();
                tile[r] = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
            }
        }
    }
}

/* 2^t for t <= 0 (0 below float's range): t = n + f with |f| <= 1/2, 2^f by a degree-5 fit
 * (2.3e-7 relative in float32, about two ulps; the softmax rounds P to bf16), 2^n by scalef.
 * Half of v_exp's operations: the softmax was a third of the attention's time. */
static inline vf v_exp2_nonpositive(vf t) {
    const vf n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = v_sub(t, n);
    vf p = v_set(1.327649224549532e-3f);
    p = v_fma(p, f, v_set(9.675516746938229e-3f));
    p = v_fma(p, f, v_set(5.550713092088699e-2f));
    p = v_fma(p, f, v_set(2.4022120237350464e-1f));
    p = v_fma(p, f, v_set(6.931469440460205e-1f));
    p = v_fma(p, f, v_set(1.0000001192092896f));
    return _mm512_scalef_ps(p, n);
}

static inline __attribute__((always_inline)) void zero_sums(int both) {
    _tile_zero(0);
    _tile_zero(1);
    if (both) {
        _tile_zero(2);
        _tile_zero(3);
    }
}

typedef struct { /* one thread's buffers for heads of up to max_rows queries and max_keys keys */
    bf16 *q, *kp, *vp, *p;
    float *s, *inv;
    int64_t keys_cap, dims, configured;
} head_scratch;

static head_scratch head_scratch_new(int64_t max_rows, int64_t max_keys, int64_t D) {
    head_scratch h;
    h.keys_cap = (max_keys + 31) / 32 * 32;
    h.dims = (D + 31) / 32 * 32;
    const int64_t rows = (max_rows + 31) / 32 * 32;
    h.q = aligned_alloc(64, (size_t)(rows * h.dims + 2 * h.keys_cap * h.dims + 32 * h.keys_cap) * 2);
    h.kp = h.q + rows * h.dims;
    h.vp = h.kp + h.keys_cap * h.dims;
    h.p = h.vp + h.keys_cap * h.dims;
    h.s = aligned_alloc(64, (size_t)(32 * h.keys_cap + 32) * 4);
    h.inv = h.s + 32 * h.keys_cap;
    h.configured = -1;
    return h;
}

static void head_scratch_free(head_scratch *h) {
    free(h->q);
    free(h->s);
}

/* One head: `rows` queries (row i at q + i q_ld) over `keys` keys and values (groups of 16 rows at
 * stride kv_ld); row i sees keys 0 .. last[i] (all when last is NULL); out row i at out + i out_ld. */
static void attend_head(const bf16 *q, int64_t q_ld, const bf16 *const *k_groups, const bf16 *const *v_groups,
                        int64_t kv_ld, int64_t keys, const int64_t *last, int64_t rows, int64_t D, float scale,
                        bf16 *out, int64_t out_ld, head_scratch *h) {
    const int64_t Dp = h->dims, Kp = (keys + 31) / 32 * 32, dks = Dp / 32;
    for (int64_t i = 0; i < (rows + 31) / 32 * 32; i++) { /* q zero-padded to Dp: a tile never reads another head */
        bf16 *dst = h->q + i * Dp;
        memset(dst, 0, (size_t)Dp * 2);
        if (i < rows) memcpy(dst, q + i * q_ld, (size_t)D * 2);
    }
    pack_b_cols(k_groups, kv_ld, keys, D, h->kp); /* k: S's columns are keys, its k steps dims */
    pack_b_rows(v_groups, kv_ld, keys, D, h->vp); /* v: the output's columns are dims, its k steps keys */
    const float c = scale * 1.44269504088896341f; /* exp(scale (s - max)) = 2^(c s - c max) */
    float acc[4][256] __attribute__((aligned(64)));
    for (int64_t m0 = 0; m0 < rows; m0 += 32) {
        const int n = (int)(rows - m0 < 32 ? rows - m0 : 32), both = n > 16;
        int64_t seen = 0; /* the block's most keys seen by a row */
        for (int r = 0; r < n; r++) {
            const int64_t row_keys = last ? last[m0 + r] + 1 : keys;
            seen = row_keys > seen ? row_keys : seen;
        }
        const int64_t steps = (seen + 31) / 32, Ks = h->keys_cap;
        if (n != h->configured) configure_tiles((int)(h->configured = n));
        for (int64_t pr = 0; pr < steps; pr++) { /* S = q k^T, 32 keys at a time */
            const bf16 *b0 = h->kp + 2 * pr * dks * 512, *b1 = b0 + dks * 512;
            zero_sums(both);
            for (int64_t kb = 0; kb < dks; kb++) k_step(h->q + m0 * Dp + kb * 32, Dp, b0 + kb * 512, b1 + kb * 512, both);
            _tile_stored(0, h->s + pr * 32, Ks * 4);
            _tile_stored(1, h->s + pr * 32 + 16, Ks * 4);
            if (both) {
                _tile_stored(2, h->s + 16 * Ks + pr * 32, Ks * 4);
                _tile_stored(3, h->s + 16 * Ks + pr * 32 + 16, Ks * 4);
            }
        }
        for (int r = 0; r < n; r++) { /* softmax(scale S) in float32 over the row's keys; P in bf16, zero past them */
            const int64_t row_keys = last ? last[m0 + r] + 1 : keys;
            float *sr = h->s + r * Ks;
            vf mx = v_set(-INFINITY);
            for (int64_t j = 0; j < row_keys; j += 16)
                mx = v_max(mx, _mm512_mask_loadu_ps(v_set(-INFINITY), mask16(row_keys - j), sr + j));
            const vf cv = v_set(c), shift = v_set(-c * _mm512_reduce_max_ps(mx));
            vf sum = v_set(0.f);
            for (int64_t j = 0; j < steps * 32; j += 16) {
                const __mmask16 m = mask16(row_keys - j > 0 ? row_keys - j : 0);
                const vf e = _mm512_maskz_mov_ps(m, v_exp2_nonpositive(v_fma(_mm512_loadu_ps(sr + j), cv, shift)));
                sum = v_add(sum, e);
                v_store(h->p + r * Ks, j, 16, e, 1);
            }
            h->inv[r] = 1.f / v_sum(sum);
        }
        for (int64_t pr = 0; pr < dks; pr++) { /* P v, 32 dims at a time */
            const bf16 *b0 = h->vp + 2 * pr * (Kp / 32) * 512, *b1 = b0 + (Kp / 32) * 512;
            zero_sums(both);
            for (int64_t kb = 0; kb < steps; kb++) k_step(h->p + kb * 32, Ks, b0 + kb * 512, b1 + kb * 512, both);
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            if (both) {
                _tile_stored(2, acc[2], 64);
                _tile_stored(3, acc[3], 64);
            }
            const int64_t left = D - pr * 32;
            for (int r = 0; r < n; r++) {
                const int half = r < 16 ? 0 : 2, rr = r % 16;
                const vf norm = v_set(h->inv[r]);
                bf16 *dst = out + (m0 + r) * out_ld + pr * 32;
                v_store(dst, 0, left, v_mul(_mm512_loadu_ps(acc[half] + rr * 16), norm), 1);
                if (left > 16) v_store(dst, 16, left - 16, v_mul(_mm512_loadu_ps(acc[half + 1] + rr * 16), norm), 1);
            }
        }
    }
}

/* Full (non-causal) attention of each crop's tokens, every head, from the fused qkv rows
 * [B, T, 3 H D] -> out [B, T, H D] (the heads side by side, as the output projection reads them):
 * Moondream's vision encoder (T = 729, D = 72). */
void full_attention_bf16(const bf16 *qkv, bf16 *out, int64_t B, int64_t T, int64_t H, int64_t D, float scale,
                           int nthreads) {
    const int64_t C = H * D, ld = 3 * C, groups = (T + 15) / 16;
#pragma omp parallel num_threads(nthreads)
    {
        head_scratch hs = head_scratch_new(T, T, D);
        const bf16 *kg[groups], *vg[groups];
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < B * H; item++) {
            const int64_t b = item / H, h = item % H;
            const bf16 *rows = qkv + b * T * ld + h * D;
            for (int64_t g = 0; g < groups; g++) {
                kg[g] = rows + C + g * 16 * ld;
                vg[g] = rows + 2 * C + g * 16 * ld;
            }
            attend_head(rows, ld, kg, vg, ld, T, NULL, T, D, scale, out + b * T * C + h * D, C, &hs);
        }
        head_scratch_free(&hs);
        _tile_release();
    }
}

/* The text model's attention over the paged cache: the rows of sequence s are q rows
 * starts[s] .. starts[s + 1] - 1 (q [T, H, D], roped), and row t sees its sequence's keys at
 * positions 0 .. last[t] (causal: its own position; a prefix-LM block's rows: the block's last),
 * from the caches [pages, Hkv, page_size, D] through tables [S, table_width] (page_size a
 * multiple of 16: a group of 16 keys is in one page). -> out [T, H D]. */
void paged_attention_amx_bf16(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *tables,
                              int64_t table_width, int64_t page_size, const int64_t *starts, const int64_t *last,
                              bf16 *out, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    const int64_t max_keys = table_width * page_size, group = H / Hkv;
    int64_t max_rows = 1;
    for (int64_t s = 0; s < S; s++) max_rows = starts[s + 1] - starts[s] > max_rows ? starts[s + 1] - starts[s] : max_rows;
#pragma omp parallel num_threads(nthreads)
    {
        head_scratch hs = head_scratch_new(max_rows, max_keys, D);
        const bf16 *kg[max_keys / 16 + 1], *vg[max_keys / 16 + 1];
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < S * H; item++) {
            const int64_t s = item / H, h = item % H, kh = h / group, first = starts[s], rows = starts[s + 1] - first;
            if (rows == 0) continue;
            int64_t keys = 0;
            for (int64_t i = 0; i < rows; i++) keys = last[first + i] + 1 > keys ? last[first + i] + 1 : keys;
            for (int64_t g = 0; g < (keys + 15) / 16; g++) {
                const int64_t row = kv_row(tables[s * table_width + g * 16 / page_size] * page_size + g * 16 % page_size,
                                           kh, Hkv, page_size);
                kg[g] = k_cache + row * D;
                vg[g] = v_cache + row * D;
            }
            attend_head(q + (first * H + h) * D, H * D, kg, vg, D, keys, last + first, rows, D, scale,
                        out + first * H * D + h * D, H * D, &hs);
        }
        head_scratch_free(&hs);
        _tile_release();
    }
}

#endif
