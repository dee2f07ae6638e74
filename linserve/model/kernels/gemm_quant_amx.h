// int8 / int4 GEMMs of several rows on AMX-INT8 tiles, with exactly gemm_quant.h's bits
// (included by gemm_quant.h where the compiler targets AMX-INT8 and gemm_amx.h is in).
//
// Per output element, the VNNI tiles (tile_vnni_row, tile_vnni_rows) compute for each block
// b of 32 inputs an int32 dot product d_b, exact, then one float step: int4
// f = fma(float(d_b), s_w[b] s_x[b], f), int8 f = fma(float(d_b), s_x[b], f) and y = f s_w
// at the end, blocks in order. One tdpbssd gives the same d_b for a tile of 16 rows x 16
// columns (integer sums are exact in any order), and the float steps below are the same
// instructions in the same order. So a row gets the same bits here, on the VNNI tiles,
// alone or in any batch, and which path runs (the number of rows, whether the CPU has AMX,
// LINSERVE_AMX) never changes a result.
//
// Why: a quantized product of many rows (prefill; a step of 16 rows) was bound by vpdpbusd,
// 64 products an instruction, about 85% of that instruction's peak rate. The tiles do the
// products 16 rows x 16 columns x 32 inputs at a time, and what remains on the vector units
// is the scaling: per block, three instructions per row and vector of 16 columns, against
// vpdpbusd's eight (int8) or eight plus the nibble unpacking (int4) and the same three.
//
// Layout of the work: a task is kAmxVecsPerTask 16-column vectors (the 64 columns of a
// panel, which lie together in memory) over all the rows, threads taking the next from a
// counter (parallel.h), so a thread unpacks each vector's weights into tile
// layout (signed bytes, [blocks][8 stored rows][16 columns][4 inputs]: int4's nibbles minus
// 8, int8's bytes minus 128) once for all its rows, during its first tile. Activations come
// from quantize_acts, whose rows are padded to a multiple of 16 with zeros, so a tile always
// loads 16 rows (the rows past the call's are computed and dropped); they are copied once
// per product into tiles of 16 rows, block by block (tile_rows). A last vector narrower than
// 16 columns runs on the VNNI tiles, masked.
#pragma once

#include <immintrin.h>

#include <cstring>
#include <vector>

namespace linserve {

// Fewer rows than this stay on the VNNI tiles. A step of 16 streams runs on the tiles: with the
// unpacking ahead (below), Granite-4.0-H-Micro's int4 step of 16 rows took 461 ms on them
// against 536 on the VNNI tiles (alternating, 2 threads; 491 with the unpacking just before each
// block's tiles); at 64 rows the GEMM alone was 1.26-1.6x faster, at 256 about 1.4x
// (tdpbssd takes 32 inputs an instruction here, half the tiles' depth, as the scales come
// per block of 32).
constexpr int64_t kAmxQuantMinRows = 16;
constexpr int64_t kAmxVecsPerTask = 4;

// Tiles: 0-1 int32 dots (16 rows x 16 columns), 2-3 activations (16 rows x 32 inputs), 4-5
// weights (8 stored rows x 16 columns x 4 inputs); two of each, so one block's dots are
// scaled while the next block's are computed.
inline void amx_configure_quant() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette = 1;
  for (int t = 0; t < 6; ++t) {
    cfg.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    cfg.rows[t] = t >= 4 ? 8 : 16;
  }
  _tile_loadconfig(&cfg);
}

