// CUDA kernels of ZEN's server-side aggregation and pull (zen_ext::aggregate_push, encode_pull,
// decode_pull_), same schemas and wire format (csrc/pull_format.h) as the CPU op
// (csrc/cpu/pull_kernel.cpp). Launched on the current stream; none of them reads device memory on the
// host, so a zen call's host synchronizations stay the ones zen.py makes (counts, message sizes).
//
// Differences from the CPU op, by design:
// * aggregate_push sums with atomicAdd: the order of the additions into one position is not fixed
//   (as for index_add_ on CUDA); integer-valued sums are still exact.
// * decode_pull_ reads the header on the device and cannot raise on a malformed message without a
//   host read: entries outside the partition are skipped (the CPU op raises). Messages come from
//   encode_pull on a peer, which checks them.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "../pull_format.h"

namespace zen_ext {
namespace {

using namespace pull;
constexpr int kThreads = 256;
constexpr int64_t kRowKernelBytes = 16;  // rows wider than this: encode_rows_kernel, decode_rows_kernel

int64_t blocks_for(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 1 << 16));
}

__device__ __forceinline__ FeistelKeys keys_from(const int64_t* keys_R) {
  FeistelKeys k;
  for (int r = 0; r < kNumRounds; ++r) k.k[r] = uint32_t(keys_R[r]);
  return k;
}

__device__ __forceinline__ void atomic_add_acc(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add_acc(double* p, double v) { atomicAdd(p, v); }

__device__ __forceinline__ void set_bit(int64_t* words, int64_t pos) {
  atomicOr(reinterpret_cast<unsigned long long*>(words + (pos >> 6)), 1ull << (pos & 63));
}

// ---- aggregate_push ------------------------------------------------------------------------------

template <typename scalar_t, typename acc_t>
__global__ void add_dense_kernel(const uint8_t* __restrict__ p, int64_t total, acc_t* __restrict__ acc) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < total; j += int64_t(gridDim.x) * blockDim.x)
    acc[j] += acc_t(load<scalar_t>(p + j * sizeof(scalar_t)));  // one payload per launch: no race
}

__global__ void fill_words_kernel(int64_t* __restrict__ words, int64_t m) {
  const int64_t nw = num_words(m);
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < nw; w += int64_t(gridDim.x) * blockDim.x) {
    const int64_t rem = m - 64 * w;  // int64: a partition of > 2^31 rows would wrap an int
    words[w] = rem >= 64 ? int64_t(~0ull) : int64_t((1ull << rem) - 1);
  }
}

template <typename scalar_t, typename acc_t>
__global__ void add_coo_kernel(const uint8_t* __restrict__ p, int64_t k, int64_t width, int64_t idx_bytes,
                               int64_t m, acc_t* __restrict__ acc, int64_t* __restrict__ words,
                               int64_t* __restrict__ bad) {
  // One thread per (entry, column): consecutive threads add consecutive columns of a row (coalesced),
  // where a thread per entry walked a whole embedding row alone.
  const uint8_t* vals = p + k * idx_bytes;
  const int64_t total = k * width;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < total; u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = u / width, c = u - j * width;
    const int64_t pos = load_pos(p + j * idx_bytes, idx_bytes);
    if (pos < 0 || pos >= m) {
      if (c == 0) atomicAdd(reinterpret_cast<unsigned long long*>(bad), 1ull);
      continue;
    }
    atomic_add_acc(acc + pos * width + c, acc_t(load<scalar_t>(vals + u * int64_t(sizeof(scalar_t)))));
    if (c == 0) set_bit(words, pos);
  }
}

