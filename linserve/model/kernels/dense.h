// Dense helpers shared by the fused decode steps (linear_step.cpp, softmax_step.cpp):
// RMSNorm over fp32 rows and the products x @ W with fp32 activations and fp32 or bf16
// weights stored [in, out].
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "embed.h"
#include "fastmath.h"
#include "gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstring>

namespace linserve {

// dst = src (fp32, contiguous, same size): a verify's snapshot of a recurrent state after a
// position. The stores stream past the caches (non-temporal): a snapshot is read again only
// when a draft is rejected, and a cached store first read each destination line from memory,
// which doubled the copy's traffic (the 0.8B shapes' 18 MB of states a position: 2.3 ms of
// an int8 verify of 3 drafts went to its snapshots). Two threads; the bits are src's.
inline void snapshot(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.numel() == src.numel() &&
                  dst.scalar_type() == at::kFloat && src.scalar_type() == at::kFloat,
              "snapshot: fp32 contiguous tensors of one size");
  float* d = dst.data_ptr<float>();
  const float* s = src.data_ptr<float>();
  const int64_t n = src.numel();
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(d) % 64 == 0) {
    const int64_t vecs = n / 16;
    at::parallel_for(0, vecs, 4096, [&](int64_t v0, int64_t v1) {
      for (int64_t v = v0; v < v1; ++v)
        _mm512_stream_ps(d + 16 * v, _mm512_loadu_ps(s + 16 * v));
      _mm_sfence();
    });
    std::memcpy(d + 16 * vecs, s + 16 * vecs, (n - 16 * vecs) * sizeof(float));
    return;
  }
#endif
  dst.copy_(src);
}

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

// x [n] = rmsnorm(x) * w, in place (one attention head's q or k norm).
inline void rms_row(float* x, const float* w, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * r * w[i];
}

// out [n] = (x - mean) / sqrt(var + eps) * w + b over n floats (LayerNorm's, or one group of
// a GroupNorm; var the biased one); out may be x.
inline void layer_norm_row(const float* x, const float* w, const float* b, float* out,
                           int64_t n, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  const float mean = sum / static_cast<float>(n);
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += (x[i] - mean) * (x[i] - mean);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] - mean) * r * w[i] + b[i];
}

// Rotary position ``pos`` on the first ``rot`` dims of x (halves rotated), in place.
inline void rotate_half(float* x, const float* inv_freq, int64_t rot, int64_t pos) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), sn = std::sin(angle);
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c - x2 * sn;
    x[i + half] = x2 * c + x1 * sn;
  }
}

// lengths[b] += 1 for the first ``rows`` rows of an int64 [B] tensor (no dispatch).
inline void advance(const at::Tensor& lengths, int64_t rows) {
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  lengths.size(0) == rows, "lengths must be contiguous int64 [B]");
  int64_t* p = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows; ++b) ++p[b];
}

// RMSNorm of x [B, d] fp32 into a new fp32 tensor.
inline at::Tensor normed(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0),
           x.size(1), eps);
  return out;
}

// LayerNorm of x [N, d] fp32 (weight and bias [d]) into a new fp32 tensor.
inline at::Tensor layer_normed(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                               double eps) {
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), d = x.size(1);
  for (int64_t r = 0; r < rows; ++r)
    layer_norm_row(x.data_ptr<float>() + r * d, w.data_ptr<float>(), b.data_ptr<float>(),
                   out.data_ptr<float>() + r * d, d, static_cast<float>(eps));
  return out;
}

// Whether projections run batch-invariant (gemm.h) or through ATen (oneDNN / MKL, bf16
// activations at larger batches). Set once per process by ``set_batch_invariant``.
inline bool& batch_invariant_flag() {
  static bool on = true;
  return on;
}

// Rows up to which bf16 weights use the invariant GEMM even when the mode is off: oneDNN is
// compute-bound on these shapes at batch 1 (a 256x1024 product: 50 us in bf16 against 29 us
// in fp32), the one-pass GEMV is memory-bound, as it should be.
constexpr int64_t kSmallBatch = 4;

