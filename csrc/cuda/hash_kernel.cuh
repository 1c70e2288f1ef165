// Algorithm 1 of the ZEN paper (OSDI'25 §3.2, "Hierarchical hashing"): the per-index logic and the
// CUDA kernels of zen_ext::hash_partition, free of torch so that a plain-CUDA harness (and, through
// the host branches of the atomics, a multi-threaded host run) can compile and exercise the same code.
//
// Memory x of Algorithm 1 is a table of n rows (one per partition, i.e. per server) of r1 parallel
// slots followed by r2 serial slots. A slot holds (input position + 1): 0 marks an empty slot, so
// index 0 stays representable, and duplicate indices in the input remain distinct entries (lossless).
// Geometry follows our documented reading of the paper (research/seeds.md §1.5): r1 =
// ceil(parallel_factor * K / n) per partition, so the parallel memory holds parallel_factor * K slots
// in total (paper: 2|G|d_G, load factor 0.5), and r2 = ceil(serial_factor * r1) (paper: r1/10).
// Serial memory that fills up spills into an overflow list (its own atomic counter), which is merged
// into the right partitions afterwards: the published algorithm leaves this case undefined.
//
// Nothing here moves bytes between ranks; the output decides what each rank pushes to each server.
#pragma once

#include <cmath>
#include <cstdint>

#include "../hashing.h"

