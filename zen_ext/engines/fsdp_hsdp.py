"""ZEN for torch FSDP2 HSDP (``fully_shard`` on a 2-D ``(replicate, shard)`` mesh): FSDP's own dense
reduce-scatter inside the node, ZEN's all-reduce of each rank's shard across the replicas.

Under HSDP, FSDP reduce-scatters each FSDP module's gradients over the shard dim (the ranks of one
node, fast links), then all-reduces the rank's shard over the replicate dim (one rank per node, slow
links). ZEN replaces only that cross-replica all-reduce, so sparsifiers run on the node-summed shard:
DGC's residual (and every per-element state) is ``P / L`` elements a rank, ``L`` the shard dim's size,
not ``P`` as under a 1-D mesh (docs/fsdp.md, "HSDP").

How FSDP is driven (torch 2.13, ``_fully_shard/_fsdp_collectives.py`` ``foreach_reduce``): FSDP offers no
switch that skips its HSDP all-reduce and still hands out the gradient (``set_requires_all_reduce(False)``
keeps the shard back for gradient accumulation, and skips the all-reduce hook too). So ``attach`` gives
each FSDP parameter group a one-rank replicate group, which makes FSDP's native all-reduce the identity
and its divide factors those of the shard dim alone (``AVG`` over ``L``, or the pre/post factors of
``L``), and sets an all-reduce hook (``FSDPModule.set_all_reduce_hook``) that FSDP calls right after, on
the reduce-scatter output: ZEN all-reduces it over the real replicate group (``BucketReducer.reduce_``,
the all-reduce path every other adapter uses). The divisions are plain HSDP's (``divide_plan``):

* no gradient divide factor, communication by averages (fp32/bf16): FSDP averages over the shard dim and
  ZEN takes the ``mean`` over the ``N`` replicas, as plain HSDP's two averages;
* a gradient divide factor: FSDP pre-multiplies by ``1/factor`` (or pre/post-divides by it), which
  involves no group size, and ZEN sums;
* no factor with sum-only communication (``set_force_sum_reduction_for_comms``, or an fp16 reduce dtype):
  FSDP would divide by the factors of the one-rank group's world (``L``), and a mean over ``N`` after it
  would make ``sum/N/L``, which rounds differently from plain HSDP's ``sum/(N·L)`` unless ``N`` or ``L`` is
  a power of two. So ``attach`` sets the factor plain HSDP uses, ``N·L``, on the parameter group (FSDP
  then pre/post-divides exactly as plain HSDP) and ZEN sums; ``close()`` clears it again.

What ``attach`` decided is checked in every call (a factor or sum-only switch changed after ``attach``
raises, naming it). ``close()`` hands the all-reduce back to FSDP.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig, load_json_config
from ..reduction.attachment import Assembled, ZenAttachment, assemble
from ..reduction.hierarchy import local_host_facts
from ..reduction.stats import startup_line
from ..reduction.synchronizer import GradSlice
from .fsdp import SUPPORTED, check_shard0, chunk_layout
from .fsdp_compat import check_fsdp_internals
from .fsdp_steps import AccumulationWatch, FSDPSteps

log = logging.getLogger(__name__)

__all__ = ["ZenAllReduceHook", "ZenHSDP", "agree_hsdp", "attach", "check_hsdp_groups", "hsdp_param_groups",
           "shard_layout"]


def shard_layout(params: list[tuple[str, tuple[int, ...]]], shard_size: int, shard_rank: int
                 ) -> tuple[list[GradSlice], int]:
    """The reduce-scatter output of shard rank ``shard_rank`` (its row of FSDP's chunk layout) as named slices.

    Returns:
        ``(slices, numel)``: ``chunk_layout``'s slices of row ``shard_rank``, offsets counted from the row's
        start (one slice per parameter chunk, whole rows, ``start`` its offset in the parameter; padding in
        none), and the row's elements.
    """
    slices, numel = chunk_layout(params, shard_size)
    row = numel // shard_size
    lo = shard_rank * row
    return [dataclasses.replace(s, offset=s.offset - lo) for s in slices if lo <= s.offset < lo + row], row


def hsdp_param_groups(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(name, module, param group)`` of every FSDP parameter group of ``model`` on a 2-D (HSDP) mesh;
    empty for a model without one (a 1-D mesh, no ``fully_shard``); refuses a model with both kinds."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    found = [(name, m, pg) for name, m in model.named_modules() if isinstance(m, FSDPModule)
             for pg in m._get_fsdp_state()._fsdp_param_groups]
    hsdp = [f for f in found if isinstance(f[2].mesh_info, HSDPMeshInfo)]
    if hsdp and len(hsdp) < len(found):
        other = next(name or "<root>" for name, _, pg in found if not isinstance(pg.mesh_info, HSDPMeshInfo))
        raise NotImplementedError(f"zen_ext.fsdp: FSDP module {other} is not on the 2-D (HSDP) mesh its other "
                                  f"modules are on; supported: {SUPPORTED}")
    return hsdp


def sum_only(param_group, reduce_dtype: torch.dtype) -> bool:
    """Whether FSDP communicates by sums only for this parameter group (torch 2.13
    ``_get_gradient_divide_factors``): forced, on MTIA, or a reduce dtype with overflow risk (not fp32/bf16)."""
    return (bool(param_group.force_sum_reduction_for_comms) or param_group.device.type == "mtia"
            or reduce_dtype not in (torch.float32, torch.bfloat16))


def reduce_dtype_of(param_group) -> torch.dtype:
    """The dtype FSDP reduces this parameter group's gradients in: the mixed-precision policy's reduce dtype,
    else its parameter dtype, else the parameters' own (``FSDPParam.init_dtype_attrs``)."""
    mp = param_group.mp_policy
    trainable = [fp for fp in param_group.fsdp_params if fp.sharded_param.requires_grad]
    return mp.reduce_dtype or mp.param_dtype or trainable[0].sharded_param.dtype


def divide_plan(param_group, replicas: int, shard: int) -> tuple[str, float | None]:
    """ZEN's op over the replicas and the gradient divide factor ``attach`` sets on ``param_group`` (None:
    none), so that FSDP's divisions and ZEN's make plain HSDP's on ``replicas × shard`` ranks (the module
    docstring): a user's factor: ``sum``; averaging communication: ``mean``; sum-only communication without
    a factor: ``sum`` with the factor ``replicas·shard``. A shard dim of 1 skips FSDP's reduce-scatter,
    which then divides by a set factor on its own (torch 2.13): there ``mean``, FSDP dividing by nothing."""
    if param_group.gradient_divide_factor is not None:
        return "sum", None
    if shard > 1 and sum_only(param_group, reduce_dtype_of(param_group)):
        return "sum", float(replicas * shard)
    return "mean", None


class ZenAllReduceHook:
    """The all-reduce hook set on one FSDP module: its parameter group, parameters, the attachment, and the
    division ``attach`` chose for it (``divide_plan``)."""

    def __init__(self, attachment: "ZenHSDP", module_name: str, param_group,
                 params: list[tuple[str, tuple[int, ...]]], op: str) -> None:
        self.attachment = attachment  # FSDP keeps the hook, so the model keeps the attachment alive
        self.module_name, self.param_group, self.params = module_name, param_group, params
        self.layouts: dict[int, list[GradSlice]] = {}
        self.op = op
        """``mean`` or ``sum`` over the replicas."""
        self.expected = (param_group.gradient_divide_factor, sum_only(param_group, reduce_dtype_of(param_group)))
        """What FSDP divided by when ``op`` was chosen: its divide factor and whether it sums only."""

    def check_divisions(self, dtype: torch.dtype) -> None:
        """Raise when FSDP's divide factor or sum-only switch changed after ``attach`` (then ``op`` would no
        longer make plain HSDP's result)."""
        pg = self.param_group
        now = (pg.gradient_divide_factor, sum_only(pg, dtype))
        if now != self.expected:
            raise RuntimeError(f"zen_ext.fsdp: FSDP module {self.module_name or '<root>'} now reduces with gradient "
                               f"divide factor {now[0]} and sum-only communication {now[1]}, but ZEN attached with "
                               f"{self.expected[0]} and {self.expected[1]}; call set_gradient_divide_factor and "
                               f"set_force_sum_reduction_for_comms before zen_ext.fsdp.attach")

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.attachment.all_reduce(self, reduce_output)

    def slices_for(self, numel: int) -> list[GradSlice]:
        """The named slices of this rank's shard of ``numel`` elements (cached per size)."""
        slices = self.layouts.get(numel)
        if slices is None:
            mesh_info = self.param_group.mesh_info
            slices, expected = shard_layout(self.params, mesh_info.shard_mesh_size, mesh_info.shard_mesh_rank)
            if numel != expected:
                raise RuntimeError(
                    f"zen_ext.fsdp: FSDP reduced a {numel}-element shard for module {self.module_name or '<root>'}, "
                    f"but its parameters that require gradients ({', '.join(n for n, _ in self.params)}) make "
                    f"{expected}: some got no gradient in this backward pass. ZEN needs every one of them reduced: "
                    f"call set_reduce_scatter_unused_params(True) on the model (unused parameters then reduce zeros)")
            self.layouts[numel] = slices
        return slices


class ZenHSDP(ZenAttachment):
    """What ZEN keeps for an FSDP2 HSDP model (built by ``attach``): the reducer over the replicate group,
    statistics, steps (``FSDPSteps``, as ``ZenFSDP`` holds them); ``state_dict()`` holds this rank's
    shard-sized DGC residuals (keyed by parameter name and chunk offset) and the mesh shape; ``close()``
    hands the all-reduce back to FSDP."""

    __slots__ = ("cfg", "rank", "dp_size", "sync", "reducer", "stats", "worker", "group", "comms", "steps",
                 "mesh_shape", "_native", "_divided")

    log_name = log.name

    def __init__(self, *, cfg: ZenConfig, group, built: Assembled, rank: int, mesh_shape: tuple[int, int],
                 accumulation: AccumulationWatch) -> None:
        self.cfg, self.group, self.rank = cfg, group, rank
        self.sync, self.reducer, self.stats = built.sync, built.reducer, built.stats
        self.stats.dense_name = "FSDP's dense HSDP all-reduce"
        self.mesh_shape = mesh_shape
        self.dp_size = mesh_shape[0] * mesh_shape[1]  # a checkpoint's residuals fit only this world and layout
        self.worker = None  # FSDP reads the shard when the hook returns: no work may stay on a thread
        self.comms: list[ZenAllReduceHook] = []
        self.steps = FSDPSteps(built.sync, built.reducer, built.stats, accumulation)
        self._native: list[tuple[object, object]] = []  # (param group, its own replicate group), for close()
        self._divided: list = []  # param groups whose gradient divide factor attach set (divide_plan), for close()

    @property
    def summary_label(self) -> str:
        return f"FSDP2 HSDP replicate={self.mesh_shape[0]} x shard={self.mesh_shape[1]}"

    @property
    def step(self) -> int:
        """Backward passes that reduced (ZEN steps)."""
        return self.steps.step

    @property
    def accumulation(self) -> AccumulationWatch:
        return self.steps.accumulation

    def install(self, name: str, module, param_group, params: list[tuple[str, tuple[int, ...]]], alone) -> None:
        """Make ZEN the cross-replica all-reduce of the FSDP module ``name`` (its trainable ``params``: names,
        unsharded shapes): FSDP's native all-reduce over ``alone`` (a one-rank group: the identity), plain
        HSDP's divisions (``divide_plan``), and a ``ZenAllReduceHook``; ``close()`` undoes all three."""
        if param_group.mesh_info.replicate_process_group is not alone:  # param groups may share a mesh info
            self._native.append((param_group, param_group.mesh_info.replicate_process_group))
            param_group.mesh_info.replicate_process_group = alone
        op, factor = divide_plan(param_group, *self.mesh_shape)
        if factor is not None:
            param_group.gradient_divide_factor = factor
            self._divided.append(param_group)
        hook = ZenAllReduceHook(self, name, param_group, params, op)
        module.set_all_reduce_hook(hook)
        self.comms.append(hook)

    def all_reduce(self, hook: ZenAllReduceHook, shard: torch.Tensor) -> None:
        """The cross-replica all-reduce of one module's shard, in place (FSDP's HSDP all-reduce).

        1. Map the shard to named slices (once per layout); refuse a DGC step accumulated across
           all-reduces (``fsdp_steps.AccumulationWatch``).
        2. The op: ``attach``'s (``divide_plan``), after checking that FSDP's divisions are still those it
           was chosen for.
        3. All-reduce over the replicate group (``BucketReducer.reduce_``: the non-finite guard, buckets of
           ``zen.bucket_cap_mb``, the Synchronizer's routing) on this thread; the step's end is queued
           (``FSDPSteps``).
        """
        t0 = self.steps.start()
        # Step 1: layout.
        slices = hook.slices_for(shard.numel())
        self.steps.watch(n for n, _ in hook.params)
        # Step 2: the op (chosen at attach, so that the result is plain HSDP's).
        hook.check_divisions(shard.dtype)
        # Step 3: the reduction, and the step's end.
        self.reducer.reduce_(shard.view(-1), slices, hook.op, pipelined=False)
        self.steps.done(t0)

    def end_step(self) -> dict:
        """Close a backward pass that reduced (``FSDPSteps.end_step``; autograd calls it)."""
        return self.steps.end_step()

    def close(self) -> None:
        """End of training: FSDP's own HSDP all-reduce is back (its replicate groups and divide factors, no
        hook), the statistics file is closed and the Synchronizer dropped. Idempotent."""
        if self.steps.closed:
            return
        for pg, native in self._native:
            pg.mesh_info.replicate_process_group = native
        for hook in self.comms:
            hook.param_group._all_reduce_hook = None
        for pg in self._divided:
            pg.gradient_divide_factor = None
        self._native, self._divided = [], []
        self.steps.close()
        self._release()
        self.sync = self.reducer = None

    def _extra_state(self) -> dict:  # ZenAttachment.state_dict's own entries
        return {"step": self.step, "mesh": list(self.mesh_shape)}

    def _load_extra_state(self, sd: dict) -> None:
        self.steps.step = int(sd.get("step", 0))

    def load_state_dict(self, sd: dict, why: str = "") -> None:
        """Restore ``state_dict()``; saved on another ``(replicate, shard)`` mesh, only the shared part (the
        shards, and with them the residuals' elements, differ)."""
        saved = tuple(sd.get("mesh") or ())
        if not why and saved != self.mesh_shape:
            why = f"the checkpoint was saved on a {saved} (replicate, shard) mesh, now {self.mesh_shape}"
        super().load_state_dict(sd, why)


def check_hsdp_groups(found: list) -> tuple[object, tuple[int, int]]:
    """Refuse what ``attach`` does not serve; returns the mesh and its ``(replicate, shard)`` sizes."""
    for name, module, pg in found:
        where, mesh = name or "<root>", pg.mesh_info.mesh
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} has {len(groups)} parameter groups "
                                      f"(parameters on several meshes); supported: {SUPPORTED}")
        names = mesh.mesh_dim_names
        if names is None or "replicate" not in names[0] or "shard" not in names[1]:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} is sharded over a 2-D mesh with dims "
                                      f"{names}; FSDP replicates over dim 0 and shards over dim 1, so name them "
                                      f"(\"replicate\", \"shard\") in that order; supported: {SUPPORTED}")
        if getattr(pg.mesh_info, "spmd_mesh", None) is not None:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} holds parameters on a larger SPMD mesh "
                                      f"(FSDP with tensor parallelism); supported: {SUPPORTED}")
        if pg.mesh_info.replicate_mesh_size < 2:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} is sharded over a 2-D mesh whose replicate "
                                      f"dim has size {pg.mesh_info.replicate_mesh_size}: nothing crosses the replicas; "
                                      f"shard over mesh[\"shard\"]; supported: {SUPPORTED}")
        if mesh.size() != dist.get_world_size():
            raise NotImplementedError(f"zen_ext.fsdp: the HSDP mesh of FSDP module {where} holds {mesh.size()} of "
                                      f"{dist.get_world_size()} ranks; supported: {SUPPORTED}")
        check_shard0(pg, where)
        if pg._all_reduce_hook is not None:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where} already has an all-reduce hook "
                                      f"({type(pg._all_reduce_hook).__name__}); attach once, to a model without one")
        if pg.mesh_info.replicate_process_group.size() != pg.mesh_info.replicate_mesh_size:
            raise NotImplementedError(f"zen_ext.fsdp: FSDP module {where}'s cross-replica all-reduce is already "
                                      f"replaced (zen.outer's register_outer ran); use one, once")
    meshes = {(tuple(pg.mesh_info.mesh.mesh.flatten().tolist()), pg.mesh_info.mesh.shape) for _, _, pg in found}
    if len(meshes) > 1:
        raise NotImplementedError(f"zen_ext.fsdp: the FSDP modules are sharded over different meshes "
                                  f"{sorted(meshes)}; supported: {SUPPORTED}")
    mesh = found[0][2].mesh_info.mesh
    return mesh, (mesh.size(0), mesh.size(1))


