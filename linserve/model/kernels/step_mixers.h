// The native step's recurrent mixers and MLPs (step_parts.h's ShortConv, Mamba2, Kda,
// Lightning, GatedDelta, SwiGLU, ReluSquared, Experts), as the eager forms compute them
// (model/layers/short_conv.py, mamba2.py, kimi_delta.py, lightning.py, gated_delta.py,
// mlp.py, moe.py). Each takes h [T B, d] (Positions' layout) and returns [T B, d]; a
// recurrent one advances its state position after position and snapshots it (Positions).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dense.h"
#include "fastmath.h"
#include "gdn.h"
#include "kda.h"
#include "mamba2.h"
#include "mlstm.h"
#include "moe.h"
#include "parallel.h"
#include "step_parts.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace linserve::step {

// LFM2's short convolution (the struct's comment). State: window [B, K-1, d].
inline at::Tensor run(const ShortConv& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  at::Tensor& window = state[0];
  const int64_t rows = h.size(0) / c.pos.count, d = h.size(1), k = p.conv.size(0);
  const at::Tensor proj = linserve::project(h, p.in_proj);
  at::Tensor mixed = at::empty({h.size(0), d}, h.options());
  std::vector<float> bx(d), y(d);
  for (int64_t t = 0; t < c.pos.count; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = t * rows + r;
      const float* in = proj.data_ptr<float>() + row * 3 * d;  // B | C | x
      for (int64_t ch = 0; ch < d; ++ch) bx[ch] = in[ch] * in[2 * d + ch];
      float* win = window.data_ptr<float>() + r * (k - 1) * d;
      linserve::gdn::conv_sum(win, bx.data(), p.conv.data_ptr<float>(), y.data(), d, k);
      linserve::gdn::shift_window(win, bx.data(), d, k);
      float* out = mixed.data_ptr<float>() + row * d;
      for (int64_t ch = 0; ch < d; ++ch) out[ch] = in[d + ch] * y[ch];
    }
    c.pos.keep(t, state, ShortConv::kState);
  }
  return linserve::project(mixed, p.out);
}

// Heads of one row in a task of the SSM update: a head's state is 32 KB at Granite's shape,
// so a task of four is long enough to prefetch through and short enough to even out.
constexpr int64_t kSsmHeadsPerTask = 4;

// One row's SSM heads [h0, h1): S = exp(dt A) S + dt x B^T, y = S C + D x.
inline void ssm_heads(const float* xbc, const float* dt_raw, const Mamba2& p, float* s,
                      float* y, int64_t h0, int64_t h1) {
  const int64_t inner = p.heads * p.head_dim, per_group = p.heads / p.groups, n = p.d_state;
  const float* a_log = p.a_log.data_ptr<float>();
  const float* dt_bias = p.dt_bias.data_ptr<float>();
  const float* dskip = p.d_skip.data_ptr<float>();
  for (int64_t hh = h0; hh < h1; ++hh) {
    const int64_t g = hh / per_group;
    const float* b = xbc + inner + g * n;
    const float* c = xbc + inner + p.groups * n + g * n;
    const float dt = std::min(
        std::max(linserve::gdn::softplus(dt_raw[hh] + dt_bias[hh]), p.dt_min), p.dt_max);
    const float decay = std::exp(dt * -std::exp(a_log[hh]));
    for (int64_t i = 0; i < p.head_dim; ++i) {
      const float xv = xbc[hh * p.head_dim + i];
      y[hh * p.head_dim + i] =
          linserve::mamba2::ssm_row<true>(s + (hh * p.head_dim + i) * n, b, c, decay, xv * dt,
                                          n) +
          dskip[hh] * xv;
    }
  }
}

