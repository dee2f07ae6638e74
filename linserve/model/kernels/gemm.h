// A batch-invariant GEMM: y [B, N] (+)= x [B, K] @ W [K, N], fp32 activations and
// accumulation, fp32 or bf16 weights stored [in, out] (row-major, contiguous).
//
// Why it exists: oneDNN / MKL pick different kernels, K-blockings and reduction orders for
// different row counts (a GEMV at one row, register tiles of several sizes above), so a
// row's result changes in its last bits with the batch it shares. A sampled token then
// flips when its uniform falls on a CDF boundary, and a seeded request is not reproducible
// under load. Here every output element is ONE fp32 accumulator that starts at zero and
// takes x[b, k] * W[k, n] for k = 0, 1, ..., K-1 in order (one fused multiply-add each
// where the target has FMA), whatever B is, whichever tile the element lands in and however
// many threads run: the row's bits depend on the row alone. The tile shapes below only
// decide which elements are computed together.
//
// Layout of the loops: rows in groups of up to kRows, columns in tiles of kVecs vectors (one
// panel of a packed weight); per tile the accumulators stay in registers over the whole K
// loop, and each weight vector loaded serves every row of the group. The work is split over
// threads by (row group, column chunk). Written with GCC vector extensions so the same source
// compiles to AVX-512, AVX2 or SSE for the -march it gets.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "parallel.h"

