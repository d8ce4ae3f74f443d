// The quantized matmul: out[M, N] = x[M, K] @ W[N, K]^T with W in its GGUF file's own codes and scales (packed by
// qpack.cpp; layout and formats in qformats.h), at every row count, with no other copy of the weight:
//
//     qlinear(x, packed, variant, terms, x2_rows, big_rows) -> out        x, out: float32 or bfloat16
//
//     M <  big_rows (or big_rows == 0)   integer dot products: x quantized per row and group of 32 inputs to int8,
//                                        in two terms when M <= x2_rows, else ``terms`` (1 or 2, below), times the
//                                        codes, exact int32 sums per sub-block, then one fp32 scaling per sub-block:
//                                            variant "avx512vnni"  VPDPBUSD, 16 output rows per zmm
//                                            variant "avx2"        VPMADDUBSW, 8 rows per ymm
//                                            variant "scalar"      the same integers and fp32 operations in C++
//     M >= big_rows                      "avx512vnni" with bfloat16 x (a CPU with AVX512-BF16): the weight
//                                        dequantized one 32-row panel at a time into a bf16 tile in cache
//                                        (vnni_block.h's layout: bf16 weights x bf16 activations, fp32 sums, as a
//                                        dense bf16 model computes) and multiplied by the VNNI bf16 GEMM block; any
//                                        other variant or x: 256-row chunks dequantized to float32 through torch's
//                                        GEMM. Either way only one panel / chunk of dequantized weight exists.
//
// The integer path. Per row r and group g of 32 inputs, x ~= u (256 a + b) (two terms) or u a (one term), with a,
// b int8 in [-127, 127] (a = round(x / e), e = max|x| / 127; b the residual at 1/256 of e; u = e / 256 or e).
// With A = 256 a + b (or a) and a sub-block j (16 or 32 inputs) of weights D_j (q - z) + Mn_j (qformats.h):
//
//     sum_k W x  =  u D_j (sum_k q A - z sum_k A)  +  Mn_j (u sum_k A)
//                   \____ exact int32 dot ____/      \__ us: per row and sub-block __/
//
// so per row and sub-block: i = sum q A - z SA (integers), then acc = fma(float(i), D_j * u, acc) and, for the
// asymmetric formats, acc = fma(Mn_j, us, acc). Every variant computes the same integers and these fp32
// operations in this order, so all three give bit-identical results (tests/test_qmm.py). Q8_0's signed codes are
// VPDPBUSD's unsigned operand as q + 128 (z = 128) and VPMADDUBSW's via the sign trick (z = 0): the same i.
// One term is llama.cpp's activation precision (its Q8 activations); two (the default) ~16 bits per group.
//
// int16 sums on AVX2: VPMADDUBSW adds two u8 x s8 products into int16 (|.| <= 2 * 255 * 127 would overflow), so
// per code width the quads summed in int16 before widening are: 4-bit 8 (<= 30480), 5-bit 4 (<= 31496), 6-bit 2
// (<= 32004), Q8_0 (|q| <= 128 via the sign trick) 1.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "qformats.h"
#include "simd.h"
#include "vnni_block.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define PARROT_VNNI 1
#endif

namespace {

using namespace parrot_kernels::q;

// ---- activations -----------------------------------------------------------------------------------------------
struct Acts {
  int64_t K = 0, KG = 0;
  int terms = 1;
  std::vector<int8_t> a, b;     // [M, K]
  std::vector<float> u;         // [M, KG]
  std::vector<int32_t> sa16;    // [M, 2 KG]: sum of A over inputs 0-15, 16-31 of each group
  std::vector<float> us16;      // [M, 2 KG]: u * sa16
  std::vector<int32_t> sa32;    // [M, KG]
  std::vector<float> us32;      // [M, KG]
};

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }

// one group's scale and the int8 terms: shared by both quantizers so they agree bit for bit
inline void group_sums(Acts& A, int64_t r, int64_t g, const int32_t* q, const int32_t* q2, float scale) {
  int32_t s[2] = {0, 0};
  for (int j = 0; j < 32; ++j) s[j / 16] += A.terms == 2 ? 256 * q[j] + q2[j] : q[j];
  const float u = A.terms == 2 ? scale * (1.f / 256.f) : scale;
  A.u[r * A.KG + g] = u;
  A.sa16[r * 2 * A.KG + 2 * g] = s[0];
  A.sa16[r * 2 * A.KG + 2 * g + 1] = s[1];
  A.us16[r * 2 * A.KG + 2 * g] = u * static_cast<float>(s[0]);
  A.us16[r * 2 * A.KG + 2 * g + 1] = u * static_cast<float>(s[1]);
  A.sa32[r * A.KG + g] = s[0] + s[1];
  A.us32[r * A.KG + g] = u * static_cast<float>(s[0] + s[1]);
}

template <typename T>
void quantize_row_scalar(const T* x, Acts& A, int64_t r) {
  int32_t q[32], q2[32];
  for (int64_t g = 0; g < A.KG; ++g) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(to_f(x[32 * g + j])));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f, inv256 = inv * 256.f;
    int8_t* a = A.a.data() + r * A.K + 32 * g;
    int8_t* b = A.terms == 2 ? A.b.data() + r * A.K + 32 * g : nullptr;
    for (int j = 0; j < 32; ++j) {
      const float v = to_f(x[32 * g + j]);
      q[j] = static_cast<int32_t>(std::nearbyint(v * inv));
      a[j] = static_cast<int8_t>(q[j]);
      if (b) {
        const float res = std::fma(-scale, static_cast<float>(q[j]), v);
        q2[j] = std::clamp(static_cast<int32_t>(std::nearbyint(res * inv256)), -127, 127);
        b[j] = static_cast<int8_t>(q2[j]);
      }
    }
    group_sums(A, r, g, q, q2, scale);
  }
}

