/*
 * Gefen's fused CPU step for one fp32 or bf16 parameter (leantrain,
 * docs/CONTRACTS.md).
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
 *   param -= (lr / bc1) * (codebook[code] * absmax) / (sqrt(v) / sqrt(bc2) + eps)
 * With period 1 the second moment is per element (and `block` is the absmax block).
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
 * 8-bit table lookups (old code -> value, cell -> code) are scalar loops: on the
 * CPU we measured (AMD EPYC Zen 3, AVX2, under KVM) a vpgatherdd costs as much as
 * eight scalar loads, and a version of pass 2 fused into one AVX2 loop with three
 * gathers per 8 elements was ~10% slower than the scalar lookup + vector update.
 * The 8-bit lookup is branch-free (a mispredicted branch per element in a cell
 * holding a midpoint cost 30% of the step with a learned codebook). A 4-bit codebook
 * fits in two AVX2 registers: old codes are dequantized with in-register permutes,
 * and new ones are found by comparing with the 15 midpoints. Everything else is in
 * loops the compiler vectorizes.
 *
 * Rounding follows the PyTorch reference op by op: g*g rounded to fp32 then summed
 * (here in double, at least as accurate as torch's cascade sum), torch's fused
 * multiply-add formulas for lerp and `add_(x, alpha)`, and addcdiv's
 * `p + (value * m) / denom`. -ffp-contract=off stops the compiler from fusing any
 * other multiply-add. sqrtf is correctly rounded where torch's vectorized sqrt may
 * be 1 ulp off, so the two can differ by an ulp of the update.
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

#define LT_TILE 512       /* elements per L1-resident tile of the 8-bit lookup */
#define LT_MAX_CHUNK 8192 /* longest sub-chunk (per-thread buffers ~13 B/element) */

#if defined(__GNUC__) && !defined(__clang__)
#define LT_SCALAR __attribute__((optimize("no-tree-vectorize")))
#else
#define LT_SCALAR
#endif

typedef struct {
  const float *codebook; /* [ncodes] values, dequantization of the old codes */
  const float *uniq;     /* [nuniq] distinct codebook values, ascending */
  const float *mid;      /* [nuniq] midpoints, mid[nuniq-1] = +inf (sentinel) */
  const uint8_t *first;  /* [nuniq] lowest code holding uniq[k] */
  const int16_t *lut;    /* [ncell] midpoints in lower cells (~count: cell has some) */
  const uint64_t *entry; /* [ncell] j = that count << 32 | fp32 bits of mid[j] */
  int32_t ncodes;        /* 2**bits */
  int32_t nuniq;
  int32_t ncell;
  int32_t steps;         /* the most midpoints any one cell holds */
} lt_quantizer;

typedef struct {
  float w1;        /* 1 - beta1, the weight of g in the lerp */
  float beta2;     /* beta2 */
  float omb2;      /* 1 - beta2 */
  float decay;     /* 1 - lr * weight_decay */
  float step_size; /* lr / (1 - beta1**step) */
  float sqrt_bc2;  /* sqrt(1 - beta2**step) */
  float eps;       /* added to the corrected sqrt(v) */
  float sign;      /* +1, or -1 when maximizing */
} lt_hyper;

typedef struct {
  int32_t param_bf16; /* the parameter is bf16 (else fp32) */
  int32_t grad_bf16;  /* the gradient is bf16 (else fp32) */
  int32_t packed;     /* 4-bit codes two per byte (else one code per byte) */
  int32_t stochastic; /* bf16 parameter written with stochastic rounding */
  uint64_t key;       /* the rounding key (leantrain.optim.precision) */
} lt_io;

typedef struct { /* per-thread buffers of `chunk` elements */
  float *m;      /* momentum, then m / absmax */
  float *val;    /* the quantized value of each element */
  int32_t *cell; /* lookup cell of each element */
  uint8_t *code; /* new codes */
  float *g;      /* the gradient in fp32 (bf16 gradients only) */
  float *p;      /* the parameter in fp32 (bf16 parameters only) */
} lt_scratch;

/* ---- bf16 <-> fp32 and rounding (see leantrain/optim/precision.py) ---- */
static inline float lt_bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Round to nearest, ties to even (torch's conversion); NaN stays a quiet NaN. */
static inline uint16_t lt_float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* MurmurHash3's 32-bit finalizer. */
static inline uint32_t lt_fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

/* Stochastic rounding of f to bf16 with 32 random bits r: away from zero iff
   r < frac * 2^32, frac = (low 16 bits) / 2^16; never to infinity (saturates);
   NaN and infinities as the nearest conversion. */
static inline uint16_t lt_float_to_bf16_sr(float f, uint32_t r) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag >= 0x7f800000u) return lt_float_to_bf16(f);
  const uint32_t a = mag >> 16, low = mag & 0xffffu;
  const uint32_t away = (a < 0x7f7fu) & ((r >> 16) < low);
  return (uint16_t)(((u >> 16) & 0x8000u) | (a + away));
}

