"""ZEN for torch FSDP2 (``fully_shard``): a ZEN reduce-scatter set on every FSDP module.

FSDP2 reduces each FSDP module's gradients with one reduce-scatter and lets a user replace it
(``FSDPModule.set_custom_reduce_scatter``, torch ≥ 2.8). ``attach`` sets a ``ZenReduceScatter`` on
every FSDP module of the model. FSDP calls it with a flat input of ``N`` elements in its chunk layout,
``[world_size, N / world_size]``: row ``r`` is rank ``r``'s dim-0 chunk of every parameter of the
module, in parameter order, each parameter's dim 0 padded to a multiple of the world size. Rank ``r``
owns row ``r``, a contiguous range of the flat input, so the reduction is a reduce-scatter over
those ranges: ``chunk_layout`` maps the layout back to named slices once per layout (a parameter is
``world_size`` slices, one per chunk, each whole embedding rows; padding is covered by no slice),
and the Synchronizer reduces it (natural rows per slice, DGC per slice with memory keyed by name and
offset, the rest dense) with the configured scheme's reduce-scatter, straight into FSDP's output.

FSDP applies its pre-divide factor before the call and passes ``op``: ``AVG`` (fp32, bf16) becomes
ZEN's mean, ``SUM`` its sum, ``PREMUL_SUM(f)`` multiplies the input by ``f`` first (as NCCL does)
and sums. FSDP records an event on the current stream right after the call returns, so the
reduction runs on the calling thread and queues its GPU work on the current stream (no
communication worker). One FSDP module's gradients are one ZEN bucket (``zen.bucket_cap_mb`` does
not apply). A backward pass that reduced is one ZEN step (DGC's warm-up), closed by a callback at
the end of that backward pass.

Served: one 1-D device mesh (FSDP's reduce-scatter over all data-parallel ranks), one parameter
group per FSDP module, ``Shard(0)`` placements; every parameter that requires a gradient gets one in
each backward pass that reduces (or ``set_reduce_scatter_unused_params(True)``).
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig, load_json_config, resolve_dgc_defaults
from ..core.reduce_scatter import even_ranges
from ..reduction.assembly import build_synchronizer
from ..reduction.attachment import ZenAttachment
from ..reduction.stats import StepStats, startup_line
from ..reduction.synchronizer import GradSlice

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED", "ZenFSDP", "ZenReduceScatter", "attach", "chunk_layout"]

SUPPORTED = ("FSDP2 fully_shard on a 1-D device mesh (every data-parallel rank shards), one parameter group "
             "per fully_shard call (no per-parameter mesh from shard_placement_fn), Shard(0) placements")
"""What ``attach`` serves, named in its errors."""


def chunk_layout(params: list[tuple[str, tuple[int, ...]]], world: int) -> tuple[list[GradSlice], int]:
    """FSDP's reduce-scatter input layout as named slices.

    Args:
        params: ``(name, unsharded shape)`` of the parameters FSDP reduces, in its order.
        world: the reduce-scatter group's size.

    Returns:
        ``(slices, numel)``: one slice per parameter and chunk that holds any of its rows (shaped as
        its whole rows, ``start`` its offset inside the parameter), sorted by offset; ``numel`` the
        input's elements. Rank ``r`` owns ``[r·numel/world, (r+1)·numel/world)``.
    """
    per_chunk = []  # (name, shape, rows per chunk, row width)
    for name, shape in params:
        if len(shape) == 0:
            raise NotImplementedError(f"zen_ext.fsdp: parameter {name} is 0-dimensional; FSDP2 shards along dim 0")
        width = math.prod(shape[1:])
        per_chunk.append((name, tuple(shape), -(-shape[0] // world), width))
    row_numel = sum(rows * width for _, _, rows, width in per_chunk)
    slices = []
    for r in range(world):
        offset = r * row_numel
        for name, shape, rows, width in per_chunk:
            real = max(0, min(rows, shape[0] - r * rows))  # the last chunks hold padding or nothing
            if real:
                slices.append(GradSlice(name, offset, real * width, (real, *shape[1:]), start=r * rows * width))
            offset += rows * width
    return slices, row_numel * world


def _reduce_op(op) -> tuple[str, float | None]:
    """FSDP's reduce op as ZEN's (``"mean"`` / ``"sum"``) and a factor to multiply the input by first."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) carries its type in .op
    if kind == dist.ReduceOp.AVG:
        return "mean", None
    if kind == dist.ReduceOp.SUM:
        return "sum", None
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = op.factor
        return "sum", float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    raise NotImplementedError(f"zen_ext.fsdp: FSDP passed reduce op {kind}; ZEN serves AVG, SUM and PREMUL_SUM")


