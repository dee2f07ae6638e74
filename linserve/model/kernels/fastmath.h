// Small numeric helpers shared by the native kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace linserve {

// exp(v - n ln2) for |v - n ln2| <= ln2 / 2: ln2 in two parts, then a degree-6 polynomial.
// T: a float, or a vector of them (v16).
template <typename T>
inline T exp_reduced(T v, T n) {
  const T r = v - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  T p = r * (1.f / 720.f) + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  return p * r + 1.f;
}

// exp(v) for v <= 0 in a form the compiler vectorises: v = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 polynomial for exp(r), then 2^n through the exponent bits. Relative error
// below 2.5e-7 on [-87, 0] (checked against float64 exp); inputs below -87 are clamped there
// (exp(-87) ~ 1.6e-38), which keeps 2^n a normal float.
inline float exp_nonpositive(float v) {
  v = v < -87.f ? -87.f : v;
  const float n = std::nearbyint(v * 1.44269504088896341f);
  const float p = exp_reduced(v, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// 16 floats as one value: one zmm on AVX-512, two ymm on AVX2 (GCC splits it). Loads and
// stores through memcpy, so any alignment.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// exp_nonpositive on 16 lanes, written as vectors so that every element takes the same
// instructions wherever it sits: a loop of exp_nonpositive calls may be vectorised with a
// scalar peel and tail chosen by the pointer's alignment, whose code need not round as the
// vector body does. v log2(e) is rounded to nearest even by adding and subtracting 1.5 x 2^23
// (exact below 2^22 in magnitude); otherwise exp_nonpositive's steps.
inline v16 exp16_nonpositive(v16 v) {
  typedef int32_t vi16 __attribute__((vector_size(64)));
  const v16 lowest = v16{} - 87.f, magic = v16{} + 12582912.f;
  v = v < lowest ? lowest : v;
  const v16 n = (v * 1.44269504088896341f + magic) - magic;
  const v16 p = exp_reduced(v, n);
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The 16 lanes' sum, as a fixed tree (halves added, then halves of the halves ...).
inline float sum16(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// x [n]'s sum of squares: 16 lanes, then sum16's tree, then the tail past n / 16 vectors in
// order, so the same bits on AVX-512 and AVX2. (A scalar chain of n dependent adds ran at
// one add per 4 cycles: Mamba2's gated norm of 4,096 per row and layer.)
inline float sum_squares(const float* x, int64_t n) {
  const int64_t vec = n / 16 * 16;
  v16 acc = {};
  for (int64_t i = 0; i < vec; i += 16) {
    const v16 v = load16(x + i);
    acc += v * v;
  }
  float out = sum16(acc);
  for (int64_t i = vec; i < n; ++i) out += x[i] * x[i];
  return out;
}

// Vectors of 16 a register-blocked loop keeps per accumulator set (a few sets at once).
#if defined(__AVX512F__)
constexpr int64_t kCols = 4;  // 4 zmm a set
#else
constexpr int64_t kCols = 2;  // 4 ymm a set
#endif

}  // namespace linserve
