/*
 * Gefen's code lookups (included by gefen_step.c): old codes -> values, and the
 * nearest code of each new value.
 *
 * Nearest code: the distinct codebook values u_0 < ... < u_{U-1} have midpoints
 * mid_j = (u_j + u_{j+1}) / 2, computed exactly and rounded down to fp32 (so x > mid_j
 * is exact for fp32 x; mid_{U-1} = +inf, a sentinel); the value index is
 * k(x) = #{j : mid_j < x} (a tie goes to the lower value) and the stored code is
 * first[k], the lowest code holding u_k. The cell of a float y is
 * floor((y + 1) * ncell / 2) in fp32, a monotone function of y, so every midpoint in
 * a lower cell is below x and every one in a higher cell is above: lut[cell] holds
 * the count j of midpoints in lower cells (bitwise NOT'ed where the cell itself
 * holds midpoints, for the torch fallback), and `steps` comparisons j += x > mid[j]
 * count the cell's own midpoints below x. With 16384 cells (1/4 of a codebook
 * histogram bin) a learned codebook's midpoints, which are at least 3/4 of a bin
 * apart, never share a cell: steps = 1. Exact for any sorted codebook. For such a
 * codebook the kernel reads entry[cell] = j << 32 | bits(mid[j]) instead: one 8-byte
 * load yields j and the midpoint to compare with (no load that depends on another).
 *
 * 8-bit table lookups (old code -> value, cell -> code) are scalar loops here: on
 * AVX2 CPUs (AMD EPYC Zen 3) a vpgatherdd costs as much as eight scalar loads, so
 * a pass 2 fused into one AVX2 loop with three gathers per 8 elements is slower
 * than the scalar lookup + vector update. With AVX-512 both lookups are 16-lane
 * gathers in gefen_avx512.h, same bits. The 8-bit lookup is branch-free (with a
 * learned codebook a branch per element in a cell holding a midpoint mispredicts
 * often). (Timings: CHANGELOG.md.) A 4-bit codebook
 * fits in two AVX2 registers (one AVX-512 register): old codes are dequantized with
 * in-register permutes, and new ones are found by comparing with the 15 midpoints.
 */
#ifndef LT_GEFEN_CODES_H
#define LT_GEFEN_CODES_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define LT_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define LT_SCALAR
#endif

typedef struct {
  const float *codebook; /* [ncodes] values, dequantization of the old codes */
  const float *mid;      /* [nuniq] midpoints, mid[nuniq-1] = +inf (sentinel) */
  const uint8_t *first;  /* [nuniq] lowest code holding the k-th distinct value */
  const int16_t *lut;    /* [ncell] midpoints in lower cells (~count: cell has some) */
  const uint64_t *entry; /* [ncell] j = that count << 32 | fp32 bits of mid[j] */
  const uint64_t *sr_entry; /* [ncell] stochastic codes' interval table (gefen_sr.h) */
  const float *upad;     /* [nuniq + 1] distinct values, then +inf */
  int32_t ncodes;        /* 2**bits */
  int32_t nuniq;
  int32_t ncell;
  int32_t steps;         /* the most midpoints any one cell holds */
  int32_t sr_steps;      /* the most values u_j (j >= 1) any one cell holds */
  int32_t unused;
} lt_quantizer;

#ifdef __AVX2__
/* A 16-entry codebook lookup of 8 codes (int32 lanes) with two in-register
   permutes and a blend on bit 3: no memory gather. */
static inline __m256 lt_take16(__m256 lo, __m256 hi, __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

#ifndef __AVX512F__ /* there lt_take16_avx512 does it */
/* 4-bit codes of [a, a + len) looked up in the codebook, 8 at a time; returns how
   many elements were done (the caller finishes the rest). */
static int64_t lt_take16_avx2(const float *cb, const uint8_t *restrict codes, int packed,
                              int64_t a, int64_t len, float *restrict out) {
  const __m256 lo = _mm256_loadu_ps(cb), hi = _mm256_loadu_ps(cb + 8);
  int64_t k = 0;
  if (!packed) {
    for (; k + 8 <= len; k += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + a + k)));
      _mm256_storeu_ps(out + k, lt_take16(lo, hi, idx));
    }
    return k;
  }
  if (a & 1) { /* start on a byte boundary */
    if (len == 0) return 0;
    out[0] = cb[codes[a >> 1] >> 4];
    k = 1;
  }
  /* 4 bytes -> 8 lanes: each byte twice, then the low / high nibble */
  const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  const __m256i nibble = _mm256_set1_epi32(15);
  for (; k + 8 <= len; k += 8) {
    int32_t four;
    memcpy(&four, codes + ((a + k) >> 1), sizeof four);
    const __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(four), twice);
    __m256i idx = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(bytes), shift);
    idx = _mm256_and_si256(idx, nibble);
    _mm256_storeu_ps(out + k, lt_take16(lo, hi, idx));
  }
  return k;
}
#endif
#endif