#if defined(PARROT_AVX2)
using parrot_kernels::avx2::hmax8;
using parrot_kernels::avx2::load8;

// the scalar quantizer's results with AVX2 (round to nearest even, the same fma, exact integer sums)
template <typename T>
void quantize_row_avx2(const T* x, Acts& A, int64_t r) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  alignas(32) int32_t q[32], q2[32];
  for (int64_t g = 0; g < A.KG; ++g) {
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
    int8_t* a = A.a.data() + r * A.K + 32 * g;
    for (int i = 0; i < 4; ++i) {
      const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + 8 * i), qi);
      if (A.terms == 2) {
        const __m256 res = _mm256_fnmadd_ps(sc, _mm256_cvtepi32_ps(qi), v[i]);
        const __m256i q2i = _mm256_max_epi32(nlim, _mm256_min_epi32(lim, _mm256_cvtps_epi32(_mm256_mul_ps(res, iv256))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(q2 + 8 * i), q2i);
      }
    }
    for (int j = 0; j < 32; ++j) a[j] = static_cast<int8_t>(q[j]);
    if (A.terms == 2) {
      int8_t* b = A.b.data() + r * A.K + 32 * g;
      for (int j = 0; j < 32; ++j) b[j] = static_cast<int8_t>(q2[j]);
    }
    group_sums(A, r, g, q, q2, scale);
  }
}
#endif

template <typename T>
void quantize(const T* x, int64_t ldx, int64_t M, int64_t K, int terms, bool simd, Acts& A) {
  A.K = K;
  A.KG = K / 32;
  A.terms = terms;
  A.a.resize(M * K);
  A.b.resize(terms == 2 ? M * K : 0);
  A.u.resize(M * A.KG);
  A.sa16.resize(2 * M * A.KG);
  A.us16.resize(2 * M * A.KG);
  A.sa32.resize(M * A.KG);
  A.us32.resize(M * A.KG);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#if defined(PARROT_AVX2)
      if (simd) {
        quantize_row_avx2(x + r * ldx, A, r);
        continue;
      }
#endif
      quantize_row_scalar(x + r * ldx, A, r);
    }
  });
}

// the weight stream, kPrefetchBytes ahead of the group being read (one call per group: its bytes' worth of lines)
constexpr int64_t kPrefetchBytes = 2048;
inline void prefetch_ahead(const uint8_t* gp, int64_t group_bytes) {
  for (int64_t p = 0; p < group_bytes; p += 64) __builtin_prefetch(gp + kPrefetchBytes + p, 0, 3);
}

inline int log2i(int z) { return z == 0 ? 0 : 31 - __builtin_clz(static_cast<unsigned>(z)); }

enum class Variant { Vnni, Avx2, Scalar };

struct Job {
  const uint8_t* cbp;  // the column block's packed bytes
  Spec s;
  int64_t fmt;
  int64_t col;  // its first output column
};

template <typename O>
inline void store_row(O* o, const float* v, int n) {
  for (int i = 0; i < n; ++i) o[i] = static_cast<O>(v[i]);
}

// ---- scalar twin ---------------------------------------------------------------------------------------------
template <typename O>
void block_scalar(const Job& J, const Acts& A, int64_t M, O* out, int64_t ldo) {
  const Spec& s = J.s;
  const int halves = s.sub == 16 ? 2 : 1, z = s.zero;
  GroupScales gs;
  std::vector<float> acc(M * kRows, 0.f);
  for (int64_t g = 0; g < A.KG; ++g) {
    group_scales(s, J.fmt, J.cbp, g, gs);
    const uint8_t* gp = J.cbp + group_offset(s, g);
    for (int c = 0; c < kRows; ++c) {
      int32_t q[32];
      for (int k = 0; k < 32; ++k) q[k] = code_at(s, gp, c, k);
      for (int64_t r = 0; r < M; ++r) {
        const int8_t* a = A.a.data() + r * A.K + 32 * g;
        const int8_t* b = A.terms == 2 ? A.b.data() + r * A.K + 32 * g : nullptr;
        const float u = A.u[r * A.KG + g];
        float& ac = acc[r * kRows + c];
        for (int h = 0; h < halves; ++h) {
          const int k0 = 16 * h, k1 = halves == 2 ? k0 + 16 : 32;
          int32_t da = 0, db = 0;
          for (int k = k0; k < k1; ++k) {
            da += q[k] * a[k];
            if (b) db += q[k] * b[k];
          }
          int32_t i = b ? 256 * da + db : da;
          const int32_t sa = halves == 2 ? A.sa16[r * 2 * A.KG + 2 * g + h] : A.sa32[r * A.KG + g];
          if (z) i -= sa << log2i(z);
          const float du = gs.D[h][c] * u;
          ac = std::fma(static_cast<float>(i), du, ac);
          if (s.asym) ac = std::fma(gs.Mn[h][c], halves == 2 ? A.us16[r * 2 * A.KG + 2 * g + h] : A.us32[r * A.KG + g], ac);
        }
      }
    }
  }
  for (int64_t r = 0; r < M; ++r) store_row(out + r * ldo + J.col, acc.data() + r * kRows, kRows);
}

