// Fused elementwise ops of the LLaMA decoder layer on the CPU (one pass over each row instead of torch's chain of
// pow / mean / add / rsqrt / mul / copy kernels, each of which reads and writes the whole tensor):
//
//     rms_norm_cast(x, w, eps, dtype)            out = x * rsqrt(mean(x^2) + eps) * w, cast to dtype
//     add_rms_norm_cast(h, delta, w, eps, dtype) h += delta (in place), then out = rms_norm(h) in dtype
//     silu_mul(gate_up)                          [T, 2I] -> [T, I]: silu(gate_up[:, :I]) * gate_up[:, I:]
//     rope(x, rot)                               x [T, heads, D] (rows may be strided) rotated pairwise by rot,
//                                                complex [T, 1, D/2]: (x0 + i x1) * (cos + i sin) -> new contiguous
//
// x / h / w are float32 (the model's residual stream and norm weights), delta / gate_up and the outputs are
// bfloat16 or float32. All math is float32; bf16 results are rounded to nearest even exactly as torch's
// conversion rounds (NaN -> quiet NaN), so they match the torch path to within one bf16 rounding of the fp32
// intermediate. Rows are spread over torch's intra-op pool only when a call has enough of them to pay for the
// fork (a decode step's 16-64 rows run on the calling thread).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/complex.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"

namespace {

constexpr int64_t kParallelElems = 1 << 16;  // elements per task below which a call stays on one thread

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

#if defined(__AVX512F__)
using parrot_kernels::exp512;
using parrot_kernels::load16;
using parrot_kernels::store16;
#elif defined(PARROT_AVX2)
using parrot_kernels::avx2::exp256;
using parrot_kernels::avx2::hsum8;
using parrot_kernels::avx2::load8;
using parrot_kernels::avx2::store8;
#endif

// out[0, n) = x * inv * w
template <typename O>
void scale_row(const float* x, const float* w, float inv, int64_t n, O* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  for (; i + 16 <= n; i += 16) store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), iv), load16(w + i)));
#elif defined(PARROT_AVX2)
  const __m256 iv = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8) store8(out + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), iv), load8(w + i)));
#endif
  for (; i < n; ++i) out[i] = from_f<O>(x[i] * inv * w[i]);
}

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m512 u = load16(x + i), v = load16(x + i + 16);
    a = _mm512_fmadd_ps(u, u, a);
    b = _mm512_fmadd_ps(v, v, b);
  }
  for (; i + 16 <= n; i += 16) { const __m512 u = load16(x + i); a = _mm512_fmadd_ps(u, u, a); }
  s = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#elif defined(PARROT_AVX2)
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 u = load8(x + i), v = load8(x + i + 8);
    a = _mm256_fmadd_ps(u, u, a);
    b = _mm256_fmadd_ps(v, v, b);
  }
  for (; i + 8 <= n; i += 8) { const __m256 u = load8(x + i); a = _mm256_fmadd_ps(u, u, a); }
  s = hsum8(_mm256_add_ps(a, b));
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// h[0, n) += d, in place
template <typename D>
void add_row(float* h, const D* d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(h + i, _mm512_add_ps(load16(h + i), load16(d + i)));
#elif defined(PARROT_AVX2)
  for (; i + 8 <= n; i += 8) store8(h + i, _mm256_add_ps(load8(h + i), load8(d + i)));
#endif
  for (; i < n; ++i) h[i] += to_f(d[i]);
}

template <typename O>
void silu_mul_row(const O* g, const O* u, int64_t n, O* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(g + i);
    // x / (1 + e^-x) with the reciprocal from rcp14 and one Newton step (relative error ~2^-28; a divide
    // would cost more than the rest of the loop). Below x = -87 silu(x) < 1e-35: -0, as torch's e^-x overflows
    const __m512 d = _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    __m512 s = _mm512_mul_ps(x, r);
    s = _mm512_mask_mul_ps(s, _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), x, _mm512_setzero_ps());
    store16(out + i, _mm512_mul_ps(s, load16(u + i)));
  }
