// Mamba2's recurrence and elementwise tail, shared by the native step (decoder_step.cpp) and
// the prefill (prefill_ops.cpp's mamba2_scan_ and mamba2_gate_): one state row's update and
// read-out, and the D skip and gated RMSNorm of one row, so both forms compute a token with
// the same code.
#pragma once

#include <cmath>
#include <cstdint>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

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
    gdn::mul_silu(y, z, g.inner);
  if (!g.normed) return;
  for (int64_t k = 0; k < g.groups; ++k) {
    float* yg = y + k * width;
    const float ss = sum_squares(yg, width);
    const float r = 1.f / std::sqrt(ss / static_cast<float>(width) + g.eps);
    for (int64_t i = 0; i < width; ++i) yg[i] *= r;
  }
  if (g.before)
    gdn::mul_silu(y, z, g.inner);
  for (int64_t i = 0; i < g.inner; ++i) y[i] *= w[i];
}

// How far ahead of the row being updated the step prefetches the state, in floats (8 KB: 16
// rows of a d_state of 128; the state of a head is contiguous, and the heads of a row too).
// In a step the state is read and written once and a Mamba2 model's is large
// (Granite-4.0-H-Micro: 17 MB a sequence), so it comes from DRAM: its update alone read 0.68
// of the native read roofline on one thread without, 0.78 with 2 to 16 KB ahead
// (bench.mamba2_step's shape with hidden 64, so that the state is all a step reads). A
// prefill's scan keeps a head's state in L1 across its tokens and does not prefetch.
constexpr int64_t kStatePrefetch = 2048;

// One state row s [N] of a head: s = decay s + xdt b, returns s . c. The dot product is
// summed in 16 lanes and then by sum16's fixed tree (the tail past N / 16 vectors last), so
// its bits are the same on AVX-512 and AVX2 (Lanes16); a scalar chain of N dependent adds
// took a third of a quantized step's time.
template <bool PREFETCH>
inline float ssm_row(float* s, const float* b, const float* c, float decay, float xdt,
                     int64_t n_len) {
  const int64_t vec = n_len / 16 * 16;
  Lanes16 acc = {};
  for (int64_t n = 0; n < vec; n += 16) {
    if constexpr (PREFETCH) __builtin_prefetch(s + n + kStatePrefetch, 1, 3);  // never faults
    for (int64_t k = 0; k < kParts; ++k) {
      const int64_t at = n + k * kPartLanes;
      const vpart v = load_part(s + at) * decay + xdt * load_part(b + at);
      store_part(s + at, v);
      acc.part[k] += v * load_part(c + at);
    }
  }
  float out = sum_lanes(acc);
  for (int64_t n = vec; n < n_len; ++n) {
    s[n] = s[n] * decay + xdt * b[n];
    out += s[n] * c[n];
  }
  return out;
}

// One head's inputs over a prefill's tokens: token t's x [P] at x + t x_ld, its dt at
// dt + t dt_ld (after softplus and the limits), its B and C [N] at b + t bc_ld and
// c + t bc_ld; its y [P] goes to y + t y_ld.
struct HeadTokens {
  const float *x, *dt, *b, *c;
  float* y;
  int64_t x_ld, dt_ld, bc_ld, y_ld;
};

// Denormals as zero and flushed to zero while alive (x86's MXCSR, restored after). A head
// whose decay is tiny, or whose inputs stay near zero, takes its state into fp32's subnormal
// range, where every product traps to microcode (the chunked form's 128 tokens of one row at
// Granite-4.0-H's shape: 27 ms instead of 8); a value below 1e-38 changes no sum above it.
struct FlushDenormals {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// One head's SSM over `tokens` tokens, in order: S [P, N] (contiguous, in place) takes
// exp(dt a) S + dt x Bᵀ and y = S C (no D skip), each token by the step's ssm_row. The
// head's state (32 KB at Granite's shape) stays in L1 across the tokens; the chunked form's
// matrix products, masks and copies in ATen took ~15% of a Granite prefill.
inline void scan_head(float* s, float a, const HeadTokens& in, int64_t tokens, int64_t p_len,
                      int64_t n_len) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float dt = in.dt[t * in.dt_ld];
    const float decay = std::exp(dt * a);
    const float* x = in.x + t * in.x_ld;
    const float* b = in.b + t * in.bc_ld;
    const float* c = in.c + t * in.bc_ld;
    float* y = in.y + t * in.y_ld;
    for (int64_t i = 0; i < p_len; ++i)
      y[i] = ssm_row<false>(s + i * n_len, b, c, decay, x[i] * dt, n_len);
  }
}

}  // namespace mamba2
}  // namespace linserve
