// Weight-only int4 GEMM for decode batches of 1-8 rows: out[M, N] = x[M, K] @ W[N, K]^T with bf16 activations,
// weights in GGUF Q4_1's own form (groups of 32 input features of one output row):
//
//     W[n][32 g + j] = d[n][g] * q[n][32 g + j] + m[n][g],     q in [0, 15],  d and m fp16 (as in the file)
//
// Why: a one-row decode step streams every weight once and does ~1 multiply per byte; the whole step is the
// weight read. torch's _weight_int4pack_mm_for_cpu reads well below the machine's bandwidth on SmolLM2's layers
// (docs/results/README.md#kernel-design-measurements); this kernel's weights are one forward stream per thread,
// decoded with a handful of integer ops per 64 bytes.
//
// Packed layout (int4_pack), N % 16 == 0, K % 32 == 0: [N/16 panels][K/32 groups][320 bytes]
//
//     bytes   0..255   the codes of one panel (16 output rows) x one group (32 inputs), 4 chunks of 64 bytes;
//     bytes 256..287   d of the 16 rows (fp16);   bytes 288..319  m of the 16 rows (fp16)
//
// A chunk c holds k pairs r = 4c .. 4c+3 (inputs 32 g + 2 r + i, i < 2). Decoding a chunk: L = low nibbles,
// H = high nibbles (one AND, one shift + AND); each interleaved with the constant byte 0x43 (unpacklo/hi_epi8,
// per 128-bit lane) gives 32 16-bit words 0x43qq, which read as bf16 are exactly 128 + q. The four word vectors
//
//     unpacklo(L) -> r = 4c    unpackhi(L) -> r = 4c+1    unpacklo(H) -> r = 4c+2    unpackhi(H) -> r = 4c+3
//
// hold in word w = 8 * lane + p the code of output row w / 2, input 32 g + 2 r + w % 2: the VNNI pair order of
// vnni_gemm.cpp, so VDPBF16PS with the broadcast pair (x[2r], x[2r+1]) adds both products to row w / 2's lane.
// Byte b of a chunk (lane = b / 16, half = b % 16 / 8, p = b % 8) thus carries the code for word 8 lane + p of
// vector `half` in its low nibble and of vector 2 + half in its high nibble (int4_pack writes exactly that).
//
// Per group and row: acc = sum_j x_j (128 + q_j) in fp32, so out += d * (acc - 128 * xs) + m * xs with
// xs = sum_j x_j over the group (the bf16 x values the dot products saw, summed once per call).
//
// Planes: a weight may be the sum of P such int4 weights, stored side by side per group ([N/16][K/32][P x 320]),
// all accumulated in fp32 before the one bf16 rounding of the output. Two planes hold GGUF Q8_0 exactly
// (layers/int4.py: W = d q, q in [-127, 127]; with u = q + 128 = 16 hi + lo, W = (16 d) hi - 128 d + d lo).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "simd.h"
#endif

namespace {

constexpr int64_t kGroupBytes = 320;  // 256 code bytes + 16 fp16 d + 16 fp16 m
constexpr int kMaxRows = 8;           // rows per call the kernel takes (more rows: the bf16 kernels win)

// byte b of a chunk: which (row, k-pair offset, i) its low nibble encodes; the high nibble is the same row and
// i at k-pair offset + 2
struct Slot {
  int row, pair, i;
};
inline Slot slot_of(int b) {
  const int lane = b / 16, half = b % 16 / 8, w = 8 * lane + b % 8;
  return {w / 2, half, w % 2};
}

#if defined(__AVX512BF16__)
// rows [0, M) x panels [p0, p1) over P planes; xs: M x K/32 group sums of x
template <int M>
void panels(const c10::BFloat16* x, int64_t ldx, const uint8_t* w, int64_t KG, int64_t P, const float* xs,
            c10::BFloat16* out, int64_t ldo, int64_t p0, int64_t p1) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), hi_byte = _mm512_set1_epi8(0x43);
  const __m512 c128 = _mm512_set1_ps(128.0f);
  const int64_t group_bytes = P * kGroupBytes;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * KG * group_bytes;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < KG; ++g) {
      const c10::BFloat16* xg = x + g * 32;
      for (int64_t pl = 0; pl < P; ++pl) {
        const uint8_t* blk = wp + g * group_bytes + pl * kGroupBytes;
        // the stream 2 KB ahead into L2 (5 lines per plane; past this thread's last panel it is harmless)
        for (int c = 0; c < kGroupBytes; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk) + 2048 + c, _MM_HINT_T1);
        __m512 ag[M];
        for (int m = 0; m < M; ++m) ag[m] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512i bytes = _mm512_loadu_si512(blk + 64 * c);
          const __m512i lo = _mm512_and_si512(bytes, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
          const __m512i v[4] = {_mm512_unpacklo_epi8(lo, hi_byte), _mm512_unpackhi_epi8(lo, hi_byte),
                                _mm512_unpacklo_epi8(hi, hi_byte), _mm512_unpackhi_epi8(hi, hi_byte)};
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j) {
            const int r = 4 * c + j;
            for (int m = 0; m < M; ++m) {
              int32_t pair;
              std::memcpy(&pair, xg + m * ldx + 2 * r, sizeof pair);
              ag[m] = _mm512_dpbf16_ps(ag[m], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)),
                                       reinterpret_cast<__m512bh>(v[j]));
            }
          }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
        const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
        for (int m = 0; m < M; ++m) {
          const __m512 s = _mm512_set1_ps(xs[m * KG + g]);
          acc[m] = _mm512_fmadd_ps(d, _mm512_fnmadd_ps(c128, s, ag[m]), acc[m]);
          acc[m] = _mm512_fmadd_ps(mn, s, acc[m]);
        }
      }
    }
    for (int m = 0; m < M; ++m) parrot_kernels::store16(out + m * ldo + p * 16, acc[m]);
  }
}

