// The native step's RWKV parts (step_parts.h's Rwkv7TimeMix, Rwkv7ChannelMix, Rwkv6TimeMix,
// Rwkv4TimeMix and RwkvGatedChannelMix), as model/layers/rwkv7.py, rwkv6.py and rwkv4.py
// compute them (their docstrings have the arithmetic). Each takes the
// normed h [T B, d] (Positions' layout) and returns [T B, d]; the token shift is the state's
// [B, 1, d], advanced position after position with the recurrence (so verify's snapshots hold
// both).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "dense.h"
#include "gdn.h"
#include "step_parts.h"
#include "wkv6.h"
#include "wkv7.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace linserve::step {

constexpr float kRwkvDecayScale = 0.606531f;  // e^{-1/2}

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// The previous token's h for each of the T B rows: the state's shift for position 0, h's
// row of position t - 1 after it. shift [B, 1, d].
inline at::Tensor shifted(const at::Tensor& h, const at::Tensor& shift, int64_t count) {
  const int64_t all = h.size(0), rows = all / count, d = h.size(1);
  at::Tensor prev = at::empty_like(h);
  std::memcpy(prev.data_ptr<float>(), shift.data_ptr<float>(), rows * d * sizeof(float));
  if (count > 1)
    std::memcpy(prev.data_ptr<float>() + rows * d, h.data_ptr<float>(),
                (all - rows) * d * sizeof(float));
  return prev;
}

// x + (prev - x) mix for one of the six lerps (mix [d]) over all rows.
inline at::Tensor lerp(const at::Tensor& x, const at::Tensor& prev, const float* mix) {
  at::Tensor out = at::empty_like(x);
  const int64_t all = x.size(0), d = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* pp = prev.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < all * d; ++i) op[i] = xp[i] + (pp[i] - xp[i]) * mix[i % d];
  return out;
}

// up(act(down(x))) + bias (bias empty: none); act 0 none, 1 tanh, 2 sigmoid.
inline at::Tensor lora(const at::Tensor& x, const at::Tensor& down, const at::Tensor& up,
                       const at::Tensor& bias, int act) {
  at::Tensor h = linserve::project(x, down);
  if (act != 0) {
    float* p = h.data_ptr<float>();
    for (int64_t i = 0; i < h.numel(); ++i) p[i] = act == 1 ? std::tanh(p[i]) : sigmoid(p[i]);
  }
  at::Tensor out = linserve::project(h, up);
  if (present(bias)) {
    const int64_t d = out.size(1);
    float* op = out.data_ptr<float>();
    const float* b = bias.data_ptr<float>();
    for (int64_t i = 0; i < out.size(0); ++i)
      for (int64_t c = 0; c < d; ++c) op[i * d + c] += b[c];
  }
  return out;
}

// Each element of x through f, in place.
template <typename F>
inline void each(at::Tensor& x, F f) {
  float* p = x.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) p[i] = f(p[i]);
}

// The token shifts' bookkeeping of a part whose shift is state[j]: after each position, the
// shift holds that position's h, and a verify keeps the part's n state tensors.
inline void advance_shift(const at::Tensor& h, at::Tensor* state, int j, int n,
                          const Call& c, int64_t t) {
  const int64_t rows = h.size(0) / c.pos.count, d = h.size(1);
  std::memcpy(state[j].data_ptr<float>(), h.data_ptr<float>() + t * rows * d,
              rows * d * sizeof(float));
  c.pos.keep(t, state, n);
}

// The recurrence's inputs of all rows, fp32 [T B, d] each: r, the decay, k (mixed with a),
// v (mixed with v1), kk (normalised per head), a, and the gate g.
struct Rwkv7Inputs {
  at::Tensor r, w, k, v, kk, a, g;
};

