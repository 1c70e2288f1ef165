"""``zen.dgc.value_bits`` on ZEN's reduce-scatter (``core/rs_zen.py``): the values quantize in ascending global
index, so a block of the push or of the server's reply to a range owner holds one tensor of the bucket after
another. What is checked, on a bucket of a large tensor (|x| ~ 1e3) and a small one (~1e-2) whose boundary lies
inside one owner's range, at 4 bits (a block's scale is its amax / 7: a value below amax / 14 codes 0):

* the reply: the owner's small-tensor sums come back non-zero and close (in position order, the reply's blocks
  mixed both tensors and coded nearly all of them 0: the control below, on the same sums), the large tensor's
  close too; every pull format, even and uneven ranges (an empty one), 2 and 3 ranks;
* the push: the values a rank's owners see (``LowBitValues.sender_feedback``) code none of the small tensor 0:
  the push already sends each owner its values in the gradient's (ascending) order.
"""

from __future__ import annotations

import pytest
import torch

from zen_ext import SimWorld, ops
from zen_ext.core.lowbit import VALUE_BLOCK as BLOCKS, LowBitValues
from zen_ext.core.reduce_scatter import build_reduce_scatter
from zen_ext.core.rs_base import even_ranges
from zen_ext.core.types import SparseGrad

NUMEL, BIG = 8192, 1024  # the large tensor is [0, BIG), the small one [BIG, NUMEL)
BITS = 4
VALUE_BLOCK = BLOCKS[BITS]


def _ranges(kind: str, n: int) -> list[tuple[int, int]]:
    if kind == "even":
        return even_ranges(NUMEL, n)
    cuts = [0] * (n - 1) + [NUMEL]  # rank 0 owns nothing; then a range holding the boundary
    cuts[-2] = 5000 if n > 2 else 0
    bounds = [0, *cuts]
    return [(bounds[r], bounds[r + 1]) for r in range(n)]


