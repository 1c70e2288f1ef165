"""Host reads of the ops' count tensors (``aggregate_push``'s and ``aggregate_push_into``'s): one read for any
number of them, and the CUDA op's out-of-partition count turned into the CPU op's error."""

from __future__ import annotations

import torch


def read_aggregate_count(count: torch.Tensor) -> int:
    """The aggregated count from ``aggregate_push``'s or ``aggregate_push_into``'s count tensor, in one
    host read; raises where the CUDA op skipped pushed positions outside the partition (a payload
    that does not match this server's layout), as the CPU op does when it meets one."""
    return read_aggregate_counts([count])[0]


def read_aggregate_counts(counts: list[torch.Tensor]) -> list[int]:
    """``read_aggregate_count`` of several count tensors (of one device) in one host read."""
    sizes = [c.numel() for c in counts]
    flat = (counts[0] if len(counts) == 1 else torch.cat([c.reshape(-1) for c in counts])).tolist()
    got, at = [], 0
    for size in sizes:
        words = flat[at : at + size]
        at += size
        if len(words) > 1 and words[1]:
            raise RuntimeError(f"aggregate_push: {words[1]} pushed position(s) lie outside this server's partition "
                               "(a payload that does not match the agreed layout)")
        got.append(int(words[0]))
    return got
