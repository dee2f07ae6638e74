// The quantized formats, a weight column's blocks and scales, the activations quantized
// per row to int8 blocks, and prefetching: what every instruction set's tiles share.
// Part of the quantized GEMM: gemm_quant.h includes the parts in order, and its head says
// the formats and the arithmetic every part keeps bit for bit.
#pragma once

#include <atomic>
#include <cmath>
#include <utility>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "fastmath.h"
#include "gemm.h"

namespace linserve {

constexpr int64_t kBlock = 32;  // activation block = int4 group
constexpr int64_t kRowsQuant = 6;  // rows of a many-row tile (a span's group)
// A product of at most this many rows (a decode step's) is one group on VNNI builds, its
// tiles tile_vnni_wide: each weight is read from memory once for all its rows, at an even
// pace. As groups of kRowsQuant, the first group of a column chunk read it from DRAM at
// twice the rate two threads can have (~35 against ~30 GB/s on a Zen 4)
// while the other groups read none: a 16-row LFM2-1.2B int4 step 78-113 -> 74-81 ms.
constexpr int64_t kWideRows = 16;

// Bytes of one block's record of `rows` rows (pack_group).
constexpr int64_t record_bytes(int64_t rows) { return rows * (kBlock + 12); }

typedef uint32_t vu32_ua __attribute__((vector_size(kLanes * 4), aligned(1), __may_alias__));
typedef int32_t vi32 __attribute__((vector_size(kLanes * 4)));

// The stored formats (see the layout above). A kernel is compiled for one, as its template
// argument F: kNib<F> (values as nibbles, 4 stored rows a block, else bytes, 8) and
// kScaled<F> (a scale per block and column, else one fp32 scale per column).
// kMin<F>: the K formats, W = s q + t per block and column (values q as they are stored:
// nibbles 0..15 or bytes q + 128), which hold llama.cpp's Q4_K, Q5_K, Q4_1, Q5_0 and Q5_1
// exactly. kQ6: bytes q + 128 with a scale for each half of a block (16 inputs), which
// holds llama.cpp's Q6_K exactly; its dots are taken a half at a time (kHalves).
// kSuper<F>: scales as one-byte multipliers of a super-block's fp32 pair (kTwoF32's
// formats). kQ4L and kQ8L are stored formats only: their products run kQ4K's and kQ8K's
// kernels (super_blocks: 1).
// kQ6S: kQ6's values in six bits, q + 32 as a nibble (kNib's stored rows) and two high bits
// (kSixRows stored rows more), widened to bytes as they are read (kSix).
enum QFormat : int { kQInt8 = 0, kQInt4 = 1, kQ8 = 2, kQ4K = 3, kQ8K = 4, kQ6 = 5, kQ4L = 6,
                     kQ8L = 7, kQ6S = 8 };
template <int F> constexpr bool kNib = F == kQInt4 || F == kQ4K;
template <int F> constexpr bool kSix = F == kQ6S;
constexpr int64_t kSixRows = 2;
template <int F> constexpr bool kScaled = F != kQInt8;
template <int F> constexpr bool kMin = F == kQ4K || F == kQ8K;
template <int F> constexpr bool kQ6Like = F == kQ6 || F == kQ6S;  // signed multipliers a half
template <int F> constexpr int64_t kHalves = kQ6Like<F> ? 2 : 1;
// Formats with two multipliers a block and column and a super-block's pair (s and t, or
// kQ6's two scales); they run on the VNNI tiles wherever AMX is (not measured on AMX).
template <int F> constexpr bool kTwoF32 = kMin<F> || kQ6Like<F>;

// Whether a stored format keeps super-blocks, and how many blocks one covers.
constexpr bool has_super(int format) { return format >= kQ4K; }
constexpr int64_t super_blocks(int format) { return format == kQ4L || format == kQ8L ? 1 : 8; }

// Bytes of one column's block in the block-scaled formats: its stored rows, then its fp16
// scale (int4, q8) or its two multipliers (the K formats).
constexpr int64_t block_bytes(int format) {
  return format == kQInt4 || format == kQ4K || format == kQ4L ? 18 : format == kQ6S ? 26 : 34;
}

// Bytes of one column's `blocks` blocks: the super-blocks' fp32 pairs, then the blocks.
constexpr int64_t column_bytes(int format, int64_t blocks) {
  return blocks * block_bytes(format) + (has_super(format) ? blocks / super_blocks(format) * 8 : 0);
}

// Whether a stored format is a kChar tensor (quant_format tells q8k and q6 apart by it).
constexpr bool stored_as_char(int format) {
  return format == kQInt8 || format == kQ6 || format == kQ6S;
}

// Stored rows of a block, and those of each half.
template <int F> constexpr int64_t kSteps = kNib<F> || kSix<F> ? kBlock / 8 : kBlock / 4;
template <int F> constexpr int64_t kHalfSteps = kSteps<F> / kHalves<F>;

// kQ6S's values q + 32 of nibble row t (inputs 8t + 4 half .. 8t + 4 half + 3, a byte each)
// from the row's nibbles v and its high-bit row h (row kSteps + t / 2): one column's
// uint32_t, or a vector of them.
template <typename U>
inline U six_bits(U v, U h, int64_t t, int64_t half) {
  const U nib = (v >> (4 * half)) & 0x0F0F0F0Fu;
  return nib | (((h >> (4 * (t & 1) + 2 * half)) & 0x03030303u) << 4);
}

// A dot product's starting value: the offset's correction d0 = -o Σ x_q (so the dot is of
// q = stored - o), except Q4K's nibbles, which are q as they are (the correction then
// gives Σ x_q for the t term: min_sum).
template <int F>
constexpr int32_t dot_start(int32_t d0) { return F == kQ4K ? 0 : d0; }

// Half g's starting value: kQ6's halves take the correction of their own 16 inputs (d0_lo
// = -128 Σ of the first 16 x_q), every other format the block's (one half).
// (kQ6S's values are q + 32: the correction over 4, exact.)
template <int F>
constexpr int32_t half_start(int32_t d0, int32_t d0_lo, int64_t g) {
  if constexpr (kSix<F>) return (g == 0 ? d0_lo : d0 - d0_lo) / 4;
  if constexpr (kHalves<F> == 2) return g == 0 ? d0_lo : d0 - d0_lo;
  return dot_start<F>(d0);
}

// Σ x_q of a row's block from its correction d0 = -o Σ x_q (o = 8 or 128: exact).
template <int F>
inline float min_sum(int32_t d0) { return static_cast<float>(d0) * (kNib<F> ? -0.125f : -0.0078125f); }

// A quantized weight: its bytes, N, K32, and which format (QFormat).
struct QuantWeights {
  const uint8_t* base;
  int64_t n, k32;
  int format;
};

// Where column c's values live, valid for the columns from c to the end of c's panel: the
// bytes of stored row t of block b at q + b block + t ld; int4's scale of block b at
// s + b block (fp16), int8's at s (fp32); the K formats' first multiplier of block b at
// s + b block, its second to_t bytes on, and its super-block's d at sup + (b >> shift)
// sup_ld, e to_t floats on.
struct QCol {
  const uint8_t* q;
  int64_t ld, block;
  const void* s;
  int64_t to_t = 0;
  const float* sup = nullptr;
  int64_t sup_ld = 0;
  int shift = 0;
};

inline QCol column(const QuantWeights& w, int64_t c) {
  const int64_t p0 = c / kPanel * kPanel, width = std::min(kPanel, w.n - p0);
  if (w.format == kQInt8) {
    const uint8_t* q = w.base + p0 * w.k32 + (c - p0) * 4;  // panels [K32 / 4, width, 4]
    return {q, width * 4, 8 * width * 4, w.base + w.n * w.k32 + c * 4};
  }
  const int64_t bb = block_bytes(w.format), blocks = w.k32 / kBlock;
  const uint8_t* panel = w.base + p0 * column_bytes(w.format, blocks);
  if (has_super(w.format)) {
    const int64_t sb = super_blocks(w.format);
    const uint8_t* first = panel + blocks / sb * 8 * width;  // past the pairs
    return {first + (c - p0) * 4, width * 4, bb * width, first + (bb - 2) * width + (c - p0),
            width, reinterpret_cast<const float*>(panel) + (c - p0), 2 * width, sb == 8 ? 3 : 0};
  }
  return {panel + (c - p0) * 4, width * 4, bb * width, panel + (bb - 2) * width + (c - p0) * 2};
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// int4's and q8's fp16 scales of block b, from a column's QCol.
inline const uint16_t* group_scales(const QCol& col, int64_t b) {
  return reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(col.s) + b * col.block);
}

// The K formats' multipliers i (0: s's or the first half's, 1: t's or the second half's) of
// block b, for the columns from col's (signed for kQ6).
inline const uint8_t* multipliers(const QCol& col, int64_t b, int64_t i) {
  return static_cast<const uint8_t*>(col.s) + b * col.block + i * col.to_t;
}
template <int F>
inline float multiplier(const uint8_t* p) {
  return kQ6Like<F> ? static_cast<float>(static_cast<int8_t>(*p)) : static_cast<float>(*p);
}

// Block b's super-block pair's d (e = 0) or e (e = 1), for the columns from col's.
inline const float* super_pair(const QCol& col, int64_t b, int64_t e) {
  return col.sup + (b >> col.shift) * col.sup_ld + e * col.to_t;
}

// The K formats' scale i of block b for col's column (s, or kQ6's half i: m d), and its t
// (m_t e): exact products.
template <int F>
inline float k_scale(const QCol& col, int64_t b, int64_t i = 0) {
  return multiplier<F>(multipliers(col, b, i)) * *super_pair(col, b, 0);
}
template <int F>
inline float k_min(const QCol& col, int64_t b) {
  return multiplier<F>(multipliers(col, b, 1)) * *super_pair(col, b, 1);
}

// kLanes one-byte multipliers from m as floats (exact). On AVX2 two instructions and a
// convert: the element loop compiled to a load, a convert and an insert a lane, per block and
// column vector of every tile.
template <int F>
inline vfloat multipliers_v(const uint8_t* m) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m));
  const __m256 v = _mm256_cvtepi32_ps(kQ6Like<F> ? _mm256_cvtepi8_epi32(bytes)
                                                 : _mm256_cvtepu8_epi32(bytes));
  vfloat out;
  std::memcpy(&out, &v, sizeof(out));
  return out;
