// AVX2 (without AVX-512): one block's integer dot products (vpmaddubsw + vpmaddwd), and
// the byte and nibble formats' tiles of 1 .. kRowsQuant rows from packed records.
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include "gemm_quant_formats.h"

namespace linserve {

#if defined(__AVX2__) && !defined(__AVX512F__)
// ---- AVX2: one block's integer dot products with vpmaddubsw + vpmaddwd --------------------
// What vpdpbusd does in one instruction, in three or four, for the generic tile below (its
// float arithmetic unchanged). Exact, like every path: vpmaddubsw sums u8 x s8 pairs into
// int16 with saturation, so no pair may pass 2^15. int8's stored bytes (q + 128) would, so
// they are taken signed (q, in [-127, 127]) against |x| with x's sign moved onto q
// (llama.cpp's trick): a pair is at most 2 x 127 x 127, and the offset's correction is not
// needed (the dot starts at 0, not at -128 Σ x). int4's nibbles (0..15) stay unsigned: a
// block's four stored rows of pairs sum to at most 8 x 15 x 127 < 2^15 before vpmaddwd.
// The narrow byte formats need neither sign: their values (stored q + 128) are taken as
// q + kNarrowBias, unsigned and at most 63 (Q6_K's q in [-32, 31] as q + 32; q8k's, Q5_K's
// and Q5_1's in [0, 31] or Q5_0's in [-16, 15], as q + 16), so two stored rows' pairs sum to
// at most 2 x 2 x 63 x 127 < 2^15 before vpmaddwd: two instructions a stored row instead of
// four. Their dot starts at -kNarrowBias Σ x, the offset's correction (-128 Σ x) over 4 or 8:
// exact.
constexpr bool kAvx2Dot = true;
template <int F> constexpr bool kNarrowBytes = F == kQ6 || F == kQ8K;
template <int F> constexpr int32_t kNarrowBias = F == kQ6 ? 32 : 16;

// A dot product's starting value on AVX2: 0 for the byte formats taken signed, the
// correction for the nibbles and the narrow bytes.
template <int F>
inline int32_t avx2_dot_start(int32_t d0, int32_t d0_lo, int64_t g) {
  if constexpr (kNib<F> || kSix<F>) return half_start<F>(d0, d0_lo, g);
  if constexpr (kNarrowBytes<F>) return half_start<F>(d0, d0_lo, g) / (128 / kNarrowBias<F>);
  return 0;
}

// kQ6S's nibble row t (v) and its high-bit row (h) widened to two rows of bytes q + 32: lo
// the row's low inputs, hi its high ones. Row t's two high bits of its low inputs are bits
// 4 (t & 1) .. + 1 of h, of its high inputs the next two; shifted to bits 4-5 (bits carried
// across bytes masked off).
inline void widen_six_avx2(__m256i v, __m256i h, int64_t t, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  lo = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(
      (t & 1) ? h : _mm256_slli_epi16(h, 4), top));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
      _mm256_and_si256((t & 1) ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2), top));
}

// block_dot_avx2's kQ6S part: nibble rows t0 .. t1 - 1 (a half) widened to q + 32 in
// registers, then as the narrow bytes (two stored rows' pairs a vpmaddwd).
template <int64_t ROWS, int64_t NV>
inline void six_dot_avx2(const int32_t* const* xq, const QCol* col, int64_t b, int64_t t0,
                         int64_t t1, __m256i (&sum)[ROWS][NV], vi32 (*dot)[NV]) {
  constexpr int F = kQ6S;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < NV; ++j) {
      const uint8_t* p = col[j].q + b * col[j].block;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + t * col[j].ld));
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p + (kSteps<F> + t / 2) * col[j].ld));
      __m256i lo, hi;
      widen_six_avx2(v, h, t, lo, hi);
      for (int64_t r = 0; r < ROWS; ++r)  // two pairs: at most 2 x 2 x 63 x 127 < 2^15
        sum[r][j] = _mm256_add_epi32(sum[r][j], _mm256_madd_epi16(_mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[r][2 * t])),
            _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[r][2 * t + 1]))), ones));
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) dot[r][j] += (vi32)sum[r][j];
}

