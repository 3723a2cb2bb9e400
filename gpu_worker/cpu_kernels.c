/* Fused CPU kernels of the Llama decoder layer.
 *
 * Built once per machine by gpu_worker/cpu_kernels.py (cc -O3 -march=native
 * -fopenmp) and called through ctypes on raw pointers of contiguous tensors.
 * Eager PyTorch spends ~100 small ops per layer around the four matmuls (norms,
 * rope, the page gather, SDPA's mask, silu); here they are five calls:
 *
 *   add_rmsnorm   x += y (optional); h = rmsnorm(x) * w
 *   rope_kv       rope on q and k of the fused qkv row; k, v written into their page slots
 *   attention     each query token attends over its sequence's pages in place (no gather copy, no mask)
 *   silu_mul      silu(gate) * up
 *
 * and, where the CPU has AMX, the matmuls and the whole loop over the layers:
 *
 *   linear_bf16   y = x @ W^T (+ bias) on AMX tiles, each row's result independent of the batch
 *                 (linear_gelu_bf16: then gelu_tanh, on the float32 sum)
 *   layers_bf16   every decoder layer, the calls above in the Python loop's order, in one call
 *
 * Rounding follows the eager bf16 path op by op (each bf16 op of PyTorch computes
 * in float32 and rounds its result), so the two agree to a few bf16 ulps; in
 * float32 they agree to float32 rounding (tests/test_cpu_kernels.py).
 *
 * Each kernel is written once over `void *` data and an `is_bf16` flag; the exported
 * `<name>_bf16` / `<name>_f32` wrappers pass a constant, so gcc inlines and
 * vectorizes a branch-free loop per element type.
 *
 * Threads: the OpenMP runtime is the one torch loaded (same soname, loaded
 * once), and every parallel region is sized by the caller (torch's intra-op
 * thread count), so these kernels and torch's matmuls share one thread team.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf2f(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays NaN. Branch-free
 * (a select, not a jump), so loops over it vectorize. */
static inline bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}


