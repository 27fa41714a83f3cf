/* The one vector kernels.c is written over: vf, 16 fp32 lanes, as one AVX-512 register, two AVX2 registers, or a
 * plain array that the compiler vectorises for any other CPU (NEON among them). Each op does the same arithmetic
 * lane by lane on every ISA (and vf_sum4 the same tree), so a kernel gives the same fp32 bits whichever build
 * runs it. bf16 differs where an ISA has bf16 instructions: vdpbf16ps and AMX sum a pair their own way, and
 * vcvtneps2bf16 flushes denormals where f2bf (torch's rounding) keeps them. Which build a process loads is chosen
 * outside this file, by ddscope.models.builds: nothing here detects a CPU.
 * VF_WIDTH is the vectors a register tile holds across (kernels.c's tiles are rows by VF_WIDTH vectors): 4 where
 * a vf is one of 32 registers (AVX-512), 1 where it takes several (two of AVX2's 16, four of NEON's 32). */
#ifndef DDSCOPE_VEC_H
#define DDSCOPE_VEC_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define PREFETCH_L1(p) __builtin_prefetch((const void *)(p), 0, 3)
#define PREFETCH_L2(p) __builtin_prefetch((const void *)(p), 0, 2)

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VF_ISA "avx512"
#define VF_WIDTH 4
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf a) { _mm512_storeu_ps(p, a); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); } /* b where either is NaN */
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a b + c, rounded once */
static inline vf vf_fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a b, rounded once */
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf y, vf i) { return _mm512_scalef_ps(y, i); } /* y 2^i, i whole, rounded once */
static inline vf vf_unless_neg_inf(vf x, vf e) { /* e where x > -inf (or NaN), else 0 */
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), e);
}
static inline vf vf_widen(const uint16_t *p) { /* 16 bf16 in order */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_even(const uint16_t *p) { /* elements 0, 2, .., 30 of 32 bf16: one shift */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(p), 16));
}
static inline vf vf_odd(const uint16_t *p) { /* elements 1, 3, .., 31: one mask */
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(p), _mm512_set1_epi32((int)0xffff0000)));
}
static inline __m512i vf_bf16_bits(vf a) { /* each lane's bf16, to nearest even, in its low 16 bits */
  __m512i u = _mm512_castps_si512(a);
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                        _mm512_set1_epi32(1)))), 16);
  __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), nan);
}
#ifdef __AVX512BF16__ /* one instruction (which also flushes denormals) */
static inline __m512i vf_bf16_lanes(vf a) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a)); }
#else
#define vf_bf16_lanes vf_bf16_bits
#endif
static inline void vf_store_bf16(uint16_t *p, vf a) {
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(vf_bf16_lanes(a)));
}
static inline void vf_store_bf16_pairs(uint16_t *p, vf even, vf odd) { /* 32 bf16: even's and odd's, interleaved */
  _mm512_storeu_si512(p, _mm512_or_si512(vf_bf16_lanes(even), _mm512_slli_epi32(vf_bf16_lanes(odd), 16)));
}
/* key j's lanes summed in lane 4 j: halves, quarters, then within a quarter */
static inline void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4e));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xb1));
  float all[16];
  _mm512_storeu_ps(all, x);
  for (int j = 0; j < 4; j++) out[j] = all[4 * j];
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VF_ISA "avx2"
#define VF_WIDTH 1
typedef struct { __m256 lo, hi; } vf; /* lanes 0-7, 8-15 */
#define VF_EACH(expr_lo, expr_hi) { expr_lo, expr_hi }
#define VF_MAP2(f, a, b) ((vf)VF_EACH(f((a).lo, (b).lo), f((a).hi, (b).hi)))
static inline vf vf_zero(void) { return (vf)VF_EACH(_mm256_setzero_ps(), _mm256_setzero_ps()); }
static inline vf vf_set1(float x) { return (vf)VF_EACH(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf vf_load(const float *p) { return (vf)VF_EACH(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void vf_store(float *p, vf a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
static inline vf vf_add(vf a, vf b) { return VF_MAP2(_mm256_add_ps, a, b); }
static inline vf vf_sub(vf a, vf b) { return VF_MAP2(_mm256_sub_ps, a, b); }
static inline vf vf_mul(vf a, vf b) { return VF_MAP2(_mm256_mul_ps, a, b); }
static inline vf vf_div(vf a, vf b) { return VF_MAP2(_mm256_div_ps, a, b); }
static inline vf vf_max(vf a, vf b) { return VF_MAP2(_mm256_max_ps, a, b); }
static inline vf vf_fma(vf a, vf b, vf c) {
  return (vf)VF_EACH(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_fnma(vf a, vf b, vf c) {
  return (vf)VF_EACH(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
static inline vf vf_round(vf a) {
  return (vf)VF_EACH(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                     _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline __m256 pow2_8(__m256i e) { /* 2^e for e in [-126, 127] */
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}
static inline __m256 scale2_8(__m256 y, __m256 i) { /* as scalef: y 2^a exact, then 2^(i - a) rounds once */
  __m256i e = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(i, _mm256_set1_ps(-252.0f)), _mm256_set1_ps(252.0f)));
  __m256i a = _mm256_srai_epi32(e, 1);
  return _mm256_mul_ps(_mm256_mul_ps(y, pow2_8(a)), pow2_8(_mm256_sub_epi32(e, a)));
}
static inline vf vf_scale2(vf y, vf i) { return VF_MAP2(scale2_8, y, i); }
static inline vf vf_unless_neg_inf(vf x, vf e) {
  __m256 ninf = _mm256_set1_ps(-INFINITY);
  return (vf)VF_EACH(_mm256_and_ps(_mm256_cmp_ps(x.lo, ninf, _CMP_NEQ_UQ), e.lo),
                     _mm256_and_ps(_mm256_cmp_ps(x.hi, ninf, _CMP_NEQ_UQ), e.hi));
}
static inline __m256 widen_8(const uint16_t *p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_widen(const uint16_t *p) { return (vf)VF_EACH(widen_8(p), widen_8(p + 8)); }
static inline vf vf_even(const uint16_t *p) {
  return (vf)VF_EACH(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)p), 16)),
                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(p + 16)), 16)));
}
static inline vf vf_odd(const uint16_t *p) {
  __m256i m = _mm256_set1_epi32((int)0xffff0000);
  return (vf)VF_EACH(_mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), m)),
                     _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16)), m)));
}
static inline __m256i bf16_bits_8(__m256 a) { /* each lane's bf16, to nearest even, in its low 16 bits */
  __m256i u = _mm256_castps_si256(a);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
}
static inline void vf_store_bf16(uint16_t *p, vf a) { /* packus interleaves 128-bit halves: 0, 2, 1, 3 mends it */
  __m256i packed = _mm256_packus_epi32(bf16_bits_8(a.lo), bf16_bits_8(a.hi));
  _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, 0xd8));
}
static inline void vf_store_bf16_pairs(uint16_t *p, vf even, vf odd) {
  _mm256_storeu_si256((__m256i *)p, _mm256_or_si256(bf16_bits_8(even.lo), _mm256_slli_epi32(bf16_bits_8(odd.lo), 16)));
  _mm256_storeu_si256((__m256i *)(p + 16),
                      _mm256_or_si256(bf16_bits_8(even.hi), _mm256_slli_epi32(bf16_bits_8(odd.hi), 16)));
}
static inline __m128 quarters(vf a) { /* lane l: (a[l] + a[l + 8]) + (a[l + 4] + a[l + 12]), as AVX-512's tree */
  __m256 h = _mm256_add_ps(a.lo, a.hi);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
static inline void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
  __m128 t0 = quarters(a), t1 = quarters(b), t2 = quarters(c), t3 = quarters(d);
  _MM_TRANSPOSE4_PS(t0, t1, t2, t3); /* t_l: lane l of each key's quarters */
  _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(t0, t2), _mm_add_ps(t1, t3)));
}

