// The candidate lists of DGC's CPU selection passes (dgc_accumulate_select_ in csrc/cpu/dgc_kernel.cpp,
// dgc_int4_select in csrc/cpu/dgc_int4.cpp). Each pass walks the bucket in fixed-size chunks, each chunk
// collecting its own candidates; the chunks are then concatenated in chunk order, so the result is
// ascending for any thread count, into outputs of the layout the CUDA ops write. The passes differ in
// what a candidate is (|R| >= thr, or |Q^-1(e) + v| >= thr); what they return is the same, written here once.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace zen_ext {
namespace dgc_select {

// The candidates one chunk of a pass found: position, value there, and its run.
template <typename scalar_t>
struct Found {
  std::vector<int64_t> pos, run;
  std::vector<scalar_t> val;
  void add(int64_t i, scalar_t v, int64_t t) {
    pos.push_back(i);
    val.push_back(v);
    run.push_back(t);
  }
};

// capacity: >= 0 for outputs of exactly that many entries, -1 for exactly the candidates.
inline void check_capacity(int64_t capacity, const char* op) {
  TORCH_CHECK(capacity >= -1, op, ": capacity (", capacity, ") must be >= 0, or -1 for all");
}

// The optional flag ok (one CPU bool): false means the pass writes nothing and finds nothing (a non-finite
// gradient must leave the memory alone; the CUDA ops read the flag on the device, without a host read).
inline bool read_ok(const c10::optional<at::Tensor>& ok_opt, const char* op) {
  if (!ok_opt.has_value() || !ok_opt->defined()) return true;
  TORCH_CHECK(ok_opt->device().is_cpu() && ok_opt->scalar_type() == at::kBool && ok_opt->numel() == 1, op,
              ": ok must be one CPU bool");
  return ok_opt->item<bool>();
}

// The chunks' candidates, concatenated in chunk order, as (positions, values, runs, count). With
// capacity >= 0 the outputs hold exactly `capacity` entries: the first min(count, capacity) candidates and
// then padding (position N, value 0, run T: past every run, so the threshold search never scans it), as the
// CUDA ops write them; with -1 exactly the candidates. count ([1] int64) is the number of candidates, which
// may exceed the capacity (the caller then knows some are missing). Values take val_options (a CPU dtype).
template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pack(const std::vector<Found<scalar_t>>& found,
                                                               int64_t capacity, int64_t N, int64_t T,
                                                               const at::TensorOptions& val_options) {
  int64_t total = 0;
  for (const auto& f : found) total += int64_t(f.pos.size());
  const int64_t size = capacity < 0 ? total : capacity;
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  auto pos = at::full({size}, N, lopt);
  auto run = at::full({size}, T, lopt);
  auto val = at::zeros({size}, val_options);
  int64_t* pp = pos.data_ptr<int64_t>();
  int64_t* rq = run.data_ptr<int64_t>();
  scalar_t* vp = val.data_ptr<scalar_t>();
  int64_t left = size;  // room left in the outputs
  for (const auto& f : found) {
    const int64_t k = std::min<int64_t>(left, int64_t(f.pos.size()));
    std::copy(f.pos.begin(), f.pos.begin() + k, pp);
    std::copy(f.run.begin(), f.run.begin() + k, rq);
    std::copy(f.val.begin(), f.val.begin() + k, vp);
    pp += k;
    rq += k;
    vp += k;
    left -= k;
  }
  return {pos, val, run, at::full({1}, total, lopt)};
}

}  // namespace dgc_select
}  // namespace zen_ext
