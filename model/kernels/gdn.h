// The Gated DeltaNet recurrent step (Qwen3.5's linear-attention layers), between a layer's
// input projections and its output projection; used by the gdn_step op (gdn_step.cpp) and
// by the whole-model step (qwen35_step.cpp).
//
// Per row: the causal depthwise convolution over the conv window and the new projections,
// SiLU, and the window shift; q and k L2-normalised per key head (q also scaled by Dk^-1/2);
// per value head the decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), and the
// gated delta rule over its state S [Dk, Dv]:
//   kv = S^T k (a read of S; in a scan, the previous token's pass computed it);
//   delta = beta (v - e^g kv);
//   one pass, row by row: S = e^g S + k delta^T, accumulating o = S^T q (and, in a scan,
//   the next token's S^T k);
// then the per-head RMSNorm of o times SiLU(z). The eager form reads and writes S four
// times (a multiply, two products and an outer-product add); a step reads it twice and
// writes it once, a scan reads and writes it once a token, which is what bounds a batched
// step, or a prefill, of a real-size model.
//
// Every (row, head) is computed by its own loops in a fixed order, so a row's result does not
// depend on the rows beside it or on the threads (batch invariance). fp32 throughout.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fastmath.h"

namespace linserve::gdn {


// x sigmoid(x) through exp_nonpositive (vectorised; glibc's expf is a call per element,
// which took a third of a prefill scan's time in gated_norm).
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // e^-|x|
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// The convolution + SiLU of one row into out [C]; shifts the row's window.
inline void conv_row(const float* mixed, float* window, const float* w, float* out,
                     int64_t c_len, int64_t k) {
  for (int64_t c = 0; c < c_len; ++c) {
    const float* wc = w + c * k;
    float acc = 0.f;
    for (int64_t i = 0; i < k - 1; ++i) acc += wc[i] * window[i * c_len + c];
    acc += wc[k - 1] * mixed[c];
    out[c] = silu(acc);
  }
  if (k > 1) {
    std::memmove(window, window + c_len, (k - 2) * c_len * sizeof(float));
    std::memcpy(window + (k - 2) * c_len, mixed, c_len * sizeof(float));
  }
}

// x [n] /= sqrt(sum x^2 + 1e-6), times ``scale``.
inline void l2norm(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// kv [dv] = S^T k for S [dk, dv].
inline void readout(const float* __restrict__ s, const float* k, float* __restrict__ kv,
                    int64_t dk, int64_t dv) {
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = s + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) kv[j] += ki * row[j];
  }
}

// One token of one value head's delta rule, in one pass over S [dk, dv], given kv = S^T k
// (of S before the token): delta = beta (v - decay kv); S = decay S + k delta^T; o = S^T q.
// With NEXT, the same pass leaves kv = S^T k_next, the next token's readout, so a scan over
// T tokens reads and writes S T times (plus one read), not 2T. ``delta``: dv floats.
template <bool NEXT>
inline void delta_pass(float* __restrict__ s, const float* q, const float* k, const float* v,
                       float decay, float beta, float* __restrict__ o, float* __restrict__ kv,
                       const float* k_next, int64_t dk, int64_t dv, float* __restrict__ delta) {
  for (int64_t j = 0; j < dv; ++j) {
    delta[j] = beta * (v[j] - decay * kv[j]);
    o[j] = 0.f;
    if (NEXT) kv[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i], ni = NEXT ? k_next[i] : 0.f;
    for (int64_t j = 0; j < dv; ++j) {
      const float r = decay * row[j] + ki * delta[j];
      row[j] = r;
      o[j] += qi * r;
      if (NEXT) kv[j] += ni * r;
    }
  }
}

// o [dv] = rmsnorm(o) * w * silu(z).
inline void gated_norm(float* o, const float* z, const float* w, int64_t dv, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
  for (int64_t j = 0; j < dv; ++j) o[j] = o[j] * r * w[j] * silu(z[j]);
}

// Shapes: Hk key / value heads Hv of Dk, Dv; C = 2 Hk Dk + Hv Dv; K conv width.
struct Shape {
  int64_t key_heads, hv, dk, dv, c_len, k;
  float eps;
};

// Inputs of one step for B rows, each a row-major [B, width] block read with its own row
// stride (they may be column ranges of one projection): mixed [C], z [Hv Dv], a, b [Hv].
struct Inputs {
  const float* mixed;
  const float* z;
  const float* a;
  const float* b;
  int64_t ld;  // the row stride shared by the four
};

