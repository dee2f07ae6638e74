// Weight-only int8 and int4 GEMMs: y [B, N] (+)= x [B, K] @ dequant(Q), fp32 activations
// and accumulation, weights stored as small integers with scales (``--quantization``).
//
// Formats (built by pack_quantized, which model/quantize.py calls; q from there):
// - int8 (a kChar tensor): q [K, N] in [-127, 127] with one fp32 scale per output column,
//   W[k, n] = q[k, n] s[n]. Stored as gemm.h's panel layout [K', N, J] of q (bf16-style pairs,
//   J = 2, where the CPU has the bf16 dot product), then the N scales' bytes:
//   shape [K' + 4 / J, N, J].
// - int4 (a kByte tensor): q [K, N] in [-8, 7] with an fp16 scale per group of G input
//   features and column, W[k, n] = q[k, n] s[k / G, n] (llama.cpp's Q4_0 without its blocks).
//   Stored as the same panel layout of q + 8 with two stored rows per byte (row 2i in the
//   low nibble, 2i + 1 in the high; with J = 2, four rows per 16-bit word of each column and
//   parity instead, see q4_quad_bf16), then the scales [K / G, N] fp16:
//   shape [K' / 2 + 2 (K / G) / J, N, J]. G is read back from the shape.
//
// Arithmetic, for every element whatever the batch (so still batch-invariant, gemm.h):
// - int8: a = Σ_k x[k] q[k, n] in order, one accumulator; y = a s[n].
// - int4: per group g in order, a_g = Σ_{k in g} x[k] q[k, n] (from zero); f = f + a_g s[g, n].
// Where the CPU has AVX512-BF16, the integers are widened to bf16 (exact: |q| ≤ 127) and the
// activations rounded to bf16, and the sums are vdpbf16ps pairs, as for bf16 weights; the
// dequantisation work is then shared by every row of a tile.
#pragma once

#include "gemm.h"

namespace linserve {

typedef int8_t v8_u __attribute__((vector_size(kLanes), aligned(1), __may_alias__));
typedef uint8_t vu8_u __attribute__((vector_size(kLanes), aligned(1), __may_alias__));
typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));

// Where a quantized weight's parts live, read from its shape and the activations' K.
struct QuantWeights {
  Weights<uint8_t> q;   // the integer panels (rows: stored byte rows)
  const void* scales;   // fp32 [N] (int8) or fp16 [K / G, N] (int4)
  int64_t group;        // G (int4), else K
  bool int4;
};

// int8 values as fp32, kLanes columns.
inline vfloat load_q8(const uint8_t* w) {
  return __builtin_convertvector(*reinterpret_cast<const v8_u*>(w), vfloat);
}

