// Causal self-attention of a fresh prefill chunk (tokens 0..n-1 of one sequence attend to each other) on the
// CPU in bf16, as two VNNI GEMMs per KV head and query tile (vnni_block.h) with an fp32 softmax between:
//
//     S = Q_tile K^T      K packed as a GEMM weight: keys are output columns, head dims the reduction
//     P = softmax(scale * S) over keys <= the query's position (others 0), rounded to bf16
//     O = P V             V^T packed as a GEMM weight: head dims are output columns, keys the reduction
//
// Why: torch's CPU flash attention reaches ~70 GFLOP/s here on SmolLM2's shapes (512 tokens, 9 query / 3 KV heads
// of 64); the register-blocked VDPBF16PS GEMM runs at ~400. A tile only computes the key panels up to its last
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
  TORCH_CHECK(prefill_attention_available(), "causal_prefill: needs AVX512-BF16 (this CPU/build has none)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "causal_prefill: q, k, v must be [n, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16 && q.device().is_cpu(),
              "causal_prefill: bfloat16 CPU tensors only");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && v.size(1) == KVH && k.size(2) == D && v.size(2) == D,
              "causal_prefill: q, k, v shapes disagree");
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && D % 32 == 0, "causal_prefill: heads must group evenly, D % 32 == 0");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == D && k.stride(1) == D &&
                  v.stride(1) == D,
              "causal_prefill: each token's heads must be contiguous rows of D");
  at::Tensor out = at::empty({n, H * D}, q.options());
#if defined(__AVX512BF16__)
  if (n == 0) return out;
  const int64_t G = H / KVH, N32 = (n + 31) / 32 * 32, tiles = (n + kTile - 1) / kTile;
  // per KV head: K [N32, D] and V^T [D, N32] in the GEMM's weight layout, packed here element by element (the
  // torch view/permute of vnni::pack costs 0.4 ms per layer at 512 tokens, a quarter of the kernel)
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
  m.def("causal_prefill(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("causal_prefill", causal_prefill); }
