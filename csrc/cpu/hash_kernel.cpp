// CPU kernels of zen_ext::permute and zen_ext::hash_partition: a stable counting sort by partition,
// bit-identical to the pure-torch reference (zen_ext/ops/_reference.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../hashing.h"
#include "feistel32.h"

namespace zen_ext {
FeistelKeys read_keys(const at::Tensor& keys) {
  TORCH_CHECK(keys.dtype() == at::kLong && keys.dim() == 1 && keys.numel() == kNumRounds,
              "keys must be an int64 tensor of ", kNumRounds, " round keys, got ", keys.dtype(), " of shape ",
              keys.sizes());
  auto k = keys.cpu().contiguous();
  FeistelKeys out;
  for (int r = 0; r < kNumRounds; ++r) out.k[r] = uint32_t(k.data_ptr<int64_t>()[r]);
  return out;
}

namespace {

void check_idx(const at::Tensor& idx, int64_t numel) {
  TORCH_CHECK(idx.device().is_cpu(), "idx must be a CPU tensor, got ", idx.device());
  TORCH_CHECK(idx.dtype() == at::kLong, "idx must be int64, got ", idx.dtype());
  TORCH_CHECK(idx.dim() == 1, "idx must be 1-D, got ", idx.dim(), "-D");
  TORCH_CHECK(numel >= 0 && uint64_t(numel) <= kMaxNumel, "numel must be in [0, 2^62], got ", numel);
}

// One pass of the Feistel network over x[0, count) for domains of at most 32 bits, bit-identical to
// feistel(x, keys, bits, Inverse) of csrc/hashing.h. The inverse is the forward network on the
// swapped halves with the keys and widths in reverse order, so one loop serves both. Lanes are
// independent and branch-free: the compiler vectorizes the loop inside each clone below.
template <bool Inverse>
__attribute__((always_inline)) inline void feistel32_pass(uint32_t* x, int64_t count, const FeistelKeys& keys,
                                                          int bits) {
  const int wl = bits - bits / 2, wr = bits / 2;
  const uint32_t mask_l = uint32_t((uint64_t(1) << wl) - 1), mask_r = uint32_t((uint64_t(1) << wr) - 1);
  // Round r's key and the width of its round function.
  const uint32_t k0 = keys.k[Inverse ? 3 : 0], k1 = keys.k[Inverse ? 2 : 1], k2 = keys.k[Inverse ? 1 : 2],
                 k3 = keys.k[Inverse ? 0 : 3];
  const uint32_t m0 = Inverse ? mask_r : mask_l, m1 = Inverse ? mask_l : mask_r;
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t hi = x[j] >> wr, lo = x[j] & mask_r;
    uint32_t left = Inverse ? lo : hi, right = Inverse ? hi : lo;
    uint32_t next = left ^ (fmix32(right ^ k0) & m0);
    left = right, right = next;
    next = left ^ (fmix32(right ^ k1) & m1);
    left = right, right = next;
    next = left ^ (fmix32(right ^ k2) & m0);
    left = right, right = next;
    next = left ^ (fmix32(right ^ k3) & m1);
    left = right, right = next;
    x[j] = Inverse ? (right << wr) | left : (left << wr) | right;
  }
}

// The AVX2 clone is picked at load time where the CPU has it.
__attribute__((target_clones("avx2", "default"))) void feistel_fwd32(uint32_t* x, int64_t count,
                                                                        const FeistelKeys& keys, int bits) {
  feistel32_pass<false>(x, count, keys, bits);
}

__attribute__((target_clones("avx2", "default"))) void feistel_inv32(uint32_t* x, int64_t count,
                                                                        const FeistelKeys& keys, int bits) {
  feistel32_pass<true>(x, count, keys, bits);
}

}  // namespace

void permute_run32(uint32_t* y, int64_t count, uint64_t numel, const FeistelKeys& keys, int bits, bool inverse) {
  auto rounds = inverse ? feistel_inv32 : feistel_fwd32;
  rounds(y, count, keys, bits);
  uint32_t walk[kFeistelRun];
  int32_t lane[kFeistelRun];
  int64_t todo = 0;
  for (int64_t j = 0; j < count; ++j) {
    walk[todo] = y[j];
    lane[todo] = int32_t(j);
    todo += y[j] >= numel;
  }
  while (todo) {
    rounds(walk, todo, keys, bits);
    int64_t left = 0;
    for (int64_t q = 0; q < todo; ++q) {
      y[lane[q]] = walk[q];
      walk[left] = walk[q];
      lane[left] = lane[q];
      left += walk[q] >= numel;
    }
    todo = left;
  }
}

