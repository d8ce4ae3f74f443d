// SIMD helpers shared by the kernels: bf16 / fp16 <-> fp32 vectors and a vectorized e^x, for AVX-512 and AVX2.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace parrot_kernels {

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {  // bf16 -> fp32 is a 16-bit left shift
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
inline void store16(float* x, __m512 v) { _mm512_storeu_ps(x, v); }
// round to nearest even like c10::BFloat16(float): bits + 0x7FFF + lsb, top half; NaN -> 0x7FC0
inline void store16(c10::BFloat16* x, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(r));
}

// e^x, |relative error| < 2e-7 for x in [-87, 88]; clamped to that range outside
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split in two for precision
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.0f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

}  // namespace parrot_kernels
#endif

// AVX2 + FMA + F16C twins (x86-64-v3): 8 fp32 lanes; bf16 / fp16 storage converted on load and store.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PARROT_AVX2 1
#include <c10/util/Half.h>
#include <immintrin.h>

namespace parrot_kernels::avx2 {

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}
inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline void store8(float* x, __m256 v) { _mm256_storeu_ps(x, v); }
// round to nearest even like c10::BFloat16(float); NaN -> 0x7FC0
inline void store8(c10::BFloat16* x, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 8 x 32-bit -> 8 x 16-bit: packus per 128-bit lane, then gather the two lanes' low halves
  const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(p));
}
inline void store8(c10::Half* x, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x as exp512 computes it (same polynomial and range reduction): |relative error| < 2e-7 in [-87, 88], clamped
// outside; 2^n is built in the exponent bits (n in [-126, 127] after the clamp)
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.0f / 720);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 120));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 24));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f / 6));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  // n = 128 (x near 88) would overflow the exponent field: scale by 2^(n-1) twice
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
  const __m256 p2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

struct RowSoftmax {
  float max, sum;  // of the scores, and of their exponentials before normalizing (lse = max + log(sum))
};

// softmax of row[0, live) in place, normalized; row[live, padded) <- 0 (padded: a multiple of 8, >= live >= 1).
// Scores more than 87 below the max give 0, as expf flushes them.
inline RowSoftmax softmax_row(float* row, int64_t live, int64_t padded) {
  float m = row[0];
  for (int64_t t = 1; t < live; ++t) m = m > row[t] ? m : row[t];
  const __m256 mm = _mm256_set1_ps(m), floor = _mm256_set1_ps(-87.0f);
  const __m256i n = _mm256_set1_epi32(static_cast<int>(live)), lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(row + t), mm);
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(t)), lanes);
    const __m256 keep = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(n, idx)), _mm256_cmp_ps(x, floor, _CMP_GE_OQ));
    const __m256 e = _mm256_and_ps(exp256(x), keep);
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(row + t, e);
  }
  const float total = hsum8(sum);
  const __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t t = 0; t < padded; t += 8) _mm256_storeu_ps(row + t, _mm256_mul_ps(_mm256_loadu_ps(row + t), inv));
  return {m, total};
}

}  // namespace parrot_kernels::avx2
#endif
