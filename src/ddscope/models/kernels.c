/* A step's ops on the CPU (ddscope.models.native builds this file and says why): RMSNorm and the heads' norm
 * + RoPE, one call each instead of torch's five to eight dispatches; projections on weights reordered into
 * panels (fp32; bf16 on AMX, vdpbf16ps, or widened to fp32); the attention of a few rows (fp32 trees as two panel
 * products); a decode row or a tree's rows through a layer in one call (a decode row on a scattered cache: two
 * around its write). Written once over vec.h's 16-lane vector and compiled per ISA (AVX-512, AVX2, generic).
 * Each row is computed alone, in the same order whatever the number of rows, so a row's result does not depend
 * on the rows beside it (and in bf16 a tree's verify sees what a decode step sees). bf16 variants round where
 * torch's ops would: after the normalisation, after each product and after the sum. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

#include "vec.h"

#define PARALLEL_ELEMENTS (1 << 16) /* fewer than this run on the calling thread alone */

const char *kernels_isa(void) { return VF_ISA; }

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

/* ---- fp32 projections: y [M, N] = x [M, K] @ w^T, w reordered as groups of 4 panels of 16 outputs, their k rows
 * side by side: p[N / 64][K][64] ---------------------------------------------------------------------------------
 * Every output is one chain of FMAs over k in order, from zero, whatever M and the tile: a row's result is the
 * same bits alone or among others, and on every ISA. A tile holds TILE_ROWS rows by VF_WIDTH of a group's panels
 * in registers (24 of AVX-512's 32, 12 of AVX2's 16); one row (a decode step) runs over a whole group. Each group
 * is one stream through memory: the hardware prefetcher follows one stream better than 4 panels laid one after
 * another (docs/journal.md has the measurement). N is a multiple of 128 (ddscope.models.native.paneled). */
#define TILE_PANELS 4
#define GROUP (TILE_PANELS * 16) /* floats in a group's k row */
#define SUB_TILES (TILE_PANELS / VF_WIDTH) /* tiles side by side across a group */
#define TILE_ROWS 6
#define ROW_BLOCK 256 /* rows whose activations stay in L2 while every panel passes */

void pack_f32(const float *w, float *p, int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) p[(n / GROUP * K + k) * GROUP + n % GROUP] = w[n * K + k];
}

/* A register tile's step: acc[i][j] += (row i's scalar, an expression of i) * w[j], for MR rows by VF_WIDTH. */
#define FMA_ROWS(MR, SCALAR)                                                                                    \
  for (int i = 0; i < MR; i++) {                                                                                \
    vf b = vf_set1(SCALAR);                                                                                     \
    for (int j = 0; j < VF_WIDTH; j++) acc[i][j] = vf_fma(b, w[j], acc[i][j]);                                  \
  }
/* One beat's share of a stream's `lines` prefetched into L2 over `beats` beats: `due` carries the remainder,
 * so the lines go evenly and all of them by the last beat (in one burst, they stall the FMAs they hide behind). */
static inline const char *spread(const char *next, int64_t *due, int64_t lines, int64_t beats) {
  for (*due += lines; *due >= beats; *due -= beats, next += 64) PREFETCH_L2(next);
  return next;
}
/* A tile over k in [k0, k1) and panels [q0, q0 + VF_WIDTH), its sums carried in y from the step before; with
 * `next`, it also prefetches lines [l, l1) of the weights further on in the thread's stream into L2, evenly over
 * its k loop's beats: the later tiles run from L2 (or L1, in steps of k) while the memory streams the rest in. */
#define TILE(MR)                                                                                                \
  static void tile_##MR(const float *x, const float *p, float *y, int64_t K, int64_t N, int64_t m0, int64_t q0, \
                        int64_t k0, int64_t k1) {                                                               \
    TILE_BODY(MR, )                                                                                             \
  }                                                                                                             \
  static void fetching_tile_##MR(const float *x, const float *p, float *y, int64_t K, int64_t N, int64_t m0,     \
                                 int64_t q0, int64_t k0, int64_t k1, const float *next, int64_t l, int64_t l1) { \
    int64_t due = 0, beats = (k1 - k0) / BEAT;                                                                 \
    const char *at = (const char *)(next + l * 16);                                                             \
    TILE_BODY(MR, at = spread(at, &due, l1 - l, beats);)                                                        \
  }
#define TILE_K(MR, kk)                                                                                          \
  {                                                                                                             \
    const float *pq = pk + ((kk) - k) * GROUP;                                                                  \
    vf w[VF_WIDTH];                                                                                             \
    for (int j = 0; j < VF_WIDTH; j++) w[j] = vf_load(pq + j * 16);                                             \
    FMA_ROWS(MR, xr[i * K + (kk)])                                                                              \
  }
#define BEAT 4 /* k rows a beat of the loop: its prefetch bookkeeping once a beat, not once a k */
#define TILE_BODY(MR, FETCH)                                                                                    \
    vf acc[MR][VF_WIDTH];                                                                                       \
    for (int i = 0; i < MR; i++)                                                                                \
      for (int j = 0; j < VF_WIDTH; j++)                                                                        \
        acc[i][j] = k0 ? vf_load(y + (m0 + i) * N + (q0 + j) * 16) : vf_zero();                                \
    const float *pk = p + (q0 / TILE_PANELS * K + k0) * GROUP + q0 % TILE_PANELS * 16, *xr = x + m0 * K;        \
    int64_t k = k0;                                                                                             \
    for (; k + BEAT <= k1; k += BEAT, pk += BEAT * GROUP) {                                                     \
      FETCH                                                                                                     \
      for (int u = 0; u < BEAT; u++) TILE_K(MR, k + u)                                                          \
    }                                                                                                           \
    for (; k < k1; k++, pk += GROUP) TILE_K(MR, k)                                                              \
    for (int i = 0; i < MR; i++)                                                                                \
      for (int j = 0; j < VF_WIDTH; j++) vf_store(y + (m0 + i) * N + (q0 + j) * 16, acc[i][j]);
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
typedef void (*fetching_tile_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                 int64_t, const float *, int64_t, int64_t);
static const tile_fn TILES[TILE_ROWS + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};
static const fetching_tile_fn FETCHING_TILES[TILE_ROWS + 1] = {0, fetching_tile_1, fetching_tile_2, fetching_tile_3,
                                                               fetching_tile_4, fetching_tile_5, fetching_tile_6};
#define FETCH_TILES 12 /* at most this many tiles of a row block prefetch: a prefill's many rows run from L2 */
#define STEP_TILES 4   /* from this many tiles, k in steps of K_STEP: a group's rows for it (16 KB) stay in L1 */
#define K_STEP 64
#define FETCH_STEPS 4 /* in steps of k, a step's tiles ask for the weights 4 steps on (64 KB); else the next group's */

static void one_row(const float *x, const float *p, float *y, int64_t K, int64_t q0) {
  vf acc[TILE_PANELS];
  for (int j = 0; j < TILE_PANELS; j++) acc[j] = vf_zero();
  const float *pk = p + q0 / TILE_PANELS * K * GROUP;
  for (int64_t k = 0; k < K; k++, pk += GROUP) {
    vf xb = vf_set1(x[k]);
    for (int j = 0; j < TILE_PANELS; j++) acc[j] = vf_fma(xb, vf_load(pk + j * 16), acc[j]);
  }
  for (int j = 0; j < TILE_PANELS; j++) vf_store(y + (q0 + j) * 16, acc[j]);
}

