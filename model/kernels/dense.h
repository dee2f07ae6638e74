// Dense helpers shared by the fused decode steps (linear_step.cpp, softmax_step.cpp):
// RMSNorm over fp32 rows and the products x @ W with fp32 activations and fp32 or bf16
// weights stored [in, out].
#pragma once

#include <ATen/ATen.h>

#include "fastmath.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace linserve {

// out[b, :] = x[b, :] / sqrt(mean(x[b, :]^2) + eps) * w, all fp32 [B, d].
inline void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t d,
              double eps) {
  for (int64_t b = 0; b < rows; ++b) {
    const float* xr = x + b * d;
    float* o = out + b * d;
    float ss = 0.f;
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + static_cast<float>(eps));
    for (int64_t i = 0; i < d; ++i) o[i] = xr[i] * r * w[i];
  }
}

// RMSNorm of x [B, d] fp32 into a new fp32 tensor.
inline at::Tensor normed(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
           x.size(1), eps);
  return out;
}

// Rows up to which bf16 weights use bf16_gemv instead of oneDNN, which is compute-bound on
// these shapes at batch 1 (a 256x1024 product: 50 us in bf16 against 29 us in fp32).
constexpr int64_t kSmallBatch = 4;

// y [B, out] (+)= x [B, in] @ W [in, out] with fp32 x and y and bf16 W: one pass over W,
// each bf16 widened to fp32 by a 16-bit shift; memory-bound, as a GEMV should be.
inline void bf16_gemv(const float* x, const at::BFloat16* w, float* y, int64_t rows, int64_t in,
               int64_t out, bool accumulate) {
  const auto* wb = reinterpret_cast<const uint16_t*>(w);
  if (!accumulate) std::memset(y, 0, rows * out * sizeof(float));
  for (int64_t i = 0; i < in; ++i) {
    const uint16_t* wr = wb + i * out;
    for (int64_t b = 0; b < rows; ++b) {
      const float xi = x[b * in + i];
      float* yr = y + b * out;
      for (int64_t o = 0; o < out; ++o) {
        const uint32_t bits = static_cast<uint32_t>(wr[o]) << 16;
        float wf;
        std::memcpy(&wf, &bits, sizeof(wf));
        yr[o] += xi * wf;
      }
    }
  }
}

// a [B, in] fp32 @ W [in, out] (fp32 or bf16) -> fp32 [B, out]; added into ``into`` if given.
inline void project(const at::Tensor& a, const at::Tensor& w, at::Tensor* into,
                    at::Tensor* out) {
  const int64_t rows = a.size(0);
  if (w.scalar_type() == at::kFloat) {
    if (into != nullptr) {
      into->addmm_(a, w);
    } else {
      *out = at::mm(a, w);
    }
    return;
  }
  if (rows <= kSmallBatch && w.scalar_type() == at::kBFloat16) {
    at::Tensor& y = into != nullptr ? *into : (*out = at::empty({rows, w.size(1)}, a.options()));
    bf16_gemv(a.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), rows,
              w.size(0), w.size(1), into != nullptr);
    return;
  }
  at::Tensor y = at::mm(a.to(w.scalar_type()), w).to(at::kFloat);
  if (into != nullptr) {
    into->add_(y);
  } else {
    *out = y;
  }
}

inline at::Tensor project(const at::Tensor& a, const at::Tensor& w) {
  at::Tensor out;
  project(a, w, nullptr, &out);
  return out;
}

inline void project_add(at::Tensor& x, const at::Tensor& a, const at::Tensor& w) {
  project(a, w, &x, nullptr);
}

// GELU, tanh form, in place over n floats: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
// with tanh(|u|) = (1 - e) / (1 + e), e = exp(-2|u|) from exp_nonpositive, so the loop
// vectorises (ATen's tanh GELU was ~6% of a bf16 prefill and of the batch-64 step).
// Within 1e-6 of torch's F.gelu(approximate="tanh").
inline void gelu_tanh(float* x, int64_t n) {
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float u = kAlpha * (v + 0.044715f * v * v * v);
    const float au = u < 0.f ? -u : u;
    const float e = exp_nonpositive(-2.f * au);
    const float t = (1.f - e) / (1.f + e);
    x[i] = 0.5f * v * (1.f + (u < 0.f ? -t : t));
  }
}

// The MLP half of a pre-norm block: x += down(gelu_tanh(up(norm(x)))).
inline void mlp_add(at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& up,
                    const at::Tensor& down, double norm_eps) {
  at::Tensor hid = project(normed(x, norm_w, norm_eps), up);
  gelu_tanh(hid.data_ptr<float>(), hid.numel());
  project_add(x, hid, down);
}

}  // namespace linserve
