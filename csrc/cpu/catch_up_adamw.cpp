// CPU kernel of zen_ext::catch_up_adamw_: CatchUpAdamW's step (zen_ext/optim.py) in one pass over each
// tensor, where the torch path makes about twenty, and a coordinate with a zero gradient (most of them
// under DGC) costs only its decay and age. Per-element logic: csrc/catch_up_adamw.h.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>

#include "../catch_up_adamw.h"
#include "../catch_up_adamw_check.h"

namespace zen_ext {
namespace {

void catch_up_adamw_cpu(at::TensorList p_T, at::TensorList g_T, at::TensorList m_T, at::TensorList v_T,
                        at::TensorList age_T, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, bool catch_up) {
  optim::check_catch_up_lists(p_T, g_T, m_T, v_T, age_T, step);
  const optim::CatchUpStep c = optim::catch_up_step(lr, beta1, beta2, eps, weight_decay, step, catch_up);
  for (size_t i = 0; i < p_T.size(); ++i) {
    const auto& p = p_T[i];
    const auto& age = age_T[i];
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous(), "catch_up_adamw_: parameter ", i,
                " must be a contiguous CPU tensor");
    optim::check_catch_up_tensors(i, p, g_T[i], m_T[i], v_T[i], age);
    const auto dt = p.scalar_type();
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
