"""ZEN for torch FSDP2 (``fully_shard``): a ZEN reduce-scatter set on every FSDP module.

FSDP2 reduces each FSDP module's gradients with one reduce-scatter, which a user may replace
(``FSDPModule.set_custom_reduce_scatter``). FSDP calls it with a flat input of ``N`` elements in its
chunk layout ``[world_size, N / world_size]``: row ``r`` is rank ``r``'s dim-0 chunk of every
parameter of the module, in order, each dim 0 padded to a multiple of the world size. Rank ``r`` owns
row ``r``, so this is a reduce-scatter over even contiguous ranges: ``chunk_layout`` maps the layout
to named slices once per layout (a parameter is one slice per chunk, whole rows, ``start`` its offset
in the parameter; padding is in no slice), and ``BucketReducer.reduce_scatter_`` routes them as the
all-reduce adapters do (natural rows and DGC per slice, the rest dense) through the configured
scheme's reduce-scatter, straight into FSDP's output.

FSDP pre-divides before the call and passes ``op``: ``AVG`` becomes ZEN's mean, ``SUM`` its sum,
``PREMUL_SUM(f)`` multiplies the input by ``f`` (as NCCL does) and sums. FSDP records an event on the
current stream as soon as the call returns, so the reduction runs on the calling thread with its GPU
work on the current stream (no communication worker). A backward pass that reduced is one ZEN step
(DGC's warm-up), closed by an autograd callback at its end.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig, load_json_config
from ..core.rs_base import even_ranges
from ..reduction.attachment import Assembled, ZenAttachment, assemble
from ..reduction.hierarchy import maybe_node_sharding
from ..reduction.slices import piece_slices
from ..reduction.stats import startup_line
from ..reduction.synchronizer import GradSlice
from .fsdp_compat import ReduceScatter, check_fsdp_internals
from .fsdp_steps import AccumulationWatch, FSDPSteps

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED", "ZenFSDP", "ZenFSDPReduceScatter", "attach", "chunk_layout"]

SUPPORTED = ("FSDP2 fully_shard on a 1-D device mesh (every data-parallel rank shards), or HSDP on a 2-D "
             "(\"replicate\", \"shard\") mesh spanning every rank with a replicate dim of size >= 2 "
             "(zen_ext.fsdp.attach: ZEN all-reduces each shard across the replicas), one parameter group "
             "per fully_shard call (no per-parameter mesh from shard_placement_fn), Shard(0) placements")
"""What ``attach`` serves, named in its errors."""


def chunk_layout(params: list[tuple[str, tuple[int, ...]]], world: int) -> tuple[list[GradSlice], int]:
    """FSDP's reduce-scatter input layout as named slices.

    Args:
        params: ``(name, unsharded shape)`` of the parameters FSDP reduces, in its order.
        world: the reduce-scatter group's size.

    Returns:
        ``(slices, numel)``: one slice per parameter and chunk that holds any of its rows
        (``reduction.slices.piece_slices``: shaped as its whole rows, 1-D where rows are single
        elements; ``start`` its offset inside the parameter), sorted by offset; ``numel`` the input's
        elements. Rank ``r`` owns ``[r·numel/world, (r+1)·numel/world)``.
    """
    per_chunk = []  # (name, shape, rows per chunk, row width)
    for name, shape in params:
        width = math.prod(shape[1:])
        per_chunk.append((name, tuple(shape), -(-shape[0] // world), width))
    row_numel = sum(rows * width for _, _, rows, width in per_chunk)
    slices = []
    for r in range(world):
        offset = r * row_numel
        for name, shape, rows, width in per_chunk:
            real = max(0, min(rows, shape[0] - r * rows))  # the last chunks hold padding or nothing
            if real:  # whole rows: one row-form slice (1-D for rows of single elements)
                slices.extend(piece_slices(name, shape, r * rows * width, real * width, offset))
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
        return "sum", float(op.factor.item() if isinstance(op.factor, torch.Tensor) else op.factor)
    raise NotImplementedError(f"zen_ext.fsdp: FSDP passed reduce op {kind}; ZEN serves AVG, SUM and PREMUL_SUM")


class ZenFSDPReduceScatter(ReduceScatter):
    """FSDP2's ``ReduceScatter`` comm object set on one FSDP module (``set_custom_reduce_scatter``): its
    parameters' names and shapes, the attachment that reduces. Not a ReduceScatterScheme: the scheme it
    ends in is the Synchronizer's (``core/rs_zen.py`` ``ZenReduceScatter`` for ``zen``)."""

    def __init__(self, attachment: "ZenFSDP", module_name: str, params: list[tuple[str, tuple[int, ...]]]) -> None:
        self.attachment = attachment  # FSDP keeps this object, so the model keeps the attachment alive
        self.module_name, self.params = module_name, params
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
    """What ZEN keeps for an FSDP2 model (built by ``attach``): the reducer over the shard group, statistics,
    steps (``FSDPSteps``). ``summary()``, ``state_dict()`` / ``load_state_dict()`` (DGC residuals keyed by
    parameter name and chunk offset, per rank) and ``annotate`` come from ``ZenAttachment``; ``close()`` at
    the end."""

    __slots__ = ("cfg", "rank", "dp_size", "sync", "reducer", "stats", "worker", "group", "comms", "steps")

    log_name = log.name

    def __init__(self, *, cfg: ZenConfig, group, built: Assembled, rank: int, accumulation: AccumulationWatch) -> None:
        self.cfg, self.group, self.rank = cfg, group, rank
        self.sync, self.reducer, self.stats = built.sync, built.reducer, built.stats
        self.stats.dense_name = "FSDP's dense reduce-scatter"
        self.dp_size = built.reducer.dp_size  # the whole shard group, also when the Synchronizer's is across nodes
        self.worker = None  # FSDP records its event right after the call: no work may stay on a thread
        self.comms: list[ZenFSDPReduceScatter] = []
        self.steps = FSDPSteps(built.sync, built.reducer, built.stats, accumulation)

    @property
    def summary_label(self) -> str:
        return f"FSDP2 dp={self.dp_size}"

    @property
    def step(self) -> int:
        """Backward passes that reduced (ZEN steps)."""
        return self.steps.step

    @property
    def accumulation(self) -> AccumulationWatch:
        return self.steps.accumulation

    def install(self, name: str, module, params: list[tuple[str, tuple[int, ...]]]) -> None:
        """Set ZEN's reduce-scatter on the FSDP module ``name`` (its trainable ``params``: names, unsharded shapes)."""
        rs = ZenFSDPReduceScatter(self, name, params)
        module.set_custom_reduce_scatter(rs)
        self.comms.append(rs)

    # --- per call -------------------------------------------------------------------------------------
    def reduce_scatter(self, comm: ZenFSDPReduceScatter, out: torch.Tensor, flat: torch.Tensor, group, op) -> None:
        """FSDP's reduce-scatter of one module: ``out`` gets this rank's row of the reduced ``flat``.

        1. Check the group and map the layout to named slices (once per layout); refuse a DGC step
           accumulated across reduce-scatters (``fsdp_steps.AccumulationWatch``).
        2. Turn FSDP's op into ZEN's (``PREMUL_SUM``'s factor multiplies the input, as NCCL does).
        3. Reduce-scatter into ``out`` (``BucketReducer.reduce_scatter_``: the non-finite guard, windows of
           ``zen.bucket_cap_mb``, the Synchronizer's routing); the step's end is queued (``FSDPSteps``).
        """
        t0 = self.steps.start()
        # Step 1: group and layout.
        if group is not self.group:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP reduce-scattered over a group other than its mesh's shard "
                                      f"group (set_separate_reduce_scatter_group?); supported: {SUPPORTED}")
        slices = comm.slices_for(flat.numel(), self.dp_size)
        self.steps.watch(n for n, _ in comm.params)
        # Step 2: the op.
        zen_op, factor = _reduce_op(op)
        if factor is not None and factor != 1.0:
            flat.mul_(factor)
        # Step 3: the reduction, and the step's end.
        self.reducer.reduce_scatter_(flat, slices, even_ranges(flat.numel(), self.dp_size), zen_op, out)
        self.steps.done(t0)

    # --- per step -------------------------------------------------------------------------------------
    def end_step(self) -> dict:
        """Close a backward pass that reduced (``FSDPSteps.end_step``; autograd calls it)."""
        return self.steps.end_step()

    def close(self) -> None:
        """End of training: close the statistics file and drop the Synchronizer (and with it the process
        group's references); the reduce-scatter refuses to run afterwards. Idempotent."""
        if self.steps.closed:
            return
        self.steps.close()
        self._release()
        self.sync = self.reducer = None

    def _extra_state(self) -> dict:  # ZenAttachment.state_dict's own entries
        return {"step": self.step}

    def _load_extra_state(self, sd: dict) -> None:
        self.steps.step = int(sd.get("step", 0))