#define PARROT_INLINE __attribute__((always_inline)) inline

constexpr int clog2(int z) { return z <= 1 ? 0 : 1 + clog2(z / 2); }

// rows per register tile (the accumulators of a tile stay in registers across the whole K loop)
constexpr int kTileVnni = 4;
constexpr int kTileAvx2 = 2;

#if defined(PARROT_VNNI)
// ---- AVX512-VNNI ------------------------------------------------------------------------------------------------
// group g's scales for the 16 rows as group_scales computes them (the same fp32 products): D per sub-block, Mn
struct Scales16 {
  __m512 D0, D1, Mn;
};

PARROT_INLINE __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PARROT_INLINE __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
PARROT_INLINE __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <int64_t F>
PARROT_INLINE Scales16 scales_vnni(const uint8_t* cbp, int64_t g) {
  constexpr Spec s = spec_of(F);
  const uint8_t* sc = cbp + group_offset(s, g) + s.scale_offset;
  if constexpr (F == Q6_K) {
    const __m512 d = half16(cbp + super_offset(s, g));
    return {_mm512_mul_ps(d, i8x16(sc)), _mm512_mul_ps(d, i8x16(sc + 16)), _mm512_setzero_ps()};
  } else if constexpr (s.kquant) {
    const uint8_t* sh = cbp + super_offset(s, g);
    const __m512 D = _mm512_mul_ps(half16(sh), u8x16(sc));
    const __m512 mn = _mm512_mul_ps(half16(sh + 32), u8x16(sc + 16));
    return {D, D, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mn), _mm512_set1_epi32(INT32_MIN)))};
  } else {
    const __m512 D = half16(sc);
    return {D, D, s.asym ? half16(sc + 32) : _mm512_setzero_ps()};
  }
}

// the 8 quads' codes of the group at gp, one u8 per byte (Q8_0: q + 128)
template <int64_t F>
PARROT_INLINE void decode_vnni(const uint8_t* gp, __m512i* q) {
  constexpr Spec s = spec_of(F);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if constexpr (s.bits == 8) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int v = 0; v < 8; ++v) q[v] = _mm512_xor_si512(_mm512_loadu_si512(gp + 64 * v), flip);
    return;
  }
  for (int v = 0; v < 4; ++v) {
    const __m512i L = _mm512_loadu_si512(gp + 64 * v);
    q[v] = _mm512_and_si512(L, low4);
    q[4 + v] = _mm512_and_si512(_mm512_srli_epi16(L, 4), low4);
  }
  if constexpr (s.bits == 5) {
    const __m512i H = _mm512_loadu_si512(gp + s.hi_offset), bit = _mm512_set1_epi8(0x10);
    const __m512i t[8] = {_mm512_slli_epi16(H, 4), _mm512_slli_epi16(H, 3), _mm512_slli_epi16(H, 2),
                          _mm512_slli_epi16(H, 1), H, _mm512_srli_epi16(H, 1), _mm512_srli_epi16(H, 2),
                          _mm512_srli_epi16(H, 3)};
    for (int v = 0; v < 8; ++v) q[v] = _mm512_ternarylogic_epi32(q[v], t[v], bit, 0xF8);  // q | (t & bit)
  } else if constexpr (s.bits == 6) {
    const __m512i bits = _mm512_set1_epi8(0x30);
    for (int hv = 0; hv < 2; ++hv) {
      const __m512i H = _mm512_loadu_si512(gp + s.hi_offset + 64 * hv);
      const __m512i t[4] = {_mm512_slli_epi16(H, 4), _mm512_slli_epi16(H, 2), H, _mm512_srli_epi16(H, 2)};
      for (int j = 0; j < 4; ++j) q[4 * hv + j] = _mm512_ternarylogic_epi32(q[4 * hv + j], t[j], bits, 0xF8);
    }
  }
}

PARROT_INLINE __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// sum over quads [V0, V1) of the codes times one term; a lone row (R == 1) splits it into two independent chains
// (there, latency and not throughput bounds it), a tile of rows has its rows' chains to overlap
template <int R, int V0, int V1>
PARROT_INLINE __m512i dot1_vnni(const __m512i* q, const int8_t* a) {
  __m512i c0 = _mm512_setzero_si512();
  if constexpr (R == 1) {
    __m512i c1 = _mm512_setzero_si512();
    for (int v = V0; v < V1; v += 2) {
      c0 = _mm512_dpbusd_epi32(c0, q[v], bcast4(a + 4 * v));
      c1 = _mm512_dpbusd_epi32(c1, q[v + 1], bcast4(a + 4 * v + 4));
    }
    return _mm512_add_epi32(c0, c1);
  } else {
    for (int v = V0; v < V1; ++v) c0 = _mm512_dpbusd_epi32(c0, q[v], bcast4(a + 4 * v));
    return c0;
  }
}

// the integer dot of quads [V0, V1) with row terms a (and b: 256 a + b combined)
template <int TM, int R, int V0, int V1>
PARROT_INLINE __m512i dot_vnni(const __m512i* q, const int8_t* a, const int8_t* b) {
  if constexpr (TM == 1) {
    return dot1_vnni<R, V0, V1>(q, a);
  } else {
    return _mm512_add_epi32(_mm512_slli_epi32(dot1_vnni<R, V0, V1>(q, a), 8), dot1_vnni<R, V0, V1>(q, b));
  }
}

