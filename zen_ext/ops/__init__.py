"""Python wrappers of the zen_ext ops (csrc/), falling back to the pure-torch reference.

``HAVE_CPP_OP`` says whether the compiled library loaded. Without it every op still works, only slower:
the reference in ``_reference.py`` (``_reference_dgc.py`` for DGC's ops) is bit-identical and doubles as
the test oracle. ``_has_kernel`` (through ``_dispatch``) is the one place that chooses the compiled kernel
or the reference, per op and device, so callers just call an op; ``_fake.py`` holds the ops' fake (meta)
kernels. A CUDA tensor that
meets a build without the CUDA kernel (CUDA torch wheels ship no nvcc, so ``launch/setup.sh`` builds
the CPU kernels only) takes the reference too, and one ``RuntimeWarning`` per process says so and how
to fix it.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Callable

import torch

from . import _reference, _reference_dgc, _reference_lowbit
from ._reference_dgc import INT4_BLOCK
from ._reference_lowbit import FUSED_LOWBIT_OPS
from .counts import read_aggregate_count, read_aggregate_counts
from .views import concat_view
from ._reference import MAX_NUMEL, NUM_ROUNDS, derive_keys, domain_bits

log = logging.getLogger(__name__)

HAVE_CPP_OP = False
if os.environ.get("ZEN_DISABLE_CPP_OP", "0") != "1":
    try:
        from zen_ext import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrars)

        HAVE_CPP_OP = True
    except ImportError as exc:  # the package stays usable, on the reference path
        log.info("zen_ext C++ op not available (%s); using the pure-torch reference", exc)

__all__ = [
    "HAVE_CPP_OP", "MAX_NUMEL", "NUM_ROUNDS", "derive_keys", "domain_bits", "permute", "hash_partition",
    "aggregate_push", "aggregate_push_into", "read_aggregate_count", "encode_pull", "decode_pull_", "decode_pulls_lowbit_", "has_dgc_select_op", "dgc_accumulate_select_",
    "has_dgc_search_op", "dgc_threshold_search", "has_dgc_gather_kept_op", "dgc_gather_kept", "has_dgc_sample_op", "dgc_sample_keys", "dgc_sort_unkey", "dgc_all_finite",
    "gather_list", "emulate_cuda_layout", "has_dgc_int4_op", "dgc_int4_select", "dgc_int4_requantize_", "dgc_int4_gather",
    "INT4_BLOCK", "force_reference", "catch_up_adamw_", "quantize_blocks", "dequantize_blocks", "has_lowbit_op",
    "quantize_sent_", "dequantize_add_blocks_", "quantize_owned_", "FUSED_LOWBIT_OPS",
]

if HAVE_CPP_OP:
    from . import _fake  # noqa: F401  (shape-only kernels of every op, for FakeTensor and torch.compile)


_warned_reference: set[str] = set()


def _warn_reference(device_type: str, why: str) -> None:
    """Warn once per device type that its tensors take the pure-torch reference, and how to fix it."""
    if device_type in _warned_reference:
        return
    _warned_reference.add(device_type)
    msg = (f"zen_ext: {why}, so the hashing ops run {device_type} tensors through the pure-torch reference "
           f"(same results, much slower). Fix: install the CUDA toolkit matching torch.version.cuda "
           f"({torch.version.cuda}), set CUDA_HOME, and rebuild with ZEN_SETUP_FORCE=1 bash launch/setup.sh "
           f"(or pip install --no-build-isolation -e .); docs/gpu.md has the details.")
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


_KERNELS: dict[tuple[str, str], bool] = {}
_FORCED_REFERENCE: frozenset[str] = frozenset()


class force_reference:
    """Context manager: the named ops take their pure-torch reference on every device, as where no kernel
    is built (benchmarks time an op against its reference in one run; tests run the reference path)."""

    def __init__(self, *names: str) -> None:
        self.names = frozenset(names)

    def __enter__(self):
        global _FORCED_REFERENCE
        self._prev, _FORCED_REFERENCE = _FORCED_REFERENCE, _FORCED_REFERENCE | self.names
        return self

    def __exit__(self, *exc):
        global _FORCED_REFERENCE
        _FORCED_REFERENCE = self._prev
        return False


def _has_kernel(op: str, t: torch.Tensor) -> bool:
    """Whether ``zen_ext::op`` has a kernel for ``t``'s device type: the one place that decides between
    the compiled op and the pure-torch reference. Ops added later may be missing from an older ``_C``,
    and some are CPU-only by design (the caller's device then takes the reference, silently); a CUDA
    tensor that meets a build without any CUDA kernel warns once. Cached per (op, device type)."""
    dev = t.device.type
    if op in _FORCED_REFERENCE:
        return False
    if not HAVE_CPP_OP:
        if dev == "cuda":
            _warn_reference(dev, "the zen_ext C++ op is not built (zen_ext._C failed to import)")
        return False
    key = (op, dev)
    got = _KERNELS.get(key)
    if got is None:
        got = _KERNELS[key] = hasattr(torch.ops.zen_ext, op) and torch._C._dispatch_has_kernel_for_dispatch_key(
            f"zen_ext::{op}", dev.upper())
    if not got and dev == "cuda" and (op == "hash_partition" or not _has_kernel("hash_partition", t)):
        _warn_reference(dev, "zen_ext._C was built without the CUDA kernel (no nvcc at build time)")
    return got


def _dispatch(op: str, t: torch.Tensor, reference):
    """``torch.ops.zen_ext.<op>`` where ``t``'s device has its kernel, else ``reference`` (same results)."""
    return getattr(torch.ops.zen_ext, op) if _has_kernel(op, t) else reference


def permute(idx_K: torch.Tensor, numel: int, keys_R: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Keyed permutation ``P`` of ``[0, numel)`` (``P⁻¹`` with ``inverse``) behind h0."""
    return _dispatch("permute", idx_K, _reference.permute)(idx_K, numel, keys_R, inverse)


def hash_partition(
    idx_K: torch.Tensor,
    numel: int,
    num_parts: int,
    keys_R: torch.Tensor,
    num_rehash: int = 3,
    parallel_factor: float = 2.0,
    serial_factor: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group indices by partition; returns ``(counts_P, order_K, pos_K, stats_3)``.

    On CUDA this is the paper's Algorithm 1 (``num_rehash`` rehash functions, parallel memory of
    ``parallel_factor * K`` slots, serial memory of ``serial_factor`` times that); the order inside a
    partition then follows the hash slots. On the CPU the grouping is a stable counting sort.
    """
    if _has_kernel("hash_partition", idx_K):
        out = torch.ops.zen_ext.hash_partition(
            idx_K, numel, num_parts, keys_R, num_rehash, parallel_factor, serial_factor
        )
    else:  # the reference's stable grouping takes no Algorithm 1 parameters
        out = _reference.hash_partition(idx_K, numel, num_parts, keys_R)
    if _EMULATE_CUDA_LAYOUT and idx_K.device.type == "cpu":
        counts_P, order_K, pos_K, stats = out
        out = (counts_P, *_cuda_partition_order(counts_P, order_K, pos_K), stats)
    return out


# --- the CUDA ops' output conventions, emulated on the CPU ----------------------------------------------
# Where a CUDA op's output differs from the CPU op's in layout or order, the Python side reads it through
# one accessor (``read_aggregate_count``) or must not depend on it (the order inside a partition). Tests
# run the CPU path with the CUDA conventions forced (``emulate_cuda_layout``), so a reader that only
# knows the CPU layout fails in CI, not first on a GPU (as ``auto``'s calibration did, reading the count with ``int()``:
# docs/gpu.md, "What the first GPU run found").
_EMULATE_CUDA_LAYOUT = False


class emulate_cuda_layout:
    """Context manager: CPU ops return their outputs in the CUDA kernels' conventions.

    1. ``aggregate_push``: count as ``[count, outside]`` (CUDA does not raise on a position outside the
       partition; the reader does), and no ``aggregate_push_into`` (CUDA has none).
    2. ``hash_partition``: entries inside each partition in reverse order (CUDA: hash-slot order, not
       the CPU's stable order); counts and the (entry, position) pairs of a partition are unchanged.
    """

    def __enter__(self):
        global _EMULATE_CUDA_LAYOUT
        self._prev, _EMULATE_CUDA_LAYOUT = _EMULATE_CUDA_LAYOUT, True
        return self

    def __exit__(self, *exc):
        global _EMULATE_CUDA_LAYOUT
        _EMULATE_CUDA_LAYOUT = self._prev
        return False


def _cuda_count_layout(count_1: torch.Tensor) -> torch.Tensor:
    """``[count]`` -> ``[count, outside = 0]``, the CUDA op's layout (``read_aggregate_count``)."""
    return torch.cat([count_1.reshape(1), count_1.new_zeros(1)])


def _cuda_partition_order(counts_P: torch.Tensor, order_K: torch.Tensor, pos_K: torch.Tensor):
    """Reverse the entries inside every partition: any order the CUDA hash slots may produce is valid."""
    k = order_K.numel()
    if k < 2:
        return order_K, pos_K
    part_K = torch.repeat_interleave(torch.arange(counts_P.numel(), device=order_K.device), counts_P.to(torch.int64))
    key = part_K * k + (k - 1 - torch.arange(k, device=order_K.device))
    perm = torch.argsort(key)
    return order_K[perm], pos_K[perm]


def aggregate_push(
    payloads: list[torch.Tensor], part_size: int, width: int, dtype: torch.dtype, idx_bytes: int,
    workspace: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ZEN server side: sum pushed uint8 payloads (dense partition, or ``[positions | rows]``) into the
    compact buffer in one pass; returns ``(acc [part_size, width], words, count)``, ``words`` the
    touched bitmap as int64 words (wire format: ``csrc/pull_format.h``). ``count`` is ``[count]`` where
    the op raises on a position outside the partition (CPU, reference) and ``[count, outside]`` on CUDA,
    where raising would cost a host synchronization of its own: read it with ``read_aggregate_count``.

    ``workspace`` returns caller-owned ``(acc, words)`` buffers of those sizes, reused across calls; it
    is called only where the device has the in-place op (the CPU, where it spares the page faults of a
    fresh buffer per call; on CUDA the caching allocator already reuses memory)."""
    if (workspace is not None and payloads and not _EMULATE_CUDA_LAYOUT
            and _has_kernel("aggregate_push_into", payloads[0])):
        acc, words = workspace()
        return acc, words, torch.ops.zen_ext.aggregate_push_into(acc, words, payloads, width, dtype, idx_bytes)
    if payloads and _has_kernel("aggregate_push", payloads[0]):
        acc, words, count = torch.ops.zen_ext.aggregate_push(payloads, part_size, width, dtype, idx_bytes)
    else:
        acc, words, count = _reference.aggregate_push(list(payloads), part_size, width, dtype, idx_bytes)
    if _EMULATE_CUDA_LAYOUT and count.numel() == 1:
        count = _cuda_count_layout(count)
    return acc, words, count


def aggregate_push_into(
    acc: torch.Tensor, words: torch.Tensor, payloads: list[torch.Tensor], width: int, dtype: torch.dtype,
    idx_bytes: int,
) -> torch.Tensor:
    """``aggregate_push`` into caller-owned buffers (``acc [part_size, width]`` of the accumulation dtype,
    ``words`` the bitmap's int64 words), zeroed by the op; returns ``count``. A CPU op; elsewhere
    ``aggregate_push``'s result is copied in (``aggregate_push(workspace=...)`` spares that copy)."""
    if _has_kernel("aggregate_push_into", acc):
        return torch.ops.zen_ext.aggregate_push_into(acc, words, payloads, width, dtype, idx_bytes)
    got_acc, got_words, count = aggregate_push(payloads, acc.shape[0], width, dtype, idx_bytes)
    acc.copy_(got_acc)
    words.copy_(got_words)
    return count


def encode_pull(
    acc: torch.Tensor, words: torch.Tensor, count: int, fmt: int, divisor: int, dtype: torch.dtype, idx_bytes: int
) -> torch.Tensor:
    """The pull message ``[fmt, count | body]`` of an aggregate (values ``/ divisor``, cast to ``dtype``)."""
    return _dispatch("encode_pull", acc, _reference.encode_pull)(acc, words, count, fmt, divisor, dtype, idx_bytes)


def decode_pull_(
    out: torch.Tensor, msg: torch.Tensor, part: int, num_parts: int, keys_R: torch.Tensor, idx_bytes: int
) -> None:
    """Write server ``part``'s pull message into ``out`` (``numel`` rows) at ``P⁻¹(p·n + part)``: bitmap
    words scanned with popcount/ctz, no bool array, no ``nonzero``; the header is read by the op."""
    _dispatch("decode_pull_", out, _reference.decode_pull_)(out, msg, part, num_parts, keys_R, idx_bytes)


def decode_pulls_lowbit_(out: torch.Tensor, msgs: list[torch.Tensor], keys_R: torch.Tensor, idx_bytes: int,
                         bits: int, block: int, divisor: int) -> None:
    """``zen.dgc.value_bits``' pull: every owner's low-bit message (``msgs[i]`` from owner ``i``) written into
    ``out`` (1-D, zeroed by the caller), ``q · scale / divisor`` cast to ``out``'s dtype at ``P⁻¹(p·n + i)``;
    one op per bucket, the headers read by the op. CPU only: elsewhere its oracle composes the device's
    ``permute`` and ``dequantize_blocks`` kernels (``_reference_lowbit.decode_pulls_lowbit_``: one host read)."""
    args = (out, list(msgs), keys_R, int(idx_bytes), int(bits), int(block), int(divisor))
    if _has_kernel("decode_pulls_lowbit_", out):
        torch.ops.zen_ext.decode_pulls_lowbit_(*args)
    else:
        _reference_lowbit.decode_pulls_lowbit_(*args, permute=permute, dequantize=dequantize_blocks)


def zero_(t: torch.Tensor) -> torch.Tensor:
    """``t.zero_()``; on the CPU with the C library's memset, whose streaming stores skip reading the
    old lines (zen's 80 MiB result: 1.2 ms against 4.4 ms for ``torch.zero_`` on one core)."""
    if t.is_contiguous() and _has_kernel("zero_", t):
        torch.ops.zen_ext.zero_(t)
        return t
    return t.zero_()


# --- DGC's ops (zen_ext.compress.dgc.thresholds drives them) ---------------------------------------------------
# Each runs its kernel where ``t``'s device has one, else its pure-torch reference (_reference_dgc.py, bit for
# bit the same): callers just call them. The ``has_dgc_*_op`` queries are for tests and benchmarks, which
# compare a kernel with its reference; nothing in zen_ext outside ops/ asks them.
def has_dgc_select_op(t: torch.Tensor) -> bool:
    """Whether ``dgc_accumulate_select_`` and ``dgc_gather_kept`` have kernels for ``t``'s device (tests)."""
    return _has_kernel("dgc_accumulate_select_", t) and _has_kernel("dgc_gather_kept", t)


def dgc_accumulate_select_(
    R: torch.Tensor, U: torch.Tensor | None, g_T: list[torch.Tensor], momentum: float, thr_U: torch.Tensor,
    ends_U: torch.Tensor, ok: torch.Tensor | None = None, capacity: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DGC's velocity update and candidate selection in one pass over the bucket.

    ``U = U·momentum + g`` (when ``U`` is given), ``R += U`` (or ``g``), ``g`` the concatenation of the
    contiguous gradients ``g_T`` (never built), only where ``ok`` (one bool on ``R``'s device) is true
    or absent; then the candidates where ``|R| ≥ thr`` of the element's run (runs end at ``ends_U``),
    ascending: ``(positions int64, R's values there, runs int64, count [1] int64)``, so the caller
    gathers nothing from the bucket. With ``capacity ≥ 0`` (required on CUDA, where nothing is read
    back) the first three hold exactly ``capacity`` entries: the first candidates, then padding
    (position ``numel``, value 0, run ``len(ends_U)``: past every run, so the threshold search never
    scans it); ``count`` may exceed ``capacity`` (some candidates are
    then missing). With ``ok`` false nothing is written and ``count`` is 0. Memory of fp32 or fp64,
    gradients of its dtype or bf16/fp16 with fp32 memory (csrc/dgc_dtypes.h).
    """
    return _dispatch("dgc_accumulate_select_", R, _reference_dgc.dgc_accumulate_select_)(
        R, U, g_T, momentum, thr_U, ends_U, ok, int(capacity))


def has_dgc_search_op(t: torch.Tensor) -> bool:
    """Whether ``dgc_threshold_search`` has a kernel for ``t``'s device (tests and benchmarks)."""
    return _has_kernel("dgc_threshold_search", t)


def dgc_threshold_search(
    sorted_S: torch.Tensor, start_U: torch.Tensor, ns_U: torch.Tensor, k_U: torch.Tensor, first_U: torch.Tensor,
    v_C: torch.Tensor, unit_C: torch.Tensor, t_low_U: torch.Tensor, passes: int, *,
    all_reduce: Callable[[torch.Tensor], object] | None = None, early_stop: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DGC's sampled threshold search, every pass of every unit in one op (one kernel on a GPU).

    Per unit ``u``: samples ``sorted_S[start_U[u]:][:ns_U[u]]`` sorted descending, ``k_U[u]`` elements
    to keep, first probe at sample rank ``first_U[u]`` (``ns_U``, ``k_U``, ``first_U`` float64), lower
    bound ``t_low_U[u]``; candidates ``v_C`` (signed values) with ascending units ``unit_C``. Returns
    ``(thr_U, keep_C)``: each unit's threshold after ``passes`` refinements and ``|v_C| ≥ thr_U[unit_C]``.
    Candidates of unit ``≥ U`` (a capacity-sized buffer's padding) belong to no unit: never kept.

    ``all_reduce`` sums each pass's int64 counts in place over a group (tensor parallelism: every rank
    then moves alike); the kernel cannot call out between passes, so the torch loop runs then.
    ``early_stop`` lets the torch loop stop once every unit is in the band (a host read per pass: only
    where reading costs nothing); the results are the same.
    """
    if all_reduce is None and _has_kernel("dgc_threshold_search", sorted_S):
        return torch.ops.zen_ext.dgc_threshold_search(sorted_S, start_U, ns_U, k_U, first_U, v_C, unit_C, t_low_U,
                                                      int(passes))
    return _reference_dgc.dgc_threshold_search(sorted_S, start_U, ns_U, k_U, first_U, v_C, unit_C, t_low_U,
                                               int(passes), all_reduce=all_reduce, early_stop=early_stop)


def has_dgc_gather_kept_op(t: torch.Tensor) -> bool:
    """Whether ``dgc_gather_kept`` has a kernel for ``t``'s device (tests)."""
    return _has_kernel("dgc_gather_kept", t)


def dgc_gather_kept(
    keep_C: torch.Tensor, pos_C: torch.Tensor, v_C: torch.Tensor, ok: torch.Tensor | None, count_C: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidates ``dgc_threshold_search`` keeps, compacted in order, and the bucket's read-back
    values, in one op (two kernels on a GPU, nothing read back).

    Returns ``(pos_K, v_K, stats)``: ``pos_K`` and ``v_K`` as long as ``keep_C``, the kept entries'
    ``pos_C`` and ``v_C`` first (ascending), then zeros; ``stats`` int64 ``[ok (1 when absent),
    count_C[0], kept]``, the three values the caller reads with one copy (then it slices the first
    ``kept`` entries: the same layout on every device).
    """
    return _dispatch("dgc_gather_kept", keep_C, _reference_dgc.dgc_gather_kept)(keep_C, pos_C, v_C, ok, count_C)


def has_dgc_sample_op(t: torch.Tensor) -> bool:
    """Whether ``dgc_sample_keys``, ``dgc_sort_unkey`` and ``dgc_all_finite`` have kernels for ``t``'s
    device (tests)."""
    return all(_has_kernel(op, t) for op in ("dgc_sample_keys", "dgc_sort_unkey", "dgc_all_finite"))


def dgc_sample_keys(
    R: torch.Tensor, U: torch.Tensor | None, g_T: list[torch.Tensor], momentum: float, grid_S: torch.Tensor,
    unit_S: torch.Tensor, hash_U: torch.Tensor, stride_U: torch.Tensor, shift: int,
) -> torch.Tensor:
    """DGC's samples of one bucket (fp32 memory ``R``) as int64 sort keys, in one op (one kernel on a GPU).

    Sample ``s`` of unit ``u = unit_S[s]`` lies at ``grid_S[s] + (hash_U[u] + shift) mod stride_U[u]``;
    its value is ``|R + U·momentum + g|`` there (``|R + g|`` without ``U``; ``g`` the concatenation of
    ``g_T``, never built; NaN as 0, inf as the largest float), the value the pending velocity update
    would give, and its key ``u·2³² + (2³¹ − 1 − bits(value))``: ascending keys are ascending units and
    descending values.
    """
    return _dispatch("dgc_sample_keys", R, _reference_dgc.dgc_sample_keys)(
        R, U, g_T, float(momentum), grid_S, unit_S, hash_U, stride_U, int(shift))


def dgc_sort_unkey(keys: torch.Tensor, low_U: torch.Tensor, tiny: float, key_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dgc_sample_keys``'s keys (in ``[0, 2^key_bits)``) sorted ascending, as their float32 values, and
    ``max(sorted value at low_U[u], tiny)`` per unit (the candidates' lower threshold), in one op (on a
    GPU a radix sort over ``key_bits`` bits only, and one kernel)."""
    return _dispatch("dgc_sort_unkey", keys, _reference_dgc.dgc_sort_unkey)(keys, low_U, float(tiny), int(key_bits))


def dgc_all_finite(g_T: list[torch.Tensor]) -> torch.Tensor:
    """Whether every element of the contiguous tensors ``g_T`` is finite: one bool on their device, in
    one pass (two launches on a GPU whatever the number of tensors; nothing read back)."""
    if not g_T:  # the dispatcher needs a tensor to pick a device
        raise ValueError("dgc_all_finite needs at least one tensor")
    return _dispatch("dgc_all_finite", g_T[0], _reference_dgc.dgc_all_finite)(g_T)


def has_dgc_int4_op(t: torch.Tensor) -> bool:
    """Whether ``dgc_int4_select`` and ``dgc_int4_requantize_`` have kernels for ``t``'s device (tests)."""
    return _has_kernel("dgc_int4_select", t) and _has_kernel("dgc_int4_requantize_", t)


def dgc_int4_select(
    codes: torch.Tensor, scales: torch.Tensor, U: torch.Tensor | None, g_T: list[torch.Tensor], momentum: float,
    update: bool, ends_T: torch.Tensor, blocks_T: torch.Tensor, thr_U: torch.Tensor, ends_U: torch.Tensor,
    ok: torch.Tensor | None = None, capacity: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DGC's candidate selection over a 4-bit residual, the residual dequantized in the pass that adds
    the step's gradient: ``a = Q⁻¹(e) + v`` per element, ``v`` = ``U ← U·momentum + g`` (``U`` given and
    ``update``; written only where ``ok`` is true or absent), ``U`` (given, not ``update``: the velocity
    of this step already) or ``g``; ``a`` is never stored. Returns the candidates ``|a| ≥ thr`` of each
    run as ``dgc_accumulate_select_`` does (fp32 values). The residual: ``INT4_BLOCK``-element blocks per
    tensor (``ends_T``, ``blocks_T``: cumulative elements and blocks; one gradient per tensor), uint8
    ``codes`` (two a byte, low nibble first) and fp32 ``scales`` ``[min, max]`` per block."""
    return _dispatch("dgc_int4_select", codes, _reference_dgc.dgc_int4_select)(
        codes, scales, U, g_T, float(momentum), bool(update), ends_T, blocks_T, thr_U, ends_U, ok, int(capacity))


def dgc_int4_requantize_(
    codes: torch.Tensor, scales: torch.Tensor, U: torch.Tensor | None, g_T: list[torch.Tensor], ends_T: torch.Tensor,
    blocks_T: torch.Tensor, thr_U: torch.Tensor, ends_U: torch.Tensor, flush_stride: int = 0, flush_phase: int = 0,
    seed: int = -1,
) -> None:
    """The step's error feedback into the 4-bit residual, in place, one pass: ``a = Q⁻¹(e) + (U or g)``
    (``U``: this step's velocity, already updated by ``dgc_int4_select``); the sent elements (``|a| ≥ thr``
    of the run, and with ``flush_stride > 0`` each tensor's elements ``≡ flush_phase`` mod the stride)
    keep ``a − wire(clamp(a))``, the others ``a``; each block is then quantized between its min and max:
    ``q = round((x − min)·15/(max − min))`` (``seed < 0``), or stochastically rounded with a hash of
    (element, ``seed``) as the draw. No fp32 copy of the bucket (one block at a time)."""
    _dispatch("dgc_int4_requantize_", codes, _reference_dgc.dgc_int4_requantize_)(
        codes, scales, U, g_T, ends_T, blocks_T, thr_U, ends_U, int(flush_stride), int(flush_phase), int(seed))


def dgc_int4_gather(codes: torch.Tensor, scales: torch.Tensor, ends_T: torch.Tensor, blocks_T: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """The 4-bit residual dequantized at int64 element positions ``pos`` (fp32; a few torch ops: it reads
    the samples and the flushed elements only)."""
    return _reference_dgc.dgc_int4_gather(codes, scales, ends_T, blocks_T, pos)


def has_lowbit_op(t: torch.Tensor) -> bool:  # tests: whether every low-bit op has a kernel for t's device
    return all(_has_kernel(op, t) for op in ("quantize_blocks", "dequantize_blocks", *FUSED_LOWBIT_OPS))


def quantize_blocks(values: torch.Tensor, seg_ends: list[int], bits: int, block: int):
    """``zen.dgc.value_bits``' quantizer: ``values`` cut at the cumulative ``seg_ends`` (host ints), blocks of
    ``block`` in each, as ``(codes, scales, dequantized)``; one launch on a GPU (``_reference_lowbit.py``)."""
    return _dispatch("quantize_blocks", values, _reference_lowbit.quantize_blocks)(
        values, [int(e) for e in seg_ends], int(bits), int(block))


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, seg_ends: list[int], bits: int, block: int):
    """``quantize_blocks``' inverse: the fp32 values ``q · scale`` of every segment."""
    return _dispatch("dequantize_blocks", codes, _reference_lowbit.dequantize_blocks)(
        codes, scales, [int(e) for e in seg_ends], int(bits), int(block))


def quantize_sent_(values, order, residual, res_pos, seg_ends: list[int], bits: int, block: int):
    """The sender's pass: ``quantize_blocks(values[order])``, with ``residual`` its error feedback too."""
    return _dispatch("quantize_sent_", values, _reference_lowbit.quantize_sent_)(
        values, order, residual, res_pos, [int(e) for e in seg_ends], int(bits), int(block))


def dequantize_add_blocks_(acc, touched, pos, codes, scales, seg_ends: list[int], bits: int, block: int) -> None:
    """The owner's aggregation pass: ``acc[pos[i]] += x̂_i`` in order (fp32), ``touched[pos] = True``."""
    _dispatch("dequantize_add_blocks_", acc, _reference_lowbit.dequantize_add_blocks_)(
        acc, touched, pos, codes, scales, [int(e) for e in seg_ends], int(bits), int(block))


def quantize_owned_(acc, pos, residual, seg_ends: list[int], bits: int, block: int, applied_dtype, divisor: int):
    """The owner's pull pass: ``s = acc[pos] (+ residual[pos])`` quantized, the residual updated."""
    return _dispatch("quantize_owned_", acc, _reference_lowbit.quantize_owned_)(
        acc, pos, residual, [int(e) for e in seg_ends], int(bits), int(block), applied_dtype, int(divisor))


def gather_list(g_T: list[torch.Tensor], pos: torch.Tensor) -> torch.Tensor:
    """Values of the concatenation of the contiguous tensors ``g_T`` at int64 positions ``pos`` (the
    C++ op on the CPU; elsewhere one gather from ``concat_view``)."""
    return _dispatch("gather_list", g_T[0], lambda g_T, pos: concat_view(g_T).index_select(0, pos))(g_T, pos)


# --- CatchUpAdamW's step --------------------------------------------------------------------------------------
CATCH_UP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _catch_up_fits(p_T: list[torch.Tensor], g_T: list[torch.Tensor]) -> bool:
    """Whether the compiled ``catch_up_adamw_`` runs these tensors: a kernel for their device, contiguous
    parameters of float32/bf16/fp16 on one device, each gradient contiguous of its parameter's dtype."""
    return bool(p_T) and _has_kernel("catch_up_adamw_", p_T[0]) and all(
        p.is_contiguous() and p.dtype in CATCH_UP_DTYPES and p.device == p_T[0].device
        and g.is_contiguous() and g.dtype == p.dtype for p, g in zip(p_T, g_T))


def catch_up_adamw_(p_T, g_T, m_T, v_T, age_T, *, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, step: int, catch_up: bool) -> None:
    """``zen_ext.optim.CatchUpAdamW``'s step over the tensors: the compiled op (one pass per tensor,
    csrc/catch_up_adamw.h) where it runs them all, else the torch reference per tensor (its oracle)."""
    if _catch_up_fits(p_T, g_T):
        torch.ops.zen_ext.catch_up_adamw_(p_T, g_T, m_T, v_T, age_T, lr, beta1, beta2, eps, weight_decay, step,
                                          catch_up)
        return
    for p, g, m, v, age in zip(p_T, g_T, m_T, v_T, age_T):
        _reference.catch_up_adamw_(p, g, m, v, age, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                   weight_decay=weight_decay, step=step, catch_up=catch_up)
