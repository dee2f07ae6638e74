// Work of the parallel (prefill) form beside its GEMMs, in one native pass each; inference
// only (no autograd): the causal convolution (with Mamba2's bias and SiLU), Mamba2's SSD scan
// and output gate, SwiGLU's activation, the elu+1 feature map with the head split, the MLP's
// tanh GELU, RMSNorm, and causal softmax attention over a KV cache.
//
// Causal depthwise convolution: out[b, t, c] = sum_i w[i, c] * x[b, t + i, c].
//
// x [B, T + K - 1, C] holds each row's K-1 buffered inputs followed by its T new ones, in the
// [time, channel] layout the q/k/v projections come out in; w [K, C] (the module's [C, K]
// weight transposed, as the fused step packs it). One pass, vectorised over channels. ATen's
// depthwise conv1d wants [B, C, T]: the two transposes and oneDNN's depthwise path cost
// about a quarter of a 1,000-token prefill here. Inference only (no autograd).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"
#include "dense.h"
#include "gdn.h"
#include "kda.h"
#include "mamba1.h"
#include "mamba2.h"
#include "moe.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace prefill_ops_cpp {  // named, not anonymous: unity units (build.py) join sources

at::Tensor causal_conv(const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, bool silu) {
  TORCH_CHECK(x.dim() == 3 && w.dim() == 2 && x.size(2) == w.size(1) && x.size(1) >= w.size(0),
              "causal_conv takes x [B, T + K - 1, C] and w [K, C]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.is_contiguous() && w.is_contiguous(), "causal_conv takes contiguous fp32");
  const bool biased = bias.has_value() && bias->defined();
  TORCH_CHECK(!biased || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                          bias->numel() == x.size(2)), "causal_conv's bias is fp32 [C]");
  const float* bp = biased ? bias->data_ptr<float>() : nullptr;
  const int64_t rows = x.size(0), k = w.size(0), c = x.size(2), t = x.size(1) - k + 1;
  at::Tensor out = at::empty({rows, t, c}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / t, pos = bt % t;
      const float* src = xp + (b * (t + k - 1) + pos) * c;
      float* dst = op + bt * c;
      for (int64_t ch = 0; ch < c; ++ch) dst[ch] = wp[ch] * src[ch];
      for (int64_t i = 1; i < k; ++i) {
        const float* wi = wp + i * c;
        const float* si = src + i * c;
        for (int64_t ch = 0; ch < c; ++ch) dst[ch] += wi[ch] * si[ch];
      }
      if (bp != nullptr)
        for (int64_t ch = 0; ch < c; ++ch) dst[ch] += bp[ch];
      if (silu) linserve::gdn::silu_into(dst, dst, c);
    }
  });
  return out;
}

// Mamba2's output gate over prefill rows, in place on y [R, inner] (the SSD's outputs,
// contiguous): the D skip y += D[h] xs per head of inner / H channels, then the gated RMSNorm
// with z as the native step computes it (mamba2.h). xs and z [R, inner] may be views with a
// row stride (splits of the projections); w [inner] fp32, or empty for y silu(z) alone. One
// pass a row: the eager form made about eight temporaries of y's size a layer (the skip, the
// SiLU, the gate, the norm's squares and scale, the weight), each page-faulted afresh.
at::Tensor mamba2_gate_(at::Tensor y, const at::Tensor& xs, const at::Tensor& d,
                        const at::Tensor& z, const at::Tensor& w, int64_t groups, double eps,
                        bool before) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "mamba2_gate_ takes contiguous fp32 y [R, inner]");
  const int64_t rows = y.size(0), inner = y.size(1), heads = d.numel();
  for (const at::Tensor* t : {&xs, &z})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == inner &&
                    t->stride(1) == 1 && t->scalar_type() == at::kFloat,
                "mamba2_gate_ takes fp32 xs and z [R, inner] with unit column stride");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && heads > 0 &&
                  inner % heads == 0 && groups > 0 && inner % groups == 0,
              "mamba2_gate_: D [H] fp32 with H and the groups dividing inner");
  const bool normed = w.numel() > 0;
  TORCH_CHECK(!normed || (w.scalar_type() == at::kFloat && w.is_contiguous() &&
                          w.numel() == inner), "mamba2_gate_'s norm weight is fp32 [inner]");
  const linserve::mamba2::Gate gate{inner, groups, normed, before, static_cast<float>(eps)};
  const int64_t p = inner / heads;
  float* yp = y.data_ptr<float>();
  const float* xp = xs.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* wp = normed ? w.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = yp + r * inner;
      const float* x = xp + r * xs.stride(0);
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = h * p; i < (h + 1) * p; ++i) row[i] += dp[h] * x[i];
      linserve::mamba2::gated_norm(row, zp + r * z.stride(0), wp, gate);
    }
  });
  return y;
}

