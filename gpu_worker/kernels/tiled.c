/* Weight-only linears on tiles of 16 output rows with int16 activations (the levels with VW 16).
 *
 * y [M, N] = x [M, K] @ W^T (+ bias), x and y float32 or bf16: W in tiles of TILE = 16 output
 * rows, each block of 32 k of a tile stored so that one vector of 32 int16 holds 16 rows x 2 k
 * (word 2 r + e: row r, k = 2 j + e of k-pair j). x is quantized per 32 k to int16 against the
 * block's largest value (dx = amax / 32767, q = x * (32767 / amax) rounded to nearest even);
 * vpmaddwd with x's pair (q[2j], q[2j + 1]) broadcast adds both products of each row into its own
 * int32 lane (then vpaddd into the block's sum; one vpdpwssd with VNNI), so a block's 16 k-pairs
 * give every row's exact integer sum in one vector, scaled once per block:
 *     y[r] = sum_b (s[r, b] dx_b) isum[r, b] + sum_g o[r, g] xs_g + bias[r]
 * with xs_g = sum of dx_b * sum(q_b) over group g's blocks. The scaling costs 3 ops per 16 dot
 * products at any M, the lanes are the outputs (no horizontal sums), and a tile's weights are
 * unpacked once for up to MB rows of x (streamed) or, for more, once into an int16 buffer that
 * 4 rows x 3 tiles at a time multiply with their sums in registers. With VNNI, streamed rows are
 * not expanded to int16: vpdpbusd multiplies the weight bytes by x's high and low bytes
 * (tq_byte_sums), the same integer sums.
 *
 * Against quant.c's row-major expansion to float32 this is 2.3-3.1x at one row of x, 1.6-2.6x at
 * four and 1.3x at 32 (BENCHMARKS.md "Tiles of 16 output rows with int16 activations"; the
 * chains, VNNI and the register blocking: "fp16 scales, attention without spills"). x's
 * rounding to int16 is QuantKernels.multiplied_activation (gpu_worker/quant.py).
 *
 * Layouts (gpu_worker/quant.py's tile() repacks a row-major q4 / q8 weight):
 *   t4  per tile, per block: 4 chunks of 64 bytes; byte 4 r + e of chunk c: its low nibble row r's
 *       k = 4 c + e, its high nibble k = 16 + 4 c + e (q in 0..15: k-quads c and c + 4, as t8's);
 *       scale, offset [N / 16][K / G][16] float32, or fp16 with FMT_HALF (where that is exact: a
 *       GGUF file's Q4_0, Q4_1 and Q8_0 scales; a sixth of a q4 tile's bytes)
 *   t8  per tile, per block: 8 k-quads of 64 int8 (byte 4 r + e of k-quad j: row r, k = 4 j + e; an
 *       int32 lane per row, as VNNI's byte products sum); scale (offset) as t4
 * Batch invariance: the same integers and the same float32 ops in the same order whatever M.
 */
#include "quant.h"
#include "vec.h"

#if VW == 16
#define TILE 16
#define MB 4 /* rows of x per pass over a tile: MB int32 and MB float32 accumulators */
#define CHAINS 4 /* a block's 16 k-pairs summed in this many independent chains */
#define NT_MAX 3 /* tiles per pass of the buffered path: 4 x 3 int32 sums and float32 results in registers */
#define PREFETCH_AHEAD 4096 /* bytes of a tile's weights the streamed path asks for ahead of the block it multiplies */

typedef __m512i vi;

