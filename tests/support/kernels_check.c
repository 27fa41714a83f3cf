/* kernels.c checked in C alone, for a build Python cannot load here (aarch64's, under qemu-user) and every other:
 * each kernel against a scalar reference in double, and each row of a product or an attention the same bits
 * alone as among others. Prints one line a failure and "N passed, N failed"; exits non-zero on a failure. */
#include <math.h>
#include <stdio.h>

#include "kernels.c"

static int passed, failed;
static uint32_t seed = 12345;

static float uniform(void) { /* in [-1, 1) */
  seed = seed * 1664525u + 1013904223u;
  return (float)(seed >> 8) / (float)(1u << 23) - 1.0f;
}

static void check(int ok, const char *what) {
  if (ok) passed++;
  else failed++, printf("FAILED: %s\n", what);
}

static int close_to(double got, double want, double tol) { return fabs(got - want) <= tol * (1.0 + fabs(want)); }

enum { M = 9, K = 64, N = 128, H = 4, HKV = 2, S = 37, D = 64, ROWS = 3 };

static void check_linear_f32(void) {
  static float w[N * K], p[N * K], x[M * K], together[M * N], alone[N];
  for (int i = 0; i < N * K; i++) w[i] = uniform();
  for (int i = 0; i < M * K; i++) x[i] = uniform();
  pack_f32(w, p, N, K, 1);
  linear_f32(x, p, together, M, K, N, 2);
  int same = 1, near = 1;
  for (int m = 0; m < M; m++) {
    linear_f32(x + m * K, p, alone, 1, K, N, 1);
    for (int n = 0; n < N; n++) {
      double want = 0;
      for (int k = 0; k < K; k++) want += (double)x[m * K + k] * w[n * K + k];
      same &= alone[n] == together[m * N + n];
      near &= close_to(together[m * N + n], want, 1e-5);
    }
  }
  check(near, "linear_f32 against the reference");
  check(same, "linear_f32: a row alone gives the bits it gets among others");
}

static void check_linear_bf16(void) {
  static uint16_t w[N * K], p[N * K], x[M * K], together[M * N], alone[N];
  for (int i = 0; i < N * K; i++) w[i] = f2bf(uniform());
  for (int i = 0; i < M * K; i++) x[i] = f2bf(uniform());
  pack_bf16(w, p, N, K, 1);
  linear_bf16(x, p, together, M, K, N, 2);
  int same = 1, near = 1;
  for (int m = 0; m < M; m++) {
    linear_bf16(x + m * K, p, alone, 1, K, N, 1);
    for (int n = 0; n < N; n++) {
      double want = 0;
      for (int k = 0; k < K; k++) want += (double)bf2f(x[m * K + k]) * bf2f(w[n * K + k]);
      same &= alone[n] == together[m * N + n];
      near &= close_to(bf2f(together[m * N + n]), want, 1e-2);
    }
  }
  check(near, "linear_bf16 against the reference");
  check(same, "linear_bf16: a row alone gives the bits it gets among others");
}

/* softmax(q k / sqrt(d)) v over the keys row r may see, in double */
static double attention_ref(const float *q, const float *k, const float *v, const uint8_t *mask, int h, int r, int c) {
  const float *qh = q + (h * ROWS + r) * D;
  const float *kh = k + (h / (H / HKV)) * S * D, *vh = v + (h / (H / HKV)) * S * D;
  double top = -INFINITY, scores[S], total = 0, out = 0;
  for (int s = 0; s < S; s++) {
    double dot = 0;
    for (int e = 0; e < D; e++) dot += (double)qh[e] * kh[s * D + e];
    scores[s] = mask[r * S + s] ? dot / sqrt((double)D) : -INFINITY;
    top = scores[s] > top ? scores[s] : top;
  }
  for (int s = 0; s < S; s++) total += exp(scores[s] - top), out += exp(scores[s] - top) * vh[s * D + c];
  return out / total;
}

typedef void (*attention_fn)(const float *, const float *, const float *, const uint8_t *, float *, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, float, int);

static void check_attention(attention_fn attend, const char *name) {
  static float q[H * ROWS * D], k[HKV * S * D], v[HKV * S * D], together[ROWS * H * D], alone[H * D];
  static uint8_t mask[ROWS * S];
  for (int i = 0; i < H * ROWS * D; i++) q[i] = uniform();
  for (int i = 0; i < HKV * S * D; i++) k[i] = uniform(), v[i] = uniform();
  for (int r = 0; r < ROWS; r++)
    for (int s = 0; s < S; s++) mask[r * S + s] = s < S - ROWS || (s - (S - ROWS)) <= r; /* a chain's mask */
  attend(q, k, v, mask, together, H, HKV, ROWS, S, D, ROWS * D, S * D, 1.0f / sqrtf((float)D), 2);
  int same = 1, near = 1;
  for (int r = 0; r < ROWS; r++) {
    static float qr[H * D];
    for (int h = 0; h < H; h++) memcpy(qr + h * D, q + (h * ROWS + r) * D, D * sizeof(float));
    attend(qr, k, v, mask + r * S, alone, H, HKV, 1, S, D, D, S * D, 1.0f / sqrtf((float)D), 1);
    for (int h = 0; h < H; h++)
      for (int c = 0; c < D; c++) {
        same &= alone[h * D + c] == together[(r * H + h) * D + c];
        near &= close_to(together[(r * H + h) * D + c], attention_ref(q, k, v, mask, h, r, c), 1e-4);
      }
  }
  char what[96];
  snprintf(what, sizeof what, "%s against the reference", name);
  check(near, what);
  snprintf(what, sizeof what, "%s: a row alone gives the bits it gets among others", name);
  check(same, what);
}

static void check_elementwise(void) {
  static float x[3 * 100], wn[100], y[3 * 100], g[1000], u[1000], s[1000];
  for (int i = 0; i < 300; i++) x[i] = uniform();
  for (int i = 0; i < 100; i++) wn[i] = uniform();
  for (int i = 0; i < 1000; i++) g[i] = 8 * uniform(), u[i] = uniform();
  rms_norm_f32(x, wn, y, 3, 100, 1e-6f, 2);
  int near = 1;
  for (int r = 0; r < 3; r++) {
    double ss = 0;
    for (int i = 0; i < 100; i++) ss += (double)x[r * 100 + i] * x[r * 100 + i];
    for (int i = 0; i < 100; i++)
      near &= close_to(y[r * 100 + i], wn[i] * x[r * 100 + i] / sqrt(ss / 100 + 1e-6), 1e-5);
  }
  check(near, "rms_norm_f32 against the reference");
  silu_mul_f32(g, u, s, 1000, 2); /* 1000: a tail of 8 past the last whole vector */
  near = 1;
  for (int i = 0; i < 1000; i++) near &= close_to(s[i], g[i] / (1 + exp(-(double)g[i])) * u[i], 1e-5);
  check(near, "silu_mul_f32 against the reference");
}

int main(void) {
  printf("kernels.c's %s build\n", kernels_isa());
  check_linear_f32();
  check_linear_bf16();
  check_attention(attend_f32, "attend_f32");
  check_attention(tree_attend_f32, "tree_attend_f32");
  check_elementwise();
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}
