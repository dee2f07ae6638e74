// The whole decode step of a model built from the shared layers (model/layers/decoder.py's
// DecoderLM: LFM2, LFM2-MoE, Granite-4.0-H, Nemotron-H, Mamba2, Bamba, Kimi-Linear, Ling,
// MiniMax) in one native call: one token per row through every layer, then the final norm
// and the LM head. The eager step dispatches
// ~20 PyTorch operators per layer part; at batch 1 of LFM2-1.2B in int4 that was a third of
// the step on top of the weight reads.
//
// A layer is two parts, the mixer then the MLP, either of which may be absent. A part takes
// h = norm_before(x) (x itself where there is none), y = norm_after(part(h)) (LFM3's
// sandwich, OLMo's post-norm; part(h) where there is none), then x = a base + b y, base
// being x (a = 1, b Granite's residual multiplier: the usual residual) or h (MiniMax's
// alpha / beta factors). Each part is one of the shared layers, as the eager forms compute
// them (model/layers/attention.py, short_conv.py, mamba2.py, mlp.py, moe.py, kimi_delta.py,
// mla.py, lightning.py):
//   1 attention: qkv [d, (H + 2 Hkv) D]; q / k RMSNorm per head [D] (or empty); rotary on the
//     first ``rot`` dims (halves rotated; empty inv_freq: none); q times q_scale, k times the
//     key multiplier; softmax over the row's cache (attention.h), or a ring's last W keys
//     (i1 = W: LFM3's sliding layers); each head times sigmoid(gate x) where a gate [d, H]
//     is given; o [H D, d]; i0 = 1: the q / k norms are over all heads at once ([H D],
//     [Hkv D]; OLMo's);
//   2 short convolution (LFM2): in [d, 3d] to B, C, x; the causal depthwise conv [K, d] over
//     B x with the window; C times it; out [d, d];
//   3 Mamba2: in [d, inner + conv + Hm] to z, xBC, dt; conv [K, conv] (+ bias) and SiLU over
//     xBC; dt = softplus(dt + dt_bias) clamped; S = exp(dt A) S + dt x B^T per head,
//     y = S C + D x; the gated RMSNorm grouped by G (or y silu(z)); out [inner, d];
//   4 SwiGLU: gate_up [d, 2f], down [f, d];  5 squared ReLU: up [d, f], down [f, d];
//   6 sparse experts (moe.h): router [d, E] fp32, expert bias [E] (or empty), the shared
//     expert's gate_up (or up) and down (or empty), its sigmoid gate [d, 1] (or empty), and
//     the latent projections in and out (or empty); the experts' own weights are in
//     ``experts``;
//   7 Kimi Delta Attention (kimi_delta.py; kda()'s comment has its weights);
//   8 multi-head latent attention over the latent cache (mla.py; mla()'s comment);
//   9 lightning attention (lightning.py; lightning()'s comment);
//   10 Gated DeltaNet (gated_delta.py's DeltaMixer; gated_delta()'s comment).
// Activations stay fp32 between layers; weights are as model/invariant.py packs them (fp32,
// bf16, int8, int4, GGUF's blocks), projected by dense.h. Every row is computed by its own
// loops in a fixed order, so a row's logits do not depend on the rows beside it (batch
// invariance).
//
// Arguments (B rows):
//   tokens [B] int64, lengths [B] int64 (each row's position before this token);
//   weights: embed, head (packed), final norm [d]; then per layer and present part (the
//     mixer's, then the MLP's) its norm before and its norm after (each [d] or empty), then
//     as many weights as its ints say, in the order above;
//   state: per layer two tensors: attention (k, v [B, Hkv, cap, D]; a ring: cap <= W, slot
//     p mod W); short conv (window
//     [B, K-1, d], empty); Mamba2 (S [B, Hm, P, N], window [B, K-1, conv]); KDA (S
//     [B, H, Dk, Dk], window [B, K-1, 3 H Dk]); MLA (latents [B, 1, cap, R + rope], a
//     zero-wide value cache); lightning (S [B, H, D, D], empty); Gated DeltaNet (S
//     [B, Hv, Dk, Dv], window [B, K-1, C]); else empty;
//     updated in place (lengths are not: the caller advances them);
//   experts: every MoE layer's experts, (gate_up or up, down) per expert, layer after layer;
//   ints, per layer 12: per part (kind, weights, base, i0, i1, i2): kind 0 an absent part
//     (no weights), base 1 the normed h; SwiGLU / ReLU^2: i0 = f; Mamba2: i0 = norm before
//     gate, i1 = gated norm; experts: i0 = the layer's first tensor in ``experts``, i1 = top
//     k, i2 = moe.h's Router in bits (sparse_experts); KDA, MLA, lightning: their comments;
//   floats, per layer 14: per part (the norms' eps before and after, a, b, f0, f1, f2)
//     (attention: q scale, key multiplier, q/k norm eps; Mamba2: dt min, dt max, the gated
//     norm's eps; experts: the top-k norm's eps, the routed scaling factor);
//   dims: d, H, Hkv, D, (unused: rot is the inv_freq's), Hm, P, N, G;
//   scalars: final norm eps, embedding scale, logits scale (logits are divided by it).
// Returns logits [B, V] fp32. decoder_verify is the same model over T tokens per row
// (speculative decoding's verify; see Positions below and qwen35_step.cpp's header).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention.h"
#include "dense.h"
#include "embed.h"
#include "fastmath.h"
#include "gdn.h"
#include "gemm.h"
#include "kda.h"
#include "mamba2.h"
#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace decoder_step_cpp {  // named, not anonymous: unity units (build.py) join sources

