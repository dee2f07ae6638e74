// RWKV-7's prefill scan (wkv7.h) as an op:
//   wkv7_scan(s [B, H, N, N] (updated), r, w, k, v, kk, a [B, T, H, N], counts [B] int64)
//     -> y [B, T, H, N] fp32: each row's first counts[b] tokens in order (right padding after
//     them writes nothing and reads zeros); a task per (row, head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "wkv7.h"

namespace rwkv_ops_cpp {  // named, not anonymous: unity units (build.py) join sources

at::Tensor wkv7_scan(const at::Tensor& s, const at::Tensor& r, const at::Tensor& w,
                     const at::Tensor& k, const at::Tensor& v, const at::Tensor& kk,
                     const at::Tensor& a, const at::Tensor& counts) {
  for (const at::Tensor* t : {&s, &r, &w, &k, &v, &kk, &a})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "wkv7_scan takes contiguous fp32 tensors");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous(),
              "wkv7_scan: counts [B] int64");
  const int64_t b = r.size(0), t_len = r.size(1), heads = r.size(2), n = r.size(3);
  TORCH_CHECK(s.size(0) == b && s.size(1) == heads && s.size(2) == n && s.size(3) == n &&
                  counts.size(0) == b,
              "wkv7_scan: the state and the inputs disagree");
  at::Tensor y = at::zeros_like(r);
  const int64_t* cnt = counts.data_ptr<int64_t>();
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / heads, h = task % heads;
      float* state = s.data_ptr<float>() + task * n * n;
      for (int64_t t = 0; t < std::min(cnt[row], t_len); ++t) {
        const int64_t at = ((row * t_len + t) * heads + h) * n;
        linserve::wkv7::head_token(state, r.data_ptr<float>() + at, w.data_ptr<float>() + at,
                                   k.data_ptr<float>() + at, v.data_ptr<float>() + at,
                                   kk.data_ptr<float>() + at, a.data_ptr<float>() + at,
                                   y.data_ptr<float>() + at, n);
      }
    }
  });
  return y;
}

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "wkv7_scan(Tensor(a!) s, Tensor r, Tensor w, Tensor k, Tensor v, Tensor kk, Tensor a, "
      "Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("wkv7_scan", &wkv7_scan); }

}  // namespace rwkv_ops_cpp