template <int F, int64_t ROWS, int64_t NV>
inline void block_dot_avx2(const QuantActs& a, int64_t r0, const QCol* col, int64_t b,
                           vi32 (*dot)[NV], int64_t t0 = 0, int64_t t1 = kBlock / 4) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int32_t* xq[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) xq[r] = reinterpret_cast<const int32_t*>(a.block(r0 + r, b));
  __m256i sum[ROWS][NV];
  for (auto& row : sum) for (auto& v : row) v = _mm256_setzero_si256();
  if constexpr (kSix<F>) return six_dot_avx2<ROWS, NV>(xq, col, b, t0, t1, sum, dot);
  if (kNib<F>) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t t = 0; t < kBlock / 8; ++t) {
      for (int64_t j = 0; j < NV; ++j) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(col[j].q + b * col[j].block + t * col[j].ld));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int64_t r = 0; r < ROWS; ++r)
          sum[r][j] = _mm256_add_epi16(sum[r][j], _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[r][2 * t])),
              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[r][2 * t + 1]))));
      }
    }
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < NV; ++j)
        dot[r][j] += (vi32)(sum[r][j] = _mm256_madd_epi16(sum[r][j], ones));
    return;
  }
  if constexpr (kNarrowBytes<F>) {  // two stored rows at a time, unsigned
    const __m256i off = _mm256_set1_epi8(static_cast<char>(128 - kNarrowBias<F>));
    __m256i sum[ROWS][NV];
    for (auto& row : sum) for (auto& v : row) v = _mm256_setzero_si256();
    for (int64_t t = t0; t < t1; t += 2) {
      for (int64_t j = 0; j < NV; ++j) {
        const uint8_t* q = col[j].q + b * col[j].block + t * col[j].ld;
        const __m256i u0 = _mm256_sub_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), off);
        const __m256i u1 = _mm256_sub_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + col[j].ld)), off);
        for (int64_t r = 0; r < ROWS; ++r)
          sum[r][j] = _mm256_add_epi32(sum[r][j], _mm256_madd_epi16(_mm256_add_epi16(
              _mm256_maddubs_epi16(u0, _mm256_set1_epi32(xq[r][t])),
              _mm256_maddubs_epi16(u1, _mm256_set1_epi32(xq[r][t + 1]))), ones));
      }
    }
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t j = 0; j < NV; ++j) dot[r][j] += (vi32)sum[r][j];
    return;
  }
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = t0; t < t1; ++t) {  // (stored rows t0 .. t1 - 1: kQ6's half)
    __m256i xb[ROWS], ax[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) {
      xb[r] = _mm256_set1_epi32(xq[r][t]);
      ax[r] = _mm256_sign_epi8(xb[r], xb[r]);
    }
    for (int64_t j = 0; j < NV; ++j) {
      const __m256i q = _mm256_xor_si256(flip, _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(col[j].q + b * col[j].block + t * col[j].ld)));
      for (int64_t r = 0; r < ROWS; ++r)
        sum[r][j] = _mm256_add_epi32(sum[r][j], _mm256_madd_epi16(
            _mm256_maddubs_epi16(ax[r], _mm256_sign_epi8(q, xb[r])), ones));
    }
  }
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t j = 0; j < NV; ++j) dot[r][j] += (vi32)sum[r][j];
}
#else
constexpr bool kAvx2Dot = false;

template <int F>  // never called: tile_q's generic loop runs
inline int32_t avx2_dot_start(int32_t, int32_t, int64_t) { return 0; }

template <int F, int64_t ROWS, int64_t NV>  // never called: tile_q's generic loop runs
inline void block_dot_avx2(const QuantActs&, int64_t, const QCol*, int64_t, vi32 (*)[NV],
                           int64_t = 0, int64_t = 0) {}
#endif