constexpr int64_t kPartInts = 6;    // kind, its weights' count, the residual's base, i0-i2
constexpr int64_t kPartFloats = 7;  // the two norms' eps, the residual's a and b, f0-f2
constexpr int64_t kInts = 2 * kPartInts;
constexpr int64_t kFloats = 2 * kPartFloats;

enum Kind : int64_t {
  kNone = 0, kAttention, kShortConv, kMamba2, kSwiGLU, kReluSquared, kExperts, kKda, kMla,
  kLightning, kGatedDelta
};

struct Dims {
  int64_t d, h, hkv, head, rot, mh, mp, mn, mg;
};

struct Part {
  int64_t kind, i0, i1, i2;
  float f0, f1, f2;
};

// How a part joins the residual stream x: h = pre(x) (or x where there is no norm before),
// y = post(part(h)) (or part(h)), then x = base a + y b, base being x or (MiniMax) h.
struct Residual {
  bool from_normed;
  double pre_eps, post_eps;
  float a, b;
};

// x = a x + b y, in place (y [B, d]); a = 1 adds b y alone (the usual residual's bits).
void add_scaled(at::Tensor& x, const at::Tensor& y, float a, float b) {
  float* xp = x.data_ptr<float>();
  const float* yp = y.data_ptr<float>();
  const int64_t n = x.numel();
  if (a == 1.f) {
    for (int64_t i = 0; i < n; ++i) xp[i] += b * yp[i];
  } else {
    for (int64_t i = 0; i < n; ++i) xp[i] = a * xp[i] + b * yp[i];
  }
}

// q heads into q [B, H, D]; k and v into the cache at each row's position; norms, rotary
// and multipliers as Attention._qkv applies them.
void write_qkv(const at::Tensor& qkv, const at::Tensor* w, at::Tensor& kc, at::Tensor& vc,
               const int64_t* lengths, const Dims& m, const Part& p, std::vector<float>& q) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dh = m.head, cap = kc.size(2);
  const bool whole = p.i0 != 0;  // the q / k norms over all heads at once (OLMo's)
  const bool qk_norm = w[1].numel() > 0 && !whole, rope = w[4].numel() > 0;
  at::Tensor src_t = qkv;
  if (whole) {
    src_t = qkv.clone();
    for (int64_t r = 0; r < rows; ++r) {
      float* row = src_t.data_ptr<float>() + r * width;
      linserve::rms_row(row, w[1].data_ptr<float>(), m.h * dh, p.f2);
      linserve::rms_row(row + m.h * dh, w[2].data_ptr<float>(), m.hkv * dh, p.f2);
    }
  }
  const float* src = src_t.data_ptr<float>();
  const int64_t rot = 2 * w[4].size(0);  // proportional RoPE: the whole head
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t pos = lengths[r], slot = p.i1 > 0 ? pos % p.i1 : pos;  // a ring: pos mod W
    TORCH_CHECK(slot < cap, "decoder_step: the KV cache is full (reserve first)");
    const float* row = src + r * width;
    for (int64_t h = 0; h < m.h; ++h) {
      float* qh = q.data() + (r * m.h + h) * dh;
      std::memcpy(qh, row + h * dh, dh * sizeof(float));
      if (qk_norm) linserve::rms_row(qh, w[1].data_ptr<float>(), dh, p.f2);
      if (rope) linserve::rotate_half(qh, w[4].data_ptr<float>(), rot, pos);
      if (p.f0 != 1.f)
        for (int64_t i = 0; i < dh; ++i) qh[i] *= p.f0;
    }
    for (int64_t g = 0; g < m.hkv; ++g) {
      float* kd = kc.data_ptr<float>() + ((r * m.hkv + g) * cap + slot) * dh;
      float* vd = vc.data_ptr<float>() + ((r * m.hkv + g) * cap + slot) * dh;
      std::memcpy(kd, row + m.h * dh + g * dh, dh * sizeof(float));
      std::memcpy(vd, row + (m.h + m.hkv) * dh + g * dh, dh * sizeof(float));
      if (qk_norm) linserve::rms_row(kd, w[2].data_ptr<float>(), dh, p.f2);
      if (rope) linserve::rotate_half(kd, w[4].data_ptr<float>(), rot, pos);
      if (p.f1 != 1.f)
        for (int64_t i = 0; i < dh; ++i) kd[i] *= p.f1;
    }
  }
}

// o [N, H D] times sigmoid(gate) [N, H], each head's D values by its row's gate.
void gate_heads(at::Tensor& o, const at::Tensor& gate, int64_t dh) {
  const int64_t all = o.size(0), heads = gate.size(1);
  float* out = o.data_ptr<float>();
  const float* g = gate.data_ptr<float>();
  for (int64_t row = 0; row < all; ++row)
    for (int64_t hh = 0; hh < heads; ++hh) {
      const float s = 1.f / (1.f + std::exp(-g[row * heads + hh]));
      for (int64_t v = 0; v < dh; ++v) out[(row * heads + hh) * dh + v] *= s;
    }
}

