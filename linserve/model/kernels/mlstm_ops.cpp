// xLSTM's prefill scan (mlstm.h) as an op:
//   mlstm_scan(c [B, H, dk, dv], n [B, H, dk], m [B, 1, H] (all updated), q, k [B, T, H, dk],
//              v [B, T, H, dv], i, f [B, T, H], counts [B] int64, eps)
//     -> h [B, T, H, dv] fp32: each row's first counts[b] tokens in order (right padding after
//     them writes nothing); a task per (row, head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "mlstm.h"

namespace mlstm_ops_cpp {  // named, not anonymous: unity units (build.py) join sources

at::Tensor mlstm_scan(const at::Tensor& c, const at::Tensor& n, const at::Tensor& m,
                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& ig, const at::Tensor& fg, const at::Tensor& counts,
                      double eps) {
  for (const at::Tensor* t : {&c, &n, &m, &q, &k, &v, &ig, &fg})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "mlstm_scan takes contiguous fp32 tensors");
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous(),
              "mlstm_scan: counts [B] int64");
  const int64_t b = q.size(0), t_len = q.size(1), heads = q.size(2), dk = q.size(3);
  const int64_t dv = v.size(3);
  TORCH_CHECK(c.size(0) == b && c.size(1) == heads && c.size(2) == dk && c.size(3) == dv &&
                  n.numel() == b * heads * dk && m.numel() == b * heads && counts.size(0) == b,
              "mlstm_scan: the state and the inputs disagree");
  at::Tensor h = at::zeros({b, t_len, heads, dv}, q.options());
  const int64_t* cnt = counts.data_ptr<int64_t>();
  at::parallel_for(0, b * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / heads, hh = task % heads;
      for (int64_t t = 0; t < std::min(cnt[row], t_len); ++t) {
        const int64_t at = (row * t_len + t) * heads + hh;
        linserve::mlstm::head_token(
            c.data_ptr<float>() + task * dk * dv, n.data_ptr<float>() + task * dk,
            m.data_ptr<float>() + task, q.data_ptr<float>() + at * dk,
            k.data_ptr<float>() + at * dk, v.data_ptr<float>() + at * dv,
            ig.data_ptr<float>()[at], fg.data_ptr<float>()[at], h.data_ptr<float>() + at * dv,
            dk, dv, static_cast<float>(eps));
      }
    }
  });
  return h;
}

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "mlstm_scan(Tensor(a!) c, Tensor(b!) n, Tensor(c!) m, Tensor q, Tensor k, Tensor v, "
      "Tensor i, Tensor f, Tensor counts, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("mlstm_scan", &mlstm_scan); }

}  // namespace mlstm_ops_cpp
