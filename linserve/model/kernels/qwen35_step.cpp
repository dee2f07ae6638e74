// The whole decode step of a Qwen3.5 hybrid (model/architectures/qwen3_5.py) in one native
// call: one token per row through every layer, then the final norm and the LM head. The
// eager step costs ~250 Python-dispatched operators per token; at batch 1 of the 0.8B shapes
// that was a fifth of the step on top of the weight reads.
//
// Activations stay fp32 between layers; weights are fp32 or bf16, packed by
// model/invariant.py (pack) when the batch-invariant mode is on. Every row is computed by its
// own loops in a fixed order and the projections are dense.h's, so a row's logits do not
// depend on the rows beside it (batch invariance) when the mode is on.
//
// Arguments (B rows; d hidden; f MLP width; H query / Hkv key-value heads of D, rot rotary
// dims; GDN shapes as gdn.h; V vocabulary):
//   tokens [B] int64, lengths [B] int64 (each row's position before this token);
//   weights: embed [V, d], head [d, V] (packed), final norm [d] (as 1 + w), then per layer
//     kLayerWeights: the mixer's 7, then the MLP's 6:
//     Gated DeltaNet: norm_in [d], in [d, C + Hv Dv + 2 Hv], conv_w [K, C], a_log [Hv],
//       dt_bias [Hv], gated-norm w [Dv], out [Hv Dv, d];
//     attention: norm_in [d], qkv [d, 2 H D + 2 Hkv D], q_norm [D], k_norm [D], o [H D, d],
//       inv_freq [rot / 2], unused;
//     dense MLP: norm_post [d], gate_up [d, 2f], down [f, d], 3 unused;
//     experts (Qwen3.5-MoE, Qwen3-Next): norm_post [d], then moe.h's forward's five (router
//       [d, E] fp32, no bias, shared gate_up and down, shared gate [d, 1]);
//   experts: every sparse layer's experts, (gate_up, down) per expert, layer after layer;
//   state: per layer two tensors, (s [B, Hv, Dk, Dv], window [B, K-1, C]) or
//     (k, v [B, Hkv, capacity, D]); updated in place (lengths are not: the caller advances
//     them);
//   ints, per layer 5: the mixer (0 Gated DeltaNet, 1 attention), the MLP (0 dense,
//     1 experts), and for experts the layer's first tensor in ``experts``, top k, and
//     moe.h's scoring + 4 if the top k are renormalised;
//   dims: d, H, Hkv, D, rot, Hk, Hv, Dk, Dv, K (the MLP widths come from its weights).
// Returns logits [B, V] fp32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"
#include "dense.h"
#include "fastmath.h"
#include "gdn.h"
#include "gemm.h"
#include "moe.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace qwen35_step_cpp {  // named, not anonymous: unity units (build.py) join sources

constexpr int64_t kMixerWeights = 7;
constexpr int64_t kLayerWeights = kMixerWeights + 6;
constexpr int64_t kInts = 5;

struct Dims {
  int64_t d, h, hkv, head, rot, hk, hv, dk, dv, k;
  float eps;
};

// x [B, d] += the MLP of the RMSNorm of x: down(silu(gate) * up), or the experts (ints:
// the layer's five, see the header).
void mlp_add(at::Tensor& x, const at::Tensor* w, const at::Tensor* experts, const int64_t* ints,
             const Dims& m) {
  const at::Tensor h = linserve::normed(x, w[0], m.eps);
  if (ints[1] == 0) {
    linserve::project_add(x, linserve::moe::swiglu(linserve::project(h, w[1])), w[2]);
    return;
  }
  x.add_(linserve::moe::forward(h, w + 1, experts + ints[2],
                                linserve::moe::router_from(ints[3], ints[4], 0.f, 1.f)));
}

// x += out(gdn(in(norm(x)))).
void gdn_layer(at::Tensor& x, const at::Tensor* w, at::Tensor& s, at::Tensor& window,
               const Dims& m) {
  const int64_t rows = x.size(0), c_len = 2 * m.hk * m.dk + m.hv * m.dv;
  at::Tensor proj = linserve::project(linserve::normed(x, w[0], m.eps), w[1]);
  const float* p = proj.data_ptr<float>();
  at::Tensor out = at::empty({rows, m.hv * m.dv}, x.options());
  const linserve::gdn::Shape sh{m.hk, m.hv, m.dk, m.dv, c_len, m.k, m.eps};
  const int64_t vd = m.hv * m.dv;
  linserve::gdn::step({p, p + c_len, p + c_len + vd + m.hv, p + c_len + vd, proj.size(1)},
                      window.data_ptr<float>(), w[2].data_ptr<float>(), w[3].data_ptr<float>(),
                      w[4].data_ptr<float>(), s.data_ptr<float>(), w[5].data_ptr<float>(),
                      out.data_ptr<float>(), rows, sh);
  linserve::project_add(x, out, w[6]);
}