// A verify's positions: h holds T positions of B rows, position-major (row t B + b is row
// b's t-th token; T = 1 for a step); the projections run over every row at once, a mixer's
// recurrence position after position over the B rows, as T steps would. After each position
// but the last, a mixer's state tensors are copied to a[t] and b[t] of ``snaps`` (if given).
struct Positions {
  int64_t count = 1;
  at::Tensor* snap_a = nullptr;
  at::Tensor* snap_b = nullptr;

  void keep(int64_t t, const at::Tensor& a, const at::Tensor& b) const {
    if (snap_a == nullptr || t + 1 >= count) return;
    linserve::snapshot(snap_a->select(0, t), a);
    if (snap_b != nullptr && b.defined() && b.numel() > 0) snap_b->select(0, t).copy_(b);
  }
};

// One key-value group of one row over its cache up to position ``at`` (attend_group): a
// ring's (W = window > 0) full slots are read in position order, as a prefill reads them.
void attend_cached(const float* q, const float* keys, const float* values, int64_t rep,
                   int64_t at, int64_t window, int64_t dh, float* out) {
  int64_t n = at + 1;
  std::vector<float> ordered;
  if (window > 0 && n > window) {
    n = window;
    const int64_t first = (at + 1) % window;  // the oldest position's slot
    ordered.resize(2 * n * dh);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t slot = (first + j) % window;
      std::memcpy(ordered.data() + j * dh, keys + slot * dh, dh * sizeof(float));
      std::memcpy(ordered.data() + (n + j) * dh, values + slot * dh, dh * sizeof(float));
    }
    keys = ordered.data();
    values = ordered.data() + n * dh;
  }
  std::vector<float> scores(std::min(rep, linserve::kGroupHeads) * n);
  linserve::attend_group(q, keys, values, rep, n, dh, out, scores.data());
}

// Weights: qkv, q_norm, k_norm, o, inv_freq, the head gate [d, H] (or empty: none).
// p.i0: the q / k norms over all heads; p.i1: the window W of a ring of keys (0: a growing
// cache). h [T B, d] -> [T B, d]; position t of row r at cache position lengths[r] + t.
at::Tensor attention(const at::Tensor& h, const at::Tensor* w, at::Tensor& kc, at::Tensor& vc,
                     const int64_t* lengths, const Dims& m, const Part& p,
                     const Positions& pos) {
  const int64_t rows = h.size(0) / pos.count, dh = m.head, rep = m.h / m.hkv, cap = kc.size(2);
  const at::Tensor qkv = linserve::project(h, w[0]);
  at::Tensor o = at::empty({h.size(0), m.h * dh}, h.options());
  std::vector<int64_t> at_pos(lengths, lengths + rows);
  for (int64_t t = 0; t < pos.count; ++t) {
    std::vector<float> q(rows * m.h * dh);
    write_qkv(qkv.narrow(0, t * rows, rows), w, kc, vc, at_pos.data(), m, p, q);
    float* o_t = o.data_ptr<float>() + t * rows * m.h * dh;
    at::parallel_for(0, rows * m.hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / m.hkv, g = task % m.hkv;
        const int64_t at_group = (r * m.hkv + g) * cap * dh;
        attend_cached(q.data() + (r * m.h + g * rep) * dh, kc.data_ptr<float>() + at_group,
                      vc.data_ptr<float>() + at_group, rep, at_pos[r], p.i1, dh,
                      o_t + (r * m.h + g * rep) * dh);
      }
    });
    for (int64_t& at : at_pos) ++at;
  }
  if (w[5].numel() > 0) gate_heads(o, linserve::project(h, w[5]), dh);
  return linserve::project(o, w[3]);
}

// Weights: in [d, 3d], conv [K, d], out [d, d]. h [T B, d] -> [T B, d].
at::Tensor short_conv(const at::Tensor& h, const at::Tensor* w, at::Tensor& window,
                      const Dims& m, const Positions& pos) {
  const int64_t rows = h.size(0) / pos.count, d = m.d, k = w[1].size(0);
  const at::Tensor proj = linserve::project(h, w[0]);
  at::Tensor mixed = at::empty({h.size(0), d}, h.options());
  std::vector<float> bx(d), y(d);
  for (int64_t t = 0; t < pos.count; ++t) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = t * rows + r;
      const float* p = proj.data_ptr<float>() + row * 3 * d;  // B | C | x
      for (int64_t c = 0; c < d; ++c) bx[c] = p[c] * p[2 * d + c];
      float* win = window.data_ptr<float>() + r * (k - 1) * d;
      linserve::gdn::conv_sum(win, bx.data(), w[1].data_ptr<float>(), y.data(), d, k);
      linserve::gdn::shift_window(win, bx.data(), d, k);
      float* out = mixed.data_ptr<float>() + row * d;
      for (int64_t c = 0; c < d; ++c) out[c] = p[d + c] * y[c];
    }
    pos.keep(t, window, at::Tensor());
  }
  return linserve::project(mixed, w[2]);
}

// Heads of one row in a task of the SSM update: a head's state is 32 KB at Granite's shape,
// so a task of four is long enough to prefetch through and short enough to even out.
constexpr int64_t kSsmHeadsPerTask = 4;

