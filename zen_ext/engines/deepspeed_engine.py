"""``ZenDeepSpeed``: ZEN attached to one DeepSpeed engine (the overrides ``engines/deepspeed.py``'s
``attach`` installs; the table of who reduces and what is overridden is in that module's docstring).
The engine-neutral parts (the machinery, statistics, summary, per-rank checkpoint files) come from
``reduction.attachment``. It holds the objects that override ZeRO's reductions: ``async_ipg`` (the
``overlap_comm`` hand-over, ``deepspeed_ipg.AsyncIPG``) and ``sharded_reduce`` (the reduce-scatter,
``deepspeed_zero3.ShardedReduce``).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ..comm.torch_dist import TorchCommunicator
from ..compress.registry import spec_of
from ..config import ZenConfig, check_deepspeed_settings
from ..reduction import NodeShardedReduce, locate_slices, maybe_node_sharding
from ..reduction.attachment import ZenAttachment, assemble
from ..reduction.stats import startup_line
from .deepspeed_compat import (TESTED_DEEPSPEED, checkpoint_tag, hook_mismatch, late_bf16_refusal, loaded_tag,
                               managed_gradient_accumulation, served_text)
from .deepspeed_ipg import AsyncIPG, async_ipg_off_reason
from .deepspeed_zero3 import ShardedReduce, sharded_refusals

log = logging.getLogger("zen_ext.engines.deepspeed")

VERIFIED_DEEPSPEED = TESTED_DEEPSPEED
"""The DeepSpeed releases the adapter's tests passed on (``deepspeed_compat``)."""


