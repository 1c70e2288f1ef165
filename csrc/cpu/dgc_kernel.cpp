// CPU kernel of DGC's accumulate-and-select pass (zen_ext::dgc_accumulate_select_): the velocity update
// and the candidate selection of the sampled threshold search in one pass over the bucket, where the
// torch path makes four (add, two compares, nonzero), and the candidates' values with their positions
// (no gather from the bucket afterwards). Bit-identical to that path (zen_ext/compress/dgc/sparsifier.py,
// ``sampled_thresholds`` (zen_ext/compress/dgc/thresholds.py) is its caller; tests/ops/test_dgc_ops.py and
// tests/unit/test_dgc.py hold it to the torch path, tests/ops/test_dgc_reference.py to its reference).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../dgc_dtypes.h"
#include "dgc_select.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace zen_ext {
namespace {

// Global end offset of every tensor of a list of contiguous 1-D CPU tensors of one dtype.
std::vector<int64_t> list_ends(at::TensorList g_T, at::ScalarType dtype, const char* op) {
  std::vector<int64_t> ends;
  int64_t at = 0;
  for (const auto& g : g_T) {
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.scalar_type() == dtype, op,
                ": every gradient must be a contiguous CPU tensor of ", dtype, ", got ", g.scalar_type(), " on ",
                g.device());
    at += g.numel();
    ends.push_back(at);
  }
  return ends;
}

// The candidates one chunk of the pass found: position, value of R there, and its run.
using dgc_select::Found;

// Elements [i, stop) of one run and one gradient: the update and the compare, scalar. Two roundings
// for the momentum (as U.mul_(m) then U.add_(g) make them): the ISO C++ build (-std=c++20) does not
// contract them into a fused multiply-add.
// A bf16/fp16 gradient is widened to the fp32 memory exactly (as torch's mixed-dtype add does).
template <typename scalar_t, typename grad_t>
inline void accumulate_select_scalar(scalar_t* rp, scalar_t* up, const grad_t* gq, scalar_t m, scalar_t th,
                                     int64_t i, int64_t stop, int64_t t, Found<scalar_t>& out) {
  for (; i < stop; ++i) {
    scalar_t r;
    const scalar_t gi = static_cast<scalar_t>(gq[i]);
    if (up) {
      const scalar_t u = up[i] * m + gi;
      up[i] = u;
      r = rp[i] + u;
    } else {
      r = rp[i] + gi;
    }
    rp[i] = r;
    if (r >= th || r <= -th) out.add(i, r, t);
  }
}

#if defined(__SSE2__)
// fp32 with SSE2 (every x86-64 CPU): 16 elements per step, the compares packed into a 16-bit mask
// that is walked with count-trailing-zeros only where it is non-zero. The scalar loop spends ~2.5
// cycles an element on its data-dependent branch (24 ms vs 11 ms for a plain in-place add over 21 M
// elements on this CPU); this one runs at the add's speed (13.6 ms). Same IEEE operations, same order:
// bit-identical to the scalar loop.
inline void accumulate_select_run(float* rp, float* up, const float* gq, float m, float th, int64_t i,
                                  int64_t stop, int64_t t, Found<float>& out) {
  const __m128 hi = _mm_set1_ps(th), lo = _mm_set1_ps(-th), mv = _mm_set1_ps(m);
  for (; i + 16 <= stop; i += 16) {
    unsigned bits = 0;
    for (int k = 0; k < 4; ++k) {
      const int64_t j = i + 4 * k;
      __m128 r;
      if (up) {
        const __m128 u = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(up + j), mv), _mm_loadu_ps(gq + j));
        _mm_storeu_ps(up + j, u);
        r = _mm_add_ps(_mm_loadu_ps(rp + j), u);
      } else {
        r = _mm_add_ps(_mm_loadu_ps(rp + j), _mm_loadu_ps(gq + j));
      }
      _mm_storeu_ps(rp + j, r);
      bits |= unsigned(_mm_movemask_ps(_mm_or_ps(_mm_cmpge_ps(r, hi), _mm_cmple_ps(r, lo)))) << (4 * k);
    }
    while (bits) {
      const int b = __builtin_ctz(bits);
      bits &= bits - 1;
      out.add(i + b, rp[i + b], t);
    }
  }
  accumulate_select_scalar(rp, up, gq, m, th, i, stop, t, out);
}
#endif

