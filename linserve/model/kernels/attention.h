// Decode attention over a KV cache for a group of query heads sharing one key-value head
// (grouped-query attention), used by the whole-model step (decoder_step.cpp).
//
// At batch 1 a step's attention is bound by reading the cache: 1,024 positions of one
// 256-wide key-value head are 2 MB, more than a core's L2, so a loop over the group's query
// heads read it from DRAM once per head (four times with Qwen3.5's 8 / 2 heads: 2 ms of a
// 21 ms int4 step). Here each key and value row is read once for all the group's heads.
//
// Per head h of the group: scores s_j = q_h . k_j / sqrt(D) (each dot product 16 partial
// sums added as a fixed tree), softmax over j (max subtracted; exp_nonpositive), then
// o_h = sum_j p_j v_j in j order, divided by sum_j p_j. A head's arithmetic does not depend
// on the other heads or rows. fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

// The passes by hand on ymm registers (key_scores_avx2, group_values_avx2): AVX2 builds
// with FMA and without AVX-512.
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define LINSERVE_ATTENTION_YMM 1
#include <immintrin.h>
#endif

#include "dense.h"
#include "fastmath.h"

namespace linserve {

// Heads per pass (the value pass keeps R x kCols accumulators in registers).
constexpr int64_t kGroupHeads = 4;
// Keys per value block: the block's rows stay in L1 / L2 across its column passes.
constexpr int64_t kKeyBlock = 64;
// Software prefetch, measured on 12 groups of 1,024 positions from DRAM (the hardware's
// prefetch alone left the passes latency-bound): the score loop asks for the next kAhead
// key rows whole; the value loop's first column pass asks for the rest of each row, so its
// misses overlap instead of coming one column pass at a time. With both, the 12 groups took
// 0.55-0.75 of the time of attend_head over their heads one by one.
constexpr int64_t kAhead = 2;
// Query rows a prefill task attends together (attend_group_rows): each block of keys and
// values is read from memory once for them all.
constexpr int64_t kCausalRows = 16;
// Keys a score pass takes at once, and 16-column vectors a value pass keeps per head: with
// kGroupHeads heads, two keys' 8 sums (or 4 x kCols values) fill AVX-512's 32 registers,
// and AVX2's 16 (each v16 two) spilled on every product: 6 GFLOP/s on a Zen 3. Either
// way an element's own arithmetic is the same (J and NV only share loads).
// On AVX2 (without AVX-512) both passes are written on ymm registers below.
#if defined(__AVX512F__)
constexpr int64_t kScoreKeys = 2;
constexpr int64_t kValueCols = kCols;
#else
constexpr int64_t kScoreKeys = 1;
constexpr int64_t kValueCols = 1;
#endif

// Scores of keys [j, j + J) (J = 1 or 2: two keys share each load of q) for R heads: kj
// is key j's row, s = scores + j (head h's at s[h n]); ``ahead``: rows past kj + J may be
// asked for early.
template <int64_t R, int64_t J>
inline void key_scores(const float* q, const float* kj, int64_t n, int64_t dim, bool ahead,
                       float scale, float* s) {
  if (ahead)
    for (int64_t d0 = 0; d0 < J * dim; d0 += 16) __builtin_prefetch(kj + kAhead * dim + d0, 0, 3);
  v16 acc[J][R] = {};
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    v16 k[J];
    for (int64_t i = 0; i < J; ++i) k[i] = load16(kj + i * dim + d0);
    for (int64_t h = 0; h < R; ++h) {
      const v16 qh = load16(q + h * dim + d0);
      for (int64_t i = 0; i < J; ++i) acc[i][h] += qh * k[i];
    }
  }
  for (int64_t i = 0; i < J; ++i)
    for (int64_t h = 0; h < R; ++h) s[h * n + i] = sum16(acc[i][h]) * scale;
}

#if defined(LINSERVE_ATTENTION_YMM)
// sum16's tree on a v16 held as two ymm (lanes 0-7, 8-15): the same additions in the same
// order, without the value going through memory.
inline float sum16_halves(__m256 lo, __m256 hi) {
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 even = _mm_add_ss(b, _mm_movehl_ps(b, b));                    // b0 + b2
  const __m128 odd = _mm_add_ss(_mm_movehdup_ps(b), _mm_movehl_ps(b, _mm_movehdup_ps(b)));
  return _mm_cvtss_f32(_mm_add_ss(even, odd));                              // (b0+b2)+(b1+b3)
}

