// The GGUF quantization formats the engine runs natively, and the one packed layout its quantized matmul kernels
// (qmm.cpp) read. Shared by the packer (qpack.cpp) and the kernels; no SIMD here.
//
// A format's weights are, per output row n and sub-block j of `sub` consecutive inputs (ggml's dequantization):
//
//     fmt    code q (bits)   sub   weight                          scales as the file stores them
//     Q4_0   0..15 (4)       32    d (q - 8)                       d fp16 per 32
//     Q4_1   0..15 (4)       32    d q + m                         d, m fp16 per 32
//     Q5_0   0..31 (5)       32    d (q - 16)                      d fp16 per 32
//     Q5_1   0..31 (5)       32    d q + m                         d, m fp16 per 32
//     Q8_0   -128..127 (8)   32    d q                             d fp16 per 32
//     Q4_K   0..15 (4)       32    d sc_j q - dmin mn_j            d, dmin fp16 per 256; sc_j, mn_j 6-bit per 32
//     Q5_K   0..31 (5)       32    d sc_j q - dmin mn_j            (as Q4_K)
//     Q6_K   0..63 (6)       16    d sc_j (q - 32)                 d fp16 per 256; sc_j int8 per 16
//
// Every such weight is  D_j (q - z) + Mn_j  with D_j the sub-block's scale (d, or d sc_j: a product of an fp16 and
// a small integer, exact in fp32), z the format's zero point (8, 16, 32; 0 for the asymmetric formats and for Q8_0's
// signed codes) and Mn_j the asymmetric formats' offset (m, or -dmin mn_j). The packed layout keeps the file's codes
// and scales as they are (no float round trip): it only moves them so that one SIMD lane is one output row.
//
// Packed weight (qpack): one uint8 tensor, a 256-byte header then one segment per part of a fused matmul (q | k | v
// may come in different formats):
//
//     header   int64 [32]: magic, K, N, nseg, then per segment s: fmt, n0 (its first output row), n, byte offset
//     segment  [n / 16 column blocks][column block bytes]                       (each segment 64-byte aligned)
//
//     column block (16 output rows = 16 lanes), K inputs:
//         K-quants:   K/256 x [ super header | 8 groups ]      super header 64 bytes: d fp16 [16], dmin fp16 [16]
//                                                                              (Q6_K: d fp16 [16], 32 bytes pad)
//         others:     K/32 groups
//
//     group (16 rows x 32 inputs):
//         codes     4/5/6-bit: 256 bytes = 4 vectors of 64; in vector v, bytes 4c..4c+3 (row c) hold
//                     inputs 4v + i (low nibble) and 16 + 4v + i (high nibble), i = 0..3
//                   8-bit: 512 bytes = 8 vectors of 64; vector s, bytes 4c + i = code of input 4s + i (int8)
//         high bits 5-bit: 64 bytes; byte 4c + i bit s = bit 4 of the code of input 4s + i      (s = 0..7)
//                   6-bit: 128 bytes = 2 vectors; vector h, byte 4c + i bits 2t, 2t + 1 = bits 4, 5 of the code
//                     of input 4 (4h + t) + i                                                   (t = 0..3)
//         scales    Q4_0 / Q5_0 / Q8_0: d fp16 [16];  Q4_1 / Q5_1: d fp16 [16], m fp16 [16];
//                   Q4_K / Q5_K: sc uint8 [16], mn uint8 [16];  Q6_K: sc int8 [16] (inputs 0-15), [16] (16-31)
//
// So a "k-quad" s (inputs 4s .. 4s + 3 of a group) of 16 rows is one 64-byte vector of 16 dwords, each the 4 codes of
// one row: exactly what VPDPBUSD (AVX512-VNNI) and VPMADDUBSW (AVX2, per 8-row half: bytes 32h .. 32h + 31) take.
// Quads 0-3 are inputs 0-15 (a Q6_K sub-block), quads 4-7 inputs 16-31.

#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace parrot_kernels::q {

// ggml's type ids
enum Fmt : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

