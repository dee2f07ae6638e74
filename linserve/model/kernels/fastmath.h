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

// exp_nonpositive on the lanes of V (v16, or any vector of floats: vpart below), written as
// vectors so that every element takes the same instructions wherever it sits (a loop of
// exp_nonpositive calls stays scalar: GCC vectorises no nearbyint). v log2(e) is rounded to
// nearest even by adding and subtracting 1.5 x 2^23 (exact below 2^22 in magnitude);
// otherwise exp_nonpositive's steps.
// EXACT: the product rounded before that add, as nearbyint takes its argument (the empty
// asm keeps the compiler from fusing the two): exp_nonpositive's bits on every lane (checked
// with SiLU on all 2^32 inputs). Else the product and the add are one fused multiply-add,
// which rounds differently on 62 of those inputs: for kernels whose every form takes it (the
// softmax, Mamba-1's scan).
template <bool EXACT, typename V>
inline V exp_nonpositive_vec(V v) {
  typedef int32_t vi __attribute__((vector_size(sizeof(V))));
  const V lowest = V{} - 87.f, magic = V{} + 12582912.f;
  v = v < lowest ? lowest : v;
  V m = v * 1.44269504088896341f;
  if constexpr (EXACT) {
#if defined(__AVX__)
    asm("" : "+x"(m));
#else
    asm("" : "+m"(m));
#endif
  }
  const V n = (m + magic) - magic;
  const V p = exp_reduced(v, n);
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
template <typename V>
inline V exp_nonpositive_lanes(V v) { return exp_nonpositive_vec<true>(v); }
template <typename V>
inline V exp_nonpositive_fused(V v) { return exp_nonpositive_vec<false>(v); }

// The 16 lanes' sum, as a fixed tree (halves added, then halves of the halves ...).
inline float sum16(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// 16 lanes as the CPU's own vectors: one v16 (a zmm) on AVX-512, two v8 (ymm, lanes 0-7 and
// 8-15) on AVX2. A loop that carries a v16 across its iterations on AVX2 had GCC move it
// through the stack a 16-byte half at a time (Mamba2's scan 4.4x slower, perf annotate);
// written on Lanes16 the same lanes take the same operations in the same order either way,
// so the bits do not change.
typedef float v8 __attribute__((vector_size(32)));
#if defined(__AVX512F__)
typedef v16 vpart;
constexpr int64_t kParts = 1;
#else
typedef v8 vpart;
constexpr int64_t kParts = 2;
#endif
constexpr int64_t kPartLanes = 16 / kParts;

struct Lanes16 {
  vpart part[kParts];
};

inline vpart load_part(const float* p) {
  vpart v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_part(float* p, vpart v) { std::memcpy(p, &v, sizeof(v)); }

// sum16's tree over the 16 lanes of ``v``.
inline float sum_lanes(const Lanes16& v) {
#if defined(__AVX512F__)
  return sum16(v.part[0]);
#else
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = v.part[0] + v.part[1];
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
#endif
}

// x [n]'s sum of squares: 16 lanes, then sum16's tree, then the tail past n / 16 vectors in
// order, so the same bits on AVX-512 and AVX2. (A scalar chain of n dependent adds ran at
// one add per 4 cycles: Mamba2's gated norm of 4,096 per row and layer.)
inline float sum_squares(const float* x, int64_t n) {
  const int64_t vec = n / 16 * 16;
  Lanes16 acc = {};
  for (int64_t i = 0; i < vec; i += 16)
    for (int64_t k = 0; k < kParts; ++k) {
      const vpart v = load_part(x + i + k * kPartLanes);
      acc.part[k] += v * v;
    }
  float out = sum_lanes(acc);
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
