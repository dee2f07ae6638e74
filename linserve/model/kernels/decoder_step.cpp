// The whole decode step of a model built from the shared layers (model/layers/decoder.py's
// DecoderLM: LFM2, LFM2-MoE, Granite-4.0-H, Nemotron-H, Mamba2, Bamba, Kimi-Linear, Ling,
// MiniMax, OLMo-Hybrid, LFM3, Qwen3.5 and Qwen3-Next) in one native call: one token per row
// through every layer part, then the final norm and the LM head. The eager step dispatches
// ~20 PyTorch operators per layer part.
//
// A model is a DecoderPlan, built once from model/layers/step_parts.py's records and checked
// then (step_parts.h): its embedding table, head and final norm, then a sequence of layer
// parts, each a Residual (its norms and how it joins x) and a body of one of step_parts.h's
// kinds, computed by step_attention.h and step_mixers.h. A part takes h = pre(x), y =
// post(body(h)), x = a base + b y. Activations stay fp32 between parts; weights are as
// model/packing.py packs them (fp32, bf16, int8, int4, GGUF's blocks), projected by dense.h.
// Every row is computed by its own loops in a fixed order, so a row's logits do not depend on
// the rows beside it (batch invariance).
//
// Ops (B rows):
//   decoder_step(plan, tokens [B], state, lengths [B], offsets [B]?) -> logits [B, V] fp32
//     (offsets: each row's rotary position minus its cache slot, M-RoPE after an image);
//   decoder_verify(plan, tokens [T B] position-major, state, snaps, hidden, lengths, T)
//     -> logits [T B, V]: speculative decoding's verify (model/verify.py), every projection
//     over the T B rows at once, each mixer position after position with the step's
//     arithmetic; snaps: per state tensor [T - 1, B, ...] for a recurrent part's (empty
//     otherwise), the state after each position but the last; hidden [T B, d] (or empty)
//     receives the final norm's output (what Qwen3.5's MTP head drafts from);
//   decoder_mtp(plan, tokens [n], hidden [n, d], state, lengths [1]) -> g [n, d]: a plan with
//     an MTP prologue over n positions of one row (model/architectures/qwen3_5/mtp.py).
// state: the parts' state tensors in order (each part takes its kind's kState), fp32
// contiguous [B, ...], updated in place (lengths are not: the caller advances them).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "dense.h"
#include "embed.h"
#include "step_attention.h"
#include "step_mixers.h"
#include "step_parts.h"
#include "step_rwkv.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace decoder_step_cpp {  // named, not anonymous: unity units (build.py) join sources

using namespace linserve::step;

// x = a x + b y, in place (y [N, d]); a = 1 adds b y alone (the usual residual's bits).
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

struct PlanPart {
  Residual residual;
  Body body;
  int64_t first_state;  // where its state tensors start in the state list
};

// A model as the step runs it (the header's comment). Built from records: ``kinds`` and
// ``fields`` name each record, its values are the next ones of ``tensors``, ``ints`` and
// ``floats``. ``model``: embed, head, final norm, its bias (empty: an RMSNorm, else a
// LayerNorm); ``scalars``: the final norm's eps, the embedding scale, the logits' divisor,
// their soft cap (0: none; cap tanh(logits / cap), Gemma's and xLSTM's).
// ``experts``: every MoE part's experts in order.
struct DecoderPlan : torch::CustomClassHolder {
  at::Tensor embed, head, norm, norm_bias;
  double norm_eps, embed_scale, logits_scale, logits_cap;
  std::optional<MtpPrologue> prologue;
  std::vector<PlanPart> parts;
  std::vector<at::Tensor> experts;
  std::vector<int64_t> recurrent;  // per state tensor, 1: snapshot per position in a verify
  int64_t carries = 0;             // value slots that cross layers (Call's carry)