static inline vi dot_pairs(vi acc, vi a, vi b) { /* acc + the pairwise products of int16 a, b */
#ifdef __AVX512VNNI__ /* one instruction, the same int32 sums (a block's stay far below 2^31) */
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* Row x [K] -> q [K] int16 (k order), dx [K / 32], xs [K / G]. */
static void tq_quantize_row(const void *x, int x_bf, int64_t K, int gshift, int16_t *q, float *dx, float *xs) {
    for (int64_t g = 0; g < K >> gshift; g++) xs[g] = 0.f;
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 x0 = v_load(x, 32 * b, 16, x_bf), x1 = v_load(x, 32 * b + 16, 16, x_bf);
        const int finite = !(_mm512_fpclass_ps_mask(x0, 0x99) | _mm512_fpclass_ps_mask(x1, 0x99));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float inv = amax > 0.f && finite ? 32767.f / amax : 0.f;
        dx[b] = finite ? amax / 32767.f : NAN;
        const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm512_cvtepi32_epi16(a));
        _mm256_storeu_si256((__m256i *)(q + 32 * b + 16), _mm512_cvtepi32_epi16(c));
        xs[(32 * b) >> gshift] += dx[b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(a, c));
    }
}

/* A block's 8 k-quad vectors (k-quad j: lane r holds row r's k = 4 j .. 4 j + 3, a byte each): t8's
 * as stored, t4's low nibbles (k-quads 0-3) and high nibbles (4-7). */
static inline __attribute__((always_inline)) void tq_quads(const int fmt, const uint8_t *blk, vi wq[8]) {
    if (fmt == FMT_Q4) {
        const vi low = _mm512_set1_epi8(15);
        for (int c = 0; c < 4; c++) {
            const vi v = _mm512_loadu_si512(blk + 64 * c);
            wq[c] = _mm512_and_si512(v, low);
            wq[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    } else {
        for (int j = 0; j < 8; j++) wq[j] = _mm512_loadu_si512(blk + 64 * j);
    }
}

/* The 16 k-pair vectors of one block of one tile, in k-pair order: k-quad j's bytes b0..b3 in lane r
 * as the words (b0, b1) of k-pair 2 j and (b2, b3) of 2 j + 1, sign-extended (t8) or not (t4). */
static inline __attribute__((always_inline)) void tq_unpack(const int fmt, const uint8_t *blk, vi wv[16]) {
    vi wq[8];
    tq_quads(fmt, blk, wq);
    for (int j = 0; j < 8; j++) {
        const vi even = fmt == FMT_Q4 ? _mm512_and_si512(wq[j], _mm512_set1_epi16(255)) /* lane r: b0, b2 */
                                      : _mm512_srai_epi16(_mm512_slli_epi16(wq[j], 8), 8);
        const vi odd = fmt == FMT_Q4 ? _mm512_srli_epi16(wq[j], 8) : _mm512_srai_epi16(wq[j], 8); /* b1, b3 */
        wv[2 * j] = _mm512_mask_blend_epi16(0xAAAAAAAA, even, _mm512_slli_epi32(odd, 16));
        wv[2 * j + 1] = _mm512_mask_blend_epi16(0xAAAAAAAA, _mm512_srli_epi32(even, 16), odd);
    }
}

#ifdef __AVX512VNNI__
/* x's int16 q as the two bytes VNNI multiplies by the weights' bytes: q = 256 hi + lo with lo = q & 255
 * and hi = q >> 8 in -128..127, stored as hi + 128 (vpdpbusd's x operand is unsigned, the weights'
 * signed: t8's int8, t4's 0..15). xb: [K] lo then [K] hi + 128. */
static void tq_bytes_row(const int16_t *q, int64_t K, uint8_t *xb) {
    for (int64_t k = 0; k < K; k += 32) {
        const __m512i v = _mm512_loadu_si512(q + k);
        _mm256_storeu_si256((__m256i *)(xb + k), _mm512_cvtepi16_epi8(v)); /* the low byte */
        _mm256_storeu_si256((__m256i *)(xb + K + k),
                            _mm512_cvtepi16_epi8(_mm512_add_epi16(_mm512_srai_epi16(v, 8), _mm512_set1_epi16(128))));
    }
}

/* Block b's exact integer sums sum_k q[m, k] w[r, k] of MBC rows of x against one tile's block, the
 * same int32 as the k-pair products: 256 (sum (hi + 128) w - sum 128 w) + sum lo w, each sum far below
 * 2^31 (|256 sum hi w| <= 256 * 32 * 128 * 128), in four chains. */
static inline __attribute__((always_inline)) void tq_byte_sums(const int fmt, const uint8_t *blk, const uint8_t *xb,
                                                               int64_t K, int64_t b, int64_t m0, const int MBC,
                                                               vi isum[MB]) {
    vi wq[8];
    tq_quads(fmt, blk, wq);
    const vi bias_hi = _mm512_set1_epi8((char)128);
    vi c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
        c0 = _mm512_dpbusd_epi32(c0, bias_hi, wq[j]);
        c1 = _mm512_dpbusd_epi32(c1, bias_hi, wq[j + 1]);
    }
    const vi minus_c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_add_epi32(c0, c1));
    for (int m = 0; m < MBC; m++) {
        const int32_t *lo = (const int32_t *)(xb + (m0 + m) * 2 * K + 32 * b), *hi = (const int32_t *)((const uint8_t *)lo + K);
        vi l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512(), h0 = minus_c, h1 = _mm512_setzero_si512();
        for (int j = 0; j < 8; j += 2) {
            l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(lo[j]), wq[j]);
            h0 = _mm512_dpbusd_epi32(h0, _mm512_set1_epi32(hi[j]), wq[j]);
            l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(lo[j + 1]), wq[j + 1]);
            h1 = _mm512_dpbusd_epi32(h1, _mm512_set1_epi32(hi[j + 1]), wq[j + 1]);
        }
        isum[m] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0, h1), 8), _mm512_add_epi32(l0, l1));
    }
}
#endif

