// CPU kernels of ZEN's server-side aggregation and pull (zen_ext::aggregate_push, encode_pull,
// decode_pull_): one pass each over the pushed payloads, the touched bitmap and the pulled message,
// bit-identical to the pure-torch reference (zen_ext/ops/_reference.py). Wire format: csrc/pull_format.h.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../lowbit.h"
#include "../pull_format.h"
#include "feistel32.h"

namespace zen_ext {
namespace {

using namespace pull;

at::ScalarType acc_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

void check_bytes(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kByte && t.dim() == 1 && t.is_contiguous(), what,
              " must be a contiguous 1-D uint8 CPU tensor, got ", t.scalar_type(), " of shape ", t.sizes(), " on ",
              t.device());
}

// The C library's memset (large sizes: streaming stores, no read of the old lines) in chunks over the
// intra-op threads; 0 is the all-zero bit pattern of every dtype the ops use.
void zero_cpu(const at::Tensor& t) {
  if (!t.is_contiguous()) {
    at::Tensor(t).zero_();
    return;
  }
  uint8_t* p = static_cast<uint8_t*>(t.data_ptr());
  const int64_t nbytes = int64_t(t.numel()) * int64_t(t.element_size());
  at::parallel_for(0, nbytes, int64_t(1) << 22, [&](int64_t b, int64_t e) { std::memset(p + b, 0, size_t(e - b)); });
}

constexpr int64_t kMaxBatch = kFeistelRun;

// Global indices of a run of positions, P⁻¹(p·n + part), into g[0, count): batched and vectorized
// while the domain fits 32 bits, then cycle walking for the few lanes that left [0, numel).
void global_indices(const int64_t* pos, int64_t count, int64_t part, int64_t n, uint64_t numel,
                    const FeistelKeys& keys, int bits, int64_t* g, uint32_t* scratch) {
  if (bits > 32) {
    for (int64_t j = 0; j < count; ++j) g[j] = global_index(pos[j], part, n, numel, keys, bits);
    return;
  }
  for (int64_t j = 0; j < count; ++j) scratch[j] = uint32_t(pos[j] * n + part);
  permute_run32(scratch, count, numel, keys, bits, /*inverse=*/true);
  for (int64_t j = 0; j < count; ++j) g[j] = int64_t(scratch[j]);
}

constexpr int64_t kBatch = kMaxBatch;
constexpr int64_t kPrefetch = 32;  // measured: 32 ahead beats 8, 64, 128 and none (docs/kernels.md)

// Stores rows [row0, row0 + count) of vals at the global indices of positions pos[0, count).
struct RowWriter {
  uint8_t* dst;
  const uint8_t* vals;
  int64_t vsz, part, n;
  uint64_t numel;
  FeistelKeys keys;
  int bits;

