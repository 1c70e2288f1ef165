"""The Python side reads the CUDA ops' outputs correctly, tested on the CPU (docs/gpu.md).

Where a CUDA op's output differs from the CPU op's (``aggregate_push``'s count is ``[count, outside]``,
``hash_partition``'s order inside a partition follows the hash slots), ``zen_ext.ops.emulate_cuda_layout``
makes the CPU ops return the CUDA convention. Every reader of those outputs then runs here as it runs on
a GPU: ``auto``'s compute calibration read the count with ``int()`` and failed on its first CUDA sync,
which no CPU test could see.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_zen_scheme import int_inputs
from zen_ext import SimWorld, SparseGrad, build_scheme, ops
from zen_ext.planner.compute_model import calibrate_compute
from zen_ext.core.hashing import HashPartitioner


def _payload(pos, vals):
    return torch.cat([pos.to(torch.int32).view(torch.uint8), vals.contiguous().view(torch.uint8)])


def test_aggregate_push_count_takes_the_cuda_layout_and_the_accessor_reads_both():
    pos = torch.tensor([3, 0, 9, 3])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    _, _, cpu = ops.aggregate_push([_payload(pos, vals)], 10, 1, torch.float32, 4)
    with ops.emulate_cuda_layout():
        acc, words, cuda = ops.aggregate_push([_payload(pos, vals)], 10, 1, torch.float32, 4)
        ws = ops.aggregate_push([_payload(pos, vals)], 10, 1, torch.float32, 4,
                                workspace=lambda: pytest.fail("CUDA has no aggregate_push_into"))
        assert ws[2].tolist() == [3, 0]
    assert cpu.tolist() == [3] and cuda.tolist() == [3, 0]
    assert ops.read_aggregate_count(cpu) == ops.read_aggregate_count(cuda) == 3
    assert acc.flatten().tolist() == [2.0, 0, 0, 5.0, 0, 0, 0, 0, 0, 3.0]
    with pytest.raises(RuntimeError, match="2 pushed position"):
        ops.read_aggregate_count(torch.tensor([5, 2]))  # the CUDA op skipped two outside positions


def test_hash_partition_cuda_order_keeps_every_partition_s_entries():
    numel, n = 5003, 7
    idx = torch.randint(0, numel, (900,), generator=torch.Generator().manual_seed(1))
    keys = ops.derive_keys(3)
    counts, order, pos, _ = ops.hash_partition(idx, numel, n, keys)
    with ops.emulate_cuda_layout():
        c2, o2, p2, _ = ops.hash_partition(idx, numel, n, keys)
    assert torch.equal(counts, c2)
    assert not torch.equal(order, o2)  # the emulation does change the order ...
    bounds = [0] + counts.cumsum(0).tolist()
    for j in range(n):  # ... but not which (entry, position) pairs a partition holds
        a = sorted(zip(order[bounds[j]:bounds[j + 1]].tolist(), pos[bounds[j]:bounds[j + 1]].tolist()))
        b = sorted(zip(o2[bounds[j]:bounds[j + 1]].tolist(), p2[bounds[j]:bounds[j + 1]].tolist()))
        assert a == b


def test_compute_calibration_reads_the_cuda_count_layout():
    with ops.emulate_cuda_layout():
        rates = calibrate_compute("cpu", elems=1 << 14, entries=1 << 10, reps=1)
    assert all(r > 0 for r in rates.as_list())


@pytest.mark.parametrize("scheme", ["zen", "zen_coo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_zen_exact_with_the_cuda_layout(scheme, dtype, width, n):
    inputs = int_inputs(n, numel=2053, nnz=150, seed=7 * n + width, width=width, dtype=dtype)
    inputs[min(1, n - 1)] = SparseGrad(torch.empty(0, dtype=torch.int64), torch.empty(
        (0,) if width == 1 else (0, width), dtype=dtype), 2053)  # an empty rank
    want = sum(x.to_dense().float() for x in inputs).to(dtype)
    with ops.emulate_cuda_layout():
        got = SimWorld(n).run(lambda c, x: build_scheme(scheme).sync(c, x), inputs)
    for g in got:
        assert g.dtype == dtype and torch.equal(g, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 4])
def test_auto_calibrates_and_stays_exact_with_the_cuda_layout(dtype, n):
    inputs = int_inputs(n, numel=40_009, nnz=300, seed=n, dtype=dtype)
    want = sum(x.to_dense().float() for x in inputs).to(dtype)
    autos = [build_scheme("auto", profile_steps=1) for _ in range(n)]
    with ops.emulate_cuda_layout():
        for _ in range(3):  # calibration + profiling, then the choice
            got = SimWorld(n).run(lambda c, x: autos[c.rank].sync(c, x, key="g"), inputs)
            for g in got:
                assert torch.equal(g, want)
    assert len({a.last_choice("g") for a in autos}) == 1


def test_partitioner_reads_hash_partition_in_any_order():
    part = HashPartitioner(1000, 4, 0)
    idx = torch.tensor([0, 999, 5, 5, 17])
    counts, order, pos, _ = part.partition(idx)
    with ops.emulate_cuda_layout():
        c2, o2, p2, _ = part.partition(idx)
    assert torch.equal(counts, c2) and sorted(order.tolist()) == sorted(o2.tolist())
