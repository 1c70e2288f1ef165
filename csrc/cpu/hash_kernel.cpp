// CPU kernels of zen_ext::permute and zen_ext::hash_partition: a stable counting sort by partition,
// bit-identical to the pure-torch reference (zen_ext/ops/_reference.py).
#include <ATen/Parallel.h>

#include <atomic>
#include <torch/library.h>
#include <torch/torch.h>

#include "../hashing.h"

namespace zen_ext {
namespace {

FeistelKeys read_keys(const at::Tensor& keys) {
  TORCH_CHECK(keys.dtype() == at::kLong && keys.dim() == 1 && keys.numel() == kNumRounds,
              "keys must be an int64 tensor of ", kNumRounds, " round keys, got ", keys.dtype(), " of shape ",
              keys.sizes());
  auto k = keys.cpu().contiguous();
  FeistelKeys out;
  for (int r = 0; r < kNumRounds; ++r) out.k[r] = uint32_t(k.data_ptr<int64_t>()[r]);
  return out;
}

void check_idx(const at::Tensor& idx, int64_t numel) {
  TORCH_CHECK(idx.device().is_cpu(), "idx must be a CPU tensor, got ", idx.device());
  TORCH_CHECK(idx.dtype() == at::kLong, "idx must be int64, got ", idx.dtype());
  TORCH_CHECK(idx.dim() == 1, "idx must be 1-D, got ", idx.dim(), "-D");
  TORCH_CHECK(numel >= 0 && uint64_t(numel) <= kMaxNumel, "numel must be in [0, 2^62], got ", numel);
}

at::Tensor permute_cpu(const at::Tensor& idx, int64_t numel, const at::Tensor& keys, bool inverse) {
  check_idx(idx, numel);
  auto k = read_keys(keys);
  auto in = idx.contiguous();
  auto out = at::empty_like(in);
  const int64_t* src = in.data_ptr<int64_t>();
  int64_t* dst = out.data_ptr<int64_t>();
  const int bits = domain_bits(uint64_t(numel));
  // Cycle walking only returns into [0, numel) for inputs that start there: check, never loop forever.
  std::atomic<bool> bad{false};
  at::parallel_for(0, in.numel(), 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      if (src[j] < 0 || src[j] >= numel) {
        bad = true;
        dst[j] = src[j];
        continue;
      }
      dst[j] = int64_t(permute_one(uint64_t(src[j]), uint64_t(numel), k, bits, inverse));
    }
  });
  TORCH_CHECK(!bad, "permute indices must lie in [0, ", numel, ")");
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
  // Step 1: histogram of partitions.
  for (int64_t j = 0; j < K; ++j) ++cp[yp[j] % num_parts];
  // Step 2: exclusive prefix sums give each partition's first output slot.
  std::vector<int64_t> next(num_parts, 0);
  for (int64_t p = 1; p < num_parts; ++p) next[p] = next[p - 1] + cp[p - 1];
  // Step 3: stable scatter (input order kept inside a partition, as torch.sort(stable=True) does).
  int64_t* op = order.data_ptr<int64_t>();
  int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t j = 0; j < K; ++j) {
    const int64_t part = yp[j] % num_parts;
    const int64_t slot = next[part]++;
    op[slot] = j;
    pp[slot] = yp[j] / num_parts;
  }
  return {counts, order, pos, at::zeros({3}, idx.options())};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("permute", &permute_cpu);
  m.impl("hash_partition", &hash_partition_cpu);
}

}  // namespace zen_ext
