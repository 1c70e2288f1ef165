"""zen.outer on DeepSpeed: ZeRO-0 with fp32 weights, each data-parallel rank a replica; or ZeRO-1/2 with
fp32 weights partitioned inside replica groups.

Inner steps reduce nothing: the engine's bucket all-reduce (``engine.allreduce_bucket``, the method ZEN's
own ZeRO-0 adapter replaces, ``deepspeed_engine.py``) is replaced by one that returns the flat bucket
unreduced, so each replica's gradients stay its own (DeepSpeed's gradient averaging happens inside that
method, so nothing divides them either). The outer step runs after every ``every``-th optimizer step
(``engine.step`` wrapped; at gradient-accumulation boundaries only). Each optimizer step checks that the
replacement ran, so a DeepSpeed release that moved the reduction fails loudly instead of silently
all-reducing every step.

ZeRO-1/2 inside replica groups: ``deepspeed.initialize(..., mpu=...)`` takes the data-parallel group from
``mpu.get_data_parallel_group()``, and ZeRO partitions the optimizer state and the flat fp32 weights over
it and reduces the gradients inside it (``stage_1_and_2.py``, ``dp_process_group``); so an ``mpu`` whose
data-parallel group is the rank's replica group confines ZeRO to it (checked: the replicas train apart).
The engine's reduction is then left as it is. The outer sync runs across the replica groups on each
rank's flat fp32 partitions (``single_partition_of_fp32_groups``: the optimizer's master weights, so
θ_global and e are shard-sized, padding included), over the group of the ranks with the same index in
every replica group; after each outer step (and after ``finish`` merged a round in flight) the optimizer
copies the partitions into the model's weights and all-gathers them inside the replica group
(``update_lp_params``, what its own step ends with).

What is refused, before training (``NotImplementedError`` naming what is served):

* ZeRO-3: its parameters are partitioned too (not built).
* ZeRO-1/2 whose data-parallel group spans every rank (no ``mpu``): there is a single replica.
* fp16 / bf16: tested with fp32 weights only (under ZeRO-0 the fp32 master weights would miss the restart).
* AutoTP, pipeline parallelism, MoE.

``zen.outer.delay: 1`` (the sum of round t on a communication thread over a process group of its own while
round t + 1 trains, ``outer/sync.py``): ``finish()`` applies the last round; ``close()`` calls it, and
``recipes/finetune_llm.py`` calls it before its final evaluation. A checkpoint holds the round in flight
(its sum waited for, the merge still due), so resuming stays bitwise. Under ZeRO-1/2 the late merge
(step 3 of ``outer/sync.py``) writes the fp32 partitions like the restart does, so the same
``update_lp_params`` carries it into the weights.

Checkpoints, per rank, ``<dir>/<tag>/zen_ext/outer_rank<r>.pt``: the rank's ``OuterSync`` state (θ_global,
its own error feedback, the outer momentum, the round in flight), next to what DeepSpeed writes:

* ZeRO-0: DeepSpeed's checkpoint holds rank 0's weights and optimizer state only (it assumes equal
  replicas), but between outer steps each replica has its own; the per-rank file also holds the
  replica's own weights and inner optimizer state, which ``load_checkpoint`` puts over rank 0's.
* ZeRO-1/2: DeepSpeed names the partition files by data-parallel rank and lets data-parallel rank 0 write
  the model, so two replica groups would overwrite each other's files in one directory. Each replica
  group ``g`` (its index among the groups ordered by their ranks) therefore gets DeepSpeed's complete
  checkpoint in a directory of its own, ``<dir>/<tag>/replica<g>/<tag>/`` (DeepSpeed's ``save_dir`` is
  ``<dir>/<tag>/replica<g>``, the tag the same on every rank, so its tag check passes); ``<dir>/latest``
  is written here, as DeepSpeed would.

A resumed run equals the uninterrupted one bitwise (weights, inner optimizer state, ``OuterSync`` state;
``tests/e2e/test_deepspeed_outer.py``).
"""

from __future__ import annotations

import logging
import os