#ifdef __AVX512F__
/* The 4-bit lookup with AVX-512: the 16 codes fit one register, so each 16 codes
   are one permute (same values as lt_take16_avx2). */
static int64_t lt_take16_avx512(const float *cb, const uint8_t *restrict codes,
                                int packed, int64_t a, int64_t len, float *restrict out) {
  const __m512 table = _mm512_loadu_ps(cb);
  int64_t k = 0;
  if (!packed) {
    for (; k + 16 <= len; k += 16) {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + a + k)));
      _mm512_storeu_ps(out + k, _mm512_permutexvar_ps(idx, table));
    }
    return k;
  }
  if (a & 1) { /* start on a byte boundary */
    if (len == 0) return 0;
    out[0] = cb[codes[a >> 1] >> 4];
    k = 1;
  }
  /* 8 bytes -> 16 lanes: each byte twice, then its low / high nibble */
  const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  for (; k + 16 <= len; k += 16) {
    const __m128i bytes = _mm_shuffle_epi8(
        _mm_loadl_epi64((const __m128i *)(codes + ((a + k) >> 1))), twice);
    /* permutexvar reads the low 4 bits of each index: no mask needed */
    const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(bytes), shift);
    _mm512_storeu_ps(out + k, _mm512_permutexvar_ps(idx, table));
  }
  return k;
}
#endif

/* Old codes of [a, a + len) looked up in the codebook (scalar: see header). */
LT_SCALAR static void lt_take_codebook(const float *restrict cb,
                                       const uint8_t *restrict codes, int bits,
                                       int packed, int64_t a, int64_t len,
                                       float *restrict out) {
#if defined(__AVX512F__)
  if (bits == 4) { /* 16 codes fit in one register: vector lookups */
    const int64_t done = lt_take16_avx512(cb, codes, packed, a, len, out);
    a += done, len -= done, out += done;
  }
#elif defined(__AVX2__)
  if (bits == 4) { /* 16 codes fit in two registers: vector lookups */
    const int64_t done = lt_take16_avx2(cb, codes, packed, a, len, out);
    a += done, len -= done, out += done;
  }
#else
  (void)bits;
#endif
  if (!packed) {
    const uint8_t *restrict c = codes + a;
    for (int64_t k = 0; k < len; k++) out[k] = cb[c[k]];
  } else {
    for (int64_t k = 0; k < len; k++) {
      int64_t i = a + k;
      out[k] = cb[(codes[i >> 1] >> ((i & 1) << 2)) & 15];
    }
  }
}

/* x = m / amax and its lookup cell; NaN -> cell 0 (never out of range).
   Vectorizes (the division above all, ~8x cheaper than in the lookup loop). */
static void lt_cells(const lt_quantizer *q, const float *restrict m, float amax,
                     int64_t len, float *restrict x_out, int32_t *restrict cell) {
  const float half = 0.5f * (float)q->ncell, top = (float)(q->ncell - 1);
  for (int64_t k = 0; k < len; k++) {
    float x = m[k] / amax;
    float t = (x + 1.0f) * half;
    t = t >= 0.0f ? t : 0.0f;
    t = t <= top ? t : top;
    x_out[k] = x;
    cell[k] = (int32_t)t;
  }
}

/* Nearest code of each x, branch-free: the cell's table entry gives the
   number j of midpoints in lower cells (stored bitwise-NOT'ed when the cell holds
   midpoints: j ^ (j >> 15) undoes that without a branch), then `steps` comparisons
   j += x > mid[j] (steps = the most midpoints in one cell, 1 for a learned codebook)
   count the cell's own midpoints below x. Midpoints of higher cells are above x,
   and mid[nuniq - 1] = +inf stops j (NaN compares false). No data-dependent
   branch: a mispredicted one per cell holding a midpoint cost more than the lookup.
   Scalar: see the header on gathers. */
