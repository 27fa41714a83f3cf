/* A decode step's small ops on the CPU, one call each instead of torch's five to eight dispatches
 * (ddscope.models.native builds this file and says why). Each row is computed alone, in the same order
 * whatever the number of rows, so a tree's verify sees what a decode step sees. bf16 variants round where
 * torch's ops would: after the normalisation, after each product and after the sum. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define PARALLEL_ELEMENTS (1 << 16) /* fewer than this run on the calling thread alone */

static inline float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f2bf(float f) { /* round to nearest even, as torch does; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* 1 / RMS of one row, summed in LANES partial sums (a fixed order the compiler vectorises). */
static inline float inv_rms(const float *x, int64_t dim, float eps) {
  float part[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= dim; i += LANES)
    for (int j = 0; j < LANES; j++) part[j] += x[i + j] * x[i + j];
  float ss = 0.0f;
  for (int j = 0; j < LANES; j++) ss += part[j];
  for (; i < dim; i++) ss += x[i] * x[i];
  return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* Widen one bf16 row into scratch (at most 16k wide: a row of hidden or head_dim). */
#define MAX_DIM 16384
static inline void widen(const uint16_t *x, float *out, int64_t dim) {
  for (int64_t i = 0; i < dim; i++) out[i] = bf2f(x[i]);
}

void rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float rs = inv_rms(xr, dim, eps);
    for (int64_t i = 0; i < dim; i++) y[r * dim + i] = w[i] * (xr[i] * rs);
  }
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    float xr[MAX_DIM];
    widen(x + r * dim, xr, dim);
    float rs = inv_rms(xr, dim, eps);
    for (int64_t i = 0; i < dim; i++) y[r * dim + i] = f2bf(bf2f(w[i]) * bf2f(f2bf(xr[i] * rs)));
  }
}

/* x [rows, heads, d] -> y [heads, rows, d]: each head's RMSNorm (w may be NULL: none), then rotary
 * embedding with cos/sin [rows, d] (the rotate-half convention). */
void norm_rope_f32(const float *x, const float *w, const float *cos, const float *sin, float *y, int64_t rows,
                   int64_t heads, int64_t d, float eps) {
  int64_t half = d / 2;
#pragma omp parallel for if (rows * heads * d >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    float n[MAX_DIM];
    const float *c = cos + r * d, *s = sin + r * d;
    for (int64_t h = 0; h < heads; h++) {
      const float *xh = x + (r * heads + h) * d;
      float rs = w ? inv_rms(xh, d, eps) : 1.0f;
      for (int64_t i = 0; i < d; i++) n[i] = w ? w[i] * (xh[i] * rs) : xh[i];
      float *out = y + (h * rows + r) * d;
      for (int64_t i = 0; i < half; i++) out[i] = n[i] * c[i] + (-n[i + half]) * s[i];
      for (int64_t i = half; i < d; i++) out[i] = n[i] * c[i] + n[i - half] * s[i];
    }
  }
}

void norm_rope_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *cos, const uint16_t *sin, uint16_t *y,
                    int64_t rows, int64_t heads, int64_t d, float eps) {
  int64_t half = d / 2;
#pragma omp parallel for if (rows * heads * d >= PARALLEL_ELEMENTS)
  for (int64_t r = 0; r < rows; r++) {
    float xh[MAX_DIM], n[MAX_DIM];
    const uint16_t *c = cos + r * d, *s = sin + r * d;
    for (int64_t h = 0; h < heads; h++) {
      widen(x + (r * heads + h) * d, xh, d);
      float rs = w ? inv_rms(xh, d, eps) : 1.0f;
      for (int64_t i = 0; i < d; i++) n[i] = w ? bf2f(f2bf(bf2f(w[i]) * bf2f(f2bf(xh[i] * rs)))) : xh[i];
      uint16_t *out = y + (h * rows + r) * d;
      for (int64_t i = 0; i < d; i++) {
        float rot = i < half ? -n[i + half] : n[i - half];
        out[i] = f2bf(bf2f(f2bf(n[i] * bf2f(c[i]))) + bf2f(f2bf(rot * bf2f(s[i]))));
      }
    }
  }
}
