"""Resuming a checkpoint with ``zen.dgc.value_bits`` turned on or off (``DGCSparsifier.resumed``,
``planner/low_bits.replan_for_value_bits``). What is checked, with ``zen`` and with ``auto``:

* on: the checkpoint of a run without value_bits loads, the owner residuals start at zero (a log line
  says so), the sender residuals are restored, and nothing is dropped across the switch: over both runs,
  inputs = what was applied + every sender residual + every owner residual;
* off: the owner residuals are dropped (a log line says so, and they are no longer saved), and what is
  lost is exactly them: inputs = applied + sender residuals + the dropped owner residuals;
* ``auto`` keeps its calibration and re-plans every slice; a candidate set changed by the user (same
  bits) is still refused."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs
from zen_ext import SimWorld
from zen_ext.compress.dgc.sparsifier import OWNER_KEY
from zen_ext.core.registry import build_scheme
from zen_ext.reduction.synchronizer import Synchronizer

DGC_SLICES = [s for s in SLICES if KINDS[s.name] == "dgc"]
N, STEPS0, STEPS1 = 3, 3, 3


def _phase(bits, scheme, inputs, states=None, scheme_kw=None):
    """Run ``inputs`` (per step, per rank) with ``value_bits=bits`` from ``states`` (or from scratch); returns
    per rank ``(outs, state_dict round-tripped through torch.save, the Synchronizer, its state right after load)``."""
    cfg = dict(DGC, value_bits=bits)

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme(scheme, **(scheme_kw or {})), param_kinds=KINDS,
                            dgc=cfg, natural={})
        loaded = None
        if states is not None:
            sync.load_state_dict(states[comm.rank])
            loaded = {k: {kk: t.clone() for kk, t in e.items()} for k, e in sync.state.params.items()}
        outs = []
        for x in inputs:
            outs.append(sync.sync_flat(x[comm.rank], SLICES, "sum").clone())
            sync.end_step()
        buf = io.BytesIO()
        torch.save(sync.state_dict(), buf)
        buf.seek(0)
        return outs, torch.load(buf), sync, loaded

    return SimWorld(N).run(fn)


def _owner_residuals(params_by_rank) -> torch.Tensor:
    """Every rank's owner residual scattered onto the bucket (fp64), by ZEN's partition of the DGC slices."""
    out = torch.zeros(NUMEL, dtype=torch.float64)
    concat = torch.cat([torch.arange(s.offset, s.offset + s.numel) for s in DGC_SLICES])
    part = build_scheme("zen").partitioner(concat.numel(), N)
    for r, params in enumerate(params_by_rank):
        owned = [k for k in params if k.startswith(OWNER_KEY)]
        assert len(owned) <= 1
        if owned:
            R = params[owned[0]]["owner_residual"].double()
            out[concat[part.indices_of(r, torch.arange(R.numel()))]] += R
    return out


def _sender_residuals(params_by_rank) -> torch.Tensor:
    out = torch.zeros(NUMEL, dtype=torch.float64)
    for params in params_by_rank:
        for s in DGC_SLICES:
            out[s.offset:s.offset + s.numel] += params[s.name]["residual"].double()
    return out


def _dgc_mask() -> torch.Tensor:
    m = torch.zeros(NUMEL, dtype=torch.bool)
    for s in DGC_SLICES:
        m[s.offset:s.offset + s.numel] = True
    return m


def _inputs():
    return [bucket_inputs(N, seed=s) for s in range(STEPS0 + STEPS1)]


@pytest.mark.parametrize("scheme", ["zen", "auto"])
def test_turning_value_bits_on_starts_the_owner_residuals_at_zero_and_drops_nothing(scheme, caplog):
    inputs = _inputs()
    first = _phase(None, scheme, inputs[:STEPS0])
    with caplog.at_level(logging.INFO, logger="zen_ext"):
        second = _phase(4, scheme, inputs[STEPS0:], states=[f[1] for f in first])
    assert "the owner residuals start at zero" in caplog.text
    for r in range(N):
        loaded = second[r][3]
        assert not any(k.startswith(OWNER_KEY) for k in loaded)
        for s in DGC_SLICES:  # the sender residuals are restored as saved
            assert torch.equal(loaded[s.name]["residual"], first[r][1]["sparsifiers"]["params"][s.name]["residual"])
        for k in range(STEPS1):
            assert torch.equal(second[r][0][k], second[0][0][k]), (r, k)
    params = [second[r][1]["sparsifiers"]["params"] for r in range(N)]
    assert all(any(k.startswith(OWNER_KEY) for k in p) for p in params)
    applied = sum(o.double() for o in first[0][0] + second[0][0])
    total_in = sum(x[r].double() for x in inputs for r in range(N))
    err = (applied + _sender_residuals(params) + _owner_residuals(params) - total_in)[_dgc_mask()].abs().max()
    assert err <= 1e-3, err
    # The identity without the owner residuals fails: they hold something, so the check can fail.
    assert (applied + _sender_residuals(params) - total_in)[_dgc_mask()].abs().max() > 1e-2


@pytest.mark.parametrize("scheme", ["zen", "auto"])
def test_turning_value_bits_off_drops_exactly_the_owner_residuals(scheme, caplog):
    inputs = _inputs()
    first = _phase(4, scheme, inputs[:STEPS0])
    saved = [f[1] for f in first]
    dropped = _owner_residuals([st["sparsifiers"]["params"] for st in saved])
    assert dropped.abs().max() > 0
    with caplog.at_level(logging.INFO, logger="zen_ext"):
        second = _phase(None, scheme, inputs[STEPS0:], states=saved)
    assert "dropping the owner residuals of 1 bucket(s)" in caplog.text
    params = [second[r][1]["sparsifiers"]["params"] for r in range(N)]
    for r in range(N):
        assert not any(k.startswith(OWNER_KEY) for k in second[r][3])
        assert not any(k.startswith(OWNER_KEY) for k in params[r])  # no longer saved
    applied = sum(o.double() for o in first[0][0] + second[0][0])
    total_in = sum(x[r].double() for x in inputs for r in range(N))
    err = (applied + _sender_residuals(params) + dropped - total_in)[_dgc_mask()].abs().max()
    assert err <= 1e-3, err


@pytest.mark.parametrize("bits0, bits1", [(None, 4), (4, None), (8, 4)])
def test_auto_keeps_its_calibration_and_replans_when_the_bits_change(bits0, bits1, caplog):
    inputs = _inputs()
    first = _phase(bits0, "auto", inputs[:STEPS0])
    saved = first[0][1]["scheme"]
    assert saved["slices"] and saved["low_bits"] == ({} if bits0 is None else {"value_bits": bits0})

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("auto"), param_kinds=KINDS,
                            dgc=dict(DGC, value_bits=bits1), natural={})
        sync.load_state_dict(first[comm.rank][1])
        return sync.scheme.state_dict()

    with caplog.at_level(logging.INFO, logger="zen_ext.planner"):
        got = SimWorld(N).run(fn)
    assert "auto re-plans every slice" in caplog.text
    assert got[0]["calibration"] == saved["calibration"] and got[0]["slices"] == {} and got[0]["runs"] == {}


def test_auto_still_refuses_other_candidates_at_the_same_bits():
    inputs = _inputs()
    first = _phase(4, "auto", inputs[:1])
    with pytest.raises(RuntimeError, match="auto state_dict options"):
        _phase(4, "auto", inputs[1:2], states=[f[1] for f in first], scheme_kw={"candidates": ["zen", "dense"]})
