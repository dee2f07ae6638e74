// RWKV-7's state update, one head of one token (model/layers/rwkv7.py's wkv7_scan, BlinkDL's
// RWKV_x070 and llama.cpp's wkv7): with S [N(value), N(key)] row-major and the token's r, w
// (the decay), k, v, kk, a [N],
//   S <- S diag(w) + (S (-kk)) (kk a)^T + v k^T,   y = S r,
// row by row (each value row i is independent): sa = -(S_i . kk), then
// S_ij = S_ij w_j + sa kk_j a_j + v_i k_j, and y_i = S_i . r. Used by the prefill's scan
// (rwkv_ops.cpp) and the whole-model step (step_rwkv.h).
#pragma once

#include "dense.h"

#include <cstdint>

namespace linserve::wkv7 {

// One head of one token: s [n, n] (advanced in place), y [n].
inline void head_token(float* s, const float* r, const float* w, const float* k,
                       const float* v, const float* kk, const float* a, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float* row = s + i * n;
    const float sa = -linserve::dot(row, kk, n);
    const float vi = v[i];
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] * w[j] + sa * (kk[j] * a[j]) + vi * k[j];
    y[i] = linserve::dot(row, r, n);
  }
}

}  // namespace linserve::wkv7
