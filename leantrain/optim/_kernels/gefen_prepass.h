/*
 * The first phase of lt_gefen_step_many (included by gefen_step.c after lt_job):
 * one read of every gradient before any state changes, for two things the
 * element loop cannot do block by block:
 *
 *   - a factored second moment's row and column means of g^2 (its v needs the
 *     column means of the whole gradient; leantrain/optim/factored.py is the
 *     reference), and
 *   - the non-finite check: a factored gradient's rows are summed in double, where
 *     a finite fp32 or bf16 square never overflows, so a non-finite row sum is
 *     exactly a NaN or an infinity in that row; other gradients' exponent bits are
 *     tested (as finite.c) in the same parallel loop.
 *
 * Then, still before the element loop and only when every gradient is finite:
 * the step counters, the per-step scalars and rounding keys of jobs that ask for
 * them (lt_job.step), the factors' EMA and their column mean cbar.
 *
 * Deterministic whatever the thread count: each factored job's rows are cut into
 * chunks fixed by its shape (factored._native_means uses the same formula); each
 * chunk writes its own row sums and column partial sums, and the column sums add
 * the partials in chunk order.
 */
#ifndef LT_GEFEN_PREPASS_H
#define LT_GEFEN_PREPASS_H
#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LT_FINITE_PIECE 65536 /* elements per finite-check task */
#define LT_COLUMN_PIECE 4096  /* columns per column-sum task */

static int64_t lt_min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t lt_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Row chunks of a rows x cols factored gradient: enough to share among threads,
   at most 64, and (chunks x cols) doubles of scratch of at most 4 MiB unless a
   single row is longer. The same formula as factored._native_means. */
static int64_t lt_factor_chunks(int64_t rows, int64_t cols) {
  return lt_min64(lt_min64(rows, 64),
                  lt_min64(lt_max64(1, rows * cols / 65536), lt_max64(1, 524288 / cols)));
}

/* Does this job's prepass sum its factors? (else, with `check`, test its bits) */
static int lt_sums_factors(const lt_job *j) { return j->rows > 0 && !j->advanced; }

#ifdef __AVX512F__
/* R <= 4 consecutive fp32 rows x of the chunk below at once: R read streams in one
   loop (one stream per loop left this pass waiting on memory) and one load and
   store of part per R rows. The same sums, in
   the same order, as the `omp simd` loop of lt_factor_chunk compiles to with gcc
   on x86-64 (8 double lanes): part[c] gets the rows in order; a row's sum keeps
   element c in lane c mod 8 below the last multiple of 8, the rest added into lane
   0 in order, and the lanes are added 0..7 onto 0.0. */
static inline void lt_factor_rows_avx512(const float *restrict x, int64_t cols, int R,
                                         double *restrict part, double *restrict rsum) {
  __m512d acc[4];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_pd();
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    __m512d p = _mm512_loadu_pd(part + c);
    for (int r = 0; r < R; r++) {
      const __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + r * cols + c));
      const __m512d sq = _mm512_mul_pd(v, v);
      p = _mm512_add_pd(p, sq);
      acc[r] = _mm512_add_pd(acc[r], sq);
    }
    _mm512_storeu_pd(part + c, p);
  }
  for (int r = 0; r < R; r++) {
    double lane[8];
    _mm512_storeu_pd(lane, acc[r]);
    for (int64_t t = c; t < cols; t++) {
      const double v = (double)x[r * cols + t], sq = v * v;
      part[t] += sq;
      lane[0] += sq;
    }
    double s = 0.0;
    for (int l = 0; l < 8; l++) s += lane[l];
    rsum[r] = s;
  }
}
#endif

/* Rows [r0, r1) of a factored gradient: row sums of g^2 into rsum, column partial
   sums into part (cols doubles, zeroed here). */
static void lt_factor_chunk(const void *grad, int bf16, int64_t cols, int64_t r0,
                            int64_t r1, double *restrict rsum, double *restrict part) {
  for (int64_t c = 0; c < cols; c++) part[c] = 0.0;
#ifdef __AVX512F__
  if (!bf16) {
    const float *g = (const float *)grad;
    int64_t i = r0;
    for (; i + 4 <= r1; i += 4) lt_factor_rows_avx512(g + i * cols, cols, 4, part, rsum + i);
    for (; i < r1; i++) lt_factor_rows_avx512(g + i * cols, cols, 1, part, rsum + i);
    return;
  }
#endif
  for (int64_t i = r0; i < r1; i++) {
    double s = 0.0;
    if (!bf16) {
      const float *restrict x = (const float *)grad + i * cols;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < cols; c++) {
        const double sq = (double)x[c] * (double)x[c];
        part[c] += sq;
        s += sq;
      }
    } else {
      const uint16_t *restrict x = (const uint16_t *)grad + i * cols;
      for (int64_t c = 0; c < cols; c++) {
        const double v = (double)lt_bf16_to_float(x[c]), sq = v * v;
        part[c] += sq;
        s += sq;
      }
    }
    rsum[i] = s;
  }
}

