// The bf16 GEMM on AMX tiles (included by gemm.h where the compiler targets AMX-BF16).
//
// Same weights, same paired activations and same contract as gemm_rows_dp: every output
// element's arithmetic depends on its row alone, never on the rows it shares a call with.
// One tdpbf16ps multiplies a tile of up to 16 rows by 32 input features and 16 columns, each
// row's sums computed apart from the others' (rows are independent in the instruction's
// definition); per element the K order is fixed: blocks of 16 feature pairs in order, each
// block accumulated into the element's fp32 sum. Batch 1 runs the same tiles with one row,
// so a row alone and a row in a batch of 16 get the same bits.
//
// What runs where, for an M-row span (M <= 16):
// - each full panel of 64 columns (pack_weight's layout [k2_len, 64, 2]): 4 accumulator tiles
//   of M x 16, one activation tile of M rows x 16 pairs, weight tiles of 16 pairs x 16
//   columns loaded from the panel with a stride of one panel row (256 bytes);
// - the K tail (k2_len % 16 pairs) after the tiles are stored, and the last panel when it is
//   narrower than 64 columns: vdpbf16ps, as gemm_rows_dp does. Both depend on the column and
//   K, never on M.
// Why: at 16 rows the AVX512-BF16 tiles of gemm_rows_dp run ~70 GFLOP/s a core, bound by
// vdpbf16ps (32 products an instruction); one tdpbf16ps does 16 K products, 256 times more.
//
// Linux hands AMX state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM); the
// request is made once, and without it (an old kernel, a hypervisor that hides it) or with
// LINSERVE_AMX=0 the GEMM stays on gemm_rows_dp, whichever it is for the whole process.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace linserve {

constexpr bool kHasAmx = true;

// Whether the kernel lets this process use AMX tile data (asked once).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
    const char* env = std::getenv("LINSERVE_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The switch tests flip to compare both paths; it is read once per GEMM call.
inline std::atomic<bool>& amx_flag() {
  static std::atomic<bool> on{true};
  return on;
}

inline bool amx_active() { return amx_flag().load(std::memory_order_relaxed) && amx_permitted(); }

// Tiles: 0-3 accumulators (M rows x 16 fp32), 4 activations (M rows x 16 pairs), 5-6 weights
// (16 pairs x 16 columns of pairs). The configuration is per thread and other code (oneDNN)
// loads its own, so every span loads it again.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

inline void amx_configure(int64_t rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t < 5 ? rows : 16);
  }
  _tile_loadconfig(&cfg);
}

constexpr int64_t kAmxPrefetch = 2;

// out [M, 64] fp32 = the first (k2_len / 16) * 16 pairs of bf16(x) [M, k2_len pairs] times
// one full panel [k2_len, 64, 2], on the configured tiles.
inline void amx_panel(const uint32_t* xp, int64_t k2_len, const uint16_t* panel, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t ldx = k2_len * 4;
  for (int64_t b = 0; b + 16 <= k2_len; b += 16) {
    _tile_loadd(4, xp + b, ldx);
    const uint16_t* wb = panel + b * 128;
    // The weights kAmxPrefetch blocks ahead (4 KB each; past the panel's end they are the
    // next panel's, and a prefetch never faults): the tile loads alone kept too few reads in
    // flight, and a one-row product read 15 GB/s where vdpbf16ps read 23 (the 0.8B shapes'
    // batch-1 step: 94 ms without, 58 with, 64 on vdpbf16ps).
    const char* pf = reinterpret_cast<const char*>(wb + kAmxPrefetch * 16 * 128);
    for (int i = 0; i < 4096; i += 64) _mm_prefetch(pf + i, _MM_HINT_T0);
    _tile_loadd(5, wb, 256);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wb + 32, 256);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wb + 64, 256);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, wb + 96, 256);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, out, 256);
  _tile_stored(1, out + 16, 256);
  _tile_stored(2, out + 32, 256);
  _tile_stored(3, out + 48, 256);
}

