// CPU ops of DGC's 4-bit residual (zen_ext::dgc_int4_select, zen_ext::dgc_int4_requantize_; layout and
// arithmetic in csrc/dgc_int4.h). Both walk the residual one block of 256 elements at a time: the block's
// values a = Q^-1(e) + v live in registers or a 1 KiB stack array, never in a bucket-sized buffer.
// Bit-identical to the torch reference (zen_ext/ops/_reference_dgc.py; tests/ops/test_dgc_int4.py).
// zen_ext/compress/dgc/int4.py is the caller.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "../dgc_int4.h"
#include "dgc_select.h"

namespace zen_ext {
namespace {

using int4::kBlock;
using int4::kHalf;

// The residual's tensors: first element, first block and numel of each, checked against the gradients.
struct Tensors {
  std::vector<int64_t> first, block0, numel, block_end;
  int64_t N = 0, NB = 0;
};

Tensors check_int4(const at::Tensor& codes, const at::Tensor& scales, at::TensorList g_T, const at::Tensor& ends_T,
                   const at::Tensor& blocks_T, const char* op) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kByte && codes.dim() == 1 && codes.is_contiguous(),
              op, ": codes must be a contiguous 1-D uint8 CPU tensor");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat && scales.dim() == 1 &&
                  scales.is_contiguous(),
              op, ": scales must be a contiguous 1-D float32 CPU tensor");
  const int64_t T = int64_t(g_T.size());
  TORCH_CHECK(T >= 1 && ends_T.numel() == T && blocks_T.numel() == T && ends_T.scalar_type() == at::kLong &&
                  blocks_T.scalar_type() == at::kLong,
              op, ": one gradient per tensor of ends_T and blocks_T (int64), got ", T, " gradients");
  const auto gdt = g_T[0].scalar_type();
  TORCH_CHECK(gdt == at::kFloat || gdt == at::kBFloat16 || gdt == at::kHalf, op,
              ": gradients of float32, bfloat16 or float16, got ", gdt);
  auto e = ends_T.contiguous();
  auto b = blocks_T.contiguous();
  const int64_t* ep = e.data_ptr<int64_t>();
  const int64_t* bp = b.data_ptr<int64_t>();
  Tensors out;
  for (int64_t t = 0; t < T; ++t) {
    const auto& g = g_T[t];
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.scalar_type() == gdt, op,
                ": every gradient must be a contiguous CPU tensor of ", gdt);
    const int64_t n = g.numel(), nb = (n + kBlock - 1) / kBlock;
    TORCH_CHECK(ep[t] == out.N + n && bp[t] == out.NB + nb, op, ": ends_T/blocks_T do not match the gradients' sizes");
    out.first.push_back(out.N);
    out.block0.push_back(out.NB);
    out.numel.push_back(n);
    out.N += n;
    out.NB += nb;
    out.block_end.push_back(out.NB);
  }
  TORCH_CHECK(codes.numel() == out.NB * kHalf && scales.numel() == 2 * out.NB, op, ": ", out.NB, " blocks need ",
              out.NB * kHalf, " code bytes and ", 2 * out.NB, " scales, got ", codes.numel(), " and ", scales.numel());
  return out;
}

void check_runs(const at::Tensor& thr_U, const at::Tensor& ends_U, int64_t N, const char* op) {
  TORCH_CHECK(thr_U.scalar_type() == at::kFloat && ends_U.scalar_type() == at::kLong && thr_U.dim() == 1 &&
                  ends_U.dim() == 1 && thr_U.numel() == ends_U.numel() && thr_U.numel() >= 1,
              op, ": thr_U (float32) and ends_U (int64) must be 1-D of one length >= 1");
  TORCH_CHECK(ends_U.contiguous().data_ptr<int64_t>()[ends_U.numel() - 1] == N, op, ": ends_U must end at numel (",
              N, ")");
}

