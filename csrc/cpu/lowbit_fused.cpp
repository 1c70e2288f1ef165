// CPU kernels of the fused low-bit ops (zen.dgc.value_bits): quantize_sent_ (the sender's gather, quantize and
// error feedback), dequantize_add_blocks_ (the owner's aggregation) and quantize_owned_ (the owner's residual,
// quantize and residual update), each one pass where zen_ext/core/zen_lowbit.py ran several torch ops.
// Same schema and results as the CUDA kernels (csrc/cuda/lowbit_fused.cu); the oracle, bit for bit, is
// zen_ext/ops/_reference_lowbit.py (tests/ops/test_lowbit_fused.py). Every sum and difference is one fp32
// rounding in the oracle's order (index_add_ adds in index order on the CPU).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "../lowbit.h"

namespace zen_ext {
namespace {

// The index tensor t as contiguous int64 (a copy only for int32).
at::Tensor as_long(const at::Tensor& t) { return t.scalar_type() == at::kLong ? t.contiguous() : t.to(at::kLong).contiguous(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_sent_cpu(const at::Tensor& values, const at::Tensor& order,
                                                                 const std::optional<at::Tensor>& residual,
                                                                 const std::optional<at::Tensor>& res_pos,
                                                                 c10::IntArrayRef seg_ends, int64_t bits, int64_t block) {
  const char* op = "quantize_sent_";
  TORCH_CHECK(values.dim() == 1 && at::isFloatingType(values.scalar_type()), op, ": values must be a 1-D float tensor");
  lowbit::check_index(order, -1, "order", op);
  const auto L = lowbit::make_layout(seg_ends, bits, block, order.numel(), op);
  const auto x = values.contiguous();
  const auto ord = as_long(order);
  const int64_t N = x.numel();
  float* R = nullptr;
  at::Tensor rp_t;
  if (residual.has_value()) {
    lowbit::check_fp32(*residual, "residual", op);
    TORCH_CHECK(residual->is_contiguous(), op, ": residual must be contiguous");
    TORCH_CHECK(res_pos.has_value(), op, ": res_pos must be given with residual");
    lowbit::check_index(*res_pos, N, "res_pos", op);
    R = residual->data_ptr<float>();
    rp_t = as_long(*res_pos);
  }
  auto codes = at::zeros({L.code.back()}, x.options().dtype(at::kByte));
  auto scales = at::empty({L.blk.back()}, x.options().dtype(at::kFloat));
  auto deq = at::empty({ord.numel()}, x.options().dtype(at::kFloat));
  const int64_t* orp = ord.data_ptr<int64_t>();
  const int64_t* rp = R ? rp_t.data_ptr<int64_t>() : nullptr;
  const int64_t M = R ? residual->numel() : 0;
  float* dp = deq.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_sent_", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    auto get = [&](int64_t i) {
      const int64_t k = orp[i];
      TORCH_CHECK(k >= 0 && k < N, op, ": order[", i, "] (", k, ") must be in [0, ", N, ")");
      return float(xp[k]);
    };
    lowbit::quantize_host(L, bits, block, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), get,
                          [&](int64_t i, float v, float d) {
                            dp[i] = d;
                            if (R) {
                              const int64_t j = rp[orp[i]];
                              TORCH_CHECK(j >= 0 && j < M, op, ": res_pos (", j, ") must be in [0, ", M, ")");
                              R[j] = R[j] + (v - d);
                            }
                          });
  });
  return {codes, scales, deq};
}

void dequantize_add_blocks_cpu(const at::Tensor& acc, const at::Tensor& touched, const at::Tensor& pos,
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
  const auto cc = codes.contiguous(), ss = scales.contiguous(), pp = pos.contiguous();
  const uint8_t* cp = cc.data_ptr<uint8_t>();
  const float* sp = ss.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  bool* tp = touched.data_ptr<bool>();
  const int64_t m = acc.numel();
  AT_DISPATCH_INDEX_TYPES(pp.scalar_type(), "dequantize_add_blocks_", [&] {
    const index_t* ip = pp.data_ptr<index_t>();
    for (size_t s = 0; s + 1 < L.elem.size(); ++s) {
      const int64_t e0 = L.elem[s], c = L.elem[s + 1] - e0;
      for (int64_t o = 0; o < c; ++o) {
        const int64_t p = int64_t(ip[e0 + o]);
        TORCH_CHECK(p >= 0 && p < m, op, ": pos[", e0 + o, "] (", p, ") must be in [0, ", m, ")");
        ap[p] = ap[p] + float(lowbit::code_at(cp, L.code[s], o, bits)) * sp[L.blk[s] + o / block];
        tp[p] = true;
      }
    }
  });
}

// The oracle's applied(): d / divisor (a true fp32 division, as torch's CPU division by a scalar), cast, and
// times divisor.
inline float applied_cpu(float d, lowbit::AppliedCast cast, int64_t divisor) {
  const float f = float(divisor);
  float a = divisor == 1 ? d : d / f;
  if (cast == lowbit::kCastBF16) a = float(c10::BFloat16(a));
  if (cast == lowbit::kCastHalf) a = float(c10::Half(a));
  return divisor == 1 ? a : a * f;
}

std::tuple<at::Tensor, at::Tensor> quantize_owned_cpu(const at::Tensor& acc, const at::Tensor& pos,
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
  const auto a = acc.contiguous(), pp = pos.contiguous();
  auto codes = at::zeros({L.code.back()}, a.options().dtype(at::kByte));
  auto scales = at::empty({L.blk.back()}, a.options());
  const float* ap = a.data_ptr<float>();
  const int64_t m = a.numel();
  AT_DISPATCH_INDEX_TYPES(pp.scalar_type(), "quantize_owned_", [&] {
    const index_t* ip = pp.data_ptr<index_t>();
    auto get = [&](int64_t i) {
      const int64_t p = int64_t(ip[i]);
      TORCH_CHECK(p >= 0 && p < m, op, ": pos[", i, "] (", p, ") must be in [0, ", m, ")");
      return R ? ap[p] + R[p] : ap[p];
    };
    lowbit::quantize_host(L, bits, block, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), get,
                          [&](int64_t i, float v, float d) {
                            if (!R) return;
                            const float nw = v - applied_cpu(d, cast, divisor);
                            if (std::isfinite(nw)) R[int64_t(ip[i])] = nw;
                          });
  });
  return {codes, scales};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("quantize_sent_", &quantize_sent_cpu);
  m.impl("dequantize_add_blocks_", &dequantize_add_blocks_cpu);
  m.impl("quantize_owned_", &quantize_owned_cpu);
}

}  // namespace zen_ext