void linear_f32(const float *x, const float *p, float *y, int64_t M, int64_t K, int64_t N, int threads) {
  int64_t panels = N / 16;
#pragma omp parallel num_threads(threads)
  {
    int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    if (M == 1) {
      int64_t groups = panels / TILE_PANELS;
      for (int64_t g = groups * t / T; g < groups * (t + 1) / T; g++) one_row(x, p, y, K, g * TILE_PANELS);
    } else {
      int64_t groups = panels / TILE_PANELS, g0 = groups * t / T, g1 = groups * (t + 1) / T;
      for (int64_t mc = 0; mc < M; mc += ROW_BLOCK) {
        int64_t rows = M - mc < ROW_BLOCK ? M - mc : ROW_BLOCK, tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
        int64_t step = tiles >= STEP_TILES && tiles <= FETCH_TILES ? K_STEP : K;
        int64_t lead = step < K ? FETCH_STEPS * step : K; /* k rows of the thread's stream its tiles fetch ahead */
        int64_t calls = tiles * SUB_TILES, lines = step * GROUP / 16;
        const float *end = p + g1 * GROUP * K;
        for (int64_t g = g0; g < g1; g++) /* tiles of even height: 33 rows as 6, 6, 6, 5, 5, 5 */
          for (int64_t k0 = 0; k0 < K; k0 += step) {
            const float *next = p + (g * K + k0 + lead) * GROUP;
            if (tiles > FETCH_TILES || next >= end) next = 0;
            for (int64_t i = 0, c = 0; i < tiles; i++)
              for (int64_t s = 0; s < SUB_TILES; s++, c++) {
                int64_t a = rows * i / tiles, b = rows * (i + 1) / tiles, k1 = k0 + step < K ? k0 + step : K;
                int64_t q0 = g * TILE_PANELS + s * VF_WIDTH;
                if (next)
                  FETCHING_TILES[b - a](x, p, y, K, N, mc + a, q0, k0, k1, next, lines * c / calls,
                                        lines * (c + 1) / calls);
                else
                  TILES[b - a](x, p, y, K, N, mc + a, q0, k0, k1);
              }
          }
      }
    }
  }
}

/* ---- bf16 projections: y [M, N] = x [M, K] @ w^T, w reordered as panels p[N / 16][K / 2][16][2] -------------
 * (pair-interleaved: a k pair's 16 outputs are one 64-byte line, the layout the tile unit's B operand and
 * vdpbf16ps's second operand read, and two shifts widen). Each output sums its k pairs in order from zero in
 * fp32 and is rounded once to bf16, so a row's result is the same bits whatever M. K and N are multiples of 32
 * (ddscope.models.native.paneled). The products: AMX's tiles where Linux lends them, else vdpbf16ps (AVX512-BF16,
 * e.g. AMD Zen 4), else each pair's two products widened to fp32 (a 16-bit shift) as two FMAs (AVX2, any CPU
 * without bf16 instructions: torch emulates its bf16 products there, far off the memory's rate). */
void pack_bf16(const uint16_t *w, uint16_t *p, int64_t N, int64_t K, int threads) {
#pragma omp parallel for num_threads(threads)
  for (int64_t n = 0; n < N; n++)
    for (int64_t k = 0; k < K; k++) p[((n / 16) * (K / 2) + k / 2) * 32 + (n % 16) * 2 + k % 2] = w[n * K + k];
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* AMX: a tile of up to 16 rows by 2 panels sums its k blocks in order; a decode step reads the weight at near the
 * memory's rate and a prefill runs at the tile unit's rate. */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROW_BLOCK 256 /* rows whose activations stay in L2 while a thread's panels pass */
#define AMX_STREAM_ROWS 128 /* up to this many rows, a row block's first pass asks for each panel line ahead */

int amx_ready(void) { /* Linux lends a process the tile registers on request (arch_prctl XCOMP_PERM, XTILEDATA) */
  static int ready = -1;
  if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}


typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

/* tmm0-3: the sums of rows [0, r0) and [16, 16 + r1) by panels 0 and 1; tmm4, 5: those rows' k block; tmm6, 7:
 * the panels' k block (r1 = 0: tmm2, 3 and 5 unused). */
static void configure(int r0, int r1) {
  tile_config c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  const int rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; t++)
    if (rows[t]) c.rows[t] = rows[t], c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

/* Rows [m, m + r0 + r1) by panels 2 cp, 2 cp + 1. `stream`: the panels come from memory for a few rows, whose
 * tile products leave the L2 streamer behind: each line is asked for into L1 two k blocks ahead. */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *x, const uint16_t *p, int64_t K, int64_t m,
                                                          int64_t cp, int r1, const int stream) {
  const uint16_t *a0 = x + m * K, *a1 = a0 + 16 * K, *b0 = p + cp * 2 * K * 16, *b1 = b0 + K * 16;
  _tile_zero(0);
  _tile_zero(1);
  if (r1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = 0; kb < K / 32; kb++) {
    if (stream)
      for (int l = 0; l < 16; l++) {
        _mm_prefetch((const char *)(b0 + (kb + 2) * 512 + l * 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(b1 + (kb + 2) * 512 + l * 32), _MM_HINT_T0);
      }
    else if (kb % 4 == 0) { /* each panel's new 4 KB page: ask for the page after next (the streamer stops at each) */
      _mm_prefetch((const char *)(b0 + (kb + 8) * 512), _MM_HINT_T1);
      _mm_prefetch((const char *)(b1 + (kb + 8) * 512), _MM_HINT_T1);
    }
    _tile_loadd(4, a0 + kb * 32, K * 2);
    _tile_loadd(6, b0 + kb * 512, 64);
    _tile_loadd(7, b1 + kb * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (r1) {
      _tile_loadd(5, a1 + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

static void amx_linear(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N,
                       int threads) {
  int64_t pairs = N / 32;
#pragma omp parallel num_threads(threads)
  {
    int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), c0 = pairs * t / T, c1 = pairs * (t + 1) / T;
    int shape = -1; /* the tile shape loaded: reloaded on every call (another library may have changed it) */
    float sums[32][32];
    for (int64_t mc = 0; mc < M; mc += AMX_ROW_BLOCK) {
      int64_t m1 = M < mc + AMX_ROW_BLOCK ? M : mc + AMX_ROW_BLOCK;
      for (int64_t cp = c0; cp < c1; cp++)
        for (int64_t m = mc; m < m1; m += 32) {
          int r0 = m1 - m < 16 ? (int)(m1 - m) : 16, r1 = m1 - m - r0 < 16 ? (int)(m1 - m - r0) : 16;
          if (shape != r0 * 32 + r1) configure(r0, r1), shape = r0 * 32 + r1;
          if (m == mc && m1 - mc <= AMX_STREAM_ROWS) /* two copies, each loop unswitched */
            amx_block(x, p, K, m, cp, r1, 1);
          else
            amx_block(x, p, K, m, cp, r1, 0);
          _tile_stored(0, &sums[0][0], 128);
          _tile_stored(1, &sums[0][16], 128);
          if (r1) {
            _tile_stored(2, &sums[16][0], 128);
            _tile_stored(3, &sums[16][16], 128);
          }
          for (int i = 0; i < r0 + r1; i++) /* each sum rounded once, to nearest even */
            _mm512_storeu_si512((void *)(y + (m + i) * N + cp * 32),
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sums[i] + 16), _mm512_loadu_ps(sums[i])));
        }
    }
    _tile_release();
  }
}
#endif

/* ---- bf16 products without the tile unit (or where Linux lends it none), a pair of k at a time --------------
 * A decode row streams each panel once (one line a pair); up to DP_ROWS rows share each line, and a row block of
 * DP_ROW_BLOCK stays in L2 while a thread's panels pass. */
#define DP_ROW_BLOCK 64
#ifdef __AVX512BF16__
#define DP_ROWS 8 /* not 16: a block of 16 rows reads 16 streams of x at once, more than the prefetcher follows */
#define PAIR_PRODUCTS 2 /* bf16_products: vdpbf16ps */
typedef __m512bh wpair;
static inline wpair pair_load(const uint16_t *w) { return (__m512bh)_mm512_loadu_si512(w); }
static inline vf pair_step(vf acc, const uint16_t *x, wpair w) { /* acc + x0 w_even + x1 w_odd, one vdpbf16ps */
  uint32_t pair;
  memcpy(&pair, x, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair), w);
}
#else
#define DP_ROWS (VF_WIDTH == 1 ? 4 : 8) /* AVX2's 16 registers: 4 rows' sums of 2 each, and the pair's 4 */
#define PAIR_PRODUCTS 3 /* bf16_products: widened to fp32 */
typedef struct { vf even, odd; } wpair;
static inline wpair pair_load(const uint16_t *w) { return (wpair){vf_even(w), vf_odd(w)}; }
static inline vf pair_step(vf acc, const uint16_t *x, wpair w) { /* (acc + x0 w_even) + x1 w_odd, two FMAs */
  return vf_fma(vf_set1(bf2f(x[1])), w.odd, vf_fma(vf_set1(bf2f(x[0])), w.even, acc));
}
#endif

/* `r` rows by one panel, each line of it read once for all of them (r a constant where it is called). */
static inline __attribute__((always_inline)) void dp_rows(const uint16_t *x, const uint16_t *panel, uint16_t *y,
                                                          int64_t K, int64_t N, const int r) {
  vf acc[DP_ROWS];
  for (int i = 0; i < r; i++) acc[i] = vf_zero();
  for (int64_t kp = 0; kp < K / 2; kp++) {
    wpair w = pair_load(panel + kp * 32);
    for (int i = 0; i < r; i++) acc[i] = pair_step(acc[i], x + i * K + 2 * kp, w);
  }
  for (int i = 0; i < r; i++) vf_store_bf16(y + i * N, acc[i]);
}

/* One row by two panels side by side (a decode row): alone, one panel's chain waits on its steps' latency (a
 * decode row read 34 GB/s from L2 on an AVX2 core so, 65 with two), each stream its lines asked for ahead (from
 * DRAM, 0.82 of an fp32 row's rate without, 0.95 with). Each output's sum is the same as above. */
#define PAIR_LEAD 32 /* lines ahead each stream asks for: two streams a thread outrun the prefetchers alone */
static void dp_row_by_two(const uint16_t *x, const uint16_t *panel, uint16_t *y, int64_t K) {
  const uint16_t *next = panel + K * 16;
  vf a = vf_zero(), b = vf_zero();
  for (int64_t kp = 0; kp < K / 2; kp++) {
    PREFETCH_L1(panel + (kp + PAIR_LEAD) * 32);
    PREFETCH_L1(next + (kp + PAIR_LEAD) * 32);
    a = pair_step(a, x + 2 * kp, pair_load(panel + kp * 32));
    b = pair_step(b, x + 2 * kp, pair_load(next + kp * 32));
  }
  vf_store_bf16(y, a);
  vf_store_bf16(y + 16, b);
}

#define DP_CASE(r) case r: dp_rows(x, panel, y, K, N, r); break;
static void dp_block(const uint16_t *x, const uint16_t *panel, uint16_t *y, int64_t K, int64_t N, int r) {
  switch (r) {
    DP_CASE(1) DP_CASE(2) DP_CASE(3) DP_CASE(4)
#if DP_ROWS > 4
    DP_CASE(5) DP_CASE(6) DP_CASE(7) DP_CASE(8)
#endif
  }
}

static void pair_linear(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N,
                        int threads) {
  int64_t panels = N / 16;
#pragma omp parallel num_threads(threads)
  {
    int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), c0 = panels * t / T, c1 = panels * (t + 1) / T;
    for (int64_t mc = 0; mc < M; mc += DP_ROW_BLOCK) {
      int64_t m1 = M < mc + DP_ROW_BLOCK ? M : mc + DP_ROW_BLOCK;
      for (int64_t c = c0; c < c1; c++)
        if (m1 - mc == 1 && c + 1 < c1) /* a decode row, two panels at a time */
          dp_row_by_two(x + mc * K, p + c * K * 16, y + mc * N + c * 16, K), c++;
        else
          for (int64_t m = mc; m < m1; m += DP_ROWS) /* each row's sums the same whatever the block it falls in */
            dp_block(x + m * K, p + c * K * 16, y + m * N + c * 16, K, N, m1 - m < DP_ROWS ? (int)(m1 - m) : DP_ROWS);
    }
  }
}

int bf16_products(void) { /* 1: the tile unit's, where Linux lends it; else the pairs' */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready()) return 1;
#endif
  return PAIR_PRODUCTS;
}