/* The vector layer: every kernel below is written once over `vf`, VW float32 lanes, where a
 * load/store takes `n` elements (the tail of a row when n < VW) of bf16 or float32 memory.
 * With AVX-512 a vf is a __m512; elsewhere VW is 1 and vf a float (portable, slow). gcc does
 * not reliably vectorize loops that mix bf16 bit tricks with float math, hence the intrinsics. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline __mmask16 tail(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline vf v_load(const void *p, int64_t i, int64_t n, int bf) {
    if (bf) {
        const __m256i h = _mm256_maskz_loadu_epi16(tail(n), (const bf16 *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(tail(n), (const float *)p + i);
}
/* float -> bf16 bits (low half of each lane), rounded to nearest even; NaN stays NaN. */
static inline __m512i v_bf16_bits(vf v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), hi, _mm512_set1_epi32(0x40));
}
static inline vf v_round(vf v, int bf) {
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(v_bf16_bits(v), 16)) : v;
}
static inline void v_store(void *p, int64_t i, int64_t n, vf v, int bf) {
    if (bf) _mm256_mask_storeu_epi16((bf16 *)p + i, tail(n), _mm512_cvtepi32_epi16(v_bf16_bits(v)));
    else _mm512_mask_storeu_ps((float *)p + i, tail(n), v);
}
static inline vf v_set(float x) { return _mm512_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf v_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline float v_sum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf v_pow2i(vf n) { /* 2^n for integral n >= -126 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
#define VW 1
typedef float vf;
static inline vf v_load(const void *p, int64_t i, int64_t n, int bf) {
    (void)n;
    return bf ? bf2f(((const bf16 *)p)[i]) : ((const float *)p)[i];
}
static inline vf v_round(vf v, int bf) { return bf ? bf2f(f2bf(v)) : v; }
static inline void v_store(void *p, int64_t i, int64_t n, vf v, int bf) {
    (void)n;
    if (bf) ((bf16 *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}
static inline vf v_set(float x) { return x; }
static inline vf v_add(vf a, vf b) { return a + b; }
static inline vf v_sub(vf a, vf b) { return a - b; }
static inline vf v_mul(vf a, vf b) { return a * b; }
static inline vf v_div(vf a, vf b) { return a / b; }
static inline vf v_fma(vf a, vf b, vf c) { return fmaf(a, b, c); }
static inline vf v_max(vf a, vf b) { return a > b ? a : b; }
static inline vf v_min(vf a, vf b) { return a < b ? a : b; }
static inline float v_sum(vf a) { return a; }
static inline vf v_pow2i(vf n) {
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

#if VW == 16
/* The lane sums of sixteen vectors, in order: lane j of the result is the sum of d[j]'s lanes.
 * Four rounds of pairwise shuffles and adds (unpack 32-bit, unpack 64-bit, then 128-bit lanes
 * twice): 30 shuffles for sixteen sums, where sixteen separate reductions take 64. */
static inline vf hsum16(const vf d[16]) {
    __m512 e[8], f[4], g[2];
    for (int i = 0; i < 8; i++)
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(e[2 * i]), b = _mm512_castps_pd(e[2 * i + 1]);
        f[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)
        g[i] = _mm512_add_ps(_mm512_shuffle_f32x4(f[2 * i], f[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(f[2 * i], f[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(g[0], g[1], 0x88), _mm512_shuffle_f32x4(g[0], g[1], 0xdd));
}
#endif

/* exp(x) in float32 to about 1 ulp (Cephes' polynomial; torch's vectorised exp, Sleef's, is
 * also ~1 ulp). Inputs are clamped to [-87, 88]: below, the result is 2^-126 * e^(...) ~ 1e-38,
 * which a softmax or silu then treats as the zero it is. */
static inline vf v_exp(vf x) {
    x = v_min(v_max(x, v_set(-87.f)), v_set(88.f));
    const vf n = v_sub(v_add(v_mul(x, v_set(1.44269504089f)), v_set(12582912.f)), v_set(12582912.f));
    const vf r = v_fma(n, v_set(2.12194440e-4f), v_fma(n, v_set(-0.693359375f), x));
    vf p = v_set(1.9875691500e-4f);
    p = v_fma(p, r, v_set(1.3981999507e-3f));
    p = v_fma(p, r, v_set(8.3334519073e-3f));
    p = v_fma(p, r, v_set(4.1665795894e-2f));
    p = v_fma(p, r, v_set(1.6666665459e-1f));
    p = v_fma(p, r, v_set(5.0000001201e-1f));
    p = v_add(v_fma(v_mul(p, r), r, r), v_set(1.f));
    return v_mul(p, v_pow2i(n));
}

/* gelu with tanh's approximation (transformers' gelu_pytorch_tanh, Moondream's MLPs) in float32:
 * 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), written as x / (1 + exp(-2u)), the
 * same function without 1 + tanh(u)'s cancellation where tanh(u) is near -1. */
static inline vf v_gelu_tanh(vf x) {
    const vf u = v_mul(v_set(0.7978845608f), v_fma(v_mul(v_set(0.044715f), x), v_mul(x, x), x));
    return v_div(x, v_add(v_set(1.f), v_exp(v_mul(v_set(-2.f), u))));
}

/* Work below this many elements runs on the calling thread alone: a parallel region costs more
 * than it saves there (4096: a 32-row norm or silu splits, a 1-row one does not; 1.04-1.10x per
 * 32-stream step over 65536, BENCHMARKS.md "Session 7"). */
#define PAR_MIN 4096

/* OpenMP outlines a parallel loop's body before the `is_bf16` constant reaches it, so each loop
 * calls a per-row function with a literal flag (`bf ? row(.., 1) : row(.., 0)`): two
 * specialised copies. */
#define SPECIALISE(bf, call_with) ((bf) ? call_with(1) : call_with(0))

/* One row: x += y (if y), rounded as the eager add; h = rmsnorm(x) * w, as transformers:
 * normalise in float32, round, then multiply by the weight. */
static inline void add_rmsnorm_row(void *xr, const void *yr, const void *w, void *hr, int64_t dim, float eps,
                                   int bf) {
    vf ss = v_set(0.f);
    for (int64_t i = 0; i < dim; i += VW) {
        vf v = v_load(xr, i, dim - i, bf);
        if (yr) {
            v = v_round(v_add(v, v_load(yr, i, dim - i, bf)), bf);
            v_store(xr, i, dim - i, v, bf);
        }
        ss = v_fma(v, v, ss);
    }
    const vf scale = v_set(1.f / sqrtf(v_sum(ss) / (float)dim + eps));
    for (int64_t i = 0; i < dim; i += VW) {
        const vf normed = v_round(v_mul(v_load(xr, i, dim - i, bf), scale), bf);
        v_store(hr, i, dim - i, v_mul(v_load(w, i, dim - i, bf), normed), bf);
    }
}

static void add_rmsnorm(void *x, const void *y, const void *w, void *h, int64_t rows, int64_t dim, float eps,
                        int nthreads, int bf) {
    const size_t el = bf ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) if (rows * dim >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const size_t at = r * dim * el;
#define ROW(B) add_rmsnorm_row((char *)x + at, y ? (const char *)y + at : NULL, w, (char *)h + at, dim, eps, B)
        SPECIALISE(bf, ROW);
#undef ROW
    }
}

/* One token of qkv [(heads + 2 kv_heads) * head_dim]: rotary (the half-split layout) on its q and
 * k heads from the float32 tables' rows ct, st [head_dim / 2], rounded to the element type first
 * as the eager path does; q -> q_out [heads, head_dim], k -> k_dst, v -> v_dst [kv_heads, head_dim]. */
static inline void rope_kv_row(const char *src, const float *ct, const float *st, char *q_out, char *k_dst,
                               char *v_dst, int64_t heads, int64_t kv_heads, int64_t head_dim, int bf) {
    const size_t el = bf ? 2 : 4;
    const int64_t half = head_dim / 2;
    for (int64_t hh = 0; hh < heads + kv_heads; hh++) {
        const char *x = src + hh * head_dim * el;
        char *dst = hh < heads ? q_out + hh * head_dim * el : k_dst + (hh - heads) * head_dim * el;
        for (int64_t i = 0; i < half; i += VW) {
            const int64_t n = half - i;
            const vf c = v_round(v_load(ct, i, n, 0), bf), s = v_round(v_load(st, i, n, 0), bf);
            const vf x1 = v_load(x, i, n, bf), x2 = v_load(x, i + half, n, bf);
            v_store(dst, i, n, v_sub(v_round(v_mul(x1, c), bf), v_round(v_mul(x2, s), bf)), bf);
            v_store(dst, i + half, n, v_add(v_round(v_mul(x2, c), bf), v_round(v_mul(x1, s), bf)), bf);
        }
    }
    memcpy(v_dst, src + (heads + kv_heads) * head_dim * el, kv_heads * head_dim * el);
}

/* qkv [tokens, (heads + 2 kv_heads) * head_dim] at positions pos[t]; k and v go to cache slots[t]. */
static void rope_kv(const void *qkv, const float *cos_table, const float *sin_table, const int64_t *pos,
                    const int64_t *slots, void *k_cache, void *v_cache, void *q_out, int64_t tokens, int64_t heads,
                    int64_t kv_heads, int64_t head_dim, int nthreads, int bf) {
    const size_t el = bf ? 2 : 4;
    const int64_t half = head_dim / 2, row = (heads + 2 * kv_heads) * head_dim, kv_row = kv_heads * head_dim;
#pragma omp parallel for num_threads(nthreads) if (tokens * row >= PAR_MIN)
    for (int64_t t = 0; t < tokens; t++) {
#define ROW(B)                                                                                                    \
    rope_kv_row((const char *)qkv + t * row * el, cos_table + pos[t] * half, sin_table + pos[t] * half,           \
                (char *)q_out + t * heads * head_dim * el, (char *)k_cache + slots[t] * kv_row * el,              \
                (char *)v_cache + slots[t] * kv_row * el, heads, kv_heads, head_dim, B)
        SPECIALISE(bf, ROW);
#undef ROW
    }
}

/* The addresses of a sequence's next nb keys (or values) of kv head kh in a cache [pages,
 * page_size, kv_heads, D] (rows of row_bytes), walking its page table: (*page, *off) is where the
 * next one is, and is moved past them. */
static inline void walk_pages(const char *cache, const int64_t *table, int64_t page_size, int64_t kv_heads,
                              int64_t kh, size_t row_bytes, int64_t nb, int64_t *page, int64_t *off,
                              const char **out) {
    for (int64_t jj = 0; jj < nb; jj++) {
        out[jj] = cache + ((table[*page] * page_size + *off) * kv_heads + kh) * row_bytes;
        if (++*off == page_size) {
            *off = 0;
            ++*page;
        }
    }
}

/* One (token, kv head): its group of query heads qt [group, D] over the keys 0 .. len - 1 of its
 * sequence, key j in page table[j / page_size] of the caches [pages, page_size, kv_heads, D]:
 * scores, softmax, then the weighted values -> ot [group, D]. scratch: group * max_len floats. */
static inline void attention_item(const char *qt, const char *k_cache, const char *v_cache, const int64_t *table,
                                  int64_t page_size, int64_t len, int64_t kh, int64_t kv_heads, int64_t group,
                                  int64_t D, int64_t max_len, float *scratch, char *ot, int bf) {
    const size_t el = bf ? 2 : 4, key_stride = kv_heads * D * el;
    const int64_t chunks = (D + VW - 1) / VW;
    const vf scale = v_set(1.f / sqrtf((float)D));
    float *scores = scratch;
    vf qv[group * chunks], acc[group * chunks];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) qv[g * chunks + c] = v_mul(v_load(qt, g * D + c * VW, D - c * VW, bf), scale);
    float mx[group];
    for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
    /* Pass 1: the scores. */
#if VW == 16
    /* Sixteen keys at a time: per query head, sixteen dot-product vectors, summed across their lanes
     * together (hsum16) instead of one horizontal reduction per key. */
    int64_t page = 0, off = 0;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t nb = len - j0 < 16 ? len - j0 : 16;
        const char *kp[16];
        walk_pages(k_cache, table, page_size, kv_heads, kh, D * el, nb, &page, &off, kp);
        for (int64_t g = 0; g < group; g++) {
            vf dots[16];
            for (int64_t jj = 0; jj < 16; jj++) {
                dots[jj] = v_set(0.f);
                if (jj < nb)
                    for (int64_t c = 0; c < chunks; c++)
                        dots[jj] = v_fma(qv[g * chunks + c], v_load(kp[jj], c * VW, D - c * VW, bf), dots[jj]);
            }
            const vf s = hsum16(dots);
            v_store(scores + g * max_len, j0, nb, s, 0);
            const float m = _mm512_mask_reduce_max_ps(tail(nb), s);
            mx[g] = m > mx[g] ? m : mx[g];
        }
    }
#else
    for (int64_t first = 0; first < len; first += page_size) {
        const char *k = k_cache + (table[first / page_size] * page_size * kv_heads + kh) * D * el;
        const int64_t in_page = len - first < page_size ? len - first : page_size;
        for (int64_t j = first; j < first + in_page; j++, k += key_stride) {
            for (int64_t g = 0; g < group; g++) {
                float s = 0.f;
                for (int64_t d = 0; d < D; d++) s += qv[g * chunks + d] * v_load(k, d, 1, bf);
                scores[g * max_len + j] = s;
                mx[g] = s > mx[g] ? s : mx[g];
            }
        }
    }
#endif
    /* Softmax per query head (exp vectorised; the tail's lanes are never stored). */
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * max_len, total = 0.f;
        for (int64_t j = 0; j < len; j += VW) v_store(sg, j, len - j, v_exp(v_sub(v_load(sg, j, len - j, 0), v_set(mx[g]))), 0);
        for (int64_t j = 0; j < len; j++) total += sg[j];
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; j++) sg[j] *= inv;
    }
    /* Pass 2: the probability-weighted values, accumulated in registers. */
    for (int64_t i = 0; i < group * chunks; i++) acc[i] = v_set(0.f);
    for (int64_t first = 0; first < len; first += page_size) {
        const char *v = v_cache + (table[first / page_size] * page_size * kv_heads + kh) * D * el;
        const int64_t in_page = len - first < page_size ? len - first : page_size;
        for (int64_t j = first; j < first + in_page; j++, v += key_stride)
            for (int64_t c = 0; c < chunks; c++) {
                const vf vc = v_load(v, c * VW, D - c * VW, bf);
                for (int64_t g = 0; g < group; g++)
                    acc[g * chunks + c] = v_fma(v_set(scores[g * max_len + j]), vc, acc[g * chunks + c]);
            }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) v_store(ot, g * D + c * VW, D - c * VW, acc[g * chunks + c], bf);
}

#if VW == 16
/* attention_item for head_dim = 16 * CH, CH a literal at the call (always inlined): the loops over
 * a head's vectors unroll, the sixteen dot products and the value accumulators stay in registers
 * (with a run-time D they lived on the stack: 1.5x slower, the kernel alone at 32 sequences). The
 * same math in the same order as attention_item, so the two agree bit for bit. */
static inline __attribute__((always_inline)) void attention_item_fixed(
    const char *qt, const char *k_cache, const char *v_cache, const int64_t *table, int64_t page_size, int64_t len,
    int64_t kh, int64_t kv_heads, int64_t group, int64_t max_len, float *scores, char *ot, int bf, const int CH) {
    const int64_t D = 16 * CH;
    const size_t el = bf ? 2 : 4;
    const vf scale = v_set(1.f / sqrtf((float)D));
    vf qv[8 * 8], keys[16 * 8], acc[8 * 8]; /* group <= 8 (checked by the caller), CH <= 8 */
    float mx[8];
    for (int64_t g = 0; g < group; g++) {
        for (int c = 0; c < CH; c++) qv[g * CH + c] = v_mul(v_load(qt, g * D + c * 16, 16, bf), scale);
        mx[g] = -INFINITY;
    }
    /* Pass 1: the scores, sixteen keys at a time; a short last block repeats its last key. */
    int64_t page = 0, off = 0;
    const char *kp[16];
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t nb = len - j0 < 16 ? len - j0 : 16;
        walk_pages(k_cache, table, page_size, kv_heads, kh, D * el, nb, &page, &off, kp);
        for (int64_t jj = nb; jj < 16; jj++) kp[jj] = kp[nb - 1];
        /* The block's keys in float32 once (exact), not once per query head. */
        for (int jj = 0; jj < 16; jj++)
            for (int c = 0; c < CH; c++) keys[jj * CH + c] = v_load(kp[jj], c * 16, 16, bf);
        for (int64_t g = 0; g < group; g++) {
            vf dots[16];
            for (int jj = 0; jj < 16; jj++) {
                dots[jj] = v_set(0.f);
                for (int c = 0; c < CH; c++) dots[jj] = v_fma(qv[g * CH + c], keys[jj * CH + c], dots[jj]);
            }
            const vf sv = hsum16(dots);
            v_store(scores + g * max_len, j0, nb, sv, 0);
            const float m = _mm512_mask_reduce_max_ps(tail(nb), sv);
            mx[g] = m > mx[g] ? m : mx[g];
        }
    }
    /* Softmax per query head. */
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * max_len, total = 0.f;
        for (int64_t j = 0; j < len; j += 16) v_store(sg, j, len - j, v_exp(v_sub(v_load(sg, j, len - j, 0), v_set(mx[g]))), 0);
        for (int64_t j = 0; j < len; j++) total += sg[j];
        const float inv = 1.f / total;
        for (int64_t j = 0; j < len; j++) sg[j] *= inv;
        for (int c = 0; c < CH; c++) acc[g * CH + c] = v_set(0.f);
    }
    /* Pass 2: the weighted values, sixteen keys at a time, each converted once for all heads; per
     * head its CH accumulators stay in registers over the block. */
    page = off = 0;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t nb = len - j0 < 16 ? len - j0 : 16;
        walk_pages(v_cache, table, page_size, kv_heads, kh, D * el, nb, &page, &off, kp);
        for (int64_t jj = 0; jj < nb; jj++)
            for (int c = 0; c < CH; c++) keys[jj * CH + c] = v_load(kp[jj], c * 16, 16, bf);
        for (int64_t g = 0; g < group; g++) {
            const float *sg = scores + g * max_len + j0;
            vf a[8];
            for (int c = 0; c < CH; c++) a[c] = acc[g * CH + c];
            for (int64_t jj = 0; jj < nb; jj++) {
                const vf w = v_set(sg[jj]);
                for (int c = 0; c < CH; c++) a[c] = v_fma(w, keys[jj * CH + c], a[c]);
            }
            for (int c = 0; c < CH; c++) acc[g * CH + c] = a[c];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int c = 0; c < CH; c++) v_store(ot, g * D + c * 16, 16, acc[g * CH + c], bf);
}
#define FIXED_ITEM(D, group) (((D) == 64 || (D) == 128) && (group) <= 8)
#else
#define FIXED_ITEM(D, group) 0
#define attention_item_fixed(...) ((void)0)
#endif