// The pairs the tiles left (k2 from k2_len / 16 * 16), added to out [M, 64] by vdpbf16ps in
// order, then out written (or added) to y.
inline void amx_finish(const uint32_t* xp, int64_t k2_len, const uint16_t* panel, float* out,
                       int64_t rows, float* y, int64_t ldy, bool accumulate) {
  const int64_t k0 = k2_len / 16 * 16;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < 4; ++j) {
      __m512 acc = _mm512_loadu_ps(out + r * 64 + j * 16);
      for (int64_t k2 = k0; k2 < k2_len; ++k2) {
        const __m512i xb = _mm512_set1_epi32(static_cast<int>(xp[r * k2_len + k2]));
        const __m512i wv = _mm512_loadu_si512(panel + k2 * 128 + j * 32);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)xb, (__m512bh)wv);
      }
      float* dst = y + r * ldy + j * 16;
      if (accumulate) acc = _mm512_add_ps(_mm512_loadu_ps(dst), acc);
      _mm512_storeu_ps(dst, acc);
    }
  }
}

// One span of up to 16 rows (xp: the span's paired rows): full panels on the tiles, a
// narrower last panel through tile_dp in groups of up to kRows rows (per element the same
// arithmetic whatever the rows; one row at a time cost an int4 prefill 13%, whose small
// bf16 projections are all narrow panel).
inline void span_rows_amx(const uint32_t* xp, int64_t k2_len, const Weights<uint16_t>& wp,
                          int64_t rows, const Span& s) {
  alignas(64) float out[16 * 64];
  int64_t c = s.c0, ld;
  const int64_t full = wp.n / kPanel * kPanel;
  if (c + 64 <= std::min(s.c1, full)) {
    amx_configure(rows);
    for (; c + 64 <= s.c1 && c + 64 <= full; c += 64) {
      const uint16_t* panel = wp.at(c, &ld);
      amx_panel(xp, k2_len, panel, out);
      amx_finish(xp, k2_len, panel, out, rows, s.y + c, s.n, s.accumulate);
    }
    _tile_release();
  }
  for (; c < s.c1; c += 16) {
    const int64_t left = s.c1 - c < 16 ? s.c1 - c : 16;
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const uint16_t* wc = wp.at(c, &ld);
    for (int64_t r = 0; r < rows; r += kRows) {
      const uint32_t* xr = xp + r * k2_len;
      float* yr = s.y + r * s.n + c;
      switch (std::min(kRows, rows - r)) {
        case 1: tile_dp<1, 1>(xr, k2_len, wc, ld, yr, s.n, s.accumulate, mask); break;
        case 2: tile_dp<2, 1>(xr, k2_len, wc, ld, yr, s.n, s.accumulate, mask); break;
        case 3: tile_dp<3, 1>(xr, k2_len, wc, ld, yr, s.n, s.accumulate, mask); break;
        case 4: tile_dp<4, 1>(xr, k2_len, wc, ld, yr, s.n, s.accumulate, mask); break;
        case 5: tile_dp<5, 1>(xr, k2_len, wc, ld, yr, s.n, s.accumulate, mask); break;
        default: tile_dp<6, 1>(xr, k2_len, wc, ld, yr, s.n, s.accumulate, mask);
      }
    }
  }
}

// Column chunks of 256 (4 panels): a 16-row call over a 3,584-column weight then splits in
// 14 pieces, which two threads share evenly (512 made 7).
constexpr int64_t kAmxChunk = 256;

// y [B, N] (+)= bf16(x [B, K]) @ P on AMX tiles, rows in groups of 16.
inline void gemm_rows_amx(const float* x, const Weights<uint16_t>& wp, float* y, int64_t rows,
                          int64_t k_len, int64_t n, bool accumulate) {
  const int64_t k2_len = (k_len + 1) / 2;
  const std::vector<uint32_t> xp = pair_rows(x, rows, k_len);
  const uint32_t* xs = xp.data();
  for_spans(x, y, rows, k_len, n, accumulate, 16, [&](int64_t r, const Span& s) {
    span_rows_amx(xs + s.r0 * k2_len, k2_len, wp, r, s);
  }, kAmxChunk);
}

}  // namespace linserve
