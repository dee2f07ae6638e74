// The whole decode step of a Qwen3.5 hybrid (model/architectures/qwen3_5/model.py) in one native
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
//
// qwen35_verify is the same model over T tokens per row (speculative decoding's verify,
// model/verify.py): tokens [T B] position-major; every projection over the T B rows at once
// (one read of the weights), each mixer position after position over the B rows with the
// step's arithmetic (so a row's logits and state at each position are the step's, bit for
// bit, with the batch-invariant GEMMs); snaps receive the GDN states after each position
// but the last, so that the caller can land each row on the position its drafts end.
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

// x += out(gdn(in(norm(x)))); x holds T positions of B rows, position-major (row t B + b
// is row b's t-th token: T = 1 for a step). The projections run over every row at once; the
// recurrence position after position over the B rows, as T steps would. After each position
// but the last, s and the window are copied to s_snap[t], w_snap[t] (when given).
void gdn_layer(at::Tensor& x, const at::Tensor* w, at::Tensor& s, at::Tensor& window,
               const Dims& m, int64_t positions, at::Tensor* s_snap, at::Tensor* w_snap) {
  const int64_t rows = x.size(0) / positions, c_len = 2 * m.hk * m.dk + m.hv * m.dv;
  at::Tensor proj = linserve::project(linserve::normed(x, w[0], m.eps), w[1]);
  const int64_t ld = proj.size(1), vd = m.hv * m.dv;
  at::Tensor out = at::empty({x.size(0), vd}, x.options());
  const linserve::gdn::Shape sh{m.hk, m.hv, m.dk, m.dv, c_len, m.k, m.eps};
  for (int64_t t = 0; t < positions; ++t) {
    const float* p = proj.data_ptr<float>() + t * rows * ld;
    linserve::gdn::step({p, p + c_len, p + c_len + vd + m.hv, p + c_len + vd, ld},
                        window.data_ptr<float>(), w[2].data_ptr<float>(),
                        w[3].data_ptr<float>(), w[4].data_ptr<float>(), s.data_ptr<float>(),
                        w[5].data_ptr<float>(), out.data_ptr<float>() + t * rows * vd, rows, sh);
    if (s_snap != nullptr && t + 1 < positions) {
      linserve::snapshot(s_snap->select(0, t), s);
      w_snap->select(0, t).copy_(window);
    }
  }
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

// One position of the B rows: their keys and values into the cache at lengths[r] and
// attention over the cache up to them, into o [B, H D], gated.
void attend_rows(const at::Tensor& qkv, const at::Tensor* w, at::Tensor& kc, at::Tensor& vc,
                 const int64_t* lengths, const Dims& m, at::Tensor o) {
  const int64_t rows = qkv.size(0), dh = m.head, rep = m.h / m.hkv, cap = kc.size(2);
  std::vector<float> q(rows * m.h * dh);
  write_kv(qkv, w, kc, vc, lengths, m, q);
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
}

// x += o(attention(norm(x)) * sigmoid(gate)); x holds T positions of B rows as in
// gdn_layer, position t of row r at cache position lengths[r] + t.
void attention_layer(at::Tensor& x, const at::Tensor* w, at::Tensor& kc, at::Tensor& vc,
                     const int64_t* lengths, const Dims& m, int64_t positions) {
  const int64_t rows = x.size(0) / positions;
  at::Tensor qkv = linserve::project(linserve::normed(x, w[0], m.eps), w[1]);
  at::Tensor o = at::empty({x.size(0), m.h * m.head}, x.options());
  std::vector<int64_t> at_pos(lengths, lengths + rows);
  for (int64_t t = 0; t < positions; ++t) {
    attend_rows(qkv.narrow(0, t * rows, rows), w, kc, vc, at_pos.data(), m,
                o.narrow(0, t * rows, rows));
    for (int64_t& p : at_pos) ++p;
  }
  linserve::project_add(x, o, w[4]);
}

// The whole model over T positions of B rows (tokens [T B], position-major); snaps: per
// state tensor, [T - 1, B, ...] for the GDN layers' two (empty: none kept, or a KV layer).
// hidden (if not empty) receives the final norm's output [T B, d] (what an MTP head drafts
// from).
at::Tensor forward(const at::Tensor& tokens, at::TensorList weights, at::TensorList experts,
                   at::TensorList state, at::TensorList snaps, const at::Tensor& lengths,
                   at::IntArrayRef ints, at::IntArrayRef dims, double eps, int64_t positions,
                   at::Tensor hidden) {
  TORCH_CHECK(dims.size() == 10, "qwen35_step: 10 dims");
  const Dims m{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8],
               dims[9], static_cast<float>(eps)};
  const int64_t layers = static_cast<int64_t>(ints.size()) / kInts;
  const int64_t rows = lengths.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 3 + kLayerWeights * layers &&
                  static_cast<int64_t>(state.size()) == 2 * layers,
              "qwen35_step: weights or state do not match the layer kinds");
  TORCH_CHECK(snaps.empty() || snaps.size() == state.size(), "qwen35_step: snaps per state");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  tokens.size(0) == rows * positions, "qwen35_step: lengths [B] int64");
  for (const at::Tensor& t : state)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.size(0) == rows,
                "qwen35_step: state is fp32 contiguous [B, ...]");
  at::Tensor x = linserve::embed_rows(weights[0], tokens, m.d, weights[0].is_same(weights[1]));
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<at::Tensor> snap(snaps.begin(), snaps.end());
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 3 + l * kLayerWeights;
    at::Tensor a = state[2 * l], b = state[2 * l + 1];
    const int64_t* li = ints.data() + l * kInts;
    if (li[0] == 0) {
      const bool keep = !snap.empty() && snap[2 * l].numel() > 0;
      gdn_layer(x, w, a, b, m, positions, keep ? &snap[2 * l] : nullptr,
                keep ? &snap[2 * l + 1] : nullptr);
    } else {
      attention_layer(x, w, a, b, len, m, positions);
    }
    mlp_add(x, w + kMixerWeights, experts.data(), li, m);
  }
  const at::Tensor normed = linserve::normed(x, weights[2], m.eps);
  if (hidden.defined() && hidden.numel() > 0) hidden.copy_(normed);
  return linserve::project(normed, weights[1]);
}

