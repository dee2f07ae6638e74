// A GGUF file's blocks (llama.cpp's Q4_K, Q5_K and Q6_K super-blocks of 256 inputs, its
// Q4_0 and Q8_0 blocks of 32) read straight into the quantized GEMM's stored formats
// (gemm_quant.h's q4k, q8k, q6, int4 and q8), for the load of a GGUF file.
//
// The same bytes as pack_quantized given model/gguf/checkpoint.py's block_values (q, and
// the multipliers m_s, m_t and the super-block's d and e, or a block's fp16 d): the tests
// compare the two. Here each output row's blocks are decoded and written into its column
// of the panel, one pass over the file's bytes. Through block_values (PyTorch and numpy
// unpacking, an int8 copy of every value and fp32 scales, then the packer reading them
// transposed) the 0.8B shapes' Q4_K_M file took 3.9 s of its 5.5 s load.
//
//   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
//     nibbles; W = (sc d) q - (mn dmin), q in [0, 15]; stored as q4k, e = -dmin.
//   Q5_K (176 bytes): Q4_K's with 32 bytes of high bits before the nibbles; q in [0, 31];
//     stored as q8k (bytes q + 128).
//   Q6_K (210 bytes): 128 bytes of low nibbles, 64 of two high bits, 16 int8 scales (one a
//     16 inputs), fp16 d; W = (sc d) q, q in [-32, 31]; stored as q6s (six bits; q6, bytes
//     q + 128, on VNNI builds: kQ6Stored), its multipliers each half's scale, e = 0.
//   Q4_0 (18 bytes): fp16 d, 16 bytes: input j the low nibble of byte j, j + 16 its high
//     one; W = d (nibble - 8); stored as int4 (the nibbles as they are).
//   Q8_0 (34 bytes): fp16 d, 32 int8 q; W = d q; stored as q8 (bytes q + 128; the caller
//     keeps a matrix holding -128 off this path, checkpoint.py's native_blocks).
// Value orders are llama.cpp's dequantize_row_q4_K / _q5_K / _q6_K / _q4_0 / _q8_0.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "gemm_quant.h"

