// int8 and int4 GEMMs: y [B, N] (+)= x [B, K] @ dequant(Q), integer dot products with the
// activations quantized per row to int8 in blocks of 32 (llama.cpp's Q8_0 rule, as its
// Q8_0 and Q4_0 dot products do), fp32 accumulation across blocks (``--quantization``).
//
// Why integers for the activations too: with the weights widened to bf16 for vdpbf16ps, a
// batch-1 step was bound by the widening (int4: a table lookup per 32 weights), not by the
// memory it reads (0.71 of the read roofline). vpdpbusd takes bytes as they are stored: 64
// products an instruction, twice vdpbf16ps's, and an int4 nibble needs one AND (and a shift).
//
// Weights (built by pack_quantized, from model/quantize.py's q and scales):
// - int8 (a kChar tensor): q [K, N] in [-127, 127], one fp32 scale per output column,
//   W[k, n] = q[k, n] s[n]. Stored as bytes q + 128.
// - int4 (a kByte tensor): q [K, N] in [-8, 7], an fp16 scale per group of 32 inputs and
//   column, W[k, n] = q[k, n] s[k / 32, n] (llama.cpp's Q4_0 without its blocks). Stored as
//   nibbles q + 8.
// - q8 (a kByte tensor): q [K, N] in [-127, 127], an fp16 scale per group of 32 inputs and
//   column, W[k, n] = q[k, n] s[k / 32, n]: llama.cpp's Q8_0 blocks, their values as they
//   are (a GGUF file's Q8_0 matrices run on them). Stored as bytes q + 128.
// - the K formats, for a GGUF file's K-quants and legacy blocks as they are: q4k (Q4_K):
//   nibbles q in [0, 15], W[k, n] = s[b, n] q + t[b, n] per block b of 32; q8k (Q5_K): the
//   same with bytes q + 128; q6 (Q6_K): bytes q + 128, W = s_h[b, n] q with a scale for each
//   half of a block (16 inputs). Their scales are stored as the file has them: a one-byte
//   multiplier per block (s = m_s d, t = m_t e; q6: s_h = m_h d, signed) of an fp32 pair
//   (d, e) per super-block of 8 blocks (llama.cpp's 256 inputs). Every product m d is exact
//   in fp32 (an fp16 d times a 6- or 8-bit integer), so the kernels' s and t are the values
//   gguf-py dequantizes with, bit for bit. q6s (Q6_K in six bits): q6's values as q + 32 in
//   a nibble and two high bits (kSix). q4l (Q4_1) and q8l (Q5_0, Q5_1): q4k's and q8k's
//   kernels with a super-block of one block (multipliers 1, (d, e) = the block's s and t).
// Layout: K padded to K32 (a multiple of 32) with zero weights; in gemm.h's column panels,
// each (stored row, column) one 32-bit lane of four bytes, so a 64-byte load is 16 columns x
// 4 inputs, vpdpbusd's operand:
// - int8: stored row t holds inputs 4t .. 4t+3, one a byte: panels [K32 / 4, width, 4],
//   then the fp32 scales [N]; shape [K32 / 4 + 1, N, 4].
// - int4: stored row t holds inputs 8t .. 8t+3 in the low nibbles and 8t+4 .. 8t+7 in the
//   high ones. A panel is K / 32 blocks, each its four stored rows [4, width, 4] and then
//   its fp16 scales [width]: 18 bytes a column and block, read front to back in one stream
//   (scales kept apart, [K / 32, N], cost a tenth of a GEMV's time on the 250k-column head:
//   a page a block). Shape [ceil(9 K / 64), N, 4] (zeros pad the end).
// - q8: as int4, a block's eight stored rows of bytes (row t: inputs 4t .. 4t+3) [8, width,
//   4] and then its fp16 scales [width]: 34 bytes a column and block, Q8_0's own size.
//   Shape [ceil(17 K / 64), N, 4].
// - q4k, q8k, q6 (and q4l, q8l): a panel starts with its super-blocks' pairs [K / 256][2]
//   [width] fp32 (d, then e), then its blocks as int4's / q8's, each block's stored rows then
//   its two multipliers [width] bytes (m_s then m_t, or q6's two halves'): 18 or 34 bytes a
//   column and block, plus 8 a super-block (4.75 bits a weight for Q4_K's 4.5, 8.75 for
//   Q6_K's 6.56; the fp32 s and t a block took 6 and 10). q6s's block: four stored rows of
//   nibbles as int4's (the low 4 bits of q + 32), then two stored rows of high bits (row u,
//   byte i: bits 4s + 2h .. 4s + 2h + 1 the top two of input 8 (2u + s) + 4h + i), then its
//   multipliers: 26 bytes, 6.75 bits a weight. q6 and q6s are kChar tensors (q8k, kByte, has
//   q6's size): quant_format.
//
// Activations (quantize_acts): per row and block b of 32 inputs, s_b = max |x| / 127 and
// x_q = round(x / s_b) (to nearest even), in [-127, 127]; model/quantize.py's
// ``quantize_activations`` is the same rule in PyTorch, the tests' reference.
//
// Arithmetic, for every element whatever the batch (so batch-invariant, gemm.h):
// d_b = Σ_{k in b} (q[k, n] + o) x_q[k] - o Σ_{k in b} x_q[k] (o = 128 or 8: exact, int32);
// int8: f = f + d_b s_b (b in order), y = f s[n]; int4 and q8: f = f + d_b (s_b s[b, n]),
// y = f; the K formats: f = f + d_b (s_b s[b, n]) + t[b, n] (s_b Σ x_q), with d_b over q as
// stored (q4k's dot starts at 0); q6: f = f + d_lo (s_b s_lo) + d_hi (s_b s_hi).
// Integer sums are exact, so only the float steps' order matters, and it is fixed.
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

