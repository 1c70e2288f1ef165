// DGC's sampling step as sort keys (zen_ext::dgc_sample_keys) and their decoding (zen_ext::dgc_sort_unkey):
// the per-sample logic shared by the CPU op (csrc/cpu/dgc_sample.cpp) and the CUDA kernels
// (csrc/cuda/dgc_sample.cu). It mirrors, operation for operation, the torch path of
// ``sampled_thresholds`` (zen_ext/compress/dgc/thresholds.py, steps 1-3, fp32 memory): the sample
// positions ``grid + (hash + shift) mod stride`` of the unit, the value ``|R + U·m + g|`` the pending
// velocity update would give there (two roundings, never a fused multiply-add), NaN as 0 and ±inf as the
// largest float (``nan_to_num``), then ``_sort_per_unit``'s int64 key ``unit·2³² + (2³¹ − 1 − bits(v))``,
// whose ascending order is by unit, then by value descending.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "hashing.h"  // ZEN_HD

namespace zen_ext {
namespace dgc {

// The position of a sample: the unit's grid point moved by the step's offset (sample_positions).
ZEN_HD int64_t sample_position(int64_t grid, int64_t hash, int64_t stride, int64_t shift) {
  return grid + (hash + shift) % stride;
}

// The sample's magnitude as torch computes it: r = R + (U·m + g) (or R + g), |r|, nan_to_num.
ZEN_HD float sample_value(float r, float delta) {
#ifdef __CUDA_ARCH__
  float v = fabsf(__fadd_rn(r, delta));
#else
  float v = std::fabs(r + delta);
#endif
  if (v != v) return 0.0f;                     // NaN -> 0
  if (v > 3.402823466e38f) return 3.402823466e38f;  // +inf -> the largest float
  return v;
}

ZEN_HD float velocity_delta(float u, float m, float g, bool has_u) {
#ifdef __CUDA_ARCH__
  return has_u ? __fadd_rn(__fmul_rn(u, m), g) : g;
#else
  return has_u ? u * m + g : g;  // -std=c++20 without -ffp-contract=fast: two roundings
#endif
}

// _sort_per_unit's key of a non-negative float: ascending keys = ascending units, descending values.
ZEN_HD int64_t sort_key(int64_t unit, float v) {
  int32_t bits;
#ifdef __CUDA_ARCH__
  bits = __float_as_int(v);
#else
  std::memcpy(&bits, &v, sizeof bits);
#endif
  return (unit << 32) | static_cast<int64_t>(0x7FFFFFFF - bits);
}

// The value a key holds (its low 32 bits).
ZEN_HD float key_value(int64_t key) {
  const int32_t bits = static_cast<int32_t>(0x7FFFFFFF - (key & 0xFFFFFFFF));
#ifdef __CUDA_ARCH__
  return __int_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

}  // namespace dgc
}  // namespace zen_ext
