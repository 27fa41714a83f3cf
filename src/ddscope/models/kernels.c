/* A step's ops on the CPU (ddscope.models.native builds this file and says why): RMSNorm and the heads' norm
 * + RoPE, one call each instead of torch's five to eight dispatches; fp32 projections on weights reordered into
 * panels. Each row is computed alone, in the same order whatever the number of rows, so a tree's verify sees
 * what a decode step sees. bf16 variants round where torch's ops would: after the normalisation, after each
 * product and after the sum. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
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

void rms_norm_f32(const float *x, const float *w, float *y, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS) num_threads(threads)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float rs = inv_rms(xr, dim, eps);
    for (int64_t i = 0; i < dim; i++) y[r * dim + i] = w[i] * (xr[i] * rs);
  }
}

void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t dim, float eps,
                   int threads) {
#pragma omp parallel for if (rows * dim >= PARALLEL_ELEMENTS) num_threads(threads)
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
                   int64_t heads, int64_t d, float eps, int threads) {
  int64_t half = d / 2;
#pragma omp parallel for if (rows * heads * d >= PARALLEL_ELEMENTS) num_threads(threads)
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
                    int64_t rows, int64_t heads, int64_t d, float eps, int threads) {
  int64_t half = d / 2;
#pragma omp parallel for if (rows * heads * d >= PARALLEL_ELEMENTS) num_threads(threads)
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

/* ---- fp32 projections: y [M, N] = x [M, K] @ w^T, w reordered as panels p[N / 16][K][16] ------------------
 * Every output is one chain of FMAs over k in order, from zero, whatever M and the tile: a row's result is the
 * same bits alone or among others. A tile holds TILE_ROWS rows by TILE_PANELS panels in 24 registers; one row
 * (a decode step) runs over 8 panels instead, 8 streams through memory, what a weight read at the memory's
 * rate needs. N is a multiple of 128 (ddscope.models.native.paneled). */
#ifdef __AVX512F__
#define TILE_PANELS 4
#define TILE_ROWS 6
#define ROW_PANELS 8
#define ROW_BLOCK 256 /* rows whose activations stay in L2 while every panel passes */

void pack_f32(const float *w, float *p, int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) p[((n / 16) * K + k) * 16 + n % 16] = w[n * K + k];
}

#define TILE(MR)                                                                                                \
  static void tile_##MR(const float *x, const float *p, float *y, int64_t K, int64_t N, int64_t m0, int64_t q0) { \
    __m512 acc[MR][TILE_PANELS];                                                                                \
    for (int i = 0; i < MR; i++)                                                                                \
      for (int j = 0; j < TILE_PANELS; j++) acc[i][j] = _mm512_setzero_ps();                                    \
    const float *pk = p + q0 * K * 16, *xr = x + m0 * K;                                                        \
    for (int64_t k = 0; k < K; k++, pk += 16) {                                                                 \
      __m512 w0 = _mm512_loadu_ps(pk), w1 = _mm512_loadu_ps(pk + K * 16);                                       \
      __m512 w2 = _mm512_loadu_ps(pk + 2 * K * 16), w3 = _mm512_loadu_ps(pk + 3 * K * 16);                      \
      for (int i = 0; i < MR; i++) {                                                                            \
        __m512 xb = _mm512_set1_ps(xr[i * K + k]);                                                              \
        acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);                                                         \
        acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);                                                         \
        acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);                                                         \
        acc[i][3] = _mm512_fmadd_ps(xb, w3, acc[i][3]);                                                         \
      }                                                                                                         \
    }                                                                                                           \
    for (int i = 0; i < MR; i++)                                                                                \
      for (int j = 0; j < TILE_PANELS; j++) _mm512_storeu_ps(y + (m0 + i) * N + (q0 + j) * 16, acc[i][j]);     \
  }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t);
static const tile_fn TILES[TILE_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

static void one_row(const float *x, const float *p, float *y, int64_t K, int64_t q0) {
  __m512 acc[ROW_PANELS];
  for (int j = 0; j < ROW_PANELS; j++) acc[j] = _mm512_setzero_ps();
  const float *pk = p + q0 * K * 16;
  for (int64_t k = 0; k < K; k++, pk += 16) {
    __m512 xb = _mm512_set1_ps(x[k]);
    for (int j = 0; j < ROW_PANELS; j++) acc[j] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(pk + j * K * 16), acc[j]);
  }
  for (int j = 0; j < ROW_PANELS; j++) _mm512_storeu_ps(y + (q0 + j) * 16, acc[j]);
}

void linear_f32(const float *x, const float *p, float *y, int64_t M, int64_t K, int64_t N, int threads) {
  int64_t panels = N / 16;
#pragma omp parallel num_threads(threads)
  {
    int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    if (M == 1) {
      int64_t groups = panels / ROW_PANELS;
      for (int64_t g = groups * t / T; g < groups * (t + 1) / T; g++) one_row(x, p, y, K, g * ROW_PANELS);
    } else {
      int64_t groups = panels / TILE_PANELS, g0 = groups * t / T, g1 = groups * (t + 1) / T;
      for (int64_t mc = 0; mc < M; mc += ROW_BLOCK) {
        int64_t rows = M - mc < ROW_BLOCK ? M - mc : ROW_BLOCK, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
        for (int64_t g = g0; g < g1; g++)
          for (int64_t i = 0; i < tiles; i++) { /* tiles of even height: 33 rows as 6, 6, 6, 5, 5, 5 */
            int64_t a = rows * i / tiles, b = rows * (i + 1) / tiles;
            TILES[b - a](x, p, y, K, N, mc + a, g * TILE_PANELS);
          }
      }
    }
  }
}