// Mamba2's SSD over a (ragged) prefill, in place on s and into y: the recurrence token by
// token, as the native step computes it (mamba2.h's scan_head), a task a (row, head).
// s [B, H, P, N] fp32 contiguous (updated); y [B, T, H P] fp32 contiguous (written: row r's
// first counts[r] tokens, zeros past them); x [B, T, H P], dt [B, T, H], b and c [B, T, G N]: fp32 with unit
// last stride (views of the projections); a_log [H] (a = -exp(a_log), as the step takes it);
// counts [B] int64, each at most T.
at::Tensor mamba2_scan_(at::Tensor s, at::Tensor y, const at::Tensor& x, const at::Tensor& dt,
                        const at::Tensor& a_log, const at::Tensor& b, const at::Tensor& c,
                        const at::Tensor& counts) {
  TORCH_CHECK(s.dim() == 4 && s.is_contiguous() && s.scalar_type() == at::kFloat,
              "mamba2_scan_ takes a contiguous fp32 state [B, H, P, N]");
  const int64_t rows = s.size(0), heads = s.size(1), p = s.size(2), n = s.size(3);
  const int64_t t_len = x.size(1), groups = b.size(2) / n;
  TORCH_CHECK(y.is_contiguous() && y.sizes() == x.sizes(), "mamba2_scan_: y like x, contiguous");
  const at::Tensor* inputs[] = {&y, &x, &dt, &b, &c};
  for (const at::Tensor* t : inputs)
    TORCH_CHECK(t->dim() == 3 && t->size(0) == rows && t->size(1) == t_len &&
                    t->stride(2) == 1 && t->scalar_type() == at::kFloat,
                "mamba2_scan_ takes fp32 [B, T, C] inputs with unit last stride");
  TORCH_CHECK(x.size(2) == heads * p && dt.size(2) == heads && groups > 0 &&
                  heads % groups == 0 && b.size(2) == groups * n && c.sizes() == b.sizes() &&
                  c.strides() == b.strides(),
              "mamba2_scan_: x [B, T, H P], dt [B, T, H], b and c [B, T, G N] alike");
  TORCH_CHECK(a_log.scalar_type() == at::kFloat && a_log.is_contiguous() &&
                  a_log.numel() == heads && counts.scalar_type() == at::kLong &&
                  counts.is_contiguous() && counts.numel() == rows,
              "mamba2_scan_: a_log [H] fp32, counts [B] int64");
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(count[r] >= 0 && count[r] <= t_len, "mamba2_scan_: a count past T");
  const int64_t per_group = heads / groups;
  linserve::for_each_task(rows * heads, [&](int64_t task) {
    const int64_t r = task / heads, h = task % heads, g = h / per_group;
    const linserve::mamba2::HeadTokens in{
        x.data_ptr<float>() + r * x.stride(0) + h * p,
        dt.data_ptr<float>() + r * dt.stride(0) + h,
        b.data_ptr<float>() + r * b.stride(0) + g * n,
        c.data_ptr<float>() + r * c.stride(0) + g * n,
        y.data_ptr<float>() + r * y.stride(0) + h * p,
        x.stride(1), dt.stride(1), b.stride(1), y.stride(1)};
    const linserve::mamba2::FlushDenormals flush;
    linserve::mamba2::scan_head(s.data_ptr<float>() + (r * heads + h) * p * n,
                                -std::exp(a_log.data_ptr<float>()[h]), in, count[r], p, n);
    for (int64_t t = count[r]; t < t_len; ++t) std::fill_n(in.y + t * in.y_ld, p, 0.f);
  });
  return y;
}

