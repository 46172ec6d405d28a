/*
 * Stochastic rounding of Gefen's 4-bit momentum codes (included by gefen_step.c
 * after gefen_codes.h; leantrain/optim/code_rounding.py is the reference: the same
 * bits).
 */
#ifndef LT_GEFEN_SR_H
#define LT_GEFEN_SR_H
#include <math.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "gefen_codes.h" /* lt_quantizer, lt_take16 */
#include "gefen_io.h"    /* lt_hash: the random bits */

/* 4-bit codes rounded stochastically (leantrain/optim/code_rounding.py is the
   reference: the same bits; lt_sr8_tile below does 8-bit codes). With the distinct values u_j, gaps d_j = u_{j+1} - u_j
   and a uniform r in [0, 1) per element (the top 24 bits of lt_hash of its global
   index i0 + k on the code key), the reference's value index
   #{j : fl(x - u_j) > fl(r * d_j)} equals i + [fl(x - u_i) > fl(r * d_i)] with
   i = #{j >= 1 : x >= u_j} (every u_j below x's interval [u_i, u_{i+1}) counts in
   the reference, none above it), which is what is computed here: 15 compares, then
   one random test on permuted table entries. Tables are padded with u = +inf,
   d = 0 (never counted). */
static inline uint32_t lt_code_bits(uint64_t i, uint64_t key) {
  return lt_hash(i, key) >> 8; /* 24 bits: r = bits * 2^-24 */
}

#ifdef __AVX512F__
/* r = the top 24 bits of lt_hash(base + lane, key) * 2^-24 for lanes 0..15: the
   uniforms of 16 consecutive elements, bit for bit lt_code_bits'. */
static inline __m512 lt_code_uniform16(uint64_t base, uint64_t key) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                         14, 15);
  const __m512i b_lo = _mm512_set1_epi32((int)(uint32_t)base);
  const __m512i lo = _mm512_add_epi32(b_lo, lane); /* wraps like uint32 */
  /* lt_hash_high of each lane: of base's high word, or of the next one where
     base + lane carried into it */
  const uint32_t hi = (uint32_t)(base >> 32);
  const __m512i high = _mm512_mask_blend_epi32(
      _mm512_cmp_epu32_mask(lo, b_lo, _MM_CMPINT_LT),
      _mm512_set1_epi32((int)lt_hash_high(hi, key)),
      _mm512_set1_epi32((int)lt_hash_high(hi + 1u, key)));
  __m512i h = _mm512_ternarylogic_epi32(lo, _mm512_set1_epi32((int)(uint32_t)key), high,
                                        0x96); /* lo ^ lo32(key) ^ high */
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85ebca6bu));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xc2b2ae35u));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)),
                       _mm512_set1_ps(0x1p-24f));
}
#endif

#ifdef __AVX2__
/* The uniforms of 8 consecutive elements (global indices base .. base + 7), bit for
   bit lt_code_bits' * 2^-24: the 2-round hash in 32-bit lanes, the carry of the low
   word into the high word where base + lane wraps. */
static inline __m256 lt_code_uniform8(uint64_t base, uint64_t key) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
  const __m256i b_lo = _mm256_set1_epi32((int)(uint32_t)base);
  const __m256i lo = _mm256_add_epi32(b_lo, lane);
  /* carried where lo < b_lo unsigned (compare with the sign bits flipped): those
     lanes take lt_hash_high of the next high word */
  const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(b_lo, sign),
                                           _mm256_xor_si256(lo, sign));
  const uint32_t hi = (uint32_t)(base >> 32);
  const __m256i high = _mm256_blendv_epi8(_mm256_set1_epi32((int)lt_hash_high(hi, key)),
                                          _mm256_set1_epi32((int)lt_hash_high(hi + 1u, key)),
                                          carry);
  __m256i h = _mm256_xor_si256(_mm256_xor_si256(lo, _mm256_set1_epi32((int)(uint32_t)key)),
                               high);
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85ebca6bu));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xc2b2ae35u));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)),
                       _mm256_set1_ps(0x1p-24f));
}
#endif

