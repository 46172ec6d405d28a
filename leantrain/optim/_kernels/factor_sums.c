/*
 * Row and column means of g^2 for Gefen's factored second moment (leantrain;
 * leantrain/optim/factored.py calls it through ctypes before the step kernel).
 *
 * One read of the gradient, no full-size temporaries: torch needs a squared copy
 * and two reductions over it (three passes). Sums run in double and are rounded to fp32 once, so the means are
 * as close to exact as fp32 can hold, whatever the matrix size.
 *
 * Deterministic whatever the thread count: the rows are cut into `nchunks` fixed
 * chunks (the caller's choice, from the shape only); each chunk writes its rows'
 * sums and its own column partial sums (into `scratch`, nchunks x cols doubles),
 * and the column sums add those partials in chunk order. Threads only decide who
 * computes which chunk.
 */
#include <stdint.h>
#include <string.h>

static inline float lt_load(const void *g, int32_t bf16, int64_t k) {
  if (!bf16) return ((const float *)g)[k];
  uint32_t bits = (uint32_t)((const uint16_t *)g)[k] << 16;
  float x;
  memcpy(&x, &bits, sizeof x);
  return x;
}

/* 0 on success, -1 on bad arguments. g: rows x cols, contiguous, fp32 (bf16 = 0)
   or bf16 (bf16 = 1). row_means [rows], col_means [cols]: fp32 outputs. */
int lt_factor_means(const void *g, int32_t bf16, int64_t rows, int64_t cols,
                    int64_t nchunks, double *scratch, float *row_means,
                    float *col_means, int32_t nthreads) {
  if (rows < 1 || cols < 1 || nchunks < 1 || nchunks > rows) return -1;
  if (nthreads < 1) nthreads = 1;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic) if (nthreads > 1)
  for (int64_t k = 0; k < nchunks; k++) {
    double *restrict part = scratch + k * cols;
    for (int64_t j = 0; j < cols; j++) part[j] = 0.0;
    const int64_t r0 = k * rows / nchunks, r1 = (k + 1) * rows / nchunks;
    for (int64_t i = r0; i < r1; i++) {
      const int64_t base = i * cols;
      double s = 0.0;
      if (!bf16) {
        const float *restrict x = (const float *)g + base;
#pragma omp simd reduction(+ : s)
        for (int64_t j = 0; j < cols; j++) {
          const double sq = (double)x[j] * (double)x[j];
          part[j] += sq;
          s += sq;
        }
      } else {
        for (int64_t j = 0; j < cols; j++) {
          const double v = (double)lt_load(g, 1, base + j), sq = v * v;
          part[j] += sq;
          s += sq;
        }
      }
      row_means[i] = (float)(s / (double)cols);
    }
  }
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1)
  for (int64_t j = 0; j < cols; j++) {
    double s = 0.0;
    for (int64_t k = 0; k < nchunks; k++) s += scratch[k * cols + j];
    col_means[j] = (float)(s / (double)rows);
  }
  return 0;
}