// Mamba-1's selective scan of every row (mamba1.h), tasks of (row, 16 channels): s [B, D, N]
// fp32, contiguous, updated in place; y [B, T, D] written (each row's first counts[r]
// tokens, zeros past them); x, dt [B, T, D] and b, c [B, T, N] fp32 with unit last stride;
// a [D, N] = -exp(A_log) fp32; counts [B] int64, each at most T.
at::Tensor mamba1_scan_(at::Tensor s, at::Tensor y, const at::Tensor& x, const at::Tensor& dt,
                        const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                        const at::Tensor& counts) {
  TORCH_CHECK(s.dim() == 3 && s.is_contiguous() && s.scalar_type() == at::kFloat,
              "mamba1_scan_ takes a contiguous fp32 state [B, D, N]");
  const int64_t rows = s.size(0), d = s.size(1), n = s.size(2), t_len = x.size(1);
  const at::Tensor* inputs[] = {&y, &x, &dt, &b, &c};
  for (const at::Tensor* t : inputs)
    TORCH_CHECK(t->dim() == 3 && t->size(0) == rows && t->size(1) == t_len &&
                    t->stride(2) == 1 && t->scalar_type() == at::kFloat,
                "mamba1_scan_ takes fp32 [B, T, C] inputs with unit last stride");
  TORCH_CHECK(x.size(2) == d && dt.size(2) == d && y.size(2) == d && b.size(2) == n &&
                  c.size(2) == n, "mamba1_scan_: x, dt, y [B, T, D]; b, c [B, T, N]");
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.numel() == d * n &&
                  counts.scalar_type() == at::kLong && counts.is_contiguous() &&
                  counts.numel() == rows,
              "mamba1_scan_: a [D, N] fp32, counts [B] int64");
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(count[r] >= 0 && count[r] <= t_len, "mamba1_scan_: a count past T");
  const int64_t blocks = (d + linserve::mamba1::kLanes - 1) / linserve::mamba1::kLanes;
  linserve::for_each_task(rows * blocks, [&](int64_t task) {
    const int64_t r = task / blocks, d0 = task % blocks * linserve::mamba1::kLanes;
    const int64_t live = std::min(linserve::mamba1::kLanes, d - d0);
    const linserve::mamba1::RowTokens in{
        x.data_ptr<float>() + r * x.stride(0), dt.data_ptr<float>() + r * dt.stride(0),
        b.data_ptr<float>() + r * b.stride(0), c.data_ptr<float>() + r * c.stride(0),
        y.data_ptr<float>() + r * y.stride(0), x.stride(1), dt.stride(1), b.stride(1),
        y.stride(1)};
    const linserve::mamba2::FlushDenormals flush;
    linserve::mamba1::scan_channels(s.data_ptr<float>() + r * d * n, a.data_ptr<float>(), in,
                                    count[r], d0, live, n);
    for (int64_t t = count[r]; t < t_len; ++t) std::fill_n(in.y + t * in.y_ld + d0, live, 0.f);
  });
  return y;
}

// Kimi Delta Attention's recurrence of every row (kda.h), a task per (row, head): s
// [B, H, Dk, Dv] fp32, contiguous, updated in place; o [B, T, H, Dv] written (each row's first
// counts[r] tokens, zeros past them); q, k, decay [B, T, H, Dk], v [B, T, H, Dv], beta
// [B, T, H], all fp32 and contiguous; counts [B] int64, each at most T.
at::Tensor kda_scan_(at::Tensor s, at::Tensor o, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& decay, const at::Tensor& beta,
                     const at::Tensor& counts) {
  const at::Tensor* all[] = {&s, &o, &q, &k, &v, &decay, &beta};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat,
                "kda_scan_ takes contiguous fp32 tensors");
  TORCH_CHECK(s.dim() == 4 && q.dim() == 4, "kda_scan_: s [B, H, Dk, Dv], q [B, T, H, Dk]");
  const int64_t rows = s.size(0), heads = s.size(1), dk = s.size(2), dv = s.size(3);
  const int64_t t_len = q.size(1);
  TORCH_CHECK(q.sizes() == k.sizes() && q.sizes() == decay.sizes() && q.size(0) == rows &&
                  q.size(2) == heads && q.size(3) == dk && v.size(3) == dv &&
                  o.sizes() == v.sizes() && v.size(1) == t_len && beta.size(2) == heads &&
                  beta.size(1) == t_len,
              "kda_scan_: q, k, decay [B, T, H, Dk]; v, o [B, T, H, Dv]; beta [B, T, H]");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() &&
                  counts.numel() == rows, "kda_scan_: counts [B] int64");
  const int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(count[r] >= 0 && count[r] <= t_len, "kda_scan_: a count past T");
  linserve::for_each_task(rows * heads, [&](int64_t task) {
    const int64_t r = task / heads, h = task % heads;
    const int64_t qk_at = (r * t_len * heads + h) * dk, v_at = (r * t_len * heads + h) * dv;
    const linserve::kda::HeadTokens in{
        q.data_ptr<float>() + qk_at, k.data_ptr<float>() + qk_at,
        v.data_ptr<float>() + v_at, decay.data_ptr<float>() + qk_at,
        beta.data_ptr<float>() + r * t_len * heads + h, o.data_ptr<float>() + v_at,
        heads * dk, heads * dv, heads, heads * dv};
    const linserve::mamba2::FlushDenormals flush;
    linserve::kda::scan_head(s.data_ptr<float>() + (r * heads + h) * dk * dv, in, count[r], dk,
                             dv);
    for (int64_t t = count[r]; t < t_len; ++t) std::fill_n(in.o + t * in.o_ld, dv, 0.f);
  });
  return o;
}

