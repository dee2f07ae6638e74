// The Gated DeltaNet recurrent step (Qwen3.5's linear-attention layers), between a layer's
// input projections and its output projection; used by the gdn_step op (gdn_step.cpp) and
// by the whole-model step (decoder_step.cpp).
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
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fastmath.h"

namespace linserve::gdn {


// x sigmoid(x) through exp_nonpositive (vectorised; glibc's expf is a call per element,
// which took a third of a prefill scan's time in gated_norm).
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // e^-|x|
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

// silu on each lane of V (vpart, or any vector of floats), bit for bit silu's: -|x| by the
// sign bit, then exp_nonpositive_lanes (fastmath.h). Checked on all 2^32 inputs against silu
// (NaNs stay NaNs). The scalar loops ran one element at a time (SwiGLU ~3% of a prefill, the
// GDN conv's ~4%).
template <typename V>
inline V silu_lanes(V x) {
  typedef int32_t vi __attribute__((vector_size(sizeof(V))));
  vi bits;
  std::memcpy(&bits, &x, sizeof(x));
  bits |= INT32_MIN;
  V v;
  std::memcpy(&v, &bits, sizeof(v));
  const V e = exp_nonpositive_lanes(v);
  return (x >= 0.f ? x : x * e) / (1.f + e);
}

// out [n] = silu(x [n]) (out may be x): the CPU's vectors, then silu on the tail.
inline void silu_into(float* out, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + kPartLanes <= n; i += kPartLanes) store_part(out + i, silu_lanes(load_part(x + i)));
  for (; i < n; ++i) out[i] = silu(x[i]);
}

// y [n] *= silu(z [n]).
inline void mul_silu(float* y, const float* z, int64_t n) {
  constexpr int64_t kChunk = 256;
  float buf[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    silu_into(buf, z + i0, len);
    for (int64_t i = 0; i < len; ++i) y[i0 + i] *= buf[i];
  }
}

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// out [C] = sum_j w[j] x_j for one token: x_j (j < K-1) the conv window's rows at
// rows + j C, x_{K-1} = last (the token's projections); w [K, C] the depthwise kernel
// transposed. Loops over C that vectorise, the sum in j order.
inline void conv_sum(const float* rows, const float* last, const float* w, float* out,
                     int64_t c_len, int64_t k) {
  for (int64_t c = 0; c < c_len; ++c) out[c] = 0.f;
  for (int64_t j = 0; j < k; ++j) {
    const float* wj = w + j * c_len;
    const float* xj = j + 1 < k ? rows + j * c_len : last;
    for (int64_t c = 0; c < c_len; ++c) out[c] += wj[c] * xj[c];
  }
}

// The same followed by SiLU.
inline void conv_token(const float* rows, const float* last, const float* w, float* out,
                       int64_t c_len, int64_t k) {
  conv_sum(rows, last, w, out, c_len, k);
  silu_into(out, out, c_len);
}

// A row's conv window [K-1, C] shifted by one token, ``mixed`` appended.
inline void shift_window(float* window, const float* mixed, int64_t c_len, int64_t k) {
  if (k > 1) {
    std::memmove(window, window + c_len, (k - 2) * c_len * sizeof(float));
    std::memcpy(window + (k - 2) * c_len, mixed, c_len * sizeof(float));
  }
}

// The convolution + SiLU of one row into out [C] (w [K, C]); shifts the row's window
// [K-1, C] and appends ``mixed``.
inline void conv_row(const float* mixed, float* window, const float* w, float* out,
                     int64_t c_len, int64_t k) {
  conv_token(window, mixed, w, out, c_len, k);
  shift_window(window, mixed, c_len, k);
}

