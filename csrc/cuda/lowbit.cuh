// The device side shared by the low-bit CUDA ops (csrc/cuda/lowbit.cu: quantize_blocks, dequantize_blocks;
// csrc/cuda/lowbit_fused.cu: quantize_sent_, dequantize_add_blocks_, quantize_owned_). One quantizing kernel,
// templated on where its values come from and what it does with each dequantized value (Src: load(e),
// store(e, x, x̂)), so every quantizing op is one launch with the same block rules; the segment table; the
// arithmetic is csrc/lowbit.h's, host and device alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <vector>

#include "../lowbit.h"

namespace zen_ext {
namespace lowbit {

constexpr int kMaxBlock = 1024;

// The segment of global block (or element) i: the last s with first[s] <= i, first of size S + 1.
__device__ __forceinline__ int64_t segment_of(const int64_t* first, int64_t S, int64_t i) {
  int64_t lo = 0, hi = S - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One thread block per value block (its segment found by a binary search over the segments' first blocks):
// the block's |x| max reduced in shared memory (NaN kept), then each thread its value's code and x̂, handed
// to src.store; a 4-bit pair is packed by its even thread. blockDim: a power of two >= block.
template <typename Src>
__global__ void quantize_kernel(Src src, const int64_t* __restrict__ table, int64_t S, int64_t bits, int64_t block,
                                uint8_t* __restrict__ codes, float* __restrict__ scales) {
  __shared__ float red[kMaxBlock];
  __shared__ int qs[kMaxBlock];
  const int64_t* elem = table;
  const int64_t* code = table + (S + 1);
  const int64_t* blk = table + 2 * (S + 1);
  const int64_t bi = blockIdx.x;
  const int64_t s = segment_of(blk, S, bi);
  const int64_t c = elem[s + 1] - elem[s];
  const int64_t b0 = (bi - blk[s]) * block;
  const int64_t len = c - b0 < block ? c - b0 : block;
  const int t = threadIdx.x;
  const bool mine = t < len;
  const int64_t e = elem[s] + b0 + t;
  const float v = mine ? src.load(e) : 0.0f;
  red[t] = mine ? fabsf(v) : 0.0f;
  __syncthreads();
  // A tree over blockDim (a power of two); amax_step keeps a NaN from either side.
  for (int d = blockDim.x / 2; d > 0; d >>= 1) {
    if (t < d) red[t] = amax_step(red[t], red[t + d]);
    __syncthreads();
  }
  const int qmax = qmax_of(bits);
  const float sc = wire_scale(__fdiv_rn(red[0], float(qmax)), bits);
  if (t == 0) scales[bi] = sc;
  const int q = mine && scale_ok(sc) ? code_of(v, sc, qmax) : 0;
  if (mine) src.store(e, v, __fmul_rn(float(q), sc));
  if (bits == 8) {
    if (mine) codes[code[s] + b0 + t] = uint8_t(int8_t(q));
  } else {
    qs[t] = q;
    __syncthreads();
    if (mine && (t % 2) == 0) {
      const int hi = t + 1 < len ? ((qs[t + 1] + 8) << 4) : 0;
      codes[code[s] + (b0 + t) / 2] = uint8_t((q + 8) | hi);
    }
  }
}

// Threads for quantize_kernel: the smallest power of two >= block, at least a warp.
inline int quantize_threads(int64_t block) {
  int threads = 32;
  while (threads < block) threads *= 2;
  return threads;
}

// The layout as one device tensor [elem | code | blk], each S + 1 long.
inline at::Tensor device_table(const Layout& L, const at::Tensor& like) {
  std::vector<int64_t> host(L.elem);
  host.insert(host.end(), L.code.begin(), L.code.end());
  host.insert(host.end(), L.blk.begin(), L.blk.end());
  auto cpu = at::from_blob(host.data(), {int64_t(host.size())}, at::TensorOptions().dtype(at::kLong)).clone();
  return cpu.to(like.device(), /*non_blocking=*/false);
}

}  // namespace lowbit
}  // namespace zen_ext
