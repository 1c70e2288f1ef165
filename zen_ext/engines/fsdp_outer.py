"""zen.outer on torch FSDP2 HSDP: each replica group trains alone, sharded by FSDP; every H-th step the
outer synchronization runs across the replicas on each rank's own shard.

The model is ``fully_shard``-ed on a 2-D ``(replicate, shard)`` mesh. Plain HSDP reduce-scatters each
module's gradients over the shard dim (the ranks of one replica group) and then all-reduces the shard over
the replicate dim. The outer form keeps the first and drops the second. FSDP has no switch for that
(``set_requires_all_reduce(False)`` keeps the shard back for gradient accumulation, it does not hand it out),
so, as the per-step HSDP adapter does (``fsdp_hsdp.py``), each FSDP parameter group gets a one-rank
replicate group: FSDP's all-reduce becomes the identity and its divisions those of the shard dim alone, so
an inner step is bitwise 1-D FSDP over the replica group. No all-reduce hook is set.

The ``OuterSync`` runs over the real replicate group (the ranks that hold the same shard, one per replica)
on each rank's local shard of every trainable parameter (the DTensor's local tensor): θ_global, the error
feedback and the outer momentum are ``P / L`` elements a rank (``L`` the shard dim's size), and each outer
step sends the picks of ``P / L`` elements per rank, all shard ranks at once on disjoint replicate groups.
Top-k chunks run over the rank's shard (consecutive elements of its shards of consecutive parameters), so
which entries are picked depends on ``L``; at density 1 (dense DiLoCo) the result does not.

``zen.outer.delay: 1`` (Streaming DiLoCo's overlap, ``outer/sync.py``): the sum of round t runs on the
communication thread over a process group of its own (the replicate group's members, built when the
``FSDPOuterSync`` is made: never the group FSDP or the training loop use) while round t + 1's inner steps
train; the anchor θ_a is shard-sized too (+4 B a local element), and round t's average is merged into the
local shards at the next outer step (θ_local ← θ_global + (θ_local − θ_a)), as on DDP and DeepSpeed ZeRO-0.
The merge writes the shards, so it needs them sharded as the restart does; ``finish()`` (the recipe calls it
before its final eval) and ``close()`` apply the round still in flight.

Checkpoints: the replicas' weights and inner optimizer state differ between outer steps (and the inner
optimizer state at outer steps too), while ``torch.distributed.checkpoint`` keeps one copy of what the
mesh calls replicated. Save every rank's own shards and optimizer state with the outer state
(``state_dict`` here; the FSDP2 recipe's per-rank files, recipes/fsdp_outer.py). At ``delay: 1`` the outer
state first waits for the round in flight and holds the merge still due (``OuterSync.state_dict``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchCommunicator
from ..config import ZenConfig
from ..outer.sync import OuterSync
from .fsdp_compat import check_fsdp_internals
from .fsdp_hsdp import agree_hsdp, check_hsdp_groups, hsdp_param_groups

__all__ = ["FSDPOuterSync", "SERVED", "load_local_state_dict", "local_state_dict", "register_outer"]

SERVED = ("zen.outer on FSDP2 serves HSDP: fully_shard on a 2-D (\"replicate\", \"shard\") device mesh spanning every "
          "rank, replicate dim >= 2, every trainable parameter sharded by fully_shard; zen.outer.delay 0 or 1")
"""What ``register_outer`` serves, named in its errors."""


class FSDPOuterSync(OuterSync):
    """``OuterSync`` over each rank's local shards of an FSDP2 HSDP model (built by ``register_outer``).

    Adds to ``OuterSync``: ``mesh_shape`` ``(replicas, shard)``, checked when a state dict is loaded (a
    shard's state fits only its mesh and shard rank), a check that the shards are sharded before the outer
    step and ``finish()`` write them, and ``close()``, which hands the cross-replica all-reduce back to FSDP.
    """

    def __init__(self, named_params, comm, cfg, *, scheme, bucket_cap_mb: float, mesh_shape: tuple[int, int],
                 shard_rank: int, param_groups: list, native: list) -> None:
        self.mesh_shape, self.shard_rank = tuple(mesh_shape), shard_rank
        self._param_groups = param_groups  # (module name, FSDP param group): checked at each outer step
        self._native = native  # (mesh info, its own replicate group), for close()
        super().__init__(named_params, comm, cfg, scheme=scheme, bucket_cap_mb=bucket_cap_mb)

    def local(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``p`` (the DTensor's local tensor, a view of FSDP's sharded storage)."""
        with torch.no_grad():
            return p.to_local()

    def _check_sharded(self, at: str) -> None:
        """Every FSDP module holds its parameters sharded: the restart (delay 0) and the merge (delay 1) write
        the shards, which parameters left unsharded would not read back until FSDP reshards them.

        Raises:
            RuntimeError: a module holds unsharded parameters at ``at``.
        """
        for name, pg in self._param_groups:
            if not pg.is_sharded:
                raise RuntimeError(f"zen.outer: FSDP module {name or '<root>'} holds unsharded parameters at {at}; "
                                   f"the outer sync writes the shards, which the next forward would not all-gather: "
                                   f"keep set_reshard_after_backward(True) (FSDP's default), reshard() before it")

    def outer_step(self) -> None:
        """``OuterSync.outer_step`` after checking that every FSDP module holds its parameters sharded."""
        self._check_sharded("the outer step")
        super().outer_step()

    def finish(self) -> None:
        """``OuterSync.finish`` (``delay: 1``: the round in flight merged into the shards) after the same check,
        when a round is in flight."""
        if any(b.inflight is not None for b in self.buckets):
            self._check_sharded("finish()")
        super().finish()

    def close(self) -> None:
        """``OuterSync.close`` (``finish()``, the communication thread stopped), then FSDP's own cross-replica
        all-reduce is back (each parameter group's replicate group). Idempotent."""
        super().close()
        for info, native in self._native:
            info.replicate_process_group = native
        self._native = []

    def state_dict(self) -> dict:
        """``OuterSync.state_dict`` with the mesh shape and this rank's shard rank."""
        return {**super().state_dict(), "mesh": list(self.mesh_shape), "shard_rank": self.shard_rank}

    def load_state_dict(self, sd: dict) -> None:
        """Restore ``state_dict()`` of this rank, saved on the same mesh.

        Raises:
            ValueError: saved on another ``(replicate, shard)`` mesh or by another shard rank.
        """
        saved = (tuple(sd.get("mesh") or ()), sd.get("shard_rank"))
        if saved != (self.mesh_shape, self.shard_rank):
            raise ValueError(f"zen.outer state_dict was saved on a {saved[0]} (replicate, shard) mesh by shard rank "
                             f"{saved[1]}; this rank is shard rank {self.shard_rank} of {self.mesh_shape}")
        super().load_state_dict(sd)


def register_outer(model: torch.nn.Module, cfg: "ZenConfig | dict", optimizer=None) -> FSDPOuterSync:
    """Confine ``model``'s inner steps to its replica group and attach the outer synchronization of ``zen.outer``.

    Call after the ``fully_shard`` calls (on a 2-D ``("replicate", "shard")`` mesh) and after loading any
    weights, before the first backward. Rank 0 of each replicate group broadcasts its shards as the common start.

    1. Check torch's FSDP internals, the mesh and modules (``SERVED``), and that every rank registers the
       same mesh, modules and section (one gather over the world).
    2. Each FSDP parameter group's replicate group becomes a one-rank group (FSDP's all-reduce: the identity).
    3. The ``FSDPOuterSync`` over the real replicate group, on each rank's local shards; with ``optimizer``,
       the outer step runs after every ``every``-th ``optimizer.step()`` (a post-step hook). ``delay: 1``:
       its sums run on a communication thread over a copy of the replicate group; call ``finish()`` on every
       rank at the end of training, before the final eval or save.

    Args:
        model: the ``fully_shard``-ed model.
        cfg: the ``"zen"`` section (ZenConfig or dict) with ``outer.enabled`` true; ``scheme``,
            ``bucket_cap_mb`` and ``exchange_impl`` apply to the outer sum.
        optimizer: the inner optimizer (over the model's DTensor parameters); without it, call
            ``outer.maybe_step(step)`` after each step yourself.

    Returns:
        The ``FSDPOuterSync`` (``state_dict`` for checkpoints, ``pop_stats``, ``finish``, ``close``).

    Raises:
        ValueError: ``zen.outer.enabled`` is false.
        NotImplementedError: not HSDP as ``SERVED`` says, or ZEN's per-step HSDP adapter already attached.
        RuntimeError: ranks that register differently, an untested torch or a missing torch internal.
    """
    # Step 1: refusals and agreement.
    cfg = cfg if isinstance(cfg, ZenConfig) else ZenConfig.from_dict(cfg)
    if not (cfg.enabled and cfg.outer.enabled):
        raise ValueError("zen.outer.enabled (False) must be true to register the outer synchronization")
    check_fsdp_internals(model, path="HSDP")
    found = hsdp_param_groups(model)
    if not found:
        raise NotImplementedError(f"{SERVED}; {type(model).__name__} has no FSDP module on a 2-D mesh (a 1-D mesh "
                                  f"has no replicas: there, zen_ext.engines.ddp_outer serves plain data parallelism)")
    mesh, shape = check_hsdp_groups(found)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plain = [n for n, p in named if not isinstance(p, torch.distributed.tensor.DTensor)]
    if plain:
        raise NotImplementedError(f"{SERVED}; parameters {plain[:4]} are not sharded by fully_shard")
    names = {id(p): n for n, p in named}
    agree_hsdp(mesh, cfg, [(name, [names.get(id(fp.sharded_param)) for fp in pg.fsdp_params]) for name, _, pg in found])
    # Step 2: FSDP's all-reduce over one rank.
    rank = dist.get_rank()
    replicate = found[0][2].mesh_info.replicate_process_group
    alone = dist.new_group([rank], use_local_synchronization=True)
    native = []
    for _, _, pg in found:
        info = pg.mesh_info
        if info.replicate_process_group is not alone:  # param groups may share a mesh info
            native.append((info, info.replicate_process_group))
            info.replicate_process_group = alone
    # Step 3: the outer sync on the local shards, over the replicate group.
    outer = FSDPOuterSync(named, TorchCommunicator(replicate, cfg.exchange_impl), cfg.outer,
                          scheme=cfg.build_scheme(), bucket_cap_mb=cfg.bucket_cap_mb, mesh_shape=shape,
                          shard_rank=found[0][2].mesh_info.shard_mesh_rank,
                          param_groups=[(name, pg) for name, _, pg in found], native=native)
    if optimizer is not None:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: outer.step_done())
    if rank == 0:
        o = cfg.outer
        print(f"zen_ext: zen.outer on FSDP2 HSDP (replicate={shape[0]} x shard={shape[1]}): every {o.every} steps, "
              f"density {o.density:g} per {o.chunk}-element chunk, error decay {o.error_decay:g}, outer SGD lr "
              f"{o.lr:g} momentum {o.momentum:g}{' nesterov' if o.nesterov else ''}, average {o.average}, "
              f"scheme {cfg.scheme}{', delay 1 (overlapped)' if o.delay else ''}, {outer.state_bytes():,} bytes of "
              f"outer state on rank 0", flush=True)
    return outer


