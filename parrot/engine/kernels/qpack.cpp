// Packing GGUF tensors into the quantized kernels' layout (qformats.h), and reading it back.
//
//     qpack(raws, fmts, K) -> packed        raws[s]: uint8 [n_s, row bytes], the GGUF tensor's own bytes (a view of
//                                           the file), rows = output features; one segment per raw, in order
//     qdequantize(packed) -> float32 [N, K] the weight the packed codes and scales encode
//     qembed(packed, ids, dtype) -> [T, K]  rows ``ids`` of that weight (a quantized embedding table)
//     qinfo(packed) -> int[]                K, N, then per segment fmt, n0, n
//
// The codes and scales are copied bit for bit (no float round trip); qdequantize computes D (q - z) + Mn per value
// in fp32 with D and Mn rebuilt as the kernels rebuild them (fp16 -> fp32, times the K-quants' integer sub-scales),
// the same values ggml's dequantization gives.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "qformats.h"

namespace {

using namespace parrot_kernels::q;

// write GGUF block `bi` (block_values inputs) of the 16 rows `rows[c]` into the column block at `cbp`
void pack_block(const Spec& s, int64_t fmt, const uint8_t* const* rows, int64_t bi, uint8_t* cbp) {
  static thread_local Block blk[kRows];
  for (int c = 0; c < kRows; ++c) decode_block(fmt, rows[c] + bi * s.block_bytes, blk[c]);
  const int64_t groups = s.block_values / 32, g0 = bi * groups;
  if (s.kquant) {
    uint8_t* sh = cbp + super_offset(s, g0);
    std::memset(sh, 0, kSuperBytes);
    for (int c = 0; c < kRows; ++c) {
      std::memcpy(sh + 2 * c, &blk[c].d_half, 2);
      if (fmt != Q6_K) std::memcpy(sh + 32 + 2 * c, &blk[c].dmin_half, 2);
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    uint8_t* gp = cbp + group_offset(s, g0 + j);
    std::memset(gp, 0, s.group_bytes);
    for (int c = 0; c < kRows; ++c) {
      const int32_t* q = blk[c].code + 32 * j;
      for (int i = 0; i < 4; ++i) {
        if (s.bits == 8) {
          for (int v = 0; v < 8; ++v) gp[64 * v + 4 * c + i] = static_cast<uint8_t>(q[4 * v + i]);
          continue;
        }
        for (int v = 0; v < 4; ++v)
          gp[64 * v + 4 * c + i] = static_cast<uint8_t>((q[4 * v + i] & 0xF) | ((q[16 + 4 * v + i] & 0xF) << 4));
        uint8_t* hi = gp + s.hi_offset;
        for (int v = 0; v < 8; ++v) {
          const int top = q[4 * v + i] >> 4;
          if (s.bits == 5) hi[4 * c + i] |= static_cast<uint8_t>((top & 1) << v);
          if (s.bits == 6) hi[64 * (v / 4) + 4 * c + i] |= static_cast<uint8_t>((top & 3) << (2 * (v % 4)));
        }
      }
      uint8_t* sc = gp + s.scale_offset;
      if (s.kquant && fmt == Q6_K) {
        sc[c] = blk[c].sc[2 * j];
        sc[16 + c] = blk[c].sc[2 * j + 1];
      } else if (s.kquant) {
        sc[c] = blk[c].sc[j];
        sc[16 + c] = blk[c].mn[j];
      } else {
        std::memcpy(sc + 2 * c, &blk[c].d_half, 2);
        if (s.asym) std::memcpy(sc + 32 + 2 * c, &blk[c].m_half, 2);
      }
    }
  }
}

// A big packed weight is streamed whole by every matmul: backing it with transparent huge pages (where the OS has
// them, in "madvise" mode as often) spares most TLB misses of that stream and most page faults of the first write.
void advise_huge_pages(uint8_t* p, int64_t n) {
#if defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = 2 << 20;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);  // advice only: failure changes nothing
#endif
}

at::Tensor qpack(at::TensorList raws, at::IntArrayRef fmts, int64_t K) {
  TORCH_CHECK(!raws.empty() && raws.size() == fmts.size() && static_cast<int64_t>(raws.size()) <= kMaxSegments,
              "qpack: 1 to ", kMaxSegments, " raw tensors, one format each");
  TORCH_CHECK(K > 0 && K % 32 == 0, "qpack: K must be a positive multiple of 32, got ", K);
  int64_t hdr[32] = {kMagic, K, 0, static_cast<int64_t>(raws.size())};
  int64_t off = kHeaderBytes;
  std::vector<at::Tensor> rc;
  for (size_t si = 0; si < raws.size(); ++si) {
    const at::Tensor& r = raws[si];
    const int64_t f = fmts[si];
    TORCH_CHECK(known(f), "qpack: segment ", si, " has unsupported format id ", f);
    const Spec s = spec(f);
    TORCH_CHECK(K % s.block_values == 0, "qpack: K = ", K, " is not a multiple of the format's block of ",
                s.block_values);
    TORCH_CHECK(r.dim() == 2 && r.scalar_type() == at::kByte && r.size(1) == K / s.block_values * s.block_bytes,
                "qpack: segment ", si, " must be uint8 [rows, ", K / s.block_values * s.block_bytes, "], got ",
                r.sizes());
    TORCH_CHECK(r.size(0) % kRows == 0 && r.size(0) > 0, "qpack: rows must be a positive multiple of ", kRows,
                ", got ", r.size(0));
    rc.push_back(r.stride(1) == 1 ? r : r.contiguous());
    hdr[4 + 4 * si] = f;
    hdr[5 + 4 * si] = hdr[2];
    hdr[6 + 4 * si] = r.size(0);
    hdr[7 + 4 * si] = off;
    hdr[2] += r.size(0);
    off += (r.size(0) / kRows * column_block_bytes(s, K) + 63) / 64 * 64;
  }
  // every byte is written below (pack_block covers each column block whole): no zero-filled pass first
  at::Tensor out = at::empty({off}, at::TensorOptions().dtype(at::kByte));
  uint8_t* o = out.mutable_data_ptr<uint8_t>();
  advise_huge_pages(o, off);
  std::memset(o, 0, kHeaderBytes);
  std::memcpy(o, hdr, sizeof hdr);
  for (size_t si = 0; si < rc.size(); ++si) {
    const int64_t f = fmts[si];
    const Spec s = spec(f);
    const uint8_t* src = rc[si].const_data_ptr<uint8_t>();
    const int64_t ld = rc[si].stride(0), cbb = column_block_bytes(s, K), nb = K / s.block_values;
    uint8_t* seg = o + hdr[7 + 4 * si];
    const int64_t end = hdr[7 + 4 * si] + rc[si].size(0) / kRows * cbb;
    std::memset(o + end, 0, (si + 1 < rc.size() ? hdr[7 + 4 * (si + 1)] : off) - end);  // the 64-byte alignment pad
    at::parallel_for(0, rc[si].size(0) / kRows, 1, [&](int64_t c0, int64_t c1) {
      const uint8_t* rows[kRows];
      for (int64_t cb = c0; cb < c1; ++cb) {
        for (int c = 0; c < kRows; ++c) rows[c] = src + (cb * kRows + c) * ld;
        for (int64_t bi = 0; bi < nb; ++bi) pack_block(s, f, rows, bi, seg + cb * cbb);
      }
    });
  }
  return out;
}

Header header_of(const at::Tensor& packed, const char* op) {
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous(), op,
              ": the weight must come from qpack (a contiguous uint8 vector)");
  return read_header(packed.const_data_ptr<uint8_t>(), packed.numel());
}

at::Tensor qdequantize(const at::Tensor& packed) {
  const Header h = header_of(packed, "qdequantize");
  at::Tensor w = at::empty({h.N, h.K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* base = packed.const_data_ptr<uint8_t>();
  float* wp = w.mutable_data_ptr<float>();
  at::parallel_for(0, h.N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequant_row(base, h, n, wp + n * h.K);
  });
  return w;
}

at::Tensor qembed(const at::Tensor& packed, const at::Tensor& ids, at::ScalarType dtype) {
  const Header h = header_of(packed, "qembed");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "qembed: ids must be a 1-D int64 tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "qembed: dtype must be float32 or bfloat16");
  const at::Tensor ic = ids.contiguous();
  const int64_t T = ic.numel();
  const int64_t* ip = ic.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ip[t] >= 0 && ip[t] < h.N, "qembed: token id ", ip[t], " outside the table's ", h.N, " rows");
  at::Tensor out = at::empty({T, h.K}, at::TensorOptions().dtype(dtype));
  const uint8_t* base = packed.const_data_ptr<uint8_t>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> row(h.K);
    for (int64_t t = t0; t < t1; ++t) {
      if (dtype == at::kFloat) {
        dequant_row(base, h, ip[t], out.mutable_data_ptr<float>() + t * h.K);
        continue;
      }
      dequant_row(base, h, ip[t], row.data());
      c10::BFloat16* o = out.mutable_data_ptr<c10::BFloat16>() + t * h.K;
      for (int64_t k = 0; k < h.K; ++k) o[k] = c10::BFloat16(row[k]);
    }
  });
  return out;
}

std::vector<int64_t> qinfo(const at::Tensor& packed) {
  const Header h = header_of(packed, "qinfo");
  std::vector<int64_t> out{h.K, h.N};
  for (int64_t s = 0; s < h.nseg; ++s) out.insert(out.end(), {h.seg[s].fmt, h.seg[s].n0, h.seg[s].n});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(parrot_kernels, m) {
  m.def("qpack(Tensor[] raws, int[] fmts, int K) -> Tensor", qpack);
  m.def("qdequantize(Tensor packed) -> Tensor", qdequantize);
  m.def("qembed(Tensor packed, Tensor ids, ScalarType dtype) -> Tensor", qembed);
  m.def("qinfo(Tensor packed) -> int[]", qinfo);
}
