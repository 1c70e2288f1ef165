// Low-bit value blocks (zen.dgc.value_bits): the argument checks, the segment layout and the arithmetic shared
// by the CPU ops (csrc/cpu/lowbit.cpp, csrc/cpu/lowbit_fused.cpp: quantize_host is their block loop) and the
// CUDA ops (csrc/cuda/lowbit.cu, csrc/cuda/lowbit_fused.cu, through csrc/cuda/lowbit.cuh), host and device
// alike. Format and rules: zen_ext/ops/_reference_lowbit.py (the oracle they equal bit for bit).
#pragma once
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

// The codes and scales a dequantizing op reads: the sizes the layout L gives.
inline void check_codes_scales(const Layout& L, const at::Tensor& codes, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(codes.dim() == 1 && codes.scalar_type() == at::kByte && codes.numel() == L.code.back(),
              op, ": codes must be 1-D uint8 of ", L.code.back(), " bytes");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.numel() == L.blk.back(),
              op, ": scales must be 1-D float32 of ", L.blk.back(), " blocks");
  TORCH_CHECK(scales.device() == codes.device(), op, ": codes and scales must be on one device");
}

// A 1-D int32/int64 index tensor (of n elements unless n < 0); a 1-D float32 one.
inline void check_index(const at::Tensor& t, int64_t n, const char* what, const char* op) {
  TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong), op, ": ", what,
              " must be a 1-D int32 or int64 tensor");
  TORCH_CHECK(n < 0 || t.numel() == n, op, ": ", what, " must have ", n, " elements (it has ", t.numel(), ")");
}
inline void check_fp32(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kFloat, op, ": ", what, " must be a 1-D float32 tensor");
}

// How an owner's sum is cast where every rank applies it (quantize_owned_'s applied_dtype): fp32 and fp64
// keep the fp32 value (fp64 holds it exactly), bf16 and fp16 round it to nearest even.
enum AppliedCast : int { kCastNone = 0, kCastBF16 = 1, kCastHalf = 2 };

inline AppliedCast applied_cast(at::ScalarType t, const char* op) {
  if (t == at::kFloat || t == at::kDouble) return kCastNone;
  if (t == at::kBFloat16) return kCastBF16;
  TORCH_CHECK(t == at::kHalf, op, ": applied_dtype (", t, ") must be float32, float64, bfloat16 or float16");
  return kCastHalf;
}

ZEN_LB_HD int qmax_of(int64_t bits) { return bits == 8 ? 127 : 7; }

// The NaN-propagating running max of |x| (std::fmax would drop a NaN).
ZEN_LB_HD float amax_step(float a, float x) {
  const float ax = fabsf(x);
  return (ax > a || ax != ax) && a == a ? ax : a;
}

// Whether a block's scale quantizes (a finite number > 0); else every code is 0.
ZEN_LB_HD bool scale_ok(float s) { return s > 0.0f && s <= 3.402823466e38f; }

// A block's scale as it travels: amax / qmax (the caller's fp32 division), at 4 bits truncated to bf16 (its
// high half), the dtype 4-bit scales take on the wire (2 bytes a block: blocks of 16 cost what fp32 scales per
// 32 did). Down, never up: qmax · scale stays at or below amax (no overflow near the fp32 maximum), and x / scale
// passes qmax by under 2^-7 relative, so the clamp costs less than half a step. The sender and every receiver
// dequantize with the same value, and q · scale (4 bits times 8) is exact in fp32. A scale that is not a finite
// number > 0 is kept (its codes are 0); one that truncates to 0 (amax below qmax · 2^-133) codes 0 as well.
ZEN_LB_HD float wire_scale(float s, int64_t bits) {
#ifdef __CUDA_ARCH__
  const float t = __uint_as_float(__float_as_uint(s) & 0xFFFF0000u);
#else
  uint32_t u;
  std::memcpy(&u, &s, 4);
  // An empty asm the optimizer cannot see through: GCC 12 (-O1 and above) dropped this mask, as if the
  // truncated float were s itself, once the caller's range checks on s were inlined around it
  // (tests/ops/test_lowbit_ops.py's op-against-oracle cases catch it).
  asm volatile("" : "+r"(u));
  u &= 0xFFFF0000u;
  float t;
  std::memcpy(&t, &u, 4);
#endif
  return bits == 4 && scale_ok(s) ? t : s;
}

// Bytes of one block's scale on the wire (zen_ext/core/lowbit.py SCALE_BYTES): fp32 at 8 bits, bf16 at 4.
ZEN_LB_HD int64_t scale_bytes_of(int64_t bits) { return bits == 4 ? 2 : 4; }

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

// The host loop of every quantizing CPU op (csrc/cpu/lowbit*.cpp): per segment and block, get(i) (the i-th
// value in fp32) once into a block buffer, the block's scale, then each value's code and put(i, x, x̂).
template <typename Get, typename Put>
inline void quantize_host(const Layout& L, int64_t bits, int64_t block, uint8_t* cp, float* sp, Get get, Put put) {
  const int qmax = qmax_of(bits);
  std::vector<float> buf(size_t(block > 0 ? block : 1));
  for (size_t s = 0; s + 1 < L.elem.size(); ++s) {
    const int64_t e0 = L.elem[s], c = L.elem[s + 1] - e0;
    for (int64_t b0 = 0, bi = L.blk[s]; b0 < c; b0 += block, ++bi) {
      const int64_t b1 = b0 + block < c ? b0 + block : c;
      float a = 0.0f;
      for (int64_t o = b0; o < b1; ++o) a = amax_step(a, buf[o - b0] = get(e0 + o));
      const float sc = wire_scale(a / float(qmax), bits);
      sp[bi] = sc;
      const bool ok = scale_ok(sc);
      for (int64_t o = b0; o < b1; ++o) {
        const float x = buf[o - b0];
        const int q = ok ? code_of(x, sc, qmax) : 0;
        put(e0 + o, x, float(q) * sc);
        if (bits == 8) {
          cp[L.code[s] + o] = uint8_t(int8_t(q));
        } else {
          cp[L.code[s] + o / 2] |= uint8_t((q + 8) << ((o & 1) * 4));
        }
      }
    }
  }
}

// The code at element o of a segment whose codes start at byte c0 (the inverse of quantize_host's write).
ZEN_LB_HD int code_at(const uint8_t* cp, int64_t c0, int64_t o, int64_t bits) {
  return bits == 8 ? int(int8_t(cp[c0 + o])) : int((cp[c0 + o / 2] >> ((o & 1) * 4)) & 15) - 8;
}

}  // namespace lowbit
}  // namespace zen_ext