// One position of the B rows of a Mamba2 layer (proj, xbc and y from their first row):
// the convolutions, bias and SiLU over xBC, then the SSM update of every head.
inline void mamba2_rows(const float* proj_p, float* xbc_p, float* y_p, const Mamba2& p,
                        at::Tensor& s, at::Tensor& window, int64_t rows) {
  const int64_t inner = p.heads * p.head_dim, conv = inner + 2 * p.groups * p.d_state;
  const int64_t k = p.conv.size(0), width = inner + conv + p.heads;
  const float* conv_w = p.conv.data_ptr<float>();
  const float* conv_b = present(p.conv_bias) ? p.conv_bias.data_ptr<float>() : nullptr;
  float* window_p = window.data_ptr<float>();
  // The rows' convolutions, bias and SiLU over xBC (pointers hoisted: a data_ptr call per
  // element kept this loop scalar).
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* out = xbc_p + r * conv;
      const float* mixed = proj_p + r * width + inner;
      float* win = window_p + r * (k - 1) * conv;
      linserve::gdn::conv_sum(win, mixed, conv_w, out, conv, k);
      linserve::gdn::shift_window(win, mixed, conv, k);
      if (conv_b != nullptr)
        for (int64_t ch = 0; ch < conv; ++ch) out[ch] += conv_b[ch];
      linserve::gdn::silu_into(out, out, conv);
    }
  });
  const int64_t per_state = p.heads * p.head_dim * p.d_state;
  // Tasks of kSsmHeadsPerTask heads of one row, taken one at a time (parallel.h).
  const int64_t per_row = (p.heads + kSsmHeadsPerTask - 1) / kSsmHeadsPerTask;
  linserve::for_each_task(rows * per_row, [&](int64_t t) {
    const int64_t r = t / per_row, h0 = t % per_row * kSsmHeadsPerTask;
    ssm_heads(xbc_p + r * conv, proj_p + r * width + inner + conv, p,
              s.data_ptr<float>() + r * per_state, y_p + r * inner, h0,
              std::min(p.heads, h0 + kSsmHeadsPerTask));
  });
}

// Mamba2 (the struct's comment). State: S [B, H, P, N], window [B, K-1, conv].
inline at::Tensor run(const Mamba2& p, const at::Tensor& h, at::Tensor* state, const Call& c) {
  const int64_t all = h.size(0), rows = all / c.pos.count, inner = p.heads * p.head_dim;
  const int64_t conv = inner + 2 * p.groups * p.d_state, width = inner + conv + p.heads;
  const at::Tensor proj = linserve::project(h, p.in_proj);
  at::Tensor xbc = at::empty({all, conv}, h.options());
  at::Tensor y = at::empty({all, inner}, h.options());
  const float* proj_p = proj.data_ptr<float>();
  for (int64_t t = 0; t < c.pos.count; ++t) {
    mamba2_rows(proj_p + t * rows * width, xbc.data_ptr<float>() + t * rows * conv,
                y.data_ptr<float>() + t * rows * inner, p, state[0], state[1], rows);
    c.pos.keep(t, state, Mamba2::kState);
  }
  const float* norm_w = present(p.norm) ? p.norm.data_ptr<float>() : nullptr;
  const linserve::mamba2::Gate gate{inner, p.groups, norm_w != nullptr && p.gated_norm,
                                    p.norm_before_gate, p.norm_eps};
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, all, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      linserve::mamba2::gated_norm(y_p + r * inner, proj_p + r * width, norm_w, gate);
  });
  return linserve::project(y, p.out);
}

inline at::Tensor run(const SwiGLU& p, const at::Tensor& h, at::Tensor*, const Call&) {
  return linserve::project(linserve::moe::swiglu(linserve::project(h, p.gate_up)), p.down);
}

inline at::Tensor run(const ReluSquared& p, const at::Tensor& h, at::Tensor*, const Call&) {
  return linserve::project(linserve::moe::relu_squared(linserve::project(h, p.up)), p.down);
}

inline at::Tensor run(const Experts& p, const at::Tensor& h, at::Tensor*, const Call& c) {
  return linserve::moe::forward(h, p.slots, c.experts + p.first,
                                linserve::moe::router_from(p.top_k, p.router_bits, p.norm_eps,
                                                           p.scaling));
}

// Kimi Delta Attention's inputs of one row at one position: q, k, v after the causal conv
// and SiLU (q, k L2-normed, q scaled by Dk^-1/2) into qkv [3 W]; each channel's decay and
// each head's beta.
inline void kda_inputs(const float* mixed, float* window, const Kda& p, const float* f,
                       const float* b, float* qkv, float* decay, float* beta) {
  const int64_t heads = p.heads, dk = p.head_dim, width = heads * dk, k_width = p.conv.size(0);
  linserve::gdn::conv_sum(window, mixed, p.conv.data_ptr<float>(), qkv, 3 * width, k_width);
  linserve::gdn::shift_window(window, mixed, 3 * width, k_width);
  linserve::gdn::silu_into(qkv, qkv, 3 * width);
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  const float* a_log = p.params.data_ptr<float>();
  const float* dt_bias = a_log + heads;
  for (int64_t h = 0; h < heads; ++h) {
    linserve::gdn::l2norm(qkv + h * dk, dk, q_scale);
    linserve::gdn::l2norm(qkv + width + h * dk, dk, 1.f);
    const float rate = std::exp(a_log[h]);
    for (int64_t i = 0; i < dk; ++i) {
      const float fi = f[h * dk + i] + dt_bias[h * dk + i];
      const float g = p.safe_gate ? p.safe_lower / (1.f + std::exp(-rate * fi))
                                  : -rate * linserve::gdn::softplus(fi);
      decay[h * dk + i] = std::exp(g);
    }
    beta[h] = 1.f / (1.f + std::exp(-b[h]));
  }
}