// key_scores<R, 1> on AVX2's ymm registers by hand: GCC moved the v16 sums through the
// stack in 16-byte halves (perf annotate; both passes 13 GFLOP/s). Each lane's sum is the
// same chain of fused multiply-adds over d, then sum16's tree: the same bits as the v16 form.
template <int64_t R>
inline void key_scores_avx2(const float* q, const float* kj, int64_t n, int64_t dim,
                            bool ahead, float scale, float* s) {
  if (ahead)
    for (int64_t d0 = 0; d0 < dim; d0 += 16) __builtin_prefetch(kj + kAhead * dim + d0, 0, 3);
  __m256 lo[R], hi[R];
  for (int64_t h = 0; h < R; ++h) lo[h] = hi[h] = _mm256_setzero_ps();
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    const __m256 klo = _mm256_loadu_ps(kj + d0), khi = _mm256_loadu_ps(kj + d0 + 8);
    for (int64_t h = 0; h < R; ++h) {
      lo[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + d0), klo, lo[h]);
      hi[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * dim + d0 + 8), khi, hi[h]);
    }
  }
  for (int64_t h = 0; h < R; ++h) s[h * n] = sum16_halves(lo[h], hi[h]) * scale;
}
#endif

// Scores [R, n] of keys [j0, j1) of n: q [R, D] K^T / sqrt(D), kb key j0's row (keys up
// to row `limit` may be read ahead); D a multiple of 16. Two keys at a time from key 0 on
// (j0 even), a last odd one alone, whatever the range: a key's score does not depend on
// how the keys were split into ranges.
template <int64_t R>
inline void group_scores_range(const float* q, const float* kb, int64_t n, int64_t dim,
                               int64_t j0, int64_t j1, int64_t limit, float* scores) {
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  int64_t j = j0;
  if constexpr (kScoreKeys == 2)
    for (; j + 2 <= j1; j += 2)
      key_scores<R, 2>(q, kb + (j - j0) * dim, n, dim, j + kAhead < limit, scale, scores + j);
#if defined(LINSERVE_ATTENTION_YMM)
  for (; j < j1; ++j)
    key_scores_avx2<R>(q, kb + (j - j0) * dim, n, dim, j + kAhead < limit, scale, scores + j);
#else
  for (; j < j1; ++j)
    key_scores<R, 1>(q, kb + (j - j0) * dim, n, dim, j + kAhead < limit, scale, scores + j);
#endif
}

// scores [R, n] = q [R, D] K^T / sqrt(D), K [n, D]; D a multiple of 16.
template <int64_t R>
inline void group_scores(const float* q, const float* keys, int64_t n, int64_t dim,
                         float* scores) {
  group_scores_range<R>(q, keys, n, dim, 0, n, n, scores);
}

// scores [n] -> exp(scores - max) in place; returns their sum. In 16 lanes: the max, the
// exponentials (exp_nonpositive_fused, the tail's lanes padded), and the sum as sum_squares
// (fastmath.h) sums: the lanes, sum16's tree, then the tail in order. A prefill's rows
// (attend_causal) take n up to the prompt's length, where a scalar chain of n dependent adds
// would bind; and an element's bits do not depend on where the scores sit.
inline float softmax_weights(float* scores, int64_t n) {
  const int64_t vec = n / 16 * 16;
  float top = -INFINITY;
  if (vec) {
    vpart m = load_part(scores);
    for (int64_t j = kPartLanes; j < vec; j += kPartLanes) {
      const vpart s = load_part(scores + j);
      m = s > m ? s : m;
    }
    for (int64_t i = 0; i < kPartLanes; ++i) top = std::max(top, m[i]);  // a max: any order
  }
  for (int64_t j = vec; j < n; ++j) top = std::max(top, scores[j]);
  const vpart shift = vpart{} + top;
  Lanes16 acc = {};
  for (int64_t j = 0; j < vec; j += 16)
    for (int64_t k = 0; k < kParts; ++k) {
      const vpart e = exp_nonpositive_fused(load_part(scores + j + k * kPartLanes) - shift);
      store_part(scores + j + k * kPartLanes, e);
      acc.part[k] += e;
    }
  float sum = sum_lanes(acc);
  if (vec < n) {
    float tail[16];
    std::fill(tail, tail + 16, top);
    std::copy(scores + vec, scores + n, tail);
    for (int64_t k = 0; k < kParts; ++k)
      store_part(tail + k * kPartLanes,
                 exp_nonpositive_fused(load_part(tail + k * kPartLanes) - shift));
    for (int64_t j = vec; j < n; ++j) sum += scores[j] = tail[j - vec];
  }
  return sum;
}

