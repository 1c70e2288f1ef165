"""``omnireduce``: OmniReduce's block-sparse format with colocated aggregators (ZEN paper §2.4, Table 3).

OmniReduce (SIGCOMM'21, sands-lab/omnireduce) cuts the flat gradient into blocks of 256 elements and
only non-zero blocks (at least one non-zero element) travel, without per-element indices; aggregators
own contiguous parts of the tensor, sum the blocks they receive and send the aggregated non-zero blocks
back to every worker. It is [Point-to-point, One-shot, Parallelism, Imbalanced]: skewed gradients put
most non-zero blocks into the first aggregator's range (paper Fig. 8: marginal gains past 64 GPUs).

This is an emulation on collective communication, not the RDMA/DPDK system: every rank is also the
aggregator of ``⌈#blocks/n⌉`` consecutive blocks; the streaming "next non-zero block offset" metadata of
the real protocol is replaced by a 4-byte block id per block (the same bytes), the push is one
``exchange_v`` and the pull one ``all_gather_v`` of the aggregated non-zero blocks. Blocks are always
sent whole (the tail of the last block is zero padding). Row-form gradients are laid out as their dense
elements first (``row·W + column``), since the block format is defined on the flat tensor.

Bytes rank ``r`` sends, with ``B_r^j`` of its non-zero blocks in range ``j`` and ``U_r`` aggregated
non-zero blocks in its own range: push ``Σ_{j≠r} (8 + B_r^j·(4 + 256·vb))``, pull
``(n−1)·(8 + U_r·(4 + 256·vb))``.

Legend: ``_K`` entries, ``_E`` non-zero elements, ``_B`` non-zero blocks.
"""

from __future__ import annotations

import torch

from ..comm.base import Communicator
from .coo import finish
from .cost import BLOCK_SIZE, Dims, ProfileView, Traffic, WorkCounts
from .hashing import contiguous_partition_of
from .scheme import PartitionFn, SyncScheme
from .sparse_ps import predict_range_traffic, range_push_pull
from .timing import PhaseTimer
from .types import SparseGrad, acc_dtype, as_sparse, index_dtype


def element_indices(sg: SparseGrad) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat element indices and values of a (row- or element-form) gradient: ``(idx_E, val_E)``."""
    w = sg.row_width
    if w == 1:
        return sg.indices, sg.values.reshape(-1)
    cols = torch.arange(w, device=sg.indices.device)
    return (sg.indices.unsqueeze(1) * w + cols).reshape(-1), sg.values.reshape(-1)


def to_blocks(sg: SparseGrad, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The non-zero blocks of ``sg``: ``(block_ids_B sorted, payload_B [B, block_size], num_blocks)``.

    Duplicate indices are summed into their block (in fp32 for half types, then rounded once).
    """
    idx_E, val_E = element_indices(sg)
    num_blocks = -(-sg.dense_numel // block_size)
    blk_E = idx_E // block_size
    ids_B, inv_E = torch.unique(blk_E, sorted=True, return_inverse=True)
    acc = torch.zeros(ids_B.numel() * block_size, dtype=acc_dtype(sg.dtype), device=val_E.device)
    if idx_E.numel():
        acc.index_add_(0, inv_E * block_size + idx_E % block_size, val_E.to(acc.dtype))
    return ids_B, acc.to(sg.dtype).view(-1, block_size), num_blocks


class OmniReduceScheme(SyncScheme):
    """OmniReduce-style block sparsity with colocated aggregators (an emulation; see the module docstring).

    Args:
        block_size: elements per block (OmniReduce's default and the paper's setting: 256).
    """

    name = "omnireduce"
    wire_phases = ("push_s", "pull_s")
    partition_unit = "block"

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"zen.block_size ({block_size!r}) must be an int >= 1")
        self.block_size = block_size

    def options(self) -> dict:
        return {"block_size": self.block_size}

    def _sync(
        self, comm: Communicator, grad: SparseGrad | torch.Tensor, op: str = "sum", timings: dict | None = None,
        key: str | None = None, out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Synchronize ``grad`` losslessly.

        1. Blocks: find this rank's non-zero blocks and fill their payloads (duplicates summed).
        2. Push, aggregate, pull: each block goes to the aggregator owning its contiguous block range,
           which sums the blocks and sends its aggregated non-zero blocks to every rank.
        3. Decode: the blocks laid out flat are the dense result (the tail of the last block dropped).
        """
        sg = as_sparse(grad)
        timer = PhaseTimer(sg.values.device, enabled=timings is not None)

        # Step 1: blocks.
        timer.start("blocks_s")
        ids_B, payload_B, num_blocks = to_blocks(sg, self.block_size)

        # Step 2: push, aggregate, pull over the block index space.
        out = range_push_pull(comm, ids_B, payload_B, num_blocks, timer)

        # Step 3: decode.
        out = finish(out.reshape(-1)[: sg.dense_numel], sg.values.dtype, op, comm.size)
        timer.write_into(timings)
        return out

    # --- cost model --------------------------------------------------------------------------------
    @staticmethod
    def predict_traffic(p: ProfileView, opts: dict) -> Traffic:
        block_size = opts.get("block_size", p.block_size)
        if block_size != p.block_size:
            raise ValueError(f"omnireduce block_size ({block_size}) must equal the profile's ({p.block_size})")
        idx_bytes = torch.empty(0, dtype=index_dtype(p.num_blocks)).element_size()
        return predict_range_traffic(p, p.counts_PP("block_counts"), p.union_per_range(blocks=True),
                                     idx_bytes + block_size * p.value_bytes)

    @staticmethod
    def predict_work(w: WorkCounts, opts: dict) -> dict:
        d = Dims.of(w)
        B = opts.get("block_size", w.block_size)
        blocks = w.block_union if w.block_union is not None else min(-(-d.N * d.W // B), d.U)
        recv = w.block_recv_max if w.block_recv_max is not None else blocks
        return {"blocks_s": {"sort_s_per_entry": d.K},
                "partition_s": {"fill_s_per_byte": blocks * B * d.vb},
                "aggregate_s": {"fill_s_per_byte": d.N / d.n * d.W * d.ab + recv * B * d.ab},
                "decode_s": {"fill_s_per_byte": d.dense_out + blocks * B * d.vb}}

    @classmethod
    def partition_fn(cls, numel: int, n: int, *, seed: int = 0, row_width: int = 1,
                     block_size: int = BLOCK_SIZE) -> PartitionFn | None:
        """Contiguous ranges of ``block_size``-element blocks (its unit of traffic): maps block ids."""
        num_blocks = -(-numel * row_width // block_size)
        return lambda blk: contiguous_partition_of(blk, num_blocks, n)