#elif defined(PARROT_AVX2)
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = load8(g + i);
    // as above, with rcp (12 bits) and one Newton step (~2^-23)
    const __m256 d = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)));
    __m256 r = _mm256_rcp_ps(d);
    r = _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, two));
    __m256 s = _mm256_mul_ps(x, r);
    s = _mm256_blendv_ps(s, _mm256_mul_ps(x, _mm256_setzero_ps()), _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
    store8(out + i, _mm256_mul_ps(s, load8(u + i)));
  }
#endif
  for (; i < n; ++i) {
    const float x = to_f(g[i]);
    out[i] = from_f<O>(x / (1.0f + std::exp(-x)) * to_f(u[i]));
  }
}

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kParallelElems / std::max<int64_t>(cols, 1)); }

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, op,
              ": x must be a float32 [T, H] tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(0) == x.size(1), op,
              ": weight must be a contiguous float32 [H]");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, op, ": dtype must be bfloat16 or float32");
}

template <typename O>
inline void norm_row(const float* x, const float* w, float eps, int64_t H, O* out) {
  scale_row(x, w, 1.0f / std::sqrt(sum_squares(x, H) / static_cast<float>(H) + eps), H, out);
}

template <typename O>
void norm_rows(const float* x, int64_t ldx, const float* w, float eps, int64_t T, int64_t H, O* out) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(x + r * ldx, w, eps, H, out + r * H);
  });
}

// h += delta, then out = rms_norm(h), row by row (the row is still in L1 for the norm)
template <typename O, typename D>
void add_norm_rows(float* h, int64_t ldh, const D* delta, int64_t ldd, const float* w, float eps, int64_t T,
                   int64_t H, O* out) {
  at::parallel_for(0, T, grain_rows(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      add_row(h + r * ldh, delta + r * ldd, H);
      norm_row(h + r * ldh, w, eps, H, out + r * H);
    }
  });
}

at::Tensor rms_norm_cast(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType dtype) {
  check_norm_args("rms_norm_cast", x, w, dtype);
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options().dtype(dtype));
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (dtype == at::kBFloat16) norm_rows(xp, x.stride(0), wp, e, T, H, out.mutable_data_ptr<c10::BFloat16>());
  else norm_rows(xp, x.stride(0), wp, e, T, H, out.mutable_data_ptr<float>());
  return out;
}

template <typename D>
void add_norm_dispatch(at::Tensor& out, at::Tensor& h, const D* delta, int64_t ldd, const float* w, float eps) {
  float* hp = h.mutable_data_ptr<float>();
  const int64_t T = h.size(0), H = h.size(1);
  if (out.scalar_type() == at::kBFloat16)
    add_norm_rows(hp, h.stride(0), delta, ldd, w, eps, T, H, out.mutable_data_ptr<c10::BFloat16>());
  else
    add_norm_rows(hp, h.stride(0), delta, ldd, w, eps, T, H, out.mutable_data_ptr<float>());
}

at::Tensor add_rms_norm_cast(at::Tensor& h, const at::Tensor& delta, const at::Tensor& w, double eps,
                             at::ScalarType dtype) {
  check_norm_args("add_rms_norm_cast", h, w, dtype);
  TORCH_CHECK(delta.device().is_cpu() && delta.dim() == 2 && delta.size(0) == h.size(0) &&
                  delta.size(1) == h.size(1) && delta.stride(1) == 1,
              "add_rms_norm_cast: delta must be a [T, H] CPU tensor with contiguous rows, like h");
  at::Tensor out = at::empty({h.size(0), h.size(1)}, h.options().dtype(dtype));
  const float* wp = w.const_data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (delta.scalar_type() == at::kBFloat16)
    add_norm_dispatch(out, h, delta.const_data_ptr<c10::BFloat16>(), delta.stride(0), wp, e);
  else if (delta.scalar_type() == at::kFloat)
    add_norm_dispatch(out, h, delta.const_data_ptr<float>(), delta.stride(0), wp, e);
  else
    TORCH_CHECK(false, "add_rms_norm_cast: delta must be bfloat16 or float32");
  return out;
}

