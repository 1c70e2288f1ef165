"""``zen_ext::dgc_gather_kept`` (CPU op) against plain torch (``nonzero`` and ``index_select``): the kept
candidates in order, zeros after them, and the three read-back values; every candidate kept, none, the
first and the last only, no candidates at all, the finiteness flag true, false and absent, every value
dtype, a count that exceeds the buffer (capacity overflow is the caller's to see), and bad input."""

from __future__ import annotations

import pytest
import torch

from zen_ext import ops

pytestmark = pytest.mark.skipif(not ops.has_dgc_gather_kept_op(torch.zeros(1)), reason="needs the zen_ext C++ op")


def _check(keep, pos, v, ok, count):
    pos_K, v_K, stats = ops.dgc_gather_kept(keep, pos, v, ok, count)
    idx = keep.nonzero().flatten()
    n = idx.numel()
    assert stats.dtype == torch.int64 and stats.tolist() == [1 if ok is None else int(ok.item()), int(count[0]), n]
    assert pos_K.shape == pos.shape and v_K.shape == v.shape and v_K.dtype == v.dtype
    assert torch.equal(pos_K[:n], pos.index_select(0, idx))
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[v.element_size()]
    assert torch.equal(v_K[:n].view(bits), v.index_select(0, idx).view(bits))  # bitwise: -0.0 and NaN too
    assert not pos_K[n:].any() and not v_K[n:].any()
    return pos_K, v_K, stats


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("C", [0, 1, 31, 2048, 2049, 100_003])
@pytest.mark.parametrize("pattern", ["random", "all", "none", "ends"])
def test_gather_kept_equals_nonzero_and_index_select(dtype, C, pattern):
    gen = torch.Generator().manual_seed(C + len(pattern))
    pos = torch.randint(0, 1 << 40, (C,), generator=gen).sort().values
    v = torch.randn(C, generator=gen).to(dtype)
    if pattern == "random":
        keep = torch.rand(C, generator=gen) < 0.3
    elif pattern == "all":
        keep = torch.ones(C, dtype=torch.bool)
    elif pattern == "none":
        keep = torch.zeros(C, dtype=torch.bool)
    else:  # only index 0 and the last
        keep = torch.zeros(C, dtype=torch.bool)
        keep[:1] = True
        keep[-1:] = True
    _check(keep, pos, v, torch.tensor([True]), torch.tensor([C + 5]))


@pytest.mark.parametrize("ok", [None, True, False])
def test_gather_kept_reports_the_flag_and_the_count_as_given(ok):
    """The flag and the candidates' count pass through (an overflowing count too: the caller compares
    it with the capacity); the kept entries are compacted whatever the flag."""
    keep = torch.tensor([False, True, True, False, True])
    flag = None if ok is None else torch.tensor([ok])
    _, _, stats = _check(keep, torch.arange(5) * 3, torch.tensor([1.0, -0.0, float("nan"), 4.0, -5.0]), flag,
                         torch.tensor([10**12]))
    assert stats[0].item() == (0 if ok is False else 1) and stats[1].item() == 10**12


def test_gather_kept_reads_the_count_from_a_view():
    """``dgc_accumulate_select_``'s count on CUDA is a one-element view of its tiles' scan."""
    scan = torch.tensor([3, 9, 14])
    _, _, stats = _check(torch.ones(2, dtype=torch.bool), torch.tensor([4, 8]), torch.ones(2), None, scan.narrow(0, 2, 1))
    assert stats.tolist() == [1, 14, 2]


def test_gather_kept_rejects_bad_input():
    keep, pos, v, count = torch.ones(4, dtype=torch.bool), torch.arange(4), torch.ones(4), torch.tensor([4])
    with pytest.raises(RuntimeError, match="keep_C must be 1-D bool"):
        ops.dgc_gather_kept(keep.int(), pos, v, None, count)
    with pytest.raises(RuntimeError, match="as long as keep_C"):
        ops.dgc_gather_kept(keep, pos[:3], v, None, count)
    with pytest.raises(RuntimeError, match="as long as keep_C"):
        ops.dgc_gather_kept(keep, pos.int(), v, None, count)
    with pytest.raises(RuntimeError, match="count_C"):
        ops.dgc_gather_kept(keep, pos, v, None, count.int())
    with pytest.raises(RuntimeError, match="ok must be one bool"):
        ops.dgc_gather_kept(keep, pos, v, torch.tensor([1, 1]), count)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ok", [None, True, False])
def test_reference_equals_the_op(monkeypatch, dtype, ok):
    """The torch reference that ``ops.dgc_gather_kept`` runs on a device without the kernel (and
    ``dgc_all_finite``'s) gives the op's results, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    keep = torch.rand(2049, generator=gen) < 0.3
    keep[0] = keep[-1] = True
    pos = torch.randint(0, 1 << 40, (2049,), generator=gen).sort().values
    v = torch.randn(2049, generator=gen).to(dtype)
    v[5] = -0.0
    flag = None if ok is None else torch.tensor([ok])
    grads = [torch.randn(7, generator=gen).to(dtype), torch.empty(0, dtype=dtype), torch.randn(3).to(dtype)]
    want = ops.dgc_gather_kept(keep, pos, v, flag, torch.tensor([4000])), [ops.dgc_all_finite(grads)]
    grads_bad = [g.clone() for g in grads]
    grads_bad[2][-1] = float("nan")
    want[1].append(ops.dgc_all_finite(grads_bad))
    monkeypatch.setattr(ops, "HAVE_CPP_OP", False)
    got = ops.dgc_gather_kept(keep, pos, v, flag, torch.tensor([4000])), [ops.dgc_all_finite(grads),
                                                                          ops.dgc_all_finite(grads_bad)]
    for a, b in zip(got[0], want[0]):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                  b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    assert [t.item() for t in got[1]] == [t.item() for t in want[1]] == [True, False]
    assert all(t.shape == () and t.dtype == torch.bool for t in got[1])