// out [R, D] += p [R, n] V for keys [j0, j1), columns [m0, m0 + 16 NV); vb key j0's value
// row.
template <int64_t R, int64_t NV>
inline void group_values(const float* p, int64_t n, const float* vb, int64_t dim,
                         int64_t j0, int64_t j1, int64_t m0, float* out) {
  v16 acc[R][NV];
  for (int64_t h = 0; h < R; ++h)
    for (int64_t v = 0; v < NV; ++v) acc[h][v] = load16(out + h * dim + m0 + 16 * v);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = vb + (j - j0) * dim + m0;
    if (m0 == 0)  // the whole row, for this pass and the ones after it
      for (int64_t d0 = 0; d0 < dim; d0 += 16) __builtin_prefetch(vj + d0, 0, 3);
    v16 row[NV];
    for (int64_t v = 0; v < NV; ++v) row[v] = load16(vj + 16 * v);
    for (int64_t h = 0; h < R; ++h) {
      const float ph = p[h * n + j];
      for (int64_t v = 0; v < NV; ++v) acc[h][v] += ph * row[v];
    }
  }
  for (int64_t h = 0; h < R; ++h)
    for (int64_t v = 0; v < NV; ++v) store16(out + h * dim + m0 + 16 * v, acc[h][v]);
}

#if defined(LINSERVE_ATTENTION_YMM)
// group_values<R, 1> on ymm registers by hand (as key_scores_avx2): each lane the same chain
// of fused multiply-adds in j order.
template <int64_t R>
inline void group_values_avx2(const float* p, int64_t n, const float* vb, int64_t dim,
                              int64_t j0, int64_t j1, int64_t m0, float* out) {
  __m256 lo[R], hi[R];
  for (int64_t h = 0; h < R; ++h) {
    lo[h] = _mm256_loadu_ps(out + h * dim + m0);
    hi[h] = _mm256_loadu_ps(out + h * dim + m0 + 8);
  }
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = vb + (j - j0) * dim + m0;
    if (m0 == 0)
      for (int64_t d0 = 0; d0 < dim; d0 += 16) __builtin_prefetch(vj + d0, 0, 3);
    const __m256 vlo = _mm256_loadu_ps(vj), vhi = _mm256_loadu_ps(vj + 8);
    for (int64_t h = 0; h < R; ++h) {
      const __m256 ph = _mm256_broadcast_ss(p + h * n + j);
      lo[h] = _mm256_fmadd_ps(ph, vlo, lo[h]);
      hi[h] = _mm256_fmadd_ps(ph, vhi, hi[h]);
    }
  }
  for (int64_t h = 0; h < R; ++h) {
    _mm256_storeu_ps(out + h * dim + m0, lo[h]);
    _mm256_storeu_ps(out + h * dim + m0 + 8, hi[h]);
  }
}
#endif

// The values pass of attend_heads for one row over keys [j0, j1): its column passes; vb
// key j0's value row.
template <int64_t R>
inline void group_values_block(const float* p, int64_t n, const float* vb, int64_t dim,
                               int64_t j0, int64_t j1, float* out) {
#if defined(LINSERVE_ATTENTION_YMM)
  for (int64_t m0 = 0; m0 < dim; m0 += 16) group_values_avx2<R>(p, n, vb, dim, j0, j1, m0, out);
#else
  int64_t m0 = 0;
  for (; m0 + 16 * kValueCols <= dim; m0 += 16 * kValueCols)
    group_values<R, kValueCols>(p, n, vb, dim, j0, j1, m0, out);
  for (; m0 < dim; m0 += 16) group_values<R, 1>(p, n, vb, dim, j0, j1, m0, out);
#endif
}

// R heads: q [R, D], K, V [n, D] -> out [R, D]; scores scratch [R, n].
template <int64_t R>
inline void attend_heads(const float* q, const float* keys, const float* values, int64_t n,
                         int64_t dim, float* scores, float* out) {
  group_scores<R>(q, keys, n, dim, scores);
  float sums[R];
  for (int64_t h = 0; h < R; ++h) sums[h] = softmax_weights(scores + h * n, n);
  std::fill(out, out + R * dim, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += kKeyBlock)
    group_values_block<R>(scores, n, values + j0 * dim, dim, j0, std::min(n, j0 + kKeyBlock),
                          out);
  for (int64_t h = 0; h < R; ++h)
    for (int64_t m = 0; m < dim; ++m) out[h * dim + m] *= 1.f / sums[h];
}