#else
  vfloat v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = multiplier<F>(m + l);
  return v;
#endif
}

// kLanes of them, for the columns from col's.
template <int F>
inline vfloat k_scales_v(const QCol& col, int64_t b, int64_t i) {
  return multipliers_v<F>(multipliers(col, b, i)) * load_w(super_pair(col, b, 0));
}
template <int F>
inline vfloat k_mins_v(const QCol& col, int64_t b) {
  return multipliers_v<F>(multipliers(col, b, 1)) * load_w(super_pair(col, b, 1));
}

// x [B, K] quantized per row and block of kBlock inputs (zeros past K).
struct QuantActs {
  int64_t k32 = 0, blocks = 0;
  std::vector<int8_t> q;       // [B, K32]
  std::vector<float> scale;    // [B, blocks]: s_b
  std::vector<int32_t> bias;   // [B, blocks]: -o Σ_b x_q
  std::vector<int32_t> bias_lo;  // [B, blocks]: -o Σ x_q over the block's first 16 inputs
  int64_t group = kRowsQuant;   // rows a span (and a packed record) holds
  std::vector<uint8_t> packed;  // VNNI builds: [B / group, blocks, record] (pack_group)
  const int8_t* block(int64_t r, int64_t b) const { return q.data() + r * k32 + b * kBlock; }
  float s(int64_t r, int64_t b) const { return scale[r * blocks + b]; }
  int32_t d0(int64_t r, int64_t b) const { return bias[r * blocks + b]; }
  int32_t d0_lo(int64_t r, int64_t b) const { return bias_lo[r * blocks + b]; }
  // The records of the group of rows from r0 (a multiple of group).
  const uint8_t* records(int64_t r0) const {
    return packed.data() + r0 / group * blocks * record_bytes(group);
  }
};

