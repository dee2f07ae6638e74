// Mixed weights: several quantized weights side by side, each in its own stored format.
//
// One product for several projections of the same input (the Gated DeltaNet's qkv, gate,
// alpha and beta) needs one weight; a GGUF file may store its parts in different formats:
// llama-quantize's Q4_K_M writes Qwen3.5's attn_qkv in Q6_K and attn_gate, ssm_alpha and
// ssm_beta in Q4_K in the first, the last and every third layer. No stored format holds both
// exactly (q6 has no t, q4k no per-half scale), so such a projection was served dequantized
//. A mixed weight keeps each part in its blocks instead: its columns are
// the parts' columns in order, each part multiplied by its own product (quant_mm), which is
// exactly what that part's product alone gives, so it is batch-invariant as they are.
//
// Layout: a kShort tensor [L, N, 2] (N the columns of all parts; L enough rows for the
// bytes), whose first int64s are a header, kMixedMagic, P, then for each part its columns,
// its dtype (0: kChar, 1: kByte) and its stored rows; each part's bytes (pack_quantized's
// [rows, n, 4]) follow at a 64-byte boundary, in order.
#pragma once

#include <vector>

#include "gemm.h"

namespace linserve {

constexpr int64_t kMixedMagic = 0x4c534d4958454431;  // "LSMIXED1"

inline int64_t round_up_64(int64_t n) { return (n + 63) / 64 * 64; }

// One part of a mixed weight: its columns from col0 and its packed bytes, as a tensor view.
struct MixedPart {
  int64_t col0;
  at::Tensor w;
};

inline bool is_mixed(const at::Tensor& w) {
  return w.scalar_type() == at::kShort && w.dim() == 3 && w.numel() >= 2 &&
         reinterpret_cast<const int64_t*>(w.data_ptr())[0] == kMixedMagic;
}

// The parts of a mixed weight, as views of its bytes.
inline std::vector<MixedPart> mixed_parts(const at::Tensor& w) {
  const auto* head = reinterpret_cast<const int64_t*>(w.data_ptr());
  auto* base = static_cast<uint8_t*>(w.data_ptr());
  const int64_t parts = head[1];
  int64_t offset = round_up_64((2 + 3 * parts) * 8), col0 = 0;
  std::vector<MixedPart> out;
  for (int64_t i = 0; i < parts; ++i) {
    const int64_t n = head[2 + 3 * i], rows = head[3 + 3 * i + 1];
    const auto dtype = head[2 + 3 * i + 1] == 0 ? at::kChar : at::kByte;
    out.push_back({col0, at::from_blob(base + offset, {rows, n, 4}, at::TensorOptions().dtype(dtype))});
    offset += round_up_64(rows * n * 4);
    col0 += n;
  }
  return out;
}

// Packed quantized weights (pack_quantized's, each [rows_i, n_i, 4]) of one K -> a mixed
// weight of their columns side by side.
inline at::Tensor join_quantized(const std::vector<at::Tensor>& parts) {
  TORCH_CHECK(!parts.empty(), "join_quantized takes at least one part");
  const int64_t header = round_up_64((2 + 3 * static_cast<int64_t>(parts.size())) * 8);
  int64_t bytes = header, n = 0;
  for (const at::Tensor& p : parts) {
    TORCH_CHECK(p.dim() == 3 && p.size(2) == 4 && p.is_contiguous() &&
                    (p.scalar_type() == at::kChar || p.scalar_type() == at::kByte),
                "join_quantized takes pack_quantized's weights");
    bytes += round_up_64(p.numel());
    n += p.size(1);
  }
  const int64_t rows = (bytes + n * 4 - 1) / (n * 4);
  at::Tensor out = at::zeros({rows, n, 2}, at::TensorOptions().dtype(at::kShort));
  auto* head = reinterpret_cast<int64_t*>(out.data_ptr());
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  head[0] = kMixedMagic;
  head[1] = static_cast<int64_t>(parts.size());
  int64_t offset = header;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    head[2 + 3 * i] = p.size(1);
    head[3 + 3 * i] = p.scalar_type() == at::kChar ? 0 : 1;
    head[4 + 3 * i] = p.size(0);
    std::memcpy(base + offset, p.data_ptr(), p.numel());
    offset += round_up_64(p.numel());
  }
  return out;
}

// y = a @ W (or y +=) for a mixed weight: each part's product into its columns.
inline void mixed_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y, bool accumulate) {
  TORCH_CHECK(is_mixed(w), "mixed_mm: a kShort weight that join_quantized did not make");
  TORCH_CHECK(y.size(0) == a.size(0) && y.size(1) == w.size(1), "mixed_mm: shapes disagree");
  for (const MixedPart& part : mixed_parts(w)) {
    const int64_t n = part.w.size(1);
    at::Tensor out = at::empty({a.size(0), n}, a.options());
    quant_mm(a, part.w, out, false);
    at::Tensor dest = y.narrow(1, part.col0, n);
    if (accumulate) {
      dest.add_(out);
    } else {
      dest.copy_(out);
    }
  }
}

}  // namespace linserve
