// CUDA kernels of zen_ext::quantize_blocks and zen_ext::dequantize_blocks (zen.dgc.value_bits), same schema
// and results as the CPU op (csrc/cpu/lowbit.cpp); oracle: zen_ext/ops/_reference_lowbit.py. One launch
// each, whatever the number of segments: quantize runs one thread block per value block (its segment found
// by a binary search over the segments' first blocks), the block's |x| max reduced in shared memory (NaN
// kept), then each thread writes its value's code and dequantized value; a 4-bit pair is packed by its even
// thread. Dequantize runs one thread per value. The segment table (3·(S+1) int64) is copied to the device
// per call; no host read. Compile-checked only where this was written (no GPU): tests/ops/test_cuda_op.py
// holds it to the CPU op on a GPU machine.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../lowbit.h"

namespace zen_ext {
namespace {

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

template <typename scalar_t>
__global__ void quantize_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ table, int64_t S,
                                int64_t bits, int64_t block, uint8_t* __restrict__ codes, float* __restrict__ scales,
                                float* __restrict__ deq) {
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
  const float v = mine ? float(x[elem[s] + b0 + t]) : 0.0f;
  red[t] = mine ? fabsf(v) : 0.0f;
  __syncthreads();
  // A tree over blockDim (a power of two); amax_step keeps a NaN from either side.
  for (int d = blockDim.x / 2; d > 0; d >>= 1) {
    if (t < d) red[t] = lowbit::amax_step(red[t], red[t + d]);
    __syncthreads();
  }
  const int qmax = lowbit::qmax_of(bits);
  const float sc = __fdiv_rn(red[0], float(qmax));
  if (t == 0) scales[bi] = sc;
  const int q = mine && lowbit::scale_ok(sc) ? lowbit::code_of(v, sc, qmax) : 0;
  if (mine) deq[elem[s] + b0 + t] = __fmul_rn(float(q), sc);
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

__global__ void dequantize_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                  const int64_t* __restrict__ table, int64_t S, int64_t bits, int64_t block, int64_t K,
                                  float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  const int64_t* elem = table;
  const int64_t* code = table + (S + 1);
  const int64_t* blk = table + 2 * (S + 1);
  const int64_t s = segment_of(elem, S, i);  // an empty segment shares its first element with the next
  const int64_t o = i - elem[s];
  const float sc = scales[blk[s] + o / block];
  const int q = bits == 8 ? int(int8_t(codes[code[s] + o])) : int((codes[code[s] + o / 2] >> ((o & 1) * 4)) & 15) - 8;
  out[i] = __fmul_rn(float(q), sc);
}

// The layout as one device tensor [elem | code | blk], each S + 1 long.
at::Tensor device_table(const lowbit::Layout& L, const at::Tensor& like) {
  std::vector<int64_t> host(L.elem);
  host.insert(host.end(), L.code.begin(), L.code.end());
  host.insert(host.end(), L.blk.begin(), L.blk.end());
  auto cpu = at::from_blob(host.data(), {int64_t(host.size())}, at::TensorOptions().dtype(at::kLong)).clone();
  return cpu.to(like.device(), /*non_blocking=*/false);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_blocks_cuda(const at::Tensor& values, c10::IntArrayRef seg_ends,
                                                                    int64_t bits, int64_t block) {
  TORCH_CHECK(values.dim() == 1 && at::isFloatingType(values.scalar_type()),
              "quantize_blocks: values must be a 1-D float tensor");
  const auto L = lowbit::make_layout(seg_ends, bits, block, values.numel(), "quantize_blocks");
  c10::cuda::CUDAGuard guard(values.device());
  const auto x = values.contiguous();
  auto codes = at::zeros({L.code.back()}, x.options().dtype(at::kByte));
  auto scales = at::empty({L.blk.back()}, x.options().dtype(at::kFloat));
  auto deq = at::empty({x.numel()}, x.options().dtype(at::kFloat));
  const int64_t nb = L.blk.back(), S = int64_t(L.elem.size()) - 1;
  if (nb == 0) return {codes, scales, deq};
  const auto table = device_table(L, x);
  int threads = 32;
  while (threads < block) threads *= 2;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    quantize_kernel<scalar_t><<<nb, threads, 0, stream>>>(x.data_ptr<scalar_t>(), table.data_ptr<int64_t>(), S, bits,
                                                          block, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                                                          deq.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {codes, scales, deq};
}

at::Tensor dequantize_blocks_cuda(const at::Tensor& codes, const at::Tensor& scales, c10::IntArrayRef seg_ends,
                                  int64_t bits, int64_t block) {
  const int64_t K = seg_ends.empty() ? 0 : seg_ends.back();
  const auto L = lowbit::make_layout(seg_ends, bits, block, K, "dequantize_blocks");
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kByte && codes.numel() == L.code.back(),
              "dequantize_blocks: codes must be 1-D uint8 of ", L.code.back(), " bytes");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.numel() == L.blk.back(),
              "dequantize_blocks: scales must be 1-D float32 of ", L.blk.back(), " blocks");
  TORCH_CHECK(scales.device() == codes.device(), "dequantize_blocks: codes and scales must be on one device");
  c10::cuda::CUDAGuard guard(codes.device());
  const auto cc = codes.contiguous(), ss = scales.contiguous();
  auto out = at::empty({K}, ss.options());
  if (K == 0) return out;
  const auto table = device_table(L, cc);
  const int64_t S = int64_t(L.elem.size()) - 1;
  const int threads = 256;
  const int64_t grid = (K + threads - 1) / threads;
  dequantize_kernel<<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      cc.data_ptr<uint8_t>(), ss.data_ptr<float>(), table.data_ptr<int64_t>(), S, bits, block, K, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) {
  m.impl("quantize_blocks", &quantize_blocks_cuda);
  m.impl("dequantize_blocks", &dequantize_blocks_cuda);
}

}  // namespace zen_ext
