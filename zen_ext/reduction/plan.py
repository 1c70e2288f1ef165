"""A bucket layout's routing (``Plan``: dense ranges, one ``SliceGroup`` per sparsifier kind) and the agreement of
every rank on it before any collective of it (``agree``): every decision that shapes a collective is
compared explicitly, and a rank that differs, or cannot plan the layout, makes every rank raise instead
of hanging. The Synchronizer plans each new layout once.

Legend: ``_K`` selected entries, ``_S`` the slices of a group.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..comm.base import Communicator
from ..compress.registry import DENSE, registered

__all__ = ["GradSlice", "Plan", "SliceGroup", "agree", "build_plan"]


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
class SliceGroup:
    """The slices of one sparsifier kind in a bucket layout, and the facts about them, found once.

    A ``fused`` group is compressed into one SparseGrad over the concatenation of its slices; when
    they tile one range ``[lo, hi)`` of the bucket (the usual layout) the scheme writes straight into
    the output's view of that range.
    """

    kind: str
    slices: list[GradSlice]
    """In bucket order."""
    fused: bool
    key: str
    """The scheme's key of a fused group (``"<first name>:<kind>"``); per-slice keys are ``"<name>:<kind>"``."""
    lo: int = 0
    hi: int = 0
    """The span of the slices (fused groups)."""
    tiled: bool = False
    """No other element lies inside the span (slices do not overlap)."""
    in_order: bool = False
    """Back to back in bucket order: indices over the concatenation already are offsets into the span."""
    shift_S: torch.Tensor | None = None  # concat → bucket offset of each slice (on the bucket's device)
    ends_S: torch.Tensor | None = None  # concat end of each slice

    def index_tensors(self, device: torch.device) -> None:
        """Put ``shift_S`` / ``ends_S`` on ``device`` (once per layout and device)."""
        if self.shift_S is not None and self.shift_S.device == device:
            return
        cat_end, shifts, ends = 0, [], []
        for s in self.slices:
            shifts.append(s.offset - cat_end)
            cat_end += s.numel
            ends.append(cat_end)
        self.shift_S = torch.tensor(shifts, dtype=torch.int64, device=device)
        self.ends_S = torch.tensor(ends, dtype=torch.int64, device=device)


    def to_bucket(self, idx_K: torch.Tensor) -> torch.Tensor:
        """Map indices over the concatenation of the slices to bucket offsets."""
        if len(self.slices) == 1:
            return idx_K + self.slices[0].offset
        if not idx_K.numel():
            return idx_K
        seg = torch.searchsorted(self.ends_S, idx_K, right=True)
        return idx_K + self.shift_S[seg]


@dataclass
class Plan:
    """How one bucket layout is routed (cached per layout, agreed across ranks once)."""

    numel: int
    dense_ranges: list[tuple[int, int]]
    groups: list[SliceGroup]
    """One per sparsifier kind present, in the registry's order."""
    slot: int = 0
    """The layout's ordinal in its Synchronizer, the same on every rank (layouts are agreed, so planned,
    in the same order everywhere): the communicator ``slot`` its scheme calls run in, so their exchanges
    carry their counts in the payload messages from the second step on (comm/base.py)."""

    def group(self, kind: str) -> SliceGroup | None:
        return next((g for g in self.groups if g.kind == kind), None)


def build_plan(numel: int, slices: list[GradSlice], param_kinds: dict[str, str]) -> Plan:
    """Route one bucket layout: dense ranges (dense slices and uncovered elements, merged) and one
    group per sparsifier kind (bucket order inside); raises ValueError naming what is wrong with a slice."""
    ordered = sorted((s for s in slices if s.numel), key=lambda s: s.offset)
    names = set()
    dense_ranges: list[tuple[int, int]] = []
    by_kind: dict[str, list[GradSlice]] = {}

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
        if kind == DENSE:
            add_dense(s.offset, s.offset + s.numel)
        else:
            by_kind.setdefault(kind, []).append(s)
        at = s.offset + s.numel
    add_dense(at, numel)
    groups = []
    for spec in registered():
        group = by_kind.pop(spec.kind, None)
        if group:
            groups.append(_group(spec.kind, group, spec.cls.bucket_mode == "fused"))
    if by_kind:  # the Synchronizer checks param_kinds against the registry first; this is a guard
        raise ValueError(f"param_kinds ({sorted(by_kind)}) must name registered sparsifiers or {DENSE!r}")
    return Plan(numel, dense_ranges, groups)


