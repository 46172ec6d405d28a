/*
 * Exact codebook dynamic program (leantrain/optim/codebook.py), in C.
 *
 * The same problem, costs and tie rules as codebook._solve_fast, so the two give the
 * same optimal cost (to float64 rounding) and the same boundaries where the optimum
 * is unique. Inputs are the float64 prefix sums S0, S1, S2 of c, c*x, c*x^2 over the
 * B non-empty bins (computed once in numpy, so both solvers see the same numbers)
 * and the pinned end costs head[t] (bins [0, t) at -1) and tail[t] ([t, B) at +1).
 *
 *   L_0(t) = head[t];  L_j(t) = min_{s < t} L_{j-1}(s) + W(s, t),  j = 1 .. k-2
 *   W(s, t) = (S2[t] - S2[s]) - (S1[t] - S1[s])^2 / (S0[t] - S0[s])
 *   answer  = min_t L_{k-2}(t) + tail[t]
 *
 * W is Monge, so each layer is solved by divide and conquer over the rows with the
 * split of the middle row bounding the rows above and below, and with the previous
 * layer's split as a further lower bound (Knuth): O(B log B) per layer, in practice
 * much less. The value of a candidate is evaluated exactly as numpy does it,
 * (base[s] - d1*d1/d0) + S2[t] with base = L_{j-1} - S2 (-ffp-contract=off keeps
 * every rounding), and the leftmost minimum wins, so ties break the same way.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LT_DP_TILE 256 /* candidates evaluated per vectorized pass */

typedef struct {
  const double *s0, *s1, *s2, *base; /* base = previous layer's L - S2 */
  double *val;                       /* this layer's L, rows [t_lo, t_hi] */
  int32_t *arg;                      /* this layer's leftmost optimal split */
  const int32_t *lower;              /* previous layer's split (a lower bound) */
} lt_layer;

/* min over s in [a, b] of base[s] - (S1[t]-S1[s])^2 / (S0[t]-S0[s]); leftmost. */
static double lt_row_min(const lt_layer *L, int64_t t, int64_t a, int64_t b,
                         int32_t *best_s) {
  const double t0 = L->s0[t], t1 = L->s1[t];
  double vals[LT_DP_TILE];
  double best = INFINITY;
  int64_t at = a;
  for (int64_t lo = a; lo <= b; lo += LT_DP_TILE) {
    const int64_t len = b - lo + 1 < LT_DP_TILE ? b - lo + 1 : LT_DP_TILE;
    const double *restrict s0 = L->s0 + lo, *restrict s1 = L->s1 + lo;
    const double *restrict base = L->base + lo;
    for (int64_t i = 0; i < len; i++) { /* vectorizes: 4 doubles per AVX2 op */
      const double d0 = t0 - s0[i], d1 = t1 - s1[i];
      vals[i] = base[i] - (d1 * d1) / d0;
    }
    for (int64_t i = 0; i < len; i++) {
      if (vals[i] < best) { /* strict: the leftmost minimum stays */
        best = vals[i];
        at = lo + i;
      }
    }
  }
  *best_s = (int32_t)at;
  return best;
}

/* Rows [r_lo, r_hi], splits known to lie in [s_lo, s_hi]. */
static void lt_dc(const lt_layer *L, int64_t r_lo, int64_t r_hi, int64_t s_lo,
                  int64_t s_hi) {
  while (r_lo <= r_hi) {
    const int64_t mid = r_lo + (r_hi - r_lo) / 2;
    int64_t a = s_lo > L->lower[mid] ? s_lo : L->lower[mid];
    int64_t b = s_hi < mid - 1 ? s_hi : mid - 1;
    if (b < a) b = a;
    int32_t opt;
    const double best = lt_row_min(L, mid, a, b, &opt);
    L->val[mid] = best + L->s2[mid];
    L->arg[mid] = opt;
    /* recurse on the smaller side, loop on the other (stack depth O(log B)) */
    if (mid - r_lo < r_hi - mid) {
      lt_dc(L, r_lo, mid - 1, s_lo, opt);
      r_lo = mid + 1;
      s_lo = opt;
    } else {
      lt_dc(L, mid + 1, r_hi, opt, s_hi);
      r_hi = mid - 1;
      s_hi = opt;
    }
  }
}

/*
 * Solves the DP. s0, s1, s2, head, tail: [n + 1]. bounds: [k + 1] output
 * (0, t_1, ..., t_{k-1}, n). Returns the optimal cost, or NaN when the arguments are
 * invalid (n < k - 1, k < 3) or memory runs out; *status says which (0 = ok).
 */
double lt_codebook_dp(const double *s0, const double *s1, const double *s2,
                      const double *head, const double *tail, int64_t n, int64_t k,
                      int64_t *bounds, int32_t *status) {
  *status = 0;
  if (k < 3 || n < k - 1 || n > INT32_MAX - 1) {
    *status = -1;
    return NAN;
  }
  const int64_t layers = k - 2, w = n + 1;
  double *prev = malloc(sizeof(double) * (size_t)w);
  double *cur = malloc(sizeof(double) * (size_t)w);
  double *base = malloc(sizeof(double) * (size_t)w);
  int32_t *lower = calloc((size_t)w, sizeof(int32_t));
  int32_t *choices = malloc(sizeof(int32_t) * (size_t)(w * layers));
  if (!prev || !cur || !base || !lower || !choices) {
    free(prev), free(cur), free(base), free(lower), free(choices);
    *status = -2;
    return NAN;
  }
  for (int64_t t = 0; t < w; t++) prev[t] = head[t];
  for (int64_t j = 1; j <= layers; j++) {
    const int64_t t_lo = j, t_hi = n - (layers - j);
    int32_t *arg = choices + (j - 1) * w;
    for (int64_t t = 0; t < w; t++) {
      base[t] = prev[t] - s2[t];
      cur[t] = INFINITY;
      arg[t] = 0;
    }
    lt_layer L = {s0, s1, s2, base, cur, arg, lower};
    lt_dc(&L, t_lo, t_hi, 0, t_hi - 1);
    /* splits monotone in t (exact arithmetic gives that; this guards near-ties, as
       codebook._solve_fast does), so they bound the next layer from below */
    for (int64_t t = t_hi - 1; t >= t_lo; t--)
      if (arg[t] > arg[t + 1]) arg[t] = arg[t + 1];
    for (int64_t t = 0; t < w; t++) lower[t] = t <= t_hi ? arg[t] : arg[t_hi];
    double *swap = prev;
    prev = cur;
    cur = swap;
  }
  int64_t best_t = layers;
  double best = INFINITY;
  for (int64_t t = layers; t < w; t++) {
    const double total = prev[t] + tail[t];
    if (total < best) {
      best = total;
      best_t = t;
    }
  }
  bounds[0] = 0;
  bounds[k] = n;
  int64_t t = best_t;
  bounds[k - 1] = t;
  for (int64_t j = layers; j >= 1; j--) {
    t = choices[(j - 1) * w + t];
    bounds[j] = t;
  }
  free(prev), free(cur), free(base), free(lower), free(choices);
  return best;
}