// One atomic per block (a block-wide sum first): an atomic per thread on the one counter serialized
// 97,600 atomics per call, 72 us on an H100 for a 6.25 M-position partition.
__global__ void popcount_total_kernel(const int64_t* __restrict__ words, int64_t nw, int64_t* __restrict__ count) {
  __shared__ unsigned long long partial[kThreads];
  unsigned long long s = 0;
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < nw; w += int64_t(gridDim.x) * blockDim.x)
    s += popcount64(uint64_t(words[w]));
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0 && partial[0]) atomicAdd(reinterpret_cast<unsigned long long*>(count), partial[0]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aggregate_push_cuda(at::TensorList payloads, int64_t part_size,
                                                                   int64_t width, at::ScalarType dtype,
                                                                   int64_t idx_bytes) {
  TORCH_CHECK(!payloads.empty(), "aggregate_push: the CUDA op needs at least one payload (for its device)");
  TORCH_CHECK(part_size >= 0 && width >= 1 && (idx_bytes == 4 || idx_bytes == 8), "aggregate_push: part_size (",
              part_size, ") >= 0, width (", width, ") >= 1, idx_bytes (", idx_bytes, ") 4 or 8");
  const c10::cuda::CUDAGuard guard(payloads[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t m = part_size, nw = num_words(m);
  const auto opts = payloads[0].options();
  const at::ScalarType acc_st = (dtype == at::kHalf || dtype == at::kBFloat16) ? at::kFloat : dtype;
  auto acc = at::zeros({m, width}, opts.dtype(acc_st));
  auto words = at::zeros({nw}, opts.dtype(at::kLong));
  auto counters = at::zeros({2}, opts.dtype(at::kLong));  // [count, bad positions]
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "aggregate_push_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const int64_t vsz = int64_t(sizeof(scalar_t)) * width;
    for (const auto& buf : payloads) {
      TORCH_CHECK(buf.is_cuda() && buf.scalar_type() == at::kByte && buf.dim() == 1 && buf.is_contiguous(),
                  "aggregate_push payloads must be contiguous 1-D uint8 CUDA tensors");
      TORCH_CHECK(buf.device() == payloads[0].device(), "aggregate_push: payloads on ", buf.device(), " and ",
                  payloads[0].device(), " must share one device");
      const int64_t nbytes = buf.numel();
      if (nbytes == 0) continue;
      if (m > 0 && nbytes == m * vsz) {
        add_dense_kernel<scalar_t, acc_t><<<blocks_for(m * width), kThreads, 0, stream>>>(
            buf.data_ptr<uint8_t>(), m * width, acc.data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        fill_words_kernel<<<blocks_for(nw), kThreads, 0, stream>>>(words.data_ptr<int64_t>(), m);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        continue;
      }
      TORCH_CHECK(nbytes % (idx_bytes + vsz) == 0, "aggregate_push: a payload of ", nbytes,
                  " bytes is neither dense (", m * vsz, ") nor whole (position, row) pairs of ", idx_bytes + vsz);
      const int64_t k = nbytes / (idx_bytes + vsz);
      add_coo_kernel<scalar_t, acc_t><<<blocks_for(k * width), kThreads, 0, stream>>>(
          buf.data_ptr<uint8_t>(), k, width, idx_bytes, m, acc.data_ptr<acc_t>(), words.data_ptr<int64_t>(),
          counters.data_ptr<int64_t>() + 1);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  if (nw) {
    popcount_total_kernel<<<blocks_for(nw), kThreads, 0, stream>>>(words.data_ptr<int64_t>(), nw,
                                                                   counters.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // [count, positions outside the partition]: the caller reads the count anyway (it sizes the pull
  // message) and checks the second word in the same read (ops.read_aggregate_count), so a malformed
  // payload fails as it does on the CPU, where the op raises, without a host synchronization of its own.
  return {acc, words, counters};
}

// ---- encode_pull ---------------------------------------------------------------------------------

__global__ void word_popcount_kernel(const int64_t* __restrict__ words, int64_t nw, int64_t* __restrict__ pc) {
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < nw; w += int64_t(gridDim.x) * blockDim.x)
    pc[w] = popcount64(uint64_t(words[w]));
}

// One value of the message, stored with the value's own width at its natural alignment. The value
// rows start at 16 + 4·count (COO, int32 positions), 16 + 8·count, 16 + 8·words or 16 bytes into a
// message that the caching allocator aligns to 512, so 2- and 4-byte values are always aligned: a
// single st.global.u16 / .u32 of the converted bits. Why not memcpy into the byte buffer, as the CPU
// op does: a 2-byte memcpy becomes two st.global.u8 of the converted Half/BFloat16 register, and
// ptxas (CUDA 13.0, sm_90) compiles the low one as F2I.U8.F16 -- the value converted to uint8, not
// its low byte (3.0 -> 0x4203) -- so every bf16/fp16 message was lossy (issue 20; reproducer:
// STORE16_CU in tests/ops/test_cuda_compile.py, which fails on that PTX pattern). 8-byte values can sit
// at 4 mod 8 after an odd count of int32 positions: they keep the byte copy (no conversion involved).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void put_value(uint8_t* p, acc_t v) {
  if constexpr (sizeof(scalar_t) == 2) {
    const scalar_t h(static_cast<float>(v));  // c10::Half / c10::BFloat16: round to nearest even
    *reinterpret_cast<uint16_t*>(p) = h.x;
  } else if constexpr (sizeof(scalar_t) == 4) {
    *reinterpret_cast<scalar_t*>(p) = static_cast<scalar_t>(v);
  } else {
    store<scalar_t>(p, static_cast<scalar_t>(v));
  }
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void put_row(const acc_t* acc, int64_t row, int64_t width, int64_t divisor,
                                        uint8_t* val_out, int64_t at_row) {
  for (int64_t c = 0; c < width; ++c) {
    const acc_t v = divisor == 1 ? acc[row * width + c] : acc[row * width + c] / acc_t(divisor);
    put_value<scalar_t, acc_t>(val_out + (at_row * width + c) * int64_t(sizeof(scalar_t)), v);
  }
}

// One thread per word (bitmap, COO) or per row (dense); first_row = exclusive prefix of popcounts.
template <typename scalar_t, typename acc_t>
__global__ void encode_kernel(const acc_t* __restrict__ acc, const int64_t* __restrict__ words,
                              const int64_t* __restrict__ incl_pc, int64_t m, int64_t width, int64_t fmt,
                              int64_t count, int64_t divisor, int64_t idx_bytes, uint8_t* __restrict__ msg) {
  uint8_t* idx_out = msg + kHeaderBytes;
  uint8_t* val_out = idx_out + index_bytes(fmt, count, m, idx_bytes);
  const int64_t nw = num_words(m);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t t0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (t0 == 0) {  // the header: two aligned int64 (encode_pull_cuda checks the message's alignment)
    reinterpret_cast<int64_t*>(msg)[0] = fmt;
    reinterpret_cast<int64_t*>(msg)[1] = count;
  }
  if (fmt == kFmtDense) {
    for (int64_t r = t0; r < m; r += stride) put_row<scalar_t, acc_t>(acc, r, width, divisor, val_out, r);
    return;
  }
  for (int64_t w = t0; w < nw; w += stride) {
    const uint64_t bits0 = uint64_t(words[w]);
    if (fmt == kFmtBitmap) *reinterpret_cast<uint64_t*>(idx_out + 8 * w) = bits0;  // 8-aligned
    int64_t k = incl_pc[w] - popcount64(bits0);
    for (uint64_t b = bits0; b; b &= b - 1) {
      const int64_t pos = w * 64 + ctz64(b);
      // Entries past count would land past their region (count is the caller's, popcount(words) the
      // truth; the CPU op raises on a mismatch, here nothing is written out of bounds): checked before
      // the position is written, whose slot at k == count is the first value's.
      if (k >= count) break;
      if (fmt == kFmtCoo) {  // aligned: positions start 16 bytes into the message
        if (idx_bytes == 4) *reinterpret_cast<int32_t*>(idx_out + k * 4) = int32_t(pos);
        else *reinterpret_cast<int64_t*>(idx_out + k * 8) = pos;
      }
      put_row<scalar_t, acc_t>(acc, pos, width, divisor, val_out, k++);
    }
  }
}

// Rows wider than 16 bytes: a block per 64 positions (a bitmap word, or 64 dense rows). Step 1: threads
// 0-63 find their position's row k in the message (popcount prefix) and write the word or the COO
// position; step 2: the whole block converts and stores those rows, consecutive threads on consecutive
// columns. encode_kernel's thread per word wrote up to 64 whole rows alone.
template <typename scalar_t, typename acc_t>
__global__ void encode_rows_kernel(const acc_t* __restrict__ acc, const int64_t* __restrict__ words,
                                   const int64_t* __restrict__ incl_pc, int64_t m, int64_t width, int64_t fmt,
                                   int64_t count, int64_t divisor, int64_t idx_bytes, uint8_t* __restrict__ msg) {
  __shared__ int64_t pos_sh[64], k_sh[64];
  uint8_t* idx_out = msg + kHeaderBytes;
  uint8_t* val_out = idx_out + index_bytes(fmt, count, m, idx_bytes);
  const int tid = threadIdx.x;
  if (blockIdx.x == 0 && tid == 0) {  // the header: two aligned int64 (encode_pull_cuda checks alignment)
    reinterpret_cast<int64_t*>(msg)[0] = fmt;
    reinterpret_cast<int64_t*>(msg)[1] = count;
  }
  const int64_t nitems = num_words(m);
  for (int64_t it = blockIdx.x; it < nitems; it += gridDim.x) {
    // Step 1: each of the item's 64 positions: its row in the message, or -1 when it sends nothing.
    if (tid < 64) {
      int64_t pos = it * 64 + tid, k = pos;
      if (fmt != kFmtDense) {
        const uint64_t w = uint64_t(words[it]);
        if (fmt == kFmtBitmap && tid == 0) *reinterpret_cast<uint64_t*>(idx_out + 8 * it) = w;  // 8-aligned
        k = incl_pc[it] - popcount64(w) + popcount64(w & ((1ull << tid) - 1ull));
        // Entries past count would land past their region (see encode_kernel): not written.
        if (!((w >> tid) & 1ull) || k >= count) pos = -1;
        if (pos >= 0 && fmt == kFmtCoo) {
          if (idx_bytes == 4) *reinterpret_cast<int32_t*>(idx_out + k * 4) = int32_t(pos);
          else *reinterpret_cast<int64_t*>(idx_out + k * 8) = pos;
        }
      }
      if (pos >= m) pos = -1;
      pos_sh[tid] = pos;
      k_sh[tid] = k;
    }
    __syncthreads();
    // Step 2: the block converts and stores the rows.
    for (int64_t u = tid; u < 64 * width; u += blockDim.x) {
      const int64_t s = u / width, c = u - s * width, pos = pos_sh[s];
      if (pos < 0) continue;
      const acc_t v = divisor == 1 ? acc[pos * width + c] : acc[pos * width + c] / acc_t(divisor);
      put_value<scalar_t, acc_t>(val_out + (k_sh[s] * width + c) * int64_t(sizeof(scalar_t)), v);
    }
    __syncthreads();
  }
}

at::Tensor encode_pull_cuda(const at::Tensor& acc, const at::Tensor& words, int64_t count, int64_t fmt,
                            int64_t divisor, at::ScalarType dtype, int64_t idx_bytes) {
  TORCH_CHECK(acc.is_cuda() && acc.dim() == 2 && acc.is_contiguous(), "encode_pull: acc must be contiguous 2-D CUDA");
  TORCH_CHECK(fmt == kFmtCoo || fmt == kFmtBitmap || fmt == kFmtDense, "encode_pull: fmt (", fmt, ") must be 0, 1 or 2");
  TORCH_CHECK(divisor >= 1 && (idx_bytes == 4 || idx_bytes == 8), "encode_pull: divisor >= 1, idx_bytes 4 or 8");
  const c10::cuda::CUDAGuard guard(acc.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t m = acc.size(0), width = acc.size(1), nw = num_words(m);
  TORCH_CHECK(words.scalar_type() == at::kLong && words.numel() == nw && words.is_contiguous(),
              "encode_pull: words must hold ", nw, " int64 words");
  TORCH_CHECK(words.device() == acc.device(), "encode_pull: words (", words.device(), ") must be on acc's device (",
              acc.device(), ")");
  TORCH_CHECK(count >= 0 && count <= m, "encode_pull: count (", count, ") must be in [0, ", m, "]");
  const int64_t vsz = at::elementSize(dtype) * width;
  auto msg = at::empty({kHeaderBytes + index_bytes(fmt, count, m, idx_bytes) + value_rows(fmt, count, m) * vsz},
                       acc.options().dtype(at::kByte));
  // put_value stores 2- and 4-byte values and the positions with their own width: they need the
  // message's start aligned (the caching allocator gives 512; a host check, no synchronization).
  TORCH_CHECK(reinterpret_cast<uintptr_t>(msg.data_ptr()) % 16 == 0, "encode_pull: message buffer not 16-byte aligned");
  auto pc = at::empty({std::max<int64_t>(nw, 1)}, words.options());
  if (fmt != kFmtDense && nw) {
    word_popcount_kernel<<<blocks_for(nw), kThreads, 0, stream>>>(words.data_ptr<int64_t>(), nw, pc.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    pc = at::cumsum(pc, 0);  // inclusive; the kernel subtracts its own word
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "encode_pull_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    TORCH_CHECK(acc.scalar_type() == c10::CppTypeToScalarType<acc_t>::value, "encode_pull: acc dtype");
    if (vsz > kRowKernelBytes) {  // rows: a block per 64 positions
      encode_rows_kernel<scalar_t, acc_t><<<static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(nw, 1), 1 << 16)),
                                            kThreads, 0, stream>>>(
          acc.data_ptr<acc_t>(), words.data_ptr<int64_t>(), pc.data_ptr<int64_t>(), m, width, fmt, count, divisor,
          idx_bytes, msg.data_ptr<uint8_t>());
    } else {
      encode_kernel<scalar_t, acc_t><<<blocks_for(std::max(fmt == kFmtDense ? m : nw, int64_t(1))), kThreads, 0,
                                       stream>>>(acc.data_ptr<acc_t>(), words.data_ptr<int64_t>(), pc.data_ptr<int64_t>(),
                                                 m, width, fmt, count, divisor, idx_bytes, msg.data_ptr<uint8_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return msg;
}

// ---- decode_pull_ --------------------------------------------------------------------------------

// Popcount per bitmap word, or zeros when the message is not a bitmap (the format is on the device).
__global__ void msg_word_popcount_kernel(const uint8_t* __restrict__ msg, int64_t nbytes, int64_t nw,
                                         int64_t* __restrict__ pc) {
  const int64_t fmt = load<int64_t>(msg);
  for (int64_t w = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; w < nw; w += int64_t(gridDim.x) * blockDim.x) {
    const bool ok = fmt == kFmtBitmap && kHeaderBytes + 8 * (w + 1) <= nbytes;
    pc[w] = ok ? popcount64(load<uint64_t>(msg + kHeaderBytes + 8 * w)) : 0;
  }
}

// One value (or narrow row) moved with one load and one store where both ends are aligned (a bit copy:
// no conversion involved), byte by byte otherwise (a message sits at any byte offset).
__device__ __forceinline__ void copy_value(uint8_t* dst, const uint8_t* src, int64_t vsz) {
  const uint64_t a = uint64_t(reinterpret_cast<uintptr_t>(dst)) | uint64_t(reinterpret_cast<uintptr_t>(src));
  if (vsz == 4 && a % 4 == 0) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  } else if (vsz == 2 && a % 2 == 0) {
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  } else if (vsz == 8 && a % 8 == 0) {
    *reinterpret_cast<uint64_t*>(dst) = *reinterpret_cast<const uint64_t*>(src);
  } else {
    memcpy(dst, src, size_t(vsz));
  }
}

// One thread per position (dense), entry (COO) or word (bitmap, with incl_pc the inclusive prefix).
__global__ void decode_kernel(uint8_t* __restrict__ out, int64_t vsz, const uint8_t* __restrict__ msg,
                              int64_t nbytes, const int64_t* __restrict__ incl_pc, int64_t part, int64_t n,
                              uint64_t numel, int64_t m, const int64_t* __restrict__ keys_R, int bits,
                              int64_t idx_bytes) {
  const int64_t fmt = load<int64_t>(msg), count = load<int64_t>(msg + 8);
  if (count < 0 || count > m) return;
  const int64_t ib = index_bytes(fmt, count, m, idx_bytes);
  if (nbytes != kHeaderBytes + ib + value_rows(fmt, count, m) * vsz) return;  // malformed: write nothing
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t t0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  // The grid is sized for m positions (the format is only known here): a bitmap needs m/8 threads.
  if (t0 >= (fmt == kFmtBitmap ? num_words(m) * 8 : fmt == kFmtCoo ? count : m)) return;
  const FeistelKeys keys = keys_from(keys_R);
  const uint8_t* idx_in = msg + kHeaderBytes;
  const uint8_t* val_in = idx_in + ib;
  auto put = [&](int64_t pos, int64_t row) {
    const int64_t g = global_index(pos, part, n, numel, keys, bits);
    copy_value(out + g * vsz, val_in + row * vsz, vsz);
  };
  if (fmt == kFmtDense) {
    for (int64_t r = t0; r < m; r += stride) put(r, r);
  } else if (fmt == kFmtCoo) {
    for (int64_t r = t0; r < count; r += stride) {
      const int64_t pos = load_pos(idx_in + r * idx_bytes, idx_bytes);
      if (pos >= 0 && pos < m) put(pos, r);
    }
  } else if (fmt == kFmtBitmap) {
    // Eight threads per word, one per byte of it: a thread per word left most of the GPU idle on a few
    // set bits each, one P^-1 and one random store after another (an H100 decoded a message of ~490 K
    // entries in 56 us, 16 % of its DRAM bandwidth).
    const int64_t nw = num_words(m);
    for (int64_t t = t0; t < nw * 8; t += stride) {
      const int64_t w = t >> 3;
      const int sub = int(t & 7);
      const uint64_t bits0 = load<uint64_t>(idx_in + 8 * w);
      const uint64_t below = sub == 0 ? 0 : bits0 & ((uint64_t(1) << (8 * sub)) - 1);
      int64_t row = incl_pc[w] - popcount64(bits0) + popcount64(below);
      for (uint64_t b = bits0 & (uint64_t(0xFF) << (8 * sub)); b; b &= b - 1) {
        const int64_t pos = w * 64 + ctz64(b);
        if (pos < m && row < count) put(pos, row);
        ++row;
      }
    }
  }
}

// Rows wider than 16 bytes (embedding rows): a block per item of 64 slots -- a bitmap word, or 64 COO
// entries or dense rows. Step 1: threads 0-63 find their slot's global row (P⁻¹) and message row into
// shared memory; step 2: the whole block copies those rows, CH bytes a thread, consecutive threads on
// consecutive chunks (coalesced). decode_kernel's thread per word copied up to 64 rows alone, a byte at
// a time: 2.5 ms per 1 MiB message on an H100 (issue 23).
template <int CH>
__device__ __forceinline__ void copy_rows(uint8_t* out, const uint8_t* val_in, int64_t vsz, const int64_t* g_sh,
                                          const int64_t* row_sh) {
  using V = typename std::conditional<CH == 16, uint4, typename std::conditional<CH == 8, uint2,
            typename std::conditional<CH == 4, uint32_t, typename std::conditional<CH == 2, uint16_t,
            uint8_t>::type>::type>::type>::type;
  const int64_t per_row = vsz / CH;
  for (int64_t u = threadIdx.x; u < 64 * per_row; u += blockDim.x) {
    const int64_t s = u / per_row, c = u - s * per_row;
    const int64_t g = g_sh[s];
    if (g < 0) continue;
    reinterpret_cast<V*>(out + g * vsz)[c] = reinterpret_cast<const V*>(val_in + row_sh[s] * vsz)[c];
  }
}

__global__ void decode_rows_kernel(uint8_t* __restrict__ out, int64_t vsz, const uint8_t* __restrict__ msg,
                                   int64_t nbytes, const int64_t* __restrict__ incl_pc, int64_t part, int64_t n,
                                   uint64_t numel, int64_t m, const int64_t* __restrict__ keys_R, int bits,
                                   int64_t idx_bytes) {
  __shared__ int64_t g_sh[64], row_sh[64];
  const int64_t fmt = load<int64_t>(msg), count = load<int64_t>(msg + 8);
  if (count < 0 || count > m) return;
  const int64_t ib = index_bytes(fmt, count, m, idx_bytes);
  if (nbytes != kHeaderBytes + ib + value_rows(fmt, count, m) * vsz) return;  // malformed: write nothing
  if (fmt != kFmtDense && fmt != kFmtCoo && fmt != kFmtBitmap) return;
  const FeistelKeys keys = keys_from(keys_R);
  const uint8_t* idx_in = msg + kHeaderBytes;
  const uint8_t* val_in = idx_in + ib;
  const int64_t items = (value_rows(fmt, count, m) + 63) / 64;  // bitmap: count <= m, one item per word
  const int64_t nitems = fmt == kFmtBitmap ? num_words(m) : items;
  // The widest copy that the row size and both ends' alignment allow (messages sit at any byte offset).
  const uint64_t a = uint64_t(reinterpret_cast<uintptr_t>(out)) | uint64_t(reinterpret_cast<uintptr_t>(val_in)) |
                     uint64_t(vsz);
  const int ch = a % 16 == 0 ? 16 : a % 8 == 0 ? 8 : a % 4 == 0 ? 4 : a % 2 == 0 ? 2 : 1;
  const int tid = threadIdx.x;
  for (int64_t it = blockIdx.x; it < nitems; it += gridDim.x) {
    // Step 1: each of 64 slots' destination row (-1: none) and message row.
    if (tid < 64) {
      int64_t pos = -1, row = 0;
      if (fmt == kFmtBitmap) {
        const uint64_t w = load<uint64_t>(idx_in + 8 * it);
        if ((w >> tid) & 1ull) {
          pos = it * 64 + tid;
          row = incl_pc[it] - popcount64(w) + popcount64(w & ((1ull << tid) - 1ull));
          if (pos >= m || row >= count) pos = -1;
        }
      } else {
        row = it * 64 + tid;
        if (row < value_rows(fmt, count, m)) pos = fmt == kFmtDense ? row : load_pos(idx_in + row * idx_bytes, idx_bytes);
        if (pos >= m) pos = -1;
      }
      g_sh[tid] = pos >= 0 ? global_index(pos, part, n, numel, keys, bits) : -1;
      row_sh[tid] = row;
    }
    __syncthreads();
    // Step 2: the block copies the item's rows.
    switch (ch) {
      case 16: copy_rows<16>(out, val_in, vsz, g_sh, row_sh); break;
      case 8: copy_rows<8>(out, val_in, vsz, g_sh, row_sh); break;
      case 4: copy_rows<4>(out, val_in, vsz, g_sh, row_sh); break;
      case 2: copy_rows<2>(out, val_in, vsz, g_sh, row_sh); break;
      default: copy_rows<1>(out, val_in, vsz, g_sh, row_sh); break;
    }
    __syncthreads();
  }
}

void decode_pull_cuda(const at::Tensor& out, const at::Tensor& msg, int64_t part, int64_t num_parts,
                      const at::Tensor& keys, int64_t idx_bytes) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() >= 1 && out.dim() <= 2,
              "decode_pull_: out must be a contiguous 1-D or 2-D CUDA tensor");
  TORCH_CHECK(msg.is_cuda() && msg.scalar_type() == at::kByte && msg.dim() == 1 && msg.is_contiguous(),
              "decode_pull_: msg must be a contiguous 1-D uint8 CUDA tensor");
  TORCH_CHECK(num_parts >= 1 && part >= 0 && part < num_parts, "decode_pull_: part must be in [0, num_parts)");
  TORCH_CHECK(idx_bytes == 4 || idx_bytes == 8, "decode_pull_: idx_bytes must be 4 or 8");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.numel() == kNumRounds, "decode_pull_: keys must be int64[4]");
  const int64_t nbytes = msg.numel();
  if (nbytes == 0) return;
  TORCH_CHECK(nbytes >= kHeaderBytes, "decode_pull_: message of ", nbytes, " bytes has no header");
  TORCH_CHECK(msg.device() == out.device(), "decode_pull_: msg (", msg.device(), ") must be on out's device (",
              out.device(), ")");
  TORCH_CHECK(uint64_t(out.size(0)) <= kMaxNumel, "decode_pull_: numel must be <= 2^62, got ", out.size(0));
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t numel = out.size(0), width = out.dim() == 2 ? out.size(1) : 1;
  const int64_t m = part_size(numel, part, num_parts), nw = num_words(m);
  auto keys_R = keys.to(out.device()).contiguous();  // no copy when zen.py passes device keys (cached)
  auto pc = at::empty({std::max<int64_t>(nw, 1)}, msg.options().dtype(at::kLong));
  if (nw) {
    msg_word_popcount_kernel<<<blocks_for(nw), kThreads, 0, stream>>>(msg.data_ptr<uint8_t>(), nbytes, nw,
                                                                       pc.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    pc = at::cumsum(pc, 0);
  }
  const int64_t vsz = out.element_size() * width;
  if (vsz > kRowKernelBytes) {  // rows: a block per 64 slots (at most one item per 64 rows, any format)
    const int64_t items = std::max<int64_t>(num_words(m), 1);
    decode_rows_kernel<<<static_cast<unsigned>(std::min<int64_t>(items, 1 << 16)), kThreads, 0, stream>>>(
        reinterpret_cast<uint8_t*>(out.data_ptr()), vsz, msg.data_ptr<uint8_t>(), nbytes, pc.data_ptr<int64_t>(), part,
        num_parts, uint64_t(numel), m, keys_R.data_ptr<int64_t>(), domain_bits(uint64_t(numel)), idx_bytes);
  } else {
    decode_kernel<<<blocks_for(std::max<int64_t>(m, 1)), kThreads, 0, stream>>>(
        reinterpret_cast<uint8_t*>(out.data_ptr()), vsz, msg.data_ptr<uint8_t>(), nbytes, pc.data_ptr<int64_t>(),
        part, num_parts, uint64_t(numel), m, keys_R.data_ptr<int64_t>(), domain_bits(uint64_t(numel)), idx_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) {
  m.impl("aggregate_push", &aggregate_push_cuda);
  m.impl("encode_pull", &encode_pull_cuda);
  m.impl("decode_pull_", &decode_pull_cuda);
}

}  // namespace zen_ext
