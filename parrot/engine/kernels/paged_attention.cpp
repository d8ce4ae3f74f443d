// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the block pool.
//
// Layouts (same as parrot/engine/layers/attention.py):
//
//     q            [B, H, D]            one new token per sequence (H = KVH * G query heads)
//     k_cache      [NB, BS, KVH, D]     v_cache alike; token t of sequence b lives in
//                                       block block_tables[b][t / BS], row t % BS
//     block_tables [B, MAXB] int32      only the first ceil(seq_lens[b] / BS) entries of a row are read
//     seq_lens     [B] int32            tokens to attend, >= 1 (the new token's K/V is already written)
//     out          [B, H, D]            in q's dtype (float32 or bfloat16; the caches may be float32, bfloat16 or
//                                       float16 whatever q is)
//     lse          [B, H] float32       log-sum-exp of the scaled scores (for merging partial attentions)
//
// Work item = (sequence b, KV heads [g0, g1)): the G query heads of a KV head share every K/V row load
// (grouped-query attention); an item is one KV head, or all of them when there are >= 2 sequences per thread.
// Two passes over the sequence's tokens: scores s[h][t] = scale * q_h . k_t (fp32 accumulate; VDPBF16PS on a
// bf16 cache where the CPU has AVX512-BF16), softmax in place, then out_h = sum_t p[h][t] v_t. Items are spread
// over torch's intra-op thread pool, so the kernel shares threads with the rest of the model (no second OpenMP
// runtime). The K/V bytes are read once, where they lie; the gather-then-SDPA path it replaces copies them first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

struct Problem {
  int64_t B, H, KVH, G, D, BS, MAXB;
  int64_t q_sb, q_sh;  // q strides (elements) of the batch and head dims; the D dim is contiguous
  float scale;
  const int32_t* tables;
  const int32_t* lens;
  float* lse;  // nullptr when not wanted
};

inline float to_f(float x) { return x; }
inline float to_f(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(c10::Half x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }

// ---- portable path (any D) -------------------------------------------------------------------------------------
template <typename T, typename KT>
void item_scalar(const Problem& p, const T* q, const KT* kc, const KT* vc, T* out, int64_t b, int64_t g,
                 std::vector<float>& buf) {
  const int64_t L = p.lens[b], G = p.G, D = p.D, BS = p.BS, row = p.KVH * D;
  const int32_t* table = p.tables + b * p.MAXB;
  buf.assign(G * L + G * D, 0.f);
  float* s = buf.data();
  float* acc = s + G * L;
  for (int64_t t = 0; t < L; ++t) {
    const KT* k = kc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row + g * D;
    for (int64_t h = 0; h < G; ++h) {
      const T* qh = q + b * p.q_sb + (g * G + h) * p.q_sh;
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += to_f(qh[d]) * to_f(k[d]);
      s[h * L + t] = dot * p.scale;
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* sh = s + h * L;
    float m = *std::max_element(sh, sh + L), sum = 0.f;
    for (int64_t t = 0; t < L; ++t) sum += (sh[t] = std::exp(sh[t] - m));
    for (int64_t t = 0; t < L; ++t) sh[t] /= sum;
    if (p.lse) p.lse[b * p.H + g * G + h] = m + std::log(sum);
  }
  for (int64_t t = 0; t < L; ++t) {
    const KT* v = vc + (static_cast<int64_t>(table[t / BS]) * BS + t % BS) * row + g * D;
    for (int64_t h = 0; h < G; ++h)
      for (int64_t d = 0; d < D; ++d) acc[h * D + d] += s[h * L + t] * to_f(v[d]);
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) out[(b * p.H + g * G + h) * D + d] = from_f<T>(acc[h * D + d]);
}

#if defined(__AVX512F__)
// ---- AVX-512 path: D = 16 * NV, q heads of one KV head held in registers ---------------------------------------
using parrot_kernels::load16;
using parrot_kernels::store16;

// e^x of scores minus their max (x <= 0): simd.h's exp512, with inputs below -87 flushed to 0 like expf
inline __m512 exp_scores(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(~tiny, parrot_kernels::exp512(x));
}

constexpr int kMaxG = 8;

// prefetch n rows of D elements (row stride ``stride`` elements) into L1
template <typename T, int D>
inline void prefetch_rows(const T* x, int64_t stride, int64_t n) {
  constexpr int kLines = (D * static_cast<int>(sizeof(T)) + 63) / 64;
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < kLines; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(x + j * stride) + 64 * c, _MM_HINT_T0);
}

#if defined(__AVX512BF16__)
// 16 vectors -> one: lane j = the sum of v[j]'s 16 lanes (45 shuffles/adds for 16 sums, vs ~8 dependent ones
// per _mm512_reduce_add_ps). Per 128-bit block:
//   stage 1  lo/hi_ps(a, b) = [a0 b0 a1 b1] / [a2 b2 a3 b3]   -> sum [a0+a2, b0+b2, a1+a3, b1+b3]
//   stage 2  lo/hi_pd of two stage-1 results (64-bit pairs)   -> [sum(a), sum(b), sum(c), sum(d)] of the block
//   stage 3/4 shuffle_f32x4 pairs of blocks (x0 x2 y0 y2) + (x1 x3 y1 y3), twice -> whole-vector sums
inline __m512 reduce16(__m512* v) {
  __m512 s1[8], s2[4];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(s1[2 * i]), y = _mm512_castps_pd(s1[2 * i + 1]);
    s2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  auto fold = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(s2[0], s2[1]), fold(s2[2], s2[3]));
}