namespace {

// Whether every src[j] lies in [0, numel) (cycle walking only returns into [0, numel) for inputs that
// start there: checked, never loop forever).
bool in_range(const int64_t* src, int64_t count, int64_t numel) {
  bool ok = true;
  for (int64_t j = 0; j < count; ++j) ok &= (src[j] >= 0) & (src[j] < numel);
  return ok;
}

at::Tensor permute_cpu(const at::Tensor& idx, int64_t numel, const at::Tensor& keys, bool inverse) {
  check_idx(idx, numel);
  auto k = read_keys(keys);
  auto in = idx.contiguous();
  auto out = at::empty_like(in);
  const int64_t* src = in.data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int bits = domain_bits(uint64_t(numel));
  TORCH_CHECK(in_range(src, in.numel(), numel), "permute indices must lie in [0, ", numel, ")");
  const bool fast = !inverse && bits <= 32 && numel > 1;
  at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t b, int64_t e) {
    if (fast) {
      uint32_t y[kFeistelRun];
      for (int64_t s = b; s < e; s += kFeistelRun) {
        const int64_t c = std::min(kFeistelRun, e - s);
        for (int64_t j = 0; j < c; ++j) y[j] = uint32_t(src[s + j]);
        permute_run32(y, c, uint64_t(numel), k, bits, /*inverse=*/false);
        for (int64_t j = 0; j < c; ++j) dst[s + j] = int64_t(y[j]);
      }
      return;
    }
    for (int64_t j = b; j < e; ++j) dst[j] = int64_t(permute_one(uint64_t(src[j]), uint64_t(numel), k, bits, inverse));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_partition_cpu(
    const at::Tensor& idx, int64_t numel, int64_t num_parts, const at::Tensor& keys, int64_t /*num_rehash*/,
    double /*parallel_factor*/, double /*serial_factor*/) {
  TORCH_CHECK(num_parts >= 1, "num_parts must be >= 1, got ", num_parts);
  auto y = permute_cpu(idx, numel, keys, /*inverse=*/false);
  const int64_t K = y.numel();
  auto counts = at::zeros({num_parts}, idx.options());
  auto order = at::empty({K}, idx.options());
  auto pos = at::empty({K}, idx.options());
  const int64_t* yp = y.data_ptr<int64_t>();
  int64_t* cp = counts.data_ptr<int64_t>();
  int64_t* op = order.data_ptr<int64_t>();
  int64_t* pp = pos.data_ptr<int64_t>();
  // Step 1: each index's partition and position (y = pos·n + part), with a histogram of partitions.
  // Below 2^32 the 32-bit division is several times cheaper than the 64-bit one.
  std::vector<int32_t> part_K(static_cast<size_t>(K));
  std::vector<int64_t> pos_K(static_cast<size_t>(K));
  if (uint64_t(numel) <= (uint64_t(1) << 32) && num_parts <= INT32_MAX) {
    const uint32_t n32 = uint32_t(num_parts);
    for (int64_t j = 0; j < K; ++j) {
      const uint32_t v = uint32_t(yp[j]), q = v / n32;
      part_K[j] = int32_t(v - q * n32);
      pos_K[j] = int64_t(q);
      ++cp[part_K[j]];
    }
  } else {
    for (int64_t j = 0; j < K; ++j) {
      part_K[j] = int32_t(yp[j] % num_parts);
      pos_K[j] = yp[j] / num_parts;
      ++cp[part_K[j]];
    }
  }
  // Step 2: exclusive prefix sums give each partition's first output slot.
  std::vector<int64_t> next(num_parts, 0);
  for (int64_t p = 1; p < num_parts; ++p) next[p] = next[p - 1] + cp[p - 1];
  // Step 3: stable scatter (input order kept inside a partition, as torch.sort(stable=True) does).
  for (int64_t j = 0; j < K; ++j) {
    const int64_t slot = next[part_K[j]]++;
    op[slot] = j;
    pp[slot] = pos_K[j];
  }
  return {counts, order, pos, at::zeros({3}, idx.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("permute", &permute_cpu);
  m.impl("hash_partition", &hash_partition_cpu);
}

}  // namespace zen_ext
