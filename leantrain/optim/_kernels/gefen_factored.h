/*
 * A factored second moment's denominators (included by gefen_step.c;
 * leantrain/optim/factored.py is the reference: the same bits).
 */
#ifndef LT_GEFEN_FACTORED_H
#define LT_GEFEN_FACTORED_H
#include <math.h>
#include <stdint.h>

/* A factored second moment's denominator factors for this step
   (factored.denominator_factors): a[i] = sqrt(r[i] / cbar) / sqrt_bc2 (0 while
   cbar is 0) and b[j] = sqrt(c[j]), so that sqrt(v_ij) / sqrt_bc2 = a[i] * b[j]
   with v_ij = r[i] c[j] / cbar. Why: one multiply per element instead of a
   division, a square root and another division (the 8-bit default step on a 29 M
   stack, 1 thread: about a sixth of its time). */
typedef struct {
  const float *a, *b;
  int64_t cols;
} lt_factors;

/* a and b from the factors r (rows) and c (cols), after this step's EMA. */
static void lt_factor_scales(const float *restrict r, const float *restrict c,
                             int64_t rows, int64_t cols, float cbar, float sqrt_bc2,
                             float *restrict a, float *restrict b) {
  for (int64_t i = 0; i < rows; i++)
    a[i] = cbar == 0.0f ? 0.0f : sqrtf(r[i] / cbar) / sqrt_bc2;
  for (int64_t j = 0; j < cols; j++) b[j] = sqrtf(c[j]);
}

/* The update's denominators of elements [e0, e0 + len): a[i] * b[j] + eps, two
   roundings as in torch, row by row. */
static void lt_factor_tile(const lt_factors *f, int64_t e0, int64_t len, float eps,
                           float *restrict out) {
  int64_t i = e0 / f->cols, j = e0 % f->cols, k = 0;
  while (k < len) {
    const int64_t run = f->cols - j < len - k ? f->cols - j : len - k;
    const float ai = f->a[i];
    const float *restrict b = f->b + j;
    for (int64_t t = 0; t < run; t++) out[k + t] = ai * b[t] + eps;
    k += run, j = 0, i++;
  }
}

#endif /* LT_GEFEN_FACTORED_H */