import torch

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig
from ..outer.sync import OuterSync
from .deepspeed_compat import checkpoint_tag, loaded_tag

log = logging.getLogger(__name__)

SERVED = ("zen.outer on DeepSpeed supports ZeRO-0 with fp32 weights, each data-parallel rank one replica, or ZeRO-1/2 "
          "with fp32 weights inside replica groups (an mpu whose data-parallel group is the rank's replica group); "
          "delay 0 and 1, checkpoints")


class OuterDeepSpeed:
    """The outer synchronization attached to a DeepSpeed engine (``engine.zen`` when ``zen.outer`` is on).

    Offers what the recipes read of an attachment: ``cfg``, ``annotate``, ``totals``, ``summary``, ``close``.

    Raises:
        NotImplementedError: an engine setting it cannot serve (see the module docstring).
    """

    def __init__(self, engine, cfg: ZenConfig) -> None:
        import torch.distributed as dist

        # Step 1: refuse what a restart from θ_global cannot reach.
        stage = engine.zero_optimization_stage()
        if stage not in (0, 1, 2):
            raise NotImplementedError(f"{SERVED}; got ZeRO-{stage} (its parameters are partitioned too; not built)")
        if engine.fp16_enabled() or engine.bfloat16_enabled():
            raise NotImplementedError(f"{SERVED}; got {'fp16' if engine.fp16_enabled() else 'bf16'} (the "
                                      f"optimizer's fp32 master weights would miss the outer restart)")
        tp = engine.autotp_size() if hasattr(engine, "autotp_size") else 1
        if (tp or 1) > 1 or getattr(engine, "pipeline_parallelism", False) or getattr(engine, "has_moe_layers", False):
            raise NotImplementedError(f"{SERVED}; not AutoTP, pipeline parallelism or MoE")
        self.engine, self.cfg, self.stage = engine, cfg, stage
        self.rank = dist.get_rank()
        # Step 2: the replicas and the outer sync (broadcasts rank 0's weights, compares the layout).
        group = engine.seq_data_parallel_group
        self.replica = None  # ZeRO-1/2: the index of this rank's replica group (its checkpoint directory)
        if stage == 0:
            named = engine.module.named_parameters()
        else:  # the optimizer's flat fp32 partitions, across the ranks holding the same ones
            parts = engine.optimizer.single_partition_of_fp32_groups
            named = [(f"fp32_partition{i}", t) for i, t in enumerate(parts)]
            group, self.replica = replicate_group(group, stage)
        self.outer = OuterSync(named, TorchCommunicator(group, cfg.exchange_impl),
                               cfg.outer, scheme=cfg.build_scheme(), bucket_cap_mb=cfg.bucket_cap_mb)
        if stage:
            engine.optimizer.update_lp_params()  # the broadcast start into the weights, inside the replica group
        self.dp_size = dist.get_world_size(group)
        self.totals = {"bytes_sent": 0, "dense_bytes": 0, "outer_steps": 0, "picks": 0, "numel": 0}
        self._calls = self._calls_at_step = 0
        # Step 3: the overrides.
        if stage == 0:  # ZeRO-1/2 reduce inside the replica group: left as they are
            self._orig_allreduce_bucket = engine.allreduce_bucket
            engine.allreduce_bucket = self._local_bucket
        self._orig_step = engine.step
        engine.step = self._step
        self._orig_save, self._orig_load = engine.save_checkpoint, engine.load_checkpoint
        engine.save_checkpoint, engine.load_checkpoint = self._save_checkpoint, self._load_checkpoint
        if self.rank == 0:
            o = cfg.outer
            where = f"ZeRO-{stage} (inside groups of {engine.seq_dp_world_size} ranks, " if stage else "ZeRO-0 ("
            print(f"zen_ext: zen.outer on DeepSpeed {where}{self.dp_size} replicas): every {o.every} steps, "
                  f"density {o.density:g} per {o.chunk}-element chunk, error decay {o.error_decay:g}, outer SGD lr "
                  f"{o.lr:g} momentum {o.momentum:g}{' nesterov' if o.nesterov else ''}, average {o.average}, "
                  f"scheme {cfg.scheme}{', delay 1 (overlapped)' if o.delay else ''}", flush=True)

    def _local_bucket(self, bucket, dp_group, dp_world_size=None):
        """The engine's ``allreduce_bucket`` contract (flatten, reduce, return the flat tensor), reducing
        nothing: the replica's own gradients, undivided."""
        self._calls += 1
        return self.engine.flatten(bucket)

    def _step(self, *args, **kwargs):
        eng = self.engine
        boundary = eng.is_gradient_accumulation_boundary()
        out = self._orig_step(*args, **kwargs)
        if boundary:
            if self.stage == 0 and self._calls == self._calls_at_step:
                import deepspeed

                raise RuntimeError(f"zen: DeepSpeed {deepspeed.__version__} did not call engine.allreduce_bucket "
                                   f"during this optimizer step; the reduction moved, so the inner steps may have "
                                   f"been all-reduced. {SERVED}")
            self._calls_at_step = self._calls
            if self.outer.step_done():
                if self.stage:  # the partitions into the weights, all-gathered inside the replica group
                    eng.optimizer.update_lp_params()
                self._count()
            n = self.dp_size
            # what a per-step dense ring all-reduce would have sent for this step
            self.totals["dense_bytes"] += 2 * (n - 1) * 4 * sum(b.numel for b in self.outer.buckets) // n
        return out

    def _count(self) -> None:
        st = self.outer.pop_stats()
        for k in ("bytes_sent", "outer_steps", "picks", "numel"):
            self.totals[k] += st[k]

    def finish(self) -> None:
        """Apply the outer round still in flight (``zen.outer.delay: 1``; nothing at delay 0): call it on every
        rank at the end of training, before evaluating or saving the final model (``OuterSync.finish``).
        ZeRO-1/2: the merged partitions then reach the weights (``update_lp_params``)."""
        merged = any(b.inflight is not None for b in self.outer.buckets)  # the same on every rank
        self.outer.finish()
        if merged and self.stage:
            self.engine.optimizer.update_lp_params()
        self._count()

    # --- what the recipes read ------------------------------------------------------------------------------
    def annotate(self, **_) -> None:
        """Per-step fields of the per-step adapter's statistics records; the outer sync keeps totals only."""

    def summary(self) -> str:
        t = self.totals
        ratio = t["bytes_sent"] / t["dense_bytes"] if t["dense_bytes"] else 0.0
        return (f"zen.outer summary ({self.dp_size} replicas, {t['outer_steps']} outer steps): "
                f"sent {t['bytes_sent']:,} "
                f"bytes per rank, {ratio:.4f}x a per-step dense all-reduce's {t['dense_bytes']:,}; "
                f"{t['picks']:,} of {t['numel']:,} entries picked")

    def close(self) -> None:
        """End of training: ``finish()``, the communication thread stopped (``delay: 1``), rank 0 prints
        ``summary()`` (``zen.stats.summary``); once."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.finish()
        self.outer.close()
        self._count()
        if self.rank == 0 and self.cfg.stats.summary:
            print(self.summary(), flush=True)

    # --- checkpoints ------------------------------------------------------------------------------------
    def _path(self, root, tag) -> str:
        return os.path.join(root, str(tag), "zen_ext", f"outer_rank{self.rank}.pt")

    def _group_dir(self, root, tag) -> str:
        """ZeRO-1/2: the ``save_dir`` DeepSpeed writes this replica group's checkpoint under."""
        return os.path.join(root, str(tag), f"replica{self.replica}")

    def _save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """1. DeepSpeed's checkpoint: into ``save_dir`` (ZeRO-0), into the replica group's own directory
        (ZeRO-1/2). 2. The per-rank file. 3. A barrier: every rank's files exist when any rank returns;
        ZeRO-1/2 then writes ``<save_dir>/latest`` (so it never names a tag whose files are incomplete)."""
        import torch.distributed as dist

        tag = checkpoint_tag(self.engine, tag)
        client_state = {} if client_state is None else client_state
        # Step 1: DeepSpeed's files.
        if self.stage:
            out = self._orig_save(self._group_dir(save_dir, tag), tag, client_state=client_state, save_latest=False,
                                  **kwargs)
        else:
            out = self._orig_save(save_dir, tag, client_state=client_state, save_latest=save_latest, **kwargs)
        # Step 2: this rank's outer state (ZeRO-0: its replica's weights and inner optimizer state too).
        path = self._path(save_dir, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        outer = self.outer.state_dict()  # delay 1: waits for the round in flight, whose bytes then count
        self._count()
        sd = {"outer": outer, "totals": dict(self.totals), "replica": self.replica}
        if not self.stage:
            sd.update(module=self.engine.module.state_dict(), optimizer=self.engine.optimizer.state_dict())
        torch.save(sd, path)
        # Step 3: saved everywhere, then the pointer to it.
        dist.barrier()
        if self.stage and save_latest:
            if self.rank == 0:
                with open(os.path.join(save_dir, "latest"), "w") as f:
                    f.write(str(tag))
            dist.barrier()
        return out

    def _load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        """DeepSpeed's checkpoint (ZeRO-1/2: the replica group's, the tag from ``<load_dir>/latest`` when
        None), then the per-rank file over it.

        Raises:
            ValueError: the per-rank file was saved by a rank of another replica group.
        """
        if self.stage:
            if tag is None and not os.path.isfile(os.path.join(load_dir, "latest")):
                log.warning("zen.outer: no %s to name the checkpoint to load; nothing loaded (as DeepSpeed)",
                            os.path.join(load_dir, "latest"))
                return None, None
            tag = loaded_tag(load_dir, tag)
            load_path, client_state = self._orig_load(self._group_dir(load_dir, tag), tag, *args, **kwargs)
        else:
            load_path, client_state = self._orig_load(load_dir, tag, *args, **kwargs)
        if load_path is None:
            return load_path, client_state
        tag = loaded_tag(load_dir, tag)
        sd = torch.load(self._path(load_dir, tag), weights_only=False)
        if sd.get("replica") != self.replica:
            raise ValueError(f"zen.outer checkpoint {self._path(load_dir, tag)} was saved by a rank of replica group "
                             f"{sd.get('replica')}, this rank is in {self.replica}: resume with the same replica groups")
        if not self.stage:  # this replica's own weights and inner optimizer state over DeepSpeed's (rank 0's) copy
            self.engine.module.load_state_dict(sd["module"])
            self.engine.optimizer.load_state_dict(sd["optimizer"])
        self.outer.load_state_dict(sd["outer"])
        self.totals.update(sd["totals"])
        return load_path, client_state


def replicate_group(dp_group, stage: int):
    """The group of the ranks holding the same ZeRO partitions as this one: index ``j`` of every replica
    group (the data-parallel groups of all ranks, gathered once; every rank creates every group, in order),
    and the index of this rank's replica group among the groups ordered by their ranks.

    Raises:
        NotImplementedError: one data-parallel group spanning every rank, or groups that do not split the
            world into equal parts.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    every = [None] * world
    dist.all_gather_object(every, list(dist.get_process_group_ranks(dp_group)))
    groups = sorted({tuple(g) for g in every})
    if len(groups) < 2:
        raise NotImplementedError(f"{SERVED}; got ZeRO-{stage} over a data-parallel group of all {world} ranks (one "
                                  f"replica): pass deepspeed.initialize an mpu whose get_data_parallel_group() is "
                                  f"the rank's replica group")
    if len({len(g) for g in groups}) != 1 or sorted(r for g in groups for r in g) != list(range(world)):
        raise NotImplementedError(f"{SERVED}; the data-parallel groups {groups} must split the {world} ranks into "
                                  f"equal replica groups")
    mine = None
    for j in range(len(groups[0])):
        ranks = [g[j] for g in groups]
        pg = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = pg
    return mine, next(i for i, g in enumerate(groups) if dist.get_rank() in g)
