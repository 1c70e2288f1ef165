"""Host synchronizations per engine bucket are bounded by a constant independent of the ranks.

``test_zen_host_syncs`` bounds one ``zen`` call; this counts a whole ``Synchronizer.sync_flat`` of a
bucket that holds every kind of slice (natural embedding rows, DGC tensors, dense ones), as the
engines call it, with DGC on its GPU path (threshold passes run blind: no early-stop flag reads).
A read that grew with the ranks (a per-peer ``.item()``) or with the tensors of the bucket would
stall a GPU stream once per peer or per tensor; the counts must be equal at n = 4 and n = 16.
"""

from __future__ import annotations

import pytest
import torch

import zen_ext.compress.dgc.thresholds as dgc_module
from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs
from tests.unit.test_zen_host_syncs import SyncCounter
from zen_ext import SimWorld, build_scheme
from zen_ext.reduction.synchronizer import Synchronizer

MAX_SYNCS_PER_BUCKET = 4
"""The host-read bound, what a bucket costs in steady state: the natural rows' counts (one read for every
embedding slice), DGC's one read (finiteness flag, candidates' and selection's counts), and one
``sync_group`` of zen over the natural rows and the DGC slices (partition counts, aggregated counts:
one read each for the group); the SparseGrads the Synchronizer builds skip the index-range read (in
range by construction). The first sync of a layout also agrees it across ranks (an object gather,
once per layout)."""


def _counts(n, scheme, dgc_selection="per_tensor"):
    steps = [bucket_inputs(n, seed=31 * n + s) for s in range(3)]

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme(scheme), param_kinds=KINDS,
                            dgc=dict(DGC, selection=dgc_selection), natural={})
        per_step = []
        for inputs in steps:
            flat = inputs[comm.rank].clone()
            with SyncCounter() as c:
                sync.sync_flat(flat, SLICES, "mean", out=flat)
            per_step.append(c.calls)
            sync.end_step()
        return per_step

    return SimWorld(n).run(fn)


@pytest.mark.parametrize("scheme", ["zen", "zen_coo"])
@pytest.mark.parametrize("dgc_selection", ["per_tensor", "per_bucket"])
def test_bucket_host_syncs_bounded_and_independent_of_n(monkeypatch, scheme, dgc_selection):
    monkeypatch.setattr(dgc_module, "FREE_HOST_READ_DEVICES", ())  # the GPU path of DGC
    per_n = {}
    for n in (4, 16):
        got = _counts(n, scheme, dgc_selection)
        # Steady state: the first step also agrees the bucket's layout (once per layout).
        steady = {len(calls) for per_step in got for calls in per_step[1:]}
        assert max(steady) <= MAX_SYNCS_PER_BUCKET, got[0][1]
        per_n[n] = max(steady)
    assert per_n[4] == per_n[16], per_n
    assert NUMEL > 0 and per_n[4] > 0  # the counter saw the bucket at all


def test_engine_bucket_path_adds_no_host_sync(monkeypatch):
    """The BucketReducer around the Synchronizer (what DeepSpeed and DDP call) reads nothing of its own
    per bucket: its statistics (the natural rows before and after, for γ) stay on the device until
    the step's ``pop_stats``, which reads them once."""
    from zen_ext.reduction.reducer import BucketReducer

    monkeypatch.setattr(dgc_module, "FREE_HOST_READ_DEVICES", ())
    n = 4
    steps = [bucket_inputs(n, seed=5 + s) for s in range(3)]

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
        reducer = BucketReducer(sync, cap_bytes=NUMEL * 4, dp_size=n)
        bare = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
        counts, gammas = [], []
        for inputs in steps:
            flat, other = inputs[comm.rank].clone(), inputs[comm.rank].clone()
            with SyncCounter() as through_reducer:
                reducer.reduce_(flat, SLICES, "mean")
            with SyncCounter() as alone:
                bare.sync_flat(other, SLICES, "mean", out=other)
            assert torch.equal(flat, other)
            counts.append((len(through_reducer.calls), len(alone.calls)))
            with SyncCounter() as popping:
                gammas.append(reducer.pop_stats()["gamma_natural"])
            counts.append((len(popping.calls), 1, popping.calls))  # one read per step for the statistics
            sync.end_step()
            bare.end_step()
        return counts, gammas, [x[3:243].view(40, 6) for x in inputs]

    for counts, gammas, _ in SimWorld(n).run(fn):
        for got, want, *_ in counts:
            assert got == want, counts
    # γ (union of non-zero rows over one rank's) is the value the rows give.
    counts, gammas, _ = SimWorld(n).run(fn)[0]
    last = steps[-1]
    union = int(sum(x[3:243].view(40, 6).abs() for x in last).ne(0).any(1).sum())
    local = int(last[0][3:243].view(40, 6).ne(0).any(1).sum())
    assert gammas[-1] == union / local