// The per-channel arithmetic of the inputs (the projections given, v already mixed), in
// place: a's sigmoid, kk, k mixed with a, the decay; kk normalised per head.
inline void rwkv7_mix(Rwkv7Inputs& in, const Rwkv7TimeMix& p) {
  const int64_t all = in.r.size(0), d = in.r.size(1), n = p.head_dim;
  float *w = in.w.data_ptr<float>(), *k = in.k.data_ptr<float>();
  float *kk = in.kk.data_ptr<float>(), *a = in.a.data_ptr<float>();
  const float* k_k = p.k_k.data_ptr<float>();
  const float* k_a = p.k_a.data_ptr<float>();
  for (int64_t i = 0; i < all * d; ++i) {
    const int64_t c = i % d;
    a[i] = sigmoid(a[i]);
    kk[i] = k[i] * k_k[c];
    k[i] = k[i] * (1.f + (a[i] - 1.f) * k_a[c]);
    w[i] = std::exp(-kRwkvDecayScale * sigmoid(w[i]));
  }
  for (int64_t h = 0; h < all * d / n; ++h) {  // kk / max(|kk|, 1e-12) per head
    float* x = kk + h * n;
    const float norm = std::max(std::sqrt(linserve::dot(x, x, n)), 1e-12f);
    for (int64_t j = 0; j < n; ++j) x[j] /= norm;
  }
}

// The GroupNorm per head of y [T B, d], then the bonus (sum over the head of r k r_k) v.
inline void rwkv7_out(at::Tensor& y, const Rwkv7Inputs& in, const Rwkv7TimeMix& p) {
  const int64_t all = y.size(0), d = y.size(1), n = p.head_dim;
  float* yp = y.data_ptr<float>();
  const float *r = in.r.data_ptr<float>(), *k = in.k.data_ptr<float>();
  const float *v = in.v.data_ptr<float>(), *g = in.g.data_ptr<float>();
  const float* r_k = p.r_k.data_ptr<float>();
  for (int64_t row = 0; row < all; ++row)
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t at = row * d + h * n;
      linserve::layer_norm_row(yp + at, p.norm.data_ptr<float>() + h * n,
                               p.norm_bias.data_ptr<float>() + h * n, yp + at, n, p.group_eps);
      float bonus = 0.f;
      for (int64_t j = 0; j < n; ++j) bonus += r[at + j] * k[at + j] * r_k[h * n + j];
      for (int64_t j = 0; j < n; ++j) yp[at + j] = (yp[at + j] + bonus * v[at + j]) * g[at + j];
    }
}

// RWKV-7's time mix (the struct's comment). State: S [B, H, N, N], the shift [B, 1, d].
inline at::Tensor run(const Rwkv7TimeMix& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  const int64_t all = h.size(0), rows = all / c.pos.count, d = h.size(1), n = p.head_dim;
  const at::Tensor prev = shifted(h, state[1], c.pos.count);
  const float* mixes = p.mixes.data_ptr<float>();
  at::Tensor xs[6];
  for (int m = 0; m < 6; ++m) xs[m] = lerp(h, prev, mixes + m * d);  // r w k v a g
  Rwkv7Inputs in{linserve::project(xs[0], p.r), lora(xs[1], p.w_down, p.w_up, p.w_bias, 1),
                 linserve::project(xs[2], p.k), linserve::project(xs[3], p.v),
                 at::Tensor(), lora(xs[4], p.a_down, p.a_up, p.a_bias, 0),
                 lora(xs[5], p.g_down, p.g_up, at::Tensor(), 2)};
  in.kk = at::empty_like(in.k);
  std::vector<at::Tensor>& carry = *c.carry;
  if (p.first) {
    carry[p.carry] = in.v.clone();  // v1, before any mixing
  } else {  // v + (v1 - v) sigmoid(v0 + x_v V1 V2)
    const at::Tensor mix = lora(xs[3], p.v_down, p.v_up, p.v_bias, 0);
    float* v = in.v.data_ptr<float>();
    const float* v1 = carry[p.carry].data_ptr<float>();
    const float* m = mix.data_ptr<float>();
    for (int64_t i = 0; i < mix.numel(); ++i) v[i] = v[i] + (v1[i] - v[i]) * sigmoid(m[i]);
  }
  rwkv7_mix(in, p);
  at::Tensor y = at::empty_like(in.r);
  for (int64_t t = 0; t < c.pos.count; ++t) {
    at::parallel_for(0, rows * p.heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t r = task / p.heads, hh = task % p.heads;
        const int64_t at = (t * rows + r) * d + hh * n;
        linserve::wkv7::head_token(state[0].data_ptr<float>() + task * n * n,
                                   in.r.data_ptr<float>() + at, in.w.data_ptr<float>() + at,
                                   in.k.data_ptr<float>() + at, in.v.data_ptr<float>() + at,
                                   in.kk.data_ptr<float>() + at, in.a.data_ptr<float>() + at,
                                   y.data_ptr<float>() + at, n);
      }
    });
    advance_shift(h, state, 1, Rwkv7TimeMix::kState, c, t);
  }
  rwkv7_out(y, in, p);
  return linserve::project(y, p.o);
}