// One token's convolved projections x [C]: q and k L2-normalised per key head in place, q
// also scaled by Dk^-1/2.
inline void normalize_qk(float* x, const Shape& sh) {
  const float q_scale = 1.f / std::sqrt(static_cast<float>(sh.dk));
  const int64_t key_dim = sh.key_heads * sh.dk;
  for (int64_t h = 0; h < sh.key_heads; ++h) {
    l2norm(x + h * sh.dk, sh.dk, q_scale);
    l2norm(x + key_dim + h * sh.dk, sh.dk, 1.f);
  }
}

// The delta rule over T tokens of ``rows`` rows, one token after the other (the recurrent
// form, for a prefill as for a step): conv [B, T, C] the convolved projections with q, k
// normalised (normalize_qk); z, a, b of row r's token t at (r T + t) in.ld; s [B, Hv, Dk, Dv]
// updated in place; out [B, T, Hv Dv] the gated-normed outputs. ``lengths`` [B] (or null: all
// T): row r's real tokens; the rest are padding, which leaves S alone and outputs zeros.
// Parallel over (row, value head): each head's S stays in cache for all T tokens.
inline void scan(const float* conv, const Inputs& in, const float* a_log, const float* dt_bias,
                 float* s, const float* norm_w, float* out, int64_t rows, int64_t t_len,
                 const int64_t* lengths, const Shape& sh) {
  const int64_t c_len = sh.c_len, hv = sh.hv, dk = sh.dk, dv = sh.dv;
  const int64_t key_dim = sh.key_heads * dk, rep = hv / sh.key_heads;
  at::parallel_for(0, rows * hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kv(dv), delta(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / hv, h = task % hv, kh = h / rep;
      const int64_t n = lengths == nullptr ? t_len : lengths[r];
      const float decay_rate = -std::exp(a_log[h]);
      float* state = s + (r * hv + h) * dk * dv;
      const auto x = [&](int64_t t) { return conv + (r * t_len + t) * c_len; };
      if (n > 0) readout(state, x(0) + key_dim + kh * dk, kv.data(), dk, dv);
      for (int64_t t = 0; t < t_len; ++t) {
        const int64_t i = r * t_len + t;  // the token's index in [B, T]
        float* o = out + i * hv * dv + h * dv;
        if (t >= n) {
          std::memset(o, 0, dv * sizeof(float));
          continue;
        }
        const float g = decay_rate * softplus(in.a[i * in.ld + h] + dt_bias[h]);
        const float beta = 1.f / (1.f + std::exp(-in.b[i * in.ld + h]));
        const float* xt = x(t);
        if (t + 1 < n) {
          delta_pass<true>(state, xt + kh * dk, xt + key_dim + kh * dk, xt + 2 * key_dim + h * dv,
                           std::exp(g), beta, o, kv.data(), x(t + 1) + key_dim + kh * dk, dk, dv,
                           delta.data());
        } else {
          delta_pass<false>(state, xt + kh * dk, xt + key_dim + kh * dk,
                            xt + 2 * key_dim + h * dv, std::exp(g), beta, o, kv.data(), nullptr,
                            dk, dv, delta.data());
        }
        gated_norm(o, in.z + i * in.ld + h * dv, norm_w, dv, sh.eps);
      }
    }
  });
}

// The step for ``rows`` rows: window [B, K-1, C] and s [B, Hv, Dk, Dv] updated in place,
// out [B, Hv Dv]. conv_w [C, K]; a_log, dt_bias [Hv]; norm_w [Dv]. Parallel over rows for the
// convolution, then over (row, value head).
inline void step(const Inputs& in, float* window, const float* conv_w, const float* a_log,
                 const float* dt_bias, float* s, const float* norm_w, float* out, int64_t rows,
                 const Shape& sh) {
  const int64_t c_len = sh.c_len, k = sh.k;
  std::vector<float> conv(rows * c_len);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = conv.data() + r * c_len;
      conv_row(in.mixed + r * in.ld, window + r * (k - 1) * c_len, conv_w, x, c_len, k);
      normalize_qk(x, sh);
    }
  });
  scan(conv.data(), in, a_log, dt_bias, s, norm_w, out, rows, 1, nullptr, sh);
}

}  // namespace linserve::gdn
