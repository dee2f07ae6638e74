// Kimi Delta Attention's recurrence (model/layers/kimi_delta.py), shared by the prefill and
// the step (prefill_ops.cpp's kda_scan_, a step being one token): per head, with a decay per
// key channel i,
//   S[i, :] *= decay_i;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q.
// One task is one (row, head): its S [Dk, Dv] stays in cache over every token, read once and
// written once. Each sum runs over i in order, so a head's bits depend on its own inputs alone
// (not on the batch, nor on how a prompt was split).
#pragma once

#include <cstdint>
#include <vector>

namespace linserve {
namespace kda {

// One (row, head)'s inputs over its tokens: q, k, decay [T, Dk], v, o [T, Dv], beta [T], each
// with its own stride between tokens.
struct HeadTokens {
  const float* q;
  const float* k;
  const float* v;
  const float* decay;
  const float* beta;
  float* o;
  int64_t qk_ld, v_ld, beta_ld, o_ld;
};

inline void scan_head(float* s, const HeadTokens& in, int64_t tokens, int64_t dk, int64_t dv) {
  std::vector<float> mem(static_cast<size_t>(dv)), out(static_cast<size_t>(dv));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* q = in.q + t * in.qk_ld;
    const float* k = in.k + t * in.qk_ld;
    const float* decay = in.decay + t * in.qk_ld;
    const float* v = in.v + t * in.v_ld;
    const float beta = in.beta[t * in.beta_ld];
    for (int64_t j = 0; j < dv; ++j) mem[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float di = decay[i], ki = k[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] *= di;
        mem[j] += row[j] * ki;
      }
    }
    for (int64_t j = 0; j < dv; ++j) mem[j] = beta * (v[j] - mem[j]);  // delta
    for (int64_t j = 0; j < dv; ++j) out[j] = 0.f;
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < dv; ++j) {
        row[j] += ki * mem[j];
        out[j] += row[j] * qi;
      }
    }
    float* o = in.o + t * in.o_ld;
    for (int64_t j = 0; j < dv; ++j) o[j] = out[j];
  }
}

}  // namespace kda
}  // namespace linserve
