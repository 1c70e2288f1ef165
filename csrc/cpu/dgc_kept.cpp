// CPU kernel of zen_ext::dgc_gather_kept: the threshold search's kept candidates, compacted in order,
// and the bucket's three read-back values in one tensor. Same schema and results as the CUDA kernels
// (csrc/cuda/dgc_kept.cu); plain torch (``nonzero`` and ``index_select``) is its oracle in
// tests/ops/test_dgc_ops.py.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include "../dgc_kept_check.h"

namespace zen_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dgc_gather_kept_cpu(const at::Tensor& keep_C, const at::Tensor& pos_C,
                                                                   const at::Tensor& v_C,
                                                                   const c10::optional<at::Tensor>& ok,
                                                                   const at::Tensor& count_C) {
  dgc::check_gather_kept_args(keep_C, pos_C, v_C, ok, count_C);
  const auto keep = keep_C.contiguous(), pos = pos_C.contiguous(), v = v_C.contiguous();
  const int64_t C = keep.numel();
  auto pos_K = at::zeros({C}, pos.options());  // the padding past the kept entries: zeros
  auto v_K = at::zeros({C}, v.options());
  auto stats = at::empty({3}, pos.options());
  const bool* kp = keep.data_ptr<bool>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t* out_p = pos_K.data_ptr<int64_t>();
  int64_t n = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "dgc_gather_kept", [&] {
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* out_v = v_K.data_ptr<scalar_t>();
    for (int64_t i = 0; i < C; ++i) {
      if (kp[i]) {
        out_p[n] = pp[i];
        out_v[n] = vp[i];
        ++n;
      }
    }
  });
  int64_t* sp = stats.data_ptr<int64_t>();
  sp[0] = (ok.has_value() && ok->defined()) ? int64_t(ok->item<bool>()) : 1;
  sp[1] = count_C.reshape(-1)[0].item<int64_t>();
  sp[2] = n;
  return {pos_K, v_K, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) { m.impl("dgc_gather_kept", &dgc_gather_kept_cpu); }

}  // namespace zen_ext