// One row's SSM heads [h0, h1): S = exp(dt A) S + dt x B^T, y = S C + D x.
void ssm_heads(const float* xbc, const float* dt_raw, const at::Tensor* w, float* s, float* y,
               int64_t h0, int64_t h1, const Dims& m, const Part& p) {
  const int64_t inner = m.mh * m.mp, per_group = m.mh / m.mg;
  const float* a_log = w[3].data_ptr<float>();
  const float* dt_bias = w[4].data_ptr<float>();
  const float* dskip = w[5].data_ptr<float>();
  for (int64_t hh = h0; hh < h1; ++hh) {
    const int64_t g = hh / per_group;
    const float* b = xbc + inner + g * m.mn;
    const float* c = xbc + inner + m.mg * m.mn + g * m.mn;
    const float dt = std::min(std::max(linserve::gdn::softplus(dt_raw[hh] + dt_bias[hh]), p.f0),
                              p.f1);
    const float decay = std::exp(dt * -std::exp(a_log[hh]));
    for (int64_t i = 0; i < m.mp; ++i) {
      const float xv = xbc[hh * m.mp + i];
      y[hh * m.mp + i] =
          linserve::mamba2::ssm_row<true>(s + (hh * m.mp + i) * m.mn, b, c, decay, xv * dt,
                                          m.mn) +
          dskip[hh] * xv;
    }
  }
}

// One position of the B rows of a Mamba2 layer (proj, xbc and y from their first row):
// the convolutions, bias and SiLU over xBC, then the SSM update of every head.
void mamba2_rows(const float* proj_p, float* xbc_p, float* y_p, const at::Tensor* w,
                 at::Tensor& s, at::Tensor& window, int64_t rows, const Dims& m,
                 const Part& p) {
  const int64_t inner = m.mh * m.mp, conv = inner + 2 * m.mg * m.mn;
  const int64_t k = w[1].size(0), width = inner + conv + m.mh;
  const float* conv_w = w[1].data_ptr<float>();
  const float* conv_b = w[2].numel() > 0 ? w[2].data_ptr<float>() : nullptr;
  float* window_p = window.data_ptr<float>();
  // The rows' convolutions, bias and SiLU over xBC (pointers hoisted: a data_ptr call per
  // element kept this loop scalar, 58 us a row and layer at Granite's 4,352 channels).
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* out = xbc_p + r * conv;
      const float* mixed = proj_p + r * width + inner;
      float* win = window_p + r * (k - 1) * conv;
      linserve::gdn::conv_sum(win, mixed, conv_w, out, conv, k);
      linserve::gdn::shift_window(win, mixed, conv, k);
      if (conv_b != nullptr)
        for (int64_t c = 0; c < conv; ++c) out[c] += conv_b[c];
      linserve::gdn::silu_into(out, out, conv);
    }
  });
  const int64_t state = m.mh * m.mp * m.mn;
  // Tasks of kSsmHeadsPerTask heads of one row, taken one at a time (parallel.h).
  const int64_t per_row = (m.mh + kSsmHeadsPerTask - 1) / kSsmHeadsPerTask;
  linserve::for_each_task(rows * per_row, [&](int64_t t) {
    const int64_t r = t / per_row, h0 = t % per_row * kSsmHeadsPerTask;
    ssm_heads(xbc_p + r * conv, proj_p + r * width + inner + conv, w,
              s.data_ptr<float>() + r * state, y_p + r * inner, h0,
              std::min(m.mh, h0 + kSsmHeadsPerTask), m, p);
  });
}

// Weights: in, conv [K, C], conv bias [C] (or empty), A_log, dt_bias, D [Hm], norm [inner]
// (or empty), out [inner, d]. h [T B, d] -> [T B, d].
at::Tensor mamba2(const at::Tensor& h, const at::Tensor* w, at::Tensor& s, at::Tensor& window,
                  const Dims& m, const Part& p, const Positions& pos) {
  const int64_t all = h.size(0), rows = all / pos.count, inner = m.mh * m.mp;
  const int64_t conv = inner + 2 * m.mg * m.mn, width = inner + conv + m.mh;
  const at::Tensor proj = linserve::project(h, w[0]);
  at::Tensor xbc = at::empty({all, conv}, h.options());
  at::Tensor y = at::empty({all, inner}, h.options());
  const float* proj_p = proj.data_ptr<float>();
  for (int64_t t = 0; t < pos.count; ++t) {
    mamba2_rows(proj_p + t * rows * width, xbc.data_ptr<float>() + t * rows * conv,
                y.data_ptr<float>() + t * rows * inner, w, s, window, rows, m, p);
    pos.keep(t, s, window);
  }
  const float* norm_w = w[6].numel() > 0 ? w[6].data_ptr<float>() : nullptr;
  const linserve::mamba2::Gate gate{inner, m.mg, norm_w != nullptr && p.i1 != 0, p.i0 != 0,
                                    p.f2};
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, all, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      linserve::mamba2::gated_norm(y_p + r * inner, proj_p + r * width, norm_w, gate);
  });
  return linserve::project(y, w[7]);
}

// Weights: (SwiGLU) gate_up [d, 2f], down; (ReLU^2) up [d, f], down. h [B, d] -> [B, d].
at::Tensor mlp(const at::Tensor& h, const at::Tensor* w, const Part& p) {
  const at::Tensor up = linserve::project(h, w[0]);
  return linserve::project(
      p.kind == kSwiGLU ? linserve::moe::swiglu(up) : linserve::moe::relu_squared(up), w[1]);
}