namespace linserve {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 6;  // 6 rows x 4 vectors: 24 of 32 zmm registers accumulate
constexpr int64_t kVecs = 4;
#else
constexpr int64_t kLanes = 8;
constexpr int64_t kRows = 6;  // 6 rows x 2 vectors: 12 of 16 ymm registers accumulate
constexpr int64_t kVecs = 2;
#endif

// Unaligned, aliasing vector views of float / bf16 memory. Loads and stores go through
// these types directly: a memcpy into them made GCC 12 split 256-bit loads through the stack
// (10x slower on AVX2).
// Values live in the naturally aligned types; memory is read and written only through the
// ``_u`` types (as Intel's own __m512 / __m512_u).
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vu32 __attribute__((vector_size(kLanes * 4)));
typedef float vfloat_u __attribute__((vector_size(kLanes * 4), aligned(4), __may_alias__));
typedef uint16_t vu16_u __attribute__((vector_size(kLanes * 2), aligned(2), __may_alias__));

// kLanes consecutive weights as fp32 (bf16 widened exactly by a 16-bit shift).
inline vfloat load_w(const float* w) { return *reinterpret_cast<const vfloat_u*>(w); }
inline vfloat load_w(const uint16_t* w) {
  const vu32 bits = __builtin_convertvector(*reinterpret_cast<const vu16_u*>(w), vu32) << 16;
  return reinterpret_cast<const vfloat&>(bits);
}

// ---- Where a weight's columns live -------------------------------------------------------
// A weight is [K', N, J]: K' stored rows, N output columns, J values per (row, column) (J = 1
// for fp32 or bf16 values, J = 2 for the bf16 pairs below, K' = K / 2 then).
// - Row-major (a weight built per call, e.g. attention's keys): column c of row k at
//   base + (k N + c) J.
// - Packed by pack_weight (a model's weights): columns in panels of kPanel, one register
//   tile wide (the last panel narrower), each panel [K', width, J] contiguous. A tile then
//   reads its weights front to back in one stream: on the row-major layout a GEMV jumped a
//   whole weight row (~1 MB on a 250k-vocabulary head) between two tiles' steps, one page and
//   one prefetch stream per step, and read DRAM at ~10 GB/s instead of ~20.
// The layout only changes where values are read from, never the arithmetic.
constexpr int64_t kPanel = kVecs * kLanes;  // columns: 64 on AVX-512, 16 on AVX2

template <typename W>
struct Weights {
  const W* base;
  int64_t rows;  // K'
  int64_t n;
  int64_t j;
  bool panels;
  // Column c's value in stored row 0, and the distance between stored rows, valid for the
  // columns from c to the end of c's panel.
  const W* at(int64_t c, int64_t* ld) const {
    if (!panels) {
      *ld = n * j;
      return base + c * j;
    }
    const int64_t p0 = c / kPanel * kPanel;
    *ld = std::min(kPanel, n - p0) * j;
    return base + p0 * rows * j + (c - p0) * j;
  }
};

// Steps ahead that a tile of several rows prefetches its weights on AVX2 (one line a step:
// a panel's row of fp32 is 64 bytes there). A tile reads one panel, a single stream, and
// with 2-6 rows of FMAs a line it kept too few reads in flight: 4 rows of fp32 weights read
// from memory took 1.42-1.46 times one row, 1.25-1.38 with this; the
// one-row GEMV reads two panels at once instead (gemv_two_panels). Not measured on AVX-512,
// whose tiles read four lines a step, so not done there.
#if defined(__AVX512F__)
constexpr int64_t kTileAhead = 0;
#else
constexpr int64_t kTileAhead = 32;
#endif

// ROWS rows x NV vectors of columns starting at (x, w, y); K sequential steps.
template <int64_t ROWS, int64_t NV, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t k_len, bool accumulate) {
  vfloat acc[ROWS][NV];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) acc[r][j] = vfloat{};
  for (int64_t k = 0; k < k_len; ++k) {
    if constexpr (ROWS > 1 && kTileAhead > 0)
      __builtin_prefetch(w + (k + kTileAhead) * ldw, 0, 3);
    vfloat wv[NV];
    for (int64_t j = 0; j < NV; ++j) wv[j] = load_w(w + k * ldw + j * kLanes);
    for (int64_t r = 0; r < ROWS; ++r) {
      const float xr = x[r * ldx + k];
      for (int64_t j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + xr * wv[j];
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    for (int64_t j = 0; j < NV; ++j) {
      float* out = y + r * ldy + j * kLanes;
      const vfloat v = accumulate ? load_w(out) + acc[r][j] : acc[r][j];
      std::memcpy(out, &v, sizeof(v));  // a store through vfloat_u came out as vmovaps
    }
  }
}

// One unit of work: ROWS rows from row r0 (x, y at that row) and the output columns [c0, c1).
struct Span {
  int64_t r0;
  const float* x;
  float* y;
  int64_t k_len, n, c0, c1;
  bool accumulate;
};

// Columns [c, s.c1) of ROWS rows in tiles of NV vectors; returns where the tiles stopped.
template <int64_t ROWS, int64_t NV, typename W>
inline int64_t columns(const Span& s, const Weights<W>& w, int64_t c) {
  for (; c + NV * kLanes <= s.c1; c += NV * kLanes) {
    int64_t ld;
    const W* wc = w.at(c, &ld);
    tile<ROWS, NV>(s.x, s.k_len, wc, ld, s.y + c, s.n, s.k_len, s.accumulate);
  }
  return c;
}

// The span's last columns [c, c1), fewer than one tile: copied, zero-padded, into one tile's
// width and run through the same tile as every other column. Narrower tiles (one vector, or
// a scalar loop) compiled to other arithmetic for different row counts, so a row's last
// N % (kVecs kLanes) outputs changed with the batch it shared.
template <int64_t ROWS, typename W>
inline void tail_columns(const Span& s, const Weights<W>& w, int64_t c) {
  constexpr int64_t kWidth = kVecs * kLanes;
  const int64_t cols = s.c1 - c;
  int64_t ld;
  const W* wc = w.at(c, &ld);
  std::vector<W> pad(static_cast<size_t>(s.k_len * kWidth), W(0));
  for (int64_t k = 0; k < s.k_len; ++k)
    std::memcpy(pad.data() + k * kWidth, wc + k * ld, static_cast<size_t>(cols) * sizeof(W));
  float out[ROWS * kWidth];
  tile<ROWS, kVecs>(s.x, s.k_len, pad.data(), kWidth, out, kWidth, s.k_len, false);
  for (int64_t r = 0; r < ROWS; ++r) {
    float* y = s.y + r * s.n + c;
    for (int64_t j = 0; j < cols; ++j)
      y[j] = s.accumulate ? y[j] + out[r * kWidth + j] : out[r * kWidth + j];
  }
}

// One row over two adjacent full panels of a packed [K, N, 1] weight: two read streams (see
// gemv_panels below); per element the arithmetic of tile.
template <typename W>
inline void gemv_two_panels(const float* x, int64_t k_len, const W* w0, float* y,
                            bool accumulate) {
  vfloat acc[2 * kVecs];
  for (auto& a : acc) a = vfloat{};
  for (int64_t k = 0; k < k_len; ++k) {
    const float xk = x[k];
    for (int64_t p = 0; p < 2; ++p) {
      const W* wk = w0 + (p * k_len + k) * kPanel;
      for (int64_t j = 0; j < kVecs; ++j)
        acc[p * kVecs + j] = acc[p * kVecs + j] + xk * load_w(wk + j * kLanes);
    }
  }
  for (int64_t j = 0; j < 2 * kVecs; ++j) {
    const vfloat v = accumulate ? load_w(y + j * kLanes) + acc[j] : acc[j];
    std::memcpy(y + j * kLanes, &v, sizeof(v));
  }
}

// The span's columns: wide tiles, then single vectors, then single elements.
template <int64_t ROWS, typename W>
inline void span_rows(const Span& s, const Weights<W>& w) {
  int64_t c = s.c0;
  if (ROWS == 1 && w.panels && w.j == 1) {
    int64_t ld;
    for (; c + 2 * kPanel <= s.c1 && c + 2 * kPanel <= w.n / kPanel * kPanel; c += 2 * kPanel)
      gemv_two_panels(s.x, s.k_len, w.at(c, &ld), s.y + c, s.accumulate);
  }
  c = columns<ROWS, kVecs>(s, w, c);
  if (c < s.c1) tail_columns<ROWS>(s, w, c);
}

// Work split: rows in groups of up to kRows, columns in chunks (a multiple of every tile
// width); a task is one (chunk, group) pair, numbered chunk-major, so the row groups of a
// chunk follow one another while its weights are still in cache (group-major, a batch of 16
// streamed every weight from DRAM three times). Threads take tasks one at a time
// (parallel.h); a single row takes chunks of kChunkOneRow columns, so the last task is
// short. The split decides who computes an element, never how, so results do not depend
// on it.
constexpr int64_t kChunk = 512;
constexpr int64_t kChunkOneRow = 256;

// f(rows_in_group, span) for every (row group, column chunk), in parallel.
template <typename F>
inline void for_spans(const float* x, float* y, int64_t rows, int64_t k_len, int64_t n,
                      bool accumulate, int64_t group_rows, const F& f, int64_t chunk = 0) {
  const int64_t groups = (rows + group_rows - 1) / group_rows;
  if (chunk == 0) chunk = groups == 1 ? kChunkOneRow : kChunk;
  const int64_t chunks = (n + chunk - 1) / chunk;
  for_each_task(groups * chunks, [&](int64_t t) {
    const int64_t g = t % groups, c0 = t / groups * chunk;
    const int64_t r0 = g * group_rows;
    const Span s{r0, x + r0 * k_len, y + r0 * n, k_len, n, c0, std::min(c0 + chunk, n),
                 accumulate};
    f(std::min(group_rows, rows - r0), s);
  });
}

// One weight value as fp32 (bf16 widened exactly, as load_w does).
inline float weight_value(const float* w) { return *w; }
inline float weight_value(const uint16_t* w) {
  const uint32_t bits = static_cast<uint32_t>(*w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// y [B, 1] (+)= x [B, K] @ w [K, 1]: a row sum, or each row's dot with one vector (the norms'
// sums of squares through invariant.sum_last). kLanes rows at a time, one per lane, the
// lane's accumulator taking acc + x_k w_k for k in order: tile's arithmetic for that row, so
// the bits are those of the general path. That path (tail_columns) computed a whole tile of
// columns for the one and copied the weight, zero-padded to that width, for every span of
// rows: 4 ms for 512 rows of 4,096 on two threads.
template <typename W>
inline void gemm_one_column(const float* x, const Weights<W>& w, float* y, int64_t rows,
                            int64_t k_len, bool accumulate) {
  constexpr int64_t kSteps = 64;  // inputs transposed into lanes at a time
  int64_t ld;
  const W* wc = w.at(0, &ld);
  for_each_task((rows + kLanes - 1) / kLanes, [&](int64_t g) {
    const int64_t r0 = g * kLanes, live = std::min(kLanes, rows - r0);
    alignas(64) float xt[kSteps][kLanes];
    vfloat acc{};
    for (int64_t k0 = 0; k0 < k_len; k0 += kSteps) {
      const int64_t steps = std::min(kSteps, k_len - k0);
      for (int64_t r = 0; r < kLanes; ++r)
        for (int64_t k = 0; k < steps; ++k)
          xt[k][r] = r < live ? x[(r0 + r) * k_len + k0 + k] : 0.f;
      for (int64_t k = 0; k < steps; ++k)
        acc = acc + load_w(xt[k]) * weight_value(wc + (k0 + k) * ld);
    }
    for (int64_t r = 0; r < live; ++r) y[r0 + r] = accumulate ? y[r0 + r] + acc[r] : acc[r];
  });
}

template <typename W>
void gemm_rows(const float* x, const Weights<W>& w, float* y, int64_t rows, int64_t k_len,
               int64_t n, bool accumulate) {
  static_assert(kRows == 6, "the switch below covers 1..kRows rows");
#if defined(__AVX512F__)
  // Only where it was checked to give tile's bits: on a Zen 3 (GCC 12, -march=native) the
  // AVX2 build's one-column loop and tile came out with different FMA contractions, and a
  // row's sum differed in its last bits from the same row in a wider product.
  if (n == 1 && w.j == 1) return gemm_one_column(x, w, y, rows, k_len, accumulate);
#endif
  for_spans(x, y, rows, k_len, n, accumulate, kRows, [&](int64_t r, const Span& s) {
    switch (r) {
      case 1: return span_rows<1>(s, w);
      case 2: return span_rows<2>(s, w);
      case 3: return span_rows<3>(s, w);
      case 4: return span_rows<4>(s, w);
      case 5: return span_rows<5>(s, w);
      default: return span_rows<6>(s, w);
    }
  });
}

#if defined(__AVX512BF16__)
// ---- bf16 dot products (AVX512-BF16): weights packed in pairs of input features ----------
// Pairs layout [ceil(K/2), N, 2] bf16: P[k2, n, j] = W[2 k2 + j, n] (a zero pads odd K),
// stored in panels as above. Activations are rounded to bf16 (nearest even) and paired the
// same way; each output element then takes vdpbf16ps over k2 = 0, 1, ... in order: twice the
// products per instruction of fp32 FMAs, still one accumulator per element in a fixed order,
// so still batch-invariant.
constexpr bool kHasBf16Dot = true;

template <int64_t ROWS, int64_t NV>
inline void tile_dp(const uint32_t* xp, int64_t k2_len, const uint16_t* wp, int64_t ld, float* y,
                    int64_t ldy, bool accumulate, __mmask16 tail) {
  __m512 acc[ROWS][NV];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < k2_len; ++k2) {
    __m512i wv[NV];
    const uint16_t* wk = wp + k2 * ld;
    for (int64_t j = 0; j < NV; ++j)
      wv[j] = NV == 1 ? _mm512_maskz_loadu_epi32(tail, wk + j * 32)
                      : _mm512_loadu_si512(wk + j * 32);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[r * k2_len + k2]));
      for (int64_t j = 0; j < NV; ++j)
        acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xb, (__m512bh)wv[j]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) {
    for (int64_t j = 0; j < NV; ++j) {
      float* out = y + r * ldy + j * 16;
      const __mmask16 m = NV == 1 ? tail : static_cast<__mmask16>(0xFFFF);
      __m512 v = acc[r][j];
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
      _mm512_mask_storeu_ps(out, m, v);
    }
  }
}

