// CUDA kernel of zen_ext::catch_up_adamw_: CatchUpAdamW's step (zen_ext/optim.py) in one launch per
// tensor, where the torch path launches about twenty. The per-element logic is csrc/catch_up_adamw.h,
// which the CPU op (csrc/cpu/catch_up_adamw.cpp) runs too; gpu_check compares the two.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../catch_up_adamw.h"
#include "../catch_up_adamw_check.h"

namespace zen_ext {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void catch_up_adamw_kernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m,
                                      T* __restrict__ v, float* __restrict__ age, int64_t n,
                                      optim::CatchUpStep c) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    optim::catch_up_adamw_element(p[j], g[j], m[j], v[j], age[j], c);
  }
}

void catch_up_adamw_cuda(at::TensorList p_T, at::TensorList g_T, at::TensorList m_T, at::TensorList v_T,
                         at::TensorList age_T, double lr, double beta1, double beta2, double eps,
                         double weight_decay, int64_t step, bool catch_up) {
  optim::check_catch_up_lists(p_T, g_T, m_T, v_T, age_T, step);
  const optim::CatchUpStep c = optim::catch_up_step(lr, beta1, beta2, eps, weight_decay, step, catch_up);
  for (size_t i = 0; i < p_T.size(); ++i) {
    const auto& p = p_T[i];
    const auto& age = age_T[i];
    TORCH_CHECK(p.is_cuda() && p.is_contiguous(), "catch_up_adamw_: parameter ", i,
                " must be a contiguous CUDA tensor");
    optim::check_catch_up_tensors(i, p, g_T[i], m_T[i], v_T[i], age);
    const auto dt = p.scalar_type();
    const int64_t numel = p.numel();
    if (numel == 0) continue;
    const c10::cuda::CUDAGuard guard(p.device());
    const int64_t blocks = std::min<int64_t>((numel + kThreads - 1) / kThreads, 65535);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "catch_up_adamw_cuda", [&] {
      catch_up_adamw_kernel<scalar_t><<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          p.data_ptr<scalar_t>(), g_T[i].data_ptr<scalar_t>(), m_T[i].data_ptr<scalar_t>(),
          v_T[i].data_ptr<scalar_t>(), age.data_ptr<float>(), numel, c);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) { m.impl("catch_up_adamw_", &catch_up_adamw_cuda); }

}  // namespace zen_ext