at::Tensor qwen35_step(const at::Tensor& tokens, at::TensorList weights, at::TensorList experts,
                       at::TensorList state, const at::Tensor& lengths, at::IntArrayRef ints,
                       at::IntArrayRef dims, double eps) {
  return forward(tokens, weights, experts, state, {}, lengths, ints, dims, eps, 1, at::Tensor());
}

// Qwen3.5's MTP layer (model/architectures/qwen3_5/mtp.py) over n positions of one request:
// g = norm(layer(fc([norm_e(embed(tokens)), norm_h(hidden)]))), the layer a full-attention
// decoder layer with a KV cache of its own. weights: embed, head (to tell a tied table),
// norm_e, norm_h (as 1 + w), fc [2d, d] (packed), norm, then the layer's kLayerWeights;
// hidden [n, d] fp32; state: the layer's (k, v [1, Hkv, cap, D]); lengths [1]; ints: the
// layer's five. Returns g [n, d] fp32.
at::Tensor qwen35_mtp(const at::Tensor& tokens, const at::Tensor& hidden, at::TensorList weights,
                      at::TensorList experts, at::TensorList state, const at::Tensor& lengths,
                      at::IntArrayRef ints, at::IntArrayRef dims, double eps) {
  TORCH_CHECK(dims.size() == 10 && weights.size() == 6 + kLayerWeights && state.size() == 2 &&
                  ints.size() == kInts && lengths.numel() == 1,
              "qwen35_mtp: one layer's weights, state and ints");
  const Dims m{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8],
               dims[9], static_cast<float>(eps)};
  const int64_t n = tokens.size(0);
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.size(0) == n && hidden.size(1) == m.d,
              "qwen35_mtp: hidden [n, d] fp32");
  const bool tied = weights[0].is_same(weights[1]);
  const at::Tensor e = linserve::embed_rows(weights[0], tokens, m.d, tied);
  const at::Tensor h = linserve::normed(hidden.contiguous(), weights[3], m.eps);
  at::Tensor x = linserve::project(at::cat({linserve::normed(e, weights[2], m.eps), h}, 1),
                                   weights[4]);
  at::Tensor kc = state[0], vc = state[1];
  const at::Tensor* w = weights.data() + 6;
  attention_layer(x, w, kc, vc, lengths.data_ptr<int64_t>(), m, n);  // n positions, 1 row
  mlp_add(x, w + kMixerWeights, experts.data(), ints.data(), m);
  return linserve::normed(x, weights[5], m.eps);
}

// A verify: T tokens per row (tokens [T B], position-major) -> logits [T B, V], the state
// after all T, the GDN states after each earlier position in snaps, and the final norm's
// output in hidden [T B, d] (if not empty).
at::Tensor qwen35_verify(const at::Tensor& tokens, at::TensorList weights,
                         at::TensorList experts, at::TensorList state, at::TensorList snaps,
                         at::Tensor hidden, const at::Tensor& lengths, at::IntArrayRef ints,
                         at::IntArrayRef dims, double eps, int64_t positions) {
  TORCH_CHECK(positions >= 1, "qwen35_verify: at least one position");
  return forward(tokens, weights, experts, state, snaps, lengths, ints, dims, eps, positions,
                 hidden);
}

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "qwen35_step(Tensor tokens, Tensor[] weights, Tensor[] experts, Tensor(a!)[] state, "
      "Tensor lengths, int[] ints, int[] dims, float eps) -> Tensor");
  m.def(
      "qwen35_mtp(Tensor tokens, Tensor hidden, Tensor[] weights, Tensor[] experts, "
      "Tensor(a!)[] state, Tensor lengths, int[] ints, int[] dims, float eps) -> Tensor");
  m.def(
      "qwen35_verify(Tensor tokens, Tensor[] weights, Tensor[] experts, Tensor(a!)[] state, "
      "Tensor(b!)[] snaps, Tensor(c!) hidden, Tensor lengths, int[] ints, int[] dims, "
      "float eps, int positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("qwen35_step", &qwen35_step);
  m.impl("qwen35_verify", &qwen35_verify);
  m.impl("qwen35_mtp", &qwen35_mtp);
}

}  // namespace qwen35_step_cpp
