// Causal self-attention of a fresh prefill chunk (tokens 0..n-1 of one sequence attend to each other) on the
// CPU in bf16, as two VNNI GEMMs per KV head and query tile (vnni_block.h) with an fp32 softmax between:
//
//     S = Q_tile K^T      K packed as a GEMM weight: keys are output columns, head dims the reduction
//     P = softmax(scale * S) over keys <= the query's position (others 0), rounded to bf16
//     O = P V             V^T packed as a GEMM weight: head dims are output columns, keys the reduction
//
// Why: torch's CPU flash attention runs SmolLM2's shapes at a fraction of the register-blocked VDPBF16PS GEMM's
// rate (docs/results/README.md#kernel-design-measurements). A tile only computes the key panels up to its last
// query (causal), so the work is ~(n / 2 + kTile / 2) keys per query instead of n.
//
// Layouts: q [n, H, D], k / v [n, KVH, D] (last dim contiguous, token rows may be strided views of the fused
// qkv tensor), out [n, H * D] bf16. Query rows of a tile are ordered (token, head of this KV head):
// row = t * G + h, so all G query heads of a KV head share each pass over its packed K and V.
//
//     Kp[g] = K_g [N32, D] in vnni_block.h's packed layout     keys are the "output columns" of S = Q K^T
//     Vp[g] = V_g^T [D, N32] in that layout                    keys are the reduction of O = P V
//
// (N32 = n rounded up to 32; padded keys are zero and masked.) Work items: (KV head, query tile), ordered so
// each thread's contiguous share mixes cheap early tiles with expensive late ones.
//
// fp32 on AVX2 (the integer-dot CPU paths' models compute in fp32): the same tiles and masking, with the two
// products as register-blocked FMA micro-kernels (4 query rows x 16 lanes, 8 accumulators):
//
//     S = Q K^T      K^T [D, N16] per KV head: lanes are keys, a row's q[d] broadcast
//     O = P V        V [N16, D] (the input rows): lanes are head dims, a row's p[key] broadcast

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"
#include "vnni_block.h"

namespace {

bool prefill_attention_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool prefill_attention_fp32_available() {
#if defined(PARROT_AVX2)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#if defined(PARROT_AVX2)
namespace f32 {
namespace v2 = parrot_kernels::avx2;
constexpr int64_t kTile = 32;  // query tokens per work item

// c[4][16] (ldc) = a[4 rows][K] (lda) . b[K][16] (ldb): 4 x 2 accumulators, b rows as two vectors
template <int R>
inline void micro(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

// c[rows][cols] = a[rows][K] . b[K][cols], cols a multiple of 16
inline void gemm(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float* c, int64_t ldc,
                 int64_t rows, int64_t cols) {
  for (int64_t j = 0; j < cols; j += 16) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) micro<4>(a + r * lda, lda, b + j, ldb, K, c + r * ldc + j, ldc);
    for (; r < rows; ++r) micro<1>(a + r * lda, lda, b + j, ldb, K, c + r * ldc + j, ldc);
  }
}

struct Scratch {
  std::vector<float> q, s, o;
};

// one (KV head g, query tile [t0, t1)) item; kt = K_g^T [D, N16], vg = V_g [N16, D] (padding zero)
void tile(const float* q, int64_t sq, const float* kt, const float* vg, float* out, int64_t H, int64_t G, int64_t D,
          int64_t N16, int64_t g, int64_t t0, int64_t t1, float scale, Scratch& sc) {
  const int64_t rows = (t1 - t0) * G, keys = (t1 + 15) / 16 * 16;
  sc.q.resize(rows * D);
  sc.s.resize(rows * keys);
  sc.o.resize(rows * D);
  const __m256 vs = _mm256_set1_ps(scale);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; d += 8)  // the scale folded into q
        _mm256_storeu_ps(sc.q.data() + ((t - t0) * G + h) * D + d,
                         _mm256_mul_ps(_mm256_loadu_ps(q + t * sq + (g * G + h) * D + d), vs));
  gemm(sc.q.data(), D, kt, N16, D, sc.s.data(), keys, rows, keys);
  for (int64_t r = 0; r < rows; ++r)  // softmax over keys <= the row's token, zeros after
    v2::softmax_row(sc.s.data() + r * keys, t0 + r / G + 1, keys);
  gemm(sc.s.data(), keys, vg, D, keys, sc.o.data(), D, rows, D);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h)
      std::copy_n(sc.o.data() + ((t - t0) * G + h) * D, D, out + (t * H + g * G + h) * D);
}

