// Q6_K in six bits (kQ6S): widened in the tiles, or once a column chunk.
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include "gemm_quant_dispatch.h"

namespace linserve {

// ---- Q6_K in six bits (kQ6S): widened in the tiles, or once a column chunk --------------
// A product of at most kSixInlineRows rows (a decode step's, a verify's) runs kQ6S's own
// tiles, which widen each value to a byte as they read it. More rows (a prefill) read each
// weight once a row group: each thread widens a column chunk once (widen_six, into a scratch
// kept for that chunk's next groups) and runs q6's tiles on the bytes, the same integers, so
// the same bits. (For 16 rows, three groups, widening each chunk measured slower than
// widening in the tiles, and widening each 16-column panel into a buffer before its tile
// slower still.) VNNI builds store Q6_K as q6 (kQ6Stored): their many-row
// tiles measured slower on six bits; a q6s weight there always takes
// the chunk path.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kQ6Stored = kQ6;
#else
constexpr int kQ6Stored = kQ6S;
constexpr int64_t kSixInlineRows = kWideRows;
#endif

typedef uint8_t vb32 __attribute__((vector_size(32)));
typedef uint8_t vb32_ua __attribute__((vector_size(32), aligned(1), __may_alias__));

// Columns [c0, c1) of a kQ6S weight as kQ6 panels at out, as that weight's own panels would
// be stored as kQ6 (c0 a multiple of kPanel): the pairs and multipliers copied, each stored
// row of nibbles widened to two of bytes q + 128.
inline void widen_six(const QuantWeights& w, int64_t c0, int64_t c1, uint8_t* out) {
  const int64_t blocks = w.k32 / kBlock, pairs = blocks / super_blocks(kQ6) * 8;
  const int64_t from = column_bytes(kQ6S, blocks), to = column_bytes(kQ6, blocks);
  for (int64_t p0 = c0; p0 < c1; p0 += kPanel) {
    const int64_t width = std::min(kPanel, w.n - p0), ld = 4 * width;
    const uint8_t* src = w.base + p0 * from;
    uint8_t* dst = out + (p0 - c0) * to;
    std::memcpy(dst, src, pairs * width);
    src += pairs * width;
    dst += pairs * width;
    for (int64_t b = 0; b < blocks; ++b, src += block_bytes(kQ6S) * width,
                 dst += block_bytes(kQ6) * width) {
      for (int64_t t = 0; t < kSteps<kQ6S>; ++t) {
        const uint8_t* nib = src + t * ld;
        const uint8_t* high = src + (kSteps<kQ6S> + t / 2) * ld;
        int64_t c = 0;
        for (; c + 32 <= ld; c += 32) {  // 32 bytes a step (the loop below did not vectorize)
          const vb32 v = *reinterpret_cast<const vb32_ua*>(nib + c);
          const vb32 h = *reinterpret_cast<const vb32_ua*>(high + c) >> (4 * (t & 1));
          *reinterpret_cast<vb32_ua*>(dst + 2 * t * ld + c) = ((v & 15) | ((h & 3) << 4)) + 0x60;
          *reinterpret_cast<vb32_ua*>(dst + (2 * t + 1) * ld + c) =
              ((v >> 4) | (((h >> 2) & 3) << 4)) + 0x60;
        }
        for (; c < ld; c += 4) {
          uint32_t v, h;
          std::memcpy(&v, nib + c, 4);
          std::memcpy(&h, high + c, 4);
          const uint32_t lo = six_bits(v, h, t, 0) + 0x60606060u;  // q + 32 + 96: no carry
          const uint32_t hi = six_bits(v, h, t, 1) + 0x60606060u;
          std::memcpy(dst + 2 * t * ld + c, &lo, 4);
          std::memcpy(dst + (2 * t + 1) * ld + c, &hi, 4);
        }
      }
      std::memcpy(dst + (block_bytes(kQ6) - 2) * width, src + (block_bytes(kQ6S) - 2) * width,
                  2 * width);
    }
  }
}

// A thread's widened chunk: which product (a number per call) and which columns it holds.
struct SixScratch {
  std::vector<uint8_t> bytes;
  uint64_t call = 0;
  int64_t c0 = -1;
};
inline std::atomic<uint64_t> six_calls{0};

// The product of a kQ6S weight (see above).
inline void quant_rows_six(const QuantActs& a, const float* x, const QuantWeights& w, float* y,
                           int64_t rows, int64_t k_len, bool accumulate) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  if (rows <= kSixInlineRows) return quant_rows<kQ6S>(a, x, w, y, rows, k_len, accumulate);
#endif
  const uint64_t call = ++six_calls;
  const int64_t cold_rows = a.group * at::get_num_threads();
  const int64_t to = column_bytes(kQ6, w.k32 / kBlock);
  for_spans(x, y, rows, k_len, w.n, accumulate, a.group, [&](int64_t r, const Span& s) {
    thread_local SixScratch scratch;
    if (scratch.call != call || scratch.c0 != s.c0) {
      scratch.bytes.resize(static_cast<size_t>((s.c1 - s.c0) * to));
      widen_six(w, s.c0, s.c1, scratch.bytes.data());
      scratch.call = call;
      scratch.c0 = s.c0;
    }
    Span local = s;  // the chunk's columns from 0 in the scratch; y still [B, N]
    local.c0 = 0;
    local.c1 = s.c1 - s.c0;
    local.y = s.y + s.c0;
    span_quant_rows<kQ6>(a, local, QuantWeights{scratch.bytes.data(), local.c1, w.k32, kQ6}, r,
                         s.r0 < cold_rows);
  });
}

// Stored rows of a weight of K inputs (rows of N columns x 4 bytes).

}  // namespace linserve
