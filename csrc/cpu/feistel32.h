// Batched, vectorized Feistel permutation P (or P⁻¹) for the CPU ops, on domains of at most 32 bits
// (numel ≤ 2^32), and the round keys' reader shared by the CPU ops that permute. Defined in
// hash_kernel.cpp; bit-identical to permute_one of csrc/hashing.h.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../hashing.h"

namespace zen_ext {

// The most values permute_run32 takes at once (its walk buffers live on the stack).
constexpr int64_t kFeistelRun = 512;

// y[j] ← P(y[j]) (P⁻¹ with inverse) for j < count ≤ kFeistelRun, every y[j] in [0, numel) on entry:
// the Feistel rounds vectorized over the run (an AVX2 clone where the CPU has it), then cycle walking
// re-vectorized on the compacted lanes that left [0, numel) (about 1 − numel / 2^bits of them).
void permute_run32(uint32_t* y, int64_t count, uint64_t numel, const FeistelKeys& keys, int bits, bool inverse);

// The round keys of an int64 tensor of kNumRounds keys (on any device: read once per call), checked.
FeistelKeys read_keys(const at::Tensor& keys);

}  // namespace zen_ext
