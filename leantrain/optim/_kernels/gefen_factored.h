/*
 * The factored second moment's per-element v (included by gefen_step.c;
 * leantrain/optim/factored.py is the reference: the same bits).
 */
#ifndef LT_GEFEN_FACTORED_H
#define LT_GEFEN_FACTORED_H
#include <stdint.h>
#include <string.h>

/* A factored second moment (leantrain/optim/factored.py): row factors r, column
   factors c (already updated for this step) and the column mean cbar. */
typedef struct {
  const float *r, *c;
  int64_t cols;
  float cbar;
} lt_factors;

/* v of elements [e0, e0 + len): (r[i] * c[j]) / cbar, two roundings as in torch
   (0 while cbar is 0), row by row. */
static void lt_factor_tile(const lt_factors *f, int64_t e0, int64_t len,
                           float *restrict out) {
  int64_t i = e0 / f->cols, j = e0 % f->cols, k = 0;
  while (k < len) {
    const int64_t run = f->cols - j < len - k ? f->cols - j : len - k;
    const float ri = f->r[i], cbar = f->cbar;
    const float *restrict c = f->c + j;
    if (cbar == 0.0f)
      memset(out + k, 0, (size_t)run * sizeof(float));
    else
      for (int64_t t = 0; t < run; t++) out[k + t] = (ri * c[t]) / cbar;
    k += run, j = 0, i++;
  }
}

#endif /* LT_GEFEN_FACTORED_H */