// Calls f(block, tensor, first element, elements in the block) for blocks [b_lo, b_hi).
template <typename F>
inline void for_blocks(const Tensors& ts, int64_t b_lo, int64_t b_hi, F&& f) {
  int64_t t = std::upper_bound(ts.block_end.begin(), ts.block_end.end(), b_lo) - ts.block_end.begin();
  for (int64_t b = b_lo; b < b_hi; ++b) {
    while (ts.block_end[size_t(t)] <= b) ++t;
    const int64_t j0 = (b - ts.block0[size_t(t)]) * kBlock;
    f(b, t, j0, std::min(kBlock, ts.numel[size_t(t)] - j0));
  }
}

// a = Q^-1(e) + v per element, v = U <- U*m + g (U, update), U (U, !update) or g; the candidates |a| >= thr
// of the element's run, ascending (chunks of blocks, concatenated in order: any thread count).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dgc_int4_select_cpu(
    const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T,
    double momentum, bool update, const at::Tensor& ends_T, const at::Tensor& blocks_T, const at::Tensor& thr_U,
    const at::Tensor& ends_U, const c10::optional<at::Tensor>& ok_opt, int64_t capacity) {
  const char* op = "dgc_int4_select";
  const Tensors ts = check_int4(codes, scales, g_T, ends_T, blocks_T, op);
  const int64_t N = ts.N;
  check_runs(thr_U, ends_U, N, op);
  const bool has_u = U_opt.has_value() && U_opt->defined();
  if (has_u) {
    TORCH_CHECK(U_opt->device().is_cpu() && U_opt->is_contiguous() && U_opt->numel() == N &&
                    U_opt->scalar_type() == at::kFloat,
                op, ": U must be a contiguous float32 CPU tensor of ", N, " elements");
  }
  dgc_select::check_capacity(capacity, op);
  const bool ok = dgc_select::read_ok(ok_opt, op);
  auto thr = thr_U.contiguous();
  auto ends = ends_U.contiguous();
  const int64_t R = ends.numel();
  const int64_t* rp = ends.data_ptr<int64_t>();
  const float* tp = thr.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* up = has_u ? U_opt->data_ptr<float>() : nullptr;
  const float m = float(momentum);
  constexpr int64_t kChunkBlocks = 256;  // 64 Ki elements a chunk
  const int64_t chunks = ok ? (ts.NB + kChunkBlocks - 1) / kChunkBlocks : 0;
  std::vector<dgc_select::Found<float>> found(size_t(std::max<int64_t>(chunks, 1)));
  auto body = [&](auto grad_tag) {
    using grad_t = decltype(grad_tag);
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        auto& out = found[size_t(c)];
        int64_t u = -1;
        for_blocks(ts, c * kChunkBlocks, std::min(ts.NB, (c + 1) * kChunkBlocks),
                   [&](int64_t b, int64_t t, int64_t j0, int64_t len) {
          const grad_t* gq = g_T[t].data_ptr<grad_t>();
          const float lo = sp[2 * b], step = int4::step_of(lo, sp[2 * b + 1]);
          const int64_t i0 = ts.first[size_t(t)] + j0;
          if (u < 0) u = std::upper_bound(rp, rp + R, i0) - rp;
          for (int64_t k = 0; k < len; ++k) {
            const int64_t i = i0 + k;
            while (rp[u] <= i) ++u;
            const float x = int4::dequant(lo, step, int4::nibble(cp, b * kBlock + k));
            const float gi = static_cast<float>(gq[j0 + k]);
            float v = gi;
            if (up) {
              v = update ? up[i] * m + gi : up[i];  // two roundings (ISO C++: no contraction)
              if (update) up[i] = v;
            }
            const float a = x + v;
            const float th = tp[u];
            if (a >= th || a <= -th) out.add(i, a, u);
          }
        });
      }
    });
  };
  const auto gdt = g_T[0].scalar_type();
  if (gdt == at::kBFloat16) body(c10::BFloat16());
  else if (gdt == at::kHalf) body(c10::Half());
  else body(float());
  // Candidates in chunk order, padded to the capacity (position N, value 0, run R), as the CUDA op writes them.
  return dgc_select::pack(found, capacity, N, R, scales.options());
}

