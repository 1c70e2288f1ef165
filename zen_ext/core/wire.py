"""Byte packing of several tensors into one uint8 message, so a phase costs one message per peer."""

from __future__ import annotations

import torch


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the raw bytes of 1-D tensors into one uint8 tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def view_as(buf_B: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements of ``dtype`` starting at byte ``offset`` of ``buf_B`` (copied if misaligned)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    part = buf_B[offset : offset + count * esize]
    if (part.storage_offset() % esize) or (part.data_ptr() % esize):
        part = part.clone()
    return part.view(dtype)


def exchange_packed(comm, sends: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Several exchanges of uint8 payloads as one: ``sends[g][j]`` goes to rank ``j``; returns
    ``recv[g][j]``. So a group of gradients costs one round per phase, not one per gradient.

    With one gradient it is ``comm.exchange_v`` itself (same bytes). With ``k > 1``, the message to a
    peer is ``[k int64 payload sizes | payloads, each padded to 8 bytes]`` (empty when every payload
    is; the padding keeps every payload aligned for the ops that read it), and the receiver reads
    every peer's sizes in one host read.
    """
    if len(sends) == 1:
        return [comm.exchange_v(sends[0])]
    k, n = len(sends), len(sends[0])
    device = sends[0][0].device
    sizes = [[sends[g][j].numel() for g in range(k)] for j in range(n)]
    table = torch.tensor(sizes, dtype=torch.int64, device=device).view(torch.uint8).view(n, 8 * k)
    zeros = torch.zeros(8, dtype=torch.uint8, device=device)
    msgs = []
    for j in range(n):
        if not any(sizes[j]):
            msgs.append(torch.empty(0, dtype=torch.uint8, device=device))
            continue
        parts = [table[j]]
        for g in range(k):
            parts += [sends[g][j].reshape(-1).view(torch.uint8), zeros[: -sizes[j][g] % 8]]
        msgs.append(torch.cat(parts))
    recv = comm.exchange_v(msgs)
    heads = [view_as(m, 0, k, torch.int64) for m in recv if m.numel()]
    read = iter(torch.stack(heads).tolist() if heads else [])  # one host read for every peer
    out: list[list[torch.Tensor]] = [[] for _ in range(k)]
    for m in recv:
        got = next(read) if m.numel() else [0] * k
        at = 8 * k if m.numel() else 0
        for g in range(k):
            out[g].append(m[at : at + got[g]])
            at += got[g] + (-got[g] % 8)
    return out