def _inputs(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank a random 60 % of the bucket, ascending (as DGC's ``nonzero`` selects): the large tensor's
    values ±[0.5, 1]·1e3, the small one's +[0.5, 1]·1e-2."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        idx = (torch.rand(NUMEL, generator=g) < 0.6).nonzero().flatten()
        mag = 0.5 + 0.5 * torch.rand(idx.numel(), generator=g)
        sign = torch.where(torch.rand(idx.numel(), generator=g) < 0.5, -1.0, 1.0)
        vals = torch.where(idx < BIG, 1e3 * mag * sign, 1e-2 * mag)
        out.append((idx, vals))
    return out


def _run(n, ranges, pull_format, inputs):
    rs = build_reduce_scatter("zen", pull_format=pull_format)

    def fn(comm):
        idx, vals = inputs[comm.rank]
        seen = {}

        def feedback(order_K, deq_K):  # what the owners dequantize of this rank's push
            seen["idx"], seen["deq"] = idx[order_K], deq_K.clone()

        sg = SparseGrad(idx, vals, NUMEL, in_range=True, lowbit=LowBitValues(BITS, sender_feedback=feedback))
        return rs.reduce_scatter(comm, sg, ranges, "sum").clone(), seen

    return rs, SimWorld(n).run(fn)


@pytest.mark.parametrize("n, kind", [(2, "even"), (3, "even"), (3, "uneven")])
@pytest.mark.parametrize("pull_format", ["auto", "coo", "bitmap", "dense"])
def test_reply_blocks_follow_ascending_index_and_keep_the_small_tensor(n, kind, pull_format):
    ranges = _ranges(kind, n)
    inputs = _inputs(n, seed=n)
    rs, got = _run(n, ranges, pull_format, inputs)
    out = torch.cat([got[r][0] for r in range(n)])
    want = torch.zeros(NUMEL)
    for idx, vals in inputs:
        want.index_add_(0, idx, vals)
    small = torch.arange(NUMEL) >= BIG
    nz = want != 0
    # A reply block holds the small tensor's sums apart from the large one's but where a segment (server,
    # owner) or a push segment (rank, server) crosses the boundary: one block each, whose small values lie
    # within a few blocks' span of it (a segment holds about every n-th index, a push segment every n/0.6-th:
    # a push block of 16 spans ~80 indices at n = 3). Past that span none codes 0, and every sum is within
    # its rounding: n pushes (amax / 14 each) and the reply (n times that).
    far = torch.arange(NUMEL) >= BIG + 4 * VALUE_BLOCK * n
    err = (out - want).abs()
    assert int(((out == 0) & nz & far).sum()) == 0
    assert float(err[nz & far].max()) <= 2 * n * 1e-2 / 14
    assert int(((out == 0) & nz & small).sum()) <= 0.05 * int((nz & small).sum())
    assert float(err[~small].max()) <= 2 * n * 1e3 / 14
    assert torch.equal(out[~nz], torch.zeros(int((~nz).sum())))

    # Control: the same sums quantized in each server's position order (how the reply went until today) code
    # nearly every small-tensor sum 0 in the range that holds the boundary, past the span above too.
    part = rs.zen.partitioner(NUMEL, n)
    ends = torch.tensor([e for _, e in ranges])
    lo, hi = next(r for r in ranges if r[0] <= BIG < r[1])
    mixed = nz & far & (torch.arange(NUMEL) < hi)
    coded0 = 0
    for i in range(n):
        x = part.indices_of(i, torch.arange(part.part_size(i)))  # position order
        x = x[nz[x]]
        owner = torch.searchsorted(ends, x, right=True)
        x = x[torch.sort(owner, stable=True)[1]]
        seg = torch.bincount(owner, minlength=n).cumsum(0).tolist()
        _, _, deq = ops.quantize_blocks(want[x], seg, BITS, VALUE_BLOCK)
        coded0 += int(((deq == 0) & mixed[x]).sum())
    assert coded0 >= 0.9 * int(mixed.sum()), (coded0, int(mixed.sum()))


@pytest.mark.parametrize("n", [2, 3])
def test_push_segments_are_in_ascending_index_and_keep_the_small_tensor(n):
    inputs = _inputs(n, seed=10 + n)
    _, got = _run(n, even_ranges(NUMEL, n), "auto", inputs)
    for r in range(n):
        seen = got[r][1]
        small = seen["idx"] >= BIG
        # Only a block straddling the boundary (one per owner's segment) may code small values 0.
        assert int(((seen["deq"] == 0) & small).sum()) <= n * (VALUE_BLOCK - 1)
        assert int(((seen["deq"] == 0) & small).sum()) <= 0.05 * int(small.sum())
        # Each owner's segment ascending: the order_K the feedback names follows the indices inside a segment.
        part = build_reduce_scatter("zen").zen.partitioner(NUMEL, n)
        owner = part.partition_of(seen["idx"])
        for i in range(n):
            seg = seen["idx"][owner == i]
            assert torch.all(seg[1:] > seg[:-1])


@pytest.mark.parametrize("index_order", [False, True])
@pytest.mark.parametrize("numel, n", [(1, 1), (97, 2), (1000, 3), (4099, 5), (50, 7)])
def test_both_ends_of_the_reply_agree_on_s_ir(index_order, numel, n):
    """``_Layout``: what server ``i`` sends owner ``r`` (its positions ``own_order`` in ``r``'s group) and where
    owner ``r`` writes what server ``i`` sends (``lo_r + tgt`` in ``i``'s group) name the same global indices
    in the same order, which is ascending with ``index_order`` (the low-bit reply) and the servers' position
    order without (the lossless reply, as before); uneven ranges with empty ones, index 0 and the last."""
    from zen_ext.core.rs_zen import _Layout

    g = torch.Generator().manual_seed(numel + n)
    cuts = sorted(torch.randint(0, numel + 1, (n - 1,), generator=g).tolist())
    if n > 2:
        cuts[0] = 0  # rank 0 owns nothing
    bounds = [0, *cuts, numel]
    ranges = [(bounds[r], bounds[r + 1]) for r in range(n)]
    part = build_reduce_scatter("zen").zen.partitioner(numel, n)
    lays = [_Layout(part, ranges, r, torch.device("cpu"), index_order) for r in range(n)]
    seen = torch.zeros(numel, dtype=torch.int64)
    for i in range(n):  # server
        for r in range(n):  # owner
            pos = lays[i].own_order[lays[i].own_cuts[r]:lays[i].own_cuts[r + 1]].long()
            sent = part.indices_of(i, pos)
            landed = ranges[r][0] + lays[r].tgt[lays[r].tgt_cuts[i]:lays[r].tgt_cuts[i + 1]].long()
            assert torch.equal(sent, landed)
            assert torch.all((sent >= ranges[r][0]) & (sent < ranges[r][1]))
            key = sent if index_order else pos
            assert torch.all(key[1:] > key[:-1])
            seen[sent] += 1
    assert torch.equal(seen, torch.ones(numel, dtype=torch.int64))  # every index once