def _reduce_scatter_base():
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class ZenReduceScatter(_reduce_scatter_base()):
    """The reduce-scatter set on one FSDP module: its parameters' names and shapes, the attachment."""

    def __init__(self, attachment: "ZenFSDP", module_name: str, params: list[tuple[str, tuple[int, ...]]]) -> None:
        self.attachment = attachment  # FSDP keeps this object, so the model keeps the attachment alive
        self.module_name = module_name
        self.params = params
        self.layouts: dict[int, list[GradSlice]] = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        self.attachment.reduce_scatter(self, output_tensor, input_tensor, group, op)
        return None

    def slices_for(self, numel: int, world: int) -> list[GradSlice]:
        """The named slices of an input of ``numel`` elements (cached per size)."""
        slices = self.layouts.get(numel)
        if slices is None:
            slices, expected = chunk_layout(self.params, world)
            if numel != expected:
                raise RuntimeError(
                    f"zen_ext.fsdp: FSDP reduced {numel} elements for module {self.module_name or '<root>'}, but its "
                    f"parameters that require gradients ({', '.join(n for n, _ in self.params)}) make {expected}: some "
                    f"got no gradient in this backward pass. ZEN needs every one of them reduced: call "
                    f"set_reduce_scatter_unused_params(True) on the model (unused parameters then reduce zeros)")
            self.layouts[numel] = slices
        return slices


