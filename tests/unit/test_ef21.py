"""EF21 feedback (``zen.dgc.feedback: "ef21"``, issue 21): each rank sends the top-k of ``g − G_i`` and
moves its estimate ``G_i`` by exactly what it sent; the result is the previous aggregate plus the
synchronized difference, so it equals ``Σ_i G_i`` (or the mean) after every step, on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_synchronizer import KINDS, NUMEL, SLICES, bucket_inputs
from zen_ext import SimWorld, build_scheme
from zen_ext.compress import DGCConfig, DGCSparsifier
from zen_ext.reduction.synchronizer import Synchronizer

EF21 = {"enabled": True, "density": 0.05, "momentum_correction": False, "feedback": "ef21"}
DGC_SLICES = [s for s in SLICES if KINDS[s.name] == "dgc"]


def _run(n, steps, dgc, op="sum", scheme="zen"):
    inputs = [bucket_inputs(n, seed=7 * t + 1) for t in range(steps)]

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme(scheme), param_kinds=KINDS, dgc=dgc, natural={})
        outs, estimates = [], []
        for x in inputs:
            outs.append(sync.sync_flat(x[comm.rank].clone(), SLICES, op).clone())
            estimates.append(torch.cat([sync.state.get(s.name, "ef21_estimate").clone() for s in DGC_SLICES]))
            sync.end_step()
        return outs, estimates

    return inputs, SimWorld(n).run(fn)


def _dgc_part(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[s.offset : s.offset + s.numel] for s in DGC_SLICES])


@pytest.mark.parametrize("n", [1, 3, 4])
def test_result_is_the_sum_of_the_estimates_every_step(n):
    inputs, got = _run(n, steps=5, dgc=EF21)
    for t in range(5):
        want = sum(got[r][1][t] for r in range(n))  # Σ_i G_i after step t (integer-valued: exact)
        for r in range(n):
            assert torch.equal(_dgc_part(got[r][0][t]), want), (t, r)


def test_estimate_moves_only_where_sent_and_by_the_difference():
    n = 3
    inputs, got = _run(n, steps=4, dgc=EF21)
    for r in range(n):
        prev = torch.zeros(sum(s.numel for s in DGC_SLICES))
        for t in range(4):
            g, est = _dgc_part(inputs[t][r]), got[r][1][t]
            moved = est != prev
            assert moved.any() and not moved.all()  # top-5 %: some entries, not all
            assert torch.equal(est[moved], g[moved])  # sent entries: G_i = old + (g − old) = g
            prev = est


def test_density_one_equals_dense_every_step():
    n = 3
    inputs, got = _run(n, steps=3, dgc={**EF21, "density": 1.0})
    for t in range(3):
        dense = sum(inputs[t][r] for r in range(n))
        for r in range(n):
            assert torch.equal(_dgc_part(got[r][0][t]), _dgc_part(dense))


def test_mean_is_the_mean_of_the_estimates():
    n = 4
    _, got = _run(n, steps=3, dgc=EF21, op="mean")
    for t in range(3):
        want = sum(got[r][1][t] for r in range(n)) / n
        assert torch.allclose(_dgc_part(got[0][0][t]), want, rtol=0, atol=1e-6)


def test_config_refuses_what_ef21_cannot_serve():
    with pytest.raises(ValueError, match=r'zen.dgc.feedback \("ef21"\) must be "ef" when zen.dgc.momentum_correction'):
        DGCConfig.from_dict({**EF21, "momentum_correction": True})
    with pytest.raises(ValueError, match=r'zen.dgc.feedback \("ef21"\) must be "ef" when zen.dgc.clip_norm'):
        DGCConfig.from_dict({**EF21, "clip_norm": 1.0})
    with pytest.raises(ValueError, match="zen.dgc.feedback"):
        DGCConfig.from_dict({**EF21, "feedback": "ef22"})
    with pytest.raises(ValueError, match="fp16 loss scaling"):
        DGCSparsifier(DGCConfig.from_dict(EF21)).set_loss_scale(1024.0)


def test_momentum_correction_null_resolves_to_false_under_ef21():
    from zen_ext.config import ZenConfig, resolve_dgc_defaults

    cfg = ZenConfig.from_dict({"dgc": {"enabled": True, "feedback": "ef21"}})
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)  # momentum 0: DGCSGD would say true
    resolved, _ = resolve_dgc_defaults(cfg, sgd)
    assert resolved.dgc.momentum_correction is False


def test_overflowed_step_leaves_the_estimate_alone():
    sp = DGCSparsifier(DGCConfig.from_dict(EF21))
    from zen_ext.compress import NamedGrad

    g = torch.arange(4096, dtype=torch.float32) - 2000
    sp.compress([NamedGrad("w", g)])
    before = sp.state.get("w", "ef21_estimate").clone()
    bad = g.clone()
    bad[7] = float("inf")
    sent = sp.compress([NamedGrad("w", bad)])
    assert torch.equal(sent.indices, torch.tensor([7]))
    assert torch.equal(sp.state.get("w", "ef21_estimate"), before)


def test_resume_continues_exactly():
    n = 2
    inputs = [bucket_inputs(n, seed=3 * t + 2) for t in range(4)]

    def fn(comm):
        def make():
            return Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=EF21, natural={})

        a = make()
        outs = []
        for x in inputs:
            outs.append(a.sync_flat(x[comm.rank].clone(), SLICES, "sum").clone())
            a.end_step()
        b = make()
        for x in inputs[:2]:
            b.sync_flat(x[comm.rank].clone(), SLICES, "sum")
            b.end_step()
        c = make()
        c.load_state_dict(b.state_dict())
        resumed = []
        for x in inputs[2:]:
            resumed.append(c.sync_flat(x[comm.rank].clone(), SLICES, "sum").clone())
            c.end_step()
        return outs[2:], resumed

    for uninterrupted, resumed in SimWorld(n).run(fn):
        for u, r in zip(uninterrupted, resumed):
            assert torch.equal(u, r)
    assert NUMEL > 0
