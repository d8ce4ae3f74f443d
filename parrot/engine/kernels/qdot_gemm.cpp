// Integer-dot GEMM for CPUs without bf16 dot products (x86-64-v3: AVX2 + FMA; AVX-512 without BF16; any CPU via
// the scalar twin): out[M, N] = x[M, K] @ W[N, K]^T with float activations quantized on the fly to int8 and
// weights in 4-bit codes per group of 32 input features (GGUF Q4_1's own form; Q4_0 is Q4_1 with m = -8 d):
//
//     W[n][32 g + j] = d[n][g] * q[n][32 g + j] + m[n][g]          q in [0, 15], d and m fp16 (as in the file)
//     x[r][32 g + j] ~= e[r][g] * a[r][32 g + j]                   a in [-127, 127], e = max|x| / 127 (fp32)
//
//     out[r][n] = sum_g  (d e) * (sum_j q a)  +  m * (e * sum_j a)            (the inner sums are exact integers)
//
// which is llama.cpp's Q4_1 x Q8_1 dot product. A weight may be the sum of P such planes (all reading the same
// activation group): two planes hold GGUF Q8_0 exactly (layers/qdot.py: u = q + 128 = 16 hi + lo).
//
// Activation precision (``terms``): one int8 term is ~8 bits per group (llama.cpp's numerics; on SmolLM2 it moves
// the logits well beyond what bf16 activations do: docs/results/README.md). Two terms add the rounding residual at
// 1/256 of the step,
//
//     x ~= e a + (e / 256) b,   b = round((x - e a) * 256 / e) in [-127, 127]     (~16 bits per group)
//
// and the integer sums combine exactly before the one float scaling: sum q x ~= (e / 256) (256 sum q a + sum q b),
// which fits int32 (|256 sum q a| <= 256 * 32 * 15 * 127). Twice the VPMADDUBSW work, the same float work.
//
// Packed layout (qdot_pack), N % 8 == 0, K % 32 == 0: uint8 [N/8 column blocks][K/32 groups][P planes][160 bytes]
//
//     bytes   0..127   codes of 8 output columns x 32 inputs: 4 vectors of 32 bytes; in vector v, the 4 bytes of
//                      column c (bytes 4c..4c+3) hold inputs 32 g + 4 v + i (low nibble) and 32 g + 16 + 4 v + i
//                      (high nibble), i = 0..3
//     bytes 128..143   d of the 8 columns (fp16);   bytes 144..159   m of the 8 columns (fp16)
//
// AVX2 inner step (one column block, one row, one group): for each of the 8 input quads, VPMADDUBSW(codes of the
// quad for 8 columns, the row's 4 int8 inputs broadcast) gives per column two int16 sums of 2 products
// (|.| <= 2 * 15 * 127 = 3810); the 8 quads are summed in int16 (<= 30480 < 32767: no saturation, which is why the
// activations stop at +-127 and the codes at 15), then VPMADDWD with ones widens to one int32 per column. Lanes
// are columns, so the per-group scales are plain vector loads and no horizontal sums are needed.
//
// The scalar twin computes the same integers and applies the same fp32 operations in the same order (fused
// multiply-adds included), so both give bit-identical results (tests/test_qdot_gemm.py checks it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kBlockBytes = 160;  // 128 code bytes + 8 fp16 d + 8 fp16 m
constexpr int64_t kCols = 8;          // output columns per block (one fp32 lane each)
constexpr int kRowTile = 4;           // rows sharing one decode of a block's codes
constexpr int64_t kChunkBytes = 16 << 10;  // int8 activations of a row chunk: stay in L1 while blocks stream by

// ---- activation quantization ---------------------------------------------------------------------------------
// Per row r and group g: a = round(x / e) (nearest even), e = max|x| / 127 (0 for an all-zero group, a = 0); with
// two terms also b = clamp(round((x - e a) * 256 / e)). ``u`` is the scale of one unit of the combined integer sum
// (e, or e / 256 with two terms) and ``us`` = u * (sum a, or 256 sum a + sum b) for the m term.
struct Quantized {
  std::vector<int8_t> a;  // [M, K]
  std::vector<int8_t> b;  // [M, K] (two terms only)
  std::vector<float> u;   // [M, KG]
  std::vector<float> us;  // [M, KG]
};

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void quantize_row_scalar(const T* x, int64_t KG, int terms, int8_t* a, int8_t* b, float* u, float* us) {
  for (int64_t g = 0; g < KG; ++g) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(x[32 * g + j])));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f, inv256 = inv * 256.f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const float v = to_f(x[32 * g + j]);
      const int32_t q = static_cast<int32_t>(std::nearbyint(v * inv));
      a[32 * g + j] = static_cast<int8_t>(q);
      if (terms == 2) {
        const float r = std::fma(-scale, static_cast<float>(q), v);
        const int32_t q2 = std::clamp(static_cast<int32_t>(std::nearbyint(r * inv256)), -127, 127);
        b[32 * g + j] = static_cast<int8_t>(q2);
        sum += 256 * q + q2;
      } else {
        sum += q;
      }
    }
    u[g] = terms == 2 ? scale * (1.f / 256.f) : scale;
    us[g] = u[g] * static_cast<float>(sum);
  }
}

