// CUDA kernels of DGC's 4-bit residual (zen_ext::dgc_int4_select, zen_ext::dgc_int4_requantize_), same
// schemas and results as the CPU ops (csrc/cpu/dgc_int4.cpp; layout and arithmetic in csrc/dgc_int4.h).
// No host read, a constant number of launches whatever the number of tensors:
//   select: 1. int4_mark_kernel: per tile of 8 blocks (2048 padded positions), a = Q^-1(e) + v per element
//              (the velocity update where the device flag ok allows), one ballot word per warp and block
//              (bit = candidate) and the tile's count; 2. a cumsum of the counts; 3. int4_compact_kernel:
//              per tile, one thread per word writes its candidates in order, a recomputed from the codes
//              and the updated velocity (a is never stored), then the padding up to the capacity.
//   requantize: int4_requantize_kernel, one thread block per quantization block, two elements (one code
//              byte) a thread: a, the sent elements' error, the block's min and max (a reduction), the
//              new codes and scales, written after every thread has read the old ones.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../dgc_int4.h"
#include "dgc_flat.h"
#include "dgc_select.cuh"

namespace zen_ext {
namespace {

using int4::kBlock;
using int4::kHalf;

using dgc_select::first_past;
constexpr int kThreads = dgc_select::kTileThreads;  // select: one thread per element of a block
static_assert(kThreads == int(kBlock), "dgc_int4_select runs one thread per element of a quantization block");
constexpr int kItems = dgc_select::kTileItems;  // blocks per tile
constexpr int64_t kTile = dgc_select::kTileSize;
constexpr int kWordsPerTile = dgc_select::kTileWords;
constexpr int kPairs = int(kHalf);  // requantize: one thread per code byte
enum Velocity { kGrad = 0, kUpdate = 1, kVelocity = 2 };  // v = g; U <- U*m + g; U as it is

// Block b's tensor: its first element, and b's first element inside the tensor.
struct Where {
  int64_t first, j0, numel;
};
__device__ __forceinline__ Where where_of(const int64_t* ends_T, const int64_t* blocks_T, int64_t T, int64_t b) {
  const int64_t t = first_past(blocks_T, T, b);
  const int64_t first = t ? ends_T[t - 1] : 0, block0 = t ? blocks_T[t - 1] : 0;
  return {first, (b - block0) * kBlock, ends_T[t] - first};
}

template <typename grad_t>
__device__ __forceinline__ float value_at(const uint8_t* codes, const float* scales, float* U, const grad_t* g,
                                          float m, int mode, int64_t b, int64_t k, int64_t i) {
  const float lo = scales[2 * b];
  const float x = int4::dequant(lo, int4::step_of(lo, scales[2 * b + 1]), int4::nibble(codes, b * kBlock + k));
  const float gi = static_cast<float>(g[i]);  // bf16/fp16 widen exactly
  float v = gi;
  if (mode == kUpdate) {
    v = int4::add(int4::mul(U[i], m), gi);
    U[i] = v;
  } else if (mode == kVelocity) {
    v = U[i];
  }
  return int4::add(x, v);
}

template <typename grad_t>
__global__ void int4_mark_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, float* U,
                                 const grad_t* __restrict__ g, float m, int mode, const int64_t* __restrict__ ends_T,
                                 const int64_t* __restrict__ blocks_T, int64_t T, const float* __restrict__ thr,
                                 const int64_t* __restrict__ ends_U, int64_t R, const bool* __restrict__ ok, int64_t NB,
                                 uint32_t* __restrict__ words, int64_t* __restrict__ tile_count) {
  const int64_t tile = blockIdx.x;
  const bool go = ok == nullptr || *ok;
  int count = 0;
  for (int j = 0; j < kItems; ++j) {
    const int64_t b = tile * kItems + j;
    bool hit = false;
    if (go && b < NB) {
      const Where w = where_of(ends_T, blocks_T, T, b);
      const int64_t local = w.j0 + threadIdx.x;
      if (local < w.numel) {
        const int64_t i = w.first + local;
        const float a = value_at(codes, scales, U, g, m, mode, b, threadIdx.x, i);
        const float th = thr[first_past(ends_U, R, i)];
        hit = a >= th || a <= -th;  // NaN: never a candidate
      }
    }
    dgc_select::mark_word(hit, tile, j, words, count);  // of padded positions: ascending words, ascending elements
  }
  dgc_select::store_tile_count(count, tile, tile_count);
}

template <typename grad_t>
__global__ void int4_compact_kernel(const uint32_t* __restrict__ words, const int64_t* __restrict__ tile_end,
                                    const int64_t* __restrict__ tile_count, const uint8_t* __restrict__ codes,
                                    const float* __restrict__ scales, float* U, const grad_t* __restrict__ g,
                                    int mode, const int64_t* __restrict__ ends_T, const int64_t* __restrict__ blocks_T,
                                    int64_t T, const int64_t* __restrict__ ends_U, int64_t R, int64_t N,
                                    int64_t capacity, int64_t* __restrict__ pos, float* __restrict__ val,
                                    int64_t* __restrict__ run) {
  const int64_t tile = blockIdx.x;
  const int w = threadIdx.x;  // blockDim.x == kWordsPerTile == 64: two warps
  uint32_t bits;
  int64_t o = dgc_select::compact_start(words, tile_end, tile_count, N, R, capacity, pos, val, run, bits);
  const int64_t first_pp = tile * kTile + int64_t(w) * 32;
  // The update ran in the mark kernel: read the velocity as it left it.
  const int read_mode = mode == kUpdate ? kVelocity : mode;
  while (bits != 0u && o < capacity) {
    const int bit = __ffs(int(bits)) - 1;
    bits &= bits - 1u;
    const int64_t pp = first_pp + bit;
    const int64_t b = pp / kBlock, k = pp % kBlock;
    const Where wh = where_of(ends_T, blocks_T, T, b);
    const int64_t i = wh.first + wh.j0 + k;
    pos[o] = i;
    val[o] = value_at(codes, scales, U, g, 0.0f, read_mode, b, k, i);
    run[o] = first_past(ends_U, R, i);
    ++o;
  }
}

template <typename grad_t>
__global__ void int4_requantize_kernel(uint8_t* __restrict__ codes, float* __restrict__ scales,
                                       const float* __restrict__ U, const grad_t* __restrict__ g,
                                       const int64_t* __restrict__ ends_T, const int64_t* __restrict__ blocks_T,
                                       int64_t T, const float* __restrict__ thr, const int64_t* __restrict__ ends_U,
                                       int64_t R, int64_t stride, int64_t phase, float top, int64_t seed) {
  __shared__ float warp_lo[kPairs / 32], warp_hi[kPairs / 32];
  const int64_t b = blockIdx.x;
  const Where w = where_of(ends_T, blocks_T, T, b);
  const int64_t len = w.numel - w.j0 < kBlock ? w.numel - w.j0 : kBlock;
  const float lo0 = scales[2 * b], step = int4::step_of(lo0, scales[2 * b + 1]);
  float e[2] = {0.0f, 0.0f};
  float lo = INFINITY, hi = -INFINITY;
  for (int h = 0; h < 2; ++h) {
    const int64_t k = 2 * int64_t(threadIdx.x) + h;
    if (k >= len) continue;
    const int64_t i = w.first + w.j0 + k;
    const float x = int4::dequant(lo0, step, int4::nibble(codes, b * kBlock + k));
    const float a = int4::add(x, U != nullptr ? U[i] : static_cast<float>(g[i]));
    const float th = thr[first_past(ends_U, R, i)];
    const bool sent = a >= th || a <= -th || (stride > 0 && (w.j0 + k) % stride == phase);
    e[h] = sent ? int4::kept_error<grad_t>(a, top) : a;
    lo = fminf(lo, e[h]);
    hi = fmaxf(hi, e[h]);
  }
  for (int d = 16; d > 0; d >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, d));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, d));
  }
  if ((threadIdx.x & 31) == 0) {
    warp_lo[threadIdx.x >> 5] = lo;
    warp_hi[threadIdx.x >> 5] = hi;
  }
  __syncthreads();  // every thread has read its old code byte and the old scales
  lo = warp_lo[0];
  hi = warp_hi[0];
  for (int v = 1; v < kPairs / 32; ++v) {
    lo = fminf(lo, warp_lo[v]);
    hi = fmaxf(hi, warp_hi[v]);
  }
  const float f = int4::factor_of(lo, hi);
  const int64_t k = 2 * int64_t(threadIdx.x);
  const int64_t i = w.first + w.j0 + k;
  const unsigned q0 = k < len ? int4::code_with(e[0], lo, f, i, seed) : 0u;
  const unsigned q1 = k + 1 < len ? int4::code_with(e[1], lo, f, i + 1, seed) : 0u;
  codes[b * kHalf + threadIdx.x] = uint8_t(q0 | (q1 << 4));
  if (threadIdx.x == 0) {
    scales[2 * b] = lo;
    scales[2 * b + 1] = hi;
  }
}