// pass 1 for bf16 K/V: s[g - g0][h][t] = scale * q_{g,h} . k_t for KV heads g in [g0, g1) and their G query
// heads, 16 tokens at a time. The bf16 q and K rows go straight into VDPBF16PS (2 products per fp32 lane; no
// conversion), one vector of partial sums per token, and reduce16 turns 16 such vectors into 16 scores.
// With several KV heads per call the token rows are read whole (all heads side by side), one forward sweep.
// NB = D / 32 bf16 vectors per head.
constexpr int64_t kAhead = 64;  // K rows prefetched this many tokens ahead (tuned: see docs/results/README.md)

template <int NB>
void scores_bf16(const Problem& p, const c10::BFloat16* qb0, const c10::BFloat16* kc, const c10::BFloat16* vc,
                 const int64_t* off, int64_t L, int64_t g0, int64_t g1, float* s, int64_t Lp) {
  constexpr int64_t D = 32 * NB;
  const int64_t G = p.G, span = (g1 - g0) * D;
  // this call's part of one token row, into L2, kAhead tokens ahead (into L1 instead, the prefetches evicted the
  // rows being read). V is prefetched by pass 2 itself (pv_bf16): pulling it in here as well doubled the misses in
  // flight while K streams. Figures: docs/results/README.md#kernel-design-measurements
  auto prefetch_l2 = [&](const c10::BFloat16* x) {
    for (int64_t c = 0; c < span * 2; c += 64) _mm_prefetch(reinterpret_cast<const char*>(x) + c, _MM_HINT_T1);
  };
  const __m512 sc = _mm512_set1_ps(p.scale);
  const c10::BFloat16* k[16];
  for (int64_t t = 0; t < std::min<int64_t>(L, kAhead); ++t) prefetch_l2(kc + off[t] + g0 * D);
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - t0);
    for (int64_t j = 0; j < n; ++j) {
      k[j] = kc + off[t0 + j];
      if (t0 + kAhead + j < L) prefetch_l2(kc + off[t0 + kAhead + j] + g0 * D);
    }
    // a short last chunk repeats its last row: the lanes past n get finite scores in the row's padding, which the
    // softmax masks; the block stays branch-free (no spills: 16 sums + NB q vectors + 1 K vector in registers)
    for (int64_t j = n; j < 16; ++j) k[j] = k[n - 1];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t h = 0; h < G; ++h) {
        const c10::BFloat16* qh = qb0 + (g * G + h) * p.q_sh;
        __m512bh qv[NB];
        for (int i = 0; i < NB; ++i) qv[i] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qh + 32 * i));
        __m512 v[16];
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) {
          const c10::BFloat16* kj = k[j] + g * D;
          v[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], reinterpret_cast<__m512bh>(_mm512_loadu_si512(kj)));
          for (int i = 1; i < NB; ++i)
            v[j] = _mm512_dpbf16_ps(v[j], qv[i], reinterpret_cast<__m512bh>(_mm512_loadu_si512(kj + 32 * i)));
        }
        _mm512_storeu_ps(s + ((g - g0) * G + h) * Lp + t0, _mm512_mul_ps(reduce16(v), sc));
      }
    }
  }
}

