"""The reduce-scatter API (``core/reduce_scatter.py``): ranges validation, agreement, ``out``, empty
gradients, the all-reduce → reduce-scatter mapping, and the reduce-scatter route (``reduce_scatter_flat``) equal to
``sync_flat``'s result cut to each rank's range."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_synchronizer import DGC, KINDS, NUMEL, SLICES, bucket_inputs
from zen_ext import SimWorld, build_scheme
from zen_ext.core.reduce_scatter import build_reduce_scatter, reduce_scatter_for, reduce_scatter_of
from zen_ext.core.rs_base import check_ranges, even_ranges
from zen_ext.core.types import SparseGrad
from zen_ext.reduction.scatter import reduce_scatter_flat
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer


@pytest.mark.parametrize("ranges, rule", [
    ([(0, 3), (3, 10)], "one (start, end) per rank"),
    ([(1, 3), (3, 5), (5, 10)], "must start at 0"),
    ([(0, 3), (4, 5), (5, 10)], "must start where ranges[0] ends"),
    ([(0, 3), (3, 2), (2, 10)], "start <= end"),
    ([(0, 3), (3, 5), (5, 9)], "must end at the gradient's dense numel (10)"),
    ([(0, "x"), (3, 5), (5, 10)], "must be a sequence of (start, end) int pairs"),
])
def test_bad_ranges_are_named(ranges, rule):
    with pytest.raises(ValueError, match="zen.reduce_scatter ranges") as e:
        check_ranges(ranges, 3, 10)
    assert rule in str(e.value)


def test_even_ranges_tile_with_short_tails():
    assert even_ranges(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert even_ranges(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"zen.reduce_scatter \('ring'\) must be one of \[.*'dense'"):
        build_reduce_scatter("ring")
    with pytest.raises(NotImplementedError, match=r"zen.scheme \('sparcml'\).*supported: \['auto', 'dense'"):
        reduce_scatter_for("sparcml")
    assert reduce_scatter_of(build_scheme("dense")).name == "dense"


@pytest.mark.parametrize("n", [1, 2, 5])
def test_dense_uneven_ranges_and_out(n):
    numel = 23
    ranges = even_ranges(numel, n)
    if n == 5:
        ranges = [(0, 3), (3, 3), (3, 10), (10, 20), (20, 23)]
    gen = torch.Generator().manual_seed(n)
    xs = [torch.randint(-3, 4, (numel,), generator=gen).float() for _ in range(n)]
    rs = build_reduce_scatter("dense")

    def fn(comm, x):
        lo, hi = ranges[comm.rank]
        out = torch.full((hi - lo,), float("nan"))
        got = rs.reduce_scatter(comm, SparseGrad.from_dense(x), ranges, op="sum", out=out)
        assert got.data_ptr() == out.data_ptr() or out.numel() == 0
        return got

    outs = SimWorld(n).run(fn, xs)
    total = sum(xs)
    for r, (lo, hi) in enumerate(ranges):
        assert torch.equal(outs[r], total[lo:hi]), r


def test_empty_gradient_runs_no_collective():
    rs = build_reduce_scatter("dense")
    outs = SimWorld(3).run(lambda c: rs.reduce_scatter(c, torch.zeros(0), [(0, 0)] * 3))
    assert all(o.numel() == 0 for o in outs)


def test_ranks_that_disagree_on_ranges_raise_naming_both():
    rs = build_reduce_scatter("dense")

    def fn(comm):
        ranges = [(0, 5), (5, 10)] if comm.rank == 0 else [(0, 4), (4, 10)]
        return rs.reduce_scatter(comm, torch.ones(10), ranges)

    with pytest.raises(RuntimeError, match=r"ranks disagree on the gradients: rank \d has .* rank \d has") as e:
        SimWorld(2).run(fn)
    assert "(0, 4)" in str(e.value) and "(0, 5)" in str(e.value)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_scatter_flat_is_sync_flat_cut_to_the_range(n, op):
    steps = [bucket_inputs(n, seed=5 * n + s) for s in range(2)]
    ranges = even_ranges(NUMEL, n) if n != 3 else [(0, 100), (100, 100), (100, NUMEL)]

    def fn(comm):
        whole = Synchronizer(dp_comm=comm, scheme=build_scheme("dense"), param_kinds=KINDS, dgc=DGC, natural={})
        shard = Synchronizer(dp_comm=comm, scheme=build_scheme("dense"), param_kinds=KINDS, dgc=DGC, natural={})
        got = []
        for x in steps:
            lo, hi = ranges[comm.rank]
            full = whole.sync_flat(x[comm.rank].clone(), SLICES, op)
            mine = reduce_scatter_flat(shard, x[comm.rank].clone(), SLICES, ranges, op)
            got.append((full[lo:hi].clone(), mine))
            whole.end_step()
            shard.end_step()
        return got, shard.pop_step_stats()

    for r, (got, stats) in enumerate(SimWorld(n).run(fn)):
        for want, mine in got:
            assert torch.equal(want, mine), r
        assert stats["buckets"] == 2


@pytest.mark.parametrize("scheme", ["direct", "zen", "auto"])
def test_reduce_scatter_flat_sparse_schemes_equal_dense(scheme):
    n = 4
    steps = [bucket_inputs(n, seed=11 + s) for s in range(2)]
    ranges = [(0, 10), (10, 1300), (1300, 1300), (1300, NUMEL)]

    def fn(comm):
        def sync(rs):
            return Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={},
                                reduce_scatter=rs)
        dense, sparse = sync("dense"), sync(scheme)
        got = []
        for x in steps:
            want = reduce_scatter_flat(dense, x[comm.rank].clone(), SLICES, ranges, "sum")
            lo, hi = ranges[comm.rank]
            out = torch.full((hi - lo,), float("nan"))
            mine = reduce_scatter_flat(sparse, x[comm.rank].clone(), SLICES, ranges, "sum", out=out)
            assert mine is out
            got.append((want, mine))
            dense.end_step()
            sparse.end_step()
        return got, sparse.pop_step_stats()

    for r, (got, stats) in enumerate(SimWorld(n).run(fn)):
        for want, mine in got:
            assert torch.equal(want, mine), r
        assert set(stats["schemes"]) <= {"dense", "direct", "zen"}


def test_reduce_scatter_flat_default_is_the_schemes_form():
    x = bucket_inputs(1, seed=1)[0]

    def fn(comm):
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
        shard = reduce_scatter_flat(sync, x.clone(), SLICES, [(0, NUMEL)], "sum")
        assert sync.rs_scheme.name == "zen"
        return shard, Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC,
                                   natural={}).sync_flat(x.clone(), SLICES, "sum")

    shard, whole = SimWorld(1).run(fn)[0]
    assert torch.equal(shard, whole)


def test_rs_scheme_is_built_once_by_the_synchronizer():
    """The Synchronizer is the one place ``rs_scheme`` is set: built on the first read (a name given to
    the constructor, or ``scheme``'s form, with its options), kept, and refused for a scheme without a
    reduce-scatter form only when read (an all-reduce user never pays for it)."""
    comm = SimWorld(1).communicators()[0]

    def sync(scheme, **kw):
        return Synchronizer(dp_comm=comm, scheme=scheme, param_kinds=KINDS, dgc=DGC, natural={}, **kw)

    form = sync(build_scheme("zen", seed=5))
    first = form.rs_scheme
    assert first is form.rs_scheme and first.name == "zen" and first.options()["seed"] == 5
    assert sync(build_scheme("zen"), reduce_scatter="direct").rs_scheme.name == "direct"
    given = build_reduce_scatter("dense")
    assert sync(build_scheme("zen"), reduce_scatter=given).rs_scheme is given
    other = sync(build_scheme("zen"))
    other.rs_scheme = "direct"  # a test's override goes through the owner too
    assert other.rs_scheme.name == "direct"
    refused = sync(build_scheme("sparcml"))  # built fine: only the read asks for the form
    with pytest.raises(NotImplementedError, match=r"zen.scheme \('sparcml'\) has no reduce-scatter form"):
        refused.rs_scheme

@pytest.mark.parametrize("scheme", ["dense", "zen"])
def test_bucket_reducer_reduce_scatter_is_reduce_cut_to_the_range(scheme):
    """Re-bucketed at a small cap (ranges cut by bucket boundaries), with the non-finite guard."""
    from zen_ext.reduction.reducer import BucketReducer

    n = 3
    steps = [bucket_inputs(n, seed=21 + s) for s in range(2)]
    ranges = [(0, 700), (700, 701), (701, NUMEL)]

    def fn(comm):
        def reducer():
            sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={},
                                reduce_scatter=scheme)
            return BucketReducer(sync, cap_bytes=1300 * 4, dp_size=n, guard_comm=comm)
        whole, shard = reducer(), reducer()
        got = []
        for x in steps:
            lo, hi = ranges[comm.rank]
            full = x[comm.rank].clone()
            whole.reduce_(full, SLICES, "sum")
            out = torch.full((hi - lo,), float("nan"))
            assert shard.reduce_scatter_(x[comm.rank].clone(), SLICES, ranges, "sum", out) is out
            got.append((full[lo:hi], out))
            whole.sync.end_step()
            shard.sync.end_step()
        bad = x[comm.rank].clone()
        bad[5] = float("inf") if comm.rank == 2 else bad[5]
        out = torch.zeros(ranges[comm.rank][1] - ranges[comm.rank][0])
        shard.reduce_scatter_(bad, SLICES, ranges, "sum", out)
        return got, bool(out.isnan().all()), shard.pop_stats()

    for r, (got, nan_filled, stats) in enumerate(SimWorld(n).run(fn)):
        for want, mine in got:
            assert torch.equal(want, mine), r
        assert nan_filled and stats["nonfinite_steps"] == 1


def _fsdp_layout(n: int, params: dict[str, tuple[int, int]]):
    """FSDP2's reduce-scatter input: ``[n, C]``, row r = rank r's dim-0 chunk of every parameter (rows
    padded to a multiple of n). Returns C and the slices (one per parameter and rank, start = the
    piece's offset in the parameter; padding rows are uncovered)."""
    C, slices, at = 0, [], {}
    for name, (rows, width) in params.items():
        at[name] = C
        C += -(-rows // n) * width
    for r in range(n):
        for name, (rows, width) in params.items():
            chunk = -(-rows // n)
            real = max(0, min(rows, (r + 1) * chunk) - r * chunk)
            shape = (real, width) if width > 1 else (real,)
            slices.append(GradSlice(name, r * C + at[name], real * width, shape, start=r * chunk * width))
    return C, slices


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fsdp_chunk_layout_merges_each_parameters_pieces(n):
    params = {"emb": (37, 4), "w": (50, 6), "b": (7, 1)}
    kinds = {"emb": "natural", "w": "dgc", "b": "dense"}
    C, slices = _fsdp_layout(n, params)
    ranges = [(r * C, (r + 1) * C) for r in range(n)]
    gen = torch.Generator().manual_seed(n)
    flats = []
    for r in range(n):
        x = torch.zeros(n * C)
        for s in slices:
            if s.name == "emb":
                rows = torch.zeros(s.numel)
                rows.view(-1, 4)[torch.randint(0, max(1, s.numel // 4), (2,), generator=gen) % max(1, s.numel // 4)] = 1
                x[s.offset : s.offset + s.numel] = rows * torch.randint(1, 4, (1,), generator=gen)
            else:
                x[s.offset : s.offset + s.numel] = torch.randint(-3, 4, (s.numel,), generator=gen).float()
        flats.append(x)

    def fn(comm):
        calls = []
        inner = comm.exchange_v
        comm.exchange_v = lambda send: (calls.append(1), inner(send))[1]

        def sync(rs):
            return Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=kinds, dgc=DGC, natural={},
                                reduce_scatter=rs)
        want = reduce_scatter_flat(sync("dense"), flats[comm.rank].clone(), slices, ranges, "sum")
        calls.clear()
        mine = reduce_scatter_flat(sync("zen"), flats[comm.rank].clone(), slices, ranges, "sum")
        return want, mine, len(calls)

    for r, (want, mine, exchanges) in enumerate(SimWorld(n).run(fn)):
        assert torch.equal(want, mine), r
        # Two rounds (push, pull) for the embedding's n pieces and the DGC group together, whatever n.
        assert exchanges == 2, exchanges


def test_config_builds_the_reduce_scatter_form_of_its_scheme():
    from zen_ext.config import ZenConfig

    rs = ZenConfig.from_dict({"scheme": "zen", "seed": 3, "pull_format": "bitmap"}).build_reduce_scatter()
    assert (rs.name, rs.options()["seed"], rs.options()["pull_format"]) == ("zen", 3, "bitmap")
    assert ZenConfig.from_dict({"scheme": "zen_coo"}).build_reduce_scatter().options()["pull_format"] == "coo"
    auto = ZenConfig.from_dict({"scheme": "auto", "planner": {"bandwidth_gbps": 5.0}}).build_reduce_scatter()
    assert (auto.name, auto.bandwidth_gbps) == ("auto", 5.0)
    assert ZenConfig.from_dict({"scheme": "dense"}).build_reduce_scatter().name == "dense"
    with pytest.raises(NotImplementedError, match=r"zen.scheme \('agsparse'\) has no reduce-scatter form"):
        ZenConfig.from_dict({"scheme": "agsparse"}).build_reduce_scatter()


def test_ranks_with_different_scheme_options_raise():
    def fn(comm):
        rs = build_reduce_scatter("zen", seed=comm.rank)
        return rs.reduce_scatter(comm, SparseGrad(torch.tensor([1, 5]), torch.ones(2), 10), even_ranges(10, 2))

    with pytest.raises(RuntimeError, match=r"ranks disagree on the scheme: rank \d has .ZenReduceScatter\(seed="):
        SimWorld(2).run(fn)


def test_an_index_outside_the_gradient_is_named():
    rs = build_reduce_scatter("zen")
    bad = SparseGrad(torch.tensor([3, 10]), torch.ones(2), 10)
    with pytest.raises(RuntimeError, match=r"reduce-scatter 'zen': grad.indices \(10\) must lie in \[0, 10\)"):
        SimWorld(1).run(lambda comm: rs.reduce_scatter(comm, bad, [(0, 10)]))  # SimWorld wraps the ValueError


@pytest.mark.parametrize("scheme,rounds", [("zen", 2), ("direct", 1)])
def test_reduce_scatter_flat_carries_counts_in_the_payload_from_the_second_step(scheme, rounds):
    # The Synchronizer runs each bucket layout in a Communicator slot: a step's exchanges are sized from
    # the last step's counts, so a repeat of the same gradients takes one round per exchange; new
    # gradients (more rows on some ranks: an overflow round between those pairs) stay equal to dense.
    n = 3
    kinds = {**KINDS, "w1": "dense", "w2": "dense"}  # natural rows only: counts fixed by the inputs
    ranges = [(0, 100), (100, 1000), (1000, NUMEL)]
    seeds = [11, 11, 12, 12]

    def fn(comm):
        dense = Synchronizer(dp_comm=comm, scheme=build_scheme("dense"), param_kinds=kinds, natural={},
                             reduce_scatter="dense")
        sparse = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=kinds, natural={},
                              reduce_scatter=scheme)
        got = []
        for seed in seeds:
            x = bucket_inputs(n, seed=seed)[comm.rank]
            want = reduce_scatter_flat(dense, x.clone(), SLICES, ranges, "sum")
            before = comm.op_stats.get("exchange_v")
            before = before.rounds if before else 0
            mine = reduce_scatter_flat(sparse, x.clone(), SLICES, ranges, "sum")
            got.append((torch.equal(want, mine), comm.op_stats["exchange_v"].rounds - before))
        return got

    for r, got in enumerate(SimWorld(n).run(fn)):
        assert all(eq for eq, _ in got), r
        per_step = [k for _, k in got]
        # Step 1: counts in a round of their own; a repeat: one round per exchange.
        assert per_step[0] == 2 * rounds and per_step[1] == rounds and per_step[3] == rounds, (r, per_step)
        assert rounds <= per_step[2] <= 2 * rounds, (r, per_step)


def test_dgc_hands_over_to_the_reduce_scatter_scheme_in_use():
    """The hand-over follows the scheme that consumes the bucket: with ``scheme: zen`` and a ``spardl``
    reduce-scatter, DGC hands its memory to SparDL's reduce-scatter (equal, step by step, to a Synchronizer
    whose scheme is spardl), while ``sync_flat`` on that Synchronizer still runs zen; the reverse pair is zen's
    lossless reduce-scatter of DGC's own selection. A 4-bit residual, which SparDL cannot write back, is
    refused when ``rs_scheme`` is read (at attach), not at the first step."""
    n, numel = 3, 620
    shapes = {"a": (16, 20), "b": (30, 10)}
    slices = [GradSlice("a", 0, 320, (16, 20)), GradSlice("b", 320, 300, (30, 10))]
    kinds = {k: "dgc" for k in shapes}
    dgc = {"enabled": True, "density": 0.05, "momentum_correction": False, "warmup_steps": 0, "min_numel": 8}
    gen = torch.Generator().manual_seed(58)
    steps = [[torch.randint(-9, 10, (numel,), generator=gen).float() for _ in range(n)] for _ in range(3)]
    ranges = [(0, 100), (100, 100), (100, numel)]

    def fn(comm):
        def sync(scheme, rs=None):
            return Synchronizer(dp_comm=comm, scheme=scheme, param_kinds=kinds, dgc=dgc, reduce_scatter=rs)
        pairs = {"spardl": (sync("zen", "spardl"), sync("spardl")), "zen": (sync("spardl", "zen"), sync("zen"))}
        got = {k: [] for k in pairs}
        for x in steps:
            for k, (mixed, own) in pairs.items():
                got[k].append((reduce_scatter_flat(mixed, x[comm.rank].clone(), slices, ranges, "sum"),
                               reduce_scatter_flat(own, x[comm.rank].clone(), slices, ranges, "sum")))
                mixed.end_step()
                own.end_step()
        mixed = pairs["spardl"][0]
        ran = set(mixed.pop_step_stats()["slice_schemes"].values())
        # The all-reduce of the same Synchronizer is still zen's (lossless: the plain zen Synchronizer's result).
        fresh, plain = sync("zen", "spardl"), sync("zen")
        assert fresh.rs_scheme.name == "spardl"
        all_reduce = (fresh.sync_flat(steps[0][comm.rank].clone(), slices, "sum"),
                      plain.sync_flat(steps[0][comm.rank].clone(), slices, "sum"))
        return got, ran, all_reduce

    results = SimWorld(n).run(fn)
    for r, (got, ran, (fresh, plain)) in enumerate(results):
        for k, rows in got.items():
            for step, (mixed, own) in enumerate(rows):
                assert torch.equal(mixed, own), (r, k, step)
        assert ran == {"spardl"}, ran
        assert torch.equal(fresh, plain), r
    # SparDL's reduce-scatter is not zen's: the pair above would be equal by accident otherwise.
    assert any(not torch.equal(a[0], b[0]) for res in results for a, b in zip(res[0]["spardl"], res[0]["zen"]))
    comm = SimWorld(1).communicators()[0]
    int4 = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=kinds, reduce_scatter="spardl",
                        dgc={**dgc, "residual_dtype": "int4"})
    with pytest.raises(ValueError, match=r"zen\.dgc\.residual_dtype \('int4'\) must be \"float32\" or \"bfloat16\""):
        int4.rs_scheme
    assert not int4.sparsifiers["dgc"].hand_over  # the all-reduce (zen) still runs with it


def test_the_route_refuses_bad_ranges_and_out_before_any_collective():
    """A wrong ``out`` or ranges of the wrong count raise on the rank that passes them, naming the rule, before
    the route's first collective (a one-rank group here would not hang, a larger one would)."""
    comm = SimWorld(2).communicators()[0]
    sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds=KINDS, dgc=DGC, natural={})
    x = bucket_inputs(1, seed=3)[0]
    ranges = even_ranges(NUMEL, 2)
    with pytest.raises(ValueError, match=r"zen\.reduce_scatter out \(\(3,\) torch\.float32 on cpu\) must be a "
                                         rf"contiguous 1-D tensor of {ranges[0][1]} torch\.float32 elements"):
        reduce_scatter_flat(sync, x, SLICES, ranges, "sum", out=torch.empty(3))
    with pytest.raises(ValueError, match=r"zen\.reduce_scatter ranges \(3 entries\) must have one \(start, end\) per "
                                         r"rank \(2\)"):
        reduce_scatter_flat(sync, x, SLICES, even_ranges(NUMEL, 3), "sum")
    assert comm.stats.bytes_sent == 0