// Weights: router, expert bias, shared gate_up (or up), shared down, shared gate, latent in,
// latent out (moe.h's forward); the experts from ``experts[p.i0]`` on. p.i2's bits: scoring
// (0-1), norm_topk (2), relu2 (3), latent (4), groups (8-15), topk_groups (16-23).
// h [B, d] -> [B, d].
at::Tensor sparse_experts(const at::Tensor& h, const at::Tensor* w, const at::Tensor* experts,
                          const Part& p) {
  return linserve::moe::forward(h, w, experts + p.i0,
                                linserve::moe::router_from(p.i1, p.i2, p.f0, p.f1));
}

// Kimi Delta Attention's inputs of one row at one position: q, k, v after the causal conv
// and SiLU (q, k L2-normed, q scaled by Dk^-1/2) into qkv [3 W]; each channel's decay and
// each head's beta. ``fa`` and ``ga`` hold the forget gate's raw values [W] (f + dt_bias).
void kda_inputs(const float* mixed, float* window, const float* conv_w, int64_t k_width,
                const float* f, const float* b, const float* params, float* qkv,
                float* decay, float* beta, const Part& p) {
  const int64_t heads = p.i0, dk = p.i1, width = heads * dk;
  linserve::gdn::conv_sum(window, mixed, conv_w, qkv, 3 * width, k_width);
  linserve::gdn::shift_window(window, mixed, 3 * width, k_width);
  linserve::gdn::silu_into(qkv, qkv, 3 * width);
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  const float* a_log = params;
  const float* dt_bias = params + heads;
  for (int64_t h = 0; h < heads; ++h) {
    linserve::gdn::l2norm(qkv + h * dk, dk, q_scale);
    linserve::gdn::l2norm(qkv + width + h * dk, dk, 1.f);
    const float rate = std::exp(a_log[h]);
    for (int64_t i = 0; i < dk; ++i) {
      const float fi = f[h * dk + i] + dt_bias[h * dk + i];
      const float g = p.i2 != 0 ? p.f1 / (1.f + std::exp(-rate * fi))
                                : -rate * linserve::gdn::softplus(fi);
      decay[h * dk + i] = std::exp(g);
    }
    beta[h] = 1.f / (1.f + std::exp(-b[h]));
  }
}

// A projection through a bottleneck where given (Kimi's f_a / f_b, g_a / g_b), else direct.
at::Tensor low_rank(const at::Tensor& h, const at::Tensor& a, const at::Tensor& b) {
  return a.numel() > 0 ? linserve::project(linserve::project(h, a), b)
                       : linserve::project(h, b);
}

// Kimi Delta Attention (model/layers/kimi_delta.py). Weights: q, k, v [d, W]; conv [K, 3W];
// f_a [d, Dk] (or empty) and f_b [Dk, W] (or Ling's f [d, W]); g_a and g_b (or g) likewise;
// b [d, H]; params [H + W + Dk] (A_log per head, dt_bias, the output norm); o [W, d].
// p.i0 heads, p.i1 Dk (= Dv), p.i2 the safe gate (g = f1 sigmoid(e^A f)); p.f0 the output
// norm's eps. State: S [B, H, Dk, Dk], window [B, K-1, 3W]. h [T B, d] -> [T B, d].
at::Tensor kda(const at::Tensor& h, const at::Tensor* w, at::Tensor& s, at::Tensor& window,
               const Part& p, const Positions& pos) {
  const int64_t all = h.size(0), rows = all / pos.count, heads = p.i0, dk = p.i1;
  const int64_t width = heads * dk, k_width = w[3].size(0);
  at::Tensor mixed = at::cat({linserve::project(h, w[0]), linserve::project(h, w[1]),
                              linserve::project(h, w[2])}, 1);
  const at::Tensor f = low_rank(h, w[4], w[5]);
  at::Tensor gate = low_rank(h, w[6], w[7]);
  const at::Tensor b = linserve::project(h, w[8]);
  const float* params = w[9].data_ptr<float>();
  at::Tensor o = at::empty({all, width}, h.options());
  std::vector<float> qkv(rows * 3 * width), decay(rows * width), beta(rows * heads);
  for (int64_t t = 0; t < pos.count; ++t) {
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t row = t * rows + r;
        kda_inputs(mixed.data_ptr<float>() + row * 3 * width,
                   window.data_ptr<float>() + r * (k_width - 1) * 3 * width,
                   w[3].data_ptr<float>(), k_width, f.data_ptr<float>() + row * width,
                   b.data_ptr<float>() + row * heads, params, qkv.data() + r * 3 * width,
                   decay.data() + r * width, beta.data() + r * heads, p);
      }
    });
    at::parallel_for(0, rows * heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t r = task / heads, hh = task % heads;
        const float* in = qkv.data() + r * 3 * width + hh * dk;
        const linserve::kda::HeadTokens one{in, in + width, in + 2 * width,
                                            decay.data() + r * width + hh * dk,
                                            beta.data() + r * heads + hh,
                                            o.data_ptr<float>() + (t * rows + r) * width + hh * dk,
                                            0, 0, 0, 0};
        linserve::kda::scan_head(s.data_ptr<float>() + (r * heads + hh) * dk * dk, one, 1, dk,
                                 dk);
      }
    });
    pos.keep(t, s, window);
  }
  const float* norm_w = params + heads + width;
  float* o_p = o.data_ptr<float>();
  const float* g_p = gate.data_ptr<float>();
  for (int64_t r = 0; r < all; ++r)
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* oh = o_p + r * width + hh * dk;
      linserve::rms_row(oh, norm_w, dk, p.f0);
      for (int64_t i = 0; i < dk; ++i)
        oh[i] *= 1.f / (1.f + std::exp(-g_p[r * width + hh * dk + i]));
    }
  return linserve::project(o, w[10]);
}