def agree_hsdp(mesh, cfg: ZenConfig, signature: list) -> None:
    """Check that every rank attaches alike (one gather over the world, before any group is changed), so a
    mismatch raises on every rank instead of hanging in a later collective; warn when a shard group spans
    several hosts (the dense reduce-scatter then crosses the slow links)."""
    mine = {"mesh": (tuple(mesh.shape), tuple(mesh.mesh_dim_names), mesh.mesh.tolist()),
            "modules": signature, "zen": cfg.to_dict(), "host": local_host_facts()[0]}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for r, theirs in enumerate(every):
        for field in ("mesh", "modules", "zen"):
            if theirs[field] != every[0][field]:
                raise RuntimeError(f"zen_ext.fsdp: rank {r} attaches with another {field} than rank 0 "
                                   f"({theirs[field]} vs {every[0][field]}); every rank must attach the same "
                                   f"model, mesh and \"zen\" section")
    spanning = [g for g in mesh.mesh.tolist() if len({every[r]["host"] for r in g}) > 1]
    if spanning and dist.get_rank() == 0:
        log.warning("zen: the HSDP shard groups %s span several hosts: FSDP's dense reduce-scatter then crosses "
                    "nodes; put the shard dim inside a node (init_device_mesh(..., (nodes, ranks_per_node)))",
                    spanning[:4])


