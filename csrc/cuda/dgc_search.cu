// CUDA kernel of DGC's threshold search (zen_ext::dgc_threshold_search), same schema and per-unit logic
// (csrc/dgc_search.h) as the CPU op (csrc/cpu/dgc_search.cpp): one block per selection unit runs every
// refinement pass over its candidates (block-wide counts, one thread moves the probe), then writes the
// unit's threshold and keep mask. One launch per bucket, where the torch path issues about two hundred
// small ones; launched on the current stream, no host read.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../dgc_search.h"

namespace zen_ext {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void threshold_search_kernel(const scalar_t* __restrict__ sorted, const int64_t* __restrict__ start_U,
                                        const double* __restrict__ ns_U, const double* __restrict__ k_U,
                                        const double* __restrict__ first_U, const scalar_t* __restrict__ v_C,
                                        const int64_t* __restrict__ unit_C, int64_t C,
                                        const scalar_t* __restrict__ t_low_U, int64_t passes,
                                        scalar_t* __restrict__ thr_U, bool* __restrict__ keep_C) {
  __shared__ long long partial[kThreads];
  __shared__ double thr_sh;
  __shared__ int done_sh;
  const int64_t u = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t c0 = dgc::lower_bound(unit_C, C, u), c1 = dgc::lower_bound(unit_C, C, u + 1);
  const double t_low = static_cast<double>(t_low_U[u]);
  dgc::Search s;  // only thread 0's copy moves
  s.rank = first_U[u];
  s.k = k_U[u];
  s.ns = ns_U[u];
  if (tid == 0) {
    thr_sh = dgc::at_rank(sorted, start_U[u], s.ns, s.rank);
    done_sh = 0;
  }
  __syncthreads();
  for (int64_t p = 0; p < passes; ++p) {
    if (done_sh) break;  // uniform: read after the barrier that published it
    const double t_eff = thr_sh > t_low ? thr_sh : t_low;
    long long count = 0;
    for (int64_t i = c0 + tid; i < c1; i += kThreads) count += dgc::abs_of(v_C[i]) >= t_eff;
    partial[tid] = count;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
      if (tid < half) partial[tid] += partial[tid + half];
      __syncthreads();
    }
    if (tid == 0) {
      double thr = thr_sh;
      dgc::update(s, static_cast<double>(partial[0]), thr, sorted, start_U[u]);
      thr_sh = thr;
      done_sh = s.done ? 1 : 0;
    }
    __syncthreads();
  }
  const double t_final = thr_sh > t_low ? thr_sh : t_low;
  if (tid == 0) thr_U[u] = static_cast<scalar_t>(t_final);  // exact: either value came from this dtype
  for (int64_t i = c0 + tid; i < c1; i += kThreads) keep_C[i] = dgc::abs_of(v_C[i]) >= t_final;
}

std::tuple<at::Tensor, at::Tensor> dgc_threshold_search_cuda(const at::Tensor& sorted_S, const at::Tensor& start_U,
                                                             const at::Tensor& ns_U, const at::Tensor& k_U,
                                                             const at::Tensor& first_U, const at::Tensor& v_C,
                                                             const at::Tensor& unit_C, const at::Tensor& t_low_U,
                                                             int64_t passes) {
  const auto U = start_U.numel();
  TORCH_CHECK(sorted_S.dim() == 1 && v_C.dim() == 1 && sorted_S.scalar_type() == v_C.scalar_type() &&
                  t_low_U.scalar_type() == v_C.scalar_type() && t_low_U.numel() == U,
              "dgc_threshold_search: sorted_S, v_C and t_low_U must be 1-D of one floating dtype");
  TORCH_CHECK(start_U.scalar_type() == at::kLong && unit_C.scalar_type() == at::kLong && unit_C.numel() == v_C.numel(),
              "dgc_threshold_search: start_U and unit_C must be int64, unit_C as long as v_C");
  TORCH_CHECK(ns_U.scalar_type() == at::kDouble && k_U.scalar_type() == at::kDouble && first_U.scalar_type() == at::kDouble &&
                  ns_U.numel() == U && k_U.numel() == U && first_U.numel() == U,
              "dgc_threshold_search: ns_U, k_U and first_U must be float64 with one entry per unit");
  const c10::cuda::CUDAGuard guard(v_C.device());
  const auto S = sorted_S.contiguous(), st = start_U.contiguous(), ns = ns_U.contiguous(), kk = k_U.contiguous(),
             fr = first_U.contiguous(), v = v_C.contiguous(), un = unit_C.contiguous(), tl = t_low_U.contiguous();
  auto thr_U = at::empty({U}, v.options());
  auto keep_C = at::zeros({v.numel()}, v.options().dtype(at::kBool));  // padding (no unit) stays false
  if (U == 0) return {thr_U, keep_C};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "dgc_threshold_search", [&] {
    threshold_search_kernel<scalar_t><<<static_cast<unsigned>(U), kThreads, 0, stream>>>(
        S.data_ptr<scalar_t>(), st.data_ptr<int64_t>(), ns.data_ptr<double>(), kk.data_ptr<double>(),
        fr.data_ptr<double>(), v.data_ptr<scalar_t>(), un.data_ptr<int64_t>(), v.numel(), tl.data_ptr<scalar_t>(),
        passes, thr_U.data_ptr<scalar_t>(), keep_C.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {thr_U, keep_C};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) { m.impl("dgc_threshold_search", &dgc_threshold_search_cuda); }

}  // namespace zen_ext
