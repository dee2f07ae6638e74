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
// Layout of the loops: rows in blocks of kRows (parallel over blocks), columns in tiles of
// kVecs vectors; per tile the accumulators stay in registers over the whole K loop, and each
// weight vector loaded is used by kRows rows. Rows left over run one at a time in wider tiles. Written with GCC vector
// extensions so the same source compiles to AVX-512, AVX2 or SSE for the -march it gets.
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
inline float load_w1(const float* w) { return *w; }
inline float load_w1(const uint16_t* w) {
  const uint32_t bits = static_cast<uint32_t>(*w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// ROWS rows x NV vectors of columns starting at (x, w, y); K sequential steps.
template <int64_t ROWS, int64_t NV, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy,
                 int64_t k_len, bool accumulate) {
  vfloat acc[ROWS][NV];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) acc[r][j] = vfloat{};
  for (int64_t k = 0; k < k_len; ++k) {
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

// The last N % kLanes columns, one element at a time, with the same arithmetic.
template <typename W>
inline void scalar_columns(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y,
                           int64_t ldy, int64_t rows, int64_t cols, int64_t k_len,
                           bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < k_len; ++k) acc = acc + x[r * ldx + k] * load_w1(w + k * ldw + c);
      y[r * ldy + c] = accumulate ? y[r * ldy + c] + acc : acc;
    }
  }
}

// Columns [c, n) of ROWS rows in tiles of NV vectors; returns where the tiles stopped.
template <int64_t ROWS, int64_t NV, typename W>
inline int64_t columns(const float* x, const W* w, float* y, int64_t k_len, int64_t n,
                       int64_t c, bool accumulate) {
  for (; c + NV * kLanes <= n; c += NV * kLanes)
    tile<ROWS, NV>(x, k_len, w + c, n, y + c, n, k_len, accumulate);
  return c;
}

// Every column of ROWS rows: wide tiles, then single vectors, then single elements.
template <int64_t ROWS, int64_t NV, typename W>
inline void row_block(const float* x, const W* w, float* y, int64_t k_len, int64_t n,
                      bool accumulate) {
  int64_t c = columns<ROWS, NV>(x, w, y, k_len, n, 0, accumulate);
  c = columns<ROWS, 1>(x, w, y, k_len, n, c, accumulate);
  if (c < n) scalar_columns(x, k_len, w + c, n, y + c, n, ROWS, n - c, k_len, accumulate);
}

// Blocks of kRows rows (parallel over blocks), then the remaining rows one at a time with
// kWide vectors per tile: a single row needs that many independent accumulator chains to
// hide the FMA latency.
// Fewer than kRows rows (a GEMV, or the rows left after the blocks): columns in blocks of
// kColBlock whose accumulators live in L1, the input features in order, each weight vector
// loaded once for all the rows. A register tile would walk the weights column tile by column
// tile with a stride of a whole weight row per step (a TLB miss per step on a 250k-column LM
// head); this reads every weight row's block contiguously. Per element the arithmetic is the
// tile's exactly (acc = 0, then acc + x·w for k in order), so results stay batch-invariant.
constexpr int64_t kColBlock = 2048;

// y[r, 0:width] (+)= acc[r][0:width] for ``rows`` rows (acc rows ``ld`` floats apart).
inline void store_block(const float* acc, int64_t ld, int64_t rows, int64_t width, float* y,
                        int64_t n, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = y + r * n;
    const float* a = acc + r * ld;
    for (int64_t c = 0; c < width; ++c) out[c] = accumulate ? out[c] + a[c] : a[c];
  }
}