  void operator()(const int64_t* pos, int64_t count, int64_t row0) const {
    int64_t g[kBatch];
    uint32_t scratch[kBatch];
    global_indices(pos, count, part, n, numel, keys, bits, g, scratch);
    // The stores are random over out: prefetch a few ahead (a whole batch ahead evicts them again).
    for (int64_t j = 0; j < count; ++j) {
      if (j + kPrefetch < count) __builtin_prefetch(dst + g[j + kPrefetch] * vsz, 1, 1);
      std::memcpy(dst + g[j] * vsz, vals + (row0 + j) * vsz, size_t(vsz));
    }
  }
};

// Server side, steps 2-3 of zen's sync fused: every pushed payload summed into the compact buffer
// acc (part_size rows of width values, fp32 for half types) in payload order, and the touched
// bitmap set in the same pass. Returns (acc, words, count) with count = popcount(words) (int64 [1]).
// Sums the payloads into acc/words (zeroed by the caller); returns the touched count.
int64_t aggregate_into(at::Tensor& acc, at::Tensor& words, at::TensorList payloads, int64_t width,
                       at::ScalarType dtype, int64_t idx_bytes) {
  const int64_t m = acc.size(0), nw = words.numel();
  uint64_t* wp = reinterpret_cast<uint64_t*>(words.data_ptr<int64_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "aggregate_push", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    acc_t* ap = acc.data_ptr<acc_t>();
    const int64_t vsz = int64_t(sizeof(scalar_t)) * width;
    for (const auto& buf : payloads) {
      check_bytes(buf, "aggregate_push payload");
      const int64_t nbytes = buf.numel();
      const uint8_t* p = buf.data_ptr<uint8_t>();
      if (nbytes == 0) continue;
      if (m > 0 && nbytes == m * vsz) {  // dense payload: the whole partition, position order
        at::parallel_for(0, m * width, 1 << 16, [&](int64_t b, int64_t e) {
          for (int64_t j = b; j < e; ++j) ap[j] += acc_t(load<scalar_t>(p + j * sizeof(scalar_t)));
        });
        for (int64_t w = 0; w < nw; ++w) wp[w] = ~uint64_t(0);
        if (m % 64) wp[nw - 1] = (uint64_t(1) << (m % 64)) - 1;
        continue;
      }
      TORCH_CHECK(nbytes % (idx_bytes + vsz) == 0, "aggregate_push: a payload of ", nbytes,
                  " bytes is neither dense (", m * vsz, ") nor whole (position, row) pairs of ", idx_bytes + vsz);
      const int64_t k = nbytes / (idx_bytes + vsz);
      const uint8_t* vals = p + k * idx_bytes;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t pos = load_pos(p + j * idx_bytes, idx_bytes);
        TORCH_CHECK(pos >= 0 && pos < m, "aggregate_push: position ", pos, " outside [0, ", m, ")");
        // The adds land at random rows of acc: prefetch a few entries ahead, as the decode does.
        if (j + kPrefetch < k) {
          const int64_t ahead = load_pos(p + (j + kPrefetch) * idx_bytes, idx_bytes);
          if (ahead >= 0 && ahead < m) __builtin_prefetch(ap + ahead * width, 1, 1);
        }
        acc_t* row = ap + pos * width;
        const uint8_t* v = vals + j * vsz;
        for (int64_t c = 0; c < width; ++c) row[c] += acc_t(load<scalar_t>(v + c * sizeof(scalar_t)));
        wp[pos >> 6] |= uint64_t(1) << (pos & 63);
      }
    }
  });
  int64_t count = 0;
  for (int64_t w = 0; w < nw; ++w) count += popcount64(wp[w]);
  return count;
}

// Server side, steps 2-3 of zen's sync fused: every pushed payload summed into the compact buffer
// acc (part_size rows of width values, fp32 for half types) in payload order, and the touched
// bitmap set in the same pass. Returns (acc, words, count) with count = popcount(words) (int64 [1]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_push_cpu(at::TensorList payloads, int64_t part_size,
                                                                  int64_t width, at::ScalarType dtype,
                                                                  int64_t idx_bytes) {
  TORCH_CHECK(part_size >= 0 && width >= 1, "aggregate_push: part_size (", part_size, ") must be >= 0 and width (",
              width, ") >= 1");
  TORCH_CHECK(idx_bytes == 4 || idx_bytes == 8, "aggregate_push: idx_bytes (", idx_bytes, ") must be 4 or 8");
  auto acc = at::zeros({part_size, width}, at::TensorOptions().dtype(acc_type(dtype)));
  auto words = at::zeros({num_words(part_size)}, at::TensorOptions().dtype(at::kLong));
  const int64_t count = aggregate_into(acc, words, payloads, width, dtype, idx_bytes);
  return {acc, words, at::full({1}, count, at::TensorOptions().dtype(at::kLong))};
}

// aggregate_push into caller-owned buffers (zeroed here): acc [part_size, width] of the accumulation
// dtype and words [num_words(part_size)] int64, views of a workspace the caller keeps between calls.
// On the CPU a fresh part_size buffer is a new mapping whose page faults cost more than the
// aggregation itself (6.5 vs 15-17 ms at 4.2 M rows); CUDA's caching allocator has no such cost.
at::Tensor aggregate_push_into_cpu(at::Tensor acc, at::Tensor words, at::TensorList payloads, int64_t width,
                                   at::ScalarType dtype, int64_t idx_bytes) {
  TORCH_CHECK(idx_bytes == 4 || idx_bytes == 8, "aggregate_push_into: idx_bytes (", idx_bytes, ") must be 4 or 8");
  TORCH_CHECK(width >= 1 && acc.device().is_cpu() && acc.dim() == 2 && acc.size(1) == width && acc.is_contiguous() &&
                  acc.scalar_type() == acc_type(dtype),
              "aggregate_push_into: acc must be a contiguous [part_size, ", width, "] CPU tensor of ", acc_type(dtype),
              ", got ", acc.scalar_type(), " of shape ", acc.sizes());
  TORCH_CHECK(words.device().is_cpu() && words.scalar_type() == at::kLong && words.is_contiguous() &&
                  words.numel() == num_words(acc.size(0)),
              "aggregate_push_into: words must hold ", num_words(acc.size(0)), " contiguous int64 words");
  zero_cpu(acc);
  zero_cpu(words);
  const int64_t count = aggregate_into(acc, words, payloads, width, dtype, idx_bytes);
  return at::full({1}, count, at::TensorOptions().dtype(at::kLong));
}