// The int4 values of two stored rows as fp32 (q + 8 in each nibble).
inline void load_q4(const uint8_t* w, vfloat* lo, vfloat* hi) {
  const vi32 v = __builtin_convertvector(*reinterpret_cast<const vu8_u*>(w), vi32);
  *lo = __builtin_convertvector(v & 15, vfloat) - 8.f;
  *hi = __builtin_convertvector(v >> 4, vfloat) - 8.f;
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// kLanes scales of group g from column c (fp32 for int8, fp16 widened for int4).
inline vfloat load_scales(const QuantWeights& w, int64_t g, int64_t c) {
  if (!w.int4) return load_w(static_cast<const float*>(w.scales) + c);
  const uint16_t* s = static_cast<const uint16_t*>(w.scales) + g * w.q.n + c;
  vfloat out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = half_to_float(s[i]);
  return out;
}

inline void store_out(float* out, vfloat v, bool accumulate) {
  if (accumulate) v = load_w(out) + v;
  std::memcpy(out, &v, sizeof(v));
}

// ---- The generic path (any -march; J = 1): rows x NV vectors from column c -----------------
template <int64_t ROWS, int64_t NV>
inline void tile_q8(const Span& s, const QuantWeights& w, int64_t c) {
  int64_t ld;
  const uint8_t* wc = w.q.at(c, &ld);
  vfloat acc[ROWS][NV] = {};
  for (int64_t k = 0; k < s.k_len; ++k) {
    vfloat wv[NV];
    for (int64_t j = 0; j < NV; ++j) wv[j] = load_q8(wc + k * ld + j * kLanes);
    for (int64_t r = 0; r < ROWS; ++r) {
      const float xr = s.x[r * s.k_len + k];
      for (int64_t j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + xr * wv[j];
    }
  }
  for (int64_t j = 0; j < NV; ++j) {
    const vfloat sc = load_scales(w, 0, c + j * kLanes);
    for (int64_t r = 0; r < ROWS; ++r)
      store_out(s.y + r * s.n + c + j * kLanes, acc[r][j] * sc, s.accumulate);
  }
}

template <int64_t ROWS, int64_t NV>
inline void tile_q4(const Span& s, const QuantWeights& w, int64_t c) {
  int64_t ld;
  const uint8_t* wc = w.q.at(c, &ld);
  vfloat out[ROWS][NV] = {};
  for (int64_t g = 0; g * w.group < s.k_len; ++g) {
    vfloat acc[ROWS][NV] = {};
    for (int64_t k = g * w.group; k < (g + 1) * w.group; k += 2) {
      vfloat lo[NV], hi[NV];
      for (int64_t j = 0; j < NV; ++j) load_q4(wc + k / 2 * ld + j * kLanes, &lo[j], &hi[j]);
      for (int64_t r = 0; r < ROWS; ++r) {
        const float x0 = s.x[r * s.k_len + k], x1 = s.x[r * s.k_len + k + 1];
        for (int64_t j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + x0 * lo[j];
        for (int64_t j = 0; j < NV; ++j) acc[r][j] = acc[r][j] + x1 * hi[j];
      }
    }
    for (int64_t j = 0; j < NV; ++j) {
      const vfloat sc = load_scales(w, g, c + j * kLanes);
      for (int64_t r = 0; r < ROWS; ++r) out[r][j] = out[r][j] + acc[r][j] * sc;
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) store_out(s.y + r * s.n + c + j * kLanes, out[r][j], s.accumulate);
}

// The last N % kLanes columns, one element at a time, with the same arithmetic.
inline void scalar_quant_columns(const Span& s, const QuantWeights& w, int64_t rows, int64_t c) {
  int64_t ld;
  const uint8_t* wc = w.q.at(c, &ld);
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = s.x + r * s.k_len;
    for (int64_t cc = 0; cc < s.c1 - c; ++cc) {
      float out = 0.f;
      for (int64_t g = 0; g * w.group < s.k_len; ++g) {
        float acc = 0.f;
        for (int64_t k = g * w.group; k < std::min((g + 1) * w.group, s.k_len); ++k) {
          const int q = w.int4 ? ((wc[k / 2 * ld + cc] >> (4 * (k & 1))) & 15) - 8
                               : static_cast<int8_t>(wc[k * ld + cc]);
          acc = acc + x[k] * static_cast<float>(q);
        }
        const float sc = w.int4
            ? half_to_float(static_cast<const uint16_t*>(w.scales)[g * w.q.n + c + cc])
            : static_cast<const float*>(w.scales)[c + cc];
        out = w.int4 ? out + acc * sc : acc * sc;
      }
      float* y = s.y + r * s.n + c + cc;
      *y = s.accumulate ? *y + out : out;
    }
  }
}

// Tiles as wide as the registers allow: int4 keeps two sums an element (group and total).
template <int64_t ROWS>
inline void span_rows_quant(const Span& s, const QuantWeights& w) {
  constexpr int64_t kWide4 = ROWS == 1 ? kVecs : kVecs / 2;
  int64_t c = s.c0;
  if (w.int4) {
    for (; c + kWide4 * kLanes <= s.c1; c += kWide4 * kLanes) tile_q4<ROWS, kWide4>(s, w, c);
  } else {
    for (; c + kVecs * kLanes <= s.c1; c += kVecs * kLanes) tile_q8<ROWS, kVecs>(s, w, c);
  }
  for (; c + kLanes <= s.c1; c += kLanes)
    w.int4 ? tile_q4<ROWS, 1>(s, w, c) : tile_q8<ROWS, 1>(s, w, c);
  if (c < s.c1) scalar_quant_columns(s, w, ROWS, c);
}

constexpr int64_t kRowsQuant = 6;

inline void quant_rows(const float* x, const QuantWeights& w, float* y, int64_t rows,
                       int64_t k_len, int64_t n, bool accumulate) {
  for_spans(x, y, rows, k_len, n, accumulate, kRowsQuant, [&](int64_t r, const Span& s) {
    switch (r) {
      case 1: return span_rows_quant<1>(s, w);
      case 2: return span_rows_quant<2>(s, w);
      case 3: return span_rows_quant<3>(s, w);
      case 4: return span_rows_quant<4>(s, w);
      case 5: return span_rows_quant<5>(s, w);
      default: return span_rows_quant<6>(s, w);
    }
  });
}

#if defined(__AVX512BF16__)
// ---- The bf16 dot-product path (J = 2 pairs): 16 columns a vector --------------------------
// ``m`` masks the columns of a last, narrower vector (loads and stores stay inside N).
inline __m256i load_bytes(const uint8_t* w, __mmask16 m) {
  const __mmask32 bm = _pdep_u32(m, 0x55555555u) | (_pdep_u32(m, 0x55555555u) << 1);
  return m == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))
                     : _mm256_maskz_loadu_epi8(bm, w);
}

// 16 columns x one pair of int8 weights (32 bytes) as 32 exact bf16 values.
inline __m512bh q8_pairs_bf16(const uint8_t* w, __mmask16 m) {
  const __m256i b = load_bytes(w, m);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// 16 columns x four pairs of int4 weights (64 bytes: a 16-bit word per column and parity,
// its four nibbles four consecutive pairs) as four vectors of bf16 pairs: a table lookup of
// q + 8 -> bf16(q). vpermw reads an index's low five bits, so each nibble needs only a shift
// (the bit above it picks the table's second, identical half).
inline void q4_quad_bf16(const uint8_t* w, __mmask16 m, __m512i table, __m512bh* q) {
  const __mmask32 wm = _pdep_u32(m, 0x55555555u) | (_pdep_u32(m, 0x55555555u) << 1);
  const __m512i v = m == 0xFFFF ? _mm512_loadu_si512(w) : _mm512_maskz_loadu_epi16(wm, w);
  q[0] = (__m512bh)_mm512_permutexvar_epi16(v, table);
  q[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
  q[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
  q[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
}

inline __m512i q4_table() {
  alignas(64) uint16_t t[32] = {};
  for (int i = 0; i < 32; ++i) t[i] = c10::BFloat16(static_cast<float>((i & 15) - 8)).x;
  return _mm512_load_si512(t);
}

inline __m512 load_scales16(const QuantWeights& w, int64_t g, int64_t c, __mmask16 m) {
  if (!w.int4) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(w.scales) + c);
  const uint16_t* s = static_cast<const uint16_t*>(w.scales) + g * w.q.n + c;
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, s));
}

inline void store16(float* out, __m512 v, bool accumulate, __mmask16 m) {
  if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
  _mm512_mask_storeu_ps(out, m, v);
}

// Where each of NV vectors of 16 columns from c starts, and the row stride of c's panel.
// (Two panels at once, as gemm.h's gemv_panels, measured no faster here: the GEMV is bound
// by the widening of the integers, not by the read streams.)
template <int64_t NV>
inline void vectors(const QuantWeights& w, int64_t c, const uint8_t** out, int64_t* ld) {
  for (int64_t j = 0; j < NV; ++j) out[j] = w.q.at(c + 16 * j, ld);
}

inline __m512bh pair_of(const uint32_t* xp, int64_t i) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[i]));
}