// The many-row tiles' layout of `rows` rows from r0 (tile_vnni_rows): per block, a record
// of their quantized inputs [rows][32] int8, their scales s_b [rows] fp32, then their
// offset sums [rows] int32 and those of the first 16 inputs [rows] int32, so one pointer
// serves every row at constant offsets.
inline void pack_group(const QuantActs& a, int64_t r0, int64_t rows, uint8_t* out) {
  for (int64_t b = 0; b < a.blocks; ++b) {
    uint8_t* rec = out + b * record_bytes(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const float sx = a.s(r0 + r, b);
      const int32_t d0 = a.d0(r0 + r, b), d0_lo = a.d0_lo(r0 + r, b);
      std::memcpy(rec + r * kBlock, a.block(r0 + r, b), kBlock);
      std::memcpy(rec + rows * kBlock + 4 * r, &sx, sizeof(sx));
      std::memcpy(rec + rows * (kBlock + 4) + 4 * r, &d0, sizeof(d0));
      std::memcpy(rec + rows * (kBlock + 8) + 4 * r, &d0_lo, sizeof(d0_lo));
    }
  }
}

// One block of kBlock inputs (zeros past n) -> q, returns its scale; *sum = the q's sum,
// *sum_lo = that of the first 16.
inline float quantize_block(const float* x, int64_t n, int8_t* q, int32_t* sum,
                            int32_t* sum_lo) {
  float buf[kBlock] = {};
  std::memcpy(buf, x, n * sizeof(float));
  // the CPU's own vectors (fastmath.h's vpart): a v16 went through the stack on AVX2; a max
  // and integer sums, so the lanes' count changes no bit
  vpart top = {};
  for (int64_t i = 0; i < kBlock; i += kPartLanes) {
    const vpart v = load_part(buf + i);
    const vpart a = v < 0 ? -v : v;
    top = a > top ? a : top;  // (a NaN is passed over, as std::max(amax, NaN) does)
  }
  float amax = 0.f;
  for (int64_t i = 0; i < kPartLanes; ++i) amax = std::max(amax, top[i]);
  const float s = amax / 127.f;
  int32_t total = 0, first = 0;
  if (s > 0.f) {
    typedef int32_t vpi __attribute__((vector_size(sizeof(vpart))));
    typedef int8_t vpc __attribute__((vector_size(kPartLanes)));
    const vpart magic = vpart{} + 12582912.f, hi = vpart{} + 127.f, zero = {};  // 1.5 2^23
    vpi acc = {};
    for (int64_t i = 0; i < kBlock; i += kPartLanes) {
      vpart v = load_part(buf + i) / s;
      v = (v + magic) - magic;  // to nearest, ties to even, as nearbyint (|v| <= 127.5)
      v = v == v ? v : zero;    // NaN: 0
      v = v > hi ? hi : (v < -hi ? -hi : v);
      const vpi qi = __builtin_convertvector(v, vpi);
      const vpc qc = __builtin_convertvector(qi, vpc);
      std::memcpy(q + i, &qc, sizeof(qc));
      if (i < 16)
        for (int64_t l = 0; l < kPartLanes; ++l) first += qi[l];
      acc += qi;
    }
    for (int64_t i = 0; i < kPartLanes; ++i) total += acc[i];
  }
  *sum = total;
  *sum_lo = first;
  return s;
}

