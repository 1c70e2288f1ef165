"""DGC's selection units: what is fixed per bucket layout (``Layout``: units, blocks, the sample grid,
the search constants, the candidates' capacity), the per-unit sort of samples, and the pooling of
samples over a TP group. ``sparsifier.py`` (``DGCSparsifier``) drives them; the threshold search itself
is ``zen_ext.ops.dgc_threshold_search``.

Legend: ``_N`` elements of one gradient, ``_S`` samples, ``_U`` selection units.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ...core.types import acc_dtype
from ...core.wire import pack, view_as

logger = logging.getLogger("zen_ext.compress.dgc")

CANDIDATE_FACTOR = 2.0
"""Candidates are the values above the sample's ``CANDIDATE_FACTOR·k`` quantile (about twice the
target): the search then moves among them, and only misses the band where the sample
overestimated the unit's quantile by more than that factor."""
CAPACITY_FACTOR = 2.0
"""The candidates' buffer holds ``CAPACITY_FACTOR`` times the ``CANDIDATE_FACTOR·k`` expected (where
the count is not read before the pass); it grows per layout when a pass finds more."""
MIN_KEPT_SAMPLES = 8
"""At least this many samples above the threshold (``8 / density`` samples), or small tensors get
a threshold from one or two values."""


class Layout:
    """What is fixed for one bucket layout: units, blocks, and the index tensors of counting.

    Each unit (a tensor, or the whole bucket with ``per_bucket``) is a contiguous range of the flat
    memory. Viewing the memory as ``[nblk, blk]`` with ``blk = gcd(numels)`` puts every block inside
    one unit, so a per-unit threshold broadcasts over a block row (``[nblk, 1]``, expanded from
    ``[U]`` by ``repeat_interleave``): no per-element threshold tensor. LLM shapes give blocks of
    thousands of elements; a layout with ``gcd == 1`` degrades to one threshold per element.
    """

    def __init__(self, names: tuple[str, ...], numels: tuple[int, ...], per_tensor: bool, device) -> None:
        self.names, self.numels = names, numels
        self.numel = sum(numels)
        self.blk = max(1, math.gcd(*numels)) if self.numel else 1
        self.nblk = self.numel // self.blk
        self.unit_numels = list(numels) if per_tensor else [self.numel]
        self.units = len(self.unit_numels)
        self.unit_of_T = list(range(len(numels))) if per_tensor else [0] * len(numels)
        self.keys = list(names) if per_tensor else [names[0]]  # sampling offsets hash the unit's first name
        bpu = [n // self.blk for n in self.unit_numels]
        self.bpt_T = torch.tensor([n // self.blk for n in numels], dtype=torch.int64, device=device)
        self.bpu_U = torch.tensor(bpu, dtype=torch.int64, device=device)
        ends = np.cumsum(bpu)
        self.ends_U = torch.tensor(ends, dtype=torch.int64, device=device)
        self.starts_U = torch.tensor(ends - np.array(bpu), dtype=torch.int64, device=device)
        self.unit_ends_N = torch.tensor(np.cumsum(self.unit_numels), dtype=torch.int64, device=device)
        # The bits a sample's sort key uses (unit · 2^32 + 31 bits of value): what the radix sort sorts.
        self.key_bits = 32 + max(1, (self.units - 1).bit_length())
        self._sample_grids: dict[tuple, tuple] = {}
        self._search_constants: dict[tuple, _SearchConstants] = {}
        self._tensor_bounds: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capacity_factor = CAPACITY_FACTOR
        self._capacity_k = 1
        self.int4 = None
        """The 4-bit residual's block layout (``int4.Int4Layout``), built on first use."""

    def flush_positions(self, step: int, stride: int, device) -> torch.Tensor:
        """The rotating flush's positions (``zen.dgc.flush_fraction``) in the flat bucket, int64 on
        ``device``: in every tensor its elements ``step % stride``, ``+ stride``, ..., counted from the
        tensor's own start. So a parameter flushes the same elements whatever bucket holds it: DDP
        rebuilds its buckets after the first iteration, so a resumed run's first step sees other buckets
        than the uninterrupted run did. The sizes come from the layout (no host read); the launches do
        not grow with the number of tensors."""
        phase = step % stride
        total = sum(max(0, -(-(n - phase) // stride)) for n in self.numels)
        bounds = self._tensor_bounds.get(str(device))
        if bounds is None:
            numel_T = torch.tensor(self.numels, dtype=torch.int64, device=device)
            bounds = self._tensor_bounds[str(device)] = (numel_T, torch.cumsum(numel_T, 0) - numel_T)
        numel_T, offset_T = bounds
        count_T = torch.clamp_min(torch.div(numel_T - phase + stride - 1, stride, rounding_mode="floor"), 0)
        ends_T = torch.cumsum(count_T, 0)
        i = torch.arange(total, dtype=torch.int64, device=device)
        t = torch.searchsorted(ends_T, i, right=True)  # the tensor of the i-th flushed element
        return offset_T[t] + phase + stride * (i - (ends_T - count_T)[t])

    def candidate_capacity(self, k: int) -> int:
        """Room for the candidates of a bucket keeping ``k`` elements, where their number is not read
        before the pass: ``capacity_factor`` times the ``CANDIDATE_FACTOR·k`` expected, plus a margin
        for small buckets, at most the bucket."""
        self._capacity_k = k
        return min(self.numel, math.ceil(self.capacity_factor * CANDIDATE_FACTOR * k) + 1024)

    def grow_capacity(self, needed: int) -> None:
        """A pass found ``needed`` candidates, more than the capacity: make room for them and more (a
        sample rarely misjudges a unit this much; a layout that keeps doing so pays one extra pass
        until the capacity has grown past it)."""
        k = max(1, self._capacity_k)
        self.capacity_factor = max(2 * self.capacity_factor, 1.5 * needed / (CANDIDATE_FACTOR * k))
        logger.debug("zen: DGC candidates (%d) exceeded the capacity; capacity factor now %.2f", needed,
                  self.capacity_factor)

    def search_constants(self, ns_U: list[int], k_U: list[int], numel_U: list[int], device) -> "_SearchConstants":
        """The threshold search's per-unit device tensors, cached by the unit sizes (the same every
        step at a fixed density): a tensor built from a host list on a GPU is a blocking copy, one host
        synchronization each, and a bucket needs five."""
        key = (tuple(ns_U), tuple(k_U), tuple(numel_U), str(device))
        c = self._search_constants.get(key)
        if c is None:
            if len(self._search_constants) >= 64:  # a density warm-up schedule moves k_U for a while
                self._search_constants.clear()
            f64 = dict(dtype=torch.float64, device=device)
            first = [min(max(1.0, k * ns / n), ns) for k, ns, n in zip(k_U, ns_U, numel_U)]
            c = self._search_constants[key] = _SearchConstants(
                start_U=torch.tensor(np.cumsum([0] + list(ns_U[:-1])), dtype=torch.int64, device=device),
                ns_U=torch.tensor(ns_U, **f64), k_U=torch.tensor(k_U, **f64), first_U=torch.tensor(first, **f64),
                unit_S=torch.from_numpy(np.repeat(np.arange(len(ns_U)), ns_U)).to(device),
                low_S=torch.tensor(_low_index(first, ns_U), dtype=torch.int64, device=device))
        return c

    def select(self, R: torch.Tensor, thr_U: torch.Tensor) -> torch.Tensor:
        """``|R| ≥ thr`` of each element's unit, as a bool ``[nblk, blk]`` (two compares, no abs copy)."""
        t = thr_U.to(R.dtype).repeat_interleave(self.bpu_U, output_size=self.nblk)[:, None]
        Rb = R.view(self.nblk, self.blk)
        mask = Rb >= t
        mask |= Rb <= -t
        return mask

    def count(self, mask: torch.Tensor) -> torch.Tensor:
        """Selected elements per unit (int64 ``[U]``)."""
        cs = torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0))
        return cs[self.ends_U] - cs[self.starts_U]

    def unit_ids(self, device) -> torch.Tensor:
        """The unit of every element (int64 ``[numel]``; built per call, only ``"exact"`` needs it)."""
        return torch.arange(self.units, device=device).repeat_interleave(self.bpu_U * self.blk, output_size=self.numel)

    def sample_grid(self, density: float, fraction: float, device) -> tuple:
        """The per-layout sampling grid on ``device`` (``sample_positions`` adds a step's offsets):
        ``(grid_S, ns_U, stride_U, unit_S, hash_U)``, built once per (density, fraction)."""
        key = (density, fraction, str(device))
        grid = self._sample_grids.get(key)
        if grid is None:
            if len(self._sample_grids) >= 64:  # a density warm-up moves the grid for a while
                self._sample_grids.clear()
            parts, ns_U, strides, base = [], [], [], 0
            for n in self.unit_numels:
                num = min(n, max(math.ceil(fraction * n), math.ceil(MIN_KEPT_SAMPLES / density)))
                stride = 1 if num >= n else n // num
                if stride > 1 and stride % 2 == 0:
                    stride -= 1  # an odd stride walks through every column of a power-of-two-wide matrix
                parts.append(base + stride * np.arange(num, dtype=np.int64))
                ns_U.append(num)
                strides.append(stride)
                base += n
            i64 = dict(dtype=torch.int64, device=device)
            grid = self._sample_grids[key] = (
                torch.from_numpy(np.concatenate(parts)).to(device), ns_U,
                torch.tensor(strides, **i64), torch.from_numpy(np.repeat(np.arange(len(ns_U)), ns_U)).to(device),
                torch.tensor([zlib.crc32(k.encode()) for k in self.keys], **i64))
        return grid

    def sample_positions(self, density: float, fraction: float, step: int, device) -> tuple[torch.Tensor, list[int]]:
        """Strided sample positions of every unit on ``device``, and the count per unit.

        Per unit: ``num = max(fraction·n, MIN_KEPT_SAMPLES/density)`` samples (all when that reaches
        ``n``) at ``offset + j·stride``, the stride odd (no aliasing with power-of-two rows), the
        offset a hash of the unit's first name moved by the step (deterministic, moving). The grid
        ``base + j·stride`` is built once per (density, fraction) and kept on the device; a step only
        adds its offsets there (three small kernels, no host-to-device copy).
        """
        grid = self.sample_grid(density, fraction, device)
        grid_S, ns_U, stride_U, unit_S, hash_U = grid
        # (step · an odd constant) mod 2^31 walks every residue of an odd stride; the hash decorrelates units.
        offset_U = (hash_U + sample_shift(step)).remainder_(stride_U)
        return grid_S + offset_U.index_select(0, unit_S), ns_U


_Layout = Layout
"""The old private name, kept for compress/dgc/sparsifier.py's import until that file (edited by another
change now) imports ``Layout``."""


def sort_per_unit(vals: torch.Tensor, unit_ids: torch.Tensor) -> torch.Tensor:
    """``vals`` (≥ 0) sorted by unit (ascending), descending within each unit.

    Up to fp32, one sort of int64 keys ``unit·2³² + (2³¹ − 1 − bits(v))`` (the bits of a
    non-negative float order like the float), about 20× faster than two stable sorts on this CPU;
    fp64 takes the two stable sorts.
    """
    if vals.dtype in (torch.float32, torch.float16, torch.bfloat16):
        bits = vals.float().view(torch.int32)
        key = (unit_ids.to(torch.int64) << 32) | (0x7FFFFFFF - bits).to(torch.int64)
        # stable=True takes torch's radix sort on the CPU: 1.6x faster than the default for int64 keys
        # (equal keys are equal values, so the order among them does not matter).
        desc = (0x7FFFFFFF - (key.sort(stable=True).values & 0xFFFFFFFF)).to(torch.int32)
        return desc.view(torch.float32).to(vals.dtype)
    v, order = vals.sort(descending=True, stable=True)
    _, by_unit = unit_ids[order].sort(stable=True)
    return v[by_unit]


@dataclass(frozen=True)
class _SearchConstants:
    """Per-unit device tensors of the threshold search (``Layout.search_constants``): first sample of
    each unit, samples, elements to keep and first probe's rank per unit (float64), and the unit of
    every sample."""

    start_U: torch.Tensor
    ns_U: torch.Tensor
    k_U: torch.Tensor
    first_U: torch.Tensor
    unit_S: torch.Tensor
    low_S: torch.Tensor
    """Where each unit's candidate threshold lies in the sorted samples: the sample at rank
    ``first_U·CANDIDATE_FACTOR``, fixed per layout and density, so computed once on the host."""


def sample_shift(step: int) -> int:
    """A step's move of the sampling offsets: (step · an odd constant) mod 2^31 walks every residue of
    an odd stride (the unit's hash decorrelates units)."""
    return (step * 0x9E3779B1) % (1 << 31)


def _low_index(first: list[float], ns_U: list[int]) -> list[int]:
    """The index in the sorted samples of each unit's sample at 1-based rank ``first·CANDIDATE_FACTOR``
    (the candidates' threshold), in float64 on the host with the IEEE operations of csrc/dgc_search.h's
    ``at_rank`` on the device."""
    out, start = [], 0
    for f, ns in zip(first, ns_U):
        out.append(start + int(min(max(math.ceil(f * CANDIDATE_FACTOR) - 1.0, 0.0), ns - 1.0)))
        start += ns
    return out


def gather_units(vals: torch.Tensor, n_U: list[int], numel_U: list[int],
                 tp_comm) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """All-gather every rank's per-unit values (samples, or all values) over the TP group in one message.

    Returns:
        ``(vals, unit ids, values per unit, numel per unit)`` pooled over the TP ranks (rank order).

    Raises:
        RuntimeError: TP ranks disagree on the number of selection units.
    """
    device, dtype = vals.device, vals.dtype
    u = len(n_U)
    header = torch.tensor([u, *numel_U, *n_U], dtype=torch.int64, device=device)
    parts = tp_comm.all_gather_v(pack(header, vals))
    pooled, unit_ids, totals, counts = [], [], [0] * u, [0] * u
    # Two host reads in all, whatever the TP size: every rank's unit count, then every rank's sizes.
    for r, u_r in enumerate(torch.cat([view_as(buf, 0, 1, torch.int64) for buf in parts]).tolist()):
        if u_r != u:
            raise RuntimeError(f"zen.dgc: TP rank {r} has {u_r} selection units but TP rank {tp_comm.rank} "
                               f"has {u}; every TP rank must compress the same parameters in the same buckets")
    metas = torch.cat([view_as(buf, 8, 2 * u, torch.int64) for buf in parts]).view(len(parts), 2 * u).tolist()
    for buf, meta in zip(parts, metas):
        pooled.append(view_as(buf, 8 * (1 + 2 * u), sum(meta[u:]), dtype))
        unit_ids.append(np.repeat(np.arange(u), meta[u:]))
        for j in range(u):
            totals[j] += meta[j]
            counts[j] += meta[u + j]
    ids = torch.from_numpy(np.concatenate(unit_ids)).to(device, non_blocking=True)
    return torch.cat(pooled), ids, counts, totals


def memory_dtype(wire: torch.dtype, residual_dtype: str) -> torch.dtype:
    """The dtype of DGC's residual and momentum for gradients of dtype ``wire`` (``"int4"``: the dtype the
    values are computed in, and the momentum's; ``int4.py`` holds the residual)."""
    if residual_dtype == "bfloat16" and wire in (torch.float32, torch.float16, torch.bfloat16):
        return torch.bfloat16
    return acc_dtype(wire)


def exact_thresholds(R: torch.Tensor, lay: "Layout", density: float, tp_comm) -> torch.Tensor:
    """The ``k``-th largest ``|v|`` of each unit (pooled over the TP group): one segmented sort."""
    vals = R.abs()
    numel_U = list(lay.unit_numels)
    if tp_comm is not None and tp_comm.size > 1:
        vals, unit_N, _, numel_U = gather_units(vals, numel_U, numel_U, tp_comm)
    else:
        unit_N = lay.unit_ids(R.device)
    sorted_N = sort_per_unit(vals, unit_N)
    k_U = [max(1, math.ceil(density * n)) for n in numel_U]
    at = np.cumsum([0] + numel_U[:-1]) + np.array(k_U) - 1
    return sorted_N[torch.from_numpy(at).to(R.device, non_blocking=True)]