class ZenFSDP(ZenAttachment):
    """What ZEN keeps for an FSDP2 model: the Synchronizer over the shard group, statistics, steps.

    Build it with ``attach``. ``summary()``, ``state_dict()`` / ``load_state_dict()`` (DGC residuals
    keyed by parameter name and chunk offset, one per rank) and ``annotate`` come from
    ``ZenAttachment``; ``close()`` at the end.
    """

    __slots__ = ("cfg", "rank", "dp_size", "sync", "stats", "worker", "group", "comms", "step", "reduce_calls",
                 "_t_step", "_step_open", "closed")

    log_name = log.name

    def __init__(self, *, cfg: ZenConfig, group, sync, stats: StepStats, rank: int) -> None:
        self.cfg, self.group, self.sync, self.stats, self.rank = cfg, group, sync, stats, rank
        self.dp_size = sync.dp_comm.size
        self.worker = None  # FSDP records its event right after the call: no work may stay on a thread
        self.comms: list[ZenReduceScatter] = []
        self.step = self.reduce_calls = 0
        self._t_step = 0.0
        self._step_open = False
        self.closed = False

    @property
    def summary_label(self) -> str:
        return f"FSDP2 dp={self.dp_size}"

    # --- per call -------------------------------------------------------------------------------------
    def reduce_scatter(self, comm: ZenReduceScatter, out: torch.Tensor, flat: torch.Tensor, group, op) -> None:
        """FSDP's reduce-scatter of one module: ``out`` gets this rank's row of the reduced ``flat``.

        1. Check the group and map the layout to named slices (once per layout).
        2. Turn FSDP's op into ZEN's (``PREMUL_SUM``'s factor multiplies the input, as NCCL does).
        3. Reduce-scatter with the Synchronizer into ``out``; open the step's end-of-backward callback.
        """
        if self.closed:
            raise RuntimeError("zen_ext.fsdp: the ZEN attachment was closed (close() ends training); attach again "
                               "to a newly sharded model to train")
        t0 = time.perf_counter()
        # Step 1: group and layout.
        if group is not self.group:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP reduce-scattered over a group other than its mesh's shard "
                                      f"group (set_separate_reduce_scatter_group?); supported: {SUPPORTED}")
        n = self.dp_size
        slices = comm.slices_for(flat.numel(), n)
        # Step 2: the op.
        zen_op, factor = _reduce_op(op)
        if factor is not None and factor != 1.0:
            flat.mul_(factor)
        # Step 3: the reduction, and the step's end.
        self.sync.reduce_scatter_flat(flat, slices, even_ranges(flat.numel(), n), zen_op, out=out)
        self.reduce_calls += 1
        self._t_step += time.perf_counter() - t0
        if not self._step_open:
            self._step_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_step)

    # --- per step -------------------------------------------------------------------------------------
    def end_step(self) -> dict:
        """Close a backward pass that reduced: advance the Synchronizer (DGC warm-up), write the record."""
        self._step_open = False
        self.step += 1
        self.sync.end_step()
        sync = self.sync.pop_step_stats()
        rec = {k: v for k, v in sync.items() if k not in ("bytes_sent", "bytes_recv", "dense_bytes_sent")}
        rec.update(bytes_sent=sync["bytes_sent"], dp_bytes_sent=sync["bytes_sent"], dp_bytes_recv=sync["bytes_recv"],
                   dense_bytes=sync["dense_bytes_sent"], reduce_s=self._t_step, reduce_calls=self.reduce_calls)
        self._t_step, self.reduce_calls = 0.0, 0
        return self.stats.end_step(self.step, rec)

    def close(self) -> None:
        """End of training: close the statistics file and drop the Synchronizer (and with it the process
        group's references); the reduce-scatter refuses to run afterwards. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._release()
        self.sync = None

    def _extra_state(self) -> dict:
        return {"step": self.step}

    def _load_extra_state(self, sd: dict) -> None:
        self.step = int(sd.get("step", 0))


def _load_section(config) -> ZenConfig:
    """The ``"zen"`` section from a ZenConfig, a dict, or a JSON path (the section itself, or a run
    config with a top-level ``"zen"`` key)."""
    if isinstance(config, ZenConfig):
        return config
    if config is None or isinstance(config, dict):
        return ZenConfig.from_dict(config)
    section = load_json_config(config)
    return ZenConfig.from_json_section(section["zen"] if "zen" in section else section)


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(name, module, param group)`` of every FSDP module that holds trainable parameters; refuses
    what ``attach`` does not serve."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
    from torch.distributed.tensor import Shard

    found, any_fsdp = [], False
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        any_fsdp = True
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {name or '<root>'} has {len(groups)} parameter groups "
                                      f"(parameters on several meshes); supported: {SUPPORTED}")
        if not groups:
            continue
        pg, where = groups[0], name or "<root>"
        mesh = pg.mesh_info.mesh
        if mesh.ndim != 1 or isinstance(pg.mesh_info, DDPMeshInfo) or not isinstance(pg.mesh_info, FSDPMeshInfo):
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} is sharded over a {mesh.ndim}-D mesh or "
                                      f"replicates (HSDP, replicate); supported: {SUPPORTED}")
        spmd = getattr(pg.mesh_info, "spmd_mesh", None)
        if spmd is not None and spmd.ndim > 1:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} holds parameters on a {spmd.ndim}-D mesh "
                                      f"(FSDP with tensor parallelism); supported: {SUPPORTED}")
        for fp in pg.fsdp_params:
            if fp.fsdp_placement != Shard(0):
                raise NotImplementedError(f"zen_ext.fsdp: a parameter of FSDP module {where} is placed "
                                          f"Shard({fp.fsdp_placement.dim}) (shard_placement_fn); supported: {SUPPORTED}")
        found.append((name, module, pg))
    if not any_fsdp:
        raise ValueError(f"zen_ext.fsdp.attach needs a model with fully_shard applied ({type(model).__name__} has no "
                         f"FSDP module): call fully_shard on its layers and on the model first")
    return found


def attach(model: torch.nn.Module, config=None, *, optimizer=None) -> ZenFSDP:
    """Set ZEN's reduce-scatter on every FSDP module of ``model``; returns the attachment.

    Call it after the ``fully_shard`` calls and before the first backward::

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        zen = zen_ext.fsdp.attach(model, {"dgc": {"enabled": True, "density": 0.05}})

    1. Read the ``"zen"`` section and find the FSDP modules, refusing what is not served (``SUPPORTED``).
    2. Route each parameter (natural / dgc / dense) and build the Synchronizer over the shard group.
    3. Set a ``ZenReduceScatter`` on each FSDP module with trainable parameters.

    Args:
        model: the root module after ``fully_shard`` (parameter names key all of ZEN's state).
        config: the ``"zen"`` section: a dict, a ZenConfig, a JSON file path (the section, or a
            config with a ``"zen"`` key), or None for the defaults (natural rows, lossless).
        optimizer: the training optimizer, from which a null ``zen.dgc.momentum_correction`` is decided.

    Raises:
        ValueError, TypeError: an invalid section, ``zen.enabled`` false, or a model without ``fully_shard``.
        NotImplementedError: HSDP / a 2-D mesh, several parameter groups in one FSDP module, a
            placement other than ``Shard(0)``, ``zen.hierarchical`` true, or a custom reduce-scatter
            already set.
    """
    # Step 1: configuration and the FSDP modules.
    cfg = _load_section(config)
    if not cfg.enabled:
        raise ValueError("zen.enabled (False) must be true to attach ZEN; skip attach to keep FSDP's reduce-scatter")
    if cfg.hierarchical is True:
        raise NotImplementedError("zen.hierarchical (True) must be false or \"auto\" with FSDP2: node-sharded "
                                  "reduction is implemented for zen_ext.deepspeed only")
    if not dist.is_initialized():
        raise RuntimeError("zen_ext.fsdp.attach needs torch.distributed initialized (fully_shard does too)")
    modules = _fsdp_modules(model)
    groups = {id(pg.mesh_info.shard_process_group) for _, _, pg in modules}
    if len(groups) > 1:
        raise NotImplementedError(f"zen_ext.fsdp: the FSDP modules shard over {len(groups)} different groups; "
                                  f"supported: {SUPPORTED}, all on one mesh")
    for name, _, pg in modules:
        if type(pg._reduce_scatter_comm).__name__ not in ("DefaultReduceScatter", "ProcessGroupAllocReduceScatter"):
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {name or '<root>'} already has a custom reduce-scatter "
                                      f"({type(pg._reduce_scatter_comm).__name__}); attach once, to a model without one")
    group = modules[0][2].mesh_info.shard_process_group if modules else dist.group.WORLD
    rank = dist.get_rank()
    if optimizer is None and cfg.dgc.enabled and cfg.dgc.momentum_correction is None and rank == 0:
        log.warning("zen: zen.dgc.momentum_correction is null and no optimizer was given: using false (plain error "
                    "feedback, right for Adam and momentum-SGD); pass optimizer= to attach")
    cfg, dgc_note = resolve_dgc_defaults(cfg, optimizer)
    # Step 2: routing and the Synchronizer.
    comm = TorchCommunicator(group, cfg.exchange_impl)
    kinds, sync = build_synchronizer(model, cfg, sync_comm=comm, tp_comm=None, rank=rank)
    sync.rs_scheme = cfg.build_reduce_scatter()  # NotImplementedError now for a scheme without one
    readers = sorted(getattr(sync, "_after_sync", ()))
    if readers:
        raise NotImplementedError(f"zen_ext.fsdp: sparsifier(s) {readers} read the synchronized gradient back "
                                  f"(e.g. zen.dgc.feedback \"ef21\"), but an FSDP rank holds only its shard; "
                                  f"supported: natural rows and DGC with error feedback (\"ef\")")
    zen = ZenFSDP(cfg=cfg, group=group, sync=sync, stats=StepStats(rank, cfg.stats.jsonl_path), rank=rank)
    if cfg.async_sync and rank == 0:
        log.info("zen: zen.async_sync is off with FSDP2: FSDP records its event when the reduce-scatter returns")
    # Step 3: a reduce-scatter per FSDP module.
    names = {id(p): n for n, p in model.named_parameters()}
    for name, module, pg in modules:
        params = [(names[id(fp.sharded_param)], tuple(fp._orig_size)) for fp in pg.fsdp_params
                  if fp.sharded_param.requires_grad]
        if params:
            rs = ZenReduceScatter(zen, name, params)
            module.set_custom_reduce_scatter(rs)
            zen.comms.append(rs)
    if rank == 0:
        print(startup_line(f"FSDP2 (dp={comm.size}, {len(zen.comms)} FSDP modules)", cfg, kinds,
                           {n: p.numel() for n, p in model.named_parameters()}, dgc_note), flush=True)
    return zen