// SwiGLU's activation over prefill rows: silu(gate) up of gate_up [R, 2f] fp32 (gate first)
// -> [R, f] fp32, as the native steps compute it (moe.h). In ATen, with the model's bf16
// between, it took four passes and two roundings (the projection's output to bf16, SiLU,
// the product, and the down projection's input back to fp32).
at::Tensor swiglu_rows(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() &&
                  gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "swiglu_rows takes contiguous fp32 gate_up [R, 2f]");
  return linserve::moe::swiglu(gate_up);
}

// GELU (tanh form) in place on a contiguous fp32 or bf16 tensor (bf16 through fp32 blocks).
at::Tensor gelu_tanh_(at::Tensor x) {
  TORCH_CHECK(x.is_contiguous(), "gelu_tanh_ takes a contiguous tensor");
  const int64_t n = x.numel();
  constexpr int64_t kBlock = 4096;
  if (x.scalar_type() == at::kFloat) {
    float* p = x.data_ptr<float>();
    at::parallel_for(0, n, kBlock,
                     [&](int64_t b, int64_t e) { linserve::gelu_tanh(p + b, e - b); });
    return x;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gelu_tanh_ takes fp32 or bf16");
  at::BFloat16* p = x.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, kBlock, [&](int64_t b, int64_t e) {
    std::vector<float> buf(kBlock);
    for (int64_t s = b; s < e; s += kBlock) {
      const int64_t len = std::min(kBlock, e - s);
      for (int64_t i = 0; i < len; ++i) buf[i] = static_cast<float>(p[s + i]);
      linserve::gelu_tanh(buf.data(), len);
      for (int64_t i = 0; i < len; ++i) p[s + i] = static_cast<at::BFloat16>(buf[i]);
    }
  });
  return x;
}

// qkv [B, T, 3 * H * D] fp32 (the projections, [q | k | v] per row) -> phi(q), phi(k) and v,
// each [B, H, T, D] contiguous, with phi(x) = elu(x) + 1 = x + 1 for x > 0, else exp(x).
// One pass: the split into heads (a permute whose reshape would copy), ATen's elu and its +1
// were ~5% of a 1,000-token fp32 prefill, mostly in elu's scalar exp.
std::vector<at::Tensor> qkv_features(const at::Tensor& qkv, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "qkv_features takes contiguous fp32 [B, T, 3 * H * D]");
  const int64_t rows = qkv.size(0), t = qkv.size(1), width = qkv.size(2);
  TORCH_CHECK(width % (3 * heads) == 0, "the last dimension must be 3 * heads * head_dim");
  const int64_t d = width / (3 * heads);
  std::vector<at::Tensor> out;
  for (int i = 0; i < 3; ++i) out.push_back(at::empty({rows, heads, t, d}, qkv.options()));
  const float* src = qkv.data_ptr<float>();
  float* dst[3] = {out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                   out[2].data_ptr<float>()};
  at::parallel_for(0, rows * t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t b = bt / t, pos = bt % t;
      const float* row = src + bt * width;
      for (int part = 0; part < 3; ++part) {
        for (int64_t h = 0; h < heads; ++h) {
          const float* in = row + (part * heads + h) * d;
          float* o = dst[part] + ((b * heads + h) * t + pos) * d;
          if (part == 2) {
            std::memcpy(o, in, d * sizeof(float));
            continue;
          }
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) {
            const float x = in[i];
            o[i] = x > 0.f ? x + 1.f : linserve::exp_nonpositive(x);
          }
        }
      }
    }
  });
  return out;
}

// RMSNorm of fp32 rows: x [..., d] contiguous, w [d] fp32 -> a new tensor of x's shape. One
// pass per row (dense.h); ATen's composite rms_norm made five passes (~2% of a prefill).
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  x.is_contiguous() && w.is_contiguous() && x.size(-1) == w.numel(),
              "rms_norm_rows takes contiguous fp32 x [..., d] and w [d]");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    linserve::rms_norm(xp + begin * d, wp, op + begin * d, end - begin, d, eps);
  });
  return out;
}

