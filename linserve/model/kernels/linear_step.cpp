// Fused RNN-mode decode step for the elu+1 linear-attention model, gated or not.
//
// One call advances every row of a batched state by one token and returns the logits (or,
// with with_head=false, the final hidden state [B, d] before the norm and LM head).
// The matrix products go to ATen (oneDNN / MKL GEMM); everything between them -- RMSNorm,
// the short causal convolution and its window shift, phi(x) = elu(x) + 1, the state update
// s += phi(k) v^T, z += phi(k), the readout phi(q)^T s / phi(q)^T z, residuals and GELU -- is
// a handful of fused loops. The eager step issues ~30 small PyTorch ops per layer, and at
// batch 1 their dispatch costs more than the layer's own matrix products.
//
// Activations and the residual stream are fp32. With bf16 weights they are cast to bf16 as
// GEMM inputs at larger batches; small batches use a bf16-weight GEMV on fp32 activations.
// Recurrent state is always fp32.
//
// Gated models (GLA's low-rank forget gate): the gate's down-projection [d, r] rides along as
// r extra columns of the qkv GEMM; the up-projection [r, H*F] and its bias are a small fp32
// loop, g = sigmoid(x)^(1/16) clamped to [e^-1, 1], and the update becomes
// s = g * s + k v^T, z = g * z + k (the gate scales the rows f of s).
//
// Shapes (B rows, L layers, H heads, F = M = head_dim, d = H*M, K = conv width):
//   tokens [B] int64
//   s, z, conv: one tensor per layer (model/state.py's per-layer entries), s[l] [B, H, F, M],
//   z[l] [B, H, F], conv[l] [B, K-1, 3d], fp32 and contiguous (the slot pool's live-row
//   views are).
//   lengths [B] int64: each row's tokens consumed, advanced by one here.
//   weights (see model/fused_step.py): embed [V, d], head [d, V] (the embedding transposed),
//   final norm [d] fp32, then per layer norm1 [d] fp32, qkv [d, 3d (+ r)], conv [K, 3d] fp32
//   (empty when K = 0), out [d, d], norm2 [d] fp32, up [d, f], down [f, d], gate_up [r, d]
//   fp32 and gate_bias [d] fp32 (both empty when ungated). GEMM weights are stored
//   [in, out] and contiguous: x @ W runs about 20% faster than x @ W_stored^T here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dense.h"
#include "fastmath.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace linear_step_cpp {  // named, not anonymous: unity units (build.py) join sources

using linserve::normed;
using linserve::project;
using linserve::project_add;

constexpr int64_t kPerLayer = 9;

// phi(v) = elu(v) + 1: v + 1 for v > 0, exp(v) otherwise.
inline float elu_plus_one(float v) {
  return v > 0.f ? v + 1.f : linserve::exp_nonpositive(v);
}

// qkv [B, 3d] fp32 in place: causal depthwise conv over (buffer, current), then the
// buffer shifts by one; phi on the q and k parts. buf [B, K-1, 3d], cw [K, 3d].
void conv_and_features(float* qkv, float* buf, const float* cw, int64_t rows, int64_t width,
                       int64_t k) {
  const int64_t qk = 2 * width / 3;
  std::vector<float> acc(width);
  for (int64_t b = 0; b < rows; ++b) {
    float* u = qkv + b * width;
    if (k > 0) {
      float* bb = buf + b * (k - 1) * width;
      const float* last = cw + (k - 1) * width;
      for (int64_t c = 0; c < width; ++c) acc[c] = last[c] * u[c];
      for (int64_t i = 0; i < k - 1; ++i) {
        const float* wi = cw + i * width;
        const float* bi = bb + i * width;
        for (int64_t c = 0; c < width; ++c) acc[c] += wi[c] * bi[c];
      }
      if (k > 1) {  // shift the window: drop the oldest input, append the current one
        std::memmove(bb, bb + width, (k - 2) * width * sizeof(float));
        std::memcpy(bb + (k - 2) * width, u, width * sizeof(float));
      }
      std::memcpy(u, acc.data(), width * sizeof(float));
    }
    for (int64_t c = 0; c < qk; ++c) u[c] = elu_plus_one(u[c]);
  }
}

