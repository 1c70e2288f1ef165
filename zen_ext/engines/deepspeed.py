"""DeepSpeed integration: ``initialize`` = ``deepspeed.initialize`` + ZEN attached to the engine.

DeepSpeed has no gradient-reduction hook, so ``attach`` replaces, on the engine instance only, the
method that all-reduces one flat gradient bucket (shared/research/engines.md A1.4):

=============================  ===================================================  =================
who reduces                    overridden instance method                           checked on
=============================  ===================================================  =================
the engine: ZeRO-0 (fp32,      ``engine.allreduce_bucket(bucket, dp_group,          deepspeed 0.19.8
fp16, bf16, AutoTP) and        dp_world_size)``
BF16_Optimizer (bf16 + ZeRO-1
+ fp32 grad accumulation)
the ZeRO optimizer: ZeRO 1, 2  ``engine.optimizer.gradient_reduction_w_predivide(   deepspeed 0.19.8
                               tensor, communication_data_type)``, with
                               ``zero_optimization.reduce_scatter`` forced false
                               and ``contiguous_gradients`` true
=============================  ===================================================  =================

With ``zen.async_sync`` and ZeRO's ``overlap_comm`` (two IPG buffers), ``engine.optimizer.reduce_ipg_grads``
is replaced too: a full IPG bucket goes to the communication worker, which reduces it and runs
DeepSpeed's per-parameter copy into the gradient partition, while the backward pass fills the other
buffer (``ZenDeepSpeed._reduce_ipg_async``).

Both overrides keep DeepSpeed's semantics: values travel in ``communication_data_type``, the result is
the data-parallel mean (or sum with ``gradient_allreduce_op: "sum"``), and groups other than the
data-parallel one (MoE expert groups) go to the original method. ``engine.step`` is wrapped to end
the Synchronizer's step and write statistics; ``save_checkpoint`` / ``load_checkpoint`` are wrapped
to store each rank's ZEN state (DGC residuals differ per rank) in ``<dir>/<tag>/zen_ext/``.
After every optimizer step the wrapper checks that the override ran, so a DeepSpeed release that
moves the reduction fails loudly instead of silently training with the wrong gradients.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os
import time

import torch

from ..comm.torch_dist import TorchCommunicator
from ..config import (SECTION, ZenConfig, check_deepspeed_settings, load_json_config, near_miss_sections,
                      resolve_dgc_defaults)
from ..reduction import BucketReducer, CommWorker, NodeShardedReduce, locate_slices, maybe_node_sharding
from ..reduction.assembly import build_synchronizer, restore_sync_state, summary_text
from ..reduction.stats import StepStats, startup_line

log = logging.getLogger(__name__)

VERIFIED_DEEPSPEED = ("0.19.8", "0.19.8")
"""The DeepSpeed releases the overrides were verified on (inclusive)."""
ALLOW_UNVERIFIED_ENV = "ZEN_EXT_ALLOW_UNVERIFIED_DEEPSPEED"
STATE_DIRNAME = "zen_ext"

_original_initialize = None


# --- public entry points --------------------------------------------------------------------------------
def check_deepspeed_version(version: str | None = None) -> str:
    """Raise RuntimeError unless DeepSpeed's version is in ``VERIFIED_DEEPSPEED`` (or the override
    environment variable is set). Returns the version."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    from packaging.version import Version

    lo, hi = VERIFIED_DEEPSPEED
    if not Version(lo) <= Version(version.split("+")[0]) <= Version(hi):
        msg = (f"zen_ext overrides private DeepSpeed methods verified on deepspeed {lo}..{hi}, found "
               f"{version}; install deepspeed=={hi} (launch/setup.sh), or set {ALLOW_UNVERIFIED_ENV}=1 to try "
               f"anyway (tests/e2e/test_deepspeed_engine.py checks that the override is still called)")
        if os.environ.get(ALLOW_UNVERIFIED_ENV) != "1":
            raise RuntimeError(msg)
        log.warning(msg)
    return version


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with ZEN attached when the config has an enabled ``"zen"`` section.

    Same arguments and return value as ``deepspeed.initialize``: ``(engine, optimizer,
    training_dataloader, lr_scheduler)``; the attachment is ``engine.zen``.

    1. Find the config (``config``, ``config_params`` or ``args.deepspeed_config``) and validate its
       ``"zen"`` section and the engine settings it needs.
    2. Rewrite the ZeRO settings the override relies on (ZeRO-1/2: ``reduce_scatter`` false,
       ``contiguous_gradients`` true) in a copy of the config.
    3. Call DeepSpeed, then ``attach``.
    """
    orig = _original_initialize or _deepspeed_initialize()
    bound = inspect.signature(orig).bind(*args, **kwargs)
    a = bound.arguments
    # Step 1: the config and its "zen" section.
    ds_args = a.get("args")
    source = a.get("config") if a.get("config") is not None else a.get("config_params")
    if source is None and getattr(ds_args, "deepspeed_config", None) is not None:
        source = ds_args.deepspeed_config
    if source is None:
        return orig(*bound.args, **bound.kwargs)
    ds_config = copy.deepcopy(load_json_config(source))
    cfg = ZenConfig.from_ds_config(ds_config)  # warns about a near-miss section name ("zne")
    if not cfg.enabled:
        result = orig(*bound.args, **bound.kwargs)
        _mark_without_zen(result[0], _off_reason(ds_config))
        return result
    check_deepspeed_version()
    _refuse_pipeline_model(a.get("model"))
    # Step 2: the ZeRO settings the override needs.
    _rewrite_zero_settings(ds_config)
    a["config"] = ds_config
    a.pop("config_params", None)
    if ds_args is not None and getattr(ds_args, "deepspeed_config", None) is not None:
        a["args"] = copy.copy(ds_args)
        a["args"].deepspeed_config = None
    # Step 3: DeepSpeed, then ZEN.
    result = orig(*bound.args, **bound.kwargs)
    attach(result[0], cfg)
    return result


def enable() -> None:
    """Make plain ``deepspeed.initialize`` attach ZEN (one line for HF Trainer / Accelerate users).

    1. Route ``deepspeed.initialize`` through ``initialize`` (Accelerate looks it up at ``prepare``).
    2. Make Accelerate leave the ``"zen"`` section alone: it treats every ``"auto"`` value of a
       DeepSpeed config as a placeholder it must fill from its own arguments and raises
       "`zen.scheme` not found in kwargs" otherwise, while ``"scheme": "auto"`` and
       ``"hierarchical": "auto"`` are zen_ext's own values (the planner, node detection).

    Example::

        >>> import zen_ext.deepspeed; zen_ext.deepspeed.enable()  # doctest: +SKIP
        >>> TrainingArguments(..., deepspeed="ds_config.json")  # a "zen" section in it now applies
    """
    import deepspeed

    global _original_initialize
    # Step 1: the initialize seam.
    if _original_initialize is None:
        _original_initialize = deepspeed.initialize
    deepspeed.initialize = _patched_initialize
    # Step 2: Accelerate's placeholder filling skips the "zen" section.
    _patch_accelerate_fill_match(True)


def disable() -> None:
    """Undo ``enable``."""
    import deepspeed

    global _original_initialize
    if _original_initialize is not None:
        deepspeed.initialize = _original_initialize
        _original_initialize = None
    _patch_accelerate_fill_match(False)


def _patch_accelerate_fill_match(on: bool) -> None:
    """Wrap (or unwrap) ``accelerate.utils.DeepSpeedPlugin.fill_match`` so that keys under ``zen.``
    are not treated as Accelerate placeholders (checked on accelerate 1.15: ``deepspeed_config_process``
    walks every leaf of the config through ``fill_match``; HF Trainer's own ``HfTrainerDeepSpeedConfig``
    only fills the keys it names, so it needs nothing). A no-op without Accelerate."""
    try:
        from accelerate.utils.dataclasses import DeepSpeedPlugin
    except ImportError:
        return
    current = DeepSpeedPlugin.fill_match
    original = getattr(current, "_zen_ext_original", None)
    if not on:
        if original is not None:
            DeepSpeedPlugin.fill_match = original
        return
    if original is not None:
        return  # already wrapped

    @functools.wraps(current)
    def fill_match(self, ds_key_long, *args, **kwargs):
        if ds_key_long == SECTION or ds_key_long.startswith(SECTION + "."):
            return None  # zen_ext's section: its "auto" values are zen_ext's choices, not placeholders
        return current(self, ds_key_long, *args, **kwargs)

    fill_match._zen_ext_original = current
    DeepSpeedPlugin.fill_match = fill_match


@functools.wraps(initialize)
def _patched_initialize(*args, **kwargs):
    return initialize(*args, **kwargs)


def _deepspeed_initialize():
    import deepspeed

    return deepspeed.initialize


def attach(engine, cfg: "ZenConfig | dict") -> "ZenDeepSpeed":
    """Attach ZEN to an initialized DeepSpeed engine; returns the attachment (also ``engine.zen``).

    Raises:
        NotImplementedError: ZeRO-3, pipeline or sequence parallelism, MoE, or ZeRO-1/2 without the
            settings ``initialize`` writes (``reduce_scatter: false``).
    """
    if isinstance(cfg, dict):
        cfg = ZenConfig.from_dict(cfg)
    check_deepspeed_version()
    if getattr(engine, "zen", None) is not None:
        raise RuntimeError("zen: this engine already has ZEN attached")
    engine.zen = ZenDeepSpeed(engine, cfg)
    return engine.zen


def _off_reason(ds_config: dict) -> str:
    """Why ``initialize`` left an engine without ZEN, in the words a user needs."""
    if SECTION in ds_config:
        return 'the config\'s "zen" section has "enabled": false'
    near = near_miss_sections(ds_config)
    if near:
        return f'the config has no "zen" section (it has {", ".join(map(repr, near))}: a misspelling?)'
    return 'the config has no "zen" section'


def _mark_without_zen(engine, reason: str) -> None:
    """Let ``engine.zen`` on an engine without ZEN raise an AttributeError that says why.

    ``getattr(engine, "zen", None)`` still returns None (the idiom the recipes use); only a direct
    ``engine.zen.summary()`` gets the explanation instead of DeepSpeed's generic "object has no
    attribute 'zen'". DeepSpeedEngine.__getattr__ is wrapped once, for the name ``zen`` only.
    """
    cls = type(engine)
    engine.__dict__["_zen_off_reason"] = reason
    if getattr(cls.__getattr__, "_zen_ext_original", None) is not None:
        return
    original = cls.__getattr__

    @functools.wraps(original)
    def __getattr__(self, name):
        if name == "zen" and "_zen_off_reason" in self.__dict__:
            raise AttributeError(
                f"zen: ZEN is not attached to this {type(self).__name__}: {self.__dict__['_zen_off_reason']}; "
                f"DeepSpeed's dense all-reduce synchronized the gradients. Add a \"zen\" section to the config "
                f"given to zen_ext.deepspeed.initialize (or to deepspeed.initialize after "
                f"zen_ext.deepspeed.enable()); check with getattr(engine, \"zen\", None)")
        return original(self, name)

    __getattr__._zen_ext_original = original
    cls.__getattr__ = __getattr__


# --- the attachment -------------------------------------------------------------------------------------
class ZenDeepSpeed:
    """ZEN attached to one DeepSpeed engine: the Synchronizer, the overrides, statistics, checkpoints.

    1. Decide the DGC defaults that depend on the optimizer (``resolve_dgc_defaults``), and refuse
       what the overrides cannot serve (ZeRO-3, pipeline/sequence parallelism, MoE, ZeRO-1/2 with
       reduce-scatter, DGC with ZeRO-2 gradient accumulation).
    2. Groups: the data-parallel group (split by node when hierarchical) and the TP group.
    3. The Synchronizer and the BucketReducer around it (re-bucketing, TP-shared embedding rows, the
       fp16 non-finite guard).
    4. Install the instance overrides (reduction, step, checkpoints); rank 0 prints one line saying
       ZEN is on (engine, groups, scheme, what each sparsifier got, the DGC momentum choice).

    Args:
        engine: the ``DeepSpeedEngine``.
        cfg: the validated ``"zen"`` section.
    """

    def __init__(self, engine, cfg: ZenConfig) -> None:
        import torch.distributed as dist
        from deepspeed.utils import groups

        # Step 1: refuse what the overrides cannot serve; DGC defaults that depend on the optimizer.
        cfg, self.dgc_note = resolve_dgc_defaults(cfg, engine.optimizer)
        self.engine, self.cfg = engine, cfg
        self.stage = engine.zero_optimization_stage()
        # The ZeRO optimizer reduces its own buckets; everything else (ZeRO-0, fp16/bf16 wrappers, and
        # BF16_Optimizer, which bf16 + ZeRO-1 + fp32 grad accumulation builds) goes through the engine.
        self.zero_reduces = hasattr(engine.optimizer, "gradient_reduction_w_predivide") and hasattr(
            engine.optimizer, "ipg_buckets")
        check_deepspeed_settings({"zero_optimization": {"stage": self.stage},
                                  "sequence_parallel_size": getattr(engine, "sequence_parallel_size", 1)})
        if getattr(engine, "pipeline_parallelism", False):
            _refuse_pipeline_model(engine.module, force=True)
        if getattr(engine, "has_moe_layers", False):
            raise NotImplementedError("zen supports dense models (data and AutoTP tensor parallelism), not MoE "
                                      "expert parallelism")
        if self.zero_reduces and getattr(engine.optimizer, "reduce_scatter", False):
            raise NotImplementedError(
                "zen with ZeRO-1/2 needs zero_optimization.reduce_scatter = false (ZEN reduces the whole bucket "
                "itself); build the engine with zen_ext.deepspeed.initialize, or zen_ext.deepspeed.enable(), "
                "which set it")
        if (self.stage == 2 and cfg.dgc.enabled and engine.gradient_accumulation_steps() > 1):
            raise NotImplementedError(
                "zen with DGC supports ZeRO-2 only with gradient_accumulation_steps = 1: ZeRO-2 reduces every "
                "micro-batch, and DGC's momentum correction must run once per optimizer step; use ZeRO-1 "
                "(reduces once per step) or ZeRO-0")
        self.rank = dist.get_rank()
        self.op = "mean" if engine.gradient_average else "sum"

        # Step 2: groups. ZEN runs over the data-parallel group; DGC agrees thresholds over the TP group.
        self.dp_group = engine.optimizer.dp_process_group if self.zero_reduces else engine.seq_data_parallel_group
        self.dp_ranks = dist.get_process_group_ranks(self.dp_group)
        tp_size = engine.autotp_size() if hasattr(engine, "autotp_size") else 1
        self.tp_comm = (TorchCommunicator(groups.get_tensor_model_parallel_group(), cfg.exchange_impl)
                        if tp_size and tp_size > 1 else None)
        node = self._maybe_node_sharding(dist)
        sync_comm = TorchCommunicator(self._inter_group if node else self.dp_group, cfg.exchange_impl)

        # Step 3: the Synchronizer, routing each parameter by kind.
        self.names = {id(p): n for n, p in engine.module.named_parameters()}
        kinds, self.sync = build_synchronizer(engine.module, cfg, sync_comm=sync_comm, tp_comm=self.tp_comm,
                                              rank=self.rank)
        from deepspeed.runtime.utils import is_model_parallel_parameter

        tp_shared = frozenset(n for n, p in engine.module.named_parameters()
                              if kinds.get(n) == "natural" and p.dim() == 2 and not is_model_parallel_parameter(p))
        guard = TorchCommunicator(None) if engine.fp16_enabled() else None
        # zen.async_sync: pipeline the ZEN buckets of each engine bucket over a communication worker
        # (compress bucket k + 1 while k is on the wire); not with node sharding or a TP group, whose
        # collectives the compression itself needs.
        self.worker = None
        if cfg.async_sync and node is None and self.tp_comm is None:
            self.worker = CommWorker.acquire(sync_comm.group, engine.device)
        elif cfg.async_sync and self.rank == 0:
            log.info("zen: zen.async_sync does not pipeline buckets with %s (their collectives run on the "
                     "training thread); buckets are synchronized in turn",
                     "node sharding" if node is not None else "a tensor-parallel group")
        self.reducer = BucketReducer(self.sync, cap_bytes=cfg.bucket_cap_bytes, dp_size=len(self.dp_ranks),
                                     node=node, tp_comm=self.tp_comm, tp_shared=tp_shared, guard_comm=guard,
                                     worker=self.worker)
        # With ZeRO's overlap_comm the backward pass fills one IPG buffer while the other is reduced:
        # the worker then takes whole IPG buckets, and the backward pass goes on (_reduce_ipg_async).
        self.async_ipg_off = self._async_ipg_off_reason()
        self.async_ipg_buckets = 0
        self._ipg_last_job = None
        self._ipg_at_last_step = 0
        if self.worker is not None and self.zero_reduces and self.rank == 0:
            if self.async_ipg_off is None:
                log.info("zen: ZeRO overlap_comm with zen.async_sync: each full IPG bucket goes to the communication "
                         "worker while the backward pass fills the other IPG buffer")
            else:
                log.info("zen: ZeRO IPG buckets are reduced on the training thread (%s); zen.async_sync pipelines "
                         "the ZEN buckets inside each of them", self.async_ipg_off)
        self.stats = StepStats(self.rank, cfg.stats.jsonl_path, getattr(engine, "monitor", None))
        self.hierarchical = node is not None

        # Step 4: install the overrides.
        self._install()
        if self.rank == 0:
            log.info("zen: attached to DeepSpeed ZeRO-%d (dp=%d, tp=%d, hierarchical=%s, op=%s): %s", self.stage,
                     len(self.dp_ranks), tp_size or 1, self.hierarchical, self.op, cfg.to_dict())
            numels = {n: p.numel() for n, p in engine.module.named_parameters()}
            print(startup_line(f"DeepSpeed ZeRO-{self.stage} (dp={len(self.dp_ranks)}, tp={tp_size or 1}, "
                               f"hierarchical={self.hierarchical})", cfg, kinds, numels, self.dgc_note), flush=True)

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
        self.override_calls = 0
        self._calls_at_last_step = 0
        if self.zero_reduces:
            self._orig_reduction = eng.optimizer.gradient_reduction_w_predivide
            eng.optimizer.gradient_reduction_w_predivide = self._gradient_reduction_w_predivide
            if self.async_ipg_off is None:
                self._orig_reduce_ipg = eng.optimizer.reduce_ipg_grads
                eng.optimizer.reduce_ipg_grads = self._reduce_ipg_async
        else:
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

    def _ipg_slices(self, flat, bucket) -> list:
        """Where each parameter of a ZeRO IPG bucket lies in ``flat`` (the bucket's reduced tensor)."""
        opt = self.engine.optimizer
        named = [(self.names[id(opt.bit16_groups[i][j])], g) for (i, j, _), g in zip(bucket.params, bucket.grads)]
        return locate_slices([flat], named)

    def _reduce(self, flat, slices, comm_dtype, pipelined: bool = True) -> torch.Tensor:
        """Reduce ``flat`` in place, with values travelling in ``comm_dtype``; returns the comm tensor."""
        t0 = time.perf_counter()
        self.override_calls += 1
        work = flat if flat.dtype == comm_dtype else flat.to(comm_dtype)
        scale = getattr(self.engine.optimizer, "loss_scale", None) if self.engine.fp16_enabled() else None
        if scale is not None:  # DGC memory follows the fp16 loss scale (docs/sparsifiers.md)
            self.sync.set_grad_scale(scale)
        self.reducer.reduce_(work, slices, self.op, pipelined=pipelined)
        if work is not flat:
            flat.copy_(work)
        self.stats.add(reduce_s=time.perf_counter() - t0)
        return work

    # --- ZeRO overlap_comm: whole IPG buckets on the worker -------------------------------------------------
    def _async_ipg_off_reason(self) -> str | None:
        """Why the ZeRO IPG buckets cannot be handed to the worker whole, or None when they can.

        The hand-over needs DeepSpeed's double IPG buffer (``overlap_comm`` with contiguous gradients:
        the backward pass fills one buffer while the other is reduced) and the per-parameter copy into
        the gradient partition (``copy_grads_in_partition``), which the worker runs after the reduction;
        CPU offload and fp32 gradient accumulation of bf16 parameters copy through other paths.
        """
        opt = self.engine.optimizer
        if not self.cfg.async_sync:
            return "zen.async_sync is off"
        if self.worker is None:
            return "no communication worker (node sharding or a tensor-parallel group)"
        if not self.zero_reduces:
            return "not a ZeRO-1/2 optimizer"
        if not getattr(opt, "overlap_comm", False):
            return "zero_optimization.overlap_comm is false (one IPG buffer)"
        if not getattr(opt, "contiguous_gradients", False):
            return "zero_optimization.contiguous_gradients is false"
        if getattr(opt, "cpu_offload", False):
            return "ZeRO CPU offload"
        if getattr(opt, "zenflow", False):
            return "ZenFlow"
        use_compact = getattr(opt, "_use_compact_grad_partition_buffer", None)
        if use_compact is not None and any(use_compact(i) for i in range(len(opt.bit16_groups))):
            return "fp32 gradient accumulation of 16-bit parameters (compact gradient partitions)"
        missing = [a for a in ("ipg_buckets", "params_already_reduced", "is_param_in_current_partition",
                               "copy_grads_in_partition", "clear_grad_attribute", "extra_large_param_to_reduce",
                               "reduce_ipg_grads", "partition_gradients") if not hasattr(opt, a)]
        if missing:
            return f"this DeepSpeed's ZeRO optimizer lacks {', '.join(missing)}"
        return None

    def _reduce_ipg_async(self, comm_dtype=None):
        """ZeRO ``reduce_ipg_grads`` with ``overlap_comm`` and ``zen.async_sync``: the worker reduces the
        full IPG bucket and copies it into the gradient partition while the backward pass fills the
        other IPG buffer.

        1. A bucket that holds one oversized parameter (reduced from its own gradient, not the IPG
           buffer) goes DeepSpeed's blocking way, after the worker drained.
        2. Snapshot the bucket on this thread: its view of the IPG buffer, its parameters and their
           slices; mark them reduced and clear the bucket, as DeepSpeed does after reducing it (the
           backward pass refills it next).
        3. Hand the worker the reduction, then DeepSpeed's own per-parameter copy into the partition
           (``copy_grads_in_partition``) or release of a gradient outside it, in bucket order: the
           order and the operations of the blocking path, so results are bitwise equal.
        4. Wait for the job before it: its IPG buffer is the one the backward pass fills next. At the
           epilogue (no ``comm_dtype``) wait for every job, since the optimizer step reads them all.
        """
        from deepspeed.runtime.torch_autocast import sort_dtypes

        opt = self.engine.optimizer
        dtypes = sort_dtypes(list(opt.ipg_buckets.keys())) if comm_dtype is None else [comm_dtype]
        for dt in dtypes:
            bucket = opt.ipg_buckets[dt]
            # Step 1: an oversized parameter.
            if dt in opt.extra_large_param_to_reduce:
                self._wait_ipg_jobs()
                self._orig_reduce_ipg(comm_dtype=dt)
                continue
            if not bucket.params:
                bucket.clear()
                continue
            # Step 2: snapshot, bookkeeping.
            flat = bucket.buffer[bucket.index].narrow(0, 0, bucket.elements)
            members = [(opt.bit16_groups[i][j], i, pid) for i, j, pid in bucket.params]
            slices = self._ipg_slices(flat, bucket)
            for p, _, pid in members:
                if opt.params_already_reduced[pid]:
                    raise RuntimeError(f"zen: parameter {self.names[id(p)]} was handed to the gradient reduction "
                                       "twice in one step (DeepSpeed supports one reduction per parameter)")
                opt.params_already_reduced[pid] = True
            bucket.clear()
            # Step 3: the worker reduces and copies.
            self.async_ipg_buckets += 1
            job = self.worker.submit(functools.partial(self._finish_ipg, flat, slices, dt, members), [flat])
            # Step 4: the previous bucket's buffer is refilled next.
            prev, self._ipg_last_job = self._ipg_last_job, job
            if prev is not None:
                prev.wait()
        if comm_dtype is None:
            self._wait_ipg_jobs()

    def _finish_ipg(self, flat, slices, comm_dtype, members) -> torch.Tensor:
        """The worker's half of ``_reduce_ipg_async``: reduce ``flat`` in place (its ZEN buckets in turn:
        this already runs on the worker), then DeepSpeed's per-parameter step of ``reduce_ipg_grads``."""
        opt = self.engine.optimizer
        self._reduce(flat, slices, comm_dtype, pipelined=False)
        for p, group_idx, pid in members:
            mine = opt.is_param_in_current_partition[pid]
            if opt.partition_gradients and not mine:
                opt.clear_grad_attribute(p)  # ZeRO-2: another rank owns this gradient
            elif mine:
                opt.copy_grads_in_partition(p, group_idx)
        return flat

    def _wait_ipg_jobs(self) -> None:
        """Wait for every IPG bucket handed to the worker (FIFO: the last one implies the others);
        re-raises a job's failure (CUDA: the current stream then waits on the worker's)."""
        job, self._ipg_last_job = self._ipg_last_job, None
        if job is not None:
            job.wait()

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
        boundary = eng.is_gradient_accumulation_boundary() or not eng.managed_gradient_accumulation()
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
                f"by ZEN. Supported: deepspeed {VERIFIED_DEEPSPEED[0]}..{VERIFIED_DEEPSPEED[1]}")
        self._calls_at_last_step = self.override_calls
        self.sync.end_step()
        rec = self.reducer.pop_stats()
        if self.async_ipg_off is None:
            rec["async_ipg_buckets"] = self.async_ipg_buckets - self._ipg_at_last_step
            self._ipg_at_last_step = self.async_ipg_buckets
        return self.stats.end_step(self.engine.global_steps, rec, getattr(self.engine, "global_samples", None))

    def annotate(self, **values) -> None:
        """Add fields (e.g. ``loss``) to the current step's statistics record."""
        self.stats.annotate(**values)

    @property
    def totals(self) -> dict:
        """This rank's totals so far (bytes_sent, dense_bytes, ...)."""
        return dict(self.stats.totals)

    def summary(self, print_it: bool | None = None) -> str:
        """Gather every rank's totals (a collective: call it on all ranks) and return the summary text;
        rank 0 prints it when ``zen.stats.summary`` is on."""
        import torch.distributed as dist

        totals = _all_gather_object(dist, {**self.stats.totals, "losses": self.stats.losses})
        return summary_text(self.stats, self.cfg, self.sync, self.rank, totals,
                            f"ZeRO-{self.stage} hierarchical={self.hierarchical}", print_it)

    def close(self) -> None:
        """Flush the statistics and release the communication worker (idempotent)."""
        self.stats.close()
        worker, self.worker = getattr(self, "worker", None), None
        if worker is not None:
            self._ipg_last_job = None  # release() drains the queue, its jobs included
            worker.release()
            self.reducer.worker = None

    # --- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"sync": self.sync.state_dict(), "dp_size": len(self.dp_ranks), "rank": self.rank,
                "config": self.cfg.to_dict()}

    def load_state_dict(self, sd: dict, why: str = "") -> None:
        """Restore ``state_dict()``: all of it at the same data-parallel size; on a resize (or from
        another rank's file, ``why``) only what the ranks share: the step counter (DGC warm-up) and the
        planner's state, while DGC residuals, momenta and thresholds restart (one warning)."""
        restore_sync_state(self.sync, sd, len(self.dp_ranks), why, logger=log)

    def _state_path(self, root: str, tag) -> str:
        return os.path.join(root, str(tag), STATE_DIRNAME, f"rank{self.rank:05d}.pt")

    def _save_checkpoint(self, save_dir, tag=None, *args, **kwargs):
        if tag is None:  # DeepSpeed's default tag, resolved before it increments anything
            tag = f"global_step{self.engine.global_steps}"
        out = self._orig_save(save_dir, tag, *args, **kwargs)
        path = self._state_path(save_dir, tag)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.state_dict(), path)
        return out

    def _load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        load_path, client_state = self._orig_load(load_dir, tag, *args, **kwargs)
        if load_path is None:
            return load_path, client_state
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        path = self._state_path(load_dir, tag)
        first = os.path.join(load_dir, str(tag), STATE_DIRNAME, "rank00000.pt")
        mine = torch.load(path, map_location="cpu", weights_only=True) if os.path.isfile(path) else None
        if mine is not None and mine.get("dp_size") == len(self.dp_ranks):
            self.load_state_dict(mine)
        elif os.path.isfile(first):
            # A resize: every rank takes the shared part (step counter, planner) from rank 0's file, so
            # all ranks resume alike (a rank without a file of its own would otherwise restart at step 0).
            sd = torch.load(first, map_location="cpu", weights_only=True)
            why = (("" if mine is not None else f"no ZEN state was saved for rank {self.rank}, and ")
                   + f"the checkpoint was saved with dp_size {sd.get('dp_size')}, now {len(self.dp_ranks)}")
            self.load_state_dict(sd, why=why)
        else:
            log.warning("zen: no ZEN state at %s (a checkpoint without ZEN?): DGC residuals start fresh", path)
        return load_path, client_state


# --- helpers -------------------------------------------------------------------------------------------
def _all_gather_object(dist, obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rewrite_zero_settings(ds_config: dict) -> None:
    zero = ds_config.setdefault("zero_optimization", {})
    if zero.get("stage", 0) in (1, 2):
        for key, value in (("reduce_scatter", False), ("contiguous_gradients", True)):
            if zero.get(key, None) not in (None, value):
                log.warning("zen: setting zero_optimization.%s = %s (was %s): ZEN reduces whole buckets",
                            key, value, zero[key])
            zero[key] = value


def _refuse_pipeline_model(model, force: bool = False) -> None:
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # pragma: no cover
        PipelineModule = ()
    if force or isinstance(model, PipelineModule):
        raise NotImplementedError("zen supports data parallelism and AutoTP tensor + data parallelism, not pipeline "
                                  "parallelism (PipelineModule); remove \"zen\" or run without pipeline stages")