// ---- The generic path (any -march): ROWS rows x NV vectors of kLanes columns from c -------
template <int F, int64_t ROWS, int64_t NV>
inline void tile_q(const QuantActs& a, const Span& s, const QuantWeights& w, int64_t c) {
  QCol col[NV];
  for (int64_t j = 0; j < NV; ++j) col[j] = column(w, c + j * kLanes);
  vfloat acc[ROWS][NV] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    prefetch_tile<F>(col[0], kLanes * NV, b + kTilePrefetch);
    for (int64_t g = 0; g < kHalves<F>; ++g) {  // the block, or kQ6's two halves in turn
      const int64_t t0 = g * kHalfSteps<F>, t1 = t0 + kHalfSteps<F>;
      vi32 dot[ROWS][NV];
      for (int64_t r = 0; r < ROWS; ++r)
        for (int64_t j = 0; j < NV; ++j)
          dot[r][j] = vi32{} + (kAvx2Dot ? avx2_dot_start<F>(
              a.d0(s.r0 + r, b), a.d0_lo(s.r0 + r, b), g) : half_start<F>(
              a.d0(s.r0 + r, b), a.d0_lo(s.r0 + r, b), g));
      if constexpr (kAvx2Dot) block_dot_avx2<F, ROWS, NV>(a, s.r0, col, b, dot, t0, t1);
      for (int64_t t = t0; t < (kAvx2Dot ? t0 : t1); ++t) {
        vu32 v[NV], v6[NV];  // (kQ6S: v the low inputs' values q + 32, v6 the high ones')
        for (int64_t j = 0; j < NV; ++j) {
          const uint8_t* p = col[j].q + b * col[j].block;
          v[j] = *reinterpret_cast<const vu32_ua*>(p + t * col[j].ld);
          if constexpr (kSix<F>) {
            const vu32 h = *reinterpret_cast<const vu32_ua*>(p + (kSteps<F> + t / 2) * col[j].ld);
            v6[j] = six_bits(v[j], h, t, 1);
            v[j] = six_bits(v[j], h, t, 0);
          }
        }
        for (int64_t i = 0; i < 4; ++i) {
          for (int64_t r = 0; r < ROWS; ++r) {
            const int8_t* xq = a.block(s.r0 + r, b);
            for (int64_t j = 0; j < NV; ++j) {
              if (kSix<F>) {
                dot[r][j] += (vi32)((v[j] >> (8 * i)) & 255u) * xq[8 * t + i];
                dot[r][j] += (vi32)((v6[j] >> (8 * i)) & 255u) * xq[8 * t + 4 + i];
              } else if (kNib<F>) {
                dot[r][j] += (vi32)((v[j] >> (8 * i)) & 15u) * xq[8 * t + i];
                dot[r][j] += (vi32)((v[j] >> (8 * i + 4)) & 15u) * xq[8 * t + 4 + i];
              } else {
                dot[r][j] += (vi32)((v[j] >> (8 * i)) & 255u) * xq[4 * t + i];
              }
            }
          }
        }
      }
      for (int64_t j = 0; j < NV; ++j) {
        const vfloat sc = kScaled<F> ? load_scales<F>(col[j], b, g) : vfloat{} + 1.f;
        const vfloat tv = kMin<F> ? k_mins_v<F>(col[j], b) : vfloat{};
        for (int64_t r = 0; r < ROWS; ++r) {
          const vfloat d = __builtin_convertvector(dot[r][j], vfloat);
          const float sx = a.s(s.r0 + r, b);
          acc[r][j] = kScaled<F> ? acc[r][j] + d * (sc * sx) : acc[r][j] + d * sx;
          if constexpr (kMin<F>)
            acc[r][j] = acc[r][j] + tv * (sx * min_sum<F>(a.d0(s.r0 + r, b)));
        }
      }
    }
  }
  for (int64_t j = 0; j < NV; ++j) {
    const vfloat sw = kScaled<F> ? vfloat{} + 1.f : load_scales<kQInt8>(col[j], 0);
    for (int64_t r = 0; r < ROWS; ++r)
      store_out(s.y + r * s.n + c + j * kLanes, kScaled<F> ? acc[r][j] : acc[r][j] * sw,
                s.accumulate);
  }
}