/* 1 when elements [a, a + len) of a gradient are all finite (exponent bits). An
   fp32 piece is read as four interleaved quarters, four read streams in one loop,
   as the factor sums read four rows: one stream waits on memory. */
static int lt_piece_finite(const void *grad, int bf16, int64_t a, int64_t len) {
  int bad = 0;
  if (!bf16) {
    const uint32_t *restrict u = (const uint32_t *)grad + a;
    const int64_t q = len / 4;
    const uint32_t *restrict u1 = u + q, *restrict u2 = u + 2 * q, *restrict u3 = u + 3 * q;
    for (int64_t k = 0; k < q; k++)
      bad |= ((u[k] & 0x7f800000u) == 0x7f800000u) | ((u1[k] & 0x7f800000u) == 0x7f800000u) |
             ((u2[k] & 0x7f800000u) == 0x7f800000u) | ((u3[k] & 0x7f800000u) == 0x7f800000u);
    for (int64_t k = 4 * q; k < len; k++) bad |= (u[k] & 0x7f800000u) == 0x7f800000u;
  } else {
    const uint16_t *restrict u = (const uint16_t *)grad + a;
    for (int64_t k = 0; k < len; k++) bad |= (u[k] & 0x7f80u) == 0x7f80u;
  }
  return !bad;
}

/* splitmix64, leantrain.optim.precision._splitmix64 */
static uint64_t lt_splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Advances a job's step counter and derives its scalars and keys from it, as
   _fused.hyperparameters, precision.rounding_key and code_rounding.code_key do
   (in double, rounded to fp32 once: the same bits). */
static void lt_advance_step(const lt_job *j) {
  const lt_opts *o = j->opts;
  const float step = *j->step + 1.0f; /* the fp32 counter's own increment */
  *j->step = step;
  const double t = (double)step;
  lt_hyper *h = j->h;
  h->w1 = (float)(1.0 - o->beta1);
  h->beta2 = (float)o->beta2;
  h->omb2 = (float)(1.0 - o->beta2);
  h->decay = (float)(1.0 - o->lr * o->weight_decay);
  h->step_size = (float)(o->lr / (1.0 - pow(o->beta1, t)));
  h->sqrt_bc2 = (float)sqrt(1.0 - pow(o->beta2, t));
  h->eps = (float)o->eps;
  h->sign = o->maximize ? -1.0f : 1.0f;
  h->max_step = (float)o->max_step;
  const uint64_t key = lt_splitmix64(lt_splitmix64((uint64_t)j->seed) ^ (uint64_t)(int64_t)t);
  j->io->key = key;
  j->io->code_key = lt_splitmix64(key ^ 0xc0de5eed5a17ed01ull);
}

/* The factors' EMA from the sums (torch's mul_(beta2).add_(x, alpha=1 - beta2):
   a rounded product, then a fused multiply-add) and their column mean. */
static float lt_advance_factors(const lt_job *j, const double *rsum, const double *csum) {
  const lt_hyper *h = j->h;
  const int64_t rows = j->rows, cols = j->n / rows;
  float *restrict r = j->v, *restrict c = j->v + rows;
  for (int64_t i = 0; i < rows; i++)
    r[i] = fmaf(h->omb2, (float)(rsum[i] / (double)cols), r[i] * h->beta2);
  double total = 0.0;
  for (int64_t k = 0; k < cols; k++) {
    c[k] = fmaf(h->omb2, (float)(csum[k] / (double)rows), c[k] * h->beta2);
    total += (double)c[k];
  }
  return (float)(total / (double)cols);
}

/* The whole first phase. cbar[i] receives job i's column mean (its own when the
   caller advanced its factors). With `check`, returns 1 + the index of the first
   job whose gradient is not finite, and then nothing was changed; 0 when all are
   finite (or unchecked) and the phase is done; -6 when its buffers do not fit. */