def _group(kind: str, slices: list[GradSlice], fused: bool) -> SliceGroup:
    lo = min(s.offset for s in slices)
    hi = max(s.offset + s.numel for s in slices)
    return SliceGroup(kind, slices, fused, f"{slices[0].name}:{kind}", lo, hi,
                      tiled=sum(s.numel for s in slices) == hi - lo,
                      in_order=all(a.offset + a.numel == b.offset for a, b in zip(slices, slices[1:])))


def agree(plan: Plan | None, key: tuple, error: ValueError | None, *, dp_comm: Communicator, tp_comm,
          scheme, configs: dict, tp_kinds: tuple[str, ...], param_kinds: dict[str, str]) -> None:
    """Compare this layout with every rank's; raise on every rank when any rank differs or failed.

    1. Data-parallel ranks gather their layout, kinds, op, scheme and every sparsifier's config (or
       the error that stopped this rank from planning) and find the first difference.
    2. Whenever a tensor-parallel group exists (whether or not this bucket has a DGC slice here),
       the TP ranks gather, for each kind that talks over the TP group (``tp_kinds``: DGC), the
       names of its slices and its config, and what step 1 found: DGC's per-layer threshold
       exchange runs over the TP group, so a TP rank whose bucket routes a parameter differently
       would otherwise return while its peer waits. Because every
       rank learns step 1's outcome of its TP peers, a failure anywhere in the DP × TP grid reaches
       every rank in these two gathers.
    3. Raise: this rank's own planning error as it is, or RuntimeError naming both ranks' values.

    ``key`` is ``(numel, dtype, op, slice entries)``; ``configs`` maps each kind to its config
    dataclass; the other arguments are the Synchronizer's.

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
            **{kind: dataclasses.asdict(cfg) for kind, cfg in configs.items()},
            "slices": [(*e[:3], param_kinds.get(e[0])) if not e[4]
                       else (*e[:3], e[4], param_kinds.get(e[0])) for e in entries],
        }
    problem = _disagreement(dp_comm, "data-parallel", mine)
    # Step 2: the tensor-parallel group, always when there is one.
    if tp_comm is not None and tp_comm.size > 1:
        tp_mine = {"problem": problem}
        for kind in tp_kinds:
            group = plan.group(kind) if plan is not None else None
            tp_mine[f"{kind}_names"] = None if plan is None else [s.state_key for s in group.slices] if group else []
            tp_mine[kind] = dataclasses.asdict(configs[kind])
        tp_mine["comm"] = tp_comm.options()
        gathered = tp_comm.all_gather_object(tp_mine)
        if problem is None:
            told = next(((r, t["problem"]) for r, t in enumerate(gathered) if t["problem"] is not None), None)
            if told is not None:
                problem = (f"zen: tensor-parallel rank {told[0]} stopped on this bucket ({told[1]}); every "
                           f"rank stops with it instead of waiting")
            elif error is None:
                problem = _first_difference([{k: v for k, v in t.items() if k != "problem"} for t in gathered],
                                            {k: v for k, v in tp_mine.items() if k != "problem"},
                                            "tensor-parallel", tp_comm.rank,
                                            "every TP rank must route each parameter the same way "
                                            "(classify_parameters(..., tp_comm=...)) in the same buckets")
    # Step 3: raise on every rank.
    if error is not None:
        raise error
    if problem is not None:
        raise RuntimeError(problem)


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
    """The first field in which a rank's entry differs from ``mine``, as an error text (None: all equal).

    Symmetric: a field only one side has (a sparsifier registered on one rank only) is a difference on
    both ranks, so both raise; a comparison over ``mine``'s fields alone would let the other rank wait.
    """
    for r, theirs in enumerate(gathered):
        if theirs == mine:
            continue
        fields = [*mine, *(k for k in theirs if k not in mine)]
        field = next(k for k in fields if theirs.get(k) != mine.get(k))
        a, b = theirs.get(field), mine.get(field)
        if isinstance(a, list) and isinstance(b, list):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            a = a[i] if i < len(a) else f"<{len(a)} entries>"
            b = b[i] if i < len(b) else f"<{len(b)} entries>"
            field = f"{field}[{i}]"
        return (f"zen: {group} ranks disagree on the bucket's {field}: rank {r} has {a!r}, rank {my_rank} has "
                f"{b!r}; {rule}")
    return None
