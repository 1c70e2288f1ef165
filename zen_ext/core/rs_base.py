"""The ReduceScatterScheme protocol and what every reduce-scatter scheme shares (ranges, signature).

The name → class registry and ``build_reduce_scatter`` are in ``core/reduce_scatter.py``.

A reduce-scatter scheme reduces one flat gradient over ``[0, N)`` across the ranks of a Communicator
and leaves each rank only the reduced values of the contiguous range it owns: ``ranges[r] = (start,
end)`` is rank ``r``'s range, the ranges in rank order tile ``[0, N)`` (uneven or empty ones allowed:
ZeRO's partitions, FSDP2's padded chunks). Lossless schemes equal ``dense`` (the Communicator's
reduce-scatter of the densified inputs) up to float summation order. API contract:
``docs/reduce_scatter.md``.

Cross-rank agreement: the call's numel, dtype, op, ranges and the scheme's options are folded into
the signature word that rides on the call's first collective (``Communicator.signed``); when ranks
differ every rank raises at that collective, then one object all-gather names both ranks' values.

Legend: ``_K`` non-zeros, ``_N`` dense length, ``_R`` this rank's range.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from ..comm.base import Communicator
from .scheme import check_op, check_out, low_bits_error, refuse_accumulated, subclasses_of
from .types import SparseGrad

_SIG_DIGEST_BITS = 50  # the numel field of the signature word (comm/base.py encode_signature)
_DISAGREE = "zen: ranks disagree on the gradient passed to"  # comm/base.py's signature error


def _carriers() -> list[str]:
    """The loaded reduce-scatter classes that carry ``zen.dgc.value_bits`` (for errors)."""
    return list(dict.fromkeys(c.name for c in subclasses_of(ReduceScatterScheme)
                              if c.carries_low_bits and isinstance(getattr(c, "name", None), str)))


class ReduceScatterScheme(abc.ABC):
    """One way to reduce a (sparse) gradient and scatter contiguous ranges of the result to their owners."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True
    takes_accumulated: ClassVar[bool] = False
    """Whether it takes an ``AccumulatedGrad`` (``core/types.py``) and selects from it itself (``spardl``)."""
    carries_low_bits: ClassVar[bool] = False
    """Whether it carries low-bit values (``zen.dgc.value_bits``, ``SparseGrad.lowbit``; ``zen`` does)."""

    def require_low_bits(self, bits: int, carriers: "list[str] | None" = None) -> None:
        """Called when a sharded engine attaches with ``zen.dgc.value_bits`` set: raise unless this scheme
        carries low-bit values (``auto`` narrows its candidates to those that do); ``carriers``: the
        registered reduce-scatters that do, for the error."""
        if not self.carries_low_bits:
            raise ValueError(low_bits_error(bits, repr(self.name), carriers if carriers is not None else _carriers(),
                                            "a reduce-scatter"))

    def reduce_scatter(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, ranges: Sequence[tuple[int, int]], op: str = "sum",
        out: torch.Tensor | None = None, timings: dict | None = None, key: str | None = None,
    ) -> torch.Tensor:
        """Reduce ``grad`` over ``comm``; return this rank's reduced range (``out`` when given).

        1. Validate ``op``, ``ranges`` (one per rank, contiguous, in rank order, tiling ``[0, N)``
           with ``N`` the dense numel), every index inside ``[0, numel)`` and ``out``.
        2. Empty gradient (N = 0): an empty result, no collective.
        3. Run the scheme under this call's signature (numel, dtype, op, ranges, options), checked by
           every rank at the first collective.

        Args:
            comm: the ranks to reduce over.
            grad: this rank's gradient, sparse (element or row form) or dense (any shape, read flat).
            ranges: ``ranges[r] = (start, end)``, rank ``r``'s range of the dense flat gradient.
            op: ``"sum"`` or ``"mean"`` (the sum divided by ``comm.size``).
            out: if given, a contiguous 1-D tensor of ``end − start`` elements of ``grad``'s dtype and
                device that receives the result (and is returned).
            timings: if given, filled with seconds per phase (and the choice of ``auto``).
            key: a stable name of the gradient (``auto`` keeps its decision per key).

        Raises:
            ValueError: bad ``op``, ``ranges``, index or ``out``.
            RuntimeError: ranks passed different numel, dtype, op, ranges or scheme options.
        """
        return self.reduce_scatter_group(comm, [grad], [ranges], op, outs=[out], timings=[timings], keys=[key])[0]

    def reduce_scatter_group(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], ranges: list[Sequence[tuple[int, int]]],
        op: str = "sum", outs: list[torch.Tensor | None] | None = None, timings: list[dict | None] | None = None,
        keys: list[str | None] | None = None,
    ) -> list[torch.Tensor]:
        """``reduce_scatter`` of several gradients of one bucket, each with its own ranges; a scheme may
        run them step by step together so that its host reads happen once per group (``zen`` does).

        1. Validate each as ``reduce_scatter`` does; empty ones get their empty result at once.
        2. Run the rest together (``_reduce_scatter_group``) under one signature covering them all.
        3. Copy a result into its ``out`` where the scheme returned a new tensor.
        """
        k = len(grads)
        outs, timings, keys = outs or [None] * k, timings or [None] * k, keys or [None] * k
        if not len(ranges) == len(outs) == len(timings) == len(keys) == k:
            raise ValueError(f"reduce_scatter_group: ranges, outs, timings and keys must have one entry per gradient ({k})")
        # Step 1: validate.
        check_op(op)
        results: list[torch.Tensor | None] = [None] * k
        live, facts = [], []
        for i in range(k):
            numel, dtype, device = self._facts(grads[i])
            rs = check_ranges(ranges[i], comm.size, numel, f"reduce-scatter {self.name!r}")
            lo, hi = rs[comm.rank]
            if outs[i] is not None:
                check_out(outs[i], hi - lo, dtype, device, f"reduce-scatter {self.name!r}")
            if numel == 0:
                results[i] = outs[i] if outs[i] is not None else torch.empty(0, dtype=dtype, device=device)
            else:
                live.append(i)
                facts.append((numel, dtype, rs))
        if not live:
            return results
        # Step 2: run under one signature for the group.
        numel0, dtype0 = facts[0][0], facts[0][1]
        word = signature_digest(self.name, self.options(), op, [(f[0], str(f[1]), f[2]) for f in facts])
        where = f"reduce-scatter {self.name!r}"
        try:
            with comm.signed(word, dtype0, op, where=where):
                got = self._reduce_scatter_group(comm, [grads[i] for i in live], [facts[j][2] for j in range(len(live))],
                                                 op, [outs[i] for i in live], [timings[i] for i in live],
                                                 [keys[i] for i in live])
        except RuntimeError as exc:
            if str(exc).startswith(_DISAGREE):
                _explain_disagreement(comm, self, op, facts, exc)
            raise
        # Step 3: into the callers' buffers.
        for i, res in zip(live, got):
            out = outs[i]
            if out is not None and res is not out:
                out.copy_(res.reshape(-1))
                res = out
            results[i] = res
        return results

    def _facts(self, grad: SparseGrad | torch.Tensor):
        """``(dense numel, dtype, device)``, after the index check (one host read unless in range by construction)."""
        refuse_accumulated(self, grad, "reduce-scatter")
        if isinstance(grad, SparseGrad) and grad.lowbit is not None and not self.carries_low_bits:
            raise ValueError(low_bits_error(grad.lowbit.bits, repr(self.name), _carriers(), "a reduce-scatter"))
        if isinstance(grad, SparseGrad):
            grad.check_range(where=f"reduce-scatter {self.name!r}")
            return grad.dense_numel, grad.values.dtype, grad.values.device
        return grad.numel(), grad.dtype, grad.device

    @abc.abstractmethod
    def _reduce_scatter_group(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], ranges: list[list[tuple[int, int]]],
        op: str, outs: list[torch.Tensor | None], timings: list[dict | None], keys: list[str | None],
    ) -> list[torch.Tensor]:
        """The scheme on validated, non-empty gradients: one result per gradient, this rank's range
        (written into ``outs[i]`` and returned, or a new 1-D tensor that the caller copies)."""

    def reduce_scatter_group_validated(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], ranges: list[list[tuple[int, int]]],
        op: str, outs: list[torch.Tensor | None], timings: list[dict | None], keys: list[str | None],
    ) -> list[torch.Tensor]:
        """This scheme on gradients another scheme already validated and signed (``reduce_scatter_group``'s
        step 1 and its signature were the caller's: spardl's lossless path, ``auto``'s choice): the scheme
        itself (``_reduce_scatter_group``), nothing checked twice."""
        return self._reduce_scatter_group(comm, grads, ranges, op, outs, timings, keys)

    def options(self) -> dict:
        """The constructor options of this instance (folded into the call signature)."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


@dataclass(frozen=True)
class RSProfile:
    """What the reduce-scatter cost predictors read (``predict_*_bytes`` next to each scheme): the same
    on every rank (``auto`` gathers it). Units are a gradient's index units (rows in row form)."""

    n: int
    lengths: list[int]
    """Units per owner range."""
    counts: list[list[int]]
    """``counts[j][r]``: rank ``j``'s entries inside owner ``r``'s range (duplicates counted)."""
    idx_bytes: int
    val_bytes: int
    """Bytes of one entry's values (``row width · itemsize``)."""

    def union(self, r: int) -> float:
        """Distinct units expected in ``R_r`` over every rank, if ranks picked them independently
        (DGC's top-k: close; correlated embedding rows: an over-estimate, so ZEN's pull is predicted
        pessimistically)."""
        length = self.lengths[r]
        if not length:
            return 0.0
        miss = 1.0
        for j in range(self.n):
            miss *= 1.0 - min(self.counts[j][r], length) / length
        return length * (1.0 - miss)


