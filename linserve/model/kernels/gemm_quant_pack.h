// Packing model/quantize.py's q and scales, or a GGUF file's blocks, into the formats'
// layout.
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include "gemm_quant.h"

namespace linserve {

struct StridedBytes {
  const uint8_t* p;
  int64_t s0, s1, s2, e;  // strides in elements, element size in bytes
  const uint8_t* at(int64_t i, int64_t j, int64_t k = 0) const {
    return p + (i * s0 + j * s1 + k * s2) * e;
  }
};

inline StridedBytes strided(const at::Tensor& t) {
  const int64_t d = t.dim();
  return {static_cast<const uint8_t*>(t.data_ptr()), t.stride(0), t.stride(1),
          d > 2 ? t.stride(2) : 0, static_cast<int64_t>(t.element_size())};
}

// A panel's super-block pairs: parts 2 and 3 (d and e) of each super-block's first block.
inline void pack_pairs(const StridedBytes& pv, int64_t blocks, int64_t sb, int64_t p0,
                       int64_t width, uint8_t* out) {
  for (int64_t sp = 0; sp < blocks / sb; ++sp)
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t c = 0; c < width; ++c)
        std::memcpy(out + ((2 * sp + e) * width + c) * 4, pv.at(2 + e, sp * sb, p0 + c), 4);
}

// One block's 32 values q into column c of its stored rows at `blk` (a panel `width` wide):
// bytes q + 128, or (`nib`) pairs of inputs 4 apart as nibbles q + `offset`.
inline void store_rows(const int8_t* q, bool nib, int32_t offset, int64_t c, int64_t width,
                       uint8_t* blk) {
  const int64_t per = nib ? kBlock / 8 : kBlock / 4;
  for (int64_t t = 0; t < per; ++t)
    for (int64_t i = 0; i < 4; ++i) {
      uint8_t* lane = blk + t * width * 4 + i + 4 * c;
      *lane = nib ? static_cast<uint8_t>((q[8 * t + i] + offset) | ((q[8 * t + i + 4] + offset) << 4))
                  : static_cast<uint8_t>(q[4 * t + i] + 128);
    }
}

// One block's 32 values q (in [-32, 31]) into column c of kQ6S's stored rows at `blk`: the
// nibbles of q + 32 as int4's, then the two rows of high bits (see the layout above).
inline void store_six_rows(const int8_t* q, int64_t c, int64_t width, uint8_t* blk) {
  uint32_t high[kSixRows] = {};
  for (int64_t t = 0; t < kSteps<kQ6S>; ++t) {  // inputs 8t .. 8t + 7, a byte each, as q + 32
    uint64_t v;
    std::memcpy(&v, q + 8 * t, 8);
    // q + 32 in each byte without a carry between bytes (the low 7 bits added, the top
    // bit's sum put back by xor)
    v = ((v & 0x7F7F7F7F7F7F7F7Full) + 0x2020202020202020ull) ^ (v & 0x8080808080808080ull);
    const uint64_t nib = v & 0x0F0F0F0F0F0F0F0Full, crumbs = (v >> 4) & 0x0303030303030303ull;
    const uint32_t row = static_cast<uint32_t>(nib) | (static_cast<uint32_t>(nib >> 32) << 4);
    std::memcpy(blk + t * width * 4 + 4 * c, &row, 4);  // (little-endian: byte i, input i)
    const int shift = 4 * static_cast<int>(t & 1);
    high[t / 2] |= (static_cast<uint32_t>(crumbs) << shift) |
                   (static_cast<uint32_t>(crumbs >> 32) << (shift + 2));
  }
  for (int64_t u = 0; u < kSixRows; ++u)
    std::memcpy(blk + (kSteps<kQ6S> + u) * width * 4 + 4 * c, &high[u], 4);
}

// One block's 32 values into column c of its stored rows, in `format` (store_rows with its
// offset, or store_six_rows).
inline void store_block(const int8_t* q, int format, int64_t c, int64_t width, uint8_t* blk) {
  if (format == kQ6S) return store_six_rows(q, c, width, blk);
  const bool nib = format == kQInt4 || format == kQ4K || format == kQ4L;
  store_rows(q, nib, format == kQInt4 ? 8 : 0, c, width, blk);
}

// One block's stored rows of a panel: q's 32 inputs from k0 for the panel's columns
// (store_block, a column at a time).
inline void pack_block_rows(const StridedBytes& q, int64_t k0, int64_t p0, int64_t width,
                            int format, uint8_t* blk) {
  int8_t column[kBlock];
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t k = 0; k < kBlock; ++k) column[k] = static_cast<int8_t>(*q.at(k0 + k, p0 + c));
    store_block(column, format, c, width, blk);
  }
}

