/*
 * AVX-512 paths of Gefen's 8-bit step (included by gefen_step.c when the compiler
 * targets AVX-512F, i.e. -march=native on such a CPU; elsewhere this file is empty).
 *
 * The 8-bit step is bound by its two table lookups per element (gefen_codes.h).
 * On AVX-512 CPUs (Intel Xeon, Emerald Rapids) a 16-lane gather costs far less
 * than 16 scalar loads, so both lookups become gathers inside one vector
 * loop each:
 *   pass 1: old code -> codebook value (one 16-lane gather), then the momentum,
 *           its absmax and sum(g^2) as in the AVX2 loop of lt_momentum;
 *   pass 2: m / absmax -> cell -> 8-byte entry (two 8-lane gathers) -> j, +1 when
 *           x is above the entry's midpoint -> code; and the parameter update with
 *           the exact m. Stochastic codes use another 8-byte cell entry that gives
 *           the interval's lower end i, then one 8-byte pair (u_i, u_{i+1}): four
 *           8-lane gathers per 16 elements where the nearest lookup followed by
 *           lt_sr8_round16 takes two and three 16-lane ones (a large share of
 *           the 8-bit default step; timings in CHANGELOG.md).
 * Every result is the same bits as the scalar code: the same IEEE operations in
 * the same order (no fused multiply-add is added, sqrt is correctly rounded in
 * both), and sum(g^2) is accumulated in the same 8 double lanes, element k into
 * lane k mod 8 in index order. Only the learned-codebook form of the lookup
 * (distinct codes, at most one midpoint per cell) is vectorized; the rest stays
 * on the scalar path.
 */
#ifndef LT_GEFEN_AVX512_H
#define LT_GEFEN_AVX512_H
#ifdef __AVX512F__
#include <immintrin.h>
#include <stdint.h>

#ifndef LT_AHEAD
#define LT_AHEAD 512
#endif

/* The momentum step shared by the 8-bit and 4-bit pass-1 loops, on 16 lanes:
   m = lerp(old, sign * g, w1) stored to m_out; |m| bit patterns folded into *top
   (max) and g*g into *acc (element k into lane k mod 8, in order). */
static inline void lt_fold16(__m512 old, const float *restrict g, __m512 v_sign,
                             __m512 v_wc, int small, float *restrict m_out,
                             __m512i *top, __m512d *acc) {
  const __m512i v_abs = _mm512_set1_epi32(0x7fffffff);
  const __m512 gg = _mm512_loadu_ps(g);
  const __m512 gk = _mm512_mul_ps(gg, v_sign);
  const __m512 m = _mm512_fmadd_ps(v_wc, _mm512_sub_ps(gk, old), small ? old : gk);
  _mm512_storeu_ps(m_out, m);
  *top = _mm512_max_epu32(*top, _mm512_and_si512(_mm512_castps_si512(m), v_abs));
  const __m512 g2 = _mm512_mul_ps(gg, gg);
  *acc = _mm512_add_pd(*acc, _mm512_cvtps_pd(_mm512_castps512_ps256(g2)));
  *acc = _mm512_add_pd(
      *acc, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g2), 1))));
}

/* Stores the lane sums and folds the 16 lane maxima into top[8]. */
static inline void lt_fold16_done(__m512i v_top, __m512d v_acc, double *acc,
                                  uint32_t *top) {
  _mm512_storeu_pd(acc, v_acc);
  uint32_t lanes[16];
  _mm512_storeu_si512(lanes, v_top);
  for (int j = 0; j < 16; j++) top[j & 7] = lanes[j] > top[j & 7] ? lanes[j] : top[j & 7];
}

/* Pass 1 for unpacked 8-bit codes over the first multiple of 16 of [0, len):
   m_out = lerp(cb[code] * amax_old, sign * g, w1); folds |m| bit patterns into
   top[8] (max) and g*g into acc[8] (element k into lane k mod 8, in order).
   Returns the number of elements done. */
static int64_t lt_momentum8_avx512(const float *restrict g, const uint8_t *restrict codes,
                                   const float *restrict cb, float amax_old, float sign,
                                   float wc, int small, int64_t len,
                                   float *restrict m_out, double *acc, uint32_t *top) {
  const __m512 v_amax = _mm512_set1_ps(amax_old), v_sign = _mm512_set1_ps(sign);
  const __m512 v_wc = _mm512_set1_ps(wc);
  __m512i v_top = _mm512_setzero_si512();
  __m512d v_acc = _mm512_loadu_pd(acc);
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    _mm_prefetch((const char *)(g + k + LT_AHEAD), _MM_HINT_T0);
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k)));
    const __m512 old = _mm512_mul_ps(_mm512_i32gather_ps(idx, cb, 4), v_amax);
    lt_fold16(old, g + k, v_sign, v_wc, small, m_out + k, &v_top, &v_acc);
  }
  lt_fold16_done(v_top, v_acc, acc, top);
  return k;
}

