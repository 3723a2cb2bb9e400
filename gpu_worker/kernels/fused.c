/* Llama's fused decoder-layer kernels, portable: written over vec.h's `vf`, built at every level.
 *
 * Eager PyTorch spends ~100 small ops per layer around the four matmuls (norms, rope, the page
 * gather, SDPA's mask, silu); here they are five calls:
 *
 *   add_rmsnorm   x += y (optional); h = rmsnorm(x) * w
 *   rope_kv       rope on q and k of the fused qkv row; k, v written at their kv_index in the cache
 *   attention     each query token attends over its sequence's pages in place (no gather copy, no mask)
 *   silu_mul      silu(gate) * up
 *
 * Rounding follows the eager bf16 path op by op (each bf16 op of PyTorch computes in float32 and
 * rounds its result), so the two agree to a few bf16 ulps; in float32 they agree to float32
 * rounding (tests/test_cpu_kernels.py).
 *
 * Each kernel is written once over `void *` data and an `is_bf16` flag; the exported
 * `<name>_bf16` / `<name>_f32` wrappers pass a constant, so gcc inlines a branch-free loop per
 * element type.
 *
 * Threads: every parallel region is sized by the caller (torch's intra-op thread count), so these
 * kernels and torch's matmuls share one thread team where the OpenMP runtime is the one torch
 * loaded (x86 wheels: libgomp.so.1, one soname, loaded once). torch's aarch64 wheels bundle a
 * renamed libgomp, so there this library brings the system's beside it: two thread teams, never
 * busy at once (a kernel call returns before torch's next op starts), each sized the same.
 */
#include "fused.h"
#include "kv_cache.h"
#include "vec.h"

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
 * as the eager path does; q -> q_out [heads, head_dim], k and v -> slot `slot` of the caches, in
 * the caches' type (kbf: bf16, rounded as PagedKVCache.write's cast). */
static inline void rope_kv_row(const char *src, const float *ct, const float *st, char *q_out, char *k_cache,
                               char *v_cache, int64_t slot, int64_t page_size, int64_t heads, int64_t kv_heads,
                               int64_t head_dim, int bf, int kbf) {
    const size_t el = bf ? 2 : 4, kel = kbf ? 2 : 4;
    const int64_t half = head_dim / 2;
    for (int64_t hh = 0; hh < heads + kv_heads; hh++) {
        const char *x = src + hh * head_dim * el;
        const int to_bf = hh < heads ? bf : kbf;
        char *dst = hh < heads ? q_out + hh * head_dim * el
                               : k_cache + kv_row(slot, hh - heads, kv_heads, page_size) * head_dim * kel;
        for (int64_t i = 0; i < half; i += VW) {
            const int64_t n = half - i;
            const vf c = v_round(v_load(ct, i, n, 0), bf), s = v_round(v_load(st, i, n, 0), bf);
            const vf x1 = v_load(x, i, n, bf), x2 = v_load(x, i + half, n, bf);
            v_store(dst, i, n, v_sub(v_round(v_mul(x1, c), bf), v_round(v_mul(x2, s), bf)), to_bf);
            v_store(dst, i + half, n, v_add(v_round(v_mul(x2, c), bf), v_round(v_mul(x1, s), bf)), to_bf);
        }
    }
    for (int64_t kh = 0; kh < kv_heads; kh++) {
        const char *v = src + (heads + kv_heads + kh) * head_dim * el;
        char *dst = v_cache + kv_row(slot, kh, kv_heads, page_size) * head_dim * kel;
        if (bf == kbf) memcpy(dst, v, head_dim * el);
        else
            for (int64_t i = 0; i < head_dim; i += VW)
                v_store(dst, i, head_dim - i, v_load(v, i, head_dim - i, bf), kbf);
    }
}

/* qkv [tokens, (heads + 2 kv_heads) * head_dim] at positions pos[t]; k and v go to slot kv_index[t]
 * of the caches [pages, kv_heads, page_size, head_dim]. */
static void rope_kv(const void *qkv, const float *cos_table, const float *sin_table, const int64_t *pos,
                    const int64_t *kv_index, void *k_cache, void *v_cache, void *q_out, int64_t tokens, int64_t heads,
                    int64_t kv_heads, int64_t head_dim, int64_t page_size, int nthreads, int bf, int kbf) {
    const size_t el = bf ? 2 : 4;
    const int64_t half = head_dim / 2, row = (heads + 2 * kv_heads) * head_dim;
#pragma omp parallel for num_threads(nthreads) if (tokens * row >= PAR_MIN)
    for (int64_t t = 0; t < tokens; t++) {
#define ROW(B, KB)                                                                                               \
    rope_kv_row((const char *)qkv + t * row * el, cos_table + pos[t] * half, sin_table + pos[t] * half,           \
                (char *)q_out + t * heads * head_dim * el, k_cache, v_cache, kv_index[t], page_size, heads,       \
                kv_heads, head_dim, B, KB)
        SPECIALISE_KV(bf, kbf, ROW);
#undef ROW
    }
}

