"""``zen_ext.optim.CatchUpAdamW`` on FSDP2's DTensor parameters (real gloo processes).

* 2 FSDP2 ranks, each reducing its own batch, step bitwise like CatchUpAdamW on the full tensors of one
  process fed the mean of the two batches' gradients (at 2 ranks FSDP's mean ``a/2 + b/2`` is exact,
  and every operation of the step is per element): parameters, ``exp_avg``, ``exp_avg_sq``, ``age``;
  embedding rows no batch touches wait and age (the catch-up path), the rest is AdamW;
* the state is DTensors placed as their parameters, so ``torch.distributed.checkpoint``'s optimizer
  state dict saves it, and a run restored from it continues bitwise;
* a gradient placed otherwise than its parameter is refused with a clear error.
"""

from __future__ import annotations

import torch

from tests.multiproc.launch import run_workers

VOCAB, WIDTH, HID = 13, 6, 7  # 13 and 7 rows: the second rank's chunk is shorter (FSDP's padding)
KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
STEPS, SAVE_AT = 5, 3


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, HID)
        self.head = torch.nn.Linear(HID, VOCAB)

    def forward(self, ids):
        return torch.nn.functional.cross_entropy(self.head(torch.tanh(self.hidden(self.embed(ids)))).flatten(0, 1),
                                                 ids.roll(-1, 1).flatten())


def _ids(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch: only rows 0-7 ever appear, so rows 8-12 (all of the second rank's embedding
    chunk but one row) get zero gradients and catch up never; rows 0-7 skip some steps."""
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randint(0, 4 + 4 * (step % 2), (2, 5), generator=g)


def _groups(model):
    return [{"params": [model.embed.weight], "catch_up": True},
            {"params": [p for n, p in model.named_parameters() if not n.startswith("embed")], "catch_up": False}]


def _sharded():
    from torch.distributed.fsdp import fully_shard

    model = TinyLM()
    for child in model.children():
        fully_shard(child)
    fully_shard(model)
    return model


def _fsdp_step(model, opt, step, rank):
    model(_ids(step, rank)).backward()
    opt.step()
    opt.zero_grad()


def _full(model, opt) -> dict:
    """Parameters and state as full tensors, by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
        out[name] = full(p.detach()).clone()
        for key in ("exp_avg", "exp_avg_sq", "age"):
            out[f"{name}.{key}"] = full(opt.state[p][key]).clone()
    return out


def _reference(world: int, steps: int) -> dict:
    """One process, full tensors: each step's gradient is the mean of the ranks' batches' gradients."""
    from zen_ext.optim import CatchUpAdamW

    model = TinyLM()
    opt = CatchUpAdamW(_groups(model), **KW)
    for step in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            model(_ids(step, r)).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        for n, p in model.named_parameters():
            p.grad = sum(g[n] for g in grads) / world
        opt.step()
        opt.zero_grad()
    return _full(model, opt)


def _dtensor_run(rank, world, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor, Replicate

    from zen_ext.optim import CatchUpAdamW

    model = _sharded()
    opt = CatchUpAdamW(_groups(model), **KW)
    for step in range(SAVE_AT):
        _fsdp_step(model, opt, step, rank)
    placed = all(isinstance(opt.state[p][k], DTensor) and opt.state[p][k].placements == p.placements
                 for p in model.parameters() for k in ("exp_avg", "exp_avg_sq", "age"))
    ages_fp32 = all(opt.state[p]["age"].dtype == torch.float32 for p in model.parameters())
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    for step in range(SAVE_AT, STEPS):
        _fsdp_step(model, opt, step, rank)
    whole = _full(model, opt)
    # A fresh model and optimizer, restored from the checkpoint, run the remaining steps.
    second = _sharded()
    opt2 = CatchUpAdamW(_groups(second), **KW)
    msd, osd = get_state_dict(second, opt2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(second, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for step in range(SAVE_AT, STEPS):
        _fsdp_step(second, opt2, step, rank)
    resumed = _full(second, opt2)
    # A gradient placed otherwise than its parameter.
    p = second.hidden.weight
    p.grad = DTensor.from_local(torch.zeros(HID, WIDTH), p.device_mesh, [Replicate()])
    try:
        opt2.step()
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return whole, resumed, placed, ages_fp32, refused


def test_catch_up_adamw_on_dtensor_equals_the_full_tensor_step_and_resumes_from_dcp(tmp_path):
    ref = _reference(2, STEPS)
    for rank, (whole, resumed, placed, ages_fp32, refused) in enumerate(
            run_workers(_dtensor_run, 2, str(tmp_path / "dcp"))):
        assert placed and ages_fp32, rank
        assert whole.keys() == ref.keys()
        for key in ref:
            assert torch.equal(whole[key], ref[key]), (rank, key, (whole[key] - ref[key]).abs().max())
            assert torch.equal(resumed[key], ref[key]), (rank, key, "resumed")
        # The catch-up path ran: rows 8-12 never had a gradient (age = STEPS, weight only decayed);
        # rows 0-3 had one every step (age 0).
        age = ref["embed.weight.age"]
        assert torch.equal(age[8:], torch.full_like(age[8:], STEPS)) and torch.equal(age[:4], torch.zeros_like(age[:4]))
        assert refused and "placed" in refused and "Replicate" in refused, refused
