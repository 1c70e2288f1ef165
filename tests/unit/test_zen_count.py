"""op="contributors" (core/zen_count.py): ZEN's owners count the senders of each index and divide there.
The result equals the dense sum of the inputs divided per index by the number of ranks that sent it,
exactly on integer values, bitwise the same on every rank, in the bytes of op="sum"; schemes that do
not count refuse the op; with low-bit values every rank applies the same quantized averages."""

from __future__ import annotations

import pytest
import torch

from zen_ext.comm.simulated import SimWorld
from zen_ext.core.lowbit import LowBitValues
from zen_ext.core.registry import build_scheme
from zen_ext.core.types import SparseGrad

N = 97  # not a multiple of any world size: uneven partitions


def _case(kind: str, n: int, rank: int, width: int = 0):
    """``(indices, values)`` of ``rank`` for an adversarial pattern (integer values, some of them 0)."""
    g = torch.Generator().manual_seed(31 * rank + len(kind))
    if kind == "empty_rank":  # rank 0 (and every even rank) sends nothing
        idx = torch.empty(0, dtype=torch.int64) if rank % 2 == 0 else torch.randperm(N, generator=g)[:20]
    elif kind == "all_empty":
        idx = torch.empty(0, dtype=torch.int64)
    elif kind == "full_overlap":  # every rank the same indices, 0 and the last among them
        idx = torch.tensor([0, N - 1, 5, 50, 51, 52])
    elif kind == "no_overlap":  # disjoint strides
        idx = torch.arange(rank, N, n)
    elif kind == "edges":  # index 0 and the last from some ranks, random others
        idx = torch.cat([torch.tensor([0, N - 1][: rank % 3], dtype=torch.int64), torch.randint(1, N - 1, (7,), generator=g).unique()])
    elif kind == "dense":  # every index from every rank: ZEN's push would go dense; counting keeps COO
        idx = torch.randperm(N, generator=g)
    elif kind == "duplicates":  # a rank sends an index twice: summed, counted once
        idx = torch.tensor([3, 3, 9, N - 1, 0, 0])
    else:
        raise AssertionError(kind)
    shape = (idx.numel(),) + ((width,) if width else ())
    vals = torch.randint(-6, 7, shape, generator=g).float()
    return idx, vals


def _reference(cases, numel: int, width: int = 0):
    """Dense sum of every rank's input, divided per index by its distinct senders."""
    total = torch.zeros((numel,) + ((width,) if width else ()))
    count = torch.zeros(numel)
    for idx, vals in cases:
        total.index_add_(0, idx, vals)
        count[idx.unique()] += 1
    div = count.clamp(min=1)
    return (total / (div.view(-1, 1) if width else div)).reshape(-1)


KINDS = ["empty_rank", "all_empty", "full_overlap", "no_overlap", "edges", "dense", "duplicates"]


@pytest.mark.parametrize("scheme", ["zen", "zen_coo"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_contributors_equal_dense_sum_over_senders(scheme, n, kind):
    cases = [_case(kind, n, r) for r in range(n)]
    sch = build_scheme(scheme)
    res = SimWorld(n).run(lambda c: sch.sync_group(
        c, [SparseGrad(*cases[c.rank], N)], "contributors")[0])
    ref = _reference(cases, N)
    for r in res:
        assert torch.equal(r, ref)  # exact, and so bitwise the same on every rank


@pytest.mark.parametrize("pull_format", ["dense", "bitmap", "coo"])
@pytest.mark.parametrize("n", [3, 4])
def test_contributors_every_pull_format_and_row_form(pull_format, n):
    cases = [_case("edges", n, r, width=3) for r in range(n)]
    sch = build_scheme("zen", pull_format=pull_format)
    res = SimWorld(n).run(lambda c: sch.sync(c, SparseGrad(*cases[c.rank], N), "contributors"))
    ref = _reference(cases, N, width=3)
    assert all(torch.equal(r, ref) for r in res)


def test_contributors_cost_the_bytes_of_a_sum():
    """The same picks: "contributors" sends what "sum" sends (one value per pick), "(value, 1)" rows more."""
    n = 4
    cases = [(torch.randperm(4000, generator=torch.Generator().manual_seed(r))[:150],
              torch.randint(-6, 7, (150,), generator=torch.Generator().manual_seed(r)).float()) for r in range(n)]
    sch = build_scheme("zen")

    def sent(op, rows=False):
        world = SimWorld(n)
        world.run(lambda c: sch.sync(c, SparseGrad(cases[c.rank][0], torch.stack(
            [cases[c.rank][1], torch.ones(150)], 1) if rows else cases[c.rank][1], 4000), op))
        return sum(s.bytes_sent for s in world.stats)
    assert sent("contributors") == sent("sum") < sent("sum", rows=True)


@pytest.mark.parametrize("scheme", ["agsparse", "sparcml", "dense", "auto"])
def test_schemes_that_do_not_count_refuse(scheme):
    sch = build_scheme(scheme)
    with pytest.raises(RuntimeError, match=r"op \('contributors'\) must go with a scheme that counts the senders "
                                            r"of each index \(zen, zen_coo\), not scheme"):
        SimWorld(2).run(lambda c: sch.sync(c, SparseGrad(torch.tensor([1]), torch.ones(1), 8), "contributors"))


def test_dense_input_refused():
    sch = build_scheme("zen")
    with pytest.raises(RuntimeError, match=r"op \('contributors'\) must be given a SparseGrad"):
        SimWorld(2).run(lambda c: sch.sync(c, torch.ones(8), "contributors"))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [3, 4])
def test_low_bit_contributors_same_on_every_rank_and_near_the_average(bits, n):
    """Quantized push and pull: every rank applies the same values; each is within the two roundings
    (sender block, owner block) of the exact average; the sender learns what its owners saw."""
    numel = 3000
    cases = [(torch.randperm(numel, generator=torch.Generator().manual_seed(r))[:400],
              torch.randn(400, generator=torch.Generator().manual_seed(50 + r))) for r in range(n)]
    sch = build_scheme("zen")

    def body(c):
        seen = torch.zeros(400)

        def feedback(order, deq):
            seen[order] = deq
        lb = LowBitValues(bits=bits, sender_feedback=feedback)
        out = sch.sync(c, SparseGrad(*cases[c.rank], numel, lowbit=lb), "contributors")
        return out, seen
    res = SimWorld(n).run(body)
    ref = _reference(cases, numel)
    for out, seen in res:
        assert torch.equal(out, res[0][0])
    step = max(v.abs().max() for _, v in cases) / (127 if bits == 8 else 7)
    assert (res[0][0] - ref).abs().max() <= step  # two half-steps at most
    assert not res[0][0][ref.eq(0)].any()  # nothing where no rank sent (a small average may round to 0)
    for (idx, vals), (_, seen) in zip(cases, res):
        assert 0 < (seen - vals).abs().max() <= step / 2 + 1e-6  # quantized, within half a step


def test_low_bit_contributors_refuse_an_owner_residual():
    sch = build_scheme("zen")
    lb = LowBitValues(bits=8, owner_residual=lambda m, d: torch.zeros(m, device=d))
    with pytest.raises(RuntimeError, match="op 'contributors' with low-bit values takes no owner residual"):
        SimWorld(2).run(lambda c: sch.sync(c, SparseGrad(torch.tensor([1]), torch.ones(1), 8, lowbit=lb),
                                           "contributors"))