template <typename scalar_t, typename grad_t>
inline void accumulate_select_run(scalar_t* rp, scalar_t* up, const grad_t* gq, scalar_t m, scalar_t th,
                                  int64_t i, int64_t stop, int64_t t, Found<scalar_t>& out) {
  accumulate_select_scalar(rp, up, gq, m, th, i, stop, t, out);
}

// R (and U) flat over the bucket; g_T the gradients in bucket order (their concatenation is R's
// length); thr_U one threshold per run of elements, run u covering [ends_U[u-1], ends_U[u]). With U
// defined: U = U·momentum + g, R += U; else R += g. Returns the candidates where |R| >= thr (as
// `R >= t || R <= -t`, the torch path's two compares), ascending: their int64 positions, the values
// of R there (so the caller gathers nothing from the bucket) and the int64 run of each.
//
// ok (optional, one bool): when false nothing is written and there are no candidates (a non-finite
// gradient must leave the memory alone; the CUDA op reads the flag on the device, without a host read).
// capacity >= 0: the outputs hold exactly `capacity` entries, the first min(count, capacity) of the
// candidates and then padding (position numel, value 0, run T: past every run, so the threshold
// search never scans it), as the CUDA op writes them; -1:
// exactly the candidates. The fourth output is the number of candidates ([1] int64), which may exceed
// the capacity (the caller then knows some are missing).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dgc_accumulate_select_cpu(
    const at::Tensor& R, const c10::optional<at::Tensor>& U_opt, at::TensorList g_T, double momentum,
    const at::Tensor& thr_U, const at::Tensor& ends_U, const c10::optional<at::Tensor>& ok_opt, int64_t capacity) {
  const bool has_u = U_opt.has_value() && U_opt->defined();
  TORCH_CHECK(R.device().is_cpu() && R.dim() == 1 && R.is_contiguous(),
              "dgc_accumulate_select_: R must be a contiguous 1-D CPU tensor, got shape ", R.sizes());
  const auto gdt = dgc::check_accumulate_dtypes(R, g_T);
  const auto gends = list_ends(g_T, gdt, "dgc_accumulate_select_");
  const int64_t N = R.numel();
  TORCH_CHECK(!gends.empty() && gends.back() == N, "dgc_accumulate_select_: the gradients hold ",
              gends.empty() ? 0 : gends.back(), " elements, R ", N);
  if (has_u) {
    const auto& U = *U_opt;
    TORCH_CHECK(U.device().is_cpu() && U.is_contiguous() && U.numel() == N && U.scalar_type() == R.scalar_type(),
                "dgc_accumulate_select_: U must be a contiguous CPU tensor like R");
  }
  TORCH_CHECK(thr_U.scalar_type() == R.scalar_type() && ends_U.scalar_type() == at::kLong && thr_U.dim() == 1 &&
                  ends_U.dim() == 1 && thr_U.numel() == ends_U.numel() && thr_U.numel() >= 1,
              "dgc_accumulate_select_: thr_U (R's dtype) and ends_U (int64) must be 1-D of one length >= 1");
  auto thr = thr_U.cpu().contiguous();
  auto ends = ends_U.cpu().contiguous();
  const int64_t T = ends.numel(), G = int64_t(gends.size());
  const int64_t* ep = ends.data_ptr<int64_t>();
  const int64_t* gp_end = gends.data();
  TORCH_CHECK(ep[T - 1] == N, "dgc_accumulate_select_: ends_U must end at numel (", N, "), got ", ep[T - 1]);
  dgc_select::check_capacity(capacity, "dgc_accumulate_select_");
  const bool ok = dgc_select::read_ok(ok_opt, "dgc_accumulate_select_");
  const int64_t chunks_all = (N + (int64_t(1) << 16) - 1) >> 16;
  // Chunks of a fixed size, each collecting its own candidates, concatenated in chunk order: the
  // result is ascending for any thread count.
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t chunks = ok ? chunks_all : 0;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> result;
  auto body = [&](auto scalar_tag, auto grad_tag) {
    using scalar_t = decltype(scalar_tag);
    using grad_t = decltype(grad_tag);
    std::vector<Found<scalar_t>> found(size_t(std::max<int64_t>(chunks, 1)));
    scalar_t* rp = R.data_ptr<scalar_t>();
    scalar_t* up = has_u ? U_opt->data_ptr<scalar_t>() : nullptr;
    const scalar_t* tp = thr.data_ptr<scalar_t>();
    const scalar_t m = scalar_t(momentum);
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t lo = c * kChunk, hi = std::min(N, lo + kChunk);
        auto& out = found[size_t(c)];
        int64_t t = std::upper_bound(ep, ep + T, lo) - ep;            // the run holding element lo
        int64_t q = std::upper_bound(gp_end, gp_end + G, lo) - gp_end;  // the gradient holding it
        int64_t i = lo;
        while (i < hi) {
          while (ep[t] <= i) ++t;
          while (gp_end[q] <= i) ++q;
          const int64_t stop = std::min({hi, ep[t], gp_end[q]});
          // g of element i is gq[i]: the gradient's data shifted by its global start.
          const grad_t* gq = g_T[q].data_ptr<grad_t>() - (gp_end[q] - g_T[q].numel());
          accumulate_select_run(rp, up, gq, m, tp[t], i, stop, t, out);
          i = stop;
        }
      }
    });
    result = dgc_select::pack(found, capacity, N, T, R.options());
  };
  if (R.scalar_type() == at::kDouble) {
    body(double(), double());
  } else if (gdt == at::kBFloat16) {
    body(float(), c10::BFloat16());
  } else if (gdt == at::kHalf) {
    body(float(), c10::Half());
  } else {
    body(float(), float());
  }
  return result;
}