// The step's error feedback, quantized in place: a = Q^-1(e) + (U or g); sent (|a| >= thr of the run, or a
// flushed element j = phase mod stride of its tensor) keeps a - wire(clamp(a)), the rest a; each block then
// gets its new min, max and codes (rounded to nearest where seed < 0, else stochastically: int4::code_with).
// A block's old codes and scales are read before its new ones are written.
void dgc_int4_requantize_cpu(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& U_opt,
                             at::TensorList g_T, const at::Tensor& ends_T, const at::Tensor& blocks_T,
                             const at::Tensor& thr_U, const at::Tensor& ends_U, int64_t flush_stride,
                             int64_t flush_phase, int64_t seed) {
  const char* op = "dgc_int4_requantize_";
  const Tensors ts = check_int4(codes, scales, g_T, ends_T, blocks_T, op);
  check_runs(thr_U, ends_U, ts.N, op);
  TORCH_CHECK(flush_stride >= 0 && (flush_stride == 0 || (flush_phase >= 0 && flush_phase < flush_stride)), op,
              ": flush_phase (", flush_phase, ") must be in [0, flush_stride (", flush_stride, "))");
  const bool has_u = U_opt.has_value() && U_opt->defined();
  if (has_u) {
    TORCH_CHECK(U_opt->device().is_cpu() && U_opt->is_contiguous() && U_opt->numel() == ts.N &&
                    U_opt->scalar_type() == at::kFloat,
                op, ": U must be a contiguous float32 CPU tensor of ", ts.N, " elements");
  }
  auto thr = thr_U.contiguous();
  auto ends = ends_U.contiguous();
  const int64_t R = ends.numel();
  const int64_t* rp = ends.data_ptr<int64_t>();
  const float* tp = thr.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  const float* up = has_u ? U_opt->data_ptr<float>() : nullptr;
  auto body = [&](auto grad_tag) {
    using grad_t = decltype(grad_tag);
    const float top = float(std::numeric_limits<grad_t>::max());
    at::parallel_for(0, ts.NB, 64, [&](int64_t b_lo, int64_t b_hi) {
      float e[kBlock];
      int64_t u = -1;
      for_blocks(ts, b_lo, b_hi, [&](int64_t b, int64_t t, int64_t j0, int64_t len) {
        const grad_t* gq = g_T[t].data_ptr<grad_t>();
        const float lo0 = sp[2 * b], step = int4::step_of(lo0, sp[2 * b + 1]);
        const int64_t i0 = ts.first[size_t(t)] + j0;
        if (u < 0) u = std::upper_bound(rp, rp + R, i0) - rp;
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (int64_t k = 0; k < len; ++k) {
          const int64_t i = i0 + k;
          while (rp[u] <= i) ++u;
          const float x = int4::dequant(lo0, step, int4::nibble(cp, b * kBlock + k));
          const float a = x + (up ? up[i] : static_cast<float>(gq[j0 + k]));
          const float th = tp[u];
          const bool sent = a >= th || a <= -th || (flush_stride > 0 && (j0 + k) % flush_stride == flush_phase);
          const float v = sent ? int4::kept_error<grad_t>(a, top) : a;
          e[k] = v;
          lo = std::min(lo, v);
          hi = std::max(hi, v);
        }
        const float f = int4::factor_of(lo, hi);
        for (int64_t k = 0; k < kBlock; k += 2) {
          const unsigned q0 = k < len ? int4::code_with(e[k], lo, f, i0 + k, seed) : 0u;
          const unsigned q1 = k + 1 < len ? int4::code_with(e[k + 1], lo, f, i0 + k + 1, seed) : 0u;
          cp[b * kHalf + k / 2] = uint8_t(q0 | (q1 << 4));
        }
        sp[2 * b] = lo;
        sp[2 * b + 1] = hi;
      });
    });
  };
  const auto gdt = g_T[0].scalar_type();
  if (gdt == at::kBFloat16) body(c10::BFloat16());
  else if (gdt == at::kHalf) body(c10::Half());
  else body(float());
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("dgc_int4_select", &dgc_int4_select_cpu);
  m.impl("dgc_int4_requantize_", &dgc_int4_requantize_cpu);
}

}  // namespace zen_ext
