// Token embeddings read from a tied model's LM head, so the table is held once.
//
// A tied model's embedding table E [V, d] and its head W = Eᵀ [d, V] are the same numbers.
// The head is the GEMM weight the step streams every token, packed (gemm.h's column panels)
// and possibly quantized (gemm_quant.h); keeping E beside it doubled the largest tensor of a
// 250k-vocabulary model (Qwen3.5-0.8B: 508 MB in bf16). Here a token's embedding is column t
// of W, gathered from whichever format W is stored in, as llama.cpp's get_rows reads a
// quantized token_embd:
// - fp32 / bf16 [K, N] row-major, or [K', N, J] panels from pack_weight: the exact values;
// - int8 (kChar [K32/4 + 1, N, 4]): (q - 128) s[n], the value the GEMM multiplies by;
// - int4, q8 and the K formats (kByte): as block_column below.
// A plain table [V, d] (an untied model) is read by rows as before.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "gemm.h"

namespace linserve {

// Input k of column c of a pack_weight'ed or row-major fp32 / bf16 weight, as fp32.
template <typename W>
inline float dense_value(const Weights<W>& w, int64_t k, int64_t c);

template <>
inline float dense_value<float>(const Weights<float>& w, int64_t k, int64_t c) {
  int64_t ld;
  return w.at(c, &ld)[k * ld];
}

template <>
inline float dense_value<uint16_t>(const Weights<uint16_t>& w, int64_t k, int64_t c) {
  int64_t ld;
  const uint16_t* col = w.at(c, &ld);
  const uint32_t bits = static_cast<uint32_t>(col[(k / w.j) * ld + k % w.j]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Column c of an int8 weight (gemm_quant.h's layout) into out[0, d).
inline void int8_column(const uint8_t* base, int64_t n, int64_t k32, int64_t c, int64_t d,
                        float* out) {
  const int64_t rows = k32 / 4, p0 = c / kPanel * kPanel, width = std::min(kPanel, n - p0);
  const uint8_t* col = base + p0 * rows * 4 + (c - p0) * 4;
  float scale;
  std::memcpy(&scale, base + rows * n * 4 + c * 4, sizeof(scale));
  for (int64_t k = 0; k < d; ++k)
    out[k] = static_cast<float>(static_cast<int32_t>(col[(k / 4) * width * 4 + k % 4]) - 128) *
             scale;
}

// Column c of a block-scaled weight (gemm_quant.h's QFormat) into out[0, d): blocks of 32
// inputs, each its stored rows of [width, 4] bytes (nibbles: inputs 8t..8t+3 in the low
// nibbles, 8t+4..8t+7 in the high ones; bytes: inputs 4t..4t+3) and then its scales. int4:
// (nibble - 8) s; q8: (byte - 128) s; q4k, q4l: nibble s + t; q8k, q8l: (byte - 128) s + t;
// q6: (byte - 128) s_h, s_h the scale of the input's half of the block; q6s: its six bits
// (gemm_quant.h's six_bits) - 32, times s_h.
inline void block_column(const QuantWeights& w, int64_t c, int64_t d, float* out) {
  const QCol col = column(w, c);
  const int f = w.format;
  const bool six = f == kQ6S;
  const bool nib = f == kQInt4 || f == kQ4K || f == kQ4L || six, q6 = f == kQ6 || six;
  const bool k = has_super(f) && !q6;
  const int32_t offset = f == kQInt4 ? 8 : six ? 32 : nib ? 0 : 128;
  for (int64_t b = 0; b < w.k32 / 32 && b * 32 < d; ++b) {
    const float t = k ? k_min<kQ4K>(col, b) : 0.f;
    for (int64_t i = 0; i < 32 && b * 32 + i < d; ++i) {
      const float scale = k ? k_scale<kQ4K>(col, b) : q6 ? k_scale<kQ6>(col, b, i / 16)
                                                         : half_to_float(*group_scales(col, b));
      const int64_t r = nib ? i / 8 : i / 4, within = nib ? i % 8 : i % 4;
      const uint8_t byte = col.q[b * col.block + r * col.ld + within % 4];
      const int64_t high_row = kSteps<kQ6S> + r / 2;  // (q6s: the row's high bits)
      const uint32_t high = six ? col.q[b * col.block + high_row * col.ld + within % 4] : 0;
      const int32_t v = static_cast<int32_t>(
          six ? six_bits<uint32_t>(byte, high, r, within / 4)
              : nib ? (within < 4 ? (byte & 0xF) : (byte >> 4)) : byte) - offset;
      out[b * 32 + i] = static_cast<float>(v) * scale + t;  // the product is exact
    }
  }
}

// The embeddings of ``tokens`` [B] as fp32 rows [B, d]: from a plain table [V, d], or (with
// ``from_head``) from a tied head in any of the formats above.
inline at::Tensor embed_rows(const at::Tensor& table, const at::Tensor& tokens, int64_t d,
                             bool from_head) {
  if (!from_head) return table.index_select(0, tokens).to(at::kFloat).contiguous();
  TORCH_CHECK(table.is_contiguous() && tokens.scalar_type() == at::kLong,
              "embed_rows: a contiguous head and int64 tokens");
  const int64_t n = table.size(1), count = tokens.numel();
  at::Tensor out = at::empty({count, d}, table.options().dtype(at::kFloat));
  const at::Tensor ids = tokens.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < n, "embed_rows: token id out of range");
  float* y = out.data_ptr<float>();
  const auto type = table.scalar_type();
  const bool packed = table.dim() == 3;
  const int64_t j = packed ? table.size(2) : 1;
  const bool quant = type == at::kChar || type == at::kByte;
  const int format = quant ? quant_format(table, d) : -1;
  TORCH_CHECK(!quant || format >= 0, "embed_rows: the head's stored format does not match d");
  at::parallel_for(0, count, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = y + r * d;
      if (quant) {
        const int64_t k32 = (d + 31) / 32 * 32;
        const auto* base = reinterpret_cast<const uint8_t*>(table.data_ptr());
        if (format == kQInt8) int8_column(base, n, k32, id[r], d, row);
        else block_column(QuantWeights{base, n, k32, format}, id[r], d, row);
      } else if (type == at::kBFloat16) {
        const Weights<uint16_t> w{reinterpret_cast<const uint16_t*>(table.data_ptr()),
                                  table.size(0), n, j, packed};
        for (int64_t k = 0; k < d; ++k) row[k] = dense_value(w, k, id[r]);
      } else {
        const Weights<float> w{table.data_ptr<float>(), table.size(0), n, j, packed};
        for (int64_t k = 0; k < d; ++k) row[k] = dense_value(w, k, id[r]);
      }
    }
  });
  return out;
}

}  // namespace linserve