  DecoderPlan(std::vector<at::Tensor> model, std::vector<double> scalars,
              std::vector<std::string> kinds, std::vector<std::string> fields,
              std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
              std::vector<double> floats, std::vector<at::Tensor> experts_)
      : experts(std::move(experts_)) {
    TORCH_CHECK(model.size() == 4 && scalars.size() == 4 && kinds.size() == fields.size(),
                "decoder plan: embed, head, norm, its bias; four scalars; a field list per "
                "record");
    embed = model[0];
    head = model[1];
    norm = model[2];
    norm_bias = model[3];
    norm_eps = scalars[0];
    embed_scale = scalars[1];
    logits_scale = scalars[2];
    logits_cap = scalars[3];
    Reader r{tensors, ints, floats};
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (kinds[i] == MtpPrologue::kKind) {
        TORCH_CHECK(i == 0, "decoder plan: an MTP prologue comes first");
        prologue.emplace(read_record<MtpPrologue>(kinds[i], fields[i], r));
        continue;
      }
      TORCH_CHECK(kinds[i] == Residual::kKind && i + 1 < kinds.size(),
                  "decoder plan: each layer part is a residual record, then its body");
      Residual res = read_record<Residual>(kinds[i], fields[i], r);
      ++i;
      Body body = read_body(kinds[i], fields[i], r);
      parts.push_back({std::move(res), std::move(body), static_cast<int64_t>(recurrent.size())});
      recurrent.insert(recurrent.end(), linserve::step::state_count(parts.back().body),
                       int64_t{linserve::step::recurrent(parts.back().body)});
      check_carry(parts.back().body);
    }
    TORCH_CHECK(r.done(), "decoder plan: values left over after the last record");
  }

  // A part that declares a value slot: the first writes it, a later one reads it.
  void check_carry(const Body& body) {
    const auto* p = std::get_if<Rwkv7TimeMix>(&body);
    if (p == nullptr) return;
    TORCH_CHECK(p->first ? p->carry == carries : p->carry < carries,
                "decoder plan: value slot ", p->carry, " read before a part writes it");
    if (p->first) ++carries;
  }

  int64_t state_count() const { return static_cast<int64_t>(recurrent.size()); }
  std::vector<int64_t> recurrent_states() const { return recurrent; }
};

// x [N, d] through an RMSNorm, or a LayerNorm where ``bias`` is given.
at::Tensor norm_of(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                   bool layer_norm, double eps) {
  return layer_norm ? linserve::layer_normed(x, w, bias, eps) : linserve::normed(x, w, eps);
}

// One part and its residual over x [N, d] (N = T B); returns the new x.
at::Tensor run_part(const PlanPart& part, at::Tensor x, at::Tensor* state, const Call& c) {
  const Residual& r = part.residual;
  at::Tensor h = present(r.pre) ? norm_of(x, r.pre, r.pre_bias, r.layer_norm, r.pre_eps) : x;
  at::Tensor y = std::visit([&](const auto& p) { return run(p, h, state, c); }, part.body);
  if (present(r.post)) y = norm_of(y, r.post, r.post_bias, r.layer_norm, r.post_eps);
  at::Tensor base = r.from_normed ? h : x;
  add_scaled(base, y, r.a, r.b);
  return base;
}

// Every part over x [T B, d]; snaps as decoder_verify's (empty: none kept).
at::Tensor run_parts(const DecoderPlan& plan, at::Tensor x, at::TensorList state,
                     at::TensorList snaps, const at::Tensor& lengths, int64_t positions,
                     const std::optional<at::Tensor>& offsets = std::nullopt) {
  const int64_t rows = lengths.size(0);
  TORCH_CHECK(static_cast<int64_t>(state.size()) == plan.state_count(),
              "decoder_step: the plan's parts take ", plan.state_count(), " state tensors, not ",
              state.size());
  TORCH_CHECK(snaps.empty() || snaps.size() == state.size(), "decoder_step: snaps per state");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() &&
                  x.size(0) == rows * positions, "decoder_step: lengths [B] int64");
  for (const at::Tensor& t : state)
    TORCH_CHECK(t.numel() == 0 || (t.is_contiguous() && t.size(0) == rows),
                "decoder_step: state is contiguous [B, ...] (fp32, a KV cache as stored)");
  std::vector<at::Tensor> st(state.begin(), state.end()), snap(snaps.begin(), snaps.end());
  std::vector<at::Tensor> carry(plan.carries);
  const bool shifted = offsets.has_value() && offsets->defined();
  TORCH_CHECK(!shifted || (offsets->scalar_type() == at::kLong && offsets->is_contiguous() &&
                           offsets->numel() == rows), "decoder_step: offsets [B] int64");
  for (const PlanPart& part : plan.parts) {
    Call call{lengths.data_ptr<int64_t>(), plan.experts.data(), Positions{positions}, &carry,
              shifted ? offsets->data_ptr<int64_t>() : nullptr};
    if (!snap.empty() && plan.recurrent[part.first_state]) call.pos.snaps = snap.data() + part.first_state;
    x = run_part(part, x, st.data() + part.first_state, call);
  }
  return x;
}

