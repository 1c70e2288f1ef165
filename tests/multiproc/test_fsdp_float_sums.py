"""Natural-only ZEN against plain FSDP2 with real float gradients, on real gloo processes: what is equal.

ZEN sums each element's contributions in another order than the engine's dense reduce-scatter (gloo's
ring, NCCL's ring or tree), and float addition is not associative. So:

* 2 ranks: every element is one addition of two operands, which commutes: bitwise equal (losses,
  every step's gradient shard, weights), fp32 and with a bf16 reduce (``MixedPrecisionPolicy``);
* 4 ranks: the first step's reduced gradient (same weights, same inputs on both runs) is within
  ``2·u·Σ_r |g_r|`` of plain FSDP2's element by element (``u`` the reduce dtype's unit roundoff:
  2^-24 fp32, 2^-8 bf16; ``g_r`` rank r's local gradient): two orders of the same sum, each within
  ``(n-1)·u·Σ|g_r|`` of the exact one, plus the mean's rounding (measured: at most 0.25 of the bound,
  fp32 and bf16). After ``STEPS`` SGD steps the weights differ by at most ``WEIGHT_BOUND`` (measured on
  this model: 0 in fp32, the updates rounding alike, and 1.5e-5 with a bf16 reduce).

Integer-valued gradients, exact in any order, are bitwise equal at 2, 3 and 4 ranks
(tests/multiproc/test_fsdp.py).
"""

from __future__ import annotations

import torch

from tests.multiproc.fsdp_helpers import train_sgd
from tests.multiproc.launch import run_workers

VOCAB, WIDTH, IN, STEPS = 16, 8, 6, 4
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
WEIGHT_BOUND = {torch.float32: 1e-6, torch.bfloat16: 1e-3}
"""Max |weight difference| after STEPS steps at 4 ranks: measured 0 / 1.5e-5, a wide margin above both
(the gradient bound above is the tight one)."""


class FloatLM(torch.nn.Module):
    """Embedding → LayerNorm → Linear → logsumexp, plus a projection of a float input: float gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 3 * VOCAB)
        self.proj = torch.nn.Linear(IN, WIDTH)

    def forward(self, ids, x):
        h = self.norm(self.embed(ids) + self.proj(x).unsqueeze(1))
        return self.head(h).logsumexp(-1).mean()


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (3, 5), generator=g), torch.randn(3, IN, generator=g)


def _train(rank, reduce_dtype, zen):
    import zen_ext.fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = FloatLM()
    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for child in (model.embed, model.head):
        fully_shard(child, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    a = zen_ext.fsdp.attach(model, zen) if zen is not None else None
    losses, grads, weights = train_sgd(model, lambda i: _batch(i, rank), STEPS, lr=0.5)
    out = {"losses": losses, "grads": grads, "w": weights}
    if a is not None:
        out["kinds"] = dict(a.sync.param_kinds)
        a.close()
    return out


def _abs_sum_shards(rank, world):
    """Σ_r |g_r| of the first step's local gradients, this rank's Shard(0) rows of each parameter."""
    import torch.distributed as dist

    model = FloatLM()
    model(*_batch(0, rank)).backward()
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.abs()
        dist.all_reduce(g)
        rows = -(-g.shape[0] // world)
        out[n] = g[rank * rows:(rank + 1) * rows]
    return out


def _worker(rank, world):
    natural = {"scheme": "zen", "natural": {"enabled": True}}
    out = {"abs_sum": _abs_sum_shards(rank, world)}
    for dtype in (torch.float32, torch.bfloat16):
        out[dtype] = (_train(rank, dtype, None), _train(rank, dtype, natural))
    return out


def test_two_ranks_float_gradients_bitwise():
    for rank, out in enumerate(run_workers(_worker, 2, timeout_s=600)):
        for dtype in (torch.float32, torch.bfloat16):
            plain, ours = out[dtype]
            assert ours["kinds"]["embed.weight"] == "natural"
            assert ours["losses"] == plain["losses"], (rank, dtype)
            for step, (g, ref) in enumerate(zip(ours["grads"], plain["grads"])):
                for name in ref:
                    assert torch.equal(g[name], ref[name]), (rank, dtype, step, name)
            for name in plain["w"]:
                assert torch.equal(ours["w"][name], plain["w"][name]), (rank, dtype, name)


def test_four_ranks_float_gradients_within_the_stated_bound():
    worst = {}
    for rank, out in enumerate(run_workers(_worker, 4, timeout_s=900)):
        for dtype in (torch.float32, torch.bfloat16):
            plain, ours = out[dtype]
            assert ours["losses"][0] == plain["losses"][0], (rank, dtype)  # the same weights and inputs
            for name, ref in plain["grads"][0].items():
                bound = 2 * UNIT_ROUNDOFF[dtype] * out["abs_sum"][name] * 1.01 + 1e-30
                diff = (ours["grads"][0][name] - ref).abs()
                assert (diff <= bound).all(), (rank, dtype, name, float((diff - bound).max()))
                worst[("grad/bound", dtype)] = max(worst.get(("grad/bound", dtype), 0.0),
                                                   float((diff / bound).max()))
            for name, ref in plain["w"].items():
                diff = float((ours["w"][name] - ref).abs().max()) if ref.numel() else 0.0
                assert diff <= WEIGHT_BOUND[dtype], (rank, dtype, name, diff)
                worst[("weights", dtype)] = max(worst.get(("weights", dtype), 0.0), diff)
    print("worst:", worst)  # the measured values the module docstring states (pytest -s)
    # The orders do differ at 4 ranks (README and docs say "within a bound", not "bitwise", here): if
    # this fails, ZEN's sums became bitwise equal to gloo's, and the docs can say so.
    assert worst[("grad/bound", torch.float32)] > 0 and worst[("grad/bound", torch.bfloat16)] > 0
