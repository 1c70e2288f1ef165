"""DGC's sampled threshold search (``zen.dgc.threshold: "sampled"``): per selection unit, a threshold
that keeps about ``density`` of it, found from a sample and refined on the candidates only
(``sampled_thresholds``). ``sparsifier.py`` calls it; ``units.py`` holds what is fixed per bucket
layout and the search's constants.

Its fused steps are ``zen_ext.ops`` ops (each its kernel, or its pure-torch reference where the device
has none): the search runs every pass of every unit in one op (``dgc_threshold_search``, logic in
csrc/dgc_search.h); under TP its torch loop all-reduces each pass's counts.

Legend: ``_S`` samples, ``_C`` candidates, ``_K`` selected, ``_U`` selection units.
"""

from __future__ import annotations

import math

import torch

from ... import ops
from .config import DGCConfig
from .units import gather_units, Layout, sort_per_unit, sample_shift

REFINE_PASSES = 4
"""Threshold refinement passes after the sampled estimate (each one count over the candidates)."""
FREE_HOST_READ_DEVICES = ("cpu",)
"""Device types where a host read costs nothing: the search may read its done flags to stop early,
and the candidates are sized exactly (elsewhere they go into a buffer of a capacity known before)."""


def sampled_thresholds(R: torch.Tensor | None, lay: Layout, density: float, tp_comm, tiny: float, cfg: DGCConfig,
                       step: int, pending: tuple | None = None,
                       int4=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per-unit thresholds keeping about ``density`` of each unit, the positions they select and
    the values of ``R`` there (``cfg``: the ``zen.dgc`` section; ``step``: the optimizer step, which
    moves the sample offsets).

    1. Sample: strided positions per unit (offset moves with the step), gathered in one indexing.
    2. Pool over TP (one ``all_gather_v``) and sort the samples per unit (descending).
    3. Candidates: one pass over the bucket selects ``|v| ≥ t_low``, the sample value at
       ``CANDIDATE_FACTOR·k`` of each unit (about twice the target): one ``nonzero``.
    4. Search among the candidates only: counts at any threshold ``≥ t_low`` are exact there, so
       the passes of the search cost ``O(candidates)``, not ``O(bucket)``. A unit whose candidates
       are fewer than the band keeps ``t_low`` (all its candidates).

    5. With ``pending``: the kept candidates compacted in order by ``dgc_gather_kept``, which also
       writes the finiteness flag and both counts; one host read of those three.

    With ``pending = (U, g, finite)`` the velocity update has not run yet: the samples are taken
    from ``R + update`` (the same roundings as the update), and step 3 is
    ``dgc_accumulate_select_``, which applies the update (where the device flag ``finite`` is true)
    and selects the candidates in one pass. Returns None when ``finite`` was false (nothing written).

    With ``int4`` (``int4.Int4Memory``, ``R`` None, ``pending`` required) the residual is 4-bit: the
    samples dequantize it where they read it, and step 3 is ``dgc_int4_select``, which dequantizes it in
    the pass that adds the update; nothing full-size of fp32 is built.
    """
    tp = tp_comm is not None and tp_comm.size > 1
    mem = int4 if int4 is not None else R  # what the search reads: the dtype and device of the values
    # The sampling ops take fp32 memory, and the samples of a TP group are pooled before the sort.
    if pending is not None and not tp and int4 is None and R.dtype == torch.float32:
        sorted_S, t_low, consts, k_U = _fused_samples(R, lay, density, pending, tiny, cfg, step)
    else:
        sorted_S, t_low, consts, k_U = _samples(R, lay, density, pending, tp_comm if tp else None, tiny, cfg, step,
                                                read=int4.gather if int4 is not None else None)
    # Step 3: candidates at t_low, one pass over the bucket.
    if pending is None:
        pos_C, v_C, unit_C = candidates(R, lay, t_low)
    else:  # the op returns the candidates' values and units too: no gather from the bucket
        # Where a host read costs a stall, the candidates go into a buffer of a capacity known
        # before the pass, and their count stays on the device until the read below.
        cap = -1 if mem.device.type in FREE_HOST_READ_DEVICES else lay.candidate_capacity(sum(k_U))
        if int4 is not None:
            pos_C, v_C, unit_C, count_C = int4.select(pending[0], pending[1], cfg.momentum, True, t_low,
                                                      lay.unit_ends_N, pending[2], cap)
        else:
            pos_C, v_C, unit_C, count_C = ops.dgc_accumulate_select_(
                R, pending[0], pending[1], cfg.momentum, t_low.to(R.dtype), lay.unit_ends_N, pending[2], cap)
    # Step 4: search among the candidates.
    thr_U, keep_C = _search(sorted_S, consts, v_C, unit_C, t_low, tp_comm if tp else None, mem)
    # (index_select: 2.5x faster than advanced indexing for 1-D gathers on the CPU)
    if pending is None:
        keep = keep_C.nonzero().flatten()
        return thr_U, pos_C.index_select(0, keep), v_C.index_select(0, keep)
    # Step 5: the bucket's one host read: the finiteness flag, the candidates' and the selection's
    # counts; the op that writes them has compacted the kept candidates already.
    pos_K, v_K, stats = ops.dgc_gather_kept(keep_C, pos_C, v_C, pending[2], count_C)
    ok, n_cand, n_keep = stats.tolist()
    if not ok:
        return None
    if n_cand > pos_C.numel():  # more candidates than the capacity: select them again, exactly
        lay.grow_capacity(n_cand)
        if int4 is not None:  # the update ran: select again from the velocity as it is now
            pos_C, v_C, unit_C, _ = int4.select(pending[0], pending[1], cfg.momentum, False, t_low,
                                                lay.unit_ends_N, None, -1 if mem.device.type in FREE_HOST_READ_DEVICES
                                                else n_cand)
        else:
            pos_C, v_C, unit_C = candidates(R, lay, t_low)
        thr_U, keep_C = _search(sorted_S, consts, v_C, unit_C, t_low, tp_comm if tp else None, mem)
        keep = keep_C.nonzero().flatten()
        return thr_U, pos_C.index_select(0, keep), v_C.index_select(0, keep)
    return thr_U, pos_K[:n_keep], v_K[:n_keep]


def _samples(R: torch.Tensor | None, lay: Layout, density: float, pending, tp_comm, tiny: float, cfg: DGCConfig,
             step: int, read=None):
    """Steps 1-2 of ``sampled_thresholds`` with torch ops, and step 3's lower threshold:
    ``(sorted_S, t_low, consts, k_U)``. ``tp_comm`` pools the samples over a TP group (None: none);
    ``read(pos)`` gives the residual at positions (default ``R.index_select``; the 4-bit residual's
    dequantizing gather)."""
    device = R.device if R is not None else pending[1][0].device
    read = read if read is not None else (lambda pos: R.index_select(0, pos))
    # Step 1: samples, one gather for the whole bucket.
    pos_S, ns_U = lay.sample_positions(density, cfg.sample_fraction, step, device)
    if pending is None:
        samples = torch.nan_to_num(read(pos_S).abs(), nan=0.0)
    else:
        U, g_T = pending[0], pending[1]
        g_S = ops.gather_list(g_T, pos_S)
        delta = g_S if U is None else U.index_select(0, pos_S) * cfg.momentum + g_S
        samples = torch.nan_to_num((read(pos_S) + delta).abs(), nan=0.0)
    numel_U = list(lay.unit_numels)
    # Step 2: pool and sort per unit.
    if tp_comm is not None:
        samples, unit_S, ns_U, numel_U = gather_units(samples, ns_U, numel_U, tp_comm)
    k_U = [max(1, math.ceil(density * n)) for n in numel_U]
    consts = lay.search_constants(ns_U, k_U, numel_U, device)
    sorted_S = sort_per_unit(samples, unit_S if tp_comm is not None else consts.unit_S)
    t_low = sorted_S.index_select(0, consts.low_S).clamp(min=tiny)  # the sample at rank CANDIDATE_FACTOR·first
    return sorted_S, t_low, consts, k_U


def _fused_samples(R: torch.Tensor, lay: Layout, density: float, pending, tiny: float, cfg: DGCConfig, step: int):
    """``_samples`` for fp32 memory with the velocity update pending, without TP, in two ops:
    ``dgc_sample_keys`` (positions, gathers, the update's value, the sort key: about fifteen torch
    ops) and ``dgc_sort_unkey`` (the sort over the keys' used bits, the sorted values and the lower
    threshold: about twelve ops and torch's full 64-bit sort), where on a GPU every torch op is a
    launch. Bit-equal to ``_samples``."""
    grid_S, ns_U, stride_U, unit_S, hash_U = lay.sample_grid(density, cfg.sample_fraction, R.device)
    keys = ops.dgc_sample_keys(R, pending[0], pending[1], cfg.momentum, grid_S, unit_S, hash_U,
                               stride_U, sample_shift(step))
    numel_U = list(lay.unit_numels)
    k_U = [max(1, math.ceil(density * n)) for n in numel_U]
    consts = lay.search_constants(ns_U, k_U, numel_U, R.device)
    sorted_S, t_low = ops.dgc_sort_unkey(keys, consts.low_S, tiny, lay.key_bits)
    return sorted_S, t_low, consts, k_U


def candidates(R: torch.Tensor, lay: Layout, t_low: torch.Tensor):
    """``|R| ≥ t_low`` of each unit: positions (one ``nonzero``), values and units."""
    pos_C = lay.select(R, t_low).view(-1).nonzero().flatten()
    return pos_C, R.index_select(0, pos_C), torch.searchsorted(lay.unit_ends_N, pos_C, right=True)


def _search(sorted_S, consts, v_C, unit_C, t_low, tp_comm, R: torch.Tensor):
    """Step 4 of ``sampled_thresholds``: ``(thr_U, keep_C)``. Without TP one op runs every pass of every
    unit (one kernel on a GPU, where a torch loop issues about fifty small ones per pass); under TP every
    pass's counts are all-reduced, so that every TP rank moves alike. On the CPU reading a flag costs
    nothing: a torch loop stops once every unit is in the band (on a GPU the passes run blind)."""
    return ops.dgc_threshold_search(sorted_S, consts.start_U, consts.ns_U, consts.k_U, consts.first_U, v_C, unit_C,
                                    t_low.to(R.dtype), REFINE_PASSES,
                                    all_reduce=tp_comm.all_reduce if tp_comm is not None else None,
                                    early_stop=R.device.type in FREE_HOST_READ_DEVICES)
