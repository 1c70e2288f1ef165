// The argument checks of zen_ext::dgc_sample_keys, one place for its CPU op (csrc/cpu/dgc_sample.cpp)
// and its CUDA op (csrc/cuda/dgc_sample.cu). Host only.
#pragma once
#include <ATen/core/Tensor.h>

#include "dgc_dtypes.h"

namespace zen_ext {
namespace dgc {

inline void check_sample_args(const at::Tensor& R, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T,
                       const at::Tensor& grid_S, const at::Tensor& unit_S, const at::Tensor& hash_U,
                       const at::Tensor& stride_U, int64_t shift, c10::DeviceType device) {
  TORCH_CHECK(R.device().type() == device && R.dim() == 1 && R.is_contiguous() && R.scalar_type() == at::kFloat,
              "dgc_sample_keys: R must be a contiguous 1-D float32 tensor on ", device, ", got ", R.scalar_type(),
              " of shape ", R.sizes(), " on ", R.device());
  dgc::check_accumulate_dtypes(R, g_T);
  if (U_opt.has_value() && U_opt->defined()) {
    TORCH_CHECK(U_opt->device() == R.device() && U_opt->is_contiguous() && U_opt->numel() == R.numel() &&
                    U_opt->scalar_type() == R.scalar_type(),
                "dgc_sample_keys: U must be a contiguous tensor like R");
  }
  for (const auto& t : {grid_S, unit_S, hash_U, stride_U}) {
    TORCH_CHECK(t.device() == R.device() && t.scalar_type() == at::kLong && t.dim() == 1,
                "dgc_sample_keys: grid_S, unit_S, hash_U and stride_U must be 1-D int64 tensors on R's device");
  }
  TORCH_CHECK(grid_S.numel() == unit_S.numel(), "dgc_sample_keys: grid_S (", grid_S.numel(), ") and unit_S (",
              unit_S.numel(), ") must have one length");
  TORCH_CHECK(hash_U.numel() == stride_U.numel() && hash_U.numel() >= 1,
              "dgc_sample_keys: hash_U and stride_U must have one length >= 1");
  TORCH_CHECK(shift >= 0, "dgc_sample_keys: shift (", shift, ") must be >= 0");
}

}  // namespace dgc
}  // namespace zen_ext