#if defined(__AVX2__) && !defined(__AVX512F__)
// ---- AVX2: the byte formats' tiles of 1 .. kRowsQuant rows, from packed records ---------
// tile_q took each row through its own pointers and struct fields: the compiler spent more
// instructions on addresses and on spilled sums than on the products (a 6-row Q6_K tile: 48
// vpmaddubsw among ~840 instructions a half block). As tile_vnni_rows: one pointer serves
// every row of a record (pack_group) at constant offsets, one the tile's weight vectors
// (they share a panel), and a pass keeps only its own rows' dots live. The arithmetic of
// tile_q, element by element (the same integers, the same float steps in the same order),
// so the bits are the same. One Zen 3 core, rows 6 / 16 / 512 of a 2,048 x 4,096 weight,
// GMAC/s: Q6_K 37 / 37 / 44 -> 49 / 51 / 60, Q8_0 44 / 44 / 45 -> 47 /
// 48 / 50; one row (a GEMV) too: Q6_K 19 -> 21. The nibbles (Q4_K, Q4_1, Q4_0 and int4)
// too, their stored rows' products in inline asm (nib_pairs_avx2): rows 1 / 4 /
// 16 / 512, Q4_0 40 / 56 / 64 / 66 -> 49 / 83 / 88 / 89, Q4_K 32 / 49 / 58 / 61 -> 38 / 67 /
// 74 / 75, every output bit as before.
// base[OFF] in every lane, by one vpbroadcastd from base + 4 OFF (broadcast_at's reason).
template <int64_t OFF>
inline __m256i broadcast_ymm_at(const int32_t* base) {
  __m256i v;
  asm volatile("vpbroadcastd %c2(%1), %0" : "=x"(v) : "r"(base), "i"(OFF * 4), "m"(*base));
  return v;
}

// The rows and vectors of a tile whose dots a pass of a half block keeps live (each row's
// inputs broadcast once for the pass's vectors), by format: measured (one Zen 3 core, 6,
// 16 and 512 rows of 2,048 x 4,096), the narrow bytes' pairs fastest a vector at a time
// (6 x 1), the six bits and the signed bytes 3 x 2, the nibbles 4 x 2 (nib_pairs_avx2).
template <int F> constexpr int64_t kPassRows = kNarrowBytes<F> ? 6 : kNib<F> ? 4 : 3;
template <int F> constexpr int64_t kPassVecs = kNarrowBytes<F> ? 1 : 2;

// A stored row of nibbles against one row's inputs, two vectors: sum[j] += vpmaddubsw(lo[j],
// xq[OFF]) + vpmaddubsw(hi[j], xq[OFF + 1]) in int16 (each lane's inputs broadcast from the
// record). Inline asm, so that each sum keeps its own register from stored row to stored row
// and its adds stay in this order: with intrinsics GCC spilled the sums of a pass or
// reassociated their adds in every variant tried, and the nibbles
// stayed on tile_q. A block's 4 stored rows sum to at most 8 x 2 x 15 x 127 < 2^15.
template <int64_t OFF>
inline void nib_pairs_avx2(const int32_t* xq, const __m256i (&lo)[2], const __m256i (&hi)[2],
                           __m256i (&sum)[2]) {
  __m256i a0, a1, t;
  asm("vpbroadcastd %c[o](%[x]), %[a0]\n\t"
      "vpbroadcastd %c[o]+4(%[x]), %[a1]\n\t"
      "vpmaddubsw %[a0], %[l0], %[t]\n\t"
      "vpaddw %[t], %[s0], %[s0]\n\t"
      "vpmaddubsw %[a1], %[h0], %[t]\n\t"
      "vpaddw %[t], %[s0], %[s0]\n\t"
      "vpmaddubsw %[a0], %[l1], %[t]\n\t"
      "vpaddw %[t], %[s1], %[s1]\n\t"
      "vpmaddubsw %[a1], %[h1], %[t]\n\t"
      "vpaddw %[t], %[s1], %[s1]"
      : [s0] "+x"(sum[0]), [s1] "+x"(sum[1]), [a0] "=&x"(a0), [a1] "=&x"(a1), [t] "=&x"(t)
      : [l0] "x"(lo[0]), [h0] "x"(hi[0]), [l1] "x"(lo[1]), [h1] "x"(hi[1]), [x] "r"(xq),
        [o] "i"(OFF * 4), "m"(*xq));
}