#if defined(PARROT_AVX2)
using parrot_kernels::avx2::hmax8;
using parrot_kernels::avx2::load8;

inline int32_t hsum8i(__m256i s) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// 4 x 8 int32 (each within int8 range) -> 32 int8 in order: packs interleave 128-bit lanes, the permute undoes it
inline void store_i8(int8_t* out, const __m256i* q) {
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  const __m256i v = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v);
}

// same results as quantize_row_scalar: rounding to nearest even (the MXCSR default), the same fma, exact int sums
template <typename T>
void quantize_row_avx2(const T* x, int64_t KG, int terms, int8_t* a, int8_t* b, float* u, float* us) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  for (int64_t g = 0; g < KG; ++g) {
    const T* xg = x + 32 * g;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(xg + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float mx = hmax8(amax);
    const float scale = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
    const __m256 iv = _mm256_set1_ps(inv), iv256 = _mm256_set1_ps(inv * 256.f), sc = _mm256_set1_ps(scale);
    __m256i q[4], q2[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    store_i8(a + 32 * g, q);
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    if (terms == 2) {
      for (int i = 0; i < 4; ++i) {
        const __m256 r = _mm256_fnmadd_ps(sc, _mm256_cvtepi32_ps(q[i]), v[i]);
        q2[i] = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(_mm256_mul_ps(r, iv256))));
      }
      store_i8(b + 32 * g, q2);
      s = _mm256_add_epi32(_mm256_slli_epi32(s, 8),
                           _mm256_add_epi32(_mm256_add_epi32(q2[0], q2[1]), _mm256_add_epi32(q2[2], q2[3])));
    }
    u[g] = terms == 2 ? scale * (1.f / 256.f) : scale;
    us[g] = u[g] * static_cast<float>(hsum8i(s));
  }
}
#endif

template <typename T>
void quantize(const T* x, int64_t ldx, int64_t M, int64_t K, int terms, bool avx2, Quantized& out) {
  const int64_t KG = K / 32;
  out.a.resize(M * K);
  out.b.resize(terms == 2 ? M * K : 0);
  out.u.resize(M * KG);
  out.us.resize(M * KG);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* b = terms == 2 ? out.b.data() + r * K : nullptr;
#if defined(PARROT_AVX2)
      if (avx2) {
        quantize_row_avx2(x + r * ldx, KG, terms, out.a.data() + r * K, b, out.u.data() + r * KG, out.us.data() + r * KG);
        continue;
      }
#endif
      quantize_row_scalar(x + r * ldx, KG, terms, out.a.data() + r * K, b, out.u.data() + r * KG, out.us.data() + r * KG);
    }
  });
}

// ---- the GEMM --------------------------------------------------------------------------------------------------
struct Args {
  const uint8_t* w;
  int64_t KG, P;
  int terms;
  const Quantized* q;
  int64_t K;
};

template <typename O>
inline void store_out(O* o, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<O>(v[i]);
}

