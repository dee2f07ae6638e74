// Small numeric helpers shared by the native kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace linserve {

// exp(v) for v <= 0 in a form the compiler vectorises: v = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 polynomial for exp(r), then 2^n through the exponent bits. Relative error
// below 2.5e-7 on [-87, 0] (checked against float64 exp); inputs below -87 are clamped there
// (exp(-87) ~ 1.6e-38), which keeps 2^n a normal float.
inline float exp_nonpositive(float v) {
  v = v < -87.f ? -87.f : v;
  const float n = std::nearbyint(v * 1.44269504088896341f);
  const float r = v - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace linserve
