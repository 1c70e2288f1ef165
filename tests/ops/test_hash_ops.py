"""The C++ hashing ops (``csrc/cpu``) against the pure-torch reference, and the load balance of h0.

Op tests: ``zen_ext::permute`` and ``zen_ext::hash_partition`` must be bit-identical to
``zen_ext/ops/_reference.py`` on every input, including K = 0, duplicates, index 0, the last index,
numel above 2^31, and must raise on out-of-range indices. Skipped where the C++ op is not built.

Load balance (paper Def. 8, ZEN §3.1): on Zipf-skewed embedding gradients (research/seeds.md §6) with
>= 1e5 non-zeros per rank, Push = max over ranks i and partitions j of ``n·|I_i^j| / |I_i|`` and Pull =
max over j of ``n·|𝕀_j ∩ ∪I| / |∪I|`` stay <= 1.1 at n = 16 and 128, where contiguous partitioning
(Sparse PS, OmniReduce) gives >= 3.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zen_ext import ops
from zen_ext.core.hashing import HashPartitioner, contiguous_partition_of, imbalance
from zen_ext.ops import _reference

SEED = 20250704
KEYS = ops.derive_keys(SEED)
needs_op = pytest.mark.skipif(not ops.HAVE_CPP_OP, reason="zen_ext._C is not built (pip install -e . builds it)")


def _op_permute(idx, numel, keys, inverse=False):
    return torch.ops.zen_ext.permute(idx, numel, keys, inverse)


def _op_partition(idx, numel, n, keys):
    return torch.ops.zen_ext.hash_partition(idx, numel, n, keys, 3, 2.0, 0.1)


def _edge_indices(numel: int, K: int, seed: int) -> torch.Tensor:
    """K indices in [0, numel) with index 0, the last index and a run of duplicates when K allows."""
    gen = torch.Generator().manual_seed(seed)
    if numel < 2**62:
        idx = torch.randint(0, numel, (K,), generator=gen)
    else:  # torch.randint's bound is an int64: build large draws from two halves
        idx = (torch.randint(0, 2**31, (K,), generator=gen) << 31 | torch.randint(0, 2**31, (K,), generator=gen))
        idx %= numel
    edges = torch.tensor([0, numel - 1, 0, numel - 1], dtype=torch.int64)[:K]
    idx[: edges.numel()] = edges
    if K > 8:
        idx[4:8] = idx[8]
    return idx


# ---------------------------------------------------------------------------------------------------
# permute
# ---------------------------------------------------------------------------------------------------

# Up to 2^62: above it the reference's int64 arithmetic overflows (the C++ op works in uint64); see
# docs/kernels.md "Known limits".
# 2^32: the largest domain of the CPU op's 32-bit vectorized path; 2^32 + 1: the first of the 64-bit one.
LARGE_NUMELS = [2, 3, 5, 17, 1000, 4097, 2**24 + 1, 2**31 - 1, 2**31, 2**31 + 5, 2**32, 2**32 + 1, 2**40 + 7, 2**62]


@needs_op
@pytest.mark.parametrize("numel", LARGE_NUMELS)
def test_permute_matches_reference_and_inverts(numel):
    idx = _edge_indices(numel, 500, numel % 1000)
    y = _op_permute(idx, numel, KEYS)
    assert torch.equal(y, _reference.permute(idx, numel, KEYS))
    assert bool(((y >= 0) & (y < numel)).all())
    assert torch.equal(_op_permute(y, numel, KEYS, True), idx)
    assert torch.equal(_reference.permute(y, numel, KEYS, inverse=True), idx)


@needs_op
@pytest.mark.parametrize("numel", [1, 2, 3, 5, 17, 1000, 4097])
def test_permute_is_a_bijection_on_small_domains(numel):
    every = torch.arange(numel)
    y = _op_permute(every, numel, KEYS)
    assert torch.equal(y, _reference.permute(every, numel, KEYS))
    assert torch.equal(torch.sort(y).values, every)
    assert torch.equal(_op_permute(y, numel, KEYS, True), every)
    if numel > 16:  # a permutation that keeps most points in place would not balance anything
        assert int((y == every).sum()) < numel // 4


@needs_op
def test_permute_keys_matter():
    idx = torch.arange(1000)
    assert not torch.equal(_op_permute(idx, 1000, KEYS), _op_permute(idx, 1000, ops.derive_keys(1)))


@needs_op
def test_permute_empty_and_non_contiguous():
    empty = torch.empty(0, dtype=torch.int64)
    assert _op_permute(empty, 100, KEYS).numel() == 0
    strided = torch.arange(0, 200, dtype=torch.int64)[::3]
    assert torch.equal(_op_permute(strided, 200, KEYS), _reference.permute(strided.contiguous(), 200, KEYS))


# ---------------------------------------------------------------------------------------------------
# hash_partition
# ---------------------------------------------------------------------------------------------------


def _check_grouping(idx, numel, n, counts, order, pos):
    """Lossless grouping: every input once, grouped by partition, pos = P(idx) // n, P⁻¹ recovers idx."""
    K = idx.numel()
    assert int(counts.sum()) == K and counts.numel() == n
    assert torch.equal(torch.sort(order).values, torch.arange(K))
    part = HashPartitioner(numel, n, SEED)
    grouped = torch.repeat_interleave(torch.arange(n), counts)
    assert torch.equal(part.partition_of(idx[order]), grouped)
    assert torch.equal(pos, _reference.permute(idx[order], numel, KEYS) // n)
    assert torch.equal(part.indices_of(grouped, pos), idx[order])


PARTITION_CASES = [
    # (numel, n, K)
    (1, 1, 0),
    (10, 3, 0),
    (1, 1, 5),
    (2, 4, 9),
    (10, 3, 1),
    (10, 3, 25),
    (1000, 7, 1000),
    (4097, 16, 5000),
    (100, 200, 50),
    (2**24 + 1, 6, 40000),  # several 512-index runs and parallel_for grains
    (2**31 + 5, 5, 1000),
    (2**32, 6, 2000),  # the last domain of the 32-bit path (positions and parts by 32-bit division)
    (2**32 + 1, 3, 2000),
    (2**40 + 7, 128, 3000),
]


@needs_op
@pytest.mark.parametrize("numel,n,K", PARTITION_CASES)
def test_hash_partition_matches_reference(numel, n, K):
    idx = _edge_indices(numel, K, K + n)
    got = _op_partition(idx, numel, n, KEYS)
    want = _reference.hash_partition(idx, numel, n, KEYS)
    for name, a, b in zip(("counts", "order", "pos", "stats"), got, want):
        assert a.dtype == torch.int64, name
        assert torch.equal(a, b), name
    assert torch.equal(got[3], torch.zeros(3, dtype=torch.int64))
    _check_grouping(idx, numel, n, *got[:3])


@needs_op
def test_hash_partition_ignores_algorithm1_parameters_on_cpu():
    idx = _edge_indices(5000, 3000, 3)
    base = _op_partition(idx, 5000, 6, KEYS)
    other = torch.ops.zen_ext.hash_partition(idx, 5000, 6, KEYS, 1, 0.25, 0.0)
    for a, b in zip(base, other):
        assert torch.equal(a, b)


@needs_op
@pytest.mark.parametrize("bad", [[-1], [10], [3, 10, 4], [0, -5]])
def test_out_of_range_indices_raise(bad):
    idx = torch.tensor(bad, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"must lie in \[0, 10\)"):
        _op_permute(idx, 10, KEYS)
    with pytest.raises(RuntimeError, match=r"must lie in \[0, 10\)"):
        _op_partition(idx, 10, 3, KEYS)
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        _reference.permute(idx, 10, KEYS)
    with pytest.raises(ValueError, match=r"must lie in \[0, 10\)"):
        _reference.hash_partition(idx, 10, 3, KEYS)


@needs_op
def test_bad_arguments_raise_with_values():
    idx = torch.tensor([1, 2], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="idx must be int64, got int"):
        _op_permute(idx.int(), 10, KEYS)
    with pytest.raises(RuntimeError, match="num_parts must be >= 1, got 0"):
        torch.ops.zen_ext.hash_partition(idx, 10, 0, KEYS)
    with pytest.raises(RuntimeError, match="keys must be an int64 tensor of 4 round keys"):
        _op_permute(idx, 10, KEYS[:3])


@needs_op
@settings(max_examples=150, deadline=None)
@given(
    numel=st.one_of(st.integers(1, 64), st.integers(65, 2**20), st.integers(2**31 - 8, 2**40)),
    n=st.integers(1, 300),
    data=st.data(),
)
def test_ops_match_reference_property(numel, n, data):
    idx_list = data.draw(st.lists(st.integers(0, numel - 1), max_size=300))
    idx = torch.tensor(idx_list, dtype=torch.int64)
    y = _op_permute(idx, numel, KEYS)
    assert torch.equal(y, _reference.permute(idx, numel, KEYS))
    assert torch.equal(_op_permute(y, numel, KEYS, True), idx)
    got = _op_partition(idx, numel, n, KEYS)
    for a, b in zip(got, _reference.hash_partition(idx, numel, n, KEYS)):
        assert torch.equal(a, b)
    _check_grouping(idx, numel, n, *got[:3])


def _registered_fake(op_name: str) -> bool:
    try:
        from torch._library.simple_registry import singleton

        return singleton.find(op_name).fake_impl.kernel is not None
    except Exception:  # private API moved: let opcheck itself decide
        return True


@needs_op
@pytest.mark.parametrize(
    "name,args",
    [
        ("permute", (torch.tensor([0, 9, 3, 3]), 10, KEYS, False)),
        ("hash_partition", (torch.tensor([0, 9, 3, 3]), 10, 3, KEYS, 3, 2.0, 0.1)),
        ("hash_partition", (torch.empty(0, dtype=torch.int64), 10, 3, KEYS, 3, 2.0, 0.1)),
    ],
)
def test_opcheck(name, args):
    op = getattr(torch.ops.zen_ext, name).default
    result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))
    assert set(result.values()) == {"SUCCESS"}
    assert _registered_fake(f"zen_ext::{name}")  # zen_ext/ops registers shape-only fake kernels
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}


