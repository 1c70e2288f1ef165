"""A bucket layout's routing (``Plan``: dense ranges, natural slices, DGC slices) and the agreement of
every rank on it before any collective of it (``agree``): every decision that shapes a collective is
compared explicitly, and a rank that differs, or cannot plan the layout, makes every rank raise instead
of hanging. The Synchronizer plans each new layout once.

Legend: ``_K`` selected entries, ``_S`` DGC slices.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..comm.base import Communicator

__all__ = ["GradSlice", "Plan", "agree", "build_plan", "to_bucket"]


@dataclass(frozen=True)
class GradSlice:
    """One parameter's place in a flat bucket."""

    name: str
    """Parameter name: the stable key of all state (never a bucket index)."""
    offset: int
    """Element offset inside the flat bucket."""
    numel: int
    shape: tuple[int, ...]
    """The parameter's shape (rows along dim 0 for embeddings), or the part's shape."""
    start: int = 0
    """Element offset of this slice inside its parameter, when the slice is a part of it (node
    shards, paper §4); 0 for a whole parameter. DGC memory is keyed by ``(name, start)``."""

    @property
    def state_key(self) -> str:
        """The key of this slice's sparsifier memory: the name, plus ``@start`` for a later part."""
        return self.name if self.start == 0 else f"{self.name}@{self.start}"


@dataclass
class Plan:
    """How one bucket layout is routed (cached per layout, agreed across ranks once)."""

    numel: int
    dense_ranges: list[tuple[int, int]]
    natural: list[GradSlice]
    dgc: list[GradSlice]
    dgc_key: str | None
    shift_S: torch.Tensor | None = None  # concat → bucket offset of each DGC slice
    ends_S: torch.Tensor | None = None  # concat end of each DGC slice


def build_plan(numel: int, slices: list[GradSlice], param_kinds: dict[str, str]) -> Plan:
    """Route one bucket layout: dense ranges (dense slices and uncovered elements, merged), natural
    slices, DGC slices (bucket order); raises ValueError naming what is wrong with a slice."""
    ordered = sorted((s for s in slices if s.numel), key=lambda s: s.offset)
    names = set()
    dense_ranges: list[tuple[int, int]] = []
    natural, dgc = [], []

    def add_dense(s: int, e: int) -> None:
        if e <= s:
            return
        if dense_ranges and dense_ranges[-1][1] == s:
            dense_ranges[-1] = (dense_ranges[-1][0], e)
        else:
            dense_ranges.append((s, e))

    at = 0
    for s in ordered:
        if s.name not in param_kinds:
            known = sorted(param_kinds)
            raise ValueError(f"GradSlice name ({s.name!r}) must be in param_kinds "
                             f"({len(known)} names, e.g. {known[:5]})")
        if s.state_key in names:
            raise ValueError(f"GradSlice name ({s.name!r}) must appear once per bucket (per start)")
        names.add(s.state_key)
        if math.prod(s.shape) != s.numel:
            raise ValueError(f"GradSlice {s.name!r} shape ({tuple(s.shape)}) must have numel {s.numel}")
        if s.offset < at:
            raise ValueError(f"GradSlice {s.name!r} (offset {s.offset}) must not overlap the slice "
                             f"before it, which ends at {at}")
        if s.offset + s.numel > numel:
            raise ValueError(f"GradSlice {s.name!r} (offset {s.offset}, numel {s.numel}) must lie inside "
                             f"the bucket of {numel} elements")
        add_dense(at, s.offset)  # elements no slice covers are reduced dense
        kind = param_kinds[s.name]
        if kind == "dense":
            add_dense(s.offset, s.offset + s.numel)
        else:
            (natural if kind == "natural" else dgc).append(s)
        at = s.offset + s.numel
    add_dense(at, numel)
    return Plan(numel, dense_ranges, natural, dgc, f"{dgc[0].name}:dgc" if dgc else None)


