/* Weight-only linears: y [M, N] = x [M, K] @ W^T (+ bias), with W stored compressed and x, y in
 * float32 or bf16; every sum in float32.
 *
 * Why: a decode step at small batch reads every weight once, so its time is the weights' bytes
 * over the memory bandwidth. GGUF files keep weights as 4- or 8-bit integers in groups with a
 * scale (and an offset); dequantized to float32 they take 4-8x the bytes. Here a weight is
 * expanded to float32 in registers, one block of output rows at a time, and never stored whole.
 *
 * Formats (gpu_worker/quant.py repacks GGUF blocks and quantizes checkpoints into them):
 *   q8    int8 q [N, K], float32 scale [N, K / G]:            W[n][k] = scale[n][k / G] * q[n][k]
 *         (GGUF Q8_0: G = 32; Q6_K: G = 16, q - 32 and d * sc folded), or with an offset
 *         [N, K / G] too: W = scale * q + offset (int8 quantized at load)
 *   q4    nibbles [N, K / 2], float32 scale, offset [N, K / G]: W[n][k] = scale * q + offset
 *         (q in 0..15; within each 32 k, byte j holds k = j in its low nibble and k = j + 16 in
 *         its high one, GGUF's order; G a multiple of 32. Q4_0: offset = -8 scale; Q4_1: the min;
 *         Q4_K: scale = d * sc, offset = -dmin * m)
 *   bf16  W [N, K] bf16 (a BF16 GGUF file's matrices)
 * Each expanded weight is bit for bit GGUF's own dequantization in float32 (scale * q is exact:
 * an fp16 scale times a small integer fits float32's 24 bits; the offset is added with one
 * rounding, as `d * q + m` does), so against a float32 matmul over the dequantized weights only
 * the order of the sums differs. Except at the levels with bf16 dot products (BF16_DOT below),
 * where bf16 activations multiply that weight rounded to bf16 (gpu_worker/quant.py's
 * QuantKernels.multiplied_weight says which weight a level multiplies).
 *
 * Shape of the work: threads split the output columns into blocks of NB rows of W. Against up
 * to MB rows of x (decode) a block's weights are expanded in registers as they stream by; against
 * more, once into a float32 buffer (L1/L2-resident) that each group of MB rows then reads. Either
 * way MB x NB accumulators stay in registers, 32 k per step. Batch invariance:
 * y[m][n] is one float32 accumulation over K in VW-wide lanes (pairs of k in each lane with bf16
 * dot products), in k order, then the lanes summed in a fixed tree, whatever M, whichever block or
 * thread: a row's result does not depend on the rows computed with it (the engine's pipelined and
 * blocking schedules batch rows differently).
 */
#include "quant.h"
#include "vec.h"

#define NB 4                     /* rows of W per block */
#define MB (VW == 16 ? 4 : 2)   /* rows of x per block: MB * NB accumulators (AVX2 has 16 registers) */

#define STEP 32         /* k per step: a q4 group's bytes hold 32 weights */
#define CHUNKS (STEP / VW)
#define PF_ROWS (2 * NB) /* prefetch distance; 1, 2, 4 and 8 blocks measured alike, none half as fast */

/* Streaming weights from memory: one thread's hardware prefetcher alone kept it at 3.5-5 GB/s
 * (an int8 head 49152 x 576 at one row: 7.1 ms without, 3.0-3.9 ms with, one thread). Ask for the
 * row PF_ROWS ahead (the same thread's next blocks: rows are contiguous) at this k. */
static inline __attribute__((always_inline)) void w_prefetch(const int fmt, const void *w, const float *scale,
                                                             const float *offset, int gshift, int64_t K, int64_t row,
                                                             int64_t k) {
    const int64_t at = (row + PF_ROWS) * K + k;
    __builtin_prefetch((const char *)w + (fmt == FMT_Q4 ? at / 2 : fmt == FMT_Q8 ? at : 2 * at));
    if (fmt != FMT_BF16 && (k & 511) == 0) { /* a line of float32 scales holds 16 groups: 512 k at G = 32 */
        __builtin_prefetch(scale + (at >> gshift));
        if (offset) __builtin_prefetch(offset + (at >> gshift));
    }
}

/* Lanes k .. k + STEP - 1 of row `row` of W in float32, as CHUNKS vectors (k a multiple of STEP,
 * and so is K: no tails). A group is G = 2^gshift weights (G divides K): its index is a
 * shift, not a division, in this innermost loop. */
