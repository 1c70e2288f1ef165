// CPU ops of DGC's sampling step (zen_ext::dgc_sample_keys) and of sorting and reading the samples back
// (zen_ext::dgc_sort_unkey); the per-sample logic is csrc/dgc_sample.h, shared with the CUDA kernels
// (csrc/cuda/dgc_sample.cu). The torch path they replace (``sampled_thresholds`` (zen_ext/compress/dgc/thresholds.py),
// steps 1-3) dispatched about thirty small ops per bucket: offsets, two gathers, the velocity, abs,
// nan_to_num, the key, then the decoding and the rank lookup; on a GPU each was a kernel launch.
// tests/ops/test_dgc_ops.py holds both ops to that torch path bit for bit, tests/ops/test_dgc_reference.py to
// their references (zen_ext/ops/_reference_dgc.py).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sort.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <tuple>
#include <vector>

#include "../dgc_dtypes.h"
#include "../dgc_sample.h"
#include "../dgc_sample_check.h"

namespace zen_ext {
namespace {

at::Tensor dgc_sample_keys_cpu(const at::Tensor& R, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T,
                               double momentum, const at::Tensor& grid_S, const at::Tensor& unit_S,
                               const at::Tensor& hash_U, const at::Tensor& stride_U, int64_t shift) {
  dgc::check_sample_args(R, U_opt, g_T, grid_S, unit_S, hash_U, stride_U, shift, c10::DeviceType::CPU);
  const bool has_u = U_opt.has_value() && U_opt->defined();
  const int64_t N = R.numel(), S = grid_S.numel(), NU = hash_U.numel();
  // Each gradient's global end; element i of the concatenation is base[q][i] (as gather_list).
  std::vector<int64_t> gends;
  int64_t at = 0;
  for (const auto& g : g_T) {
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.scalar_type() == g_T[0].scalar_type(),
                "dgc_sample_keys: every gradient must be a contiguous CPU tensor of ", g_T[0].scalar_type());
    at += g.numel();
    gends.push_back(at);
  }
  TORCH_CHECK(at == N, "dgc_sample_keys: the gradients hold ", at, " elements, R ", N);
  const auto grid = grid_S.contiguous(), unit = unit_S.contiguous();
  const auto hash = hash_U.contiguous(), stride = stride_U.contiguous();
  const int64_t* gp = grid.data_ptr<int64_t>();
  const int64_t* up = unit.data_ptr<int64_t>();
  const int64_t* hp = hash.data_ptr<int64_t>();
  const int64_t* sp = stride.data_ptr<int64_t>();
  for (int64_t u = 0; u < NU; ++u) TORCH_CHECK(sp[u] >= 1 && hp[u] >= 0, "dgc_sample_keys: unit ", u,
                                               " has stride ", sp[u], " and hash ", hp[u], " (must be >= 1, >= 0)");
  auto keys = at::empty({S}, R.options().dtype(at::kLong));
  int64_t* kp = keys.data_ptr<int64_t>();
  const float* rp = R.data_ptr<float>();
  const float* vp = has_u ? U_opt->data_ptr<float>() : nullptr;
  const float m = static_cast<float>(momentum);  // as torch's fp32 tensor × Python scalar
  auto body = [&](auto grad_tag) {
    using grad_t = decltype(grad_tag);
    std::vector<const grad_t*> base(g_T.size());
    for (size_t q = 0; q < g_T.size(); ++q) base[q] = g_T[q].data_ptr<grad_t>() - (gends[q] - g_T[q].numel());
    const int64_t G = int64_t(gends.size());
    int64_t q = 0;  // positions ascend within a unit: walk forward, binary search otherwise
    for (int64_t s = 0; s < S; ++s) {
      const int64_t u = up[s];
      TORCH_CHECK(u >= 0 && u < NU, "dgc_sample_keys: unit ", u, " outside [0, ", NU, ")");
      const int64_t i = dgc::sample_position(gp[s], hp[u], sp[u], shift);
      TORCH_CHECK(i >= 0 && i < N, "dgc_sample_keys: sample position ", i, " outside [0, ", N, ")");
      if (i >= gends[q] || (q > 0 && i < gends[q - 1])) {
        q = std::upper_bound(gends.data(), gends.data() + G, i) - gends.data();
      }
      const float g = static_cast<float>(base[size_t(q)][i]);  // bf16/fp16 widen exactly
      const float delta = dgc::velocity_delta(has_u ? vp[i] : 0.0f, m, g, has_u);
      kp[s] = dgc::sort_key(u, dgc::sample_value(rp[i], delta));
    }
  };
  const auto gdt = g_T[0].scalar_type();
  if (gdt == at::kBFloat16) {
    body(c10::BFloat16());
  } else if (gdt == at::kHalf) {
    body(c10::Half());
  } else {
    body(float());
  }
  return keys;
}

std::tuple<at::Tensor, at::Tensor> dgc_sort_unkey_cpu(const at::Tensor& keys, const at::Tensor& low_U, double tiny,
                                                      int64_t key_bits) {
  TORCH_CHECK(keys.device().is_cpu() && keys.scalar_type() == at::kLong && keys.dim() == 1 &&
                  low_U.device().is_cpu() && low_U.scalar_type() == at::kLong && low_U.dim() == 1,
              "dgc_sort_unkey: keys and low_U must be 1-D int64 CPU tensors");
  TORCH_CHECK(key_bits >= 1 && key_bits <= 64, "dgc_sort_unkey: key_bits (", key_bits, ") must be in [1, 64]");
  // Step 1: sort (torch's stable sort is a radix sort here; equal keys are equal values, so stability
  // does not change the result, and the keys' bits above key_bits are zero, so the order is the CUDA op's).
  const auto sorted = std::get<0>(at::sort(keys, /*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  if (key_bits < 64 && sorted.numel() > 0) {
    const int64_t top = sorted[-1].item<int64_t>(), bottom = sorted[0].item<int64_t>();
    TORCH_CHECK(bottom >= 0 && (top >> key_bits) == 0, "dgc_sort_unkey: keys must lie in [0, 2^", key_bits,
                "), got ", bottom, " to ", top);
  }
  // Step 2: the values and every unit's lower threshold.
  const auto& k = sorted;
  const auto low = low_U.contiguous();
  const int64_t S = k.numel(), NU = low.numel();
  auto vals = at::empty({S}, keys.options().dtype(at::kFloat));
  auto t_low = at::empty({NU}, keys.options().dtype(at::kFloat));
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* lp = low.data_ptr<int64_t>();
  float* vp = vals.data_ptr<float>();
  float* tp = t_low.data_ptr<float>();
  for (int64_t s = 0; s < S; ++s) vp[s] = dgc::key_value(kp[s]);
  const float floor_v = static_cast<float>(tiny);
  for (int64_t u = 0; u < NU; ++u) {
    TORCH_CHECK(lp[u] >= 0 && lp[u] < S, "dgc_sort_unkey: low_U[", u, "] (", lp[u], ") outside [0, ", S, ")");
    tp[u] = std::max(vp[lp[u]], floor_v);
  }
  return {vals, t_low};
}

// Whether any of n values (raw bits) has an all-ones exponent (inf or NaN): integer compares the
// compiler vectorizes (std::isfinite per element with an early exit did not: 48 ms for 30 M floats
// on one core, against 17 ms for torch's norms), checked in chunks so a bad value stops the read.
template <typename bits_t>
bool any_non_finite(const bits_t* p, int64_t n, bits_t exponent) {
  constexpr int64_t kChunk = 4096;
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t stop = std::min(n, at + kChunk);
    int any = 0;
    for (int64_t i = at; i < stop; ++i) any |= (p[i] & exponent) == exponent;
    if (any) return true;
  }
  return false;
}

at::Tensor dgc_all_finite_cpu(at::TensorList g_T) {
  TORCH_CHECK(!g_T.empty(), "dgc_all_finite: needs at least one tensor");
  bool ok = true;
  for (const auto& g : g_T) {
    TORCH_CHECK(g.device().is_cpu(), "dgc_all_finite: every tensor must be on the CPU, got ", g.device());
    const auto c = g.contiguous();
    const void* p = c.data_ptr();
    const int64_t n = c.numel();
    switch (c.scalar_type()) {
      case at::kFloat: ok = !any_non_finite(static_cast<const uint32_t*>(p), n, uint32_t(0x7F800000u)); break;
      case at::kDouble:
        ok = !any_non_finite(static_cast<const uint64_t*>(p), n, uint64_t(0x7FF0000000000000ull));
        break;
      case at::kHalf: ok = !any_non_finite(static_cast<const uint16_t*>(p), n, uint16_t(0x7C00u)); break;
      case at::kBFloat16: ok = !any_non_finite(static_cast<const uint16_t*>(p), n, uint16_t(0x7F80u)); break;
      default: TORCH_CHECK(false, "dgc_all_finite: ", c.scalar_type(), " (supported: float32, float64, float16, bfloat16)");
    }
    if (!ok) break;
  }
  return at::full({}, ok, at::TensorOptions().dtype(at::kBool));
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("dgc_all_finite", &dgc_all_finite_cpu);
  m.impl("dgc_sample_keys", &dgc_sample_keys_cpu);
  m.impl("dgc_sort_unkey", &dgc_sort_unkey_cpu);
}

}  // namespace zen_ext