/* The addresses of a sequence's next nb keys (or values) of kv head kh in a cache [pages,
 * kv_heads, page_size, D] (rows of row_bytes), walking its page table: (*page, *off) is where the
 * next one is, and is moved past them. */
static inline void walk_pages(const char *cache, const int64_t *table, int64_t page_size, int64_t kv_heads,
                              int64_t kh, size_t row_bytes, int64_t nb, int64_t *page, int64_t *off,
                              const char **out) {
    for (int64_t jj = 0; jj < nb; jj++) {
        out[jj] = cache + kv_row(table[*page] * page_size + *off, kh, kv_heads, page_size) * row_bytes;
        if (++*off == page_size) {
            *off = 0;
            ++*page;
        }
    }
}

/* The addresses of keys (or values) j0 .. j0 + nb - 1, as walk_pages, for a block of VW keys
 * starting at a multiple of VW: where VW divides the page size the block lies in one page (rows
 * one after the other, no walk per key). */
static inline void block_rows(const char *cache, const int64_t *table, int64_t page_size, int64_t kv_heads,
                              int64_t kh, size_t row_bytes, int64_t j0, int64_t nb, int64_t *page, int64_t *off,
                              const char **out) {
    if (page_size % VW == 0) {
        const char *first = cache + kv_row(table[j0 / page_size] * page_size + j0 % page_size, kh, kv_heads, page_size) * row_bytes;
        for (int64_t jj = 0; jj < nb; jj++) out[jj] = first + jj * row_bytes;
        return;
    }
    walk_pages(cache, table, page_size, kv_heads, kh, row_bytes, nb, page, off, out);
}

/* Values j0 .. j0 + nb - 1 asked for into L2 while pass 1 reads the keys of the same positions, so
 * pass 2 finds them there (where VW divides the page size: the block is one run of rows). Pass 2's
 * loads of the values waited on memory for 44% of a one-thread item at 2000 keys: the cache is
 * cold at each step (the weights read between two layers' attention evict it), and a kv head's
 * runs of page_size rows, between the other heads' runs, are too short for the hardware
 * prefetcher. Only for a sequence's first row in the batch (`cold`): a prompt's next rows find
 * the values cached (with every row asking, a 2000-token prompt took 2-7% longer than before the
 * chunks; 0.5-2.3% as it is). The keys' own prefetch a block ahead was slower (BENCHMARKS.md
 * "Attention in chunks"). */
static inline void prefetch_values(int cold, const char *v_cache, const int64_t *table, int64_t page_size,
                                   int64_t kv_heads, int64_t kh, size_t row_bytes, int64_t j0, int64_t nb) {
    if (!cold || page_size % VW) return;
    const char *first = v_cache + kv_row(table[j0 / page_size] * page_size + j0 % page_size, kh, kv_heads, page_size) * row_bytes;
    for (size_t at = 0; at < nb * row_bytes; at += 64) __builtin_prefetch(first + at, 0, 2);
}

/* A block of nb scores (the first lanes of s) stored at sg + j0; the head's running max updated. */
static inline void put_scores(float *sg, int64_t j0, int64_t nb, vf s, float *mx) {
    v_store(sg, j0, nb, s, 0);
    const float m = v_max_of(s, nb);
    *mx = m > *mx ? m : *mx;
}

/* The scores sg [len] -> their softmax, given their max (exp vectorised; a tail's lanes are never
 * stored); returns the exponentials' sum, summed per lane then across (a scalar loop was one chain
 * of dependent adds: 16% of a 32-sequence decode's attention, BENCHMARKS.md "Attention's softmax
 * summed per lane"). */
static inline float softmax(float *sg, int64_t len, float mx) {
    vf sums = v_set(0.f);
    for (int64_t j = 0; j < len; j += VW) {
        v_store(sg, j, len - j, v_exp(v_sub(v_load(sg, j, len - j, 0), v_set(mx))), 0);
        sums = v_add(sums, v_load(sg, j, len - j, 0)); /* the stored lanes: v_load zero-fills the rest */
    }
    const float total = v_sum(sums);
    const vf inv = v_set(1.f / total);
    for (int64_t j = 0; j < len; j += VW) v_store(sg, j, len - j, v_mul(v_load(sg, j, len - j, 0), inv), 0);
    return total;
}

