// Python-facing ops for the batch-invariant GEMM (gemm.h) and its process-wide switch.
//
//   invariant_mm(a [B, K] fp32, w [K, N] fp32|bf16) -> [B, N] fp32: the eager forms' linear
//   layers in batch-invariant mode (model/invariant.py).
//   pack_weight(w [K, N] fp32|bf16) -> the panel layout the GEMM streams: [K, N, 1], or
//   [K/2, N, 2] bf16 pairs for the bf16 dot-product path (AVX512-BF16 builds; has_bf16_dot()
//   says which).
//   pack_quantized(q [K, N] int8, scales, format) -> an int8 (0: fp32 scales [N]), int4 (1)
//   or q8 (2: fp16 scales [K/32, N]) weight in gemm_quant.h's formats, which invariant_mm
//   also takes.
//   join_quantized(parts) -> a mixed weight: packed quantized weights of one K, each in its
//   own format, side by side (gemm_mixed.h), which invariant_mm also takes.
//   head_rows(head, tokens [B], d) -> [B, d] fp32: a tied model's embeddings read from its
//   GEMM head in any stored format (embed.h), so the table is held once.
//   q6_k_values(blocks [n, 210] uint8) -> q [n, 256] int8: a GGUF Q6_K tensor's 6-bit values
//   (model/gguf/checkpoint.py's _q6_k; its scales are read there).
//   pack_gguf(raw [N, row bytes] uint8, ggml type) -> a GGUF Q4_0 / Q8_0 / K-quant matrix's
//   rows as the stored weight (int4, q8, q4k, q8k, q6 or q6s), straight from its blocks
//   (gguf_blocks.h); stored_format(format) says which a format is stored as on this build.
//   q8_0_holds_minus_128(raw [N, row bytes] uint8) -> whether a Q8_0 matrix has a −128.
//   set_batch_invariant(on): whether the fused steps' projections use it (dense.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dense.h"
#include "embed.h"
#include "gemm.h"
#include "gguf_blocks.h"

namespace gemm_cpp {  // named, not anonymous: unity units (build.py) join sources

at::Tensor invariant_mm_op(const at::Tensor& a, const at::Tensor& w) {
  TORCH_CHECK(a.dim() == 2, "invariant_mm takes 2-d activations");
  at::Tensor y = at::empty({a.size(0), w.size(1)}, a.options());
  linserve::invariant_mm(a.contiguous(), w.contiguous(), y, false);
  return y;
}

at::Tensor pack_weight_op(const at::Tensor& w) { return linserve::pack_weight(w); }

at::Tensor pack_quantized_op(const at::Tensor& q, const at::Tensor& scales, int64_t format) {
  return linserve::pack_quantized(q, scales, format);
}

at::Tensor join_quantized_op(const std::vector<at::Tensor>& parts) {
  return linserve::join_quantized(parts);
}

at::Tensor head_rows_op(const at::Tensor& head, const at::Tensor& tokens, int64_t dim) {
  return linserve::embed_rows(head, tokens, dim, true);
}

// A GGUF Q6_K tensor's values, a block at a time (gguf_blocks.h's q6_k_values_of): one pass
// where PyTorch's took five over the tensor (1.9 s of a 248k-row embedding's load).
at::Tensor q6_k_values(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 210 && blocks.scalar_type() == at::kByte &&
                  blocks.is_contiguous(),
              "q6_k_values takes contiguous uint8 blocks [n, 210]");
  const int64_t n = blocks.size(0);
  at::Tensor q = at::empty({n, 256}, blocks.options().dtype(at::kChar));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  int8_t* dst = q.data_ptr<int8_t>();
  at::parallel_for(0, n, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) linserve::q6_k_values_of(src + b * 210, dst + b * 256);
  });
  return q;
}

at::Tensor pack_gguf_op(const at::Tensor& raw, int64_t type) { return linserve::pack_gguf(raw, type); }

bool q8_0_holds_minus_128_op(const at::Tensor& raw) { return linserve::q8_0_holds_minus_128(raw); }

bool has_bf16_dot() { return linserve::kHasBf16Dot; }

// The stored format pack_quantized and pack_gguf make of `format`: Q6_K's (5) is q6s (8) on
// builds without VNNI (gemm_quant.h's kQ6Stored); every other the same.
int64_t stored_format(int64_t format) {
  return format == linserve::kQ6 ? linserve::kQ6Stored : format;
}

// Whether bf16 GEMMs run on AMX tiles now; set_amx(false) keeps them on AVX512-BF16 (tests
// compare the two; a process must not flip it while it serves).
bool amx_active() { return linserve::amx_active(); }

void set_amx(bool on) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  linserve::amx_flag() = on;
#else
  (void)on;
#endif
}

void set_batch_invariant(bool on) { linserve::batch_invariant_flag() = on; }

bool get_batch_invariant() { return linserve::batch_invariant_flag(); }


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("invariant_mm(Tensor a, Tensor w) -> Tensor");
  m.def("pack_weight(Tensor w) -> Tensor");
  m.def("pack_quantized(Tensor q, Tensor scales, int format) -> Tensor");
  m.def("join_quantized(Tensor[] parts) -> Tensor");
  m.def("head_rows(Tensor head, Tensor tokens, int dim) -> Tensor");
  m.def("q6_k_values(Tensor blocks) -> Tensor");
  m.def("pack_gguf(Tensor raw, int type) -> Tensor");
  m.def("q8_0_holds_minus_128(Tensor raw) -> bool");
  m.def("has_bf16_dot() -> bool");
  m.def("stored_format(int format) -> int");
  m.def("amx_active() -> bool");
  m.def("set_amx(bool on) -> ()");
  m.def("set_batch_invariant(bool on) -> ()");
  m.def("get_batch_invariant() -> bool");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("invariant_mm", &invariant_mm_op);
  m.impl("pack_weight", &pack_weight_op);
  m.impl("pack_quantized", &pack_quantized_op);
  m.impl("join_quantized", &join_quantized_op);
  m.impl("head_rows", &head_rows_op);
  m.impl("q6_k_values", &q6_k_values);
  m.impl("pack_gguf", &pack_gguf_op);
  m.impl("q8_0_holds_minus_128", &q8_0_holds_minus_128_op);
}

TORCH_LIBRARY_IMPL(linserve, CatchAll, m) {
  m.impl("set_batch_invariant", &set_batch_invariant);
  m.impl("get_batch_invariant", &get_batch_invariant);
  m.impl("has_bf16_dot", &has_bf16_dot);
  m.impl("stored_format", &stored_format);
  m.impl("amx_active", &amx_active);
  m.impl("set_amx", &set_amx);
}

}  // namespace gemm_cpp
