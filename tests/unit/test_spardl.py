"""SparDL (``core/spardl.py``, ``core/rs_spardl.py``) in SimWorld: exact conservation of the global
residual, the lossless limit at density 1, the local-residual variant, bytes / messages / rounds
against the seed's ``k(P−1)/P`` and the cost model, edge worlds, and the DGC hand-over."""

from __future__ import annotations

import math

import pytest
import torch

from zen_ext.comm.simulated import SimWorld
from zen_ext.core.coo import entry_bytes
from zen_ext.core.reduce_scatter import build_reduce_scatter
from zen_ext.core.registry import build_scheme
from zen_ext.core.rs_base import even_ranges
from zen_ext.core.rs_spardl import predict_spardl_bytes
from zen_ext.core.spardl import SparDLScheme, block_ks, even_blocks, srs_bags, srs_distances
from zen_ext.core.types import AccumulatedGrad, FlushPositions, SparseGrad

WORLDS = (1, 2, 3, 4, 5, 8, 16)


def _ints(n: int, numel: int, seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, (numel,), generator=g).to(dtype) for _ in range(n)]


def _allreduce(n, mems, density, residual="global", op="sum", wire=torch.float32, momenta=None):
    scheme = build_scheme("spardl", residual=residual)
    world = SimWorld(n)
    moms = momenta or [None] * n
    outs = world.run(lambda c, i: scheme.sync(c, AccumulatedGrad.of(mems[i], density, wire, moms[i]), op=op),
                     list(range(n)))
    return outs, world


def _reduce_scatter(n, mems, density, ranges, residual="global"):
    rs = build_reduce_scatter("spardl", residual=residual)
    world = SimWorld(n)
    outs = world.run(lambda c, m: rs.reduce_scatter(c, AccumulatedGrad.of(m, density, torch.float32), ranges), mems)
    return outs, world


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("numel", [1, 7, 1000])
@pytest.mark.parametrize("density", [0.01, 0.2])
def test_global_residual_conserves_exactly(n, numel, density):
    """What every rank applied (the result, equal on every rank) plus what every rank kept equals the
    sum of the inputs, element for element (integer values: exact in fp32)."""
    grads = _ints(n, numel, seed=n * 1000 + numel)
    mems = [g.clone() for g in grads]
    outs, _ = _allreduce(n, mems, density)
    for o in outs:
        assert torch.equal(o, outs[0])
    assert torch.equal(outs[0] + sum(mems), sum(grads))
    # It is sparse: at most k_b entries per block reached the result.
    assert int(outs[0].ne(0).sum()) <= sum(block_ks(even_blocks(numel, n), density))


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("numel", [5, 1000])
def test_reduce_scatter_conserves_exactly_over_uneven_ranges(n, numel):
    grads = _ints(n, numel, seed=7 + n)
    cuts = sorted(torch.randint(0, numel + 1, (n - 1,), generator=torch.Generator().manual_seed(n)).tolist())
    ranges = list(zip([0] + cuts, cuts + [numel]))  # uneven, some empty
    mems = [g.clone() for g in grads]
    outs, _ = _reduce_scatter(n, mems, 0.05, ranges)
    assert [o.numel() for o in outs] == [e - s for s, e in ranges]
    assert torch.equal(torch.cat(outs) + sum(mems), sum(grads))


@pytest.mark.parametrize("n", (2, 3, 5, 6, 8, 16))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_density_one_is_the_dense_all_reduce(n, dtype):
    """With k_b = |b| nothing is dropped: SRS + all-gather and SRS alone equal the dense sum (any n)."""
    grads = _ints(n, 301, seed=n)
    outs, _ = _allreduce(n, [g.clone() for g in grads], 1.0, wire=dtype)
    assert outs[0].dtype == dtype and torch.equal(outs[0].float(), sum(grads))
    mean, _ = _allreduce(n, [g.clone() for g in grads], 1.0, op="mean")
    assert torch.allclose(mean[0], sum(grads) / n)
    rs, _ = _reduce_scatter(n, [g.clone() for g in grads], 1.0, even_ranges(301, n))
    assert torch.equal(torch.cat(rs), sum(grads))


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_half_wire_keeps_the_rounding_in_the_residual(wire):
    """Values travel in the gradient's dtype; what the cast rounds off stays in the fp32 residual."""
    n = 4
    grads = [g * 1.001 for g in _ints(n, 500, seed=3)]  # not representable in bf16/fp16
    mems = [g.clone() for g in grads]
    outs, _ = _allreduce(n, mems, 0.1, wire=wire)
    assert outs[0].dtype == wire
    assert torch.allclose(outs[0].float() + sum(mems), sum(grads), atol=1e-4, rtol=0)