// One row over P adjacent full panels (64 P columns): P read streams and 4 P accumulator
// chains, so a GEMV keeps more DRAM reads in flight than one tile's stream (batch-1 decode
// of the 0.8B shapes: 26.8 -> 28.8 GB/s with P = 2; 4 and 8 measured no better). Per element
// the arithmetic of tile_dp.
template <int64_t P>
inline void gemv_panels(const uint32_t* xp, int64_t k2_len, const uint16_t* w0, float* y,
                        bool accumulate) {
  __m512 acc[4 * P];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < k2_len; ++k2) {
    const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[k2]));
    for (int64_t p = 0; p < P; ++p) {
      const uint16_t* wk = w0 + (p * k2_len + k2) * 128;  // panel p: [k2_len, 64, 2]
      for (int64_t j = 0; j < 4; ++j)
        acc[4 * p + j] = _mm512_dpbf16_ps(acc[4 * p + j], (__m512bh)xb,
                                          (__m512bh)_mm512_loadu_si512(wk + j * 32));
    }
  }
  for (int64_t j = 0; j < 4 * P; ++j) {
    __m512 v = acc[j];
    if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(y + j * 16), v);
    _mm512_storeu_ps(y + j * 16, v);
  }
}

// The span's columns for ROWS paired rows: tiles of 4 vectors, then single (masked) vectors.
template <int64_t ROWS>
inline void span_rows_dp(const uint32_t* xp, int64_t k2_len, const Weights<uint16_t>& wp,
                         const Span& s) {
  int64_t c = s.c0, ld;
  if (ROWS == 1 && wp.panels) {
    constexpr int64_t kP = 2;
    for (; c + 64 * kP <= s.c1 && c + 64 * kP <= wp.n / kPanel * kPanel; c += 64 * kP)
      gemv_panels<kP>(xp, k2_len, wp.at(c, &ld), s.y + c, s.accumulate);
  }
  for (; c + 64 <= s.c1; c += 64) {
    const uint16_t* wc = wp.at(c, &ld);
    tile_dp<ROWS, 4>(xp, k2_len, wc, ld, s.y + c, s.n, s.accumulate, 0xFFFF);
  }
  for (; c < s.c1; c += 16) {
    const int64_t left = s.c1 - c < 16 ? s.c1 - c : 16;
    const uint16_t* wc = wp.at(c, &ld);
    tile_dp<ROWS, 1>(xp, k2_len, wc, ld, s.y + c, s.n, s.accumulate,
                     static_cast<__mmask16>((1u << left) - 1u));
  }
}