// softmax weights of one head for the bf16 pass 2: w[t] = bf16(e^(s[t] - max)) for t < L, 0 up to Lp (a multiple
// of 16). Returns the lse (from the fp32 exponentials) and 1 / the sum of the ROUNDED weights, so the weights
// the pass multiplies with sum to exactly 1 after that scaling.
struct Weights {
  float lse, inv_sum;
};
inline Weights softmax_bf16(const float* sh, int64_t L, int64_t Lp, c10::BFloat16* w) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (L & 15)) - 1);
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 mk = (L - t >= 16) ? __mmask16(0xFFFF) : tail;
    mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, sh + t));
  }
  const float m = _mm512_reduce_max_ps(mv);
  const __m512 mm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps(), sum_rounded = _mm512_setzero_ps();
  for (int64_t t = 0; t < Lp; t += 16) {
    const __mmask16 mk = (L - t >= 16) ? __mmask16(0xFFFF) : tail;
    const __m512 e = _mm512_maskz_mov_ps(mk, exp_scores(_mm512_sub_ps(_mm512_loadu_ps(sh + t), mm)));
    const __m256i eb = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), eb);
    sum = _mm512_add_ps(sum, e);
    sum_rounded = _mm512_add_ps(sum_rounded, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
  }
  return {m + std::log(_mm512_reduce_add_ps(sum)), 1.0f / _mm512_reduce_add_ps(sum_rounded)};
}

// pass 2 on bf16 V: out_h = inv_h * sum_t w[h][t] v_t for the G query heads of KV head g, two tokens per
// VDPBF16PS. The rows v_t, v_t+1 interleaved 16-bit-wise (unpacklo/hi_epi16, which work per 128-bit lane) hold
// the pairs (v_t[d], v_t+1[d]) that meet the broadcast pair (w[h][t], w[h][t+1]); per 32-wide slice i of the row:
//
//     lo[i] lane 4k + j  <-  d = 32 i + 8 k + j          hi[i] lane 4k + j  <-  d = 32 i + 8 k + 4 + j
//
// (k = 128-bit lane, j < 4), put back in d order by one two-source permute per 16 outputs at the end.
// Half the instructions of an fp32 FMA per token and head; the weights carry bf16 precision (8 bits), the
// accumulation stays fp32. An odd last token pairs with a zero row (its partner weight is the padding's 0).
template <int NB>
void pv_bf16(const c10::BFloat16* vc, const int64_t* off, int64_t L, int64_t gD, const c10::BFloat16* w,
             int64_t Lp, int64_t G, const float* inv, c10::BFloat16* out) {
  constexpr int64_t D = 32 * NB;
  __m512 acc[kMaxG][2 * NB];
  for (int64_t h = 0; h < G; ++h)
    for (int i = 0; i < 2 * NB; ++i) acc[h][i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 2) {
    // V from DRAM into L2 48 tokens ahead, and from L2 into L1 16 tokens ahead
    if (t + 17 < L) {
      prefetch_rows<c10::BFloat16, D>(vc + off[t + 16] + gD, 0, 1);
      prefetch_rows<c10::BFloat16, D>(vc + off[t + 17] + gD, 0, 1);
    }
    if (t + 49 < L) {
      for (int c = 0; c < D * 2; c += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(vc + off[t + 48] + gD) + c, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vc + off[t + 49] + gD) + c, _MM_HINT_T1);
      }
    }
    const c10::BFloat16* va = vc + off[t] + gD;
    const c10::BFloat16* vb = t + 1 < L ? vc + off[t + 1] + gD : nullptr;
    __m512i lo[NB], hi[NB];
    for (int i = 0; i < NB; ++i) {
      const __m512i a = _mm512_loadu_si512(va + 32 * i);
      const __m512i b = vb ? _mm512_loadu_si512(vb + 32 * i) : _mm512_setzero_si512();
      lo[i] = _mm512_unpacklo_epi16(a, b);
      hi[i] = _mm512_unpackhi_epi16(a, b);
    }
    for (int64_t h = 0; h < G; ++h) {
      int32_t pair;
      std::memcpy(&pair, w + h * Lp + t, sizeof pair);
      const __m512bh wv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int i = 0; i < NB; ++i) {
        acc[h][2 * i] = _mm512_dpbf16_ps(acc[h][2 * i], reinterpret_cast<__m512bh>(lo[i]), wv);
        acc[h][2 * i + 1] = _mm512_dpbf16_ps(acc[h][2 * i + 1], reinterpret_cast<__m512bh>(hi[i]), wv);
      }
    }
  }
  // output d = 8 k + 4 s + j (s: 0 = lo, 1 = hi) of a slice comes from lane 4 k + j of lo / hi; index 16 + x of
  // the two-source permute names hi's lane x
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < G; ++h) {
    const __m512 sc = _mm512_set1_ps(inv[h]);
    for (int i = 0; i < NB; ++i) {
      const __m512 x = acc[h][2 * i], y = acc[h][2 * i + 1];
      store16(out + h * D + 32 * i, _mm512_mul_ps(_mm512_permutex2var_ps(x, first, y), sc));
      store16(out + h * D + 32 * i + 16, _mm512_mul_ps(_mm512_permutex2var_ps(x, second, y), sc));
    }
  }
}
#endif

