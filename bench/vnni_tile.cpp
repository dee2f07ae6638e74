// The int4 vpdpbusd tile of many rows alone, in cycles per block of 32 inputs (one thread),
// and the pipes it competes for (BENCHMARKS.md §44; never run by CI). Standalone, no torch:
//
//   g++ -O3 -march=native bench/vnni_tile.cpp -o /tmp/vnni_tile && /tmp/vnni_tile [GHZ]
//
// GHZ (default: measured by a chain of dependent adds) converts seconds to cycles.
// - "peaks": vpdpbusd's and vdpbf16ps's instructions a cycle and GMAC/s on one core.
// - "pipes": 12 independent vpdpbusd chains alone, then with 4 of each other instruction the
//   tile issues beside them (extra cycles: that instruction shares vpdpbusd's pipes).
// - "tile": 6 rows x 2 vectors of 16 columns (int4, gemm_quant.h's layout and arithmetic),
//   over K = 2048: as §43 left it (each row and each vector through its own pointers and
//   run-time strides, a prefetch 16 blocks ahead), and as tile_vnni_rows reads (packed
//   per-block records, one weight pointer), with and without the prefetch;
//   the weights of 1, 16 or 64 tiles taken in turn (in L1, L2, L3).
#include <immintrin.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

double now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

double clock_ghz() {
  const long n = 400000000;
  long x = 0;
  const double t0 = now();
  for (long i = 0; i < n; ++i) asm volatile("add $1, %0" : "+r"(x));
  return n / (now() - t0) / 1e9;
}

#define DP12                                                                              \
  "vpdpbusd %%zmm30,%%zmm31,%%zmm0\n vpdpbusd %%zmm30,%%zmm31,%%zmm1\n"                    \
  "vpdpbusd %%zmm30,%%zmm31,%%zmm2\n vpdpbusd %%zmm30,%%zmm31,%%zmm3\n"                    \
  "vpdpbusd %%zmm30,%%zmm31,%%zmm4\n vpdpbusd %%zmm30,%%zmm31,%%zmm5\n"                    \
  "vpdpbusd %%zmm30,%%zmm31,%%zmm6\n vpdpbusd %%zmm30,%%zmm31,%%zmm7\n"                    \
  "vpdpbusd %%zmm30,%%zmm31,%%zmm8\n vpdpbusd %%zmm30,%%zmm31,%%zmm9\n"                    \
  "vpdpbusd %%zmm30,%%zmm31,%%zmm10\n vpdpbusd %%zmm30,%%zmm31,%%zmm11\n"
#define X4(op) op("12") op("13") op("14") op("15")
#define FMA(r) "vfmadd231ps %%zmm30,%%zmm31,%%zmm" r "\n"
#define MUL(r) "vmulps %%zmm30,%%zmm31,%%zmm" r "\n"
#define CVT(r) "vcvtdq2ps %%zmm30,%%zmm" r "\n"
#define AND(r) "vpandd %%zmm30,%%zmm31,%%zmm" r "\n"
#define SRL(r) "vpsrlw $4,%%zmm30,%%zmm" r "\n"
#define BCAST(r) "vpbroadcastd (%0),%%zmm" r "\n"
#define PIPES(name, body)                                                                 \
  {                                                                                       \
    const long n = 50000000;                                                              \
    const double t0 = now();                                                              \
    for (long i = 0; i < n; ++i) asm volatile(body : : "r"(buf) : "memory");              \
    std::printf("  %-22s %.2f cycles\n", name, (now() - t0) / n * ghz * 1e9);             \
  }

void pipes(double ghz) {
  static int32_t buf[16] __attribute__((aligned(64)));
  asm volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n vpxord %%zmm31,%%zmm31,%%zmm31" ::: "memory");
  std::printf("pipes: 12 vpdpbusd chains a loop, then with 4 more of\n");
  PIPES("(nothing)", DP12)
  PIPES("vfmadd231ps", DP12 X4(FMA))
  PIPES("vmulps", DP12 X4(MUL))
  PIPES("vcvtdq2ps", DP12 X4(CVT))
  PIPES("vpandd", DP12 X4(AND))
  PIPES("vpsrlw", DP12 X4(SRL))
  PIPES("vpbroadcastd (mem)", DP12 X4(BCAST))
}

