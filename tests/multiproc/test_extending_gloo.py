"""docs/extending.md's sparsifier example in torch DDP over real gloo processes: a model's masked layer
goes to the outside ``nonzero`` sparsifier, and the gradients equal DDP's own all-reduce bitwise."""

from __future__ import annotations

import torch

from tests.multiproc.launch import run_workers
from tests.unit.test_extending_sparsifier import load_example


class MaskedLM(torch.nn.Module):
    """An embedding (natural), a masked layer whose gradient is mostly zero (nonzero), a head (dense)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(40, 8)
        self.mask_proj = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.Linear(8, 40)
        self.register_buffer("mask", (torch.rand(8, 8) < 0.2).float())

    def forward(self, ids):
        h = self.embed(ids)
        h = h + torch.nn.functional.linear(h, self.mask_proj.weight * self.mask)  # masked weights: zero grads
        return self.head(h).logsumexp(-1).mean()


def _ddp_with_outside_sparsifier(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp import register_zen_hook

    load_example()
    zen = {"scheme": "zen", "nonzero": {"enabled": True, "params": [r"^mask_proj\.weight$"]}}
    runs = []
    for hooked in (False, True):
        ddp = DDP(MaskedLM(), bucket_cap_mb=0.001)
        state = register_zen_hook(ddp, zen) if hooked else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        grads = []
        for step in range(3):
            ids = torch.tensor([[rank, 39 - step, 0], [step, rank + 5, 39]])
            ddp(ids).backward()
            grads.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
            opt.step()
            opt.zero_grad()
        runs.append((grads, dict(state.sync.param_kinds) if state else None,
                     state.stats.totals if state else None))
    return runs


def test_ddp_hook_uses_the_outside_sparsifier_and_equals_ddp():
    for (ref, _, _), (got, kinds, totals) in run_workers(_ddp_with_outside_sparsifier, 2):
        assert kinds["mask_proj.weight"] == "nonzero" and kinds["embed.weight"] == "natural"
        assert kinds["head.weight"] == "dense"
        for step, (r, g) in enumerate(zip(ref, got)):
            for name in r:  # (a + b) / 2 == a/2 + b/2 exactly with 2 ranks: bitwise equal
                assert torch.equal(g[name], r[name]), (step, name)
        assert totals["bytes_sent"] > 0
