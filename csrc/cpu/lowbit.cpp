// CPU kernels of zen_ext::quantize_blocks and zen_ext::dequantize_blocks (zen.dgc.value_bits): symmetric
// per-block scales, 8-bit or packed 4-bit codes, segments that blocks never straddle. Same schema and
// results as the CUDA kernels (csrc/cuda/lowbit.cu); zen_ext/ops/_reference_lowbit.py is the oracle
// (tests/ops/test_lowbit_ops.py). One pass over a block to find its scale, one to write its codes and
// dequantized values.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <tuple>

#include "../lowbit.h"

namespace zen_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_blocks_cpu(const at::Tensor& values, c10::IntArrayRef seg_ends,
                                                                   int64_t bits, int64_t block) {
  TORCH_CHECK(values.dim() == 1 && at::isFloatingType(values.scalar_type()),
              "quantize_blocks: values must be a 1-D float tensor");
  const auto L = lowbit::make_layout(seg_ends, bits, block, values.numel(), "quantize_blocks");
  const auto x = values.contiguous();
  auto codes = at::zeros({L.code.back()}, x.options().dtype(at::kByte));
  auto scales = at::empty({L.blk.back()}, x.options().dtype(at::kFloat));
  auto deq = at::empty({x.numel()}, x.options().dtype(at::kFloat));
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  float* dp = deq.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    lowbit::quantize_host(L, bits, block, cp, sp, [&](int64_t i) { return float(xp[i]); },
                          [&](int64_t i, float, float d) { dp[i] = d; });
  });
  return {codes, scales, deq};
}

at::Tensor dequantize_blocks_cpu(const at::Tensor& codes, const at::Tensor& scales, c10::IntArrayRef seg_ends,
                                 int64_t bits, int64_t block) {
  const int64_t K = seg_ends.empty() ? 0 : seg_ends.back();
  const auto L = lowbit::make_layout(seg_ends, bits, block, K, "dequantize_blocks");
  lowbit::check_codes_scales(L, codes, scales, "dequantize_blocks");
  const auto cc = codes.contiguous(), ss = scales.contiguous();
  auto out = at::empty({K}, ss.options());
  const uint8_t* cp = cc.data_ptr<uint8_t>();
  const float* sp = ss.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (size_t s = 0; s + 1 < L.elem.size(); ++s) {
    const int64_t e0 = L.elem[s], c = L.elem[s + 1] - e0;
    for (int64_t o = 0; o < c; ++o) {
      op[e0 + o] = float(lowbit::code_at(cp, L.code[s], o, bits)) * sp[L.blk[s] + o / block];
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("quantize_blocks", &quantize_blocks_cpu);
  m.impl("dequantize_blocks", &dequantize_blocks_cpu);
}

}  // namespace zen_ext
