"""Engine-neutral bucket handling (zen_ext/reduction/): slices, re-bucketing, node shards,
TP-shared embedding rows and the non-finite guard, checked against a dense all-reduce on gloo.

Gradients are integer-valued, so every lossless path must equal the dense sum exactly.
"""


import pytest
import torch

from tests.multiproc.launch import run_workers
from zen_ext.reduction.synchronizer import GradSlice
from zen_ext.reduction import BucketReducer, clip_slices, locate_slices, shard_bounds, split_to_cap
from zen_ext.reduction.hierarchy import hierarchy_applies, node_layout

# A bucket: embedding [12, 4] (natural), a weight [6, 5] (dgc or dense), a bias [3] (dense), 2 pad elements.
LAYOUT = [("emb", 0, (12, 4)), ("w", 48, (6, 5)), ("b", 78, (3,))]
NUMEL = 83


def _slices():
    return [GradSlice(n, o, int(torch.Size(s).numel()), s) for n, o, s in LAYOUT]


# --- single-process helpers ----------------------------------------------------------------------------
def test_locate_slices_by_address_for_lists_and_views():
    flat = torch.zeros(10)
    a, b = flat[0:4].view(2, 2), flat[6:9]
    # A flat buffer holding views: slices at the views' offsets, the gap uncovered.
    assert locate_slices([flat], [("b", b), ("a", a)]) == [GradSlice("a", 0, 4, (2, 2)), GradSlice("b", 6, 3, (3,))]
    # A list of separate tensors: offsets in concatenation order; unnamed tensors get no slice.
    x, y, z = torch.zeros(3), torch.zeros(2, 2), torch.zeros(5)
    assert locate_slices([x, y, z], [("z", z), ("x", x)]) == [GradSlice("x", 0, 3, (3,)), GradSlice("z", 7, 5, (5,))]
    # A tensor named twice (tied) is one slice.
    assert len(locate_slices([x], [("x", x), ("x_alias", x)])) == 1


def test_split_to_cap_cuts_at_slices_and_isolates():
    sl = _slices()
    got = split_to_cap(NUMEL, sl, cap=50)
    assert [(a, b) for a, b, _ in got] == [(0, 48), (48, 83)]
    assert got[1][2] == [GradSlice("w", 0, 30, (6, 5)), GradSlice("b", 30, 3, (3,))]
    # An oversized slice is a bucket of its own; the padding tail joins the last bucket that has room.
    assert [(a, b) for a, b, _ in split_to_cap(NUMEL, sl, cap=10)] == [(0, 48), (48, 78), (78, 83)]
    # Isolated names get their own bucket even under a large cap.
    assert [(a, b) for a, b, _ in split_to_cap(NUMEL, sl, cap=10**6, isolate={"w"})] == [(0, 48), (48, 78), (78, 83)]
    # Buckets always tile the whole range.
    for cap in (1, 7, 31, 48, 49, 83, 1000):
        bounds = [(a, b) for a, b, _ in split_to_cap(NUMEL, sl, cap)]
        assert bounds[0][0] == 0 and bounds[-1][1] == NUMEL
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(bounds, bounds[1:]))


