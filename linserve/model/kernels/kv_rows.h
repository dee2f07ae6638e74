// A KV cache's rows as stored (--kv-cache-dtype; model/state.py's KVEntry): fp32, bf16, or
// int8 rows of D + D / 8 bytes (D values, then one fp32 scale per block of 32 values, as
// llama.cpp's q8_0 blocks with the scales gathered at the row's end). Rows are written from
// fp32 (store_row) with the operations KVEntry.put applies, and read back to fp32 a block of
// kKeyBlock rows at a time (StoredRows), so that attention over a stored cache
// (attend_group_stored) has, bit for bit, attend_group's result on the cache read back whole,
// while the cache's bytes cross memory once, at their stored width.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention.h"

namespace linserve {

enum class KvKind { kFp32, kBf16, kInt8 };
constexpr int64_t kQuantBlock = 32;  // an int8 row's values per scale

// Bytes of one stored row of D values.
inline int64_t row_bytes(KvKind kind, int64_t dim) {
  return kind == KvKind::kFp32 ? dim * 4 : kind == KvKind::kBf16 ? dim * 2 : dim + dim / 8;
}

// fp32 -> bf16, rounded to nearest even (NaN kept a quiet NaN), as torch converts.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// One row of D fp32 values into its stored form at dst. int8: per block of 32, scale =
// max |x| / 127 and value = round(x / scale) half to even, clamped to +-127 (scale 0: all 0).
inline void store_row(KvKind kind, const float* x, int64_t dim, uint8_t* dst) {
  if (kind == KvKind::kFp32) {
    std::memcpy(dst, x, dim * 4);
    return;
  }
  if (kind == KvKind::kBf16) {
    for (int64_t i = 0; i < dim; ++i) {
      const uint16_t h = to_bf16(x[i]);
      std::memcpy(dst + 2 * i, &h, 2);
    }
    return;
  }
  auto* values = reinterpret_cast<int8_t*>(dst);
  for (int64_t b = 0; b < dim / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float top = 0.f;
    for (int64_t i = 0; i < kQuantBlock; ++i) top = std::max(top, std::fabs(xb[i]));
    const float scale = top / 127.f, safe = scale > 0.f ? scale : 1.f;
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      const float q = std::nearbyint(xb[i] / safe);
      values[b * kQuantBlock + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
    }
    std::memcpy(dst + dim + 4 * b, &scale, 4);
  }
}

// bf16 values [i, n) of src back to fp32 (exact), one at a time.
inline void bf16_tail(const uint8_t* src, int64_t i, int64_t n, float* out) {
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    std::memcpy(out + i, &u, 4);
  }
}

// int8 values [i, n) of src times scale, one at a time.
inline void int8_tail(const int8_t* src, int64_t i, int64_t n, float scale, float* out) {
  for (; i < n; ++i) out[i] = static_cast<float>(src[i]) * scale;
}

// One stored row back to D fp32 values (bf16 exactly; int8 value times its block's scale),
// 16 or 8 lanes at a time where the build has them: the same conversions and one product
// per value, so the same bits as the scalar tails.
inline void load_row(KvKind kind, const uint8_t* src, int64_t dim, float* out) {
  if (kind == KvKind::kFp32) {
    std::memcpy(out, src, dim * 4);
    return;
  }
  int64_t i = 0;
  if (kind == KvKind::kBf16) {
#if defined(__AVX512F__)
    for (; i + 16 <= dim; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i));
      _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(h), 16)));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= dim; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i));
      _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(h), 16)));
    }
#endif
    bf16_tail(src, i, dim, out);
    return;
  }
  const auto* values = reinterpret_cast<const int8_t*>(src);
  for (int64_t b = 0; b < dim / kQuantBlock; ++b) {
    float scale;
    std::memcpy(&scale, src + dim + 4 * b, 4);
    const int64_t end = (b + 1) * kQuantBlock;
    i = b * kQuantBlock;
#if defined(__AVX512F__)
    const __m512 s16 = _mm512_set1_ps(scale);
    for (; i + 16 <= end; i += 16) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + i));
      _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s16));
    }
