"""recipes/fsdp_checkpoint.py restoring at another world size (2 → 4 and 4 → 2 gloo ranks).

A run saves its distributed checkpoint (model, CatchUpAdamW, the step, each rank's ZEN state with DGC
residuals) after 3 steps; a fresh run at the other world size loads it as the FSDP2 recipe does
(``fsdp_checkpoint.load``): the weights and the optimizer's per-element state come back resharded,
bit for bit as full tensors; ZEN takes the shared part (its step counter, so DGC's warm-up goes on) and
restarts the per-rank residuals, saying so in one warning; then it trains on, its collectives in line.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.multiproc.launch import run_workers
from tests.multiproc.test_fsdp import SplitLM, _batch, _shard

ZEN = {"scheme": "zen", "natural": {"enabled": True},
       "dgc": {"enabled": True, "density": 0.2, "min_numel": 8, "momentum_correction": False, "warmup_steps": 10}}
SAVED_AT = 3


def _build(world):
    """The recipe's pieces on the test model: FSDP2, CatchUpAdamW (its default under DGC), ZEN."""
    import zen_ext.fsdp
    from zen_ext.config import ZenConfig
    from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

    model = _shard(SplitLM(torch.float32), world, "avg")
    opt = CatchUpAdamW(catch_up_param_groups(model, ZenConfig.from_json_section(ZEN)), lr=0.01)
    return model, opt, zen_ext.fsdp.attach(model, ZEN, optimizer=opt)


def _full(model, opt) -> dict:
    """Every parameter and every optimizer state tensor as full (unsharded) tensors, by name."""
    out = {f"param.{n}": p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for k, v in opt.state.get(p, {}).items():
            out[f"optim.{n}.{k}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else torch.as_tensor(v).clone()
    return out


def _train(model, opt, rank, world, start, steps):
    losses = []
    for step in range(start, start + steps):
        loss = model(*_batch(step, rank, world, torch.float32))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save(rank, world, path):
    from recipes import fsdp_checkpoint

    model, opt, zen = _build(world)
    _train(model, opt, rank, world, 0, SAVED_AT)
    residual = sum(float(st["residual"].abs().sum()) for st in zen.sync.state.params.values() if "residual" in st)
    fsdp_checkpoint.save(path, SAVED_AT, model, opt, zen, "CatchUpAdamW")
    return _full(model, opt), zen.step, zen.sync.state.step, residual


def _load(rank, world, path):
    from recipes import fsdp_checkpoint

    model, opt, zen = _build(world)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger(zen.log_name).addHandler(handler)
    step = fsdp_checkpoint.load(fsdp_checkpoint.latest(path), model, opt, zen)
    restored, steps = _full(model, opt), (step, zen.step, zen.sync.state.step)
    residual = sum(float(st["residual"].abs().sum()) for st in zen.sync.state.params.values() if "residual" in st)
    losses = _train(model, opt, rank, world, step, 2)
    return restored, steps, residual, records, losses, _full(model, opt)


@pytest.mark.parametrize("before,after", [(2, 4), (4, 2)])
def test_a_checkpoint_resumes_at_another_world_size(tmp_path, before, after):
    path = str(tmp_path / "checkpoints")
    saved = run_workers(_save, before, path, timeout_s=600)
    full, zen_step, dgc_step, _ = saved[0]
    assert zen_step == SAVED_AT and dgc_step == SAVED_AT
    assert sum(r[3] for r in saved) > 0  # DGC held gradient back: there were residuals to lose
    for rank, (restored, steps, residual, records, losses, after_full) in enumerate(
            run_workers(_load, after, path, timeout_s=600)):
        assert steps == (SAVED_AT,) * 3, (rank, steps)  # the recipe's, ZEN's and DGC's step counters
        assert restored.keys() == full.keys()
        for key in full:  # resharded by DCP, equal as full tensors
            assert torch.equal(restored[key], full[key]), (before, after, rank, key)
        assert residual == 0.0  # the residuals of another world size restart ...
        assert any(f"dp_size {before}, now {after}" in m for m in records), records  # ... and it says so
        assert all(torch.isfinite(torch.tensor(losses)))
        assert any(not torch.equal(after_full[k], full[k]) for k in full if k.startswith("param."))  # it trained