// One (row, head): s = g s + k v^T, z = g z + k, out = q^T s / (q^T z + eps), in one pass
// over s [F, M] (g = nullptr: no gate). DIM > 0 fixes F = M at compile time so the
// accumulator stays in registers.
template <int64_t DIM>
void attend_head(const float* q, const float* kk, const float* v, const float* g, float* sp,
                 float* zp, float* o, int64_t dim_rt, float eps) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  float num[DIM > 0 ? DIM : 1024];
  float den = 0.f;
  for (int64_t m = 0; m < dim; ++m) num[m] = 0.f;
  for (int64_t f = 0; f < dim; ++f) {
    const float kf = kk[f], qf = q[f];
    float* row = sp + f * dim;
    if (g != nullptr) {
      const float gf = g[f];
      zp[f] = gf * zp[f] + kf;
      for (int64_t m = 0; m < dim; ++m) {
        const float updated = gf * row[m] + kf * v[m];
        row[m] = updated;
        num[m] += qf * updated;
      }
    } else {
      zp[f] += kf;
      for (int64_t m = 0; m < dim; ++m) {
        const float updated = row[m] + kf * v[m];
        row[m] = updated;
        num[m] += qf * updated;
      }
    }
    den += qf * zp[f];
  }
  const float inv = 1.f / (den + eps);
  for (int64_t m = 0; m < dim; ++m) o[m] = num[m] * inv;
}

// Every (row, head). qkv [B, 3d] holds phi(q), phi(k), v; gates [B, d] or nullptr;
// s [B, H, F, M]; z [B, H, F]; out [B, d].
void attend(const float* qkv, const float* gates, float* s, float* z, float* out,
            int64_t rows, int64_t heads, int64_t dim, double eps) {
  TORCH_CHECK(dim <= 1024, "head_dim above 1024 is not supported by the fused step");
  const int64_t d = heads * dim;
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* q = qkv + b * 3 * d + h * dim;
      float* args_s = s + bh * dim * dim;
      float* args_z = z + bh * dim;
      float* o = out + b * d + h * dim;
      const float* g = gates != nullptr ? gates + b * d + h * dim : nullptr;
      const auto e = static_cast<float>(eps);
      if (dim == 64) {
        attend_head<64>(q, q + d, q + 2 * d, g, args_s, args_z, o, dim, e);
      } else if (dim == 32) {
        attend_head<32>(q, q + d, q + 2 * d, g, args_s, args_z, o, dim, e);
      } else {
        attend_head<0>(q, q + d, q + 2 * d, g, args_s, args_z, o, dim, e);
      }
    }
  });
}

// gates [B, d] from the gate's low-rank input low [B, r] (row stride ``ld``):
// x = bias + low @ up, g = max(sigmoid(x)^(1/16), e^-1), the same as exp(clamp(
// logsigmoid(x) / 16, -1)) in model/attention/gated.py.
void gates_from(const float* low, int64_t ld, const float* up, const float* bias, float* g,
                int64_t rows, int64_t rank, int64_t d) {
  constexpr float kMinGate = 0.36787944117144233f;  // e^-1
  for (int64_t b = 0; b < rows; ++b) {
    float* gb = g + b * d;
    std::memcpy(gb, bias, d * sizeof(float));
    for (int64_t r = 0; r < rank; ++r) {
      const float lr = low[b * ld + r];
      const float* ur = up + r * d;
      for (int64_t c = 0; c < d; ++c) gb[c] += lr * ur[c];
    }
    for (int64_t c = 0; c < d; ++c) {
      const float x = gb[c];
      const float e = linserve::exp_nonpositive(x > 0.f ? -x : x);  // exp(-|x|)
      float sg = x > 0.f ? 1.f / (1.f + e) : e / (1.f + e);
      sg = std::sqrt(std::sqrt(std::sqrt(std::sqrt(sg))));  // ^(1/16)
      gb[c] = sg < kMinGate ? kMinGate : sg;
    }
  }
}