#elif defined(__AVX2__)
    const __m256 s8 = _mm256_set1_ps(scale);
    for (; i + 8 <= end; i += 8) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + i));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s8));
    }
#endif
    int8_tail(values, i, end, scale, out);
  }
}

// One key-value group's stored rows (keys or values), row j at data + j * row_bytes.
struct StoredRows {
  const uint8_t* data;
  KvKind kind;
  int64_t dim;

  // Row j read back to fp32 into out [D].
  void read(int64_t j, float* out) const {
    load_row(kind, data + j * row_bytes(kind, dim), dim, out);
  }

  // Rows [j0, j1) as fp32 [j1 - j0, D]: the cache itself where it is fp32, else read into buf.
  const float* block(int64_t j0, int64_t j1, float* buf) const {
    const int64_t bytes = row_bytes(kind, dim);
    if (kind == KvKind::kFp32) return reinterpret_cast<const float*>(data + j0 * bytes);
    for (int64_t j = j0; j < j1; ++j) load_row(kind, data + j * bytes, dim, buf + (j - j0) * dim);
    return buf;
  }
};

// attend_heads<R> over stored rows: each block of kKeyBlock keys read into buf (kKeyBlock
// x D floats) for its scores, each block of values for its pass; the same calls in the
// same order as attend_heads makes over the rows read back whole.
template <int64_t R>
inline void attend_heads_stored(const float* q, const StoredRows& keys, const StoredRows& values,
                                int64_t n, int64_t dim, float* scores, float* out, float* buf) {
  for (int64_t j0 = 0; j0 < n; j0 += kKeyBlock) {
    const int64_t j1 = std::min(n, j0 + kKeyBlock);
    group_scores_range<R>(q, keys.block(j0, j1, buf), n, dim, j0, j1, j1, scores);
  }
  float sums[R];
  for (int64_t h = 0; h < R; ++h) sums[h] = softmax_weights(scores + h * n, n);
  std::fill(out, out + R * dim, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += kKeyBlock) {
    const int64_t j1 = std::min(n, j0 + kKeyBlock);
    group_values_block<R>(scores, n, values.block(j0, j1, buf), dim, j0, j1, out);
  }
  for (int64_t h = 0; h < R; ++h)
    for (int64_t m = 0; m < dim; ++m) out[h * dim + m] *= 1.f / sums[h];
}

// attend_group over a stored cache (n rows of keys and values): o [rep, D], the bits
// attend_group gives over the rows read back to fp32. Scores scratch as attend_group's.
inline void attend_group_stored(const float* q, const StoredRows& keys, const StoredRows& values,
                                int64_t rep, int64_t n, int64_t dim, float* o, float* scores) {
  if (keys.kind == KvKind::kFp32) {
    attend_group(q, reinterpret_cast<const float*>(keys.data),
                 reinterpret_cast<const float*>(values.data), rep, n, dim, o, scores);
    return;
  }
  if (dim % 16 != 0) {  // attend_head, one head at a time: read every row first
    std::vector<float> whole(2 * n * dim);
    keys.block(0, n, whole.data());
    values.block(0, n, whole.data() + n * dim);
    attend_group(q, whole.data(), whole.data() + n * dim, rep, n, dim, o, scores);
    return;
  }
  thread_local std::vector<float> buf;
  buf.resize(kKeyBlock * dim);
  int64_t h = 0;
  for (; h + kGroupHeads <= rep; h += kGroupHeads)
    attend_heads_stored<kGroupHeads>(q + h * dim, keys, values, n, dim, scores, o + h * dim,
                                     buf.data());
  for (; h + 2 <= rep; h += 2)
    attend_heads_stored<2>(q + h * dim, keys, values, n, dim, scores, o + h * dim, buf.data());
  for (; h < rep; ++h)
    attend_heads_stored<1>(q + h * dim, keys, values, n, dim, scores, o + h * dim, buf.data());
}

}  // namespace linserve
