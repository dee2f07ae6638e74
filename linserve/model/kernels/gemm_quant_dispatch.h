// Spans of rows to the build's tiles: VNNI, AVX2 or generic, and AMX's above a row count.
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include <algorithm>

#include "gemm_quant_vnni.h"

namespace linserve {

template <int F, int64_t ROWS>
inline void span_quant(const QuantActs& a, const Span& s, const QuantWeights& w, bool cold) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return span_rows_vnni<F, ROWS>(a, s, w, cold);
#else
  return span_rows_quant<F, ROWS>(a, s, w, cold);
#endif
}

// The tallest span: groups of kRowsQuant, or on VNNI builds one wide group (kWideRows).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kMaxSpanRows = kWideRows;
#else
constexpr int64_t kMaxSpanRows = kRowsQuant;
#endif

template <int F, int64_t... R>
inline void span_quant_of(const QuantActs& a, const Span& s, const QuantWeights& w,
                          int64_t rows, bool cold, std::integer_sequence<int64_t, R...>) {
  (void)((rows == R + 1 && (span_quant<F, R + 1>(a, s, w, cold), true)) || ...);
}

// A span of `rows` (1 .. kMaxSpanRows) rows, the tile height picked at compile time.
template <int F>
inline void span_quant_rows(const QuantActs& a, const Span& s, const QuantWeights& w,
                            int64_t rows, bool cold = true) {
  span_quant_of<F>(a, s, w, std::clamp<int64_t>(rows, 1, kMaxSpanRows), cold,
                      std::make_integer_sequence<int64_t, kMaxSpanRows>{});
}

#if defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
}  // namespace linserve
#include "gemm_quant_amx.h"  // NOLINT: quant_rows_amx, on the definitions above
namespace linserve {
#endif

template <int F>
inline void quant_rows(const QuantActs& a, const float* x, const QuantWeights& w, float* y,
                       int64_t rows, int64_t k_len, bool accumulate) {
#if defined(__AMX_INT8__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if constexpr (!kTwoF32<F>)  // these run on the VNNI tiles (not measured on AMX)
    if (rows >= kAmxQuantMinRows && amx_active())
      return quant_rows_amx<F>(a, x, w, y, rows, k_len, accumulate);
#endif
  // Threads take a column chunk's row groups in turn (for_spans), so each thread's first
  // group of a chunk reads its weights from memory and later ones find them in L2: only
  // the first `threads` groups prefetch. From L2, or L3, the prefetch cost a many-row tile
  // more than it saved (bench/vnni_tile.cpp: ~75 against ~70 cycles a block).
  const int64_t cold_rows = a.group * at::get_num_threads();
  for_spans(x, y, rows, k_len, w.n, accumulate, a.group, [&](int64_t r, const Span& s) {
    span_quant_rows<F>(a, s, w, r, s.r0 < cold_rows);
  });
}

}  // namespace linserve
