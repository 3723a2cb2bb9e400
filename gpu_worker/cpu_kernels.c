/* Fused CPU kernels of the Llama decoder layer: everything but the matmuls.
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

/* Work below this many elements runs on the calling thread alone: a parallel
 * region costs more than it saves there. */
#define PAR_MIN 65536

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
    const char *page_keys = k_cache + (table[0] * page_size * kv_heads + kh) * D * el;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
        const int64_t nb = len - j0 < 16 ? len - j0 : 16;
        const char *kp[16];
        for (int64_t jj = 0; jj < nb; jj++) {
            kp[jj] = page_keys + off * key_stride;
            if (++off == page_size && j0 + jj + 1 < len) {
                off = 0;
                page_keys = k_cache + (table[++page] * page_size * kv_heads + kh) * D * el;
            }
        }
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

/* q [tokens, heads, D]; token t of sequence seq[t] sees keys 0 .. pos[t] of that sequence, whose
 * pages are tables[seq[t] * table_width ...]; out [tokens, heads * D]. Query head h reads kv head
 * h / (heads / kv_heads), as in transformers. scratch: nthreads * group * max_len floats. */
static void attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                      int64_t table_width, int64_t page_size, const int64_t *seq, const int64_t *pos, void *out,
                      int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, float *scratch,
                      int nthreads, int bf) {
    const size_t el = bf ? 2 : 4;
    const int64_t group = heads / kv_heads, work = tokens * kv_heads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (work > 1)
    for (int64_t item = 0; item < work; item++) {
        const int64_t t = item / kv_heads, kh = item % kv_heads;
        const int64_t at = (t * heads + kh * group) * D * el;
        float *mine = scratch + (int64_t)omp_get_thread_num() * group * max_len;
#define ITEM(B)                                                                                                   \
    attention_item((const char *)q + at, k_cache, v_cache, tables + seq[t] * table_width, page_size, pos[t] + 1, \
                   kh, kv_heads, group, D, max_len, mine, (char *)out + at, B)
        SPECIALISE(bf, ITEM);
#undef ITEM
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