LT_SCALAR static void lt_lookup(const lt_quantizer *q, const float *restrict x,
                                const int32_t *restrict cell, int64_t len,
                                uint8_t *restrict code) {
  const int16_t *restrict lut = q->lut;
  const float *restrict mid = q->mid;
  const uint8_t *restrict first = q->first;
  if (q->steps <= 1 && q->nuniq == q->ncodes) { /* a learned codebook */
    /* one 8-byte load per element gives both j and mid[j] (no dependent load) */
    const uint64_t *restrict entry = q->entry;
    for (int64_t k = 0; k < len; k++) {
      const uint64_t e = entry[cell[k]];
      const uint32_t mb = (uint32_t)e;
      float m;
      memcpy(&m, &mb, sizeof m);
      const int32_t j = (int32_t)(e >> 32) + (x[k] > m);
      code[k] = (uint8_t)j;
    }
    return;
  }
  const int32_t steps = q->steps;
  for (int64_t k = 0; k < len; k++) {
    int32_t j = lut[cell[k]];
    j ^= j >> 15;
    for (int32_t s = 0; s < steps; s++) j += x[k] > mid[j];
    code[k] = first[j];
  }
}

/* 4-bit codebooks: the same rule by comparing with every midpoint (at most 15),
   k = #{j : mid_j < x}, picking the code with selects. Vectorizes, unlike a
   table lookup. Midpoints past nuniq - 1 are +inf and never pass. */
static void lt_lookup16(const lt_quantizer *q, const float *restrict m, float amax,
                        int64_t len, uint8_t *restrict code) {
  float mid[15];
  int32_t first[16];
  for (int j = 0; j < 16; j++) {
    if (j < 15) mid[j] = j < q->nuniq - 1 ? q->mid[j] : INFINITY;
    first[j] = q->first[j < q->nuniq ? j : q->nuniq - 1];
  }
  int64_t k = 0;
#ifdef __AVX512F__
  { /* the same count in 16 lanes; the code by one permute */
    const __m512 am = _mm512_set1_ps(amax);
    const __m512i f = _mm512_loadu_si512(first), one = _mm512_set1_epi32(1);
    for (; k + 16 <= len; k += 16) {
      const __m512 x = _mm512_div_ps(_mm512_loadu_ps(m + k), am);
      __m512i cnt = _mm512_setzero_si512();
      for (int j = 0; j < 15; j++)
        cnt = _mm512_mask_add_epi32(
            cnt, _mm512_cmp_ps_mask(x, _mm512_set1_ps(mid[j]), _CMP_GT_OQ), cnt, one);
      _mm_storeu_si128((__m128i *)(code + k),
                       _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(cnt, f)));
    }
  }
#endif
#ifdef __AVX2__
  /* Count the midpoints below x with 15 compares, then take the code with
     in-register permutes: ~2/3 of the operations of the selects below. */
  const __m256 am = _mm256_set1_ps(amax);
  const __m256 f_lo = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)first));
  const __m256 f_hi = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(first + 8)));
  for (; k + 8 <= len; k += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(m + k), am);
    __m256i cnt = _mm256_setzero_si256();
    for (int j = 0; j < 15; j++) /* a true compare is -1: subtract it */
      cnt = _mm256_sub_epi32(
          cnt, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_set1_ps(mid[j]), _CMP_GT_OQ)));
    const __m256i c = _mm256_castps_si256(lt_take16(f_lo, f_hi, cnt));
    const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)(code + k), _mm_packus_epi16(c16, c16));
  }
#endif
  for (; k < len; k++) {
    const float x = m[k] / amax;
    int32_t c = first[0];
#pragma GCC unroll 16
    for (int j = 0; j < 15; j++) c = x > mid[j] ? first[j + 1] : c;
    code[k] = (uint8_t)c;
  }
}

/* The index of the value nearest 0 (absmax 0 means m == 0 in the whole block). */
static int32_t lt_zero_index(const lt_quantizer *q) {
  int32_t j = 0;
  while (0.0f > q->mid[j]) j++;
  return j;
}

static void lt_store_codes(uint8_t *restrict codes, int packed, int64_t n, int64_t a,
                           int64_t len, const uint8_t *restrict code) {
  if (!packed) {
    memcpy(codes + a, code, (size_t)len);
    return;
  }
  int64_t k = 0;
  if (a & 1) { /* odd start: our first code is the high nibble of a shared byte */
    codes[a >> 1] = (uint8_t)((codes[a >> 1] & 0x0F) | (code[0] << 4));
    k = 1;
  }
  uint8_t *restrict out = codes + ((a + k) >> 1);
  const int64_t pairs = (len - k) >> 1;
  for (int64_t j = 0; j < pairs; j++) {
    out[j] = (uint8_t)(code[k + 2 * j] | (code[k + 2 * j + 1] << 4));
  }
  k += 2 * pairs;
  if (k < len) { /* one code left, a low nibble; after the last element: zero */
    const int last = a + k == n - 1;
    out[pairs] = (uint8_t)(last ? code[k] : ((out[pairs] & 0xF0) | code[k]));
  }
}

#endif /* LT_GEFEN_CODES_H */
