"""DeepSpeed ZeRO-3 and ZeRO-2 (``reduce_scatter: true``) with ``zen.hierarchical`` on emulated nodes
(``ZEN_EXT_HOST`` per rank: 2 nodes × 2 ranks; 2 × 3 and 3 × 2 for natural rows): the node-level
reduce-scatter (``reduction/node_scatter.py``) on real gloo processes.

* natural-only node-level ZEN equals plain DeepSpeed (losses and gathered parameters, ``==``) on
  ``ExactToy`` (integer-multiple gradients: exact sums in any order): ZeRO-3 fp32 and bf16, ZeRO-2 fp32;
* with DGC (ZeRO-3), node-level ``zen`` equals node-level ``dense`` fed the same DGC output, and each
  rank's DGC state is about half the flat path's (2 × 2).
"""

import os

import pytest
import torch

from tests.e2e.test_deepspeed_zero3 import STEPS, _batches, _ds_config, _engine, _train, _weights
from tests.multiproc.launch import run_workers

DGC = {"enabled": True, "density": 0.3, "min_numel": 8, "momentum_correction": False, "momentum_masking": False,
       "warmup_steps": 0}


def _state_bytes(engine) -> int:
    sd = engine.zen.sync.state_dict()
    return sum(t.numel() * t.element_size() for e in sd["sparsifiers"]["params"].values() for t in e.values())


def _run(stage, dtype, zen, batches):
    e = _engine(_ds_config(stage, dtype, zen=zen), toy=True)
    out = {"losses": _train(e, batches, toy=True), "w": _weights(e)}
    if zen is not None:
        out.update(node=e.zen.reducer.node is not None, totals=e.zen.totals, last=e.zen.stats.last,
                   state_bytes=_state_bytes(e))
        e.zen.close()
    return out


def _worker(rank, world, L, with_dgc):
    os.environ["ZEN_EXT_HOST"] = f"node{rank // L}"
    batches = _batches(rank, STEPS, toy=True)
    natural = {"scheme": "zen", "hierarchical": True}
    out = {}
    for name, stage, dtype in (("zero3_fp32", 3, "fp32"), ("zero3_bf16", 3, "bf16"), ("zero2_fp32", 2, "fp32")):
        out[name] = (_run(stage, dtype, None, batches), _run(stage, dtype, natural, batches))
    if with_dgc:
        dgc = {"dgc": DGC, "hierarchical": True}
        out["dgc"] = (_run(3, "fp32", {**dgc, "scheme": "dense"}, batches),
                      _run(3, "fp32", {**dgc, "scheme": "zen"}, batches))
        out["flat_dgc"] = _run(3, "fp32", {**dgc, "scheme": "zen", "hierarchical": False}, batches)
    return out


@pytest.mark.parametrize("N, L", [(2, 2), pytest.param(2, 3, marks=pytest.mark.slow),
                                  pytest.param(3, 2, marks=pytest.mark.slow)])  # 6 DeepSpeed processes: minutes
def test_node_level_zero_equals_plain_zero(N, L):
    with_dgc = (N, L) == (2, 2)
    res = run_workers(_worker, N * L, L, with_dgc, timeout_s=1500)
    if with_dgc:
        assert any("dgc" in out["dgc"][1]["last"]["numel"] for out in res)  # DGC ran
    for rank, out in enumerate(res):
        for name in ("zero3_fp32", "zero3_bf16", "zero2_fp32") + (("dgc",) if with_dgc else ()):
            ref, got = out[name]
            assert got["node"], (name, rank)
            assert got["losses"] == ref["losses"], (name, rank)
            assert torch.equal(got["w"], ref["w"]), (name, rank)
            assert got["totals"]["intra_bytes_sent"] > 0, (name, rank, got["totals"])
        if not with_dgc:
            continue
        last = out["dgc"][1]["last"]
        if "dgc" in last["numel"]:  # ranks whose node-level shard holds some of lin.weight
            assert last["nnz"]["dgc"] < last["numel"]["dgc"], (rank, last)
        flat, node = out["flat_dgc"]["state_bytes"], out["dgc"][1]["state_bytes"]
        assert not out["flat_dgc"]["node"] and 0 < node <= flat / L * 1.5, (rank, node, flat)