/* q [tokens, heads, D]; token t of sequence seq[t] sees keys 0 .. pos[t] of that sequence, whose
 * pages are tables[seq[t] * table_width ...]; out [tokens, heads * D]. Query head h reads kv head
 * h / (heads / kv_heads), as in transformers. scratch: nthreads * group * max_len floats. */
static void attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                      int64_t table_width, int64_t page_size, const int64_t *seq, const int64_t *pos, void *out,
                      int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, float *scratch,
                      int nthreads, int bf) {
    const size_t el = bf ? 2 : 4;
    const int64_t group = heads / kv_heads, work = tokens * kv_heads;
    const int fixed = FIXED_ITEM(D, group);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (work > 1)
    for (int64_t item = 0; item < work; item++) {
        const int64_t t = item / kv_heads, kh = item % kv_heads;
        const int64_t at = (t * heads + kh * group) * D * el;
        float *mine = scratch + (int64_t)omp_get_thread_num() * group * max_len;
#define ITEM(B)                                                                                                   \
    attention_item((const char *)q + at, k_cache, v_cache, tables + seq[t] * table_width, page_size, pos[t] + 1, \
                   kh, kv_heads, group, D, max_len, mine, (char *)out + at, B)
#define FIXED(B, CH)                                                                                              \
    attention_item_fixed((const char *)q + at, k_cache, v_cache, tables + seq[t] * table_width, page_size,       \
                         pos[t] + 1, kh, kv_heads, group, max_len, mine, (char *)out + at, B, CH)
#define FIXED4(B) FIXED(B, 4)
#define FIXED8(B) FIXED(B, 8)
        if (fixed && D == 64) SPECIALISE(bf, FIXED4);
        else if (fixed) SPECIALISE(bf, FIXED8);
        else SPECIALISE(bf, ITEM);
#undef ITEM
#undef FIXED
#undef FIXED4
#undef FIXED8
    }
}