// sequence b, KV heads [g0, g1): every query head of those KV heads
template <typename T, int NV>
void item_avx512(const Problem& p, const T* q, const T* kc, const T* vc, T* out, int64_t b, int64_t g0,
                 int64_t g1, std::vector<float>& buf, std::vector<int64_t>& offs,
                 std::vector<c10::BFloat16>& wbuf) {
  const int64_t L = p.lens[b], G = p.G, BS = p.BS, row = p.KVH * p.D;
  constexpr int64_t D = 16 * NV;
  const int32_t* table = p.tables + b * p.MAXB;
  const int64_t Lp = (L + 15) & ~int64_t(15);  // per-head score rows padded to whole vectors
  buf.resize((g1 - g0) * G * Lp);
  // token t's row starts off[t] elements into a cache (no per-token division by BS)
  offs.resize(L);
  for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
    const int64_t base = static_cast<int64_t>(table[i]) * BS * row;
    for (int64_t j = 0; j < std::min(BS, L - t0); ++j) offs[t0 + j] = base + j * row;
  }
  // pass 1: scores
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
    scores_bf16<NV / 2>(p, q + b * p.q_sb, kc, vc, offs.data(), L, g0, g1, buf.data(), Lp);
  } else
#endif
  {
    // the blocks are scattered over the pool, which defeats the hardware prefetcher at every block boundary:
    // prefetch the next block's K rows and this block's V rows (read again in pass 2) by hand
    const __m512 sc = _mm512_set1_ps(p.scale);
    for (int64_t g = g0; g < g1; ++g) {
      float* s = buf.data() + (g - g0) * G * Lp;
      __m512 qv[kMaxG][NV];
      for (int64_t h = 0; h < G; ++h) {
        const T* qh = q + b * p.q_sb + (g * G + h) * p.q_sh;
        for (int i = 0; i < NV; ++i) qv[h][i] = _mm512_mul_ps(load16(qh + 16 * i), sc);
      }
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        if (t0 + BS < L) prefetch_rows<T, D>(kc + offs[t0 + BS] + g * D, row, std::min(BS, L - t0 - BS));
        prefetch_rows<T, D>(vc + offs[t0] + g * D, row, n);
        for (int64_t j = 0; j < n; ++j) {
          const T* k = kc + offs[t0 + j] + g * D;
          __m512 kv[NV];
          for (int i = 0; i < NV; ++i) kv[i] = load16(k + 16 * i);
          for (int64_t h = 0; h < G; ++h) {
            __m512 a = _mm512_mul_ps(qv[h][0], kv[0]);
            for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(qv[h][i], kv[i], a);
            s[h * Lp + t0 + j] = _mm512_reduce_add_ps(a);
          }
        }
      }
    }
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && NV % 2 == 0) {
    // softmax into bf16 weights, then the pair-wise pass 2 (pv_bf16)
    wbuf.resize(G * Lp);
    float inv[kMaxG];
    for (int64_t g = g0; g < g1; ++g) {
      const float* s = buf.data() + (g - g0) * G * Lp;
      for (int64_t h = 0; h < G; ++h) {
        const Weights wt = softmax_bf16(s + h * Lp, L, Lp, wbuf.data() + h * Lp);
        inv[h] = wt.inv_sum;
        if (p.lse) p.lse[b * p.H + g * G + h] = wt.lse;
      }
      pv_bf16<NV / 2>(vc, offs.data(), L, g * D, wbuf.data(), Lp, G, inv, out + (b * p.H + g * G) * D);
    }
    return;
  }
