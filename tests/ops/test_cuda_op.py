"""The CUDA hashing op (Algorithm 1, ``csrc/cuda/hash_kernel.cu``) against the CPU op, on a GPU.

``permute`` must be bit-identical to the CPU op. ``hash_partition`` must give exactly the CPU op's
counts and, inside each partition, the same entries (the order inside a partition follows the hash
slots on the GPU, a stable sort on the CPU), with ``pos = P(idx) // n``. Forced serial-memory overflow
(tiny ``serial_factor``, ``parallel_factor`` < 1) must stay lossless and be reported in ``stats``.

Run on a CUDA machine after ``pip install --no-build-isolation -e .`` with a CUDA torch (docs/kernels.md).
"""

from __future__ import annotations

import pytest
import torch

from zen_ext import ops
from zen_ext.core.hashing import HashConfig, HashPartitioner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="zen_ext._C is not built"),
]

SEED = 77
KEYS = ops.derive_keys(SEED)


def _cuda_has_op() -> bool:
    try:
        torch.ops.zen_ext.permute(torch.zeros(1, dtype=torch.int64, device="cuda"), 2, KEYS.cuda(), False)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.fixture(scope="module", autouse=True)
def _require_cuda_kernels():
    if not _cuda_has_op():
        pytest.fail("zen_ext._C has no CUDA kernels: rebuild with a CUDA torch (pip install --no-build-isolation -e .)")


def _indices(numel: int, K: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, numel, (K,), generator=gen)
    edges = torch.tensor([0, numel - 1, 0, numel - 1], dtype=torch.int64)[:K]
    idx[: edges.numel()] = edges
    if K > 8:
        idx[4:8] = idx[8]  # duplicates stay distinct entries
    return idx


def _pairs_per_partition(counts, order, pos):
    out, start = [], 0
    for c in counts.tolist():
        out.append(sorted(zip(order[start:start + c].tolist(), pos[start:start + c].tolist())))
        start += c
    return out


def _assert_same_grouping(idx, numel, n, **alg1):
    cpu = torch.ops.zen_ext.hash_partition(idx, numel, n, KEYS, 3, 2.0, 0.1)
    args = (alg1.get("num_rehash", 3), alg1.get("parallel_factor", 2.0), alg1.get("serial_factor", 0.1))
    gpu = torch.ops.zen_ext.hash_partition(idx.cuda(), numel, n, KEYS.cuda(), *args)
    for t in gpu:
        assert t.is_cuda and t.dtype == torch.int64
    counts, order, pos, stats = (t.cpu() for t in gpu)
    assert torch.equal(counts, cpu[0])
    assert torch.equal(torch.sort(order).values, torch.arange(idx.numel())), "every entry exactly once"
    assert _pairs_per_partition(counts, order, pos) == _pairs_per_partition(*cpu[:3])
    collisions, serial, overflows = stats.tolist()
    assert collisions >= args[0] * serial and 0 <= overflows <= serial <= idx.numel()
    return stats


@pytest.mark.parametrize("numel", [1, 2, 3, 5, 17, 1000, 4097])
def test_permute_bijection_matches_cpu(numel):
    every = torch.arange(numel)
    y = torch.ops.zen_ext.permute(every.cuda(), numel, KEYS.cuda(), False)
    assert torch.equal(y.cpu(), torch.ops.zen_ext.permute(every, numel, KEYS, False))
    assert torch.equal(torch.ops.zen_ext.permute(y, numel, KEYS.cuda(), True).cpu(), every)