// rows [r0, r0 + R) x the 16 rows of column block J: R fp32 accumulators in registers over all K
template <int64_t F, int TM, int R, typename O>
void tile_vnni(const Job& J, const Acts& A, int64_t r0, O* out, int64_t ldo) {
  constexpr Spec s = spec_of(F);
  constexpr int zsh = clog2(F == Q8_0 ? 128 : s.zero);
  constexpr bool sym = F == Q8_0 || s.zero != 0;
  const int64_t KG = A.KG, K = A.K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < KG; ++g) {
    const uint8_t* gp = J.cbp + group_offset(s, g);
    prefetch_ahead(gp, s.group_bytes);
    const Scales16 sc = scales_vnni<F>(J.cbp, g);
    __m512i q[8];
    decode_vnni<F>(gp, q);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t row = r0 + r;
      const int8_t* a = A.a.data() + row * K + 32 * g;
      const int8_t* b = TM == 2 ? A.b.data() + row * K + 32 * g : nullptr;
      const __m512 u = _mm512_set1_ps(A.u[row * KG + g]);
      if constexpr (s.sub == 16) {  // Q6_K: two sub-blocks of 16 inputs
        __m512i i0 = dot_vnni<TM, R, 0, 4>(q, a, b), i1 = dot_vnni<TM, R, 4, 8>(q, a, b);
        i0 = _mm512_sub_epi32(i0, _mm512_slli_epi32(_mm512_set1_epi32(A.sa16[row * 2 * KG + 2 * g]), zsh));
        i1 = _mm512_sub_epi32(i1, _mm512_slli_epi32(_mm512_set1_epi32(A.sa16[row * 2 * KG + 2 * g + 1]), zsh));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(sc.D0, u), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(sc.D1, u), acc[r]);
      } else {
        __m512i i = dot_vnni<TM, R, 0, 8>(q, a, b);
        if constexpr (sym) i = _mm512_sub_epi32(i, _mm512_slli_epi32(_mm512_set1_epi32(A.sa32[row * KG + g]), zsh));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(sc.D0, u), acc[r]);
        if constexpr (s.asym) acc[r] = _mm512_fmadd_ps(sc.Mn, _mm512_set1_ps(A.us32[row * KG + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) parrot_kernels::store16(out + (r0 + r) * ldo + J.col, acc[r]);
}

template <int64_t F, int TM, typename O>
void block_vnni(const Job& J, const Acts& A, int64_t M, O* out, int64_t ldo) {
  int64_t r0 = 0;
  for (; r0 + kTileVnni <= M; r0 += kTileVnni) tile_vnni<F, TM, kTileVnni>(J, A, r0, out, ldo);
  switch (M - r0) {
    case 1: tile_vnni<F, TM, 1>(J, A, r0, out, ldo); break;
    case 2: tile_vnni<F, TM, 2>(J, A, r0, out, ldo); break;
    case 3: tile_vnni<F, TM, 3>(J, A, r0, out, ldo); break;
    default: break;
  }
}
#endif

#if defined(PARROT_AVX2)
// ---- AVX2 -------------------------------------------------------------------------------------------------------
// rows 8 hf .. 8 hf + 7 of group g's scales, as group_scales computes them
struct Scales8 {
  __m256 D0, D1, Mn;
};

PARROT_INLINE __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
PARROT_INLINE __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
PARROT_INLINE __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int64_t F>
PARROT_INLINE Scales8 scales_avx2(const uint8_t* cbp, int64_t g, int hf) {
  constexpr Spec s = spec_of(F);
  const uint8_t* sc = cbp + group_offset(s, g) + s.scale_offset;
  if constexpr (F == Q6_K) {
    const __m256 d = half8(cbp + super_offset(s, g) + 16 * hf);
    return {_mm256_mul_ps(d, i8x8(sc + 8 * hf)), _mm256_mul_ps(d, i8x8(sc + 16 + 8 * hf)), _mm256_setzero_ps()};
  } else if constexpr (s.kquant) {
    const uint8_t* sh = cbp + super_offset(s, g);
    const __m256 D = _mm256_mul_ps(half8(sh + 16 * hf), u8x8(sc + 8 * hf));
    const __m256 mn = _mm256_mul_ps(half8(sh + 32 + 16 * hf), u8x8(sc + 16 + 8 * hf));
    return {D, D, _mm256_xor_ps(mn, _mm256_set1_ps(-0.0f))};
  } else {
    const __m256 D = half8(sc + 16 * hf);
    return {D, D, s.asym ? half8(sc + 32 + 16 * hf) : _mm256_setzero_ps()};
  }
}

// the 8 quads' codes of the group at gp for rows 8 hf .. 8 hf + 7 (u8; Q8_0: the signed codes)
template <int64_t F>
PARROT_INLINE void decode_avx2(const uint8_t* gp, int hf, __m256i* q) {
  constexpr Spec s = spec_of(F);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  auto ld = [&](int64_t off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gp + off + 32 * hf)); };
  if constexpr (s.bits == 8) {
    for (int v = 0; v < 8; ++v) q[v] = ld(64 * v);
    return;
  }
  for (int v = 0; v < 4; ++v) {
    const __m256i L = ld(64 * v);
    q[v] = _mm256_and_si256(L, low4);
    q[4 + v] = _mm256_and_si256(_mm256_srli_epi16(L, 4), low4);
  }
  if constexpr (s.bits == 5) {
    const __m256i H = ld(s.hi_offset), bit = _mm256_set1_epi8(0x10);
    const __m256i t[8] = {_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 3), _mm256_slli_epi16(H, 2),
                          _mm256_slli_epi16(H, 1), H, _mm256_srli_epi16(H, 1), _mm256_srli_epi16(H, 2),
                          _mm256_srli_epi16(H, 3)};
    for (int v = 0; v < 8; ++v) q[v] = _mm256_or_si256(q[v], _mm256_and_si256(t[v], bit));
  } else if constexpr (s.bits == 6) {
    const __m256i bits = _mm256_set1_epi8(0x30);
    for (int hv = 0; hv < 2; ++hv) {
      const __m256i H = ld(s.hi_offset + 64 * hv);
      const __m256i t[4] = {_mm256_slli_epi16(H, 4), _mm256_slli_epi16(H, 2), H, _mm256_srli_epi16(H, 2)};
      for (int j = 0; j < 4; ++j) q[4 * hv + j] = _mm256_or_si256(q[4 * hv + j], _mm256_and_si256(t[j], bits));
    }
  }
}

