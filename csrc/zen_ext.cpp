// Op schemas of the zen_ext library; kernels live in csrc/cpu and csrc/cuda (one file per device).
#include <Python.h>
#include <torch/library.h>

// An empty Python module: importing zen_ext._C runs the static registrars below and in the kernels.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&def);
}

TORCH_LIBRARY(zen_ext, m) {
  // P(idx) or its inverse: the keyed permutation of [0, numel) behind h0.
  m.def("permute(Tensor idx, int numel, Tensor keys, bool inverse) -> Tensor");
  // Group indices by partition P(idx) % num_parts. Returns (counts, order, pos, stats) where stats =
  // [collisions, serial writes, serial-memory overflows] (Algorithm 1 counters; zeros on the CPU).
  m.def(
      "hash_partition(Tensor idx, int numel, int num_parts, Tensor keys, int num_rehash=3, "
      "float parallel_factor=2.0, float serial_factor=0.1) -> (Tensor, Tensor, Tensor, Tensor)");
  // ZEN's server side (wire format: csrc/pull_format.h): sum the pushed payloads (dense partitions or
  // [positions | rows] pairs) into the compact buffer in one pass. Returns (acc [part_size, width] in
  // fp32 for half types, touched bitmap as int64 words, count = set bits as int64 [1]).
  m.def(
      "aggregate_push(Tensor[] payloads, int part_size, int width, ScalarType dtype, int idx_bytes) -> "
      "(Tensor, Tensor, Tensor)");
  // aggregate_push into caller-owned, reused buffers (zeroed by the op); returns count [1]. CPU only:
  // it spares the page faults of a fresh part_size buffer per call.
  m.def("aggregate_push_into(Tensor(a!) acc, Tensor(b!) words, Tensor[] payloads, int width, ScalarType dtype, "
        "int idx_bytes) -> Tensor");
  // The pull message [format, count | body] of an aggregate, values divided by divisor and cast to dtype.
  m.def(
      "encode_pull(Tensor acc, Tensor words, int count, int fmt, int divisor, ScalarType dtype, int idx_bytes) "
      "-> Tensor");
  // Write server part's pulled message into out (numel rows) at the global indices P^-1(p*n + part).
  m.def("decode_pull_(Tensor(a!) out, Tensor msg, int part, int num_parts, Tensor keys, int idx_bytes) -> ()");
  // zen.dgc.value_bits: every owner's low-bit pull message (msgs[i] from owner i) written into out (1-D, zeroed
  // by the caller): values q * scale / divisor cast to out's dtype at P^-1(p*n + i). One op per bucket.
  m.def("decode_pulls_lowbit_(Tensor(a!) out, Tensor[] msgs, Tensor keys, int idx_bytes, int bits, int block, "
        "int divisor) -> ()");
  // Zero a contiguous tensor with the C library's memset (CPU only): for buffers larger than the cache
  // it writes with streaming stores, without reading the lines first as torch's vectorized fill does.
  m.def("zero_(Tensor(a!) t) -> ()");
  // DGC's velocity update and candidate selection in one pass: U = U*momentum + g (when U is given),
  // R += U (or g), g the concatenation of g_T, only where the flag ok (one bool on R's device) is true
  // or absent; returns the candidates where |R| >= the threshold of the element's run (runs end at
  // ends_U), ascending: int64 positions, R's values there, int64 runs, and their number ([1] int64).
  // capacity >= 0 (required on CUDA, where the number is not read back): outputs of exactly that
  // many entries, the first candidates then padding (position numel, value 0, run = the number of runs).
  m.def("dgc_accumulate_select_(Tensor(a!) R, Tensor(b!)? U, Tensor[] g_T, float momentum, Tensor thr_U, "
        "Tensor ends_U, Tensor? ok=None, int capacity=-1) -> (Tensor, Tensor, Tensor, Tensor)");
  // DGC's sampled threshold search, every refinement pass of every unit in one op: per unit u, the samples
  // sorted_S[start_U[u] : start_U[u] + ns_U[u]] (descending), k_U[u] elements to keep, the first probe's
  // sample rank first_U[u], the lower bound t_low_U[u], and the candidates v_C (R's values; unit_C
  // ascending; entries of unit >= the number of units, padding, belong to none and are not kept). Returns
  // (thr_U, keep_C = |v_C| >= thr_U[unit_C]); logic in csrc/dgc_search.h.
  m.def("dgc_threshold_search(Tensor sorted_S, Tensor start_U, Tensor ns_U, Tensor k_U, Tensor first_U, Tensor v_C, "
        "Tensor unit_C, Tensor t_low_U, int passes) -> (Tensor, Tensor)");
  // The candidates the search keeps (keep_C), compacted in order: (pos_K, v_K, stats). pos_K and v_K are
  // as long as keep_C: the kept entries' positions and values first, then zeros; stats (int64 [3]) is
  // (ok, absent: 1; count_C[0], the candidates' number; the kept entries' number), the values the
  // caller reads back in one copy.
  m.def("dgc_gather_kept(Tensor keep_C, Tensor pos_C, Tensor v_C, Tensor? ok, Tensor count_C) -> (Tensor, Tensor, Tensor)");
  // DGC's samples of one bucket as sort keys, in one op: sample s of unit u = unit_S[s] lies at
  // grid_S[s] + (hash_U[u] + shift) mod stride_U[u]; its value |R + U*momentum + g| (or |R + g| without
  // U; g the concatenation of g_T; NaN as 0, inf as the largest float) as the int64 key
  // u*2^32 + (2^31 - 1 - bits(value)), whose ascending order is by unit, then by value descending. R fp32.
  m.def("dgc_sample_keys(Tensor R, Tensor? U, Tensor[] g_T, float momentum, Tensor grid_S, Tensor unit_S, "
        "Tensor hash_U, Tensor stride_U, int shift) -> Tensor");
  // The keys (in [0, 2^key_bits)) sorted ascending as their float32 values, and max(value at low_U[u],
  // tiny) per unit (indices into the sorted keys).
  m.def("dgc_sort_unkey(Tensor keys, Tensor low_U, float tiny, int key_bits) -> (Tensor, Tensor)");
  // DGC's 4-bit residual (csrc/dgc_int4.h): uint8 codes and float32 [min, max] scales per block of 256
  // elements of each tensor (tensor t ends at element ends_T[t] and block blocks_T[t]; one gradient per
  // tensor). Select: a = Q^-1(e) + v per element, v = U <- U*momentum + g (U given, update), U (given, not
  // update) or g, U written only where ok is true or absent, a never stored; returns the candidates
  // |a| >= thr of the element's run as dgc_accumulate_select_ does (float32 values).
  m.def("dgc_int4_select(Tensor codes, Tensor scales, Tensor(a!)? U, Tensor[] g_T, float momentum, bool update, "
        "Tensor ends_T, Tensor blocks_T, Tensor thr_U, Tensor ends_U, Tensor? ok=None, int capacity=-1) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  // Requantize: a = Q^-1(e) + (U or g); a sent element (|a| >= thr of its run, or j = flush_phase mod
  // flush_stride of its tensor when flush_stride > 0) keeps a - wire(clamp(a)), the rest a; every block is
  // quantized anew between its min and max, in place: rounded to nearest (seed < 0) or stochastically with
  // a hash of (element, seed) as the draw (seed >= 0).
  m.def("dgc_int4_requantize_(Tensor(a!) codes, Tensor(b!) scales, Tensor? U, Tensor[] g_T, Tensor ends_T, "
        "Tensor blocks_T, Tensor thr_U, Tensor ends_U, int flush_stride, int flush_phase, int seed=-1) -> ()");
  // Whether every element of the tensors g_T is finite, as one bool on their device (no host read).
  m.def("dgc_all_finite(Tensor[] g_T) -> Tensor");
  // zen_ext.optim.CatchUpAdamW's step over parameters p_T (in place, with their gradients g_T, moments
  // m_T, v_T of their dtype and float32 ages age_T): step is the global step of the bias corrections;
  // catch_up false takes every gradient, zero or not (AdamW). Logic in csrc/catch_up_adamw.h.
  m.def("catch_up_adamw_(Tensor(a!)[] p_T, Tensor[] g_T, Tensor(b!)[] m_T, Tensor(c!)[] v_T, Tensor(d!)[] age_T, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool catch_up) -> ()");
  // zen.dgc.value_bits: the 1-D float values, cut into segments (seg_ends: cumulative element ends) and each
  // segment into blocks of `block` values, as symmetric codes of `bits` (8: int8; 4: q + 8, two a byte) and one
  // float32 scale amax/qmax per block. Returns (codes uint8, scales float32, the dequantized values float32).
  // Format and rules: zen_ext/ops/_reference_lowbit.py; logic in csrc/lowbit.h.
  m.def("quantize_blocks(Tensor values, int[] seg_ends, int bits, int block) -> (Tensor, Tensor, Tensor)");
  // quantize_blocks' inverse: the float32 values q * scale.
  m.def("dequantize_blocks(Tensor codes, Tensor scales, int[] seg_ends, int bits, int block) -> Tensor");
  // The fused forms (one pass each; oracle zen_ext/ops/_reference_lowbit.py). The sender's: quantize_blocks of
  // values[order], and with residual (float32) residual[res_pos[order]] += x - x̂ (its error feedback);
  // returns what quantize_blocks does.
  m.def("quantize_sent_(Tensor values, Tensor order, Tensor(a!)? residual, Tensor? res_pos, int[] seg_ends, int bits, "
        "int block) -> (Tensor, Tensor, Tensor)");
  // The owner's aggregation: acc[pos[i]] += x̂_i in the order of i (float32), touched[pos[i]] = true.
  m.def("dequantize_add_blocks_(Tensor(a!) acc, Tensor(b!) touched, Tensor pos, Tensor codes, Tensor scales, "
        "int[] seg_ends, int bits, int block) -> ()");
  // The owner's pull: (codes, scales) of s = acc[pos] (+ residual[pos]); residual[pos] = s - applied(x̂) where
  // finite, applied(x̂) = x̂ / divisor cast to applied_dtype and back, times divisor. pos unique.
  m.def("quantize_owned_(Tensor acc, Tensor pos, Tensor(a!)? residual, int[] seg_ends, int bits, int block, "
        "ScalarType applied_dtype, int divisor) -> (Tensor, Tensor)");
  // Values of the concatenation of g_T at int64 positions pos, without the concatenation.
  m.def("gather_list(Tensor[] g_T, Tensor pos) -> Tensor");
}
