// The generic tiles (any -march): ROWS rows x NV vectors from a column, the last columns
// one at a time, and a span of rows on them (AVX2 builds take whole panels from their own
// tiles first).
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include "gemm_quant_avx2.h"

namespace linserve {

// ---- The generic path (any -march): ROWS rows x NV vectors of kLanes columns from c -------
template <int F, int64_t ROWS, int64_t NV>
inline void tile_q(const QuantActs& a, const Span& s, const QuantWeights& w, int64_t c) {
  QCol col[NV];
  for (int64_t j = 0; j < NV; ++j) col[j] = column(w, c + j * kLanes);
  vfloat acc[ROWS][NV] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    prefetch_tile<F>(col[0], kLanes * NV, b + kTilePrefetch);
    for (int64_t g = 0; g < kHalves<F>; ++g) {  // the block, or kQ6's two halves in turn
      const int64_t t0 = g * kHalfSteps<F>, t1 = t0 + kHalfSteps<F>;
      vi32 dot[ROWS][NV];
      for (int64_t r = 0; r < ROWS; ++r)
        for (int64_t j = 0; j < NV; ++j)
          dot[r][j] = vi32{} + (kAvx2Dot ? avx2_dot_start<F>(
              a.d0(s.r0 + r, b), a.d0_lo(s.r0 + r, b), g) : half_start<F>(
              a.d0(s.r0 + r, b), a.d0_lo(s.r0 + r, b), g));
      if constexpr (kAvx2Dot) block_dot_avx2<F, ROWS, NV>(a, s.r0, col, b, dot, t0, t1);
      for (int64_t t = t0; t < (kAvx2Dot ? t0 : t1); ++t) {
        vu32 v[NV], v6[NV];  // (kQ6S: v the low inputs' values q + 32, v6 the high ones')
        for (int64_t j = 0; j < NV; ++j) {
          const uint8_t* p = col[j].q + b * col[j].block;
          v[j] = *reinterpret_cast<const vu32_ua*>(p + t * col[j].ld);
          if constexpr (kSix<F>) {
            const vu32 h = *reinterpret_cast<const vu32_ua*>(p + (kSteps<F> + t / 2) * col[j].ld);
            v6[j] = six_bits(v[j], h, t, 1);
            v[j] = six_bits(v[j], h, t, 0);
          }
        }
        for (int64_t i = 0; i < 4; ++i) {
          for (int64_t r = 0; r < ROWS; ++r) {
            const int8_t* xq = a.block(s.r0 + r, b);
            for (int64_t j = 0; j < NV; ++j) {
              if (kSix<F>) {
                dot[r][j] += (vi32)((v[j] >> (8 * i)) & 255u) * xq[8 * t + i];
                dot[r][j] += (vi32)((v6[j] >> (8 * i)) & 255u) * xq[8 * t + 4 + i];
              } else if (kNib<F>) {
                dot[r][j] += (vi32)((v[j] >> (8 * i)) & 15u) * xq[8 * t + i];
                dot[r][j] += (vi32)((v[j] >> (8 * i + 4)) & 15u) * xq[8 * t + 4 + i];
              } else {
                dot[r][j] += (vi32)((v[j] >> (8 * i)) & 255u) * xq[4 * t + i];
              }
            }
          }
        }
      }
      for (int64_t j = 0; j < NV; ++j) {
        const vfloat sc = kScaled<F> ? load_scales<F>(col[j], b, g) : vfloat{} + 1.f;
        const vfloat tv = kMin<F> ? k_mins_v<F>(col[j], b) : vfloat{};
        for (int64_t r = 0; r < ROWS; ++r) {
          const vfloat d = __builtin_convertvector(dot[r][j], vfloat);
          const float sx = a.s(s.r0 + r, b);
          acc[r][j] = kScaled<F> ? acc[r][j] + d * (sc * sx) : acc[r][j] + d * sx;
          if constexpr (kMin<F>)
            acc[r][j] = acc[r][j] + tv * (sx * min_sum<F>(a.d0(s.r0 + r, b)));
        }
      }
    }
  }
  for (int64_t j = 0; j < NV; ++j) {
    const vfloat sw = kScaled<F> ? vfloat{} + 1.f : load_scales<kQInt8>(col[j], 0);
    for (int64_t r = 0; r < ROWS; ++r)
      store_out(s.y + r * s.n + c + j * kLanes, kScaled<F> ? acc[r][j] : acc[r][j] * sw,
                s.accumulate);
  }
}

