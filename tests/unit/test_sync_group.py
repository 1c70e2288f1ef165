"""``SyncScheme.sync_group``: several gradients of one bucket in one call (host reads per bucket:
test_bucket_host_syncs.py).

Every scheme must return what ``sync`` returns for each member; ``zen`` runs the members step by step
together, so its host reads (partition counts, aggregated counts) happen once per group, whatever the
number of members.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_zen_host_syncs import SyncCounter
from tests.unit.test_zen_scheme import int_inputs
from zen_ext import SimWorld, SparseGrad, build_scheme
from zen_ext.core.registry import available_schemes


def _members(n, seed):
    """Per rank: element-form, row-form (width 3, bf16-exact integers), an empty one, a dense tensor."""
    a = int_inputs(n, numel=5003, nnz=300, seed=seed)
    b = int_inputs(n, numel=701, nnz=90, seed=seed + 1, width=3)
    c = [SparseGrad(torch.empty(0, dtype=torch.int64), torch.empty(0), 0, in_range=True) for _ in range(n)]
    d = [torch.randint(-8, 9, (257,), generator=torch.Generator().manual_seed(seed + r)).float() for r in range(n)]
    return [[a[r], b[r], c[r], d[r]] for r in range(n)]


def _dense(x):
    return x.to_dense().reshape(-1) if isinstance(x, SparseGrad) else x


@pytest.mark.parametrize("scheme", sorted(set(available_schemes()) - {"auto"}) + ["auto"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_group_equals_the_dense_sum_of_each_member(scheme, n):
    inputs = _members(n, seed=7 * n)
    want = [sum(_dense(inputs[r][i]) for r in range(n)) for i in range(4)]
    s = build_scheme(scheme)
    lossless = s.lossless

    def fn(comm, mine):
        outs = [torch.full((_dense(m).numel(),), 99.0) for m in mine]
        outs[1] = None  # a member without an out gets a new tensor
        return s.sync_group(comm, mine, "sum", keys=["a", "b", "c", "d"], outs=outs), outs

    for res, outs in SimWorld(n).run(fn, inputs):
        assert len(res) == 4
        for i in range(4):
            if lossless:
                assert torch.equal(res[i], want[i]), (scheme, i)
            assert res[i].numel() == want[i].numel()
        assert res[0] is outs[0] and res[3] is outs[3]


def test_zen_group_reads_the_host_as_often_as_one_member():
    n = 4
    # In range by construction, as the Synchronizer's are (else each member's check reads once).
    inputs = [[SparseGrad(x.indices, x.values, x.numel, in_range=True) for x in m[:3]] for m in _members(n, seed=3)]
    s = build_scheme("zen")

    def fn(comm, mine):
        s.sync_group(comm, mine, "mean")  # warm-up: partitioners, keys
        with SyncCounter() as one:
            s.sync_group(comm, mine[:1], "mean")
        with SyncCounter() as three:
            got = s.sync_group(comm, mine, "mean")
        return one.calls, three.calls, got

    for one, three, got in SimWorld(n).run(fn, inputs):
        assert len(three) == len(one) == 2, (one, three)
        assert torch.equal(got[1], sum(x[1].to_dense().reshape(-1) for x in inputs) / n)


def test_group_members_are_checked_like_sync():
    s = build_scheme("zen")

    def fn(comm, mine):
        bad = SparseGrad(torch.tensor([0, 5000]), torch.ones(2), 10)
        with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
            s.sync_group(comm, [mine[0], bad], "sum")
        with pytest.raises(ValueError, match="one entry per gradient"):
            s.sync_group(comm, [mine[0]], "sum", keys=["a", "b"])
        return True

    assert all(SimWorld(2).run(fn, _members(2, seed=1)))


def test_ranks_passing_different_members_raise():
    s = build_scheme("zen")

    def fn(comm, mine):
        grads = [mine[0], mine[1]] if comm.rank == 0 else [mine[0], SparseGrad(mine[1].indices, mine[1].values, 702)]
        with pytest.raises(RuntimeError, match="disagree"):
            s.sync_group(comm, grads, "sum")
        return True

    assert all(SimWorld(2).run(fn, _members(2, seed=2)))


def test_auto_runs_the_members_that_chose_one_scheme_as_one_group():
    """``auto`` chooses per member, then hands the members of one choice to that scheme together:
    with ``zen`` the only candidate, a settled group reads the host as often as zen alone."""
    n = 4
    inputs = [[SparseGrad(x.indices, x.values, x.numel, in_range=True) for x in m[:3]] for m in _members(n, seed=5)]
    s = build_scheme("auto", candidates=["zen"], profile_steps=1)

    def fn(comm, mine):
        keys = ["a", "b", "c"]
        s.sync_group(comm, mine, "sum", keys=keys)  # profiles and decides
        s.sync_group(comm, mine, "sum", keys=keys)  # zen's first run on this rank (not learned from)
        timings = [{}, {}, {}]
        with SyncCounter() as c:
            got = s.sync_group(comm, mine, "sum", timings=timings, keys=keys)
        return c.calls, got, [t.get("scheme") for t in timings]

    for calls, got, chosen in SimWorld(n).run(fn, inputs):
        assert chosen == ["zen", "zen", None] and len(calls) == 2, calls  # the third member is empty
        for i in range(3):
            assert torch.equal(got[i], sum(x[i].to_dense().reshape(-1) for x in inputs))
