// Fused recurrent step of a Gated DeltaNet layer (Qwen3.5's linear-attention layers), between
// its input projections and its output projection.
//
// Per row: the causal depthwise convolution over the conv window and the new projections,
// SiLU, and the window shift; q and k L2-normalised per key head (q also scaled by Dk^-1/2);
// per value head the decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), and the
// gated delta rule over its state S [Dk, Dv] in two passes:
//   pass 1, row by row of S: decay it, and accumulate kv = S^T k;
//   delta = beta (v - kv);
//   pass 2, row by row: S += k delta^T, and accumulate o = S^T q;
// then the per-head RMSNorm of o times SiLU(z). The eager form reads and writes S four
// times (a multiply, two products and an outer-product add); this reads it twice and writes
// it twice, which is what bounds a batched step of a real-size model.
//
// Every row is computed by its own loops in a fixed order, so a row's result does not depend
// on the rows beside it (batch invariance). fp32 throughout; S stays fp32.
//
// Shapes (B rows; Hk, Hv key / value heads of Dk, Dv; C = 2 Hk Dk + Hv Dv; K conv width):
//   mixed [B, C] projections; window [B, K-1, C] (updated); conv_w [C, K];
//   a, b [B, Hv]; a_log, dt_bias [Hv]; s [B, Hv, Dk, Dv] (updated); z [B, Hv Dv];
//   norm_w [Dv]  ->  out [B, Hv Dv].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// The convolution + SiLU of one row into out [C]; shifts the row's window.
void conv_row(const float* mixed, float* window, const float* w, float* out, int64_t c_len,
              int64_t k) {
  for (int64_t c = 0; c < c_len; ++c) {
    const float* wc = w + c * k;
    float acc = 0.f;
    for (int64_t i = 0; i < k - 1; ++i) acc += wc[i] * window[i * c_len + c];
    acc += wc[k - 1] * mixed[c];
    out[c] = silu(acc);
  }
  if (k > 1) {
    std::memmove(window, window + c_len, (k - 2) * c_len * sizeof(float));
    std::memcpy(window + (k - 2) * c_len, mixed, c_len * sizeof(float));
  }
}

// x [n] /= sqrt(sum x^2 + 1e-6), times ``scale``.
void l2norm(float* x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

// One value head's delta rule on S [dk, dv]; o [dv] gets S^T q after the update.
void delta_head(float* s, const float* q, const float* k, const float* v, float decay,
                float beta, float* o, int64_t dk, int64_t dv) {
  std::vector<float> kv(dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= decay;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) kv[j] = beta * (v[j] - kv[j]);  // delta
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * kv[j];
      o[j] += qi * row[j];
    }
  }
}

// o [dv] = rmsnorm(o) * w * silu(z).
void gated_norm(float* o, const float* z, const float* w, int64_t dv, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < dv; ++j) ss += o[j] * o[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
  for (int64_t j = 0; j < dv; ++j) o[j] = o[j] * r * w[j] * silu(z[j]);
}

at::Tensor gdn_step(const at::Tensor& mixed, const at::Tensor& window, const at::Tensor& conv_w,
                    const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                    const at::Tensor& dt_bias, const at::Tensor& s, const at::Tensor& z,
                    const at::Tensor& norm_w, int64_t key_heads, double eps) {
  for (const at::Tensor* t : {&mixed, &window, &conv_w, &a, &b, &a_log, &dt_bias, &s, &z,
                              &norm_w}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "gdn_step takes contiguous fp32 tensors");
  }
  const int64_t rows = mixed.size(0), c_len = mixed.size(1), k = conv_w.size(1);
  const int64_t hv = s.size(1), dk = s.size(2), dv = s.size(3);
  TORCH_CHECK(c_len == 2 * key_heads * dk + hv * dv && hv % key_heads == 0,
              "gdn_step: projections and state disagree");
  TORCH_CHECK(window.size(0) == rows && window.size(1) == k - 1 && s.size(0) == rows,
              "gdn_step: the window or state has the wrong shape");
  at::Tensor conv = at::empty({rows, c_len}, mixed.options());
  at::Tensor out = at::empty({rows, hv * dv}, mixed.options());
  const int64_t key_dim = key_heads * dk, rep = hv / key_heads;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = conv.data_ptr<float>() + r * c_len;
      conv_row(mixed.data_ptr<float>() + r * c_len, window.data_ptr<float>() + r * (k - 1) *
               c_len, conv_w.data_ptr<float>(), x, c_len, k);
      for (int64_t h = 0; h < key_heads; ++h) {
        l2norm(x + h * dk, dk, q_scale);
        l2norm(x + key_dim + h * dk, dk, 1.f);
      }
      for (int64_t h = 0; h < hv; ++h) {
        const int64_t kh = h / rep;
        const float g = -std::exp(a_log.data_ptr<float>()[h]) *
                        softplus(a.data_ptr<float>()[r * hv + h] + dt_bias.data_ptr<float>()[h]);
        const float beta = 1.f / (1.f + std::exp(-b.data_ptr<float>()[r * hv + h]));
        float* o = out.data_ptr<float>() + r * hv * dv + h * dv;
        delta_head(s.data_ptr<float>() + (r * hv + h) * dk * dv, x + kh * dk,
                   x + key_dim + kh * dk, x + 2 * key_dim + h * dv, std::exp(g), beta, o, dk,
                   dv);
        gated_norm(o, z.data_ptr<float>() + r * hv * dv + h * dv, norm_w.data_ptr<float>(),
                   dv, static_cast<float>(eps));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(linserve, m) {
  m.def(
      "gdn_step(Tensor mixed, Tensor(a!) window, Tensor conv_w, Tensor a, Tensor b, "
      "Tensor a_log, Tensor dt_bias, Tensor(b!) s, Tensor z, Tensor norm_w, int key_heads, "
      "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(linserve, CPU, m) { m.impl("gdn_step", &gdn_step); }
