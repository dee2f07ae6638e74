// The native step's attention parts over a KV cache (step_parts.h's Attention and Mla), as
// the eager forms compute them (model/layers/attention.py, mla.py; Qwen3.5's gated
// attention). Each takes h [T B, d] (Positions' layout) and returns [T B, d].
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "attention.h"
#include "dense.h"
#include "kv_rows.h"
#include "step_parts.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace linserve::step {

// o [N, H D] times sigmoid(gate) [N, H], each head's D values by its row's gate.
inline void gate_heads(at::Tensor& o, const at::Tensor& gate, int64_t dh) {
  const int64_t all = o.size(0), heads = gate.size(1);
  float* out = o.data_ptr<float>();
  const float* g = gate.data_ptr<float>();
  for (int64_t row = 0; row < all; ++row)
    for (int64_t hh = 0; hh < heads; ++hh) {
      const float s = 1.f / (1.f + std::exp(-g[row * heads + hh]));
      for (int64_t v = 0; v < dh; ++v) out[(row * heads + hh) * dh + v] *= s;
    }
}

// o [N, H D] times sigmoid of the gates interleaved in qkv [N, ...] (per head [q D | gate D]).
inline void gate_interleaved(at::Tensor& o, const at::Tensor& qkv, int64_t heads, int64_t dh) {
  const int64_t all = o.size(0), width = qkv.size(1);
  float* out = o.data_ptr<float>();
  const float* src = qkv.data_ptr<float>();
  for (int64_t row = 0; row < all; ++row)
    for (int64_t hh = 0; hh < heads; ++hh) {
      const float* gate = src + row * width + hh * 2 * dh + dh;
      float* oh = out + (row * heads + hh) * dh;
      for (int64_t i = 0; i < dh; ++i) oh[i] *= 1.f / (1.f + std::exp(-gate[i]));
    }
}

// What a cache tensor holds (KVEntry's dtype): fp32, bf16, or int8 rows of D + D / 8 bytes.
inline linserve::KvKind kv_kind(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: return linserve::KvKind::kFp32;
    case at::kBFloat16: return linserve::KvKind::kBf16;
    case at::kChar: return linserve::KvKind::kInt8;
    default: TORCH_CHECK(false, "decoder_step: a KV cache of ", cache.scalar_type());
  }
  return linserve::KvKind::kFp32;
}

// Group g's rows of cache row r, as stored.
inline linserve::StoredRows stored(const at::Tensor& cache, int64_t r, int64_t g, int64_t dh) {
  const int64_t groups = cache.size(1), cap = cache.size(2);
  const linserve::KvKind kind = kv_kind(cache);
  const auto* base = static_cast<const uint8_t*>(cache.data_ptr());
  return {base + (r * groups + g) * cap * linserve::row_bytes(kind, dh), kind, dh};
}

// q heads into q [B, H, D]; k and v into the cache at each row's position, in its dtype;
// norms, rotary and multipliers as Attention._qkv applies them.
inline void write_qkv(const at::Tensor& qkv, const Attention& p, at::Tensor& kc, at::Tensor& vc,
                      const int64_t* lengths, const int64_t* offsets, std::vector<float>& q) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dh = p.head_dim, cap = kc.size(2);
  const linserve::KvKind kind = kv_kind(kc);
  const int64_t bytes = linserve::row_bytes(kind, dh);
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type() && kc.size(3) * kc.element_size() == bytes,
              "decoder_step: the KV cache's rows do not hold the head size ", dh);
  std::vector<float> kd(dh);
  const bool qk_norm = present(p.q_norm) && !p.norm_whole, rope = present(p.inv_freq);
  const int64_t q_stride = p.gate_interleaved ? 2 * dh : dh, k_at = p.heads * q_stride;
  at::Tensor src_t = qkv;
  if (p.norm_whole) {  // the q / k norms over all heads at once (OLMo's)
    src_t = qkv.clone();
    for (int64_t r = 0; r < rows; ++r) {
      float* row = src_t.data_ptr<float>() + r * width;
      linserve::rms_row(row, p.q_norm.data_ptr<float>(), p.heads * dh, p.norm_eps);
      linserve::rms_row(row + p.heads * dh, p.k_norm.data_ptr<float>(), p.kv_heads * dh,
                        p.norm_eps);
    }
  }
  const float* src = src_t.data_ptr<float>();
  const int64_t rot = rope ? 2 * p.inv_freq.size(0) : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = p.window > 0 ? lengths[r] % p.window : lengths[r];
    const int64_t pos = lengths[r] + (offsets != nullptr ? offsets[r] : 0);  // rotary
    TORCH_CHECK(slot < cap, "decoder_step: the KV cache is full (reserve first)");
    const float* row = src + r * width;
    for (int64_t h = 0; h < p.heads; ++h) {
      float* qh = q.data() + (r * p.heads + h) * dh;
      std::memcpy(qh, row + h * q_stride, dh * sizeof(float));
      if (qk_norm) linserve::rms_row(qh, p.q_norm.data_ptr<float>(), dh, p.norm_eps);
      if (rope) linserve::rotate_half(qh, p.inv_freq.data_ptr<float>(), rot, pos);
      if (p.q_scale != 1.f)
        for (int64_t i = 0; i < dh; ++i) qh[i] *= p.q_scale;
    }
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      const int64_t at = ((r * p.kv_heads + g) * cap + slot) * bytes;
      std::memcpy(kd.data(), row + k_at + g * dh, dh * sizeof(float));
      if (qk_norm) linserve::rms_row(kd.data(), p.k_norm.data_ptr<float>(), dh, p.norm_eps);
      if (rope) linserve::rotate_half(kd.data(), p.inv_freq.data_ptr<float>(), rot, pos);
      if (p.key_multiplier != 1.f)
        for (int64_t i = 0; i < dh; ++i) kd[i] *= p.key_multiplier;
      linserve::store_row(kind, kd.data(), dh, static_cast<uint8_t*>(kc.data_ptr()) + at);
      linserve::store_row(kind, row + k_at + (p.kv_heads + g) * dh, dh,
                          static_cast<uint8_t*>(vc.data_ptr()) + at);
    }
  }
}

