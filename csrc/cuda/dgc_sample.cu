// CUDA kernels of DGC's sampling step (zen_ext::dgc_sample_keys) and of sorting and reading the samples
// back (zen_ext::dgc_sort_unkey): one launch, and one cub radix sort over only the bits a key uses,
// whatever the number of tensors in the bucket, no host read. The
// per-sample logic is csrc/dgc_sample.h, which the CPU op (csrc/cpu/dgc_sample.cpp) runs too; gpu_check
// compares the two byte for byte. A position outside the bucket cannot be raised from the device: its
// key carries the value 0 (the grid is built by zen_ext and never leaves the unit; the CPU op raises).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cub/device/device_radix_sort.cuh>

#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

#include "../dgc_sample.h"
#include "../dgc_sample_check.h"
#include "dgc_flat.h"

namespace zen_ext {
namespace {

constexpr int kThreads = 256;

template <typename grad_t>
__global__ void sample_keys_kernel(const float* __restrict__ R, const float* __restrict__ U,
                                   const grad_t* __restrict__ g, float m, const int64_t* __restrict__ grid,
                                   const int64_t* __restrict__ unit, const int64_t* __restrict__ hash,
                                   const int64_t* __restrict__ stride, int64_t shift, int64_t S, int64_t N,
                                   int64_t NU, int64_t* __restrict__ keys) {
  for (int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; s < S; s += int64_t(gridDim.x) * blockDim.x) {
    int64_t u = unit[s];
    u = u < 0 ? 0 : (u >= NU ? NU - 1 : u);
    const int64_t i = dgc::sample_position(grid[s], hash[u], stride[u], shift);
    float v = 0.0f;
    if (i >= 0 && i < N) {
      const float gi = static_cast<float>(g[i]);  // bf16/fp16 widen exactly
      v = dgc::sample_value(R[i], dgc::velocity_delta(U != nullptr ? U[i] : 0.0f, m, gi, U != nullptr));
    }
    keys[s] = dgc::sort_key(u, v);
  }
}

__global__ void unkey_kernel(const int64_t* __restrict__ keys, int64_t S, const int64_t* __restrict__ low,
                             int64_t NU, float tiny, float* __restrict__ vals, float* __restrict__ t_low) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t s = first; s < S; s += stride) vals[s] = dgc::key_value(keys[s]);
  for (int64_t u = first; u < NU; u += stride) {
    const int64_t at = low[u];
    const float v = at >= 0 && at < S ? dgc::key_value(keys[at]) : 0.0f;
    t_low[u] = fmaxf(v, tiny);
  }
}

template <typename scalar_t>
__global__ void all_finite_kernel(const scalar_t* __restrict__ g, int64_t N, bool* __restrict__ ok) {
  using acc_t = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N; i += int64_t(gridDim.x) * blockDim.x) {
    bad |= !isfinite(static_cast<acc_t>(g[i]));
  }
  // Every writer writes false: the race is benign.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *ok = false;
}

int64_t blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return b < 1 ? 1 : (b > 65535 ? 65535 : b);
}

