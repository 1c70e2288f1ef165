"""SparDL on real gloo processes: the all-reduce and the reduce-scatter equal SimWorld's bit for bit (2 and
3 ranks, the fixed-size ``sendrecv`` rounds over ``batch_isend_irecv``), and DDP's hook trains with
``"scheme": "spardl"`` behind DGC, replicas equal, residuals in the checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.launch import run_workers
from tests.multiproc.test_ddp_hook import TinyLM, _train

NUMEL, DENSITY = 1001, 0.03


def _inputs(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(world)
    return [torch.randint(-9, 10, (NUMEL,), generator=g).float() for _ in range(world)]


def _run(comm, mem, residual):
    from zen_ext.core.reduce_scatter import build_reduce_scatter
    from zen_ext.core.registry import build_scheme
    from zen_ext.core.rs_base import even_ranges
    from zen_ext.core.types import AccumulatedGrad

    ar_mem, rs_mem = mem.clone(), mem.clone()
    out = build_scheme("spardl", residual=residual).sync(comm, AccumulatedGrad.of(ar_mem, DENSITY, torch.float32))
    part = build_reduce_scatter("spardl", residual=residual).reduce_scatter(
        comm, AccumulatedGrad.of(rs_mem, DENSITY, torch.float32), even_ranges(NUMEL, comm.size))
    return out, ar_mem, part, rs_mem, comm.stats.as_dict()


def _gloo(rank, world, residual):
    from zen_ext.comm.torch_dist import TorchCommunicator

    return _run(TorchCommunicator(), _inputs(world)[rank], residual)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("residual", ["global", "local"])
def test_gloo_equals_simworld(world, residual):
    from zen_ext.comm.simulated import SimWorld

    got = run_workers(_gloo, world, residual)
    sim = SimWorld(world).run(lambda c, m: _run(c, m, residual), _inputs(world))
    for g, s in zip(got, sim):
        for a, b in zip(g[:4], s[:4]):
            assert torch.equal(a, b)
        assert g[4] == s[4]  # the same bytes, messages and rounds
    if residual == "global":
        total = sum(_inputs(world))
        assert torch.equal(got[0][0] + sum(g[1] for g in got), total)
        assert torch.equal(torch.cat([g[2] for g in got]) + sum(g[3] for g in got), total)


ZEN = {"scheme": "spardl", "dgc": {"enabled": True, "density": 0.1, "min_numel": 64, "warmup_steps": 0}}


def _ddp_spardl(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zen_ext.engines.ddp import ZenHookState, register_zen_hook

    ddp = DDP(TinyLM(), bucket_cap_mb=0.002)
    state = register_zen_hook(ddp, ZEN)
    _, losses = _train(ddp, 12, rank, world, lr=0.5)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    sd = state.state_dict()
    other = ZenHookState.build(TinyLM(), ZEN)
    other.load_state_dict(sd)
    return losses, params, sd, other.state_dict(), dict(state.sync.param_kinds), state.stats.totals


def test_ddp_hook_trains_with_spardl():
    (losses0, params0, sd0, restored0, kinds, totals), (losses1, params1, *_) = run_workers(_ddp_spardl, 2)
    assert kinds["head.weight"] == "dgc"
    for name in params0:  # SparDL's result is the same on every rank
        assert torch.equal(params0[name], params1[name]), name
    assert sum(losses0[-3:]) < sum(losses0[:3])
    assert "head.weight" in str(sd0["sync"]["sparsifiers"])  # the residual, keyed by name
    assert str(sd0["sync"]) == str(restored0["sync"])
    assert 0 < totals["bytes_sent"] < totals["dense_bytes"]