// Host checks shared by both ops (sizes only: the CPU op also checks ends_T/blocks_T against the
// gradients, which here would cost a host read).
int64_t check_int4_cuda(const at::Tensor& codes, const at::Tensor& scales, at::TensorList g_T,
                        const at::Tensor& ends_T, const at::Tensor& blocks_T, const at::Tensor& thr_U,
                        const at::Tensor& ends_U, const c10::optional<at::Tensor>& U_opt, const char* op) {
  TORCH_CHECK(codes.is_cuda() && codes.scalar_type() == at::kByte && codes.dim() == 1 && codes.is_contiguous(), op,
              ": codes must be a contiguous 1-D uint8 CUDA tensor");
  TORCH_CHECK(scales.device() == codes.device() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() * kHalf == codes.numel() * 2,
              op, ": scales must be contiguous float32 [min, max] per block of codes, on codes' device");
  const int64_t T = int64_t(g_T.size());
  TORCH_CHECK(T >= 1 && ends_T.numel() == T && blocks_T.numel() == T && ends_T.scalar_type() == at::kLong &&
                  blocks_T.scalar_type() == at::kLong && ends_T.device() == codes.device() &&
                  blocks_T.device() == codes.device(),
              op, ": one gradient per tensor of ends_T and blocks_T (int64, on codes' device)");
  const auto gdt = g_T[0].scalar_type();
  TORCH_CHECK(gdt == at::kFloat || gdt == at::kBFloat16 || gdt == at::kHalf, op,
              ": gradients of float32, bfloat16 or float16, got ", gdt);
  int64_t N = 0, NB = 0;
  for (const auto& g : g_T) {
    N += g.numel();
    NB += (g.numel() + kBlock - 1) / kBlock;
  }
  TORCH_CHECK(scales.numel() == 2 * NB, op, ": ", NB, " blocks need ", 2 * NB, " scales, got ", scales.numel());
  TORCH_CHECK(thr_U.scalar_type() == at::kFloat && ends_U.scalar_type() == at::kLong && thr_U.dim() == 1 &&
                  thr_U.numel() == ends_U.numel() && thr_U.numel() >= 1 && thr_U.device() == codes.device() &&
                  ends_U.device() == codes.device(),
              op, ": thr_U (float32) and ends_U (int64) must be 1-D of one length >= 1 on codes' device");
  if (U_opt.has_value() && U_opt->defined()) {
    TORCH_CHECK(U_opt->device() == codes.device() && U_opt->is_contiguous() && U_opt->numel() == N &&
                    U_opt->scalar_type() == at::kFloat,
                op, ": U must be a contiguous float32 tensor of ", N, " elements on codes' device");
  }
  return N;
}