def attach(model: torch.nn.Module, config=None, *, optimizer=None, guard_nonfinite: bool = False) -> ZenHSDP:
    """ZEN as the cross-replica all-reduce of every FSDP module of an HSDP ``model``; returns the attachment.

    ``zen_ext.fsdp.attach`` calls it for a model on a 2-D mesh (docs/fsdp.md, "HSDP"); its arguments are
    those of the 1-D ``zen_ext.engines.fsdp.attach`` (``guard_nonfinite``: over every rank of the mesh).

    1. Check torch (``fsdp_compat.check_fsdp_internals``: the version, the private names read here), find
       the FSDP parameter groups and refuse what is not served (``SUPPORTED``); check that every rank
       attaches the same mesh, modules and section.
    2. Route each parameter (natural / dgc / dense) and build the Synchronizer over the replicate group.
    3. Per FSDP module: a one-rank replicate group for FSDP's native all-reduce, the divisions of plain HSDP
       (``divide_plan``: a gradient divide factor where the communication is sum-only), and a
       ``ZenAllReduceHook``.

    Raises:
        ValueError, TypeError: an invalid section or ``zen.enabled`` false.
        NotImplementedError: what is not ``SUPPORTED``, ``zen.hierarchical`` true, attaching twice.
        RuntimeError: ranks that attach differently, an untested torch or a missing torch internal.
    """
    # Step 1: the parameter groups, refusals, agreement.
    if isinstance(config, (str, os.PathLike)):  # the section itself, or a run config with a "zen" key
        section = load_json_config(config)
        config = ZenConfig.from_json_section(section["zen"] if "zen" in section else section)
    cfg = config if isinstance(config, ZenConfig) else ZenConfig.from_dict(config)
    if not cfg.enabled:
        raise ValueError("zen.enabled (False) must be true to attach ZEN; skip attach to keep FSDP's all-reduce")
    if cfg.hierarchical is True:
        raise NotImplementedError("zen.hierarchical (True) must be false or \"auto\" with FSDP2 HSDP: FSDP already "
                                  "reduces inside the node (its reduce-scatter over the shard dim) and ZEN runs "
                                  "across the nodes (the replicate dim)")
    check_fsdp_internals(model, path="HSDP")  # a torch the tests did not run, or one without an internal read below
    found = hsdp_param_groups(model)
    if not found:
        raise NotImplementedError(f"zen_ext.engines.fsdp_hsdp.attach needs FSDP modules on a 2-D (\"replicate\", "
                                  f"\"shard\") mesh ({type(model).__name__} has none); zen_ext.fsdp.attach serves "
                                  f"both kinds; supported: {SUPPORTED}")
    mesh, shape = check_hsdp_groups(found)
    names = {id(p): n for n, p in model.named_parameters()}
    per_module = [(name, module, pg, [(names[id(fp.sharded_param)], tuple(fp._orig_size)) for fp in pg.fsdp_params
                                      if fp.sharded_param.requires_grad]) for name, module, pg in found]
    agree_hsdp(mesh, cfg, [(name, params) for name, _, _, params in per_module])
    rank = dist.get_rank()
    cfg, dgc_note = cfg.resolve_defaults(optimizer, quiet=rank != 0)
    # Step 2: routing and the Synchronizer over the replicate group.
    replicate = found[0][2].mesh_info.replicate_process_group
    comm = TorchCommunicator(replicate, cfg.exchange_impl)
    built = assemble(model, cfg, sync_comm=comm, tp_comm=None, rank=rank, dp_size=comm.size,
                     device=next((p.device for p in model.parameters()), torch.device("cpu")),
                     guard_comm=TorchCommunicator(dist.group.WORLD) if guard_nonfinite else None,
                     worker_in_reducer=False, worker_off="FSDP2 HSDP (FSDP reads the shard when the hook returns)")
    zen = ZenHSDP(cfg=cfg, group=replicate, built=built, rank=rank, mesh_shape=shape,
                  accumulation=AccumulationWatch(model, built.sync.param_kinds, hsdp=True))
    # Step 3: FSDP's native all-reduce over one rank, plain HSDP's divisions, ZEN's all-reduce in the hook.
    alone = dist.new_group([rank], use_local_synchronization=True)
    for name, module, pg, params in per_module:
        if params:
            zen.install(name, module, pg, params, alone)
    if rank == 0:
        print(startup_line(f"FSDP2 HSDP (replicate={shape[0]} x shard={shape[1]}, {len(zen.comms)} FSDP modules)",
                           cfg, built.kinds, {n: p.numel() for n, p in model.named_parameters()}, dgc_note), flush=True)
    return zen
