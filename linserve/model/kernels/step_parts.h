// The whole-model native step's layer parts as named structs: the C++ side of
// model/layers/step_parts.py, field for field. A plan is built once from records
// (decoder_step.cpp's DecoderPlan): per record a kind, the names of its fields (checked here
// against the struct's kFields, so the two sides cannot drift apart silently) and its values
// in three streams: tensors, ints, floats, each in the fields' order. Each struct reads its
// own values through a Reader and checks what it needs once, when the plan is built; the step
// then reads named fields.
//
// A part declares how many state tensors it takes (kState, consumed in order from the
// layer's state list: kv -> k, v; recurrent -> S; conv -> window) and whether verify
// snapshots them after each position (kRecurrent). Shapes: d hidden, H heads of D.
#pragma once

#include <ATen/ATen.h>

#include "dense.h"

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace linserve::step {

// The three value streams of a plan's records, read in order.
struct Reader {
  const std::vector<at::Tensor>& tensors;
  const std::vector<int64_t>& ints;
  const std::vector<double>& floats;
  size_t t = 0, i = 0, f = 0;

  at::Tensor tensor() {
    TORCH_CHECK(t < tensors.size(), "decoder plan: fewer tensors than the records name");
    return tensors[t++];
  }
  int64_t integer() {
    TORCH_CHECK(i < ints.size(), "decoder plan: fewer ints than the records name");
    return ints[i++];
  }
  bool flag() { return integer() != 0; }
  double f64() {
    TORCH_CHECK(f < floats.size(), "decoder plan: fewer floats than the records name");
    return floats[f++];
  }
  float f32() { return static_cast<float>(f64()); }
  bool done() const { return t == tensors.size() && i == ints.size() && f == floats.size(); }
};

inline bool present(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// How a part joins the residual stream x: h = pre(x) (x where pre is empty),
// y = post(part(h)) (part(h) where post is empty), then x = a base + b y, base being x or,
// with from_normed, h (MiniMax's alpha / beta). The norms are RMSNorms, or with layer_norm
// LayerNorms with their biases (RWKV's).
struct Residual {
  static constexpr const char* kKind = "residual";
  static constexpr const char* kFields =
      "pre post pre_bias post_bias from_normed layer_norm pre_eps post_eps a b";
  at::Tensor pre, post, pre_bias, post_bias;
  bool from_normed, layer_norm;
  double pre_eps, post_eps;
  float a, b;
  explicit Residual(Reader& r)
      : pre(r.tensor()), post(r.tensor()), pre_bias(r.tensor()), post_bias(r.tensor()),
        from_normed(r.flag()), layer_norm(r.flag()), pre_eps(r.f64()), post_eps(r.f64()),
        a(r.f32()), b(r.f32()) {
    TORCH_CHECK(!layer_norm || ((!present(pre) || present(pre_bias)) &&
                                (!present(post) || present(post_bias))),
                "decoder plan: a LayerNorm without its bias");
  }
};

// Qwen3.5's MTP head before its layer: x = fc([norm_embed(e), norm_hidden(h)]).
struct MtpPrologue {
  static constexpr const char* kKind = "mtp_prologue";
  static constexpr const char* kFields = "norm_embed norm_hidden fc eps";
  at::Tensor norm_embed, norm_hidden, fc;
  double eps;
  explicit MtpPrologue(Reader& r)
      : norm_embed(r.tensor()), norm_hidden(r.tensor()), fc(r.tensor()), eps(r.f64()) {}
};

// Softmax attention over a KV cache (attention.py; Qwen3.5's gated attention). qkv
// [d, (H + 2 Hkv) D] (gate_interleaved: per head [q D | gate D], then k, v); q / k RMSNorm
// per head [D] or, with norm_whole, over all heads ([H D], [Hkv D]); o [H D, d]; inv_freq
// [rot / 2] (empty: no positions); gate [d, H] (one sigmoid gate a head; empty: none);
// window W > 0: a ring of the last W keys. State: k, v [B, Hkv, cap, D].
struct Attention {
  static constexpr const char* kKind = "attention";
  static constexpr const char* kFields =
      "qkv q_norm k_norm o inv_freq gate heads kv_heads head_dim norm_whole window "
      "gate_interleaved q_scale key_multiplier norm_eps";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = false;
  at::Tensor qkv, q_norm, k_norm, o, inv_freq, gate;
  int64_t heads, kv_heads, head_dim;
  bool norm_whole;
  int64_t window;
  bool gate_interleaved;
  float q_scale, key_multiplier, norm_eps;
  explicit Attention(Reader& r)
      : qkv(r.tensor()), q_norm(r.tensor()), k_norm(r.tensor()), o(r.tensor()),
        inv_freq(r.tensor()), gate(r.tensor()), heads(r.integer()), kv_heads(r.integer()),
        head_dim(r.integer()), norm_whole(r.flag()), window(r.integer()),
        gate_interleaved(r.flag()), q_scale(r.f32()), key_multiplier(r.f32()),
        norm_eps(r.f32()) {
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
                "decoder plan: attention heads ", heads, " over ", kv_heads, " groups");
  }
};

// LFM2's short convolution: in [d, 3d] to B, C, x; the causal depthwise conv [K, d] over
// B x; C times it; out [d, d]. State: window [B, K-1, d].
struct ShortConv {
  static constexpr const char* kKind = "short_conv";
  static constexpr const char* kFields = "in_proj conv out";
  static constexpr int kState = 1;
  static constexpr bool kRecurrent = true;
  at::Tensor in_proj, conv, out;
  explicit ShortConv(Reader& r) : in_proj(r.tensor()), conv(r.tensor()), out(r.tensor()) {}
};

// Mamba2 (mamba2.py): in [d, inner + conv + H] to z, xBC, dt; conv [K, conv] (+ bias) and
// SiLU over xBC; dt = softplus(dt + dt_bias) clamped to [dt_min, dt_max];
// S = exp(dt A) S + dt x B^T per head, y = S C + D x; the gated RMSNorm grouped by G (or
// y silu(z)); out [inner, d]. State: S [B, H, P, N], window [B, K-1, conv].
struct Mamba2 {
  static constexpr const char* kKind = "mamba2";
  static constexpr const char* kFields =
      "in_proj conv conv_bias a_log dt_bias d_skip norm out heads head_dim d_state groups "
      "norm_before_gate gated_norm dt_min dt_max norm_eps";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = true;
  at::Tensor in_proj, conv, conv_bias, a_log, dt_bias, d_skip, norm, out;
  int64_t heads, head_dim, d_state, groups;
  bool norm_before_gate, gated_norm;
  float dt_min, dt_max, norm_eps;
  explicit Mamba2(Reader& r)
      : in_proj(r.tensor()), conv(r.tensor()), conv_bias(r.tensor()), a_log(r.tensor()),
        dt_bias(r.tensor()), d_skip(r.tensor()), norm(r.tensor()), out(r.tensor()),
        heads(r.integer()), head_dim(r.integer()), d_state(r.integer()), groups(r.integer()),
        norm_before_gate(r.flag()), gated_norm(r.flag()), dt_min(r.f32()), dt_max(r.f32()),
        norm_eps(r.f32()) {
    TORCH_CHECK(groups > 0 && heads % groups == 0, "decoder plan: mamba2 heads ", heads,
                " over ", groups, " groups");
  }
};

// SwiGLU: gate_up [d, 2f], down [f, d].
struct SwiGLU {
  static constexpr const char* kKind = "swiglu";
  static constexpr const char* kFields = "gate_up down";
  static constexpr int kState = 0;
  static constexpr bool kRecurrent = false;
  at::Tensor gate_up, down;
  explicit SwiGLU(Reader& r) : gate_up(r.tensor()), down(r.tensor()) {}
};

// Squared ReLU: up [d, f], down [f, d].
struct ReluSquared {
  static constexpr const char* kKind = "relu_squared";
  static constexpr const char* kFields = "up down";
  static constexpr int kState = 0;
  static constexpr bool kRecurrent = false;
  at::Tensor up, down;
  explicit ReluSquared(Reader& r) : up(r.tensor()), down(r.tensor()) {}
};

// Sparse experts (moe.h): router [d, E] fp32, expert bias [E], the shared expert's gate_up
// (or up) and down, its sigmoid gate [d, 1], the latent projections in and out (each empty
// where absent); the experts' own (gate_up or up, down) are the plan's experts from
// ``first`` on; router_bits: moe.h's Router (model/layers/moe.py's native_flags).
struct Experts {
  static constexpr const char* kKind = "experts";
  static constexpr const char* kFields =
      "router bias shared_up shared_down shared_gate latent_in latent_out first top_k "
      "router_bits norm_eps scaling";
  static constexpr int kState = 0;
  static constexpr bool kRecurrent = false;
  at::Tensor slots[7];  // router .. latent_out, in moe.h's forward's order
  int64_t first, top_k, router_bits;
  float norm_eps, scaling;
  explicit Experts(Reader& r)
      : slots{r.tensor(), r.tensor(), r.tensor(), r.tensor(), r.tensor(), r.tensor(),
              r.tensor()},
        first(r.integer()), top_k(r.integer()), router_bits(r.integer()), norm_eps(r.f32()),
        scaling(r.f32()) {}
};

// Kimi Delta Attention (kimi_delta.py): q, k, v [d, W]; conv [K, 3W]; f_a [d, Dk] (or
// empty) and f_b [Dk, W] (or Ling's f [d, W]); g_a and g_b (or g) likewise; b [d, H];
// params [H + W + Dk] fp32 (A_log per head, dt_bias, the output norm); o [W, d].
// safe_gate: g = safe_lower sigmoid(e^A f). State: S [B, H, Dk, Dk], window [B, K-1, 3W].
struct Kda {
  static constexpr const char* kKind = "kda";
  static constexpr const char* kFields =
      "q k v conv f_a f_b g_a g_b b params o heads head_dim safe_gate norm_eps safe_lower";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = true;
  at::Tensor q, k, v, conv, f_a, f_b, g_a, g_b, b, params, o;
  int64_t heads, head_dim;
  bool safe_gate;
  float norm_eps, safe_lower;
  explicit Kda(Reader& r)
      : q(r.tensor()), k(r.tensor()), v(r.tensor()), conv(r.tensor()), f_a(r.tensor()),
        f_b(r.tensor()), g_a(r.tensor()), g_b(r.tensor()), b(r.tensor()), params(r.tensor()),
        o(r.tensor()), heads(r.integer()), head_dim(r.integer()), safe_gate(r.flag()),
        norm_eps(r.f32()), safe_lower(r.f32()) {}
};

// Multi-head latent attention (mla.py): q_a [d, Rq] and its norm (or empty), q_b
// [Rq, H qk] (or q [d, H qk]); kv_a [d, R + rope] and the latent's norm [R]; the absorbed
// kb [H, nope, R] and vb^T [H, R, v] fp32; o [H v, d]; gate [d, H] (or empty); inv_freq
// [rope / 2] (or empty: no positions). State: the latents [B, 1, cap, R + rope] and a
// zero-wide value cache.
struct Mla {
  static constexpr const char* kKind = "mla";
  static constexpr const char* kFields =
      "q_a q_a_norm q_b kv_a kv_norm kb vb o gate inv_freq rope_dim";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = false;
  at::Tensor q_a, q_a_norm, q_b, kv_a, kv_norm, kb, vb, o, gate, inv_freq;
  int64_t rope_dim;
  explicit Mla(Reader& r)
      : q_a(r.tensor()), q_a_norm(r.tensor()), q_b(r.tensor()), kv_a(r.tensor()),
        kv_norm(r.tensor()), kb(r.tensor()), vb(r.tensor()), o(r.tensor()), gate(r.tensor()),
        inv_freq(r.tensor()), rope_dim(r.integer()) {}
};

// Lightning attention (lightning.py): qkv [d, 3 H D] (each head's q | k | v), the output
// gate [d, H D], the norm over all heads [H D], out [H D, d], each head's log-rate [H] fp32.
// State: S [B, H, D, D].
struct Lightning {
  static constexpr const char* kKind = "lightning";
  static constexpr const char* kFields = "qkv gate norm out log_rate heads head_dim norm_eps";
  static constexpr int kState = 1;
  static constexpr bool kRecurrent = true;
  at::Tensor qkv, gate, norm, out, log_rate;
  int64_t heads, head_dim;
  float norm_eps;
  explicit Lightning(Reader& r)
      : qkv(r.tensor()), gate(r.tensor()), norm(r.tensor()), out(r.tensor()),
        log_rate(r.tensor()), heads(r.integer()), head_dim(r.integer()), norm_eps(r.f32()) {}
};

// Gated DeltaNet (gated_delta.py; gdn.h's step): in [d, C + Hv Dv + 2 Hv] (q, k, v, then
// z, b, a), conv [K, C], A_log and dt_bias [Hv] fp32, the gated norm [Dv], out [Hv Dv, d].
// State: S [B, Hv, Dk, Dv], window [B, K-1, C].
struct GatedDelta {
  static constexpr const char* kKind = "gated_delta";
  static constexpr const char* kFields =
      "in_proj conv a_log dt_bias norm out key_heads head_k_dim norm_eps beta_scale";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = true;
  at::Tensor in_proj, conv, a_log, dt_bias, norm, out;
  int64_t key_heads, head_k_dim;
  float norm_eps, beta_scale;
  explicit GatedDelta(Reader& r)
      : in_proj(r.tensor()), conv(r.tensor()), a_log(r.tensor()), dt_bias(r.tensor()),
        norm(r.tensor()), out(r.tensor()), key_heads(r.integer()), head_k_dim(r.integer()),
        norm_eps(r.f32()), beta_scale(r.f32()) {}
};

// RWKV-7's time mix (model/layers/rwkv7.py): mixes [6, d] fp32 (the token-shift lerps of
// r, w, k, v, a, g); r, k, v, o [d, d]; the LoRAs' down and up GEMM weights and the up ones'
// biases (w: tanh between, a: none, v: none (empty on the first layer), g: sigmoid, no
// bias); k_k, k_a [d], r_k [H N], the output GroupNorm [d] and its bias, fp32. ``first``:
// layer 0, whose v it writes to the plan's value slot ``carry`` (v1, which every later
// layer reads). State: S [B, H, N(value), N(key)], the shift [B, 1, d].
struct Rwkv7TimeMix {
  static constexpr const char* kKind = "rwkv7_time_mix";
  static constexpr const char* kFields =
      "mixes r k v o w_down w_up w_bias a_down a_up a_bias v_down v_up v_bias g_down g_up "
      "k_k k_a r_k norm norm_bias heads head_dim first carry group_eps";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = true;
  at::Tensor mixes, r, k, v, o, w_down, w_up, w_bias, a_down, a_up, a_bias, v_down, v_up,
      v_bias, g_down, g_up, k_k, k_a, r_k, norm, norm_bias;
  int64_t heads, head_dim;
  bool first;
  int64_t carry;
  float group_eps;
  explicit Rwkv7TimeMix(Reader& rd)
      : mixes(rd.tensor()), r(rd.tensor()), k(rd.tensor()), v(rd.tensor()), o(rd.tensor()),
        w_down(rd.tensor()), w_up(rd.tensor()), w_bias(rd.tensor()), a_down(rd.tensor()),
        a_up(rd.tensor()), a_bias(rd.tensor()), v_down(rd.tensor()), v_up(rd.tensor()),
        v_bias(rd.tensor()), g_down(rd.tensor()), g_up(rd.tensor()), k_k(rd.tensor()),
        k_a(rd.tensor()), r_k(rd.tensor()), norm(rd.tensor()), norm_bias(rd.tensor()),
        heads(rd.integer()), head_dim(rd.integer()), first(rd.flag()), carry(rd.integer()),
        group_eps(rd.f32()) {
    TORCH_CHECK(carry >= 0 && (first || present(v_down)) && mixes.size(0) == 6,
                "decoder plan: an RWKV-7 time mix's value slot or weights");
  }
};

// RWKV-7's channel mix: value(relu(key(x + (x_prev - x) x_k))^2); x_k [d] fp32, key [d, f],
// value [f, d]. State: the shift [B, 1, d].
struct Rwkv7ChannelMix {
  static constexpr const char* kKind = "rwkv7_channel_mix";
  static constexpr const char* kFields = "x_k key value";
  static constexpr int kState = 1;
  static constexpr bool kRecurrent = true;
  at::Tensor x_k, key, value;
  explicit Rwkv7ChannelMix(Reader& r) : x_k(r.tensor()), key(r.tensor()), value(r.tensor()) {}
};

// RWKV-6's time mix (model/layers/rwkv6.py): maa_x [d], maa [5, d] (w k v r g), the
// token-shift LoRA maa_w1 [d, 5 D] and maa_w2 [5, D, d], the decay w0 [d] and its LoRA
// decay_w1 [d, R], decay_w2 [R, d] (fp32, x @ W); the bonus u [H N]; r, k, v, g, o [d, d];
// the output GroupNorm. State: S [B, H, N(value), N(key)], the shift [B, 1, d].
struct Rwkv6TimeMix {
  static constexpr const char* kKind = "rwkv6_time_mix";
  static constexpr const char* kFields =
      "maa_x maa maa_w1 maa_w2 decay decay_w1 decay_w2 u r k v g o norm norm_bias heads "
      "head_dim group_eps";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = true;
  at::Tensor maa_x, maa, maa_w1, maa_w2, decay, decay_w1, decay_w2, u, r, k, v, g, o, norm,
      norm_bias;
  int64_t heads, head_dim;
  float group_eps;
  explicit Rwkv6TimeMix(Reader& rd)
      : maa_x(rd.tensor()), maa(rd.tensor()), maa_w1(rd.tensor()), maa_w2(rd.tensor()),
        decay(rd.tensor()), decay_w1(rd.tensor()), decay_w2(rd.tensor()), u(rd.tensor()),
        r(rd.tensor()), k(rd.tensor()), v(rd.tensor()), g(rd.tensor()), o(rd.tensor()),
        norm(rd.tensor()), norm_bias(rd.tensor()), heads(rd.integer()), head_dim(rd.integer()),
        group_eps(rd.f32()) {
    TORCH_CHECK(maa.size(0) == 5 && maa_w2.dim() == 3 && maa_w2.size(0) == 5,
                "decoder plan: an RWKV-6 time mix's five lerps");
  }
};

// RWKV-4's time mix (model/layers/rwkv4.py): mix [3, d] (k v r: x mu + x_prev (1 - mu)), the
// decay w = -exp(w0) and the bonus u [A] fp32; k, v, r [d, A], o [A, d]. State: num, den and
// the largest exponent [B, 3, 1, A], the shift [B, 1, d].
struct Rwkv4TimeMix {
  static constexpr const char* kKind = "rwkv4_time_mix";
  static constexpr const char* kFields = "mix w u k v r o";
  static constexpr int kState = 2;
  static constexpr bool kRecurrent = true;
  at::Tensor mix, w, u, k, v, r, o;
  explicit Rwkv4TimeMix(Reader& rd)
      : mix(rd.tensor()), w(rd.tensor()), u(rd.tensor()), k(rd.tensor()), v(rd.tensor()),
        r(rd.tensor()), o(rd.tensor()) {}
};

// RWKV-4's and RWKV-6's channel mix: sigmoid(receptance(x_r)) value(relu(key(x_k))^2); mix
// [2, d] (k r) in RWKV-6's form x + (x_prev - x) mu with ``maa``, else RWKV-4's
// x mu + x_prev (1 - mu). State: the shift [B, 1, d].
struct RwkvGatedChannelMix {
  static constexpr const char* kKind = "rwkv_gated_channel_mix";
  static constexpr const char* kFields = "mix key receptance value maa";
  static constexpr int kState = 1;
  static constexpr bool kRecurrent = true;
  at::Tensor mix, key, receptance, value;
  bool maa;
  explicit RwkvGatedChannelMix(Reader& r)
      : mix(r.tensor()), key(r.tensor()), receptance(r.tensor()), value(r.tensor()),
        maa(r.flag()) {}
};

// xLSTM's mLSTM layer (model/layers/mlstm.py): proj [d, 2 qk + 2 v + 2 H] (q, k, v, the
// output gate, the input and forget gates), gate_bias [2 H], the per-head norm's weight [v],
// out [v, d]. State: C [B, H, K, V], n [B, H, K], m [B, 1, H].
struct Mlstm {
  static constexpr const char* kKind = "mlstm";
  static constexpr const char* kFields =
      "proj gate_bias norm out heads qk_dim v_dim gate_cap norm_eps eps";
  static constexpr int kState = 3;
  static constexpr bool kRecurrent = true;
  at::Tensor proj, gate_bias, norm, out;
  int64_t heads, qk_dim, v_dim;
  float gate_cap, norm_eps, eps;
  explicit Mlstm(Reader& r)
      : proj(r.tensor()), gate_bias(r.tensor()), norm(r.tensor()), out(r.tensor()),
        heads(r.integer()), qk_dim(r.integer()), v_dim(r.integer()), gate_cap(r.f32()),
        norm_eps(r.f32()), eps(r.f32()) {}
};

using Body = std::variant<Attention, ShortConv, Mamba2, SwiGLU, ReluSquared, Experts, Kda, Mla,
                          Lightning, GatedDelta, Rwkv7TimeMix, Rwkv7ChannelMix, Rwkv6TimeMix,
                          Rwkv4TimeMix, RwkvGatedChannelMix, Mlstm>;

// A record of a known kind whose field names must be ``fields``.
template <typename T>
T read_record(const std::string& kind, const std::string& fields, Reader& r) {
  TORCH_CHECK(fields == T::kFields, "decoder plan: the ", kind, " record's fields are \"",
              fields, "\" in Python but \"", T::kFields, "\" in C++ (step_parts.h)");
  return T(r);
}

// The body a record names (its kind one of Body's).
template <size_t I = 0>
Body read_body(const std::string& kind, const std::string& fields, Reader& r) {
  if constexpr (I == std::variant_size_v<Body>) {
    TORCH_CHECK(false, "decoder plan: no layer part of kind ", kind);
    __builtin_unreachable();
  } else {
    using T = std::variant_alternative_t<I, Body>;
    if (kind == T::kKind) return read_record<T>(kind, fields, r);
    return read_body<I + 1>(kind, fields, r);
  }
}

// A body's state tensors and whether they are snapshot per position.
inline int state_count(const Body& b) {
  return std::visit([](const auto& p) { return std::decay_t<decltype(p)>::kState; }, b);
}
inline bool recurrent(const Body& b) {
  return std::visit([](const auto& p) { return std::decay_t<decltype(p)>::kRecurrent; }, b);
}

// A call's positions: h holds T positions of B rows, position-major (row t B + b is row
// b's t-th token; T = 1 for a step); the projections run over every row at once, a mixer's
// recurrence position after position over the B rows, as T steps would. After each position
// but the last, a recurrent part's state tensors are copied to their snapshots
// ``snaps[j][t]`` (verify's; none in a step).
struct Positions {
  int64_t count = 1;
  at::Tensor* snaps = nullptr;  // one per state tensor of the part, or none

  void keep(int64_t t, const at::Tensor* state, int n) const {
    if (snaps == nullptr || t + 1 >= count) return;
    for (int j = 0; j < n; ++j)
      if (present(snaps[j])) linserve::snapshot(snaps[j].select(0, t), state[j]);
  }
};

// What every part of one call sees: each row's position before the call (lengths [B]), the
// plan's experts, the positions, and the values that cross layers (the plan's slots: a part
// that declares one writes or reads it; RWKV-7's v1).
struct Call {
  const int64_t* lengths;
  const at::Tensor* experts;
  Positions pos;
  std::vector<at::Tensor>* carry = nullptr;
  const int64_t* offsets = nullptr;  // rotary position minus cache slot, per row (M-RoPE)
};

}  // namespace linserve::step