/* Attention in chunks of CHUNK keys (flash-decoding's split, at a fixed place): a chunk's result is
 * its softmax-weighted values (the whole attention where one chunk holds every key), and a token's
 * chunks merge in order, weighted by their exponentials' sums. The chunks of one token may run on
 * different threads (a decode step of one sequence has only kv_heads items for all threads), and a
 * token's numerics depend on its own length alone, never on its batch or its threads.
 * A chunk's part [group * PART_PER_HEAD(D)] floats: [group][D] the weighted values, then [group] the
 * scores' max and [group] the exponentials' sum (at that max). */
#define CHUNK 256
#define PART_PER_HEAD(D) ((D) + 2)

/* The parts of a token's `chunks` chunks -> its output ot [group, D] (in the activations' type): one
 * chunk's is its part as it is (its weight exactly 1). */
static inline void merge_chunks(const float *parts, int64_t chunks, int64_t group, int64_t D, char *ot, int bf) {
    const int64_t width = group * PART_PER_HEAD(D);
    for (int64_t g = 0; g < group; g++) {
        float mx = -INFINITY, total = 0.f, weight[chunks];
        for (int64_t c = 0; c < chunks; c++) {
            const float m = parts[c * width + group * D + g];
            mx = m > mx ? m : mx;
        }
        for (int64_t c = 0; c < chunks; c++) {
            const float *stats = parts + c * width + group * D;
            weight[c] = stats[group + g] * expf(stats[g] - mx);
            total += weight[c];
        }
        for (int64_t c = 0; c < chunks; c++) weight[c] /= total;
        for (int64_t i = 0; i < D; i += VW) {
            vf o = v_set(0.f);
            for (int64_t c = 0; c < chunks; c++) o = v_fma(v_set(weight[c]), v_load(parts + c * width, g * D + i, D - i, 0), o);
            v_store(ot, g * D + i, D - i, o, bf);
        }
    }
}

/* A chunk's statistics, after its weighted values: max and exponentials' sum per query head. */
static inline void put_stats(float *part, int64_t group, int64_t D, const float *mx, const float *total) {
    for (int64_t g = 0; g < group; g++) {
        part[group * D + g] = mx[g];
        part[group * D + group + g] = total[g];
    }
}

/* One chunk of one (token, kv head): its group of query heads qt [group, D] over the keys first ..
 * len - 1 of its sequence, key j in page table[j / page_size] of the caches [pages, kv_heads,
 * page_size, D]: scores, softmax, then the weighted values -> part. scratch: group * CHUNK floats. */
static inline void attention_item(const char *qt, const char *k_cache, const char *v_cache, const int64_t *table,
                                  int64_t page_size, int64_t first, int64_t len, int64_t kh, int64_t kv_heads,
                                  int64_t group, int64_t D, float *scratch, float *part, int bf, int kbf) {
    const size_t el = kbf ? 2 : 4; /* the caches' */
    const int64_t chunks = (D + VW - 1) / VW;
    const vf scale = v_set(1.f / sqrtf((float)D));
    float *scores = scratch;
    vf qv[group * chunks], acc[group * chunks];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) qv[g * chunks + c] = v_mul(v_load(qt, g * D + c * VW, D - c * VW, bf), scale);
    float mx[group], total[group];
    for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
    /* Pass 1: the scores, VW keys at a time: per query head, VW dot-product vectors summed across
     * their lanes together (v_sums) instead of one horizontal reduction per key. */
    int64_t page = first / page_size, off = first % page_size;
    for (int64_t j0 = first; j0 < len; j0 += VW) {
        const int64_t nb = len - j0 < VW ? len - j0 : VW;
        const char *kp[VW];
        walk_pages(k_cache, table, page_size, kv_heads, kh, D * el, nb, &page, &off, kp);
        for (int64_t g = 0; g < group; g++) {
            vf dots[VW];
            for (int64_t jj = 0; jj < VW; jj++) {
                dots[jj] = v_set(0.f);
                if (jj < nb)
                    for (int64_t c = 0; c < chunks; c++)
                        dots[jj] = v_fma(qv[g * chunks + c], v_load(kp[jj], c * VW, D - c * VW, kbf), dots[jj]);
            }
            put_scores(scores + g * CHUNK, j0 - first, nb, v_sums(dots), &mx[g]);
        }
    }
    for (int64_t g = 0; g < group; g++) total[g] = softmax(scores + g * CHUNK, len - first, mx[g]);
    /* Pass 2: the probability-weighted values, accumulated in registers. */
    for (int64_t i = 0; i < group * chunks; i++) acc[i] = v_set(0.f);
    for (int64_t start = first; start < len;) {
        const char *v = v_cache + kv_row(table[start / page_size] * page_size + start % page_size, kh, kv_heads,
                                         page_size) * D * el;
        const int64_t page_end = (start / page_size + 1) * page_size, end = len < page_end ? len : page_end;
        for (int64_t j = start; j < end; j++, v += D * el)
            for (int64_t c = 0; c < chunks; c++) {
                const vf vc = v_load(v, c * VW, D - c * VW, kbf);
                for (int64_t g = 0; g < group; g++)
                    acc[g * chunks + c] = v_fma(v_set(scores[g * CHUNK + j - first]), vc, acc[g * chunks + c]);
            }
        start = end;
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) v_store(part, g * D + c * VW, D - c * VW, acc[g * chunks + c], 0);
    put_stats(part, group, D, mx, total);
}