void linear_bf16(const uint16_t *x, const uint16_t *p, uint16_t *y, int64_t M, int64_t K, int64_t N, int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready()) {
    amx_linear(x, p, y, M, K, N, threads);
    return;
  }
#endif
  pair_linear(x, p, y, M, K, N, threads);
}

/* ---- attention of a few query rows (a decode step, a tree's verify) over one sequence's keys ----------------
 * q [H, n, d] (heads `q_stride` apart, rows d apart: a batch's decode rows are one row of each sequence's),
 * k and v [Hkv, S, d] (heads `head_stride` apart, rows d apart), mask [n, S] (nonzero: may attend; NULL: every
 * key) -> out [n, H * d]. The query vectors of one K/V head (its query heads times the rows) go in tiles
 * of TILE_VECTORS, each tile reading the keys and values once: two passes, the scores and their max, then the
 * softmax weights summed key by key. A vector's arithmetic depends on nothing but its own visible keys, in
 * order: a tree's row gets the bits a decode step of the same token gets over the same keys. */
static inline vf vf_exp(vf x) { /* e^x to about 1 ulp: 2^i * e^r, |r| <= ln2 / 2 */
  x = vf_max(x, vf_set1(-104.0f));
  vf i = vf_round(vf_mul(x, vf_set1(1.44269504f)));
  vf r = vf_fnma(i, vf_set1(1.42860677e-6f), vf_fnma(i, vf_set1(0.693145752f), x));
  vf y = vf_set1(1.0f / 720);
  y = vf_fma(y, r, vf_set1(1.0f / 120));
  y = vf_fma(y, r, vf_set1(1.0f / 24));
  y = vf_fma(y, r, vf_set1(1.0f / 6));
  y = vf_fma(y, r, vf_set1(0.5f));
  y = vf_fma(y, r, vf_set1(1.0f));
  y = vf_fma(y, r, vf_set1(1.0f));
  return vf_scale2(y, i);
}

/* Chunk c of a row of ch 16-wide chunks, in fp32. In bf16, chunks 2j and 2j + 1 (when both exist) are the even
 * and the odd elements of the row's 32 from 32 j: one shift or one mask each, where widening in order takes a
 * shuffle too. A sum kept by chunk is then by element all the same, its lanes in that order. */
static inline vf chunk_f32(const float *row, int c, int ch) { return vf_load(row + c * 16); }
static inline vf chunk_bf16(const uint16_t *row, int c, int ch) {
  if (c % 2) return vf_odd(row + (c - 1) * 16);
  return c + 1 < ch ? vf_even(row + c * 16) : vf_widen(row + c * 16);
}
/* out = sums * scale, the sums by chunk as `chunk_` reads them; each output rounded once. */
static inline void scaled_f32(float *out, const vf *sums, int ch, vf scale) {
  for (int c = 0; c < ch; c++) vf_store(out + c * 16, vf_mul(sums[c], scale));
}
static inline void scaled_bf16(uint16_t *out, const vf *sums, int ch, vf scale) {
  int c = 0;
  for (; c + 1 < ch; c += 2) vf_store_bf16_pairs(out + c * 16, vf_mul(sums[c], scale), vf_mul(sums[c + 1], scale));
  if (c < ch) vf_store_bf16(out + c * 16, vf_mul(sums[c], scale)); /* an odd row's last 16 */
}
/* A dot product's step s over rows of ch 16-wide chunks: fp32, an FMA of chunk s; bf16 with AVX512-BF16, a
 * `vdpbf16ps` of the 32 elements from 32 s (an odd row's last 16 alone), each lane adding its pair's products,
 * exact in fp32, one at a time: an FMA chain's arithmetic in half the instructions, with no widening; bf16
 * elsewhere, an FMA of the widened chunk s. */