@pytest.mark.parametrize("numel", [2**31 - 1, 2**31 + 5, 2**40 + 7, 2**62])
def test_permute_large_numel_matches_cpu(numel):
    idx = torch.tensor([0, 1, numel // 3, numel - 2, numel - 1], dtype=torch.int64)
    y = torch.ops.zen_ext.permute(idx.cuda(), numel, KEYS, False)  # keys may stay on the CPU
    assert torch.equal(y.cpu(), torch.ops.zen_ext.permute(idx, numel, KEYS, False))
    assert torch.equal(torch.ops.zen_ext.permute(y, numel, KEYS, True).cpu(), idx)


@pytest.mark.parametrize(
    "numel,n,K",
    [(1, 1, 5), (2, 4, 9), (10, 3, 25), (1000, 7, 1000), (4097, 16, 5000), (100, 200, 50), (2**31 + 5, 5, 1000),
     (2**40 + 7, 128, 3000), (2**24, 16, 1_000_000), (2**26, 3, 2_000_000)],
)
def test_hash_partition_matches_cpu(numel, n, K):
    stats = _assert_same_grouping(_indices(numel, K, K + n), numel, n)
    if K >= 100_000:  # paper defaults at load factor 0.5: a few percent serial writes, no overflow
        assert 0 < stats[1] < 0.1 * K and stats[2] == 0


def test_empty_input():
    counts, order, pos, stats = torch.ops.zen_ext.hash_partition(
        torch.empty(0, dtype=torch.int64, device="cuda"), 100, 7, KEYS.cuda())
    assert torch.equal(counts.cpu(), torch.zeros(7, dtype=torch.int64))
    assert order.numel() == pos.numel() == 0 and order.is_cuda
    assert torch.equal(stats.cpu(), torch.zeros(3, dtype=torch.int64))
    assert torch.ops.zen_ext.permute(torch.empty(0, dtype=torch.int64, device="cuda"), 9, KEYS, False).numel() == 0


@pytest.mark.parametrize(
    "num_rehash,parallel_factor,serial_factor",
    [(1, 0.25, 0.0), (1, 0.5, 1e-6), (2, 0.5, 0.05), (0, 2.0, 0.0), (0, 1.0, 0.5), (4, 0.75, 0.01)],
)
def test_forced_serial_overflow_is_lossless_and_reported(num_rehash, parallel_factor, serial_factor):
    K = 200_000
    stats = _assert_same_grouping(_indices(2**30, K, 5), 2**30, 16, num_rehash=num_rehash,
                                  parallel_factor=parallel_factor, serial_factor=serial_factor)
    collisions, serial, overflows = stats.tolist()
    assert overflows > 0, stats
    if num_rehash == 0:
        assert serial == K and collisions == 0
    if serial_factor == 0.0:
        assert overflows == serial


def test_generous_memory_has_no_serial_writes_at_all():
    # 64 slots per non-zero and k = 4: a serial write would need 4 collisions at load factor 1/64.
    # Distinct indices: m copies of one index share one probe sequence, so m > k copies must go serial.
    idx = torch.randperm(2**20, generator=torch.Generator().manual_seed(9))[:5000]
    stats = _assert_same_grouping(idx, 2**20, 4, num_rehash=4, parallel_factor=64.0)
    assert stats[1] <= 1


def test_runs_on_a_side_stream_and_through_the_partitioner():
    idx = _indices(2**22, 300_000, 11)
    part = HashPartitioner(2**22, 12, SEED, HashConfig(num_rehash=2, parallel_factor=1.0, serial_factor=0.05))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        counts, order, pos, _ = part.partition(idx.cuda())
    stream.synchronize()
    cpu = part.partition(idx)
    assert torch.equal(counts.cpu(), cpu[0])
    assert _pairs_per_partition(counts.cpu(), order.cpu(), pos.cpu()) == _pairs_per_partition(*cpu[:3])
    grouped = torch.repeat_interleave(torch.arange(12, device="cuda"), counts)
    assert torch.equal(part.indices_of(grouped, pos).cpu(), idx[order.cpu()])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_guard_second_gpu():
    idx = _indices(2**20, 50_000, 3)
    counts, order, pos, _ = torch.ops.zen_ext.hash_partition(idx.to("cuda:1"), 2**20, 8, KEYS.to("cuda:0"))
    assert counts.device == torch.device("cuda:1")
    cpu = torch.ops.zen_ext.hash_partition(idx, 2**20, 8, KEYS)
    assert torch.equal(counts.cpu(), cpu[0])
    assert _pairs_per_partition(counts.cpu(), order.cpu(), pos.cpu()) == _pairs_per_partition(*cpu[:3])


@pytest.mark.parametrize("bad", [[-1], [10], [3, 10, 4]])
def test_out_of_range_indices_raise(bad):
    idx = torch.tensor(bad, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=r"must lie in \[0, 10\)"):
        torch.ops.zen_ext.permute(idx, 10, KEYS, False)
    with pytest.raises(RuntimeError, match=r"must lie in \[0, 10\)"):
        torch.ops.zen_ext.hash_partition(idx, 10, 3, KEYS)


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 3, 2.0, 0.1), "num_parts must be >= 1, got 0"),
        ((4, -1, 2.0, 0.1), "num_rehash must be >= 0, got -1"),
        ((4, 3, 0.0, 0.1), "parallel_factor must be > 0, got 0"),
        ((4, 3, float("nan"), 0.1), "parallel_factor must be > 0, got nan"),
        ((4, 3, 2.0, -0.5), "serial_factor must be >= 0, got -0.5"),
    ],
)
def test_bad_arguments_raise_with_values(args, message):
    idx = torch.tensor([1, 2], dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match=message):
        torch.ops.zen_ext.hash_partition(idx, 10, args[0], KEYS, *args[1:])


def test_bad_tensors_raise():
    idx = torch.tensor([1, 2], device="cuda")
    with pytest.raises(RuntimeError, match="idx must be int64, got Int"):
        torch.ops.zen_ext.hash_partition(idx.int(), 10, 3, KEYS)
    with pytest.raises(RuntimeError, match="idx must be 1-D, got 2-D"):
        torch.ops.zen_ext.permute(idx.view(1, 2), 10, KEYS, False)
    with pytest.raises(RuntimeError, match="keys must be an int64 tensor of 4 round keys"):
        torch.ops.zen_ext.permute(idx, 10, KEYS[:3], False)
