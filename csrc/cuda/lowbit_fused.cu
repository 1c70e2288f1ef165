// CUDA kernels of the fused low-bit ops (zen.dgc.value_bits): quantize_sent_ (the sender's gather, quantize and
// error feedback) and quantize_owned_ (the owner's residual, quantize and residual update) are
// lowbit::quantize_kernel (csrc/cuda/lowbit.cuh) with their own Src, one launch each; dequantize_add_blocks_
// (the owner's aggregation) is one thread per contribution. Same schema as the CPU op
// (csrc/cpu/lowbit_fused.cpp); each equals the oracle (zen_ext/ops/_reference_lowbit.py) run on the GPU, i.e.
// the torch ops the schemes ran before, with two of their CUDA semantics kept on purpose:
// * quantize_owned_'s x̂ / divisor is x̂ times the fp32 reciprocal of divisor (torch's CUDA division of a tensor
//   by a CPU scalar; the CPU op divides, as torch's CPU one does);
// * dequantize_add_blocks_ adds with atomicAdd, as torch's CUDA index_add_ did: where several senders
//   contribute to one position the order of those fp32 adds is not fixed (the sum may differ in its last
//   bit from run to run, never between ranks: every rank applies the owner's one quantized sum).
// Compile-checked where this was written (no GPU: tests/ops/test_cuda_compile.py); tests/ops/test_lowbit_cuda.py
// holds it to the oracle on a GPU machine.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "lowbit.cuh"

namespace zen_ext {
namespace {

// quantize_sent_'s values: x[order[e]] in; x̂ out, and with R its error feedback R[rpos[order[e]]] += x − x̂
// (DGC's positions are unique: no two threads write one R entry).
template <typename scalar_t>
struct SentSrc {
  const scalar_t* __restrict__ x;
  const int64_t* __restrict__ order;
  const int64_t* __restrict__ rpos;
  float* __restrict__ R;
  float* __restrict__ deq;
  int64_t N, M;
  __device__ __forceinline__ float load(int64_t e) const {
    const int64_t k = order[e];
    CUDA_KERNEL_ASSERT(k >= 0 && k < N);
    return float(x[k]);
  }
  __device__ __forceinline__ void store(int64_t e, float v, float d) const {
    deq[e] = d;
    if (R != nullptr) {
      const int64_t j = rpos[order[e]];
      CUDA_KERNEL_ASSERT(j >= 0 && j < M);
      R[j] = __fadd_rn(R[j], __fsub_rn(v, d));
    }
  }
};

// quantize_owned_'s values: s = acc[pos[e]] (+ R[pos[e]]) in; with R, R[pos[e]] = s − applied(x̂) where finite.
// A block reads its R entries before any of its threads writes one (load precedes the block's reduction),
// and pos is unique, so no block reads an entry another writes.
template <typename index_t>
struct OwnedSrc {
  const float* __restrict__ acc;
  const index_t* __restrict__ pos;
  float* __restrict__ R;
  int64_t m;
  int cast;
  int64_t divisor;
  float inv;  // 1 / divisor in fp32, as torch computes it on the host
  __device__ __forceinline__ float load(int64_t e) const {
    const int64_t p = int64_t(pos[e]);
    CUDA_KERNEL_ASSERT(p >= 0 && p < m);
    return R != nullptr ? __fadd_rn(acc[p], R[p]) : acc[p];
  }
  __device__ __forceinline__ float applied(float d) const {
    float a = divisor == 1 ? d : __fmul_rn(d, inv);
    if (cast == lowbit::kCastBF16) a = float(c10::BFloat16(a));
    if (cast == lowbit::kCastHalf) a = float(c10::Half(a));
    return divisor == 1 ? a : __fmul_rn(a, float(divisor));
  }
  __device__ __forceinline__ void store(int64_t e, float v, float d) const {
    if (R == nullptr) return;
    const float nw = __fsub_rn(v, applied(d));
    if (isfinite(nw)) R[int64_t(pos[e])] = nw;
  }
};

template <typename index_t>
__global__ void dequantize_add_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales,
                                      const int64_t* __restrict__ table, int64_t S, int64_t bits, int64_t block,
                                      int64_t K, const index_t* __restrict__ pos, float* __restrict__ acc,
                                      bool* __restrict__ touched, int64_t m) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= K) return;
  const int64_t* elem = table;
  const int64_t* code = table + (S + 1);
  const int64_t* blk = table + 2 * (S + 1);
  const int64_t s = lowbit::segment_of(elem, S, i);
  const int64_t o = i - elem[s];
  const float d = __fmul_rn(float(lowbit::code_at(codes, code[s], o, bits)), scales[blk[s] + o / block]);
  const int64_t p = int64_t(pos[i]);
  CUDA_KERNEL_ASSERT(p >= 0 && p < m);
  atomicAdd(acc + p, d);
  touched[p] = true;
}

