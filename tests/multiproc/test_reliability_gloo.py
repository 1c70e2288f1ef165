"""Reliability on real gloo processes: index ranges on the wire path, TP routing and
agreement, a planning error on one rank, and the hierarchy decided from hosts the ranks report.

Every scenario that used to hang runs under a short ``timeout_s``: before the fixes these tests failed
by timing out (a rank waiting for a peer that had returned or raised), now every rank raises at once.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.multiproc.launch import run_workers

NUMEL = 37


# --- item 2: index ranges, 2 real ranks ------------------------------------------------------------------
def _range_worker(rank, world):
    from zen_ext import SparseGrad, build_scheme
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.core.registry import available_schemes

    comm = TorchCommunicator()
    out = {}
    for name in available_schemes():
        scheme = build_scheme(name)
        for bad in (-1, NUMEL, NUMEL + 5):
            # Every rank holds a bad index: each must refuse it at entry, before any message.
            try:
                scheme.sync(comm, SparseGrad(torch.tensor([0, bad]), torch.tensor([1.0, 2.0]), NUMEL))
                out[(name, bad)] = "no error"
            except ValueError as exc:
                out[(name, bad)] = str(exc)
        idx = torch.tensor([0, NUMEL - 1, rank + 1, NUMEL - 1])
        vals = torch.tensor([1.0, -2.0, 3.0, 4.0]) * (rank + 1)
        out[(name, "edges")] = scheme.sync(comm, SparseGrad(idx, vals, NUMEL))
    return out


def test_gloo_every_scheme_refuses_out_of_range_and_keeps_the_edges():
    from zen_ext import SparseGrad
    from zen_ext.core.registry import available_schemes

    res = run_workers(_range_worker, 2, timeout_s=240)
    want = sum(SparseGrad(torch.tensor([0, NUMEL - 1, r + 1, NUMEL - 1]), torch.tensor([1.0, -2.0, 3.0, 4.0]) * (r + 1),
                          NUMEL).to_dense() for r in range(2))
    for name in available_schemes():
        for bad in (-1, NUMEL, NUMEL + 5):
            lo, hi = min(bad, 0), max(bad, 0)
            for r in range(2):
                assert res[r][(name, bad)] == (f"scheme {name!r}: grad.indices ({bad}) must lie in [0, {NUMEL}) "
                                               f"(indices span [{lo}, {hi}])")
        for r in range(2):
            assert torch.equal(res[r][(name, "edges")], want), (name, r)


# --- item 4 and the fast failure: 2 ranks as one TP group (each its own DP group of 1) ----------------------
def _tp_setup(rank, world):
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator

    own = [dist.new_group([r]) for r in range(world)][rank]  # new_group is collective: every rank makes both
    dgc = {"enabled": True, "density": 0.1, "min_numel": 1024, "momentum_correction": False,
           "momentum_masking": False}
    # An uneven AutoTP shard: 1030 elements on TP rank 0, 1010 on TP rank 1 (min_numel 1024).
    rows = 103 if rank == 0 else 101
    return TorchCommunicator(own), TorchCommunicator(), dgc, rows


def _tp_disagree_worker(rank, world):
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    dp_comm, tp_comm, dgc, rows = _tp_setup(rank, world)
    # Kinds that differ (routing computed from each rank's local shard): the TP agreement must run on
    # both ranks, including the one whose bucket has no DGC slice, and raise on both.
    kinds = {"0.weight": "dgc" if rank == 0 else "dense"}
    sync = Synchronizer(dp_comm=dp_comm, scheme="zen", param_kinds=kinds, dgc=dgc, tp_comm=tp_comm)
    try:
        sync.sync_flat(torch.ones(rows * 10), [GradSlice("0.weight", 0, rows * 10, (rows, 10))], "sum")
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_tp_disagreement_raises_on_both_ranks():
    """Before: the TP rank without a DGC slice returned; its peer waited in the agreement until timeout."""
    res = run_workers(_tp_disagree_worker, 2, timeout_s=90)
    assert res[0] == ("zen: tensor-parallel ranks disagree on the bucket's dgc_names[0]: rank 1 has '<0 entries>', "
                      "rank 0 has '0.weight'; every TP rank must route each parameter the same way "
                      "(classify_parameters(..., tp_comm=...)) in the same buckets")
    assert res[1].startswith("zen: tensor-parallel ranks disagree on the bucket's dgc_names[0]: rank 0 has "
                             "'0.weight', rank 1 has '<0 entries>'")


def _tp_routing_worker(rank, world):
    from zen_ext.compress import classify_parameters
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer
    from zen_ext.reduction import BucketReducer

    dp_comm, tp_comm, dgc, rows = _tp_setup(rank, world)
    model = torch.nn.Sequential(torch.nn.Linear(10, rows, bias=False))
    out = {"local_kinds": classify_parameters(model, natural=None, dgc=dgc, log=False)}
    kinds = classify_parameters(model, natural=None, dgc=dgc, log=False, tp_comm=tp_comm)
    out["kinds"] = kinds
    # With agreed kinds, DGC's threshold exchange over the TP group completes on both ranks.
    sync = Synchronizer(dp_comm=dp_comm, scheme="zen", param_kinds=kinds, dgc=dgc, tp_comm=tp_comm)
    red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=1, tp_comm=tp_comm)
    flat = torch.arange(1, rows * 10 + 1, dtype=torch.float32)
    red.reduce_(flat, [GradSlice("0.weight", 0, rows * 10, (rows, 10))], "sum")
    out["sent"] = int(flat.ne(0).sum())

    # Two replicated one-row embeddings shared over TP: TP rank 1's share of each is empty, yet it must
    # join each new layout's TP agreement as rank 0 does (two layouts, two agreements on both ranks).
    kinds = {"e1": "natural", "e2": "natural"}
    sync = Synchronizer(dp_comm=dp_comm, scheme="zen", param_kinds=kinds, natural={}, tp_comm=tp_comm)
    red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=1, tp_comm=tp_comm, tp_shared=frozenset(kinds))
    flat = torch.tensor([1.0, 0.0, -3.0, 4.0, 0.0, 5.0, 0.0, 6.0])
    slices = [GradSlice("e1", 0, 4, (1, 4)), GradSlice("e2", 4, 4, (1, 4))]
    for _ in range(2):
        got = flat.clone()
        red.reduce_(got, slices, "sum")
    out["shared"] = got
    return out


def test_tp_routing_is_a_function_of_gathered_shard_sizes():
    res = run_workers(_tp_routing_worker, 2, timeout_s=90)
    # Local shard sizes route the same parameter differently: the bug.
    assert res[0]["local_kinds"] == {"0.weight": "dgc"} and res[1]["local_kinds"] == {"0.weight": "dense"}
    # The gathered largest shard routes it alike on both TP ranks.
    assert res[0]["kinds"] == res[1]["kinds"] == {"0.weight": "dgc"}
    for r in range(2):
        assert 0 < res[r]["sent"] < 1030 // 2, res[r]["sent"]
        assert torch.equal(res[r]["shared"], torch.tensor([1.0, 0.0, -3.0, 4.0, 0.0, 5.0, 0.0, 6.0])), r


def _plan_error_worker(rank, world):
    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

    sync = Synchronizer(dp_comm=TorchCommunicator(), scheme="zen", param_kinds={"w": "dense"})
    # Rank 1's engine hands over a slice its routing does not know (a rank-local bug).
    name = "w" if rank == 0 else "w_typo"
    try:
        sync.sync_flat(torch.ones(8), [GradSlice(name, 0, 8, (8,))], "sum")
        return "no error"
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_planning_error_on_one_rank_reaches_its_peer_at_once():
    """Before: rank 1 raised alone and rank 0 waited in the agreement for the process-group timeout."""
    res = run_workers(_plan_error_worker, 2, timeout_s=90)
    own = "ValueError: GradSlice name ('w_typo') must be in param_kinds (1 names, e.g. ['w'])"
    assert res[1] == own
    assert res[0] == (f"RuntimeError: zen: data-parallel rank 1 could not plan this bucket ({own}); every rank stops "
                      f"with it instead of waiting")


# --- item 5: hosts the ranks report decide the hierarchy, identically on all ------------------------------
def _hosts_worker(rank, world):
    import torch.distributed as dist

    from zen_ext.comm.torch_dist import TorchCommunicator
    from zen_ext.reduction.synchronizer import GradSlice, Synchronizer
    from zen_ext.reduction import BucketReducer, maybe_node_sharding

    out = {}
    # (i) An uneven hostfile, 4 + 2: each rank's own LOCAL_WORLD_SIZE differs (4 or 2).
    first = rank < 4
    os.environ.update(ZEN_EXT_HOST="gpu1" if first else "gpu2", LOCAL_WORLD_SIZE="4" if first else "2",
                      LOCAL_RANK=str(rank if first else rank - 4))
    node, inter, reason = maybe_node_sharding("auto", list(range(world)), rank)
    out["auto"] = (node is None, inter is None, reason)
    try:
        maybe_node_sharding(True, list(range(world)), rank)
        out["true"] = "no error"
    except NotImplementedError as exc:
        out["true"] = str(exc)

    # (ii) 3 hosts of 2 ranks, interleaved (rank r on host r % 3): nodes are {0,3}, {1,4}, {2,5}, not
    # consecutive ranks; 3 nodes make the inter-node group a non-power-of-two.
    os.environ.update(ZEN_EXT_HOST=f"h{rank % 3}", LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank // 3))
    node, inter, reason = maybe_node_sharding("auto", list(range(world)), rank)
    out["even"] = (dist.get_process_group_ranks(node.intra.group), dist.get_process_group_ranks(inter), reason)
    sync = Synchronizer(dp_comm=TorchCommunicator(inter), scheme="zen", param_kinds={"w": "dense", "e": "natural"},
                        natural={})
    red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=world, node=node)
    flat = _host_grad(rank)
    red.reduce_(flat, [GradSlice("e", 0, 24, (6, 4)), GradSlice("w", 24, 17, (17,))], "sum")
    out["sum"] = flat
    # Buckets smaller than a node: local rank 1's shard is empty and still joins each new layout.
    tiny = []
    for name, shape in (("w", (1,)), ("e", (1, 1)), ("w", (1,))):
        one = torch.tensor([float(rank + 1)])
        red.reduce_(one, [GradSlice(name, 0, 1, shape)], "sum")
        tiny.append(float(one))
    out["tiny"] = tiny
    # (iii) One rank configured differently: every rank raises, none skips the gather.
    try:
        maybe_node_sharding(False if rank == 5 else "auto", list(range(world)), rank)
        out["disagree"] = "no error"
    except RuntimeError as exc:
        out["disagree"] = str(exc)
    return out


def _host_grad(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    flat = torch.zeros(41)
    flat[4 * (rank % 6): 4 * (rank % 6) + 4] = torch.randint(-5, 6, (4,), generator=g).float()  # one row
    flat[24:] = torch.randint(-5, 6, (17,), generator=g).float()
    return flat


def test_hierarchy_from_reported_hosts_is_identical_everywhere():
    res = run_workers(_hosts_worker, 6, timeout_s=180)
    reason = ("the data-parallel group [0, 1, 2, 3, 4, 5] spans nodes of different sizes "
              "(gpu1: [0, 1, 2, 3], gpu2: [4, 5])")
    for r in range(6):
        assert res[r]["auto"] == (True, True, reason), r
        assert res[r]["true"].startswith("zen.hierarchical (True) supports data-parallel groups spread evenly"), r
        intra, inter, why = res[r]["even"]
        assert intra == sorted({r, (r + 3) % 6}) and inter == [x for x in range(6) if x // 3 == r // 3]
        assert why == "3 nodes of 2 ranks per data-parallel group"
        assert torch.equal(res[r]["sum"], sum(_host_grad(k) for k in range(6))), r
        assert res[r]["tiny"] == [21.0, 21.0, 21.0], r
        if r != 5:
            assert res[r]["disagree"] == (f"zen: ranks disagree on zen.hierarchical: rank 5 has False, rank {r} has "
                                          f"'auto'; every rank must use the same value"), r
    assert res[5]["disagree"] == ("zen: ranks disagree on zen.hierarchical: rank 0 has 'auto', rank 5 has False; "
                                  "every rank must use the same value")


@pytest.fixture(autouse=True)
def _no_leaked_host_env(monkeypatch):
    monkeypatch.delenv("ZEN_EXT_HOST", raising=False)
