// xLSTM's mLSTM cell, one head of one token (model/layers/mlstm.py's mlstm_scan; transformers'
// mlstm_recurrent_step_native), fp32. The state: C [dk, dv] (key x value), n [dk] and the
// stabiliser m; i and f are the gates' pre-activations (soft-capped already):
//   m' = max(logsigmoid(f) + m, i),  a = exp(logsigmoid(f) + m - m'),  b = exp(i - m'),
//   C <- a C + b k v^T,  n <- a n + b k,  q = q / sqrt(dk),
//   h = (q^T C) / (max(|q . n|, exp(-m')) + eps).
// Used by the prefill's scan (mlstm_ops.cpp) and the whole-model step (step_mixers.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace linserve::mlstm {

inline float log_sigmoid(float x) {
  return x >= 0.f ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

inline void head_token(float* c, float* n, float* m, const float* q, const float* k,
                       const float* v, float ig, float fg, float* h, int64_t dk, int64_t dv,
                       float eps) {
  const float flog = log_sigmoid(fg);
  const float next = std::max(flog + *m, ig);
  const float a = std::exp(flog + *m - next), b = std::exp(ig - next);
  const float scale = 1.f / std::sqrt(static_cast<float>(dk));
  float qn = 0.f;
  for (int64_t j = 0; j < dv; ++j) h[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = c + i * dv;
    const float kb = b * k[i], qi = q[i] * scale;
    for (int64_t j = 0; j < dv; ++j) {
      row[j] = a * row[j] + kb * v[j];
      h[j] += qi * row[j];
    }
    n[i] = a * n[i] + kb;
    qn += qi * n[i];
  }
  const float denom = std::max(std::fabs(qn), std::exp(-next)) + eps;
  for (int64_t j = 0; j < dv; ++j) h[j] /= denom;
  *m = next;
}

}  // namespace linserve::mlstm