def agree(plan: Plan | None, key: tuple, error: ValueError | None, *, dp_comm: Communicator, tp_comm,
          scheme, dgc_config, natural_config, param_kinds: dict[str, str]) -> None:
    """Compare this layout with every rank's; raise on every rank when any rank differs or failed.

    1. Data-parallel ranks gather their layout, kinds, op, scheme and DGC/natural config (or the
       error that stopped this rank from planning) and find the first difference.
    2. Whenever a tensor-parallel group exists (whether or not this bucket has a DGC slice here),
       the TP ranks gather the DGC names of their buckets, the DGC config, and what step 1 found:
       DGC's per-layer threshold exchange runs over the TP group, so a TP rank whose bucket
       routes a parameter differently would otherwise return while its peer waits. Because every
       rank learns step 1's outcome of its TP peers, a failure anywhere in the DP × TP grid reaches
       every rank in these two gathers.
    3. Raise: this rank's own planning error as it is, or RuntimeError naming both ranks' values.

    ``key`` is ``(numel, dtype, op, slice entries)``; the other arguments are the Synchronizer's.

    Raises:
        ValueError: this rank could not plan the layout (``error``).
        RuntimeError: another rank could not plan it, or the ranks disagree.
    """
    numel, dtype, op, entries = key
    # Step 1: the data-parallel group.
    if error is not None:
        mine = {"error": f"{type(error).__name__}: {error}"}
    else:
        mine = {
            "numel": numel, "dtype": dtype, "op": op, "scheme": repr(scheme), "comm": dp_comm.options(),
            "dgc": dataclasses.asdict(dgc_config), "natural": dataclasses.asdict(natural_config),
            "slices": [(*e[:3], param_kinds.get(e[0])) if not e[4]
                       else (*e[:3], e[4], param_kinds.get(e[0])) for e in entries],
        }
    problem = _disagreement(dp_comm, "data-parallel", mine)
    # Step 2: the tensor-parallel group, always when there is one.
    if tp_comm is not None and tp_comm.size > 1:
        tp_mine = {"problem": problem,
                   "dgc_names": None if plan is None else [s.state_key for s in plan.dgc],
                   "dgc": dataclasses.asdict(dgc_config), "comm": tp_comm.options()}
        gathered = tp_comm.all_gather_object(tp_mine)
        if problem is None:
            told = next(((r, t["problem"]) for r, t in enumerate(gathered) if t["problem"] is not None), None)
            if told is not None:
                problem = (f"zen: tensor-parallel rank {told[0]} stopped on this bucket ({told[1]}); every "
                           f"rank stops with it instead of waiting")
            elif error is None:
                problem = _first_difference(gathered, {k: v for k, v in tp_mine.items() if k != "problem"},
                                            "tensor-parallel", tp_comm.rank,
                                            "every TP rank must route each parameter the same way "
                                            "(classify_parameters(..., tp_comm=...)) in the same buckets")
    # Step 3: raise on every rank.
    if error is not None:
        raise error
    if problem is not None:
        raise RuntimeError(problem)


def to_bucket(plan: Plan, idx_K: torch.Tensor) -> torch.Tensor:
    """Map indices over the concatenation of the DGC slices to bucket offsets."""
    if len(plan.dgc) == 1 or not idx_K.numel():
        return idx_K + plan.dgc[0].offset if len(plan.dgc) == 1 else idx_K
    seg = torch.searchsorted(plan.ends_S, idx_K, right=True)
    return idx_K + plan.shift_S[seg]


def _disagreement(comm: Communicator, group: str, mine: dict) -> str | None:
    """Gather ``mine`` over ``comm`` (one object collective); the first problem found, or None.

    A rank whose entry is ``{"error": text}`` could not plan the bucket: every rank reports it.
    """
    if comm.size == 1:
        return None
    gathered = comm.all_gather_object(mine)
    failed = next((r for r, t in enumerate(gathered) if "error" in t), None)
    if failed is not None:
        return (f"zen: {group} rank {failed} could not plan this bucket ({gathered[failed]['error']}); every rank "
                f"stops with it instead of waiting")
    return _first_difference(gathered, mine, group, comm.rank, "every rank must reduce the same buckets with the "
                             "same configuration")


def _first_difference(gathered: list, mine: dict, group: str, my_rank: int, rule: str) -> str | None:
    for r, theirs in enumerate(gathered):
        theirs = {k: v for k, v in theirs.items() if k in mine}
        if theirs == mine:
            continue
        field = next(k for k in mine if theirs.get(k) != mine.get(k))
        a, b = theirs.get(field), mine.get(field)
        if isinstance(a, list) and isinstance(b, list):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            a = a[i] if i < len(a) else f"<{len(a)} entries>"
            b = b[i] if i < len(b) else f"<{len(b)} entries>"
            field = f"{field}[{i}]"
        return (f"zen: {group} ranks disagree on the bucket's {field}: rank {r} has {a!r}, rank {my_rank} has "
                f"{b!r}; {rule}")
    return None
