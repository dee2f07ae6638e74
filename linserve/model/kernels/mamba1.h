// Mamba-1's selective scan (Mamba, Falcon-Mamba), shared by the prefill and the step
// (prefill_ops.cpp's mamba1_scan_, a step being one token): per channel d and state n,
// s[d, n] = exp(dt_d a[d, n]) s[d, n] + dt_d x_d b_n, and y_d = sum_n s[d, n] c_n (the D skip
// and the gate stay outside).
//
// Sixteen channels ride in the lanes of one vector: the decay and the write are elementwise,
// and each lane's read-out sums over n in order, so a channel's bits depend on its own inputs
// alone (not on its batch, its row's other channels or how a prompt was split). A task keeps
// its channels' state in registers and L1 across every token: read once, written once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fastmath.h"

namespace linserve {
namespace mamba1 {

constexpr int64_t kLanes = 16;

// One row's inputs over its tokens: x, dt and y [T, D], b and c [T, N], each with its own
// stride between tokens.
struct RowTokens {
  const float* x;
  const float* dt;
  const float* b;
  const float* c;
  float* y;
  int64_t x_ld, dt_ld, bc_ld, y_ld;
};

// Up to 16 floats from p (live of them), zeros past them.
inline Lanes16 load_lanes(const float* p, int64_t live) {
  float buf[kLanes] = {};
  std::memcpy(buf, p, static_cast<size_t>(live) * sizeof(float));
  Lanes16 v;
  for (int64_t k = 0; k < kParts; ++k) v.part[k] = load_part(buf + k * kPartLanes);
  return v;
}

inline void store_lanes(float* p, const Lanes16& v, int64_t live) {
  float buf[kLanes];
  for (int64_t k = 0; k < kParts; ++k) store_part(buf + k * kPartLanes, v.part[k]);
  std::memcpy(p, buf, static_cast<size_t>(live) * sizeof(float));
}

// Channels [d0, d0 + live) of one row over `tokens` tokens: s [D, N] is the row's state and
// a [D, N] = -exp(A_log), both row-major; the channels' state is transposed into lanes for
// the scan and written back once. The lanes are Lanes16 (fastmath.h): as one v16 on AVX2
// each state moved through the stack in 16-byte halves.
inline void scan_channels(float* s, const float* a, const RowTokens& in, int64_t tokens,
                          int64_t d0, int64_t live, int64_t n_len) {
  std::vector<Lanes16> st(static_cast<size_t>(n_len)), av(static_cast<size_t>(n_len));
  for (int64_t k = 0; k < n_len; ++k) {
    float sb[kLanes] = {}, ab[kLanes] = {};
    for (int64_t j = 0; j < live; ++j) {
      sb[j] = s[(d0 + j) * n_len + k];
      ab[j] = a[(d0 + j) * n_len + k];
    }
    st[k] = load_lanes(sb, kLanes);
    av[k] = load_lanes(ab, kLanes);
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const Lanes16 dt = load_lanes(in.dt + t * in.dt_ld + d0, live);
    const Lanes16 xs = load_lanes(in.x + t * in.x_ld + d0, live);
    const float* b = in.b + t * in.bc_ld;
    const float* c = in.c + t * in.bc_ld;
    Lanes16 acc = {};
    for (int64_t q = 0; q < kParts; ++q) {
      const vpart dx = dt.part[q] * xs.part[q];
      for (int64_t k = 0; k < n_len; ++k) {
        vpart& sk = st[k].part[q];
        sk = exp_nonpositive_fused(dt.part[q] * av[k].part[q]) * sk + dx * b[k];
        acc.part[q] = acc.part[q] + sk * c[k];
      }
    }
    store_lanes(in.y + t * in.y_ld + d0, acc, live);
  }
  for (int64_t k = 0; k < n_len; ++k) {
    float sb[kLanes];
    store_lanes(sb, st[k], kLanes);
    for (int64_t j = 0; j < live; ++j) s[(d0 + j) * n_len + k] = sb[j];
  }
}

}  // namespace mamba1
}  // namespace linserve
