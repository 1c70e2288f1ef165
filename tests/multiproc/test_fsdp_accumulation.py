"""FSDP2 gradient accumulation with ZEN (``zen_ext/engines/fsdp_steps.py``), on real gloo processes (2 ranks).

* DGC with micro-batches that each reduce-scatter (no ``set_requires_gradient_sync(False)``) is refused
  at the second micro-batch, before the first optimizer step, with the fix in the message; the same
  accumulation with ``set_requires_gradient_sync(False)`` counts one DGC step per optimizer step.
* One backward pass per step, gradients zeroed with ``set_to_none=False`` (zeros stay), and a loop
  without a torch optimizer that zeroes with ``set_to_none=True``: not refused.
* Natural rows only (lossless): micro-batches that each reduce-scatter are served and equal plain
  FSDP2 accumulating the same way (integer-valued gradients: exact in any order).
* ``close()`` removes the global optimizer hook.
"""

from __future__ import annotations

import torch

from tests.multiproc.launch import run_workers

DGC = {"scheme": "zen", "natural": {"enabled": True},
       "dgc": {"enabled": True, "density": 0.3, "min_numel": 8, "momentum_correction": False, "warmup_steps": 0}}
NATURAL = {"scheme": "zen", "natural": {"enabled": True}}
MICRO, STEPS = 3, 2


class Toy(torch.nn.Module):
    """An embedding (natural rows) and a linear layer (DGC-routed); integer gradients for integer inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 4)
        self.proj = torch.nn.Linear(6, 5)

    def forward(self, ids, x):
        return self.embed(ids).sum() + (self.proj(x) * (torch.arange(5) % 3 - 1)).sum()


def _batch(i, rank):
    g = torch.Generator().manual_seed(10 * i + rank)
    return torch.randint(0, 11, (2, 3), generator=g), torch.randint(-2, 3, (3, 6), generator=g).float()


def _model():
    from torch.distributed.fsdp import fully_shard

    m = Toy()
    fully_shard(m.proj)
    fully_shard(m)
    return m


def _accumulate(rank, zen, *, no_sync: bool, steps=STEPS):
    """``steps`` optimizer steps of ``MICRO`` micro-batches; returns the attachment's counts, or the error."""
    import zen_ext.fsdp

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    a = zen_ext.fsdp.attach(model, zen) if zen is not None else None
    done = 0
    try:
        for step in range(steps):
            for micro in range(MICRO):
                if no_sync:
                    model.set_requires_gradient_sync(micro == MICRO - 1)
                model(*_batch(step * MICRO + micro, rank)).backward()
            opt.step()
            opt.zero_grad()
            done += 1
    except NotImplementedError as exc:
        return {"error": str(exc), "done": done, "zen_steps": a.step}
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    out = {"params": params, "zen_steps": a.step if a else None, "dgc_steps": a.sync.state.step if a else None}
    if a is not None:
        a.close()
    return out


def _worker(rank, world):
    import zen_ext.fsdp

    out = {"dgc_every_micro": _accumulate(rank, DGC, no_sync=False),
           "dgc_no_sync": _accumulate(rank, DGC, no_sync=True),
           "natural_every_micro": _accumulate(rank, NATURAL, no_sync=False),
           "plain_every_micro": _accumulate(rank, None, no_sync=False)}
    # One backward per step, zeros kept between steps (set_to_none=False): the optimizer hook resets.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    a = zen_ext.fsdp.attach(model, DGC)
    for step in range(3):
        model(*_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    out["zeros_kept_steps"] = a.sync.state.step
    a.close()
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    out["hooks_left"] = [h for h in _global_optimizer_pre_hooks.values()
                         if getattr(h, "__self__", None) is a.accumulation]
    # No torch optimizer at all: a hand-written update, gradients set to None.
    model = _model()
    a = zen_ext.fsdp.attach(model, DGC)
    for step in range(3):
        model(*_batch(step, rank)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.125 * p.grad)
        model.zero_grad(set_to_none=True)
    out["manual_steps"] = a.sync.state.step
    a.close()
    return out


def test_fsdp2_accumulation_with_dgc_is_counted_or_refused():
    for rank, out in enumerate(run_workers(_worker, 2, timeout_s=600)):
        err = out["dgc_every_micro"]
        assert "error" in err, (rank, err)
        assert err["done"] == 0 and err["zen_steps"] == 1, (rank, err)  # refused at micro-batch 2, before a step
        assert "zen.dgc must see one gradient per optimizer step" in err["error"]
        assert "set_requires_gradient_sync(False)" in err["error"]
        ok = out["dgc_no_sync"]
        assert ok["zen_steps"] == STEPS and ok["dgc_steps"] == STEPS, (rank, ok)  # one DGC step per optimizer step
        assert out["zeros_kept_steps"] == 3 and out["manual_steps"] == 3, rank
        assert out["hooks_left"] == [], rank
        nat, plain = out["natural_every_micro"], out["plain_every_micro"]
        assert nat["zen_steps"] == STEPS * MICRO, (rank, nat["zen_steps"])  # each reducing backward pass
        for name, ref in plain["params"].items():
            assert torch.equal(nat["params"][name], ref), (rank, name)