constexpr int64_t kMagic = 0x31574B50;  // "PKW1"
constexpr int64_t kHeaderBytes = 256;
constexpr int64_t kMaxSegments = 7;
constexpr int64_t kRows = 16;  // output rows per column block (one zmm of int32 / fp32 lanes)

struct Spec {
  int bits = 0;              // code width
  int sub;               // inputs per scale sub-block (16 or 32)
  int zero;              // z: subtracted from the codes (0: none)
  bool asym;             // has the offset Mn
  bool kquant;           // 256-input super-blocks with a header
  int64_t block_values;  // values per GGUF block
  int64_t block_bytes;   // bytes per GGUF block
  int64_t group_bytes;   // packed bytes per group (16 rows x 32 inputs): codes + high bits + scales
  int64_t hi_offset;     // where the high bits start in a group
  int64_t scale_offset;  // where the group's scales start
};

inline bool known(int64_t f) {
  switch (f) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return true;
    default: return false;
  }
}

// the table (constexpr: the kernels are instantiated per format)
constexpr Spec spec_of(int64_t f) {
  switch (f) {
    case Q4_0: return {4, 32, 8, false, false, 32, 18, 288, 256, 256};
    case Q4_1: return {4, 32, 0, true, false, 32, 20, 320, 256, 256};
    case Q5_0: return {5, 32, 16, false, false, 32, 22, 352, 256, 320};
    case Q5_1: return {5, 32, 0, true, false, 32, 24, 384, 256, 320};
    case Q8_0: return {8, 32, 0, false, false, 32, 34, 544, 512, 512};
    case Q4_K: return {4, 32, 0, true, true, 256, 144, 288, 256, 256};
    case Q5_K: return {5, 32, 0, true, true, 256, 176, 352, 256, 320};
    case Q6_K: return {6, 16, 32, false, true, 256, 210, 416, 256, 384};
    default: return {};
  }
}

inline Spec spec(int64_t f) {
  TORCH_CHECK(known(f), "unsupported quantization format id ", f);
  return spec_of(f);
}

constexpr int64_t kSuperBytes = 64;

// bytes of one column block of K inputs
constexpr int64_t column_block_bytes(const Spec& s, int64_t K) {
  return (K / 32) * s.group_bytes + (s.kquant ? (K / 256) * kSuperBytes : 0);
}
// offset of group g within a column block, and of its super header (K-quants)
constexpr int64_t group_offset(const Spec& s, int64_t g) {
  return s.kquant ? (g / 8 + 1) * kSuperBytes + g * s.group_bytes : g * s.group_bytes;
}
constexpr int64_t super_offset(const Spec& s, int64_t g) { return (g / 8) * (kSuperBytes + 8 * s.group_bytes); }

// ---- the header -------------------------------------------------------------------------------------------------
struct Segment {
  int64_t fmt, n0, n, offset;
};
struct Header {
  int64_t K, N, nseg;
  Segment seg[kMaxSegments];
};

inline Header read_header(const uint8_t* p, int64_t nbytes) {
  TORCH_CHECK(nbytes >= kHeaderBytes, "not a packed quantized weight (too short)");
  int64_t h[32];
  std::memcpy(h, p, sizeof h);
  TORCH_CHECK(h[0] == kMagic, "not a packed quantized weight (bad magic): pack it with qpack");
  Header out{h[1], h[2], h[3], {}};
  TORCH_CHECK(out.nseg >= 1 && out.nseg <= kMaxSegments, "packed weight: bad segment count ", out.nseg);
  for (int64_t s = 0; s < out.nseg; ++s) {
    out.seg[s] = {h[4 + 4 * s], h[5 + 4 * s], h[6 + 4 * s], h[7 + 4 * s]};
    const Segment& g = out.seg[s];
    TORCH_CHECK(known(g.fmt) && g.n % kRows == 0 && g.offset + g.n / kRows * column_block_bytes(spec(g.fmt), out.K) <= nbytes,
                "packed weight: corrupt segment ", s);
  }
  return out;
}