PARROT_INLINE __m256i bcast4_256(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// int32 sums over quads [V0, V1) of one term; RUN quads are summed in int16 before each widening (saturation bound)
template <int64_t F, int V0, int V1>
PARROT_INLINE __m256i dot1_avx2(const __m256i* q, const int8_t* a) {
  constexpr int bits = spec_of(F).bits;
  constexpr int RUN = std::min(V1 - V0, bits == 4 ? 8 : bits == 5 ? 4 : bits == 6 ? 2 : 1);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i i32 = _mm256_setzero_si256();
  for (int v = V0; v < V1; v += RUN) {
    __m256i s16 = _mm256_setzero_si256();
    for (int w = v; w < v + RUN; ++w) {
      const __m256i x = bcast4_256(a + 4 * w);
      if constexpr (bits == 8) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_abs_epi8(q[w]), _mm256_sign_epi8(x, q[w])));
      else s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(q[w], x));
    }
    i32 = _mm256_add_epi32(i32, _mm256_madd_epi16(s16, ones));
  }
  return i32;
}

template <int64_t F, int TM, int V0, int V1>
PARROT_INLINE __m256i dot_avx2(const __m256i* q, const int8_t* a, const int8_t* b) {
  if constexpr (TM == 1) {
    return dot1_avx2<F, V0, V1>(q, a);
  } else {
    return _mm256_add_epi32(_mm256_slli_epi32(dot1_avx2<F, V0, V1>(q, a), 8), dot1_avx2<F, V0, V1>(q, b));
  }
}

// rows [r0, r0 + R) x rows 8 hf .. 8 hf + 8 H - 1 of column block J (H halves of its 16 rows), accumulators in
// registers over all K. One row reads both halves per pass (H = 2): each 64-byte line of a quad is used whole while
// it streams in, instead of half on a first pass and the other half from L2 on a second.
template <int64_t F, int TM, int R, int H, typename O>
void tile_avx2(const Job& J, const Acts& A, int64_t r0, int hf0, O* out, int64_t ldo) {
  constexpr Spec s = spec_of(F);
  constexpr int zsh = clog2(s.zero);
  const int64_t KG = A.KG, K = A.K;
  __m256 acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < KG; ++g) {
    const uint8_t* gp = J.cbp + group_offset(s, g);
    prefetch_ahead(gp, s.group_bytes);
    for (int h = 0; h < H; ++h) {
      const int hf = hf0 + h;
      const Scales8 sc = scales_avx2<F>(J.cbp, g, hf);
      __m256i q[8];
      decode_avx2<F>(gp, hf, q);
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const int8_t* a = A.a.data() + row * K + 32 * g;
        const int8_t* b = TM == 2 ? A.b.data() + row * K + 32 * g : nullptr;
        const __m256 u = _mm256_set1_ps(A.u[row * KG + g]);
        __m256& ac = acc[h][r];
        if constexpr (s.sub == 16) {
          __m256i i0 = dot_avx2<F, TM, 0, 4>(q, a, b), i1 = dot_avx2<F, TM, 4, 8>(q, a, b);
          i0 = _mm256_sub_epi32(i0, _mm256_slli_epi32(_mm256_set1_epi32(A.sa16[row * 2 * KG + 2 * g]), zsh));
          i1 = _mm256_sub_epi32(i1, _mm256_slli_epi32(_mm256_set1_epi32(A.sa16[row * 2 * KG + 2 * g + 1]), zsh));
          ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(sc.D0, u), ac);
          ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(sc.D1, u), ac);
        } else {
          __m256i i = dot_avx2<F, TM, 0, 8>(q, a, b);
          if constexpr (s.zero != 0) i = _mm256_sub_epi32(i, _mm256_slli_epi32(_mm256_set1_epi32(A.sa32[row * KG + g]), zsh));
          ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(sc.D0, u), ac);
          if constexpr (s.asym) ac = _mm256_fmadd_ps(sc.Mn, _mm256_set1_ps(A.us32[row * KG + g]), ac);
        }
      }
    }
  }
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) parrot_kernels::avx2::store8(out + (r0 + r) * ldo + J.col + 8 * (hf0 + h), acc[h][r]);
}