// Causal grouped-query attention of T new rows over a KV cache: row t attends keys 0 ..
// start + t, each row alone by the decode steps' attend_group (attention.h), so a row's bits
// depend on its query and its keys only (a prompt prefilled whole, in chunks or a token at a
// time, alone or in a batch, gives the same; the native decode steps run the same
// arithmetic on their own q, k and v). q [B, T, H, D]
// contiguous, k, v [B, Hkv, >= start + T, D] with rows of D contiguous (a cache's slice) ->
// o [B, T, H, D], fp32. In place of scores as a matrix and five elementwise passes over it,
// which took a fifth of a 2,048-token LFM2-1.2B prefill. Threads take
// (rows, group) tasks from a counter, kCausalRows rows each (attend_group_rows: each block
// of keys read once for all of them; later rows have more keys).
at::Tensor attend_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         int64_t start) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() &&
                  q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && q.is_contiguous(),
              "attend_causal takes fp32 q [B, T, H, D] contiguous, k and v [B, Hkv, S, D]");
  const int64_t batch = q.size(0), t_len = q.size(1), heads = q.size(2), dim = q.size(3);
  const int64_t groups = k.size(1), rep = groups ? heads / groups : 0;
  TORCH_CHECK(k.size(0) == batch && k.size(3) == dim && groups > 0 && heads % groups == 0 &&
                  start >= 0 && k.size(2) >= start + t_len && k.stride(3) == 1 &&
                  k.stride(2) == dim && v.stride(3) == 1 && v.stride(2) == dim,
              "attend_causal: k and v do not match q, or their rows are not contiguous");
  at::Tensor o = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const int64_t blocks = (t_len + linserve::kCausalRows - 1) / linserve::kCausalRows;
  linserve::for_each_task(batch * groups * blocks, [&](int64_t task) {
    const int64_t t0 = task % blocks * linserve::kCausalRows, g = task / blocks % groups;
    const int64_t b = task / (blocks * groups), rows = std::min(linserve::kCausalRows, t_len - t0);
    const int64_t n0 = start + t0 + 1, at_q = ((b * t_len + t0) * heads + g * rep) * dim;
    thread_local std::vector<float> scores;
    scores.resize(rows * std::min(rep, linserve::kGroupHeads) * (n0 + rows - 1));
    linserve::attend_group_rows(qp + at_q, heads * dim, kp + b * k.stride(0) + g * k.stride(1),
                                vp + b * v.stride(0) + g * v.stride(1), rep, n0, rows, dim,
                                op + at_q, scores.data());
  });
  return o;
}


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def("attend_causal(Tensor q, Tensor k, Tensor v, int start) -> Tensor");
  m.def("causal_conv(Tensor x, Tensor w, Tensor? bias=None, bool silu=False) -> Tensor");
  m.def("mamba2_gate_(Tensor(a!) y, Tensor xs, Tensor d, Tensor z, Tensor w, int groups, "
        "float eps, bool before) -> Tensor(a!)");
  m.def("mamba2_scan_(Tensor(a!) s, Tensor(b!) y, Tensor x, Tensor dt, Tensor a_log, Tensor b, "
        "Tensor c, Tensor counts) -> Tensor(b!)");
  m.def("mamba1_scan_(Tensor(a!) s, Tensor(b!) y, Tensor x, Tensor dt, Tensor a_mat, Tensor b, "
        "Tensor c, Tensor counts) -> Tensor(b!)");
  m.def("kda_scan_(Tensor(a!) s, Tensor(b!) o, Tensor q, Tensor k, Tensor v, Tensor decay, "
        "Tensor beta, Tensor counts) -> Tensor(b!)");
  m.def("swiglu_rows(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_(Tensor(a!) x) -> Tensor(a!)");
  m.def("qkv_features(Tensor qkv, int heads) -> Tensor[]");
  m.def("rms_norm_rows(Tensor x, Tensor w, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("attend_causal", &attend_causal);
  m.impl("causal_conv", &causal_conv);
  m.impl("mamba2_gate_", &mamba2_gate_);
  m.impl("mamba2_scan_", &mamba2_scan_);
  m.impl("mamba1_scan_", &mamba1_scan_);
  m.impl("kda_scan_", &kda_scan_);
  m.impl("swiglu_rows", &swiglu_rows);
  m.impl("gelu_tanh_", &gelu_tanh_);
  m.impl("qkv_features", &qkv_features);
  m.impl("rms_norm_rows", &rms_norm_rows);
}

}  // namespace prefill_ops_cpp
