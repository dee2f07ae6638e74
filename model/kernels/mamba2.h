// Mamba2's elementwise tail, shared by the native step (decoder_step.cpp) and the prefill
// (prefill_ops.cpp's mamba2_gate): the D skip and the gated RMSNorm of one row, so both
// forms compute a row's gated output with the same code.
#pragma once

#include <cmath>
#include <cstdint>

#include "fastmath.h"
#include "gdn.h"

namespace linserve {
namespace mamba2 {

// How a family gates: ``normed``: an RMSNorm over groups of inner / groups channels with
// weight w (else y silu(z) alone); ``before``: normalise first, then gate (Falcon-H1),
// else gate first (Mamba2).
struct Gate {
  int64_t inner, groups;
  bool normed, before;
  float eps;
};

// y [inner] gated by z [inner] and normalised per group, times w [inner], in place.
inline void gated_norm(float* y, const float* z, const float* w, const Gate& g) {
  const int64_t width = g.inner / g.groups;
  if (!g.normed || !g.before)
    for (int64_t i = 0; i < g.inner; ++i) y[i] *= gdn::silu(z[i]);
  if (!g.normed) return;
  for (int64_t k = 0; k < g.groups; ++k) {
    float* yg = y + k * width;
    const float ss = sum_squares(yg, width);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(width) + g.eps);
    for (int64_t i = 0; i < width; ++i) yg[i] *= r;
  }
  if (g.before)
    for (int64_t i = 0; i < g.inner; ++i) y[i] *= gdn::silu(z[i]);
  for (int64_t i = 0; i < g.inner; ++i) y[i] *= w[i];
}

}  // namespace mamba2
}  // namespace linserve
