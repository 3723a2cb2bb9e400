/* quant.c's weight-only linear, for the kernel files that call it (layers.c). */
#pragma once
#include <stdint.h>

enum { FMT_Q8 = 0, FMT_Q4 = 1, FMT_BF16 = 2, FMT_T8 = 4, FMT_T4 = 5 }; /* gpu_worker/quant.py's FORMATS (3: layers.c's AMX) */
enum { FMT_HALF = 8 }; /* or'ed into FMT_T8 / FMT_T4: the scales and offsets are fp16 (quant.py's QWeight.code) */

/* tiled.c: q8 / q4 in tiles of 16 output rows (the levels with VW 16) */
void tlinear(int fmt, const void *x, int x_bf, const void *w, const void *scale, const void *offset, int64_t G,
             const float *bias, void *y, int y_bf, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
void wlinear(int fmt, const void *x, int x_bf, const void *w, const float *scale, const float *offset, int64_t G,
             const float *bias, void *y, int y_bf, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
