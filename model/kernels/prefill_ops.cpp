// Elementwise work of the parallel (prefill) form, in one native pass each; inference only
// (no autograd): the causal convolution and the MLP's tanh GELU.
//
// Causal depthwise convolution: out[b, t, c] = sum_i w[i, c] * x[b, t + i, c].
//
// x [B, T + K - 1, C] holds each row's K-1 buffered inputs followed by its T new ones, in the
// [time, channel] layout the q/k/v projections come out in; w [K, C] (the module's [C, K]
// weight transposed, as the fused step packs it). One pass, vectorised over channels. ATen's
// depthwise conv1d wants [B, C, T]: the two transposes and oneDNN's depthwise path cost
// about a quarter of a 1,000-token prefill here. Inference only (no autograd).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dense.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

at::Tensor causal_conv(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(1) && x.size(1) >= w.size(0),
              "causal_conv takes x [B, T + K - 1, C] and w [K, C]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.is_contiguous() && w.is_contiguous(), "causal_conv takes contiguous fp32");
  const int64_t rows = x.size(0), k = w.size(0), c = x.size(2), t = x.size(1) - k + 1;
  at::Tensor out = at::empty({rows, t, c}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / t, pos = bt % t;
      const float* src = xp + (b * (t + k - 1) + pos) * c;
      float* dst = op + bt * c;
      for (int64_t ch = 0; ch < c; ++ch) dst[ch] = wp[ch] * src[ch];
      for (int64_t i = 1; i < k; ++i) {
        const float* wi = wp + i * c;
        const float* si = src + i * c;
        for (int64_t ch = 0; ch < c; ++ch) dst[ch] += wi[ch] * si[ch];
      }
    }
  });
  return out;
}

// GELU (tanh form) in place on a contiguous fp32 or bf16 tensor (bf16 through fp32 blocks).
at::Tensor gelu_tanh_(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "gelu_tanh_ takes a contiguous tensor");
  const int64_t n = x.numel();
  constexpr int64_t kBlock = 4096;
  if (x.scalar_type() == at::kFloat) {
    float* p = x.data_ptr<float>();
    at::parallel_for(0, n, kBlock,
                     [&](int64_t b, int64_t e) { linserve::gelu_tanh(p + b, e - b); });
    return x;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gelu_tanh_ takes fp32 or bf16");
  at::BFloat16* p = x.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, kBlock, [&](int64_t b, int64_t e) {
    std::vector<float> buf(kBlock);
    for (int64_t s = b; s < e; s += kBlock) {
      const int64_t len = std::min(kBlock, e - s);
      for (int64_t i = 0; i < len; ++i) buf[i] = static_cast<float>(p[s + i]);
      linserve::gelu_tanh(buf.data(), len);
      for (int64_t i = 0; i < len; ++i) p[s + i] = static_cast<at::BFloat16>(buf[i]);
    }
  });
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("causal_conv(Tensor x, Tensor w) -> Tensor");
  m.def("gelu_tanh_(Tensor(a!) x) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("causal_conv", &causal_conv);
  m.impl("gelu_tanh_", &gelu_tanh_);
}