def test_shard_bounds_snap_to_rows_and_clip_keeps_parts():
    sl = _slices()
    cuts = shard_bounds(NUMEL, sl, 3)
    assert cuts[0] == 0 and cuts[-1] == NUMEL and cuts == sorted(cuts)
    assert cuts[1] % 4 == 0  # inside the embedding: a row boundary (rows of 4)
    parts = clip_slices(sl, cuts[1], cuts[2])
    emb = [p for p in parts if p.name == "emb"]
    if emb:
        assert emb[0].shape == (emb[0].numel // 4, 4) and emb[0].start == cuts[1]
    w = [p for p in parts if p.name == "w"][0]
    assert w.start == max(0, cuts[1] - 48) and w.offset == max(0, 48 - cuts[1])
    assert node_layout([0, 2, 4, 6], 4) == [[0, 2], [4, 6]] and hierarchy_applies([[0, 2], [4, 6]])
    assert not hierarchy_applies([[0, 1, 2, 3]]) and not hierarchy_applies([[0], [4]])
    assert not hierarchy_applies([[0, 1], [2, 3, 4]])  # unequal nodes


def test_hierarchical_true_on_one_node_is_an_error():
    from zen_ext.reduction.hierarchy import build_node_sharding

    with pytest.raises(ValueError) as info:
        build_node_sharding([0, 1], [[0, 1]], 2, 0, required=True)
    assert str(info.value) == ('zen.hierarchical (True) must be false or "auto" here: the data-parallel group '
                               '[0, 1] does not span several nodes with several ranks each (0: [0, 1])')
    assert build_node_sharding([0, 1], [[0, 1]], 2, 0) == (None, None)


# --- gloo workers --------------------------------------------------------------------------------------
def _grad(rank: int, seed: int = 0) -> torch.Tensor:
    """Integer-valued bucket: embedding rows sparse (different rows per rank, row 0 and the last row
    included on some ranks), dense weight, bias, padding."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    flat = torch.zeros(NUMEL)
    emb = flat[:48].view(12, 4)
    rows = {0: [0, 3], 1: [3, 11], 2: [], 3: [5, 0, 11]}[rank % 4]
    for r in rows:
        emb[r] = torch.randint(-4, 5, (4,), generator=g).float()
    flat[48:] = torch.randint(-4, 5, (NUMEL - 48,), generator=g).float()
    return flat


def _build(dp_comm, tp_comm, dgc):
    from zen_ext.config import ZenConfig
    from zen_ext.reduction.synchronizer import Synchronizer

    cfg = ZenConfig.from_dict({"dgc": {"enabled": dgc, "min_numel": 10, "density": 0.2}})
    kinds = {"emb": "natural", "w": "dgc" if dgc else "dense", "b": "dense"}
    return Synchronizer(dp_comm=dp_comm, scheme=cfg.build_scheme(), param_kinds=kinds,
                        sections=cfg.sections(), tp_comm=tp_comm)


def _hierarchical_worker(rank, world, cases):
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.reduction.hierarchy import build_node_sharding

    # 2 emulated nodes of 2 local ranks: intra {0,1},{2,3}; inter {0,2},{1,3}.
    node, inter = build_node_sharding(range(world), [range(world)], 2, rank, required=True)
    out = []
    for op, cap in cases:
        sync = _build(TorchCommunicator(inter), None, dgc=False)
        red = BucketReducer(sync, cap_bytes=cap, dp_size=world, node=node)
        for step in range(2):
            flat = _grad(rank, step)
            red.reduce_(flat, _slices(), op)
            sync.end_step()
            out.append((flat, red.pop_stats()))
    return out


def test_hierarchical_equals_dense_sum():
    """2 emulated nodes × 2 local ranks: reduce-scatter, ZEN across nodes per shard, all-gather; one
    bucket, and buckets re-cut to a 64-byte cap."""
    cases = [("mean", 10**6), ("sum", 64)]
    res = run_workers(_hierarchical_worker, 4, cases)
    for c, (op, _) in enumerate(cases):
        for step in range(2):
            want = sum(_grad(r, step) for r in range(4))
            if op == "mean":
                want = want / 4
            for r in range(4):
                flat, stats = res[r][2 * c + step]
                assert torch.equal(flat, want), (op, r, step)
                assert stats["intra_bytes_sent"] > 0 and stats["dense_bytes"] == 2 * 3 * NUMEL * 4 // 4


def _tp_shared_worker(rank, world):
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator

    tp, dp = 2, 2  # TP groups {0,1},{2,3}; DP groups {0,2},{1,3} (DeepSpeed's AutoTP layout)
    tp_group = dp_group = None
    for t in range(dp):
        g = dist.new_group([t * tp + i for i in range(tp)])
        if rank // tp == t:
            tp_group = g
    for i in range(tp):
        g = dist.new_group([t * tp + i for t in range(dp)])
        if rank % tp == i:
            dp_group = g
    tp_comm = TorchCommunicator(tp_group)
    out = []
    for use_dgc in (False, True):
        sync = _build(TorchCommunicator(dp_group), tp_comm, dgc=use_dgc)
        red = BucketReducer(sync, cap_bytes=10**6, dp_size=dp, tp_comm=tp_comm, tp_shared=frozenset({"emb"}))
        flat = _grad(rank // tp)  # TP ranks of one replica hold identical gradients
        flat[48:] += rank % tp  # except for their own (sharded) weights
        red.reduce_(flat, _slices(), "sum")
        out.append((flat, red.pop_stats(), sync.pop_step_stats()))
    return out


def test_tp_shared_embedding_is_synchronized_once_per_dp_group():
    """tp 2 × dp 2: each TP rank reduces half of the embedding rows over its DP group, then the TP
    ranks exchange the non-zero rows; with DGC on the weight as well."""
    res = run_workers(_tp_shared_worker, 4)
    want_emb = (_grad(0) + _grad(1))[:48]
    for case, use_dgc in enumerate((False, True)):
        for r in range(4):
            flat, stats, _ = res[r][case]
            assert torch.equal(flat[:48], want_emb), (use_dgc, r)
            if not use_dgc:
                want_rest = _grad(0)[48:] + _grad(1)[48:] + 2 * (r % 2)
                assert torch.equal(flat[48:], want_rest), r
            assert stats["tp_share_bytes_sent"] > 0
            # Half of the 12 rows each: the natural numel this rank's Synchronizer saw is 6 rows of 4.
            assert stats["numel"]["natural"] == 24


def _guard_worker(rank, world, nan_rank):
    from zen_ext.comm.torch_dist import TorchCommunicator

    comm = TorchCommunicator()
    out = []
    for value in (float("nan"), float("inf"), float("-inf")):
        sync = _build(comm, None, dgc=True)
        red = BucketReducer(sync, cap_bytes=10**6, dp_size=world, guard_comm=comm)
        flat = _grad(rank)
        if rank == nan_rank:
            flat[50] = value  # one DGC weight element, which top-k alone could drop
        red.reduce_(flat, _slices(), "mean")
        stats = red.pop_stats()
        clean = _grad(rank)
        red.reduce_(clean, _slices(), "mean")  # the next step is unaffected
        out.append((flat, stats, clean))
    return out


def test_nonfinite_gradient_reaches_every_rank():
    """fp16 loss scaling: one rank's overflow (NaN, +Inf, -Inf) must make every rank (3, a
    non-power-of-two world) see a non-finite bucket, and leave the next step clean."""
    res = run_workers(_guard_worker, 3, 1)
    for case in range(3):
        for r in range(3):
            flat, stats, clean = res[r][case]
            assert torch.isnan(flat).all(), (case, r)
            assert stats["nonfinite_steps"] == 1
            assert torch.isfinite(clean).all()
