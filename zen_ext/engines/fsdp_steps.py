"""What a ZEN attachment on FSDP2 keeps per step (``FSDPSteps``, held by the 1-D and the HSDP attachment
alike), and FSDP2 gradient accumulation against sparsifiers that must see one gradient per optimizer step.

FSDP2 reduces in every backward pass unless the module was told otherwise
(``set_requires_gradient_sync(False)``; under HSDP also ``set_requires_all_reduce(False)``, which
reduce-scatters but keeps the node-summed shard back, unreduced across the replicas, until a backward
pass that all-reduces); a sharded gradient that is already there when the next reduction lands gets the
new one added (FSDP's ``foreach_reduce``). Accumulating micro-batches with gradient sync on therefore
runs ZEN once per micro-batch: its reduce-scatter on a 1-D mesh, its all-reduce hook under HSDP. For a
lossless kind (natural rows, dense) that is only more traffic: the sum of the reduced micro-batches
equals the reduced sum. For a ``once_per_step`` sparsifier (DGC: its residual, momentum correction and
warm-up advance per call) it is a different algorithm, top-k of each micro-batch, counted as one step
per micro-batch. ``AccumulationWatch`` refuses it at the second micro-batch's first reduction, before
the first optimizer step, as DeepSpeed's adapter refuses DGC with ZeRO-2/3 gradient accumulation.

The signal is FSDP's own accumulation condition: a backward pass begins reducing while a trainable
sharded gradient of the module is still there, and no optimizer holding the model's parameters has
stepped since the last backward pass that reduced (a global ``torch.optim`` step pre-hook, so
``attach`` needs no ``optimizer=``; it tells apart ``zero_grad(set_to_none=False)``, which leaves zeros).
Under HSDP a backward pass with ``set_requires_all_reduce(False)`` neither calls ZEN nor sets a sharded
gradient (FSDP returns before both), so that accumulation is one ZEN step and passes.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..compress.registry import spec_of

__all__ = ["AccumulationWatch", "FSDPSteps"]


class FSDPSteps:
    """The step bookkeeping of an FSDP2 attachment, whichever FSDP hook runs ZEN (``ZenFSDP``'s reduce-scatter,
    ``ZenHSDP``'s all-reduce hook): the backward pass's reductions form one ZEN step (DGC's warm-up), closed by
    an autograd callback at its end; DGC accumulating across reductions is refused (``AccumulationWatch``); a
    closed attachment refuses to reduce.

    Per reduction: ``start`` (refused once closed), ``watch`` (the accumulation check, on a backward pass's
    first reduction), the reduction itself, ``done`` (its seconds; the first one queues ``end_step``).

    Args:
        sync, reducer, stats: the attachment's Synchronizer, BucketReducer and StepStats.
        accumulation: the attachment's ``AccumulationWatch``.
    """

    def __init__(self, sync, reducer, stats, accumulation: "AccumulationWatch") -> None:
        self.sync, self.reducer, self.stats, self.accumulation = sync, reducer, stats, accumulation
        self.step = 0
        """Backward passes that reduced (ZEN steps)."""
        self.seconds = 0.0
        self.open = False
        """A reduction of the current backward pass ran: its ``end_step`` is queued."""
        self.closed = False

    def start(self) -> float:
        """Before a reduction: refuse once closed; returns the start time."""
        if self.closed:
            raise RuntimeError("zen_ext.fsdp: the attachment was closed (close() ends training); attach anew to train")
        return time.perf_counter()

    def watch(self, names) -> None:
        """The first reduction of a backward pass, of the parameters ``names``: refuse DGC accumulating across
        reductions (``AccumulationWatch.begin_backward``)."""
        if not self.open:
            self.accumulation.begin_backward(names)

    def done(self, t0: float) -> None:
        """After a reduction: its seconds; the first of a backward pass queues ``end_step`` for when autograd
        finishes the pass."""
        self.seconds += time.perf_counter() - t0
        if not self.open:
            self.open = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_step)

    def end_step(self) -> dict:
        """Close a backward pass that reduced: advance the Synchronizer (DGC warm-up), write the record."""
        self.open = False
        self.step += 1
        self.sync.end_step()
        rec = self.reducer.pop_stats()
        rec["reduce_s"], self.seconds = self.seconds, 0.0
        return self.stats.end_step(self.step, rec)

    def close(self) -> None:
        """Reductions refuse from now on; the accumulation watch's global hook is removed. Idempotent."""
        self.closed = True
        self.accumulation.close()


class AccumulationWatch:
    """Refuse FSDP2 gradient accumulation across reduce-scatters when a ``once_per_step`` kind is routed.

    Args:
        model: the FSDP2 root module (its trainable parameters are the sharded ones FSDP accumulates into).
        param_kinds: parameter name → routed kind (``Synchronizer.param_kinds``).
        hsdp: ZEN is HSDP's cross-replica all-reduce (engines/fsdp_hsdp.py), not the reduce-scatter: the
            error names that collective and HSDP's own way to accumulate.
    """

    def __init__(self, model: torch.nn.Module, param_kinds: dict[str, str], *, hsdp: bool = False) -> None:
        self.hsdp = hsdp
        self.kinds = sorted({k for k in param_kinds.values() if k != "dense" and spec_of(k).cls.once_per_step})
        # Weak: the global hook below must not keep the model alive if close() is never called.
        self.params = weakref.WeakValueDictionary({n: p for n, p in model.named_parameters() if p.requires_grad})
        self._ids = {id(p) for p in self.params.values()}
        self.reduced = 0  # backward passes that reduced since an optimizer holding these parameters stepped
        self._mine: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer → holds our params?
        self._hook = (register_optimizer_step_pre_hook(self._on_step) if self.kinds
                      else None)

    def _on_step(self, optimizer, args, kwargs) -> None:
        mine = self._mine.get(optimizer)
        if mine is None:
            mine = self._mine[optimizer] = any(id(p) in self._ids for g in optimizer.param_groups
                                               for p in g["params"])
        if mine:
            self.reduced = 0

    def begin_backward(self, names) -> None:
        """A backward pass starts reducing (ZEN's first reduce-scatter or HSDP all-reduce of it), first the
        parameters ``names``: raise if FSDP is about to add this reduction's result to a gradient an earlier
        one left (no optimizer step between)."""
        if not self.kinds:
            return
        if self.reduced and any(getattr(self.params.get(n), "grad", None) is not None for n in names):
            kind = self.kinds[0]
            reduced, keep = "reduce-scattered", ""
            if self.hsdp:
                reduced = "all-reduced across the replicas"
                keep = (" (under HSDP, set_requires_all_reduce(False) instead keeps the reduce-scattered shard "
                        "back, unreduced across the replicas)")
            raise NotImplementedError(
                f"zen_ext.fsdp: a second backward pass {reduced} before the optimizer stepped (gradient "
                f"accumulation with gradient sync on), and zen.{kind} must see one gradient per optimizer step: "
                f"reducing each micro-batch would run {kind} per micro-batch and count each as a step. Call "
                f"model.set_requires_gradient_sync(False) before every micro-batch's backward but the last "
                f"(set_requires_gradient_sync(True) before the last){keep}, or turn zen.{kind} off. (zen_ext "
                f"counts optimizer steps through torch.optim's step pre-hook: an optimizer that is not a "
                f"torch.optim.Optimizer must zero gradients with set_to_none=True.)")
        self.reduced += 1

    def close(self) -> None:
        """Remove the global optimizer hook (idempotent)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
