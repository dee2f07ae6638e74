// AVX512-VNNI: vpdpbusd tiles, 16 columns a vector (one row, many rows, wide groups).
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include "gemm_quant_generic.h"

namespace linserve {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- AVX512-VNNI: vpdpbusd, 16 columns a vector ------------------------------------------
// Block b of the panels that the nv column vectors of col cover (col[0] at a panel's start).
// (The builtin is emitted here, in the one-row tiles; this code is as it was measured.)
inline void prefetch_block(const QCol* col, int64_t nv, int64_t b) {
  for (int64_t j = 0; j < nv; j += 4) {
    const char* p = reinterpret_cast<const char*>(col[j].q + b * col[j].block);
    for (int64_t i = 0; i < col[j].block; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
  }
}

// A block's float step: acc + d_b (s_b s[b, n]) for the block-scaled formats (sc: the
// block's weight scales), then the K formats' + t[b, n] (s_b Σ x_q) (tv: the t's, d0: the
// row's correction, which gives Σ x_q); acc + d_b s_b for int8 (the column scale comes at
// the store).
template <int F>
inline __m512 block_step(__m512 acc, __m512i dot, __m512 sc, float sx, __m512 tv = {},
                         int32_t d0 = 0) {
  const __m512 s = _mm512_set1_ps(sx);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), kScaled<F> ? _mm512_mul_ps(sc, s) : s, acc);
  if constexpr (kMin<F>) acc = _mm512_fmadd_ps(tv, _mm512_set1_ps(sx * min_sum<F>(d0)), acc);
  return acc;
}

// The K formats' multipliers i of block b for 16 columns from col's column + `from`
// (masked by m), widened to fp32.
template <int F>
inline __m512 multipliers_v(const QCol& col, int64_t b, int64_t i, __mmask16 m, int64_t from) {
  const __m128i bytes = _mm_maskz_loadu_epi8(m, multipliers(col, b, i) + from);
  return _mm512_cvtepi32_ps(F == kQ6 ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

// The block-scaled formats' weight scales of block b for 16 columns from col's column +
// `from` (masked by m); 1 for int8.
template <int F>
inline __m512 block_scales(const QCol& col, int64_t b, __mmask16 m, int64_t from = 0,
                           int64_t g = 0) {
  if constexpr (kTwoF32<F>)
    return _mm512_mul_ps(multipliers_v<F>(col, b, g, m, from),
                         _mm512_maskz_loadu_ps(m, super_pair(col, b, 0) + from));
  if constexpr (kScaled<F>)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, group_scales(col, b) + from));
  return _mm512_set1_ps(1.f);
}

// The K formats' t of block b for 16 columns from col's column + `from` (masked by m).
template <int F>
inline __m512 block_mins(const QCol& col, int64_t b, __mmask16 m, int64_t from = 0) {
  if constexpr (kMin<F>)
    return _mm512_mul_ps(multipliers_v<F>(col, b, 1, m, from),
                         _mm512_maskz_loadu_ps(m, super_pair(col, b, 1) + from));
  return _mm512_setzero_ps();
}

// A tile's sums into y [ROWS, ldy] (or added to it), vector j's 16 columns at y + 16 j
// (masked by m); int8 times the column scales, from col_s(j).
template <int F, int64_t ROWS, int64_t NV, typename ColScales>
inline void store_tile(const __m512 (&acc)[ROWS][NV], const ColScales& col_s, float* y,
                       int64_t ldy, bool accumulate, __mmask16 m) {
  for (int64_t j = 0; j < NV; ++j) {
    const __m512 sw = kScaled<F> ? _mm512_set1_ps(1.f) : _mm512_maskz_loadu_ps(m, col_s(j));
    for (int64_t r = 0; r < ROWS; ++r) {
      float* out = y + r * ldy + 16 * j;
      __m512 v = kScaled<F> ? acc[r][j] : _mm512_mul_ps(acc[r][j], sw);
      // The product is rounded before the add, as store_out keeps it: left to itself GCC
      // fused the two into an FMA in some tiles and not others, so a row's bits changed
      // with its batch (Qwen3.5 int8: project_add; tests/model/test_families.py).
      asm("" : "+v"(v));
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
      _mm512_mask_storeu_ps(out, m, v);
    }
  }
}