// Server side, step 4: the pull message [fmt, count | body] of acc in format fmt, values divided by
// divisor (the op "mean" of zen: divide in the accumulation dtype, then cast, as the reference does).
at::Tensor encode_pull_cpu(const at::Tensor& acc, const at::Tensor& words, int64_t count, int64_t fmt,
                           int64_t divisor, at::ScalarType dtype, int64_t idx_bytes) {
  TORCH_CHECK(acc.device().is_cpu() && acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == acc_type(dtype),
              "encode_pull: acc must be a contiguous 2-D CPU tensor of ", acc_type(dtype), ", got ",
              acc.scalar_type(), " of shape ", acc.sizes());
  TORCH_CHECK(fmt == kFmtCoo || fmt == kFmtBitmap || fmt == kFmtDense, "encode_pull: fmt (", fmt,
              ") must be 0 (coo), 1 (bitmap) or 2 (dense)");
  TORCH_CHECK(divisor >= 1 && (idx_bytes == 4 || idx_bytes == 8), "encode_pull: divisor (", divisor,
              ") must be >= 1 and idx_bytes (", idx_bytes, ") 4 or 8");
  const int64_t m = acc.size(0), width = acc.size(1), nw = num_words(m);
  TORCH_CHECK(words.scalar_type() == at::kLong && words.numel() == nw && words.is_contiguous(),
              "encode_pull: words must hold ", nw, " int64 words");
  TORCH_CHECK(count >= 0 && count <= m, "encode_pull: count (", count, ") must be in [0, ", m, "]");
  const uint64_t* wp = reinterpret_cast<const uint64_t*>(words.data_ptr<int64_t>());
  const int64_t esz = at::elementSize(dtype), vsz = esz * width;
  const int64_t ib = index_bytes(fmt, count, m, idx_bytes);
  auto msg = at::empty({kHeaderBytes + ib + value_rows(fmt, count, m) * vsz}, at::TensorOptions().dtype(at::kByte));
  uint8_t* out = msg.data_ptr<uint8_t>();
  store<int64_t>(out, fmt);
  store<int64_t>(out + 8, count);
  uint8_t* idx_out = out + kHeaderBytes;
  uint8_t* val_out = idx_out + ib;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "encode_pull", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t* ap = acc.data_ptr<acc_t>();
    const acc_t div = acc_t(divisor);
    auto put_row = [&](int64_t row, int64_t at_row) {
      const acc_t* src = ap + row * width;
      uint8_t* dst = val_out + at_row * vsz;
      for (int64_t c = 0; c < width; ++c) {
        const acc_t v = divisor == 1 ? src[c] : src[c] / div;
        store<scalar_t>(dst + c * esz, scalar_t(v));
      }
    };
    if (fmt == kFmtDense) {
      at::parallel_for(0, m, 1 << 14, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) put_row(r, r);
      });
      return;
    }
    if (fmt == kFmtBitmap) std::memcpy(idx_out, wp, size_t(8 * nw));
    int64_t k = 0;
    for (int64_t w = 0; w < nw; ++w) {
      for (uint64_t bits = wp[w]; bits; bits &= bits - 1) {
        const int64_t pos = w * 64 + ctz64(bits);
        TORCH_CHECK(k < count, "encode_pull: more than count (", count, ") bits set");
        if (fmt == kFmtCoo) {
          if (idx_bytes == 4) store<int32_t>(idx_out + k * 4, int32_t(pos));
          else store<int64_t>(idx_out + k * 8, pos);
        }
        put_row(pos, k++);
      }
    }
    TORCH_CHECK(k == count, "encode_pull: count (", count, ") but ", k, " bits set");
  });
  return msg;
}