#if VW > 1
#define MAX_CH (128 / VW) /* D <= 128 */
#if VW == 16 && defined(__AVX512BF16__)
/* A block of scores of one query head qg [D = 16 CH] in bf16 against the keys at kp: vdpbf16ps on
 * q's and the keys' bf16 pairs as stored (exact products, float32 sums), the scale applied to the
 * sums. */
static inline __attribute__((always_inline)) void scores_bf16(const char *qg, const char *const *kp, const int CH,
                                                              float *sg, int64_t j0, int64_t nb, vf scale,
                                                              float *mx) {
    vf dots[VW];
    for (int jj = 0; jj < VW; jj++) {
        dots[jj] = v_set(0.f);
        for (int c = 0; c < CH / 2; c++)
            dots[jj] = _mm512_dpbf16_ps(dots[jj], (__m512bh)_mm512_loadu_si512(qg + 64 * c),
                                        (__m512bh)_mm512_loadu_si512(kp[jj] + 64 * c));
    }
    put_scores(sg, j0, nb, v_mul(v_sums(dots), scale), mx);
}

/* A float32 query head q [D] times scale as two bf16 halves, hi = bf16(q) and lo = bf16(q - hi): hi +
 * lo is q to 2^-18 of it, and each of their products with a bf16 key is exact. */
static inline __attribute__((always_inline)) void split_query(const float *q, vf scale, const int CH, __m512bh *hi,
                                                              __m512bh *lo) {
    for (int c = 0; c < CH / 2; c++) {
        const vf a = v_mul(_mm512_loadu_ps(q + 32 * c), scale), b = v_mul(_mm512_loadu_ps(q + 32 * c + 16), scale);
        hi[c] = _mm512_cvtne2ps_pbh(b, a);
        const __m512i h = (__m512i)hi[c]; /* a's and b's halves widened back */
        const vf ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
        const vf hb = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
        lo[c] = _mm512_cvtne2ps_pbh(v_sub(b, hb), v_sub(a, ha));
    }
}

/* A block of scores of a float32 query head, split (split_query), against bf16 keys at kp: vdpbf16ps
 * on hi and on lo, so the keys are read as stored, never widened (the quantized models' float32
 * activations over their bf16 cache: BENCHMARKS.md "The KV cache in bf16 under quantized weights"). */
static inline __attribute__((always_inline)) void scores_split(const __m512bh *hi, const __m512bh *lo,
                                                               const char *const *kp, const int CH, float *sg,
                                                               int64_t j0, int64_t nb, float *mx) {
    vf dots[VW];
    for (int jj = 0; jj < VW; jj++) {
        dots[jj] = v_set(0.f);
        for (int c = 0; c < CH / 2; c++) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(kp[jj] + 64 * c);
            dots[jj] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(dots[jj], hi[c], k), lo[c], k);
        }
    }
    put_scores(sg, j0, nb, v_sums(dots), mx);
}
#endif
#define ACC_REGS (VW == 16 ? 16 : 8) /* value accumulators pass 2 keeps in registers (of 32 or 16) */
/* attention_item for head_dim = VW * CH, CH a literal at the call (always inlined): the loops over
 * a head's vectors unroll and the VW dot products and the value accumulators stay in registers
 * (with a run-time D they lived on the stack: 1.5x slower, the kernel alone at 32 sequences). Keys
 * are read from the cache for each query head (L1 after the first): a block's keys staged for all
 * heads were VW * CH vectors, spilled to the stack (2.3x slower at one sequence). G, where a
 * literal (0: the group is known at run time only), lets pass 2 convert each value once for the
 * group's heads, whose G * CH accumulators then fit in registers.
 * In float32 (and below AVX512-BF16) the same math in the same order as attention_item, so the
 * two agree bit for bit. bf16 with AVX512-BF16: pass 1 is scores_bf16 (no conversion of the keys
 * to float32, which took most of it: BENCHMARKS.md "Attention's bf16 dot products"), and with a
 * literal G the item is attention_item_bf16; float32 over a bf16 cache: pass 1 is scores_split. */
