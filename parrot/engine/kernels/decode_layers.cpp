// All LLaMA decoder layers for a batch of decode rows, in one call. Per layer the same steps, in the same order
// and on the same kernels, as LlamaDecoderLayer.forward_fused with the native ops (parrot/engine/models/llama.py):
//
//     qkv = linear(x, qkv_w)                                  [T, (H + 2 KVH) D]   q | k | v
//     qk  = rope(qkv[:, :(H + KVH) D], rot)                   [T, H + KVH, D]
//     k_cache[slot[t]] = qk[t, H:];  v_cache[slot[t]] = v[t]  (the new tokens' K/V, before attending)
//     a   = paged_decode(qk[:, :H], caches, tables, lens)     [T, H, D]
//     x2  = add_rms_norm_cast(h, linear(a, o_w), post_norm)   h += o, x2 = norm(h)
//     out = add_rms_norm_cast(h, linear(silu_mul(linear(x2, gate_up_w)), down_w), next_norm)
//
// Why: at one to a few dozen rows every step above is a few microseconds of kernel, and going through Python
// for each (module calls, row-count dispatch, the op wrappers, views) costs as much again as the kernels (figures:
// docs/results/README.md#kernel-design-measurements). Here the kernels are called through the dispatcher from C++,
// one Python call per step.
//
// linear(x, w) runs the kernel the packed weight belongs to: a uint8 vector (qpack.cpp) = qlinear (qmm.cpp) on
// ``qmm_variant`` with ``act_terms`` / ``x2_rows``, bf16 [N/32, K/32, 2, 16, 16, 2] = vnni_linear on
// ``vnni_backend`` (vnni_gemm.cpp): the same calls with the same settings as the per-op path (Linear.native_call),
// so the results are the same.
//
// The compute dtype (x, h's updates, the matmul outputs) is bfloat16 or float32; the KV caches may be stored in
// another dtype (float32, bfloat16 or float16: the new rows are converted as they are written).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)> vnni_linear =
      op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view)>("parrot_kernels::vnni_linear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, int64_t,
                                      int64_t)>
      qlinear = op<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, int64_t, int64_t)>(
          "parrot_kernels::qlinear");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)> rope =
      op<at::Tensor(const at::Tensor&, const at::Tensor&)>("parrot_kernels::rope");
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
      op<at::Tensor(const at::Tensor&)>("parrot_kernels::silu_mul");
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::ScalarType)>
      add_rms_norm_cast = op<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::ScalarType)>(
          "parrot_kernels::add_rms_norm_cast");
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const at::Tensor&, double, bool)>
      paged_decode = op<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const at::Tensor&, double, bool)>(
          "parrot_kernels::paged_decode");
};

const Ops& ops() {
  static const Ops o;  // looked up once, after every op of the library is registered
  return o;
}

// the settings of the two matmul kernels a model's layers run
struct Kernels {
  c10::string_view qmm_variant;
  int64_t terms, x2_rows;
  c10::string_view vnni_backend;
};

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const Kernels& k) {
  if (w.scalar_type() == at::kByte && w.dim() == 1) return ops().qlinear.call(x, w, k.qmm_variant, k.terms, k.x2_rows, 0);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 6,
              "decode_layers: a weight must be qpack'ed (uint8) or vnni_pack'ed (bfloat16)");
  return ops().vnni_linear.call(x, w, k.vnni_backend);
}

// k_cache[slot[t]] = k[t] (rows of KVH * D elements; k / v may be row-strided views), converted to the cache's dtype
template <typename S, typename C>
void write_rows_as(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t T) {
  const int64_t row = cache.size(2) * cache.size(3), nslots = cache.size(0) * cache.size(1);
  C* dst = cache.mutable_data_ptr<C>();
  const S* s = src.const_data_ptr<S>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < nslots, "decode_layers: slot ", slots[t], " outside the KV pool");
    if constexpr (std::is_same_v<S, C>) {
      std::memcpy(dst + slots[t] * row, s + t * src.stride(0), row * sizeof(C));
    } else {
      for (int64_t i = 0; i < row; ++i) dst[slots[t] * row + i] = static_cast<C>(static_cast<float>(s[t * src.stride(0) + i]));
    }
  }
}