// Two stored rows of unsigned bytes (u0 against xq[OFF], u1 against xq[OFF + 1]: the
// six-bit rows widened, or the narrow bytes) and one row's inputs, two vectors: dot[j] +=
// vpmaddwd(vpmaddubsw(u0[j], .) + vpmaddubsw(u1[j], .), 1), as nib_pairs_avx2 and for its
// reason (two pairs: at most 2 x 2 x 63 x 127 < 2^15).
template <int64_t OFF>
inline void byte_pairs_avx2(const int32_t* xq, const __m256i (&u0)[2], const __m256i (&u1)[2],
                            __m256i ones, __m256i (&dot)[2]) {
  __m256i a0, a1, t0, t1;
  asm("vpbroadcastd %c[o](%[x]), %[a0]\n\t"
      "vpbroadcastd %c[o]+4(%[x]), %[a1]\n\t"
      "vpmaddubsw %[a0], %[u00], %[t0]\n\t"
      "vpmaddubsw %[a1], %[u10], %[t1]\n\t"
      "vpaddw %[t1], %[t0], %[t0]\n\t"
      "vpmaddwd %[one], %[t0], %[t0]\n\t"
      "vpaddd %[t0], %[d0], %[d0]\n\t"
      "vpmaddubsw %[a0], %[u01], %[t0]\n\t"
      "vpmaddubsw %[a1], %[u11], %[t1]\n\t"
      "vpaddw %[t1], %[t0], %[t0]\n\t"
      "vpmaddwd %[one], %[t0], %[t0]\n\t"
      "vpaddd %[t0], %[d1], %[d1]"
      : [d0] "+x"(dot[0]), [d1] "+x"(dot[1]), [a0] "=&x"(a0), [a1] "=&x"(a1),
        [t0] "=&x"(t0), [t1] "=&x"(t1)
      : [u00] "x"(u0[0]), [u10] "x"(u1[0]), [u01] "x"(u0[1]), [u11] "x"(u1[1]),
        [one] "x"(ones), [x] "r"(xq), [o] "i"(OFF * 4), "m"(*xq));
}

// One stored row of signed bytes q (two vectors) and one row's inputs xq[OFF]: x's sign
// moved onto q (block_dot_avx2's trick), dot[j] += vpmaddwd(vpmaddubsw(|x|, ±q[j]), 1).
template <int64_t OFF>
inline void signed_row_avx2(const int32_t* xq, const __m256i (&q)[2], __m256i ones,
                            __m256i (&dot)[2]) {
  __m256i xb, ax, t;
  asm("vpbroadcastd %c[o](%[x]), %[xb]\n\t"
      "vpsignb %[xb], %[xb], %[ax]\n\t"
      "vpsignb %[xb], %[q0], %[t]\n\t"
      "vpmaddubsw %[t], %[ax], %[t]\n\t"
      "vpmaddwd %[one], %[t], %[t]\n\t"
      "vpaddd %[t], %[d0], %[d0]\n\t"
      "vpsignb %[xb], %[q1], %[t]\n\t"
      "vpmaddubsw %[t], %[ax], %[t]\n\t"
      "vpmaddwd %[one], %[t], %[t]\n\t"
      "vpaddd %[t], %[d1], %[d1]"
      : [d0] "+x"(dot[0]), [d1] "+x"(dot[1]), [xb] "=&x"(xb), [ax] "=&x"(ax), [t] "=&x"(t)
      : [q0] "x"(q[0]), [q1] "x"(q[1]), [one] "x"(ones), [x] "r"(xq), [o] "i"(OFF * 4),
        "m"(*xq));
}

// A half's stored row t of vector j: 32 bytes at p + t ld + 32 j.
inline __m256i stored_row_avx2(const uint8_t* p, int64_t ld, int64_t t, int64_t j) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + t * ld + 32 * j));
}

// The nibble formats (kNib): a block's 4 stored rows of nibbles, in int16, then vpmaddwd.
template <int F, int64_t P, int64_t NV, int64_t R0>
inline void half_dot_nib_avx2(const int32_t* xq, const uint8_t* p, int64_t ld,
                              __m256i (&dot)[P][NV]) {
  static_assert(NV == 2, "nib_pairs_avx2 takes two vectors");
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(15);
  __m256i sum[P][NV];
  for (auto& row : sum) for (auto& v : row) v = _mm256_setzero_si256();
  unrolled<kSteps<F>>([&](auto t) {
    __m256i lo[NV], hi[NV];
    for (int64_t j = 0; j < NV; ++j) {
      const __m256i v = stored_row_avx2(p, ld, t, j);
      lo[j] = _mm256_and_si256(v, low);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    unrolled<P>([&](auto r) { nib_pairs_avx2<8 * (R0 + r) + 2 * t>(xq, lo, hi, sum[r]); });
  });
  for (int64_t r = 0; r < P; ++r)
    for (int64_t j = 0; j < NV; ++j)
      dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(sum[r][j], ones));
}

