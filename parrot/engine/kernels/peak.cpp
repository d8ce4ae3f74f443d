// Measured int8 dot-product peak of this CPU (the denominator of the engine benchmark's "% int8 peak"):
//
//     int8_dot_peak_gops(float seconds) -> float      total GOPS over torch's intra-op threads
//
// A synthetic loop of VPMADDUBSW (_mm256_maddubs_epi16: 32 u8 x s8 products, summed in adjacent pairs to 16 int16)
// with no loads or stores: each thread runs kChains independent chains, each adding its VPMADDUBSW results into an
// int16 accumulator (VPADDW, wrapping: the values are meaningless) and widening that every kWiden steps with
// VPMADDWD by ones + VPADDD into int32 -- the integer-dot kernel's own pattern (qmm.cpp's AVX2 variant sums up to
// 8 quads in int16, then one VPMADDWD), so its multiply-port load is the kernel's. Only the VPMADDUBSW products count:
// 2 ops per multiply-add, 64 ops per instruction. An empty asm statement makes the multiplicand opaque before every
// VPMADDUBSW, so the compiler can neither hoist the loop-invariant products out of the loop nor merge the chains;
// the accumulators are folded into a volatile sink and into the returned value, so the loop cannot be dropped.
//
// One task per intra-op thread (at::parallel_for over the thread count, grain 1), each running until ``seconds``
// of wall time have passed (checked every kSteps steps); GOPS = all threads' ops / the wall time of the whole call.
// Without AVX2 at compile time (or on a CPU without it) the op raises.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__)
constexpr int kChains = 10;        // independent VPMADDUBSW chains per thread (int16 accumulators)
constexpr int kWiden = 8;          // VPMADDUBSW steps per chain between widenings (as the kernel's 8 quads)
constexpr int64_t kSteps = 4096;   // widenings between clock reads (~0.05-0.2 ms)
constexpr double kOpsPerMaddubs = 64.0;  // 32 u8 x s8 products, 2 ops each

volatile int64_t g_sink = 0;

// one thread's share: (VPMADDUBSW instructions issued, folded accumulators)
struct Work {
  int64_t maddubs = 0;
  int64_t fold = 0;
};

// one step of every chain: kChains x (VPMADDUBSW into a scratch register, VPADDW into the chain's accumulator), in
// asm so the compiler neither hoists the loop-invariant products nor reorders them into spills
#define PARROT_PEAK_CHAIN(i) "vpmaddubsw %[b], %[a], %[t]\n\tvpaddw %[t], %[c" #i "], %[c" #i "]\n\t"

__attribute__((noinline)) Work run_thread(int64_t seed, std::chrono::steady_clock::time_point deadline) {
  static_assert(kChains == 10, "the asm step below names 10 chains");
  // runtime-dependent operands (not constants the compiler could fold)
  const __m256i a = _mm256_set1_epi8(static_cast<char>(1 + (seed & 7)));   // u8 side
  const __m256i b = _mm256_set1_epi8(static_cast<char>(-3 - (seed & 3)));  // s8 side
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0, c8 = c0,
          c9 = c0, t;
  __m256i acc32 = _mm256_setzero_si256();
  Work w;
  while (true) {
    for (int64_t s = 0; s < kSteps; ++s) {
      for (int k = 0; k < kWiden; ++k)
        asm volatile(PARROT_PEAK_CHAIN(0) PARROT_PEAK_CHAIN(1) PARROT_PEAK_CHAIN(2) PARROT_PEAK_CHAIN(3)
                     PARROT_PEAK_CHAIN(4) PARROT_PEAK_CHAIN(5) PARROT_PEAK_CHAIN(6) PARROT_PEAK_CHAIN(7)
                     PARROT_PEAK_CHAIN(8) PARROT_PEAK_CHAIN(9)
                     : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4), [c5] "+x"(c5),
                       [c6] "+x"(c6), [c7] "+x"(c7), [c8] "+x"(c8), [c9] "+x"(c9), [t] "=&x"(t)
                     : [a] "x"(a), [b] "x"(b));
      // widen: VPMADDWD by ones + VPADDD into int32, then restart the int16 sums (as the kernel does per group)
#define PARROT_PEAK_WIDEN(c)                                        \
  acc32 = _mm256_add_epi32(acc32, _mm256_madd_epi16(c, ones)); \
  c = _mm256_setzero_si256();
      PARROT_PEAK_WIDEN(c0) PARROT_PEAK_WIDEN(c1) PARROT_PEAK_WIDEN(c2) PARROT_PEAK_WIDEN(c3) PARROT_PEAK_WIDEN(c4)
      PARROT_PEAK_WIDEN(c5) PARROT_PEAK_WIDEN(c6) PARROT_PEAK_WIDEN(c7) PARROT_PEAK_WIDEN(c8) PARROT_PEAK_WIDEN(c9)
#undef PARROT_PEAK_WIDEN
    }
    w.maddubs += kSteps * kWiden * kChains;
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc32);
  for (int i = 0; i < 8; ++i) w.fold += lanes[i];
  return w;
}
#undef PARROT_PEAK_CHAIN
#endif

double int8_dot_peak_gops(double seconds) {
  TORCH_CHECK(seconds > 0 && seconds < 600, "int8_dot_peak_gops: seconds must be in (0, 600), got ", seconds);
#if defined(__AVX2__)
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "int8_dot_peak_gops: this CPU has no AVX2");
  const int64_t threads = at::get_num_threads();
  std::vector<Work> work(threads);
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                 std::chrono::duration<double>(seconds));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) work[t] = run_thread(t, deadline);
  });
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int64_t maddubs = 0, fold = 0;
  for (const Work& w : work) {
    maddubs += w.maddubs;
    fold += w.fold;
  }
  g_sink = fold;
  // fold the accumulators into the result too: +0 or a negligible 1e-300 (never a visible change)
  return maddubs * kOpsPerMaddubs / wall / 1e9 + ((fold & 1) ? 1e-300 : 0.0);
#else
  TORCH_CHECK(false, "int8_dot_peak_gops: the kernel library was built without AVX2 (the int8 peak loop is AVX2 "
                     "VPMADDUBSW code; built for a CPU without AVX2)");
  return 0.0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("int8_dot_peak_gops(float seconds) -> float", int8_dot_peak_gops);
}
