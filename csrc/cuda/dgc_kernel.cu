// CUDA kernel of DGC's accumulate-and-select pass (zen_ext::dgc_accumulate_select_), same schema and
// results as the CPU op (csrc/cpu/dgc_kernel.cpp, its oracle in tests): the velocity update, predicated
// on a device flag (a non-finite gradient leaves the memory alone without a host read), and the
// candidates |R| >= the threshold of the element's run, written in ascending order into outputs of a
// fixed capacity, with their number on the device. No host read, three launches whatever the number of
// tensors in the bucket:
//   1. accumulate_mark_kernel: per tile of 2048 elements, the update, one 32-bit ballot word per warp
//      and item (bit = candidate) and the tile's candidate count;
//   2. the exclusive scan of the tile counts (one torch cumsum);
//   3. compact_kernel: per tile, one thread per word writes the word's candidates at the tile's offset
//      plus the popcount prefix of the words before it (so the order is the elements' order); the grid
//      writes the padding after the last candidate.
// The first `capacity` candidates are written; the count says how many there were.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <tuple>

#include "../dgc_dtypes.h"
#include "dgc_flat.h"
#include "dgc_select.cuh"

namespace zen_ext {
namespace {

using dgc_select::first_past;  // the run of an element: first_past(ends, T, i)
constexpr int kThreads = dgc_select::kTileThreads;
constexpr int kItems = dgc_select::kTileItems;
constexpr int64_t kTile = dgc_select::kTileSize;  // elements per block
constexpr int kWordsPerTile = dgc_select::kTileWords;  // 64: one compaction thread per word

// The update's two roundings, never contracted into a fused multiply-add (the CPU op and torch's
// U.mul_(m); U.add_(g) round twice).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename scalar_t, typename grad_t>
__global__ void accumulate_mark_kernel(scalar_t* __restrict__ R, scalar_t* __restrict__ U,
                                       const grad_t* __restrict__ g, scalar_t m, const scalar_t* __restrict__ thr,
                                       const int64_t* __restrict__ ends, int64_t T, const bool* __restrict__ ok,
                                       int64_t N, uint32_t* __restrict__ words, int64_t* __restrict__ tile_count) {
  const int64_t tile = blockIdx.x;
  const int64_t base = tile * kTile;
  const bool update = ok == nullptr || *ok;
  int64_t t = first_past(ends, T, base + threadIdx.x < N ? base + threadIdx.x : N - 1);
  int count = 0;
  for (int j = 0; j < kItems; ++j) {
    const int64_t i = base + int64_t(j) * kThreads + threadIdx.x;
    bool hit = false;
    if (update && i < N) {
      while (ends[t] <= i) ++t;  // elements grow by kThreads per item: a run rarely changes
      scalar_t r;
      const scalar_t gi = static_cast<scalar_t>(g[i]);  // bf16/fp16 widen to fp32 exactly
      if (U != nullptr) {
        const scalar_t u = add_rn(mul_rn(U[i], m), gi);
        U[i] = u;
        r = add_rn(R[i], u);
      } else {
        r = add_rn(R[i], gi);
      }
      R[i] = r;
      const scalar_t th = thr[t];
      hit = r >= th || r <= -th;  // NaN: never a candidate, as on the CPU
    }
    dgc_select::mark_word(hit, tile, j, words, count);  // words in ascending order: elements in ascending order
  }
  dgc_select::store_tile_count(count, tile, tile_count);
}

template <typename scalar_t>
__global__ void compact_kernel(const uint32_t* __restrict__ words, const int64_t* __restrict__ tile_end,
                               const int64_t* __restrict__ tile_count, const scalar_t* __restrict__ R,
                               const int64_t* __restrict__ ends, int64_t T, int64_t N, int64_t capacity,
                               int64_t* __restrict__ pos, scalar_t* __restrict__ val, int64_t* __restrict__ run) {
  const int64_t tile = blockIdx.x;
  const int w = threadIdx.x;  // blockDim.x == kWordsPerTile == 64: two warps
  uint32_t bits;
  int64_t o = dgc_select::compact_start(words, tile_end, tile_count, N, T, capacity, pos, val, run, bits);
  if (o >= capacity) return;
  const int64_t first = tile * kTile + int64_t(w) * 32;
  int64_t t = -1;
  while (bits != 0u && o < capacity) {
    const int b = __ffs(int(bits)) - 1;
    bits &= bits - 1u;
    const int64_t i = first + b;
    if (t < 0) t = first_past(ends, T, i);
    while (ends[t] <= i) ++t;
    pos[o] = i;
    val[o] = R[i];
    run[o] = t;
    ++o;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dgc_accumulate_select_cuda(
    const at::Tensor& R, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T, double momentum,
    const at::Tensor& thr_U, const at::Tensor& ends_U, const c10::optional<at::Tensor>& ok_opt, int64_t capacity) {
  TORCH_CHECK(R.is_cuda() && R.dim() == 1 && R.is_contiguous(),
              "dgc_accumulate_select_: R must be a contiguous 1-D CUDA tensor, got shape ", R.sizes());
  dgc::check_accumulate_dtypes(R, g_T);
  TORCH_CHECK(capacity >= 0, "dgc_accumulate_select_: capacity (", capacity,
              ") must be >= 0 on CUDA (the number of candidates stays on the device)");
  const c10::cuda::CUDAGuard guard(R.device());
  const int64_t N = R.numel();
  const bool has_u = U_opt.has_value() && U_opt->defined();
  if (has_u) {
    TORCH_CHECK(U_opt->device() == R.device() && U_opt->is_contiguous() && U_opt->numel() == N &&
                    U_opt->scalar_type() == R.scalar_type(),
                "dgc_accumulate_select_: U must be a contiguous tensor like R");
  }
  TORCH_CHECK(thr_U.scalar_type() == R.scalar_type() && ends_U.scalar_type() == at::kLong && thr_U.dim() == 1 &&
                  ends_U.dim() == 1 && thr_U.numel() == ends_U.numel() && thr_U.numel() >= 1 &&
                  thr_U.device() == R.device() && ends_U.device() == R.device(),
              "dgc_accumulate_select_: thr_U (R's dtype) and ends_U (int64) must be 1-D of one length >= 1 on R's "
              "device");
  const bool has_ok = ok_opt.has_value() && ok_opt->defined();
  if (has_ok) {
    TORCH_CHECK(ok_opt->device() == R.device() && ok_opt->scalar_type() == at::kBool && ok_opt->numel() == 1,
                "dgc_accumulate_select_: ok must be one bool on R's device");
  }
  const at::Tensor g = dgc::flat_gradient(g_T, R, N, "dgc_accumulate_select_");
  const auto thr = thr_U.contiguous();
  const auto ends = ends_U.contiguous();
  const auto ok = has_ok ? ok_opt->contiguous() : at::Tensor();
  const int64_t T = ends.numel();
  auto lopt = R.options().dtype(at::kLong);
  const int64_t tiles = (N + kTile - 1) / kTile;
  if (tiles == 0) {  // padding only: position N, value 0, run T (past every run)
    return {at::full({capacity}, N, lopt), at::zeros({capacity}, R.options()), at::full({capacity}, T, lopt),
            at::zeros({1}, lopt)};
  }
  // Written whole by compact_kernel: the candidates, then the padding.
  auto pos = at::empty({capacity}, lopt);
  auto run = at::empty({capacity}, lopt);
  auto val = at::empty({capacity}, R.options());
  auto words = at::empty({tiles * kWordsPerTile}, R.options().dtype(at::kInt));
  auto tile_count = at::empty({tiles}, lopt);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto mark = [&](auto scalar_tag, auto grad_tag) {
    using scalar_t = decltype(scalar_tag);
    using grad_t = decltype(grad_tag);
    accumulate_mark_kernel<scalar_t, grad_t><<<tiles, kThreads, 0, stream>>>(
        R.data_ptr<scalar_t>(), has_u ? U_opt->data_ptr<scalar_t>() : nullptr, g.data_ptr<grad_t>(),
        static_cast<scalar_t>(momentum), thr.data_ptr<scalar_t>(), ends.data_ptr<int64_t>(), T,
        has_ok ? ok.data_ptr<bool>() : nullptr, N, reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()),
        tile_count.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (R.scalar_type() == at::kDouble) {
    mark(double(), double());
  } else if (g.scalar_type() == at::kBFloat16) {
    mark(float(), c10::BFloat16());
  } else if (g.scalar_type() == at::kHalf) {
    mark(float(), c10::Half());
  } else {
    mark(float(), float());
  }
  // Step 2: where each tile's candidates end (inclusive scan); the last is the count.
  const auto tile_end = tile_count.cumsum(0);
  if (capacity > 0) {
    AT_DISPATCH_FLOATING_TYPES(R.scalar_type(), "dgc_accumulate_select_cuda", [&] {
      compact_kernel<scalar_t><<<tiles, kWordsPerTile, 0, stream>>>(
          reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), tile_end.data_ptr<int64_t>(),
          tile_count.data_ptr<int64_t>(), R.data_ptr<scalar_t>(), ends.data_ptr<int64_t>(), T, N, capacity,
          pos.data_ptr<int64_t>(), val.data_ptr<scalar_t>(), run.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {pos, val, run, tile_end.narrow(0, tiles - 1, 1)};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) { m.impl("dgc_accumulate_select_", &dgc_accumulate_select_cuda); }

}  // namespace zen_ext