// rows [r0, r0 + R) x column block cb, scalar
template <typename O>
void tile_scalar(const Args& A, int64_t r0, int R, int64_t cb, O* out, int64_t ldo) {
  const int64_t KG = A.KG, P = A.P;
  float acc[kRowTile][kCols] = {};
  for (int64_t g = 0; g < KG; ++g)
    for (int64_t p = 0; p < P; ++p) {
      const uint8_t* blk = A.w + ((cb * KG + g) * P + p) * kBlockBytes;
      const c10::Half* dh = reinterpret_cast<const c10::Half*>(blk + 128);
      const c10::Half* mh = reinterpret_cast<const c10::Half*>(blk + 144);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = A.q->a.data() + (r0 + r) * A.K + 32 * g;
        const int8_t* b = A.terms == 2 ? A.q->b.data() + (r0 + r) * A.K + 32 * g : nullptr;
        const float u = A.q->u[(r0 + r) * KG + g], us = A.q->us[(r0 + r) * KG + g];
        for (int c = 0; c < kCols; ++c) {
          int32_t dot = 0, dot2 = 0;
          for (int v = 0; v < 4; ++v)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = blk[32 * v + 4 * c + i];
              const int32_t lo = byte & 15, hi = byte >> 4;
              dot += lo * a[4 * v + i] + hi * a[16 + 4 * v + i];
              if (b) dot2 += lo * b[4 * v + i] + hi * b[16 + 4 * v + i];
            }
          if (b) dot = 256 * dot + dot2;
          const float du = static_cast<float>(dh[c]) * u;
          acc[r][c] = std::fma(static_cast<float>(dot), du, acc[r][c]);
          acc[r][c] = std::fma(static_cast<float>(mh[c]), us, acc[r][c]);
        }
      }
    }
  for (int r = 0; r < R; ++r) store_out(out + (r0 + r) * ldo + cb * kCols, acc[r], kCols);
}

#if defined(PARROT_AVX2)
using parrot_kernels::avx2::store8;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// rows [r0, r0 + R) x column block cb, PL planes, TM activation terms. Per group: the code vectors are decoded once
// (low / high nibbles) and meet every row's broadcast input quads (broadcast once for all planes); per row, plane
// and term the 8 VPMADDUBSW results are summed in int16, then widened once (two terms: 256 s1 + s2 in int32).
template <int R, int PL, int TM, typename O>
void tile_avx2(const Args& A, int64_t r0, int64_t cb, O* out, int64_t ldo) {
  const int64_t KG = A.KG, K = A.K;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* a[TM][R];
  const float* u[R];
  const float* us[R];
  for (int r = 0; r < R; ++r) {
    a[0][r] = A.q->a.data() + (r0 + r) * K;
    if constexpr (TM == 2) a[1][r] = A.q->b.data() + (r0 + r) * K;
    u[r] = A.q->u.data() + (r0 + r) * KG;
    us[r] = A.q->us.data() + (r0 + r) * KG;
  }
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* blk = A.w + cb * KG * PL * kBlockBytes;
  for (int64_t g = 0; g < KG; ++g, blk += PL * kBlockBytes) {
    __m256i s[PL][TM][R];
    for (int p = 0; p < PL; ++p)
      for (int t = 0; t < TM; ++t)
        for (int r = 0; r < R; ++r) s[p][t][r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int v = 0; v < 4; ++v) {
      __m256i lo[PL], hi[PL];
      for (int p = 0; p < PL; ++p) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + p * kBlockBytes + 32 * v));
        lo[p] = _mm256_and_si256(bytes, low4);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < TM; ++t) {
          const int8_t* ar = a[t][r] + 32 * g + 4 * v;
          const __m256i xl = bcast4(ar), xh = bcast4(ar + 16);
          for (int p = 0; p < PL; ++p)
            s[p][t][r] = _mm256_add_epi16(
                s[p][t][r], _mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl), _mm256_maddubs_epi16(hi[p], xh)));
        }
    }
    for (int p = 0; p < PL; ++p) {
      const uint8_t* sc = blk + p * kBlockBytes + 128;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
      const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i i32 = _mm256_madd_epi16(s[p][0][r], ones);
        if constexpr (TM == 2) i32 = _mm256_add_epi32(_mm256_slli_epi32(i32, 8), _mm256_madd_epi16(s[p][1][r], ones));
        const __m256 dot = _mm256_cvtepi32_ps(i32);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_broadcast_ss(u[r] + g)), acc[r]);
        acc[r] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(us[r] + g), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store8(out + (r0 + r) * ldo + cb * kCols, acc[r]);
}

// rows per tile for PL planes x TM terms: the int16 sums (PL * TM per row) and the accumulators must fit the 16
// registers with the decoded codes
constexpr int tile_rows(int PL, int TM) { return kRowTile / (PL * TM); }

template <typename O>
using TileFn = void (*)(const Args&, int64_t, int64_t, O*, int64_t);
template <int PL, int TM, typename O, int... R>
constexpr std::array<TileFn<O>, sizeof...(R)> make_tiles(std::integer_sequence<int, R...>) {
  return {&tile_avx2<R + 1, PL, TM, O>...};
}
// kTiles<PL, TM, O>[R - 1]: R rows (1 <= R <= tile_rows(PL, TM))
template <int PL, int TM, typename O>
inline constexpr auto kTiles = make_tiles<PL, TM, O>(std::make_integer_sequence<int, tile_rows(PL, TM)>{});