// Few rows (the weight stream is the cost): each row tile reads both halves per pass. More rows (the dot products
// are): tiles of kTileAvx2 rows over one half at a time, whose codes stay in L1 across the tiles. An odd last row
// reads both halves (figures: docs/results, "Kernel design measurements").
constexpr int64_t kBothHalvesRows = 4;
template <int64_t F, int TM, typename O>
void block_avx2(const Job& J, const Acts& A, int64_t M, O* out, int64_t ldo) {
  const int64_t full = M / kTileAvx2 * kTileAvx2;
  if (M <= kBothHalvesRows) {
    for (int64_t r0 = 0; r0 < full; r0 += kTileAvx2) tile_avx2<F, TM, kTileAvx2, 2>(J, A, r0, 0, out, ldo);
  } else {
    for (int hf = 0; hf < 2; ++hf)
      for (int64_t r0 = 0; r0 < full; r0 += kTileAvx2) tile_avx2<F, TM, kTileAvx2, 1>(J, A, r0, hf, out, ldo);
  }
  for (int64_t r0 = full; r0 < M; ++r0) tile_avx2<F, TM, 1, 2>(J, A, r0, 0, out, ldo);
}
#endif

// ---- the big-batch paths ---------------------------------------------------------------------------------------
#if defined(PARROT_VNNI) && defined(__AVX512BF16__)
#define PARROT_PANEL 1
// column block J's weights as half `j` of a 32-row panel in the VNNI bf16 GEMM's layout (vnni_block.h: per 32
// inputs kb, [j][r pair][c row][i] at tile + (kb * 2 + j) * 512 + r * 32 + 2 c + i), D (q - z) + Mn rounded to bf16
template <int64_t F>
void dequant_half_fmt(const Job& J, int64_t g0, int64_t g1, int j, c10::BFloat16* tile) {
  constexpr Spec s = spec_of(F);
  // bytes 4c + {0, 1} (and {2, 3}) of each dword -> 16-bit lanes; the signed variant puts them in the high byte
  const __m512i lo_pairs = _mm512_set4_epi32(0x800D800C, 0x80098008, 0x80058004, 0x80018000);
  const __m512i hi_pairs = _mm512_set4_epi32(0x800F800E, 0x800B800A, 0x80078006, 0x80038002);
  const __m512i lo_pairs_s = _mm512_set4_epi32(0x0D800C80, 0x09800880, 0x05800480, 0x01800080);
  const __m512i hi_pairs_s = _mm512_set4_epi32(0x0F800E80, 0x0B800A80, 0x07800680, 0x03800280);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i mask16 = _mm512_set1_epi32(0xFFFF);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = J.cbp + group_offset(s, g);
    const Scales16 sc = scales_vnni<F>(J.cbp, g);
    __m512i q[8];
    if constexpr (s.bits != 8) decode_vnni<F>(gp, q);  // Q8_0's signed bytes are read below (signed shuffles)
    for (int h = 0; h < 2; ++h) {
      const __m512 D = h ? sc.D1 : sc.D0;
      const __m512 B = _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(s.zero)), D, sc.Mn);  // Mn - z D
      for (int v = 4 * h; v < 4 * h + 4; ++v) {
        for (int half = 0; half < 2; ++half) {
          __m512i even, odd;
          if constexpr (s.bits == 8) {
            const __m512i p = _mm512_srai_epi16(
                _mm512_shuffle_epi8(_mm512_loadu_si512(gp + 64 * v), half ? hi_pairs_s : lo_pairs_s), 8);
            even = _mm512_srai_epi32(_mm512_slli_epi32(p, 16), 16);
            odd = _mm512_srai_epi32(p, 16);
          } else {
            const __m512i p = _mm512_shuffle_epi8(q[v], half ? hi_pairs : lo_pairs);
            even = _mm512_and_si512(p, mask16);
            odd = _mm512_srli_epi32(p, 16);
          }
          const __m512 we = _mm512_fmadd_ps(_mm512_cvtepi32_ps(even), D, B);
          const __m512 wo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(odd), D, B);
          const __m512bh packed = _mm512_cvtne2ps_pbh(wo, we);  // [we 0..15 | wo 0..15]
          const __m512i lanes = _mm512_permutexvar_epi16(interleave, reinterpret_cast<const __m512i&>(packed));
          _mm512_storeu_si512(tile + ((g - g0) * 2 + j) * 512 + (2 * v + half) * 32, lanes);  // pair 2v + half
        }
      }
    }
  }
}

// groups [g0, g1) of column block J as half j of a panel tile
void dequant_half(const Job& J, int64_t g0, int64_t g1, int j, c10::BFloat16* tile) {
  switch (J.fmt) {
    case Q4_0: return dequant_half_fmt<Q4_0>(J, g0, g1, j, tile);
    case Q4_1: return dequant_half_fmt<Q4_1>(J, g0, g1, j, tile);
    case Q5_0: return dequant_half_fmt<Q5_0>(J, g0, g1, j, tile);
    case Q5_1: return dequant_half_fmt<Q5_1>(J, g0, g1, j, tile);
    case Q8_0: return dequant_half_fmt<Q8_0>(J, g0, g1, j, tile);
    case Q4_K: return dequant_half_fmt<Q4_K>(J, g0, g1, j, tile);
    case Q5_K: return dequant_half_fmt<Q5_K>(J, g0, g1, j, tile);
    case Q6_K: return dequant_half_fmt<Q6_K>(J, g0, g1, j, tile);
    default: TORCH_CHECK(false, "qlinear: unsupported format id ", J.fmt);
  }
}

