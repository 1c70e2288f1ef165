"""The FSDP2 recipe's outer form (``zen.outer`` on an HSDP mesh, recipes/finetune_llm_fsdp.py): the
attachment the training loop reads, and per-rank checkpoints.

``OuterRun`` wraps ``zen_ext.engines.fsdp_outer.register_outer``'s ``FSDPOuterSync`` with what the loop reads of
a per-step attachment (``cfg``, ``annotate``, ``totals``, ``summary``, ``close``): ``totals`` counts the bytes
the outer steps sent and, per inner step, what a dense per-step all-reduce of the rank's shard across the
replicas would have sent (plain HSDP's cross-replica traffic). ``finish()`` applies the round still in flight
(``zen.outer.delay: 1``; nothing at delay 0): the loop calls it after the last step, before the final eval.

Checkpoints are per rank: the replicas' weights and inner optimizer state differ (between outer steps the
weights, always the optimizer state), and ``torch.distributed.checkpoint`` keeps one copy of what the
mesh calls replicated. ``<output_dir>/checkpoints/step<N>/outer_rank<RRRRR>.pt`` holds the step, the rank's
shards and optimizer state (``fsdp_outer.local_state_dict``), its ``FSDPOuterSync`` state (θ_global, error
feedback, momentum; at ``delay: 1`` also the anchor and the merge still due of the round in flight, whose sum
the save waits for) and the totals; ``recipe_optimizer.json`` and ``checkpoints/latest`` as in
recipes/fsdp_checkpoint.py. Resuming needs the same world size and ``--replicas``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from recipes import common
from recipes.fsdp_checkpoint import LATEST


class OuterRun:
    """``FSDPOuterSync`` as the recipe's loop reads an attachment (module docstring)."""

    def __init__(self, model, zen_section: dict, optimizer) -> None:
        from zen_ext.config import ZenConfig
        from zen_ext.engines.fsdp_outer import register_outer

        self.cfg = ZenConfig.from_json_section(zen_section)
        self.outer = register_outer(model, self.cfg, optimizer)  # its post-step hook runs the outer step first
        self.replicas = self.outer.mesh_shape[0]
        self.totals = {"bytes_sent": 0, "dense_bytes": 0, "outer_steps": 0, "picks": 0, "numel": 0}
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._count())
        self._closed = False

    def _fold(self) -> None:
        """The outer sync's statistics since the last call into ``totals`` (``delay: 1``: a round's bytes count
        when its sum is waited for: the next outer step, ``finish``, a checkpoint's ``state_dict``)."""
        st = self.outer.pop_stats()
        for k in ("bytes_sent", "outer_steps", "picks", "numel"):
            self.totals[k] += st[k]

    def _count(self) -> None:
        self._fold()
        n = self.replicas
        self.totals["dense_bytes"] += 2 * (n - 1) * 4 * sum(b.numel for b in self.outer.buckets) // n

    def annotate(self, **_) -> None:
        """Per-step fields of the per-step adapters' records; the outer sync keeps totals only."""

    def summary(self) -> str:
        t = self.totals
        ratio = t["bytes_sent"] / t["dense_bytes"] if t["dense_bytes"] else 0.0
        return (f"zen.outer summary (FSDP2 HSDP, {self.replicas} replicas x shard {self.outer.mesh_shape[1]}, "
                f"{t['outer_steps']} outer steps): sent {t['bytes_sent']:,} bytes per rank, {ratio:.4f}x a per-step "
                f"dense all-reduce's {t['dense_bytes']:,}; {t['picks']:,} of {t['numel']:,} entries picked")

    def finish(self) -> None:
        """Apply the outer round still in flight (``FSDPOuterSync.finish``); every rank, at the same step."""
        self.outer.finish()
        self._fold()

    def close(self) -> None:
        """End of training: rank 0 prints ``summary()`` (``zen.stats.summary``), once; FSDP gets its all-reduce back."""
        if self._closed:
            return
        self._closed = True
        if dist.get_rank() == 0 and self.cfg.stats.summary:
            print(self.summary(), flush=True)
        self.outer.close()
        self._fold()


def _file(path: str, rank: int) -> str:
    return os.path.join(path, f"outer_rank{rank:05d}.pt")


def save(ckpt_dir: str, step: int, model, optimizer, run: OuterRun, optimizer_name: str) -> str:
    """Every rank writes its own file (a collective: a barrier before ``latest`` moves); returns the folder."""
    from zen_ext.engines.fsdp_outer import local_state_dict

    rank = dist.get_rank()
    path = os.path.join(ckpt_dir, f"step{step}")
    os.makedirs(path, exist_ok=True)
    outer = run.outer.state_dict()  # delay 1: waits for the round in flight, whose bytes then count
    run._fold()  # in the saved totals, as a resumed run (whose round in flight is restored done) counts them
    torch.save({"step": step, "local": local_state_dict(model, optimizer), "outer": outer,
                "totals": dict(run.totals)}, _file(path, rank))
    common.save_optimizer_name(path, optimizer_name, rank)
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(ckpt_dir, f"{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    return path


def load(path: str, model, optimizer, run: OuterRun) -> int:
    """Restore this rank's file of the checkpoint folder ``path``; returns the step it was saved at.

    Raises:
        common.ConfigError: no file of this rank (saved at another world size or by the per-step recipe).
    """
    from zen_ext.engines.fsdp_outer import load_local_state_dict

    file = _file(path, dist.get_rank())
    if not os.path.isfile(file):
        raise common.ConfigError(f"--resume: {path} has no zen.outer file of rank {dist.get_rank()} (saved at another "
                                 f"world size, or without zen.outer)")
    sd = torch.load(file, map_location="cpu", weights_only=True)
    load_local_state_dict(model, sd["local"], optimizer)
    run.outer.load_state_dict(sd["outer"])
    run.totals.update(sd["totals"])
    return int(sd["step"])