static void lt_load(const void *src, int bf16, int64_t a, int64_t len, float *restrict out) {
  if (!bf16) {
    memcpy(out, (const float *)src + a, (size_t)len * sizeof(float));
    return;
  }
  const uint16_t *restrict h = (const uint16_t *)src + a;
  for (int64_t k = 0; k < len; k++) out[k] = lt_bf16_to_float(h[k]);
}

/* Writes fp32 values of elements [a, a + len) into a bf16 parameter. */
static void lt_store_bf16(uint16_t *restrict dst, const float *restrict src, int64_t a,
                          int64_t len, const lt_io *io) {
  uint16_t *restrict h = dst + a;
  if (!io->stochastic) {
    for (int64_t k = 0; k < len; k++) h[k] = lt_float_to_bf16(src[k]);
    return;
  }
  const uint32_t k_lo = (uint32_t)io->key, k_hi = (uint32_t)(io->key >> 32);
  for (int64_t k = 0; k < len; k++) {
    const uint64_t i = (uint64_t)(a + k);
    const uint32_t r = lt_fmix32(lt_fmix32((uint32_t)i ^ k_lo) ^ (uint32_t)(i >> 32) ^ k_hi);
    h[k] = lt_float_to_bf16_sr(src[k], r);
  }
}

#ifdef __AVX2__
/* A 16-entry codebook lookup of 8 codes (int32 lanes) with two in-register
   permutes and a blend on bit 3: no memory gather. */
static inline __m256 lt_take16(__m256 lo, __m256 hi, __m256i idx) {
  const __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

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

/* Old codes of [a, a + len) looked up in the codebook (scalar: see header). */
LT_SCALAR static void lt_take_codebook(const float *restrict cb,
                                       const uint8_t *restrict codes, int bits,
                                       int packed, int64_t a, int64_t len,
                                       float *restrict out) {
#ifdef __AVX2__
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
    lt_take_codebook(cb, codes, bits, packed, a, len, m_out);
#ifdef __AVX2__
    /* the same arithmetic, lane j of the vectors being acc[j] / top[j] below */
    const __m256 v_amax = _mm256_set1_ps(amax_old), v_sign = _mm256_set1_ps(sign);
    const __m256 v_wc = _mm256_set1_ps(wc);
    const __m256i v_abs = _mm256_set1_epi32(0x7fffffff);
    __m256i v_top = _mm256_setzero_si256();
    __m256d v_lo = _mm256_setzero_pd(), v_hi = _mm256_setzero_pd();
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

/* x = m / amax (in place) and its lookup cell; NaN -> cell 0 (never out of range).
   Vectorizes (the division above all, ~8x cheaper than in the lookup loop). */
static void lt_cells(const lt_quantizer *q, float *restrict m, float amax, int64_t len,
                     int32_t *restrict cell) {
  const float half = 0.5f * (float)q->ncell, top = (float)(q->ncell - 1);
  for (int64_t k = 0; k < len; k++) {
    float x = m[k] / amax;
    float t = (x + 1.0f) * half;
    t = t >= 0.0f ? t : 0.0f;
    t = t <= top ? t : top;
    m[k] = x;
    cell[k] = (int32_t)t;
  }
}

/* Nearest value and code of each x, branch-free: the cell's table entry gives the
   number j of midpoints in lower cells (stored bitwise-NOT'ed when the cell holds
   midpoints: j ^ (j >> 15) undoes that without a branch), then `steps` comparisons
   j += x > mid[j] (steps = the most midpoints in one cell, 1 for a learned codebook)
   count the cell's own midpoints below x. Midpoints of higher cells are above x,
   and mid[nuniq - 1] = +inf stops j (NaN compares false). No data-dependent
   branch: a mispredicted one per cell holding a midpoint cost more than the lookup.
   Scalar: see the header on gathers. */
LT_SCALAR static void lt_lookup(const lt_quantizer *q, const float *restrict x,
                                const int32_t *restrict cell, int64_t len,
                                float *restrict val, uint8_t *restrict code) {
  const int16_t *restrict lut = q->lut;
  const float *restrict mid = q->mid, *restrict uniq = q->uniq;
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
      val[k] = uniq[j];
      code[k] = (uint8_t)j;
    }
    return;
  }
  const int32_t steps = q->steps;
  for (int64_t k = 0; k < len; k++) {
    int32_t j = lut[cell[k]];
    j ^= j >> 15;
    for (int32_t s = 0; s < steps; s++) j += x[k] > mid[j];
    val[k] = uniq[j];
    code[k] = first[j];
  }
}