template <typename S>
void write_rows_from(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t T) {
  switch (cache.scalar_type()) {
    case at::kFloat: write_rows_as<S, float>(cache, src, slots, T); break;
    case at::kBFloat16: write_rows_as<S, c10::BFloat16>(cache, src, slots, T); break;
    case at::kHalf: write_rows_as<S, c10::Half>(cache, src, slots, T); break;
    default: TORCH_CHECK(false, "decode_layers: caches must be float32, bfloat16 or float16");
  }
}

void write_rows(at::Tensor& cache, const at::Tensor& src, const int64_t* slots, int64_t T) {
  if (src.scalar_type() == at::kFloat) write_rows_from<float>(cache, src, slots, T);
  else write_rows_from<c10::BFloat16>(cache, src, slots, T);
}

at::Tensor layer(at::Tensor& h, const at::Tensor& x, const at::Tensor& rot, const at::Tensor& qkv_w,
                 const at::Tensor& o_w, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                 const at::Tensor& post_norm, const at::Tensor& next_norm, double eps, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lens,
                 double scale, int64_t H, const Kernels& kern) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.is_contiguous(),
              "decode_layers: caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  const at::ScalarType dtype = x.scalar_type();
  const int64_t T = x.size(0), KVH = k_cache.size(2), D = k_cache.size(3);
  const at::Tensor qkv = linear(x, qkv_w, kern);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D, "decode_layers: qkv has ", qkv.size(1), " columns, expected ",
              (H + 2 * KVH) * D);
  const at::Tensor qk = ops().rope.call(qkv.narrow(1, 0, (H + KVH) * D).view({T, H + KVH, D}), rot);
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  write_rows(k_cache, qk.narrow(1, H, KVH), sp, T);
  write_rows(v_cache, qkv.narrow(1, (H + KVH) * D, KVH * D), sp, T);
  const at::Tensor attn = std::get<0>(ops().paged_decode.call(qk.narrow(1, 0, H), k_cache, v_cache, tables, lens,
                                                               scale, false));
  const at::Tensor x2 =
      ops().add_rms_norm_cast.call(h, linear(attn.view({T, H * D}), o_w, kern), post_norm, eps, dtype);
  const at::Tensor mlp =
      linear(ops().silu_mul.call(linear(x2, gate_up_w, kern)), down_w, kern);
  return ops().add_rms_norm_cast.call(h, mlp, next_norm, eps, dtype);
}

// layers [0, L): weights, norms and caches are per-layer lists (next_norms[i] = the norm after layer i: layer
// i + 1's input norm, the final norm for the last); returns the last layer's output
at::Tensor decode_layers(at::Tensor& h, const at::Tensor& x, const at::Tensor& rot, at::TensorList qkv_w,
                         at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
                         at::TensorList post_norms, at::TensorList next_norms, double eps, at::TensorList k_caches,
                         at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& tables,
                         const at::Tensor& lens, double scale, int64_t num_heads, c10::string_view qmm_variant,
                         int64_t act_terms, int64_t x2_rows, c10::string_view vnni_backend) {
  const Kernels kern{qmm_variant, act_terms, x2_rows, vnni_backend};
  const size_t L = qkv_w.size();
  TORCH_CHECK(o_w.size() == L && gate_up_w.size() == L && down_w.size() == L && post_norms.size() == L &&
                  next_norms.size() == L && k_caches.size() == L && v_caches.size() == L,
              "decode_layers: every per-layer list must have one entry per layer");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "decode_layers: x must be a bfloat16 or float32 [T, hidden]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == x.size(0),
              "decode_layers: slots must be int64 [T]");
  at::Tensor out = x;
  for (size_t i = 0; i < L; ++i) {
    at::Tensor kc = k_caches[i], vc = v_caches[i];
    out = layer(h, out, rot, qkv_w[i], o_w[i], gate_up_w[i], down_w[i], post_norms[i], next_norms[i], eps, kc, vc,
                slots, tables, lens, scale, num_heads, kern);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("decode_layers(Tensor(a!) h, Tensor x, Tensor rot, Tensor[] qkv_w, Tensor[] o_w, Tensor[] gate_up_w, "
        "Tensor[] down_w, Tensor[] post_norms, Tensor[] next_norms, float eps, Tensor(b!)[] k_caches, "
        "Tensor(c!)[] v_caches, Tensor slots, Tensor tables, Tensor lens, float scale, int num_heads, "
        "str qmm_variant, int act_terms, int x2_rows, str vnni_backend) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("decode_layers", decode_layers); }
