// int8 and int4 GEMMs: y [B, N] (+)= x [B, K] @ dequant(Q), integer dot products with the
// activations quantized per row to int8 in blocks of 32 (llama.cpp's Q8_0 rule, as its
// Q8_0 and Q4_0 dot products do), fp32 accumulation across blocks (``--quantization``).
//
// Why integers for the activations too: with the weights widened to bf16 for vdpbf16ps, a
// batch-1 step was bound by the widening (int4: a table lookup per 32 weights), not by the
// memory it reads (0.71 of the read roofline). vpdpbusd takes bytes as they are stored: 64
// products an instruction, twice vdpbf16ps's, and an int4 nibble needs one AND (and a shift).
//
// Weights (built by pack_quantized, from model/quantize.py's q and scales):
// - int8 (a kChar tensor): q [K, N] in [-127, 127], one fp32 scale per output column,
//   W[k, n] = q[k, n] s[n]. Stored as bytes q + 128.
// - int4 (a kByte tensor): q [K, N] in [-8, 7], an fp16 scale per group of 32 inputs and
//   column, W[k, n] = q[k, n] s[k / 32, n] (llama.cpp's Q4_0 without its blocks). Stored as
//   nibbles q + 8.
// - q8 (a kByte tensor): q [K, N] in [-127, 127], an fp16 scale per group of 32 inputs and
//   column, W[k, n] = q[k, n] s[k / 32, n]: llama.cpp's Q8_0 blocks, their values as they
//   are (a GGUF file's Q8_0 matrices run on them). Stored as bytes q + 128.
// - the K formats, for a GGUF file's K-quants and legacy blocks as they are: q4k (Q4_K):
//   nibbles q in [0, 15], W[k, n] = s[b, n] q + t[b, n] per block b of 32; q8k (Q5_K): the
//   same with bytes q + 128; q6 (Q6_K): bytes q + 128, W = s_h[b, n] q with a scale for each
//   half of a block (16 inputs). Their scales are stored as the file has them: a one-byte
//   multiplier per block (s = m_s d, t = m_t e; q6: s_h = m_h d, signed) of an fp32 pair
//   (d, e) per super-block of 8 blocks (llama.cpp's 256 inputs). Every product m d is exact
//   in fp32 (an fp16 d times a 6- or 8-bit integer), so the kernels' s and t are the values
//   gguf-py dequantizes with, bit for bit. q6s (Q6_K in six bits): q6's values as q + 32 in
//   a nibble and two high bits (kSix). q4l (Q4_1) and q8l (Q5_0, Q5_1): q4k's and q8k's
//   kernels with a super-block of one block (multipliers 1, (d, e) = the block's s and t).
// Layout: K padded to K32 (a multiple of 32) with zero weights; in gemm.h's column panels,
// each (stored row, column) one 32-bit lane of four bytes, so a 64-byte load is 16 columns x
// 4 inputs, vpdpbusd's operand:
// - int8: stored row t holds inputs 4t .. 4t+3, one a byte: panels [K32 / 4, width, 4],
//   then the fp32 scales [N]; shape [K32 / 4 + 1, N, 4].
// - int4: stored row t holds inputs 8t .. 8t+3 in the low nibbles and 8t+4 .. 8t+7 in the
//   high ones. A panel is K / 32 blocks, each its four stored rows [4, width, 4] and then
//   its fp16 scales [width]: 18 bytes a column and block, read front to back in one stream
//   (scales kept apart, [K / 32, N], cost a tenth of a GEMV's time on the 250k-column head:
//   a page a block). Shape [ceil(9 K / 64), N, 4] (zeros pad the end).
// - q8: as int4, a block's eight stored rows of bytes (row t: inputs 4t .. 4t+3) [8, width,
//   4] and then its fp16 scales [width]: 34 bytes a column and block, Q8_0's own size.
//   Shape [ceil(17 K / 64), N, 4].
// - q4k, q8k, q6 (and q4l, q8l): a panel starts with its super-blocks' pairs [K / 256][2]
//   [width] fp32 (d, then e), then its blocks as int4's / q8's, each block's stored rows then
//   its two multipliers [width] bytes (m_s then m_t, or q6's two halves'): 18 or 34 bytes a
//   column and block, plus 8 a super-block (4.75 bits a weight for Q4_K's 4.5, 8.75 for
//   Q6_K's 6.56; the fp32 s and t a block took 6 and 10). q6s's block: four stored rows of
//   nibbles as int4's (the low 4 bits of q + 32), then two stored rows of high bits (row u,
//   byte i: bits 4s + 2h .. 4s + 2h + 1 the top two of input 8 (2u + s) + 4h + i), then its
//   multipliers: 26 bytes, 6.75 bits a weight. q6 and q6s are kChar tensors (q8k, kByte, has
//   q6's size): quant_format.
//
// Activations (quantize_acts): per row and block b of 32 inputs, s_b = max |x| / 127 and
// x_q = round(x / s_b) (to nearest even), in [-127, 127]; model/quantize.py's
// ``quantize_activations`` is the same rule in PyTorch, the tests' reference.
//
// Arithmetic, for every element whatever the batch (so batch-invariant, gemm.h):
// d_b = Σ_{k in b} (q[k, n] + o) x_q[k] - o Σ_{k in b} x_q[k] (o = 128 or 8: exact, int32);
// int8: f = f + d_b s_b (b in order), y = f s[n]; int4 and q8: f = f + d_b (s_b s[b, n]),
// y = f; the K formats: f = f + d_b (s_b s[b, n]) + t[b, n] (s_b Σ x_q), with d_b over q as
// stored (q4k's dot starts at 0); q6: f = f + d_lo (s_b s_lo) + d_hi (s_b s_hi).
// Integer sums are exact, so only the float steps' order matters, and it is fixed.
//
// The parts, each building on the ones before it:
// - gemm_quant_formats.h: formats, columns, activations quantized, prefetching (any -march);
// - gemm_quant_avx2.h: AVX2's block dot products and record tiles;
// - gemm_quant_generic.h: the generic tiles and a span of rows on them;
// - gemm_quant_vnni.h: AVX512-VNNI's tiles;
// - gemm_quant_dispatch.h: spans to the build's tiles (gemm_quant_amx.h on AMX builds);
// - gemm_quant_six.h: Q6_K in six bits;
// - this file: the entry points (quant_mm and what sizes it);
// - gemm_quant_pack.h: packing weights into the formats (after the entry points).
#pragma once

