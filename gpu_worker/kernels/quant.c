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
 *   bf16  W [N, K] bf16 (CPUs without AMX: oneDNN's bf16 path needs AVX-512)
 * Each expanded weight is bit for bit GGUF's own dequantization in float32 (scale * q is exact:
 * an fp16 scale times a small integer fits float32's 24 bits; the offset is added with one
 * rounding, as `d * q + m` does), so against a float32 matmul over the dequantized weights only
 * the order of the sums differs.
 *
 * Shape of the work: threads split the output columns into blocks of NB rows of W; a thread
 * expands its block's NB rows into a float32 buffer (L1/L2-resident), then multiplies every row
 * of x by it, MB rows of x at a time with MB x NB accumulators in registers. Batch invariance:
 * y[m][n] is one float32 accumulation over K in VW-wide lanes, in k order, then the lanes summed
 * in a fixed tree, whatever M, whichever block or thread: a row's result does not depend on the
 * rows computed with it (the engine's pipelined and blocking schedules batch rows differently).
 */
#include "vec.h"

#define NB 4                     /* rows of W per block */
#define MB (VW == 16 ? 4 : 2)   /* rows of x per block: MB * NB accumulators (AVX2 has 16 registers) */

enum { FMT_Q8 = 0, FMT_Q4 = 1, FMT_BF16 = 2 };

/* Lanes k .. k + VW - 1 of row `row` of W in float32 (q8, q4: k a multiple of VW; bf16: a tail
 * past K reads zeros). */
static inline __attribute__((always_inline)) vf w_chunk(const int fmt, const void *w, const float *scale,
                                                        const float *offset, int64_t G, int64_t K, int64_t row,
                                                        int64_t k) {
    if (fmt == FMT_BF16) return v_load((const bf16 *)w + row * K, k, K - k, 1);
    const int64_t g = row * ((K + G - 1) / G) + k / G;
    if (fmt == FMT_Q8) {
        const int8_t *q = (const int8_t *)w + row * K + k;
#if VW == 16
        const vf v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
#elif VW == 8
        const vf v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#else
        float f[VW];
        for (int i = 0; i < VW; i++) f[i] = (float)q[i];
        const vf v = v_load(f, 0, VW, 0);
#endif
        return offset ? v_fma(v, v_set(scale[g]), v_set(offset[g])) : v_mul(v, v_set(scale[g]));
    }
    /* q4: within the 32 k of a group of bytes, k % 32 < 16 are the low nibbles */
    const int64_t in32 = k % 32, lo = in32 < 16;
    const uint8_t *b = (const uint8_t *)w + row * K / 2 + k / 32 * 16 + (lo ? in32 : in32 - 16);
#if VW == 16
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    const vf q = _mm512_cvtepi32_ps(lo ? _mm512_and_si512(bytes, _mm512_set1_epi32(15)) : _mm512_srli_epi32(bytes, 4));
#elif VW == 8
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b));
    const vf q = _mm256_cvtepi32_ps(lo ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4));
#else
    float f[VW];
    for (int i = 0; i < VW; i++) f[i] = (float)(lo ? b[i] & 15 : b[i] >> 4);
    const vf q = v_load(f, 0, VW, 0);
#endif
    return v_fma(q, v_set(scale[g]), v_set(offset[g]));
}

/* The lane sums of MB * NB accumulators, acc[m * NB + n] -> sums[m * NB + n], each in one fixed
 * tree whatever its neighbours (see the top: batch invariance). MB * NB is a multiple of VW. */
static inline void sum_lanes(const vf *acc, float *sums) {
    for (int i = 0; i < MB * NB; i += VW) v_store(sums, i, VW, v_sums(acc + i), 0);
}

/* x rows m0 .. m0 + MBC - 1 (MBC <= MB, a literal at each call) times W's rows n0 .. n0 + nb - 1,
 * read from the expanded block `buf` [NB][Kp] or, where buf is NULL, expanded in registers as
 * they are used -> y (+ bias), rounded to y's type once. */