// The six-bit and narrow-byte formats (kSix, kNarrowBytes): pairs of byte rows a vpmaddwd.
template <int F, int64_t P, int64_t NV, int64_t G, int64_t R0>
inline void half_dot_pairs_avx2(const int32_t* xq, const uint8_t* p, int64_t ld,
                                __m256i (&dot)[P][NV]) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int64_t t0 = G * kHalfSteps<F>;
  unrolled<kHalfSteps<F> / (kSix<F> ? 1 : 2)>([&](auto tt) {
    __m256i u0[NV], u1[NV];  // two stored rows of bytes, u0's inputs at xq[xi]
    if constexpr (kSix<F>) {  // nibble row t widened to q + 32
      constexpr int64_t t = t0 + tt;
      for (int64_t j = 0; j < NV; ++j)
        widen_six_avx2(stored_row_avx2(p, ld, t, j),
                       stored_row_avx2(p, ld, kSteps<F> + t / 2, j), t, u0[j], u1[j]);
    } else {  // two stored rows of bytes, q + kNarrowBias
      constexpr int64_t t = t0 + 2 * tt;
      const __m256i off = _mm256_set1_epi8(static_cast<char>(128 - kNarrowBias<F>));
      for (int64_t j = 0; j < NV; ++j) {
        u0[j] = _mm256_sub_epi8(stored_row_avx2(p, ld, t, j), off);
        u1[j] = _mm256_sub_epi8(stored_row_avx2(p, ld, t + 1, j), off);
      }
    }
    constexpr int64_t xi = kSix<F> ? 2 * (t0 + tt) : t0 + 2 * tt;
    if constexpr (NV == 2) {  // the six bits' passes (kPassVecs)
      unrolled<P>([&](auto r) { byte_pairs_avx2<8 * (R0 + r) + xi>(xq, u0, u1, ones, dot[r]); });
      return;
    }
    unrolled<P>([&](auto r) {  // the narrow bytes' passes of one vector
      const __m256i a0 = broadcast_ymm_at<8 * (R0 + r) + xi>(xq);
      const __m256i a1 = broadcast_ymm_at<8 * (R0 + r) + xi + 1>(xq);
      for (int64_t j = 0; j < NV; ++j)
        dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(_mm256_add_epi16(
            _mm256_maddubs_epi16(u0[j], a0), _mm256_maddubs_epi16(u1[j], a1)), ones));
    });
  });
}

// The byte formats: bytes taken signed, x's sign moved onto q (block_dot_avx2).
template <int F, int64_t P, int64_t NV, int64_t G, int64_t R0>
inline void half_dot_signed_avx2(const int32_t* xq, const uint8_t* p, int64_t ld,
                                 __m256i (&dot)[P][NV]) {
  static_assert(NV == 2, "signed_row_avx2 takes two vectors");
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int64_t t0 = G * kHalfSteps<F>;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  unrolled<kHalfSteps<F>>([&](auto tt) {
    constexpr int64_t t = t0 + tt;
    __m256i q[NV];
    for (int64_t j = 0; j < NV; ++j) q[j] = _mm256_xor_si256(flip, stored_row_avx2(p, ld, t, j));
    unrolled<P>([&](auto r) { signed_row_avx2<8 * (R0 + r) + t>(xq, q, ones, dot[r]); });
  });
}

// Half G of a block (the block, or kQ6's half): NV vectors of 8 columns' integer dots of
// rows R0 .. R0 + P - 1 (inputs xq [ROWS][8] of 4), added to dot; the weights' stored rows
// at p + t ld, vector j 32 bytes on (p: the pass's first vector). One of the three format
// families' dots above.
template <int F, int64_t P, int64_t NV, int64_t G, int64_t R0>
inline void half_dot_avx2(const int32_t* xq, const uint8_t* p, int64_t ld,
                          __m256i (&dot)[P][NV]) {
  if constexpr (kNib<F>)
    half_dot_nib_avx2<F, P, NV, R0>(xq, p, ld, dot);
  else if constexpr (kSix<F> || kNarrowBytes<F>)
    half_dot_pairs_avx2<F, P, NV, G, R0>(xq, p, ld, dot);
  else
    half_dot_signed_avx2<F, P, NV, G, R0>(xq, p, ld, dot);
}