#define STEPS_f32(ch) (ch)
#define step_f32 chunk_f32
static inline vf mac_f32(vf acc, vf a, vf b) { return vf_fma(a, b, acc); }
#ifdef __AVX512BF16__
#define STEPS_bf16(ch) (((ch) + 1) / 2)
static inline vf step_bf16(const uint16_t *row, int s, int ch) {
  return _mm512_castsi512_ps(2 * s + 1 < ch ? _mm512_loadu_si512(row + s * 32)
                                            : _mm512_maskz_loadu_epi16(0xffff, row + s * 32));
}
static inline vf mac_bf16(vf acc, vf a, vf b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
#else
#define STEPS_bf16(ch) (ch)
#define step_bf16 chunk_bf16
#define mac_bf16 mac_f32
#endif

/* A thread's scratch of at least `bytes` in one of its slots (0: the attention's, 1: a layer's rows), kept for
 * its next call: a fresh malloc of this size is fresh pages, whose first touch costs a fault each (an
 * attention call over a long context is tens of microseconds). */
static void *scratch_in(int slot, int64_t bytes) {
  static __thread void *buffer[2];
  static __thread int64_t size[2];
  if (bytes > size[slot]) {
    free(buffer[slot]);
    buffer[slot] = malloc(bytes);
    size[slot] = bytes;
  }
  return buffer[slot];
}
static float *scratch(int64_t n) { return scratch_in(0, n * (int64_t)sizeof(float)); }

/* A pass over keys or values asks for its lines ahead of their use: a stream the prefetchers alone keep too
 * short. fp32, 8 KB ahead into L1; bf16, whose keys take half the time, 16 KB ahead into L2. */
static inline void ahead_f32(const void *at, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) PREFETCH_L1((const char *)at + 8192 + l);
}
static inline void ahead_bf16(const void *at, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) PREFETCH_L2((const char *)at + 16384 + l);
}

#define MAX_HEAD 256      /* head_dim */
#define TILE_VECTORS 64   /* query vectors a tile: each tile reads its K/V head once */
#define BLOCK_BYTES 24576 /* a block of keys (or values) that stays in L1 while a tile's vectors pass */
#define VB (VF_WIDTH == 1 ? 1 : 4) /* query vectors a register block (the last of a tile: 2 or 1) */
#define KB 4 /* keys a register block of the scores (vf_sum4's) */
/* One tile of m query vectors over one K/V head of head_dim 16 * CH, in blocks of keys that stay in L1 while
 * every vector passes. A score is a chain of steps in each lane, then vf_sum4's tree across them; a value sum, a
 * chain of FMAs over the keys in order (an unseen one's weight 0); the register blocks only decide which chains
 * run side by side. */
#define SCORES(SUFFIX, CH, N) /* vectors u0 .. u0 + N over keys [b, end) */                                     \
  for (int64_t s = b; s < end; s += KB) { /* past `end`, a repeated key, never stored */                        \
    if (u0 == 0) ahead_##SUFFIX(kh + s * d, KB * d * sizeof(*kh));                                              \
    vf dot[N][KB];                                                                                              \
    for (int i = 0; i < N; i++)                                                                                 \
      for (int j = 0; j < KB; j++) dot[i][j] = vf_zero();                                                       \
    for (int c = 0; c < STEPS_##SUFFIX(CH); c++) {                                                              \
      vf kc[KB];                                                                                                \
      for (int j = 0; j < KB; j++) kc[j] = step_##SUFFIX(kh + (s + j < end ? s + j : end - 1) * d, c, CH);      \
      for (int i = 0; i < N; i++) {                                                                             \
        vf qc = step_##SUFFIX(qs[u0 + i], c, CH);                                                               \
        for (int j = 0; j < KB; j++) dot[i][j] = mac_##SUFFIX(dot[i][j], qc, kc[j]);                            \
      }                                                                                                         \
    }                                                                                                           \
    for (int i = 0; i < N; i++) {                                                                               \
      float sums[KB];                                                                                           \
      vf_sum4(dot[i][0], dot[i][1], dot[i][2], dot[i][3], sums);                                                \
      for (int j = 0; j < KB && s + j < end; j++) {                                                             \
        const uint8_t *sn = seen[u0 + i];                                                                       \
        float x = -INFINITY;                                                                                    \
        if (!sn || sn[s + j]) {                                                                                 \
          x = sums[j] * scale;                                                                                  \
          top[u0 + i] = x > top[u0 + i] ? x : top[u0 + i];                                                      \
        }                                                                                                       \
        scores[(u0 + i) * (S + 16) + s + j] = x;                                                                \
      }                                                                                                         \
    }                                                                                                           \
  }
/* 16-wide chunks of a register block of N vectors' sums: AVX-512's 32 registers hold 16 of them, AVX2's 4 */
#define VC(N) (VF_WIDTH == 1 ? 4 : (N) >= 4 ? 4 : (N) == 2 ? 8 : 16)
#define VALUES(SUFFIX, CH, N) /* vectors u0 .. u0 + N over keys [b, end), each weight 0 where it is unseen */   \
  for (int c0 = 0; c0 < CH; c0 += VC(N)) {                                                                      \
    vf a[N][VC(N)];                                                                                             \
    float sum[N];                                                                                               \
    for (int i = 0; i < N; i++) {                                                                               \
      sum[i] = total[u0 + i];                                                                                   \
      for (int cc = 0; cc < VC(N) && c0 + cc < CH; cc++) a[i][cc] = acc[u0 + i][c0 + cc];                       \
    }                                                                                                           \
    for (int64_t s = b; s < end; s++) {                                                                         \
      if (u0 == 0 && c0 == 0) ahead_##SUFFIX(vh + s * d, d * sizeof(*vh));                                      \
      vf vc[VC(N)];                                                                                             \
      for (int cc = 0; cc < VC(N) && c0 + cc < CH; cc++) vc[cc] = chunk_##SUFFIX(vh + s * d, c0 + cc, CH);      \
      for (int i = 0; i < N; i++) { /* + 0 * v: a vector's sums stay as they are, bit for bit */                \
        float e = scores[(u0 + i) * (S + 16) + s];                                                              \
        vf w = vf_set1(e);                                                                                      \
        if (c0 == 0) sum[i] += e;                                                                               \
        for (int cc = 0; cc < VC(N) && c0 + cc < CH; cc++) a[i][cc] = vf_fma(w, vc[cc], a[i][cc]);               \
      }                                                                                                         \
    }                                                                                                           \
    for (int i = 0; i < N; i++) {                                                                               \
      if (c0 == 0) total[u0 + i] = sum[i];                                                                      \
      for (int cc = 0; cc < VC(N) && c0 + cc < CH; cc++) acc[u0 + i][c0 + cc] = a[i][cc];                       \
    }                                                                                                           \
  }
#define BLOCKS(PASS, SUFFIX, CH) /* every vector in blocks of VB, then 2, then 1 */                             \
  for (int64_t b = 0; b < S; b += block) {                                                                      \
    int64_t end = S < b + block ? S : b + block, u0 = 0;                                                        \
    for (; u0 + VB <= m; u0 += VB) { PASS(SUFFIX, CH, VB) }                                                     \
    if (u0 + 2 <= m) { PASS(SUFFIX, CH, 2) u0 += 2; }                                                           \
    if (u0 < m) { PASS(SUFFIX, CH, 1) }                                                                         \
  }
#define ATTEND_TILE(SUFFIX, T, CH)                                                                              \
  static void tile_##SUFFIX##_##CH(const T *const *qs, const uint8_t *const *seen, T *const *outs, int64_t m,   \
                                   const T *kh, const T *vh, int64_t S, float scale, float *scores) {           \
    const int64_t d = 16 * CH, block = BLOCK_BYTES / (d * (int64_t)sizeof(T)) / KB * KB;                        \
    float top[TILE_VECTORS], total[TILE_VECTORS];                                                               \
    vf acc[TILE_VECTORS][CH];                                                                                   \
    for (int64_t u = 0; u < m; u++) {                                                                           \
      top[u] = -INFINITY, total[u] = 0.0f;                                                                      \
      for (int c = 0; c < CH; c++) acc[u][c] = vf_zero();                                                       \
    }                                                                                                           \
    BLOCKS(SCORES, SUFFIX, CH)                                                                                  \
    for (int64_t u = 0; u < m; u++) { /* the 16 past S are padding, never read back; an unseen key weighs 0 */  \
      float *row = scores + u * (S + 16);                                                                       \
      for (int64_t s = S; s < S + 16; s++) row[s] = -INFINITY;                                                  \
      for (int64_t s = 0; s < S; s += 16) {                                                                     \
        vf x = vf_load(row + s);                                                                                \
        vf_store(row + s, vf_unless_neg_inf(x, vf_exp(vf_sub(x, vf_set1(top[u])))));                            \
      }                                                                                                         \
    }                                                                                                           \
    BLOCKS(VALUES, SUFFIX, CH)                                                                                  \
    for (int64_t u = 0; u < m; u++)                                                                             \
      scaled_##SUFFIX(outs[u], acc[u], CH, vf_set1(1.0f / total[u]));                                          \
  }
