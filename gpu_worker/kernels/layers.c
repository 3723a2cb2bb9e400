/* Every Llama decoder layer in one call, at every level: fused.c's kernels and the layers' linears
 * in the order of cpu_backend.fused_layers' Python loop, so the result is that loop's bit for bit,
 * without its ~270 Python calls a step and the GIL taken back after each (the engine's compute
 * thread then shares the GIL with the host thread for a whole forward's worth of small waits;
 * BENCHMARKS.md "The AMX matmul and the layers in one C call").
 *
 * A linear is quant.c's weight-only matmul (q8, q4 or bf16 weights, activations bf16 or float32)
 * or, at level amx, amx.c's matmul over a packed bf16 weight. The table (int64, LAYER_WIDTH per
 * layer; gpu_worker/cpu_backend.layer_table writes it):
 *   [0] the input norm's weight, [1] the post-attention norm's, [2] the next layer's input norm's
 *       (the final norm's after the last layer); the norms' weights have the activations' type
 *   then the four linears qkv, o, gate_up, down, LINEAR_WIDTH each: [0] its parts' count (1..
 *       MAX_PARTS, stacked along N: a fused projection whose parts came in different formats),
 *       then per part PART_WIDTH: format (FMT_* or FMT_AMX), data, scale, offset, group, rows,
 *       bias (float32 for quant.c's formats, bf16 for FMT_AMX; 0: none). FMT_AMX is a part alone.
 * x [T, hidden] is the residual stream (updated in place); h [T, hidden] gets norm(x) after the
 * last layer; the caches hold the activations' type, or bf16 under float32 activations
 * (layers_f32_kvbf16). Buffers: qkv [T, (H + 2 Hkv) D], q and o [T, H D], proj [T, hidden], gu [T, 2
 * inter], act [T, inter]; att_scratch as attention's.
 */
#include "fused.h"
#include "quant.h"
#include "vec.h"

#define FMT_AMX 3 /* a weight packed for amx.c's linear_bf16 */
#define MAX_PARTS 3
#define PART_WIDTH 7
#define LINEAR_WIDTH (1 + MAX_PARTS * PART_WIDTH)
#define LAYER_WIDTH (3 + 4 * LINEAR_WIDTH)

/* amx.c's matmul, present at level amx only (weak: NULL elsewhere, where no table names FMT_AMX). */
void linear_bf16(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int64_t M, int64_t K, int64_t N,
                 int nthreads) __attribute__((weak));

/* y [M, N] = x [M, K] @ the linear at `rec`^T (+ bias), each part into its columns. */
static void linear(const int64_t *rec, const void *x, void *y, int64_t M, int64_t K, int bf, int nthreads) {
    const int64_t parts = rec[0];
    int64_t N = 0;
    for (int64_t p = 0; p < parts; p++) N += rec[1 + p * PART_WIDTH + 5];
    int64_t at = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t *r = rec + 1 + p * PART_WIDTH;
        const void *data = (const void *)(intptr_t)r[1], *bias = (const void *)(intptr_t)r[6];
        if (r[0] == FMT_AMX)
            linear_bf16(x, data, bias, y, M, K, r[5], nthreads);
        else
            wlinear((int)r[0], x, bf, data, (const float *)(intptr_t)r[2], (const float *)(intptr_t)r[3], r[4], bias,
                    (char *)y + at * (bf ? 2 : 4), bf, N, M, K, r[5], nthreads);
        at += r[5];
    }
}

static void layers(void *x, void *h, const int64_t *table, int64_t n_layers, void *k_cache, void *v_cache,
                   int64_t layer_stride, const float *cos_table, const float *sin_table, const int64_t *pos,
                   const int64_t *kv_index, const int64_t *tables, int64_t table_width, int64_t page_size,
                   const int64_t *seq, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t hidden,
                   int64_t inter, float eps, int64_t max_len, void *qkv, void *q, void *o, void *proj, void *gu,
                   void *act, float *att_scratch, int nthreads, int bf, int kbf) {
    const size_t kel = kbf ? 2 : 4; /* the caches' */
#define NORM(i, k) ((const void *)(intptr_t)table[(i) * LAYER_WIDTH + (k)])
#define LINEAR(i, j) (table + (i) * LAYER_WIDTH + 3 + (j) * LINEAR_WIDTH)
#define SFX(name) (bf ? name##_bf16 : name##_f32)
#define KV_SFX(name) (bf ? name##_bf16 : kbf ? name##_f32_kvbf16 : name##_f32)
    SFX(add_rmsnorm)(x, NULL, NORM(0, 0), h, tokens, hidden, eps, nthreads);
    for (int64_t i = 0; i < n_layers; i++) {
        char *kc = (char *)k_cache + i * layer_stride * kel, *vc = (char *)v_cache + i * layer_stride * kel;
        linear(LINEAR(i, 0), h, qkv, tokens, hidden, bf, nthreads);
        KV_SFX(rope_kv)(qkv, cos_table, sin_table, pos, kv_index, kc, vc, q, tokens, heads, kv_heads, D, page_size,
                     nthreads);
        KV_SFX(attention)(q, kc, vc, tables, table_width, page_size, seq, pos, o, tokens, heads, kv_heads, D, max_len,
                       att_scratch, nthreads);
        linear(LINEAR(i, 1), o, proj, tokens, heads * D, bf, nthreads);
        SFX(add_rmsnorm)(x, proj, NORM(i, 1), h, tokens, hidden, eps, nthreads);
        linear(LINEAR(i, 2), h, gu, tokens, hidden, bf, nthreads);
        SFX(silu_mul)(gu, act, tokens, inter, nthreads);
        linear(LINEAR(i, 3), act, proj, tokens, inter, bf, nthreads);
        SFX(add_rmsnorm)(x, proj, NORM(i, 2), h, tokens, hidden, eps, nthreads);
    }
#undef SFX
#undef KV_SFX
#undef LINEAR
#undef NORM
}

#define EXPORT(SFX, BF, KBF)                                                                                        \
    void layers_##SFX(void *x, void *h, const int64_t *table, int64_t n_layers, void *k_cache, void *v_cache,    \
                      int64_t layer_stride, const float *cos_table, const float *sin_table, const int64_t *pos,  \
                      const int64_t *kv_index, const int64_t *tables, int64_t table_width, int64_t page_size,    \
                      const int64_t *seq, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D,            \
                      int64_t hidden, int64_t inter, float eps, int64_t max_len, void *qkv, void *q, void *o,    \
                      void *proj, void *gu, void *act, float *att_scratch, int nthreads) {                       \
        layers(x, h, table, n_layers, k_cache, v_cache, layer_stride, cos_table, sin_table, pos, kv_index,       \
               tables, table_width, page_size, seq, tokens, heads, kv_heads, D, hidden, inter, eps, max_len,     \
               qkv, q, o, proj, gu, act, att_scratch, nthreads, BF, KBF);                                             \
    }

EXPORT(bf16, 1, 1)
EXPORT(f32, 0, 0)
EXPORT(f32_kvbf16, 0, 1)