# ---------------------------------------------------------------------------------------------------
# Load balance on Zipf-skewed embedding gradients (paper Def. 8)
# ---------------------------------------------------------------------------------------------------

# Vocabulary and row width of a Gemma-like embedding (256k rows) at a reduced width; each rank draws
# T tokens from Zipf(s) over the frequency-sorted vocabulary (seeds.md §6), its non-zeros are the
# unique rows × width. Frequent tokens have small ids, so contiguous ranges are badly skewed.
VOCAB, WIDTH, TOKENS, ZIPF_S = 256_000, 512, 2000, 1.05


def _zipf_workload(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, VOCAB + 1, dtype=torch.float64).pow(-ZIPF_S)
    cols = torch.arange(WIDTH)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    for _ in range(n):
        rows = torch.multinomial(weights, TOKENS, replacement=True, generator=gen).unique()
        seen[rows] = True
        yield (rows[:, None] * WIDTH + cols).flatten()
    rows = seen.nonzero().flatten()
    yield (rows[:, None] * WIDTH + cols).flatten()  # the union ∪I, last


@pytest.mark.parametrize("n", [16, 128])
def test_zipf_push_and_pull_balance(n):
    numel = VOCAB * WIDTH
    hashed = HashPartitioner(numel, n, seed=3)
    *ranks, union = _zipf_workload(n, seed=n)
    assert min(idx.numel() for idx in ranks) >= 100_000

    def ratio(part_of):
        return imbalance(torch.bincount(part_of, minlength=n))

    push = max(ratio(hashed.partition_of(idx)) for idx in ranks)
    pull = ratio(hashed.partition_of(union))
    push_contiguous = max(ratio(contiguous_partition_of(idx, numel, n)) for idx in ranks)
    pull_contiguous = ratio(contiguous_partition_of(union, numel, n))
    assert push <= 1.1 and pull <= 1.1, (push, pull)
    assert push_contiguous >= 3 and pull_contiguous >= 3, (push_contiguous, pull_contiguous)
    # The grouping op sees the same counts as h0 itself.
    counts = hashed.partition(ranks[0])[0]
    assert torch.equal(counts, torch.bincount(hashed.partition_of(ranks[0]), minlength=n))
