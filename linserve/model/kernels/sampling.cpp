// Fused sampling for the common case: temperature (with optional min-p) or greedy, per row.
//
// The eager sampler makes about ten passes over the [B, V] logits (copy, divide, masks,
// softmax, cumsum, argmax), each a trip to memory once B*V*4 bytes outgrow the cache: at
// B = 64, V = 8192 that is ~6.8 ms a step, half the decode step itself. Here each row is
// handled while it sits in L1/L2: one pass for the maximum, one for exp and the sum, one for
// the inverse-CDF walk. Top-k and top-p need a sort and stay in model/sampling.py.
//
// logits [B, V] fp32, temperature [B] fp32 (<= 0: greedy), min_p [B] fp32 (<= 0: off),
// u [B] fp32 uniforms in [0, 1) from each row's own generator, and optionally allowed
// [B, ceil(V/32)] int32 (structured outputs: bit i%32 of word i/32 set where token i may
// come next; an unconstrained row is all ones) -> tokens [B] int64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "fastmath.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace sampling_cpp {  // named, not anonymous: unity units (build.py) join sources

// The largest logit of a row (vectorised; NaN never wins).
float max_row(const float* l, int64_t v) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < v; ++i) m = l[i] > m ? l[i] : m;
  return m;
}

// Index of the largest logit (the first one on ties; NaN never wins).
int64_t argmax_row(const float* l, int64_t v) {
  const float m = max_row(l, v);
  for (int64_t i = 0; i < v; ++i) {
    if (l[i] == m) return i;
  }
  return 0;  // every logit NaN
}

// One draw from softmax(l / t), restricted to p_i >= min_p * p_max, by inverse CDF at u.
int64_t draw_row(const float* l, int64_t v, float t, float min_p, float u, float* w) {
  const float m = max_row(l, v);
  if (!std::isfinite(m)) return argmax_row(l, v);
  const float inv_t = 1.f / t;
  // p_i >= min_p * p_max  <=>  (l_i - m) / t >= log(min_p)
  const float floor = min_p > 0.f ? std::log(min_p) : -INFINITY;
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < v; ++i) {
    const float x = (l[i] - m) * inv_t;  // <= 0; NaN logits compare false below
    const float e = x >= floor ? linserve::exp_nonpositive(x) : 0.f;
    w[i] = e;
    total += e;
  }
  const float target = u * total;
  float cum = 0.f;
  int64_t last = -1;
  for (int64_t i = 0; i < v; ++i) {
    if (w[i] <= 0.f) continue;
    cum += w[i];
    last = i;
    if (cum > target) return i;
  }
  // Rounding left the target at the very top: the last kept token (the argmax always is one,
  // so it is only searched for, two more passes, if no token was kept at all).
  return last >= 0 ? last : argmax_row(l, v);
}

// Whether a row's bitmask allows every token (no copy needed).
bool all_allowed(const int32_t* bits, int64_t words) {
  for (int64_t w = 0; w < words; ++w) {
    if (bits[w] != -1) return false;
  }
  return true;
}

// The row with every token whose bit is clear set to -inf (into out, a scratch row).
void mask_row(const float* l, int64_t v, const int32_t* bits, float* out) {
  for (int64_t i = 0; i < v; ++i) {
    out[i] = (static_cast<uint32_t>(bits[i >> 5]) >> (i & 31)) & 1u ? l[i] : -INFINITY;
  }
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& min_p, const at::Tensor& u,
                       const c10::optional<at::Tensor>& allowed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits: [B, V] fp32");
  const at::Tensor l = logits.contiguous();
  const at::Tensor t = temperature.to(at::kFloat).contiguous();
  const at::Tensor mp = min_p.to(at::kFloat).contiguous();
  const at::Tensor uu = u.to(at::kFloat).contiguous();
  const int64_t rows = l.size(0), v = l.size(1);
  TORCH_CHECK(t.numel() == rows && mp.numel() == rows && uu.numel() == rows,
              "one temperature, min_p and uniform per row");
  at::Tensor out = at::empty({rows}, l.options().dtype(at::kLong));
  const float* lp = l.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const float* mpp = mp.data_ptr<float>();
  const float* up = uu.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::Tensor bits;
  const int64_t words = (v + 31) / 32;
  if (allowed.has_value()) {
    bits = allowed->contiguous();
    TORCH_CHECK(bits.scalar_type() == at::kInt && bits.dim() == 2 && bits.size(0) == rows &&
                    bits.size(1) == words, "allowed: [B, ceil(V/32)] int32");
  }
  const int32_t* bp = bits.defined() ? bits.data_ptr<int32_t>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(v);
    std::vector<float> masked;
    for (int64_t b = begin; b < end; ++b) {
      const float* row = lp + b * v;
      if (bp != nullptr && !all_allowed(bp + b * words, words)) {
        masked.resize(v);
        mask_row(row, v, bp + b * words, masked.data());
        row = masked.data();
      }
      op[b] = tp[b] > 0.f ? draw_row(row, v, tp[b], mpp[b], up[b], w.data())
                          : argmax_row(row, v);
    }
  });
  return out;
}


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor min_p, Tensor u, "
        "Tensor? allowed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("sample_rows", &sample_rows); }

}  // namespace sampling_cpp