template <typename W>
void few_rows(const float* x, const W* w, float* y, int64_t rows, int64_t k_len, int64_t n,
              bool accumulate) {
  const int64_t vec_end = n / kLanes * kLanes;
  at::parallel_for(0, (vec_end + kColBlock - 1) / kColBlock, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[kRows][kColBlock];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * kColBlock;
      const int64_t width = std::min(kColBlock, vec_end - c0);
      for (int64_t r = 0; r < rows; ++r) std::memset(acc[r], 0, width * sizeof(float));
      for (int64_t k = 0; k < k_len; ++k) {
        const W* wk = w + k * n + c0;
        for (int64_t c = 0; c < width; c += kLanes) {
          __builtin_prefetch(wk + 4 * n + c);  // four weight rows ahead: DRAM latency
          const vfloat wv = load_w(wk + c);
          for (int64_t r = 0; r < rows; ++r) {
            auto* a = reinterpret_cast<vfloat_u*>(acc[r] + c);
            *a = *a + x[r * k_len + k] * wv;
          }
        }
      }
      store_block(acc[0], sizeof(acc[0]) / sizeof(float), rows, width, y + c0, n, accumulate);
    }
  });
  if (vec_end < n)
    scalar_columns(x, k_len, w + vec_end, n, y + vec_end, n, rows, n - vec_end, k_len,
                   accumulate);
}

template <typename W>
void gemm_rows(const float* x, const W* w, float* y, int64_t rows, int64_t k_len, int64_t n,
               bool accumulate) {
  constexpr int64_t kWide = 8;
  const int64_t blocks = rows / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      row_block<kRows, kVecs>(x + b * kRows * k_len, w, y + b * kRows * n, k_len, n,
                              accumulate);
  });
  if (blocks * kRows < rows)
    few_rows(x + blocks * kRows * k_len, w, y + blocks * kRows * n, rows - blocks * kRows, k_len,
             n, accumulate);
}

#if defined(__AVX512BF16__)
// ---- bf16 dot products (AVX512-BF16): weights packed in pairs of input features ----------
// Packed layout P [ceil(K/2), N, 2] bf16: P[k2, n, j] = W[2 k2 + j, n] (a zero pads odd K).
// Activations are rounded to bf16 (nearest even) and paired the same way; each output element
// then takes vdpbf16ps over k2 = 0, 1, ... in order: twice the products per instruction of
// fp32 FMAs, still one accumulator per element in a fixed order, so still batch-invariant.
constexpr bool kHasBf16Dot = true;
constexpr int64_t kDpRows = 6;  // 6 rows x 4 vectors: 24 of 32 zmm registers accumulate

template <int64_t ROWS, int64_t NV>
inline void tile_dp(const uint32_t* xp, int64_t k2_len, const uint16_t* wp, int64_t n, float* y,
                    int64_t ldy, bool accumulate, __mmask16 tail) {
  __m512 acc[ROWS][NV];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < k2_len; ++k2) {
    __m512i wv[NV];
    const uint16_t* wk = wp + k2 * n * 2;
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

// All columns of ROWS rows: tiles of 4 vectors, then single (possibly masked) vectors.
template <int64_t ROWS>
inline void row_block_dp(const uint32_t* xp, int64_t k2_len, const uint16_t* wp, int64_t n,
                         float* y, bool accumulate) {
  int64_t c = 0;
  for (; c + 64 <= n; c += 64)
    tile_dp<ROWS, 4>(xp, k2_len, wp + c * 2, n, y + c, n, accumulate, 0xFFFF);
  for (; c < n; c += 16) {
    const int64_t left = n - c < 16 ? n - c : 16;
    tile_dp<ROWS, 1>(xp, k2_len, wp + c * 2, n, y + c, n, accumulate,
                     static_cast<__mmask16>((1u << left) - 1u));
  }
}

// Fewer than kDpRows rows, blocked over columns as few_rows (the same arithmetic per element
// as tile_dp: acc = 0, then one vdpbf16ps per input pair in order).
inline void few_rows_dp(const uint32_t* xp, int64_t k2_len, const uint16_t* wp, float* y,
                        int64_t rows, int64_t n, bool accumulate) {
  constexpr int64_t kBlock = 2048;
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[kDpRows][kBlock];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t width = std::min(kBlock, n - c0);
      for (int64_t r = 0; r < rows; ++r) std::memset(acc[r], 0, width * sizeof(float));
      for (int64_t k2 = 0; k2 < k2_len; ++k2) {
        const uint16_t* wk = wp + (k2 * n + c0) * 2;
        for (int64_t c = 0; c < width; c += 16) {
          const int64_t left = width - c < 16 ? width - c : 16;
          const __mmask16 m = static_cast<__mmask16>((1u << left) - 1u);
          __builtin_prefetch(wk + (4 * n + c) * 2);  // four weight rows ahead: DRAM latency
          const __m512i wv = _mm512_maskz_loadu_epi32(m, wk + c * 2);
          for (int64_t r = 0; r < rows; ++r) {
            const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[r * k2_len + k2]));
            const __m512 a = _mm512_dpbf16_ps(_mm512_maskz_loadu_ps(m, acc[r] + c),
                                              (__m512bh)xb, (__m512bh)wv);
            _mm512_mask_storeu_ps(acc[r] + c, m, a);
          }
        }
      }
      store_block(acc[0], sizeof(acc[0]) / sizeof(float), rows, width, y + c0, n, accumulate);
    }
  });
}

