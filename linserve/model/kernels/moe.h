// A sparse mixture of experts on fp32 rows, as model/layers/moe.py's SparseMoE computes it: a
// router picks top_k of E experts per row, the chosen experts (SwiGLU, or Nemotron-H's
// squared-ReLU MLPs, optionally between latent projections) run on the rows that chose them,
// and each row adds their outputs times the router's weights.
//
// Only the chosen experts' weights are read: rows are grouped by expert, so each chosen
// expert is one product over its rows (a grouped GEMM, expert after expert), and an expert no
// row chose is never touched. Batch-invariant: a row's routing is its own row of the router's
// product; each expert's product is the invariant GEMM (dense.h's project: a row's output
// does not depend on the rows beside it); and a row adds its experts' outputs in ascending
// expert order whatever the other rows chose.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dense.h"
#include "gdn.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace linserve::moe {

// How a family routes (moe.py's RouterSpec). scoring: 0 softmax over all experts then the
// top k (Qwen); 1 sigmoid then the top k (LFM2-MoE, Nemotron-H; chosen by score + bias where
// a bias is given); 2 the top k logits then a softmax over them (Granite, Mixtral). groups > 1:
// only the experts of the best topk_groups groups (a group scored by its two best) may be
// chosen (Nemotron-H's n_group). relu2: the experts are down(relu(up(x))^2), else SwiGLU.
// latent: the experts run between forward()'s w[5] and w[6] projections.
struct Router {
  int64_t top_k;
  int64_t scoring;
  bool norm_topk;   // the chosen weights divided by their sum (+ eps)
  float norm_eps;
  float scaling;    // then times routed_scaling_factor
  int64_t groups = 1;
  int64_t topk_groups = 1;
  bool relu2 = false;
  bool latent = false;
};

// A Router from the bits the Python side packs (model/layers/moe.py's SparseMoE.native_args):
// scoring (bits 0-1), norm_topk (2), relu2 (3), latent (4), groups (8-15), topk_groups (16-23).
inline Router router_from(int64_t top_k, int64_t flags, float norm_eps, float scaling) {
  return Router{top_k, flags & 3, (flags & 4) != 0, norm_eps, scaling,
                std::max<int64_t>((flags >> 8) & 255, 1),
                std::max<int64_t>((flags >> 16) & 255, 1), (flags & 8) != 0, (flags & 16) != 0};
}

// choice [B, E] with the experts outside each row's topk_groups best groups set to -inf: the
// same ATen operations as moe.py's keep_top_groups (a group scored by its two best).
inline at::Tensor keep_top_groups(const at::Tensor& choice, const Router& r) {
  const int64_t rows = choice.size(0), n = choice.size(1);
  const at::Tensor grouped = choice.view({rows, r.groups, n / r.groups});
  const at::Tensor score = std::get<0>(grouped.topk(2, -1)).sum(-1);
  const at::Tensor best = std::get<1>(at::topk(score, r.topk_groups, -1, true, false));
  const at::Tensor keep = at::zeros_like(score, score.options().dtype(at::kBool))
                              .scatter_(1, best, true);
  return grouped.masked_fill(keep.logical_not().unsqueeze(-1),
                             -std::numeric_limits<float>::infinity())
      .view({rows, n});
}

// Each row's routing: logits [B, E] fp32 (bias [E] or empty) -> chosen [B, k] int64 and
// their weights [B * k]. The top k are at::topk's, so ties go to the experts transformers'
// torch.topk chooses, whatever the scores' arithmetic.
inline at::Tensor route(const at::Tensor& logits, const at::Tensor& bias, const Router& r,
                        std::vector<float>& weight) {
  const int64_t rows = logits.size(0), n = logits.size(1), k = r.top_k;
  weight.assign(rows * k, 0.f);
  if (r.scoring == 2) {  // the top k logits, a softmax over them
    const auto [top_raw, chosen] = at::topk(logits, k);
    const at::Tensor top = top_raw.contiguous();
    for (int64_t row = 0; row < rows; ++row) {
      const float* v = top.data_ptr<float>() + row * k;
      float* w = weight.data() + row * k;
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += w[j] = std::exp(v[j] - v[0]);
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    }
    return chosen.contiguous();
  }
  at::Tensor scores = logits.clone();
  for (int64_t row = 0; row < rows; ++row) {
    float* s = scores.data_ptr<float>() + row * n;
    if (r.scoring == 0) {
      float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t e = 0; e < n; ++e) top = std::max(top, s[e]);
      for (int64_t e = 0; e < n; ++e) sum += s[e] = std::exp(s[e] - top);
      for (int64_t e = 0; e < n; ++e) s[e] /= sum;
    } else {
      for (int64_t e = 0; e < n; ++e) s[e] = 1.f / (1.f + std::exp(-s[e]));
    }
  }
  at::Tensor choice = bias.numel() > 0 ? scores + bias : scores;
  if (r.groups > 1) choice = keep_top_groups(choice.contiguous(), r);
  const at::Tensor chosen = std::get<1>(at::topk(choice, k)).contiguous();
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t* c = chosen.data_ptr<int64_t>() + row * k;
    float* w = weight.data() + row * k;
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += w[j] = scores.data_ptr<float>()[row * n + c[j]];
    for (int64_t j = 0; j < k; ++j) {
      if (r.norm_topk) w[j] /= sum + r.norm_eps;
      w[j] *= r.scaling;
    }
  }
  return chosen;
}