at::Tensor as_long(const at::Tensor& t) { return t.scalar_type() == at::kLong ? t.contiguous() : t.to(at::kLong).contiguous(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_sent_cuda(const at::Tensor& values, const at::Tensor& order,
                                                                  const std::optional<at::Tensor>& residual,
                                                                  const std::optional<at::Tensor>& res_pos,
                                                                  c10::IntArrayRef seg_ends, int64_t bits, int64_t block) {
  const char* op = "quantize_sent_";
  TORCH_CHECK(values.dim() == 1 && at::isFloatingType(values.scalar_type()), op, ": values must be a 1-D float tensor");
  lowbit::check_index(order, -1, "order", op);
  const auto L = lowbit::make_layout(seg_ends, bits, block, order.numel(), op);
  c10::cuda::CUDAGuard guard(values.device());
  const auto x = values.contiguous();
  const auto ord = as_long(order);
  float* R = nullptr;
  at::Tensor rp;
  if (residual.has_value()) {
    lowbit::check_fp32(*residual, "residual", op);
    TORCH_CHECK(residual->is_contiguous(), op, ": residual must be contiguous");
    TORCH_CHECK(res_pos.has_value(), op, ": res_pos must be given with residual");
    lowbit::check_index(*res_pos, x.numel(), "res_pos", op);
    R = residual->data_ptr<float>();
    rp = as_long(*res_pos);
  }
  auto codes = at::zeros({L.code.back()}, x.options().dtype(at::kByte));
  auto scales = at::empty({L.blk.back()}, x.options().dtype(at::kFloat));
  auto deq = at::empty({ord.numel()}, x.options().dtype(at::kFloat));
  const int64_t nb = L.blk.back(), S = int64_t(L.elem.size()) - 1;
  if (nb == 0) return {codes, scales, deq};
  const auto table = lowbit::device_table(L, x);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_sent_", [&] {
    const SentSrc<scalar_t> src{x.data_ptr<scalar_t>(), ord.data_ptr<int64_t>(), R ? rp.data_ptr<int64_t>() : nullptr,
                                R, deq.data_ptr<float>(), x.numel(), R ? residual->numel() : 0};
    lowbit::quantize_kernel<<<nb, lowbit::quantize_threads(block), 0, stream>>>(
        src, table.data_ptr<int64_t>(), S, bits, block, codes.data_ptr<uint8_t>(), scales.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {codes, scales, deq};
}

void dequantize_add_blocks_cuda(const at::Tensor& acc, const at::Tensor& touched, const at::Tensor& pos,
                                const at::Tensor& codes, const at::Tensor& scales, c10::IntArrayRef seg_ends,
                                int64_t bits, int64_t block) {
  const char* op = "dequantize_add_blocks_";
  const int64_t K = seg_ends.empty() ? 0 : seg_ends.back();
  const auto L = lowbit::make_layout(seg_ends, bits, block, K, op);
  lowbit::check_codes_scales(L, codes, scales, op);
  lowbit::check_fp32(acc, "acc", op);
  TORCH_CHECK(acc.is_contiguous() && touched.is_contiguous(), op, ": acc and touched must be contiguous");
  TORCH_CHECK(touched.dim() == 1 && touched.scalar_type() == at::kBool && touched.numel() == acc.numel(), op,
              ": touched must be a 1-D bool tensor of ", acc.numel(), " elements");
  lowbit::check_index(pos, K, "pos", op);
  if (K == 0) return;
  c10::cuda::CUDAGuard guard(acc.device());
  const auto cc = codes.contiguous(), ss = scales.contiguous(), pp = pos.contiguous();
  const auto table = lowbit::device_table(L, cc);
  const int64_t S = int64_t(L.elem.size()) - 1;
  const int threads = 256;
  const int64_t grid = (K + threads - 1) / threads;
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(pp.scalar_type(), "dequantize_add_blocks_", [&] {
    dequantize_add_kernel<index_t><<<grid, threads, 0, stream>>>(
        cc.data_ptr<uint8_t>(), ss.data_ptr<float>(), table.data_ptr<int64_t>(), S, bits, block, K,
        pp.data_ptr<index_t>(), acc.data_ptr<float>(), touched.data_ptr<bool>(), acc.numel());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> quantize_owned_cuda(const at::Tensor& acc, const at::Tensor& pos,
                                                       const std::optional<at::Tensor>& residual, c10::IntArrayRef seg_ends,
                                                       int64_t bits, int64_t block, at::ScalarType applied_dtype,
                                                       int64_t divisor) {
  const char* op = "quantize_owned_";
  lowbit::check_fp32(acc, "acc", op);
  lowbit::check_index(pos, -1, "pos", op);
  TORCH_CHECK(divisor >= 1, op, ": divisor (", divisor, ") must be >= 1");
  const auto cast = lowbit::applied_cast(applied_dtype, op);
  const auto L = lowbit::make_layout(seg_ends, bits, block, pos.numel(), op);
  float* R = nullptr;
  if (residual.has_value()) {
    lowbit::check_fp32(*residual, "residual", op);
    TORCH_CHECK(residual->numel() == acc.numel(), op, ": residual must have acc's ", acc.numel(), " elements");
    TORCH_CHECK(residual->is_contiguous(), op, ": residual must be contiguous");
    R = residual->data_ptr<float>();
  }
  c10::cuda::CUDAGuard guard(acc.device());
  const auto a = acc.contiguous(), pp = pos.contiguous();
  auto codes = at::zeros({L.code.back()}, a.options().dtype(at::kByte));
  auto scales = at::empty({L.blk.back()}, a.options());
  const int64_t nb = L.blk.back(), S = int64_t(L.elem.size()) - 1;
  if (nb == 0) return {codes, scales};
  const auto table = lowbit::device_table(L, a);
  const float inv = 1.0f / float(divisor);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(pp.scalar_type(), "quantize_owned_", [&] {
    const OwnedSrc<index_t> src{a.data_ptr<float>(), pp.data_ptr<index_t>(), R, a.numel(), int(cast), divisor, inv};
    lowbit::quantize_kernel<<<nb, lowbit::quantize_threads(block), 0, stream>>>(
        src, table.data_ptr<int64_t>(), S, bits, block, codes.data_ptr<uint8_t>(), scales.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {codes, scales};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) {
  m.impl("quantize_sent_", &quantize_sent_cuda);
  m.impl("dequantize_add_blocks_", &dequantize_add_blocks_cuda);
  m.impl("quantize_owned_", &quantize_owned_cuda);
}

}  // namespace zen_ext
