// RWKV's prefill scans (wkv7.h, wkv6.h) as ops. RWKV-7:
//   wkv7_scan(s [B, H, N, N] (updated), r, w, k, v, kk, a [B, T, H, N], counts [B] int64)
//     -> y [B, T, H, N] fp32: each row's first counts[b] tokens in order (right padding after
//     them writes nothing and reads zeros); a task per (row, head). RWKV-6:
//   wkv6_scan(s [B, H, N, N] (updated), r, w, k, v [B, T, H, N], u [H, N], counts [B])
//     -> y [B, T, H, N], the same way. RWKV-4:
//   wkv4_scan(s [B, 3, 1, C] (num, den, max; updated), w, u [C], k, v [B, T, C], counts [B])
//     -> y [B, T, C]; a task per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>

#include "wkv6.h"
#include "wkv7.h"

namespace rwkv_ops_cpp {  // named, not anonymous: unity units (build.py) join sources

void check_inputs(const char* op, std::initializer_list<const at::Tensor*> ts,
                  const at::Tensor& counts) {
  for (const at::Tensor* t : ts)
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), op,
                " takes contiguous fp32 tensors");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous(), op,
              ": counts [B] int64");
}

// Each (row, head) of the state s [B, H, N, N] as a task, its row's first counts[b] tokens
// in order: fn(that head's S, the token's offset into x [B, T, H, N], the head).
template <typename F>
void each_head_token(const at::Tensor& s, const at::Tensor& counts, const at::Tensor& x, F fn) {
  const int64_t t_len = x.size(1), heads = x.size(2), n = x.size(3);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  at::parallel_for(0, x.size(0) * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / heads, h = task % heads;
      float* state = s.data_ptr<float>() + task * n * n;
      for (int64_t t = 0; t < std::min(cnt[row], t_len); ++t)
        fn(state, ((row * t_len + t) * heads + h) * n, h);
    }
  });
}

at::Tensor wkv7_scan(const at::Tensor& s, const at::Tensor& r, const at::Tensor& w,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& kk,
                     const at::Tensor& a, const at::Tensor& counts) {
  check_inputs("wkv7_scan", {&s, &r, &w, &k, &v, &kk, &a}, counts);
  const int64_t b = r.size(0), heads = r.size(2), n = r.size(3);
  TORCH_CHECK(s.size(0) == b && s.size(1) == heads && s.size(2) == n && s.size(3) == n &&
                  counts.size(0) == b,
              "wkv7_scan: the state and the inputs disagree");
  at::Tensor y = at::zeros_like(r);
  each_head_token(s, counts, r, [&](float* state, int64_t at, int64_t) {
    linserve::wkv7::head_token(state, r.data_ptr<float>() + at, w.data_ptr<float>() + at,
                               k.data_ptr<float>() + at, v.data_ptr<float>() + at,
                               kk.data_ptr<float>() + at, a.data_ptr<float>() + at,
                               y.data_ptr<float>() + at, n);
  });
  return y;
}

at::Tensor wkv6_scan(const at::Tensor& s, const at::Tensor& r, const at::Tensor& w,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& u,
                     const at::Tensor& counts) {
  check_inputs("wkv6_scan", {&s, &r, &w, &k, &v, &u}, counts);
  const int64_t b = r.size(0), heads = r.size(2), n = r.size(3);
  TORCH_CHECK(s.size(0) == b && s.size(1) == heads && s.size(2) == n && s.size(3) == n &&
                  u.numel() == heads * n && counts.size(0) == b,
              "wkv6_scan: the state and the inputs disagree");
  at::Tensor y = at::zeros_like(r);
  each_head_token(s, counts, r, [&](float* state, int64_t at, int64_t h) {
    linserve::wkv6::head_token(state, r.data_ptr<float>() + at, w.data_ptr<float>() + at,
                               k.data_ptr<float>() + at, v.data_ptr<float>() + at,
                               u.data_ptr<float>() + h * n, y.data_ptr<float>() + at, n);
  });
  return y;
}

at::Tensor wkv4_scan(const at::Tensor& s, const at::Tensor& w, const at::Tensor& u,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& counts) {
  check_inputs("wkv4_scan", {&s, &w, &u, &k, &v}, counts);
  const int64_t b = k.size(0), t_len = k.size(1), c = k.size(2);
  TORCH_CHECK(s.size(0) == b && s.numel() == b * 3 * c && w.numel() == c && u.numel() == c &&
                  counts.size(0) == b,
              "wkv4_scan: the state and the inputs disagree");
  at::Tensor y = at::zeros_like(k);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* num = s.data_ptr<float>() + row * 3 * c;
      for (int64_t t = 0; t < std::min(cnt[row], t_len); ++t) {
        const int64_t at = (row * t_len + t) * c;
        linserve::wkv4::channels_token(num, num + c, num + 2 * c, w.data_ptr<float>(),
                                       u.data_ptr<float>(), k.data_ptr<float>() + at,
                                       v.data_ptr<float>() + at, y.data_ptr<float>() + at, c);
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "wkv6_scan(Tensor(a!) s, Tensor r, Tensor w, Tensor k, Tensor v, Tensor u, "
      "Tensor counts) -> Tensor");
  m.def(
      "wkv4_scan(Tensor(a!) s, Tensor w, Tensor u, Tensor k, Tensor v, Tensor counts) "
      "-> Tensor");
  m.def(
      "wkv7_scan(Tensor(a!) s, Tensor r, Tensor w, Tensor k, Tensor v, Tensor kk, Tensor a, "
      "Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("wkv7_scan", &wkv7_scan);
  m.impl("wkv6_scan", &wkv6_scan);
  m.impl("wkv4_scan", &wkv4_scan);
}

}  // namespace rwkv_ops_cpp