namespace zen_ext {
namespace alg1 {

// Table shape and probing parameters. Plain data so it can be passed to kernels by value.
struct Geometry {
  int64_t num_parts;  // n: partitions (servers).
  int64_t r1;         // parallel slots per partition.
  int64_t r2;         // serial slots per partition.
  int num_rehash;     // k: hash functions h_1..h_k tried in parallel memory before the serial write.
  ZEN_HD int64_t width() const { return r1 + r2; }
};

// r1 = ceil(parallel_factor * K / n), r2 = ceil(serial_factor * r1). Callers check K > 0, n >= 1,
// parallel_factor > 0 (so r1 >= 1) and serial_factor >= 0.
inline Geometry make_geometry(int64_t K, int64_t num_parts, int num_rehash, double parallel_factor,
                              double serial_factor) {
  Geometry g;
  g.num_parts = num_parts;
  g.r1 = int64_t(std::ceil(parallel_factor * double(K) / double(num_parts)));
  if (g.r1 < 1) g.r1 = 1;
  g.r2 = int64_t(std::ceil(serial_factor * double(g.r1)));
  g.num_rehash = num_rehash;
  return g;
}

// ----------------------------------------------------------------------------------------------
// Second-level hash functions h_1..h_k: MurmurHash3_x86_32 of the 8-byte index, one seed per function.
// ----------------------------------------------------------------------------------------------

ZEN_HD uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

ZEN_HD uint32_t murmur3_mix_block(uint32_t h, uint32_t block) {
  block *= 0xCC9E2D51u;
  block = rotl32(block, 15);
  block *= 0x1B873593u;
  h ^= block;
  h = rotl32(h, 13);
  return h * 5u + 0xE6546B64u;
}

// MurmurHash3_x86_32 of the little-endian bytes of `key` (8 bytes, no tail) with `seed`.
ZEN_HD uint32_t murmur3_u64(uint64_t key, uint32_t seed) {
  uint32_t h = murmur3_mix_block(seed, uint32_t(key));
  h = murmur3_mix_block(h, uint32_t(key >> 32));
  return fmix32(h ^ 8u);
}

// Seed of h_{i+1}. Derived from the shared Feistel round keys, so every rank that agreed on the
// h0 seed also agrees on H (the paper broadcasts MurmurHash seeds at start). The odd multiple of the
// golden ratio keeps seeds distinct when i wraps around the round keys.
ZEN_HD uint32_t rehash_seed(const FeistelKeys& keys, int i) {
  // Select the round key with constant indices: a dynamic keys.k[i % 4] would put the keys in local
  // (stack) memory on the GPU.
  uint32_t key = keys.k[0];
  for (int r = 1; r < kNumRounds; ++r) key = (i % kNumRounds == r) ? keys.k[r] : key;
  return fmix32(key ^ (0x9E3779B9u * uint32_t(2 * i + 1)));
}

// h_{i+1}(idx) in [0, r1). Multiply-shift range reduction (no division) when r1 fits 32 bits.
ZEN_HD int64_t rehash_slot(uint64_t idx, const FeistelKeys& keys, int i, int64_t r1) {
  const uint32_t seed = rehash_seed(keys, i);
  const uint32_t h = murmur3_u64(idx, seed);
  if (uint64_t(r1) <= (uint64_t(1) << 32)) return int64_t((uint64_t(h) * uint64_t(r1)) >> 32);
  const uint64_t wide = (uint64_t(murmur3_u64(idx, ~seed)) << 32) | h;
  return int64_t(wide % uint64_t(r1));
}

// ----------------------------------------------------------------------------------------------
// Atomics with a device branch (CUDA) and a host branch (GCC builtins) so the same insertion code
// runs in the kernels and in the multi-threaded host harness (tests/ops/hash_kernel_harness.cu).
// ----------------------------------------------------------------------------------------------

ZEN_HD int32_t atomic_cas(int32_t* p, int32_t expected, int32_t desired) {
#if defined(__CUDA_ARCH__)
  return atomicCAS(reinterpret_cast<int*>(p), expected, desired);
#else
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;  // the value found in *p (== the original `expected` iff the swap happened)
#endif
}

ZEN_HD int64_t atomic_cas(int64_t* p, int64_t expected, int64_t desired) {
#if defined(__CUDA_ARCH__)
  return int64_t(atomicCAS(reinterpret_cast<unsigned long long*>(p), (unsigned long long)expected,
                           (unsigned long long)desired));
#else
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
#endif
}

// Returns the value before the addition (like CUDA's atomicAdd).
ZEN_HD int64_t atomic_add(int64_t* p, int64_t v) {
#if defined(__CUDA_ARCH__)
  return int64_t(atomicAdd(reinterpret_cast<unsigned long long*>(p), (unsigned long long)v));
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

// ----------------------------------------------------------------------------------------------
// Per-index logic (Algorithm 1, lines 5-16) and the extraction (lines 19-23).
// ----------------------------------------------------------------------------------------------

// Global counters written by the insertion; their first three entries are the op's `stats` output.
enum Counter : int { kCollisions = 0, kSerialWrites = 1, kOverflows = 2, kOutOfRange = 3, kNumCounters = 4 };

// What one insertion adds to the collision and serial-write counters (summed per warp on the GPU
// before one atomic, instead of one global atomic per event).
struct Tally {
  int64_t collisions = 0;
  int64_t serial_writes = 0;
};

// Places `entry` (= input position + 1) of index `idx` into row `part` of `table`.
//
// 1. Probe h_1..h_k in the parallel memory; claim the first empty slot.
// 2. After k failed probes, take the next serial slot of the partition from its atomic counter.
// 3. If the serial memory is full, append to the overflow list with the entry's rank among the
//    partition's overflow entries (the serial counter value past r2), so the merge can place it.
template <typename slot_t>
ZEN_HD void insert_one(slot_t entry, uint64_t idx, int64_t part, const Geometry& g, const FeistelKeys& keys,
                       slot_t* table, int64_t* serial_count, slot_t* ovf_entry, slot_t* ovf_rank,
                       int64_t* ovf_total, Tally& tally) {
  slot_t* row = table + part * g.width();
  // Step 1: parallel memory. The paper writes, then re-reads the slot to detect a concurrent
  // writer (Technique #4). On a GPU that check is racy: thread A writes and re-reads its own value,
  // then thread B, which had also seen the slot empty, overwrites it and re-reads *its* value; both
  // checks pass and A's index is lost (nothing orders B's write before A's re-read, and a compiler may
  // even forward A's store to its load). atomicCAS(slot, empty, entry) fuses the emptiness check
  // (line 12), the write (line 13) and the read-after-write into one indivisible step: exactly one
  // thread claims an empty slot, and every loser sees the winner's value and rehashes.
  for (int i = 0; i < g.num_rehash; ++i) {
    const int64_t q = rehash_slot(idx, keys, i, g.r1);
    if (atomic_cas(row + q, slot_t(0), entry) == slot_t(0)) return;
    ++tally.collisions;
  }
  // Step 2: serial memory (lines 8-10). The counter hands out each serial slot once, so a plain store
  // suffices; counts past r2 are not lost, they mean "overflow entry number s - r2".
  ++tally.serial_writes;
  const int64_t s = atomic_add(serial_count + part, 1);
  if (s < g.r2) {
    row[g.r1 + s] = entry;
    return;
  }
  // Step 3: overflow list (capacity K, so it cannot fill up).
  const int64_t o = atomic_add(ovf_total, 1);
  ovf_entry[o] = entry;
  ovf_rank[o] = slot_t(s - g.r2);
}

// Per-partition totals from the inclusive prefix count `cum` of non-empty table slots (row-major over
// n rows of `width` slots) and the serial counters. Runs once, on one thread: n is small.
//
// Writes counts[p] (entries of partition p, overflow included), ovf_before[p] (overflow entries of
// partitions < p, which shift table entries of p in the output) and ovf_start[p] (output position of
// partition p's first overflow entry, right after its table entries).
template <typename cum_t>
ZEN_HD void partition_totals(const Geometry& g, const cum_t* cum, const int64_t* serial_count, int64_t* counts,
                             int64_t* ovf_before, int64_t* ovf_start) {
  int64_t prev_cum = 0, out_start = 0, ovf_seen = 0;
  for (int64_t p = 0; p < g.num_parts; ++p) {
    const int64_t row_end = int64_t(cum[(p + 1) * g.width() - 1]);
    const int64_t in_table = row_end - prev_cum;
    prev_cum = row_end;
    const int64_t spilled = serial_count[p] > g.r2 ? serial_count[p] - g.r2 : 0;
    counts[p] = in_table + spilled;
    ovf_before[p] = ovf_seen;
    ovf_start[p] = out_start + in_table;
    ovf_seen += spilled;
    out_start += counts[p];
  }
}

// Writes one output entry: its input position and its local position P(idx) // n in the partition.
ZEN_HD void emit(int64_t out, int64_t j, const int64_t* idx, uint64_t numel, const FeistelKeys& keys, int bits,
                 int64_t num_parts, int64_t* order, int64_t* pos) {
  order[out] = j;
  // Recomputing P is as cheap in memory traffic as reading a stored copy (8 bytes either way) and
  // saves a K-sized buffer.
  pos[out] = int64_t(permute_one(uint64_t(idx[j]), numel, keys, bits, false) / uint64_t(num_parts));
}

// Extraction of table slot `s` (line 20: nonzero(x[p]) in slot order, all partitions concatenated).
template <typename slot_t, typename cum_t>
ZEN_HD void place_table_slot(int64_t s, const slot_t* table, const cum_t* cum, const Geometry& g,
                             const int64_t* ovf_before, const int64_t* idx, uint64_t numel, const FeistelKeys& keys,
                             int bits, int64_t* order, int64_t* pos) {
  const slot_t v = table[s];
  if (v == slot_t(0)) return;
  const int64_t part = s / g.width();
  emit(int64_t(cum[s]) - 1 + ovf_before[part], int64_t(v) - 1, idx, numel, keys, bits, g.num_parts, order, pos);
}

// Merge of overflow entry `o` behind its partition's table entries, in overflow-rank order.
template <typename slot_t>
ZEN_HD void place_overflow(int64_t o, const slot_t* ovf_entry, const slot_t* ovf_rank, const int64_t* ovf_start,
                           const int64_t* idx, uint64_t numel, const FeistelKeys& keys, int bits, int64_t num_parts,
                           int64_t* order, int64_t* pos) {
  const int64_t j = int64_t(ovf_entry[o]) - 1;
  const int64_t part = int64_t(permute_one(uint64_t(idx[j]), numel, keys, bits, false) % uint64_t(num_parts));
  emit(ovf_start[part] + int64_t(ovf_rank[o]), j, idx, numel, keys, bits, num_parts, order, pos);
}

ZEN_HD bool in_range(int64_t x, uint64_t numel) { return x >= 0 && uint64_t(x) < numel; }

ZEN_HD FeistelKeys load_keys(const int64_t* keys_R) {
  FeistelKeys k;
  for (int r = 0; r < kNumRounds; ++r) k.k[r] = uint32_t(keys_R[r]);
  return k;
}

// ----------------------------------------------------------------------------------------------
// Kernels. One thread per index (grid-stride). Keys are read from device memory by every thread
// (a broadcast load, cached) so the host never has to copy them back.
// ----------------------------------------------------------------------------------------------
#if defined(__CUDACC__)

constexpr int kThreadsPerBlock = 256;  // a multiple of 32: every warp is full for the warp sums

// Sum of `v` over the warp, added to *dst by lane 0. Every lane of every warp must call it.
__device__ __forceinline__ void warp_sum_to(int64_t v, int64_t* dst) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  if ((threadIdx.x & 31) == 0 && v != 0) atomic_add(dst, v);
}

__global__ void permute_kernel(const int64_t* __restrict__ idx, int64_t K, uint64_t numel, const int64_t* keys_R,
                               int bits, bool inverse, int64_t* __restrict__ out, int64_t* out_of_range) {
  const FeistelKeys keys = load_keys(keys_R);
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < K; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = idx[j];
    // Cycle walking only returns into [0, numel) for inputs that start there: flag, never spin.
    if (!in_range(x, numel)) {
      out[j] = x;
      atomic_add(out_of_range, 1);
      continue;
    }
    out[j] = int64_t(permute_one(uint64_t(x), numel, keys, bits, inverse));
  }
}

// Algorithm 1, lines 4-17, for every index in parallel. counters: see enum Counter.
template <typename slot_t>
__global__ void insert_kernel(const int64_t* __restrict__ idx, int64_t K, uint64_t numel, const int64_t* keys_R,
                              int bits, Geometry g, slot_t* table, int64_t* serial_count, slot_t* ovf_entry,
                              slot_t* ovf_rank, int64_t* counters) {
  const FeistelKeys keys = load_keys(keys_R);
  Tally tally;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < K; j += int64_t(gridDim.x) * blockDim.x) {
    const int64_t x = idx[j];
    if (!in_range(x, numel)) {
      atomic_add(counters + kOutOfRange, 1);
      continue;
    }
    // Line 5: p = h0(idx), the same keyed permutation as on the CPU.
    const int64_t part = int64_t(permute_one(uint64_t(x), numel, keys, bits, false) % uint64_t(g.num_parts));
    insert_one<slot_t>(slot_t(j + 1), uint64_t(x), part, g, keys, table, serial_count, ovf_entry, ovf_rank,
                       counters + kOverflows, tally);
  }
  warp_sum_to(tally.collisions, counters + kCollisions);
  warp_sum_to(tally.serial_writes, counters + kSerialWrites);
}

