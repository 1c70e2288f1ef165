"""SparseLoCo (arXiv 2508.15706): a direct implementation for the peers benchmark, not part of zen_ext.

After ``H`` inner optimizer steps each replica holds a pseudo-gradient ``Δ = θ_global − θ_local``. SparseLoCo
keeps an error-feedback buffer per parameter and sends a chunked, 2-bit top-k of it:

1. ``e ← β·e + Δ`` (β 0.95 in the paper's 512 M sweep);
2. each 2-D tensor cut into tiles of about 64 × 64 (each side the largest divisor of the dimension not above
   64, as the authors' ``ChunkingTransform``), 1-D tensors into chunks of about 64; per tile the ``k``
   largest magnitudes (k 64 of 4,096: 1.56 %; a chunk with fewer elements sends them all);
3. the values quantized to 2 bits: centred on their mean, 4 bins over ±6σ (``scale = 6σ / 4``), each code
   decoded through the mean of the values that fell in its bin (a per-tensor table of 4 fp32 means plus the
   fp32 shift);
4. ``e ← e − decode(q)``: the error feedback subtracts what was actually sent, dequantized;
5. all-gather of the packed messages (indices 12 bits each, values 2 bits each, the table): every replica
   decodes every replica's picks and averages each index over the replicas that picked it
   (``scatter_reduce_(reduce="mean", include_self=False)``);
6. outer SGD, lr 1, no momentum: ``θ_global ← θ_global − lr·Δ̂``, copied into every replica.

The authors' public code (templar's ``CCLoco``, its per-step ancestor) was read for steps 2, 3 and 5; the
message is packed here into real 12-bit and 2-bit fields so the bytes counted are the bytes sent.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

SPARSELOCO_DEFAULTS = {"sync_every": 15, "topk": 64, "chunk": 64, "error_decay": 0.95, "value_bits": 2,
                       "range_sigmas": 6.0, "outer_lr": 1.0}
"""The published settings (arXiv 2508.15706, 512 M sweep): H = 15, top-64 of each 64 × 64 tile, β = 0.95,
2-bit values over ±6σ, outer SGD lr 1 without momentum."""
INDEX_BITS = 12
"""Bits per index inside a 4,096-element tile (2^12 = 4,096), as SparseLoCo counts them."""


def smaller_split(n: int, close_to: int) -> int:
    """The largest divisor of ``n`` not above ``close_to`` (1 for a prime above it: every element its own
    chunk, all sent), as the authors' ``_get_smaller_split``."""
    divisors = sorted({d for i in range(1, int(math.isqrt(n)) + 1) if n % i == 0 for d in (i, n // i)})
    for i, d in enumerate(divisors):
        if d == close_to:
            return d
        if d > close_to:
            return d if i == 0 else divisors[i - 1]
    return n


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``x`` as ``[num_chunks, chunk_elements]``: 2-D tensors in tiles of ``h × w`` (each side
    ``smaller_split(dim, chunk)``), 1-D tensors in runs of ``smaller_split(n, chunk)``."""
    if x.dim() == 2:
        h, w = smaller_split(x.shape[0], chunk), smaller_split(x.shape[1], chunk)
        return x.reshape(x.shape[0] // h, h, x.shape[1] // w, w).permute(0, 2, 1, 3).reshape(-1, h * w)
    if x.dim() == 1:
        w = smaller_split(x.shape[0], chunk)
        return x.reshape(-1, w)
    raise ValueError(f"sparseloco: a parameter of shape {tuple(x.shape)} must be 1-D or 2-D")


def from_chunks(c: torch.Tensor, shape: torch.Size, chunk: int) -> torch.Tensor:
    """The inverse of ``to_chunks``."""
    if len(shape) == 2:
        h, w = smaller_split(shape[0], chunk), smaller_split(shape[1], chunk)
        return c.reshape(shape[0] // h, shape[1] // w, h, w).permute(0, 2, 1, 3).reshape(shape)
    return c.reshape(shape)


def quantize(val: torch.Tensor, bits: int, range_sigmas: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in ``[0, 2^bits)`` and the table ``[shift, mean of bin 0, ..., mean of bin 2^bits − 1]`` (fp32).

    As the authors' ``_quantize``: centre on the mean, ``scale = range_sigmas·σ / bins`` (σ unbiased), code
    ``round(c / scale + bins // 2)`` clamped; a bin decodes to the mean of the centred values in it (0 if empty).
    """
    bins = 1 << bits
    shift = val.mean()
    c = val - shift
    std = c.norm() / math.sqrt(c.numel() - 1) if c.numel() > 1 else torch.zeros((), dtype=val.dtype)
    scale = range_sigmas * std / bins
    if not (scale > 0 and torch.isfinite(scale)):
        scale = torch.ones((), dtype=val.dtype)
    codes = (c / scale + bins // 2).round().clamp(0, bins - 1).to(torch.long).flatten()
    sums = torch.zeros(bins, dtype=torch.float32).scatter_add_(0, codes, c.float().flatten())
    counts = torch.zeros(bins, dtype=torch.float32).scatter_add_(0, codes, torch.ones_like(sums[codes]))
    table = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return codes.view(val.shape), torch.cat([shift.float().view(1), table])


def dequantize(codes: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Values from codes and ``[shift, bin means...]``."""
    return table[1:][codes.long()] + table[0]


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below ``2^bits`` (``bits`` 2 or 12) packed little-end first into uint8."""
    v = codes.flatten().to(torch.int64)
    if bits == 2:
        v = torch.cat([v, v.new_zeros((-v.numel()) % 4)]).view(-1, 4)
        return (v[:, 0] | (v[:, 1] << 2) | (v[:, 2] << 4) | (v[:, 3] << 6)).to(torch.uint8)
    if bits == 12:
        v = torch.cat([v, v.new_zeros(v.numel() % 2)]).view(-1, 2)
        a, b = v[:, 0], v[:, 1]
        return torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=1).flatten().to(torch.uint8)
    raise ValueError(f"sparseloco: bits ({bits}) must be 2 or 12")


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` integers of ``pack_bits``' output."""
    p = packed.to(torch.int64)
    if bits == 2:
        v = torch.stack([p & 3, (p >> 2) & 3, (p >> 4) & 3, (p >> 6) & 3], dim=1).flatten()
    elif bits == 12:
        p = p.view(-1, 3)
        v = torch.stack([p[:, 0] | ((p[:, 1] & 0xF) << 8), (p[:, 1] >> 4) | (p[:, 2] << 4)], dim=1).flatten()
    else:
        raise ValueError(f"sparseloco: bits ({bits}) must be 2 or 12")
    return v[:n]


def layout_of(params, chunk: int, topk: int) -> list[tuple[int, int, int]]:
    """Per parameter ``(chunks, elements per chunk, k)``: fixed by the shapes, so every replica's message has
    the same size."""
    out = []
    for p in params:
        rows, width = to_chunks(torch.empty(p.shape, device="meta"), chunk).shape
        out.append((rows, width, min(topk, width)))
    return out


def message_bytes(layout, value_bits: int = 2) -> int:
    """Bytes of one replica's message: indices packed 12 bits each (pairs in 3 bytes, per tensor), values
    ``value_bits`` each (per tensor, whole bytes), and per tensor the fp32 shift and bin means."""
    per = 8 // value_bits
    return sum(math.ceil(rows * k / 2) * 3 + math.ceil(rows * k / per) + 4 * (1 + (1 << value_bits))
               for rows, _, k in layout)


class SparseLoCo:
    """The outer synchronization of SparseLoCo over the model's parameters (one replica per rank of ``group``).

    Call ``after_inner_step()`` after every inner optimizer step; every ``sync_every`` steps it runs steps
    1-6 of the module docstring. ``bytes_sent`` counts what this rank sent (a ring all-gather forwards each
    of the other ``n − 1`` replicas' messages once: ``(n − 1)·message``).

    Memory per parameter element: the global copy (fp32) and the error buffer (fp32), 8 bytes.
    """

    def __init__(self, model: torch.nn.Module, group=None, **settings) -> None:
        unknown = sorted(set(settings) - set(SPARSELOCO_DEFAULTS))
        if unknown:
            raise ValueError(f"sparseloco settings {unknown} must be among {sorted(SPARSELOCO_DEFAULTS)}")
        self.s = {**SPARSELOCO_DEFAULTS, **settings}
        if self.s["chunk"] ** 2 > 1 << INDEX_BITS:
            raise ValueError(f"sparseloco.chunk ({self.s['chunk']}) must be at most 64: indices are {INDEX_BITS} bits")
        self.group = group
        self.world = dist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.global_params = [p.detach().clone() for p in self.params]
        self.errors = [torch.zeros_like(p) for p in self.params]
        self.inner_steps = 0
        self.bytes_sent = 0
        self.outer_steps = 0
        self.layout = layout_of(self.params, self.s["chunk"], self.s["topk"])

    def message_bytes(self) -> int:
        """Bytes of one replica's message (``message_bytes``)."""
        return message_bytes(self.layout, self.s["value_bits"])

    @torch.no_grad()
    def after_inner_step(self) -> bool:
        """Count an inner step; on every ``sync_every``-th run the outer step. Returns whether it synced."""
        self.inner_steps += 1
        if self.inner_steps % self.s["sync_every"]:
            return False
        self.sync()
        return True

    @torch.no_grad()
    def sync(self) -> None:
        s = self.s
        idx_parts, val_parts, tables = [], [], []
        for p, g, e, (rows, width, k) in zip(self.params, self.global_params, self.errors, self.layout):
            # Step 1: error feedback of the pseudo-gradient.
            e.mul_(s["error_decay"]).add_(g - p.detach())
            # Step 2: top-k per chunk.
            chunks = to_chunks(e, s["chunk"])
            idx = chunks.abs().topk(k, dim=1, sorted=False).indices
            val = chunks.gather(1, idx)
            # Step 3: 2-bit values decoded through the bin means.
            codes, table = quantize(val, s["value_bits"], s["range_sigmas"])
            # Step 4: subtract what is sent, dequantized.
            sent = torch.zeros_like(chunks).scatter_(1, idx, dequantize(codes, table).to(chunks.dtype))
            e.sub_(from_chunks(sent, e.shape, s["chunk"]))
            idx_parts.append(pack_bits(idx, INDEX_BITS))
            val_parts.append(pack_bits(codes, s["value_bits"]))
            tables.append(table)
        # Step 5: one all-gather of the packed bytes, one of the tables (constant collectives per step).
        payload = torch.cat(idx_parts + val_parts)
        table_flat = torch.cat(tables)
        gathered = torch.empty(self.world * payload.numel(), dtype=torch.uint8)
        dist.all_gather_into_tensor(gathered, payload, group=self.group)
        gathered_tables = torch.empty(self.world * table_flat.numel(), dtype=torch.float32)
        dist.all_gather_into_tensor(gathered_tables, table_flat, group=self.group)
        self.bytes_sent += (self.world - 1) * (payload.numel() + 4 * table_flat.numel())
        per = gathered.view(self.world, -1)
        per_tables = gathered_tables.view(self.world, -1)
        idx_sizes = [t.numel() for t in idx_parts]
        val_sizes = [t.numel() for t in val_parts]
        idx_off = [0]
        for n in idx_sizes + val_sizes:
            idx_off.append(idx_off[-1] + n)
        t_width = 1 + (1 << s["value_bits"])
        for i, (p, g, (rows, width, k)) in enumerate(zip(self.params, self.global_params, self.layout)):
            all_idx, all_val = [], []
            for r in range(self.world):
                ii = unpack_bits(per[r, idx_off[i]:idx_off[i + 1]], INDEX_BITS, rows * k).view(rows, k)
                j = len(idx_sizes) + i
                vv = unpack_bits(per[r, idx_off[j]:idx_off[j + 1]], s["value_bits"], rows * k).view(rows, k)
                all_idx.append(ii)
                all_val.append(dequantize(vv, per_tables[r, i * t_width:(i + 1) * t_width]).to(p.dtype))
            # Each index averaged over the replicas that picked it.
            agg = torch.zeros(rows, width, dtype=p.dtype).scatter_reduce_(
                1, torch.cat(all_idx, 1), torch.cat(all_val, 1), reduce="mean", include_self=False)
            # Step 6: outer SGD on the aggregated pseudo-gradient; every replica restarts from it.
            g.sub_(from_chunks(agg, g.shape, s["chunk"]), alpha=s["outer_lr"])
            p.copy_(g)
        self.outer_steps += 1