// x [B, K] fp32 rounded to bf16 (nearest even) in pairs [B, ceil(K/2)] (a zero pads odd K).
inline std::vector<uint32_t> pair_rows(const float* x, int64_t rows, int64_t k_len) {
  const int64_t k2_len = (k_len + 1) / 2;
  std::vector<uint32_t> xp(rows * k2_len, 0u);
  auto* xh = reinterpret_cast<at::BFloat16*>(xp.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < k_len; ++k) xh[r * k2_len * 2 + k] = at::BFloat16(x[r * k_len + k]);
  return xp;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
}  // namespace linserve
#include "gemm_amx.h"  // NOLINT: gemm_rows_amx, on the definitions above
namespace linserve {
#else
constexpr bool kHasAmx = false;
inline bool amx_active() { return false; }
#endif

// y [B, N] (+)= bf16(x [B, K]) @ P, P in pairs as above (on AMX tiles where they run).
inline void gemm_rows_dp(const float* x, const Weights<uint16_t>& wp, float* y, int64_t rows,
                         int64_t k_len, int64_t n, bool accumulate) {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  if (amx_active()) return gemm_rows_amx(x, wp, y, rows, k_len, n, accumulate);
#endif
  const int64_t k2_len = (k_len + 1) / 2;
  const std::vector<uint32_t> xp = pair_rows(x, rows, k_len);
  const uint32_t* xs = xp.data();
  for_spans(x, y, rows, k_len, n, accumulate, kRows, [&](int64_t r, const Span& s) {
    const uint32_t* xr = xs + s.r0 * k2_len;  // the paired copy of the span's rows
    switch (r) {
      case 1: return span_rows_dp<1>(xr, k2_len, wp, s);
      case 2: return span_rows_dp<2>(xr, k2_len, wp, s);
      case 3: return span_rows_dp<3>(xr, k2_len, wp, s);
      case 4: return span_rows_dp<4>(xr, k2_len, wp, s);
      case 5: return span_rows_dp<5>(xr, k2_len, wp, s);
      default: return span_rows_dp<6>(xr, k2_len, wp, s);
    }
  });
}
#else
constexpr bool kHasBf16Dot = false;
constexpr bool kHasAmx = false;
inline bool amx_active() { return false; }
#endif

// src [K', N, J] -> the same values with the columns in panels (see Weights): panel by
// panel, each [K', width, J] contiguous.
inline at::Tensor panelize(const at::Tensor& src) {
  const int64_t rows = src.size(0), n = src.size(1), j = src.size(2);
  at::Tensor out = at::empty({rows, n, j}, src.options());
  at::Tensor flat = out.view({-1});
  for (int64_t p0 = 0; p0 < n; p0 += kPanel) {
    const int64_t width = std::min(kPanel, n - p0);
    flat.narrow(0, p0 * rows * j, rows * width * j)
        .view({rows, width, j})
        .copy_(src.narrow(1, p0, width));
  }
  return out;
}

// W [K, N] fp32 or bf16 -> the packed layout the GEMM streams (see Weights): [K, N, 1], or
// [ceil(K/2), N, 2] bf16 pairs where the CPU has the bf16 dot product.
inline at::Tensor pack_weight(const at::Tensor& w) {
  const auto type = w.scalar_type();
  TORCH_CHECK(w.dim() == 2 && (type == at::kBFloat16 || type == at::kFloat),
              "pack_weight takes [K, N] fp32 or bf16");
  const int64_t k_len = w.size(0), n = w.size(1);
  at::Tensor src = w.unsqueeze(2);  // [K', N, J]
  if (kHasBf16Dot && type != at::kFloat) {
    at::Tensor padded = at::zeros({(k_len + 1) / 2 * 2, n}, w.options());
    padded.narrow(0, 0, k_len).copy_(w);
    src = padded.view({-1, 2, n}).permute({0, 2, 1});
  }
  return panelize(src);
}

// int8 / int4 weights (gemm_quant.h, included at the end of this file).
inline void quant_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y, bool accumulate);
inline void mixed_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y, bool accumulate);

