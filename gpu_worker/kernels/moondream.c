/* Moondream's portable kernels, written over vec.h's `vf`, built at every level (its AMX attention
 * is in amx.c). */
#include "kv_cache.h"
#include "vec.h"

/* Moondream's rotary and cache write in one pass over the fused qkv rows [T, (H + 2 Hkv) D] at
 * positions pos[t]: of each q and k head, the first `rot` dims rotated (their halves as real and
 * imaginary parts, written interleaved), in float32 and rounded to bf16 once, the rest copied
 * (as apply_partial_rope: the same bits); q -> q_out [T, H, D], k and v -> slot kv_index[t] of the
 * caches [pages, Hkv, page_size, D]. Tables cos_t, sin_t [positions, rot / 2] float32. */
void partial_rope_kv_bf16(const bf16 *qkv, const float *cos_t, const float *sin_t, const int64_t *pos,
                          const int64_t *kv_index, bf16 *k_cache, bf16 *v_cache, bf16 *q_out, int64_t T, int64_t H,
                          int64_t Hkv, int64_t D, int64_t rot, int64_t page_size, int nthreads) {
    const int64_t half = rot / 2, row = (H + 2 * Hkv) * D;
#pragma omp parallel for num_threads(nthreads) if (T * row >= PAR_MIN)
    for (int64_t t = 0; t < T; t++) {
        const bf16 *src = qkv + t * row;
        const float *ct = cos_t + pos[t] * half, *st = sin_t + pos[t] * half;
        for (int64_t hh = 0; hh < H + Hkv; hh++) {
            const bf16 *x = src + hh * D;
            bf16 *dst = hh < H ? q_out + (t * H + hh) * D : k_cache + kv_row(kv_index[t], hh - H, Hkv, page_size) * D;
            for (int64_t i = 0; i < half; i += VW) {
                const int64_t n = half - i;
                const vf re = v_load(x, i, n, 1), im = v_load(x, half + i, n, 1);
                const vf c = v_load(ct, i, n, 0), s = v_load(st, i, n, 0);
                vf lo, hi;
                v_zip(v_sub(v_mul(re, c), v_mul(im, s)), v_add(v_mul(re, s), v_mul(im, c)), &lo, &hi);
                v_store(dst, 2 * i, 2 * n, lo, 1);
                if (2 * n > VW) v_store(dst, 2 * i + VW, 2 * n - VW, hi, 1);
            }
            memcpy(dst + rot, x + rot, (size_t)(D - rot) * 2);
        }
        for (int64_t kh = 0; kh < Hkv; kh++)
            memcpy(v_cache + kv_row(kv_index[t], kh, Hkv, page_size) * D, src + (H + Hkv + kh) * D, (size_t)D * 2);
    }
}