def check_shard0(pg, where: str) -> None:
    """Refuse a parameter group with a placement other than ``Shard(0)`` (``shard_placement_fn``): the
    chunk layout (``chunk_layout``) cuts whole rows of dim 0."""
    from torch.distributed.tensor import Shard

    for fp in pg.fsdp_params:
        if fp.fsdp_placement != Shard(0):
            raise NotImplementedError(f"zen_ext.fsdp: a parameter of FSDP module {where} is placed Shard("
                                      f"{fp.fsdp_placement.dim}) (shard_placement_fn); supported: {SUPPORTED}")


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(name, module, param group)`` of every FSDP module that holds trainable parameters; refuses
    what ``attach`` does not serve."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(f"zen_ext.fsdp.attach needs a model with fully_shard applied ({type(model).__name__} has no "
                         f"FSDP module): call fully_shard on its layers and on the model first")
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {name or '<root>'} has {len(groups)} parameter "
                                      f"groups (parameters on several meshes); supported: {SUPPORTED}")
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
        check_shard0(pg, where)
        custom = type(pg._reduce_scatter_comm).__name__
        if custom not in ("DefaultReduceScatter", "ProcessGroupAllocReduceScatter"):
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} already has a custom reduce-scatter "
                                      f"({custom}); attach once, to a model without one")
        found.append((name, module, pg))
    if len({id(pg.mesh_info.shard_process_group) for _, _, pg in found}) > 1:
        raise NotImplementedError(f"zen_ext.fsdp: the FSDP modules shard over different groups; supported: {SUPPORTED}")
    return found