/* One row: gate_up [2 inter] -> out [inter] = silu(gate) * up, each op rounded as eager. */
static inline void silu_mul_row(const char *g, char *o, int64_t inter, int bf) {
    const char *u = g + inter * (bf ? 2 : 4);
    for (int64_t i = 0; i < inter; i += VW) {
        const int64_t n = inter - i;
        const vf x = v_load(g, i, n, bf);
        const vf silu = v_round(v_div(x, v_add(v_set(1.f), v_exp(v_sub(v_set(0.f), x)))), bf);
        v_store(o, i, n, v_mul(silu, v_load(u, i, n, bf)), bf);
    }
}

static void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int nthreads, int bf) {
    const size_t el = bf ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) if (rows * inter >= PAR_MIN)
    for (int64_t r = 0; r < rows; r++) {
#define ROW(B) silu_mul_row((const char *)gate_up + r * 2 * inter * el, (char *)out + r * inter * el, inter, B)
        SPECIALISE(bf, ROW);
#undef ROW
    }
}

/* The exported entry points, one per element type. */
#define EXPORT(SFX, BF)                                                                                          \
    void add_rmsnorm_##SFX(void *x, const void *y, const void *w, void *h, int64_t rows, int64_t dim, float eps, \
                           int nthreads) {                                                                       \
        add_rmsnorm(x, y, w, h, rows, dim, eps, nthreads, BF);                                                   \
    }                                                                                                            \
    void rope_kv_##SFX(const void *qkv, const float *cos_table, const float *sin_table, const int64_t *pos,     \
                       const int64_t *slots, void *k_cache, void *v_cache, void *q_out, int64_t tokens,          \
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int nthreads) {                        \
        rope_kv(qkv, cos_table, sin_table, pos, slots, k_cache, v_cache, q_out, tokens, heads, kv_heads,         \
                head_dim, nthreads, BF);                                                                         \
    }                                                                                                            \
    void attention_##SFX(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,        \
                         int64_t table_width, int64_t page_size, const int64_t *seq, const int64_t *pos,         \
                         void *out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, \
                         float *scratch, int nthreads) {                                                         \
        attention(q, k_cache, v_cache, tables, table_width, page_size, seq, pos, out, tokens, heads, kv_heads,  \
                  D, max_len, scratch, nthreads, BF);                                                            \
    }                                                                                                            \
    void silu_mul_##SFX(const void *gate_up, void *out, int64_t rows, int64_t inter, int nthreads) {            \
        silu_mul(gate_up, out, rows, inter, nthreads, BF);                                                       \
    }