/* Pass 1 for 4-bit codes (packed from an even element, or one per byte): the same
   as lt_momentum8_avx512 with the lookup an in-register permute of the 16 codes
   (lt_take16_avx512's unpacking). `codes` points at the first element's byte. */
static int64_t lt_momentum4_avx512(const float *restrict g, const uint8_t *restrict codes,
                                   int packed, const float *restrict cb, float amax_old,
                                   float sign, float wc, int small, int64_t len,
                                   float *restrict m_out, double *acc, uint32_t *top) {
  const __m512 table = _mm512_loadu_ps(cb);
  const __m512 v_amax = _mm512_set1_ps(amax_old), v_sign = _mm512_set1_ps(sign);
  const __m512 v_wc = _mm512_set1_ps(wc);
  const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  __m512i v_top = _mm512_setzero_si512();
  __m512d v_acc = _mm512_loadu_pd(acc);
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    __m512i idx; /* permutexvar reads the low 4 bits of each index */
    if (packed)
      idx = _mm512_srlv_epi32(
          _mm512_cvtepu8_epi32(_mm_shuffle_epi8(
              _mm_loadl_epi64((const __m128i *)(codes + (k >> 1))), twice)),
          shift);
    else
      idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k)));
    const __m512 old = _mm512_mul_ps(_mm512_permutexvar_ps(idx, table), v_amax);
    lt_fold16(old, g + k, v_sign, v_wc, small, m_out + k, &v_top, &v_acc);
  }
  lt_fold16_done(v_top, v_acc, acc, top);
  return k;
}

/* The constants of lt_update16 (lt_update's scalars, broadcast). */
typedef struct {
  __m512 decay, ss, denom, bound, nbound;
} lt_update_consts;

static inline lt_update_consts lt_update_setup(const lt_hyper *h, float denom_block) {
  const lt_update_consts c = {_mm512_set1_ps(h->decay),    _mm512_set1_ps(h->step_size),
                              _mm512_set1_ps(denom_block), _mm512_set1_ps(h->max_step),
                              _mm512_set1_ps(-h->max_step)};
  return c;
}

/* p = p * decay - clip((step_size * m) / denom) on 16 lanes (lt_update; the
   per-element denominators den when den is not NULL), with the exact m. */
static inline void lt_update16(const lt_update_consts *c, float *restrict p,
                               const float *restrict m, const float *restrict den) {
  const __m512 denom = den ? _mm512_loadu_ps(den) : c->denom;
  const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(p), c->decay);
  const __m512 step = _mm512_mul_ps(c->ss, _mm512_loadu_ps(m));
  /* lt_clip: min/max return their second operand on NaN, so a NaN stays */
  __m512 u = _mm512_min_ps(c->bound, _mm512_div_ps(step, denom));
  u = _mm512_max_ps(c->nbound, u);
  _mm512_storeu_ps(p, _mm512_sub_ps(w, u));
}

/* The lookup cell of x = m / amax on 16 lanes, as lt_cells computes it. */
static inline __m512i lt_cell16(__m512 x, __m512 half, __m512 top) {
  __m512 t = _mm512_mul_ps(_mm512_add_ps(x, _mm512_set1_ps(1.0f)), half);
  t = _mm512_max_ps(t, _mm512_setzero_ps()); /* NaN -> 0: max returns its 2nd operand */
  t = _mm512_min_ps(t, top);
  return _mm512_cvttps_epi32(t);
}

/* Pass 2 for a learned 8-bit codebook over the first multiple of 16 of [0, len):
   nearest code of m / amax (lt_cells + lt_lookup's entry path; with `sr`, rounded
   stochastically by lt_sr8_round16), and the update (lt_update16). Returns the
   number of elements done. */
