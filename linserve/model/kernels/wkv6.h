// RWKV-6's and RWKV-4's recurrences, one head (or channel run) of one token
// (model/layers/rwkv6.py's wkv6_scan, rwkv4.py's wkv4_scan; BlinkDL's att_seq_v6_0 and
// transformers' rwkv_linear_attention_cpu). Used by the prefill's scans (rwkv_ops.cpp).
#pragma once

#include "dense.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace linserve::wkv6 {

// RWKV-6, one head of one token: s [n(value), n(key)] row-major (advanced in place), the
// token's r, w (the decay), k, v [n] and the bonus u [n] -> y [n]:
//   y_i = S_i . r + v_i (sum_j r_j u_j k_j),   S_ij <- S_ij w_j + v_i k_j.
inline void head_token(float* s, const float* r, const float* w, const float* k,
                       const float* v, const float* u, float* y, int64_t n) {
  float bonus = 0.f;
  for (int64_t j = 0; j < n; ++j) bonus += r[j] * u[j] * k[j];
  for (int64_t i = 0; i < n; ++i) {
    float* row = s + i * n;
    y[i] = linserve::dot(row, r, n) + v[i] * bonus;
    const float vi = v[i];
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] * w[j] + vi * k[j];
  }
}

}  // namespace linserve::wkv6

namespace linserve::wkv4 {

// RWKV-4, channels [0, n) of one token: the state num, den, p (its running maximum
// exponent; a fresh state's zeros stand for "nothing seen"), the time decay w (= -exp of the
// checkpoint's), the bonus u, the token's k and v -> y:
//   y = (e^(p-q) num + e^(k+u-q) v) / (e^(p-q) den + e^(k+u-q)),  q = max(p, k + u),
//   then num, den <- e^(p+w-q') (num, den) + e^(k-q') (v, 1),  p <- q' = max(p + w, k).
inline void channels_token(float* num, float* den, float* p, const float* w, const float* u,
                           const float* k, const float* v, float* y, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float ku = k[c] + u[c];
    const float q = std::max(p[c], ku);
    const float e1 = std::exp(p[c] - q), e2 = std::exp(ku - q);
    y[c] = (e1 * num[c] + e2 * v[c]) / (e1 * den[c] + e2);
    const float pw = p[c] + w[c];
    const float q2 = std::max(pw, k[c]);
    const float f1 = std::exp(pw - q2), f2 = std::exp(k[c] - q2);
    num[c] = f1 * num[c] + f2 * v[c];
    den[c] = f1 * den[c] + f2;
    p[c] = q2;
  }
}

}  // namespace linserve::wkv4