static void lt_lookup16_sr(const lt_quantizer *q, const float *restrict m, float amax,
                           int64_t len, uint64_t i0, uint64_t key,
                           uint8_t *restrict code) {
  float u[16], d[16];
  int32_t first[16];
  for (int j = 0; j < 16; j++) {
    first[j] = q->first[j < q->nuniq ? j : q->nuniq - 1];
    u[j] = j < q->nuniq ? q->codebook[first[j]] : INFINITY;
  }
  for (int j = 0; j < 16; j++) d[j] = j < q->nuniq - 1 ? u[j + 1] - u[j] : 0.0f;
  int64_t k = 0;
#ifdef __AVX512F__
  {
    const __m512 am = _mm512_set1_ps(amax);
    const __m512 tu = _mm512_loadu_ps(u), td = _mm512_loadu_ps(d);
    const __m512i f = _mm512_loadu_si512(first), one = _mm512_set1_epi32(1);
    for (; k + 16 <= len; k += 16) {
      const __m512 r = lt_code_uniform16(i0 + (uint64_t)k, key);
      const __m512 x = _mm512_div_ps(_mm512_loadu_ps(m + k), am);
      __m512i i = _mm512_setzero_si512();
      for (int j = 1; j < 16; j++)
        i = _mm512_mask_add_epi32(
            i, _mm512_cmp_ps_mask(x, _mm512_set1_ps(u[j]), _CMP_GE_OQ), i, one);
      const __m512 t = _mm512_sub_ps(x, _mm512_permutexvar_ps(i, tu));
      const __m512 s = _mm512_mul_ps(r, _mm512_permutexvar_ps(i, td));
      i = _mm512_mask_add_epi32(i, _mm512_cmp_ps_mask(t, s, _CMP_GT_OQ), i, one);
      _mm_storeu_si128((__m128i *)(code + k),
                       _mm512_cvtepi32_epi8(_mm512_permutexvar_epi32(i, f)));
    }
  }
#endif
#ifdef __AVX2__
  {
    const __m256 am = _mm256_set1_ps(amax);
    const __m256 u_lo = _mm256_loadu_ps(u), u_hi = _mm256_loadu_ps(u + 8);
    const __m256 d_lo = _mm256_loadu_ps(d), d_hi = _mm256_loadu_ps(d + 8);
    const __m256 f_lo = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)first));
    const __m256 f_hi = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(first + 8)));
    for (; k + 8 <= len; k += 8) {
      const __m256 r = lt_code_uniform8(i0 + (uint64_t)k, key);
      const __m256 x = _mm256_div_ps(_mm256_loadu_ps(m + k), am);
      __m256i i = _mm256_setzero_si256();
      for (int j = 1; j < 16; j++)
        i = _mm256_sub_epi32(
            i, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_set1_ps(u[j]), _CMP_GE_OQ)));
      const __m256 t = _mm256_sub_ps(x, lt_take16(u_lo, u_hi, i));
      const __m256 s = _mm256_mul_ps(r, lt_take16(d_lo, d_hi, i));
      i = _mm256_sub_epi32(i, _mm256_castps_si256(_mm256_cmp_ps(t, s, _CMP_GT_OQ)));
      const __m256i c = _mm256_castps_si256(lt_take16(f_lo, f_hi, i));
      const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
      _mm_storel_epi64((__m128i *)(code + k), _mm_packus_epi16(c16, c16));
    }
  }
#endif
  for (; k < len; k++) {
    const float x = m[k] / amax;
    const float r = (float)lt_code_bits(i0 + (uint64_t)k, key) * 0x1p-24f;
    int32_t i = 0;
    for (int j = 1; j < 16; j++) i += x >= u[j];
    i += (x - u[i]) > r * d[i];
    code[k] = (uint8_t)first[i];
  }
}

/* 8-bit codes rounded stochastically, by the same rule, after the nearest-code
   lookup: the nearest value u_j is an end of x's interval, so the interval's lower
   end is i = j - [x < u_j] (no search), then the same random test. (With AVX-512
   and a learned codebook, lt_quant8_sr_update_avx512 reads i from a cell table
   instead: fewer table loads, the same i.) The tables:
   the distinct values u, their gaps d = fl(u_{j+1} - u_j) and each code's value
   index, built once per quantizer and thread. */
typedef struct {
  const lt_quantizer *q; /* the quantizer the tables were built for (0: none) */
  int32_t last;          /* nuniq - 1 */
  int32_t identity;      /* every code its own value (a learned codebook): no lookups */
  float u[256], d[256];  /* d[last] = 0 (never used: i < last is tested) */
  int32_t value_of[256]; /* code -> index of its distinct value */
  int32_t first[256];    /* value index -> its lowest code (q->first, widened) */
} lt_sr8_table;

static void lt_sr8_prepare(const lt_quantizer *q, lt_sr8_table *t) {
  if (t->q == q) return;
  t->q = q;
  t->last = q->nuniq - 1;
  for (int32_t j = 0; j < q->nuniq; j++) t->u[j] = q->codebook[q->first[j]];
  for (int32_t j = 0; j < t->last; j++) t->d[j] = t->u[j + 1] - t->u[j];
  t->d[t->last] = 0.0f;
  t->identity = q->nuniq == q->ncodes;
  for (int32_t j = 0; j < q->nuniq; j++) t->first[j] = q->first[j];
  for (int32_t c = 0, j = 0; c < q->ncodes; c++) {
    while (j < t->last && q->codebook[c] >= t->u[j + 1]) j++;
    t->value_of[c] = j; /* codes are ascending: a run per value */
  }
}

