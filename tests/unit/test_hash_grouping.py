"""The partitioner's GPU grouping (h0, then a stable radix sort of partition ids; docs/kernels.md: hashing in
≤ 1 ms at the paper's scale) run on the CPU: the same counts, order and positions as the C++
``hash_partition`` op, for any number of partitions and adversarial index sets, and zen stays exact."""

from __future__ import annotations

import pytest
import torch

import zen_ext.core.hashing as hashing
from tests.unit.test_zen_scheme import int_inputs
from zen_ext import SimWorld, build_scheme
from zen_ext.core.hashing import HashPartitioner


@pytest.mark.parametrize("n", [1, 2, 3, 16, 255, 256, 300])
@pytest.mark.parametrize("case", ["random", "duplicates", "empty", "ends", "all"])
def test_sort_grouping_equals_the_op(n, case):
    numel = 5003
    g = torch.Generator().manual_seed(n)
    idx = {"random": torch.randint(0, numel, (700,), generator=g),
           "duplicates": torch.tensor([7, 7, 7, 0, 0, numel - 1] * 5),
           "empty": torch.empty(0, dtype=torch.int64),
           "ends": torch.tensor([0, numel - 1]),
           "all": torch.randperm(numel, generator=g)}[case]
    part = HashPartitioner(numel, n, seed=11)
    want = part.partition(idx)  # the CPU op: a stable counting sort
    got = part._by_sort(idx)
    for w, x, what in zip(want[:3], got[:3], ("counts", "order", "positions")):
        assert x.dtype == torch.int64 and torch.equal(x, w), what
    assert int(got[0].sum()) == idx.numel()


def test_zen_with_the_sort_grouping_equals_dense(monkeypatch):
    monkeypatch.setattr(hashing, "GROUPING_BY_SORT_DEVICES", ("cpu",))
    inputs = int_inputs(5, numel=20011, nnz=900, seed=4, width=3)
    want = sum(x.to_dense() for x in inputs).reshape(-1)
    for out in SimWorld(5).run(lambda c, x: build_scheme("zen").sync(c, x), inputs):
        assert torch.equal(out, want)