// x [n] /= sqrt(sum x^2 + 1e-6), times ``scale``.
inline void l2norm(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// The delta rule's passes over S [dk, dv] run over column blocks of kCols vectors of 16
// floats, the block's accumulators in registers over all dk rows (a loop over the whole
// row kept them in memory: a store and a reload a row, twice as slow when S is in cache).
// Each output column is still a sum over the rows in row order, whatever the block. kCols
// (fastmath.h): 3 sets of accumulators fit the registers.

// Columns [j0, j0 + 16 NV) of kv = S^T k.
template <int64_t NV>
inline void readout_cols(const float* s, const float* k, float* kv, int64_t dk, int64_t dv,
                         int64_t j0) {
  constexpr int64_t M = NV * kParts;  // the CPU's vectors (Lanes16's parts)
  vpart acc[M] = {};
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = s + i * dv + j0;
    for (int64_t m = 0; m < M; ++m) acc[m] += k[i] * load_part(row + kPartLanes * m);
  }
  for (int64_t m = 0; m < M; ++m) store_part(kv + j0 + kPartLanes * m, acc[m]);
}

// kv [dv] = S^T k for S [dk, dv].
inline void readout(const float* __restrict__ s, const float* k, float* __restrict__ kv,
                    int64_t dk, int64_t dv) {
  int64_t j0 = 0;
  for (; j0 + 16 * kCols <= dv; j0 += 16 * kCols) readout_cols<kCols>(s, k, kv, dk, dv, j0);
  for (; j0 + 16 <= dv; j0 += 16) readout_cols<1>(s, k, kv, dk, dv, j0);
  for (int64_t j = j0; j < dv; ++j) {
    float acc = 0.f;
    for (int64_t i = 0; i < dk; ++i) acc += k[i] * s[i * dv + j];
    kv[j] = acc;
  }
}

// One token's update of columns [j0, j0 + 16 NV) (delta_pass): S = decay S + k delta^T,
// o = S^T q, with NEXT kv = S^T k_next. ``prefetch``: the next head's S, brought toward
// the cache a row at a time while this one is computed (or null).
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: the same pass on ymm registers by hand. As 16-lane vectors GCC moved each through
// the stack a 16-byte half at a time (a quarter of a 512-token prefill in this loop).
// r = k_i d + decay s and the sums are fused multiply-adds in a fixed form.
template <int64_t NV, bool NEXT>
inline void delta_cols(float* s, const float* q, const float* k, const float* delta,
                       float decay, float* o, float* kv, const float* k_next, int64_t dk,
                       int64_t dv, int64_t j0, const float* prefetch) {
  constexpr int64_t M = 2 * NV;  // vectors of 8
  __m256 d[M], ao[M], an[M];
  for (int64_t m = 0; m < M; ++m) {
    d[m] = _mm256_loadu_ps(delta + j0 + 8 * m);
    ao[m] = an[m] = _mm256_setzero_ps();
  }
  const __m256 dec = _mm256_set1_ps(decay);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv + j0;
    if (prefetch != nullptr)
      for (int64_t j = 0; j < dv; j += 16) __builtin_prefetch(prefetch + i * dv + j, 1, 3);
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    const __m256 ni = NEXT ? _mm256_set1_ps(k_next[i]) : ki;
    for (int64_t m = 0; m < M; ++m) {
      const __m256 r = _mm256_fmadd_ps(ki, d[m], _mm256_mul_ps(dec, _mm256_loadu_ps(row + 8 * m)));
      _mm256_storeu_ps(row + 8 * m, r);
      ao[m] = _mm256_fmadd_ps(qi, r, ao[m]);
      if (NEXT) an[m] = _mm256_fmadd_ps(ni, r, an[m]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    _mm256_storeu_ps(o + j0 + 8 * m, ao[m]);
    if (NEXT) _mm256_storeu_ps(kv + j0 + 8 * m, an[m]);
  }
}
#else
template <int64_t NV, bool NEXT>
inline void delta_cols(float* s, const float* q, const float* k, const float* delta,
                       float decay, float* o, float* kv, const float* k_next, int64_t dk,
                       int64_t dv, int64_t j0, const float* prefetch) {
  v16 d[NV], ao[NV] = {}, an[NV] = {};
  for (int64_t n = 0; n < NV; ++n) d[n] = load16(delta + j0 + 16 * n);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv + j0;
    if (prefetch != nullptr)
      for (int64_t j = 0; j < dv; j += 16) __builtin_prefetch(prefetch + i * dv + j, 1, 3);
    for (int64_t n = 0; n < NV; ++n) {
      const v16 r = decay * load16(row + 16 * n) + k[i] * d[n];
      store16(row + 16 * n, r);
      ao[n] += q[i] * r;
      if (NEXT) an[n] += k_next[i] * r;
    }
  }
  for (int64_t n = 0; n < NV; ++n) {
    store16(o + j0 + 16 * n, ao[n]);
    if (NEXT) store16(kv + j0 + 16 * n, an[n]);
  }
}
#endif