#else /* any other CPU: plain arrays, vectorised by the compiler (NEON on aarch64) */
#define VF_ISA "generic"
#define VF_WIDTH 1
typedef struct { float v[LANES]; } vf;
#define VF_LANES(expr) { vf r; for (int l = 0; l < LANES; l++) r.v[l] = (expr); return r; }
static inline vf vf_zero(void) VF_LANES(0.0f)
static inline vf vf_set1(float x) VF_LANES(x)
static inline vf vf_load(const float *p) VF_LANES(p[l])
static inline void vf_store(float *p, vf a) { memcpy(p, a.v, sizeof a.v); }
static inline vf vf_add(vf a, vf b) VF_LANES(a.v[l] + b.v[l])
static inline vf vf_sub(vf a, vf b) VF_LANES(a.v[l] - b.v[l])
static inline vf vf_mul(vf a, vf b) VF_LANES(a.v[l] * b.v[l])
static inline vf vf_div(vf a, vf b) VF_LANES(a.v[l] / b.v[l])
static inline vf vf_max(vf a, vf b) VF_LANES(a.v[l] > b.v[l] ? a.v[l] : b.v[l])
static inline vf vf_fma(vf a, vf b, vf c) VF_LANES(fmaf(a.v[l], b.v[l], c.v[l]))
static inline vf vf_fnma(vf a, vf b, vf c) VF_LANES(fmaf(-a.v[l], b.v[l], c.v[l]))
static inline vf vf_round(vf a) VF_LANES(nearbyintf(a.v[l]))
static inline vf vf_scale2(vf y, vf i) VF_LANES(ldexpf(y.v[l], (int)fmaxf(fminf(i.v[l], 252.0f), -252.0f)))
static inline vf vf_unless_neg_inf(vf x, vf e) VF_LANES(x.v[l] != -INFINITY ? e.v[l] : 0.0f)
static inline vf vf_widen(const uint16_t *p) VF_LANES(bf2f(p[l]))
static inline vf vf_even(const uint16_t *p) VF_LANES(bf2f(p[2 * l]))
static inline vf vf_odd(const uint16_t *p) VF_LANES(bf2f(p[2 * l + 1]))
static inline void vf_store_bf16(uint16_t *p, vf a) {
  for (int l = 0; l < LANES; l++) p[l] = f2bf(a.v[l]);
}
static inline void vf_store_bf16_pairs(uint16_t *p, vf even, vf odd) {
  for (int l = 0; l < LANES; l++) p[2 * l] = f2bf(even.v[l]), p[2 * l + 1] = f2bf(odd.v[l]);
}
static inline float quarter_sum(vf a) {
  float q[4];
  for (int l = 0; l < 4; l++) q[l] = (a.v[l] + a.v[l + 8]) + (a.v[l + 4] + a.v[l + 12]);
  return (q[0] + q[2]) + (q[1] + q[3]);
}
static inline void vf_sum4(vf a, vf b, vf c, vf d, float out[4]) {
  out[0] = quarter_sum(a), out[1] = quarter_sum(b), out[2] = quarter_sum(c), out[3] = quarter_sum(d);
}
#endif

