"""4 processes: AutoTP tensor × data parallel (tp 2 × dp 2), and hierarchical data parallel on 2
emulated nodes × 2 local ranks (ZEN_EXT_HOST names the node). One launch serves both (it is the slowest test).

* AutoTP: ZEN runs over each data-parallel group, DGC agrees thresholds over the TP group, and the
  replicated embedding is synchronized once per DP group (each TP rank half of its rows). With
  natural sparsity only, losses and weights equal the dense DeepSpeed AutoTP run (DP groups of 2).
* Hierarchical: dense reduce-scatter inside a node, ZEN across nodes on each shard, all-gather
  inside the node. Sums of 4 ranks then run in another order than gloo's ring, so the comparison
  with the dense run is to float tolerance.
"""

import os

import pytest
import torch

from tests.e2e.test_deepspeed_engine import MODEL, _batches, _ds_config, _engine, _train, _weights
from tests.multiproc.launch import run_workers

pytestmark = pytest.mark.slow

DGC = {"enabled": True, "density": 0.05, "min_numel": 256, "momentum_correction": False, "momentum_masking": False}


def _worker(rank, world):
    from deepspeed.utils import groups

    out = {}
    # Hierarchical first: AutoTP engines set global TP groups that later plain engines would inherit.
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["ZEN_EXT_HOST"] = f"node{rank // 2}"  # the hierarchy is decided from the hosts ranks report
    batches = _batches(rank, 3)
    dense = _engine(_ds_config(0))
    hier = _engine(_ds_config(0, zen={"scheme": "zen", "hierarchical": True}))
    out["hier"] = {"dense": _train(dense, batches), "zen": _train(hier, batches), "dense_w": _weights(dense),
                   "zen_w": _weights(hier), "on": hier.zen.hierarchical, "totals": hier.zen.totals}
    flat = _engine(_ds_config(0, zen={"scheme": "zen", "hierarchical": False}))
    out["flat_off"] = not flat.zen.hierarchical
    fixed = _batches(rank, 2, seed=4)
    hd = _engine(_ds_config(1, zen={"scheme": "zen", "dgc": DGC, "hierarchical": "auto"}))
    out["hier_dgc"] = {"losses": _train(hd, fixed * 8), "on": hd.zen.hierarchical}

    # AutoTP tp 2 x dp 2: TP ranks of a replica read the same batches.
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    os.environ["ZEN_EXT_HOST"] = "node0"
    for stage in (0, 1):
        tp = {"autotp_size": 2}
        d = _engine(_ds_config(stage, tensor_parallel=tp))
        dp_rank = groups.get_data_parallel_rank()
        batches = _batches(dp_rank, 3)
        z = _engine(_ds_config(stage, tensor_parallel=tp, zen={"scheme": "zen"}))
        out[f"tp_zero{stage}"] = {"dense": _train(d, batches), "zen": _train(z, batches), "dense_w": _weights(d),
                                  "zen_w": _weights(z), "totals": z.zen.totals, "dp_rank": dp_rank,
                                  "shared": sorted(z.zen.reducer.tp_shared), "last": z.zen.stats.last}
    z = _engine(_ds_config(1, tensor_parallel={"autotp_size": 2}, zen={"scheme": "zen", "dgc": DGC}))
    fixed = _batches(groups.get_data_parallel_rank(), 2, seed=4)
    out["tp_dgc"] = {"losses": _train(z, fixed * 8), "totals": z.zen.totals}
    out["tp_catch_up"] = _catch_up_under_autotp(fixed * 8)
    return out


def _catch_up_under_autotp(batches):
    """CatchUpAdamW (the recipe's default for DGC under Adam) as a client optimizer under AutoTP: its
    groups are built on the unsharded model, and DeepSpeed re-points them at the sharded parameters."""
    import zen_ext.deepspeed as zds
    from recipes.common import build_model
    from zen_ext.config import ZenConfig
    from zen_ext.optim import CatchUpAdamW, catch_up_param_groups

    cfg = _ds_config(0, tensor_parallel={"autotp_size": 2}, zen={"scheme": "zen", "dgc": DGC})
    cfg.pop("optimizer")
    model = build_model(MODEL, seed=0)
    opt = CatchUpAdamW(catch_up_param_groups(model, ZenConfig.from_ds_config(cfg)), lr=2e-3)
    engine, *_ = zds.initialize(model=model, config=cfg, optimizer=opt)
    losses = _train(engine, batches)
    up, rest = ([p for p in g["params"]] for g in opt.param_groups)
    return {"losses": losses, "w": _weights(engine), "n_up": len(up),
            "covers_live": {id(p) for p in up + rest} == {id(p) for p in engine.module.parameters()},
            "max_age": max(float(opt.state[p]["age"].max()) for p in up)}


@pytest.fixture(scope="module")
def runs():
    return run_workers(_worker, 4, timeout_s=600)


@pytest.mark.parametrize("stage", [0, 1])
def test_autotp_natural_equals_dense(runs, stage):
    for rank in range(4):
        r = runs[rank][f"tp_zero{stage}"]
        assert r["dp_rank"] == rank // 2  # DeepSpeed's layout: TP ranks contiguous
        assert r["zen"] == r["dense"], rank
        assert torch.equal(r["zen_w"], r["dense_w"]), rank
        assert r["shared"] == ["model.embed_tokens.weight"]  # replicated embedding, shared over TP
        assert r["totals"]["tp_bytes_sent"] > 0
        # Each TP rank synchronized half of the embedding's rows over its DP group.
        assert r["last"]["numel"]["natural"] == 500 * 64 and r["last"]["nnz"]["natural"] < 500 * 64 // 4
    # TP ranks hold different shards; DP replicas of one TP rank hold the same ones.
    assert torch.equal(runs[0]["tp_zero0"]["zen_w"], runs[2]["tp_zero0"]["zen_w"])


def test_autotp_dgc_trains(runs):
    for rank in range(4):
        r = runs[rank]["tp_dgc"]
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2]) - 0.3, r["losses"]
        assert 0 < r["totals"]["bytes_sent"] < 0.5 * r["totals"]["dense_bytes"]


def test_catch_up_adamw_trains_the_sharded_parameters(runs):
    """Every live (sharded) parameter is in CatchUpAdamW's groups, the DGC ones caught up after being held
    back, the run trains, and the two DP replicas of each TP rank end with the same shard."""
    for rank in range(4):
        r = runs[rank]["tp_catch_up"]
        assert r["covers_live"] and r["n_up"] > 0 and r["max_age"] >= 2, r
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2]) - 0.3, r["losses"]
    for rank in (0, 1):
        assert torch.equal(runs[rank]["tp_catch_up"]["w"], runs[rank + 2]["tp_catch_up"]["w"])


def test_hierarchical_matches_dense(runs):
    for rank in range(4):
        r = runs[rank]["hier"]
        assert r["on"] and runs[rank]["flat_off"]
        torch.testing.assert_close(torch.tensor(r["zen"]), torch.tensor(r["dense"]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["zen_w"], r["dense_w"], rtol=1e-4, atol=1e-5)
        assert r["totals"]["intra_bytes_sent"] > 0
        h = runs[rank]["hier_dgc"]
        assert h["on"] and sum(h["losses"][-2:]) < sum(h["losses"][:2]) - 0.3
    # Every replica ends with the same weights.
    for rank in range(1, 4):
        assert torch.equal(runs[0]["hier"]["zen_w"], runs[rank]["hier"]["zen_w"])