# --- per-rank checkpoints --------------------------------------------------------------------------------
def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p


def local_state_dict(model: torch.nn.Module, optimizer=None) -> dict:
    """This rank's own shards and inner optimizer state as plain CPU tensors (``torch.save``-able, loadable
    with ``weights_only=True``): what a per-rank checkpoint of the outer form holds beside ``outer.state_dict()``.

    Returns:
        ``{"params": {name: local shard}, "buffers": {name: tensor}, "optimizer": optimizer.state_dict() with
        every DTensor replaced by {"local": its local tensor}}`` (no ``"optimizer"`` without one).
    """
    def plain(v):
        if isinstance(v, torch.distributed.tensor.DTensor):
            return {"local": v.to_local().detach().to("cpu", copy=True)}
        return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v

    with torch.no_grad():
        out = {"params": {n: _local(p).detach().to("cpu", copy=True) for n, p in model.named_parameters()},
               "buffers": {n: plain(b) for n, b in model.named_buffers()}}
    if optimizer is not None:
        sd = optimizer.state_dict()
        out["optimizer"] = {"param_groups": sd["param_groups"],
                            "state": {i: {k: plain(v) for k, v in s.items()} for i, s in sd["state"].items()}}
    return out


def load_local_state_dict(model: torch.nn.Module, sd: dict, optimizer=None) -> None:
    """Restore ``local_state_dict()`` of this rank in place (same mesh, same model and optimizer).

    Raises:
        ValueError: a parameter missing or of another local shape.
    """
    with torch.no_grad():
        for n, p in model.named_parameters():
            t = _local(p)
            saved = sd["params"].get(n)
            if saved is None or saved.shape != t.shape:
                raise ValueError(f"zen.outer local state_dict holds {None if saved is None else tuple(saved.shape)} "
                                 f"for parameter {n}, whose local shard is {tuple(t.shape)}")
            t.copy_(saved)
        for n, b in model.named_buffers():
            b.copy_(sd["buffers"][n])
    if optimizer is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def back(v, p):
        if isinstance(v, dict) and set(v) == {"local"}:
            return torch.distributed.tensor.DTensor.from_local(v["local"].to(p.device), p.device_mesh, p.placements,
                                                               shape=p.shape, stride=p.stride(), run_check=False)
        return v

    saved = sd["optimizer"]
    state = {int(i): {k: back(v, params[int(i)]) for k, v in s.items()} for i, s in saved["state"].items()}
    optimizer.load_state_dict({"param_groups": saved["param_groups"], "state": state})
