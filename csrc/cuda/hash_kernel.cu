// CUDA kernels of zen_ext::permute and zen_ext::hash_partition: the ZEN paper's Algorithm 1
// (OSDI'25 §3.2) with h0 = P(idx) % n, the same keyed permutation as the CPU op, so every device and
// every rank agree on which server owns which index. The kernels and the per-index logic live in
// hash_kernel.cuh (torch-free, compile-checked and host-tested by tests/ops/test_cuda_compile.py);
// this file is the torch glue: checks, allocation, launches on the current stream.
//
// Output contract (identical to csrc/cpu/hash_kernel.cpp except the order inside a partition):
// counts_P (exact), order_K grouped by partition (inside a partition: parallel slots in slot order,
// then serial slots in counter order, then overflow entries), pos_K = P(idx) // n of each grouped
// entry, stats_3 = [collisions (failed parallel probes), serial writes, serial-memory overflows].
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "hash_kernel.cuh"

namespace zen_ext {
namespace {

using alg1::kThreadsPerBlock;

int64_t num_blocks(int64_t work) {
  // Grid-stride loops cover the rest: 2^16 blocks of 256 threads keep every current GPU busy.
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreadsPerBlock - 1) / kThreadsPerBlock, 1 << 16));
}

void check_inputs(const char* op, const at::Tensor& idx, int64_t numel, const at::Tensor& keys) {
  TORCH_CHECK(idx.is_cuda(), op, ": idx must be a CUDA tensor, got ", idx.device());
  TORCH_CHECK(idx.scalar_type() == at::kLong, op, ": idx must be int64, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == 1, op, ": idx must be 1-D, got ", idx.dim(), "-D");
  TORCH_CHECK(numel >= 0 && uint64_t(numel) <= kMaxNumel, op, ": numel must be in [0, 2^62], got ", numel);
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.numel() == kNumRounds, op,
              ": keys must be an int64 tensor of ", kNumRounds, " round keys, got ", keys.scalar_type(),
              " of shape ", keys.sizes());
}

// Kernels read the round keys from device memory: no device-to-host copy when they already live there.
at::Tensor keys_on_device(const at::Tensor& keys, const at::Tensor& idx) {
  return keys.to(idx.device()).contiguous();
}