class ZenDeepSpeed(ZenAttachment):
    """ZEN attached to one DeepSpeed engine: the Synchronizer, the overrides, statistics, checkpoints.

    1. Decide the sparsifier defaults that depend on the optimizer (``ZenConfig.resolve_defaults``:
       DGC's), and refuse what the overrides cannot serve (pipeline/sequence parallelism, MoE, a
       ``once_per_step`` sparsifier such as DGC with ZeRO-2/3 gradient accumulation, what
       ``deepspeed_zero3`` refuses). ZeRO-3 and ZeRO-1/2 with ``reduce_scatter`` take ZEN's
       reduce-scatter (``sharded``), the rest ZEN's all-reduce.
    2. Groups: the data-parallel group (split by node when hierarchical) and the TP group.
    3. The Synchronizer and the BucketReducer around it (re-bucketing, TP-shared embedding rows, the
       fp16 non-finite guard).
    4. Install the instance overrides (reduction, step, checkpoints; the reduce-scatter's and the IPG
       hand-over's through the objects it holds, ``sharded_reduce`` and ``async_ipg``); rank 0 prints
       one line saying ZEN is on (engine, groups, scheme, what each sparsifier got, the DGC momentum
       choice).

    Args:
        engine: the ``DeepSpeedEngine``.
        cfg: the validated ``"zen"`` section.
    """

    def __init__(self, engine, cfg: ZenConfig) -> None:
        import torch.distributed as dist
        from deepspeed.utils import groups

        # Step 1: refuse what the overrides cannot serve; sparsifier defaults that depend on the optimizer.
        cfg, self.defaults_note = cfg.resolve_defaults(engine.optimizer)
        self.engine, self.cfg = engine, cfg
        self.stage = engine.zero_optimization_stage()
        # The ZeRO optimizer reduces its own buckets; everything else (ZeRO-0, fp16/bf16 wrappers, and
        # BF16_Optimizer, which bf16 + ZeRO-1 + fp32 grad accumulation builds) goes through the engine.
        self.zero_reduces = hasattr(engine.optimizer, "gradient_reduction_w_predivide") and hasattr(
            engine.optimizer, "ipg_buckets")
        check_deepspeed_settings({"zero_optimization": {"stage": self.stage},
                                  "sequence_parallel_size": getattr(engine, "sequence_parallel_size", 1)})
        if getattr(engine, "pipeline_parallelism", False):
            refuse_pipeline_model(engine.module, force=True)
        # A DeepSpeed release whose hooks the overrides cannot serve (deepspeed_compat); ZeRO-1/2 optimizers
        # are checked whether or not they have per-dtype IPG buckets (0.17.0 has neither these nor the dtype).
        zero_hooks = self.zero_reduces or (self.stage in (1, 2) and hasattr(engine.optimizer, "average_tensor"))
        refusal = (hook_mismatch(engine, zero_hooks) if self.stage != 3 else None) or late_bf16_refusal(engine)
        if refusal is not None:
            raise NotImplementedError(refusal)
        if getattr(engine, "has_moe_layers", False):
            raise NotImplementedError("zen supports dense models (data and AutoTP tensor parallelism), not MoE "
                                      "expert parallelism")
        # ZeRO-3, and ZeRO-1/2 with reduce_scatter: each rank receives only what it owns.
        self.sharded = self.stage == 3 or (self.zero_reduces and getattr(engine.optimizer, "reduce_scatter", False))
        if self.sharded:
            sharded_refusals(engine.optimizer, self.stage)
        once = [k for k in cfg.sections() if spec_of(k).cls.once_per_step]
        if self.stage >= 2 and once and engine.gradient_accumulation_steps() > 1:
            raise NotImplementedError(
                f"zen with zen.{once[0]} on supports ZeRO-{self.stage} only with gradient_accumulation_steps = 1: "
                f"ZeRO-{self.stage} reduces every micro-batch, and the {once[0]} sparsifier's memory (e.g. momentum "
                f"correction) must advance once per optimizer step; use ZeRO-1 (reduces once per step) or ZeRO-0")
        self.rank = dist.get_rank()
        self.op = "mean" if engine.gradient_average else "sum"

        # Step 2: groups. ZEN runs over the data-parallel group; DGC agrees thresholds over the TP group.
        self.dp_group = (engine.optimizer.dp_process_group if self.zero_reduces or self.stage == 3
                         else engine.seq_data_parallel_group)
        self.dp_ranks = dist.get_process_group_ranks(self.dp_group)
        tp_size = engine.autotp_size() if hasattr(engine, "autotp_size") else 1
        self.tp_comm = (TorchCommunicator(groups.get_tensor_model_parallel_group(), cfg.exchange_impl)
                        if tp_size and tp_size > 1 else None)
        if self.sharded and self.tp_comm is not None:
            raise NotImplementedError("zen with a ZeRO reduce-scatter (ZeRO-3, reduce_scatter true) supports data "
                                      "parallelism only, not AutoTP; use ZeRO-1/2 with reduce_scatter false")
        node = self._maybe_node_sharding(dist)
        sync_comm = TorchCommunicator(self._inter_group if node else self.dp_group, cfg.exchange_impl)

        # Step 3: the Synchronizer, routing each parameter by kind, and the machinery around it.
        # zen.async_sync pipelines the ZEN buckets of each engine bucket over a communication worker
        # (compress bucket k + 1 while k is on the wire); not with node sharding or a TP group, whose
        # collectives the compression itself needs.
        self.names = {id(p): n for n, p in engine.module.named_parameters()}
        numels = {n: getattr(p, "ds_numel", p.numel()) for n, p in engine.module.named_parameters()}
        from deepspeed.runtime.utils import is_model_parallel_parameter

        replicated = frozenset(n for n, p in engine.module.named_parameters()
                               if p.dim() == 2 and not is_model_parallel_parameter(p))
        built = assemble(engine.module, cfg, sync_comm=sync_comm, tp_comm=self.tp_comm, rank=self.rank,
                         dp_size=self.dp_size, device=engine.device, node=node, tp_replicated=replicated,
                         guard_comm=TorchCommunicator(None) if engine.fp16_enabled() else None,
                         worker_off=("node sharding" if node is not None else "a tensor-parallel group"
                                     if self.tp_comm is not None else None),
                         monitor=getattr(engine, "monitor", None))
        kinds, self.sync, self.reducer, self.worker, self.stats = (built.kinds, built.sync, built.reducer,
                                                                   built.worker, built.stats)
        if self.sharded:  # the Synchronizer builds zen.scheme's reduce-scatter form on this first read:
            _ = self.sync.rs_scheme  # NotImplementedError for a scheme without one comes before training
        # With ZeRO's overlap_comm the backward pass fills one IPG buffer while the other is reduced:
        # the worker then takes whole IPG buckets, and the backward pass goes on (AsyncIPG).
        self.async_ipg_off = async_ipg_off_reason(engine.optimizer, async_sync=cfg.async_sync, worker=self.worker,
                                                  zero_reduces=self.zero_reduces, stage=self.stage)
        if self.worker is not None and self.zero_reduces and self.rank == 0:
            if self.async_ipg_off is None:
                log.info("zen: ZeRO overlap_comm with zen.async_sync: each full IPG bucket goes to the communication "
                         "worker while the backward pass fills the other IPG buffer")
            else:
                log.info("zen: ZeRO IPG buckets are reduced on the training thread (%s); zen.async_sync pipelines "
                         "the ZEN buckets inside each of them", self.async_ipg_off)
        self.hierarchical = node is not None

        # Step 4: install the overrides.
        self._install()
        if self.rank == 0:
            log.info("zen: attached to DeepSpeed ZeRO-%d (dp=%d, tp=%d, hierarchical=%s, op=%s): %s", self.stage,
                     self.dp_size, tp_size or 1, self.hierarchical, self.op, cfg.to_dict())
            print(startup_line(f"DeepSpeed ZeRO-{self.stage} (dp={self.dp_size}, tp={tp_size or 1}, "
                               f"hierarchical={self.hierarchical}; {self._reduction_choice()})", cfg, kinds, numels,
                               self.defaults_note), flush=True)

    log_name = log.name

    @property
    def dp_size(self) -> int:
        return len(self.dp_ranks)

    @property
    def dp_rank(self) -> int:
        """This rank's place in the data-parallel group (the Synchronizer's group is the inter-node one
        with node-level reduction)."""
        return self.dp_ranks.index(self.rank)

    @property
    def override_calls(self) -> int:
        """Reductions the overrides ran (the all-reduce's and the reduce-scatter's): ``end_step`` checks
        that each optimizer step ran one."""
        return self._reduce_calls + (self.sharded_reduce.calls if self.sharded_reduce is not None else 0)

    @property
    def async_ipg_buckets(self) -> int:
        """IPG buckets handed to the communication worker so far (0 without the hand-over)."""
        return self.async_ipg.buckets if self.async_ipg is not None else 0

    def _reduction_choice(self) -> str:
        """What reduces the gradients and why, for the start-up line."""
        if self.sharded:
            rs = self.sync.rs_scheme.name
            why = "ZeRO-3" if self.stage == 3 else "zero_optimization.reduce_scatter true"
            level = ("node-level: dense inside the node, " + rs + " across nodes" if self.reducer.node is not None
                     else rs)
            return f"reduce-scatter {level} ({why}: each rank receives only its partition)"
        if self.stage in (1, 2):
            return ("all-reduce, each rank keeps its partition (zero_optimization.reduce_scatter false; "
                    "set it true for ZEN's reduce-scatter)")
        return "all-reduce"

    # --- groups -------------------------------------------------------------------------------------------
    def _maybe_node_sharding(self, dist) -> NodeShardedReduce | None:
        """Node-sharded (hierarchical) reduction when every DP group spans several equal multi-rank nodes.

        Decided from facts gathered once here (each rank's host and local rank, every DP group), the
        same on every rank: a rank's own ``LOCAL_WORLD_SIZE`` differs between the nodes of an uneven
        hostfile, and node groups are created by a collective that every rank must join or skip.
        """
        node, self._inter_group, self.hierarchy_reason = maybe_node_sharding(
            self.cfg.hierarchical, self.dp_ranks, self.rank, log)
        return node

    # --- the overrides ------------------------------------------------------------------------------------
    def _install(self) -> None:
        eng = self.engine
        self._reduce_calls = 0
        self._calls_at_last_step = 0
        self.sharded_reduce = self.async_ipg = None
        if self.sharded:
            self.sharded_reduce = ShardedReduce(eng, self.stage, sync=self.sync, reducer=self.reducer, stats=self.stats,
                                                names=self.names, is_dp_group=self._is_dp_group,
                                                dp_size=self.dp_size, dp_rank=self.dp_rank)
            self.sharded_reduce.install()
        elif self.zero_reduces:
            self._orig_reduction = eng.optimizer.gradient_reduction_w_predivide
            eng.optimizer.gradient_reduction_w_predivide = self._gradient_reduction_w_predivide
        if self.zero_reduces and self.async_ipg_off is None:  # all-reduce or reduce_scatter: whole IPG buckets
            self.async_ipg = AsyncIPG(eng.optimizer, self.worker, self.names, self._ipg_job)
            self.async_ipg.install()
        if not self.sharded and not self.zero_reduces:
            self._orig_allreduce_bucket = eng.allreduce_bucket
            eng.allreduce_bucket = self._allreduce_bucket
        self._orig_step = eng.step
        eng.step = self._step
        self._orig_save, self._orig_load = eng.save_checkpoint, eng.load_checkpoint
        eng.save_checkpoint, eng.load_checkpoint = self._save_checkpoint, self._load_checkpoint

    def _is_dp_group(self, group) -> bool:
        import torch.distributed as dist

        return group is self.dp_group or (group is not None and dist.get_process_group_ranks(group) == self.dp_ranks)

    def _allreduce_bucket(self, bucket, dp_group, dp_world_size=None):
        """ZeRO-0: the engine's ``allreduce_bucket`` contract — flatten, reduce, return the flat tensor."""
        if not self._is_dp_group(dp_group):
            return self._orig_allreduce_bucket(bucket, dp_group, dp_world_size)
        flat = self.engine.flatten(bucket)
        slices = locate_slices(bucket, self._named_grads())
        self._reduce(flat, slices, self.engine.communication_data_type)
        return flat

    def _gradient_reduction_w_predivide(self, tensor, communication_data_type):
        """ZeRO-1/2: reduce the flat IPG bucket in place; return it in the communication dtype."""
        if tensor.numel() == 0:
            return tensor
        bucket = self.engine.optimizer.ipg_buckets[communication_data_type]
        return self._reduce(tensor, self._ipg_slices(tensor, bucket), communication_data_type)

    def _ipg_job(self, flat, bucket, comm_dtype):
        """``AsyncIPG``'s job for one IPG bucket, built on the training thread: the reduce-scatter of
        DeepSpeed's owner segments (``reduce_scatter`` true, recorded now), or the all-reduce in place."""
        if self.sharded_reduce is not None:
            return self.sharded_reduce.zero2_job(flat, comm_dtype)
        return functools.partial(self._reduce, flat, self._ipg_slices(flat, bucket), comm_dtype, pipelined=False)

    def _ipg_slices(self, flat, bucket) -> list:
        """Where each parameter of a ZeRO IPG bucket lies in ``flat`` (the bucket's reduced tensor)."""
        opt = self.engine.optimizer
        named = [(self.names[id(opt.bit16_groups[i][j])], g) for (i, j, _), g in zip(bucket.params, bucket.grads)]
        return locate_slices([flat], named)

    def _reduce(self, flat, slices, comm_dtype, pipelined: bool = True) -> torch.Tensor:
        """Reduce ``flat`` in place, with values travelling in ``comm_dtype``; returns the comm tensor."""
        t0 = time.perf_counter()
        self._reduce_calls += 1
        work = flat if flat.dtype == comm_dtype else flat.to(comm_dtype)
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.engine.fp16_enabled() else None
        if scale is not None:  # DGC memory follows the fp16 loss scale (docs/sparsifiers.md)
            self.sync.set_grad_scale(scale)
        self.reducer.reduce_(work, slices, self.op, pipelined=pipelined)
        if work is not flat:
            flat.copy_(work)
        self.stats.add(reduce_s=time.perf_counter() - t0)
        return work

    def _named_grads(self):
        """(name, gradient) of every parameter, where the bucket's tensors may live."""
        opt = self.engine.optimizer
        if hasattr(opt, "fp32_groups_gradients") and hasattr(opt, "bf16_groups"):
            # BF16_Optimizer reduces its fp32 flat gradient buffers, one per param group.
            return [(self.names[id(p)], g) for ps, gs in zip(opt.bf16_groups, opt.fp32_groups_gradients)
                    for p, g in zip(ps, gs)]
        return [(n, p.grad) for n, p in self.engine.module.named_parameters() if p.grad is not None]

    # --- step, statistics ---------------------------------------------------------------------------------
    def _step(self, *args, **kwargs):
        eng = self.engine
        boundary = eng.is_gradient_accumulation_boundary() or not managed_gradient_accumulation(eng)
        out = self._orig_step(*args, **kwargs)
        if boundary:
            self.end_step()
        return out

    def end_step(self) -> dict:
        """Close one optimizer step: check the override ran, advance the Synchronizer, write stats."""
        if self.override_calls == self._calls_at_last_step:
            import deepspeed

            raise RuntimeError(
                f"zen: DeepSpeed {deepspeed.__version__} did not call the ZEN gradient reduction during this "
                f"optimizer step (ZeRO-{self.stage}); the override point moved, so gradients were not synchronized "
                f"by ZEN. Supported: {served_text()}")
        self._calls_at_last_step = self.override_calls
        self.sync.end_step()
        rec = self.reducer.pop_stats()
        if self.async_ipg is not None:
            rec["async_ipg_buckets"] = self.async_ipg.step_buckets()
        return self.stats.end_step(self.engine.global_steps, rec, getattr(self.engine, "global_samples", None))

    @property
    def summary_label(self) -> str:
        return f"ZeRO-{self.stage} hierarchical={self.hierarchical}"

    def close(self) -> None:
        """Flush the statistics and release the communication worker (idempotent)."""
        if getattr(self, "async_ipg", None) is not None:
            self.async_ipg.forget()  # the worker's drain finishes its jobs, those included
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._release()
        self.worker = self.reducer.worker = None

    # --- checkpoints: zen_ext's per-rank files inside DeepSpeed's tag folder ------------------------------
    def _save_checkpoint(self, save_dir, tag=None, *args, **kwargs):
        tag = checkpoint_tag(self.engine, tag)
        out = self._orig_save(save_dir, tag, *args, **kwargs)
        self.save_rank_state(save_dir, tag)
        return out

    def _load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        load_path, client_state = self._orig_load(load_dir, tag, *args, **kwargs)
        if load_path is None:
            return load_path, client_state
        tag = loaded_tag(load_dir, tag)
        self.load_rank_state(load_dir, tag)
        return load_path, client_state


def refuse_pipeline_model(model, force: bool = False) -> None:
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # pragma: no cover
        PipelineModule = ()
    if force or isinstance(model, PipelineModule):
        raise NotImplementedError("zen supports data parallelism and AutoTP tensor + data parallelism, not pipeline "
                                  "parallelism (PipelineModule); remove \"zen\" or run without pipeline stages")