// rows [r, r + R) of column block cb on the AVX2 tiles, split into tiles of the rows the shape allows
template <int PL, int TM, typename O>
void rows_avx2(const Args& A, int64_t r, int R, int64_t cb, O* out, int64_t ldo) {
  constexpr int T = tile_rows(PL, TM);
  for (int h = 0; h < R; h += T) kTiles<PL, TM, O>[std::min(T, R - h) - 1](A, r + h, cb, out, ldo);
}
#endif

// rows [0, M) x column blocks [c0, c1): rows in chunks whose activations stay in L1, each chunk against every
// column block of the range (a block's weights stay in L1 across the chunk's row tiles)
template <typename O>
void gemm_range(const Args& A, int64_t M, bool avx2, O* out, int64_t ldo, int64_t c0, int64_t c1) {
  const int64_t chunk = std::max<int64_t>(kRowTile, kChunkBytes / (A.K * A.terms) / kRowTile * kRowTile);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    for (int64_t cb = c0; cb < c1; ++cb)
      for (int64_t r = m0; r < m1; r += kRowTile) {
        const int R = static_cast<int>(std::min<int64_t>(kRowTile, m1 - r));
#if defined(PARROT_AVX2)
        if (avx2) {
          if (A.P == 1 && A.terms == 1) rows_avx2<1, 1>(A, r, R, cb, out, ldo);
          else if (A.P == 1) rows_avx2<1, 2>(A, r, R, cb, out, ldo);
          else if (A.terms == 1) rows_avx2<2, 1>(A, r, R, cb, out, ldo);
          else rows_avx2<2, 2>(A, r, R, cb, out, ldo);
          continue;
        }
#endif
        tile_scalar(A, r, R, cb, out, ldo);
      }
  }
}

std::vector<std::string> qdot_variants() {
  std::vector<std::string> v;
#if defined(PARROT_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    v.emplace_back("avx2");
#endif
  v.emplace_back("scalar");
  return v;
}

bool variant_is_avx2(c10::string_view variant) {
  if (variant == "avx2") {
#if defined(PARROT_AVX2)
    static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c");
    TORCH_CHECK(ok, "qdot_linear: this CPU has no AVX2 + FMA + F16C");
    return true;
#else
    TORCH_CHECK(false, "qdot_linear: this build has no AVX2 variant (built for a CPU without AVX2 + FMA + F16C)");
#endif
  }
  TORCH_CHECK(variant == "scalar", "qdot_linear: variant must be 'avx2' or 'scalar', got '", std::string(variant), "'");
  return false;
}

// codes uint8 [P, N, K] (0..15), d / m float [P, N, K/32] -> the packed layout above
at::Tensor qdot_pack(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte, "qdot_pack: codes must be uint8 [planes, N, K]");
  const at::Tensor cc = codes.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const int64_t P = cc.size(0), N = cc.size(1), K = cc.size(2), KG = K / 32;
  TORCH_CHECK(P == 1 || P == 2, "qdot_pack: 1 or 2 planes, got ", P);
  TORCH_CHECK(N % kCols == 0 && K % 32 == 0 && K > 0,
              "qdot_pack: N must be a multiple of 8 and K a positive multiple of 32, got ", N, " x ", K);
  TORCH_CHECK(dc.scalar_type() == at::kFloat && mc.scalar_type() == at::kFloat && dc.dim() == 3 &&
                  dc.sizes() == mc.sizes() && dc.size(0) == P && dc.size(1) == N && dc.size(2) == KG,
              "qdot_pack: d and m must be float [planes, N, K/32]");
  const uint8_t* q = cc.const_data_ptr<uint8_t>();
  const float* dp = dc.const_data_ptr<float>();
  const float* mp = mc.const_data_ptr<float>();
  for (int64_t i = 0; i < P * N * K; ++i) TORCH_CHECK(q[i] < 16, "qdot_pack: codes must lie in [0, 15]");
  at::Tensor out = at::empty({N / kCols, KG, P, kBlockBytes}, codes.options());
  uint8_t* o = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, N / kCols, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb)
      for (int64_t g = 0; g < KG; ++g)
        for (int64_t p = 0; p < P; ++p) {
          uint8_t* blk = o + ((cb * KG + g) * P + p) * kBlockBytes;
          for (int64_t c = 0; c < kCols; ++c) {
            const int64_t n = cb * kCols + c;
            const uint8_t* row = q + (p * N + n) * K + 32 * g;
            for (int v = 0; v < 4; ++v)
              for (int i = 0; i < 4; ++i)
                blk[32 * v + 4 * c + i] = static_cast<uint8_t>(row[4 * v + i] | (row[16 + 4 * v + i] << 4));
            reinterpret_cast<c10::Half*>(blk + 128)[c] = c10::Half(dp[(p * N + n) * KG + g]);
            reinterpret_cast<c10::Half*>(blk + 144)[c] = c10::Half(mp[(p * N + n) * KG + g]);
          }
        }
  });
  return out;
}

