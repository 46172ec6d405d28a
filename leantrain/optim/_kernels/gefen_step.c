/*
 * Gefen's fused CPU step for one fp32 or bf16 parameter (leantrain,
 * docs/CONTRACTS.md). Why it exists: CPU speed (one pass per block, one call per
 * step for all parameters); leantrain/optim/_step.py is its oracle.
 *
 * Plain C99 + OpenMP, no torch headers: leantrain/optim/_native.py compiles this file
 * on first use with `gcc -O3 -march=native -fopenmp -ffp-contract=off` and calls it
 * through ctypes with the tensors' data pointers (validated in Python first; the
 * checks here are a second line of defence against memory corruption).
 *
 * One step, per block of `block` contiguous elements (the last block shorter):
 *   v      = beta2 * v + (1 - beta2) * mean_block(g * g)
 *   param *= 1 - lr * weight_decay
 *   m      = lerp(codebook[code] * absmax, g, 1 - beta1)
 *   absmax = max_block |m|;  code = nearest_code(m / absmax)  (absmax 0 -> code of 0)
 *   param -= clip((lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps), lr * update_clip)
 * The update uses the exact new m; only the stored copy is quantized.
 * With period 1 the second moment is per element (and `block` is the absmax block);
 * a factored one's denominator is a[i] * b[j] + eps (gefen_factored.h).
 * With fp32 momentum (bits 0) m = lerp(m, g, 1 - beta1) is stored as is.
 * 4-bit codes are packed two per byte (element 2i in the low nibble) or stored one
 * per byte (lt_io.packed); 8-bit codes one per byte. The math is fp32 throughout: a
 * bf16 gradient or parameter is widened per sub-chunk into a per-thread buffer, and
 * the updated parameter is written back rounded to nearest even, or stochastically
 * with a counter-based hash of (element index, key) (leantrain/optim/precision.py
 * is the reference; the two give the same bits).
 *
 * Work per block: pass 1 reads g and the old codes once, keeps m in a per-thread
 * buffer of `chunk` floats (L1/L2) and reduces sum(g^2) and max|m|; pass 2 quantizes
 * the buffer, stores the codes and updates the parameter. A block longer than the
 * buffer is done in sub-chunks, recomputing m in pass 2 (bit-identical: the same
 * arithmetic), so temporaries never grow with the tensor. Threads take whole blocks
 * (pairs of blocks when 4-bit codes of an odd block length would share a byte),
 * scheduled dynamically.
 *
 * Rounding follows the PyTorch reference op by op: g*g rounded to fp32 then summed
 * (here in double, at least as accurate as torch's cascade sum), torch's fused
 * multiply-add formulas for lerp and `add_(x, alpha)`, and addcdiv's
 * `p + (value * m) / denom`. -ffp-contract=off stops the compiler from fusing any
 * other multiply-add. sqrtf is correctly rounded where torch's vectorized sqrt may
 * be 1 ulp off, so the two can differ by an ulp of the update.
 *
 * Nearest code: see gefen_codes.h; stochastic codes: gefen_sr.h; a factored
 * second moment's v: gefen_factored.h; bf16 I/O: gefen_io.h; the first phase of a
 * call (factor sums, the non-finite check, step counters): gefen_prepass.h (all
 * included here).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "gefen_codes.h"
#include "gefen_factored.h"
#include "gefen_io.h"
#include "gefen_sr.h"

#define LT_TILE 512       /* elements per L1-resident tile of the 8-bit lookup */
#define LT_MAX_CHUNK 16384 /* longest sub-chunk: the largest automatic period */

typedef struct {
  float w1;        /* 1 - beta1, the weight of g in the lerp */
  float beta2;     /* beta2 */
  float omb2;      /* 1 - beta2 */
  float decay;     /* 1 - lr * weight_decay */
  float step_size; /* lr / (1 - beta1**step) */
  float sqrt_bc2;  /* sqrt(1 - beta2**step) */
  float eps;       /* added to the corrected sqrt(v) */
  float sign;      /* +1, or -1 when maximizing */
  float max_step;  /* lr * update_clip: the largest step of one element (inf: none) */
} lt_hyper;