// One token of one value head's delta rule, in one pass over S [dk, dv], given kv = S^T k
// (of S before the token): delta = beta (v - decay kv); S = decay S + k delta^T; o = S^T q.
// With NEXT, the same pass leaves kv = S^T k_next, the next token's readout, so a scan over
// T tokens reads and writes S T times (plus one read), not 2T. ``delta``: dv floats.
// ``prefetch`` as in delta_cols (the first column block issues it).
template <bool NEXT>
inline void delta_pass(float* __restrict__ s, const float* q, const float* k, const float* v,
                       float decay, float beta, float* __restrict__ o, float* __restrict__ kv,
                       const float* k_next, int64_t dk, int64_t dv, float* __restrict__ delta,
                       const float* prefetch) {
  for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - decay * kv[j]);
  int64_t j0 = 0;
  for (; j0 + 16 * kCols <= dv; j0 += 16 * kCols, prefetch = nullptr)
    delta_cols<kCols, NEXT>(s, q, k, delta, decay, o, kv, k_next, dk, dv, j0, prefetch);
  for (; j0 + 16 <= dv; j0 += 16, prefetch = nullptr)
    delta_cols<1, NEXT>(s, q, k, delta, decay, o, kv, k_next, dk, dv, j0, prefetch);
  for (int64_t j = j0; j < dv; ++j) {
    float ao = 0.f, an = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      const float r = decay * s[i * dv + j] + k[i] * delta[j];
      s[i * dv + j] = r;
      ao += q[i] * r;
      if (NEXT) an += k_next[i] * r;
    }
    o[j] = ao;
    if (NEXT) kv[j] = an;
  }
}

// o [dv] = rmsnorm(o) * w * silu(z).
inline void gated_norm(float* o, const float* z, const float* w, int64_t dv, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
  for (int64_t j = 0; j < dv; ++j) o[j] = o[j] * r * w[j];
  mul_silu(o, z, dv);
}

// Shapes: Hk key / value heads Hv of Dk, Dv; C = 2 Hk Dk + Hv Dv; K conv width.
struct Shape {
  int64_t key_heads, hv, dk, dv, c_len, k;
  float eps;
  float beta_scale = 1.f;  // beta = sigmoid(b) times this (2: OLMo-Hybrid's negative eigenvalues)
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
        const float beta = 1.f / (1.f + std::exp(-in.b[i * in.ld + h])) * sh.beta_scale;
        const float* xt = x(t);
        if (t + 1 < n) {
          delta_pass<true>(state, xt + kh * dk, xt + key_dim + kh * dk, xt + 2 * key_dim + h * dv,
                           std::exp(g), beta, o, kv.data(), x(t + 1) + key_dim + kh * dk, dk, dv,
                           delta.data(), nullptr);
        } else {
          delta_pass<false>(state, xt + kh * dk, xt + key_dim + kh * dk,
                            xt + 2 * key_dim + h * dv, std::exp(g), beta, o, kv.data(), nullptr,
                            dk, dv, delta.data(), task + 1 < end ? state + dk * dv : nullptr);
        }
        gated_norm(o, in.z + i * in.ld + h * dv, norm_w, dv, sh.eps);
      }
    }
  });
}

// The step for ``rows`` rows: window [B, K-1, C] and s [B, Hv, Dk, Dv] updated in place,
// out [B, Hv Dv]. conv_w [K, C]; a_log, dt_bias [Hv]; norm_w [Dv]. Parallel over rows for the
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