#define ATTEND(SUFFIX, T)                                                                                       \
  ATTEND_TILE(SUFFIX, T, 1) ATTEND_TILE(SUFFIX, T, 2)                                                           \
  ATTEND_TILE(SUFFIX, T, 3) ATTEND_TILE(SUFFIX, T, 4)                                                           \
  ATTEND_TILE(SUFFIX, T, 5) ATTEND_TILE(SUFFIX, T, 6)                                                           \
  ATTEND_TILE(SUFFIX, T, 7) ATTEND_TILE(SUFFIX, T, 8)                                                           \
  ATTEND_TILE(SUFFIX, T, 9) ATTEND_TILE(SUFFIX, T, 10)                                                          \
  ATTEND_TILE(SUFFIX, T, 11) ATTEND_TILE(SUFFIX, T, 12)                                                         \
  ATTEND_TILE(SUFFIX, T, 13) ATTEND_TILE(SUFFIX, T, 14)                                                         \
  ATTEND_TILE(SUFFIX, T, 15) ATTEND_TILE(SUFFIX, T, 16)                                                         \
  typedef void (*tile_##SUFFIX)(const T *const *, const uint8_t *const *, T *const *, int64_t, const T *,       \
                                const T *, int64_t, float, float *);                                            \
  static const tile_##SUFFIX TILES_##SUFFIX[MAX_HEAD / 16 + 1] = {                                              \
      0, tile_##SUFFIX##_1, tile_##SUFFIX##_2, tile_##SUFFIX##_3, tile_##SUFFIX##_4, tile_##SUFFIX##_5,         \
      tile_##SUFFIX##_6, tile_##SUFFIX##_7, tile_##SUFFIX##_8, tile_##SUFFIX##_9, tile_##SUFFIX##_10,           \
      tile_##SUFFIX##_11, tile_##SUFFIX##_12, tile_##SUFFIX##_13, tile_##SUFFIX##_14, tile_##SUFFIX##_15,       \
      tile_##SUFFIX##_16};                                                                                      \
  void attend_##SUFFIX(const T *q, const T *k, const T *v, const uint8_t *mask, T *out, int64_t heads,          \
                       int64_t kv_heads, int64_t n, int64_t S, int64_t d, int64_t q_stride, int64_t head_stride, \
                       float scale, int threads) {                                                              \
    int64_t group = heads / kv_heads, vectors = group * n;                                                      \
    int64_t tiles = (vectors + TILE_VECTORS - 1) / TILE_VECTORS, busy = (threads + kv_heads - 1) / kv_heads;    \
    if (tiles < busy) tiles = busy < vectors ? busy : vectors; /* a unit for every thread */                    \
    _Pragma("omp parallel num_threads(threads)") {                                                              \
      float *scores = scratch(TILE_VECTORS * (S + 16));                                                         \
      _Pragma("omp for schedule(static)")                                                                       \
      for (int64_t unit = 0; unit < kv_heads * tiles; unit++) {                                                 \
        int64_t kv = unit / tiles, u0 = vectors * (unit % tiles) / tiles;                                       \
        int64_t m = vectors * (unit % tiles + 1) / tiles - u0;                                                  \
        const T *qs[TILE_VECTORS];                                                                              \
        const uint8_t *seen[TILE_VECTORS];                                                                      \
        T *outs[TILE_VECTORS];                                                                                  \
        for (int64_t u = 0; u < m; u++) { /* vector u0 + u: row r of query head h */                            \
          int64_t r = (u0 + u) / group, h = kv * group + (u0 + u) % group;                                      \
          qs[u] = q + h * q_stride + r * d, seen[u] = mask ? mask + r * S : 0, outs[u] = out + (r * heads + h) * d; \
        }                                                                                                       \
        TILES_##SUFFIX[d / 16](qs, seen, outs, m, k + kv * head_stride, v + kv * head_stride, S, scale, scores); \
      }                                                                                                         \
    }                                                                                                           \
  }
ATTEND(f32, float)
ATTEND(bf16, uint16_t)

static inline int64_t lines_of(int64_t S, int64_t from, int64_t keys, int64_t d) { /* fp32 rows [from, +keys) */
  return ((S < from + keys ? S : from + keys) - from) * d / 16;
}
/* ---- a tree's attention in fp32 as two products: q [H, n, d], k and v [Hkv, S, d] as `attend_f32` takes them,
 * mask [n, S] (nonzero: may attend) -> out [n, H * d], head_dim a multiple of 64. The query vectors of a K/V
 * head (its query heads times the rows) go in units of up to 80, 16 to a register's lanes: a key's scores
 * for 16 vectors are one FMA a head dim, with no sum across lanes, and the values' sums are a panel product
 * whose weights are the value rows as the cache holds them. Every score and sum is one chain in a fixed
 * order (head dims, then keys, in order), so a row's result does not depend on the rows beside it. */
#define TREE_VECTORS 80 /* query vectors a unit: 5 panels of 16 */
#define D_STEP 64       /* head dims a pass over a block of keys: the unit's query panels for them (20 KB) in L1 */
#define SCORE_BLOCK 32  /* keys a block of the scores: their rows stay in L1 while each pass over them runs */
#define SCORE_KEYS (VF_WIDTH == 1 ? 1 : 4) /* keys a register block of the scores (by up to 5 panels) */
#define MIX_BLOCK 128   /* keys a block of the values' sums, its weights in L1 while every vector passes */
#define MIX_VECTORS 6   /* vectors a register block of the sums (by MIX_DIMS head dims) */
#define MIX_DIMS (16 * VF_WIDTH)
#define SCORES_TILE(P)                                                                                          \
  static void scores_##P(const float *qp, const float *kh, float *t, int64_t S, int64_t d, int64_t c0,        \
                         int64_t s, const char *next, int64_t lines) {                                         \
    vf acc[SCORE_KEYS][P];                                                                                      \
    const float *kr[SCORE_KEYS]; /* past S, the last key again, never stored */                                 \
    for (int i = 0; i < SCORE_KEYS; i++) {                                                                      \
      kr[i] = kh + (s + i < S ? s + i : S - 1) * d;                                                             \
      for (int j = 0; j < P; j++)                                                                               \
        acc[i][j] = c0 && s + i < S ? vf_load(t + (s + i) * TREE_VECTORS + j * 16) : vf_zero();                \
    }                                                                                                           \
    for (int64_t c = c0, due = 0; c < c0 + D_STEP; c += BEAT) { /* its lines of the stream, evenly */         \
      next = spread(next, &due, lines, D_STEP / BEAT);                                                          \
      for (int64_t e = c; e < c + BEAT; e++) {                                                                  \
        vf qv[P];                                                                                               \
        for (int j = 0; j < P; j++) qv[j] = vf_load(qp + (j * d + e) * 16);                                     \
        for (int i = 0; i < SCORE_KEYS; i++) {                                                                  \
          vf kb = vf_set1(kr[i][e]);                                                                            \
          for (int j = 0; j < P; j++) acc[i][j] = vf_fma(kb, qv[j], acc[i][j]);                                 \
        }                                                                                                       \
      }                                                                                                         \
    }                                                                                                           \
    for (int i = 0; i < SCORE_KEYS && s + i < S; i++)                                                           \
      for (int j = 0; j < P; j++) vf_store(t + (s + i) * TREE_VECTORS + j * 16, acc[i][j]);                     \
  }
SCORES_TILE(1) SCORES_TILE(2) SCORES_TILE(3) SCORES_TILE(4) SCORES_TILE(5)
typedef void (*scores_fn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, const char *,
                          int64_t);
static const scores_fn SCORES_TILES[TREE_VECTORS / 16 + 1] = {0, scores_1, scores_2, scores_3, scores_4, scores_5};

/* Key e's values into the sums of a mix tile. */
#define MIX_KEY(MR, e)                                                                                          \
  {                                                                                                             \
    const float *vr = vh + (e) * d + c0, *ts = t + (e) * TREE_VECTORS + u;                                      \
    vf w[VF_WIDTH];                                                                                             \
    for (int j = 0; j < VF_WIDTH; j++) w[j] = vf_load(vr + j * 16);                                             \
    FMA_ROWS(MR, ts[i])                                                                                         \
  }