static int64_t lt_quant8_update_avx512(const lt_quantizer *q, const float *restrict m,
                                       float amax, int64_t len, float *restrict p,
                                       const float *restrict den, float denom_block,
                                       const lt_hyper *h, const float *ahead,
                                       const lt_sr8_table *sr,
                                       uint64_t i0, uint64_t key, uint8_t *restrict code) {
  const __m512 v_amax = _mm512_set1_ps(amax);
  const __m512 half = _mm512_set1_ps(0.5f * (float)q->ncell);
  const __m512 top = _mm512_set1_ps((float)(q->ncell - 1));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                         26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i inc = _mm512_set1_epi32(1);
  const lt_update_consts uc = lt_update_setup(h, denom_block);
  const long long *entry = (const long long *)q->entry;
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    _mm_prefetch((const char *)(p + k + LT_AHEAD), _MM_HINT_T0);
    if (ahead) /* the next block's gradient, for its pass 1 (see lt_block) */
      _mm_prefetch((const char *)(ahead + k), _MM_HINT_T1);
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(m + k), v_amax);
    const __m512i cell = lt_cell16(x, half, top);
    const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(cell), entry, 8);
    const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(cell, 1), entry, 8);
    /* entry = j << 32 | midpoint bits: low halves are the midpoints, high the j */
    const __m512 mid = _mm512_castsi512_ps(_mm512_permutex2var_epi32(e0, even, e1));
    __m512i j = _mm512_permutex2var_epi32(e0, odd, e1);
    j = _mm512_mask_add_epi32(j, _mm512_cmp_ps_mask(x, mid, _CMP_GT_OQ), j, inc);
    if (sr) /* stochastic codes (every code its own value: j is the code) */
      j = lt_sr8_round16(sr, x, j, i0 + (uint64_t)k, key);
    _mm_storeu_si128((__m128i *)(code + k), _mm512_cvtepi32_epi8(j));
    lt_update16(&uc, p + k, m + k, den ? den + k : 0);
  }
  return k;
}

/* The lower end i(x) = #{j >= 1 : x >= u_j} of the interval of x = m / amax on 16
   lanes, from the cell's sr_entry (count << 32 | threshold bits, _quant_table.py):
   count + (x > threshold). */
static inline __m512i lt_interval16(const long long *entry, __m512 x, __m512 half,
                                    __m512 top, __m512i even, __m512i odd) {
  const __m512i cell = lt_cell16(x, half, top);
  const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(cell), entry, 8);
  const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(cell, 1), entry, 8);
  const __m512 thr = _mm512_castsi512_ps(_mm512_permutex2var_epi32(e0, even, e1));
  const __m512i i = _mm512_permutex2var_epi32(e0, odd, e1);
  return _mm512_mask_add_epi32(i, _mm512_cmp_ps_mask(x, thr, _CMP_GT_OQ), i,
                               _mm512_set1_epi32(1));
}

/* Pass 2 with stochastic codes for a learned 8-bit codebook whose lookup cells
   hold at most one value each (q->sr_steps <= 1): the same codes as
   lt_quant8_update_avx512 with lt_sr8_round16, in two 8-byte loads per element
   instead of one and three 4-byte ones (gathers bound that loop). The interval's
   lower end is i(x) = #{j >= 1 : x >= u_j} (what lt_sr8_round16 derives from the
   nearest code: see gefen_sr.h), read from the cell's sr_entry (lt_interval16);
   then one load of the pair (u_i, u_{i+1}) at upad + i gives u_i and
   d_i = u_{i+1} - u_i, the table's own subtraction. The random test, r and the
   mask i < last are lt_sr8_round16's. The two loads depend on each other, so the
   loop computes i one vector ahead (software pipelining): the next vector's first
   load is issued before this one's second, instead of the core waiting on each
   chain in turn. Returns the number of elements done. */
static int64_t lt_quant8_sr_update_avx512(const lt_quantizer *q, const float *restrict m,
                                          float amax, int64_t len, float *restrict p,
                                          const float *restrict den, float denom_block,
                                          const lt_hyper *h, const float *ahead, uint64_t i0,
                                          uint64_t key, uint8_t *restrict code) {
  if (len < 16) return 0;
  const __m512 v_amax = _mm512_set1_ps(amax);
  const __m512 half = _mm512_set1_ps(0.5f * (float)q->ncell);
  const __m512 top = _mm512_set1_ps((float)(q->ncell - 1));
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                         26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  const __m512i inc = _mm512_set1_epi32(1), last = _mm512_set1_epi32(q->nuniq - 1);
  const lt_update_consts uc = lt_update_setup(h, denom_block);
  const long long *entry = (const long long *)q->sr_entry;
  __m512 x = _mm512_div_ps(_mm512_loadu_ps(m), v_amax);
  __m512i i = lt_interval16(entry, x, half, top, even, odd);
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    _mm_prefetch((const char *)(p + k + LT_AHEAD), _MM_HINT_T0);
    if (ahead) /* the next block's gradient, for its pass 1 (see lt_block) */
      _mm_prefetch((const char *)(ahead + k), _MM_HINT_T1);
    __m512 x_next = x;
    __m512i i_next = i;
    if (k + 32 <= len) { /* the next vector's interval, one step ahead */
      x_next = _mm512_div_ps(_mm512_loadu_ps(m + k + 16), v_amax);
      i_next = lt_interval16(entry, x_next, half, top, even, odd);
    }
    const __m512 r = lt_code_uniform16(i0 + (uint64_t)k, key);
    /* (u_i, u_{i+1}) pairs: 8 bytes at upad + 4 i (i <= last: the +inf pad) */
    const __m512i u0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(i), q->upad, 4);
    const __m512i u1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(i, 1), q->upad, 4);
    const __m512 ui = _mm512_castsi512_ps(_mm512_permutex2var_epi32(u0, even, u1));
    const __m512 un = _mm512_castsi512_ps(_mm512_permutex2var_epi32(u0, odd, u1));
    const __m512 di = _mm512_sub_ps(un, ui);
    const __mmask16 up =
        _mm512_cmp_epi32_mask(i, last, _MM_CMPINT_LT) &
        _mm512_cmp_ps_mask(_mm512_sub_ps(x, ui), _mm512_mul_ps(r, di), _CMP_GT_OQ);
    _mm_storeu_si128((__m128i *)(code + k),
                     _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(i, up, i, inc)));
    lt_update16(&uc, p + k, m + k, den ? den + k : 0);
    x = x_next, i = i_next;
  }
  return k;
}