def attach(model: torch.nn.Module, config=None, *, optimizer=None, guard_nonfinite: bool = False) -> ZenFSDP:
    """Set ZEN's reduce-scatter on every FSDP module of ``model``; returns the attachment.

    Call it after the ``fully_shard`` calls and before the first backward (docs/fsdp.md).

    1. Read the ``"zen"`` section and find the FSDP modules, refusing what is not served (``SUPPORTED``).
    2. Route each parameter (natural / dgc / dense) and build the Synchronizer over the shard group.
    3. Set a ``ZenFSDPReduceScatter`` on each FSDP module with trainable parameters.

    Args:
        model: the root module after ``fully_shard`` (parameter names key all of ZEN's state).
        config: the ``"zen"`` section: a dict, a ZenConfig, a JSON file path (the section, or a
            config with a ``"zen"`` key), or None for the defaults (natural rows, lossless).
        optimizer: the training optimizer, from which a null ``zen.dgc.momentum_correction`` is decided.
        guard_nonfinite: a NaN/Inf gradient on any rank NaN-fills every rank's shard instead of being
            reduced (and DGC's memory is left alone), so a loss scaler sees the overflow DGC could drop.

    Raises:
        ValueError, TypeError: an invalid section, ``zen.enabled`` false, or a model without ``fully_shard``.
        NotImplementedError: what is not ``SUPPORTED`` (HSDP, several parameter groups in a module, ...),
            a scheme without a reduce-scatter form, ``zen.hierarchical`` true where the shard group does
            not span several equal multi-rank nodes (also ValueError), a sparsifier that reads the
            synchronized gradient back, or attaching twice.
    """
    # Step 1: configuration and the FSDP modules.
    if isinstance(config, (str, os.PathLike)):  # the section itself, or a run config with a "zen" key
        section = load_json_config(config)
        config = ZenConfig.from_json_section(section["zen"] if "zen" in section else section)
    cfg = config if isinstance(config, ZenConfig) else ZenConfig.from_dict(config)
    if not cfg.enabled:
        raise ValueError("zen.enabled (False) must be true to attach ZEN; skip attach to keep FSDP's reduce-scatter")
    if not dist.is_initialized():
        raise RuntimeError("zen_ext.fsdp.attach needs torch.distributed initialized (fully_shard does too)")
    check_fsdp_internals(model)  # a torch the tests did not run, or one without an internal read below
    modules = _fsdp_modules(model)
    group = modules[0][2].mesh_info.shard_process_group if modules else dist.group.WORLD
    rank = dist.get_rank()
    cfg, dgc_note = cfg.resolve_defaults(optimizer, quiet=rank != 0)  # the start-up line says what it chose
    # Step 2: node-level or flat (zen.hierarchical, reduction/node_scatter.py), routing and the Synchronizer.
    dp_ranks = dist.get_process_group_ranks(group)
    node, inter, _ = maybe_node_sharding(cfg.hierarchical, dp_ranks, rank, log)
    comm = TorchCommunicator(inter if node is not None else group, cfg.exchange_impl)
    built = assemble(model, cfg, sync_comm=comm, tp_comm=None, rank=rank, dp_size=len(dp_ranks), node=node,
                     device=next((p.device for p in model.parameters()), torch.device("cpu")),
                     guard_comm=TorchCommunicator(group) if guard_nonfinite else None, worker_in_reducer=False,
                     worker_off="FSDP2 (it records its event when the reduce-scatter returns)")
    _ = built.sync.rs_scheme  # built now: NotImplementedError for a scheme without a reduce-scatter form
    readers = built.sync.after_sync_kinds
    if readers:
        raise NotImplementedError(f"zen_ext.fsdp: sparsifier(s) {readers} read the synchronized gradient back "
                                  f"(after_sync), but an FSDP rank holds only its shard; "
                                  f"supported: sparsifiers without after_sync (natural rows, DGC)")
    zen = ZenFSDP(cfg=cfg, group=group, built=built, rank=rank,
                  accumulation=AccumulationWatch(model, built.sync.param_kinds))
    # Step 3: a reduce-scatter per FSDP module.
    names = {id(p): n for n, p in model.named_parameters()}
    for name, module, pg in modules:
        params = [(names[id(fp.sharded_param)], tuple(fp._orig_size)) for fp in pg.fsdp_params
                  if fp.sharded_param.requires_grad]
        if params:
            zen.install(name, module, params)
    if rank == 0:
        level = f", node-level: {node.local_size} ranks a node" if node is not None else ""
        print(startup_line(f"FSDP2 (dp={len(dp_ranks)}{level}, {len(zen.comms)} FSDP modules)", cfg, built.kinds,
                           {n: p.numel() for n, p in model.named_parameters()}, dgc_note), flush=True)
    return zen
