// The concatenation of a DGC bucket's gradients as one CUDA tensor, for the DGC kernels
// (csrc/cuda/dgc_kernel.cu, csrc/cuda/dgc_sample.cu). Host only.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

namespace zen_ext {
namespace dgc {

// The gradients' concatenation as one pointer: the tensors themselves when they lie back to back in
// memory (the Synchronizer's views of one bucket), else one copy.
inline at::Tensor flat_gradient(at::TensorList g_T, const at::Tensor& R, int64_t N, const char* op) {
  const auto gdt = g_T[0].scalar_type();  // a supported pair with R's: check_accumulate_dtypes ran first
  int64_t at_elem = 0;
  bool adjacent = true;
  const auto esz = g_T[0].element_size();
  const char* start = static_cast<const char*>(g_T[0].data_ptr());
  for (const auto& g : g_T) {
    TORCH_CHECK(g.device() == R.device() && g.is_contiguous() && g.scalar_type() == gdt,
                op, ": every gradient must be a contiguous tensor of ", gdt, " on ",
                R.device(), ", got ", g.scalar_type(), " on ", g.device());
    if (g.numel() > 0 && static_cast<const char*>(g.data_ptr()) != start + at_elem * esz) adjacent = false;
    at_elem += g.numel();
  }
  TORCH_CHECK(at_elem == N, op, ": the gradients hold ", at_elem, " elements, R ", N);
  if (g_T.size() == 1) return g_T[0];
  if (adjacent && N > 0) {
    // A view over the bytes the tensors occupy (they share one allocation: back to back).
    return at::from_blob(const_cast<char*>(start), {N}, g_T[0].options());
  }
  return N > 0 ? at::cat(g_T) : at::empty({0}, g_T[0].options());
}

}  // namespace dgc
}  // namespace zen_ext