// Every group of a.group rows into a.packed, once per product (a span used to pack its
// rows again for every chunk of columns); `grain`: groups a task takes at least.
inline void pack_groups(QuantActs& a, int64_t rows, int64_t grain) {
  const int64_t groups = (rows + a.group - 1) / a.group;
  const int64_t group_bytes = a.blocks * record_bytes(a.group);
  a.packed.resize(groups * group_bytes);
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      pack_group(a, g * a.group, std::min(a.group, rows - g * a.group),
                 a.packed.data() + g * group_bytes);
  });
}

// Inputs a task of quantize_acts takes at least (fewer rows stay on the calling thread).
constexpr int64_t kQuantizeRowsPerTask = 1 << 16;

inline QuantActs quantize_acts(const float* x, int64_t rows, int64_t k_len, int32_t offset) {
  QuantActs a;
  a.k32 = (k_len + kBlock - 1) / kBlock * kBlock;
  a.blocks = a.k32 / kBlock;
  const int64_t padded = (rows + 15) / 16 * 16;  // zero rows for gemm_quant_amx.h's tiles
  a.q.assign(padded * a.k32, 0);
  a.scale.assign(padded * a.blocks, 0.f);
  a.bias.assign(padded * a.blocks, 0);
  a.bias_lo.assign(padded * a.blocks, 0);
  // Rows on the threads when there are many (a prefill chunk's 512 rows took 4% of an int4
  // prefill on one thread while the other waited); each row's bits are its own.
  const int64_t grain = std::max<int64_t>(1, kQuantizeRowsPerTask / a.k32);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int64_t k0 = b * kBlock, n = std::min(kBlock, k_len - k0);
        int32_t sum = 0, sum_lo = 0;
        a.scale[r * a.blocks + b] =
            quantize_block(x + r * k_len + k0, n, a.q.data() + r * a.k32 + k0, &sum, &sum_lo);
        a.bias[r * a.blocks + b] = -offset * sum;
        a.bias_lo[r * a.blocks + b] = -offset * sum_lo;
      }
    }
  });
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (rows <= kWideRows) a.group = rows;  // one wide group (see kWideRows)
  if (rows > 1) pack_groups(a, rows, std::max<int64_t>(1, grain / a.group));  // 1: GEMV