static int64_t lt_prepass(const lt_job *jobs, int32_t count, int check, int nt,
                          float *cbar) {
  int64_t *task0 = malloc(sizeof(int64_t) * (size_t)(count + 1)); /* first tasks */
  int64_t *col0 = malloc(sizeof(int64_t) * (size_t)(count + 1));  /* column tasks */
  int64_t *sum0 = malloc(sizeof(int64_t) * (size_t)(count + 1));  /* sum offsets */
  if (!task0 || !col0 || !sum0) {
    free(task0), free(col0), free(sum0);
    return -6;
  }
  task0[0] = col0[0] = sum0[0] = 0;
  for (int32_t i = 0; i < count; i++) {
    const lt_job *j = jobs + i;
    int64_t tasks = 0, ctasks = 0, sums = 0;
    if (lt_sums_factors(j)) {
      const int64_t cols = j->n / j->rows, chunks = lt_factor_chunks(j->rows, cols);
      tasks = chunks;
      ctasks = (cols + LT_COLUMN_PIECE - 1) / LT_COLUMN_PIECE;
      sums = j->rows + cols + chunks * cols; /* row sums, column sums, partials */
    } else if (check) {
      tasks = (j->n + LT_FINITE_PIECE - 1) / LT_FINITE_PIECE;
    }
    task0[i + 1] = task0[i] + tasks;
    col0[i + 1] = col0[i] + ctasks;
    sum0[i + 1] = sum0[i] + sums;
  }
  const int64_t ntasks = task0[count], ncol = col0[count];
  double *sums = malloc(sizeof(double) * (size_t)(sum0[count] > 0 ? sum0[count] : 1));
  char *ok = malloc((size_t)(ntasks > 0 ? ntasks : 1));
  if (!sums || !ok) {
    free(task0), free(col0), free(sum0), free(sums), free(ok);
    return -6;
  }
  const int threads = nt > 1 && ntasks > 1 ? nt : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; t++) {
      int32_t lo = 0, hi = count - 1; /* the job holding task t */
      while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (task0[mid] <= t) lo = mid; else hi = mid - 1;
      }
      const lt_job *j = jobs + lo;
      const int64_t k = t - task0[lo];
      const int bf16 = j->io->grad_bf16;
      if (lt_sums_factors(j)) {
        const int64_t rows = j->rows, cols = j->n / rows;
        const int64_t chunks = task0[lo + 1] - task0[lo];
        double *base = sums + sum0[lo];
        lt_factor_chunk(j->grad, bf16, cols, k * rows / chunks, (k + 1) * rows / chunks,
                        base, base + rows + cols + k * cols);
        ok[t] = 1;
      } else {
        const int64_t a = k * LT_FINITE_PIECE;
        ok[t] = (char)lt_piece_finite(j->grad, bf16, a, lt_min64(LT_FINITE_PIECE, j->n - a));
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ncol; t++) { /* column sums: the partials in chunk order */
      int32_t lo = 0, hi = count - 1;
      while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (col0[mid] <= t) lo = mid; else hi = mid - 1;
      }
      const lt_job *j = jobs + lo;
      const int64_t rows = j->rows, cols = j->n / rows;
      const int64_t chunks = task0[lo + 1] - task0[lo];
      double *base = sums + sum0[lo], *csum = base + rows, *part = csum + cols;
      const int64_t c0 = (t - col0[lo]) * LT_COLUMN_PIECE;
      const int64_t c1 = lt_min64(c0 + LT_COLUMN_PIECE, cols);
      for (int64_t c = c0; c < c1; c++) {
        double s = 0.0;
        for (int64_t k = 0; k < chunks; k++) s += part[k * cols + c];
        csum[c] = s;
      }
    }
  }
  int64_t bad = 0;
  for (int32_t i = 0; i < count && check && !bad; i++) {
    const lt_job *j = jobs + i;
    if (lt_sums_factors(j)) {
      const double *rsum = sums + sum0[i];
      for (int64_t r = 0; r < j->rows; r++)
        if (!isfinite(rsum[r])) {
          bad = 1 + i;
          break;
        }
    } else {
      for (int64_t t = task0[i]; t < task0[i + 1]; t++)
        if (!ok[t]) {
          bad = 1 + i;
          break;
        }
    }
  }
  if (!bad) {
    for (int32_t i = 0; i < count; i++) {
      const lt_job *j = jobs + i;
      if (j->step) lt_advance_step(j);
      if (lt_sums_factors(j)) {
        const double *base = sums + sum0[i];
        cbar[i] = lt_advance_factors(j, base, base + j->rows);
      } else {
        cbar[i] = j->cbar;
      }
    }
  }
  free(task0), free(col0), free(sum0), free(sums), free(ok);
  return bad;
}

#endif /* LT_GEFEN_PREPASS_H */