// silu(gate) * up of gate_up [rows, 2f] (gate first, contiguous fp32) -> [rows, f]; rows in
// parallel past 16 (a prefill's; a step's few run on the calling thread).
inline at::Tensor swiglu(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), f = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, f}, gate_up.options());
  const float* u = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      gdn::silu_into(a + r * f, u + r * 2 * f, f);
      for (int64_t i = 0; i < f; ++i) a[r * f + i] *= u[r * 2 * f + f + i];
    }
  });
  return act;
}

// relu(up)^2 in place, up [rows, f].
inline at::Tensor relu_squared(at::Tensor up) {
  float* u = up.data_ptr<float>();
  for (int64_t i = 0; i < up.numel(); ++i) {
    const float v = std::max(u[i], 0.f);
    u[i] = v * v;
  }
  return up;
}

// An expert or shared expert on rows x: down(act(up(x))), SwiGLU (up = gate_up) or relu^2.
inline at::Tensor expert(const at::Tensor& x, const at::Tensor& up, const at::Tensor& down,
                         const Router& r) {
  const at::Tensor u = project(x, up);
  return project(r.relu2 ? relu_squared(u) : swiglu(u), down);
}

// Σ_k weight_k · expert_k(x) per row, routed by h [B, d] fp32; x [B, d'] (h itself, or its
// latent projection) -> [B, d'] fp32. router: the GEMM weight [d, E] (fp32); bias [E] or
// empty; experts: for expert e, gate_up [d', 2f] (or up [d', f]) at experts[2e] and down
// [f, d'] at experts[2e + 1], packed as dense.h's project takes them.
inline at::Tensor experts(const at::Tensor& h, const at::Tensor& xs, const at::Tensor& router,
                          const at::Tensor& bias, const at::Tensor* experts, const Router& r) {
  const int64_t rows = h.size(0), d = xs.size(1), k = r.top_k;
  const at::Tensor logits = project(h, router);
  const int64_t n = logits.size(1);
  std::vector<float> weight;
  const at::Tensor picked = route(logits, bias, r, weight);
  const int64_t* chosen = picked.data_ptr<int64_t>();
  at::Tensor out = at::zeros({rows, d}, xs.options());
  std::vector<int64_t> members;
  std::vector<float> scale;
  for (int64_t e = 0; e < n; ++e) {  // ascending: each row adds its experts in order
    members.clear();
    scale.clear();
    for (int64_t j = 0; j < rows * k; ++j)
      if (chosen[j] == e) {
        members.push_back(j / k);
        scale.push_back(weight[j]);
      }
    if (members.empty()) continue;
    const int64_t m = static_cast<int64_t>(members.size());
    at::Tensor x = rows == m ? xs : at::empty({m, d}, xs.options());
    if (rows != m)
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(x.data_ptr<float>() + i * d, xs.data_ptr<float>() + members[i] * d,
                    d * sizeof(float));
    const at::Tensor y = expert(x, experts[2 * e], experts[2 * e + 1], r);
    for (int64_t i = 0; i < m; ++i) {
      float* o = out.data_ptr<float>() + members[i] * d;
      const float* yi = y.data_ptr<float>() + i * d;
      for (int64_t c = 0; c < d; ++c) o[c] += yi[c] * scale[i];
    }
  }
  return out;
}

// The sparse MLP, h [B, d] -> [B, d]: the experts (experts(), with w[0] the router and w[1]
// its bias; for a latent router, on w[5] h and then projected back by w[6]), plus where w[2]
// is given the shared expert down(act(up(h))) (w[2], w[3]), times sigmoid(w[4] h) where
// w[4] [d, 1] is given.
inline at::Tensor forward(const at::Tensor& h, const at::Tensor* w, const at::Tensor* expert_w,
                          const Router& r) {
  at::Tensor out = r.latent ? project(experts(h, project(h, w[5]), w[0], w[1], expert_w, r), w[6])
                            : experts(h, h, w[0], w[1], expert_w, r);
  if (w[2].numel() == 0) return out;
  const at::Tensor shared = expert(h, w[2], w[3], r);
  const int64_t rows = h.size(0), d = h.size(1);
  const bool gated = w[4].numel() > 0;
  const at::Tensor gate = gated ? project(h, w[4]) : at::Tensor();
  for (int64_t row = 0; row < rows; ++row) {
    const float g = gated ? 1.f / (1.f + std::exp(-gate.data_ptr<float>()[row])) : 1.f;
    float* o = out.data_ptr<float>() + row * d;
    const float* s = shared.data_ptr<float>() + row * d;
    for (int64_t c = 0; c < d; ++c) o[c] += gated ? g * s[c] : s[c];
  }
  return out;
}

}  // namespace linserve::moe
