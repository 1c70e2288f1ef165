"""DGC under DeepSpeed fp16 dynamic loss scaling, on 2 gloo processes (tiny Llama, ZeRO-1, small buckets).

* The adapter hands the optimizer's loss scale to DGC before every bucket (``set_grad_scale``), so the
  residuals follow the scale when it halves after an overflow.
* An overflow on one rank in a *late* bucket of the step (layer 0 is reduced last) skips the step, and
  every rank's DGC memory — including the buckets compressed before the overflowed one — is bitwise
  what it was before the step.
"""

import torch

from tests.e2e.test_deepspeed_engine import _batches, _ds_config, _engine
from tests.multiproc.launch import run_workers


def _state(engine):
    return {n: {k: t.clone() for k, t in e.items() if k != "threshold"}
            for n, e in engine.zen.sync.state.state_dict()["params"].items()}


def _worker(rank, world):
    dgc = {"enabled": True, "density": 0.05, "min_numel": 256}
    cfg = _ds_config(1, "fp16", zen={"scheme": "zen", "dgc": dgc})
    cfg["zero_optimization"].update({"reduce_bucket_size": 20000, "reduce_scatter": False})
    cfg["fp16"]["hysteresis"] = 1  # halve the scale at the first overflow (DeepSpeed's default waits for 2)
    engine = _engine(cfg)
    w = engine.module.model.layers[0].self_attn.q_proj.weight
    poison = {"on": False}
    w.register_hook(lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("inf"),
                    dtype=g.dtype)) if poison["on"] else g)
    out = {"scales": [], "dgc_scales": [], "states": [], "skipped": [], "calls": []}
    for i, x in enumerate(_batches(rank, 4, seed=5)):
        poison["on"] = rank == 1 and i == 2
        before = engine.zen.override_calls
        out["states"].append(_state(engine))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        out["calls"].append(engine.zen.override_calls - before)
        out["scales"].append(float(engine.optimizer.loss_scale))
        out["dgc_scales"].append(engine.zen.sync.sparsifiers["dgc"].loss_scale)
        out["skipped"].append(engine.skipped_steps)
    out["states"].append(_state(engine))
    return out


def test_overflow_keeps_dgc_memory_and_scale_follows():
    res = run_workers(_worker, 2, timeout_s=600)
    for rank, r in enumerate(res):
        assert r["skipped"] == [0, 0, 1, 1], (rank, r["skipped"])
        assert min(r["calls"]) > 1  # several buckets per step: earlier ones compressed before the overflow
        # The memory of the skipped step (index 2) is bitwise what it was before it ...
        before, after = r["states"][2], r["states"][3]
        assert before and set(before) == set(after)
        for name in before:
            for key in before[name]:
                assert torch.equal(after[name][key], before[name][key]), (rank, name, key)
        # ... while normal steps change it.
        assert any(not torch.equal(r["states"][2][n]["residual"], r["states"][1][n]["residual"]) for n in before)
        # DGC saw the scale each step was reduced at: the scale before the step's optimizer update.
        assert r["dgc_scales"][0] == 2.0 ** 8
        assert r["dgc_scales"][1:] == r["scales"][:-1]
        assert r["scales"][2] == r["scales"][1] / 2  # halved after the overflow: DGC's memory followed