static inline __attribute__((always_inline)) void w_step(const int fmt, const void *w, const float *scale,
                                                         const float *offset, int gshift, int64_t K, int64_t row,
                                                         int64_t k, vf out[CHUNKS]) {
    if (fmt == FMT_BF16) {
        for (int c = 0; c < CHUNKS; c++) out[c] = v_load((const bf16 *)w + row * K, k + c * VW, VW, 1);
        return;
    }
    if (fmt == FMT_Q8) {
        const int8_t *q = (const int8_t *)w + row * K + k;
        for (int c = 0; c < CHUNKS; c++) {
#if VW == 16
            const vf v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + c * 16))));
#elif VW == 8
            const vf v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + c * 8))));
#else
            float f[VW];
            for (int i = 0; i < VW; i++) f[i] = (float)q[c * VW + i];
            const vf v = v_load(f, 0, VW, 0);
#endif
            const int64_t g = (row * K + k + c * VW) >> gshift; /* Q6_K's groups of 16 change within a step */
            out[c] = offset ? v_fma(v, v_set(scale[g]), v_set(offset[g])) : v_mul(v, v_set(scale[g]));
        }
        return;
    }
    /* q4: the step's 16 bytes, k .. k + 15 in the low nibbles, k + 16 .. k + 31 in the high ones */
    const uint8_t *b = (const uint8_t *)w + (row * K + k) / 2;
    const int64_t g = (row * K + k) >> gshift;
    const vf s = v_set(scale[g]), o = v_set(offset[g]);
#if VW == 16
    /* The group's 16 values s * q + o, then each nibble looks its value up (vpermps reads the low 4
     * bits of an index): 2 ops fewer a step than masking and converting each half. */
    const vf values = v_fma(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s, o);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    out[0] = _mm512_permutexvar_ps(bytes, values);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
#elif VW == 8
    for (int h = 0; h < 2; h++) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 8 * h)));
        out[h] = v_fma(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))), s, o);
        out[2 + h] = v_fma(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), s, o);
    }
#else
    float f[STEP];
    for (int j = 0; j < 16; j++) {
        f[j] = (float)(b[j] & 15);
        f[16 + j] = (float)(b[j] >> 4);
    }
    for (int c = 0; c < CHUNKS; c++) out[c] = v_fma(v_load(f, c * VW, VW, 0), s, o);
#endif
}

#if VW == 16 && defined(__AVX512BF16__)
/* bf16 dot products (level avx512_bf16 and up, bf16 activations): vdpbf16ps multiplies 32 bf16
 * pairs into 16 float32 lanes, twice the float32 FMA's products per instruction (measured on Zen 4,
 * BENCHMARKS.md "Quantized weights on a CPU"). The weight's float32 expansion is rounded to bf16
 * (nearest even) first; the products are then exact and only the sums round, in float32. */
#define BF16_DOT 1
typedef __m512bh vbh;
static inline __attribute__((always_inline)) vbh w_step_bf16(const int fmt, const void *w, const float *scale,
                                                             const float *offset, int gshift, int64_t K, int64_t row,
                                                             int64_t k) {
    if (fmt == FMT_BF16) return (vbh)_mm512_loadu_si512((const bf16 *)w + row * K + k); /* already bf16 */
    vf wv[CHUNKS];
    w_step(fmt, w, scale, offset, gshift, K, row, k, wv);
    return _mm512_cvtne2ps_pbh(wv[1], wv[0]); /* k .. k + 15 in the low half, as in memory */
}
#else
#define BF16_DOT 0
#endif

/* The lane sums of MB * NB accumulators, acc[m * NB + n] -> sums[m * NB + n], each in one fixed
 * tree whatever its neighbours (see the top: batch invariance). MB * NB is a multiple of VW. */
static inline void sum_lanes(const vf *acc, float *sums) {
    for (int i = 0; i < MB * NB; i += VW) v_store(sums, i, VW, v_sums(acc + i), 0);
}

/* The block's sums (+ bias) -> y, rounded to y's type once. */
static inline __attribute__((always_inline)) void store_block(const vf *acc, int64_t m0, const int MBC, int64_t n0,
                                                              int64_t nb, const float *bias, void *y, int y_bf,
                                                              int64_t ldy) {
    float sums[MB * NB];
    sum_lanes(acc, sums);
    for (int64_t m = 0; m < MBC; m++)
        for (int64_t n = 0; n < nb; n++) {
            const float v = sums[m * NB + n] + (bias ? bias[n0 + n] : 0.f);
            const int64_t at = (m0 + m) * ldy + n0 + n;
            if (y_bf) ((bf16 *)y)[at] = f2bf(v);
            else ((float *)y)[at] = v;
        }
}

