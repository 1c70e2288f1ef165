// CPU kernel of zen_ext::catch_up_adamw_: CatchUpAdamW's step (zen_ext/optim.py) in one pass over each
// tensor, where the torch path makes about twenty, and a coordinate with a zero gradient (most of them
// under DGC) costs only its decay and age. Per-element logic: csrc/catch_up_adamw.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cmath>

#include "../catch_up_adamw.h"

namespace zen_ext {
namespace {

void catch_up_adamw_cpu(at::TensorList p_T, at::TensorList g_T, at::TensorList m_T, at::TensorList v_T,
                        at::TensorList age_T, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, bool catch_up) {
  const size_t n = p_T.size();
  TORCH_CHECK(g_T.size() == n && m_T.size() == n && v_T.size() == n && age_T.size() == n,
              "catch_up_adamw_: the five tensor lists must have the same length");
  TORCH_CHECK(step >= 1, "catch_up_adamw_: step (", step, ") must be >= 1");
  optim::CatchUpStep c;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.step_scale = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.catch_up = catch_up;
  for (size_t i = 0; i < n; ++i) {
    const auto& p = p_T[i];
    const auto dt = p.scalar_type();
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), "catch_up_adamw_: parameter ", i,
                " must be a contiguous CPU tensor");
    for (const auto* t : {&g_T[i], &m_T[i], &v_T[i]}) {
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == dt && t->numel() == p.numel(),
                  "catch_up_adamw_: gradient and moments of parameter ", i,
                  " must be contiguous CPU tensors of its dtype and size");
    }
    const auto& age = age_T[i];
    TORCH_CHECK(age.device().is_cpu() && age.is_contiguous() && age.scalar_type() == at::kFloat &&
                    age.numel() == p.numel(),
                "catch_up_adamw_: the ages of parameter ", i, " must be a contiguous float32 CPU tensor of its size");
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "catch_up_adamw_: parameters of ", dt,
                " (supported: float32, bfloat16, float16; the arithmetic is float32)");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "catch_up_adamw_", [&] {
      scalar_t* pp = p.data_ptr<scalar_t>();
      const scalar_t* gp = g_T[i].data_ptr<scalar_t>();
      scalar_t* mp = m_T[i].data_ptr<scalar_t>();
      scalar_t* vp = v_T[i].data_ptr<scalar_t>();
      float* ap = age.data_ptr<float>();
      at::parallel_for(0, p.numel(), 1 << 15, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) optim::catch_up_adamw_element(pp[j], gp[j], mp[j], vp[j], ap[j], c);
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) { m.impl("catch_up_adamw_", &catch_up_adamw_cpu); }

}  // namespace zen_ext