typedef struct { /* per-thread buffers of `chunk` elements */
  float *den;    /* the sub-chunk's per-element denominators (factored or period 1) */
  float *m;      /* the new momentum (fp32, what the update uses) */
  float *val;    /* m / absmax of each element (the 8-bit lookup input) */
  int32_t *cell; /* lookup cell of each element */
  uint8_t *code; /* new codes */
  float *g;      /* the gradient in fp32 (bf16 gradients only) */
  float *p;      /* the parameter in fp32 (bf16 parameters only) */
  lt_sr8_table sr8; /* stochastic 8-bit codes' tables (gefen_sr.h), built lazily */
} lt_scratch;

#include "gefen_avx512.h" /* after lt_hyper: its pass-2 loop reads one */

/* m over [a, a + len) into m_out (g: the gradient of those elements); returns
   sum(g^2) from 8 double sums and, through *amax, max |m| (with 8-bit or 4-bit
   codes; max over the float bit patterns with the sign cleared: for non-negative floats
   the integer order is the float order, it vectorizes, and a NaN wins, as in
   torch's amax, so it propagates). One vectorized loop after the scalar code lookup: the
   momentum, its absmax and sum(g^2) in a single pass over the L1-resident
   buffer. lerp is torch's: fma(w, b - a, a) for w < 0.5, else fma(w - 1, b - a, b). */