// Block b's half G for the tile's rows R0 .. ROWS - 1 and vectors J0 .. NV - 1, a pass of
// kPassRows x kPassVecs at a time: their dots, then tile_q's float steps into acc.
template <int F, int64_t ROWS, int64_t NV, int64_t G, int64_t R0 = 0, int64_t J0 = 0>
inline void half_rows_avx2(const uint8_t* rec, const uint8_t* q, const QCol* col,
                           const vfloat* sc, const vfloat* tv, vfloat (&acc)[ROWS][NV]) {
  constexpr int64_t P = std::min(kPassRows<F>, ROWS - R0), V = std::min(kPassVecs<F>, NV - J0);
  const int32_t* xq = reinterpret_cast<const int32_t*>(rec);  // [ROWS][8] of 4 inputs
  const float* sx = reinterpret_cast<const float*>(rec + ROWS * kBlock);
  const int32_t* d0 = reinterpret_cast<const int32_t*>(rec + ROWS * (kBlock + 4));
  const int32_t* d0_lo = reinterpret_cast<const int32_t*>(rec + ROWS * (kBlock + 8));
  __m256i dot[P][V];
  for (int64_t r = 0; r < P; ++r)
    for (int64_t j = 0; j < V; ++j)
      dot[r][j] = _mm256_set1_epi32(avx2_dot_start<F>(d0[R0 + r], d0_lo[R0 + r], G));
  half_dot_avx2<F, P, V, G, R0>(xq, q + 4 * kLanes * J0, col[0].ld, dot);
  for (int64_t r = 0; r < P; ++r) {
    const float s = sx[R0 + r];
    for (int64_t j = 0; j < V; ++j) {
      const vfloat d = __builtin_convertvector((vi32)dot[r][j], vfloat);
      vfloat& out = acc[R0 + r][J0 + j];
      out = kScaled<F> ? out + d * (sc[J0 + j] * s) : out + d * s;
      if constexpr (kMin<F>) out = out + tv[J0 + j] * (s * min_sum<F>(d0[R0 + r]));
    }
  }
  if constexpr (R0 + P < ROWS)
    half_rows_avx2<F, ROWS, NV, G, R0 + P, J0>(rec, q, col, sc, tv, acc);
  else if constexpr (J0 + V < NV)
    half_rows_avx2<F, ROWS, NV, G, 0, J0 + V>(rec, q, col, sc, tv, acc);
}

// ROWS rows (packed records from rec) x NV vectors of 8 columns from col[0]'s column (col:
// each vector's column), into y [ROWS, ldy] at that column; `prefetch`: the weights are cold.
template <int F, int64_t ROWS, int64_t NV>
[[gnu::flatten]] inline void tile_avx2_rows(const uint8_t* rec, int64_t blocks, const QCol* col,
                                            float* y, int64_t ldy, bool accumulate,
                                            bool prefetch) {
  vfloat acc[ROWS][NV] = {};
  const uint8_t* q = col[0].q;
  for (int64_t b = 0; b < blocks; ++b, q += col[0].block, rec += record_bytes(ROWS)) {
    if (prefetch) prefetch_tile<F>(col[0], kLanes * NV, b + kTilePrefetch);
    unrolled<kHalves<F>>([&](auto g) {  // the block, or kQ6's two halves in turn
      vfloat sc[NV], tv[NV];
      for (int64_t j = 0; j < NV; ++j) {
        sc[j] = kScaled<F> ? load_scales<F>(col[j], b, g) : vfloat{} + 1.f;
        tv[j] = kMin<F> ? k_mins_v<F>(col[j], b) : vfloat{};
      }
      half_rows_avx2<F, ROWS, NV, g>(rec, q, col, sc, tv, acc);
    });
  }
  for (int64_t j = 0; j < NV; ++j) {
    const vfloat sw = kScaled<F> ? vfloat{} + 1.f : load_scales<kQInt8>(col[j], 0);
    for (int64_t r = 0; r < ROWS; ++r)
      store_out(y + r * ldy + j * kLanes, kScaled<F> ? acc[r][j] : acc[r][j] * sw, accumulate);
  }
}
#endif

}  // namespace linserve
