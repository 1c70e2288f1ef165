"""Host synchronizations per sparse reduce-scatter call are bounded and independent of the ranks (the
``tests/unit/test_zen_host_syncs.py`` counter, at n = 4 and n = 16, after a warm-up call that builds
the layout's tables)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_zen_host_syncs import SyncCounter
from tests.unit.test_zen_scheme import int_inputs
from zen_ext import SimWorld
from zen_ext.core.reduce_scatter import build_reduce_scatter, even_ranges

MAX_SYNCS = {"zen": 4, "direct": 2}
"""zen: the index check, the push counts, the per-owner aggregated counts, the pulled headers; direct: the
index check, the per-owner counts."""


def _count(name, n, op, width=1, dtype=torch.float32, **options):
    numel = 50_003
    inputs = int_inputs(n, numel=numel, nnz=400, seed=n, width=width, dtype=dtype)
    ranges = even_ranges(numel * width, n)
    rs = build_reduce_scatter(name, **options)

    def fn(comm, x):
        rs.reduce_scatter(comm, x, ranges, op=op)  # warm-up: the layout's tables, keys per device
        with SyncCounter() as c:
            rs.reduce_scatter(comm, x, ranges, op=op)
        return c.calls

    return SimWorld(n).run(fn, inputs)


@pytest.mark.parametrize("name, options", [("zen", {}), ("zen", {"pull_format": "bitmap"}),
                                           ("zen", {"pull_format": "coo"}), ("direct", {})])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_host_syncs_bounded_and_independent_of_n(name, options, op):
    per_n = {}
    for n in (4, 16):
        got = _count(name, n, op, **options)
        assert max(len(c) for c in got) <= MAX_SYNCS[name], got[0]
        per_n[n] = max(len(c) for c in got)
    assert per_n[4] == per_n[16], per_n


def test_row_form_half_precision_bounded():
    got = _count("zen", 16, "mean", width=3, dtype=torch.bfloat16)
    assert max(len(c) for c in got) <= MAX_SYNCS["zen"], got[0]


def test_a_group_reads_the_host_a_fixed_number_of_times():
    """Three gradients in one call: the packed exchanges add one size-table read each, whatever n."""
    per_n = {}
    for n in (4, 16):
        inputs = [int_inputs(n, numel=20_011, nnz=150, seed=n + g) for g in range(3)]
        ranges = [even_ranges(20_011, n)] * 3
        rs = build_reduce_scatter("zen")

        def fn(comm):
            grads = [inp[comm.rank] for inp in inputs]
            rs.reduce_scatter_group(comm, grads, ranges, op="sum")
            with SyncCounter() as c:
                rs.reduce_scatter_group(comm, grads, ranges, op="sum")
            return c.calls

        per_n[n] = max(len(c) for c in SimWorld(n).run(fn))
    # three index checks, push counts, push sizes, owner counts, pull sizes, pulled headers
    assert per_n[4] == per_n[16] <= 8, per_n
