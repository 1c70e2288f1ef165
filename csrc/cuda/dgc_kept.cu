// CUDA kernels of zen_ext::dgc_gather_kept, same schema and results as the CPU op
// (csrc/cpu/dgc_kept.cpp): the candidates the threshold search keeps, compacted in ascending order, and
// the bucket's three read-back values (the finiteness flag, the candidates' and the kept entries'
// numbers) in one int64 tensor, so the caller reads them with one copy. Two launches whatever the number
// of candidates, where ``nonzero_static``, two ``index_select`` and the stacking of the three values
// took nine:
//   1. kept_count_kernel: per tile of the candidates, the number kept;
//   2. gather_kept_kernel: per tile, its offset (the counts of the tiles before it, summed by the
//      block: the tile length grows with the candidates so that there are at most kMaxTiles), then the
//      tile's kept entries in order (a ballot per warp, the warps' counts in shared memory); the grid
//      zeroes the padding past the last kept entry, and block 0 writes the three values.
// Launched on the current stream, no host read.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "../dgc_kept_check.h"

namespace zen_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMinTile = 2048;
constexpr int64_t kMaxTiles = 1024;

// The block's sum of one value per thread (every thread gets it).
__device__ __forceinline__ long long block_sum(long long x, long long* warp_sum) {
  for (int d = 16; d > 0; d >>= 1) x += __shfl_down_sync(0xffffffffu, x, d);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sum[warp] = x;
  __syncthreads();
  long long total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_sum[w];
  __syncthreads();  // warp_sum may be reused at once
  return total;
}

__global__ void kept_count_kernel(const bool* __restrict__ keep, int64_t C, int64_t tile_len,
                                  int64_t* __restrict__ tile_count) {
  __shared__ long long warp_sum[kWarps];
  const int64_t start = int64_t(blockIdx.x) * tile_len;
  const int64_t end = start + tile_len < C ? start + tile_len : C;
  long long n = 0;
  for (int64_t i = start + threadIdx.x; i < end; i += kThreads) n += keep[i] ? 1 : 0;
  n = block_sum(n, warp_sum);
  if (threadIdx.x == 0) tile_count[blockIdx.x] = n;
}

template <typename scalar_t>
__global__ void gather_kept_kernel(const bool* __restrict__ keep, const int64_t* __restrict__ pos,
                                   const scalar_t* __restrict__ v, int64_t C, int64_t tile_len, int64_t T,
                                   const int64_t* __restrict__ tile_count, const bool* __restrict__ ok,
                                   const int64_t* __restrict__ count_C, int64_t* __restrict__ pos_K,
                                   scalar_t* __restrict__ v_K, int64_t* __restrict__ stats) {
  __shared__ long long warp_sum[kWarps];
  __shared__ int warp_kept[kWarps];
  const int64_t tile = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Step 1: this tile's offset and the total, from the tiles' counts (at most kMaxTiles of them).
  long long before = 0, all = 0;
  for (int64_t j = threadIdx.x; j < T; j += kThreads) {
    all += tile_count[j];
    before += j < tile ? tile_count[j] : 0;
  }
  int64_t o = block_sum(before, warp_sum);
  const int64_t total = block_sum(all, warp_sum);
  if (tile == 0 && threadIdx.x == 0) {
    stats[0] = ok == nullptr ? 1 : int64_t(*ok);
    stats[1] = count_C[0];
    stats[2] = total;
  }
  // Step 2: the padding past the last kept entry, spread over the grid.
  for (int64_t q = total + tile * kThreads + threadIdx.x; q < C; q += int64_t(gridDim.x) * kThreads) {
    pos_K[q] = 0;
    v_K[q] = scalar_t(0);
  }
  // Step 3: the tile's kept entries, chunk by chunk of kThreads, in order (the chunk loop is uniform
  // over the block: every lane reaches the ballot).
  const int64_t start = tile * tile_len;
  const int64_t end = start + tile_len < C ? start + tile_len : C;
  for (int64_t base = start; base < end; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const bool hit = i < end && keep[i];
    const unsigned bits = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_kept[warp] = __popc(bits);
    __syncthreads();
    int64_t at = o + __popc(bits & ((1u << lane) - 1u));
    int chunk = 0;
    for (int w = 0; w < kWarps; ++w) {
      at += w < warp ? warp_kept[w] : 0;
      chunk += warp_kept[w];
    }
    if (hit) {
      pos_K[at] = pos[i];
      v_K[at] = v[i];
    }
    o += chunk;
    __syncthreads();  // warp_kept is rewritten by the next chunk
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dgc_gather_kept_cuda(const at::Tensor& keep_C, const at::Tensor& pos_C,
                                                                    const at::Tensor& v_C,
                                                                    const c10::optional<at::Tensor>& ok_opt,
                                                                    const at::Tensor& count_C) {
  dgc::check_gather_kept_args(keep_C, pos_C, v_C, ok_opt, count_C);
  TORCH_CHECK(keep_C.is_cuda(), "dgc_gather_kept: keep_C must be a CUDA tensor here");
  const bool has_ok = ok_opt.has_value() && ok_opt->defined();
  const c10::cuda::CUDAGuard guard(keep_C.device());
  const auto keep = keep_C.contiguous(), pos = pos_C.contiguous(), v = v_C.contiguous(), cnt = count_C.contiguous();
  const auto ok = has_ok ? ok_opt->contiguous() : at::Tensor();
  const int64_t C = keep.numel();
  // Tiles of at least kMinTile candidates, and at most kMaxTiles of them (each block sums the counts).
  int64_t tile_len = std::max(kMinTile, (C + kMaxTiles - 1) / kMaxTiles);
  tile_len = (tile_len + kThreads - 1) / kThreads * kThreads;
  const int64_t T = std::max<int64_t>(1, (C + tile_len - 1) / tile_len);
  auto pos_K = at::empty({C}, pos.options());  // written whole by gather_kept_kernel
  auto v_K = at::empty({C}, v.options());
  auto stats = at::empty({3}, pos.options());
  auto tile_count = at::empty({T}, pos.options());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  kept_count_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(keep.data_ptr<bool>(), C, tile_len,
                                                                        tile_count.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "dgc_gather_kept", [&] {
    gather_kept_kernel<scalar_t><<<static_cast<unsigned>(T), kThreads, 0, stream>>>(
        keep.data_ptr<bool>(), pos.data_ptr<int64_t>(), v.data_ptr<scalar_t>(), C, tile_len, T,
        tile_count.data_ptr<int64_t>(), has_ok ? ok.data_ptr<bool>() : nullptr, cnt.data_ptr<int64_t>(),
        pos_K.data_ptr<int64_t>(), v_K.data_ptr<scalar_t>(), stats.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {pos_K, v_K, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) { m.impl("dgc_gather_kept", &dgc_gather_kept_cuda); }

}  // namespace zen_ext
