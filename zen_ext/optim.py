"""``FrozenVarianceAdamW``: AdamW whose second moment stops moving after a warm-up (1-bit Adam's design).

Why it exists (issue 21): Adam divides each coordinate's step by the RMS of its recent gradients. DGC
sends a small coordinate once every ``T`` steps, as the sum of ``T`` gradients, so Adam sees a burst
``T·g`` and nothing in between: the burst's square inflates the second moment, and the coordinate moves
about ``1/sqrt(T)`` as far as dense training would move it (a smaller effective learning rate on most
coordinates). With the second moment frozen after a dense-enough warm-up (1-bit Adam, Tang et al. 2021;
0/1 Adam), the step is ``m / sqrt(v_frozen)``, linear in the gradients, so DGC's error feedback (which
delays but never drops gradient) conserves the total movement, as it does for momentum SGD.

Use it as the client optimizer of ``deepspeed.initialize`` (the DeepSpeed recipe: ``--frozen_variance_after
N``), with ZeRO 0–2; its state (``exp_avg``, ``exp_avg_sq``, ``step``) is saved with the engine's
checkpoints like any torch optimizer's.
"""

from __future__ import annotations

import math

import torch


class FrozenVarianceAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose ``exp_avg_sq`` is updated for ``freeze_after`` steps, then kept.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        freeze_after: optimizer steps that update the second moment (its bias correction stays at that
            step's afterwards); a coordinate still at zero then takes its first gradient's square, once.

    Raises:
        ValueError: a hyperparameter out of range (named as in ``torch.optim.AdamW``).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, freeze_after: int = 100) -> None:
        if not lr >= 0:
            raise ValueError(f"FrozenVarianceAdamW lr ({lr!r}) must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"FrozenVarianceAdamW betas ({betas!r}) must be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"FrozenVarianceAdamW eps ({eps!r}) must be > 0")
        if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < 1:
            raise ValueError(f"FrozenVarianceAdamW freeze_after ({freeze_after!r}) must be an int >= 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      freeze_after=freeze_after))

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step; the second moment moves only during the first ``freeze_after`` steps.

        1. Decay the weights (decoupled: ``p ← p·(1 − lr·wd)``).
        2. Update the first moment; the second moment only before the freeze (after it, only where it
           is still zero: a coordinate's first gradient).
        3. Step by ``lr · m̂ / (sqrt(v̂) + eps)``, ``v̂`` bias-corrected at ``min(step, freeze_after)``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd, freeze = (group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                             group["freeze_after"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["step"] += 1
                t = st["step"]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                # Step 1: decoupled weight decay.
                if wd:
                    p.mul_(1 - lr * wd)
                # Step 2: moments; the second only until the freeze.
                m.lerp_(g, 1 - b1)
                if t <= freeze:
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                else:
                    # A coordinate that never had a gradient before the freeze (an embedding row no
                    # batch touched, a coordinate DGC had not sent yet) has v = 0 and would step by
                    # lr·m/eps: it takes its first gradient's square instead, then stays frozen.
                    torch.where(v > 0, v, g.square().mul_(1 - b2), out=v)
                # Step 3: the bias-corrected step.
                bc1 = 1 - b1 ** t
                bc2 = 1 - b2 ** min(t, freeze)
                denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / bc1)
        return loss