static inline __attribute__((always_inline)) void attention_item_fixed(
    const char *qt, const char *k_cache, const char *v_cache, const int64_t *table, int64_t page_size, int64_t first,
    int64_t len, int64_t kh, int64_t kv_heads, int64_t group, float *scores, float *part, int cold, int bf, int kbf,
    const int CH, const int G) {
    const int64_t D = VW * CH;
    const size_t el = kbf ? 2 : 4; /* the caches' */
    const vf scale = v_set(1.f / sqrtf((float)D));
    float mx[8], total[8]; /* group <= 8 (checked by the caller) */
    for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY;
    /* Pass 1: the scores, VW keys at a time; a short last block repeats its last key. */
    int64_t page = first / page_size, off = first % page_size;
    const char *kp[VW];
#if VW == 16 && defined(__AVX512BF16__)
    __m512bh q_hi[8 * MAX_CH / 2], q_lo[8 * MAX_CH / 2];
    if (!bf && kbf)
        for (int64_t g = 0; g < group; g++)
            split_query((const float *)qt + g * D, scale, CH, q_hi + g * CH / 2, q_lo + g * CH / 2);
#endif
    for (int64_t j0 = first; j0 < len; j0 += VW) {
        const int64_t nb = len - j0 < VW ? len - j0 : VW;
        block_rows(k_cache, table, page_size, kv_heads, kh, D * el, j0, nb, &page, &off, kp);
        for (int64_t jj = nb; jj < VW; jj++) kp[jj] = kp[nb - 1];
        prefetch_values(cold, v_cache, table, page_size, kv_heads, kh, D * el, j0, nb);
        for (int64_t g = 0; g < group; g++) {
            vf dots[VW];
#if VW == 16 && defined(__AVX512BF16__)
            if (bf) {
                scores_bf16(qt + 2 * g * D, kp, CH, scores + g * CHUNK, j0 - first, nb, scale, &mx[g]);
                continue;
            }
            if (kbf) {
                scores_split(q_hi + g * CH / 2, q_lo + g * CH / 2, kp, CH, scores + g * CHUNK, j0 - first, nb, &mx[g]);
                continue;
            }
#endif
            vf qv[MAX_CH];
            for (int c = 0; c < CH; c++) qv[c] = v_mul(v_load(qt, g * D + c * VW, VW, bf), scale);
            for (int jj = 0; jj < VW; jj++) {
                dots[jj] = v_set(0.f);
                for (int c = 0; c < CH; c++) dots[jj] = v_fma(qv[c], v_load(kp[jj], c * VW, VW, kbf), dots[jj]);
            }
            put_scores(scores + g * CHUNK, j0 - first, nb, v_sums(dots), &mx[g]);
        }
    }
    for (int64_t g = 0; g < group; g++) total[g] = softmax(scores + g * CHUNK, len - first, mx[g]);
    put_stats(part, group, D, mx, total);
    page = first / page_size, off = first % page_size;
    if (G) { /* Pass 2: each value converted once and weighted for every head of the group, whose
              * G * CH accumulators stay in registers; the same sums in the same order as below. */
        vf accg[ACC_REGS > MAX_CH ? ACC_REGS : MAX_CH];
        for (int i = 0; i < G * CH; i++) accg[i] = v_set(0.f);
        for (int64_t j0 = first; j0 < len; j0 += VW) {
            const int64_t nb = len - j0 < VW ? len - j0 : VW;
            block_rows(v_cache, table, page_size, kv_heads, kh, D * el, j0, nb, &page, &off, kp);
            for (int64_t jj = 0; jj < nb; jj++) {
                vf v[MAX_CH];
                for (int c = 0; c < CH; c++) v[c] = v_load(kp[jj], c * VW, VW, kbf);
                for (int g = 0; g < G; g++) {
                    const vf w = v_set(scores[g * CHUNK + j0 - first + jj]);
                    for (int c = 0; c < CH; c++) accg[g * CH + c] = v_fma(w, v[c], accg[g * CH + c]);
                }
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) v_store(part, g * D + c * VW, VW, accg[g * CH + c], 0);
        return;
    }
    /* Pass 2, the group known at run time only: one head at a time over a block (its CH
     * accumulators in registers), each value's vectors reloaded from L1 per head. */
    vf acc[8 * MAX_CH];
    for (int64_t i = 0; i < group * CH; i++) acc[i] = v_set(0.f);
    for (int64_t j0 = first; j0 < len; j0 += VW) {
        const int64_t nb = len - j0 < VW ? len - j0 : VW;
        block_rows(v_cache, table, page_size, kv_heads, kh, D * el, j0, nb, &page, &off, kp);
        for (int64_t g = 0; g < group; g++) {
            const float *sg = scores + g * CHUNK + j0 - first;
            vf a[MAX_CH];
            for (int c = 0; c < CH; c++) a[c] = acc[g * CH + c];
            for (int64_t jj = 0; jj < nb; jj++) {
                const vf w = v_set(sg[jj]);
                for (int c = 0; c < CH; c++) a[c] = v_fma(w, v_load(kp[jj], c * VW, VW, kbf), a[c]);
            }
            for (int c = 0; c < CH; c++) acc[g * CH + c] = a[c];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int c = 0; c < CH; c++) v_store(part, g * D + c * VW, VW, acc[g * CH + c], 0);
}
#define FIXED_ITEM(D, group) (((D) == 64 || (D) == 128) && (group) <= 8)

#else /* VW 1: the plain loops are the code */
#define FIXED_ITEM(D, group) 0
#define attention_item_fixed(...) ((void)0)
#endif

#if VW == 16 && defined(__AVX512BF16__)
/* attention_item_fixed in bf16 at AVX512-BF16 with a literal group G: pass 2 also in vdpbf16ps.
 * The softmax's exponentials are rounded to bf16 (PyTorch's CPU flash attention rounds its
 * probabilities to bf16 before their matmul with the values) and stored over their float32
 * scores; two keys' values interleaved word by word make one vdpbf16ps add both keys' products to
 * each dimension's sum (half the multiplies and no bf16 -> float32 conversion of the values), and
 * the division by the exponentials' sum scales the G x D sums once. The sums' lanes hold the dimensions in
 * unpack order (32 c + 8 L + i: lo has i = 0..3, hi 4..7 of each 128-bit lane L), put back in
 * order at the store. */
static inline __attribute__((always_inline)) void attention_item_bf16(
    const char *qt, const char *k_cache, const char *v_cache, const int64_t *table, int64_t page_size, int64_t first,
    int64_t len, int64_t kh, int64_t kv_heads, float *scores, float *part, int cold, const int CH, const int G) {
    const int64_t D = 16 * CH, row = D * 2, n = len - first;
    const vf scale = v_set(1.f / sqrtf((float)D));
    float mx[8], sum[8];
    for (int g = 0; g < G; g++) mx[g] = -INFINITY;
    int64_t page = first / page_size, off = first % page_size;
    const char *kp[VW + 1];
    for (int64_t j0 = first; j0 < len; j0 += VW) { /* pass 1: attention_item_fixed's */
        const int64_t nb = len - j0 < VW ? len - j0 : VW;
        block_rows(k_cache, table, page_size, kv_heads, kh, row, j0, nb, &page, &off, kp);
        for (int64_t jj = nb; jj < VW; jj++) kp[jj] = kp[nb - 1];
        prefetch_values(cold, v_cache, table, page_size, kv_heads, kh, row, j0, nb);
        for (int g = 0; g < G; g++) scores_bf16(qt + row * g, kp, CH, scores + g * CHUNK, j0 - first, nb, scale, &mx[g]);
    }
    for (int g = 0; g < G; g++) { /* the exponentials in bf16, over their scores; a 0 after the last */
        float *sg = scores + g * CHUNK;
        uint16_t *eg = (uint16_t *)sg;
        vf total = v_set(0.f);
        for (int64_t j = 0; j < n; j += VW) {
            const __mmask16 m = mask16(n - j);
            const __m256i e = (__m256i)_mm512_cvtneps_pbh(v_exp(v_sub(v_load(sg, j, n - j, 0), v_set(mx[g]))));
            total = _mm512_mask_add_ps(total, m, total, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e), 16)));
            _mm256_mask_storeu_epi16(eg + j, m, e);
        }
        eg[n] = 0;
        sum[g] = v_sum(total);
    }
    put_stats(part, G, D, mx, sum);
    vf acc[ACC_REGS];
    for (int i = 0; i < G * CH; i++) acc[i] = v_set(0.f);
    page = first / page_size, off = first % page_size;
    for (int64_t j0 = first; j0 < len; j0 += VW) { /* pass 2: a pair of keys per vdpbf16ps */
        const int64_t nb = len - j0 < VW ? len - j0 : VW;
        block_rows(v_cache, table, page_size, kv_heads, kh, row, j0, nb, &page, &off, kp);
        kp[nb] = kp[nb - 1]; /* an odd block's last key pairs with itself, weighted 0 */
        for (int64_t jj = 0; jj < nb; jj += 2) {
            __m512i lo[4], hi[4];
            for (int c = 0; c < CH / 2; c++) {
                const __m512i a = _mm512_loadu_si512(kp[jj] + 64 * c), b = _mm512_loadu_si512(kp[jj + 1] + 64 * c);
                lo[c] = _mm512_unpacklo_epi16(a, b);
                hi[c] = _mm512_unpackhi_epi16(a, b);
            }
            for (int g = 0; g < G; g++) {
                uint32_t pair;
                memcpy(&pair, (const uint16_t *)(scores + g * CHUNK) + j0 - first + jj, 4);
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int c = 0; c < CH / 2; c++) {
                    acc[g * CH + 2 * c] = _mm512_dpbf16_ps(acc[g * CH + 2 * c], (__m512bh)lo[c], w);
                    acc[g * CH + 2 * c + 1] = _mm512_dpbf16_ps(acc[g * CH + 2 * c + 1], (__m512bh)hi[c], w);
                }
            }
        }
    }
    /* lane d of a 16-dimension half: lo's lane 4 L + i or hi's (L = d / 8 + 2 half, i = d % 8) */
    const __m512i low_half = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i high_half = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int g = 0; g < G; g++)
        for (int c = 0; c < CH / 2; c++) {
            const vf a = acc[g * CH + 2 * c], b = acc[g * CH + 2 * c + 1], inv = v_set(1.f / sum[g]);
            v_store(part, g * D + 32 * c, VW, v_mul(_mm512_permutex2var_ps(a, low_half, b), inv), 0);
            v_store(part, g * D + 32 * c + 16, VW, v_mul(_mm512_permutex2var_ps(a, high_half, b), inv), 0);
        }
}
#define ITEM_BF16(B, G) ((B) && (G))
#else
#define ITEM_BF16(B, G) 0
#define attention_item_bf16(...) ((void)0)
#endif