// Block b of the (full) vector of 16 columns at col, in tile layout: q [blocks, 512] signed
// bytes, block b's 512 written; int4's and q8's scales widened to fp32, sc [blocks, 16], row b.
template <int F>
inline void unpack_block(const QCol& col, int64_t b, int8_t* q, float* sc) {
  const uint8_t* src = col.q + b * col.block;
  int8_t* out = q + b * 512;
  if (kNib<F>) {  // stored row t: inputs 8t..8t+3 in the low nibbles, 8t+4..8t+7 the high ones
    const __m512i low = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    for (int64_t t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(src + t * col.ld);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      _mm512_storeu_si512(out + 128 * t, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
      _mm512_storeu_si512(out + 128 * t + 64, _mm512_sub_epi8(hi, eight));
    }
  } else {  // stored row t: inputs 4t..4t+3, as bytes q + 128
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t t = 0; t < 8; ++t)
      _mm512_storeu_si512(out + 64 * t,
                          _mm512_xor_si512(_mm512_loadu_si512(src + t * col.ld), flip));
  }
  if constexpr (kScaled<F>) {  // int4's and q8's block scales
    const auto* s = reinterpret_cast<const __m256i*>(group_scales(col, b));
    _mm512_storeu_ps(sc + 16 * b, _mm512_cvtph_ps(_mm256_loadu_si256(s)));
  }
}

// The activations of each 16-row tile block by block, [tiles, blocks, 16 rows, 32 inputs]:
// a block's tile is then 512 contiguous bytes (eight cache lines read whole) instead of 16
// rows 2,048 bytes apart at Granite's K (half of each of 16 lines). Alone, the tiles' loads
// and products of 512 rows took longer than the vector units' scaling; laid out this way
// the whole int4 product of 512 x 2,048 x 8,512 went 150 -> 190 GMAC/s on one thread.
inline std::vector<int8_t> tile_rows(const QuantActs& a, int64_t rows) {
  const int64_t tiles = (rows + 15) / 16, nb = a.blocks;
  std::vector<int8_t> out(tiles * nb * 512);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t r = 0; r < 16; ++r)
        std::memcpy(out.data() + (t * nb + b) * 512 + r * kBlock, a.block(t * 16 + r, b), kBlock);
  return out;
}

// Block b's dots of a tile's 16 activation rows (x: the tile in tile_rows' layout) and one
// unpacked vector, on tile pair b % 2.
inline void amx_block_dp(const int8_t* x, const int8_t* q, int64_t b) {
  if (b % 2 == 0) {
    _tile_zero(0);
    _tile_loadd(2, x + b * 512, kBlock);
    _tile_loadd(4, q + b * 512, 64);
    _tile_dpbssd(0, 2, 4);
  } else {
    _tile_zero(1);
    _tile_loadd(3, x + b * 512, kBlock);
    _tile_loadd(5, q + b * 512, 64);
    _tile_dpbssd(1, 3, 5);
  }
}

// Block b's dots (tile b % 2) stored to dots [16, 16].
inline void amx_block_store(int64_t b, int32_t* dots) {
  if (b % 2 == 0)
    _tile_stored(0, dots, 64);
  else
    _tile_stored(1, dots, 64);
}

// The 16 rows' fp32 sums as 16 named registers: tilestored's asm clobbers memory, and an
// array of them was kept on the stack, each step a load and a store (1.5x slower tiles).
#define LINSERVE_ROWS16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
  X(12) X(13) X(14) X(15)

// How many blocks ahead of its tiles a block is unpacked: a tile load of bytes the vector
// units stored just before waits for those stores to reach the cache.
constexpr int64_t kAmxUnpackAhead = 4;