// a [B, in] fp32 @ W [in, out] (fp32 or bf16) -> fp32 [B, out]; added into ``into`` if given.
inline void project(const at::Tensor& a, const at::Tensor& w, at::Tensor* into,
                    at::Tensor* out) {
  const int64_t rows = a.size(0);
  const bool small_bf16 = rows <= kSmallBatch && w.scalar_type() == at::kBFloat16;
  if (batch_invariant_flag() || small_bf16 || w.dim() == 3) {  // 3-d: bf16 pairs, gemm.h
    const at::Tensor x = a.contiguous();
    if (into != nullptr) {
      invariant_mm(x, w, *into, true);
    } else {
      *out = at::empty({rows, w.size(1)}, a.options());
      invariant_mm(x, w, *out, false);
    }
    return;
  }
  if (w.scalar_type() == at::kFloat) {
    if (into != nullptr) {
      into->addmm_(a, w);
    } else {
      *out = at::mm(a, w);
    }
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

// GELU, tanh form, of one value or each lane of a vector of floats:
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with tanh(|u|) = (1 - e) / (1 + e),
// e = exp(-2|u|) from exp_nonpositive (its lanes' form for vectors, the same bits).
// Within 1e-6 of torch's F.gelu(approximate="tanh").
template <typename V>
inline V gelu_tanh_of(V v) {
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  const V u = kAlpha * (v + 0.044715f * v * v * v);
  const V au = u < 0.f ? -u : u;
  V e;
  if constexpr (std::is_same_v<V, float>)
    e = exp_nonpositive(-2.f * au);
  else
    e = exp_nonpositive_lanes(-2.f * au);
  const V t = (1.f - e) / (1.f + e);
  return 0.5f * v * (1.f + (u < 0.f ? -t : t));
}

// gelu_tanh_of in place over n floats: the CPU's vectors (fastmath.h's vpart), then the tail
// one by one. (ATen's tanh GELU was ~6% of a bf16 prefill and of the batch-64 step; the loop
// of scalar calls did not vectorise.)
inline void gelu_tanh(float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kPartLanes <= n; i += kPartLanes) store_part(x + i, gelu_tanh_of(load_part(x + i)));
  for (; i < n; ++i) x[i] = gelu_tanh_of(x[i]);
}

// The MLP half of a pre-norm block: x += down(gelu_tanh(up(norm(x)))).
inline void mlp_add(at::Tensor& x, const at::Tensor& norm_w, const at::Tensor& up,
                    const at::Tensor& down, double norm_eps) {
  at::Tensor hid = project(normed(x, norm_w, norm_eps), up);
  gelu_tanh(hid.data_ptr<float>(), hid.numel());
  project_add(x, hid, down);
}

// a . b over n floats, with 16 partial sums the compiler keeps in vector registers.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int64_t l = 0; l < 16; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float total = 0.f;
  for (; i < n; ++i) total += a[i] * b[i];
  for (float v : acc) total += v;
  return total;
}

// One (row, head): out = softmax(K q / sqrt(D)) V over the first n slots of K, V [C, D].
inline void attend_head(const float* q, const float* keys, const float* values, int64_t n,
                        int64_t dim, float* scores, float* out) {
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  float top = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = dot(q, keys + j * dim, dim) * scale;
    top = std::max(top, scores[j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = linserve::exp_nonpositive(scores[j] - top);
    sum += scores[j];
  }
  for (int64_t m = 0; m < dim; ++m) out[m] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = scores[j];
    const float* vj = values + j * dim;
    for (int64_t m = 0; m < dim; ++m) out[m] += p * vj[m];
  }
  const float inv = 1.f / sum;
  for (int64_t m = 0; m < dim; ++m) out[m] *= inv;
}

}  // namespace linserve