def check_ranges(ranges: Sequence[tuple[int, int]], n: int, numel: int, where: str = "reduce-scatter") -> list[tuple[int, int]]:
    """``ranges`` as a list of int pairs, or ValueError unless they are one per rank, in rank order,
    contiguous and tiling ``[0, numel)`` (empty ranges allowed)."""
    try:
        rs = [(int(s), int(e)) for s, e in ranges]
    except (TypeError, ValueError):
        raise ValueError(f"zen.reduce_scatter ranges ({ranges!r}) must be a sequence of (start, end) int pairs "
                         f"({where})") from None
    if len(rs) != n:
        raise ValueError(f"zen.reduce_scatter ranges ({len(rs)} entries) must have one (start, end) per rank ({n}) ({where})")
    at = 0
    for r, (s, e) in enumerate(rs):
        if s != at:
            raise ValueError(f"zen.reduce_scatter ranges[{r}] ({(s, e)}) must start where ranges[{r - 1}] ends ({at}): "
                             f"the ranges tile [0, {numel}) in rank order ({where})" if r else
                             f"zen.reduce_scatter ranges[0] ({(s, e)}) must start at 0 ({where})")
        if e < s:
            raise ValueError(f"zen.reduce_scatter ranges[{r}] ({(s, e)}) must have start <= end ({where})")
        at = e
    if at != numel:
        raise ValueError(f"zen.reduce_scatter ranges[{n - 1}] ({rs[-1]}) must end at the gradient's dense numel "
                         f"({numel}) ({where})")
    return rs