// A projection through a bottleneck where given (Kimi's f_a / f_b, g_a / g_b), else direct.
inline at::Tensor low_rank(const at::Tensor& h, const at::Tensor& a, const at::Tensor& b) {
  return present(a) ? linserve::project(linserve::project(h, a), b) : linserve::project(h, b);
}

// Kimi Delta Attention (the struct's comment). State: S [B, H, Dk, Dk], window [B, K-1, 3W].
inline at::Tensor run(const Kda& p, const at::Tensor& h, at::Tensor* state, const Call& c) {
  const int64_t all = h.size(0), rows = all / c.pos.count, heads = p.heads, dk = p.head_dim;
  const int64_t width = heads * dk, k_width = p.conv.size(0);
  at::Tensor& s = state[0];
  at::Tensor& window = state[1];
  at::Tensor mixed = at::cat({linserve::project(h, p.q), linserve::project(h, p.k),
                              linserve::project(h, p.v)}, 1);
  const at::Tensor f = low_rank(h, p.f_a, p.f_b);
  at::Tensor gate = low_rank(h, p.g_a, p.g_b);
  const at::Tensor b = linserve::project(h, p.b);
  at::Tensor o = at::empty({all, width}, h.options());
  std::vector<float> qkv(rows * 3 * width), decay(rows * width), beta(rows * heads);
  for (int64_t t = 0; t < c.pos.count; ++t) {
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row = t * rows + r;
        kda_inputs(mixed.data_ptr<float>() + row * 3 * width,
                   window.data_ptr<float>() + r * (k_width - 1) * 3 * width, p,
                   f.data_ptr<float>() + row * width, b.data_ptr<float>() + row * heads,
                   qkv.data() + r * 3 * width, decay.data() + r * width, beta.data() + r * heads);
      }
    });
    at::parallel_for(0, rows * heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t r = task / heads, hh = task % heads;
        const float* in = qkv.data() + r * 3 * width + hh * dk;
        const linserve::kda::HeadTokens one{in, in + width, in + 2 * width,
                                            decay.data() + r * width + hh * dk,
                                            beta.data() + r * heads + hh,
                                            o.data_ptr<float>() + (t * rows + r) * width + hh * dk,
                                            0, 0, 0, 0};
        linserve::kda::scan_head(s.data_ptr<float>() + (r * heads + hh) * dk * dk, one, 1, dk,
                                 dk);
      }
    });
    c.pos.keep(t, state, Kda::kState);
  }
  const float* norm_w = p.params.data_ptr<float>() + heads + width;
  float* o_p = o.data_ptr<float>();
  const float* g_p = gate.data_ptr<float>();
  for (int64_t r = 0; r < all; ++r)
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* oh = o_p + r * width + hh * dk;
      linserve::rms_row(oh, norm_w, dk, p.norm_eps);
      for (int64_t i = 0; i < dk; ++i)
        oh[i] *= 1.f / (1.f + std::exp(-g_p[r * width + hh * dk + i]));
    }
  return linserve::project(o, p.o);
}

// Lightning attention (the struct's comment): per head S = e^-rate S + v k^T, y = S q
// (mamba2.h's row update with dt = 1, as the eager form's scan). State: S [B, H, D, D].
inline at::Tensor run(const Lightning& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  const int64_t all = h.size(0), rows = all / c.pos.count, heads = p.heads, dh = p.head_dim;
  const int64_t width = heads * dh;
  at::Tensor& s = state[0];
  at::Tensor qkv = linserve::project(h, p.qkv);
  float* qkv_p = qkv.data_ptr<float>();
  linserve::gdn::silu_into(qkv_p, qkv_p, qkv.numel());
  at::Tensor y = at::empty({all, width}, h.options());
  const float* log_rate = p.log_rate.data_ptr<float>();
  for (int64_t t = 0; t < c.pos.count; ++t) {
    at::parallel_for(0, rows * heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t r = task / heads, hh = task % heads, row = t * rows + r;
        const float* in = qkv_p + row * 3 * width + hh * 3 * dh;  // q | k | v
        const float decay = std::exp(-std::exp(log_rate[hh]));
        float* sh = s.data_ptr<float>() + (r * heads + hh) * dh * dh;
        float* out = y.data_ptr<float>() + row * width + hh * dh;
        for (int64_t i = 0; i < dh; ++i)
          out[i] = linserve::mamba2::ssm_row<true>(sh + i * dh, in + dh, in, decay,
                                                   in[2 * dh + i], dh);
      }
    });
    c.pos.keep(t, state, Lightning::kState);
  }
  const at::Tensor gate = linserve::project(h, p.gate);
  at::Tensor o = linserve::normed(y, p.norm, p.norm_eps);
  float* o_p = o.data_ptr<float>();
  const float* g_p = gate.data_ptr<float>();
  for (int64_t i = 0; i < o.numel(); ++i) o_p[i] *= 1.f / (1.f + std::exp(-g_p[i]));
  return linserve::project(o, p.out);
}