// One row (the GEMV) x NV vectors of 16 columns from c (the last vector's columns masked by m).
template <int F, int64_t NV>
inline void tile_vnni_row(const QuantActs& a, const Span& s, const QuantWeights& w, int64_t c,
                          __mmask16 m) {
  QCol col[NV];
  for (int64_t j = 0; j < NV; ++j) col[j] = column(w, c + 16 * j);
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[1][NV];
  for (auto& v : acc[0]) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    if constexpr (NV >= 4) prefetch_block(col, NV, b + kQuantPrefetch);
    const int32_t* xq = reinterpret_cast<const int32_t*>(a.block(s.r0, b));
    const int32_t d0 = a.d0(s.r0, b);
    for (int64_t g = 0; g < kHalves<F>; ++g) {  // the block, or kQ6's two halves in turn
      __m512i dot[NV];
      for (int64_t j = 0; j < NV; ++j)
        dot[j] = _mm512_set1_epi32(half_start<F>(d0, a.d0_lo(s.r0, b), g));
      for (int64_t t = g * kHalfSteps<F>; t < (g + 1) * kHalfSteps<F>; ++t) {
        for (int64_t j = 0; j < NV; ++j) {
          const uint8_t* p = col[j].q + b * col[j].block + t * col[j].ld;
          const __m512i v = NV > 1 || m == 0xFFFF ? _mm512_loadu_si512(p)
                                                   : _mm512_maskz_loadu_epi32(m, p);
          if (kNib<F>) {
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            dot[j] = _mm512_dpbusd_epi32(dot[j], lo, _mm512_set1_epi32(xq[2 * t]));
            dot[j] = _mm512_dpbusd_epi32(dot[j], hi, _mm512_set1_epi32(xq[2 * t + 1]));
          } else {
            dot[j] = _mm512_dpbusd_epi32(dot[j], v, _mm512_set1_epi32(xq[t]));
          }
        }
      }
      for (int64_t j = 0; j < NV; ++j)
        acc[0][j] = block_step<F>(acc[0][j], dot[j], block_scales<F>(col[j], b, m, 0, g),
                                  a.s(s.r0, b), block_mins<F>(col[j], b, m), d0);
    }
  }
  store_tile<F, 1, NV>(acc, [&](int64_t j) { return static_cast<const float*>(col[j].s); },
                          s.y + c, 0, s.accumulate, m);
}

// base[OFF] in every lane, by one vpbroadcastd from base + 4 OFF where it is used. With
// _mm512_set1_epi32(base[i]) GCC 12 hoisted a record's 48 inputs into general registers
// and spilled them to the stack, and with a memory operand it did the same with their
// addresses; a constant offset from one register leaves it nothing to hoist.
template <int64_t OFF>
inline __m512i broadcast_at(const int32_t* base) {
  __m512i v;
  asm volatile("vpbroadcastd %c2(%1), %0" : "=v"(v) : "r"(base), "i"(OFF * 4), "m"(*base));
  return v;
}

