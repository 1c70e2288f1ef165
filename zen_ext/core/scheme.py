"""The SyncScheme protocol: a scheme's sync and, next to it, its cost model (the name → class registry
is ``core/registry.py``).

A scheme synchronizes one flat gradient over a Communicator and returns the dense aggregate on every
rank. Lossless schemes must equal ``dense`` (an all-reduce of the same inputs) up to float summation
order. Options are keyword arguments of the scheme's constructor.

Its cost model, declared on the class in the terms of ``core/cost.py``, is what ``auto`` predicts it
by: ``wire_phases`` (the phases of its ``timings`` that are the wire's), ``predict_traffic`` (bytes
and messages per rank from a sparsity profile) and ``predict_work`` (computation per phase). A
scheme that declares none runs, and ``auto`` leaves it out.
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar

import torch

from ..comm.base import Communicator
from .cost import BLOCK_SIZE, ProfileView, Traffic, WorkCounts
from .types import AccumulatedGrad, SparseGrad
from .zen_count import CONTRIBUTORS

REDUCE_OPS = ("sum", "mean")
PartitionFn = Callable[[torch.Tensor], torch.Tensor]
"""Maps indices (or block ids) to the server that owns them, in ``[0, n)``."""


class SyncScheme(abc.ABC):
    """One way to aggregate a (sparse) gradient across the ranks of a Communicator."""

    name: ClassVar[str]
    lossless: ClassVar[bool] = True
    reduce_scatter_form: ClassVar[str | None] = None
    """The reduce-scatter scheme (``core/reduce_scatter.py``) that serves this scheme under ZeRO-2
    reduce_scatter, ZeRO-3 and FSDP2; None: the scheme has no reduce-scatter form (sharded engines refuse it)."""
    #: The phases (keys of the ``timings`` it fills) whose time is the wire's; empty: no cost model.
    wire_phases: ClassVar[tuple[str, ...]] = ()
    #: Whether it takes an ``AccumulatedGrad`` (a sparsifier's dense memory, ``core/types.py``) and selects
    #: from it itself (``spardl``); every other scheme refuses one.
    takes_accumulated: ClassVar[bool] = False
    #: What ``partition_fn`` maps: ``"index"`` (rows in row form) or ``"block"`` (OmniReduce's blocks).
    partition_unit: ClassVar[str] = "index"
    #: Whether it carries low-bit values (``zen.dgc.value_bits``: ``SparseGrad.lowbit``, ``core/lowbit.py``):
    #: quantized push and pull with the owner's error feedback. Every other scheme refuses such a gradient.
    carries_low_bits: ClassVar[bool] = False
    #: Whether it takes ``op="contributors"``: each index of the sum divided by the number of ranks that sent
    #: it, counted where the sum is made (``zen``'s owners: ``core/zen_count.py``). Every other scheme
    #: refuses that op (the outer sync then sends ``(value, 1)`` rows through a plain sum instead).
    counts_contributors: ClassVar[bool] = False

    def require_low_bits(self, bits: int, carriers: "list[str] | None" = None) -> None:
        """Called before the first step when ``zen.dgc.value_bits`` is set: raise unless this scheme carries
        low-bit values (``auto`` narrows its candidates to those that do); ``carriers``: the registered
        schemes that do, for the error."""
        if not self.carries_low_bits:
            raise ValueError(low_bits_error(bits, f"zen.scheme {self.name!r}", carriers))

    def sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Aggregate ``grad`` over ``comm``; returns a dense flat tensor of ``grad``'s numel and dtype.

        The public entry point of every scheme: the input is checked once here, then ``_sync`` runs.

        1. Validate: ``op``, every index inside ``[0, numel)`` (one host synchronization), ``out``.
        2. Empty gradient (numel 0): return an empty result without any collective (every rank has the
           same numel, so every rank skips).
        3. Run the scheme; a scheme that cannot write into ``out`` returns a new tensor, copied here.
           The first collective checks that every rank passed the same numel, dtype and op (it rides
           on the header of the first exchange; a scheme that opens with an all-reduce, ``dense``,
           pays one 8-byte all-gather).

        Args:
            comm: the ranks to synchronize.
            grad: this rank's gradient, sparse (COO) or dense.
            op: ``"sum"`` or ``"mean"``.
            timings: if given, filled with seconds per phase.
            key: a stable name of the gradient slice (e.g. a parameter or bucket name); schemes that
                keep per-slice decisions (``auto``) use it, the others ignore it.
            out: if given, a contiguous 1-D tensor of the dense numel, dtype and device of ``grad``
                that receives the result (and is returned); no result-sized temporary is kept.

        Raises:
            ValueError: a bad ``op``, an index outside ``[0, numel)`` (naming the scheme, the index and
                the range), or an ``out`` of the wrong size, dtype or device.
            RuntimeError: ranks passed different numel, dtype or op (naming both ranks' values).
        """
        # Step 1: validate.
        dense_numel, dtype, device = self._validate(grad, op, out)
        # Step 2: nothing to synchronize.
        if dense_numel == 0:
            return out if out is not None else torch.empty(0, dtype=dtype, device=device)
        # Step 3: run, with this call's signature (numel, dtype, op) declared on the communicator: its
        # first header carries it and every rank compares it before any payload moves (comm/base.py),
        # so ranks passing different gradients raise instead of summing garbage or hanging.
        with comm.signed(dense_numel, dtype, op, where=f"scheme {self.name!r}.sync"):
            res = self._sync(comm, grad, op, timings, key, out)
        return _into(res, out)

    def sync_group(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], op: str = "sum",
        timings: list[dict | None] | None = None, keys: list[str | None] | None = None,
        outs: list[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]:
        """``sync`` of several gradients of one bucket (e.g. its embedding rows and its DGC slices):
        the same results, but a scheme may run them step by step together, so that what it reads on
        the host happens once per group rather than once per gradient (``zen`` does; the others run
        them one after the other). ``timings``, ``keys`` and ``outs`` are per gradient.

        1. Validate every gradient as ``sync`` does; empty ones get their empty result at once.
        2. Run the rest together (``_sync_group``); copy a result into its ``out`` where the scheme
           returned a new tensor.
        """
        k = len(grads)
        timings, keys, outs = timings or [None] * k, keys or [None] * k, outs or [None] * k
        if not len(timings) == len(keys) == len(outs) == k:
            raise ValueError(f"sync_group: timings, keys and outs must have one entry per gradient ({k})")
        # Step 1: validate.
        results: list[torch.Tensor | None] = [None] * k
        live = []
        for i, (g, o) in enumerate(zip(grads, outs)):
            dense_numel, dtype, device = self._validate(g, op, o)
            if dense_numel == 0:
                results[i] = o if o is not None else torch.empty(0, dtype=dtype, device=device)
            else:
                live.append(i)
        # Step 2: run.
        if live:
            got = self._sync_group(comm, [grads[i] for i in live], op, [timings[i] for i in live],
                                   [keys[i] for i in live], [outs[i] for i in live])
            for i, res in zip(live, got):
                results[i] = _into(res, outs[i])
        return results

    def _validate(self, grad: SparseGrad | torch.Tensor, op: str, out: torch.Tensor | None):
        """``op``, every index inside ``[0, numel)``, ``out``; returns ``(dense numel, dtype, device)``."""
        if op == CONTRIBUTORS:
            if not self.counts_contributors:
                raise ValueError(f"op ({op!r}) must go with a scheme that counts the senders of each index "
                                 f"(zen, zen_coo), not scheme {self.name!r}; send (value, 1) rows with op 'sum' "
                                 f"instead")
            if isinstance(grad, torch.Tensor):
                raise ValueError(f"op ({op!r}) must be given a SparseGrad (a dense tensor does not say which "
                                 f"indices a rank sent)")
        else:
            check_op(op)
        refuse_accumulated(self, grad, "scheme")
        if isinstance(grad, SparseGrad) and grad.lowbit is not None and not self.carries_low_bits:
            raise ValueError(low_bits_error(grad.lowbit.bits, f"scheme {self.name!r}"))
        if isinstance(grad, SparseGrad):
            grad.check_range(where=f"scheme {self.name!r}")
            dense_numel, dtype, device = grad.dense_numel, grad.values.dtype, grad.values.device
        else:
            dense_numel, dtype, device = grad.numel(), grad.dtype, grad.device
        if out is not None:
            check_out(out, dense_numel, dtype, device, f"scheme {self.name!r}")
        return dense_numel, dtype, device

    def _sync_group(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], op: str, timings: list[dict | None],
        keys: list[str | None], outs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Several validated, non-empty gradients (see ``sync_group``); by default one ``_sync`` each,
        each under its own signature. A scheme that runs them step by step overrides this and declares
        each gradient's signature around that gradient's first collective."""
        results = []
        for g, t, k, o in zip(grads, timings, keys, outs):
            sg_numel = g.dense_numel if isinstance(g, SparseGrad) else g.numel()
            dtype = g.values.dtype if isinstance(g, SparseGrad) else g.dtype
            with comm.signed(sg_numel, dtype, op, where=f"scheme {self.name!r}.sync"):
                results.append(self._sync(comm, g, op, t, k, o))
        return results

    @abc.abstractmethod
    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str, timings: dict | None,
        key: str | None, out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The scheme itself, on validated, non-empty input (see ``sync``).

        It may write the result into ``out`` and return ``out``, or return a new dense flat tensor
        (``sync`` then copies it into ``out``).
        """

    # --- for schemes that hand a validated gradient on to another (spardl → zen, auto → its choice) ------
    def sync_validated(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str, timings: dict | None,
        key: str | None, out: torch.Tensor | None,
    ) -> torch.Tensor:
        """This scheme on a gradient another scheme already validated and signed (``sync``'s step 1 and
        its signature were the caller's): the scheme itself (``_sync``), nothing checked twice."""
        return self._sync(comm, grad, op, timings, key, out)

    def sync_group_validated(
        self, comm: Communicator, grads: list[SparseGrad | torch.Tensor], op: str, timings: list[dict | None],
        keys: list[str | None], outs: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """``sync_validated`` of several gradients of one bucket (``_sync_group``)."""
        return self._sync_group(comm, grads, op, timings, keys, outs)

    def options(self) -> dict:
        """The constructor options this instance was built with (for agreement checks and logs)."""
        return {}

    def check_agreement(self, comm: Communicator) -> None:
        """Raise RuntimeError unless every rank of ``comm`` built this scheme with the same options.

        A scheme's options (seed, formats) and the communicator's (transport, backend, device type:
        ``comm.options()``) shape its collectives: ranks that disagree would exchange garbage or hang,
        so they are compared explicitly once, before the first sync.
        """
        mine = (self.name, sorted(self.options().items()), sorted(comm.options().items()))
        for rank, theirs in enumerate(comm.all_gather_object(mine)):
            if theirs != mine:
                raise RuntimeError(
                    f"scheme configuration differs across ranks: rank {comm.rank} has {mine}, rank {rank} has {theirs}"
                )

    # --- the cost model (read by the planner, zen_ext/planner/cost_model.py) ------------------------
    @classmethod
    def has_cost_model(cls) -> bool:
        """Whether ``auto`` can predict this scheme (it declares ``wire_phases`` and both predictors)."""
        return bool(cls.wire_phases)

    @staticmethod
    def predict_traffic(profile: ProfileView, options: dict) -> Traffic:
        """The bytes and messages each rank sends and receives on ``profile`` when built with
        ``options``, recorded with ``Traffic.exchange_v`` / ``all_gather_v`` / ``all_reduce`` in the
        order the scheme runs them."""
        raise NotImplementedError("this scheme declares no cost model (wire_phases is empty)")

    @staticmethod
    def predict_work(work: WorkCounts, options: dict) -> dict[str, dict[str, float]]:
        """The computation of the slowest rank per phase: ``{phase: {primitive: units}}`` in
        ``core.cost.PRIMITIVES`` (``Dims.of(work)`` gives the usual quantities)."""
        raise NotImplementedError("this scheme declares no cost model (wire_phases is empty)")

    @classmethod
    def partition_fn(cls, numel: int, n: int, *, seed: int = 0, row_width: int = 1,
                     block_size: int = BLOCK_SIZE) -> PartitionFn | None:
        """The index → server map of a Parallelism scheme (for the Push/Pull imbalance of paper
        Def. 8, ``analysis/metrics.py``), over ``partition_unit``s; None for Centralization schemes."""
        return None

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def _into(res: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A scheme's result, copied into the caller's ``out`` where it is a new tensor."""
    if out is not None and res is not out:
        out.copy_(res.reshape(-1))
        return out
    return res


def low_bits_error(bits: int, what: str, carriers: "list[str] | None" = None, kind: str = "a scheme") -> str:
    """The error of a scheme that cannot carry ``zen.dgc.value_bits``, naming the ones that can: ``carriers``
    (the registered ones, as the Synchronizer passes them), else the loaded classes that declare it."""
    if carriers is None:
        carriers = list(dict.fromkeys(c.name for c in subclasses_of(SyncScheme if kind == "a scheme" else None)
                                      if c.carries_low_bits and isinstance(getattr(c, "name", None), str)))
    return (f"zen.dgc.value_bits ({bits}) must go with {kind} that carries low-bit values, not {what}; "
            f"{'schemes' if kind == 'a scheme' else 'reduce-scatter schemes'} that carry it: "
            f"{list(carriers) + ['auto']} (auto then chooses among them)")


def subclasses_of(base) -> list:
    """Every subclass of ``base``, depth first (the loaded scheme classes, for errors that list them)."""
    out, todo = [], list(base.__subclasses__()) if base is not None else []
    while todo:
        c = todo.pop(0)
        out.append(c)
        todo[:0] = c.__subclasses__()
    return out


def refuse_accumulated(scheme, grad, what: str) -> None:
    """Raise ValueError when ``grad`` is a sparsifier's memory handed to a scheme that does not select
    from it (it would synchronize nothing)."""
    if isinstance(grad, AccumulatedGrad) and not scheme.takes_accumulated:
        raise ValueError(f"{what} {scheme.name!r} got an AccumulatedGrad (a sparsifier's dense memory), which only "
                         f"schemes that select their own entries take (spardl)")


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"op ({op!r}) must be one of {list(REDUCE_OPS)}")


def check_out(out: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device, where: str) -> None:
    """Raise ValueError unless ``out`` can receive a dense flat result of ``numel`` ``dtype`` elements."""
    if out.dim() != 1 or out.numel() != numel or out.dtype != dtype or out.device != device \
            or not out.is_contiguous():
        raise ValueError(f"{where}: out ({tuple(out.shape)} {out.dtype} on {out.device}) must be a contiguous 1-D "
                         f"tensor of {numel} {dtype} elements on {device}")