at::Tensor dgc_sample_keys_cuda(const at::Tensor& R, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T,
                                double momentum, const at::Tensor& grid_S, const at::Tensor& unit_S,
                                const at::Tensor& hash_U, const at::Tensor& stride_U, int64_t shift) {
  dgc::check_sample_args(R, U_opt, g_T, grid_S, unit_S, hash_U, stride_U, shift, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(R.device());
  const bool has_u = U_opt.has_value() && U_opt->defined();
  const int64_t N = R.numel(), S = grid_S.numel(), NU = hash_U.numel();
  const at::Tensor g = dgc::flat_gradient(g_T, R, N, "dgc_sample_keys");
  const auto grid = grid_S.contiguous(), unit = unit_S.contiguous();
  const auto hash = hash_U.contiguous(), stride = stride_U.contiguous();
  auto keys = at::empty({S}, R.options().dtype(at::kLong));
  if (S == 0) return keys;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto grad_tag) {
    using grad_t = decltype(grad_tag);
    sample_keys_kernel<grad_t><<<blocks_for(S), kThreads, 0, stream>>>(
        R.data_ptr<float>(), has_u ? U_opt->data_ptr<float>() : nullptr,
        N > 0 ? g.data_ptr<grad_t>() : nullptr, static_cast<float>(momentum), grid.data_ptr<int64_t>(),
        unit.data_ptr<int64_t>(), hash.data_ptr<int64_t>(), stride.data_ptr<int64_t>(), shift, S, N, NU,
        keys.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const auto gdt = g.scalar_type();
  if (gdt == at::kBFloat16) {
    launch(c10::BFloat16());
  } else if (gdt == at::kHalf) {
    launch(c10::Half());
  } else {
    launch(float());
  }
  return keys;
}

std::tuple<at::Tensor, at::Tensor> dgc_sort_unkey_cuda(const at::Tensor& keys, const at::Tensor& low_U, double tiny,
                                                       int64_t key_bits) {
  TORCH_CHECK(keys.is_cuda() && keys.scalar_type() == at::kLong && keys.dim() == 1 &&
                  low_U.device() == keys.device() && low_U.scalar_type() == at::kLong && low_U.dim() == 1,
              "dgc_sort_unkey: keys and low_U must be 1-D int64 tensors on one CUDA device");
  TORCH_CHECK(key_bits >= 1 && key_bits <= 64, "dgc_sort_unkey: key_bits (", key_bits, ") must be in [1, 64]");
  TORCH_CHECK(keys.numel() <= std::numeric_limits<int>::max(), "dgc_sort_unkey: at most 2^31 - 1 keys, got ",
              keys.numel());
  const c10::cuda::CUDAGuard guard(keys.device());
  const auto k = keys.contiguous(), low = low_U.contiguous();
  const int64_t S = k.numel(), NU = low.numel();
  auto vals = at::empty({S}, keys.options().dtype(at::kFloat));
  auto t_low = at::empty({NU}, keys.options().dtype(at::kFloat));
  if (S == 0 && NU == 0) return {vals, t_low};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  // Step 1: sort the keys (non-negative: as unsigned) over bits [0, key_bits) only: no indices, and
  // 32 + ceil(log2 U) bits take 5 one-sweep passes for 49 units where torch.sort makes 8 and returns
  // the order too.
  auto sorted = at::empty_like(k);
  const auto* in = reinterpret_cast<const uint64_t*>(k.data_ptr<int64_t>());
  auto* out = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  size_t tmp_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, tmp_bytes, in, out, static_cast<int>(S), 0,
                                                static_cast<int>(key_bits), stream));
  auto tmp = at::empty({static_cast<int64_t>(tmp_bytes > 0 ? tmp_bytes : 1)}, keys.options().dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(tmp.data_ptr(), tmp_bytes, in, out, static_cast<int>(S), 0,
                                                static_cast<int>(key_bits), stream));
  // Step 2: the values and every unit's lower threshold.
  unkey_kernel<<<blocks_for(S > NU ? S : NU), kThreads, 0, stream>>>(
      sorted.data_ptr<int64_t>(), S, low.data_ptr<int64_t>(), NU, static_cast<float>(tiny), vals.data_ptr<float>(),
      t_low.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {vals, t_low};
}

// Two launches whatever the number of tensors (the flag's fill and one pass), where the norms'
// finiteness took six (two multi-tensor passes, their cleanup, a stack, a sum, a compare).
at::Tensor dgc_all_finite_cuda(at::TensorList g_T) {
  TORCH_CHECK(!g_T.empty(), "dgc_all_finite: needs at least one tensor");
  const auto& first = g_T[0];
  TORCH_CHECK(first.is_cuda(), "dgc_all_finite: the tensors must be on a CUDA device, got ", first.device());
  const c10::cuda::CUDAGuard guard(first.device());
  int64_t N = 0;
  for (const auto& g : g_T) N += g.numel();
  const at::Tensor flat = dgc::flat_gradient(g_T, first, N, "dgc_all_finite");
  auto ok = at::ones({}, first.options().dtype(at::kBool));
  if (N == 0) return ok;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "dgc_all_finite_cuda", [&] {
    all_finite_kernel<scalar_t><<<blocks_for(N < 1024 * kThreads ? N : 1024 * kThreads), kThreads, 0,
                                  c10::cuda::getCurrentCUDAStream()>>>(flat.data_ptr<scalar_t>(), N,
                                                                       ok.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return ok;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) {
  m.impl("dgc_all_finite", &dgc_all_finite_cuda);
  m.impl("dgc_sample_keys", &dgc_sample_keys_cuda);
  m.impl("dgc_sort_unkey", &dgc_sort_unkey_cuda);
}

}  // namespace zen_ext