/* A token's chunks: its keys 0 .. pos in CHUNK-key pieces. */
static inline int64_t chunks_of(int64_t keys) { return (keys + CHUNK - 1) / CHUNK; }

/* Below SPLIT_ITEMS items a thread, a token's chunks are spread over the threads; above, each item
 * (token, kv head) runs its chunks in turn, on one thread. */
#define SPLIT_ITEMS 4

/* One chunk (keys first .. len - 1) of the item (token t, kv head kh) -> part; `cold`: the first row of
 * its sequence in the batch (prefetch_values). */
static inline __attribute__((always_inline)) void attention_chunk(
    const void *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t page_size, int64_t t,
    int64_t kh, int64_t first, int64_t len, int64_t heads, int64_t kv_heads, int64_t D, float *scores, float *part,
    int cold, int bf, int kbf) {
    const int64_t group = heads / kv_heads;
    const char *qt = (const char *)q + (t * heads + kh * group) * D * (bf ? 2 : 4);
    const int fixed = FIXED_ITEM(D, group);
#define ITEM(B, KB) \
    attention_item(qt, k_cache, v_cache, table, page_size, first, len, kh, kv_heads, group, D, scores, part, B, KB)
#define FIXED_G(B, KB, CH, G)                                                                                    \
    (ITEM_BF16(B, G) ? attention_item_bf16(qt, k_cache, v_cache, table, page_size, first, len, kh, kv_heads,     \
                                           scores, part, cold, CH, G)                                            \
                     : attention_item_fixed(qt, k_cache, v_cache, table, page_size, first, len, kh, kv_heads,    \
                                            group, scores, part, cold, B, KB, CH, G))
/* The group as a literal where its G * CH accumulators fit in registers (or G is 1: as many as the
 * run-time path's). */
#define G_FITS(G, CH) ((G) == 1 || (G) * (CH) <= ACC_REGS ? (G) : 0)
#define FIXED(B, KB, CH)                                                                                         \
    (group == 1 ? FIXED_G(B, KB, CH, 1)                                                                          \
     : group == 2 ? FIXED_G(B, KB, CH, G_FITS(2, CH))                                                            \
     : group == 3 ? FIXED_G(B, KB, CH, G_FITS(3, CH))                                                            \
     : group == 4 ? FIXED_G(B, KB, CH, G_FITS(4, CH))                                                            \
                  : FIXED_G(B, KB, CH, 0))
#define FIXED64(B, KB) FIXED(B, KB, 64 / VW)
#define FIXED128(B, KB) FIXED(B, KB, 128 / VW)
    if (fixed && D == 64) SPECIALISE_KV(bf, kbf, FIXED64);
    else if (fixed) SPECIALISE_KV(bf, kbf, FIXED128);
    else SPECIALISE_KV(bf, kbf, ITEM);
#undef ITEM
#undef FIXED_G
#undef G_FITS
#undef FIXED
#undef FIXED64
#undef FIXED128
}