void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1), G = H / KVH;
  const int64_t N16 = (n + 15) / 16 * 16, tiles = (n + kTile - 1) / kTile;
  std::vector<float> kt(KVH * D * N16, 0.f), vg(KVH * N16 * D, 0.f);
  const float* kd = k.const_data_ptr<float>();
  const float* vd = v.const_data_ptr<float>();
  at::parallel_for(0, KVH, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < n; ++c)
        for (int64_t d = 0; d < D; ++d) {
          kt[(g * D + d) * N16 + c] = kd[c * k.stride(0) + g * D + d];
          vg[(g * N16 + c) * D + d] = vd[c * v.stride(0) + g * D + d];
        }
  });
  const float* qd = q.const_data_ptr<float>();
  float* od = out.mutable_data_ptr<float>();
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t i0, int64_t i1) {
    Scratch sc;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i % KVH, j = i / KVH;
      const int64_t ti = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;  // 0, last, 1, last - 1, ...
      tile(qd, q.stride(0), kt.data() + g * D * N16, vg.data() + g * N16 * D, od, H, G, D, N16, g, ti * kTile,
           std::min(n, (ti + 1) * kTile), static_cast<float>(scale), sc);
    }
  });
}
}  // namespace f32
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kTile = 32;  // query tokens per work item

using bf16 = c10::BFloat16;

// Kp[g] and Vp[g] for KV head g (keys past n stay zero)
void pack_head(const bf16* k, const bf16* v, int64_t sk, int64_t sv, int64_t n, int64_t N32, int64_t D, int64_t g,
               bf16* kp, bf16* vp) {
  using parrot_kernels::vnni::packed_index;
  for (int64_t c = 0; c < n; ++c) {
    const bf16* kr = k + c * sk + g * D;
    const bf16* vr = v + c * sv + g * D;
    for (int64_t d = 0; d < D; ++d) {
      kp[packed_index(c, d, D / 32)] = kr[d];    // K_g [N32, D]
      vp[packed_index(d, c, N32 / 32)] = vr[d];  // V_g^T [D, N32]
    }
  }
}

struct Scratch {
  std::vector<bf16> q, p, o;
  std::vector<float> s;
};

// one (KV head g, query tile [t0, t1)) item
void tile(const bf16* q, int64_t sq, const bf16* kp, const bf16* vp, bf16* out, int64_t H, int64_t G, int64_t D,
          int64_t N32, int64_t g, int64_t t0, int64_t t1, float scale, Scratch& sc) {
  namespace vn = parrot_kernels::vnni;
  const int64_t rows = (t1 - t0) * G, keys = (t1 + 31) / 32 * 32, DB = D / 32;
  sc.q.resize(rows * D);
  sc.s.resize(rows * keys);
  sc.p.resize(rows * keys);
  sc.o.resize(rows * D);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h)
      std::copy_n(q + t * sq + (g * G + h) * D, D, sc.q.data() + ((t - t0) * G + h) * D);
  // S = Q K^T over the key panels this tile can see
  vn::panels<float>(sc.q.data(), D, kp, DB * 1024, DB, sc.s.data(), keys, rows, 0, keys / 32);
  // P = softmax(scale * S), keys > t masked; rows padded with zeros to whole panels
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t live = t0 + r / G + 1;  // keys 0..t
    float* sr = sc.s.data() + r * keys;
    bf16* pr = sc.p.data() + r * keys;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < live; c += 16) {
      const __mmask16 mk = live - c >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (live - c)) - 1);
      mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, sr + c));
    }
    const __m512 mm = _mm512_set1_ps(_mm512_reduce_max_ps(mv) * scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < keys; c += 16) {  // e^(scale * s - max) in place, 0 past the query
      const __mmask16 mk = static_cast<__mmask16>((1u << std::clamp<int64_t>(live - c, 0, 16)) - 1);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(mk, sr + c), vs, mm);
      const __m512 ex = _mm512_maskz_mov_ps(mk, parrot_kernels::exp512(x));
      sum = _mm512_add_ps(sum, ex);
      _mm512_storeu_ps(sr + c, ex);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t c = 0; c < keys; c += 16) parrot_kernels::store16(pr + c, _mm512_mul_ps(_mm512_loadu_ps(sr + c), inv));
  }
  // O = P V over the same keys (a prefix of every V^T panel's k-steps)
  vn::panels<bf16>(sc.p.data(), keys, vp, (N32 / 32) * 1024, keys / 32, sc.o.data(), D, rows, 0, DB);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t h = 0; h < G; ++h)
      std::copy_n(sc.o.data() + ((t - t0) * G + h) * D, D, out + (t * H + g * G + h) * D);
}
#endif