// Each dot-product instruction's peak on one core: 12 independent chains, in instructions a
// cycle and GMAC/s (vpdpbusd: 64 multiply-adds, u8 x s8; vdpbf16ps: 32, bf16 pairs). The
// int8 / int4 GEMMs and the bf16 ones are bound by these (BENCHMARKS.md §44, §48).
#define DP12_OP(op)                                                                       \
  op " %%zmm30,%%zmm31,%%zmm0\n " op " %%zmm30,%%zmm31,%%zmm1\n"                          \
  op " %%zmm30,%%zmm31,%%zmm2\n " op " %%zmm30,%%zmm31,%%zmm3\n"                          \
  op " %%zmm30,%%zmm31,%%zmm4\n " op " %%zmm30,%%zmm31,%%zmm5\n"                          \
  op " %%zmm30,%%zmm31,%%zmm6\n " op " %%zmm30,%%zmm31,%%zmm7\n"                          \
  op " %%zmm30,%%zmm31,%%zmm8\n " op " %%zmm30,%%zmm31,%%zmm9\n"                          \
  op " %%zmm30,%%zmm31,%%zmm10\n " op " %%zmm30,%%zmm31,%%zmm11\n"
#define PEAK(name, op, macs)                                                              \
  {                                                                                       \
    const long n = 50000000;                                                              \
    const double t0 = now();                                                              \
    for (long i = 0; i < n; ++i) asm volatile(DP12_OP(op) : : : "memory");                \
    const double secs = now() - t0;                                                       \
    std::printf("  %-10s %.2f a cycle, %.0f GMAC/s a core\n", name,                       \
                12.0 * n / (secs * ghz * 1e9), 12.0 * n * (macs) / secs / 1e9);           \
  }

void peaks(double ghz) {
  asm volatile("vpxord %%zmm30,%%zmm30,%%zmm30\n vpxord %%zmm31,%%zmm31,%%zmm31" ::: "memory");
  std::printf("peaks: 12 chains of one instruction\n");
  PEAK("vpdpbusd", "vpdpbusd", 64)
#if defined(__AVX512BF16__)
  PEAK("vdpbf16ps", "vdpbf16ps", 32)
#endif
}

constexpr int64_t kBlock = 32, kK = 2048, kBlocks = kK / kBlock, kWidth = 64, kRows = 6;
constexpr int64_t kBlockBytes = 18 * kWidth;  // a panel's block: 4 stored rows, then scales
constexpr int64_t kRecord = kRows * (kBlock + 8);

struct Acts {  // the rows' quantized inputs [rows][K], scales and offset sums [rows][blocks]
  std::vector<int8_t> q;
  std::vector<float> s;
  std::vector<int32_t> d0;
};

inline void prefetch_line(const void* p) {
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
}

// One block's integer dots, then the float step: the arithmetic of gemm_quant.h.
template <typename W, typename X, typename S>
inline void block(W wq, const uint8_t* sc16, X xq, S scale, __m512 (&acc)[kRows][2]) {
  const __m512i low = _mm512_set1_epi8(15);
  __m512i dot[kRows][2];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < 2; ++j) dot[r][j] = _mm512_set1_epi32(scale(r).second);
  for (int64_t t = 0; t < 4; ++t) {
    for (int64_t j = 0; j < 2; ++j) {
      const __m512i v = _mm512_loadu_si512(wq(t, j));
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int64_t r = 0; r < kRows; ++r) {
        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], lo, _mm512_set1_epi32(xq(r)[2 * t]));
        dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], hi, _mm512_set1_epi32(xq(r)[2 * t + 1]));
      }
    }
  }
  for (int64_t j = 0; j < 2; ++j) {
    const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        sc16 + 32 * j)));
    for (int64_t r = 0; r < kRows; ++r)
      acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][j]),
                                  _mm512_mul_ps(sc, _mm512_set1_ps(scale(r).first)), acc[r][j]);
  }
}

// A panel's columns as gemm_quant.h's QCol describes them: run-time strides.
struct Col {
  const uint8_t* q;
  int64_t ld, block;
  const uint8_t* s;
};

// The tile before §44: each row through its own pointers, each vector through its own Col,
// and the weights prefetched 16 blocks ahead in every tile (strides known at run time only,
// as QuantActs' and QCol's are).
__attribute__((noinline)) void tile_before(const Acts& a, int64_t k32, int64_t blocks,
                                           const Col* cols, float* y) {
  Col col[2] = {cols[0], cols[1]};
  __m512 acc[kRows][2] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t j = 0; j < 2; ++j) prefetch_line(col[0].q + (b + 16) * col[0].block + t * col[0].ld + 64 * j);
    prefetch_line(col[0].s + (b + 16) * col[0].block);
    const int32_t* xq[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      xq[r] = reinterpret_cast<const int32_t*>(&a.q[r * k32 + b * kBlock]);
    block([&](int64_t t, int64_t j) { return col[j].q + b * col[j].block + t * col[j].ld; },
          col[0].s + b * col[0].block, [&](int64_t r) { return xq[r]; },
          [&](int64_t r) { return std::make_pair(a.s[r * blocks + b], a.d0[r * blocks + b]); },
          acc);
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < 2; ++j) _mm512_storeu_ps(y + r * 32 + 16 * j, acc[r][j]);
}

