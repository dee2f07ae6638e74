// How many vector-integer instructions of each kind one core issues a cycle (never run by
// CI): the ceiling of the quantized products on an AVX2 CPU (BENCHMARKS.md §73).
//   g++ -O2 -march=native bench/int_issue_rate.cpp -o /tmp/int_issue_rate && /tmp/int_issue_rate
// Each loop runs 16 instructions a pass on 8 independent registers; the clock is taken from
// a chain of dependent scalar adds (one a cycle). "pairs" is vpmaddubsw followed by vpaddw
// on the same register, as a block's int16 sums are built (both instructions counted).
#include <chrono>
#include <cstdio>

#define LOOP(OP)                                                                       \
  asm volatile(                                                                        \
      "vpxor %%ymm0,%%ymm0,%%ymm0\n vpxor %%ymm1,%%ymm1,%%ymm1\n"                     \
      "vpxor %%ymm2,%%ymm2,%%ymm2\n vpxor %%ymm3,%%ymm3,%%ymm3\n"                     \
      "vpxor %%ymm4,%%ymm4,%%ymm4\n vpxor %%ymm5,%%ymm5,%%ymm5\n"                     \
      "vpxor %%ymm6,%%ymm6,%%ymm6\n vpxor %%ymm7,%%ymm7,%%ymm7\n"                     \
      "vpcmpeqb %%ymm15,%%ymm15,%%ymm15\n"                                             \
      "1:\n" OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7)                           \
      OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) "dec %0\n jnz 1b\n"              \
      : "+r"(n)                                                                        \
      :                                                                                \
      : "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm15", "cc")
#define MADDUBS(i) "vpmaddubsw %%ymm15, %%ymm" #i ", %%ymm" #i "\n"
#define MADDWD(i) "vpmaddwd %%ymm15, %%ymm" #i ", %%ymm" #i "\n"
#define PADDW(i) "vpaddw %%ymm15, %%ymm" #i ", %%ymm" #i "\n"
#define PAIR(i) MADDUBS(i) PADDW(i)
#define FMA(i) "vfmadd231ps %%ymm15, %%ymm15, %%ymm" #i "\n"

// Instructions a nanosecond of loop K (16 a pass; 32 for the pairs).
template <int K>
double per_ns(long passes) {
  long n = passes;
  const auto t0 = std::chrono::steady_clock::now();
  if (K == 0) LOOP(MADDUBS);
  if (K == 1) LOOP(MADDWD);
  if (K == 2) LOOP(PADDW);
  if (K == 3) LOOP(PAIR);
  if (K == 4) LOOP(FMA);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return (K == 3 ? 32.0 : 16.0) * passes / s / 1e9;
}

// Cycles a nanosecond: four dependent adds a pass.
double ghz(long passes) {
  long x = 0, n = passes;
  const auto t0 = std::chrono::steady_clock::now();
  asm volatile("1: add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n dec %1\n jnz 1b"
               : "+r"(x), "+r"(n) : : "cc");
  return 4.0 * passes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

int main() {
  const long passes = 50000000;
  for (int round = 0; round < 3; ++round) {
    const double g = ghz(4 * passes);
    std::printf("%.2f GHz; a cycle: vpmaddubsw %.2f  vpmaddwd %.2f  vpaddw %.2f  "
                "vpmaddubsw+vpaddw %.2f  vfmadd231ps %.2f\n", g, per_ns<0>(passes) / g,
                per_ns<1>(passes) / g, per_ns<2>(passes) / g, per_ns<3>(passes) / g,
                per_ns<4>(passes) / g);
  }
}