namespace linserve {

// ggml's type numbers of the formats packed here.
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ8_0 = 8, kGgmlQ4K = 12, kGgmlQ5K = 13, kGgmlQ6K = 14;

// One super-block decoded: its 256 values as the stored format takes them, the two
// multipliers of each of its 8 blocks (as bytes: q6's are signed) and the pair (d, e).
struct SuperBlock {
  int8_t q[256];
  uint8_t ms[8], mt[8];
  float d, e;
};

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// llama.cpp's get_scale_min_k4: block j's 6-bit scale and min from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
    mn = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Q4_K and Q5_K (`five`): d, dmin, the scales, (Q5_K's high bits,) the nibbles.
inline void decode_q45_k(const uint8_t* b, bool five, SuperBlock& out) {
  out.d = fp16_at(b);
  out.e = -fp16_at(b + 2);
  for (int j = 0; j < 8; ++j) scale_min_k4(j, b + 4, out.ms[j], out.mt[j]);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int c = 0; c < 4; ++c)  // four runs of 64: 32 bytes' low nibbles, then their high ones
    for (int l = 0; l < 32; ++l) {
      int lo = qs[32 * c + l] & 15, hi = qs[32 * c + l] >> 4;
      if (five) {
        lo |= ((qh[l] >> (2 * c)) & 1) << 4;
        hi |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
      }
      out.q[64 * c + l] = static_cast<int8_t>(lo);
      out.q[64 * c + 32 + l] = static_cast<int8_t>(hi);
    }
}

// Q6_K's 256 values into q (as llama.cpp's dequantize_row_q6_K orders them).
inline void q6_k_values_of(const uint8_t* b, int8_t* q) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, q += 128)
    for (int l = 0; l < 32; ++l) {
      q[l] = static_cast<int8_t>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
      q[l + 32] = static_cast<int8_t>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
      q[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      q[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
}

inline void decode_q6_k(const uint8_t* b, SuperBlock& out) {
  q6_k_values_of(b, out.q);
  for (int j = 0; j < 8; ++j) {  // each block's halves' int8 scales, kept as their bytes
    out.ms[j] = b[192 + 2 * j];
    out.mt[j] = b[192 + 2 * j + 1];
  }
  out.d = fp16_at(b + 208);
  out.e = 0.0f;
}

inline void decode_k(const uint8_t* b, int64_t type, SuperBlock& out) {
  if (type == kGgmlQ6K) return decode_q6_k(b, out);
  decode_q45_k(b, type == kGgmlQ5K, out);
}

// One super-block into column c of a panel `width` wide (gemm_quant.h's layout: the pairs
// at `panel`, the blocks from `first`).
inline void store_super_block(const SuperBlock& sb, int64_t sp, int64_t c, int64_t width,
                              int format, uint8_t* panel, uint8_t* first) {
  std::memcpy(panel + ((2 * sp) * width + c) * 4, &sb.d, 4);
  std::memcpy(panel + ((2 * sp + 1) * width + c) * 4, &sb.e, 4);
  const int64_t bb = block_bytes(format);
  for (int64_t j = 0; j < 8; ++j) {
    uint8_t* blk = first + (8 * sp + j) * bb * width;
    store_block(sb.q + 32 * j, format, c, width, blk);
    uint8_t* tail = blk + (bb - 2) * width;
    tail[c] = sb.ms[j];
    tail[width + c] = sb.mt[j];
  }
}

// A Q4_0 (`four`) or Q8_0 block into column c of block `blk` of a panel `width` wide: its
// stored rows, then its fp16 d as it is.
inline void store_legacy_block(const uint8_t* b, bool four, int64_t c, int64_t width,
                               uint8_t* blk) {
  int8_t q[32];
  for (int j = 0; j < (four ? 16 : 32); ++j) {
    if (four) {
      q[j] = static_cast<int8_t>((b[2 + j] & 15) - 8);
      q[j + 16] = static_cast<int8_t>((b[2 + j] >> 4) - 8);
    } else {
      q[j] = static_cast<int8_t>(b[2 + j]);
    }
  }
  store_rows(q, four, 8, c, width, blk);
  std::memcpy(blk + (four ? kBlock / 8 : kBlock / 4) * 4 * width + 2 * c, b, 2);
}

// The stored format of a ggml type, and its block's bytes and inputs.
struct GgmlBlocks {
  int format;
  int64_t bytes, inputs;
};

inline GgmlBlocks ggml_blocks(int64_t type) {
  switch (type) {
    case kGgmlQ4_0: return {kQInt4, 18, 32};
    case kGgmlQ8_0: return {kQ8, 34, 32};
    case kGgmlQ4K: return {kQ4K, 144, 256};
    case kGgmlQ5K: return {kQ8K, 176, 256};
    case kGgmlQ6K: return {kQ6Stored, 210, 256};
    default: TORCH_CHECK(false, "pack_gguf takes Q4_0 (2), Q8_0 (8), Q4_K (12), Q5_K (13) or "
                         "Q6_K (14) blocks, not type ", type);
  }
}

// raw [N, row bytes] uint8 (a GGUF matrix's rows, each of blocks of `type`) -> the stored
// weight pack_quantized would make of its values.
inline at::Tensor pack_gguf(const at::Tensor& raw, int64_t type) {
  const GgmlBlocks g = ggml_blocks(type);
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.size(1) % g.bytes == 0 && raw.size(1) > 0,
              "pack_gguf takes contiguous uint8 rows [N, K / block inputs x block bytes]");
  const int64_t n = raw.size(0), units = raw.size(1) / g.bytes, k_len = units * g.inputs;
  const int64_t blocks = k_len / kBlock, bb = block_bytes(g.format);
  const bool super = has_super(g.format);
  at::Tensor flat = at::zeros({quant_rows_of(k_len, g.format) * n * 4}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* out = flat.data_ptr<uint8_t>();
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    SuperBlock sb;
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t p0 = p * kPanel, width = std::min(kPanel, n - p0);
      uint8_t* panel = out + p0 * column_bytes(g.format, blocks);
      uint8_t* first = panel + (super ? units * 8 * width : 0);
      for (int64_t c = 0; c < width; ++c) {
        const uint8_t* row = src + (p0 + c) * raw.size(1);
        for (int64_t u = 0; u < units; ++u) {
          if (!super) {
            store_legacy_block(row + u * g.bytes, type == kGgmlQ4_0, c, width, first + u * bb * width);
            continue;
          }
          decode_k(row + u * g.bytes, type, sb);
          store_super_block(sb, u, c, width, g.format, panel, first);
        }
      }
    }
  });
  flat = flat.view({-1, n, 4});
  return stored_as_char(g.format) ? flat.view(at::kChar) : flat;
}

// Whether a Q8_0 matrix's rows [N, row bytes] hold a value of -128 (a byte 0x80 after a
// block's fp16 d): such a matrix is dequantized (the AVX2 product takes each value's sign
// apart, and -128 has no positive twin). In PyTorch, a strided compare over the values took
// 1.7 s of a 0.8B Q8_0 file's load.
inline bool q8_0_holds_minus_128(const at::Tensor& raw) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
                  raw.size(1) % 34 == 0,
              "q8_0_holds_minus_128 takes contiguous uint8 rows of Q8_0 blocks");
  const int64_t blocks = raw.numel() / 34;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  std::atomic<bool> found{false};
  at::parallel_for(0, blocks, 1 << 14, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1 && !found.load(std::memory_order_relaxed); ++b) {
      const uint8_t* v = src + b * 34 + 2;
      uint8_t hit = 0;
      for (int j = 0; j < 32; ++j) hit |= static_cast<uint8_t>(v[j] == 0x80);
      if (hit) found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

}  // namespace linserve