/* Pass 2 for 4-bit codes over the first multiple of 16 of [0, len): the AVX-512
   loop of lt_lookup16 (nearest) or, with `sr`, of lt_lookup16_sr (the same tables,
   compares and random test), codes one per byte into code (the caller packs
   them), and the update (lt_update16) in the same loop. As separate loops the
   update was bound by the divider (a square root and two divisions per element
   with a factored v) while the lookup's compares and hash left it idle; in one
   loop they overlap. Returns the number of elements done. */
static int64_t lt_quant4_update_avx512(const lt_quantizer *q, const float *restrict m,
                                       float amax, int64_t len, float *restrict p,
                                       const float *restrict den, float denom_block,
                                       const lt_hyper *h, const float *ahead, int sr, uint64_t i0,
                                       uint64_t key, uint8_t *restrict code) {
  float mid[16], u[16], d[16];
  int32_t first[16];
  for (int j = 0; j < 16; j++) { /* lt_lookup16's and lt_lookup16_sr's tables */
    mid[j] = j < 15 && j < q->nuniq - 1 ? q->mid[j] : INFINITY;
    first[j] = q->first[j < q->nuniq ? j : q->nuniq - 1];
    u[j] = j < q->nuniq ? q->codebook[first[j]] : INFINITY;
  }
  for (int j = 0; j < 16; j++) d[j] = j < q->nuniq - 1 ? u[j + 1] - u[j] : 0.0f;
  const __m512 am = _mm512_set1_ps(amax);
  const __m512 tu = _mm512_loadu_ps(u), td = _mm512_loadu_ps(d), tm = _mm512_loadu_ps(mid);
  const __m512i f = _mm512_loadu_si512(first), one = _mm512_set1_epi32(1);
  const lt_update_consts uc = lt_update_setup(h, denom_block);
  int64_t k = 0;
  for (; k + 16 <= len; k += 16) {
    _mm_prefetch((const char *)(p + k + LT_AHEAD), _MM_HINT_T0);
    if (ahead) /* the next block's gradient, for its pass 1 (see lt_block) */
      _mm_prefetch((const char *)(ahead + k), _MM_HINT_T1);
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(m + k), am);
    /* The counts #{j >= 1 : x >= u_j} and #{j : x > mid_j} of the scalar loops,
       by a binary search over the ascending tables (+inf past the last value,
       which no x reaches; a NaN passes no test: 0, as there): 4 permutes and
       compares instead of 15 compares. */
    __m512i i = _mm512_setzero_si512();
    if (sr) {
      const __m512 r = lt_code_uniform16(i0 + (uint64_t)k, key);
      for (int step = 8; step; step >>= 1) { /* the largest j with x >= u_j, or 0 */
        const __m512i c = _mm512_add_epi32(i, _mm512_set1_epi32(step));
        i = _mm512_mask_mov_epi32(
            i, _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(c, tu), _CMP_GE_OQ), c);
      }
      const __m512 t = _mm512_sub_ps(x, _mm512_permutexvar_ps(i, tu));
      const __m512 s = _mm512_mul_ps(r, _mm512_permutexvar_ps(i, td));
      i = _mm512_mask_add_epi32(i, _mm512_cmp_ps_mask(t, s, _CMP_GT_OQ), i, one);
    } else {
      for (int step = 8; step; step >>= 1) { /* 1 + the largest j with x > mid_j */
        const __m512i c = _mm512_add_epi32(i, _mm512_set1_epi32(step));
        i = _mm512_mask_mov_epi32(
            i,
            _mm512_cmp_ps_mask(x, _mm512_permutexvar_ps(_mm512_sub_epi32(c, one), tm),
                               _CMP_GT_OQ),
            c);
      }
    }
    _mm_storeu_si128((__m128i *)(code + k),
                     _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(i, f)));
    lt_update16(&uc, p + k, m + k, den ? den + k : 0);
  }
  return k;
}
#endif /* __AVX512F__ */
#endif /* LT_GEFEN_AVX512_H */