// ROWS paired rows x NV vectors of columns from c (the last one masked by m).
template <int64_t ROWS, int64_t NV>
inline void tile_q8_dp(const uint32_t* xp, int64_t k2_len, const Span& s, const QuantWeights& w,
                       int64_t c, __mmask16 m) {
  int64_t ld;
  const uint8_t* wc[NV];
  vectors<NV>(w, c, wc, &ld);
  __m512 acc[ROWS][NV];
  for (auto& row : acc) for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < k2_len; ++k2) {
    __m512bh wv[NV];
    for (int64_t j = 0; j < NV; ++j) wv[j] = q8_pairs_bf16(wc[j] + k2 * ld, m);
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512bh xb = pair_of(xp, r * k2_len + k2);
      for (int64_t j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
    }
  }
  for (int64_t j = 0; j < NV; ++j) {
    const __m512 sc = load_scales16(w, 0, c + 16 * j, m);
    for (int64_t r = 0; r < ROWS; ++r)
      store16(s.y + r * s.n + c + 16 * j, _mm512_mul_ps(acc[r][j], sc), s.accumulate, m);
  }
}

template <int64_t ROWS, int64_t NV>
inline void tile_q4_dp(const uint32_t* xp, int64_t k2_len, const Span& s, const QuantWeights& w,
                       int64_t c, __mmask16 m, __m512i table) {
  int64_t ld;
  const int64_t p0 = c / kPanel * kPanel;
  const uint8_t* panel = w.q.at(p0, &ld);
  const uint8_t* wc[NV];  // vector j's words in the first quad of pairs (rows: 2 ld bytes)
  for (int64_t j = 0; j < NV; ++j) wc[j] = panel + (c + 16 * j - p0) * 4;
  const int64_t g2 = w.group / 2;  // pairs a group
  __m512 out[ROWS][NV];
  for (auto& row : out) for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t k0 = 0, g = 0; k0 < k2_len; k0 += g2, ++g) {
    __m512 acc[ROWS][NV];
    for (auto& row : acc) for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t k2 = k0; k2 < k0 + g2; k2 += 4) {
      __m512bh q[NV][4];
      for (int64_t j = 0; j < NV; ++j) q4_quad_bf16(wc[j] + k2 / 2 * ld, m, table, q[j]);
      for (int64_t r = 0; r < ROWS; ++r) {
        for (int64_t t = 0; t < 4; ++t) {
          const __m512bh xt = pair_of(xp, r * k2_len + k2 + t);
          for (int64_t j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xt, q[j][t]);
        }
      }
    }
    for (int64_t j = 0; j < NV; ++j) {
      const __m512 sc = load_scales16(w, g, c + 16 * j, m);
      for (int64_t r = 0; r < ROWS; ++r) out[r][j] = _mm512_fmadd_ps(acc[r][j], sc, out[r][j]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j)
      store16(s.y + r * s.n + c + 16 * j, out[r][j], s.accumulate, m);
}