/* The scratch attention needs, in floats: per thread a chunk's scores (group * CHUNK) and the parts
 * of SPLIT_ITEMS items' chunks. */
int64_t attention_scratch_floats(int64_t nthreads, int64_t group, int64_t D, int64_t max_len) {
    return nthreads * (group * CHUNK + SPLIT_ITEMS * chunks_of(max_len) * group * PART_PER_HEAD(D));
}

/* q [tokens, heads, D]; token t of sequence seq[t] sees keys 0 .. pos[t] of that sequence, whose
 * pages are tables[seq[t] * table_width ...]; out [tokens, heads * D]. Query head h reads kv head
 * h / (heads / kv_heads), as in transformers. scratch: attention_scratch_floats. */
static void attention(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,
                      int64_t table_width, int64_t page_size, const int64_t *seq, const int64_t *pos, void *out,
                      int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, float *scratch,
                      int nthreads, int bf, int kbf) {
    const size_t el = bf ? 2 : 4;
    const int64_t group = heads / kv_heads, items = tokens * kv_heads, width = group * PART_PER_HEAD(D);
    float *const parts = scratch + nthreads * group * CHUNK;
#define ITEM_AT(item, t, kh) const int64_t t = (item) / kv_heads, kh = (item) % kv_heads
#define CHUNK_OF(t, kh, c, part)                                                                                   \
    attention_chunk(q, k_cache, v_cache, tables + seq[t] * table_width, page_size, t, kh, (c) * CHUNK,            \
                    pos[t] + 1 < ((c) + 1) * CHUNK ? pos[t] + 1 : ((c) + 1) * CHUNK, heads, kv_heads, D,          \
                    scratch + (int64_t)omp_get_thread_num() * group * CHUNK, part, (t) == 0 || seq[(t) - 1] != seq[t], \
                    bf, kbf)
#define MERGE(t, kh, first_part, chunks) \
    merge_chunks(first_part, chunks, group, D, (char *)out + ((t) * heads + (kh) * group) * D * el, bf)
    int64_t units = items; /* the chunks of every item, where there are few items */
    for (int64_t item = 0; items < SPLIT_ITEMS * nthreads && item < items; item++)
        units += chunks_of(pos[item / kv_heads] + 1) - 1;
    if (units == items || items >= SPLIT_ITEMS * nthreads) { /* no split: one parallel loop, no merge step */
#pragma omp parallel for num_threads(nthreads) schedule(static) if (items > 1)
        for (int64_t item = 0; item < items; item++) {
            ITEM_AT(item, t, kh);
            float *mine = parts + (int64_t)omp_get_thread_num() * SPLIT_ITEMS * chunks_of(max_len) * width;
            const int64_t chunks = chunks_of(pos[t] + 1);
            for (int64_t c = 0; c < chunks; c++) CHUNK_OF(t, kh, c, mine + c * width);
            MERGE(t, kh, mine, chunks);
        }
        return;
    }
    int64_t start[items + 1]; /* item i's chunks are the units start[i] .. start[i + 1] - 1 */
    start[0] = 0;
    for (int64_t item = 0; item < items; item++) start[item + 1] = start[item] + chunks_of(pos[item / kv_heads] + 1);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < units; unit++) {
            int64_t item = 0;
            while (start[item + 1] <= unit) item++;
            ITEM_AT(item, t, kh);
            CHUNK_OF(t, kh, unit - start[item], parts + unit * width);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; item++) {
            ITEM_AT(item, t, kh);
            MERGE(t, kh, parts + start[item] * width, start[item + 1] - start[item]);
        }
    }