/* x rows m0 .. m0 + MBC - 1 (MBC <= MB, a literal at each call) times W's rows n0 .. n0 + nb - 1,
 * read from the expanded block `buf` [NB][K] or, where buf is NULL, expanded in registers as
 * they are used -> y (+ bias), rounded to y's type once. */
static inline __attribute__((always_inline)) void multiply_block(
    const int fmt, const void *w, const float *scale, const float *offset, int gshift, const int from_buf,
    const void *buf, const void *x, const int x_bf, int64_t K, int64_t m0, const int MBC, int64_t n0, int64_t nb,
    const float *bias, void *y, int y_bf, int64_t ldy) {
    vf acc[MB * NB];
    for (int i = 0; i < MB * NB; i++) acc[i] = v_set(0.f);
    const size_t x_el = x_bf ? 2 : 4;
    int64_t rows[NB];
    for (int n = 0; n < NB; n++) rows[n] = n0 + (n < nb ? n : 0);
#if BF16_DOT
    if (x_bf) { /* a literal at every call: this loop or the float32 one below */
        for (int64_t k = 0; k < K; k += STEP) {
            vbh xv[MB];
            for (int m = 0; m < MBC; m++) xv[m] = (vbh)_mm512_loadu_si512((const bf16 *)x + (m0 + m) * K + k);
            for (int n = 0; n < NB; n++) {
                if (!from_buf) w_prefetch(fmt, w, scale, offset, gshift, K, rows[n], k);
                const vbh wv = from_buf ? (vbh)_mm512_loadu_si512((const bf16 *)buf + n * K + k)
                                        : w_step_bf16(fmt, w, scale, offset, gshift, K, rows[n], k);
                for (int m = 0; m < MBC; m++) acc[m * NB + n] = _mm512_dpbf16_ps(acc[m * NB + n], xv[m], wv);
            }
        }
        store_block(acc, m0, MBC, n0, nb, bias, y, y_bf, ldy);
        return;
    }
#endif
    for (int64_t k = 0; k < K; k += STEP) {
        vf xv[MB][CHUNKS];
        for (int m = 0; m < MBC; m++)
            for (int c = 0; c < CHUNKS; c++) xv[m][c] = v_load((const char *)x + (m0 + m) * K * x_el, k + c * VW, VW, x_bf);
        for (int n = 0; n < NB; n++) {
            vf wv[CHUNKS];
            if (from_buf) /* a literal: two copies of this loop, each with one source */
                for (int c = 0; c < CHUNKS; c++) wv[c] = v_load((const float *)buf + n * K, k + c * VW, VW, 0);
            else {
                w_prefetch(fmt, w, scale, offset, gshift, K, rows[n], k);
                w_step(fmt, w, scale, offset, gshift, K, rows[n], k, wv);
            }
            for (int c = 0; c < CHUNKS; c++) /* in k order: a lane's sum does not depend on the blocking */
                for (int m = 0; m < MBC; m++) acc[m * NB + n] = v_fma(xv[m][c], wv[c], acc[m * NB + n]);
        }
    }
    store_block(acc, m0, MBC, n0, nb, bias, y, y_bf, ldy);
}

/* One block of NB rows of W against all M rows of x (see the top: streamed up to MB rows, else
 * expanded into `buf` once). */
