// The argument checks of zen_ext::dgc_gather_kept, one place for its CPU op (csrc/cpu/dgc_kept.cpp) and
// its CUDA op (csrc/cuda/dgc_kept.cu). Host only.
#pragma once
#include <ATen/core/Tensor.h>

namespace zen_ext {
namespace dgc {

inline void check_gather_kept_args(const at::Tensor& keep_C, const at::Tensor& pos_C, const at::Tensor& v_C,
                                   const c10::optional<at::Tensor>& ok, const at::Tensor& count_C) {
  TORCH_CHECK(keep_C.dim() == 1 && keep_C.scalar_type() == at::kBool, "dgc_gather_kept: keep_C must be 1-D bool");
  TORCH_CHECK(pos_C.dim() == 1 && pos_C.scalar_type() == at::kLong && pos_C.numel() == keep_C.numel() &&
                  v_C.dim() == 1 && v_C.numel() == keep_C.numel(),
              "dgc_gather_kept: pos_C (int64) and v_C must be 1-D and as long as keep_C");
  TORCH_CHECK(count_C.scalar_type() == at::kLong && count_C.numel() >= 1,
              "dgc_gather_kept: count_C must hold the candidates' number as int64");
  TORCH_CHECK(!ok.has_value() || !ok->defined() ||
                  (ok->scalar_type() == at::kBool && ok->numel() == 1 && ok->device() == keep_C.device()),
              "dgc_gather_kept: ok must be one bool on keep_C's device");
  for (const at::Tensor* t : {&pos_C, &v_C, &count_C}) {
    TORCH_CHECK(t->device() == keep_C.device(), "dgc_gather_kept: every tensor must be on keep_C's device");
  }
}

}  // namespace dgc
}  // namespace zen_ext
