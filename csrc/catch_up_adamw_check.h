// Argument checks of zen_ext::catch_up_adamw_, one place for its CPU op (csrc/cpu/catch_up_adamw.cpp)
// and its CUDA op (csrc/cuda/catch_up_adamw.cu). Host only.
#pragma once
#include <ATen/core/Tensor.h>

namespace zen_ext {
namespace optim {

// The five lists are as long as each other and the step is a real one.
inline void check_catch_up_lists(at::TensorList p_T, at::TensorList g_T, at::TensorList m_T, at::TensorList v_T,
                                 at::TensorList age_T, int64_t step) {
  const size_t n = p_T.size();
  TORCH_CHECK(g_T.size() == n && m_T.size() == n && v_T.size() == n && age_T.size() == n,
              "catch_up_adamw_: the five tensor lists must have the same length");
  TORCH_CHECK(step >= 1, "catch_up_adamw_: step (", step, ") must be >= 1");
}

// Parameter i (already on the op's device, contiguous): a supported dtype, its gradient and moments
// contiguous on its device with its dtype and size, its ages contiguous float32 of its size.
inline void check_catch_up_tensors(size_t i, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                                   const at::Tensor& v, const at::Tensor& age) {
  const auto dt = p.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "catch_up_adamw_: parameters of ", dt,
              " (supported: float32, bfloat16, float16; the arithmetic is float32)");
  for (const auto* t : {&g, &m, &v}) {
    TORCH_CHECK(t->device() == p.device() && t->is_contiguous() && t->scalar_type() == dt && t->numel() == p.numel(),
                "catch_up_adamw_: gradient and moments of parameter ", i,
                " must be contiguous tensors of its device, dtype and size");
  }
  TORCH_CHECK(age.device() == p.device() && age.is_contiguous() && age.scalar_type() == at::kFloat &&
                  age.numel() == p.numel(),
              "catch_up_adamw_: the ages of parameter ", i, " must be a contiguous float32 tensor of its size");
}

}  // namespace optim
}  // namespace zen_ext
