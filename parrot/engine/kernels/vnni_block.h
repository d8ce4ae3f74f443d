// The AVX512-BF16 register block of the VNNI GEMM, shared by vnni_gemm.cpp (decode matmuls) and
// prefill_attention.cpp (Q K^T and P V on packed K / V^T). Weight layout: vnni_gemm.cpp's comment.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace parrot_kernels::vnni {

// a bf16 [N, K] weight (N, K multiples of 32; any strides) in the packed layout [N/32, K/32, 2, 16, 16, 2]:
// [N, K] -> [n, j, c, kb, r, i] -> [n, kb, j, r, c, i]
inline at::Tensor pack(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1);
  return w.contiguous().view({N / 32, 2, 16, K / 32, 16, 2}).permute({0, 3, 1, 4, 2, 5}).contiguous();
}

// where W[n][k] of a weight with KB = K / 32 k-steps lands in that layout (for packing element by element)
inline int64_t packed_index(int64_t n, int64_t k, int64_t KB) {
  return ((((n / 32) * KB + k / 32) * 2 + (n % 32) / 16) * 16 + (k % 32) / 2) * 32 + (n % 16) * 2 + k % 2;
}

}  // namespace parrot_kernels::vnni

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace parrot_kernels::vnni {

constexpr int64_t kPrefetch = 4;  // k-steps (2 KB each) ahead
constexpr int kMaxRows = 12;      // rows per register block: 2 accumulators per row + 2 weight rows + 1 x pair

inline void prefetch_step(const c10::BFloat16* b) {
  const char* c = reinterpret_cast<const char*>(b);
  for (int i = 0; i < 2048; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}
inline void prefetch_step_l2(const c10::BFloat16* b) {
  const char* c = reinterpret_cast<const char*>(b);
  for (int i = 0; i < 2048; i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// 32 fp32 (lo: columns 0-15, hi: 16-31) -> 32 outputs at out (bf16: round to nearest even)
inline void store32(c10::BFloat16* out, __m512 lo, __m512 hi) {
  __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
  _mm512_storeu_si512(reinterpret_cast<void*>(out), reinterpret_cast<__m512i&>(v));
}
inline void store32(float* out, __m512 lo, __m512 hi) {
  _mm512_storeu_ps(out, lo);
  _mm512_storeu_ps(out + 16, hi);
}

// one k-step (32 inputs) of one panel (32 output columns, the k-step's two 1 KB blocks at b) for MR rows of x
// (xk: row 0's 32 inputs, rows ldx apart) into the accumulators c0 (columns 0-15) and c1 (16-31)
template <int MR>
inline void kstep(__m512* c0, __m512* c1, const c10::BFloat16* xk, int64_t ldx, const c10::BFloat16* b) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + r * 32));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 512 + r * 32));
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      int32_t pair;  // (x[m][2r], x[m][2r+1]); rows may start at any element, so no int32 pointer cast
      std::memcpy(&pair, xk + m * ldx + 2 * r, sizeof pair);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      c0[m] = _mm512_dpbf16_ps(c0[m], a, b0);
      c1[m] = _mm512_dpbf16_ps(c1[m], a, b1);
    }
  }
}

// one panel (32 output columns) x MR rows: out[m][0..32) = xa[m][0..32 KB) . panel^T over its first KB k-steps.
// ``stream``: the panel comes from DRAM (prefetch ahead in it); ``ahead``: a panel to pull into cache meanwhile
// (this block computes from cache). Both prefetch into L2, not L1: the panel being read (~36 KB) already fills
// L1, and L1 prefetches evicted it (figures: docs/results/README.md#kernel-design-measurements)
template <int MR, typename Out>
void block(const c10::BFloat16* xa, int64_t ldx, const c10::BFloat16* wp, int64_t KB, Out* out, int64_t ldo,
           bool stream, const c10::BFloat16* ahead) {
  __m512 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) { c0[m] = _mm512_setzero_ps(); c1[m] = _mm512_setzero_ps(); }
  for (int64_t kb = 0; kb < KB; ++kb) {
    const c10::BFloat16* b = wp + kb * 1024;
    if (stream) prefetch_step_l2(b + kPrefetch * 1024);
    if (ahead) prefetch_step_l2(ahead + kb * 1024);
    kstep<MR>(c0, c1, xa + kb * 32, ldx, b);
  }
  for (int m = 0; m < MR; ++m) store32(out + m * ldo, c0[m], c1[m]);
}

