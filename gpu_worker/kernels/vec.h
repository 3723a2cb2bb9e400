/* The vector layer every kernel is written over: `vf`, VW float32 lanes, and the v_* ops on it.
 *
 * One build per ISA level (gpu_worker/cpu_kernels.py compiles every kernels/ *.c with the
 * level's flags and picks the library at run time); this header turns the compiler's flags
 * into the level's VW:
 *
 *   VW 16  AVX-512 F+BW+VL+DQ  (levels avx512, avx512_bf16, amx)
 *   VW 8   AVX2 + FMA + F16C   (level avx2)
 *   VW 4   NEON                (aarch64, level neon)
 *   VW 1   plain C             (level scalar)
 *
 * A load or store takes `n` elements (n < VW: the tail of a row; lanes past it load as 0 and
 * are never stored) of bf16 or float32 memory (`bf`). Each op rounds as float32 does at every
 * level, so a kernel's results differ between levels only by the order of its sums. gcc does
 * not reliably vectorize loops that mix bf16 bit tricks with float math, hence the intrinsics.
 */
#pragma once
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
 * (a select, not a jump), so loops over it vectorize. Every level's v_store rounds the same way. */
static inline bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
/* ---- VW 16: AVX-512 ---- */
#include <immintrin.h>
#define VW 16
typedef __m512 vf;
static inline __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }
static inline vf v_load(const void *p, int64_t i, int64_t n, int bf) {
    if (bf) {
        const __m256i h = _mm256_maskz_loadu_epi16(mask16(n), (const bf16 *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(mask16(n), (const float *)p + i);
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
    if (bf) _mm256_mask_storeu_epi16((bf16 *)p + i, mask16(n), _mm512_cvtepi32_epi16(v_bf16_bits(v)));
    else _mm512_mask_storeu_ps((float *)p + i, mask16(n), v);
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
static inline float v_max_of(vf a, int64_t n) { return _mm512_mask_reduce_max_ps(mask16(n), a); }
static inline vf v_pow2i(vf n) { /* 2^n for integral n >= -126 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
/* a, b -> a0 b0 a1 b1 ... (lo: the first VW of them, hi: the rest). */
static inline void v_zip(vf a, vf b, vf *lo, vf *hi) {
    *lo = _mm512_permutex2var_ps(a, _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), b);
    *hi = _mm512_permutex2var_ps(a, _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8), b);
}
/* The lane sums of VW vectors: lane j of the result is the sum of d[j]'s lanes. Four rounds of
 * pairwise shuffles and adds (unpack 32-bit, unpack 64-bit, then 128-bit lanes twice): 30
 * shuffles for sixteen sums, where sixteen separate reductions take 64. */
static inline vf v_sums(const vf d[16]) {
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

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* ---- VW 8: AVX2 + FMA. AVX2 has masked float loads and stores but no 16-bit ones: a bf16 tail
 * goes through an 8-lane buffer. ---- */
#include <immintrin.h>
#define VW 8
typedef __m256 vf;
static inline __m256i mask8(int64_t n) { /* lanes < n all ones */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf v_load(const void *p, int64_t i, int64_t n, int bf) {
    if (bf) {
        const bf16 *src = (const bf16 *)p + i;
        __m128i h;
        if (n >= 8) h = _mm_loadu_si128((const __m128i *)src);
        else {
            bf16 buf[8] = {0};
            memcpy(buf, src, (size_t)n * 2);
            h = _mm_loadu_si128((const __m128i *)buf);
        }
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* vpmovzxwd + shift */
    }
    return n >= 8 ? _mm256_loadu_ps((const float *)p + i) : _mm256_maskload_ps((const float *)p + i, mask8(n));
}
static inline __m256i v_bf16_bits(vf v) {
    const __m256i u = _mm256_castps_si256(v), hi = _mm256_srli_epi32(u, 16);
    const __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}
static inline vf v_round(vf v, int bf) {
    return bf ? _mm256_castsi256_ps(_mm256_slli_epi32(v_bf16_bits(v), 16)) : v;
}
static inline void v_store(void *p, int64_t i, int64_t n, vf v, int bf) {
    if (bf) {
        const __m256i bits = v_bf16_bits(v); /* < 2^16: the unsigned-saturating pack is exact */
        const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08));
        bf16 *dst = (bf16 *)p + i;
        if (n >= 8) _mm_storeu_si128((__m128i *)dst, h);
        else {
            bf16 buf[8];
            _mm_storeu_si128((__m128i *)buf, h);
            memcpy(dst, buf, (size_t)n * 2);
        }
    } else if (n >= 8) _mm256_storeu_ps((float *)p + i, v);
    else _mm256_maskstore_ps((float *)p + i, mask8(n), v);
}
static inline vf v_set(float x) { return _mm256_set1_ps(x); }
static inline vf v_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf v_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf v_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline float v_sum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float v_max_of(vf a, int64_t n) {
    a = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), a, _mm256_castsi256_ps(mask8(n)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline vf v_pow2i(vf n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline void v_zip(vf a, vf b, vf *lo, vf *hi) { /* unpack works within 128-bit halves */
    const vf l = _mm256_unpacklo_ps(a, b), h = _mm256_unpackhi_ps(a, b);
    *lo = _mm256_permute2f128_ps(l, h, 0x20);
    *hi = _mm256_permute2f128_ps(l, h, 0x31);
}
/* The lane sums of 8 vectors (as the AVX-512 v_sums, one round fewer): 12 shuffles. */
static inline vf v_sums(const vf d[8]) {
    __m256 e[4], f[2];
    for (int i = 0; i < 4; i++)
        e[i] = _mm256_add_ps(_mm256_unpacklo_ps(d[2 * i], d[2 * i + 1]), _mm256_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d a = _mm256_castps_pd(e[2 * i]), b = _mm256_castps_pd(e[2 * i + 1]);
        f[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(f[0], f[1], 0x20), _mm256_permute2f128_ps(f[0], f[1], 0x31));
}

#elif defined(__ARM_NEON) && defined(__aarch64__)
/* ---- VW 4: NEON (every aarch64 CPU). No masked loads: a tail goes through a 4-lane buffer. ---- */
#include <arm_neon.h>
#define VW 4
typedef float32x4_t vf;
static inline vf v_load(const void *p, int64_t i, int64_t n, int bf) {
    if (bf) {
        const bf16 *src = (const bf16 *)p + i;
        bf16 buf[4] = {0};
        if (n < 4) memcpy(buf, src, (size_t)n * 2), src = buf;
        return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(src)), 16));
    }
    const float *src = (const float *)p + i;
    float buf[4] = {0};
    if (n < 4) memcpy(buf, src, (size_t)n * 4), src = buf;
    return vld1q_f32(src);
}
static inline uint32x4_t v_bf16_bits(vf v) {
    const uint32x4_t u = vreinterpretq_u32_f32(v), hi = vshrq_n_u32(u, 16);
    const uint32x4_t odd = vandq_u32(hi, vdupq_n_u32(1));
    const uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16);
    return vbslq_u32(vmvnq_u32(vceqq_f32(v, v)), vorrq_u32(hi, vdupq_n_u32(0x40)), r);
}
static inline vf v_round(vf v, int bf) { return bf ? vreinterpretq_f32_u32(vshlq_n_u32(v_bf16_bits(v), 16)) : v; }
static inline void v_store(void *p, int64_t i, int64_t n, vf v, int bf) {
    if (bf) {
        const uint16x4_t h = vmovn_u32(v_bf16_bits(v));
        if (n >= 4) vst1_u16((bf16 *)p + i, h);
        else {
            bf16 buf[4];
            vst1_u16(buf, h);
            memcpy((bf16 *)p + i, buf, (size_t)n * 2);
        }
    } else if (n >= 4) vst1q_f32((float *)p + i, v);
    else {
        float buf[4];
        vst1q_f32(buf, v);
        memcpy((float *)p + i, buf, (size_t)n * 4);
    }
}
static inline vf v_set(float x) { return vdupq_n_f32(x); }
static inline vf v_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf v_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf v_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf v_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf v_max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf v_min(vf a, vf b) { return vminq_f32(a, b); }
static inline float v_sum(vf a) { return vaddvq_f32(a); }
static inline float v_max_of(vf a, int64_t n) {
    const uint32x4_t keep = vcltq_u32((uint32x4_t){0, 1, 2, 3}, vdupq_n_u32((uint32_t)(n < 4 ? n : 4)));
    return vmaxvq_f32(vbslq_f32(keep, a, vdupq_n_f32(-INFINITY)));
}
static inline vf v_pow2i(vf n) {
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23));
}
static inline void v_zip(vf a, vf b, vf *lo, vf *hi) {
    *lo = vzip1q_f32(a, b);
    *hi = vzip2q_f32(a, b);
}
static inline vf v_sums(const vf d[4]) { return vpaddq_f32(vpaddq_f32(d[0], d[1]), vpaddq_f32(d[2], d[3])); }

#else
/* ---- VW 1: plain C (portable, slow). ---- */
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
static inline float v_max_of(vf a, int64_t n) { return n > 0 ? a : -INFINITY; }
static inline vf v_pow2i(vf n) {
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline void v_zip(vf a, vf b, vf *lo, vf *hi) {
    *lo = a;
    *hi = b;
}
static inline vf v_sums(const vf d[1]) { return d[0]; }
#endif

/* ---- Built on the ops above: the same code at every level. ---- */

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
 * 32-stream step over 65536, BENCHMARKS.md "The AMX matmul and the layers in one C call"). */
#define PAR_MIN 4096

/* OpenMP outlines a parallel loop's body before an `is_bf16` constant reaches it, so each loop
 * calls a per-row function with a literal flag (`bf ? row(.., 1) : row(.., 0)`): two
 * specialised copies. */
#define SPECIALISE(bf, call_with) ((bf) ? call_with(1) : call_with(0))
/* The same for an activations' and a KV cache's type (bf16 activations always have a bf16 cache). */
#define SPECIALISE_KV(bf, kbf, call_with) ((bf) ? call_with(1, 1) : (kbf) ? call_with(0, 1) : call_with(0, 0))