EXPORT(bf16, 1)
EXPORT(f32, 0)

/* ---- The bf16 matmul on AMX: y [M, N] = x [M, K] @ W^T (+ bias), W an nn.Linear weight [N, K].
 *
 * Why our own: oneDNN's per-call overhead and its blocking for few rows read the weights at about
 * half the memory bandwidth at 1 and 32 rows (BENCHMARKS.md "Session 7"), and a row's result
 * must not depend on the batch around it (a request's tokens would then depend on the schedule).
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && VW == 16
#include <sys/syscall.h>
#include <unistd.h>

/* Linux grants AMX's 8 KB of tile state per process, on request. */
int linear_ready(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }

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
 * crop's consecutive tokens, or one page's slots), packed into tiles zero-padded to multiples of
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
        const __mmask16 m = tail(rows - nb * 16 > 0 ? rows - nb * 16 : 0);
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
        const __mmask16 m = tail(cols - nb * 16 > 0 ? cols - nb * 16 : 0);
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
                mx = v_max(mx, _mm512_mask_loadu_ps(v_set(-INFINITY), tail(row_keys - j), sr + j));
            const vf cv = v_set(c), shift = v_set(-c * _mm512_reduce_max_ps(mx));
            vf sum = v_set(0.f);
            for (int64_t j = 0; j < steps * 32; j += 16) {
                const __mmask16 m = tail(row_keys - j > 0 ? row_keys - j : 0);
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

/* Moondream's rotary and cache write in one pass over the fused qkv rows [T, (H + 2 Hkv) D] at
 * positions pos[t]: of each q and k head, the first `rot` dims rotated (their halves as real and
 * imaginary parts, written interleaved), in float32 and rounded to bf16 once, the rest copied
 * (as apply_partial_rope: the same bits); q -> q_out [T, H, D], k and v -> cache slots[t] of
 * [slots, Hkv, D]. Tables cos_t, sin_t [positions, rot / 2] float32. */
void partial_rope_kv_bf16(const bf16 *qkv, const float *cos_t, const float *sin_t, const int64_t *pos,
                          const int64_t *slots, bf16 *k_cache, bf16 *v_cache, bf16 *q_out, int64_t T, int64_t H,
                          int64_t Hkv, int64_t D, int64_t rot, int nthreads) {
    const int64_t half = rot / 2, row = (H + 2 * Hkv) * D;
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
#pragma omp parallel for num_threads(nthreads) if (T * row >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *src = qkv + t * row;
        const float *ct = cos_t + pos[t] * half, *st = sin_t + pos[t] * half;
        for (int64_t hh = 0; hh < H + Hkv; hh++) {
            const bf16 *x = src + hh * D;
            bf16 *dst = hh < H ? q_out + (t * H + hh) * D : k_cache + (slots[t] * Hkv + hh - H) * D;
            for (int64_t i = 0; i < half; i += 16) {
                const int64_t n = half - i;
                const vf re = v_load(x, i, n, 1), im = v_load(x, half + i, n, 1);
                const vf c = v_load(ct, i, n, 0), s = v_load(st, i, n, 0);
                const vf a = v_sub(v_mul(re, c), v_mul(im, s)), b = v_add(v_mul(re, s), v_mul(im, c));
                v_store(dst, 2 * i, 2 * n, _mm512_permutex2var_ps(a, lo, b), 1);
                if (n > 8) v_store(dst, 2 * i + 16, 2 * n - 16, _mm512_permutex2var_ps(a, hi, b), 1);
            }
            memcpy(dst + rot, x + rot, (size_t)(D - rot) * 2);
        }
        memcpy(v_cache + slots[t] * Hkv * D, src + (H + Hkv) * D, (size_t)Hkv * D * 2);
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
 * from the caches [pages, page_size, Hkv, D] through tables [S, table_width] (page_size a
 * multiple of 16: a group of 16 keys is in one page). -> out [T, H D]. */
void paged_attention_amx_bf16(const bf16 *q, const bf16 *k_cache, const bf16 *v_cache, const int64_t *tables,
                              int64_t table_width, int64_t page_size, const int64_t *starts, const int64_t *last,
                              bf16 *out, int64_t S, int64_t H, int64_t Hkv, int64_t D, float scale, int nthreads) {
    const int64_t max_keys = table_width * page_size, group = H / Hkv, ld = Hkv * D;
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
                const int64_t slot = tables[s * table_width + g * 16 / page_size] * page_size + g * 16 % page_size;
                kg[g] = k_cache + slot * ld + kh * D;
                vg[g] = v_cache + slot * ld + kh * D;
            }
            attend_head(q + (first * H + h) * D, H * D, kg, vg, ld, keys, last + first, rows, D, scale,
                        out + first * H * D + h * D, H * D, &hs);
        }
        head_scratch_free(&hs);
        _tile_release();
    }
}