def test_local_residual_keeps_only_the_local_drop():
    """``residual: local``: the memory is the input minus its own block-wise top-k; what the SRS steps
    drop later is lost (so the global sum is not conserved in general)."""
    n, numel, density = 4, 400, 0.05
    grads = _ints(n, numel, seed=11)
    mems = [g.clone() for g in grads]
    outs, _ = _allreduce(n, mems, density, residual="local")
    ks = block_ks(even_blocks(numel, n), density)
    for g, m in zip(grads, mems):
        sent = g - m
        for (s, e), k in zip(even_blocks(numel, n), ks):
            chosen = sent[s:e].ne(0)
            assert int(chosen.sum()) <= k  # at most k_b of its own entries left the memory
            assert torch.equal(m[s:e][chosen], torch.zeros(int(chosen.sum())))
            assert bool((g[s:e].abs()[chosen].min() if chosen.any() else 0) >= g[s:e].abs()[~chosen].max())
    lost = sum(grads) - outs[0] - sum(mems)
    assert lost.abs().sum() > 0  # the in-procedure drops of this input are gone


@pytest.mark.parametrize("n", (2, 3, 5, 8, 16, 128))
def test_bytes_per_rank_are_constant_in_the_rank_count(n):
    """Each rank sends Σ_{b≠own} k_b entries in ⌈log2 n⌉ SRS messages and as many again in ⌈log2 n⌉
    Bruck messages (≈ 2·k(n−1)/n pairs), no count round; the cost model predicts it exactly."""
    numel, density = 12800, 0.01
    mems = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    _, world = _allreduce(n, mems, density)
    ks = block_ks(even_blocks(numel, n), density)
    eb = entry_bytes(numel, 1, torch.float32)
    rounds = math.ceil(math.log2(n))
    for r, st in enumerate(world.stats):
        srs = sum(ks[b] for b in range(n) if b != r) * eb
        gathered = sum(ks[b] for b in range(n) if b != r) * eb
        assert st.bytes_sent == srs + gathered and st.bytes_recv == st.bytes_sent
        assert st.rounds == 2 * rounds and st.msgs_sent == 2 * rounds
    k = density * numel
    assert world.stats[0].bytes_sent == pytest.approx(2 * k * (n - 1) / n * eb, rel=0.02)

    class _P:  # the cost model's view of the same call
        pass

    p = _P()
    p.n, p.numel, p.row_width, p.value_bytes = n, numel, 1, 4
    p.locals = [type("L", (), {"raw_nnz": int(k)})() for _ in range(n)]
    pred = SparDLScheme.predict_traffic(p, {"density": density})
    assert [s.bytes_sent for s in pred.stats] == [s.bytes_sent for s in world.stats]
    assert [s.rounds for s in pred.stats] == [s.rounds for s in world.stats]
    assert [s.bytes_sent for s in pred.first_stats] == [s.bytes_sent for s in world.stats]


def test_reduce_scatter_bytes_match_its_predictor():
    n, numel = 6, 6000
    mems = [torch.randn(numel) for _ in range(n)]
    ranges = even_ranges(numel, n)
    _, world = _reduce_scatter(n, mems, 0.02, ranges)
    pred = predict_spardl_bytes(n, [e - s for s, e in ranges], 0.02, numel, torch.float32)
    assert pred["bytes"] == max(max(s.bytes_sent, s.bytes_recv) for s in world.stats)
    assert pred["rounds"] == world.stats[0].rounds == 3


