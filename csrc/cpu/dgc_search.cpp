// CPU kernel of DGC's threshold search (zen_ext::dgc_threshold_search): every refinement pass of every
// selection unit in one op, where the torch path issues about fifty small tensor ops per pass. The
// per-unit logic is csrc/dgc_search.h, shared with the CUDA kernel (csrc/cuda/dgc_search.cu); the
// torch reference in zen_ext/ops/_reference_dgc.py is its oracle (tests/ops/test_dgc_reference.py).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../dgc_search.h"

namespace zen_ext {
namespace {

void check_inputs(const at::Tensor& sorted_S, const at::Tensor& start_U, const at::Tensor& ns_U,
                  const at::Tensor& k_U, const at::Tensor& first_U, const at::Tensor& v_C,
                  const at::Tensor& unit_C, const at::Tensor& t_low_U) {
  const auto U = start_U.numel();
  TORCH_CHECK(sorted_S.dim() == 1 && v_C.dim() == 1 && t_low_U.dim() == 1 && sorted_S.scalar_type() == v_C.scalar_type() &&
                  t_low_U.scalar_type() == v_C.scalar_type(),
              "dgc_threshold_search: sorted_S, v_C and t_low_U must be 1-D of one floating dtype");
  TORCH_CHECK(start_U.scalar_type() == at::kLong && unit_C.scalar_type() == at::kLong && unit_C.numel() == v_C.numel(),
              "dgc_threshold_search: start_U and unit_C must be int64, unit_C as long as v_C");
  TORCH_CHECK(ns_U.scalar_type() == at::kDouble && k_U.scalar_type() == at::kDouble && first_U.scalar_type() == at::kDouble &&
                  ns_U.numel() == U && k_U.numel() == U && first_U.numel() == U && t_low_U.numel() == U,
              "dgc_threshold_search: ns_U, k_U, first_U (float64) and t_low_U must have one entry per unit");
}

std::tuple<at::Tensor, at::Tensor> dgc_threshold_search_cpu(const at::Tensor& sorted_S, const at::Tensor& start_U,
                                                            const at::Tensor& ns_U, const at::Tensor& k_U,
                                                            const at::Tensor& first_U, const at::Tensor& v_C,
                                                            const at::Tensor& unit_C, const at::Tensor& t_low_U,
                                                            int64_t passes) {
  check_inputs(sorted_S, start_U, ns_U, k_U, first_U, v_C, unit_C, t_low_U);
  const auto S = sorted_S.contiguous(), st = start_U.contiguous(), ns = ns_U.contiguous(), kk = k_U.contiguous(),
             fr = first_U.contiguous(), v = v_C.contiguous(), un = unit_C.contiguous(), tl = t_low_U.contiguous();
  const int64_t U = st.numel(), C = v.numel();
  auto thr_U = at::empty({U}, v.options());
  auto keep_C = at::zeros({C}, v.options().dtype(at::kBool));  // padding (no unit) stays false
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, v.scalar_type(), "dgc_threshold_search", [&] {
    const scalar_t* sp = S.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* tlp = tl.data_ptr<scalar_t>();
    const int64_t* stp = st.data_ptr<int64_t>();
    const int64_t* up = un.data_ptr<int64_t>();
    const double *nsp = ns.data_ptr<double>(), *kp = kk.data_ptr<double>(), *fp = fr.data_ptr<double>();
    scalar_t* out = thr_U.data_ptr<scalar_t>();
    bool* keep = keep_C.data_ptr<bool>();
    at::parallel_for(0, U, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        // The unit's candidates: one run of unit_C (ascending).
        const int64_t c0 = dgc::lower_bound(up, C, u), c1 = dgc::lower_bound(up, C, u + 1);
        dgc::Search s;
        s.rank = fp[u];
        s.k = kp[u];
        s.ns = nsp[u];
        double thr = dgc::at_rank(sp, stp[u], s.ns, s.rank);
        const double t_low = static_cast<double>(tlp[u]);
        // A unit in the band keeps its probe: stopping there gives what the blind passes give.
        for (int64_t p = 0; p < passes && !s.done; ++p) {
          const double t_eff = std::max(thr, t_low);
          int64_t count = 0;
          for (int64_t i = c0; i < c1; ++i) count += dgc::abs_of(vp[i]) >= t_eff;
          dgc::update(s, static_cast<double>(count), thr, sp, stp[u]);
        }
        const double t_final = std::max(thr, t_low);
        out[u] = static_cast<scalar_t>(t_final);  // exact: either value came from this dtype
        for (int64_t i = c0; i < c1; ++i) keep[i] = dgc::abs_of(vp[i]) >= t_final;
      }
    });
  });
  return {thr_U, keep_C};
}

}  // namespace

TORCH_LIBRARY_IMPL(zen_ext, CPU, m) { m.impl("dgc_threshold_search", &dgc_threshold_search_cpu); }

}  // namespace zen_ext