template <typename cum_t>
__global__ void totals_kernel(Geometry g, const cum_t* cum, const int64_t* serial_count, int64_t* counts,
                              int64_t* ovf_before, int64_t* ovf_start) {
  if (blockIdx.x == 0 && threadIdx.x == 0) partition_totals(g, cum, serial_count, counts, ovf_before, ovf_start);
}

template <typename slot_t>
__global__ void extract_kernel(const slot_t* __restrict__ table, const slot_t* __restrict__ cum, Geometry g,
                               const int64_t* ovf_before, const int64_t* __restrict__ idx, uint64_t numel,
                               const int64_t* keys_R, int bits, int64_t* order, int64_t* pos) {
  const FeistelKeys keys = load_keys(keys_R);
  const int64_t num_slots = g.num_parts * g.width();
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < num_slots;
       s += int64_t(gridDim.x) * blockDim.x) {
    place_table_slot(s, table, cum, g, ovf_before, idx, numel, keys, bits, order, pos);
  }
}

template <typename slot_t>
__global__ void merge_overflow_kernel(const slot_t* __restrict__ ovf_entry, const slot_t* __restrict__ ovf_rank,
                                      int64_t num_overflows, const int64_t* ovf_start, const int64_t* __restrict__ idx,
                                      uint64_t numel, const int64_t* keys_R, int bits, int64_t num_parts, int64_t* order,
                                      int64_t* pos) {
  const FeistelKeys keys = load_keys(keys_R);
  for (int64_t o = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; o < num_overflows;
       o += int64_t(gridDim.x) * blockDim.x) {
    place_overflow(o, ovf_entry, ovf_rank, ovf_start, idx, numel, keys, bits, num_parts, order, pos);
  }
}

#endif  // __CUDACC__

}  // namespace alg1
}  // namespace zen_ext