def test_bags_are_the_seeds():
    """Fig. 5 (6 workers, worker 1 in the seed's 1-based numbering = rank 0 here): bags {4,5}, {2,3},
    {1} sent at distances 4, 2, 1; what arrives is always a block still held (Theorem 1)."""
    assert srs_distances(6) == [4, 2, 1]
    assert [srs_bags(6, 0, d)[0] for d in (4, 2, 1)] == [[4, 5], [2, 3], [1]]
    for n in range(2, 40):
        for w in range(n):
            held = set(range(n))
            for d in srs_distances(n):
                out_b, in_b = srs_bags(n, w, d)
                assert set(in_b) <= held - set(out_b)
                held -= set(out_b)
            assert held == {w}


def test_world_of_one_and_empty_gradients():
    grads = _ints(1, 50)
    mems = [grads[0].clone()]
    outs, world = _allreduce(1, mems, 0.1)
    assert int(outs[0].ne(0).sum()) <= 5 and torch.equal(outs[0] + mems[0], grads[0])
    assert world.stats[0].bytes_sent == 0 and world.stats[0].rounds == 0
    outs, world = _allreduce(3, [torch.zeros(0) for _ in range(3)], 0.1)
    assert all(o.numel() == 0 for o in outs) and world.stats[0].rounds == 0
    # fewer elements than ranks: empty blocks send nothing
    grads = _ints(8, 3)
    mems = [g.clone() for g in grads]
    outs, _ = _allreduce(8, mems, 0.5)
    assert torch.equal(outs[0] + sum(mems), sum(grads))


def test_momentum_is_masked_where_the_residual_was_reset():
    n, numel = 3, 300
    grads = _ints(n, numel, seed=5)
    mems = [g.clone() for g in grads]
    moms = [torch.ones(numel) for _ in range(n)]
    outs, _ = _allreduce(n, mems, 0.05, momenta=moms)
    for g, m, u in zip(grads, mems, moms):
        reset = u.eq(0)
        assert reset.any() and bool(outs[0][reset].ne(0).any() | g[reset].eq(0).any())
        assert bool(reset.sum() <= outs[0].ne(0).sum() + g.eq(0).sum())


def test_plain_gradients_go_through_zen_losslessly():
    n = 4
    grads = _ints(n, 200, seed=2)
    scheme = build_scheme("spardl")
    outs = SimWorld(n).run(lambda c, g: scheme.sync(c, SparseGrad.from_dense(g)), grads)
    assert torch.equal(outs[0], sum(grads))


def test_other_schemes_refuse_an_accumulated_gradient():
    g = AccumulatedGrad.of(torch.ones(10), 0.5, torch.float32)
    with pytest.raises(ValueError, match=r"^scheme 'zen' got an AccumulatedGrad"):
        build_scheme("zen").sync(SimWorld(1).communicators()[0], g)
    with pytest.raises(ValueError, match=r"^reduce-scatter 'zen' got an AccumulatedGrad"):
        build_reduce_scatter("zen").reduce_scatter(SimWorld(1).communicators()[0], g, [(0, 10)])


def test_auto_never_picks_a_lossy_scheme():
    from zen_ext.planner.auto import AutoScheme

    assert "spardl" not in AutoScheme.valid_candidates()
    with pytest.raises(ValueError, match="must be a subset"):
        AutoScheme(candidates=["zen", "spardl"])


def test_bad_residual_option():
    with pytest.raises(ValueError, match=r"^zen.spardl.residual \('all'\) must be one of \['global', 'local'\]$"):
        build_scheme("spardl", residual="all")