// Values of the concatenation of g_T at the global positions pos (int64, any order).
at::Tensor gather_list_cpu(at::TensorList g_T, const at::Tensor& pos) {
  TORCH_CHECK(!g_T.empty(), "gather_list: needs at least one tensor");
  const auto gends = list_ends(g_T, g_T[0].scalar_type(), "gather_list");
  TORCH_CHECK(pos.device().is_cpu() && pos.scalar_type() == at::kLong && pos.dim() == 1,
              "gather_list: pos must be a 1-D int64 CPU tensor");
  auto p = pos.contiguous();
  const int64_t K = p.numel(), N = gends.back(), G = int64_t(gends.size());
  const int64_t* pp = p.data_ptr<int64_t>();
  auto out = at::empty({K}, g_T[0].options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g_T[0].scalar_type(), "gather_list", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    // Base pointer of each tensor shifted by its global start, so element i of the concatenation is
    // base[q][i]; positions usually come ascending (strided samples): the tensor is found by walking
    // forward, by binary search otherwise.
    std::vector<const scalar_t*> base(static_cast<size_t>(G), nullptr);
    for (int64_t q = 0; q < G; ++q) base[size_t(q)] = g_T[q].data_ptr<scalar_t>() - (gends[q] - g_T[q].numel());
    int64_t q = 0;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t i = pp[j];
      TORCH_CHECK(i >= 0 && i < N, "gather_list: position ", i, " outside [0, ", N, ")");
      if (i >= gends[q] || (q > 0 && i < gends[q - 1])) {
        q = i >= gends[q] && q + 1 < G && i < gends[q + 1] ? q + 1
                                                            : std::upper_bound(gends.data(), gends.data() + G, i) - gends.data();
      }
      op[j] = base[size_t(q)][i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) {
  m.impl("dgc_accumulate_select_", &dgc_accumulate_select_cpu);
  m.impl("gather_list", &gather_list_cpu);
}

}  // namespace zen_ext