// The span's columns: tiles of whole vectors, then one masked vector.
template <int64_t ROWS>
inline void span_rows_quant_dp(const uint32_t* xp, int64_t k2_len, const Span& s,
                               const QuantWeights& w, __m512i table) {
  constexpr int64_t kWide4 = ROWS == 1 ? 4 : 2;
  int64_t c = s.c0;
  if (w.int4) {
    for (; c + 16 * kWide4 <= s.c1; c += 16 * kWide4)
      tile_q4_dp<ROWS, kWide4>(xp, k2_len, s, w, c, 0xFFFF, table);
  } else {
    for (; c + 64 <= s.c1; c += 64) tile_q8_dp<ROWS, 4>(xp, k2_len, s, w, c, 0xFFFF);
  }
  for (; c < s.c1; c += 16) {
    const int64_t left = std::min<int64_t>(16, s.c1 - c);
    const auto m = static_cast<__mmask16>((1u << left) - 1u);
    w.int4 ? tile_q4_dp<ROWS, 1>(xp, k2_len, s, w, c, m, table)
           : tile_q8_dp<ROWS, 1>(xp, k2_len, s, w, c, m);
  }
}

inline void quant_rows_dp(const float* x, const QuantWeights& w, float* y, int64_t rows,
                          int64_t k_len, int64_t n, bool accumulate) {
  const int64_t k2_len = (k_len + 1) / 2;
  const std::vector<uint32_t> xp = pair_rows(x, rows, k_len);
  const uint32_t* xs = xp.data();
  const __m512i table = q4_table();
  for_spans(x, y, rows, k_len, n, accumulate, kRowsQuant, [&](int64_t r, const Span& s) {
    const uint32_t* xr = xs + s.r0 * k2_len;
    switch (r) {
      case 1: return span_rows_quant_dp<1>(xr, k2_len, s, w, table);
      case 2: return span_rows_quant_dp<2>(xr, k2_len, s, w, table);
      case 3: return span_rows_quant_dp<3>(xr, k2_len, s, w, table);
      case 4: return span_rows_quant_dp<4>(xr, k2_len, s, w, table);
      case 5: return span_rows_quant_dp<5>(xr, k2_len, s, w, table);
      default: return span_rows_quant_dp<6>(xr, k2_len, s, w, table);
    }
  });
}
#endif