// the float32 weight [N, K] of a packed tensor into w (row-major), column blocks spread over the threads (the same
// fp32 operations as Planes.dequantize in layers/qdot.py: sum over planes of d q + m)
void dequantize_into(const at::Tensor& packed, float* w) {
  const int64_t NB = packed.size(0), KG = packed.size(1), P = packed.size(2), K = KG * 32;
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb)
      for (int64_t g = 0; g < KG; ++g)
        for (int64_t c = 0; c < kCols; ++c) {
          float* row = w + (cb * kCols + c) * K + 32 * g;
          for (int j = 0; j < 32; ++j) row[j] = 0.f;
          for (int64_t p = 0; p < P; ++p) {
            const uint8_t* blk = src + ((cb * KG + g) * P + p) * kBlockBytes;
            const float d = static_cast<float>(reinterpret_cast<const c10::Half*>(blk + 128)[c]);
            const float m = static_cast<float>(reinterpret_cast<const c10::Half*>(blk + 144)[c]);
            for (int v = 0; v < 4; ++v)
              for (int i = 0; i < 4; ++i) {
                const uint8_t byte = blk[32 * v + 4 * c + i];
                row[4 * v + i] += d * static_cast<float>(byte & 15) + m;
                row[16 + 4 * v + i] += d * static_cast<float>(byte >> 4) + m;
              }
          }
        }
  });
}

void check_packed(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(3) == kBlockBytes && (packed.size(2) == 1 || packed.size(2) == 2),
              op, ": weight must come from qdot_pack");
}

at::Tensor qdot_dequantize(const at::Tensor& packed) {
  check_packed(packed, "qdot_dequantize");
  at::Tensor w = at::empty({packed.size(0) * kCols, packed.size(1) * 32}, packed.options().dtype(at::kFloat));
  dequantize_into(packed, w.mutable_data_ptr<float>());
  return w;
}

at::Tensor qdot_linear(const at::Tensor& x, const at::Tensor& packed, c10::string_view variant, int64_t terms) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qdot_linear: x must be a 2-D float32 or bfloat16 CPU tensor");
  check_packed(packed, "qdot_linear");
  const bool avx2 = variant_is_avx2(variant);
  TORCH_CHECK(terms == 1 || terms == 2, "qdot_linear: terms must be 1 or 2, got ", terms);
  const int64_t M = x.size(0), K = x.size(1), KG = K / 32, NB = packed.size(0), N = NB * kCols;
  TORCH_CHECK(packed.size(1) * 32 == K, "qdot_linear: x has ", K, " features, the weight ", packed.size(1) * 32);
  const int64_t P = packed.size(2);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  thread_local Quantized q;  // reused across calls: a decode step makes ~120 of these
  const int t = static_cast<int>(terms);
  if (x.scalar_type() == at::kFloat) quantize(xc.const_data_ptr<float>(), xc.stride(0), M, K, t, avx2, q);
  else quantize(xc.const_data_ptr<c10::BFloat16>(), xc.stride(0), M, K, t, avx2, q);
  const Args A{packed.const_data_ptr<uint8_t>(), KG, P, t, &q, K};
  // column blocks per task: an even share per thread, at most 16 (ragged shares balance at prefill sizes)
  const int64_t grain = std::clamp<int64_t>(NB / at::get_num_threads(), 1, 16);
  auto run = [&](auto* o) {
    at::parallel_for(0, NB, grain, [&](int64_t c0, int64_t c1) { gemm_range(A, M, avx2, o, N, c0, c1); });
  };
  if (x.scalar_type() == at::kFloat) run(out.mutable_data_ptr<float>());
  else run(out.mutable_data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("qdot_variants() -> str[]", qdot_variants);
  m.def("qdot_pack(Tensor codes, Tensor d, Tensor m) -> Tensor", qdot_pack);
  m.def("qdot_linear(Tensor x, Tensor packed, str variant, int terms) -> Tensor");
  m.def("qdot_dequantize(Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) {
  m.impl("qdot_linear", qdot_linear);
  m.impl("qdot_dequantize", qdot_dequantize);
}