/* The 16 rows' scales (or offsets) at index i of a tile's [K / G][16], float32 or fp16. */
static inline __m512 tq_scales(const void *p, int64_t i, const int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i * TILE)));
    return _mm512_loadu_ps((const float *)p + i * TILE);
}

/* The epilogue of MR rows x NT tiles (rows m0.., tiles t0..): the offsets' term, the bias, the store;
 * the same for both paths. Each offset vector is converted once for the MR rows and each row's xs
 * broadcast once for the NT tiles (once per (row, tile), q4 linears took 1.04-1.09x longer at 32
 * rows: BENCHMARKS.md "Pages by kv head"); per (row, tile) the same float32 operations in the same
 * order. */
static inline __attribute__((always_inline)) void tq_finish(__m512 acc[MB][NT_MAX], const int MR, const int NT,
                                                            const int half, const void *offset, const float *xs,
                                                            int64_t m0, int64_t groups, const float *bias, void *y,
                                                            int y_bf, int64_t ldy, int64_t t0, int64_t N) {
    if (offset)
        for (int64_t g = 0; g < groups; g++) {
            __m512 xv[MB];
            for (int m = 0; m < MR; m++) xv[m] = _mm512_set1_ps(xs[(m0 + m) * groups + g]);
            for (int n = 0; n < NT; n++) {
                const __m512 ov = tq_scales(offset, (t0 + n) * groups + g, half);
                for (int m = 0; m < MR; m++) acc[m][n] = _mm512_fmadd_ps(ov, xv[m], acc[m][n]);
            }
        }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NT; n++) {
            const int64_t t = t0 + n, rows = N - t * TILE < TILE ? N - t * TILE : TILE;
            __m512 out = acc[m][n];
            if (bias) out = _mm512_add_ps(out, v_load(bias, t * TILE, rows, 0));
            v_store(y, (m0 + m) * ldy + t * TILE, rows, out, y_bf);
        }
}

/* Rows m0 .. m0 + MBC - 1 of x (at most MB: a decode step's) against tile t -> y, the tile's weights
 * unpacked block by block as they stream in. */