#endif
  const __mmask16 tail = static_cast<__mmask16>((1u << (L & 15)) - 1);
  for (int64_t g = g0; g < g1; ++g) {
    float* s = buf.data() + (g - g0) * G * Lp;
    // softmax per head, in place; the padded tail [L, Lp) of each row is written as 0 by the exp pass
    for (int64_t h = 0; h < G; ++h) {
      float* sh = s + h * Lp;
      __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < L; t += 16) {
        __mmask16 mk = (L - t >= 16) ? __mmask16(0xFFFF) : tail;
        mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, sh + t));
      }
      const float m = _mm512_reduce_max_ps(mv);
      const __m512 mm = _mm512_set1_ps(m);
      __m512 sv = _mm512_setzero_ps();
      for (int64_t t = 0; t < Lp; t += 16) {
        __mmask16 mk = (L - t >= 16) ? __mmask16(0xFFFF) : tail;
        __m512 e = _mm512_maskz_mov_ps(mk, exp_scores(_mm512_sub_ps(_mm512_loadu_ps(sh + t), mm)));
        _mm512_storeu_ps(sh + t, e);
        sv = _mm512_add_ps(sv, e);
      }
      const float sum = _mm512_reduce_add_ps(sv);
      const __m512 inv = _mm512_set1_ps(1.0f / sum);
      for (int64_t t = 0; t < Lp; t += 16) _mm512_storeu_ps(sh + t, _mm512_mul_ps(_mm512_loadu_ps(sh + t), inv));
      if (p.lse) p.lse[b * p.H + g * G + h] = m + std::log(sum);
    }
    // pass 2: out_h = sum_t p[h][t] v_t
    __m512 acc[kMaxG][NV];
    for (int64_t h = 0; h < G; ++h)
      for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; ++t) {
      if (t + 16 < L) prefetch_rows<T, D>(vc + offs[t + 16] + g * D, row, 1);  // L2 -> L1 (see docs/results)
      const T* v = vc + offs[t] + g * D;
      __m512 vv[NV];
      for (int i = 0; i < NV; ++i) vv[i] = load16(v + 16 * i);
      for (int64_t h = 0; h < G; ++h) {
        const __m512 w = _mm512_set1_ps(s[h * Lp + t]);
        for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_fmadd_ps(w, vv[i], acc[h][i]);
      }
    }
    for (int64_t h = 0; h < G; ++h)
      for (int i = 0; i < NV; ++i) store16(out + (b * p.H + g * G + h) * D + 16 * i, acc[h][i]);
  }
}
#endif


#if defined(PARROT_AVX2)
// ---- AVX2 path: fp32 math, D a multiple of 32; K/V stored as fp32, bf16 or fp16 --------------------------------
// Pass 1 takes 8 tokens at a time: per query head, 8 dot-product vectors (one per token, D / 8 FMAs each) folded
// into one vector of 8 scores by fold8. Pass 2 keeps a tile of up to 3 query heads x 32 output dims in 12
// accumulators and sweeps the tokens once per tile (the V row slice is re-read from L1 by each head of the tile).
namespace v2 = parrot_kernels::avx2;

// 8 vectors -> one: lane j = the sum of v[j]'s 8 lanes
inline __m256 fold8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);  // [0 1 2 3 | 0 1 2 3], [4..7 | 4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

template <typename KT>
inline void prefetch_row(const KT* x, int64_t D) {
  for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(KT)); c += 64)
    _mm_prefetch(reinterpret_cast<const char*>(x) + c, _MM_HINT_T0);
}

// out[h][32 c .. 32 c + 32) for heads [h0, h0 + HT) of KV head g (out: head h0's row): sum_t p[h][t] v_t (p
// normalized)
template <int HT, typename T, typename KT>
void pv_tile(const KT* vc, const int64_t* off, int64_t L, int64_t gD, const float* s, int64_t Lp, int64_t h0,
             int64_t D, int64_t c, T* out) {
  __m256 acc[HT][4];
  for (int h = 0; h < HT; ++h)
    for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const KT* v = vc + off[t] + gD + 32 * c;
    __m256 vv[4];
    for (int i = 0; i < 4; ++i) vv[i] = v2::load8(v + 8 * i);
    for (int h = 0; h < HT; ++h) {
      const __m256 w = _mm256_broadcast_ss(s + (h0 + h) * Lp + t);
      for (int i = 0; i < 4; ++i) acc[h][i] = _mm256_fmadd_ps(w, vv[i], acc[h][i]);
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int i = 0; i < 4; ++i) v2::store8(out + h * D + 32 * c + 8 * i, acc[h][i]);
}