// A block's (or half g's) weight scale of one column, as the tiles widen it.
template <int F>
inline float column_scale(const QCol& col, int64_t b, int64_t g) {
  if constexpr (kTwoF32<F>) return k_scale<F>(col, b, g);
  return half_to_float(*group_scales(col, b));
}

// The last N % kLanes columns, one element at a time, with the same arithmetic.
template <int F>
inline void scalar_quant_columns(const QuantActs& a, const Span& s, const QuantWeights& w,
                                 int64_t rows, int64_t c) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t cc = 0; cc < s.c1 - c; ++cc) {
      const QCol col = column(w, c + cc);
      float f = 0.f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int8_t* xq = a.block(s.r0 + r, b);
        const float sx = a.s(s.r0 + r, b);
        for (int64_t g = 0; g < kHalves<F>; ++g) {
          int32_t d = half_start<F>(a.d0(s.r0 + r, b), a.d0_lo(s.r0 + r, b), g);
          for (int64_t t = g * kHalfSteps<F>; t < (g + 1) * kHalfSteps<F>; ++t) {
            const uint8_t* lane = col.q + b * col.block + t * col.ld;
            for (int64_t i = 0; i < 4; ++i) {
              if (kSix<F>) {
                const uint32_t v = lane[i];
                const uint32_t h = col.q[b * col.block + (kSteps<F> + t / 2) * col.ld + i];
                d += static_cast<int32_t>(six_bits(v, h, t, 0)) * xq[8 * t + i] +
                     static_cast<int32_t>(six_bits(v, h, t, 1)) * xq[8 * t + 4 + i];
              } else if (kNib<F>) {
                d += (lane[i] & 15) * xq[8 * t + i] + (lane[i] >> 4) * xq[8 * t + 4 + i];
              } else {
                d += lane[i] * xq[4 * t + i];
              }
            }
          }
          f = kScaled<F> ? f + static_cast<float>(d) * (column_scale<F>(col, b, g) * sx)
                         : f + static_cast<float>(d) * sx;
          if constexpr (kMin<F>)
            f = f + k_min<F>(col, b) * (sx * min_sum<F>(a.d0(s.r0 + r, b)));
        }
      }
      const volatile float out = kScaled<F> ? f : f * *static_cast<const float*>(col.s);
      float* y = s.y + r * s.n + c + cc;
      *y = s.accumulate ? *y + out : out;
    }
  }
}


template <int F, int64_t ROWS>
inline void span_rows_quant(const QuantActs& a, const Span& s, const QuantWeights& w,
                            bool cold = true) {
  int64_t c = s.c0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  for (; c + kVecs * kLanes <= s.c1; c += kVecs * kLanes) {  // whole panels from the records
    QCol col[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) col[j] = column(w, c + j * kLanes);
    tile_avx2_rows<F, ROWS, kVecs>(a.records(s.r0), a.blocks, col, s.y + c, s.n,
                                   s.accumulate, cold);
  }
#endif
  (void)cold;
  for (; c + kVecs * kLanes <= s.c1; c += kVecs * kLanes) tile_q<F, ROWS, kVecs>(a, s, w, c);
  // The last single vectors one row at a time: a narrow tile's arithmetic changed with the
  // number of rows it held, so a row's last columns depended on its batch (seen on AVX2).
  for (; c + kLanes <= s.c1; c += kLanes) {
    for (int64_t r = 0; r < ROWS; ++r) {
      Span one = s;
      one.r0 = s.r0 + r;
      one.x = s.x + r * s.k_len;
      one.y = s.y + r * s.n;
      tile_q<F, 1, 1>(a, one, w, c);
    }
  }
  if (c < s.c1) scalar_quant_columns<F>(a, s, w, ROWS, c);
}

}  // namespace linserve