// DeepSeek's interleaved rotary pairs laid out as halves (mla.py's interleaved_to_halves),
// then rotated at ``at`` (dense.h's rotate_half over all n).
void rope_interleaved(float* x, const float* inv_freq, int64_t n, int64_t at) {
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
void mla_queries(const float* q, const float* kb, const float* freqs, float* out,
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
at::Tensor mla_out(const at::Tensor& h, const at::Tensor& att, const at::Tensor* w,
                   int64_t heads, int64_t rank, int64_t width, int64_t vdim) {
  const int64_t all = h.size(0);
  at::Tensor heads_out = at::zeros({all, heads * vdim}, h.options());
  const float* vb = w[6].data_ptr<float>();
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
  if (w[8].numel() > 0) gate_heads(heads_out, linserve::project(h, w[8]), vdim);
  return linserve::project(heads_out, w[7]);
}

// Multi-head latent attention (model/layers/mla.py). Weights: q_a [d, Rq] and its norm (or
// empty), q_b [Rq, H qk] (or q [d, H qk]); kv_a [d, R + rope] and the latent's norm [R];
// W_kb [H, nope, R] and W_vb^T [H, R, v] fp32; o [H v, d]; the head gate g [d, H] (or
// empty); inv_freq [rope / 2] (or empty: no positions). p.i0 rope. Cache: keys
// [B, 1, cap, R + rope] (the latent, which is also the value). h [T B, d] -> [T B, d].
at::Tensor mla(const at::Tensor& h, const at::Tensor* w, at::Tensor& kc,
               const int64_t* lengths, const Part& p, const Positions& pos) {
  const int64_t all = h.size(0), rows = all / pos.count, rope = p.i0;
  const int64_t heads = w[5].size(0), nope = w[5].size(1), rank = w[5].size(2);
  const int64_t vdim = w[6].size(2), width = rank + rope, cap = kc.size(2);
  const at::Tensor q = w[0].numel() > 0
      ? linserve::project(linserve::normed(linserve::project(h, w[0]), w[1], 1e-6), w[2])
      : linserve::project(h, w[2]);
  const at::Tensor lat = linserve::project(h, w[3]);
  const float* freqs = w[9].numel() > 0 ? w[9].data_ptr<float>() : nullptr;
  at::Tensor o = at::empty({all, heads * width}, h.options());
  for (int64_t t = 0; t < pos.count; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = t * rows + r, at = lengths[r] + t;
      TORCH_CHECK(at < cap, "decoder_step: the KV cache is full (reserve first)");
      float* key = kc.data_ptr<float>() + (r * cap + at) * width;
      std::copy(lat.data_ptr<float>() + row * width,
                lat.data_ptr<float>() + (row + 1) * width, key);
      linserve::rms_row(key, w[4].data_ptr<float>(), rank, 1e-6f);
      if (freqs != nullptr) rope_interleaved(key + rank, freqs, rope, at);
      mla_queries(q.data_ptr<float>() + row * heads * (nope + rope), w[5].data_ptr<float>(),
                  freqs, o.data_ptr<float>() + row * heads * width, heads, nope, rank, rope,
                  at);
    }
  // every position's heads over its row's cache, a task of kMlaHeadsPerTask heads
  at::Tensor att = at::empty_like(o);
  const int64_t per_row = (heads + kMlaHeadsPerTask - 1) / kMlaHeadsPerTask;
  at::parallel_for(0, all * per_row, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t row = task / per_row, h0 = task % per_row * kMlaHeadsPerTask;
      const int64_t r = row % rows, n = lengths[r] + row / rows + 1;
      const int64_t count = std::min(heads, h0 + kMlaHeadsPerTask) - h0;
      std::vector<float> scores(std::min(count, linserve::kGroupHeads) * n);
      const float* keys = kc.data_ptr<float>() + r * cap * width;
      linserve::attend_group(o.data_ptr<float>() + (row * heads + h0) * width, keys, keys,
                             count, n, width, att.data_ptr<float>() + (row * heads + h0) * width,
                             scores.data());
    }
  });
  return mla_out(h, att, w, heads, rank, width, vdim);
}