// ---- one GGUF block, decoded (scalar; the packer and the reference dequantization use it) ---------------------------
// codes [block_values] in the format's code range (Q8_0: -128..127); D / Mn per sub-block of `sub` values
struct Block {
  int32_t code[256];
  float D[16], Mn[16];
  // the scales as the packed layout stores them
  uint16_t d_half, dmin_half;  // fp16 bits (K-quants: the super-block's; others: the block's d and m)
  uint16_t m_half;
  uint8_t sc[16], mn[16];  // K-quants: the sub-block scales / mins (Q6_K: int8 scales as bytes)
};

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }
inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// ggml's get_scale_min_k4: the j-th 6-bit scale and min of a Q4_K / Q5_K block's 12 scale bytes
inline void scale_min_k4(int j, const uint8_t* q, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = q[j] & 63;
    mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void decode_block(int64_t f, const uint8_t* b, Block& o) {
  switch (f) {
    case Q4_0: case Q4_1: {
      const bool one = f == Q4_1;
      const uint8_t* qs = b + (one ? 4 : 2);
      for (int j = 0; j < 16; ++j) { o.code[j] = qs[j] & 0xF; o.code[j + 16] = qs[j] >> 4; }
      o.d_half = rd16(b);
      o.m_half = one ? rd16(b + 2) : 0;
      o.D[0] = half_to_float(o.d_half);
      o.Mn[0] = one ? half_to_float(o.m_half) : 0.f;
      return;
    }
    case Q5_0: case Q5_1: {
      const bool one = f == Q5_1;
      uint32_t qh;
      std::memcpy(&qh, b + (one ? 4 : 2), 4);
      const uint8_t* qs = b + (one ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        o.code[j] = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
        o.code[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      o.d_half = rd16(b);
      o.m_half = one ? rd16(b + 2) : 0;
      o.D[0] = half_to_float(o.d_half);
      o.Mn[0] = one ? half_to_float(o.m_half) : 0.f;
      return;
    }
    case Q8_0: {
      for (int j = 0; j < 32; ++j) o.code[j] = static_cast<int8_t>(b[2 + j]);
      o.d_half = rd16(b);
      o.m_half = 0;
      o.D[0] = half_to_float(o.d_half);
      o.Mn[0] = 0.f;
      return;
    }
    case Q4_K: case Q5_K: {
      const bool five = f == Q5_K;
      o.d_half = rd16(b);
      o.dmin_half = rd16(b + 2);
      const float d = half_to_float(o.d_half), dmin = half_to_float(o.dmin_half);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int j = 0; j < 8; ++j) {
        scale_min_k4(j, scales, o.sc[j], o.mn[j]);
        o.D[j] = d * static_cast<float>(o.sc[j]);
        o.Mn[j] = -(dmin * static_cast<float>(o.mn[j]));
      }
      for (int i = 0; i < 4; ++i)  // 64 values per 32 code bytes: sub-blocks 2i (low nibbles) and 2i + 1 (high)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * i + l] & 0xF, hi = qs[32 * i + l] >> 4;
          if (five) {
            lo |= ((qh[l] >> (2 * i)) & 1) << 4;
            hi |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
          }
          o.code[64 * i + l] = lo;
          o.code[64 * i + 32 + l] = hi;
        }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      o.d_half = rd16(b + 208);
      const float d = half_to_float(o.d_half);
      for (int j = 0; j < 16; ++j) {
        o.sc[j] = static_cast<uint8_t>(sc[j]);
        o.D[j] = d * static_cast<float>(sc[j]);
        o.Mn[j] = 0.f;
      }
      for (int n = 0; n < 2; ++n)  // two halves of 128 values: ql 64 bytes, qh 32 bytes each
        for (int l = 0; l < 32; ++l) {
          const uint8_t* L = ql + 64 * n;
          const uint8_t h = qh[32 * n + l];
          o.code[128 * n + l] = (L[l] & 0xF) | ((h & 3) << 4);
          o.code[128 * n + l + 32] = (L[l + 32] & 0xF) | (((h >> 2) & 3) << 4);
          o.code[128 * n + l + 64] = (L[l] >> 4) | (((h >> 4) & 3) << 4);
          o.code[128 * n + l + 96] = (L[l + 32] >> 4) | (((h >> 6) & 3) << 4);
        }
      return;
    }
    default: TORCH_CHECK(false, "unsupported quantization format id ", f);
  }
}

// ---- the packed layout, read back (scalar: the packer's check, the reference kernel, the dequantization) ----------
// D[h][c], Mn[h][c] of group g's sub-blocks h (h = 0 only for 32-input sub-blocks) for rows c of the column block
struct GroupScales {
  float D[2][kRows], Mn[2][kRows];
};

inline void group_scales(const Spec& s, int64_t fmt, const uint8_t* cbp, int64_t g, GroupScales& o) {
  const uint8_t* sc = cbp + group_offset(s, g) + s.scale_offset;
  const uint8_t* sh = s.kquant ? cbp + super_offset(s, g) : nullptr;
  for (int c = 0; c < kRows; ++c) {
    if (fmt == Q6_K) {
      const float d = half_to_float(rd16(sh + 2 * c));
      o.D[0][c] = d * static_cast<float>(static_cast<int8_t>(sc[c]));
      o.D[1][c] = d * static_cast<float>(static_cast<int8_t>(sc[16 + c]));
      o.Mn[0][c] = o.Mn[1][c] = 0.f;
    } else if (s.kquant) {
      o.D[0][c] = o.D[1][c] = half_to_float(rd16(sh + 2 * c)) * static_cast<float>(sc[c]);
      o.Mn[0][c] = o.Mn[1][c] = -(half_to_float(rd16(sh + 32 + 2 * c)) * static_cast<float>(sc[16 + c]));
    } else {
      o.D[0][c] = o.D[1][c] = half_to_float(rd16(sc + 2 * c));
      o.Mn[0][c] = o.Mn[1][c] = s.asym ? half_to_float(rd16(sc + 32 + 2 * c)) : 0.f;
    }
  }
}

// the code of row c, input k (0..31) of the group at gp (Q8_0: signed)
inline int32_t code_at(const Spec& s, const uint8_t* gp, int c, int k) {
  const int v = k / 4, i = k % 4;
  if (s.bits == 8) return static_cast<int8_t>(gp[64 * v + 4 * c + i]);
  const uint8_t byte = gp[64 * (v % 4) + 4 * c + i];
  int32_t q = v < 4 ? (byte & 0xF) : (byte >> 4);
  if (s.bits == 5) q |= ((gp[s.hi_offset + 4 * c + i] >> v) & 1) << 4;
  if (s.bits == 6) q |= ((gp[s.hi_offset + 64 * (v / 4) + 4 * c + i] >> (2 * (v % 4))) & 3) << 4;
  return q;
}

// the float32 weights D (q - z) + Mn of row c over group g of the column block at cbp -> w[0..32)
inline void dequant_group(const Spec& s, int64_t fmt, const uint8_t* cbp, int64_t g, int c, float* w) {
  GroupScales gs;
  group_scales(s, fmt, cbp, g, gs);
  const uint8_t* gp = cbp + group_offset(s, g);
  for (int k = 0; k < 32; ++k) {
    const int h = k / 16;
    w[k] = gs.D[h][c] * static_cast<float>(code_at(s, gp, c, k) - s.zero) + gs.Mn[h][c];
  }
}

// row n (0 <= n < N) of the packed weight at base -> K floats
inline void dequant_row(const uint8_t* base, const Header& h, int64_t n, float* w) {
  for (int64_t si = 0; si < h.nseg; ++si) {
    const Segment& g = h.seg[si];
    if (n < g.n0 || n >= g.n0 + g.n) continue;
    const Spec s = spec(g.fmt);
    const int64_t r = n - g.n0;
    const uint8_t* cbp = base + g.offset + (r / kRows) * column_block_bytes(s, h.K);
    for (int64_t gi = 0; gi < h.K / 32; ++gi) dequant_group(s, g.fmt, cbp, gi, static_cast<int>(r % kRows), w + 32 * gi);
    return;
  }
  TORCH_CHECK(false, "row ", n, " outside the packed weight's ", h.N, " rows");
}

}  // namespace parrot_kernels::q