using PanelFn = void (*)(const c10::BFloat16*, int64_t, const uint8_t*, int64_t, int64_t, const float*,
                         c10::BFloat16*, int64_t, int64_t, int64_t);
template <int... R>
constexpr std::array<PanelFn, sizeof...(R)> make_panels(std::integer_sequence<int, R...>) {
  return {&panels<R + 1>...};
}
constexpr auto kPanels = make_panels(std::make_integer_sequence<int, kMaxRows>{});
#endif

bool int4_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// codes uint8 [P, N, K] (0..15), d / m float [P, N, K/32] (or [N, K] / [N, K/32] for one plane) -> the packed
// layout above, the P planes of a group side by side
at::Tensor int4_pack(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK((codes.dim() == 2 || codes.dim() == 3) && codes.scalar_type() == at::kByte,
              "int4_pack: codes must be a uint8 [N, K] or [planes, N, K] tensor");
  const at::Tensor cc = (codes.dim() == 2 ? codes.unsqueeze(0) : codes).contiguous();
  const at::Tensor dc = (d.dim() == 2 ? d.unsqueeze(0) : d).contiguous();
  const at::Tensor mc = (m.dim() == 2 ? m.unsqueeze(0) : m).contiguous();
  const int64_t P = cc.size(0), N = cc.size(1), K = cc.size(2), KG = K / 32;
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "int4_pack: N must be a multiple of 16 and K of 32, got ", N, " x ", K);
  TORCH_CHECK(dc.scalar_type() == at::kFloat && mc.scalar_type() == at::kFloat && dc.dim() == 3 && mc.dim() == 3 &&
                  dc.sizes() == mc.sizes() && dc.size(0) == P && dc.size(1) == N && dc.size(2) == KG,
              "int4_pack: d and m must be float [N, K/32] (one per plane)");
  const uint8_t* q = cc.const_data_ptr<uint8_t>();
  const float* dp = dc.const_data_ptr<float>();
  const float* mp = mc.const_data_ptr<float>();
  for (int64_t i = 0; i < P * N * K; ++i) TORCH_CHECK(q[i] < 16, "int4_pack: codes must lie in [0, 15]");
  at::Tensor out = at::empty({N / 16, KG, P * kGroupBytes}, codes.options());
  uint8_t* o = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t g = 0; g < KG; ++g)
        for (int64_t pl = 0; pl < P; ++pl) {
          uint8_t* blk = o + ((p * KG + g) * P + pl) * kGroupBytes;
          const uint8_t* qp = q + pl * N * K;
          for (int c = 0; c < 4; ++c)
            for (int b = 0; b < 64; ++b) {
              const Slot s = slot_of(b);
              const int64_t row = (16 * p + s.row) * K, k = 32 * g + 2 * (4 * c + s.pair) + s.i;
              blk[64 * c + b] = static_cast<uint8_t>(qp[row + k] | (qp[row + k + 4] << 4));  // +4: pair offset + 2
            }
          auto* dh = reinterpret_cast<c10::Half*>(blk + 256);
          auto* mh = reinterpret_cast<c10::Half*>(blk + 288);
          for (int r = 0; r < 16; ++r) {
            dh[r] = c10::Half(dp[(pl * N + 16 * p + r) * KG + g]);
            mh[r] = c10::Half(mp[(pl * N + 16 * p + r) * KG + g]);
          }
        }
  });
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(int4_available(), "int4_linear: needs a CPU with AVX512-BF16 (and a build for it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "int4_linear: x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) > 0 && packed.size(2) % kGroupBytes == 0,
              "int4_linear: weight must come from int4_pack");
  const int64_t M = x.size(0), K = x.size(1), KG = packed.size(1), N = packed.size(0) * 16;
  const int64_t P = packed.size(2) / kGroupBytes;
  TORCH_CHECK(KG * 32 == K, "int4_linear: x has ", K, " features, the weight ", KG * 32);
  TORCH_CHECK(M <= kMaxRows, "int4_linear: at most ", kMaxRows, " rows, got ", M);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(__AVX512BF16__)
  const at::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  const int64_t ldx = xc.stride(0);
  std::vector<float> xs(M * KG);  // group sums of the bf16 inputs
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < KG; ++g) {
      __m512 s = _mm512_add_ps(parrot_kernels::load16(xp + m * ldx + 32 * g),
                               parrot_kernels::load16(xp + m * ldx + 32 * g + 16));
      xs[m * KG + g] = _mm512_reduce_add_ps(s);
    }
  const uint8_t* wp = packed.const_data_ptr<uint8_t>();
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  const PanelFn fn = kPanels[M - 1];
  at::parallel_for(0, N / 16, 1, [&](int64_t p0, int64_t p1) { fn(xp, ldx, wp, KG, P, xs.data(), op, N, p0, p1); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("int4_available() -> bool", int4_available);
  m.def("int4_pack(Tensor codes, Tensor d, Tensor m) -> Tensor", int4_pack);
  m.def("int4_linear(Tensor x, Tensor packed) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("int4_linear", int4_linear); }