// Lightning attention (lightning.py). Weights: qkv [d, 3 H D] (each head's q | k | v), the
// output gate [d, H D], the norm over all heads [H D], out [H D, d], each head's log-rate
// [H] fp32. p.i0 heads, p.i1 D; p.f0 the norm's eps. Per head S = e^-rate S + v k^T,
// y = S q (mamba2.h's row update with dt = 1, as the eager form's scan). State: S
// [B, H, D, D]. h [T B, d] -> [T B, d].
at::Tensor lightning(const at::Tensor& h, const at::Tensor* w, at::Tensor& s, const Part& p,
                     const Positions& pos) {
  const int64_t all = h.size(0), rows = all / pos.count, heads = p.i0, dh = p.i1;
  const int64_t width = heads * dh;
  at::Tensor qkv = linserve::project(h, w[0]);
  float* qkv_p = qkv.data_ptr<float>();
  linserve::gdn::silu_into(qkv_p, qkv_p, qkv.numel());
  at::Tensor y = at::empty({all, width}, h.options());
  const float* log_rate = w[4].data_ptr<float>();
  for (int64_t t = 0; t < pos.count; ++t) {
    at::parallel_for(0, rows * heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t r = task / heads, hh = task % heads, row = t * rows + r;
        const float* in = qkv_p + row * 3 * width + hh * 3 * dh;  // q | k | v
        const float decay = std::exp(-std::exp(log_rate[hh]));
        float* sh = s.data_ptr<float>() + (r * heads + hh) * dh * dh;
        float* out = y.data_ptr<float>() + row * width + hh * dh;
        for (int64_t i = 0; i < dh; ++i)
          out[i] = linserve::mamba2::ssm_row<true>(sh + i * dh, in + dh, in, decay,
                                                   in[2 * dh + i], dh);
      }
    });
    pos.keep(t, s, at::Tensor());
  }
  const at::Tensor gate = linserve::project(h, w[1]);
  at::Tensor o = linserve::normed(y, w[2], p.f0);
  float* o_p = o.data_ptr<float>();
  const float* g_p = gate.data_ptr<float>();
  for (int64_t i = 0; i < o.numel(); ++i) o_p[i] *= 1.f / (1.f + std::exp(-g_p[i]));
  return linserve::project(o, w[3]);
}

// Gated DeltaNet (gated_delta.py, OLMo-Hybrid's linear layers; gdn.h's step, Qwen3.5's
// arithmetic). Weights: in [d, C + Hv Dv + 2 Hv] (q, k, v, then z, b, a), conv [K, C],
// A_log and dt_bias [Hv] fp32, the gated norm [Dv], out [Hv Dv, d]. p.i0 key heads, p.i1 Dk;
// p.f0 the norm's eps, p.f1 beta's scale. State: S [B, Hv, Dk, Dv], window [B, K-1, C].
// h [T B, d] -> [T B, d].
at::Tensor gated_delta(const at::Tensor& h, const at::Tensor* w, at::Tensor& s,
                       at::Tensor& window, const Part& p, const Positions& pos) {
  const int64_t all = h.size(0), rows = all / pos.count, hv = w[2].size(0), dv = w[4].size(0);
  const int64_t dk = p.i1, c_len = 2 * p.i0 * dk + hv * dv, width = c_len + hv * dv + 2 * hv;
  const linserve::gdn::Shape sh{p.i0, hv, dk, dv, c_len, w[1].size(0), p.f0, p.f1};
  const at::Tensor proj = linserve::project(h, w[0]);
  at::Tensor y = at::empty({all, hv * dv}, h.options());
  for (int64_t t = 0; t < pos.count; ++t) {
    const float* mixed = proj.data_ptr<float>() + t * rows * width;
    const linserve::gdn::Inputs in{mixed, mixed + c_len, mixed + c_len + hv * dv + hv,
                                   mixed + c_len + hv * dv, width};
    linserve::gdn::step(in, window.data_ptr<float>(), w[1].data_ptr<float>(),
                        w[2].data_ptr<float>(), w[3].data_ptr<float>(), s.data_ptr<float>(),
                        w[4].data_ptr<float>(), y.data_ptr<float>() + t * rows * hv * dv, rows,
                        sh);
    pos.keep(t, s, window);
  }
  return linserve::project(y, w[5]);
}

// One part of a layer on h = norm(x): the mixer or MLP it is.
at::Tensor run_part(const at::Tensor& h, const at::Tensor* w, const at::Tensor* experts,
                    at::Tensor& a, at::Tensor& b, const int64_t* lengths, const Dims& m,
                    const Part& p, const Positions& pos) {
  switch (p.kind) {
    case kAttention: return attention(h, w, a, b, lengths, m, p, pos);
    case kShortConv: return short_conv(h, w, a, m, pos);
    case kMamba2: return mamba2(h, w, a, b, m, p, pos);
    case kSwiGLU:
    case kReluSquared: return mlp(h, w, p);
    case kExperts: return sparse_experts(h, w, experts, p);
    case kKda: return kda(h, w, a, b, p, pos);
    case kMla: return mla(h, w, a, lengths, p, pos);
    case kLightning: return lightning(h, w, a, p, pos);
    case kGatedDelta: return gated_delta(h, w, a, b, p, pos);
    default: TORCH_CHECK(false, "decoder_step: unknown part kind ", p.kind);
  }
}

// One part of a layer and its residual (Residual's comment); w: the norm before, the norm
// after (each empty where there is none), then the part's weights. x [T B, d] -> [T B, d].
at::Tensor layer_part(at::Tensor x, const at::Tensor* w, const at::Tensor* experts,
                      at::Tensor& a, at::Tensor& b, const int64_t* len, const Dims& m,
                      const Part& p, const Residual& r, const Positions& pos) {
  at::Tensor h = w[0].numel() > 0 ? linserve::normed(x, w[0], r.pre_eps) : x;
  at::Tensor y = run_part(h, w + 2, experts, a, b, len, m, p, pos);
  if (w[1].numel() > 0) y = linserve::normed(y, w[1], r.post_eps);
  at::Tensor base = r.from_normed ? h : x;
  add_scaled(base, y, r.a, r.b);
  return base;
}

