/* fused.c's entry points that other kernel files call (layers.c runs them between its linears),
 * one per element type: <name>_bf16 and <name>_f32; rope_kv and attention also over bf16 caches
 * with float32 activations: <name>_f32_kvbf16. */
#pragma once
#include <stdint.h>

#define FUSED_DECLARE(SFX)                                                                                       \
    void add_rmsnorm_##SFX(void *x, const void *y, const void *w, void *h, int64_t rows, int64_t dim, float eps, \
                           int nthreads);                                                                        \
    void silu_mul_##SFX(const void *gate_up, void *out, int64_t rows, int64_t inter, int nthreads);
#define FUSED_DECLARE_KV(SFX)                                                                                    \
    void rope_kv_##SFX(const void *qkv, const float *cos_table, const float *sin_table, const int64_t *pos,     \
                       const int64_t *kv_index, void *k_cache, void *v_cache, void *q_out, int64_t tokens,       \
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t page_size, int nthreads);      \
    void attention_##SFX(const void *q, const void *k_cache, const void *v_cache, const int64_t *tables,        \
                         int64_t table_width, int64_t page_size, const int64_t *seq, const int64_t *pos,         \
                         void *out, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t D, int64_t max_len, \
                         float *scratch, int nthreads);

FUSED_DECLARE(bf16)
FUSED_DECLARE(f32)
FUSED_DECLARE_KV(bf16)
FUSED_DECLARE_KV(f32)
FUSED_DECLARE_KV(f32_kvbf16)
#undef FUSED_DECLARE
#undef FUSED_DECLARE_KV