/* 4-bit codebooks: the same rule by comparing with every midpoint (at most 15),
   k = #{j : mid_j < x}, picking value and code with selects. Vectorizes, unlike a
   table lookup. Midpoints past nuniq - 1 are +inf and never pass. */
static void lt_lookup16(const lt_quantizer *q, const float *restrict m, float amax,
                        int64_t len, float *restrict val, uint8_t *restrict code) {
  float mid[15], uniq[16];
  int32_t first[16];
  for (int j = 0; j < 16; j++) {
    if (j < 15) mid[j] = j < q->nuniq - 1 ? q->mid[j] : INFINITY;
    uniq[j] = q->uniq[j < q->nuniq ? j : q->nuniq - 1];
    first[j] = q->first[j < q->nuniq ? j : q->nuniq - 1];
  }
  int64_t k = 0;
#ifdef __AVX2__
  /* Count the midpoints below x with 15 compares, then take value and code with
     in-register permutes: ~2/3 of the operations of the selects below. */
  const __m256 am = _mm256_set1_ps(amax);
  const __m256 u_lo = _mm256_loadu_ps(uniq), u_hi = _mm256_loadu_ps(uniq + 8);
  const __m256 f_lo = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)first));
  const __m256 f_hi = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(first + 8)));
  for (; k + 8 <= len; k += 8) {
    const __m256 x = _mm256_div_ps(_mm256_loadu_ps(m + k), am);
    __m256i cnt = _mm256_setzero_si256();
    for (int j = 0; j < 15; j++) /* a true compare is -1: subtract it */
      cnt = _mm256_sub_epi32(
          cnt, _mm256_castps_si256(_mm256_cmp_ps(x, _mm256_set1_ps(mid[j]), _CMP_GT_OQ)));
    _mm256_storeu_ps(val + k, lt_take16(u_lo, u_hi, cnt));
    const __m256i c = _mm256_castps_si256(lt_take16(f_lo, f_hi, cnt));
    const __m128i c16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64((__m128i *)(code + k), _mm_packus_epi16(c16, c16));
  }
#endif
  for (; k < len; k++) {
    const float x = m[k] / amax;
    float v = uniq[0];
    int32_t c = first[0];
#pragma GCC unroll 16
    for (int j = 0; j < 15; j++) {
      const int above = x > mid[j];
      v = above ? uniq[j + 1] : v;
      c = above ? first[j + 1] : c;
    }
    val[k] = v;
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

/* p = p * decay - (step_size * m) / denom over len elements, m = scale * val
   (p, vel: those elements of the parameter in fp32 and, with period 1, of v). */
static void lt_update(float *restrict p, const float *restrict val, float scale,
                      const float *restrict vel, float denom_block, const lt_hyper *h,
                      int64_t len) {
  const float ss = h->step_size, decay = h->decay;
  if (vel == 0) {
    for (int64_t k = 0; k < len; k++) {
      float w = p[k] * decay;
      p[k] = w - (ss * (val[k] * scale)) / denom_block;
    }
  } else { /* period 1: one second moment per element */
    const float *restrict v = vel;
    for (int64_t k = 0; k < len; k++) {
      float denom = sqrtf(v[k]) / h->sqrt_bc2 + h->eps;
      float w = p[k] * decay;
      p[k] = w - (ss * (val[k] * scale)) / denom;
    }
  }
}

/* One block [s, s + len): both passes. */
static void lt_block(void *param, const void *grad, float *restrict v,
                     float *restrict absmax, uint8_t *restrict codes,
                     float *restrict exp_avg, int64_t n, int64_t b, int64_t s,
                     int64_t len, int per_element_v, int bits, const lt_quantizer *q,
                     const lt_hyper *h, const lt_io *io, int64_t chunk, int32_t zero,
                     lt_scratch *w) {
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
  if (!per_element_v) {
    const float mean = (float)(sumsq / (double)len);
    const float vb = fmaf(h->omb2, mean, v[b] * h->beta2); /* torch's add_(x, alpha) */
    v[b] = vb;
    denom = sqrtf(vb) / h->sqrt_bc2 + h->eps;
  }
  if (bits) absmax[b] = amax;
  const float *vel = per_element_v ? v + s : 0;
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
    const float *ve = vel ? vel + a : 0;
    if (!bits) {
      memcpy(exp_avg + s + a, w->m, (size_t)l * sizeof(float));
      lt_update(p, w->m, 1.0f, ve, denom, h, l);
    } else {
      if (amax > 0.0f && bits == 8) {
        /* in L1-resident tiles: the cells, values and codes a loop writes are read
           by the next one before they leave L1 */
        for (int64_t t = 0; t < l; t += LT_TILE) {
          const int64_t tl = l - t < LT_TILE ? l - t : LT_TILE;
          lt_cells(q, w->m + t, amax, tl, w->cell);
          lt_lookup(q, w->m + t, w->cell, tl, w->val, codes + s + a + t);
          lt_update(p + t, w->val, amax, ve ? ve + t : 0, denom, h, tl);
        }
      } else {
        if (amax > 0.0f && bits == 4) {
          lt_lookup16(q, w->m, amax, l, w->val, w->code);
        } else if (amax > 0.0f) {
          lt_cells(q, w->m, amax, l, w->cell);
          lt_lookup(q, w->m, w->cell, l, w->val, w->code);
        } else {
          for (int64_t k = 0; k < l; k++) {
            w->val[k] = q->uniq[zero];
            w->code[k] = q->first[zero];
          }
        }
        if (bits == 8 || !packed)
          memcpy(codes + s + a, w->code, (size_t)l);
        else
          lt_store_codes(codes, 1, n, s + a, l, w->code);
        lt_update(p, w->val, amax, ve, denom, h, l);
      }
    }
    if (io->param_bf16) lt_store_bf16((uint16_t *)param, w->p, s + a, l, io);
  }
}

