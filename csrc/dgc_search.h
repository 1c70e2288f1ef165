// DGC's per-unit threshold search (zen_ext::dgc_threshold_search), the logic shared by the CPU op
// (csrc/cpu/dgc_search.cpp) and the CUDA kernel (csrc/cuda/dgc_search.cu). It mirrors, operation for
// operation, ``_Search`` of zen_ext/ops/_reference_dgc.py (the torch reference: tensor parallelism, where
// every pass's counts are all-reduced, and the tests' oracle). Thresholds are carried as doubles, which
// hold every float, bf16 and fp16 value exactly; a new probe is rounded through the memory's dtype as
// the torch path's ``.to(thr.dtype)`` rounds it.
#pragma once
#include <cmath>
#include <cstdint>

#include "hashing.h"  // ZEN_HD

namespace zen_ext {
namespace dgc {

constexpr double kBandLo = 0.8, kBandHi = 1.25;  // REFINE_BAND of zen_ext/ops/_reference_dgc.py

// A product that nvcc must not contract into a fused multiply-add with a neighbouring sum: the CPU
// rounds the product first, and the two devices must compute the same probe.
#ifdef __CUDA_ARCH__
#define ZEN_DMUL_RN(a, b) __dmul_rn((a), (b))
#else
#define ZEN_DMUL_RN(a, b) ((a) * (b))
#endif

// A new probe as a value of the memory's dtype, and no finer than float32 (``_Search.update``
// rounds the same way): in float64 the probe would carry the last-bit differences of ``log`` between
// the CPU's libm and CUDA's into the threshold.
template <typename scalar_t>
ZEN_HD double round_probe(double t) {
  return static_cast<double>(static_cast<scalar_t>(t));
}
template <>
ZEN_HD double round_probe<double>(double t) {
  return static_cast<double>(static_cast<float>(t));
}

// One unit's search state (the torch path's per-unit tensors).
struct Search {
  double rank, k, ns;
  double t_over = 0, c_over = 0, t_under = 0, c_under = 0;
  bool done = false, has_over = false, has_under = false;
};

// The sample at 1-based (fractional) rank of the unit's descending sort (``_reference_dgc.at_rank``).
template <typename scalar_t>
ZEN_HD double at_rank(const scalar_t* sorted, int64_t start, double ns, double rank) {
  double r = ceil(rank) - 1.0;
  r = r < 0.0 ? 0.0 : r;
  r = r < ns - 1.0 ? r : ns - 1.0;
  return static_cast<double>(sorted[start + static_cast<int64_t>(r)]);
}

// Record the count at ``thr`` and move ``thr`` to the next probe (``_Search.update``).
template <typename scalar_t>
ZEN_HD void update(Search& s, double c, double& thr, const scalar_t* sorted, int64_t start) {
  const double k = s.k, t = thr;
  s.done = s.done || (c >= kBandLo * k && c <= kBandHi * k);
  const bool over = c > kBandHi * k && (!s.has_over || t > s.t_over);
  const bool under = c < kBandLo * k && (!s.has_under || t < s.t_under);
  if (over) {
    s.t_over = t;
    s.c_over = c;
  }
  if (under) {
    s.t_under = t;
    s.c_under = c;
  }
  s.has_over = s.has_over || over;
  s.has_under = s.has_under || under;
  // Next probe: a rank step on the sample, or interpolation in (threshold, log count) once bracketed.
  double rank = s.rank * k / (c < 1.0 ? 1.0 : c);
  rank = rank < 1.0 ? 1.0 : rank;
  rank = rank < s.ns ? rank : s.ns;
  const double t_rank = at_rank(sorted, start, s.ns, rank);
  const double log_over = log(s.c_over < 0.5 ? 0.5 : s.c_over);
  const double log_under = log(s.c_under < 0.5 ? 0.5 : s.c_under);
  const double span = log_over - log_under;
  const double w = (log_over - log(k)) / (span < 1e-12 ? 1e-12 : span);
  const double t_interp = s.t_over + ZEN_DMUL_RN(s.t_under - s.t_over, w);
  const double t_next = (s.has_over && s.has_under) ? t_interp : t_rank;
  if (!s.done) {
    s.rank = rank;
    thr = round_probe<scalar_t>(t_next);
  }
}

// The first index of a sorted int64 array holding a value >= v.
ZEN_HD int64_t lower_bound(const int64_t* a, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename scalar_t>
ZEN_HD double abs_of(scalar_t v) {
  const double d = static_cast<double>(v);
  return d < 0.0 ? -d : d;
}

}  // namespace dgc
}  // namespace zen_ext