static inline __attribute__((always_inline)) void multiply_block(
    const int fmt, const void *w, const float *scale, const float *offset, int64_t G, const float *buf,
    const void *x, const int x_bf, int64_t K, int64_t Kp, int64_t m0, const int MBC, int64_t n0, int64_t nb,
    const float *bias, void *y, int y_bf, int64_t ldy) {
    vf acc[MB * NB];
    for (int i = 0; i < MB * NB; i++) acc[i] = v_set(0.f);
    const size_t x_el = x_bf ? 2 : 4;
    int64_t rows[NB];
    for (int n = 0; n < NB; n++) rows[n] = n0 + (n < nb ? n : 0);
    for (int64_t k = 0; k < Kp; k += VW) {
        vf wv[NB];
        for (int n = 0; n < NB; n++)
            wv[n] = buf ? v_load(buf + n * Kp, k, VW, 0) : w_chunk(fmt, w, scale, offset, G, K, rows[n], k);
        for (int m = 0; m < MBC; m++) {
            const vf xv = v_load((const char *)x + (m0 + m) * K * x_el, k, K - k, x_bf); /* past K: zeros */
            for (int n = 0; n < NB; n++) acc[m * NB + n] = v_fma(xv, wv[n], acc[m * NB + n]);
        }
    }
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

/* One block of NB rows of W against all M rows of x. Up to MB rows the weights are expanded in
 * registers as they stream by (read once: decode); past that, once into `buf` and reused by each
 * group of MB rows (prefill, many streams). */
static inline __attribute__((always_inline)) void block_rows(
    const int fmt, const void *w, const float *scale, const float *offset, int64_t G, float *buf, const void *x,
    const int x_bf, int64_t K, int64_t Kp, int64_t M, int64_t n0, int64_t nb, const float *bias, void *y, int y_bf,
    int64_t ldy) {
    if (M > MB) {
        for (int64_t r = 0; r < NB; r++)
            for (int64_t k = 0; k < Kp; k += VW)
                v_store(buf + r * Kp, k, VW, w_chunk(fmt, w, scale, offset, G, K, n0 + (r < nb ? r : 0), k), 0);
    } else {
        buf = NULL;
    }
    int64_t m0 = 0;
    for (; m0 + MB <= M; m0 += MB)
        multiply_block(fmt, w, scale, offset, G, buf, x, x_bf, K, Kp, m0, MB, n0, nb, bias, y, y_bf, ldy);
    switch (M - m0) { /* the last rows, with as many accumulators as they need */
    case 1: multiply_block(fmt, w, scale, offset, G, buf, x, x_bf, K, Kp, m0, 1, n0, nb, bias, y, y_bf, ldy); break;
#if MB > 2
    case 2: multiply_block(fmt, w, scale, offset, G, buf, x, x_bf, K, Kp, m0, 2, n0, nb, bias, y, y_bf, ldy); break;
    case 3: multiply_block(fmt, w, scale, offset, G, buf, x, x_bf, K, Kp, m0, 3, n0, nb, bias, y, y_bf, ldy); break;
#endif
    default: break;
    }
}

/* y [M, ldy] columns 0 .. N - 1 = x [M, K] @ W^T + bias (float32, may be NULL). x_bf, y_bf: bf16
 * (else float32). fmt: FMT_*; for q8 and q4, scale (and offset) [N, ceil(K / G)], K a multiple of
 * 32. */
void wlinear(int fmt, const void *x, int x_bf, const void *w, const float *scale, const float *offset, int64_t G,
             const float *bias, void *y, int y_bf, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads) {
    const int64_t Kp = (K + VW - 1) / VW * VW, blocks = (N + NB - 1) / NB;
    if (M * N * K < (1 << 15)) nthreads = 1; /* a parallel region costs more than it saves */
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = M > MB ? aligned_alloc(64, (size_t)(NB * Kp * 4 + 63) / 64 * 64) : NULL;
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t n0 = blk * NB, nb = N - n0 < NB ? N - n0 : NB;
#define BLOCK(F, XB) block_rows(F, w, scale, offset, G, buf, x, XB, K, Kp, M, n0, nb, bias, y, y_bf, ldy)
            /* one specialised copy per format and x type: the branches leave the inner loop */
            if (fmt == FMT_Q8) x_bf ? BLOCK(FMT_Q8, 1) : BLOCK(FMT_Q8, 0);
            else if (fmt == FMT_Q4) x_bf ? BLOCK(FMT_Q4, 1) : BLOCK(FMT_Q4, 0);
            else x_bf ? BLOCK(FMT_BF16, 1) : BLOCK(FMT_BF16, 0);
#undef BLOCK
        }
        free(buf);
    }
}

/* The rows `ids` of a q8 or q4 table [rows, K] (an embedding), expanded to float32 -> out [n, K]. */
void wgather(int fmt, const void *w, const float *scale, const float *offset, int64_t G, int64_t K,
             const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < K; k += VW)
            v_store(out + i * K, k, VW, fmt == FMT_Q8 ? w_chunk(FMT_Q8, w, scale, offset, G, K, ids[i], k)
                                                      : w_chunk(FMT_Q4, w, scale, offset, G, K, ids[i], k), 0);
}
