/*
 * The job of Gefen's fused step for one parameter (leantrain, docs/CONTRACTS.md):
 * the layout leantrain/optim/_cabi.py mirrors with ctypes, its validity check, and
 * the per-job plan lt_gefen_step_many derives once. Included by gefen_step.c after
 * lt_hyper and lt_quantizer are defined; never compiled on its own.
 */
#ifndef LT_GEFEN_JOB_H
#define LT_GEFEN_JOB_H

/* A param group's options, for jobs whose kernel call advances their step
   (lt_job.step): the per-step scalars are derived from them. */
typedef struct {
  double lr, beta1, beta2, eps, weight_decay;
  double max_step; /* lr * update_clip, already rounded to fp32 (inf: no clip) */
  int64_t maximize;
} lt_opts;

/* One parameter's step: its tensors, layout and per-step scalars. */
typedef struct {
  void *param;
  const void *grad;
  float *v;        /* exp_avg_sq */
  float *absmax;   /* exp_avg_absmax (codes only) */
  uint8_t *codes;  /* exp_avg_codes (codes only) */
  float *exp_avg;  /* fp32 momentum (bits 0 only) */
  int64_t n, period, block;
  int32_t bits, unused;
  const lt_quantizer *q;
  lt_hyper *h; /* written by the kernel when `step` is set */
  lt_io *io;   /* its keys too */
  int64_t rows; /* > 0: v holds a factored state's [r (rows), c (n / rows)] */
  float cbar;   /* with `advanced`: their column mean (factored.py) */
  int32_t advanced; /* 1: the caller advanced the factors; 0: the kernel does */
  float *step;  /* the state's step counter: the kernel advances it and derives h
                   and io's keys from opts and seed; 0: the caller did (h and io
                   are then only read) */
  const lt_opts *opts;
  int64_t seed; /* the rounding streams' seed (the parameter's position) */
} lt_job;

/* 0, or a negative number naming the invalid argument. */
static int lt_check_job(const lt_job *j) {
  if (j->n < 0 || j->period < 1 || j->block < 1) return -1;
  if (j->bits != 0 && j->bits != 4 && j->bits != 8) return -2;
  if (j->period != j->block && j->period != 1) return -3;
  const lt_quantizer *q = j->q;
  if (j->bits != 0 && (q == 0 || q->ncodes != (1 << j->bits) || q->nuniq < 1 ||
                       q->nuniq > q->ncodes || q->ncell < 1))
    return -4;
  if (j->io == 0 || j->h == 0) return -7;
  if (j->rows < 0 || (j->rows > 0 && j->n % j->rows != 0)) return -8;
  if (j->step != 0 && j->opts == 0) return -9;
  return 0;
}

typedef struct { /* derived once per job */
  int64_t nblocks, unit, nunits, grab, chunk;
  int32_t zero;
} lt_plan;

#endif /* LT_GEFEN_JOB_H */