static inline __attribute__((always_inline)) void block_rows(
    const int fmt, const void *w, const float *scale, const float *offset, int gshift, void *buf, const void *x,
    const int x_bf, int64_t K, int64_t M, int64_t n0, int64_t nb, const float *bias, void *y, int y_bf,
    int64_t ldy) {
    if (M > MB) {
        for (int64_t r = 0; r < NB; r++)
            for (int64_t k = 0; k < K; k += STEP) {
                const int64_t row = n0 + (r < nb ? r : 0);
#if BF16_DOT
                if (x_bf) { /* the bf16 dot products' buffer: the weights rounded to bf16 */
                    _mm512_storeu_si512((bf16 *)buf + r * K + k,
                                        (__m512i)w_step_bf16(fmt, w, scale, offset, gshift, K, row, k));
                    continue;
                }
#endif
                vf wv[CHUNKS];
                w_step(fmt, w, scale, offset, gshift, K, row, k, wv);
                for (int c = 0; c < CHUNKS; c++) v_store((float *)buf + r * K, k + c * VW, VW, wv[c], 0);
            }
    } else {
        buf = NULL;
    }
#define ROWS(B, R) multiply_block(fmt, w, scale, offset, gshift, B, buf, x, x_bf, K, m0, R, n0, nb, bias, y, y_bf, ldy)
    int64_t m0 = 0;
    if (buf) {
        for (; m0 + MB <= M; m0 += MB) ROWS(1, MB);
    } else if (M == MB) {
        ROWS(0, MB);
        m0 = MB;
    }
    switch (M - m0) { /* the last rows, with as many accumulators as they need */
    case 1: buf ? ROWS(1, 1) : ROWS(0, 1); break;
#if MB > 2
    case 2: buf ? ROWS(1, 2) : ROWS(0, 2); break;
    case 3: buf ? ROWS(1, 3) : ROWS(0, 3); break;
#endif
    default: break;
    }
#undef ROWS
}

/* y [M, ldy] columns 0 .. N - 1 = x [M, K] @ W^T + bias (float32, may be NULL). x_bf, y_bf: bf16
 * (else float32). fmt: FMT_*; for q8 and q4, scale (and offset) [N, K / G], G a power of two >= 16
 * dividing K. K a multiple of 32 for every format (quant.py checks). */
void wlinear(int fmt, const void *x, int x_bf, const void *w, const float *scale, const float *offset, int64_t G,
             const float *bias, void *y, int y_bf, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
#if VW == 16
    if ((fmt & ~FMT_HALF) == FMT_T4 || (fmt & ~FMT_HALF) == FMT_T8) {
        tlinear(fmt, x, x_bf, w, scale, offset, G, bias, y, y_bf, ldy, M, K, N, nthreads);
        return;
    }
#endif
    const int64_t blocks = (N + NB - 1) / NB;
    const int gshift = G > 0 ? __builtin_ctzll((unsigned long long)G) : 0; /* G: a power of two */
    if (M * N * K < (1 << 15)) nthreads = 1; /* a parallel region costs more than it saves */
#pragma omp parallel num_threads(nthreads)
    {
        void *buf = M > MB ? aligned_alloc(64, (size_t)(NB * K * 4 + 63) / 64 * 64) : NULL;
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t n0 = blk * NB, nb = N - n0 < NB ? N - n0 : NB;
#define BLOCK(F, XB) block_rows(F, w, scale, offset, gshift, buf, x, XB, K, M, n0, nb, bias, y, y_bf, ldy)
            /* one specialised copy per format and x type: the branches leave the inner loop */
            if (fmt == FMT_Q8) x_bf ? BLOCK(FMT_Q8, 1) : BLOCK(FMT_Q8, 0);
            else if (fmt == FMT_Q4) x_bf ? BLOCK(FMT_Q4, 1) : BLOCK(FMT_Q4, 0);
            else x_bf ? BLOCK(FMT_BF16, 1) : BLOCK(FMT_BF16, 0);
#undef BLOCK
        }
        free(buf);
    }
}

/* Whether wlinear multiplies bf16 activations by the weights rounded to bf16 (BF16_DOT, above). */
int wlinear_bf16_dot(void) { return BF16_DOT; }

/* The rows `ids` of a table [rows, K] in any format (an embedding), expanded to float32 -> out [n, K]. */
void wgather(int fmt, const void *w, const float *scale, const float *offset, int64_t G, int64_t K,
             const int64_t *ids, int64_t n, float *out) {
    const int gshift = G > 0 ? __builtin_ctzll((unsigned long long)G) : 0;
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < K; k += STEP) {
            vf wv[CHUNKS];
            if (fmt == FMT_Q8) w_step(FMT_Q8, w, scale, offset, gshift, K, ids[i], k, wv);
            else if (fmt == FMT_Q4) w_step(FMT_Q4, w, scale, offset, gshift, K, ids[i], k, wv);
            else w_step(FMT_BF16, w, scale, offset, gshift, K, ids[i], k, wv);
            for (int c = 0; c < CHUNKS; c++) v_store(out + i * K, k + c * VW, VW, wv[c], 0);
        }
}