static inline __attribute__((always_inline)) void tq_tile(const int fmt, const int half, const uint8_t *w,
                                                          const void *scale, const void *offset, int gshift,
                                                          const int16_t *qx, const uint8_t *xb, const float *dx,
                                                          const float *xs, int64_t K, int64_t N, int64_t t,
                                                          int64_t m0, const int MBC,
                                                          const float *bias, void *y, int y_bf, int64_t ldy) {
    const int64_t blocks = K / 32, groups = K >> gshift, bytes = fmt == FMT_Q4 ? 256 : 512;
    const uint8_t *tw = w + t * blocks * bytes;
    __m512 acc[MB][NT_MAX];
    for (int m = 0; m < MB; m++) acc[m][0] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* every line of the block PREFETCH_AHEAD bytes on: one line a block left q8's 8 to the hardware
         * prefetcher, and a one-row step 1.2x slower (BENCHMARKS.md "Tiles in k-quads"); 4 blocks on
         * (1-2 KB), a one-row step took 1.3x (q4) and 1.1x (q8) as long on the AMX Xeon ("The
         * decode path prefetches 4 KB ahead") */
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(tw + b * bytes + PREFETCH_AHEAD + l), _MM_HINT_T0);
        vi isum[MB];
#ifdef __AVX512VNNI__ /* bytes times bytes, no int16 expansion (BENCHMARKS.md "Tiles in k-quads") */
        tq_byte_sums(fmt, tw + b * bytes, xb, K, b, m0, MBC, isum);
#else
        {
            vi wv[16];
            tq_unpack(fmt, tw + b * bytes, wv);
            for (int m = 0; m < MBC; m++) {
                const int32_t *pairs = (const int32_t *)(qx + (m0 + m) * K + 32 * b);
                /* four independent chains of k-pairs (a chain of 16 waited on each sum's latency);
                 * integer sums, so the order changes no bit */
                vi part[CHAINS];
                for (int c = 0; c < CHAINS; c++) part[c] = _mm512_madd_epi16(wv[c], _mm512_set1_epi32(pairs[c]));
                for (int j = CHAINS; j < 16; j++)
                    part[j % CHAINS] = dot_pairs(part[j % CHAINS], wv[j], _mm512_set1_epi32(pairs[j]));
                isum[m] = part[0];
                for (int c = 1; c < CHAINS; c++) isum[m] = _mm512_add_epi32(isum[m], part[c]);
            }
        }
#endif
        const __m512 sv = tq_scales(scale, t * groups + ((32 * b) >> gshift), half);
        for (int m = 0; m < MBC; m++)
            acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]),
                                        _mm512_mul_ps(sv, _mm512_set1_ps(dx[(m0 + m) * blocks + b])), acc[m][0]);
    }
    tq_finish(acc, MBC, 1, half, offset, xs, m0, groups, bias, y, y_bf, ldy, t, N);
}

/* Rows m0 .. m0 + MR - 1 of x against tiles t0 .. t0 + NT - 1, whose weights are in int16 in buf
 * [NT][K / 32][16][32] (more rows than MB: a prefill's or a large batch's). Registers hold MR x NT
 * int32 sums and float32 results, so each k-pair's weight vectors and x's broadcast pair serve MR x NT
 * products (the streamed path's 1 x 1 was bound by the broadcasts and loads: a third of the
 * integer dot product's rate). The same integers and the same float32 operations in the same order
 * as tq_tile, so a row's bits do not depend on the path its batch took. While it runs,
 * `next_bytes` of `next` (the thread's next tiles) are prefetched into L2, spread over the blocks:
 * unpacking them from memory after the multiplies left both cores waiting (1.2-1.3x slower
 * than with the weights in cache; BENCHMARKS.md "Attention's values in bf16 pairs; the next
 * tiles prefetched"). */
