/* The paged KV cache's layout (gpu_worker/kv_cache.py): a layer's keys (and values) [pages, kv_heads,
 * page_size, D], so that one kv head's rows in a page are contiguous (an attention item reads one
 * kv head: with [pages, page_size, kv_heads, D] it read one row in kv_heads and streamed from memory
 * 1.1-1.3x slower, BENCHMARKS.md "Pages by kv head"). A token's slot is the engine's kv_index:
 * page * page_size + offset. */
#pragma once
#include <stdint.h>

/* The row, in rows of D elements, of kv head kh of slot `slot`. */
static inline int64_t kv_row(int64_t slot, int64_t kh, int64_t kv_heads, int64_t page_size) {
    return (slot / page_size * kv_heads + kh) * page_size + slot % page_size;
}