// The ``rep`` query heads of one key-value group over n cached positions:
// o [rep, D] = softmax(q K^T / sqrt(D)) V; q [rep, D]; K, V [n, D]; scores scratch
// [min(rep, kGroupHeads), n]. Heads go kGroupHeads at a time (then 2, then 1); a head size
// that is not a multiple of 16 takes attend_head (dense.h), one head at a time.
inline void attend_group(const float* q, const float* keys, const float* values, int64_t rep,
                         int64_t n, int64_t dim, float* o, float* scores) {
  if (dim % 16 != 0) {
    for (int64_t h = 0; h < rep; ++h)
      attend_head(q + h * dim, keys, values, n, dim, scores, o + h * dim);
    return;
  }
  int64_t h = 0;
  for (; h + kGroupHeads <= rep; h += kGroupHeads)
    attend_heads<kGroupHeads>(q + h * dim, keys, values, n, dim, scores, o + h * dim);
  for (; h + 2 <= rep; h += 2) attend_heads<2>(q + h * dim, keys, values, n, dim, scores, o + h * dim);
  for (; h < rep; ++h) attend_heads<1>(q + h * dim, keys, values, n, dim, scores, o + h * dim);
}

// attend_heads<R> for `rows` consecutive query rows of one group, row i over keys
// [0, n0 + i): q and out of row i at i * stride. Each row makes exactly attend_heads's calls
// in their order (the same bits as attending it alone); only the rows are interleaved per
// block of kKeyBlock keys, so that a block is read from memory once for all of them and
// from the core's cache after. Scores scratch [rows, R, n0 + rows - 1].
template <int64_t R>
inline void attend_heads_rows(const float* q, int64_t stride, const float* keys,
                              const float* values, int64_t n0, int64_t rows, int64_t dim,
                              float* scores, float* out) {
  const int64_t last = n0 + rows - 1;
  for (int64_t j0 = 0; j0 < last; j0 += kKeyBlock)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = n0 + i;
      if (n > j0)
        group_scores_range<R>(q + i * stride, keys + j0 * dim, n, dim, j0,
                              std::min(n, j0 + kKeyBlock), n, scores + i * R * last);
    }
  float sums[R * kCausalRows];
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < R; ++h)
      sums[i * R + h] = softmax_weights(scores + i * R * last + h * (n0 + i), n0 + i);
    std::fill(out + i * stride, out + i * stride + R * dim, 0.f);
  }
  for (int64_t j0 = 0; j0 < last; j0 += kKeyBlock)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t n = n0 + i;
      if (n > j0)
        group_values_block<R>(scores + i * R * last, n, values + j0 * dim, dim, j0,
                              std::min(n, j0 + kKeyBlock), out + i * stride);
    }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t h = 0; h < R; ++h)
      for (int64_t m = 0; m < dim; ++m) out[i * stride + h * dim + m] *= 1.f / sums[i * R + h];
}

// attend_group for up to kCausalRows consecutive query rows of one group (a prefill's rows),
// row i over keys [0, n0 + i): q [rows, ..., rep, D] and o alike, rows `stride` floats
// apart. Each row's result has the bits attend_group gives it alone (the decode step's),
// while each key and value row is read from memory once per pass instead of once per query
// row: at 16k keys a row's pass over them came from DRAM every time. Scores scratch: at least
// rows * min(rep, kGroupHeads) * (n0 + rows - 1) floats.
inline void attend_group_rows(const float* q, int64_t stride, const float* keys,
                              const float* values, int64_t rep, int64_t n0, int64_t rows,
                              int64_t dim, float* o, float* scores) {
  if (dim % 16 != 0) {
    for (int64_t i = 0; i < rows; ++i)
      attend_group(q + i * stride, keys, values, rep, n0 + i, dim, o + i * stride, scores);
    return;
  }
  int64_t h = 0;
  for (; h + kGroupHeads <= rep; h += kGroupHeads)
    attend_heads_rows<kGroupHeads>(q + h * dim, stride, keys, values, n0, rows, dim, scores,
                                   o + h * dim);
  for (; h + 2 <= rep; h += 2)
    attend_heads_rows<2>(q + h * dim, stride, keys, values, n0, rows, dim, scores, o + h * dim);
  for (; h < rep; ++h)
    attend_heads_rows<1>(q + h * dim, stride, keys, values, n0, rows, dim, scores, o + h * dim);
}

}  // namespace linserve