// The block-scaled formats' panels (see the layout above) written straight from q [K, N]
// int8 (K a multiple of 32) and `parts` [P, K / 32, N]: fp16 scales, or the K formats' four
// fp32 numbers (two multipliers, stored as bytes, and the super-block's d and e), into out
// (column_bytes x N bytes); a task per panel. Either may be a strided view (StridedBytes).
// (Built from tensor ops, with an int32 copy of q and its permutes, packing took 2.9 s of a
// 0.8B Q4_K_M file's 16 s load.)
inline void pack_blocks(const at::Tensor& q, const at::Tensor& parts, int format, uint8_t* out) {
  const int64_t k_len = q.size(0), n = q.size(1), blocks = k_len / kBlock;
  const int64_t bb = block_bytes(format), sb = super_blocks(format);
  const StridedBytes qv = strided(q), pv = strided(parts);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t p0 = p * kPanel, width = std::min(kPanel, n - p0);
      uint8_t* panel = out + p0 * column_bytes(format, blocks);
      if (has_super(format)) pack_pairs(pv, blocks, sb, p0, width, panel);
      uint8_t* first = panel + (has_super(format) ? blocks / sb * 8 * width : 0);
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = first + b * bb * width;
        pack_block_rows(qv, b * kBlock, p0, width, format, blk);
        uint8_t* tail = blk + (bb - 2) * width;
        if (!has_super(format)) {  // the block's fp16 scales
          for (int64_t c = 0; c < width; ++c)
            std::memcpy(tail + c * pv.e, pv.at(0, b, p0 + c), pv.e);
          continue;
        }
        for (int64_t m = 0; m < 2; ++m)  // its two multipliers, as bytes
          for (int64_t c = 0; c < width; ++c) {
            float f;
            std::memcpy(&f, pv.at(m, b, p0 + c), 4);
            tail[m * width + c] = static_cast<uint8_t>(static_cast<int32_t>(f));
          }
      }
    }
  });
}

// q [K, N] int8 and its scales -> the stored format (QFormat): int8 (q in [-127, 127], fp32
// scales [N]), int4 (q in [-8, 7], fp16 scales [K / 32, N]), q8 (q in [-127, 127], fp16
// scales [K / 32, N]: llama.cpp's Q8_0 blocks, values as they are), or the K formats, W = s q
// + t with [4, K / 32, N] fp32 (m_s, m_t, d, e): s = m_s d, t = m_t e, d and e the same
// across each super-block, m_s and m_t integers in [0, 255]: q4k and q4l (q in [0, 15]),
// q8k and q8l (q in [-128, 127]); or q6 (q in [-128, 127], W = s_h q, s_h = m_h d with the
// multipliers of each half of 16 in [-128, 127], e unused; stored as q6s where kQ6Stored
// says so, and as q6s wherever format 8 is asked for).
inline at::Tensor pack_quantized(const at::Tensor& q, const at::Tensor& scales, int64_t format) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_quantized takes q [K, N] int8");
  TORCH_CHECK(format >= kQInt8 && format <= kQ6S,
              "pack_quantized: format is 0 (int8), 1 (int4), 2 (q8), 3 (q4k), 4 (q8k), 5 (q6), "
              "6 (q4l), 7 (q8l) or 8 (q6s)");
  if (format == kQ6) format = kQ6Stored;  // Q6_K as this build stores it
  const int64_t k_len = q.size(0), n = q.size(1);
  const bool k_format = has_super(static_cast<int>(format));
  const bool ok = format == kQInt8 ? scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                                         scales.size(0) == n
                  : k_format ? scales.scalar_type() == at::kFloat && scales.dim() == 3 &&
                                   scales.size(0) == 4 && scales.size(1) == k_len / kBlock &&
                                   scales.size(2) == n && holds(static_cast<int>(format), k_len)
                             : scales.scalar_type() == at::kHalf && scales.dim() == 2 &&
                                   k_len % kBlock == 0 && scales.size(0) == k_len / kBlock &&
                                   scales.size(1) == n;
  TORCH_CHECK(ok, "pack_quantized: int8 scales are fp32 [N], int4 and q8 scales fp16 [K / 32, "
              "N], the K formats' fp32 [4, K / 32, N] (K a multiple of 256 for q4k, q8k, q6)");
  at::Tensor flat = at::zeros({quant_rows_of(k_len, format) * n * 4}, q.options().dtype(at::kByte));
  if (format != kQInt8) {  // q and the scales read in place, whatever their strides
    const at::Tensor parts = k_format ? scales : scales.unsqueeze(0);
    pack_blocks(q, parts, static_cast<int>(format), flat.data_ptr<uint8_t>());
  } else {
    const int64_t k32 = (k_len + kBlock - 1) / kBlock * kBlock;
    at::Tensor u = at::full({k32, n}, 128, q.options().dtype(at::kInt));
    u.narrow(0, 0, k_len).copy_(q.to(at::kInt) + 128);
    const at::Tensor panels = panelize(u.view({k32 / 4, 4, n}).permute({0, 2, 1}).to(at::kByte));
    const at::Tensor body = at::cat({panels.view({-1}), scales.contiguous().view(at::kByte).view({-1})});
    flat.narrow(0, 0, body.numel()).copy_(body);
  }
  flat = flat.view({-1, n, 4});
  return stored_as_char(static_cast<int>(format)) ? flat.view(at::kChar) : flat;
}

}  // namespace linserve