static inline __attribute__((always_inline)) void tq_tiles_buffered(
    const int half, const int16_t *buf, const void *scale, const void *offset, int gshift, const int16_t *qx,
    const float *dx, const float *xs, int64_t K, int64_t N, int64_t t0, int64_t m0, const int MR, const int NT,
    const float *bias, void *y, int y_bf, int64_t ldy, const uint8_t *next, int64_t next_bytes) {
    const int64_t blocks = K / 32, groups = K >> gshift, lines = (next_bytes / 64 + blocks - 1) / blocks;
    __m512 acc[MB][NT_MAX];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NT; n++) acc[m][n] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        vi isum[MB][NT_MAX];
        for (int m = 0; m < MR; m++)
            for (int n = 0; n < NT; n++) isum[m][n] = _mm512_setzero_si512();
        for (int64_t l = b * lines; l < (b + 1) * lines && l * 64 < next_bytes; l++)
            _mm_prefetch((const char *)next + l * 64, _MM_HINT_T1);
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            vi wv[NT_MAX];
            for (int n = 0; n < NT; n++) wv[n] = _mm512_loadu_si512(buf + ((n * blocks + b) * 16 + j) * 32);
            for (int m = 0; m < MR; m++) {
                const vi xp = _mm512_set1_epi32(((const int32_t *)(qx + (m0 + m) * K + 32 * b))[j]);
                for (int n = 0; n < NT; n++) isum[m][n] = dot_pairs(isum[m][n], wv[n], xp);
            }
        }
        for (int n = 0; n < NT; n++) {
            const __m512 sv = tq_scales(scale, (t0 + n) * groups + ((32 * b) >> gshift), half);
            for (int m = 0; m < MR; m++)
                acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m][n]),
                                            _mm512_mul_ps(sv, _mm512_set1_ps(dx[(m0 + m) * blocks + b])), acc[m][n]);
        }
    }
    tq_finish(acc, MR, NT, half, offset, xs, m0, groups, bias, y, y_bf, ldy, t0, N);
}

/* A buffer of at least `bytes` (64-byte aligned) of the calling thread's, buffer 0..3, reused from call
 * to call (a few KB each: OpenMP's pool threads keep theirs for the process's life). */
static void *thread_buffer(int which, size_t bytes) {
    static __thread void *held[4];
    static __thread size_t size[4];
    if (size[which] < bytes) {
        free(held[which]);
        size[which] = (bytes + 4095) / 4096 * 4096;
        held[which] = aligned_alloc(64, size[which]);
    }
    return held[which];
}

