// The wire format of ZEN's pull message and the per-element logic shared by the CPU op
// (csrc/cpu/pull_kernel.cpp) and the CUDA kernels (csrc/cuda/pull_kernel.cu). Must stay identical to
// zen_ext/ops/_reference.py (aggregate_push, encode_pull, decode_pull_) and zen_ext/core/zen.py.
//
// One pull message = [header: int64 format, int64 count | body], body by format:
//   kFmtCoo:    count positions (int32, or int64 for numel >= 2^31) | count rows of values
//   kFmtBitmap: ceil(|I_i| / 64) little-endian 64-bit words (bit p = position p is non-zero; the
//               same bytes as a least-significant-bit-first byte bitmap padded to 8) | count rows of values
//   kFmtDense:  |I_i| rows of values
// A push payload is either a partition's |I_i| dense rows, or k pairs [k positions | k rows]; its
// byte size tells them apart (a COO payload of |I_i| rows' size is never sent: zen.py sends dense then).
#pragma once
#include <cstdint>
#include <cstring>

#include "hashing.h"

namespace zen_ext {
namespace pull {

constexpr int64_t kFmtCoo = 0, kFmtBitmap = 1, kFmtDense = 2;
constexpr int64_t kHeaderBytes = 16;

// |I_part|: how many of [0, numel) hash to `part` of n (positions p with p·n + part < numel).
ZEN_HD int64_t part_size(int64_t numel, int64_t part, int64_t n) {
  const int64_t m = (numel - part + n - 1) / n;
  return m > 0 ? m : 0;
}

ZEN_HD int64_t num_words(int64_t m) { return (m + 63) / 64; }

// Body bytes before the values: positions (COO) or words (bitmap) or nothing (dense).
ZEN_HD int64_t index_bytes(int64_t fmt, int64_t count, int64_t m, int64_t idx_bytes) {
  return fmt == kFmtCoo ? count * idx_bytes : fmt == kFmtBitmap ? 8 * num_words(m) : 0;
}

// Rows of values in the body.
ZEN_HD int64_t value_rows(int64_t fmt, int64_t count, int64_t m) { return fmt == kFmtDense ? m : count; }

// Unaligned little-endian load: messages are byte buffers at any offset.
template <typename T>
ZEN_HD T load(const uint8_t* p) {
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}

template <typename T>
ZEN_HD void store(uint8_t* p, T v) {
  memcpy(p, &v, sizeof(T));
}

ZEN_HD int64_t load_pos(const uint8_t* p, int64_t idx_bytes) {
  return idx_bytes == 4 ? int64_t(load<int32_t>(p)) : load<int64_t>(p);
}

ZEN_HD int popcount64(uint64_t w) {
#if defined(__CUDA_ARCH__)
  return __popcll(w);
#else
  return __builtin_popcountll(w);
#endif
}

ZEN_HD int ctz64(uint64_t w) {
#if defined(__CUDA_ARCH__)
  return __ffsll((long long)w) - 1;
#else
  return __builtin_ctzll(w);
#endif
}

// Global index of position p of partition `part`: P⁻¹(p·n + part).
ZEN_HD int64_t global_index(int64_t p, int64_t part, int64_t n, uint64_t numel, const FeistelKeys& keys, int bits) {
  return int64_t(permute_one(uint64_t(p) * uint64_t(n) + uint64_t(part), numel, keys, bits, /*inverse=*/true));
}

}  // namespace pull
}  // namespace zen_ext
