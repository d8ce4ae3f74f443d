// bf16 GEMM for decode-sized batches: out[M, N] = x[M, K] @ W[N, K]^T, fp32 accumulate, weights pre-packed in
// "VNNI" order (pairs of input features side by side). Two backends share the layout:
//
//   "amx"          Intel AMX tiles (TDPBF16PS), Sapphire Rapids and later
//   "avx512_bf16"  AVX512-BF16 dot products (VDPBF16PS), e.g. AMD Zen 4 / Intel Cooper Lake
//
// Why: at a few to a few dozen rows a decode step is bound by streaming the weights from DRAM. oneDNN reaches
// well under the machine's read bandwidth on this shape mix (many 1-3 MB weights, one call each; 2 threads); a
// kernel whose weight reads are one sequential, software-prefetched stream per thread reaches it (figures:
// docs/results/README.md#kernel-design-measurements). From a few dozen rows on the work is bound by the dot
// products; the same kernel then runs panels in pairs (below). A dense bf16 layer keeps only this form
// (layers/packed.py).
//
// Packed weight layout (vnni_pack), for N % 32 == 0 and K % 32 == 0:
//
//     P[n][kb][j][r][c][i] = W[32 n + 16 j + c][32 kb + 2 r + i]      shape [N/32, K/32, 2, 16, 16, 2]
//
//     panel n = 32 output columns; k-step kb = 32 input features; half j = 16 output columns:
//     16 rows (r: k pairs) x 64 bytes (c: 16 columns x i: 2 bf16 of one k pair). One k-step of a panel = two
//     1 KB blocks back to back; a whole panel is contiguous (K/32 x 2 KB), so a thread that owns a run of panels
//     reads its weights as one forward stream.
//
//     For AMX a 1 KB block is a B tile as TDPBF16PS wants it. For AVX-512 each 64-byte row (j, r) is one zmm
//     register: lane c holds the pair (W[col c][2r], W[col c][2r+1]), so VDPBF16PS with the pair
//     (x[m][2r], x[m][2r+1]) broadcast to every lane adds both products to column c's accumulator.
//
// AMX tiles per (panel, 32-row chunk of x):  C00 C01 (rows 0-15 x cols 0-15 | 16-31)   tmm0 tmm1
//                                             C10 C11 (rows 16-31 x ...)                 tmm2 tmm3
//                                             A0  A1  (x rows 0-15 | 16-31, 32 k)       tmm4 tmm5
//                                             B0  B1  (the panel's two halves, 32 k)    tmm6 tmm7
// A chunk with <= 16 rows uses C00 C01 A0 B0 B1 only. Row counts below 16 are set in the tile config (tiles
// load and store only their configured rows), so x needs no padding.
//
// AVX-512 registers per (panel, block of up to 12 rows): 2 accumulators per row (columns 0-15 | 16-31), the two
// weight rows of the current k pair, one broadcast x pair: 2 * 12 + 3 = 27 of the 32 zmm registers (vnni_block.h).
// From kPairRows rows, per (two panels, block of up to 6 rows): 4 accumulators per row, 4 weight rows, one x pair:
// 4 * 6 + 5 = 29 -- 10 loads per 24 VDPBF16PS instead of 14.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "vnni_block.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512BF16__)
#define PARROT_AVX512_BF16 1
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define PARROT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(PARROT_AVX512_BF16)
using parrot_kernels::vnni::kPrefetch;
using parrot_kernels::vnni::prefetch_step;
using parrot_kernels::vnni::store32;
#endif

#if defined(PARROT_AMX)
// Linux keeps AMX tile data off until a process asks for it (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool request_amx() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tile config for a chunk of m0 (+ m1) rows; every tile is 64 bytes wide
void configure(int m0, int m1) {
  TileConfig cfg;
  auto set = [&](int t, int rows) { cfg.rows[t] = static_cast<uint8_t>(rows); cfg.colsb[t] = 64; };
  set(0, m0); set(1, m0); set(4, m0); set(6, 16); set(7, 16);
  if (m1 > 0) { set(2, m1); set(3, m1); set(5, m1); }
  _tile_loadconfig(&cfg);
}

// fp32 [rows][32] (row stride 32) -> bf16 out rows (stride ldo)
inline void emit(const float* acc, int rows, c10::BFloat16* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r)
    store32(out + r * ldo, _mm512_loadu_ps(acc + r * 32), _mm512_loadu_ps(acc + r * 32 + 16));
}