// RWKV-7's channel mix (the struct's comment). State: the shift [B, 1, d].
inline at::Tensor run(const Rwkv7ChannelMix& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  at::Tensor xk = lerp(h, shifted(h, state[0], c.pos.count), p.x_k.data_ptr<float>());
  for (int64_t t = 0; t < c.pos.count; ++t)
    advance_shift(h, state, 0, Rwkv7ChannelMix::kState, c, t);
  at::Tensor k = linserve::project(xk, p.key);
  each(k, [](float z) { return z > 0.f ? z * z : 0.f; });
  return linserve::project(k, p.value);
}

// RWKV-6's five mixed inputs x_g = h + (prev - h)(maa_g + m_g), m from the token-shift LoRA.
inline std::vector<at::Tensor> rwkv6_mixed(const Rwkv6TimeMix& p, const at::Tensor& h,
                                           const at::Tensor& prev) {
  const int64_t all = h.size(0), d = h.size(1), rank = p.maa_w2.size(1);
  at::Tensor lo = linserve::project(lerp(h, prev, p.maa_x.data_ptr<float>()), p.maa_w1);
  each(lo, [](float z) { return std::tanh(z); });
  std::vector<at::Tensor> out;
  const float *hp = h.data_ptr<float>(), *pp = prev.data_ptr<float>();
  for (int64_t g = 0; g < 5; ++g) {
    at::Tensor m = linserve::project(lo.narrow(1, g * rank, rank).contiguous(),
                                     p.maa_w2.select(0, g).contiguous());
    float* mp = m.data_ptr<float>();
    const float* mu = p.maa.data_ptr<float>() + g * d;
    for (int64_t i = 0; i < all * d; ++i) mp[i] = hp[i] + (pp[i] - hp[i]) * (mu[i % d] + mp[i]);
    out.push_back(m);
  }
  return out;  // w k v r g
}

// RWKV-6's time mix (the struct's comment). State: S [B, H, N, N], the shift [B, 1, d].
inline at::Tensor run(const Rwkv6TimeMix& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  const int64_t all = h.size(0), rows = all / c.pos.count, d = h.size(1), n = p.head_dim;
  const std::vector<at::Tensor> x = rwkv6_mixed(p, h, shifted(h, state[1], c.pos.count));
  const at::Tensor r = linserve::project(x[3], p.r), k = linserve::project(x[1], p.k);
  const at::Tensor v = linserve::project(x[2], p.v);
  at::Tensor g = linserve::project(x[4], p.g);
  each(g, [](float z) { return z * sigmoid(z); });
  at::Tensor lo = linserve::project(x[0], p.decay_w1);
  each(lo, [](float z) { return std::tanh(z); });
  at::Tensor w = linserve::project(lo, p.decay_w2);
  const float* w0 = p.decay.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  for (int64_t i = 0; i < all * d; ++i) wp[i] = std::exp(-std::exp(w0[i % d] + wp[i]));
  at::Tensor y = at::empty_like(r);
  for (int64_t t = 0; t < c.pos.count; ++t) {
    at::parallel_for(0, rows * p.heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t hh = task % p.heads, at = (t * rows + task / p.heads) * d + hh * n;
        linserve::wkv6::head_token(state[0].data_ptr<float>() + task * n * n,
                                   r.data_ptr<float>() + at, wp + at, k.data_ptr<float>() + at,
                                   v.data_ptr<float>() + at, p.u.data_ptr<float>() + hh * n,
                                   y.data_ptr<float>() + at, n);
      }
    });
    advance_shift(h, state, 1, Rwkv6TimeMix::kState, c, t);
  }
  float* yp = y.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  for (int64_t row = 0; row < all; ++row)
    for (int64_t hh = 0; hh < p.heads; ++hh) {
      const int64_t at = row * d + hh * n;
      linserve::layer_norm_row(yp + at, p.norm.data_ptr<float>() + hh * n,
                               p.norm_bias.data_ptr<float>() + hh * n, yp + at, n, p.group_eps);
    }
  for (int64_t i = 0; i < all * d; ++i) yp[i] *= gp[i];
  return linserve::project(y, p.o);
}