// A group of panels (32 output rows each: consecutive column blocks in pairs, each half dequantized by its own
// block's format; a lone last block pads with zeros) times every row of x, K in chunks: per chunk of kKChunk groups,
// the group's tiles are dequantized into cache (kPanelsPerGroup x 128 KB) and every row block of x (MR <= 6 rows
// over both panels at once, vnni_block.h's block_acc2; a lone panel: MR <= 12) runs through them, accumulating into
// C (fp32 [M][kPanelsPerGroup * 32]). x is thus read once per panel group, not once per panel (tried: 2-8 panels,
// 512-2048 inputs per chunk; figures: docs/results, "Kernel design measurements").
constexpr int64_t kPanelsPerGroup = 2;
constexpr int64_t kKChunk = 64;  // groups of 32 inputs per chunk: 2048 inputs

void panel_group(const std::vector<Job>& jobs, int64_t p0, int64_t np, const c10::BFloat16* x, int64_t ldx,
                 int64_t M, int64_t KG, c10::BFloat16* out, int64_t ldo) {
  static thread_local std::vector<c10::BFloat16> tiles;
  static thread_local std::vector<float> C;
  constexpr int64_t tile_elems = kKChunk * 1024;
  const int64_t ldc = np * 32;
  tiles.resize(kPanelsPerGroup * tile_elems);
  C.resize(M * ldc);
  // two panels: blocks of <= kMaxRows2 rows over both at once; one: blocks of <= kMaxRows over it
  const int64_t max_rows = np == 2 ? parrot_kernels::vnni::kMaxRows2 : parrot_kernels::vnni::kMaxRows;
  const int64_t nblocks = (M + max_rows - 1) / max_rows;
  const int64_t rows = (M + nblocks - 1) / nblocks;
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  for (int64_t g0 = 0; g0 < KG; g0 += kKChunk) {
    const int64_t g1 = std::min(KG, g0 + kKChunk);
    for (int64_t p = 0; p < np; ++p) {
      c10::BFloat16* tile = tiles.data() + p * tile_elems;
      const int64_t j0 = 2 * (p0 + p);
      dequant_half(jobs[j0], g0, g1, 0, tile);
      if (j0 + 1 < njobs) dequant_half(jobs[j0 + 1], g0, g1, 1, tile);
      else for (int64_t g = g0; g < g1; ++g) std::memset(tile + ((g - g0) * 2 + 1) * 512, 0, 1024);
    }
    for (int64_t m = 0; m < M; m += rows) {
      const int64_t mr = std::min(rows, M - m);
      if (np == 2) {
        parrot_kernels::vnni::blocks_acc2[mr - 1](x + m * ldx + g0 * 32, ldx, tiles.data(), tiles.data() + tile_elems,
                                                  g1 - g0, C.data() + m * ldc, ldc, g0 == 0);
        continue;
      }
      for (int64_t p = 0; p < np; ++p)
        parrot_kernels::vnni::blocks_acc[mr - 1](x + m * ldx + g0 * 32, ldx, tiles.data() + p * tile_elems, g1 - g0,
                                                 C.data() + m * ldc + p * 32, ldc, g0 == 0);
    }
  }
  const int64_t col0 = jobs[2 * p0].col, ncols = std::min<int64_t>(np * 32, (njobs - 2 * p0) * kRows);
  for (int64_t m = 0; m < M; ++m) {
    const float* c = C.data() + m * ldc;
    c10::BFloat16* o = out + m * ldo + col0;
    int64_t n = 0;
    for (; n + 16 <= ncols; n += 16) parrot_kernels::store16(o + n, _mm512_loadu_ps(c + n));
  }
}
#endif

// ---- the op ---------------------------------------------------------------------------------------------------
std::vector<std::string> qmm_variants() {
  std::vector<std::string> v;
#if defined(PARROT_VNNI)
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) v.emplace_back("avx512vnni");
#endif
#if defined(PARROT_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    v.emplace_back("avx2");
#endif
  v.emplace_back("scalar");
  return v;
}


Variant parse_variant(c10::string_view variant) {
  static const std::vector<std::string> have = qmm_variants();
  TORCH_CHECK(std::find(have.begin(), have.end(), std::string(variant)) != have.end(), "qlinear: variant '",
              std::string(variant), "' is not available on this CPU/build (have: ", have.size(), " variants)");
  if (variant == "avx512vnni") return Variant::Vnni;
  if (variant == "avx2") return Variant::Avx2;
  return Variant::Scalar;
}

// the column blocks of every segment, in output order
std::vector<Job> jobs_of(const uint8_t* base, const Header& h) {
  std::vector<Job> jobs;
  jobs.reserve(h.N / kRows);
  for (int64_t si = 0; si < h.nseg; ++si) {
    const Segment& g = h.seg[si];
    const Spec s = spec(g.fmt);
    const int64_t cbb = column_block_bytes(s, h.K);
    for (int64_t cb = 0; cb < g.n / kRows; ++cb) jobs.push_back({base + g.offset + cb * cbb, s, g.fmt, g.n0 + cb * kRows});
  }
  return jobs;
}

