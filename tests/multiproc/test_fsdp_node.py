"""FSDP2 on a 1-D mesh spanning emulated nodes (``ZEN_EXT_HOST`` per rank: 2 nodes × 2 ranks, 2 × 3 and
3 × 2), with ``zen.hierarchical``: the node-level reduce-scatter (``reduction/node_scatter.py``) on real
gloo processes.

* natural-only node-level ZEN equals plain FSDP2 bitwise (losses, every step's gradient shard,
  parameters), fp32 and bf16, ops AVG and SUM (``SplitLM``: integer gradients, exact sums);
* with DGC, node-level ``zen`` equals node-level ``dense`` fed the same DGC output, and each rank's DGC
  state is about 1/L of the flat path's;
* ``"auto"`` on one emulated host runs flat.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.multiproc.fsdp_helpers import assert_same_run, state_bytes
from tests.multiproc.launch import run_workers
from tests.multiproc.test_fsdp import STEPS, SplitLM, _shard, _train

DGC = {"enabled": True, "density": 0.3, "min_numel": 8, "momentum_correction": False, "warmup_steps": 0}


def _run(rank, world, dtype, op, zen):
    import zen_ext.fsdp

    model = _shard(SplitLM(dtype), world, op)
    a = zen_ext.fsdp.attach(model, zen) if zen is not None else None
    out = _train(model, rank, world, dtype)
    if a is None:
        return out
    out += ({"node": a.reducer.node is not None, "step": a.step, "state_bytes": state_bytes(a.state_dict()["sync"]["sparsifiers"]["params"]),
             **a.totals},)
    a.close()
    return out


def _node_worker(rank, world, L):
    os.environ["ZEN_EXT_HOST"] = f"node{rank // L}"
    natural = {"scheme": "zen", "hierarchical": True, "natural": {"enabled": True}}
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("avg", "sum"):
            cases[("natural", dtype, op)] = (_run(rank, world, dtype, op, None),
                                             _run(rank, world, dtype, op, natural))
    dgc = {"natural": {"enabled": True}, "dgc": DGC, "hierarchical": True}
    cases[("dgc", torch.float32, "avg")] = (_run(rank, world, torch.float32, "avg", {**dgc, "scheme": "dense"}),
                                            _run(rank, world, torch.float32, "avg", {**dgc, "scheme": "zen"}))
    flat = _run(rank, world, torch.float32, "avg", {**dgc, "scheme": "zen", "hierarchical": False})
    os.environ["ZEN_EXT_HOST"] = "one-host"
    auto = _run(rank, world, torch.float32, "avg", {"scheme": "zen", "hierarchical": "auto"})
    return cases, flat[3], auto[3]


@pytest.mark.parametrize("N, L", [(2, 2), (2, 3), (3, 2)])
def test_node_level_fsdp2_equals_plain_fsdp2(N, L):
    for rank, (cases, flat, auto) in enumerate(run_workers(_node_worker, N * L, L, timeout_s=900)):
        for (what, dtype, op), (ref, got) in cases.items():
            where = f"rank {rank} {what} {dtype} {op}"
            losses, grads, params, info = got
            assert info["node"] and info["step"] == STEPS, where
            assert info["intra_bytes_sent"] > 0 and info["bytes_sent"] > info["intra_bytes_sent"], (where, info)
            if what == "dgc":
                ref = ref[:3]  # the dense node-level reduce-scatter of the same DGC output
            assert_same_run(ref, (losses, grads, params), where)
        node_dgc = cases[("dgc", torch.float32, "avg")][1][3]
        assert not flat["node"] and not auto["node"] and auto["intra_bytes_sent"] == 0
        # DGC's residual covers this rank's node-level shard: about 1/L of what the flat path keeps.
        assert 0 < node_dgc["state_bytes"] <= flat["state_bytes"] / L * 1.5, (node_dgc["state_bytes"],
                                                                              flat["state_bytes"])