template <typename T, typename KT>
void item_avx2(const Problem& p, const T* q, const KT* kc, const KT* vc, T* out, int64_t b, int64_t g0,
               int64_t g1, std::vector<float>& buf, std::vector<int64_t>& offs) {
  const int64_t L = p.lens[b], G = p.G, BS = p.BS, D = p.D, row = p.KVH * D, NV = D / 8;
  const int32_t* table = p.tables + b * p.MAXB;
  const int64_t Lp = (L + 7) & ~int64_t(7);
  // scores [G, Lp], then the fp32 query heads of one KV head [G, D] (scaled)
  buf.resize(G * Lp + G * D);
  float* s = buf.data();
  float* qf = s + G * Lp;
  offs.resize(L);
  for (int64_t t0 = 0, i = 0; t0 < L; t0 += BS, ++i) {
    const int64_t base = static_cast<int64_t>(table[i]) * BS * row;
    for (int64_t j = 0; j < std::min(BS, L - t0); ++j) offs[t0 + j] = base + j * row;
  }
  const __m256 sc = _mm256_set1_ps(p.scale);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t h = 0; h < G; ++h) {
      const T* qh = q + b * p.q_sb + (g * G + h) * p.q_sh;
      for (int64_t i = 0; i < NV; ++i) _mm256_storeu_ps(qf + h * D + 8 * i, _mm256_mul_ps(v2::load8(qh + 8 * i), sc));
    }
    // pass 1: scores, 8 tokens at a time (a short last chunk repeats its last row; the softmax masks the padding)
    const KT* k[8];
    for (int64_t t0 = 0; t0 < L; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, L - t0);
      for (int64_t j = 0; j < 8; ++j) k[j] = kc + offs[t0 + std::min(j, n - 1)] + g * D;
      if (t0 + 16 < L)
        for (int64_t j = 0; j < std::min<int64_t>(8, L - t0 - 16); ++j) prefetch_row(kc + offs[t0 + 16 + j] + g * D, D);
      for (int64_t h = 0; h < G; ++h) {
        const float* qh = qf + h * D;
        __m256 v[8];
        for (int j = 0; j < 8; ++j) v[j] = _mm256_setzero_ps();
        for (int64_t i = 0; i < NV; ++i) {
          const __m256 qv = _mm256_loadu_ps(qh + 8 * i);
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) v[j] = _mm256_fmadd_ps(qv, v2::load8(k[j] + 8 * i), v[j]);
        }
        _mm256_storeu_ps(s + h * Lp + t0, fold8(v));
      }
    }
    // softmax per head, in place, normalized; padding [L, Lp) -> 0
    for (int64_t h = 0; h < G; ++h) {
      const v2::RowSoftmax sm = v2::softmax_row(s + h * Lp, L, Lp);
      if (p.lse) p.lse[b * p.H + g * G + h] = sm.max + std::log(sm.sum);
    }
    // pass 2: tiles of <= 3 heads x 32 dims
    for (int64_t c = 0; c < D / 32; ++c)
      for (int64_t h0 = 0; h0 < G; h0 += 3) {
        const int64_t ht = std::min<int64_t>(3, G - h0);
        T* oh = out + (b * p.H + g * G + h0) * D;
        if (ht == 3) pv_tile<3>(vc, offs.data(), L, g * D, s, Lp, h0, D, c, oh);
        else if (ht == 2) pv_tile<2>(vc, offs.data(), L, g * D, s, Lp, h0, D, c, oh);
        else pv_tile<1>(vc, offs.data(), L, g * D, s, Lp, h0, D, c, oh);
      }
  }
}
#endif

