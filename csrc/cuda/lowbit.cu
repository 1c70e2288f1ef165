// CUDA kernels of zen_ext::quantize_blocks and zen_ext::dequantize_blocks (zen.dgc.value_bits), same schema
// and results as the CPU op (csrc/cpu/lowbit.cpp); oracle: zen_ext/ops/_reference_lowbit.py. One launch
// each, whatever the number of segments: quantize runs lowbit::quantize_kernel (csrc/cuda/lowbit.cuh: one
// thread block per value block), dequantize one thread per value. The segment table (3·(S+1) int64) is
// copied to the device per call; no host read. Compile-checked where this was written (no GPU:
// tests/ops/test_cuda_compile.py); tests/ops/test_lowbit_cuda.py holds it to the oracle on a GPU machine.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "lowbit.cuh"

namespace zen_ext {
namespace {

// quantize_blocks' values: x[e] in, x̂ out.
template <typename scalar_t>
struct PlainSrc {
  const scalar_t* __restrict__ x;
  float* __restrict__ deq;
  __device__ __forceinline__ float load(int64_t e) const { return float(x[e]); }
  __device__ __forceinline__ void store(int64_t e, float, float d) const { deq[e] = d; }
};

__global__ void dequantize_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                  const int64_t* __restrict__ table, int64_t S, int64_t bits, int64_t block, int64_t K,
                                  float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  const int64_t* elem = table;
  const int64_t* code = table + (S + 1);
  const int64_t* blk = table + 2 * (S + 1);
  const int64_t s = lowbit::segment_of(elem, S, i);  // an empty segment shares its first element with the next
  const int64_t o = i - elem[s];
  out[i] = __fmul_rn(float(lowbit::code_at(codes, code[s], o, bits)), scales[blk[s] + o / block]);
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
  const auto table = lowbit::device_table(L, x);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    const PlainSrc<scalar_t> src{x.data_ptr<scalar_t>(), deq.data_ptr<float>()};
    lowbit::quantize_kernel<<<nb, lowbit::quantize_threads(block), 0, stream>>>(
        src, table.data_ptr<int64_t>(), S, bits, block, codes.data_ptr<uint8_t>(), scales.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {codes, scales, deq};
}

at::Tensor dequantize_blocks_cuda(const at::Tensor& codes, const at::Tensor& scales, c10::IntArrayRef seg_ends,
                                  int64_t bits, int64_t block) {
  const int64_t K = seg_ends.empty() ? 0 : seg_ends.back();
  const auto L = lowbit::make_layout(seg_ends, bits, block, K, "dequantize_blocks");
  lowbit::check_codes_scales(L, codes, scales, "dequantize_blocks");
  c10::cuda::CUDAGuard guard(codes.device());
  const auto cc = codes.contiguous(), ss = scales.contiguous();
  auto out = at::empty({K}, ss.options());
  if (K == 0) return out;
  const auto table = lowbit::device_table(L, cc);
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