at::Tensor causal_prefill(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "causal_prefill: q, k, v must be [n, heads, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() && q.device().is_cpu() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "causal_prefill: bfloat16 or float32 CPU tensors of one dtype");
  const bool fp32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(fp32 || prefill_attention_available(), "causal_prefill: bfloat16 needs AVX512-BF16 (this CPU/build has none)");
  TORCH_CHECK(!fp32 || prefill_attention_fp32_available(), "causal_prefill: float32 needs AVX2 + FMA (this CPU/build has none)");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && v.size(1) == KVH && k.size(2) == D && v.size(2) == D,
              "causal_prefill: q, k, v shapes disagree");
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && D % 32 == 0, "causal_prefill: heads must group evenly, D % 32 == 0");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D &&
                  v.stride(1) == D,
              "causal_prefill: each token's heads must be contiguous rows of D");
  at::Tensor out = at::empty({n, H * D}, q.options());
  if (n == 0) return out;
#if defined(PARROT_AVX2)
  if (fp32) {
    f32::run(q, k, v, scale, out);
    return out;
  }
#endif
#if defined(__AVX512BF16__)
  const int64_t G = H / KVH, N32 = (n + 31) / 32 * 32, tiles = (n + kTile - 1) / kTile;
  // per KV head: K [N32, D] and V^T [D, N32] in the GEMM's weight layout, packed here element by element (the
  // torch view/permute of vnni::pack cost a quarter of the kernel: docs/results/README.md)
  at::Tensor kp = at::zeros({KVH, N32 * D}, q.options());
  at::Tensor vp = at::zeros({KVH, N32 * D}, q.options());
  const bf16* qd = q.const_data_ptr<bf16>();
  const bf16* kd = k.const_data_ptr<bf16>();
  const bf16* vd = v.const_data_ptr<bf16>();
  bf16* kpd = kp.mutable_data_ptr<bf16>();
  bf16* vpd = vp.mutable_data_ptr<bf16>();
  bf16* od = out.mutable_data_ptr<bf16>();
  at::parallel_for(0, KVH, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      pack_head(kd, vd, k.stride(0), v.stride(0), n, N32, D, g, kpd + g * N32 * D, vpd + g * N32 * D);
  });
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t i0, int64_t i1) {
    Scratch sc;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i % KVH, j = i / KVH;
      const int64_t ti = j % 2 == 0 ? j / 2 : tiles - 1 - j / 2;  // 0, last, 1, last - 1, ...
      tile(qd, q.stride(0), kpd + g * N32 * D, vpd + g * N32 * D, od, H, G, D, N32, g, ti * kTile,
           std::min(n, (ti + 1) * kTile), static_cast<float>(scale), sc);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("prefill_attention_available() -> bool", prefill_attention_available);
  m.def("prefill_attention_fp32_available() -> bool", prefill_attention_fp32_available);
  m.def("causal_prefill(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("causal_prefill", causal_prefill); }