/* Vectors [u, u + MR) of the weights t over keys [s0, s1), values' head dims [c0, c0 + MIX_DIMS): added to their
 * sums in o [m][d]. */
#define MIX_TILE(MR)                                                                                            \
  static void mix_##MR(const float *t, const float *vh, int64_t s0, int64_t s1, int64_t d, int64_t c0,          \
                       int64_t u, float *o, const char *next, int64_t lines) {                                  \
    vf acc[MR][VF_WIDTH];                                                                                       \
    for (int i = 0; i < MR; i++)                                                                                \
      for (int j = 0; j < VF_WIDTH; j++) acc[i][j] = vf_load(o + (u + i) * d + c0 + j * 16);                    \
    int64_t s = s0, due = 0, beats = (s1 - s0) / BEAT;                                                         \
    for (; s + BEAT <= s1; s += BEAT) { /* its lines of the stream, evenly */                                   \
      next = spread(next, &due, lines, beats);                                                                  \
      for (int64_t e = s; e < s + BEAT; e++) MIX_KEY(MR, e)                                                     \
    }                                                                                                           \
    for (; s < s1; s++) MIX_KEY(MR, s)                                                                          \
    for (int i = 0; i < MR; i++)                                                                                \
      for (int j = 0; j < VF_WIDTH; j++) vf_store(o + (u + i) * d + c0 + j * 16, acc[i][j]);                    \
  }
MIX_TILE(1) MIX_TILE(2) MIX_TILE(3) MIX_TILE(4) MIX_TILE(5) MIX_TILE(6)
typedef void (*mix_fn)(const float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t, float *,
                       const char *, int64_t);
static const mix_fn MIX_TILES[MIX_VECTORS + 1] = {0, mix_1, mix_2, mix_3, mix_4, mix_5, mix_6};

/* Scores [S][TREE_VECTORS] of one unit's m vectors -> their softmax weights (exactly 0 where a vector may not
 * attend), and each vector's sum of them. Keys before `open` are every vector's: past it, vector u sees key s
 * where seen[u][s] (a tree's mask) or, without a mask, where s < upto[u] (causal rows). */
static void softmax_keys(float *t, int64_t S, int64_t m, int64_t open, const uint8_t *const *seen,
                         const int64_t *upto, float scale, float *sum) {
  for (int64_t s = open; s < S; s++)
    for (int64_t u = 0; u < m; u++)
      if (seen ? !seen[u][s] : s >= upto[u]) t[s * TREE_VECTORS + u] = -INFINITY;
  int P = (int)((m + 15) / 16);
  for (int j = 0; j < P; j++) {
    vf top = vf_set1(-INFINITY), total = vf_zero(), sc = vf_set1(scale);
    for (int64_t s = 0; s < S; s++) top = vf_max(top, vf_load(t + s * TREE_VECTORS + j * 16));
    for (int64_t s = 0; s < S; s++) {
      float *at = t + s * TREE_VECTORS + j * 16;
      vf x = vf_load(at), e = vf_unless_neg_inf(x, vf_exp(vf_mul(vf_sub(x, top), sc)));
      vf_store(at, e);
      total = vf_add(total, e);
    }
    vf_store(sum + j * 16, total);
  }
}

/* One unit: m query vectors qs[u] (rows of d) over keys [0, S) of one K/V head (kh, vh), outs[u] their results;
 * qp, a scratch of `unit_scratch`'s floats. */
static void tree_unit(const float *const *qs, float *const *outs, const uint8_t *const *seen, const int64_t *upto,
                      int64_t m, int64_t open, const float *kh, const float *vh, int64_t S, int64_t d, float scale,
                      float *qp) {
  int64_t P = (m + 15) / 16;
  float *o = qp + TREE_VECTORS * d, *t = o + TREE_VECTORS * d, *sum = t + S * TREE_VECTORS;
  memset(qp, 0, sizeof(float) * P * 16 * d);
  memset(o, 0, sizeof(float) * m * d);
  for (int64_t u = 0; u < m; u++) /* vector u in lane u % 16 of panel u / 16 */
    for (int64_t c = 0; c < d; c++) qp[((u / 16) * d + c) * 16 + u % 16] = qs[u][c];
  for (int64_t l = 0; l < lines_of(S, 0, SCORE_BLOCK, d); l++) PREFETCH_L2((const char *)kh + l * 64);
  /* Each block's calls fetch the next (the last: v's first), each call its share of the lines evenly over its
   * loop: in one burst a call's prefetches stall its FMAs. */
  for (int64_t b = 0; b < S; b += SCORE_BLOCK) {
    int64_t end = S < b + SCORE_BLOCK ? S : b + SCORE_BLOCK, c = 0;
    int64_t calls = d / D_STEP * ((end - b + SCORE_KEYS - 1) / SCORE_KEYS);
    const float *next = end < S ? kh + end * d : vh;
    int64_t lines = end < S ? lines_of(S, end, SCORE_BLOCK, d) : lines_of(S, 0, MIX_BLOCK, d);
    for (int64_t c0 = 0; c0 < d; c0 += D_STEP)
      for (int64_t s = b; s < end; s += SCORE_KEYS, c++) {
        int64_t l0 = lines * c / calls; /* this call's share of the lines, over its head dims */
        SCORES_TILES[P](qp, kh, t, S, d, c0, s, (const char *)next + l0 * 64, lines * (c + 1) / calls - l0);
      }
  }
  softmax_keys(t, S, m, open, seen, upto, scale, sum);
  for (int64_t b = 0; b < S; b += MIX_BLOCK) {
    int64_t end = S < b + MIX_BLOCK ? S : b + MIX_BLOCK, c = 0, lines = lines_of(S, end, MIX_BLOCK, d);
    int64_t calls = d / MIX_DIMS * ((m + MIX_VECTORS - 1) / MIX_VECTORS);
    for (int64_t c0 = 0; c0 < d; c0 += MIX_DIMS)
      for (int64_t u = 0; u < m; u += MIX_VECTORS, c++) {
        int64_t l0 = lines * c / calls; /* this call's share of the lines, over its keys */
        MIX_TILES[m - u < MIX_VECTORS ? m - u : MIX_VECTORS](t, vh, b, end, d, c0, u, o,
                                                             (const char *)(vh + end * d) + l0 * 64,
                                                             lines * (c + 1) / calls - l0);
      }
  }
  for (int64_t u = 0; u < m; u++) {
    vf inv = vf_set1(1.0f / sum[u]);
    for (int64_t c = 0; c < d; c += 16) vf_store(outs[u] + c, vf_mul(vf_load(o + u * d + c), inv));
  }
}
static float *unit_scratch(int64_t S, int64_t d) {
  return scratch((2 * TREE_VECTORS + 1) * d + (S + 1) * TREE_VECTORS);
}

void tree_attend_f32(const float *q, const float *k, const float *v, const uint8_t *mask, float *out, int64_t heads,
                     int64_t kv_heads, int64_t n, int64_t S, int64_t d, int64_t q_stride, int64_t head_stride,
                     float scale, int threads) {
  int64_t group = heads / kv_heads, vectors = group * n, open = S;
  for (int64_t r = 0; r < n; r++) { /* the first key some row may not see */
    const uint8_t *hidden = memchr(mask + r * S, 0, open);
    if (hidden) open = hidden - (mask + r * S);
  }
  int64_t tiles = (vectors + TREE_VECTORS - 1) / TREE_VECTORS, busy = (threads + kv_heads - 1) / kv_heads;
  if (tiles < busy) tiles = busy < vectors ? busy : vectors;
#pragma omp parallel num_threads(threads)
  {
    float *qp = unit_scratch(S, d);
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < kv_heads * tiles; unit++) {
      int64_t kv = unit / tiles, u0 = vectors * (unit % tiles) / tiles, m = vectors * (unit % tiles + 1) / tiles - u0;
      const float *qs[TREE_VECTORS];
      float *outs[TREE_VECTORS];
      const uint8_t *seen[TREE_VECTORS];
      for (int64_t u = 0; u < m; u++) { /* vector u0 + u: row r of query head h */
        int64_t r = (u0 + u) / group, h = kv * group + (u0 + u) % group;
        qs[u] = q + h * q_stride + r * d, outs[u] = out + (r * heads + h) * d, seen[u] = mask + r * S;
      }
      tree_unit(qs, outs, seen, NULL, m, open, k + kv * head_stride, v + kv * head_stride, S, d, scale, qp);
    }
  }
}