// A block's (or half g's) weight scale of one column, as the tiles widen it.
template <int F>
inline float column_scale(const QCol& col, int64_t b, int64_t g) {
  if constexpr (kTwoF32<F>) return k_scale<F>(col, b, g);
  return half_to_float(*group_scales(col, b));
}

// The last N % kLanes columns, one element at a time, with the same arithmetic.
template <int F>
inline void scalar_quant_columns(const QuantActs& a, const Span& s, const QuantWeights& w,
                                 int64_t rows, int64_t c) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t cc = 0; cc < s.c1 - c; ++cc) {
      const QCol col = column(w, c + cc);
      float f = 0.f;
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int8_t* xq = a.block(s.r0 + r, b);
        const float sx = a.s(s.r0 + r, b);
        for (int64_t g = 0; g < kHalves<F>; ++g) {
          int32_t d = half_start<F>(a.d0(s.r0 + r, b), a.d0_lo(s.r0 + r, b), g);
          for (int64_t t = g * kHalfSteps<F>; t < (g + 1) * kHalfSteps<F>; ++t) {
            const uint8_t* lane = col.q + b * col.block + t * col.ld;
            for (int64_t i = 0; i < 4; ++i) {
              if (kSix<F>) {
                const uint32_t v = lane[i];
                const uint32_t h = col.q[b * col.block + (kSteps<F> + t / 2) * col.ld + i];
                d += static_cast<int32_t>(six_bits(v, h, t, 0)) * xq[8 * t + i] +
                     static_cast<int32_t>(six_bits(v, h, t, 1)) * xq[8 * t + 4 + i];
              } else if (kNib<F>) {
                d += (lane[i] & 15) * xq[8 * t + i] + (lane[i] >> 4) * xq[8 * t + 4 + i];
              } else {
                d += lane[i] * xq[4 * t + i];
              }
            }
          }
          f = kScaled<F> ? f + static_cast<float>(d) * (column_scale<F>(col, b, g) * sx)
                         : f + static_cast<float>(d) * sx;
          if constexpr (kMin<F>)
            f = f + k_min<F>(col, b) * (sx * min_sum<F>(a.d0(s.r0 + r, b)));
        }
      }
      const volatile float out = kScaled<F> ? f : f * *static_cast<const float*>(col.s);
      float* y = s.y + r * s.n + c + cc;
      *y = s.accumulate ? *y + out : out;
    }
  }
}

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

