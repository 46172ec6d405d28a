/*
 * bf16 <-> fp32 conversion, rounding and the parameter/gradient I/O of Gefen's CPU
 * kernel (included by gefen_step.c; leantrain/optim/precision.py is the reference:
 * the two give the same bits).
 */
#ifndef LT_GEFEN_IO_H
#define LT_GEFEN_IO_H
#include <stdint.h>
#include <string.h>

typedef struct {
  int32_t param_bf16; /* the parameter is bf16 (else fp32) */
  int32_t grad_bf16;  /* the gradient is bf16 (else fp32) */
  int32_t packed;     /* 4-bit codes two per byte (else one code per byte) */
  int32_t stochastic; /* bf16 parameter written with stochastic rounding */
  uint64_t key;       /* the rounding key (leantrain.optim.precision) */
  int32_t code_sr;    /* codes rounded stochastically (code_rounding.py) */
  int32_t unused;
  uint64_t code_key;  /* their key (code_rounding.code_key) */
  int64_t index0;     /* global flat index of element 0 (a shard's offset): the
                         hash counter of both roundings */
} lt_io;

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

/* The high word's part of lt_hash: fmix32(hi32(i) ^ hi32(key)). */
static inline uint32_t lt_hash_high(uint32_t i_hi, uint64_t key) {
  return lt_fmix32(i_hi ^ (uint32_t)(key >> 32));
}

/* The counter-based hash of both roundings: 32 random bits of global element i,
   fmix32(lo32(i) ^ lo32(key) ^ fmix32(hi32(i) ^ hi32(key))). The high word's
   round is the same for every element of a tensor below 2^32 elements, so vector
   code does it once per vector: one round per element. */
static inline uint32_t lt_hash(uint64_t i, uint64_t key) {
  return lt_fmix32((uint32_t)i ^ (uint32_t)key ^ lt_hash_high((uint32_t)(i >> 32), key));
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
  const uint64_t i0 = (uint64_t)(io->index0 + a);
  for (int64_t k = 0; k < len; k++)
    h[k] = lt_float_to_bf16_sr(src[k], lt_hash(i0 + (uint64_t)k, io->key));
}

#endif /* LT_GEFEN_IO_H */