// Rows [r0, r0 + 16) x the vector at col: y's rows below `rows` written (or added to); x is
// the rows' tile in tile_rows' layout. With ``unpack``, each block of the vector's weights is
// unpacked into q / sc kAmxUnpackAhead blocks before its tiles (the reads then overlap the
// tiles' work); without, q / sc hold them already. A block's dots are stored a block after
// its product is issued (``lag``) where the weights are not being unpacked, so the store
// does not wait on the product just issued (512 rows: 150 -> 167 GMAC/s on one thread);
// while unpacking, at 16 rows, the lag measured no faster.
template <int F>
inline void amx_quant_tile(const QuantActs& a, const int8_t* x, int64_t r0, int64_t rows,
                           bool unpack, int8_t* q, float* sc, const QCol& col, float* y,
                           int64_t ldy, bool accumulate) {
  alignas(64) int32_t dots[2][16 * 16];
#define LINSERVE_ZERO(r) __m512 acc##r = _mm512_setzero_ps();
  LINSERVE_ROWS16(LINSERVE_ZERO)
#undef LINSERVE_ZERO
  const float* sx = a.scale.data() + r0 * a.blocks;
  const int64_t nb = a.blocks, lag = unpack ? 0 : 1;
  if (unpack)
    for (int64_t b = 0; b < std::min(kAmxUnpackAhead, nb); ++b) unpack_block<F>(col, b, q, sc);
  for (int64_t b = 0; b <= nb + lag; ++b) {
    if (b < nb) {
      if (unpack && b + kAmxUnpackAhead < nb) unpack_block<F>(col, b + kAmxUnpackAhead, q, sc);
      amx_block_dp(x, q, b);
    }
    if (b >= lag && b - lag < nb) amx_block_store(b - lag, dots[(b - lag) % 2]);
    if (b < lag + 1) continue;
    const int64_t p = b - lag - 1;  // the block whose dots were stored a step ago
    const int32_t* d = dots[p % 2];
    const float* sp = sx + p;  // row r's s_x of block p at sp[r * nb]
    const __m512 sw = kScaled<F> ? _mm512_loadu_ps(sc + 16 * p) : _mm512_set1_ps(1.f);
#define LINSERVE_SCALE(r)                                                             \
    {                                                                                 \
      const __m512 s = _mm512_set1_ps(sp[r * nb]);                                    \
      acc##r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(d + 16 * r)),     \
                               kScaled<F> ? _mm512_mul_ps(sw, s) : s, acc##r);              \
    }
    LINSERVE_ROWS16(LINSERVE_SCALE)
#undef LINSERVE_SCALE
  }
  const __m512 sw = kScaled<F> ? _mm512_set1_ps(1.f)
                         : _mm512_loadu_ps(static_cast<const float*>(col.s));
#define LINSERVE_STORE(r)                                                             \
  if (r0 + r < rows) {                                                                \
    float* out = y + r * ldy;                                                         \
    __m512 v = kScaled<F> ? acc##r : _mm512_mul_ps(acc##r, sw);                             \
    asm("" : "+v"(v)); /* rounded before the add, as store_tile does */               \
    if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(out), v);                       \
    _mm512_storeu_ps(out, v);                                                         \
  }
  LINSERVE_ROWS16(LINSERVE_STORE)
#undef LINSERVE_STORE
}
#undef LINSERVE_ROWS16

// y [rows, N] (+)= the quantized product, the full vectors on the tiles, a narrower last one
// on the VNNI tiles. ``a``'s rows are padded to a multiple of 16 (quantize_acts).
template <int F>
inline void quant_rows_amx(const QuantActs& a, const float* x, const QuantWeights& w, float* y,
                           int64_t rows, int64_t k_len, bool accumulate) {
  const int64_t vecs = w.n / 16;
  const std::vector<int8_t> tiled = tile_rows(a, rows);
  parallel_tasks((vecs + kAmxVecsPerTask - 1) / kAmxVecsPerTask, [&](TaskQueue& queue) {
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> sc;
    q.resize(a.blocks * 512);
    sc.resize(a.blocks * 16);
    amx_configure_quant();
    for (int64_t t = queue.take(); t >= 0; t = queue.take()) {
      for (int64_t v = t * kAmxVecsPerTask; v < std::min(vecs, (t + 1) * kAmxVecsPerTask); ++v) {
        const QCol col = column(w, 16 * v);
        for (int64_t r0 = 0; r0 < rows; r0 += 16)
          amx_quant_tile<F>(a, tiled.data() + r0 * a.k32, r0, rows, r0 == 0, q.data(),
                               sc.data(), col, y + r0 * w.n + 16 * v, w.n, accumulate);
      }
    }
    _tile_release();
  });
  if (vecs * 16 == w.n) return;
  for (int64_t r0 = 0; r0 < rows; r0 += a.group) {
    const Span s{r0, x + r0 * k_len, y + r0 * w.n, k_len, w.n, vecs * 16, w.n, accumulate};
    span_quant_rows<F>(a, s, w, std::min(a.group, rows - r0));
  }
}

}  // namespace linserve