// q / k norms and rotary positions, the new key and value into the cache; qkv [B, ...] as
// the stacked projection gives it: per query head [q D | gate D], then k [Hkv D], v [Hkv D].
void write_kv(const at::Tensor& qkv, const at::Tensor* w, at::Tensor& kc, at::Tensor& vc,
              const int64_t* lengths, const Dims& m, std::vector<float>& q) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dh = m.head, cap = kc.size(2);
  float* p = qkv.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = lengths[r];
    TORCH_CHECK(pos < cap, "qwen35_step: the KV cache is full (reserve first)");
    for (int64_t h = 0; h < m.h; ++h) {
      float* qh = q.data() + (r * m.h + h) * dh;
      std::memcpy(qh, p + r * width + h * 2 * dh, dh * sizeof(float));
      linserve::rms_row(qh, w[2].data_ptr<float>(), dh, m.eps);
      linserve::rotate_half(qh, w[5].data_ptr<float>(), m.rot, pos);
    }
    for (int64_t g = 0; g < m.hkv; ++g) {
      float* kd = kc.data_ptr<float>() + ((r * m.hkv + g) * cap + pos) * dh;
      float* vd = vc.data_ptr<float>() + ((r * m.hkv + g) * cap + pos) * dh;
      std::memcpy(kd, p + r * width + 2 * m.h * dh + g * dh, dh * sizeof(float));
      std::memcpy(vd, p + r * width + 2 * m.h * dh + m.hkv * dh + g * dh, dh * sizeof(float));
      linserve::rms_row(kd, w[3].data_ptr<float>(), dh, m.eps);
      linserve::rotate_half(kd, w[5].data_ptr<float>(), m.rot, pos);
    }
  }
}

// x += o(attention(norm(x)) * sigmoid(gate)).
void attention_layer(at::Tensor& x, const at::Tensor* w, at::Tensor& kc, at::Tensor& vc,
                     const int64_t* lengths, const Dims& m) {
  const int64_t rows = x.size(0), dh = m.head, rep = m.h / m.hkv, cap = kc.size(2);
  at::Tensor qkv = linserve::project(linserve::normed(x, w[0], m.eps), w[1]);
  std::vector<float> q(rows * m.h * dh);
  write_kv(qkv, w, kc, vc, lengths, m, q);
  at::Tensor o = at::empty({rows, m.h * dh}, x.options());
  const float* gates = qkv.data_ptr<float>();
  at::parallel_for(0, rows * m.hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / m.hkv, g = t % m.hkv, len = lengths[r] + 1;
      std::vector<float> scores(std::min(rep, linserve::kGroupHeads) * len);
      float* og = o.data_ptr<float>() + (r * m.h + g * rep) * dh;
      const int64_t at_group = (r * m.hkv + g) * cap * dh;
      linserve::attend_group(q.data() + (r * m.h + g * rep) * dh, kc.data_ptr<float>() + at_group,
                   vc.data_ptr<float>() + at_group, rep, len, dh, og, scores.data());
      for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {  // the sigmoid output gate
        const float* gate = gates + r * qkv.size(1) + h * 2 * dh + dh;
        float* oh = o.data_ptr<float>() + (r * m.h + h) * dh;
        for (int64_t i = 0; i < dh; ++i) oh[i] *= 1.f / (1.f + std::exp(-gate[i]));
      }
    }
  });
  linserve::project_add(x, o, w[4]);
}

at::Tensor qwen35_step(const at::Tensor& tokens, at::TensorList weights, at::TensorList experts,
                       at::TensorList state, const at::Tensor& lengths, at::IntArrayRef ints,
                       at::IntArrayRef dims, double eps) {
  TORCH_CHECK(dims.size() == 10, "qwen35_step: 10 dims");
  const Dims m{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8],
               dims[9], static_cast<float>(eps)};
  const int64_t layers = static_cast<int64_t>(ints.size()) / kInts;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 3 + kLayerWeights * layers &&
                  static_cast<int64_t>(state.size()) == 2 * layers,
              "qwen35_step: weights or state do not match the layer kinds");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.size(0) == tokens.size(0), "qwen35_step: lengths [B] int64");
  for (const at::Tensor& t : state)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.size(0) == tokens.size(0), "qwen35_step: state is fp32 contiguous [B, ...]");
  at::Tensor x = linserve::embed_rows(weights[0], tokens, m.d, weights[0].is_same(weights[1]));
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 3 + l * kLayerWeights;
    at::Tensor a = state[2 * l], b = state[2 * l + 1];
    const int64_t* li = ints.data() + l * kInts;
    if (li[0] == 0) {
      gdn_layer(x, w, a, b, m);
    } else {
      attention_layer(x, w, a, b, len, m);
    }
    mlp_add(x, w + kMixerWeights, experts.data(), li, m);
  }
  return linserve::project(linserve::normed(x, weights[2], m.eps), weights[1]);
}


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "qwen35_step(Tensor tokens, Tensor[] weights, Tensor[] experts, Tensor(a!)[] state, "
      "Tensor lengths, int[] ints, int[] dims, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("qwen35_step", &qwen35_step); }

}  // namespace qwen35_step_cpp