// panels [p0, p1) of out = x @ W^T on AMX tiles; x rows are ldx elements apart
void amx_panels(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, c10::BFloat16* out, int64_t M,
                int64_t N, int64_t K, int64_t p0, int64_t p1) {
  const int64_t KB = K / 32, lda = ldx * 2;
  alignas(64) float acc[32 * 32];
  int cur0 = -1, cur1 = -1;
  for (int64_t p = p0; p < p1; ++p) {
    const c10::BFloat16* wp = w + p * KB * 1024;  // the panel: KB k-steps x 2 tiles x 512 bf16
    for (int64_t m = 0; m < M; m += 32) {
      const int m0 = static_cast<int>(std::min<int64_t>(16, M - m));
      const int m1 = static_cast<int>(std::clamp<int64_t>(M - m - 16, 0, 16));
      if (m0 != cur0 || m1 != cur1) { configure(m0, m1); cur0 = m0; cur1 = m1; }
      const c10::BFloat16* xa = x + m * ldx;
      _tile_zero(0); _tile_zero(1);
      // the first chunk streams the panel from DRAM: prefetch kPrefetch k-steps ahead (past the panel's end is
      // the next panel, which this thread also owns, or harmless: prefetches never fault)
      // ...and with more than one chunk, the last one (computing from cache) prefetches the next panel step by
      // step, so the memory keeps streaming while the tiles compute
      const bool stream = m == 0;
      const c10::BFloat16* ahead = m + 32 >= M && m > 0 ? wp + KB * 1024 : nullptr;
      if (m1 > 0) {
        _tile_zero(2); _tile_zero(3);
        for (int64_t kb = 0; kb < KB; ++kb) {
          const c10::BFloat16* b = wp + kb * 1024;
          if (stream) prefetch_step(b + kPrefetch * 1024);
          if (ahead) prefetch_step(ahead + kb * 1024);
          _tile_loadd(4, xa + kb * 32, lda);
          _tile_loadd(5, xa + 16 * ldx + kb * 32, lda);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      } else {
        for (int64_t kb = 0; kb < KB; ++kb) {
          const c10::BFloat16* b = wp + kb * 1024;
          if (stream) prefetch_step(b + kPrefetch * 1024);
          _tile_loadd(4, xa + kb * 32, lda);
          _tile_loadd(6, b, 64);
          _tile_loadd(7, b + 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, acc, 128);
      _tile_stored(1, acc + 16, 128);
      emit(acc, m0, out + m * N + p * 32, N);
      if (m1 > 0) {
        _tile_stored(2, acc, 128);
        _tile_stored(3, acc + 16, 128);
        emit(acc, m1, out + (m + 16) * N + p * 32, N);
      }
    }
  }
  _tile_release();
}
#endif

#if defined(PARROT_AVX512_BF16)
// panels [p0, p1) of out = x @ W^T with AVX512-BF16 (the register blocks: vnni_block.h)
void avx512_panels(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, c10::BFloat16* out, int64_t M,
                   int64_t N, int64_t K, int64_t p0, int64_t p1) {
  parrot_kernels::vnni::panels<c10::BFloat16>(x, ldx, w, (K / 32) * 1024, K / 32, out, N, M, p0, p1);
}
#endif

std::vector<std::string> vnni_backends() {
  std::vector<std::string> out;
#if defined(PARROT_AMX)
  static const bool amx_ok = request_amx();
  if (amx_ok) out.emplace_back("amx");
#endif
#if defined(PARROT_AVX512_BF16)
  out.emplace_back("avx512_bf16");
#endif
  return out;
}

at::Tensor vnni_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "vnni_pack: a 2-D bfloat16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "vnni_pack: N and K must be multiples of 32, got ", N, " x ", K);
  return parrot_kernels::vnni::pack(w);
}

at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& packed, c10::string_view backend) {
  static const std::vector<std::string> have = vnni_backends();  // once: not per call
  TORCH_CHECK(std::find(have.begin(), have.end(), std::string(backend)) != have.end(), "vnni_linear: backend '",
              backend, "' is not available on this CPU/OS/build");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "vnni_linear: x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 6 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 16 && packed.size(5) == 2,
              "vnni_linear: weight must come from vnni_pack");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 32;
  TORCH_CHECK(packed.size(1) * 32 == K, "vnni_linear: x has ", K, " features, the weight ", packed.size(1) * 32);
  const at::Tensor xc = x.stride(1) == 1 && x.stride(0) >= K ? x : x.contiguous();  // row views are fine
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(PARROT_AVX512_BF16)
  const c10::BFloat16* xp = xc.const_data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.const_data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.mutable_data_ptr<c10::BFloat16>();
  const int64_t ldx = xc.stride(0);
#if defined(PARROT_AMX)
  if (backend == "amx") {
    at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) { amx_panels(xp, ldx, wp, op, M, N, K, p0, p1); });
    return out;
  }
#endif
  at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) { avx512_panels(xp, ldx, wp, op, M, N, K, p0, p1); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("vnni_backends() -> str[]", vnni_backends);
  m.def("vnni_pack(Tensor w) -> Tensor", vnni_pack);
  m.def("vnni_linear(Tensor x, Tensor packed, str backend) -> Tensor");
}

TORCH_LIBRARY_IMPL(parrot_kernels, CPU, m) { m.impl("vnni_linear", vnni_linear); }