static double lt_momentum(const float *restrict g, const uint8_t *restrict codes,
                          const float *restrict mom, int bits, int packed,
                          const float *restrict cb, float amax_old, const lt_hyper *h,
                          int64_t a, int64_t len, float *restrict m_out,
                          float *restrict amax) {
  const float sign = h->sign;
  const int small = h->w1 < 0.5f;
  const float wc = small ? h->w1 : h->w1 - 1.0f;
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  uint32_t top[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  if (bits) {
#ifdef __AVX512F__
    if (bits == 8) /* the lookup as a gather, in the same loop as the momentum */
      k = lt_momentum8_avx512(g, codes + a, cb, amax_old, sign, wc, small, len, m_out,
                              acc, top);
    else if (!packed || !(a & 1)) /* 4-bit: a permute (an odd packed start: below) */
      k = lt_momentum4_avx512(g, codes + (packed ? a >> 1 : a), packed, cb, amax_old, sign,
                              wc, small, len, m_out, acc, top);
#endif
    lt_take_codebook(cb, codes, bits, packed, a + k, len - k, m_out + k);
#ifdef __AVX2__
    /* the same arithmetic, lane j of the vectors being acc[j] / top[j] below */
    const __m256 v_amax = _mm256_set1_ps(amax_old), v_sign = _mm256_set1_ps(sign);
    const __m256 v_wc = _mm256_set1_ps(wc);
    const __m256i v_abs = _mm256_set1_epi32(0x7fffffff);
    __m256i v_top = _mm256_loadu_si256((const __m256i *)top);
    __m256d v_lo = _mm256_loadu_pd(acc), v_hi = _mm256_loadu_pd(acc + 4);
    for (; k + 8 <= len; k += 8) {
      const __m256 gg = _mm256_loadu_ps(g + k);
      const __m256 old = _mm256_mul_ps(_mm256_loadu_ps(m_out + k), v_amax);
      const __m256 gk = _mm256_mul_ps(gg, v_sign);
      const __m256 m = _mm256_fmadd_ps(v_wc, _mm256_sub_ps(gk, old), small ? old : gk);
      _mm256_storeu_ps(m_out + k, m);
      v_top = _mm256_max_epu32(v_top, _mm256_and_si256(_mm256_castps_si256(m), v_abs));
      const __m256 g2 = _mm256_mul_ps(gg, gg);
      v_lo = _mm256_add_pd(v_lo, _mm256_cvtps_pd(_mm256_castps256_ps128(g2)));
      v_hi = _mm256_add_pd(v_hi, _mm256_cvtps_pd(_mm256_extractf128_ps(g2, 1)));
    }
    _mm256_storeu_si256((__m256i *)top, v_top);
    _mm256_storeu_pd(acc, v_lo);
    _mm256_storeu_pd(acc + 4, v_hi);
#endif
    for (; k + 8 <= len; k += 8) {
      for (int j = 0; j < 8; j++) {
        const float old = m_out[k + j] * amax_old, gk = g[k + j] * sign;
        const float m = fmaf(wc, gk - old, small ? old : gk);
        m_out[k + j] = m;
        uint32_t u;
        memcpy(&u, &m, sizeof u);
        u &= 0x7fffffffu;
        top[j] = u > top[j] ? u : top[j];
        acc[j] += (double)(g[k + j] * g[k + j]);
      }
    }
    for (; k < len; k++) {
      const float old = m_out[k] * amax_old, gk = g[k] * sign;
      const float m = fmaf(wc, gk - old, small ? old : gk);
      m_out[k] = m;
      uint32_t u;
      memcpy(&u, &m, sizeof u);
      u &= 0x7fffffffu;
      top[0] = u > top[0] ? u : top[0];
      acc[0] += (double)(g[k] * g[k]);
    }
    uint32_t r = 0;
    for (int j = 0; j < 8; j++) r = top[j] > r ? top[j] : r;
    memcpy(amax, &r, sizeof r);
  } else {
    const float *restrict m = mom + a;
    for (int64_t i = 0; i < len; i++) {
      float gk = g[i] * sign;
      m_out[i] = fmaf(wc, gk - m[i], small ? m[i] : gk);
    }
    for (; k + 8 <= len; k += 8) {
      for (int j = 0; j < 8; j++) acc[j] += (double)(g[k + j] * g[k + j]);
    }
    for (; k < len; k++) acc[0] += (double)(g[k] * g[k]);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* step clipped to [-bound, bound]; written so that a NaN step stays NaN (as
   torch.clamp) and so that it compiles to minps/maxps: min(bound, x) is
   bound < x ? bound : x, whose NaN case returns x. */
static inline float lt_clip(float x, float bound) {
  x = bound < x ? bound : x;
  return -bound > x ? -bound : x;
}

/* p = p * decay - clip((step_size * m) / denom) over len elements (p: those
   elements of the parameter in fp32; den: their denominators, or NULL for the
   block's denom_block). */
static void lt_update(float *restrict p, const float *restrict m,
                      const float *restrict den, float denom_block, const lt_hyper *h,
                      int64_t len) {
  const float ss = h->step_size, decay = h->decay, bound = h->max_step;
  if (den == 0) { /* two loops: each vectorizes */
    for (int64_t k = 0; k < len; k++) {
      float w = p[k] * decay;
      p[k] = w - lt_clip((ss * m[k]) / denom_block, bound);
    }
  } else {
    for (int64_t k = 0; k < len; k++) {
      float w = p[k] * decay;
      p[k] = w - lt_clip((ss * m[k]) / den[k], bound);
    }
  }
}

/* The denominators sqrt(v) / sqrt(bc2) + eps of len per-element second moments. */
static void lt_element_den(const float *restrict v, const lt_hyper *h, int64_t len,
                           float *restrict out) {
  for (int64_t k = 0; k < len; k++) out[k] = sqrtf(v[k]) / h->sqrt_bc2 + h->eps;
}

/* One block [s, s + len): both passes (fac: a factored state's factors, else 0;
   next_mine: this thread does the next block [s + len, ...) next). */
static void lt_block(void *param, const void *grad, float *restrict v,
                     float *restrict absmax, uint8_t *restrict codes,
                     float *restrict exp_avg, int64_t n, int64_t b, int64_t s,
                     int64_t len, int per_element_v, int bits, const lt_quantizer *q,
                     const lt_hyper *h, const lt_io *io, int64_t chunk, int32_t zero,
                     const lt_factors *fac, int next_mine, lt_scratch *w) {
  const float *cb = bits ? q->codebook : 0;
  const float amax_old = bits ? absmax[b] : 0.0f;
  const int packed = bits == 4 && io->packed;
  double sumsq = 0.0;
  float amax = 0.0f;
  for (int64_t a = 0; a < len; a += chunk) { /* pass 1 */
    const int64_t l = len - a < chunk ? len - a : chunk;
    const float *g = (const float *)grad + s + a;
    if (io->grad_bf16) {
      lt_load(grad, 1, s + a, l, w->g);
      g = w->g;
    }
    float mx = 0.0f;
    sumsq += lt_momentum(g, codes, exp_avg, bits, packed, cb, amax_old, h, s + a, l, w->m,
                         &mx);
    if (bits) amax = mx > amax || mx != mx ? mx : amax;
    if (per_element_v) {
      float *restrict vv = v + s + a;
      for (int64_t k = 0; k < l; k++) vv[k] = fmaf(h->omb2, g[k] * g[k], vv[k] * h->beta2);
    }
  }
  float denom = 0.0f;
  if (!per_element_v && !fac) {
    const float mean = (float)(sumsq / (double)len);
    const float vb = fmaf(h->omb2, mean, v[b] * h->beta2); /* torch's add_(x, alpha) */
    v[b] = vb;
    denom = sqrtf(vb) / h->sqrt_bc2 + h->eps;
  }
  if (bits) absmax[b] = amax;
  for (int64_t a = 0; a < len; a += chunk) { /* pass 2 */
    const int64_t l = len - a < chunk ? len - a : chunk;
    if (len > chunk) { /* the buffer holds the last sub-chunk only: recompute */
      const float *g = (const float *)grad + s + a;
      if (io->grad_bf16) {
        lt_load(grad, 1, s + a, l, w->g);
        g = w->g;
      }
      float unused;
      lt_momentum(g, codes, exp_avg, bits, packed, cb, amax_old, h, s + a, l, w->m, &unused);
    }
    float *p = (float *)param + s + a;
    if (io->param_bf16) {
      lt_load(param, 1, s + a, l, w->p);
      p = w->p;
    }
    const float *den = 0; /* per-element denominators (0: the block's denom) */
    if (fac) {
      lt_factor_tile(fac, s + a, l, h->eps, w->den);
      den = w->den;
    } else if (per_element_v) {
      lt_element_den(v + s + a, h, l, w->den);
      den = w->den;
    }
    int updated = 0; /* the code loops may update the parameter as they go */
#ifdef __AVX512F__
    /* The same elements of the next block's fp32 gradient, when this thread does
       that block next: pass 2 (compute-bound) prefetches them into L2 for that
       block's pass 1, which otherwise waits on memory for them. */
    const float *ahead = next_mine && !io->grad_bf16 && s + len + a + l <= n
                             ? (const float *)grad + s + len + a
                             : 0;
#endif
    if (!bits) {
      memcpy(exp_avg + s + a, w->m, (size_t)l * sizeof(float));
    } else if (amax > 0.0f && bits == 8) {
      int64_t t = 0;
      if (io->code_sr) lt_sr8_prepare(q, &w->sr8);
#ifdef __AVX512F__
      if (io->code_sr && q->sr_steps <= 1 && q->nuniq == q->ncodes)
        t = lt_quant8_sr_update_avx512(q, w->m, amax, l, p, den, denom, h, ahead,
                                       (uint64_t)(io->index0 + s + a), io->code_key,
                                       codes + s + a);
      else if (q->steps <= 1 && q->nuniq == q->ncodes) /* a learned codebook */
        t = lt_quant8_update_avx512(q, w->m, amax, l, p, den, denom, h, ahead,
                                    io->code_sr ? &w->sr8 : 0,
                                    (uint64_t)(io->index0 + s + a), io->code_key,
                                    codes + s + a);
#endif
      /* in L1-resident tiles: the x values, cells and codes a loop writes are read
         by the next one before they leave L1 */
      for (; t < l; t += LT_TILE) {
        const int64_t tl = l - t < LT_TILE ? l - t : LT_TILE;
        lt_cells(q, w->m + t, amax, tl, w->val, w->cell);
        lt_lookup(q, w->val, w->cell, tl, codes + s + a + t);
        if (io->code_sr) /* the nearest codes, rounded stochastically */
          lt_sr8_tile(&w->sr8, w->val, tl, (uint64_t)(io->index0 + s + a + t),
                      io->code_key, codes + s + a + t);
        lt_update(p + t, w->m + t, den ? den + t : 0, denom, h, tl);
      }
      updated = 1;
    } else { /* 4-bit codes, or a block whose momentum is all zero (or NaN) */
      int64_t t = 0; /* amax > 0 here means 4-bit codes */
#ifdef __AVX512F__
      if (amax > 0.0f) { /* the lookup and the update in one loop, then the tail */
        t = lt_quant4_update_avx512(q, w->m, amax, l, p, den, denom, h, ahead, io->code_sr,
                                    (uint64_t)(io->index0 + s + a), io->code_key,
                                    w->code);
        lt_update(p + t, w->m + t, den ? den + t : 0, denom, h, l - t);
        updated = 1;
      }
#endif
      if (amax > 0.0f && io->code_sr)
        lt_lookup16_sr(q, w->m + t, amax, l - t, (uint64_t)(io->index0 + s + a + t),
                       io->code_key, w->code + t);
      else if (amax > 0.0f)
        lt_lookup16(q, w->m + t, amax, l - t, w->code + t);
      else
        memset(w->code, q->first[zero], (size_t)l);
      if (bits == 8 || !packed)
        memcpy(codes + s + a, w->code, (size_t)l);
      else
        lt_store_codes(codes, 1, n, s + a, l, w->code);
    }
    /* the exact new m, not its stored quantization */
    if (!updated) lt_update(p, w->m, den, denom, h, l);
    if (io->param_bf16) lt_store_bf16((uint16_t *)param, w->p, s + a, l, io);
  }
}

#include "gefen_job.h"     /* lt_job, its check, lt_plan: after lt_hyper */
#include "gefen_prepass.h" /* the first phase: factor sums, finite check, steps */

/* One step of `count` parameters in one call, in two phases. The first
   (gefen_prepass.h) reads every gradient once, before anything changes: the
   factored jobs' row and column sums of g^2 and, with `check`, the non-finite
   test of every gradient; then it advances the step counters and scalars of jobs
   that ask for it, and the factors. The second, the element loop, runs in one
   parallel region: threads take grabs of ~16K elements (whole blocks, pairs of
   blocks when 4-bit codes of an odd block length would share a byte) from every
   job, dynamically; blocks are independent, so the result is the same for any
   thread count or order.
   Returns 0; or 1 + the index of the first job with a non-finite gradient (with
   `check`; nothing was changed); or a negative number naming the invalid argument
   (nothing was changed: every job is checked and the buffers allocated before any
   work). */
int lt_gefen_step_many(const lt_job *jobs, int32_t count, int64_t chunk,
                       int32_t nthreads, int32_t check) {
  if (count < 0 || (count > 0 && jobs == 0)) return -1;
  if (chunk < 1 || chunk > LT_MAX_CHUNK) return -5;
  for (int32_t i = 0; i < count; i++) {
    const int rc = lt_check_job(jobs + i);
    if (rc) return rc;
  }
  if (nthreads < 1) nthreads = 1;
  lt_plan *plan = malloc(sizeof(lt_plan) * (size_t)(count > 0 ? count : 1));
  int64_t *first = malloc(sizeof(int64_t) * (size_t)(count + 1)); /* grab offsets */
  int64_t *scale0 = malloc(sizeof(int64_t) * (size_t)(count + 1)); /* a, b offsets */
  float *cbar = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
  if (plan == 0 || first == 0 || scale0 == 0 || cbar == 0) {
    free(plan);
    free(first);
    free(scale0);
    free(cbar);
    return -6;
  }
  scale0[0] = 0;
  for (int32_t i = 0; i < count; i++) /* a factored job's rows + cols scales */
    scale0[i + 1] = scale0[i] + (jobs[i].rows > 0 ? jobs[i].rows + jobs[i].n / jobs[i].rows : 0);
  float *scales = malloc(sizeof(float) * (size_t)(scale0[count] > 0 ? scale0[count] : 1));
  int64_t cmax = 1;
  first[0] = 0;
  for (int32_t i = 0; i < count; i++) {
    const lt_job *j = jobs + i;
    lt_plan *pl = plan + i;
    pl->nblocks = (j->n + j->block - 1) / j->block;
    pl->unit = (j->bits == 4 && j->io->packed && (j->block & 1)) ? 2 : 1;
    pl->nunits = (pl->nblocks + pl->unit - 1) / pl->unit;
    pl->grab = 16384 / (pl->unit * j->block) > 1 ? 16384 / (pl->unit * j->block) : 1;
    /* a sub-chunk never needs to be longer than a block (same result, less memory) */
    pl->chunk = chunk < j->block ? chunk : j->block;
    pl->zero = j->bits ? lt_zero_index(j->q) : 0;
    cmax = pl->chunk > cmax ? pl->chunk : cmax;
    first[i + 1] = first[i] + (pl->nunits + pl->grab - 1) / pl->grab;
  }
  const int64_t ngrabs = first[count];
  const int nt = nthreads > 1 && ngrabs > 1 ? nthreads : 1;
  /* Buffers staggered by a few cache lines: equal offsets modulo 4 KiB between a
     loaded and a stored stream make the CPU stall on false store-load aliasing. */
  const size_t c = (size_t)cmax, gap = 320, per = (c * 25 + 7 * gap + 63) / 64 * 64;
  char *arena = malloc(per * (size_t)nt);
  const int64_t pre = arena && scales ? lt_prepass(jobs, count, check, nthreads, cbar) : -6;
  if (pre != 0) {
    free(arena);
    free(plan);
    free(first);
    free(scale0);
    free(scales);
    free(cbar);
    return (int)pre;
  }
  for (int32_t i = 0; i < count; i++) { /* the factors advanced: this step's a, b */
    const lt_job *j = jobs + i;
    if (j->rows > 0)
      lt_factor_scales(j->v, j->v + j->rows, j->rows, j->n / j->rows, cbar[i],
                       j->h->sqrt_bc2, scales + scale0[i], scales + scale0[i] + j->rows);
  }

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    int tid = 0;
#ifdef _OPENMP
    tid = omp_get_thread_num();
#endif
    char *base = arena + per * (size_t)tid;
    lt_scratch w = {(float *)(base + 21 * c + 6 * gap),
                    (float *)base,
                    (float *)(base + 4 * c + gap),
                    (int32_t *)(base + 8 * c + 2 * gap),
                    (uint8_t *)(base + 12 * c + 3 * gap),
                    (float *)(base + 13 * c + 4 * gap),
                    (float *)(base + 17 * c + 5 * gap)};
    /* Dynamic: a thread that is descheduled (a shared machine) holds up one grab,
       not a fixed share of the work. */
#pragma omp for schedule(dynamic, 1)
    for (int64_t gi = 0; gi < ngrabs; gi++) {
      int32_t lo = 0, hi = count - 1; /* the job holding grab gi */
      while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= gi) lo = mid; else hi = mid - 1;
      }
      const lt_job *j = jobs + lo;
      const lt_plan *pl = plan + lo;
      const int64_t u0 = (gi - first[lo]) * pl->grab;
      const int64_t u1 = u0 + pl->grab < pl->nunits ? u0 + pl->grab : pl->nunits;
      const int64_t b_end = u1 * pl->unit < pl->nblocks ? u1 * pl->unit : pl->nblocks;
      const lt_factors fac = {scales + scale0[lo], scales + scale0[lo] + j->rows,
                              j->rows > 0 ? j->n / j->rows : 1};
      for (int64_t b = u0 * pl->unit; b < b_end; b++) {
        const int64_t s = b * j->block;
        const int64_t len = s + j->block <= j->n ? j->block : j->n - s;
        lt_block(j->param, j->grad, j->v, j->absmax, j->codes, j->exp_avg, j->n, b, s,
                 len, j->period == 1 && j->rows == 0, j->bits, j->q, j->h, j->io,
                 pl->chunk, pl->zero, j->rows > 0 ? &fac : 0, nt == 1 || b + 1 < b_end,
                 &w);
      }
    }
  }
  free(arena);
  free(plan);
  free(first);
  free(scale0);
  free(scales);
  free(cbar);
  return 0;
}

/* Let Python check the struct layouts and the buffer limit of the library it loaded. */
int lt_sizeof_quantizer(void) { return (int)sizeof(lt_quantizer); }
int lt_sizeof_hyper(void) { return (int)sizeof(lt_hyper); }
int lt_sizeof_io(void) { return (int)sizeof(lt_io); }
int lt_sizeof_job(void) { return (int)sizeof(lt_job); }
int lt_sizeof_opts(void) { return (int)sizeof(lt_opts); }
int lt_max_chunk(void) { return LT_MAX_CHUNK; }