// one column block on the variant's kernel, instantiated per format and activation terms
template <int64_t F, typename O>
void block_fmt(const Job& J, const Acts& A, int64_t M, Variant var, O* out, int64_t ldo) {
#if defined(PARROT_VNNI)
  if (var == Variant::Vnni) {
    if (A.terms == 2) block_vnni<F, 2>(J, A, M, out, ldo);
    else block_vnni<F, 1>(J, A, M, out, ldo);
    return;
  }
#endif
#if defined(PARROT_AVX2)
  if (var == Variant::Avx2) {
    if (A.terms == 2) block_avx2<F, 2>(J, A, M, out, ldo);
    else block_avx2<F, 1>(J, A, M, out, ldo);
    return;
  }
#endif
  block_scalar(J, A, M, out, ldo);
}

template <typename O>
void block_any(const Job& J, const Acts& A, int64_t M, Variant var, O* out, int64_t ldo) {
  switch (J.fmt) {
    case Q4_0: return block_fmt<Q4_0>(J, A, M, var, out, ldo);
    case Q4_1: return block_fmt<Q4_1>(J, A, M, var, out, ldo);
    case Q5_0: return block_fmt<Q5_0>(J, A, M, var, out, ldo);
    case Q5_1: return block_fmt<Q5_1>(J, A, M, var, out, ldo);
    case Q8_0: return block_fmt<Q8_0>(J, A, M, var, out, ldo);
    case Q4_K: return block_fmt<Q4_K>(J, A, M, var, out, ldo);
    case Q5_K: return block_fmt<Q5_K>(J, A, M, var, out, ldo);
    case Q6_K: return block_fmt<Q6_K>(J, A, M, var, out, ldo);
    default: TORCH_CHECK(false, "qlinear: unsupported format id ", J.fmt);
  }
}

template <typename O>
void run_integer(const std::vector<Job>& jobs, const Acts& A, int64_t M, Variant var, O* out, int64_t ldo) {
  const int64_t NB = static_cast<int64_t>(jobs.size());
  const int64_t grain = std::clamp<int64_t>(NB / at::get_num_threads(), 1, 16);
  at::parallel_for(0, NB, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t i = c0; i < c1; ++i) block_any(jobs[i], A, M, var, out, ldo);
  });
}

// float32 chunks of at most 256 rows through torch's GEMM (x as float32)
void run_dense(const uint8_t* base, const Header& h, const at::Tensor& x, at::Tensor& out) {
  const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  constexpr int64_t kChunk = 256;
  at::Tensor w = at::empty({kChunk, h.K}, x.options().dtype(at::kFloat));
  for (int64_t n0 = 0; n0 < h.N; n0 += kChunk) {
    const int64_t n1 = std::min(h.N, n0 + kChunk);
    float* wp = w.mutable_data_ptr<float>();
    at::parallel_for(n0, n1, 8, [&](int64_t a, int64_t b) {
      for (int64_t n = a; n < b; ++n) dequant_row(base, h, n, wp + (n - n0) * h.K);
    });
    at::Tensor part = at::mm(xf, w.narrow(0, 0, n1 - n0).t());
    out.narrow(1, n0, n1 - n0).copy_(part);
  }
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& packed, c10::string_view variant, int64_t terms,
                   int64_t x2_rows, int64_t big_rows) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear: x must be a 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "qlinear: the weight must come from qpack");
  TORCH_CHECK(terms == 1 || terms == 2, "qlinear: terms must be 1 or 2, got ", terms);
  TORCH_CHECK(x2_rows >= 0 && big_rows >= 0, "qlinear: row thresholds must be >= 0");
  const Variant var = parse_variant(variant);
  const uint8_t* base = packed.const_data_ptr<uint8_t>();
  const Header h = read_header(base, packed.numel());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K == h.K, "qlinear: x has ", K, " features, the weight ", h.K);
  at::Tensor out = at::empty({M, h.N}, x.options());
  if (M == 0) return out;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const std::vector<Job> jobs = jobs_of(base, h);
  if (big_rows > 0 && M >= big_rows) {
#if defined(PARROT_PANEL)
    if (var == Variant::Vnni && x.scalar_type() == at::kBFloat16) {
      const int64_t NP = (static_cast<int64_t>(jobs.size()) + 1) / 2;  // panels
      const int64_t NG = (NP + kPanelsPerGroup - 1) / kPanelsPerGroup;
      const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
      c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
      at::parallel_for(0, NG, 1, [&](int64_t q0, int64_t q1) {
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t p0 = q * kPanelsPerGroup;
          panel_group(jobs, p0, std::min(kPanelsPerGroup, NP - p0), xp, xc.stride(0), M, K / 32, op, h.N);
        }
      });
      return out;
    }
#endif
    run_dense(base, h, xc, out);
    return out;
  }
  thread_local Acts A;
  const bool simd = var != Variant::Scalar;
  const int t = M <= x2_rows ? 2 : static_cast<int>(terms);
  if (x.scalar_type() == at::kFloat) quantize(xc.const_data_ptr<float>(), xc.stride(0), M, K, t, simd, A);
  else quantize(xc.const_data_ptr<c10::BFloat16>(), xc.stride(0), M, K, t, simd, A);
  if (x.scalar_type() == at::kFloat) run_integer(jobs, A, M, var, out.mutable_data_ptr<float>(), h.N);
  else run_integer(jobs, A, M, var, out.mutable_data_ptr<c10::BFloat16>(), h.N);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("qmm_variants() -> str[]", qmm_variants);
  m.def("qlinear(Tensor x, Tensor packed, str variant, int terms, int x2_rows, int big_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("qlinear", qlinear); }
