// The Gated DeltaNet recurrent step (Qwen3.5's linear-attention layers), between a layer's
// input projections and its output projection; used by the gdn_step op (gdn_step.cpp) and
// by the whole-model step (qwen35_step.cpp).
//
// Per row: the causal depthwise convolution over the conv window and the new projections,
// SiLU, and the window shift; q and k L2-normalised per key head (q also scaled by Dk^-1/2);
// per value head the decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), and the
// gated delta rule over its state S [Dk, Dv] in two passes:
//   pass 1, row by row of S: decay it, and accumulate kv = S^T k;
//   delta = beta (v - kv);
//   pass 2, row by row: S += k delta^T, and accumulate o = S^T q;
// then the per-head RMSNorm of o times SiLU(z). The eager form reads and writes S four
// times (a multiply, two products and an outer-product add); this reads it twice and writes
// it twice, which is what bounds a batched step of a real-size model.
//
// Every (row, head) is computed by its own loops in a fixed order, so a row's result does not
// depend on the rows beside it or on the threads (batch invariance). fp32 throughout.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace linserve::gdn {


inline float silu(float x) { return x / (1.f + std::exp(-x)); }

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

// One value head's delta rule on S [dk, dv]; o [dv] gets S^T q after the update.
inline void delta_head(float* s, const float* q, const float* k, const float* v, float decay,
                       float beta, float* o, int64_t dk, int64_t dv) {
  std::vector<float> kv(dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) kv[j] = beta * (v[j] - kv[j]);  // delta
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * kv[j];
      o[j] += qi * row[j];
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

// The step for ``rows`` rows: window [B, K-1, C] and s [B, Hv, Dk, Dv] updated in place,
// out [B, Hv Dv]. conv_w [C, K]; a_log, dt_bias [Hv]; norm_w [Dv]. Parallel over rows for the
// convolution, then over (row, value head).
inline void step(const Inputs& in, float* window, const float* conv_w, const float* a_log,
                 const float* dt_bias, float* s, const float* norm_w, float* out, int64_t rows,
                 const Shape& sh) {
  const int64_t c_len = sh.c_len, k = sh.k, hv = sh.hv, dk = sh.dk, dv = sh.dv;
  const int64_t key_dim = sh.key_heads * dk, rep = hv / sh.key_heads;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  std::vector<float> conv(rows * c_len);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = conv.data() + r * c_len;
      conv_row(in.mixed + r * in.ld, window + r * (k - 1) * c_len, conv_w, x, c_len, k);
      for (int64_t h = 0; h < sh.key_heads; ++h) {
        l2norm(x + h * dk, dk, q_scale);
        l2norm(x + key_dim + h * dk, dk, 1.f);
      }
    }
  });
  at::parallel_for(0, rows * hv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / hv, h = t % hv, kh = h / rep;
      const float* x = conv.data() + r * c_len;
      const float g = -std::exp(a_log[h]) * softplus(in.a[r * in.ld + h] + dt_bias[h]);
      const float beta = 1.f / (1.f + std::exp(-in.b[r * in.ld + h]));
      float* o = out + r * hv * dv + h * dv;
      delta_head(s + (r * hv + h) * dk * dv, x + kh * dk, x + key_dim + kh * dk,
                 x + 2 * key_dim + h * dv, std::exp(g), beta, o, dk, dv);
      gated_norm(o, in.z + r * in.ld + h * dv, norm_w, dv, sh.eps);
    }
  });
}

}  // namespace linserve::gdn