// Packed per-block records (tile_vnni_rows), optionally prefetching 16 blocks ahead.
template <bool PREFETCH>
__attribute__((noinline)) void tile_packed(const uint8_t* rec, const uint8_t* w, float* y) {
  __m512 acc[kRows][2] = {};
  for (int64_t b = 0; b < kBlocks; ++b, rec += kRecord) {
    const uint8_t* q = w + b * kBlockBytes;
    if (PREFETCH)
      for (int64_t line = 0; line < 9; ++line)
        prefetch_line(q + 16 * kBlockBytes + (line < 8 ? (line / 2) * 4 * kWidth + 64 * (line % 2)
                                                       : 16 * kWidth));
    const int32_t* xq = reinterpret_cast<const int32_t*>(rec);
    const float* sx = reinterpret_cast<const float*>(rec + kRows * kBlock);
    const int32_t* d0 = reinterpret_cast<const int32_t*>(rec + kRows * (kBlock + 4));
    block([&](int64_t t, int64_t j) { return q + t * 4 * kWidth + 64 * j; }, q + 16 * kWidth,
          [&](int64_t r) { return xq + 8 * r; },
          [&](int64_t r) { return std::make_pair(sx[r], d0[r]); }, acc);
  }
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t j = 0; j < 2; ++j) _mm512_storeu_ps(y + r * 32 + 16 * j, acc[r][j]);
}

template <typename F>
double cycles_per_block(double ghz, int64_t tiles, const F& run) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const int64_t iters = 20000;
    const double t0 = now();
    for (int64_t i = 0; i < iters; ++i) run(i % tiles);
    best = std::min(best, (now() - t0) / iters / kBlocks * ghz * 1e9);
  }
  return best;
}

void tiles(double ghz) {
  std::srand(1);
  Acts a;
  a.q.resize(kRows * kK);
  a.s.resize(kRows * kBlocks);
  a.d0.resize(kRows * kBlocks);
  for (auto& v : a.q) v = static_cast<int8_t>(std::rand() % 255 - 127);
  for (auto& v : a.s) v = 0.01f * static_cast<float>(1 + std::rand() % 7);
  for (auto& v : a.d0) v = std::rand() % 1000;
  std::vector<uint8_t> rec(kBlocks * kRecord);
  for (int64_t b = 0; b < kBlocks; ++b)
    for (int64_t r = 0; r < kRows; ++r) {
      std::memcpy(&rec[b * kRecord + r * kBlock], &a.q[r * kK + b * kBlock], kBlock);
      std::memcpy(&rec[b * kRecord + kRows * kBlock + 4 * r], &a.s[r * kBlocks + b], 4);
      std::memcpy(&rec[b * kRecord + kRows * (kBlock + 4) + 4 * r], &a.d0[r * kBlocks + b], 4);
    }
  std::printf("tile: 6 rows x 32 columns, int4, K = %ld; cycles a block\n", long(kK));
  std::printf("  %-28s %10s %10s %10s\n", "", "1 tile", "16 tiles", "64 tiles");
  const int64_t counts[3] = {1, 16, 64};
  std::vector<uint8_t> w(kBlocks * kBlockBytes * 64);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint8_t>(std::rand());
  for (int64_t t = 0; t < 64 * kBlocks; ++t)  // fp16 scales near 2^-7
    for (int64_t c = 0; c < kWidth; ++c) {
      const uint16_t h = 0x2000 + (std::rand() & 0xff);
      std::memcpy(&w[t * kBlockBytes + 16 * kWidth + 2 * c], &h, 2);
    }
  float y[kRows * 32];
  volatile int64_t k32_v = kK, blocks_v = kBlocks;  // run-time values, as in the server
  const int64_t k32 = k32_v, blocks = blocks_v;
  const char* names[3] = {"before (§43)", "packed records", "packed + prefetch"};
  for (int v = 0; v < 3; ++v) {
    std::printf("  %-28s", names[v]);
    for (int64_t n : counts) {
      const double c = cycles_per_block(ghz, n, [&](int64_t i) {
        const uint8_t* wt = w.data() + i * kBlocks * kBlockBytes;
        if (v == 0) {
          const Col cols[2] = {{wt, 4 * kWidth, kBlockBytes, wt + 16 * kWidth},
                               {wt + 64, 4 * kWidth, kBlockBytes, wt + 16 * kWidth + 32}};
          tile_before(a, k32, blocks, cols, y);
        }
        else if (v == 1) tile_packed<false>(rec.data(), wt, y);
        else tile_packed<true>(rec.data(), wt, y);
      });
      std::printf(" %10.1f", c);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double ghz = argc > 1 ? std::atof(argv[1]) : clock_ghz();
  std::printf("clock %.2f GHz\n", ghz);
  peaks(ghz);
  pipes(ghz);
  tiles(ghz);
}