/* Returns 0, or a negative number naming the invalid argument. */
int lt_gefen_step(void *param, const void *grad, float *v, float *absmax, uint8_t *codes,
                  float *exp_avg, int64_t n, int64_t period, int64_t block, int32_t bits,
                  const lt_quantizer *q, const lt_hyper *h, const lt_io *io,
                  int64_t chunk, int32_t nthreads) {
  if (n < 0 || period < 1 || block < 1) return -1;
  if (bits != 0 && bits != 4 && bits != 8) return -2;
  if (period != block && period != 1) return -3;
  if (bits != 0 && (q == 0 || q->ncodes != (1 << bits) || q->nuniq < 1 ||
                    q->nuniq > q->ncodes || q->ncell < 1))
    return -4;
  if (chunk < 1 || chunk > LT_MAX_CHUNK) return -5;
  if (io == 0) return -7;
  if (nthreads < 1) nthreads = 1;
  if (n == 0) return 0;
  const int per_element_v = period == 1;
  const int64_t nblocks = (n + block - 1) / block;
  /* With packed 4-bit codes, a block of odd length can start in the middle of a
     byte; threads then take pairs of blocks, so no byte is written by two threads. */
  const int64_t unit = (bits == 4 && io->packed && (block & 1)) ? 2 : 1;
  const int64_t nunits = (nblocks + unit - 1) / unit;
  const int32_t zero = bits ? lt_zero_index(q) : 0;
  /* One allocation up front: a failure leaves every tensor untouched. */
  const int nt = nthreads > 1 && nunits > 1 ? nthreads : 1;
  /* Buffers staggered by a few cache lines: equal offsets modulo 4 KiB between a
     loaded and a stored stream make the CPU stall on false store-load aliasing. */
  const size_t c = (size_t)chunk, gap = 320, per = (c * 21 + 6 * gap + 63) / 64 * 64;
  char *arena = malloc(per * (size_t)nt);
  const int64_t grab = 16384 / (unit * block) > 1 ? 16384 / (unit * block) : 1;
  if (arena == 0) return -6;

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    int tid = 0;
#ifdef _OPENMP
    tid = omp_get_thread_num();
#endif
    char *base = arena + per * (size_t)tid;
    lt_scratch w = {(float *)base,
                    (float *)(base + 4 * c + gap),
                    (int32_t *)(base + 8 * c + 2 * gap),
                    (uint8_t *)(base + 12 * c + 3 * gap),
                    (float *)(base + 13 * c + 4 * gap),
                    (float *)(base + 17 * c + 5 * gap)};
    /* Dynamic, in grabs of ~16K elements: a thread that is descheduled (a shared
       machine) holds up one grab, not a fixed half of the tensor. Blocks are
       independent, so the result does not depend on who takes which. */
#pragma omp for schedule(dynamic, grab)
    for (int64_t u = 0; u < nunits; u++) {
      const int64_t b_end = (u + 1) * unit < nblocks ? (u + 1) * unit : nblocks;
      for (int64_t b = u * unit; b < b_end; b++) {
        const int64_t s = b * block;
        const int64_t len = s + block <= n ? block : n - s;
        lt_block(param, grad, v, absmax, codes, exp_avg, n, b, s, len, per_element_v,
                 bits, q, h, io, chunk, zero, &w);
      }
    }
  }
  free(arena);
  return 0;
}

/* Let Python check the struct layouts and the buffer limit of the library it loaded. */
int lt_sizeof_quantizer(void) { return (int)sizeof(lt_quantizer); }
int lt_sizeof_hyper(void) { return (int)sizeof(lt_hyper); }
int lt_sizeof_io(void) { return (int)sizeof(lt_io); }
int lt_max_chunk(void) { return LT_MAX_CHUNK; }