// as block, for a panel already in cache: C (MR rows of 32 fp32, ldc apart) = (first ? 0 : C) + xa . panel^T over
// KB k-steps. The big-batch quantized matmul (qmm.cpp) runs a weight's K in chunks through it.
template <int MR>
void block_acc(const c10::BFloat16* xa, int64_t ldx, const c10::BFloat16* wp, int64_t KB, float* C, int64_t ldc,
               bool first) {
  __m512 c0[MR], c1[MR];
  for (int m = 0; m < MR; ++m) {
    c0[m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + m * ldc);
    c1[m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + m * ldc + 16);
  }
  for (int64_t kb = 0; kb < KB; ++kb) {
    kstep<MR>(c0, c1, xa + kb * 32, ldx, wp + kb * 1024);
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(C + m * ldc, c0[m]);
    _mm512_storeu_ps(C + m * ldc + 16, c1[m]);
  }
}

// one k-step of two panels (64 output columns: the k-step's blocks at b and at b2) for MR rows: per input pair, four
// weight vectors and MR broadcasts feed 4 MR products (10 loads per 24 VDPBF16PS at MR = 6, against 14 for one panel
// at MR = 12). Every output's sum runs in the same order as kstep's.
template <int MR>
inline void kstep2(__m512 (&c)[4][MR], const c10::BFloat16* xk, int64_t ldx, const c10::BFloat16* b,
                   const c10::BFloat16* b2) {
#pragma GCC unroll 16
  for (int r = 0; r < 16; ++r) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + r * 32));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 512 + r * 32));
    const __m512bh w2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b2 + r * 32));
    const __m512bh w3 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b2 + 512 + r * 32));
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, xk + m * ldx + 2 * r, sizeof pair);
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      c[0][m] = _mm512_dpbf16_ps(c[0][m], a, w0);
      c[1][m] = _mm512_dpbf16_ps(c[1][m], a, w1);
      c[2][m] = _mm512_dpbf16_ps(c[2][m], a, w2);
      c[3][m] = _mm512_dpbf16_ps(c[3][m], a, w3);
    }
  }
}

constexpr int kMaxRows2 = 6;  // rows per two-panel block: 4 accumulators per row + 4 weight vectors + 1 x pair

// block_acc over two panels at once (wp, wp2; C holds 64 columns per row)
template <int MR>
void block_acc2(const c10::BFloat16* xa, int64_t ldx, const c10::BFloat16* wp, const c10::BFloat16* wp2, int64_t KB,
                float* C, int64_t ldc, bool first) {
  __m512 c[4][MR];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) c[q][m] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + m * ldc + 16 * q);
  for (int64_t kb = 0; kb < KB; ++kb) kstep2<MR>(c, xa + kb * 32, ldx, wp + kb * 1024, wp2 + kb * 1024);
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(C + m * ldc + 16 * q, c[q][m]);
}

using BlockAcc2 = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t, float*,
                           int64_t, bool);
template <int... R>
constexpr std::array<BlockAcc2, sizeof...(R)> make_blocks_acc2(std::integer_sequence<int, R...>) {
  return {&block_acc2<R + 1>...};
}
// blocks_acc2[mr - 1] runs mr rows, 1 <= mr <= kMaxRows2
inline constexpr auto blocks_acc2 = make_blocks_acc2(std::make_integer_sequence<int, kMaxRows2>{});

using BlockAcc = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, float*, int64_t, bool);
template <int... R>
constexpr std::array<BlockAcc, sizeof...(R)> make_blocks_acc(std::integer_sequence<int, R...>) {
  return {&block_acc<R + 1>...};
}
// blocks_acc[mr - 1] runs mr rows, 1 <= mr <= kMaxRows
inline constexpr auto blocks_acc = make_blocks_acc(std::make_integer_sequence<int, kMaxRows>{});