/* Causal attention of n rows at positions [start, start + n) over keys [0, start + n) (a prefill, after a
 * prefix of `start`), as `tree_attend_f32`'s units of TREE_VECTORS / group rows: row r sees keys up to its own,
 * and gets the bits a tree's row over the same keys gets, whatever the rows beside it. */
void causal_attend_f32(const float *q, const float *k, const float *v, float *out, int64_t heads, int64_t kv_heads,
                       int64_t n, int64_t start, int64_t d, int64_t q_stride, int64_t head_stride, float scale,
                       int threads) {
  int64_t group = heads / kv_heads, rows = TREE_VECTORS / group, chunks = (n + rows - 1) / rows;
#pragma omp parallel num_threads(threads)
  {
    float *qp = unit_scratch(start + n, d);
#pragma omp for schedule(dynamic)
    for (int64_t unit = 0; unit < kv_heads * chunks; unit++) { /* the longest first */
      int64_t kv = unit % kv_heads, r0 = (chunks - 1 - unit / kv_heads) * rows, r1 = n < r0 + rows ? n : r0 + rows;
      int64_t m = (r1 - r0) * group, upto[TREE_VECTORS];
      const float *qs[TREE_VECTORS];
      float *outs[TREE_VECTORS];
      for (int64_t u = 0; u < m; u++) { /* vector u: row r0 + u / group of query head h */
        int64_t r = r0 + u / group, h = kv * group + u % group;
        qs[u] = q + h * q_stride + r * d, outs[u] = out + (r * heads + h) * d, upto[u] = start + r + 1;
      }
      tree_unit(qs, outs, NULL, upto, m, start + r0, k + kv * head_stride, v + kv * head_stride, start + r1, d,
                scale, qp);
    }
  }
}

/* ---- the MLP's gate: silu(gate) * up, elementwise ------------------------------------------------------- */
static inline vf silu16(vf g) { return vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g)))); }

void silu_mul_f32(const float *g, const float *u, float *y, int64_t n, int threads) {
#pragma omp parallel for if (n >= PARALLEL_ELEMENTS) num_threads(threads)
  for (int64_t i = 0; i < n; i += 16) {
    if (n - i >= 16) vf_store(y + i, vf_mul(silu16(vf_load(g + i)), vf_load(u + i)));
    else vf_store_n(y + i, vf_mul(silu16(vf_load_n(g + i, n - i)), vf_load_n(u + i, n - i)), n - i);
  }
}

void silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t n, int threads) {
#pragma omp parallel for if (n >= PARALLEL_ELEMENTS) num_threads(threads)
  for (int64_t i = 0; i < n; i += 16) { /* rounded where torch's silu, then its product, round */
    if (n - i >= 16)
      vf_store_bf16(y + i, vf_mul(vf_bf16_round(silu16(vf_widen(g + i))), vf_widen(u + i)));
    else
      vf_store_bf16_n(y + i, vf_mul(vf_bf16_round(silu16(vf_widen_n(g + i, n - i))), vf_widen_n(u + i, n - i)), n - i);
  }
}

/* ---- structured outputs: a small legal set's likeliest tokens ---------------------------------------------
 * The k tokens of a grammar's bitmask (token 32 w + i is bit i of word w) with the highest log-probs in `logp`,
 * best first (a tie: the lower id first, as a stable sort), each minus the set's log-sum-exp (renormalised over
 * it); -inf ones left out. Returns how many (at most k). It reads every legal token: for sets of a few hundred,
 * in place of numpy's dozen calls a node (ddscope.structured.masks). */
int64_t legal_top_f32(const int32_t *bits, const float *logp, int64_t vocab, int64_t k, int64_t *ids, float *vals) {
  int64_t n = 0;
  if (k <= 0) return 0;
  for (int64_t w = 0; w * 32 < vocab; w++) {
    for (uint32_t word = (uint32_t)bits[w]; word; word &= word - 1) {
      int64_t t = w * 32 + __builtin_ctz(word);
      float v = t < vocab ? logp[t] : -INFINITY;
      if (!(v > -INFINITY) || (n == k && !(v > vals[k - 1]))) continue;
      int64_t i = n < k ? n++ : k - 1; /* the new one's slot, then moved up past the lower ones */
      for (; i > 0 && vals[i - 1] < v; i--) {
        vals[i] = vals[i - 1];
        ids[i] = ids[i - 1];
      }
      vals[i] = v;
      ids[i] = t;
    }
  }
  if (n == 0) return 0;
  const double peak = vals[0];
  double sum = 0.0;
  for (int64_t w = 0; w * 32 < vocab; w++)
    for (uint32_t word = (uint32_t)bits[w]; word; word &= word - 1) {
      int64_t t = w * 32 + __builtin_ctz(word);
      if (t < vocab) sum += exp((double)logp[t] - peak);
    }
  float lse = (float)(peak + log(sum));
  for (int64_t i = 0; i < n; i++) vals[i] -= lse;
  return n;
}

/* ---- rows through a layer: a decode row or a tree's rows in one call, or a decode row in two around the cache's
 * write ------------------------------------------------------------------------------------------------------
 * The same kernels in the same order as the layer's modules call them one by one (so the same bits), without
 * the Python between them: after each projection has streamed megabytes through the caches, that Python
 * runs cold. */
