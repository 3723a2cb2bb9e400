/* quant.c's weight-only linear, for the kernel files that call it (layers.c). */
#pragma once
#include <stdint.h>

enum { FMT_Q8 = 0, FMT_Q4 = 1, FMT_BF16 = 2 }; /* gpu_worker/quant.py's FORMATS */

void wlinear(int fmt, const void *x, int x_bf, const void *w, const float *scale, const float *offset, int64_t G,
             const float *bias, void *y, int y_bf, int64_t ldy, int64_t M, int64_t K, int64_t N, int nthreads);