// y [B, N] (+)= bf16(x [B, K]) @ P, P packed as above.
inline void gemm_rows_dp(const float* x, const uint16_t* wp, float* y, int64_t rows,
                         int64_t k_len, int64_t n, bool accumulate) {
  const int64_t k2_len = (k_len + 1) / 2;
  std::vector<uint32_t> xp(rows * k2_len, 0u);
  auto* xh = reinterpret_cast<at::BFloat16*>(xp.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < k_len; ++k) xh[r * k2_len * 2 + k] = at::BFloat16(x[r * k_len + k]);
  const int64_t blocks = rows / kDpRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      row_block_dp<kDpRows>(xp.data() + b * kDpRows * k2_len, k2_len, wp,
                            n, y + b * kDpRows * n, accumulate);
  });
  const int64_t done = blocks * kDpRows;
  if (done < rows)
    few_rows_dp(xp.data() + done * k2_len, k2_len, wp, y + done * n, rows - done, n, accumulate);
}
#else
constexpr bool kHasBf16Dot = false;
#endif

// W [K, N] bf16 -> [ceil(K/2), N, 2] for the bf16 dot-product path (a copy of W unchanged
// where the CPU has none).
inline at::Tensor pack_bf16_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack takes [K, N] bf16");
  if (!kHasBf16Dot) return w.contiguous();
  const int64_t k_len = w.size(0), n = w.size(1);
  at::Tensor padded = at::zeros({(k_len + 1) / 2 * 2, n}, w.options());
  padded.narrow(0, 0, k_len).copy_(w);
  return padded.view({-1, 2, n}).permute({0, 2, 1}).contiguous();
}

// y = a @ w (or y += a @ w with ``accumulate``): a [B, K] fp32 contiguous, w [K, N] fp32 or
// bf16 contiguous, y [B, N] fp32 contiguous.
inline void invariant_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y,
                         bool accumulate) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat,
              "invariant_mm takes fp32 activations");
  TORCH_CHECK(a.is_contiguous() && w.is_contiguous() && y.is_contiguous(),
              "invariant_mm takes contiguous tensors");
  TORCH_CHECK(w.dim() == 2 || (w.dim() == 3 && kHasBf16Dot && w.size(2) == 2),
              "invariant_mm: weights are [K, N], or [K/2, N, 2] bf16 pairs");
  const int64_t w_in = w.dim() == 2 ? w.size(0) : 2 * w.size(0);
  TORCH_CHECK((a.size(1) == w_in || (w.dim() == 3 && a.size(1) + 1 == w_in)) &&
              y.size(0) == a.size(0) && y.size(1) == w.size(1),
              "invariant_mm: shapes disagree");
  const int64_t rows = a.size(0), k_len = a.size(1), n = w.size(1);
#if defined(__AVX512BF16__)
  if (w.dim() == 3) {
    gemm_rows_dp(a.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
                 y.data_ptr<float>(), rows, k_len, n, accumulate);
    return;
  }
#endif
  if (w.scalar_type() == at::kBFloat16) {
    gemm_rows(a.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()),
              y.data_ptr<float>(), rows, k_len, n, accumulate);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat, "invariant_mm takes fp32 or bf16 weights");
    gemm_rows(a.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rows, k_len, n,
              accumulate);
  }
}

}  // namespace linserve