#ifdef __AVX512F__
/* The rule's value index for 16 lanes: x = m / amax, j = the index of x's nearest
   value, base = the global index of lane 0. Used by lt_sr8_tile and by the fused
   lookup-and-update pass (gefen_avx512.h). */
static inline __m512i lt_sr8_round16(const lt_sr8_table *t, __m512 x, __m512i j,
                                     uint64_t base, uint64_t key) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 r = lt_code_uniform16(base, key);
  const __m512 uj = _mm512_i32gather_ps(j, t->u, 4);
  __m512i i = _mm512_mask_sub_epi32(j, _mm512_cmp_ps_mask(x, uj, _CMP_LT_OQ), j, one);
  i = _mm512_max_epi32(i, _mm512_setzero_si512());
  const __m512 ui = _mm512_i32gather_ps(i, t->u, 4);
  const __m512 di = _mm512_i32gather_ps(i, t->d, 4);
  const __mmask16 up =
      _mm512_cmp_epi32_mask(i, _mm512_set1_epi32(t->last), _MM_CMPINT_LT) &
      _mm512_cmp_ps_mask(_mm512_sub_ps(x, ui), _mm512_mul_ps(r, di), _CMP_GT_OQ);
  return _mm512_mask_add_epi32(i, up, i, one);
}
#endif

/* x: the tile's m / amax as lt_cells computed it (the rule's x, a division);
   code: in, the nearest codes; out, the stochastic ones. */
static void lt_sr8_tile(const lt_sr8_table *t, const float *restrict x, int64_t len,
                        uint64_t i0, uint64_t key, uint8_t *restrict code) {
  int64_t k = 0;
#ifdef __AVX512F__
  for (; k + 16 <= len; k += 16) { /* the scalar loop's steps, 16 lanes, gathers */
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(code + k)));
    const __m512i j = t->identity ? c : _mm512_i32gather_epi32(c, t->value_of, 4);
    const __m512i i = lt_sr8_round16(t, _mm512_loadu_ps(x + k), j, i0 + (uint64_t)k, key);
    const __m512i f = t->identity ? i : _mm512_i32gather_epi32(i, t->first, 4);
    _mm_storeu_si128((__m128i *)(code + k), _mm512_cvtepi32_epi8(f));
  }
#endif
#ifdef __AVX2__
  /* The scalar loop's steps, 8 lanes, gathers (CPUs without AVX-512; on AVX-512 the
     tail of 8 or more). A true compare is -1, so i + (x < u_j) subtracts one and
     i - up adds one. */
  for (; k + 8 <= len; k += 8) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(code + k)));
    const __m256i j = t->identity ? c : _mm256_i32gather_epi32(t->value_of, c, 4);
    const __m256 x8 = _mm256_loadu_ps(x + k);
    const __m256 uj = _mm256_i32gather_ps(t->u, j, 4);
    __m256i i = _mm256_add_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(x8, uj, _CMP_LT_OQ)));
    i = _mm256_max_epi32(i, _mm256_setzero_si256());
    const __m256 r = lt_code_uniform8(i0 + (uint64_t)k, key);
    const __m256 ui = _mm256_i32gather_ps(t->u, i, 4);
    const __m256 di = _mm256_i32gather_ps(t->d, i, 4);
    const __m256i below_last = _mm256_cmpgt_epi32(_mm256_set1_epi32(t->last), i);
    const __m256i up = _mm256_and_si256(
        below_last, _mm256_castps_si256(_mm256_cmp_ps(_mm256_sub_ps(x8, ui),
                                                      _mm256_mul_ps(r, di), _CMP_GT_OQ)));
    i = _mm256_sub_epi32(i, up);
    const __m256i f = t->identity ? i : _mm256_i32gather_epi32(t->first, i, 4);
    const __m128i f16 = _mm_packus_epi32(_mm256_castsi256_si128(f), _mm256_extracti128_si256(f, 1));
    _mm_storel_epi64((__m128i *)(code + k), _mm_packus_epi16(f16, f16));
  }
#endif
  for (; k < len; k++) {
    const int32_t j = t->value_of[code[k]];
    int32_t i = j - (x[k] < t->u[j]);
    i = i < 0 ? 0 : i;
    const float r = (float)lt_code_bits(i0 + (uint64_t)k, key) * 0x1p-24f;
    if (i < t->last) i += (x[k] - t->u[i]) > r * t->d[i];
    code[k] = (uint8_t)t->first[i];
  }
}

#endif /* LT_GEFEN_SR_H */
