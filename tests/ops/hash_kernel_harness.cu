// Plain-CUDA harness for csrc/cuda/hash_kernel.cuh (no torch): tests/ops/test_cuda_compile.py builds
// it with nvcc, links it against the CUDA runtime and runs it.
//
// It runs Algorithm 1 twice on the same input:
//   host:   the header's insert_one / partition_totals / place_* functions, with the insertion spread
//           over several std::threads that race on the same table through the header's host atomics;
//   device: the header's kernels, when a CUDA device is present (otherwise it says why not).
// and prints the host result for the test to compare with the CPU op, plus the device check.
//
// stdin:  numel num_parts num_rehash parallel_factor serial_factor num_threads slot_bits K
//         key0 key1 key2 key3
//         idx_0 ... idx_{K-1}
// stdout: "geometry r1 r2", "counts ...", "order ...", "pos ...", "stats c s o", "device ..." lines.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "../../csrc/cuda/hash_kernel.cuh"

using namespace zen_ext;
using namespace zen_ext::alg1;

struct Input {
  uint64_t numel = 0;
  int64_t num_parts = 1;
  int num_rehash = 3;
  double parallel_factor = 2.0, serial_factor = 0.1;
  int num_threads = 1, slot_bits = 32;
  std::vector<int64_t> keys_R = std::vector<int64_t>(kNumRounds), idx;
};

struct Result {
  std::vector<int64_t> counts, order, pos, stats;
};

void print(const char* name, const std::vector<int64_t>& v) {
  std::string line = name;
  for (int64_t x : v) line += " " + std::to_string(x);
  std::puts(line.c_str());
}

template <typename slot_t>
Result run_host(const Input& in, const Geometry& g) {
  const int64_t K = int64_t(in.idx.size());
  const FeistelKeys keys = load_keys(in.keys_R.data());
  const int bits = domain_bits(in.numel);
  std::vector<slot_t> table(size_t(g.num_parts * g.width()), 0), ovf_entry(size_t(K), 0), ovf_rank(size_t(K), 0);
  std::vector<int64_t> serial_count(size_t(g.num_parts), 0), counters(kNumCounters, 0);
  // Threads interleave (j = t, t + T, ...) so that neighbours race for the same slots.
  std::vector<std::thread> threads;
  for (int t = 0; t < in.num_threads; ++t) {
    threads.emplace_back([&, t] {
      Tally tally;
      for (int64_t j = t; j < K; j += in.num_threads) {
        const uint64_t x = uint64_t(in.idx[size_t(j)]);
        const int64_t part = int64_t(permute_one(x, in.numel, keys, bits, false) % uint64_t(g.num_parts));
        insert_one<slot_t>(slot_t(j + 1), x, part, g, keys, table.data(), serial_count.data(), ovf_entry.data(),
                           ovf_rank.data(), &counters[kOverflows], tally);
      }
      atomic_add(&counters[kCollisions], tally.collisions);
      atomic_add(&counters[kSerialWrites], tally.serial_writes);
    });
  }
  for (auto& th : threads) th.join();
  std::vector<slot_t> cum(table.size());
  int64_t running = 0;
  for (size_t s = 0; s < table.size(); ++s) cum[s] = slot_t(running += (table[s] != 0));
  Result r;
  r.counts.resize(size_t(g.num_parts));
  std::vector<int64_t> ovf_before(size_t(g.num_parts)), ovf_start(size_t(g.num_parts));
  partition_totals(g, cum.data(), serial_count.data(), r.counts.data(), ovf_before.data(), ovf_start.data());
  r.order.assign(size_t(K), -1);
  r.pos.assign(size_t(K), -1);
  for (int64_t s = 0; s < int64_t(table.size()); ++s)
    place_table_slot(s, table.data(), cum.data(), g, ovf_before.data(), in.idx.data(), in.numel, keys, bits,
                     r.order.data(), r.pos.data());
  for (int64_t o = 0; o < counters[kOverflows]; ++o)
    place_overflow(o, ovf_entry.data(), ovf_rank.data(), ovf_start.data(), in.idx.data(), in.numel, keys, bits,
                   g.num_parts, r.order.data(), r.pos.data());
  r.stats.assign(counters.begin(), counters.begin() + 3);
  return r;
}