#include "gemm_quant_six.h"

namespace linserve {

inline int64_t quant_rows_of(int64_t k_len, int format) {
  const int64_t k32 = (k_len + kBlock - 1) / kBlock * kBlock;
  if (format == kQInt8) return k32 / 4 + 1;
  return (column_bytes(format, k32 / kBlock) + 3) / 4;
}

// Whether a format can hold K inputs: K a multiple of 32 (256 for the K-quants' super-blocks).
inline bool holds(int format, int64_t k_len) {
  return k_len % (kBlock * (has_super(format) ? super_blocks(format) : 1)) == 0;
}

// Which format a stored weight of K inputs is in (pack_quantized), told apart by dtype and
// stored rows: int8, q6 and q6s are kChar tensors, the other block-scaled formats kByte (q8k and
// q6 take the same bytes a block). -1: none.
inline int quant_format(const at::Tensor& w, int64_t k_len) {
  if (w.dim() != 3 || w.size(2) != 4) return -1;
  if (w.scalar_type() == at::kChar) {
    if (w.size(0) == quant_rows_of(k_len, kQInt8)) return kQInt8;
    if (holds(kQ6, k_len) && w.size(0) == quant_rows_of(k_len, kQ6)) return kQ6;
    return holds(kQ6S, k_len) && w.size(0) == quant_rows_of(k_len, kQ6S) ? kQ6S : -1;
  }
  if (w.scalar_type() != at::kByte) return -1;
  for (const int f : {kQInt4, kQ8, kQ4K, kQ8K, kQ4L, kQ8L})
    if (holds(f, k_len) && w.size(0) == quant_rows_of(k_len, f)) return f;
  return -1;
}

// y = a @ dequant(w) (or y +=): a [B, K] fp32, y [B, N] fp32, w from pack_quantized.
inline void quant_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y, bool accumulate) {
  const int64_t rows = a.size(0), k_len = a.size(1), n = w.size(1);
  const int format = quant_format(w, k_len);
  TORCH_CHECK(format >= 0 && y.size(1) == n, "quant_mm: the weight does not match the activations");
  const QuantWeights qw{reinterpret_cast<const uint8_t*>(w.data_ptr()), n,
                        (k_len + kBlock - 1) / kBlock * kBlock, format};
  const float* x = a.data_ptr<float>();
  const bool nib = format == kQInt4 || format == kQ4K || format == kQ4L;
  const QuantActs acts = quantize_acts(x, rows, k_len, nib ? 8 : 128);
  float* out = y.data_ptr<float>();
  switch (format) {
    case kQInt4: return quant_rows<kQInt4>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ8: return quant_rows<kQ8>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ4K: case kQ4L: return quant_rows<kQ4K>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ8K: case kQ8L: return quant_rows<kQ8K>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ6: return quant_rows<kQ6>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ6S: return quant_rows_six(acts, x, qw, out, rows, k_len, accumulate);
    default: return quant_rows<kQInt8>(acts, x, qw, out, rows, k_len, accumulate);
  }
}

// A tensor's bytes by index whatever its strides: q [K, N] and the scales' parts [P, K / 32,
// N] may be transposed views (a GGUF matrix's blocks unpack as [N, K]; copying them into
// [K, N] first, a byte transpose of a 250k-column head, took seconds of a load).

}  // namespace linserve

#include "gemm_quant_pack.h"  // NOLINT: packing, on the entry points above
