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
  const int qmax = lowbit::qmax_of(bits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_blocks", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (size_t s = 0; s + 1 < L.elem.size(); ++s) {
      const int64_t e0 = L.elem[s], c = L.elem[s + 1] - e0;
      for (int64_t b0 = 0, bi = L.blk[s]; b0 < c; b0 += block, ++bi) {
        const int64_t b1 = b0 + block < c ? b0 + block : c;
        float a = 0.0f;
        for (int64_t o = b0; o < b1; ++o) a = lowbit::amax_step(a, float(xp[e0 + o]));
        const float sc = a / float(qmax);
        sp[bi] = sc;
        const bool ok = lowbit::scale_ok(sc);
        for (int64_t o = b0; o < b1; ++o) {
          const int q = ok ? lowbit::code_of(float(xp[e0 + o]), sc, qmax) : 0;
          dp[e0 + o] = float(q) * sc;
          if (bits == 8) {
            cp[L.code[s] + o] = uint8_t(int8_t(q));
          } else {
            cp[L.code[s] + o / 2] |= uint8_t((q + 8) << ((o & 1) * 4));
          }
        }
      }
    }
  });
  return {codes, scales, deq};
}

at::Tensor dequantize_blocks_cpu(const at::Tensor& codes, const at::Tensor& scales, c10::IntArrayRef seg_ends,
                                 int64_t bits, int64_t block) {
  const int64_t K = seg_ends.empty() ? 0 : seg_ends.back();
  const auto L = lowbit::make_layout(seg_ends, bits, block, K, "dequantize_blocks");
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kByte && codes.numel() == L.code.back(),
              "dequantize_blocks: codes must be 1-D uint8 of ", L.code.back(), " bytes");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.numel() == L.blk.back(),
              "dequantize_blocks: scales must be 1-D float32 of ", L.blk.back(), " blocks");
  TORCH_CHECK(scales.device() == codes.device(), "dequantize_blocks: codes and scales must be on one device");
  const auto cc = codes.contiguous(), ss = scales.contiguous();
  auto out = at::empty({K}, ss.options());
  const uint8_t* cp = cc.data_ptr<uint8_t>();
  const float* sp = ss.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (size_t s = 0; s + 1 < L.elem.size(); ++s) {
    const int64_t e0 = L.elem[s], c = L.elem[s + 1] - e0;
    for (int64_t o = 0; o < c; ++o) {
      const float sc = sp[L.blk[s] + o / block];
      const int q = bits == 8 ? int(int8_t(cp[L.code[s] + o])) : int((cp[L.code[s] + o / 2] >> ((o & 1) * 4)) & 15) - 8;
      op[e0 + o] = float(q) * sc;
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