#define CHECK_CUDA(expr)                                                              \
  do {                                                                                \
    cudaError_t err_ = (expr);                                                        \
    if (err_ != cudaSuccess) return std::string(#expr ": ") + cudaGetErrorString(err_); \
  } while (0)

template <typename T>
T* device_copy(const std::vector<T>& v) {
  T* p = nullptr;
  if (cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

template <typename T>
std::vector<T> host_copy(const T* p, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

// The same pipeline as csrc/cuda/hash_kernel.cu, with the prefix count done on the host (no ATen here).
template <typename slot_t>
std::string run_device(const Input& in, const Geometry& g, Result& out) {
  const int64_t K = int64_t(in.idx.size()), S = g.num_parts * g.width();
  const int bits = domain_bits(in.numel);
  const int blocks = int(std::max<int64_t>(1, std::min<int64_t>((std::max(K, S) + 255) / 256, 1 << 16)));
  int64_t* idx = device_copy(in.idx);
  int64_t* keys = device_copy(in.keys_R);
  slot_t* table = device_copy(std::vector<slot_t>(size_t(S), 0));
  slot_t* ovf_entry = device_copy(std::vector<slot_t>(size_t(K), 0));
  slot_t* ovf_rank = device_copy(std::vector<slot_t>(size_t(K), 0));
  int64_t* serial_count = device_copy(std::vector<int64_t>(size_t(g.num_parts), 0));
  int64_t* counters = device_copy(std::vector<int64_t>(kNumCounters, 0));
  if (!idx || !keys || !table || !ovf_entry || !ovf_rank || !serial_count || !counters) return "cudaMalloc failed";
  insert_kernel<slot_t><<<blocks, kThreadsPerBlock>>>(idx, K, in.numel, keys, bits, g, table, serial_count, ovf_entry,
                                                      ovf_rank, counters);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  const std::vector<slot_t> table_h = host_copy(table, size_t(S));
  std::vector<slot_t> cum_h(size_t(S), 0);
  int64_t running = 0;
  for (int64_t s = 0; s < S; ++s) cum_h[size_t(s)] = slot_t(running += (table_h[size_t(s)] != 0));
  slot_t* cum = device_copy(cum_h);
  int64_t* counts = device_copy(std::vector<int64_t>(size_t(g.num_parts), 0));
  int64_t* offsets = device_copy(std::vector<int64_t>(size_t(2 * g.num_parts), 0));
  int64_t* order = device_copy(std::vector<int64_t>(size_t(K), -1));
  int64_t* pos = device_copy(std::vector<int64_t>(size_t(K), -1));
  totals_kernel<slot_t><<<1, 1>>>(g, cum, serial_count, counts, offsets, offsets + g.num_parts);
  extract_kernel<slot_t><<<blocks, kThreadsPerBlock>>>(table, cum, g, offsets, idx, in.numel, keys, bits, order, pos);
  const std::vector<int64_t> counters_h = host_copy(counters, kNumCounters);
  if (counters_h[kOverflows] > 0)
    merge_overflow_kernel<slot_t><<<blocks, kThreadsPerBlock>>>(ovf_entry, ovf_rank, counters_h[kOverflows],
                                                                offsets + g.num_parts, idx, in.numel, keys, bits,
                                                                g.num_parts, order, pos);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  out.counts = host_copy(counts, size_t(g.num_parts));
  out.order = host_copy(order, size_t(K));
  out.pos = host_copy(pos, size_t(K));
  out.stats.assign(counters_h.begin(), counters_h.begin() + 3);
  for (void* p : {(void*)idx, (void*)keys, (void*)table, (void*)ovf_entry, (void*)ovf_rank, (void*)serial_count,
                  (void*)counters, (void*)cum, (void*)counts, (void*)offsets, (void*)order, (void*)pos})
    cudaFree(p);
  return "";
}

// Device vs host: counts equal, and inside each partition the same (position, local position) pairs.
std::string compare(const Result& a, const Result& b) {
  if (a.counts != b.counts) return "counts differ";
  int64_t start = 0;
  for (int64_t c : a.counts) {
    std::vector<std::pair<int64_t, int64_t>> pa, pb;
    for (int64_t i = start; i < start + c; ++i) {
      pa.emplace_back(a.order[size_t(i)], a.pos[size_t(i)]);
      pb.emplace_back(b.order[size_t(i)], b.pos[size_t(i)]);
    }
    std::sort(pa.begin(), pa.end());
    std::sort(pb.begin(), pb.end());
    if (pa != pb) return "partition entries differ";
    start += c;
  }
  return "";
}

template <typename slot_t>
int run(const Input& in) {
  const int64_t K = int64_t(in.idx.size());
  if (K == 0) {
    std::puts("error: K must be > 0 (the op returns early on empty input)");
    return 2;
  }
  const Geometry g = make_geometry(K, in.num_parts, in.num_rehash, in.parallel_factor, in.serial_factor);
  std::printf("geometry %lld %lld\n", (long long)g.r1, (long long)g.r2);
  const Result host = run_host<slot_t>(in, g);
  print("counts", host.counts);
  print("order", host.order);
  print("pos", host.pos);
  print("stats", host.stats);
  int num_devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&num_devices);
  if (err != cudaSuccess || num_devices == 0) {
    std::printf("device none (%s)\n", err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device");
    return 0;
  }
  Result dev;
  const std::string failure = run_device<slot_t>(in, g, dev);
  if (!failure.empty()) {
    std::printf("device error (%s)\n", failure.c_str());
    return 1;
  }
  const std::string diff = compare(host, dev);
  std::printf("device %s\n", diff.empty() ? "match" : ("mismatch: " + diff).c_str());
  return diff.empty() ? 0 : 1;
}

int main() {
  Input in;
  int64_t K = 0;
  std::cin >> in.numel >> in.num_parts >> in.num_rehash >> in.parallel_factor >> in.serial_factor >>
      in.num_threads >> in.slot_bits >> K;
  for (auto& k : in.keys_R) std::cin >> k;
  in.idx.resize(size_t(K));
  for (auto& x : in.idx) std::cin >> x;
  if (!std::cin) {
    std::puts("error: malformed input");
    return 2;
  }
  for (int64_t x : in.idx) {
    if (!in_range(x, in.numel)) {
      std::puts("error: index out of range");
      return 2;
    }
  }
  return in.slot_bits == 64 ? run<int64_t>(in) : run<int32_t>(in);
}
