// The sparse MLP (moe.h) as an op of its own, for the prefill of every family with experts
// (model/layers/moe.py's SparseMoE): a prompt's tokens are grouped by expert natively, where
// grouping them from Python cost more than the experts' products on a CPU. The whole-model
// decode step (decoder_step.cpp) calls the same moe::forward.
//
//   moe_forward(h [N, d] fp32, weights, experts, top_k, flags, norm_eps, scaling) -> [N, d]:
//   weights are moe.h forward()'s seven slots (router [d, E] fp32, expert bias [E], shared
//   gate_up or up, shared down, shared gate [d, 1], latent in, latent out; absent ones empty),
//   experts each expert's (gate_up or up, down) GEMM weights in order, flags moe.h's
//   router_from bits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "moe.h"

namespace moe_ops_cpp {  // named, not anonymous: unity units (build.py) join sources

at::Tensor moe_forward(const at::Tensor& h, at::TensorList weights, at::TensorList experts,
                       int64_t top_k, int64_t flags, double norm_eps, double scaling) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "moe_forward: h is [N, d] fp32 contiguous");
  TORCH_CHECK(weights.size() == 7, "moe_forward: seven weight slots");
  const linserve::moe::Router r = linserve::moe::router_from(
      top_k, flags, static_cast<float>(norm_eps), static_cast<float>(scaling));
  const int64_t n = weights[0].size(1);
  TORCH_CHECK(static_cast<int64_t>(experts.size()) == 2 * n && top_k > 0 && top_k <= n,
              "moe_forward: two tensors per expert and 0 < top_k <= experts");
  return linserve::moe::forward(h, weights.data(), experts.data(), r);
}


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("moe_forward(Tensor h, Tensor[] weights, Tensor[] experts, int top_k, int flags, "
        "float norm_eps, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("moe_forward", &moe_forward); }

}  // namespace moe_ops_cpp