/* Shared by every ISA: partial vectors (a row's last few lanes), a sum in any order, and a vector rounded to
 * bf16 and back (where torch rounds between two bf16 ops). */
static inline vf vf_load_n(const float *p, int64_t n) {
  float t[LANES] = {0};
  memcpy(t, p, n * sizeof(float));
  return vf_load(t);
}
static inline void vf_store_n(float *p, vf a, int64_t n) {
  float t[LANES];
  vf_store(t, a);
  memcpy(p, t, n * sizeof(float));
}
static inline vf vf_widen_n(const uint16_t *p, int64_t n) {
  uint16_t t[LANES] = {0};
  memcpy(t, p, n * sizeof(uint16_t));
  return vf_widen(t);
}
static inline void vf_store_bf16_n(uint16_t *p, vf a, int64_t n) {
  uint16_t t[LANES];
  vf_store_bf16(t, a);
  memcpy(p, t, n * sizeof(uint16_t));
}
static inline vf vf_bf16_round(vf a) {
  uint16_t t[LANES];
  vf_store_bf16(t, a);
  return vf_widen(t);
}
static inline float vf_sum(vf a) {
  float t[LANES], s = 0.0f;
  vf_store(t, a);
  for (int l = 0; l < LANES; l++) s += t[l];
  return s;
}
#endif