@pytest.mark.parametrize("n", (2, 3, 5))
def test_through_the_synchronizer_dgc_memory_holds_the_residual(n):
    """DGC (no momentum correction) hands its memory to SparDL: per step, the applied result plus every
    rank's DGC residual equals every input so far (exact on integers), the residual is DGC's state keyed
    by name, and the Synchronizer's stats count SparDL's bytes."""
    from zen_ext.reduction.plan import GradSlice
    from zen_ext.reduction.synchronizer import Synchronizer

    shapes = {"a": (16, 20), "b": (30, 10)}
    slices = [GradSlice("a", 0, 320, (16, 20)), GradSlice("b", 320, 300, (30, 10))]
    dgc = {"enabled": True, "density": 0.05, "momentum_correction": False, "warmup_steps": 0, "min_numel": 8}
    steps = [_ints(n, 620, seed=100 + t) for t in range(3)]
    syncs = [None] * n

    def run(comm):
        r = comm.rank
        sync = syncs[r] = Synchronizer(dp_comm=comm, scheme="spardl", param_kinds={k: "dgc" for k in shapes}, dgc=dgc)
        got = []
        for flats in steps:
            out = sync.sync_flat(flats[r], slices, op="sum")
            sync.end_step()
            got.append((out, torch.cat([sync.state.params[k]["residual"].reshape(-1) for k in shapes]).clone()))
        return got

    per_rank = SimWorld(n).run(run)
    applied, inputs = torch.zeros(620), torch.zeros(620)
    for t, flats in enumerate(steps):
        inputs += sum(flats)
        outs = [per_rank[r][t][0] for r in range(n)]
        assert all(torch.equal(o, outs[0]) for o in outs)
        applied += outs[0]
        assert torch.equal(applied + sum(per_rank[r][t][1] for r in range(n)), inputs)
    stats = syncs[0].pop_step_stats()
    assert 0 < stats["bytes_sent"] < stats["dense_bytes_sent"]
    sd = syncs[0].state_dict()["sparsifiers"]  # checkpointed with DGC's state, keyed by parameter name
    assert "'a'" in str(sd) and "'b'" in str(sd) and "residual" in str(sd)


# --- DGC's rotating flush (zen.dgc.flush_fraction) inside SparDL's budget ----------------------------------
def _flush(numels, phase, stride):
    from zen_ext.compress.dgc.units import _Layout

    lay = _Layout(tuple(f"t{i}" for i in range(len(numels))), tuple(numels), True, torch.device("cpu"))
    return FlushPositions(lay.flush_positions(phase, stride, "cpu"), tuple(numels), phase, stride)


@pytest.mark.parametrize("numels,phase,stride", [((100, 7, 53), 3, 10), ((5, 5), 6, 7), ((1000,), 0, 1),
                                                 ((33, 1, 64), 31, 40)])