// Half G of a block (the block, or kQ6's half): NV vectors of 8 columns' integer dots of
// rows R0 .. R0 + P - 1 (inputs xq [ROWS][8] of 4), added to dot; the weights' stored rows
// at p + t ld, vector j 32 bytes on.
template <int F, int64_t P, int64_t NV, int64_t G, int64_t R0>
inline void half_dot_avx2(const int32_t* xq, const uint8_t* p, int64_t ld,
                          __m256i (&dot)[P][NV]) {  // (p: the pass's first vector)
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int64_t t0 = G * kHalfSteps<F>;
  const auto at = [&](int64_t t, int64_t j) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + t * ld + 32 * j));
  };
  if constexpr (kNib<F>) {  // a block's 4 stored rows of nibbles, in int16, then vpmaddwd
    static_assert(NV == 2, "nib_pairs_avx2 takes two vectors");
    const __m256i low = _mm256_set1_epi8(15);
    __m256i sum[P][NV];
    for (auto& row : sum) for (auto& v : row) v = _mm256_setzero_si256();
    unrolled<kSteps<F>>([&](auto t) {
      __m256i lo[NV], hi[NV];
      for (int64_t j = 0; j < NV; ++j) {
        const __m256i v = at(t, j);
        lo[j] = _mm256_and_si256(v, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      unrolled<P>([&](auto r) { nib_pairs_avx2<8 * (R0 + r) + 2 * t>(xq, lo, hi, sum[r]); });
    });
    for (int64_t r = 0; r < P; ++r)
      for (int64_t j = 0; j < NV; ++j)
        dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(sum[r][j], ones));
  } else if constexpr (kSix<F> || kNarrowBytes<F>) {  // pairs of byte rows a vpmaddwd
    unrolled<kHalfSteps<F> / (kSix<F> ? 1 : 2)>([&](auto tt) {
      __m256i u0[NV], u1[NV];  // two stored rows of bytes, u0's inputs at xq[xi]
      if constexpr (kSix<F>) {  // nibble row t widened to q + 32
        constexpr int64_t t = t0 + tt;
        for (int64_t j = 0; j < NV; ++j)
          widen_six_avx2(at(t, j), at(kSteps<F> + t / 2, j), t, u0[j], u1[j]);
      } else {  // two stored rows of bytes, q + kNarrowBias
        constexpr int64_t t = t0 + 2 * tt;
        const __m256i off = _mm256_set1_epi8(static_cast<char>(128 - kNarrowBias<F>));
        for (int64_t j = 0; j < NV; ++j) {
          u0[j] = _mm256_sub_epi8(at(t, j), off);
          u1[j] = _mm256_sub_epi8(at(t + 1, j), off);
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
  } else {  // bytes taken signed, x's sign moved onto q (block_dot_avx2)
    static_assert(NV == 2, "signed_row_avx2 takes two vectors");
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    unrolled<kHalfSteps<F>>([&](auto tt) {
      constexpr int64_t t = t0 + tt;
      __m256i q[NV];
      for (int64_t j = 0; j < NV; ++j) q[j] = _mm256_xor_si256(flip, at(t, j));
      unrolled<P>([&](auto r) { signed_row_avx2<8 * (R0 + r) + t>(xq, q, ones, dot[r]); });
    });
  }
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

template <int F, int64_t ROWS>
inline void span_rows_quant(const QuantActs& a, const Span& s, const QuantWeights& w,
                            bool cold = true) {
  int64_t c = s.c0;
#if defined(__AVX2__) && !defined(__AVX512F__)
  for (; c + kVecs * kLanes <= s.c1; c += kVecs * kLanes) {  // whole panels from the records
    QCol col[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) col[j] = column(w, c + j * kLanes);
    tile_avx2_rows<F, ROWS, kVecs>(a.records(s.r0), a.blocks, col, s.y + c, s.n,
                                   s.accumulate, cold);
  }
#endif
  (void)cold;
  for (; c + kVecs * kLanes <= s.c1; c += kVecs * kLanes) tile_q<F, ROWS, kVecs>(a, s, w, c);
  // The last single vectors one row at a time: a narrow tile's arithmetic changed with the
  // number of rows it held, so a row's last columns depended on its batch (seen on AVX2).
  for (; c + kLanes <= s.c1; c += kLanes) {
    for (int64_t r = 0; r < ROWS; ++r) {
      Span one = s;
      one.r0 = s.r0 + r;
      one.x = s.x + r * s.k_len;
      one.y = s.y + r * s.n;
      tile_q<F, 1, 1>(a, one, w, c);
    }
  }
  if (c < s.c1) scalar_quant_columns<F>(a, s, w, ROWS, c);
}

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
inline int64_t quant_rows_of(int64_t k_len, int format) {
  const int64_t k32 = (k_len + kBlock - 1) / kBlock * kBlock;
  if (format == kQInt8) return k32 / 4 + 1;
  return (column_bytes(format, k32 / kBlock) + 3) / 4;
}

// Whether a format can hold K inputs: K a multiple of 32 (256 for the K-quants' super-blocks).
inline bool holds(int format, int64_t k_len) {
  return k_len % (kBlock * (has_super(format) ? super_blocks(format) : 1)) == 0;
}

// Which format a stored weight of K inputs is in (pack_quantized), told apart by dtype and
// stored rows: int8, q6 and q6s are kChar tensors, the other block-scaled formats kByte (q8k and
// q6 take the same bytes a block). -1: none.
inline int quant_format(const at::Tensor& w, int64_t k_len) {
  if (w.dim() != 3 || w.size(2) != 4) return -1;
  if (w.scalar_type() == at::kChar) {
    if (w.size(0) == quant_rows_of(k_len, kQInt8)) return kQInt8;
    if (holds(kQ6, k_len) && w.size(0) == quant_rows_of(k_len, kQ6)) return kQ6;
    return holds(kQ6S, k_len) && w.size(0) == quant_rows_of(k_len, kQ6S) ? kQ6S : -1;
  }
  if (w.scalar_type() != at::kByte) return -1;
  for (const int f : {kQInt4, kQ8, kQ4K, kQ8K, kQ4L, kQ8L})
    if (holds(f, k_len) && w.size(0) == quant_rows_of(k_len, f)) return f;
  return -1;
}

// y = a @ dequant(w) (or y +=): a [B, K] fp32, y [B, N] fp32, w from pack_quantized.
inline void quant_mm(const at::Tensor& a, const at::Tensor& w, at::Tensor& y, bool accumulate) {
  const int64_t rows = a.size(0), k_len = a.size(1), n = w.size(1);
  const int format = quant_format(w, k_len);
  TORCH_CHECK(format >= 0 && y.size(1) == n, "quant_mm: the weight does not match the activations");
  const QuantWeights qw{reinterpret_cast<const uint8_t*>(w.data_ptr()), n,
                        (k_len + kBlock - 1) / kBlock * kBlock, format};
  const float* x = a.data_ptr<float>();
  const bool nib = format == kQInt4 || format == kQ4K || format == kQ4L;
  const QuantActs acts = quantize_acts(x, rows, k_len, nib ? 8 : 128);
  float* out = y.data_ptr<float>();
  switch (format) {
    case kQInt4: return quant_rows<kQInt4>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ8: return quant_rows<kQ8>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ4K: case kQ4L: return quant_rows<kQ4K>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ8K: case kQ8L: return quant_rows<kQ8K>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ6: return quant_rows<kQ6>(acts, x, qw, out, rows, k_len, accumulate);
    case kQ6S: return quant_rows_six(acts, x, qw, out, rows, k_len, accumulate);
    default: return quant_rows<kQInt8>(acts, x, qw, out, rows, k_len, accumulate);
  }
}

// A tensor's bytes by index whatever its strides: q [K, N] and the scales' parts [P, K / 32,
// N] may be transposed views (a GGUF matrix's blocks unpack as [N, K]; copying them into
// [K, N] first, a byte transpose of a 250k-column head, took seconds of a load).
struct StridedBytes {
  const uint8_t* p;
  int64_t s0, s1, s2, e;  // strides in elements, element size in bytes
  const uint8_t* at(int64_t i, int64_t j, int64_t k = 0) const {
    return p + (i * s0 + j * s1 + k * s2) * e;
  }
};

inline StridedBytes strided(const at::Tensor& t) {
  const int64_t d = t.dim();
  return {static_cast<const uint8_t*>(t.data_ptr()), t.stride(0), t.stride(1),
          d > 2 ? t.stride(2) : 0, static_cast<int64_t>(t.element_size())};
}

// A panel's super-block pairs: parts 2 and 3 (d and e) of each super-block's first block.
inline void pack_pairs(const StridedBytes& pv, int64_t blocks, int64_t sb, int64_t p0,
                       int64_t width, uint8_t* out) {
  for (int64_t sp = 0; sp < blocks / sb; ++sp)
    for (int64_t e = 0; e < 2; ++e)
      for (int64_t c = 0; c < width; ++c)
        std::memcpy(out + ((2 * sp + e) * width + c) * 4, pv.at(2 + e, sp * sb, p0 + c), 4);
}

// One block's 32 values q into column c of its stored rows at `blk` (a panel `width` wide):
// bytes q + 128, or (`nib`) pairs of inputs 4 apart as nibbles q + `offset`.
inline void store_rows(const int8_t* q, bool nib, int32_t offset, int64_t c, int64_t width,
                       uint8_t* blk) {
  const int64_t per = nib ? kBlock / 8 : kBlock / 4;
  for (int64_t t = 0; t < per; ++t)
    for (int64_t i = 0; i < 4; ++i) {
      uint8_t* lane = blk + t * width * 4 + i + 4 * c;
      *lane = nib ? static_cast<uint8_t>((q[8 * t + i] + offset) | ((q[8 * t + i + 4] + offset) << 4))
                  : static_cast<uint8_t>(q[4 * t + i] + 128);
    }
}

// One block's 32 values q (in [-32, 31]) into column c of kQ6S's stored rows at `blk`: the
// nibbles of q + 32 as int4's, then the two rows of high bits (see the layout above).
inline void store_six_rows(const int8_t* q, int64_t c, int64_t width, uint8_t* blk) {
  uint32_t high[kSixRows] = {};
  for (int64_t t = 0; t < kSteps<kQ6S>; ++t) {  // inputs 8t .. 8t + 7, a byte each, as q + 32
    uint64_t v;
    std::memcpy(&v, q + 8 * t, 8);
    // q + 32 in each byte without a carry between bytes (the low 7 bits added, the top
    // bit's sum put back by xor)
    v = ((v & 0x7F7F7F7F7F7F7F7Full) + 0x2020202020202020ull) ^ (v & 0x8080808080808080ull);
    const uint64_t nib = v & 0x0F0F0F0F0F0F0F0Full, crumbs = (v >> 4) & 0x0303030303030303ull;
    const uint32_t row = static_cast<uint32_t>(nib) | (static_cast<uint32_t>(nib >> 32) << 4);
    std::memcpy(blk + t * width * 4 + 4 * c, &row, 4);  // (little-endian: byte i, input i)
    const int shift = 4 * static_cast<int>(t & 1);
    high[t / 2] |= (static_cast<uint32_t>(crumbs) << shift) |
                   (static_cast<uint32_t>(crumbs >> 32) << (shift + 2));
  }
  for (int64_t u = 0; u < kSixRows; ++u)
    std::memcpy(blk + (kSteps<kQ6S> + u) * width * 4 + 4 * c, &high[u], 4);
}

// One block's 32 values into column c of its stored rows, in `format` (store_rows with its
// offset, or store_six_rows).
inline void store_block(const int8_t* q, int format, int64_t c, int64_t width, uint8_t* blk) {
  if (format == kQ6S) return store_six_rows(q, c, width, blk);
  const bool nib = format == kQInt4 || format == kQ4K || format == kQ4L;
  store_rows(q, nib, format == kQInt4 ? 8 : 0, c, width, blk);
}

// One block's stored rows of a panel: q's 32 inputs from k0 for the panel's columns
// (store_block, a column at a time).
inline void pack_block_rows(const StridedBytes& q, int64_t k0, int64_t p0, int64_t width,
                            int format, uint8_t* blk) {
  int8_t column[kBlock];
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t k = 0; k < kBlock; ++k) column[k] = static_cast<int8_t>(*q.at(k0 + k, p0 + c));
    store_block(column, format, c, width, blk);
  }
}

// The block-scaled formats' panels (see the layout above) written straight from q [K, N]
// int8 (K a multiple of 32) and `parts` [P, K / 32, N]: fp16 scales, or the K formats' four
// fp32 numbers (two multipliers, stored as bytes, and the super-block's d and e), into out
// (column_bytes x N bytes); a task per panel. Either may be a strided view (StridedBytes).
// (Built from tensor ops, with an int32 copy of q and its permutes, packing took 2.9 s of a
// 0.8B Q4_K_M file's 16 s load.)
inline void pack_blocks(const at::Tensor& q, const at::Tensor& parts, int format, uint8_t* out) {
  const int64_t k_len = q.size(0), n = q.size(1), blocks = k_len / kBlock;
  const int64_t bb = block_bytes(format), sb = super_blocks(format);
  const StridedBytes qv = strided(q), pv = strided(parts);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      const int64_t p0 = p * kPanel, width = std::min(kPanel, n - p0);
      uint8_t* panel = out + p0 * column_bytes(format, blocks);
      if (has_super(format)) pack_pairs(pv, blocks, sb, p0, width, panel);
      uint8_t* first = panel + (has_super(format) ? blocks / sb * 8 * width : 0);
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* blk = first + b * bb * width;
        pack_block_rows(qv, b * kBlock, p0, width, format, blk);
        uint8_t* tail = blk + (bb - 2) * width;
        if (!has_super(format)) {  // the block's fp16 scales
          for (int64_t c = 0; c < width; ++c)
            std::memcpy(tail + c * pv.e, pv.at(0, b, p0 + c), pv.e);
          continue;
        }
        for (int64_t m = 0; m < 2; ++m)  // its two multipliers, as bytes
          for (int64_t c = 0; c < width; ++c) {
            float f;
            std::memcpy(&f, pv.at(m, b, p0 + c), 4);
            tail[m * width + c] = static_cast<uint8_t>(static_cast<int32_t>(f));
          }
      }
    }
  });
}