#elif defined(__AVX2__) && !defined(__AVX512F__)
  pack_groups(a, rows, std::max<int64_t>(1, grain / a.group));  // (tile_avx2_rows: any rows)
#endif
  return a;
}

// kLanes scales of a column vector: int8's fp32 ones, or int4's of block b widened.
template <int F>
inline vfloat load_scales(const QCol& col, int64_t b, int64_t g = 0) {
  if (!kScaled<F>) return load_w(static_cast<const float*>(col.s));
  if constexpr (kTwoF32<F>) return k_scales_v<F>(col, b, g);
  const uint16_t* s = group_scales(col, b);
  vfloat out;
#if defined(__AVX2__) && !defined(__AVX512F__) && defined(__F16C__)
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  std::memcpy(&out, &v, sizeof(out));  // (exact, as half_to_float)
#else
  for (int64_t i = 0; i < kLanes; ++i) out[i] = half_to_float(s[i]);
#endif
  return out;
}

// ``v`` arrives as a product (acc times the scales); the volatile round trip keeps it one,
// rounded, before the add: otherwise the compiler fused product and add into an FMA in some
// tile shapes and not in others, and a row's bits changed with its batch (seen on AVX2).
inline void store_out(float* out, vfloat v, bool accumulate) {
  if (accumulate) {
    volatile vfloat product = v;
    v = load_w(out) + product;
  }
  std::memcpy(out, &v, sizeof(v));
}

// f(std::integral_constant<int64_t, i>{}) for i = 0 .. N - 1, unrolled (i a constant).
template <typename F, size_t... I>
inline void unrolled(F&& f, std::index_sequence<I...>) {
  (f(std::integral_constant<int64_t, static_cast<int64_t>(I)>{}), ...);
}
template <int64_t N, typename F>
inline void unrolled(F&& f) { unrolled(f, std::make_index_sequence<N>{}); }


// ---- Prefetching the weights a tile reads ------------------------------------------------
// The weights are prefetched ahead of the loads: their vector loads alone kept too few reads
// in flight, as gemm_amx.h's tiles. A VNNI GEMV (one row, 8 vectors) prefetches both panels'
// whole block kQuantPrefetch blocks ahead (prefetch_block): 4 read a little faster than 2, 8
// no faster. Every tile of the generic path (its int8 GEMV on AVX2 read 10-20% faster), and
// the VNNI and AVX2 tiles of more rows where their weights are cold (quant_rows), prefetch
// their own lines kTilePrefetch blocks ahead (prefetch_tile; a tile of NV vectors
// 2 kTilePrefetch / NV: the same bytes ahead, as a whole panel's tile reads twice a half
// panel's a block). Without
// it a 16-row step's tiles read int4 weights from DRAM at 5 GB/s a thread, bound by the
// latency of their loads (16 rows of 2048 x 16384 on two threads: 178 -> 443 GMAC/s).
// Where they point never changes the arithmetic, and a prefetch past the
// weight's end never faults.
constexpr int64_t kQuantPrefetch = 4;
constexpr int64_t kTilePrefetch = 16;

// prefetcht0 of p's line; never faults, wherever p points. Inline asm on x86, not
// _mm_prefetch: GCC 12 left the builtin out of the many-row VNNI tiles altogether (no
// prefetcht0 in the object).
inline void prefetch_line(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// The lines [p, p + bytes).
inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + bytes;
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < end; a += 64)
    prefetch_line(reinterpret_cast<const void*>(a));
}

// The lines of block b that a tile of `columns` columns from col reads (within one panel):
// each stored row's 4 bytes a column, and int4's fp16 scales.
template <int F>
inline void prefetch_tile(const QCol& col, int64_t columns, int64_t b) {
  for (int64_t t = 0; t < kSteps<F> + (kSix<F> ? kSixRows : 0); ++t)
    prefetch_bytes(col.q + b * col.block + t * col.ld, 4 * columns);
  if constexpr (kTwoF32<F>) {
    prefetch_bytes(multipliers(col, b, 0), col.to_t + columns);
    prefetch_bytes(reinterpret_cast<const uint8_t*>(super_pair(col, b, 0)), 4 * (col.to_t + columns));
  } else if constexpr (kScaled<F>) {
    prefetch_bytes(reinterpret_cast<const uint8_t*>(group_scales(col, b)), 2 * columns);
  }
}

}  // namespace linserve