template <typename F>
void dispatch_grad(at::ScalarType gdt, F&& f) {
  if (gdt == at::kBFloat16) f(c10::BFloat16());
  else if (gdt == at::kHalf) f(c10::Half());
  else f(float());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dgc_int4_select_cuda(
    const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T,
    double momentum, bool update, const at::Tensor& ends_T, const at::Tensor& blocks_T, const at::Tensor& thr_U,
    const at::Tensor& ends_U, const c10::optional<at::Tensor>& ok_opt, int64_t capacity) {
  const char* op = "dgc_int4_select";
  const int64_t N = check_int4_cuda(codes, scales, g_T, ends_T, blocks_T, thr_U, ends_U, U_opt, op);
  TORCH_CHECK(capacity >= 0, op, ": capacity (", capacity, ") must be >= 0 on CUDA (the count stays on the device)");
  const c10::cuda::CUDAGuard guard(codes.device());
  const bool has_u = U_opt.has_value() && U_opt->defined();
  const bool has_ok = ok_opt.has_value() && ok_opt->defined();
  if (has_ok) {
    TORCH_CHECK(ok_opt->device() == codes.device() && ok_opt->scalar_type() == at::kBool && ok_opt->numel() == 1, op,
                ": ok must be one bool on codes' device");
  }
  const at::Tensor g = dgc::flat_gradient(g_T, scales, N, op);
  const auto thr = thr_U.contiguous(), ends = ends_U.contiguous(), et = ends_T.contiguous(), bt = blocks_T.contiguous();
  const auto ok = has_ok ? ok_opt->contiguous() : at::Tensor();
  const int64_t T = et.numel(), R = ends.numel(), NB = scales.numel() / 2;
  const int mode = has_u ? (update ? kUpdate : kVelocity) : kGrad;
  auto lopt = scales.options().dtype(at::kLong);
  const int64_t tiles = (NB + kItems - 1) / kItems;
  if (tiles == 0) {
    return {at::full({capacity}, N, lopt), at::zeros({capacity}, scales.options()), at::full({capacity}, R, lopt),
            at::zeros({1}, lopt)};
  }
  auto pos = at::empty({capacity}, lopt);
  auto run = at::empty({capacity}, lopt);
  auto val = at::empty({capacity}, scales.options());
  auto words = at::empty({tiles * kWordsPerTile}, scales.options().dtype(at::kInt));
  auto tile_count = at::empty({tiles}, lopt);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  float* up = has_u ? U_opt->data_ptr<float>() : nullptr;
  dispatch_grad(g.scalar_type(), [&](auto grad_tag) {
    using grad_t = decltype(grad_tag);
    int4_mark_kernel<grad_t><<<tiles, kThreads, 0, stream>>>(
        codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), up, g.data_ptr<grad_t>(), float(momentum), mode,
        et.data_ptr<int64_t>(), bt.data_ptr<int64_t>(), T, thr.data_ptr<float>(), ends.data_ptr<int64_t>(), R,
        has_ok ? ok.data_ptr<bool>() : nullptr, NB, reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()),
        tile_count.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  const auto tile_end = tile_count.cumsum(0);
  if (capacity > 0) {
    dispatch_grad(g.scalar_type(), [&](auto grad_tag) {
      using grad_t = decltype(grad_tag);
      int4_compact_kernel<grad_t><<<tiles, kWordsPerTile, 0, stream>>>(
          reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), tile_end.data_ptr<int64_t>(),
          tile_count.data_ptr<int64_t>(), codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), up,
          g.data_ptr<grad_t>(), mode, et.data_ptr<int64_t>(), bt.data_ptr<int64_t>(), T, ends.data_ptr<int64_t>(), R,
          N, capacity, pos.data_ptr<int64_t>(), val.data_ptr<float>(), run.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {pos, val, run, tile_end.narrow(0, tiles - 1, 1)};
}

void dgc_int4_requantize_cuda(const at::Tensor& codes, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& U_opt, at::TensorList g_T, const at::Tensor& ends_T,
                              const at::Tensor& blocks_T, const at::Tensor& thr_U, const at::Tensor& ends_U,
                              int64_t flush_stride, int64_t flush_phase, int64_t seed) {
  const char* op = "dgc_int4_requantize_";
  const int64_t N = check_int4_cuda(codes, scales, g_T, ends_T, blocks_T, thr_U, ends_U, U_opt, op);
  TORCH_CHECK(flush_stride >= 0 && (flush_stride == 0 || (flush_phase >= 0 && flush_phase < flush_stride)), op,
              ": flush_phase (", flush_phase, ") must be in [0, flush_stride (", flush_stride, "))");
  const c10::cuda::CUDAGuard guard(codes.device());
  const int64_t NB = scales.numel() / 2;
  if (NB == 0) return;
  const at::Tensor g = dgc::flat_gradient(g_T, scales, N, op);
  const auto thr = thr_U.contiguous(), ends = ends_U.contiguous(), et = ends_T.contiguous(), bt = blocks_T.contiguous();
  const bool has_u = U_opt.has_value() && U_opt->defined();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_grad(g.scalar_type(), [&](auto grad_tag) {
    using grad_t = decltype(grad_tag);
    int4_requantize_kernel<grad_t><<<NB, kPairs, 0, stream>>>(
        codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), has_u ? U_opt->data_ptr<float>() : nullptr,
        g.data_ptr<grad_t>(), et.data_ptr<int64_t>(), bt.data_ptr<int64_t>(), et.numel(), thr.data_ptr<float>(),
        ends.data_ptr<int64_t>(), ends.numel(), flush_stride, flush_phase,
        float(std::numeric_limits<grad_t>::max()), seed);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CUDA, m) {
  m.impl("dgc_int4_select", &dgc_int4_select_cuda);
  m.impl("dgc_int4_requantize_", &dgc_int4_requantize_cuda);
}

}  // namespace zen_ext