// Calls write(pos, c, row0) for batches of the positions of one pulled message's index part, in row
// order (format dense: every position of the partition of m; COO: the count positions, all checked
// before the first write, so a rejected message leaves out untouched; bitmap: the set bits, checked
// against count), in parallel over the rows. Shared by decode_pull_ and decode_pulls_lowbit_.
template <class Write>
void for_each_position(int64_t fmt, int64_t count, int64_t m, const uint8_t* idx_in, int64_t idx_bytes,
                       const char* op, const Write& write) {
  const int64_t nw = num_words(m);
  if (fmt == kFmtDense) {
    at::parallel_for(0, m, kBatch * 16, [&](int64_t b, int64_t e) {
      int64_t pos[kBatch];
      for (int64_t r = b; r < e; r += kBatch) {
        const int64_t c = std::min(kBatch, e - r);
        for (int64_t j = 0; j < c; ++j) pos[j] = r + j;
        write(pos, c, r);
      }
    });
  } else if (fmt == kFmtCoo) {
    // Check every position before the first write: a rejected message leaves out untouched.
    for (int64_t r = 0; r < count; ++r) {
      const int64_t pos = load_pos(idx_in + r * idx_bytes, idx_bytes);
      TORCH_CHECK(pos >= 0 && pos < m, op, ": COO position ", pos, " lies outside [0, ", m, ")");
    }
    at::parallel_for(0, count, kBatch * 16, [&](int64_t b, int64_t e) {
      int64_t pos[kBatch];
      for (int64_t r = b; r < e; r += kBatch) {
        const int64_t c = std::min(kBatch, e - r);
        for (int64_t j = 0; j < c; ++j) pos[j] = load_pos(idx_in + (r + j) * idx_bytes, idx_bytes);
        write(pos, c, r);
      }
    });
  } else {
    // Word by word: popcount gives each chunk of words its first value row (so threads can split
    // the words), count-trailing-zeros walks the set bits into batches of positions.
    const int64_t grain = 1 << 12;
    const int64_t chunks = (nw + grain - 1) / grain;
    std::vector<int64_t> first(chunks + 1, 0);
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t s = 0;
      for (int64_t w = c * grain, e = std::min(nw, w + grain); w < e; ++w) s += popcount64(load<uint64_t>(idx_in + 8 * w));
      first[c + 1] = first[c] + s;
    }
    TORCH_CHECK(first[chunks] == count, op, ": bitmap has ", first[chunks], " bits set, header says ", count);
    if (m % 64) {
      TORCH_CHECK((load<uint64_t>(idx_in + 8 * (nw - 1)) >> (m % 64)) == 0, op, ": bitmap bits past ", m);
    }
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      int64_t pos[kBatch];
      for (int64_t c = cb; c < ce; ++c) {
        int64_t row = first[c], fill = 0;
        for (int64_t w = c * grain, e = std::min(nw, w + grain); w < e; ++w) {
          for (uint64_t b = load<uint64_t>(idx_in + 8 * w); b; b &= b - 1) {
            pos[fill++] = w * 64 + ctz64(b);
            if (fill == kBatch) {
              write(pos, fill, row);
              row += fill, fill = 0;
            }
          }
        }
        if (fill) write(pos, fill, row);
      }
    });
  }
}

