"""Hierarchical hashing into balanced partitions (ZEN paper §3.2, Algorithm 1).

h0 sends index ``idx`` to partition ``P(idx) % n``, where ``P`` is a keyed pseudo-random permutation
of ``[0, numel)`` (Feistel network with MurmurHash3 ``fmix32`` rounds and cycle walking; see
``zen_ext/ops/_reference.py``). It is data-independent, so every rank computes the same partition from
the shared seed, and on any index set (Zipf-skewed embedding rows, clustered DGC top-k) each partition
receives ~1/n of the non-zeros: Push and Pull imbalance (paper Def. 8) stay near 1.

Because ``P`` is a bijection, partition ``i``'s index set in its fixed order is ``𝕀_i[p] =
P⁻¹(i + p·n)`` for ``p < |𝕀_i| = ⌈(numel − i)/n⌉``: a server aggregates into a compact buffer at
position ``P(idx) // n``, and a decoder maps bitmap positions back to indices on the fly, with no
``numel``-sized table (design note: docs/design.md, "h0: a keyed permutation").

The second hashing level of Algorithm 1 (``k`` rehash functions into parallel memory, serial memory
with an atomic counter) only places indices in GPU memory without sorting; it lives in the CUDA op
(``csrc/cuda/hash_kernel.cu``). On the CPU a stable counting sort groups indices instead. On a GPU the
partitioner groups them with a stable radix sort of one-byte partition ids after h0 (``_by_sort``):
on an H100 at the paper's scale (214 M elements at 5.2 %, 16 partitions) 0.79 ms against Algorithm
1's 3.39 ms, whose atomics into the hash memory are latency-bound there (docs/kernels.md), with the
same partitions and the CPU op's order inside each. h0, and so the balance, is the same either way.

Legend: ``_K`` non-zeros, ``_P`` partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops


GROUPING_BY_SORT_DEVICES = ("cuda",)
"""Device types where ``HashPartitioner.partition`` groups by a radix sort (``_by_sort``) rather than
Algorithm 1's hash memory (the ``hash_partition`` op, which stays the CPU path and has its own tests)."""


@dataclass(frozen=True)
class HashConfig:
    """Algorithm 1 parameters (used by the CUDA op; the CPU grouping is exact whatever they are)."""

    num_rehash: int = 3
    """``k``, rehash functions into parallel memory before the serial region (paper: 3)."""
    parallel_factor: float = 2.0
    """Parallel memory ``r1`` in slots per non-zero, over all partitions (paper: 2|G|d_G)."""
    serial_factor: float = 0.1
    """Serial memory ``r2`` as a fraction of ``r1`` (paper: r1/10)."""


class HashPartitioner:
    """h0 for one gradient size and one number of partitions.

    Args:
        numel: dense length of the gradient.
        num_parts: number of partitions ``n`` (the number of servers = ranks).
        seed: the seed all ranks agreed on.
        hash_config: Algorithm 1 parameters for the CUDA op.
    """

    def __init__(self, numel: int, num_parts: int, seed: int, hash_config: HashConfig | None = None) -> None:
        if num_parts < 1:
            raise ValueError(f"num_parts ({num_parts}) must be >= 1")
        self.numel = int(numel)
        self.num_parts = int(num_parts)
        self.seed = int(seed)
        self.keys = ops.derive_keys(seed)
        self.cfg = hash_config or HashConfig()
        self._keys_by_device: dict[torch.device, torch.Tensor] = {torch.device("cpu"): self.keys}

    def keys_on(self, device: torch.device | str) -> torch.Tensor:
        """The round keys on ``device``, copied there once (a per-call copy would be a host transfer)."""
        device = torch.device(device)
        k = self._keys_by_device.get(device)
        if k is None:  # a benign race under SimWorld threads: both store equal tensors
            k = self._keys_by_device[device] = self.keys.to(device)
        return k

    def part_size(self, part: int) -> int:
        """``|𝕀_part|``: how many of the ``numel`` indices hash to ``part``."""
        return max(0, (self.numel - part + self.num_parts - 1) // self.num_parts)

    def partition_of(self, idx_K: torch.Tensor) -> torch.Tensor:
        """h0 itself: the partition of each index."""
        return ops.permute(idx_K, self.numel, self.keys_on(idx_K.device)) % self.num_parts

    def partition(self, idx_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group indices by partition.

        Returns:
            ``counts_P``, ``order_K`` (into ``idx_K``, grouped by partition), ``pos_K`` (position of each
            grouped index inside its partition's ordered index set), ``stats_3`` (Algorithm 1 counters).
        """
        if idx_K.device.type in GROUPING_BY_SORT_DEVICES:
            return self._by_sort(idx_K)
        c = self.cfg
        return ops.hash_partition(
            idx_K, self.numel, self.num_parts, self.keys_on(idx_K.device), c.num_rehash, c.parallel_factor,
            c.serial_factor,
        )

    def _by_sort(self, idx_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``partition`` by h0 and a stable radix sort of the partition ids (the narrowest integer
        type that holds them: one byte up to 256 partitions, one radix pass), no host read.

        1. ``y = P(idx)``: partition ``y % n``, position ``y // n``.
        2. Stable sort of the partition ids: ``order_K`` (the CPU op's order: stable).
        3. Counts from where each partition starts in the sorted ids (binary search, no atomics).
        """
        n, device = self.num_parts, idx_K.device
        # Step 1: h0.
        y = ops.permute(idx_K, self.numel, self.keys_on(device))
        key_dtype = torch.uint8 if n <= 256 else torch.int16 if n <= 32767 else torch.int32
        part = (y % n).to(key_dtype)
        # Step 2: the grouping.
        sorted_p, order_K = torch.sort(part, stable=True)
        # Step 3: counts.
        starts = torch.searchsorted(sorted_p, torch.arange(n, device=device, dtype=key_dtype))
        counts_P = torch.diff(starts, append=torch.full((1,), idx_K.numel(), dtype=starts.dtype, device=device))
        return (counts_P.to(torch.int64), order_K, (y // n).index_select(0, order_K),
                torch.zeros(3, dtype=torch.int64, device=device))

    def indices_of(self, part_K: torch.Tensor | int, pos_K: torch.Tensor) -> torch.Tensor:
        """``𝕀_part[pos]``: global indices of local positions (inverse of ``partition``)."""
        return self.unpermute(pos_K.to(torch.int64) * self.num_parts + part_K)

    def unpermute(self, y_K: torch.Tensor) -> torch.Tensor:
        """``P⁻¹(y)`` for hashed values ``y = pos·n + part`` in ``[0, numel)``."""
        return ops.permute(y_K, self.numel, self.keys_on(y_K.device), inverse=True)


def imbalance(counts: torch.Tensor) -> float:
    """``max / mean`` of per-partition loads (paper Def. 8); 1.0 is perfect, empty loads give 1.0."""
    counts = counts.to(torch.float64)
    mean = counts.mean()
    return float(counts.max() / mean) if mean > 0 else 1.0


def contiguous_partition_of(idx_K: torch.Tensor, numel: int, num_parts: int) -> torch.Tensor:
    """Partition of each index under contiguous ranges (Sparse PS, OmniReduce): the skewed baseline."""
    size = -(-numel // num_parts)
    return idx_K // size