#define DECODE(SUFFIX, T, ADD, TREES)                                                                   \
  /* pqkv: q's, k's and v's panels one after another (one product); qkv: their rows, v's in place */            \
  void decode_qkv_##SUFFIX(const T *h, const T *w_in, float eps, const T *pqkv, const T *q_norm,                 \
                           const T *k_norm, float qk_eps, const T *cos, const T *sin, T *xn, T *qkv, T *q, T *k, \
                           int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d, int threads) {            \
    rms_norm_##SUFFIX(h, w_in, xn, 1, hidden, eps, threads);                                                    \
    linear_##SUFFIX(xn, pqkv, qkv, 1, hidden, (heads + 2 * kv_heads) * d, threads);                             \
    norm_rope_##SUFFIX(qkv, q_norm, cos, sin, q, 1, heads, d, qk_eps, threads);                                 \
    norm_rope_##SUFFIX(qkv + heads * d, k_norm, cos, sin, k, 1, kv_heads, d, qk_eps, threads);                  \
  }                                                                                                             \
  /* h += o_proj(attention of q over the cache's S keys); h += down(silu(gate(norm(h))) * up(norm(h))), with    \
   * pgu the gate's and up's panels one after another (one product into gu). */                               \
  void decode_rest_##SUFFIX(T *h, const T *q, const T *keys, const T *values, int64_t S, int64_t head_stride,   \
                            const T *po, const T *w_post, float eps, const T *pgu, const T *pd, T *att, T *o,    \
                            T *xn, T *gu, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d,            \
                            int64_t inter, float scale, int threads) {                                          \
    attend_##SUFFIX(q, keys, values, 0, att, heads, kv_heads, 1, S, d, d, head_stride, scale, threads);         \
    linear_##SUFFIX(att, po, o, 1, heads * d, hidden, threads);                                                 \
    for (int64_t i = 0; i < hidden; i++) h[i] = ADD(h[i], o[i]);                                                \
    rms_norm_##SUFFIX(h, w_post, xn, 1, hidden, eps, threads);                                                  \
    linear_##SUFFIX(xn, pgu, gu, 1, hidden, 2 * inter, threads);                                                \
    silu_mul_##SUFFIX(gu, gu + inter, gu, inter, threads);                                                      \
    linear_##SUFFIX(gu, pd, o, 1, inter, hidden, threads);                                                      \
    for (int64_t i = 0; i < hidden; i++) h[i] = ADD(h[i], o[i]);                                                \
  }                                                                                                             \
  /* n rows at positions S - n .. S - 1 (a decode row, a tree's rows under `mask` [n, S]) through the whole   \
   * layer, their K/V stored into keys/values [kv_heads, S, d] (heads head_stride apart, rows d apart): a cache \
   * whose slots lie in one run, with no Python between. The kernels the modules call, in their order.         \
   * The attention: one row's, `attend`; a tree's, TREES (fp32: `tree_attend_f32`; bf16: `attend`, each row   \
   * with a decode step's bits, ddscope.models.layers.EXACT_TREES). */                                         \
  void rows_layer_##SUFFIX(T *h, const T *w_in, float eps, const T *pqkv, const T *q_norm, const T *k_norm,      \
                           float qk_eps, const T *cos, const T *sin, T *keys, T *values, int64_t S,               \
                           int64_t head_stride, const uint8_t *mask, const T *po, const T *w_post, float post_eps, \
                           const T *pgu, const T *pd, int64_t n, int64_t hidden, int64_t heads, int64_t kv_heads, \
                           int64_t d, int64_t inter, float scale, int threads) {                                  \
    int64_t width = (heads + 2 * kv_heads) * d, qw = heads * d, kw = kv_heads * d;                               \
    T *xn = scratch_in(1, n * (2 * hidden + 2 * width + 2 * qw + 3 * inter) * (int64_t)sizeof(T));              \
    T *qkv = xn + n * hidden, *qx = qkv + n * width, *kx = qx + n * qw, *q = kx + n * kw, *k = q + n * qw;        \
    T *att = k + n * kw, *o = att + n * qw, *gu = o + n * hidden, *act = gu + 2 * n * inter;                     \
    rms_norm_##SUFFIX(h, w_in, xn, n, hidden, eps, threads);                                                    \
    linear_##SUFFIX(xn, pqkv, qkv, n, hidden, width, threads);                                                  \
    for (int64_t r = 0; r < n; r++) { /* q's and k's columns as the norm + RoPE takes them */                   \
      memcpy(qx + r * qw, qkv + r * width, qw * sizeof(T));                                                     \
      memcpy(kx + r * kw, qkv + r * width + qw, kw * sizeof(T));                                                \
    }                                                                                                           \
    norm_rope_##SUFFIX(qx, q_norm, cos, sin, q, n, heads, d, qk_eps, threads);                                  \
    norm_rope_##SUFFIX(kx, k_norm, cos, sin, k, n, kv_heads, d, qk_eps, threads);                               \
    for (int64_t j = 0; j < kv_heads; j++)                                                                      \
      for (int64_t r = 0; r < n; r++) {                                                                         \
        memcpy(keys + j * head_stride + (S - n + r) * d, k + (j * n + r) * d, d * sizeof(T));                   \
        memcpy(values + j * head_stride + (S - n + r) * d, qkv + r * width + qw + kw + j * d, d * sizeof(T));   \
      }                                                                                                         \
    (n > 1 ? TREES : attend_##SUFFIX)(q, keys, values, mask, att, heads, kv_heads, n, S, d, n * d, head_stride,   \
                                      scale, threads);                                                          \
    linear_##SUFFIX(att, po, o, n, qw, hidden, threads);                                                        \
    for (int64_t i = 0; i < n * hidden; i++) h[i] = ADD(h[i], o[i]);                                            \
    rms_norm_##SUFFIX(h, w_post, xn, n, hidden, post_eps, threads);                                             \
    linear_##SUFFIX(xn, pgu, gu, n, hidden, 2 * inter, threads);                                                \
    for (int64_t r = 0; r < n; r++)                                                                             \
      silu_mul_##SUFFIX(gu + 2 * r * inter, gu + (2 * r + 1) * inter, act + r * inter, inter, threads);         \
    linear_##SUFFIX(act, pd, o, n, inter, hidden, threads);                                                     \
    for (int64_t i = 0; i < n * hidden; i++) h[i] = ADD(h[i], o[i]);                                            \
  }
#define ADD_F32(a, b) ((a) + (b))
#define ADD_BF16(a, b) f2bf(bf2f(a) + bf2f(b)) /* rounded once, as torch's bf16 add */
DECODE(f32, float, ADD_F32, tree_attend_f32)
DECODE(bf16, uint16_t, ADD_BF16, attend_bf16)

/* ---- the units' peak and the memory's (ddscope.bench.limit.hardware: the host's floor) ----------------------
 * Independent chains in registers, nothing read from memory: the most FLOPs the FMA units (the tile unit)
 * retire here, which a library's matmul only bounds from below. And a read alone, at least as fast as any
 * product's: each thread sums its share in one stream, 8 sums side by side. */
#if VF_WIDTH == 1 /* each vf two registers: 12 of AVX2's 16 */
#define PEAK_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define PEAK_CHAIN_COUNT 6
#else
#define PEAK_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define PEAK_CHAIN_COUNT 12
#endif
#define PEAK_START(i) vf a##i = vf_fma(vf_set1((float)i), vf_set1(1e-3f), lane); /* lanes apart: nothing to fold */
#define PEAK_FMA(i) a##i = vf_fma(a##i, m, c);
#define PEAK_SUM(i) s = vf_add(s, a##i);

static vf peak_lanes(void) { /* each lane its own value: with equal ones a compiler folds AVX2's halves into one */
  float lanes[LANES];
  for (int l = 0; l < LANES; l++) lanes[l] = (float)l;
  return vf_load(lanes);
}

int64_t fma_peak_flops(void) { return PEAK_CHAIN_COUNT * LANES * 2; } /* a thread's FLOPs a step of fma_peak_f32 */

void fma_peak_f32(int64_t steps, float *sink, int threads) { /* a step: PEAK_CHAIN_COUNT FMAs of 16 lanes a thread */
#pragma omp parallel num_threads(threads)
  {
    const vf m = vf_set1(0.999f), c = vf_set1(1e-3f); /* each chain tends to 1: no denormals */
    const vf lane = peak_lanes();
    PEAK_CHAINS(PEAK_START)
    for (int64_t i = 0; i < steps; i++) { PEAK_CHAINS(PEAK_FMA) }
    vf s = vf_zero();
    PEAK_CHAINS(PEAK_SUM)
    sink[omp_get_thread_num()] = vf_sum(s);
  }
}

void read_peak_f32(const float *a, int64_t n, float *sink, int threads) { /* n a multiple of 128 * threads */
#pragma omp parallel num_threads(threads)
  {
    int64_t t = omp_get_thread_num(), share = n / omp_get_num_threads();
    vf s[8];
    for (int j = 0; j < 8; j++) s[j] = vf_zero();
    for (const float *at = a + t * share; at < a + (t + 1) * share; at += 128)
      for (int j = 0; j < 8; j++) s[j] = vf_add(s[j], vf_load(at + j * 16));
    for (int j = 1; j < 8; j++) s[0] = vf_add(s[0], s[j]);
    sink[t] = vf_sum(s[0]);
  }
}

#ifdef __AVX512BF16__ /* an AMX build too: its bf16 products are the pairs' where Linux lends no tiles */
#define DP_PEAK(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
void dp_peak_bf16(int64_t steps, float *sink, int threads) { /* a step: 12 vdpbf16ps of 16 lanes (2 pairs) a thread */
#pragma omp parallel num_threads(threads)
  {
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x2000), y = x; /* 2^-63 squared: the sums stay tiny, finite */
    const vf lane = peak_lanes();
    PEAK_CHAINS(PEAK_START)
    for (int64_t i = 0; i < steps; i++) { PEAK_CHAINS(DP_PEAK) }
    vf s = vf_zero();
    PEAK_CHAINS(PEAK_SUM)
    sink[omp_get_thread_num()] = vf_sum(s);
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
void amx_peak_bf16(int64_t steps, float *sink, int threads) { /* a step: 4 products of 16 x 32 by 32 x 16 a thread */
#pragma omp parallel num_threads(threads)
  {
    uint16_t ones[16 * 32];
    float out[16 * 16];
    for (int i = 0; i < 16 * 32; i++) ones[i] = 0x3c00; /* 2^-7: the sums stay small and finite */
    configure(16, 16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    for (int64_t i = 0; i < steps; i++) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    sink[omp_get_thread_num()] = out[0];
    _tile_release();
  }
}
#endif