/* wlinear (quant.c) for the tiled formats: the same arguments. */
void tlinear(int fmt, const void *x, int x_bf, const void *wt, const void *scale, const void *offset, int64_t G,
             const float *bias, void *y, int y_bf, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
    const uint8_t *w = (const uint8_t *)wt;
    const int half = fmt & FMT_HALF;
    fmt = (fmt & ~FMT_HALF) == FMT_T4 ? FMT_Q4 : FMT_Q8;
    const int gshift = __builtin_ctzll((unsigned long long)G);
    const int64_t tiles = (N + TILE - 1) / TILE, groups = K >> gshift;
    if (M * N * K < (1 << 15)) nthreads = 1;
    /* Up to MB rows (a decode step), each thread rounds x itself (the same bits) and multiplies as the
     * tiles stream in, with no barrier between; more rows are rounded once into shared buffers by all
     * threads, then multiplied NT_MAX tiles at a time from an int16 copy of their weights. */
    const int shared = M > MB;
    int16_t *qx = shared ? aligned_alloc(64, (size_t)(M * K * 2 + 63) / 64 * 64) : NULL;
    float *dx = shared ? malloc((size_t)(M * (K / 32)) * sizeof(float)) : NULL;
    float *xs = shared ? malloc((size_t)(M * groups) * sizeof(float)) : NULL;
#pragma omp parallel num_threads(nthreads)
    if (!shared) { /* each thread rounds x into its own buffers, kept from call to call */
        int16_t *my_qx = thread_buffer(0, (size_t)(M * K) * sizeof(int16_t));
        float *my_dx = thread_buffer(1, (size_t)(M * (K / 32)) * sizeof(float));
        float *my_xs = thread_buffer(2, (size_t)(M * groups) * sizeof(float));
        uint8_t *my_xb = NULL;
        for (int64_t m = 0; m < M; m++)
            tq_quantize_row((const char *)x + m * K * (x_bf ? 2 : 4), x_bf, K, gshift, my_qx + m * K,
                            my_dx + m * (K / 32), my_xs + m * groups);
#ifdef __AVX512VNNI__
        my_xb = thread_buffer(3, (size_t)(M * 2 * K));
        for (int64_t m = 0; m < M; m++) tq_bytes_row(my_qx + m * K, K, my_xb + m * 2 * K);
#endif
#pragma omp for schedule(static) nowait /* the region's end is the barrier */
        for (int64_t t = 0; t < tiles; t++) {
#define TILE_ROWS(F, H, R) tq_tile(F, H, w, scale, offset, gshift, my_qx, my_xb, my_dx, my_xs, K, N, t, 0, R, bias, y, y_bf, ldy)
#define ROWS_H(H, R) (fmt == FMT_Q4 ? TILE_ROWS(FMT_Q4, H, R) : TILE_ROWS(FMT_Q8, H, R))
#define ROWS(R) (half ? ROWS_H(1, R) : ROWS_H(0, R))
            switch (M) {
            case 1: ROWS(1); break;
            case 2: ROWS(2); break;
            case 3: ROWS(3); break;
            case 4: ROWS(4); break;
            default: break;
            }
#undef ROWS
#undef ROWS_H
#undef TILE_ROWS
        }
    } else {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            tq_quantize_row((const char *)x + m * K * (x_bf ? 2 : 4), x_bf, K, gshift, qx + m * K, dx + m * (K / 32),
                            xs + m * groups);
        const int64_t bytes = fmt == FMT_Q4 ? 256 : 512, blocks = K / 32;
        int16_t *buf = aligned_alloc(64, (size_t)NT_MAX * K * TILE * 2); /* NT_MAX tiles' int16 weights */
#pragma omp for schedule(static) nowait
        for (int64_t t0 = 0; t0 < tiles; t0 += NT_MAX) {
            const int nt = tiles - t0 < NT_MAX ? (int)(tiles - t0) : NT_MAX;
            for (int n = 0; n < nt; n++)
                for (int64_t b = 0; b < blocks; b++) {
                    vi wv[16];
                    if (fmt == FMT_Q4) tq_unpack(FMT_Q4, w + ((t0 + n) * blocks + b) * bytes, wv);
                    else tq_unpack(FMT_Q8, w + ((t0 + n) * blocks + b) * bytes, wv);
                    for (int j = 0; j < 16; j++) _mm512_storeu_si512(buf + ((n * blocks + b) * 16 + j) * 32, wv[j]);
                }
#define BLOCK(H, R, T)                                                                                     \
    tq_tiles_buffered(H, buf, scale, offset, gshift, qx, dx, xs, K, N, t0, m0, R, T, bias, y, y_bf, ldy,        \
                      w + (t0 + nt) * blocks * bytes, m0 ? 0 : next_bytes)
#define BLOCK_T(R, T) (half ? BLOCK(1, R, T) : BLOCK(0, R, T))
#define BLOCK_R(R) (nt == 3 ? BLOCK_T(R, 3) : nt == 2 ? BLOCK_T(R, 2) : BLOCK_T(R, 1))
            /* the thread's next tiles (static: its range is contiguous), prefetched by its first rows */
            const int64_t after = tiles - t0 - nt, next_bytes = (after < NT_MAX ? after : NT_MAX) * blocks * bytes;
            int64_t m0 = 0;
            for (; m0 + MB <= M; m0 += MB) BLOCK_R(MB);
            switch (M - m0) {
            case 1: BLOCK_R(1); break;
            case 2: BLOCK_R(2); break;
            case 3: BLOCK_R(3); break;
            default: break;
            }
#undef BLOCK_R
#undef BLOCK_T
#undef BLOCK
        }
        free(buf);
    }
    free(qx);
    free(dx);
    free(xs);
}

/* The rows of W per tile: gpu_worker/quant.py tiles q4 and q8 weights where this is not 0. */
int wlinear_tile_rows(void) { return TILE; }
#else
int wlinear_tile_rows(void) { return 0; }
#endif