void layer_step(at::Tensor& x, const std::vector<at::Tensor>& w, int64_t base, at::Tensor s,
                at::Tensor z, at::Tensor conv, int64_t heads, double attn_eps,
                double norm_eps) {
  const int64_t rows = x.size(0), d = x.size(1);
  const at::Tensor& cw = w[base + 2];
  const at::Tensor& gate_up = w[base + 7];
  at::Tensor qkv = project(normed(x, w[base], norm_eps), w[base + 1]);
  at::Tensor gates;
  if (gate_up.numel() > 0) {  // the qkv GEMM also made the gate's low-rank input
    const int64_t rank = gate_up.size(0);
    gates = at::empty({rows, d}, x.options());
    gates_from(qkv.data_ptr<float>() + 3 * d, qkv.size(1), gate_up.data_ptr<float>(),
               w[base + 8].data_ptr<float>(), gates.data_ptr<float>(), rows, rank, d);
    qkv = qkv.narrow(1, 0, 3 * d).contiguous();
  }
  const int64_t k = cw.numel() ? cw.size(0) : 0;
  conv_and_features(qkv.data_ptr<float>(), k > 1 ? conv.data_ptr<float>() : nullptr,
                    k ? cw.data_ptr<float>() : nullptr, rows, 3 * d, k);
  at::Tensor o = at::empty({rows, d}, x.options());
  attend(qkv.data_ptr<float>(), gates.defined() ? gates.data_ptr<float>() : nullptr,
         s.data_ptr<float>(), z.data_ptr<float>(), o.data_ptr<float>(), rows, heads, d / heads,
         attn_eps);
  project_add(x, o, w[base + 3]);
  linserve::mlp_add(x, w[base + 4], w[base + 5], w[base + 6], norm_eps);
}

at::Tensor linear_step(const at::Tensor& tokens, at::TensorList weights, at::TensorList s,
                       at::TensorList z, at::TensorList conv, const at::Tensor& lengths,
                       int64_t heads, double attn_eps, double norm_eps, bool with_head) {
  const std::vector<at::Tensor> w(weights.begin(), weights.end());
  const int64_t layers = (static_cast<int64_t>(w.size()) - 3) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(w.size()) == 3 + kPerLayer * layers, "bad weight list");
  TORCH_CHECK(static_cast<int64_t>(s.size()) == layers &&
                  static_cast<int64_t>(z.size()) == layers &&
                  static_cast<int64_t>(conv.size()) == layers,
              "state has the wrong number of layers");
  const at::Tensor& embed = w[0];
  at::Tensor x = linserve::embed_rows(embed, tokens, w[2].size(0), embed.is_same(w[1]));
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor sl = s[l], zl = z[l], cl = conv[l];
    TORCH_CHECK(sl.scalar_type() == at::kFloat && zl.scalar_type() == at::kFloat &&
                    cl.scalar_type() == at::kFloat, "state must be fp32");
    TORCH_CHECK(sl.is_contiguous() && zl.is_contiguous() && cl.is_contiguous(),
                "each layer's state must be contiguous");
    TORCH_CHECK(sl.size(0) == x.size(0), "state and tokens disagree on the batch size");
    layer_step(x, w, 3 + kPerLayer * l, sl, zl, cl, heads, attn_eps, norm_eps);
  }
  linserve::advance(lengths, x.size(0));
  return with_head ? project(normed(x, w[2], norm_eps), w[1]) : x;
}


TORCH_LIBRARY(linserve, m) {
  m.def(
      "linear_step(Tensor tokens, Tensor[] weights, Tensor(a!)[] s, Tensor(b!)[] z, "
      "Tensor(c!)[] conv, Tensor(d!) lengths, int heads, float attn_eps, float norm_eps, "
      "bool with_head=True) "
      "-> Tensor");
  m.def("matmul(Tensor a, Tensor w) -> Tensor");
}

// matmul: a [B, in] fp32 @ w [in, out] the way the step runs its products (benchmarks).
TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("linear_step", &linear_step);
  m.impl("matmul", [](const at::Tensor& a, const at::Tensor& w) {
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && w.is_contiguous(),
                "matmul takes contiguous fp32 activations and [in, out] weights");
    return project(a, w);
  });
}

}  // namespace linear_step_cpp