// One key-value group of one row over its cache up to position ``at`` (attend_group, over
// the rows as stored: attend_group_stored): a ring's (W = window > 0) full slots are read in
// position order, as a prefill reads them.
inline void attend_cached(const float* q, const linserve::StoredRows& keys,
                          const linserve::StoredRows& values, int64_t rep, int64_t at,
                          int64_t window, int64_t dh, float* out) {
  int64_t n = at + 1;
  std::vector<float> scores(std::min(rep, linserve::kGroupHeads) *
                           (window > 0 ? std::min(n, window) : n));
  if (window > 0 && n > window) {
    n = window;
    const int64_t first = (at + 1) % window;  // the oldest position's slot
    std::vector<float> ordered(2 * n * dh);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = (first + j) % window;
      keys.read(slot, ordered.data() + j * dh);
      values.read(slot, ordered.data() + (n + j) * dh);
    }
    linserve::attend_group(q, ordered.data(), ordered.data() + n * dh, rep, n, dh, out,
                           scores.data());
    return;
  }
  linserve::attend_group_stored(q, keys, values, rep, n, dh, out, scores.data());
}

// Attention (the struct's comment); position t of row r at cache position lengths[r] + t.
inline at::Tensor run(const Attention& p, const at::Tensor& h, at::Tensor* state,
                      const Call& c) {
  at::Tensor& kc = state[0];
  at::Tensor& vc = state[1];
  const int64_t rows = h.size(0) / c.pos.count, dh = p.head_dim, rep = p.heads / p.kv_heads;
  const at::Tensor qkv = linserve::project(h, p.qkv);
  at::Tensor o = at::empty({h.size(0), p.heads * dh}, h.options());
  std::vector<int64_t> at_pos(c.lengths, c.lengths + rows);
  for (int64_t t = 0; t < c.pos.count; ++t) {
    std::vector<float> q(rows * p.heads * dh);
    write_qkv(qkv.narrow(0, t * rows, rows), p, kc, vc, at_pos.data(), c.offsets, q);
    float* o_t = o.data_ptr<float>() + t * rows * p.heads * dh;
    at::parallel_for(0, rows * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / p.kv_heads, g = task % p.kv_heads;
        attend_cached(q.data() + (r * p.heads + g * rep) * dh, stored(kc, r, g, dh),
                      stored(vc, r, g, dh), rep, at_pos[r], p.window, dh,
                      o_t + (r * p.heads + g * rep) * dh);
      }
    });
    for (int64_t& at : at_pos) ++at;
  }
  if (p.gate_interleaved) gate_interleaved(o, qkv, p.heads, dh);
  if (present(p.gate)) gate_heads(o, linserve::project(h, p.gate), dh);
  return linserve::project(o, p.o);
}

// DeepSeek's interleaved rotary pairs laid out as halves (mla.py's interleaved_to_halves),
// then rotated at ``at`` (dense.h's rotate_half over all n).
inline void rope_interleaved(float* x, const float* inv_freq, int64_t n, int64_t at) {
  std::vector<float> tmp(x, x + n);
  for (int64_t i = 0; i < n / 2; ++i) {
    x[i] = tmp[2 * i];
    x[n / 2 + i] = tmp[2 * i + 1];
  }
  linserve::rotate_half(x, inv_freq, n, at);
}

// Heads of a task of the latent attention: the cache is read once per task.
constexpr int64_t kMlaHeadsPerTask = 8;

