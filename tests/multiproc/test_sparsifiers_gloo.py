"""The Synchronizer on real gloo processes: same results and bytes as SimWorld, lossless where it must be."""

from __future__ import annotations

import torch

from tests.multiproc.launch import run_workers
from tests.unit.test_dgc import run_grid
from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs, dgc_oracle
from zen_ext import SimWorld
from zen_ext.reduction.synchronizer import Synchronizer


def _steps(comm, steps, tp_comm=None, dgc=DGC):
    sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=KINDS, dgc=dgc, natural={}, tp_comm=tp_comm)
    outs, stats, thr = [], [], []
    for inputs in steps:
        x = inputs[comm.rank] if tp_comm is None else inputs
        outs.append(sync.sync_flat(x, SLICES, "mean"))
        st = sync.pop_step_stats()
        stats.append((st["bytes_sent"], st["bytes_recv"], st["tp_bytes_sent"]))
        thr.append([sync.state.get(n, "threshold").clone() for n in ("w1", "w2")])
        sync.end_step()
    return outs, stats, thr


def _dp_worker(rank, world_size, steps):
    from zen_ext.comm.torch_dist import TorchCommunicator

    return _steps(TorchCommunicator(), steps)


def test_mixed_bucket_on_gloo_matches_simworld_and_oracles():
    n = 3
    steps = [bucket_inputs(n, seed=s, empty_rank=2) for s in range(2)]
    got = run_workers(_dp_worker, n, steps)
    sim = SimWorld(n).run(lambda c: _steps(c, steps))
    want_dgc = dgc_oracle(steps, DGC, "mean")
    dgc_mask = torch.zeros(NUMEL, dtype=torch.bool)
    dgc_mask[260:1460] = dgc_mask[1465:2464] = True
    for step, inputs in enumerate(steps):
        dense = sum(inputs) / n
        for r in range(n):
            out = got[r][0][step]
            assert torch.equal(out, sim[r][0][step])
            assert torch.equal(out[~dgc_mask], dense[~dgc_mask])  # lossless paths: exact
            assert torch.equal(out[dgc_mask], want_dgc[step][dgc_mask].float())  # mean of what was sent
            assert got[r][1][step] == sim[r][1][step]  # same bytes as the simulator


def _grid_worker(rank, world_size, inputs, dp, tp, dgc):
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator

    # Global rank g = d·tp + t; every rank creates every group, in the same order.
    dp_groups = [dist.new_group([d * tp + t for d in range(dp)]) for t in range(tp)]
    tp_groups = [dist.new_group([d * tp + t for t in range(tp)]) for d in range(dp)]
    d, t = divmod(rank, tp)
    dp_comm, tp_comm = TorchCommunicator(dp_groups[t]), TorchCommunicator(tp_groups[d])
    return _steps(dp_comm, [inputs[rank]], tp_comm=tp_comm, dgc=dgc)


def test_dp_by_tp_grid_on_gloo_shares_thresholds_within_tp_groups():
    dp, tp = 2, 2
    inputs = bucket_inputs(dp * tp, seed=7)
    dgc = dict(DGC, density=0.1)
    got = run_workers(_grid_worker, dp * tp, inputs, dp, tp, dgc)
    sim = run_grid(dp, tp, lambda dc, tc, x: _steps(dc, [x], tp_comm=tc, dgc=dgc), inputs)
    for g in range(dp * tp):
        assert torch.equal(got[g][0][0], sim[g][0][0])
        assert got[g][1] == sim[g][1] and got[g][1][0][2] > 0
    for d in range(dp):
        a, b = got[d * tp][2][0], got[d * tp + 1][2][0]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
