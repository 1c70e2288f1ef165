// The dtype rule of zen_ext::dgc_accumulate_select_, one place for its CPU op (csrc/cpu/dgc_kernel.cpp)
// and its CUDA op (csrc/cuda/dgc_kernel.cu): memory (R, U) of fp32 or fp64; gradients of the memory's
// dtype, or bf16/fp16 with fp32 memory (widened exactly, as torch's mixed-dtype add does). Host only.
#pragma once
#include <ATen/core/Tensor.h>

namespace zen_ext {
namespace dgc {

// Raise unless R's and the gradients' dtypes are a supported pair; returns the gradients' dtype.
inline at::ScalarType check_accumulate_dtypes(const at::Tensor& R, at::TensorList g_T) {
  TORCH_CHECK(R.scalar_type() == at::kFloat || R.scalar_type() == at::kDouble,
              "dgc_accumulate_select_: memory of ", R.scalar_type(), " (supported: float32, float64)");
  TORCH_CHECK(!g_T.empty(), "dgc_accumulate_select_: needs at least one gradient");
  const auto gdt = g_T[0].scalar_type();
  TORCH_CHECK(gdt == R.scalar_type() ||
                  (R.scalar_type() == at::kFloat && (gdt == at::kBFloat16 || gdt == at::kHalf)),
              "dgc_accumulate_select_: gradients of ", gdt, " with memory of ", R.scalar_type(),
              " (supported: the memory's dtype, or bf16/fp16 with fp32 memory)");
  return gdt;
}

}  // namespace dgc
}  // namespace zen_ext