// Worker side, step 5: one pulled message of server `part` written into out (numel rows of width
// values, dtype of the values) at the global indices P⁻¹(p·n + part) of its positions p. Positions
// come from the bitmap words by popcount/count-trailing-zeros (no bool array, no nonzero).
void decode_pull_cpu(const at::Tensor& out, const at::Tensor& msg, int64_t part, int64_t num_parts,
                     const at::Tensor& keys, int64_t idx_bytes) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() >= 1 && out.dim() <= 2,
              "decode_pull_: out must be a contiguous 1-D or 2-D CPU tensor, got shape ", out.sizes());
  check_bytes(msg, "decode_pull_: msg");
  TORCH_CHECK(num_parts >= 1 && part >= 0 && part < num_parts, "decode_pull_: part (", part,
              ") must be in [0, num_parts = ", num_parts, ")");
  TORCH_CHECK(idx_bytes == 4 || idx_bytes == 8, "decode_pull_: idx_bytes (", idx_bytes, ") must be 4 or 8");
  const int64_t numel = out.size(0), width = out.dim() == 2 ? out.size(1) : 1;
  TORCH_CHECK(uint64_t(numel) <= kMaxNumel, "decode_pull_: numel must be <= 2^62, got ", numel);
  const int64_t m = part_size(numel, part, num_parts);
  const int64_t nbytes = msg.numel();
  if (nbytes == 0) return;
  TORCH_CHECK(nbytes >= kHeaderBytes, "decode_pull_: message of ", nbytes, " bytes has no header");
  const uint8_t* p = msg.data_ptr<uint8_t>();
  const int64_t fmt = load<int64_t>(p), count = load<int64_t>(p + 8);
  TORCH_CHECK(fmt == kFmtCoo || fmt == kFmtBitmap || fmt == kFmtDense, "decode_pull_: bad format ", fmt);
  TORCH_CHECK(count >= 0 && count <= m, "decode_pull_: count (", count, ") must be in [0, ", m, "]");
  const int64_t esz = out.element_size(), vsz = esz * width;
  const int64_t ib = index_bytes(fmt, count, m, idx_bytes);
  TORCH_CHECK(nbytes == kHeaderBytes + ib + value_rows(fmt, count, m) * vsz, "decode_pull_: message of ", nbytes,
              " bytes does not match format ", fmt, " with count ", count, " of a partition of ", m);
  const uint8_t* idx_in = p + kHeaderBytes;
  const uint8_t* val_in = idx_in + ib;
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr());
  const FeistelKeys k = read_keys(keys);
  const int bits = domain_bits(uint64_t(numel));
  // A row is copied byte for byte: the values are already in out's dtype (scaled by the server).
  for_each_position(fmt, count, m, idx_in, idx_bytes, "decode_pull_",
                    RowWriter{dst, val_in, vsz, part, num_parts, uint64_t(numel), k, bits});
}
// zen.dgc.value_bits, worker side (core/zen_lowbit.py, step 5): the global indices of a pulled message's
// positions, stored at their rows; the message's values follow those indices in ascending order (the owner
// quantizes its sums in that order), so the decode sorts them before it writes.
// Sorts g (values below 2^bits) ascending: an LSD radix sort, 11 bits a pass, so a message of K indices costs
// O(K · ceil(bits / 11)) instead of std::sort's O(K log K) (measured: a 16-rank DGC 1 % decode spent 10 of its
// 14 ms in std::sort). tmp is scratch of g's size.
void radix_sort_indices(std::vector<int64_t>& g, std::vector<int64_t>& tmp, int bits) {
  constexpr int kRadixBits = 11;
  constexpr size_t kBuckets = size_t(1) << kRadixBits;
  const size_t K = g.size();
  if (K < 2) return;
  tmp.resize(K);
  std::vector<size_t> count(kBuckets);
  for (int shift = 0; shift < bits; shift += kRadixBits) {
    std::fill(count.begin(), count.end(), size_t(0));
    for (size_t j = 0; j < K; ++j) ++count[(uint64_t(g[j]) >> shift) & (kBuckets - 1)];
    size_t sum = 0;
    for (size_t b = 0; b < kBuckets; ++b) {
      const size_t c = count[b];
      count[b] = sum;
      sum += c;
    }
    for (size_t j = 0; j < K; ++j) tmp[count[(uint64_t(g[j]) >> shift) & (kBuckets - 1)]++] = g[j];
    g.swap(tmp);
  }
}

struct GlobalIndexWriter {
  int64_t* g;
  int64_t part, n;
  uint64_t numel;
  FeistelKeys keys;
  int dbits;

  void operator()(const int64_t* pos, int64_t count, int64_t row0) const {
    uint32_t scratch[kBatch];
    global_indices(pos, count, part, n, numel, keys, dbits, g + row0, scratch);
  }
};

