// CPU kernel of DGC's accumulate-and-select pass (zen_ext::dgc_accumulate_select_): the velocity update
// and the candidate selection of the sampled threshold search in one pass over the bucket, where the
// torch path makes four (add, two compares, nonzero). Bit-identical to that path
// (zen_ext/compress/dgc.py, ``_fused_accumulate_select`` is its caller and its test oracle is the torch path).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <vector>

namespace zen_ext {
namespace {

// R (and U) flat over the bucket; g the gradient over the same elements; thr_T one threshold per run
// of elements, run t covering [ends_T[t-1], ends_T[t]). With U defined: U = U·momentum + g, R += U;
// else R += g. Returns the int64 positions where |R| ≥ thr (as `R >= t || R <= -t`), ascending.
at::Tensor dgc_accumulate_select_cpu(const at::Tensor& R, const c10::optional<at::Tensor>& U_opt,
                                     const at::Tensor& g, double momentum, const at::Tensor& thr_T,
                                     const at::Tensor& ends_T) {
  const bool has_u = U_opt.has_value() && U_opt->defined();
  TORCH_CHECK(R.device().is_cpu() && R.dim() == 1 && R.is_contiguous(),
              "dgc_accumulate_select_: R must be a contiguous 1-D CPU tensor, got shape ", R.sizes());
  TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() && g.numel() == R.numel() && g.scalar_type() == R.scalar_type(),
              "dgc_accumulate_select_: g must be a contiguous CPU tensor of R's ", R.numel(), " ", R.scalar_type(),
              " elements, got ", g.numel(), " ", g.scalar_type());
  if (has_u) {
    const auto& U = *U_opt;
    TORCH_CHECK(U.device().is_cpu() && U.is_contiguous() && U.numel() == R.numel() && U.scalar_type() == R.scalar_type(),
                "dgc_accumulate_select_: U must be a contiguous CPU tensor like R");
  }
  TORCH_CHECK(thr_T.scalar_type() == R.scalar_type() && ends_T.scalar_type() == at::kLong &&
                  thr_T.dim() == 1 && ends_T.dim() == 1 && thr_T.numel() == ends_T.numel() && thr_T.numel() >= 1,
              "dgc_accumulate_select_: thr_T (R's dtype) and ends_T (int64) must be 1-D of one length >= 1");
  auto thr = thr_T.contiguous();
  auto ends = ends_T.contiguous();
  const int64_t T = ends.numel(), N = R.numel();
  const int64_t* ep = ends.data_ptr<int64_t>();
  TORCH_CHECK(ep[T - 1] == N, "dgc_accumulate_select_: ends_T must end at numel (", N, "), got ", ep[T - 1]);
  // Chunks of a fixed size, each collecting its own positions, concatenated in chunk order: the
  // result is ascending for any thread count.
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  std::vector<std::vector<int64_t>> found(size_t(std::max<int64_t>(chunks, 1)));
  AT_DISPATCH_FLOATING_TYPES(R.scalar_type(), "dgc_accumulate_select_", [&] {
    scalar_t* rp = R.data_ptr<scalar_t>();
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* up = has_u ? U_opt->data_ptr<scalar_t>() : nullptr;
    const scalar_t* tp = thr.data_ptr<scalar_t>();
    const scalar_t m = scalar_t(momentum);
    at::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t lo = c * kChunk, hi = std::min(N, lo + kChunk);
        auto& out = found[size_t(c)];
        int64_t t = std::upper_bound(ep, ep + T, lo) - ep;  // the run holding element lo
        int64_t i = lo;
        while (i < hi) {
          const int64_t stop = std::min(hi, ep[t]);
          const scalar_t th = tp[t];
          for (; i < stop; ++i) {
            scalar_t r;
            if (up) {
              // Two roundings, as U.mul_(m) then U.add_(g) make them: the ISO C++ build (-std=c++20)
              // does not contract them into a fused multiply-add.
              const scalar_t u = up[i] * m + gp[i];
              up[i] = u;
              r = rp[i] + u;
            } else {
              r = rp[i] + gp[i];
            }
            rp[i] = r;
            if (r >= th || r <= -th) out.push_back(i);
          }
          ++t;
        }
      }
    });
  });
  int64_t total = 0;
  for (const auto& f : found) total += int64_t(f.size());
  auto pos = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  int64_t* pp = pos.data_ptr<int64_t>();
  for (const auto& f : found) {
    std::copy(f.begin(), f.end(), pp);
    pp += f.size();
  }
  return pos;
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) { m.impl("dgc_accumulate_select_", &dgc_accumulate_select_cpu); }

}  // namespace zen_ext