// One row's absorbed queries [H, R + rope] at cache position ``at``: W_kb^T q_nope, then
// q_rot (rotated where positions are on), times sqrt(R + rope) / sqrt(qk) (attend_group's
// 1 / sqrt(R + rope) then makes the head's 1 / sqrt(qk)).
inline void mla_queries(const float* q, const float* kb, const float* freqs, float* out,
                        int64_t heads, int64_t nope, int64_t rank, int64_t rope, int64_t at) {
  const int64_t width = rank + rope, qk = nope + rope;
  const float factor = std::sqrt(static_cast<float>(width)) / std::sqrt(static_cast<float>(qk));
  at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t hh = h0; hh < h1; ++hh) {
      float* oh = out + hh * width;
      const float* qh = q + hh * qk;
      std::fill(oh, oh + rank, 0.f);
      for (int64_t n = 0; n < nope; ++n) {
        const float* row = kb + (hh * nope + n) * rank;
        const float qn = qh[n];
        for (int64_t r = 0; r < rank; ++r) oh[r] += qn * row[r];
      }
      std::copy(qh + nope, qh + qk, oh + rank);
      if (freqs != nullptr) rope_interleaved(oh + rank, freqs, rope, at);
      for (int64_t i = 0; i < width; ++i) oh[i] *= factor;
    }
  });
}

// The latent attention's outputs: per head W_vb^T applied to the weighted latent
// (att [T B, H, R + rope], its first R), times sigmoid(g x) where the heads are gated, then
// o. h [T B, d] -> [T B, d].
inline at::Tensor mla_out(const at::Tensor& h, const at::Tensor& att, const Mla& p,
                          int64_t heads, int64_t rank, int64_t width, int64_t vdim) {
  const int64_t all = h.size(0);
  at::Tensor heads_out = at::zeros({all, heads * vdim}, h.options());
  const float* vb = p.vb.data_ptr<float>();
  at::parallel_for(0, all * heads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t row = task / heads, hh = task % heads;
      const float* a = att.data_ptr<float>() + (row * heads + hh) * width;
      float* out = heads_out.data_ptr<float>() + (row * heads + hh) * vdim;
      for (int64_t r = 0; r < rank; ++r) {
        const float* vr = vb + (hh * rank + r) * vdim;
        for (int64_t v = 0; v < vdim; ++v) out[v] += a[r] * vr[v];
      }
    }
  });
  if (present(p.gate)) gate_heads(heads_out, linserve::project(h, p.gate), vdim);
  return linserve::project(heads_out, p.o);
}

// Multi-head latent attention (the struct's comment). Cache: keys [B, 1, cap, R + rope] (the
// latent, which is also the value).
inline at::Tensor run(const Mla& p, const at::Tensor& h, at::Tensor* state, const Call& c) {
  at::Tensor& kc = state[0];
  const int64_t all = h.size(0), rows = all / c.pos.count, rope = p.rope_dim;
  const int64_t heads = p.kb.size(0), nope = p.kb.size(1), rank = p.kb.size(2);
  const int64_t vdim = p.vb.size(2), width = rank + rope, cap = kc.size(2);
  const at::Tensor q = present(p.q_a)
      ? linserve::project(linserve::normed(linserve::project(h, p.q_a), p.q_a_norm, 1e-6), p.q_b)
      : linserve::project(h, p.q_b);
  const at::Tensor lat = linserve::project(h, p.kv_a);
  const float* freqs = present(p.inv_freq) ? p.inv_freq.data_ptr<float>() : nullptr;
  at::Tensor o = at::empty({all, heads * width}, h.options());
  for (int64_t t = 0; t < c.pos.count; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = t * rows + r, at = c.lengths[r] + t;
      TORCH_CHECK(at < cap, "decoder_step: the KV cache is full (reserve first)");
      float* key = kc.data_ptr<float>() + (r * cap + at) * width;
      std::copy(lat.data_ptr<float>() + row * width,
                lat.data_ptr<float>() + (row + 1) * width, key);
      linserve::rms_row(key, p.kv_norm.data_ptr<float>(), rank, 1e-6f);
      if (freqs != nullptr) rope_interleaved(key + rank, freqs, rope, at);
      mla_queries(q.data_ptr<float>() + row * heads * (nope + rope), p.kb.data_ptr<float>(),
                  freqs, o.data_ptr<float>() + row * heads * width, heads, nope, rank, rope,
                  at);
    }
  // every position's heads over its row's cache, a task of kMlaHeadsPerTask heads
  at::Tensor att = at::empty_like(o);
  const int64_t per_row = (heads + kMlaHeadsPerTask - 1) / kMlaHeadsPerTask;
  at::parallel_for(0, all * per_row, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t row = task / per_row, h0 = task % per_row * kMlaHeadsPerTask;
      const int64_t r = row % rows, n = c.lengths[r] + row / rows + 1;
      const int64_t count = std::min(heads, h0 + kMlaHeadsPerTask) - h0;
      std::vector<float> scores(std::min(count, linserve::kGroupHeads) * n);
      const float* keys = kc.data_ptr<float>() + r * cap * width;
      linserve::attend_group(o.data_ptr<float>() + (row * heads + h0) * width, keys, keys,
                             count, n, width, att.data_ptr<float>() + (row * heads + h0) * width,
                             scores.data());
    }
  });
  return mla_out(h, att, p, heads, rank, width, vdim);
}

}  // namespace linserve::step