// q [K, N] int8 and its scales -> the stored format (QFormat): int8 (q in [-127, 127], fp32
// scales [N]), int4 (q in [-8, 7], fp16 scales [K / 32, N]), q8 (q in [-127, 127], fp16
// scales [K / 32, N]: llama.cpp's Q8_0 blocks, values as they are), or the K formats, W = s q
// + t with [4, K / 32, N] fp32 (m_s, m_t, d, e): s = m_s d, t = m_t e, d and e the same
// across each super-block, m_s and m_t integers in [0, 255]: q4k and q4l (q in [0, 15]),
// q8k and q8l (q in [-128, 127]); or q6 (q in [-128, 127], W = s_h q, s_h = m_h d with the
// multipliers of each half of 16 in [-128, 127], e unused; stored as q6s where kQ6Stored
// says so, and as q6s wherever format 8 is asked for).
inline at::Tensor pack_quantized(const at::Tensor& q, const at::Tensor& scales, int64_t format) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack_quantized takes q [K, N] int8");
  TORCH_CHECK(format >= kQInt8 && format <= kQ6S,
              "pack_quantized: format is 0 (int8), 1 (int4), 2 (q8), 3 (q4k), 4 (q8k), 5 (q6), "
              "6 (q4l), 7 (q8l) or 8 (q6s)");
  if (format == kQ6) format = kQ6Stored;  // Q6_K as this build stores it
  const int64_t k_len = q.size(0), n = q.size(1);
  const bool k_format = has_super(static_cast<int>(format));
  const bool ok = format == kQInt8 ? scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                                         scales.size(0) == n
                  : k_format ? scales.scalar_type() == at::kFloat && scales.dim() == 3 &&
                                   scales.size(0) == 4 && scales.size(1) == k_len / kBlock &&
                                   scales.size(2) == n && holds(static_cast<int>(format), k_len)
                             : scales.scalar_type() == at::kHalf && scales.dim() == 2 &&
                                   k_len % kBlock == 0 && scales.size(0) == k_len / kBlock &&
                                   scales.size(1) == n;
  TORCH_CHECK(ok, "pack_quantized: int8 scales are fp32 [N], int4 and q8 scales fp16 [K / 32, "
              "N], the K formats' fp32 [4, K / 32, N] (K a multiple of 256 for q4k, q8k, q6)");
  at::Tensor flat = at::zeros({quant_rows_of(k_len, format) * n * 4}, q.options().dtype(at::kByte));
  if (format != kQInt8) {  // q and the scales read in place, whatever their strides
    const at::Tensor parts = k_format ? scales : scales.unsqueeze(0);
    pack_blocks(q, parts, static_cast<int>(format), flat.data_ptr<uint8_t>());
  } else {
    const int64_t k32 = (k_len + kBlock - 1) / kBlock * kBlock;
    at::Tensor u = at::full({k32, n}, 128, q.options().dtype(at::kInt));
    u.narrow(0, 0, k_len).copy_(q.to(at::kInt) + 128);
    const at::Tensor panels = panelize(u.view({k32 / 4, 4, n}).permute({0, 2, 1}).to(at::kByte));
    const at::Tensor body = at::cat({panels.view({-1}), scales.contiguous().view(at::kByte).view({-1})});
    flat.narrow(0, 0, body.numel()).copy_(body);
  }
  flat = flat.view({-1, n, 4});
  return stored_as_char(static_cast<int>(format)) ? flat.view(at::kChar) : flat;
}

}  // namespace linserve
