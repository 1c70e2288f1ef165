// Shared device-agnostic pieces of zen_ext's h0: MurmurHash3 fmix32 and the keyed Feistel permutation
// with cycle walking. Must stay bit-identical to zen_ext/ops/_reference.py.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define ZEN_HD __host__ __device__ __forceinline__
#else
#define ZEN_HD inline
#endif

namespace zen_ext {

constexpr int kNumRounds = 4;

ZEN_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

struct FeistelKeys {
  uint32_t k[kNumRounds];
};

ZEN_HD uint64_t feistel(uint64_t x, const FeistelKeys& keys, int h, bool inverse) {
  const uint64_t mask = (uint64_t(1) << h) - 1;
  uint64_t left = x >> h, right = x & mask;
  if (!inverse) {
    for (int r = 0; r < kNumRounds; ++r) {
      uint64_t nr = left ^ (fmix32(uint32_t(right) ^ keys.k[r]) & mask);
      left = right;
      right = nr;
    }
  } else {
    for (int r = kNumRounds - 1; r >= 0; --r) {
      uint64_t nl = right ^ (fmix32(uint32_t(left) ^ keys.k[r]) & mask);
      right = left;
      left = nl;
    }
  }
  return (left << h) | right;
}

// P(x) on [0, numel): cycle walking keeps the Feistel permutation of [0, 4^h) inside [0, numel).
ZEN_HD uint64_t permute_one(uint64_t x, uint64_t numel, const FeistelKeys& keys, int h, bool inverse) {
  if (numel <= 1) return x;
  uint64_t y = feistel(x, keys, h, inverse);
  while (y >= numel) y = feistel(y, keys, h, inverse);
  return y;
}

inline int half_bits(uint64_t numel) {
  int bits = 0;
  uint64_t v = numel > 0 ? numel - 1 : 0;
  while (v) {
    ++bits;
    v >>= 1;
  }
  if (bits < 2) bits = 2;
  bits += bits & 1;
  return bits / 2;
}

}  // namespace zen_ext