// The final norm's output of x into hidden (if given), then the logits.
at::Tensor logits_of(const DecoderPlan& plan, const at::Tensor& x, at::Tensor hidden) {
  const at::Tensor normed =
      norm_of(x, plan.norm, plan.norm_bias, present(plan.norm_bias), plan.norm_eps);
  if (hidden.defined() && hidden.numel() > 0) hidden.copy_(normed);
  at::Tensor logits = linserve::project(normed, plan.head);
  if (plan.logits_scale != 1.0) logits.div_(plan.logits_scale);
  if (plan.logits_cap > 0.0) {
    const float cap = static_cast<float>(plan.logits_cap);
    float* lp = logits.data_ptr<float>();
    for (int64_t i = 0; i < logits.numel(); ++i) lp[i] = std::tanh(lp[i] / cap) * cap;
  }
  return logits;
}

at::Tensor embedded(const DecoderPlan& plan, const at::Tensor& tokens) {
  at::Tensor x = linserve::embed_rows(plan.embed, tokens, plan.norm.size(0),
                                      plan.embed.is_same(plan.head));
  if (plan.embed_scale != 1.0) x.mul_(plan.embed_scale);
  return x;
}

at::Tensor decoder_step(const c10::intrusive_ptr<DecoderPlan>& plan, const at::Tensor& tokens,
                        at::TensorList state, const at::Tensor& lengths,
                        const std::optional<at::Tensor>& offsets) {
  const at::Tensor x =
      run_parts(*plan, embedded(*plan, tokens), state, {}, lengths, 1, offsets);
  return logits_of(*plan, x, at::Tensor());
}

at::Tensor decoder_verify(const c10::intrusive_ptr<DecoderPlan>& plan, const at::Tensor& tokens,
                          at::TensorList state, at::TensorList snaps, at::Tensor hidden,
                          const at::Tensor& lengths, int64_t positions,
                          const std::optional<at::Tensor>& offsets) {
  TORCH_CHECK(positions >= 1, "decoder_verify: at least one position");
  const at::Tensor x =
      run_parts(*plan, embedded(*plan, tokens), state, snaps, lengths, positions, offsets);
  return logits_of(*plan, x, hidden);
}

at::Tensor decoder_mtp(const c10::intrusive_ptr<DecoderPlan>& plan, const at::Tensor& tokens,
                       const at::Tensor& hidden, at::TensorList state,
                       const at::Tensor& lengths) {
  TORCH_CHECK(plan->prologue.has_value() && lengths.numel() == 1,
              "decoder_mtp: a plan with an MTP prologue, one row");
  const MtpPrologue& p = *plan->prologue;
  const int64_t n = tokens.size(0), d = plan->norm.size(0);
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.size(0) == n && hidden.size(1) == d,
              "decoder_mtp: hidden [n, d] fp32");
  const at::Tensor e = linserve::embed_rows(plan->embed, tokens, d,
                                            plan->embed.is_same(plan->head));
  const at::Tensor h = linserve::normed(hidden.contiguous(), p.norm_hidden, p.eps);
  const at::Tensor x = linserve::project(
      at::cat({linserve::normed(e, p.norm_embed, p.eps), h}, 1), p.fc);
  return linserve::normed(run_parts(*plan, x, state, {}, lengths, n), plan->norm,
                          plan->norm_eps);
}

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.class_<DecoderPlan>("DecoderPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<double>, std::vector<std::string>,
                       std::vector<std::string>, std::vector<at::Tensor>, std::vector<int64_t>,
                       std::vector<double>, std::vector<at::Tensor>>())
      .def("state_count", &DecoderPlan::state_count)
      .def("recurrent_states", &DecoderPlan::recurrent_states);
  m.def(
      "decoder_step(__torch__.torch.classes.linserve.DecoderPlan plan, Tensor tokens, "
      "Tensor(a!)[] state, Tensor lengths, Tensor? offsets=None) -> Tensor");
  m.def(
      "decoder_verify(__torch__.torch.classes.linserve.DecoderPlan plan, Tensor tokens, "
      "Tensor(a!)[] state, Tensor(b!)[] snaps, Tensor(c!) hidden, Tensor lengths, "
      "int positions, Tensor? offsets=None) -> Tensor");
  m.def(
      "decoder_mtp(__torch__.torch.classes.linserve.DecoderPlan plan, Tensor tokens, "
      "Tensor hidden, Tensor(a!)[] state, Tensor lengths) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("decoder_step", &decoder_step);
  m.impl("decoder_verify", &decoder_verify);
  m.impl("decoder_mtp", &decoder_mtp);
}

}  // namespace decoder_step_cpp