// The many-row tiles read their rows from packed records (pack_group). A tile that took
// each of its 6 rows, and each of its 2 weight vectors, through its own pointers and run-time
// strides ran out of general registers: the compiler moved them through vector registers
// (vmovq) and took ~100 cycles a block where its vector work needs ~60. One pointer now
// serves every row of a record at constant offsets, and one the tile's weight vectors, which
// share a panel (bench/vnni_tile.cpp: ~100 -> ~61 cycles a block, one thread). The values
// are the same, and so the bits.
// ROWS rows (packed records from rec) x NV vectors of 16 columns from col's column (NV == 1:
// masked by m), into y [ROWS, ldy] at that column. The arithmetic of tile_vnni_row.
template <int F, int64_t ROWS, int64_t NV>
inline void tile_vnni_rows(const uint8_t* rec, int64_t blocks, const QCol& col, float* y,
                           int64_t ldy, bool accumulate, __mmask16 m, bool prefetch) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[ROWS][NV];
  for (auto& row : acc) for (auto& v : row) v = _mm512_setzero_ps();
  const uint8_t* q = col.q;
  for (int64_t b = 0; b < blocks; ++b, q += col.block, rec += record_bytes(ROWS)) {
    if (prefetch) prefetch_tile<F>(col, 16 * NV, b + kTilePrefetch * 2 / NV);
    const int32_t* xq = reinterpret_cast<const int32_t*>(rec);  // [ROWS][8] of 4 inputs
    const float* sx = reinterpret_cast<const float*>(rec + ROWS * kBlock);
    const int32_t* d0 = reinterpret_cast<const int32_t*>(rec + ROWS * (kBlock + 4));
    const int32_t* d0_lo = reinterpret_cast<const int32_t*>(rec + ROWS * (kBlock + 8));
#pragma GCC unroll 4
    for (int64_t j = 0; j < NV; ++j) {  // a vector at a time: ROWS dots live, not ROWS x NV
      unrolled<kHalves<F>>([&](auto g) {  // the block, or kQ6's two halves in turn
        __m512i dot[ROWS];
        for (int64_t r = 0; r < ROWS; ++r)
          dot[r] = _mm512_set1_epi32(half_start<F>(d0[r], d0_lo[r], g));
        unrolled<kHalfSteps<F>>([&](auto tt) {
          constexpr int64_t t = g * kHalfSteps<F> + tt;
          const uint8_t* p = q + t * col.ld + 64 * j;  // a tile's vectors share one panel
          const __m512i v = NV > 1 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi32(m, p);
          if constexpr (kNib<F>) {
            const __m512i lo = _mm512_and_si512(v, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            unrolled<ROWS>([&](auto r) {
              dot[r] = _mm512_dpbusd_epi32(dot[r], lo, broadcast_at<8 * r + 2 * t>(xq));
              dot[r] = _mm512_dpbusd_epi32(dot[r], hi, broadcast_at<8 * r + 2 * t + 1>(xq));
            });
          } else {
            unrolled<ROWS>([&](auto r) {
              dot[r] = _mm512_dpbusd_epi32(dot[r], v, broadcast_at<8 * r + t>(xq));
            });
          }
        });
        const __m512 sc = block_scales<F>(col, b, m, 16 * j, g);
        const __m512 tv = block_mins<F>(col, b, m, 16 * j);
        for (int64_t r = 0; r < ROWS; ++r)
          acc[r][j] = block_step<F>(acc[r][j], dot[r], sc, sx[r], tv, d0[r]);
      });
    }
  }
  store_tile<F, ROWS, NV>(
      acc, [&](int64_t j) { return static_cast<const float*>(col.s) + 16 * j; }, y, ldy,
      accumulate, m);
}

// A wide group's tile (kRowsQuant < ROWS <= kWideRows): ROWS rows x one vector of 16
// columns (masked by m), each block's weights read from memory once. Past kOnePassRows rows
// the rows take a block in two halves (the second half's loads hit L1), so that the live
// dots and the ROWS sums fit the 32 vector registers. The arithmetic of tile_vnni_rows,
// element by element, so the bits are the same.
constexpr int64_t kOnePassRows = 10;
template <int F, int64_t ROWS>
inline void tile_vnni_wide(const uint8_t* rec, int64_t blocks, const QCol& col, float* y,
                           int64_t ldy, bool accumulate, __mmask16 m, bool prefetch) {
  constexpr int64_t kHalf = ROWS > kOnePassRows ? (ROWS + 1) / 2 : ROWS;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[ROWS][1];
  for (auto& row : acc) row[0] = _mm512_setzero_ps();
  const uint8_t* q = col.q;
  for (int64_t b = 0; b < blocks; ++b, q += col.block, rec += record_bytes(ROWS)) {
    if (prefetch) prefetch_tile<F>(col, 16, b + kTilePrefetch);
    const int32_t* xq = reinterpret_cast<const int32_t*>(rec);  // [ROWS][8] of 4 inputs
    const float* sx = reinterpret_cast<const float*>(rec + ROWS * kBlock);
    const int32_t* d0 = reinterpret_cast<const int32_t*>(rec + ROWS * (kBlock + 4));
    const int32_t* d0_lo = reinterpret_cast<const int32_t*>(rec + ROWS * (kBlock + 8));
    const __m512 tv = block_mins<F>(col, b, m);
    unrolled<(ROWS > kOnePassRows ? 2 : 1) * kHalves<F>>([&](auto hg) {
      // rows' half h (past kOnePassRows), and the block or kQ6's half g of it, in turn
      constexpr int64_t h = hg / kHalves<F>, g = hg % kHalves<F>;
      constexpr int64_t r0 = h * kHalf, rows = h == 0 ? kHalf : ROWS - kHalf;
      const __m512 sc = block_scales<F>(col, b, m, 0, g);
      __m512i dot[rows];
      for (int64_t r = 0; r < rows; ++r)
        dot[r] = _mm512_set1_epi32(half_start<F>(d0[r0 + r], d0_lo[r0 + r], g));
      unrolled<kHalfSteps<F>>([&](auto tt) {
        constexpr int64_t t = g * kHalfSteps<F> + tt;
        const __m512i v = _mm512_maskz_loadu_epi32(m, q + t * col.ld);
        if constexpr (kNib<F>) {
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          unrolled<rows>([&](auto r) {
            dot[r] = _mm512_dpbusd_epi32(dot[r], lo, broadcast_at<8 * (r0 + r) + 2 * t>(xq));
            dot[r] = _mm512_dpbusd_epi32(dot[r], hi, broadcast_at<8 * (r0 + r) + 2 * t + 1>(xq));
          });
        } else {
          unrolled<rows>([&](auto r) {
            dot[r] = _mm512_dpbusd_epi32(dot[r], v, broadcast_at<8 * (r0 + r) + t>(xq));
          });
        }
      });
      for (int64_t r = 0; r < rows; ++r)
        acc[r0 + r][0] = block_step<F>(acc[r0 + r][0], dot[r], sc, sx[r0 + r], tv, d0[r0 + r]);
    });
  }
  store_tile<F, ROWS, 1>(acc, [&](int64_t) { return static_cast<const float*>(col.s); }, y,
                            ldy, accumulate, m);
}

