"""The node-level reduce-scatter (``reduction/node_scatter.py``) in SimWorld: N nodes of L ranks in one
process, each rank with its intra-node and inter-node Communicators.

* natural-only (and dense) node-level ZEN equals the dense reduce-scatter of the same inputs, exactly
  (integer values), fp32 and bf16, sum and mean, at 2×2, 2×3, 3×2 (and 1×2, 2×1), with even (FSDP)
  and uneven ranges (ZeRO: empty ones, one rank owning almost everything), small sub-bucket caps,
  rows at index 0 and last, and nodes whose ranks interleave;
* with DGC, every lossless reduce-scatter scheme equals the dense node-level reduce-scatter fed the
  same DGC output, and DGC's state is the shard's: about P/L elements a rank;
* 16 × 8 ranks;
* what is refused.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from zen_ext import SimWorld
from zen_ext.comm.simulated import run_grid
from zen_ext.core.rs_base import even_ranges
from zen_ext.reduction import BucketReducer, NodeShardedReduce
from zen_ext.reduction.hierarchy import decide_hierarchy, owner_order
from zen_ext.reduction.synchronizer import GradSlice, Synchronizer

ROWS, WIDTH = 24, 4
OUT, IN = 16, 8
GAP = 3  # uncovered elements (alignment padding): reduced dense
SLICES = [GradSlice("emb", 0, ROWS * WIDTH, (ROWS, WIDTH)), GradSlice("w", ROWS * WIDTH, OUT * IN, (OUT, IN)),
          GradSlice("b", ROWS * WIDTH + OUT * IN + GAP, OUT, (OUT,))]
NUMEL = ROWS * WIDTH + OUT * IN + GAP + OUT
NATURAL = {"emb": "natural", "w": "dense", "b": "dense"}
WITH_DGC = {"emb": "natural", "w": "dgc", "b": "dense"}
DGC = {"enabled": True, "density": 0.1, "min_numel": 8, "momentum_correction": False, "warmup_steps": 0}


def node_grid(nodes: list[list[int]], fn):
    """Run ``fn(dp_rank, node_reduce, inter)`` on every data-parallel rank of ``nodes`` (lists of ranks),
    on threads; inter-node group ``l`` orders its members by rank, as ``new_group`` does."""
    L, n = len(nodes[0]), sum(len(m) for m in nodes)
    owners = owner_order(nodes, list(range(n)))

    def cell(k, l, intra, inter):
        return fn(nodes[k][l], NodeShardedReduce(intra, l, L, owners=owners), inter)

    out = run_grid(len(nodes), L, cell, col_rank=lambda k, l: owners[l].index(nodes[k][l]), timeout_s=120)
    by_rank = [None] * n
    for k, members in enumerate(nodes):
        for l, r in enumerate(members):
            by_rank[r] = out[k * L + l]
    return by_rank


def blocks(N: int, L: int) -> list[list[int]]:
    return [[k * L + l for l in range(L)] for k in range(N)]


def grads(n: int, step: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Integer gradients: a few embedding rows per rank (row 0 and the last on rank 0), the rest dense."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(1000 * step + r)
        x = torch.randint(-4, 5, (NUMEL,), generator=g).float()
        emb = torch.zeros(ROWS, WIDTH)
        rows = torch.randint(0, ROWS, (3,), generator=g)
        emb[rows] = torch.randint(-3, 4, (3, WIDTH), generator=g).float()
        if r == 0:
            emb[0] += 1
            emb[ROWS - 1] -= 2
        x[: ROWS * WIDTH] = emb.reshape(-1)
        out.append(x.to(dtype))
    return out


def uneven(n: int) -> list[tuple[int, int]]:
    """ZeRO-like owner ranges: the first rank empty, the next ones short, the last owning the rest."""
    cuts = [0, 0] + [min(5 + 7 * i, NUMEL) for i in range(n - 2)] + [NUMEL]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


def run_node(nodes, inputs_per_step, ranges, op, kinds=NATURAL, rs="zen", cap_bytes=1 << 20, dgc=None):
    """Every step's shard on every rank, its reducer's last stats and its DGC state dict."""
    n = sum(len(m) for m in nodes)

    def fn(r, node, inter):
        sync = Synchronizer(dp_comm=inter, scheme="zen", param_kinds=kinds, natural={}, dgc=dgc, reduce_scatter=rs)
        red = BucketReducer(sync, cap_bytes=cap_bytes, dp_size=n, node=node)
        shards = []
        for xs in inputs_per_step:
            lo, hi = ranges[r]
            out = torch.full((hi - lo,), float("nan"), dtype=xs[r].dtype)
            x = xs[r].clone()
            assert red.reduce_scatter_(x, SLICES, ranges, op, out) is out
            assert torch.equal(x, xs[r])  # the engine's bucket is not modified
            shards.append(out)
            sync.end_step()
        return shards, red.pop_stats(), sync.state_dict()

    return node_grid(nodes, fn)


def dense_want(xs, ranges, r, op):
    total = sum(x.double() for x in xs).to(xs[0].dtype)
    if op == "mean":
        total = total / len(xs)
    lo, hi = ranges[r]
    return total[lo:hi]


@pytest.mark.parametrize("N, L", [(2, 2), (2, 3), (3, 2), (1, 2), (2, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("layout", ["even", "uneven"])
def test_natural_node_level_equals_the_dense_reduce_scatter(N, L, dtype, op, layout):
    n = N * L
    ranges = even_ranges(NUMEL, n) if layout == "even" else uneven(n)
    steps = [grads(n, s, dtype) for s in range(2)]
    # A 64-element cap splits every shard into several sub-buckets (the embedding alone exceeds it).
    for r, (shards, stats, _) in enumerate(run_node(blocks(N, L), steps, ranges, op, cap_bytes=64 * 4)):
        for s, xs in enumerate(steps):
            assert torch.equal(shards[s], dense_want(xs, ranges, r, op)), (r, s)
        if L > 1:
            assert stats["intra_bytes_sent"] > 0
        if N > 1 and ranges[r][1] > ranges[r][0]:
            assert stats["dp_bytes_sent"] > 0  # across nodes


def test_the_fsdp_layout_reorders_by_rows_and_interleaved_nodes_are_served():
    """Even ranges take Step A's one-gather path; nodes whose ranks interleave (node 0 = ranks 0 and
    3) give inter-node groups whose order is not the node order."""
    nodes = [[0, 3], [1, 2]]
    n = 4
    numel = NUMEL - NUMEL % n
    ranges = even_ranges(numel, n)
    slices = [s for s in SLICES if s.offset + s.numel <= numel]

    def fn(r, node, inter):
        sync = Synchronizer(dp_comm=inter, scheme="zen", param_kinds=NATURAL, natural={}, reduce_scatter="zen")
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=n, node=node)
        out = torch.empty(ranges[r][1] - ranges[r][0])
        red.reduce_scatter_(grads(n, 0)[r][:numel].clone(), slices, ranges, "sum", out)
        return out, red.route.node.layouts

    xs = [x[:numel] for x in grads(n, 0)]
    for r, (out, layouts) in enumerate(node_grid(nodes, fn)):
        assert torch.equal(out, dense_want(xs, ranges, r, "sum")), r
        assert next(iter(layouts.values())).rows is not None


@pytest.mark.parametrize("layout", ["even", "uneven"])
@pytest.mark.parametrize("cap_elems", [5, 37, 64, 1 << 18])
def test_step_a_reorders_in_windows_of_at_most_the_cap(layout, cap_elems):
    """A bucket above half the cap is reordered and reduced inside the node in column windows (every
    block's same window at once): each window's parts hold at most half the cap (no copy of the whole
    bucket), they
    cover every block's elements once, and the shards equal the dense reduce-scatter at any cap."""
    N, L = 2, 3
    n = N * L
    ranges = even_ranges(NUMEL - NUMEL % n, n) if layout == "even" else uneven(n)
    numel = ranges[-1][1] if layout == "even" else NUMEL
    slices = [sl for sl in SLICES if sl.offset + sl.numel <= numel]
    xs = [x[:numel] for x in grads(n, 0)]

    def fn(r, node, inter):
        sync = Synchronizer(dp_comm=inter, scheme="zen", param_kinds=NATURAL, natural={}, reduce_scatter="zen")
        red = BucketReducer(sync, cap_bytes=cap_elems * 4, dp_size=n, node=node)
        out = torch.empty(ranges[r][1] - ranges[r][0])
        red.reduce_scatter_(xs[r].clone(), slices, ranges, "sum", out)
        return out, next(iter(red.route.node.layouts.values()))

    for r, (out, lay) in enumerate(node_grid(blocks(N, L), fn)):
        assert torch.equal(out, dense_want(xs, ranges, r, "sum")), (r, cap_elems)
        if lay.rows is not None:  # one index_select: only when the whole bucket fits in the cap
            assert layout == "even" and 2 * numel <= cap_elems and not lay.windows
            continue
        sizes = [sum(b if a < 0 else b - a for a, b in parts) for _, _, parts in lay.windows]
        assert max(sizes) <= max(cap_elems // 2, L) and sum(sizes) == L * lay.width
        assert len(lay.windows) == -(-lay.width // max(1, cap_elems // (2 * L)))
        taken = sorted(i for _, _, parts in lay.windows for a, b in parts if a >= 0 for i in range(a, b))
        assert taken == list(range(numel))  # every element once (the ranges tile the bucket here)


@pytest.mark.parametrize("rs", ["zen", "direct", "auto"])
@pytest.mark.parametrize("N, L", [(2, 2), (3, 2), (2, 3)])
def test_dgc_every_lossless_scheme_equals_the_dense_node_level_reduce_scatter(rs, N, L):
    n = N * L
    steps = [grads(n, s) for s in range(3)]
    ranges = uneven(n)
    want = run_node(blocks(N, L), steps, ranges, "sum", WITH_DGC, rs="dense", dgc=DGC, cap_bytes=64 * 4)
    got = run_node(blocks(N, L), steps, ranges, "sum", WITH_DGC, rs=rs, dgc=DGC, cap_bytes=64 * 4)
    selected = 0
    for r, ((a, _, sd_a), (b, stats, sd_b)) in enumerate(zip(want, got)):
        for s in range(len(steps)):
            assert torch.equal(a[s], b[s]), (r, s)
        assert str(sd_a["sparsifiers"]) == str(sd_b["sparsifiers"])  # the same DGC memory
        if "dgc" in stats["numel"]:  # ranks whose shard holds some of w
            assert stats["nnz"]["dgc"] < stats["numel"]["dgc"]  # DGC did select
            selected += 1
    assert selected >= N  # w lies in the shards of at least one local rank per node


def _state_bytes(sd: dict) -> int:
    """Bytes of every tensor in a Synchronizer state dict (summed by storage, as zen_ext holds them)."""
    seen, total = set(), 0
    for entry in sd["sparsifiers"]["params"].values():
        for t in entry.values():
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
    return total


def test_dgc_state_is_the_shards():
    """Flat, every rank's DGC state covers its whole ``w``; node-level at L = 2, about half of it."""
    N, L = 2, 2
    n = N * L
    steps = [grads(n, s) for s in range(2)]
    ranges = even_ranges(NUMEL, n)
    node = run_node(blocks(N, L), steps, ranges, "sum", WITH_DGC, dgc=DGC)

    def flat(comm):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=WITH_DGC, natural={}, dgc=DGC, reduce_scatter="zen")
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=n)
        for xs in steps:
            lo, hi = ranges[comm.rank]
            red.reduce_scatter_(xs[comm.rank].clone(), SLICES, ranges, "sum", torch.empty(hi - lo))
            sync.end_step()
        return sync.state_dict()

    flat_bytes = [_state_bytes(sd) for sd in SimWorld(n).run(flat)]
    node_bytes = [_state_bytes(sd) for _, _, sd in node]
    assert min(flat_bytes) > 0 and max(node_bytes) > 0
    # Flat: every rank keeps state for all OUT·IN elements of w; node-level: its share of w.
    assert sum(node_bytes) * L == pytest.approx(sum(flat_bytes), rel=0.05), (flat_bytes, node_bytes)


@pytest.mark.slow
def test_16_nodes_of_8_ranks():
    N, L = 16, 8
    n = N * L
    steps = [grads(n, s) for s in range(2)]
    ranges = uneven(n)
    for r, (shards, stats, _) in enumerate(run_node(blocks(N, L), steps, ranges, "sum")):
        for s, xs in enumerate(steps):
            assert torch.equal(shards[s], dense_want(xs, ranges, r, "sum")), (r, s)


def test_one_rank_per_node_or_one_node_runs_flat():
    """The decision: L = 1 (every rank its own host) or N = 1 (one host) is flat ZEN ("auto"), and an
    error naming why with ``true``."""
    assert decide_hierarchy("auto", ["a", "b", "c"], [[0, 1, 2]])[0] is None
    assert decide_hierarchy("auto", ["a", "a", "a"], [[0, 1, 2]])[0] is None
    with pytest.raises(ValueError, match="does not span several nodes with several ranks each"):
        decide_hierarchy(True, ["a", "b"], [[0, 1]])
    with pytest.raises(NotImplementedError, match="nodes of different sizes"):
        decide_hierarchy(True, ["a", "a", "b"], [[0, 1, 2]])
    layouts, _ = decide_hierarchy(True, ["a", "b", "a", "b"], [[0, 1, 2, 3]])
    assert owner_order(layouts[(0, 1, 2, 3)], [0, 1, 2, 3]) == [[0, 1], [2, 3]]


def test_what_is_refused_is_named():
    def no_owners(comm):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=NATURAL, natural={})
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=2, node=NodeShardedReduce(comm))
        red.reduce_scatter_(torch.zeros(NUMEL), SLICES, even_ranges(NUMEL, 2), "sum", torch.empty(NUMEL // 2))

    with pytest.raises(RuntimeError, match="needs the node layout of the data-parallel group"):
        SimWorld(2).run(no_owners)

    def uneven_owners(comm):
        sync = Synchronizer(dp_comm=comm, scheme="zen", param_kinds=NATURAL, natural={})
        node = NodeShardedReduce(comm, owners=[[0, 2], [1]])
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=3, node=node)
        red.reduce_scatter_(torch.zeros(NUMEL), SLICES, even_ranges(NUMEL, 3), "sum", torch.empty(0))

    with pytest.raises(RuntimeError, match="uneven nodes are not supported"):
        SimWorld(2).run(uneven_owners)

    def disagree(r, node, inter):  # one rank of node 1 hands over a shorter bucket
        sync = Synchronizer(dp_comm=inter, scheme="zen", param_kinds=NATURAL, natural={})
        red = BucketReducer(sync, cap_bytes=1 << 20, dp_size=4, node=node)
        numel = NUMEL - (1 if r == 3 else 0)
        ranges = even_ranges(numel, 4)
        red.reduce_scatter_(torch.zeros(numel), [SLICES[0]], ranges, "sum", torch.empty(ranges[r][1] - ranges[r][0]))

    with pytest.raises(RuntimeError, match=r"the ranks of a node disagree on a bucket's layout.*local rank \d has"):
        node_grid(blocks(2, 2), disagree)


def test_the_docs_section_turns_node_level_on():
    """docs/deepspeed_zero3.md's "Node-level DGC" block is a valid section that asks for it."""
    from zen_ext.config import ZenConfig

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "deepspeed_zero3.md")).read()
    block = re.search(r"<!-- snippet: node-level-zen -->\n```json\n(.*?)```", text, re.S).group(1)
    cfg = ZenConfig.from_dict(json.loads(block)["zen"])
    assert cfg.hierarchical is True and cfg.sections()["dgc"].enabled