def test_flush_positions_are_counted_on_the_host_as_they_lie(numels, phase, stride):
    """``count_in`` (host, from the segments) agrees with the positions DGC's layout builds (device)."""
    f = _flush(numels, phase, stride)
    total = sum(numels)
    assert torch.equal(f.positions, f.positions.sort().values)
    cuts = [0, 1, total // 3, total // 2, total - 1, total]
    ranges = list(zip(cuts, cuts[1:])) + [(0, total), (4, 4)]
    assert f.count_in(ranges) == [int(((f.positions >= lo) & (f.positions < hi)).sum()) for lo, hi in ranges]


@pytest.mark.parametrize("n", (1, 2, 3, 5, 8))
@pytest.mark.parametrize("residual", ["global", "local"])
@pytest.mark.parametrize("form", ["all_reduce", "reduce_scatter"])
def test_flushed_positions_are_applied_in_full_within_the_budget(n, residual, form):
    """The flushed positions hold tiny values the top-k would never pick, beside huge ones that fill
    every block's budget: each still reaches the result as the sum over all ranks, and no rank keeps a
    residual there; the bytes are those without a flush (the flush takes its share of k_b), and the
    global residual still conserves exactly."""
    numels, numel, density = (300, 200, 121), 621, 0.05
    f = _flush(numels, 4, 40)  # DGC's stride at flush_fraction 0.5: half of the budget
    gen = torch.Generator().manual_seed(n)
    grads = [torch.randint(1, 3, (numel,), generator=gen).float() for _ in range(n)]
    for g in grads:
        g[1::3] = 1000.0  # a third of the elements, far above the 5 % budget: the top-k's choice
        g[f.positions] = 1.0
    mems, plain = [g.clone() for g in grads], [g.clone() for g in grads]
    ranges = even_ranges(numel, n)
    if form == "all_reduce":
        scheme = build_scheme("spardl", residual=residual)
        run = lambda c, m, fl: scheme.sync(c, AccumulatedGrad.of(m, density, torch.float32, None, fl))  # noqa: E731
    else:
        rs = build_reduce_scatter("spardl", residual=residual)
        run = lambda c, m, fl: rs.reduce_scatter(c, AccumulatedGrad.of(m, density, torch.float32, None, fl),  # noqa: E731
                                                 ranges)
    world, base = SimWorld(n), SimWorld(n)
    outs = world.run(lambda c, m: run(c, m, f), mems)
    base.run(lambda c, m: run(c, m, None), plain)
    got = outs[0] if form == "all_reduce" else torch.cat(outs)
    assert torch.equal(got[f.positions], torch.full((f.positions.numel(),), float(n)))
    for m in mems:
        assert torch.equal(m[f.positions], torch.zeros(f.positions.numel()))
    for p in plain:  # without the flush they wait
        assert bool(p[f.positions].ne(0).any())
    assert [s.bytes_sent for s in world.stats] == [s.bytes_sent for s in base.stats]
    if residual == "global":
        assert torch.equal(got + sum(mems), sum(grads))


@pytest.mark.parametrize("n", (2, 3))
def test_through_the_synchronizer_dgc_s_flush_reaches_every_coordinate_within_a_stride(n):
    """DGC with ``flush_fraction`` hands its flush to SparDL: while huge gradients on every third
    coordinate take the whole top-k every step, the small ones of the first step are still applied in
    full, each within one stride of steps (what the start-up line promises), and the residuals stay
    DGC's, conserving exactly."""
    from zen_ext.reduction.plan import GradSlice
    from zen_ext.reduction.synchronizer import Synchronizer

    shapes = {"a": (16, 20), "b": (30, 10)}
    slices = [GradSlice("a", 0, 320, (16, 20)), GradSlice("b", 320, 300, (30, 10))]
    dgc = {"enabled": True, "density": 0.05, "flush_fraction": 0.5, "momentum_correction": False,
           "warmup_steps": 0, "min_numel": 8}
    stride = round(1 / (0.5 * 0.05))
    hot = torch.zeros(620, dtype=torch.bool)
    hot[0::3] = True
    first = _ints(n, 620, seed=9)
    steps = [[torch.where(hot, 1000.0, g) for g in first]] + [[hot * 1000.0] * n for _ in range(stride - 1)]
    syncs = [None] * n

    def run(comm):
        r = comm.rank
        sync = syncs[r] = Synchronizer(dp_comm=comm, scheme="spardl", param_kinds={k: "dgc" for k in shapes}, dgc=dgc)
        applied = torch.zeros(620)
        for flats in steps:
            applied += sync.sync_flat(flats[r].clone(), slices, op="sum")
            sync.end_step()
        return applied, torch.cat([sync.state.params[k]["residual"].reshape(-1) for k in shapes]).clone()

    per_rank = SimWorld(n).run(run)
    applied = per_rank[0][0]
    assert torch.equal(applied + sum(res for _, res in per_rank), sum(sum(s) for s in steps))
    cold = ~hot
    assert torch.equal(applied[cold], sum(first)[cold])  # every small coordinate arrived, in full
    for _, res in per_rank:
        assert torch.equal(res[cold], torch.zeros(int(cold.sum())))


def test_a_flush_larger_than_the_budget_widens_the_blocks():
    """A stride below ``1/density`` flushes more than ``k_b`` per block: the block sends its flushed
    positions (a size every rank computes the same), all of them applied, conservation exact."""
    n, numels, numel = 3, (50, 61), 111
    f = _flush(numels, 1, 3)
    grads = _ints(n, numel, seed=21)
    mems = [g.clone() for g in grads]
    scheme = build_scheme("spardl")
    world = SimWorld(n)
    outs = world.run(lambda c, m: scheme.sync(c, AccumulatedGrad.of(m, 0.05, torch.float32, None, f)), mems)
    assert torch.equal(outs[0][f.positions], sum(grads)[f.positions])
    assert torch.equal(outs[0] + sum(mems), sum(grads))
    ks = [max(k, c) for k, c in zip(block_ks(even_blocks(numel, n), 0.05), f.count_in(even_blocks(numel, n)))]
    eb = entry_bytes(numel, 1, torch.float32)
    # Every block reaches each other rank once in the SRS and once in the all-gather.
    assert sum(s.bytes_sent for s in world.stats) == 2 * (n - 1) * sum(ks) * eb
    assert sum(ks) > sum(block_ks(even_blocks(numel, n), 0.05))
