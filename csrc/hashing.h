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

// Unbalanced Feistel network on [0, 2^bits): left ceil(bits/2) bits, right floor(bits/2); each round
// swaps the roles and widths, and the even number of rounds restores them.
ZEN_HD uint64_t feistel(uint64_t x, const FeistelKeys& keys, int bits, bool inverse) {
  int wl = bits - bits / 2, wr = bits / 2;
  uint64_t left = x >> wr, right = x & ((uint64_t(1) << wr) - 1);
  if (!inverse) {
    for (int r = 0; r < kNumRounds; ++r) {
      uint64_t nr = left ^ (fmix32(uint32_t(right) ^ keys.k[r]) & ((uint64_t(1) << wl) - 1));
      left = right;
      right = nr;
      int t = wl; wl = wr; wr = t;
    }
  } else {
    for (int r = kNumRounds - 1; r >= 0; --r) {
      uint64_t nl = right ^ (fmix32(uint32_t(left) ^ keys.k[r]) & ((uint64_t(1) << wr) - 1));
      right = left;
      left = nl;
      int t = wl; wl = wr; wr = t;
    }
  }
  return (left << wr) | right;
}

// P(x) on [0, numel): cycle walking keeps the Feistel permutation of [0, 2^bits) inside [0, numel)
// (fewer than 2 rounds on average, since 2^bits < 2·numel).
ZEN_HD uint64_t permute_one(uint64_t x, uint64_t numel, const FeistelKeys& keys, int bits, bool inverse) {
  if (numel <= 1) return x;
  uint64_t y = feistel(x, keys, bits, inverse);
  while (y >= numel) y = feistel(y, keys, bits, inverse);
  return y;
}

// Width of the Feistel domain for numel elements (at least 2 bits).
ZEN_HD int domain_bits(uint64_t numel) {
  int bits = 0;
  uint64_t v = numel > 0 ? numel - 1 : 0;
  while (v) {
    ++bits;
    v >>= 1;
  }
  return bits < 2 ? 2 : bits;
}

constexpr uint64_t kMaxNumel = uint64_t(1) << 62;

}  // namespace zen_ext