// The whole model over T positions of B rows (tokens [T B], position-major); snaps: per
// state tensor, [T - 1, B, ...] for the recurrent layers' (empty: none kept, or a KV layer).
at::Tensor forward(const at::Tensor& tokens, at::TensorList weights, at::TensorList experts,
                   at::TensorList state, at::TensorList snaps, const at::Tensor& lengths,
                   at::IntArrayRef ints, at::ArrayRef<double> floats, at::IntArrayRef dims,
                   at::ArrayRef<double> scalars, int64_t positions) {
  TORCH_CHECK(dims.size() == 9 && scalars.size() == 3, "decoder_step: 9 dims, 3 scalars");
  const Dims m{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], dims[7], dims[8]};
  const int64_t layers = static_cast<int64_t>(ints.size()) / kInts;
  const int64_t rows = lengths.size(0);
  int64_t slots = 3;
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t part = 0; part < 2; ++part) {
      const int64_t* i = ints.data() + l * kInts + kPartInts * part;
      slots += i[0] == kNone ? 0 : 2 + i[1];
    }
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == slots &&
                  static_cast<int64_t>(state.size()) == 2 * layers &&
                  static_cast<int64_t>(floats.size()) == kFloats * layers,
              "decoder_step: weights, state or parameters do not match the layers");
  TORCH_CHECK(snaps.empty() || snaps.size() == state.size(), "decoder_step: snaps per state");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  tokens.size(0) == rows * positions, "decoder_step: lengths [B] int64");
  for (const at::Tensor& t : state)
    TORCH_CHECK(t.numel() == 0 || (t.scalar_type() == at::kFloat && t.is_contiguous() &&
                                   t.size(0) == rows),
                "decoder_step: state is fp32 contiguous [B, ...]");
  at::Tensor x = linserve::embed_rows(weights[0], tokens, m.d, weights[0].is_same(weights[1]));
  if (scalars[1] != 1.0) x.mul_(scalars[1]);
  const int64_t* len = lengths.data_ptr<int64_t>();
  std::vector<at::Tensor> snap(snaps.begin(), snaps.end());
  const at::Tensor* w = weights.data() + 3;
  for (int64_t l = 0; l < layers; ++l) {
    at::Tensor a = state[2 * l], b = state[2 * l + 1];
    Positions pos{positions};
    if (!snap.empty() && snap[2 * l].numel() > 0) {
      pos.snap_a = &snap[2 * l];
      pos.snap_b = &snap[2 * l + 1];
    }
    for (int64_t part = 0; part < 2; ++part) {
      const int64_t* i = ints.data() + l * kInts + kPartInts * part;
      const double* pf = floats.data() + l * kFloats + kPartFloats * part;
      const Part p{i[0], i[3], i[4], i[5], static_cast<float>(pf[4]), static_cast<float>(pf[5]),
                   static_cast<float>(pf[6])};
      if (p.kind == kNone) continue;
      const Residual r{i[2] != 0, pf[0], pf[1], static_cast<float>(pf[2]),
                       static_cast<float>(pf[3])};
      x = layer_part(x, w, experts.data(), a, b, len, m, p, r, pos);
      w += 2 + i[1];
    }
  }
  at::Tensor logits = linserve::project(linserve::normed(x, weights[2], scalars[0]), weights[1]);
  if (scalars[2] != 1.0) logits.div_(scalars[2]);
  return logits;
}

at::Tensor decoder_step(const at::Tensor& tokens, at::TensorList weights, at::TensorList experts,
                        at::TensorList state, const at::Tensor& lengths, at::IntArrayRef ints,
                        at::ArrayRef<double> floats, at::IntArrayRef dims,
                        at::ArrayRef<double> scalars) {
  return forward(tokens, weights, experts, state, {}, lengths, ints, floats, dims, scalars, 1);
}

// A verify (model/verify.py): T tokens per row, tokens [T B] position-major -> logits
// [T B, V]; the state after all T, the recurrent states after each earlier one in snaps.
at::Tensor decoder_verify(const at::Tensor& tokens, at::TensorList weights,
                          at::TensorList experts, at::TensorList state, at::TensorList snaps,
                          const at::Tensor& lengths, at::IntArrayRef ints,
                          at::ArrayRef<double> floats, at::IntArrayRef dims,
                          at::ArrayRef<double> scalars, int64_t positions) {
  TORCH_CHECK(positions >= 1, "decoder_verify: at least one position");
  return forward(tokens, weights, experts, state, snaps, lengths, ints, floats, dims, scalars,
                 positions);
}

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "decoder_step(Tensor tokens, Tensor[] weights, Tensor[] experts, Tensor(a!)[] state, "
      "Tensor lengths, "
      "int[] ints, float[] floats, int[] dims, float[] scalars) -> Tensor");
  m.def(
      "decoder_verify(Tensor tokens, Tensor[] weights, Tensor[] experts, Tensor(a!)[] state, "
      "Tensor(b!)[] snaps, Tensor lengths, int[] ints, float[] floats, int[] dims, "
      "float[] scalars, int positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("decoder_step", &decoder_step);
  m.impl("decoder_verify", &decoder_verify);
}

}  // namespace decoder_step_cpp