template <typename Out>
using Block = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, Out*, int64_t, bool,
                       const c10::BFloat16*);

template <typename Out, int... R>
constexpr std::array<Block<Out>, sizeof...(R)> make_blocks(std::integer_sequence<int, R...>) {
  return {&block<R + 1, Out>...};
}
// blocks<Out>[mr - 1] runs mr rows, 1 <= mr <= kMaxRows
template <typename Out>
inline constexpr auto blocks = make_blocks<Out>(std::make_integer_sequence<int, kMaxRows>{});

// block over two panels at once (wp, wp2 = wp + panel_stride; out gets 64 columns per row); ``stream``: both come
// from DRAM (prefetch ahead in each)
template <int MR, typename Out>
void block2(const c10::BFloat16* xa, int64_t ldx, const c10::BFloat16* wp, const c10::BFloat16* wp2, int64_t KB,
            Out* out, int64_t ldo, bool stream) {
  __m512 c[4][MR];
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) c[q][m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (stream) {
      prefetch_step_l2(wp + (kb + kPrefetch) * 1024);
      prefetch_step_l2(wp2 + (kb + kPrefetch) * 1024);
    }
    kstep2<MR>(c, xa + kb * 32, ldx, wp + kb * 1024, wp2 + kb * 1024);
  }
  for (int m = 0; m < MR; ++m) {
    store32(out + m * ldo, c[0][m], c[1][m]);
    store32(out + m * ldo + 32, c[2][m], c[3][m]);
  }
}

template <typename Out>
using Block2 = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t, Out*,
                        int64_t, bool);
template <typename Out, int... R>
constexpr std::array<Block2<Out>, sizeof...(R)> make_blocks2(std::integer_sequence<int, R...>) {
  return {&block2<R + 1, Out>...};
}
template <typename Out>
inline constexpr auto blocks2 = make_blocks2<Out>(std::make_integer_sequence<int, kMaxRows2>{});

// from this many rows the matmul is bound by the dot products, not the weight stream: panels go in pairs
constexpr int64_t kPairRows = 24;

// rows [0, M) x panels [p0, p1) of out = x @ W^T, panel p's weights at w + p * panel_stride, its first KB k-steps
// used; rows split into equal blocks of <= kMaxRows. The first block of a panel streams it from DRAM, the last of
// several prefetches the next panel while it computes from cache. From kPairRows rows, two panels at a time in
// blocks of <= kMaxRows2 rows (kstep2: fewer loads per product).
template <typename Out>
void panels(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t panel_stride, int64_t KB, Out* out,
            int64_t ldo, int64_t M, int64_t p0, int64_t p1) {
  int64_t pstart = p0;
  if (M >= kPairRows) {
    const int64_t nb2 = (M + kMaxRows2 - 1) / kMaxRows2, rows2 = (M + nb2 - 1) / nb2;
    for (; pstart + 2 <= p1; pstart += 2) {
      const c10::BFloat16* wp = w + pstart * panel_stride;
      for (int64_t m = 0; m < M; m += rows2) {
        const int64_t mr = std::min(rows2, M - m);
        blocks2<Out>[mr - 1](x + m * ldx, ldx, wp, wp + panel_stride, KB, out + m * ldo + pstart * 32, ldo, m == 0);
      }
    }
  }
  const int64_t nblocks = (M + kMaxRows - 1) / kMaxRows, rows = (M + nblocks - 1) / nblocks;
  for (int64_t p = pstart; p < p1; ++p) {
    const c10::BFloat16* wp = w + p * panel_stride;
    const c10::BFloat16* next = p + 1 < p1 ? wp + panel_stride : nullptr;
    for (int64_t m = 0; m < M; m += rows) {
      const int64_t mr = std::min(rows, M - m);
      const c10::BFloat16* ahead = m > 0 && m + mr >= M ? next : nullptr;
      blocks<Out>[mr - 1](x + m * ldx, ldx, wp, KB, out + m * ldo + p * 32, ldo, m == 0, ahead);
    }
  }
}

}  // namespace parrot_kernels::vnni
#endif
