"""``CatchUpAdamW``: AdamW for the parameters DGC holds back, and the parameter groups it needs.

Under DGC's error feedback a coordinate's gradient arrives late, as the sum of the steps it missed;
``CatchUpAdamW`` moves such a coordinate as far as those steps would have (the recipes' optimizer under
DGC; ``zen.dgc``'s defaults decide the rotating flush from it). The other optimizers tried for this
were measured worse and removed (docs/results/dgc_history.md).
"""

from __future__ import annotations

import math

import torch


def _check_adam_args(name: str, lr: float, betas, eps: float) -> None:
    """The hyperparameter checks, named as in ``torch.optim.AdamW``."""
    if not lr >= 0:
        raise ValueError(f"{name} lr ({lr!r}) must be >= 0")
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
        raise ValueError(f"{name} betas ({betas!r}) must be in [0, 1)")
    if not eps > 0:
        raise ValueError(f"{name} eps ({eps!r}) must be > 0")


def _run_closure(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its storage: in-place updates land in the DTensor), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _check_placements(p: torch.Tensor) -> None:
    """A DTensor parameter's gradient must be placed as the parameter (FSDP2's are): the local shards
    then hold the same elements."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) and (not isinstance(p.grad, DTensor) or p.grad.placements != p.placements
                                   or p.grad.device_mesh != p.device_mesh):
        got = p.grad.placements if isinstance(p.grad, DTensor) else type(p.grad).__name__
        raise ValueError(f"CatchUpAdamW: a DTensor parameter placed {p.placements} has a gradient placed {got}; "
                         f"it must be placed as its parameter (as FSDP2's gradients are)")


def _adam_state(st: dict, p: torch.Tensor) -> dict:
    """``p``'s state with Adam's moments (created at the first step) and its step count advanced."""
    if not st:
        st["step"] = 0
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    st["step"] += 1
    return st


class CatchUpAdamW(torch.optim.Optimizer):
    """AdamW that takes a gradient DGC held back for ``k`` steps as ``k`` steps' worth (a lazy catch-up).

    Why it exists (benchmarks/quality/results/time_to_quality_catch_up.md): under error feedback a coordinate arrives as a burst ``G``, the sum of the
    ``k`` gradients it missed, and nothing in between. Plain Adam takes the burst as one gradient: its
    square lands in the second moment, and the coordinate moves about ``lr / sqrt(1 − β2)`` in total
    whatever ``k`` is. Here a coordinate whose synchronized gradient is exactly zero (not sent, or an
    embedding row no batch touched) waits: its moments and weight stay, as in a lazy Adam. When ``G``
    arrives after ``k`` steps, it counts as ``k`` steps of gradients with mean ``G/k`` and mean square
    ``G²/k``: ``m ← β1^k·m + (1 − β1^k)·G/k``, ``v ← β2^k·v + (1 − β2^k)·G²/k``, and the weight moves
    ``k · lr · m̂ / (sqrt(v̂) + eps)``. ``G²/k`` is the mean square of ``k`` independent zero-mean
    gradients (``E[G²] = k·E[g²]``): a coordinate whose gradients are mostly noise then moves about
    ``sqrt(k) · lr``, as dense AdamW's random walk moves it, and one with a steady gradient moves
    ``sqrt(k) · lr`` instead of dense's ``k · lr`` (conservative). Taking ``(G/k)²`` instead (right for a
    steady gradient) moved noise ``k · lr`` and was far worse (benchmarks/quality/results/time_to_quality.md).

    The age is read from the synchronized gradient, so it is the same on every rank without a
    collective. Where every coordinate has a non-zero gradient every step (``k = 1``), this is AdamW.
    Use it as the client optimizer of ``deepspeed.initialize`` (the DeepSpeed recipe: ``--catch_up_adam``),
    with ZeRO 0–2; its state (``exp_avg``, ``exp_avg_sq``, ``age``, ``step``) is saved with the engine's
    checkpoints like any torch optimizer's. On FSDP2's DTensor parameters each rank steps its local shard
    (every operation is per element, so a shard's step is the full tensor's step restricted to it) and
    the per-element state is a DTensor placed as its parameter, so ``torch.distributed.checkpoint``'s
    optimizer state dict saves and reshards it (recipes/finetune_llm_fsdp.py).

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (weight decay is applied every step).
        catch_up: the default of a group's ``"catch_up"``: False makes the group plain AdamW (a zero
            gradient is a gradient), for parameters no compressor holds back.

    Raises:
        ValueError: a hyperparameter out of range (named as in ``torch.optim.AdamW``).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, catch_up: bool = True) -> None:
        _check_adam_args("CatchUpAdamW", lr, betas, eps)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      catch_up=catch_up))

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the ages come back in fp32: torch casts every
        other state tensor to its parameter's dtype, and a bf16 age cannot count past 256."""
        ages = {i: st["age"] for i, st in state_dict["state"].items() if "age" in st}
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            if i in ages:
                self.state[p]["age"] = ages[i].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        """One step.

        1. Decay every weight (decoupled: ``p ← p·(1 − lr·wd)``) and age every coordinate by one step.
        2. Where the gradient is non-zero: fold ``k`` steps (``k`` = age) of mean ``G/k`` and mean square
           ``G²/k`` into the moments.
        3. There, step by ``k · lr · m̂ / (sqrt(v̂) + eps)``; reset the age.

        ``zen_ext.ops.catch_up_adamw_`` runs them: contiguous float32/bf16/fp16 parameters on a device
        the op has a kernel for (the CPU; CUDA where the set-up built the CUDA kernels) in the fused op (one pass per tensor, and a coordinate that waits costs only its decay and age), any
        other in its torch reference (``zen_ext/ops/_reference.py``), the op's oracle. DTensors (FSDP2)
        go in as their local shards; their state is created as DTensors placed like the parameter.
        """
        from . import ops

        loss = _run_closure(closure)
        for group in self.param_groups:
            hp = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], wd=group["weight_decay"],
                      catch_up=group.get("catch_up", True))
            by_step: dict[int, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                _check_placements(p)
                st = _adam_state(self.state[p], p)
                if "age" not in st:
                    # fp32 whatever the parameter's dtype: a bf16 count stops at 256 (256 + 1 rounds
                    # back to 256), fp16's at 2048.
                    st["age"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                by_step.setdefault(st["step"], []).append(p)
            for t, params in by_step.items():  # one step count per group in practice
                sts = [self.state[p] for p in params]
                ops.catch_up_adamw_([_local(p) for p in params], [_local(p.grad) for p in params],
                                    [_local(s["exp_avg"]) for s in sts], [_local(s["exp_avg_sq"]) for s in sts],
                                    [_local(s["age"]) for s in sts], lr=hp["lr"],
                                    beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                                    weight_decay=hp["wd"], step=t, catch_up=hp["catch_up"])
        return loss


def catch_up_param_groups(model: torch.nn.Module, zen) -> list[dict]:
    """CatchUpAdamW's parameter groups for ``model`` under the ``"zen"`` section ``zen`` (a ZenConfig):
    the parameters zen routes to DGC, which holds gradients back, catch up; every other one (natural
    sparsity's embedding rows, small and 1-D tensors, all of them with zen or DGC off) is plain AdamW,
    since a zero gradient there is a real zero, not a delay. Call it on the model before the engine
    wraps it (names as ``model.named_parameters()``)."""
    from .compress.registry import registered
    from .compress.routing import classify_parameters

    kinds = classify_parameters(model, sections=zen.sections(), log=False) if zen.enabled else {}
    # A lossy kind (DGC) holds gradient back; a lossless one (and dense) sends every non-zero at once.
    lossy = {s.kind for s in registered() if not s.cls.lossless}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if kinds.get(n) in lossy], "catch_up": True},
              {"params": [p for n, p in named if kinds.get(n) not in lossy], "catch_up": False}]
    return [g for g in groups if g["params"]]