// y = a @ w (or y += a @ w with ``accumulate``): a [B, K] fp32 contiguous, y [B, N] fp32
// contiguous, w [K, N] fp32 or bf16 row-major, or [K', N, J] from pack_weight, or an int8 /
// int4 weight from pack_quantized (gemm_quant.h).
inline void invariant_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y,
                         bool accumulate) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "invariant_mm takes fp32 activations");
  TORCH_CHECK(a.is_contiguous() && w.is_contiguous() && y.is_contiguous(),
              "invariant_mm takes contiguous tensors");
  if (w.scalar_type() == at::kChar || w.scalar_type() == at::kByte) {
    TORCH_CHECK(w.dim() == 3 && y.size(0) == a.size(0), "invariant_mm: shapes disagree");
    return quant_mm(a, w, y, accumulate);
  }
  if (w.scalar_type() == at::kShort) return mixed_mm(a, w, y, accumulate);  // gemm_mixed.h
  const bool packed = w.dim() == 3;
  const int64_t j = packed ? w.size(2) : 1;
  TORCH_CHECK(w.dim() == 2 || (packed && (j == 1 || (j == 2 && kHasBf16Dot))),
              "invariant_mm: weights are [K, N], or packed by pack_weight");
  const int64_t w_in = w.size(0) * j;
  TORCH_CHECK((a.size(1) == w_in || (j == 2 && a.size(1) + 1 == w_in)) &&
              y.size(0) == a.size(0) && y.size(1) == w.size(1),
              "invariant_mm: shapes disagree");
  const int64_t rows = a.size(0), k_len = a.size(1), n = w.size(1);
  float* out = y.data_ptr<float>();
  if (w.scalar_type() == at::kBFloat16) {
    const Weights<uint16_t> wv{reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(0), n, j,
                               packed};
#if defined(__AVX512BF16__)
    if (j == 2) return gemm_rows_dp(a.data_ptr<float>(), wv, out, rows, k_len, n, accumulate);
#endif
    gemm_rows(a.data_ptr<float>(), wv, out, rows, k_len, n, accumulate);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "invariant_mm takes fp32 or bf16 weights");
    const Weights<float> wv{w.data_ptr<float>(), w.size(0), n, 1, packed};
    gemm_rows(a.data_ptr<float>(), wv, out, rows, k_len, n, accumulate);
  }
}

}  // namespace linserve

#include "gemm_quant.h"  // NOLINT: defines quant_mm, declared above
#include "gemm_mixed.h"  // NOLINT: defines mixed_mm, declared above