at::Tensor permute_cuda(const at::Tensor& idx, int64_t numel, const at::Tensor& keys, bool inverse) {
  check_inputs("permute", idx, numel, keys);
  const c10::cuda::CUDAGuard device_guard(idx.device());
  auto in = idx.contiguous();
  auto out = at::empty_like(in);
  const int64_t K = in.numel();
  if (K == 0) return out;
  auto keys_R = keys_on_device(keys, in);
  auto out_of_range = at::zeros({1}, in.options());
  alg1::permute_kernel<<<num_blocks(K), kThreadsPerBlock, 0, c10::cuda::getCurrentCUDAStream()>>>(
      in.data_ptr<int64_t>(), K, uint64_t(numel), keys_R.data_ptr<int64_t>(), domain_bits(uint64_t(numel)), inverse,
      out.data_ptr<int64_t>(), out_of_range.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // One synchronisation, so that a bad index raises here as it does on the CPU.
  const int64_t num_bad = out_of_range.item<int64_t>();
  TORCH_CHECK(num_bad == 0, "permute indices must lie in [0, ", numel, "), got ", num_bad, " outside");
  return out;
}

// Algorithm 1 with table slots of type slot_t (int32 while K + 1 fits, else int64).
//
// 1. Allocate x = 0^{n x (r1 + r2)} (line 2), the serial counters (line 3, counted from r1) and an
//    overflow list of capacity K.
// 2. Insert every index in parallel (lines 4-17).
// 3. Read the counters back once: raise on out-of-range indices, learn the overflow count.
// 4. Extract (lines 19-23): a prefix count of non-empty slots gives every table entry its output
//    position; partition totals come from the same prefix count.
// 5. Merge overflow entries behind their partition's table entries (only if any spilled).
template <typename slot_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_partition_impl(const at::Tensor& idx, int64_t numel,
                                                                                const at::Tensor& keys_R,
                                                                                const alg1::Geometry& g,
                                                                                at::ScalarType slot_type) {
  const int64_t K = idx.numel(), n = g.num_parts, num_slots = n * g.width();
  const int bits = domain_bits(uint64_t(numel));
  const auto opts = idx.options();
  const auto slot_opts = opts.dtype(slot_type);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t* idx_p = idx.data_ptr<int64_t>();
  const int64_t* keys_p = keys_R.data_ptr<int64_t>();

  // Step 1: the empty marker is 0, so zero-filled memory is an empty table.
  auto table = at::zeros({num_slots}, slot_opts);
  auto serial_count = at::zeros({n}, opts);
  auto ovf_entry = at::empty({K}, slot_opts);
  auto ovf_rank = at::empty({K}, slot_opts);
  auto counters = at::zeros({alg1::kNumCounters}, opts);

  // Step 2: insertion.
  alg1::insert_kernel<slot_t><<<num_blocks(K), kThreadsPerBlock, 0, stream>>>(
      idx_p, K, uint64_t(numel), keys_p, bits, g, table.data_ptr<slot_t>(), serial_count.data_ptr<int64_t>(),
      ovf_entry.data_ptr<slot_t>(), ovf_rank.data_ptr<slot_t>(), counters.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Step 3: the only synchronisation (callers read counts_P on the host right after anyway).
  const auto host = counters.cpu();
  const int64_t num_bad = host.data_ptr<int64_t>()[alg1::kOutOfRange];
  const int64_t num_overflows = host.data_ptr<int64_t>()[alg1::kOverflows];
  TORCH_CHECK(num_bad == 0, "hash_partition indices must lie in [0, ", numel, "), got ", num_bad, " outside");

  // Step 4: nonzero(x[p]) for all p at once, in row-major slot order.
  auto cum = at::cumsum(table.ne(0), 0, slot_type);
  auto counts = at::empty({n}, opts);
  auto offsets = at::empty({2 * n}, opts);  // [ovf_before (n) | ovf_start (n)]
  int64_t* ovf_before = offsets.data_ptr<int64_t>();
  int64_t* ovf_start = ovf_before + n;
  alg1::totals_kernel<slot_t><<<1, 1, 0, stream>>>(g, cum.data_ptr<slot_t>(), serial_count.data_ptr<int64_t>(),
                                                    counts.data_ptr<int64_t>(), ovf_before, ovf_start);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto order = at::empty({K}, opts);
  auto pos = at::empty({K}, opts);
  alg1::extract_kernel<slot_t><<<num_blocks(num_slots), kThreadsPerBlock, 0, stream>>>(
      table.data_ptr<slot_t>(), cum.data_ptr<slot_t>(), g, ovf_before, idx_p, uint64_t(numel), keys_p, bits,
      order.data_ptr<int64_t>(), pos.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Step 5: the lossless fallback the paper leaves out.
  if (num_overflows > 0) {
    alg1::merge_overflow_kernel<slot_t><<<num_blocks(num_overflows), kThreadsPerBlock, 0, stream>>>(
        ovf_entry.data_ptr<slot_t>(), ovf_rank.data_ptr<slot_t>(), num_overflows, ovf_start, idx_p,
        uint64_t(numel), keys_p, bits, n, order.data_ptr<int64_t>(), pos.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {counts, order, pos, counters.narrow(0, 0, 3).clone()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_partition_cuda(
    const at::Tensor& idx, int64_t numel, int64_t num_parts, const at::Tensor& keys, int64_t num_rehash,
    double parallel_factor, double serial_factor) {
  check_inputs("hash_partition", idx, numel, keys);
  TORCH_CHECK(num_parts >= 1, "num_parts must be >= 1, got ", num_parts);
  TORCH_CHECK(num_rehash >= 0 && num_rehash <= std::numeric_limits<int>::max(),
              "num_rehash must be >= 0, got ", num_rehash);
  TORCH_CHECK(std::isfinite(parallel_factor) && parallel_factor > 0, "parallel_factor must be > 0, got ",
              parallel_factor);
  TORCH_CHECK(std::isfinite(serial_factor) && serial_factor >= 0, "serial_factor must be >= 0, got ",
              serial_factor);
  const c10::cuda::CUDAGuard device_guard(idx.device());
  auto in = idx.contiguous();
  const int64_t K = in.numel();
  if (K == 0) {
    return {at::zeros({num_parts}, in.options()), at::empty({0}, in.options()), at::empty({0}, in.options()),
            at::zeros({3}, in.options())};
  }
  const auto g = alg1::make_geometry(K, num_parts, int(num_rehash), parallel_factor, serial_factor);
  TORCH_CHECK(double(num_parts) * double(g.width()) < 9.0e18, "hash_partition: table of ", num_parts, " x ",
              g.width(), " slots does not fit in int64 (parallel_factor ", parallel_factor, ", serial_factor ",
              serial_factor, ")");
  auto keys_R = keys_on_device(keys, in);
  // Slots store input position + 1, and the prefix counts reach at most K: int32 halves the table
  // whenever K + 1 fits.
  if (K < std::numeric_limits<int32_t>::max()) {
    return hash_partition_impl<int32_t>(in, numel, keys_R, g, at::kInt);
  }
  return hash_partition_impl<int64_t>(in, numel, keys_R, g, at::kLong);
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) {
  m.impl("permute", &permute_cuda);
  m.impl("hash_partition", &hash_partition_cuda);
}

}  // namespace zen_ext