template <typename T, typename KT>
void run(const Problem& p, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, at::Tensor& out) {
  const T* qp = q.const_data_ptr<T>();
  const KT* kp = kc.const_data_ptr<KT>();
  const KT* vp = vc.const_data_ptr<KT>();
  T* op = out.mutable_data_ptr<T>();
  // item = (sequence, KV heads): with enough sequences for every thread, a whole sequence (one forward sweep over
  // whole token rows: as fast as three strided per-head sweeps, docs/results/README.md, and fewer items), else one
  // KV head of one sequence
  const int64_t per = p.B >= 2 * at::get_num_threads() ? p.KVH : 1, items = p.B * (p.KVH / per);
  // an item costs ~ its sequence length; small grains keep both threads busy on a ragged batch
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    std::vector<int64_t> offs;
    std::vector<c10::BFloat16> wbuf;  // bf16 softmax weights (pv_bf16)
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b = it / (p.KVH / per), g0 = it % (p.KVH / per) * per, g1 = g0 + per;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, KT>) {
        if (p.G <= kMaxG) {
          if (p.D == 64) { item_avx512<T, 4>(p, qp, kp, vp, op, b, g0, g1, buf, offs, wbuf); continue; }
          if (p.D == 128) { item_avx512<T, 8>(p, qp, kp, vp, op, b, g0, g1, buf, offs, wbuf); continue; }
          if (p.D == 32) { item_avx512<T, 2>(p, qp, kp, vp, op, b, g0, g1, buf, offs, wbuf); continue; }
        }
      }
#endif
#if defined(PARROT_AVX2)
      // K/V stored in another dtype than q (e.g. fp16 caches for an fp32 model), or a CPU without AVX-512
      if (p.D % 32 == 0) { item_avx2<T, KT>(p, qp, kp, vp, op, b, g0, g1, buf, offs); continue; }
#endif
      for (int64_t g = g0; g < g1; ++g) item_scalar<T, KT>(p, qp, kp, vp, op, b, g, buf);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens, double scale, bool want_lse) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: the K and V caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  TORCH_CHECK(q.stride(2) == 1, "paged_decode: q's last dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "paged_decode: block_tables must be a contiguous int32 [B, MAXB]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "paged_decode: seq_lens int32");
  Problem p{};
  p.B = q.size(0); p.H = q.size(1); p.D = q.size(2);
  p.BS = k_cache.size(1); p.KVH = k_cache.size(2); p.MAXB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == p.D && p.H % p.KVH == 0, "paged_decode: head shapes disagree");
  TORCH_CHECK(block_tables.size(0) == p.B && seq_lens.numel() == p.B, "paged_decode: batch sizes disagree");
  p.G = p.H / p.KVH;
  p.q_sb = q.stride(0); p.q_sh = q.stride(1);
  p.scale = static_cast<float>(scale);
  p.tables = block_tables.const_data_ptr<int32_t>();
  p.lens = seq_lens.const_data_ptr<int32_t>();
  const int64_t nb = k_cache.size(0);
  for (int64_t b = 0; b < p.B; ++b) {  // bounds: a bad table must raise, never read outside the pool
    const int64_t L = p.lens[b];
    TORCH_CHECK(L >= 1 && (L + p.BS - 1) / p.BS <= p.MAXB, "paged_decode: seq_lens out of range");
    for (int64_t i = 0; i < (L + p.BS - 1) / p.BS; ++i) {
      const int32_t blk = p.tables[b * p.MAXB + i];
      TORCH_CHECK(blk >= 0 && blk < nb, "paged_decode: block id out of range");
    }
  }
  at::Tensor out = at::empty({p.B, p.H, p.D}, q.options());
  at::Tensor lse = at::empty({want_lse ? p.B : 0, p.H}, q.options().dtype(at::kFloat));
  p.lse = want_lse ? lse.mutable_data_ptr<float>() : nullptr;
  auto with_q = [&](auto* qtag) {
    using T = std::remove_pointer_t<decltype(qtag)>;
    switch (k_cache.scalar_type()) {
      case at::kFloat: run<T, float>(p, q, k_cache, v_cache, out); break;
      case at::kBFloat16: run<T, c10::BFloat16>(p, q, k_cache, v_cache, out); break;
      case at::kHalf: run<T, c10::Half>(p, q, k_cache, v_cache, out); break;
      default: TORCH_CHECK(false, "paged_decode: caches must be float32, bfloat16 or float16");
    }
  };
  if (q.scalar_type() == at::kBFloat16) with_q(static_cast<c10::BFloat16*>(nullptr));
  else if (q.scalar_type() == at::kFloat) with_q(static_cast<float*>(nullptr));
  else TORCH_CHECK(false, "paged_decode: q must be float32 or bfloat16");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, bool want_lse) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("paged_decode", paged_decode); }