/* All decoder layers of Llama._fused_layers in one call: the same kernels in the same order, so
 * the result is bit for bit the Python loop's, without its ~270 Python calls a step and the GIL
 * taken back after each (the engine's compute thread then shares the GIL with the host thread
 * for a whole forward's worth of small waits). Each of the layers' four linears packed for
 * linear_bf16. weights [layers][10]: input norm, post-attention norm, qkv, qkv bias, o, gate_up,
 * gate_up bias, down, down bias, the next layer's input norm (the final norm after the last);
 * a bias may be NULL. x [T, hidden] is the residual stream (updated in place); h [T,
 * hidden] gets norm(x) after the last layer. Buffers: qkv [T, (H + 2 Hkv) D], q and o [T, H D],
 * proj [T, hidden], gu [T, 2 inter], act [T, inter]; att_scratch as attention's. */
void layers_bf16(bf16 *x, bf16 *h, const int64_t *weights, int64_t n_layers, bf16 *k_cache, bf16 *v_cache,
                 int64_t layer_stride, const float *cos_table, const float *sin_table, const int64_t *pos,
                 const int64_t *slots, const int64_t *tables, int64_t table_width, int64_t page_size,
                 const int64_t *seq, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t hidden,
                 int64_t inter, float eps, int64_t max_len, bf16 *qkv, bf16 *q, bf16 *o, bf16 *proj, bf16 *gu,
                 bf16 *act, float *att_scratch, int nthreads) {
    const int64_t qkv_width = (heads + 2 * kv_heads) * D;
#define W(i, k) ((const bf16 *)(intptr_t)weights[(i) * 10 + (k)])
    add_rmsnorm(x, NULL, W(0, 0), h, tokens, hidden, eps, nthreads, 1);
    for (int64_t i = 0; i < n_layers; i++) {
        bf16 *kc = k_cache + i * layer_stride, *vc = v_cache + i * layer_stride;
        linear_bf16(h, W(i, 2), W(i, 3), qkv, tokens, hidden, qkv_width, nthreads);
        rope_kv(qkv, cos_table, sin_table, pos, slots, kc, vc, q, tokens, heads, kv_heads, D, nthreads, 1);
        attention(q, kc, vc, tables, table_width, page_size, seq, pos, o, tokens, heads, kv_heads, D, max_len,
                  att_scratch, nthreads, 1);
        linear_bf16(o, W(i, 4), NULL, proj, tokens, heads * D, hidden, nthreads);
        add_rmsnorm(x, proj, W(i, 1), h, tokens, hidden, eps, nthreads, 1);
        linear_bf16(h, W(i, 5), W(i, 6), gu, tokens, hidden, 2 * inter, nthreads);
        silu_mul(gu, act, tokens, inter, nthreads, 1);
        linear_bf16(act, W(i, 7), W(i, 8), proj, tokens, inter, hidden, nthreads);
        add_rmsnorm(x, proj, W(i, 9), h, tokens, hidden, eps, nthreads, 1);
    }
#undef W
}
#else
int linear_ready(void) { return 0; }
void layers_bf16(void) {}
void linear_pack_bf16(const bf16 *w, bf16 *out, int64_t N, int64_t K) { (void)w, (void)out, (void)N, (void)K; }
void linear_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t K, int64_t N,
                 int nthreads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)nthreads;
}
void linear_gelu_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t K, int64_t N,
                      int nthreads) {
    linear_bf16(x, wp, bias, y, M, K, N, nthreads);
}
void full_attention_bf16(void) {}
void partial_rope_kv_bf16(void) {}
void paged_attention_amx_bf16(void) {}
#endif