#undef ITEM_AT
#undef CHUNK_OF
#undef MERGE
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

/* The exported entry points, one per element type; rope_kv and attention also per the caches' type
 * (f32_kvbf16: float32 activations over bf16 caches, the weight-only quantized models'). */
#define EXPORT(SFX, BF)                                                                                          \
    void add_rmsnorm_##SFX(void *x, const void *y, const void *w, void *h, int64_t rows, int64_t dim, float eps, \
                           int nthreads) {                                                                       \
        add_rmsnorm(x, y, w, h, rows, dim, eps, nthreads, BF);                                                   \
    }                                                                                                            \
    void silu_mul_##SFX(const void *gate_up, void *out, int64_t rows, int64_t inter, int nthreads) {            \
        silu_mul(gate_up, out, rows, inter, nthreads, BF);                                                       \
    }
#define EXPORT_KV(SFX, BF, KBF)                                                                                  \
    void rope_kv_##SFX(const void *qkv, const float *cos_table, const float *sin_table, const int64_t *pos,     \
                       const int64_t *kv_index, void *k_cache, void *v_cache, void *q_out, int64_t tokens,       \
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, int nthreads) {     \
        rope_kv(qkv, cos_table, sin_table, pos, kv_index, k_cache, v_cache, q_out, tokens, heads, kv_heads,      \
                head_dim, page_size, nthreads, BF, KBF);                                                         \
    }                                                                                                            \
    void attention_##SFX(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,        \
                         int64_t table_width, int64_t page_size, const int64_t *seq, const int64_t *pos,         \
                         void *out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, \
                         float *scratch, int nthreads) {                                                         \
        attention(q, k_cache, v_cache, tables, table_width, page_size, seq, pos, out, tokens, heads, kv_heads,  \
                  D, max_len, scratch, nthreads, BF, KBF);                                                       \
    }

EXPORT(bf16, 1)
EXPORT(f32, 0)
EXPORT_KV(bf16, 1, 1)
EXPORT_KV(f32, 0, 0)
EXPORT_KV(f32_kvbf16, 0, 1)
