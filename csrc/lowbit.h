// Low-bit value blocks (zen.dgc.value_bits): the argument checks and the segment layout shared by the CPU
// op (csrc/cpu/lowbit.cpp) and the CUDA op (csrc/cuda/lowbit.cu); the arithmetic, host and device alike.
// Format and rules: zen_ext/ops/_reference_lowbit.py (the oracle both equal bit for bit).
#pragma once
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define ZEN_LB_HD __host__ __device__ __forceinline__
#else
#define ZEN_LB_HD inline
#endif

namespace zen_ext {
namespace lowbit {

// Per segment: first element, first code byte, first block, each with a final total (size S + 1).
struct Layout {
  std::vector<int64_t> elem, code, blk;
};

inline Layout make_layout(c10::IntArrayRef seg_ends, int64_t bits, int64_t block, int64_t numel, const char* op) {
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits (", bits, ") must be 8 or 4");
  TORCH_CHECK(block >= 2 && block % 2 == 0 && block <= 1024, op, ": block (", block, ") must be even and in [2, 1024]");
  Layout l;
  l.elem.push_back(0);
  l.code.push_back(0);
  l.blk.push_back(0);
  for (int64_t e : seg_ends) {
    const int64_t c = e - l.elem.back();
    TORCH_CHECK(c >= 0, op, ": seg_ends must be non-decreasing from 0");
    l.elem.push_back(e);
    l.code.push_back(l.code.back() + (c * bits + 7) / 8);
    l.blk.push_back(l.blk.back() + (c + block - 1) / block);
  }
  TORCH_CHECK(l.elem.back() == numel, op, ": seg_ends must end at the number of values (", numel, ")");
  return l;
}

ZEN_LB_HD int qmax_of(int64_t bits) { return bits == 8 ? 127 : 7; }

// The NaN-propagating running max of |x| (std::fmax would drop a NaN).
ZEN_LB_HD float amax_step(float a, float x) {
  const float ax = fabsf(x);
  return (ax > a || ax != ax) && a == a ? ax : a;
}

// Whether a block's scale quantizes (a finite number > 0); else every code is 0.
ZEN_LB_HD bool scale_ok(float s) { return s > 0.0f && s <= 3.402823466e38f; }

// The code of x in a block of scale s (scale_ok): rint(x / s) clamped to [-qmax, qmax], ties to even.
ZEN_LB_HD int code_of(float x, float s, int qmax) {
#ifdef __CUDA_ARCH__
  float q = rintf(__fdiv_rn(x, s));
#else
  float q = std::nearbyint(x / s);
#endif
  q = q < -qmax ? float(-qmax) : (q > qmax ? float(qmax) : q);
  return int(q);
}

}  // namespace lowbit
}  // namespace zen_ext