/* ---- a decode step's attention: one query row over all of a sequence's keys ------------------------------
 * q [H, 1, d] (heads `q_stride` apart: a batch's rows are one row of each sequence's), k and v [Hkv, S, d]
 * (heads `head_stride` apart, rows d apart) -> out [1, H * d]. Each K/V
 * head's query heads run together, so its keys and values are read once: two passes, the scores and their
 * max, then the softmax weights summed key by key. */
static inline __m512 exp16(__m512 x) { /* e^x to about 1 ulp: 2^i * e^r, |r| <= ln2 / 2 */
  const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2_hi = _mm512_set1_ps(0.693145752f),
               ln2_lo = _mm512_set1_ps(1.42860677e-6f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  __m512 i = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(i, ln2_lo, _mm512_fnmadd_ps(i, ln2_hi, x));
  __m512 y = _mm512_set1_ps(1.0f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, i);
}

static inline __m512 load16_f32(const float *x) { return _mm512_loadu_ps(x); }
static inline __m512 load16_bf16(const uint16_t *x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

#define MAX_HEAD 256 /* head_dim */
#define MAX_GROUP 8  /* query heads per K/V head */
#define ATTEND(SUFFIX, T, LOAD, STORE)                                                                          \
  void attend_##SUFFIX(const T *q, const T *k, const T *v, T *out, int64_t heads, int64_t kv_heads, int64_t S,  \
                       int64_t d, int64_t q_stride, int64_t head_stride, float scale, int threads) {            \
    int64_t group = heads / kv_heads, chunks = d / 16;                                                          \
    _Pragma("omp parallel num_threads(threads)") {                                                              \
      float *scores = malloc(sizeof(float) * group * (S + 16));                                                 \
      _Pragma("omp for schedule(static)")                                                                       \
      for (int64_t kv = 0; kv < kv_heads; kv++) {                                                               \
        const T *kh = k + kv * head_stride, *vh = v + kv * head_stride;                                         \
        __m512 qv[MAX_GROUP][MAX_HEAD / 16], acc[MAX_GROUP][MAX_HEAD / 16];                                     \
        float top[MAX_GROUP], total[MAX_GROUP];                                                                 \
        for (int64_t g = 0; g < group; g++) {                                                                   \
          for (int64_t c = 0; c < chunks; c++) {                                                                \
            qv[g][c] = LOAD(q + (kv * group + g) * q_stride + c * 16);                                          \
            acc[g][c] = _mm512_setzero_ps();                                                                    \
          }                                                                                                     \
          top[g] = -INFINITY, total[g] = 0.0f;                                                                  \
        }                                                                                                       \
        for (int64_t s = 0; s < S; s++)                                                                         \
          for (int64_t g = 0; g < group; g++) {                                                                 \
            __m512 dot = _mm512_setzero_ps();                                                                   \
            for (int64_t c = 0; c < chunks; c++) dot = _mm512_fmadd_ps(qv[g][c], LOAD(kh + s * d + c * 16), dot); \
            float x = _mm512_reduce_add_ps(dot) * scale;                                                        \
            scores[g * (S + 16) + s] = x;                                                                       \
            top[g] = x > top[g] ? x : top[g];                                                                   \
          }                                                                                                     \
        for (int64_t g = 0; g < group; g++) { /* the 16 past S are padding, never read back */                 \
          float *row = scores + g * (S + 16);                                                                   \
          for (int64_t s = S; s < S + 16; s++) row[s] = -INFINITY;                                              \
          for (int64_t s = 0; s < S; s += 16)                                                                   \
            _mm512_storeu_ps(row + s, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + s), _mm512_set1_ps(top[g])))); \
        }                                                                                                       \
        for (int64_t s = 0; s < S; s++)                                                                         \
          for (int64_t g = 0; g < group; g++) {                                                                 \
            float e = scores[g * (S + 16) + s];                                                                 \
            __m512 w = _mm512_set1_ps(e);                                                                       \
            total[g] += e;                                                                                      \
            for (int64_t c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(w, LOAD(vh + s * d + c * 16), acc[g][c]); \
          }                                                                                                     \
        for (int64_t g = 0; g < group; g++) {                                                                   \
          __m512 inv = _mm512_set1_ps(1.0f / total[g]);                                                         \
          for (int64_t c = 0; c < chunks; c++) STORE(out + (kv * group + g) * d + c * 16, _mm512_mul_ps(acc[g][c], inv)); \
        }                                                                                                       \
      }                                                                                                         \
      free(scores);                                                                                             \
    }                                                                                                           \
  }
static inline void store16_f32(float *y, __m512 x) { _mm512_storeu_ps(y, x); }
static inline void store16_bf16(uint16_t *y, __m512 x) { _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(x)); }
ATTEND(f32, float, load16_f32, store16_f32)
ATTEND(bf16, uint16_t, load16_bf16, store16_bf16)
/* ---- the MLP's gate: silu(gate) * up, elementwise ------------------------------------------------------- */
static inline __m512 silu16(__m512 g) { /* g / (1 + e^-g) */
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

void silu_mul_f32(const float *g, const float *u, float *y, int64_t n, int threads) {
#pragma omp parallel for if (n >= PARALLEL_ELEMENTS) num_threads(threads)
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
    __m512 s = silu16(_mm512_maskz_loadu_ps(m, g + i));
    _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + i)));
  }
}

void silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t n, int threads) {
#pragma omp parallel for if (n >= PARALLEL_ELEMENTS) num_threads(threads)
  for (int64_t i = 0; i < n; i += 16) { /* rounded where torch's silu, then its product, round */
    __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
    __m512 gv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, g + i)), 16));
    __m512 uv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, u + i)), 16));
    __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(silu16(gv))), 16));
    _mm256_mask_storeu_epi16(y + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, uv)));
  }
}
#endif /* __AVX512F__ */