def as_units(grad: SparseGrad | torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[SparseGrad, list[tuple[int, int]]]:
    """``grad`` as a validated SparseGrad and ``ranges`` in its index units (rows of a row-form gradient).

    A row-form gradient whose rows some range boundary cuts is expanded to element form first (each
    row's ``W`` elements become entries), so every index has one owner; values are unchanged.
    """
    sg = grad if isinstance(grad, SparseGrad) else SparseGrad.from_dense(grad)
    w = sg.row_width
    if w > 1 and any(s % w or e % w for s, e in ranges):
        cols = torch.arange(w, device=sg.indices.device)
        sg = SparseGrad((sg.indices.unsqueeze(1) * w + cols).reshape(-1), sg.values.reshape(-1), sg.numel * w,
                        in_range=True)
        w = 1
    return sg, [(s // w, e // w) for s, e in ranges]


def even_ranges(numel: int, n: int) -> list[tuple[int, int]]:
    """Equal contiguous ranges of ``ceil(numel / n)`` (FSDP's padded chunks; the last ones shorter)."""
    size = -(-numel // n) if n else 0
    return [(min(numel, r * size), min(numel, (r + 1) * size)) for r in range(n)]


def signature_digest(name: str, options: dict, op: str, facts: list) -> int:
    """The call's numel field: a 50-bit digest of what shapes its collectives (every gradient's numel,
    dtype and ranges, the scheme and its options, op). Ranks that differ in any of them differ here."""
    text = repr((name, sorted(options.items()), op, facts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << _SIG_DIGEST_BITS) - 1)


def _explain_disagreement(comm: Communicator, scheme: ReduceScatterScheme, op: str, facts: list, exc: RuntimeError):
    """Every rank raised at the same signature check: gather the plain values once and name both ranks'."""
    mine = {"scheme": repr(scheme), "op": op,
            "gradients": [{"numel": f[0], "dtype": str(f[1]), "ranges": f[2]} for f in facts]}
    for r, theirs in enumerate(comm.all_gather_object(mine)):
        if theirs != mine:
            field = next(k for k in mine if theirs.get(k) != mine.get(k))
            raise RuntimeError(f"zen.reduce_scatter: ranks disagree on the {field}: rank {r} has {theirs[field]!r}, "
                               f"rank {comm.rank} has {mine[field]!r}; every rank must pass the same numel, dtype, "
                               f"op and ranges to the same scheme built with the same options") from exc