template <typename O>
void silu_mul_rows(const O* gu, int64_t ld, int64_t T, int64_t I, O* out) {
  at::parallel_for(0, T, grain_rows(I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gu + r * ld, gu + r * ld + I, I, out + r * I);
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a [T, 2I] CPU tensor with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16)
    silu_mul_rows(gate_up.const_data_ptr<c10::BFloat16>(), gate_up.stride(0), T, I,
                  out.mutable_data_ptr<c10::BFloat16>());
  else if (gate_up.scalar_type() == at::kFloat)
    silu_mul_rows(gate_up.const_data_ptr<float>(), gate_up.stride(0), T, I, out.mutable_data_ptr<float>());
  else
    TORCH_CHECK(false, "silu_mul: bfloat16 or float32 only");
  return out;
}

// ---- RoPE -----------------------------------------------------------------------------------------------------
// x's last dim holds D/2 (re, im) pairs; rot row t holds D/2 (cos, sin) float pairs shared by all heads:
//     out[2i] = x[2i] cos_i - x[2i+1] sin_i,    out[2i+1] = x[2i+1] cos_i + x[2i] sin_i
template <typename T>
void rope_row(const T* x, const float* cs, int64_t D, T* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16) {  // 8 pairs: duplicate cos / sin into both lanes of a pair, swap x's pairs
    const __m512 v = load16(x + d), r = _mm512_loadu_ps(cs + d);
    const __m512 c = _mm512_moveldup_ps(r), sn = _mm512_movehdup_ps(r);
    const __m512 sw = _mm512_permute_ps(v, 0xB1);
    store16(out + d, _mm512_fmaddsub_ps(v, c, _mm512_mul_ps(sw, sn)));  // even lanes: -, odd lanes: +
  }
#elif defined(PARROT_AVX2)
  for (; d + 8 <= D; d += 8) {  // 4 pairs, as above
    const __m256 v = load8(x + d), r = _mm256_loadu_ps(cs + d);
    const __m256 c = _mm256_moveldup_ps(r), sn = _mm256_movehdup_ps(r);
    const __m256 sw = _mm256_permute_ps(v, 0xB1);
    store8(out + d, _mm256_fmaddsub_ps(v, c, _mm256_mul_ps(sw, sn)));
  }
#endif
  for (; d < D; d += 2) {
    const float a = to_f(x[d]), b = to_f(x[d + 1]), c = cs[d], sn = cs[d + 1];
    out[d] = from_f<T>(a * c - b * sn);
    out[d + 1] = from_f<T>(b * c + a * sn);
  }
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& rot) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope: x must be a [T, heads, D] CPU tensor with contiguous last dim and even D");
  TORCH_CHECK(rot.scalar_type() == at::kComplexFloat && rot.dim() == 3 && rot.size(0) == x.size(0) &&
                  rot.size(1) == 1 && rot.size(2) * 2 == x.size(2),
              "rope: rot must be complex64 [T, 1, D/2] for x of shape ", x.sizes());
  const at::Tensor cs = rot.contiguous();  // complex64 = (re, im) float pairs: [T, D/2, 2] floats
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  at::Tensor out = at::empty({T, H, D}, x.options());
  auto run = [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    const S* xp = x.const_data_ptr<S>();
    S* op = out.mutable_data_ptr<S>();
    const float* cp = reinterpret_cast<const float*>(cs.const_data_ptr<c10::complex<float>>());
    at::parallel_for(0, T, grain_rows(H * D), [&](int64_t r0, int64_t r1) {
      for (int64_t t = r0; t < r1; ++t)
        for (int64_t h = 0; h < H; ++h)
          rope_row(xp + t * x.stride(0) + h * x.stride(1), cp + t * D, D, op + (t * H + h) * D);
    });
  };
  if (x.scalar_type() == at::kBFloat16)
    run(static_cast<c10::BFloat16*>(nullptr));
  else if (x.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr));
  else
    TORCH_CHECK(false, "rope: bfloat16 or float32 only");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("rms_norm_cast(Tensor x, Tensor weight, float eps, ScalarType dtype) -> Tensor");
  m.def("add_rms_norm_cast(Tensor(a!) h, Tensor delta, Tensor weight, float eps, ScalarType dtype) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope(Tensor x, Tensor rot) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) {
  m.impl("rms_norm_cast", rms_norm_cast);
  m.impl("add_rms_norm_cast", add_rms_norm_cast);
  m.impl("silu_mul", silu_mul);
  m.impl("rope", rope);
}
