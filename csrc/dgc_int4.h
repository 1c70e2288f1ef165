// DGC's 4-bit residual (zen.dgc.residual_dtype "int4"), one definition for the CPU ops
// (csrc/cpu/dgc_int4.cpp), the CUDA kernels (csrc/cuda/dgc_int4.cu) and, operation for operation, the torch
// reference (zen_ext/ops/_reference_dgc.py: int4_dequantize, int4_quantize_into).
//
// Per tensor, blocks of kBlock consecutive elements; a block keeps fp32 [min, max] and 4-bit codes, two a
// byte, the even element in the low nibble. Element j of a tensor whose first block is b0 lies at padded
// position (b0 * kBlock + j): block pp / kBlock, byte pp / 2, nibble pp & 1. Every operation below is one
// IEEE rounding, never contracted into a fused multiply-add (the ISO C++ build does not contract; the
// device code spells each rounding out), so the CPU op, the kernels and torch agree bit for bit.
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define ZEN_INT4_HD __host__ __device__ __forceinline__
#else
#define ZEN_INT4_HD inline
#endif

namespace zen_ext {
namespace int4 {

// Elements per block: two fp32 scales per 256 elements are 1/32 byte an element (0.53 bytes in all).
constexpr int64_t kBlock = 256;
constexpr int64_t kHalf = kBlock / 2;  // code bytes per block

ZEN_INT4_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ZEN_INT4_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ZEN_INT4_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
ZEN_INT4_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The dequantization step of a block: (max - min) / 15.
ZEN_INT4_HD float step_of(float lo, float hi) { return div(sub(hi, lo), 15.0f); }

// min + q * step: the product and the sum rounded apart.
ZEN_INT4_HD float dequant(float lo, float step, unsigned q) { return add(lo, mul(float(q), step)); }

// The code of element pp (its byte's nibble).
ZEN_INT4_HD unsigned nibble(const uint8_t* codes, int64_t pp) {
  const unsigned byte = codes[pp >> 1];
  return (pp & 1) ? (byte >> 4) : (byte & 15u);
}

// The quantization factor of a block: 15 / (max - min), at most FLT_MAX (a subnormal range), 0 for a
// constant block (every code 0: min comes back exactly).
ZEN_INT4_HD float factor_of(float lo, float hi) { return hi > lo ? fminf(div(15.0f, sub(hi, lo)), FLT_MAX) : 0.0f; }

// round((x - min) * factor), half to even, clamped to [0, 15].
ZEN_INT4_HD unsigned code_of(float x, float lo, float f) {
  return unsigned(fminf(fmaxf(rintf(mul(sub(x, lo), f)), 0.0f), 15.0f));
}

// A 32-bit integer hash (two multiply-xorshift rounds): every product of a 32-bit value and the 27-bit
// constant fits in 64 bits, so torch's int64 arithmetic reproduces it.
ZEN_INT4_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h = uint32_t((uint64_t(h) * 0x45d9f3bu) & 0xffffffffu);
  h ^= h >> 16;
  h = uint32_t((uint64_t(h) * 0x45d9f3bu) & 0xffffffffu);
  return h ^ (h >> 16);
}

// Stochastic rounding's uniform draw for element i under seed (>= 0): 24 bits of a hash, in [0, 1).
ZEN_INT4_HD float uniform_of(int64_t i, int64_t seed) {
  const uint32_t s = mix32(uint32_t(seed) ^ uint32_t(uint64_t(i) >> 32));
  return float(mix32(uint32_t(i) ^ s) >> 8) * (1.0f / 16777216.0f);
}

// floor((x - min) * factor + u), clamped to [0, 15]: rounds up with probability the fraction, so the
// code is unbiased (E[Q^-1(Q(x))] = x) and a small gradient that keeps coming is not rounded away.
ZEN_INT4_HD unsigned code_stochastic(float x, float lo, float f, float u) {
  return unsigned(fminf(fmaxf(floorf(add(mul(sub(x, lo), f), u)), 0.0f), 15.0f));
}

// The code under seed: round to nearest where seed < 0, else stochastically with element i's draw.
ZEN_INT4_HD unsigned code_with(float x, float lo, float f, int64_t i, int64_t seed) {
  return seed < 0 ? code_of(x, lo, f) : code_stochastic(x, lo, f, uniform_of(i, seed));
}

// What a sent element keeps: a - wire(clamp(a)) (the cast's rounding error and the excess past the wire
// dtype's range; 0 for fp32 gradients).
template <typename wire_t>
ZEN_INT4_HD float kept_error(float a, float top) {
  const float c = fminf(fmaxf(a, -top), top);
  return sub(a, static_cast<float>(static_cast<wire_t>(c)));
}

}  // namespace int4
}  // namespace zen_ext