// The span's columns: tiles of whole vectors (one row: 8, two panels' read streams; int4 at
// 4, one stream, read 5% slower at batch 1; 2 to 6 rows: 4, a whole panel, so each block's
// bytes are read front to back (with 2, half of each stored row's 256 bytes, in two passes
// over the panel: a 4-row int8 product of memory-bound weights took 1.34 of a row's time,
// now 1.11), from packed records; more, up to kWideRows: tile_vnni_wide's one vector), then
// one masked vector at a time. `cold`: the span's weights are likely not yet in this core's
// caches (see quant_rows), so its many-row tiles prefetch them.
template <int F, int64_t ROWS>
inline void span_rows_vnni(const QuantActs& a, const Span& s, const QuantWeights& w, bool cold) {
  int64_t c = s.c0;
  if constexpr (ROWS == 1) {
    for (; c + 16 * 8 <= s.c1; c += 16 * 8) tile_vnni_row<F, 8>(a, s, w, c, 0xFFFF);
    for (; c < s.c1; c += 16) {
      const int64_t left = std::min<int64_t>(16, s.c1 - c);
      tile_vnni_row<F, 1>(a, s, w, c, static_cast<__mmask16>((1u << left) - 1u));
    }
  } else {
    const uint8_t* rec = a.records(s.r0);
    if constexpr (ROWS > kRowsQuant) {
      for (; c < s.c1; c += 16) {
        const int64_t left = std::min<int64_t>(16, s.c1 - c);
        tile_vnni_wide<F, ROWS>(rec, a.blocks, column(w, c), s.y + c, s.n, s.accumulate,
                                   static_cast<__mmask16>((1u << left) - 1u), cold);
      }
      return;
    }
    for (; c + kPanel <= s.c1 && c % kPanel == 0; c += kPanel)  // a whole panel: 4 vectors
      tile_vnni_rows<F, ROWS, kPanel / 16>(rec, a.blocks, column(w, c), s.y + c, s.n,
                                              s.accumulate, 0xFFFF, cold);
    for (; c + 32 <= s.c1; c += 32)
      tile_vnni_rows<F, ROWS, 2>(rec, a.blocks, column(w, c), s.y + c, s.n, s.accumulate,
                                    0xFFFF, cold);
    for (; c < s.c1; c += 16) {
      const int64_t left = std::min<int64_t>(16, s.c1 - c);
      tile_vnni_rows<F, ROWS, 1>(rec, a.blocks, column(w, c), s.y + c, s.n, s.accumulate,
                                    static_cast<__mmask16>((1u << left) - 1u), cold);
    }
  }
}
#endif

}  // namespace linserve