// x mu + prev (1 - mu) (RWKV-4's lerp; mu [d]) over all rows.
inline at::Tensor mix4(const at::Tensor& x, const at::Tensor& prev, const float* mu) {
  at::Tensor out = at::empty_like(x);
  const int64_t d = x.size(1);
  const float *xp = x.data_ptr<float>(), *pp = prev.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i)
    op[i] = xp[i] * mu[i % d] + pp[i] * (1.f - mu[i % d]);
  return out;
}

// RWKV-4's time mix (the struct's comment). State: num, den, p [B, 3, 1, A], the shift.
inline at::Tensor run(const Rwkv4TimeMix& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  const int64_t rows = h.size(0) / c.pos.count, d = h.size(1), width = p.w.numel();
  const at::Tensor prev = shifted(h, state[1], c.pos.count);
  const float* mu = p.mix.data_ptr<float>();
  const at::Tensor k = linserve::project(mix4(h, prev, mu), p.k);
  const at::Tensor v = linserve::project(mix4(h, prev, mu + d), p.v);
  at::Tensor r = linserve::project(mix4(h, prev, mu + 2 * d), p.r);
  each(r, [](float z) { return sigmoid(z); });
  at::Tensor y = at::empty_like(k);
  for (int64_t t = 0; t < c.pos.count; ++t) {
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) {
        float* num = state[0].data_ptr<float>() + row * 3 * width;
        const int64_t at = (t * rows + row) * width;
        linserve::wkv4::channels_token(num, num + width, num + 2 * width,
                                       p.w.data_ptr<float>(), p.u.data_ptr<float>(),
                                       k.data_ptr<float>() + at, v.data_ptr<float>() + at,
                                       y.data_ptr<float>() + at, width);
      }
    });
    advance_shift(h, state, 1, Rwkv4TimeMix::kState, c, t);
  }
  y.mul_(r);
  return linserve::project(y, p.o);
}

// RWKV-4's and RWKV-6's channel mix (the struct's comment). State: the shift [B, 1, d].
inline at::Tensor run(const RwkvGatedChannelMix& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  const int64_t d = h.size(1);
  const at::Tensor prev = shifted(h, state[0], c.pos.count);
  const float* mu = p.mix.data_ptr<float>();
  const at::Tensor xk = p.maa ? lerp(h, prev, mu) : mix4(h, prev, mu);
  const at::Tensor xr = p.maa ? lerp(h, prev, mu + d) : mix4(h, prev, mu + d);
  for (int64_t t = 0; t < c.pos.count; ++t)
    advance_shift(h, state, 0, RwkvGatedChannelMix::kState, c, t);
  at::Tensor k = linserve::project(xk, p.key);
  each(k, [](float z) { return z > 0.f ? z * z : 0.f; });
  at::Tensor r = linserve::project(xr, p.receptance);
  each(r, [](float z) { return sigmoid(z); });
  at::Tensor out = linserve::project(k, p.value);
  out.mul_(r);
  return out;
}

}  // namespace linserve::step