// Every owner's low-bit pull message (msgs[i] from owner i of n = msgs.size()) written into out (1-D,
// numel, zeroed by the caller): [format, count | index part | scales (ceil(count / block); fp32 at 8 bits,
// bf16 at 4) | codes
// (ceil(count · bits / 8))], the index part as decode_pull_'s (dense: count is the partition's size), the
// values in ascending order of their positions' global indices. One
// op per bucket, no host read, the header read by the op: the oracle is
// zen_ext/ops/_reference_lowbit.py's decode_pulls_lowbit_.
void decode_pulls_lowbit_cpu(const at::Tensor& out, at::TensorList msgs, const at::Tensor& keys, int64_t idx_bytes,
                             int64_t bits, int64_t block, int64_t divisor) {
  const char* op = "decode_pulls_lowbit_";
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 1, op,
              ": out must be a contiguous 1-D CPU tensor, got shape ", out.sizes());
  TORCH_CHECK(idx_bytes == 4 || idx_bytes == 8, op, ": idx_bytes (", idx_bytes, ") must be 4 or 8");
  TORCH_CHECK(bits == 8 || bits == 4, op, ": bits (", bits, ") must be 8 or 4");
  TORCH_CHECK(block >= 2 && block % 2 == 0, op, ": block (", block, ") must be even and >= 2");
  TORCH_CHECK(divisor >= 1, op, ": divisor (", divisor, ") must be >= 1");
  const int64_t numel = out.size(0), n = int64_t(msgs.size());
  TORCH_CHECK(uint64_t(numel) <= kMaxNumel, op, ": numel must be <= 2^62, got ", numel);
  const FeistelKeys k = read_keys(keys);
  const int dbits = domain_bits(uint64_t(numel));
  int index_bits = 1;  // every global index is below numel
  while (index_bits < 63 && (int64_t(1) << index_bits) < numel) ++index_bits;
  std::vector<int64_t> g, tmp;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& msg = msgs[i];
    check_bytes(msg, "decode_pulls_lowbit_: msg");
    const int64_t nbytes = msg.numel(), m = part_size(numel, i, n);
    if (nbytes == 0) continue;
    TORCH_CHECK(nbytes >= kHeaderBytes, op, ": message ", i, " of ", nbytes, " bytes has no header");
    const uint8_t* p = msg.data_ptr<uint8_t>();
    const int64_t fmt = load<int64_t>(p), count = load<int64_t>(p + 8);
    TORCH_CHECK(fmt == kFmtCoo || fmt == kFmtBitmap || (fmt == kFmtDense && count == m), op, ": bad format ", fmt,
                " with count ", count, " of a partition of ", m);
    TORCH_CHECK(count >= 0 && count <= m, op, ": count (", count, ") must be in [0, ", m, "]");
    const int64_t ib = index_bytes(fmt, count, m, idx_bytes), nb = (count + block - 1) / block;
    const int64_t sb = lowbit::scale_bytes_of(bits);
    TORCH_CHECK(nbytes == kHeaderBytes + ib + sb * nb + (count * bits + 7) / 8, op, ": message ", i, " of ", nbytes,
                " bytes does not match format ", fmt, " with count ", count);
    const uint8_t* idx_in = p + kHeaderBytes;
    // The scales are copied out (the message's run may be unaligned for a float load); a bf16 scale (4 bits)
    // is the high half of its fp32.
    std::vector<float> scales(static_cast<size_t>(nb));
    if (nb && sb == 4) std::memcpy(scales.data(), idx_in + ib, size_t(4 * nb));
    for (int64_t b = 0; sb == 2 && b < nb; ++b) {
      uint16_t h;
      std::memcpy(&h, idx_in + ib + 2 * b, 2);
      const uint32_t u = uint32_t(h) << 16;
      std::memcpy(&scales[size_t(b)], &u, 4);
    }
    const uint8_t* codes = idx_in + ib + sb * nb;
    // Value j lands at the j-th smallest global index of the message's positions.
    g.assign(static_cast<size_t>(count), 0);
    for_each_position(fmt, count, m, idx_in, idx_bytes, op, GlobalIndexWriter{g.data(), i, n, uint64_t(numel), k, dbits});
    radix_sort_indices(g, tmp, index_bits);
    // Row j's value: q_j · scale[j / block] (fp32; 8 bits an int8 code, 4 bits the nibble j % 2 of byte j / 2,
    // offset 8, as csrc/cpu/lowbit.cpp's dequantize_blocks), divided by divisor in fp32, cast on store.
    const float div = float(divisor);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "decode_pulls_lowbit_", [&] {
      scalar_t* dst = out.data_ptr<scalar_t>();
      at::parallel_for(0, count, kBatch * 16, [&](int64_t b, int64_t e) {
        for (int64_t j = b; j < e; ++j) {
          if (j + kPrefetch < e) __builtin_prefetch(dst + g[j + kPrefetch], 1, 1);
          const int q = bits == 8 ? int(int8_t(codes[j])) : int((codes[j / 2] >> ((j & 1) * 4)) & 15) - 8;
          float v = float(q) * scales[j / block];
          if (div != 1.0f) v = v / div;
          dst[g[j]] = static_cast<scalar_t>(v);
        }
      });
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("aggregate_push", &aggregate_push_cpu);
  m.impl("aggregate_push_into", &aggregate_push_into_cpu);
  m.impl("encode_pull", &encode_pull_cpu);
  m.impl("decode_pull_", &decode_pull_cpu);
  m.impl("decode_pulls_lowbit_", &decode_pulls_lowbit_cpu);
  m.impl("zero_", [](const at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu(), "zero_: t must be a CPU tensor, got ", t.device());
    zero_cpu(t);
  });
}

}  // namespace zen_ext