// y = a @ dequant(w) (or y +=): a [B, K] fp32, y [B, N] fp32, w from pack_quantized.
inline void quant_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y, bool accumulate) {
  const int64_t rows = a.size(0), k_len = a.size(1), n = w.size(1), j = w.size(2);
  const bool int4 = w.scalar_type() == at::kByte;
  const int64_t k_rows = (k_len + j - 1) / j;         // K'
  const int64_t data_rows = int4 ? k_rows / 2 : k_rows;
  const int64_t scale_rows = w.size(0) - data_rows;  // 4 / J (int8), 2 (K / G) / J (int4)
  TORCH_CHECK(scale_rows > 0 && (j == 1 || (j == 2 && kHasBf16Dot)) && y.size(1) == n,
              "quant_mm: the weight does not match the activations");
  const int64_t groups = int4 ? scale_rows * j / 2 : 1;
  TORCH_CHECK(!int4 || (k_len % groups == 0 && (k_len / groups) % (j == 2 ? 8 : 2) == 0),
              "quant_mm: int4 groups must divide K");
  const auto* base = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const QuantWeights qw{{base, data_rows, n, j, true}, base + data_rows * n * j,
                        int4 ? k_len / groups : k_len, int4};
  float* out = y.data_ptr<float>();
#if defined(__AVX512BF16__)
  if (j == 2) return quant_rows_dp(a.data_ptr<float>(), qw, out, rows, k_len, n, accumulate);
#endif
  quant_rows(a.data_ptr<float>(), qw, out, rows, k_len, n, accumulate);
}

// q [K, N] int8 (int8: [-127, 127]; int4: [-8, 7]) and its scales (fp32 [N], or fp16
// [K / G, N]) -> the stored formats above.
inline at::Tensor pack_quantized(const at::Tensor& q, const at::Tensor& scales, bool int4) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_quantized takes q [K, N] int8");
  TORCH_CHECK(int4 ? scales.scalar_type() == at::kHalf && scales.dim() == 2
                   : scales.scalar_type() == at::kFloat && scales.dim() == 1,
              "pack_quantized: int8 scales are fp32 [N], int4 scales fp16 [K / G, N]");
  at::Tensor panels = pack_weight(int4 ? q.add(8) : q);  // [K', N, J]
  const int64_t k_rows = panels.size(0), n = panels.size(1), j = panels.size(2);
  if (int4) {
    // panel by panel, J = 1: stored rows 2i, 2i+1 in one byte (low, high nibble); J = 2: rows
    // 4i .. 4i+3 in one 16-bit word per column and parity (see q4_quad_bf16)
    const int64_t per = j == 2 ? 4 : 2;
    TORCH_CHECK(k_rows % per == 0, "pack_quantized: int4 needs whole groups of stored rows");
    at::Tensor bytes = at::empty({k_rows / 2 * n * j}, q.options().dtype(at::kByte));
    for (int64_t p0 = 0; p0 < n; p0 += kPanel) {
      const int64_t width = std::min(kPanel, n - p0);
      const at::Tensor p = panels.view({-1}).narrow(0, p0 * k_rows * j, k_rows * width * j)
                               .view({k_rows / per, per, width * j}).to(at::kInt);
      at::Tensor packed = p.select(1, 0);
      for (int64_t t = 1; t < per; ++t)
        packed = packed.bitwise_or(p.select(1, t).bitwise_left_shift(4 * t));
      const at::Tensor out = per == 4 ? packed.to(at::kShort).view(at::kByte) : packed.to(at::kByte);
      bytes.narrow(0, p0 * k_rows / 2 * j, k_rows / 2 * width * j).copy_(out.reshape({-1}));
    }
    panels = bytes;
  }
  const at::Tensor sbytes = scales.contiguous().view({-1}).view(at::kByte);
  at::Tensor flat = at::cat({panels.view({-1}).view(at::kByte), sbytes});
  TORCH_CHECK(flat.numel() % (n * j) == 0, "pack_quantized: scales do not fill whole rows");
  flat = flat.view({-1, n, j});
  return int4 ? flat : flat.view(at::kChar);
}

}  // namespace linserve
