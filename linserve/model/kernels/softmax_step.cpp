// Fused decode step for the softmax baselines (full causal attention with a KV cache, or
// sliding-window attention over a ring of W slots).
//
// One call advances every row by one token at its own position and returns the logits (or,
// with with_head=false, the last layer's output [B, d]). Per layer: RMSNorm, the qkv GEMM,
// rotary positions on q and k (angles in fp64, as model/attention/softmax.py computes them),
// the new key and value written into the cache at their slot, then decode attention over the
// row's valid slots -- scores q.k / sqrt(D), a max-subtracted softmax and the weighted sum of
// values, one pass over K and one over V per (row, head), parallel over rows x heads -- and
// the output projection and MLP as in the linear step (dense.h). The eager step's SDPA call
// with a per-row mask, the rotary table gather and the cache's advanced-index writes are a
// dozen dispatches per layer; here they are loops over memory the step must read anyway.
//
// Shapes (B rows, L layers, H heads, D head_dim, d = H*D, C cache slots):
//   tokens [B] int64; k, v: one [B, H, C, D] per layer, fp32, contiguous, all of one capacity
//   C (model/state.py's KV entries; the pool's live-row views are contiguous);
//   lengths [B] int64, the position of each row's new token, advanced by one at the end;
//   the cache must already have a slot for it.
//   weights (see model/fused_step.py): embed [V, d], head [d, V], final norm [d] fp32, then
//   per layer norm1 [d] fp32, qkv [d, 3d], out [d, d], norm2 [d] fp32, up [d, f], down [f, d].
//   window: 0 for full attention (slot = position), else W (slot = position mod W, and a row
//   reads min(position + 1, W) slots).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dense.h"
#include "fastmath.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace softmax_step_cpp {  // named, not anonymous: unity units (build.py) join sources

constexpr int64_t kPerLayer = 6;

// Rotate the pairs (x[i], x[i + D/2]) of every head of one row's q or k [H * D] by the angles
// pos * inv_freq[i], in place.
void rope_row(float* x, const std::vector<double>& inv_freq, int64_t pos, int64_t heads,
              int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const double ang = static_cast<double>(pos) * inv_freq[i];
    const auto c = static_cast<float>(std::cos(ang));
    const auto s = static_cast<float>(std::sin(ang));
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + h * dim;
      const float x1 = xh[i], x2 = xh[i + half];
      xh[i] = x1 * c - x2 * s;
      xh[i + half] = x1 * s + x2 * c;
    }
  }
}


struct Cache {
  std::vector<float*> k, v;  // per layer [B, H, C, D]
  const int64_t* lengths;
  int64_t heads, slots, dim, window;

  // Start of head h, slot 0 of row b's keys (or values) in one layer.
  int64_t offset(int64_t b, int64_t h) const { return (b * heads + h) * slots * dim; }
  int64_t slot(int64_t b) const { return window ? lengths[b] % window : lengths[b]; }
  int64_t valid(int64_t b) const {
    return window ? std::min(lengths[b] + 1, window) : lengths[b] + 1;
  }
};

// qkv [B, 3d] (rotated q, k and v) -> the new keys and values into their slots, then every
// (row, head)'s attention output into out [B, d].
void cache_and_attend(const float* qkv, const Cache& c, int64_t layer, int64_t rows,
                      float* out) {
  const int64_t d = c.heads * c.dim;
  for (int64_t b = 0; b < rows; ++b) {
    for (int64_t h = 0; h < c.heads; ++h) {
      const int64_t at = c.offset(b, h) + c.slot(b) * c.dim;
      std::memcpy(c.k[layer] + at, qkv + b * 3 * d + d + h * c.dim, c.dim * sizeof(float));
      std::memcpy(c.v[layer] + at, qkv + b * 3 * d + 2 * d + h * c.dim, c.dim * sizeof(float));
    }
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < rows; ++b) longest = std::max(longest, c.valid(b));
  at::parallel_for(0, rows * c.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(longest);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / c.heads, h = bh % c.heads;
      const int64_t base = c.offset(b, h);
      linserve::attend_head(qkv + b * 3 * d + h * c.dim, c.k[layer] + base, c.v[layer] + base, c.valid(b),
                  c.dim,
                  scores.data(), out + b * d + h * c.dim);
    }
  });
}

at::Tensor softmax_step(const at::Tensor& tokens, at::TensorList weights, at::TensorList k,
                        at::TensorList v, const at::Tensor& lengths, int64_t heads,
                        int64_t window, double rope_base, double norm_eps, bool with_head) {
  const std::vector<at::Tensor> w(weights.begin(), weights.end());
  const int64_t layers = (static_cast<int64_t>(w.size()) - 3) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(w.size()) == 3 + kPerLayer * layers, "bad weight list");
  TORCH_CHECK(static_cast<int64_t>(k.size()) == layers &&
                  static_cast<int64_t>(v.size()) == layers, "one K and V per layer expected");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.size(0) == tokens.size(0),
              "tokens and lengths disagree on the batch size");
  const int64_t dim = k[0].size(3), slots = k[0].size(2);
  Cache c{{}, {}, lengths.data_ptr<int64_t>(), heads, slots, dim, window};
  for (int64_t l = 0; l < layers; ++l) {
    TORCH_CHECK(k[l].dim() == 4 && k[l].sizes() == v[l].sizes() && k[l].size(1) == heads &&
                    k[l].size(2) == slots && k[l].size(3) == dim &&
                    k[l].size(0) == tokens.size(0), "the KV cache has the wrong shape");
    TORCH_CHECK(k[l].scalar_type() == at::kFloat && v[l].scalar_type() == at::kFloat &&
                    k[l].is_contiguous() && v[l].is_contiguous(),
                "the KV cache must be contiguous fp32");
    c.k.push_back(k[l].data_ptr<float>());
    c.v.push_back(v[l].data_ptr<float>());
  }
  for (int64_t b = 0; b < tokens.size(0); ++b) {
    TORCH_CHECK(c.lengths[b] >= 0 && c.slot(b) < slots, "no cache slot for the new token");
  }
  std::vector<double> inv_freq(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    inv_freq[i] = 1.0 / std::pow(rope_base, static_cast<double>(2 * i) / dim);
  }
  at::Tensor x = linserve::embed_rows(w[0], tokens, w[2].size(0), w[0].is_same(w[1]));
  const int64_t rows = x.size(0), d = x.size(1);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t base = 3 + kPerLayer * l;
    at::Tensor qkv = linserve::project(linserve::normed(x, w[base], norm_eps), w[base + 1]);
    float* p = qkv.data_ptr<float>();
    for (int64_t b = 0; b < rows; ++b) {
      rope_row(p + b * 3 * d, inv_freq, c.lengths[b], heads, dim);
      rope_row(p + b * 3 * d + d, inv_freq, c.lengths[b], heads, dim);
    }
    at::Tensor o = at::empty({rows, d}, x.options());
    cache_and_attend(p, c, l, rows, o.data_ptr<float>());
    linserve::project_add(x, o, w[base + 2]);
    linserve::mlp_add(x, w[base + 3], w[base + 4], w[base + 5], norm_eps);
  }
  linserve::advance(lengths, rows);
  return with_head ? linserve::project(linserve::normed(x, w[2], norm_eps), w[1]) : x;
}


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "softmax_step(Tensor tokens, Tensor[] weights, Tensor(a!)[] k, Tensor(b!)[] v, "
      "Tensor(c!) lengths, int heads, int window, float rope_base, float norm_eps, "
      "bool with_head=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("softmax_step", &softmax_step); }

}  // namespace softmax_step_cpp