// Gated DeltaNet (the struct's comment; Qwen3.5's and OLMo-Hybrid's linear layers).
// State: S [B, Hv, Dk, Dv], window [B, K-1, C].
inline at::Tensor run(const GatedDelta& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  const int64_t all = h.size(0), rows = all / c.pos.count, hv = p.a_log.size(0);
  const int64_t dv = p.norm.size(0), dk = p.head_k_dim;
  const int64_t c_len = 2 * p.key_heads * dk + hv * dv, width = c_len + hv * dv + 2 * hv;
  const linserve::gdn::Shape sh{p.key_heads, hv, dk, dv, c_len, p.conv.size(0), p.norm_eps,
                                p.beta_scale};
  const at::Tensor proj = linserve::project(h, p.in_proj);
  at::Tensor y = at::empty({all, hv * dv}, h.options());
  for (int64_t t = 0; t < c.pos.count; ++t) {
    const float* mixed = proj.data_ptr<float>() + t * rows * width;
    const linserve::gdn::Inputs in{mixed, mixed + c_len, mixed + c_len + hv * dv + hv,
                                   mixed + c_len + hv * dv, width};
    linserve::gdn::step(in, state[1].data_ptr<float>(), p.conv.data_ptr<float>(),
                        p.a_log.data_ptr<float>(), p.dt_bias.data_ptr<float>(),
                        state[0].data_ptr<float>(), p.norm.data_ptr<float>(),
                        y.data_ptr<float>() + t * rows * hv * dv, rows, sh);
    c.pos.keep(t, state, GatedDelta::kState);
  }
  return linserve::project(y, p.out);
}

// xLSTM's mLSTM layer (step_parts.h's Mlstm; model/layers/mlstm.py has the arithmetic).
// State: C [B, H, K, V], n [B, H, K], m [B, 1, H].
inline at::Tensor run(const Mlstm& p, const at::Tensor& x, at::Tensor* state, const Call& c) {
  const int64_t all = x.size(0), rows = all / c.pos.count, heads = p.heads;
  const int64_t dk = p.qk_dim / heads, dv = p.v_dim / heads;
  at::Tensor y = linserve::project(x, p.proj);  // q k v o i f
  const int64_t width = y.size(1), gates = 2 * p.qk_dim + 2 * p.v_dim;
  float* yp = y.data_ptr<float>();
  const float* bias = p.gate_bias.data_ptr<float>();
  for (int64_t r = 0; r < all; ++r)
    for (int64_t g = 0; g < 2 * heads; ++g) {
      float& z = yp[r * width + gates + g];
      z = std::tanh((z + bias[g]) / p.gate_cap) * p.gate_cap;
    }
  at::Tensor h = at::empty({all, p.v_dim}, x.options());
  float* hp = h.data_ptr<float>();
  for (int64_t t = 0; t < c.pos.count; ++t) {
    at::parallel_for(0, rows * heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t hh = task % heads, row = t * rows + task / heads;
        const float* base = yp + row * width;
        linserve::mlstm::head_token(
            state[0].data_ptr<float>() + task * dk * dv, state[1].data_ptr<float>() + task * dk,
            state[2].data_ptr<float>() + task, base + hh * dk, base + p.qk_dim + hh * dk,
            base + 2 * p.qk_dim + hh * dv, base[gates + hh], base[gates + heads + hh],
            hp + row * p.v_dim + hh * dv, dk, dv, p.eps);
      }
    });
    c.pos.keep(t, state, Mlstm::kState);
  }
  const std::vector<float> zeros(dv, 0.f);
  const float* w = p.norm.data_ptr<float>();
  for (int64_t r = 0; r < all; ++r) {
    const float* o = yp + r * width + 2 * p.qk_dim + p.v_dim;
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* at = hp + r * p.v_dim + hh * dv;
      linserve::layer_norm_row(at, w + hh * dv, zeros.data(), at, dv, p.norm_eps);
    }
    for (int64_t j = 0; j < p.v_dim; ++j)
      hp[r * p.v_dim + j] = 1.f / (1.f + std::exp(-o[j])) * hp[r * p.v_dim + j];
  }
  return linserve::project(h, p.out);
}

}  // namespace linserve::step
