// The Gated DeltaNet ops (gdn.h): gdn_step, one recurrent step for the eager per-layer step,
// and gdn_scan, the recurrent form over a prompt for the prefill.
//
// Shapes (B rows; Hk, Hv key / value heads of Dk, Dv; C = 2 Hk Dk + Hv Dv; K conv width):
//   gdn_step: mixed [B, C] projections; window [B, K-1, C] (updated); conv_w [K, C];
//     a, b [B, Hv]; a_log, dt_bias [Hv]; s [B, Hv, Dk, Dv] (updated); z [B, Hv Dv];
//     norm_w [Dv]  ->  out [B, Hv Dv].
//   gdn_scan: full [B, K-1+T, C] each row's conv window then its T new projections;
//     conv_wt [K, C] the depthwise kernel transposed; zba [B, T, Hv Dv + 2 Hv] the gate
//     projections z, b, a side by side; s (updated);
//     lengths [B] int64, each row's real tokens (right padding after them writes nothing)
//     ->  out [B, T, Hv Dv] (zeros at padding).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gdn.h"

namespace gdn_step_cpp {  // named, not anonymous: unity units (build.py) join sources

at::Tensor gdn_step(const at::Tensor& mixed, const at::Tensor& window, const at::Tensor& conv_w,
                    const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                    const at::Tensor& dt_bias, const at::Tensor& s, const at::Tensor& z,
                    const at::Tensor& norm_w, int64_t key_heads, double eps,
                    double beta_scale) {
  for (const at::Tensor* t : {&mixed, &window, &conv_w, &a, &b, &a_log, &dt_bias, &s, &z,
                              &norm_w}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gdn_step takes contiguous fp32 tensors");
  }
  const int64_t rows = mixed.size(0), c_len = mixed.size(1), k = conv_w.size(0);
  const int64_t hv = s.size(1), dk = s.size(2), dv = s.size(3);
  TORCH_CHECK(c_len == 2 * key_heads * dk + hv * dv && hv % key_heads == 0,
              "gdn_step: projections and state disagree");
  TORCH_CHECK(window.size(0) == rows && window.size(1) == k - 1 && s.size(0) == rows &&
                  a.size(1) == hv && b.size(1) == hv && z.size(1) == hv * dv,
              "gdn_step: the window, state or gates have the wrong shape");
  // the four inputs as column ranges of one [B, C + Hv Dv + 2 Hv] block, as the fused
  // projection produces them
  at::Tensor proj = at::cat({mixed, z, b, a}, 1);
  const float* p = proj.data_ptr<float>();
  const int64_t ld = proj.size(1);
  at::Tensor out = at::empty({rows, hv * dv}, mixed.options());
  const linserve::gdn::Shape sh{key_heads, hv, dk, dv, c_len, k, static_cast<float>(eps),
                                static_cast<float>(beta_scale)};
  linserve::gdn::step({p, p + c_len, p + c_len + hv * dv + hv, p + c_len + hv * dv, ld},
                      window.data_ptr<float>(), conv_w.data_ptr<float>(),
                      a_log.data_ptr<float>(), dt_bias.data_ptr<float>(), s.data_ptr<float>(),
                      norm_w.data_ptr<float>(), out.data_ptr<float>(), rows, sh);
  return out;
}

// out [B, T, C]: per token the causal convolution of full [B, K-1+T, C] with w [K, C] (the
// sum in gdn.h's conv_token order), SiLU, and q, k normalised.
at::Tensor convolve(const at::Tensor& full, const at::Tensor& w, const linserve::gdn::Shape& sh) {
  const int64_t rows = full.size(0), k = w.size(0), c_len = full.size(2);
  const int64_t t_len = full.size(1) - k + 1;
  at::Tensor out = at::empty({rows, t_len, c_len}, full.options());
  const float* fp = full.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows * t_len, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* src = fp + ((i / t_len) * (t_len + k - 1) + i % t_len) * c_len;
      float* dst = op + i * c_len;
      linserve::gdn::conv_token(src, src + (k - 1) * c_len, wp, dst, c_len, k);
      linserve::gdn::normalize_qk(dst, sh);
    }
  });
  return out;
}

at::Tensor gdn_scan(const at::Tensor& full, const at::Tensor& conv_wt, const at::Tensor& zba,
                    const at::Tensor& a_log, const at::Tensor& dt_bias, const at::Tensor& s,
                    const at::Tensor& norm_w, const at::Tensor& lengths, int64_t key_heads,
                    double eps, double beta_scale) {
  for (const at::Tensor* t : {&full, &conv_wt, &zba, &a_log, &dt_bias, &s, &norm_w}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gdn_scan takes contiguous fp32 tensors");
  }
  TORCH_CHECK(full.dim() == 3 && conv_wt.dim() == 2 && conv_wt.size(1) == full.size(2) &&
                  full.size(1) >= conv_wt.size(0), "gdn_scan: full and conv_wt disagree");
  const int64_t rows = full.size(0), c_len = full.size(2);
  const int64_t t_len = full.size(1) - conv_wt.size(0) + 1;
  const int64_t hv = s.size(1), dk = s.size(2), dv = s.size(3);
  TORCH_CHECK(c_len == 2 * key_heads * dk + hv * dv && hv % key_heads == 0 &&
                  s.size(0) == rows && zba.size(0) == rows && zba.size(1) == t_len &&
                  zba.size(2) == hv * dv + 2 * hv,
              "gdn_scan: projections and state disagree");
  const at::Tensor n = lengths.to(at::kLong).contiguous();
  TORCH_CHECK(n.numel() == rows, "gdn_scan: one length a row");
  const linserve::gdn::Shape sh{key_heads, hv, dk, dv, c_len, conv_wt.size(0),
                                 static_cast<float>(eps), static_cast<float>(beta_scale)};
  at::Tensor x = convolve(full, conv_wt, sh);
  const float* xp = x.data_ptr<float>();
  const float* p = zba.data_ptr<float>();
  const int64_t ld = zba.size(2);
  at::Tensor out = at::empty({rows, t_len, hv * dv}, full.options());
  linserve::gdn::scan(xp, {nullptr, p, p + hv * dv + hv, p + hv * dv, ld},
                      a_log.data_ptr<float>(), dt_bias.data_ptr<float>(), s.data_ptr<float>(),
                      norm_w.data_ptr<float>(), out.data_ptr<float>(), rows, t_len,
                      n.data_ptr<int64_t>(), sh);
  return out;
}


TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "gdn_step(Tensor mixed, Tensor(a!) window, Tensor conv_w, Tensor a, Tensor b, "
      "Tensor a_log, Tensor dt_bias, Tensor(b!) s, Tensor z, Tensor norm_w, int key_heads, "
      "float eps, float beta_scale=1.0) -> Tensor");
  m.def(
      "gdn_scan(Tensor full, Tensor conv_wt, Tensor zba, Tensor a_log, Tensor dt_bias, Tensor(a!) s, "
      "Tensor norm_w, Tensor lengths, int key_heads, float eps, float beta_scale=1.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) {
  m.impl("gdn_step", &gdn_step);
  m.impl("gdn_scan", &gdn_scan);
}

}  // namespace gdn_step_cpp
