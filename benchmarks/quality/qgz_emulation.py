"""ZeRO++ qgZ, emulated on CPU: DeepSpeed 0.19.8's ``all_to_all_quant_reduce`` step for step in torch ops.

An EMULATION, for the peers benchmark only (not part of zen_ext). DeepSpeed's qgZ runs CUDA kernels
(``swizzle_quant``, ``quantized_reduction``, ``dequantize`` in ``csrc/quantization``); on CPU its
``QuantizerBuilder`` is not implemented, so a CPU comparison needs this. What it reproduces, per gradient
tensor handed to ZeRO-3's ``__avg_scatter_grads`` (``runtime/comm/coalesced_collectives.py``):

1. Fallbacks: a 1-D tensor, or one whose ``numel % (2·world) != 0``, goes through DeepSpeed's own
   ``reduce_scatter_coalesced`` (the mean, exact).
2. ``groups = max(shape[0], shape[1], world)`` quantization groups of ``numel / groups`` elements, read as
   fp16 (the kernels take ``__half*``); per group **int4 symmetric**: ``scale = 8 / absmax`` (1.0 for an
   all-zero group), ``q = clamp(round_half_even(x·scale), −8, 7)``, one fp32 ``1/scale`` stored per group.
3. Swizzle: the tensor's ``nodes·local`` contiguous partitions reordered so partition ``k·local + d`` goes to
   local rank ``d`` (slot ``d·nodes + k``); ``all_to_all_single`` inside the node (codes packed two per byte,
   and the scales).
4. ``quantized_reduction``: dequantize each local peer's chunk to fp16, **sum in fp16** (peer by peer),
   re-quantize to int4 per group of the same size.
5. ``all_to_all_single`` across nodes (the ranks with the same local index).
6. Dequantize to fp16, ``sum(chunks) / num_nodes`` in fp16: rank ``k·local + d`` gets partition ``k·local + d``
   of the sum over all ranks divided by the number of nodes — the intra-node sum is not divided, so the
   quantized tensors come out ``local`` times the mean while the fallbacks give the mean. DeepSpeed does
   exactly this; the emulation keeps it.

Deviations, said wherever results are: the arithmetic runs in torch on CPU (fp16 rounding per operation as
the kernels' ``__half2`` adds; the kernels' thread-level reduction order of the absmax does not change a max);
codes travel as packed bytes over gloo; with fp32 gradients the emulation casts them to fp16 first (the
CUDA kernel would read fp32 memory as ``__half``, so a real fp32 run needs ``communication_data_type``
fp16) and returns the result in the input's dtype. Shapes the CUDA kernel cannot cover (``groups`` not a
multiple of the world size, ``numel`` not a multiple of ``groups``, groups of more than 40,960 elements:
the kernel leaves them unwritten or launches nothing) are refused with an error. No error feedback
(LoCo-ZeRO++ was removed before 0.19.8).

``install()`` puts the emulation where ZeRO-3 calls it (``deepspeed.runtime.zero.stage3.all_to_all_quant_reduce``);
DeepSpeed then takes the qgZ path when the config sets ``"zero_quantized_gradients": true`` and there is more
than one node (``world // accelerator.device_count()``: on the CPU accelerator ``LOCAL_SIZE``, which
DeepSpeed's launcher sets per node — ``benchmarks/quality_nodes.py`` runs emulated nodes that way).
"""

from __future__ import annotations

from typing import List

import torch

MAX_GROUP_ELEMENTS = 40960
"""The largest group ``swizzled_quant_kernel`` launches for (512 threads × 8 halves × 2 per step × at most 5
steps: ``total_unroll`` ≤ 10); above it DeepSpeed launches no kernel."""

stats = {"calls": 0, "quantized_tensors": 0, "fallback_tensors": 0, "bytes_sent": 0}
"""What this process's emulation did: tensors through the quantized path and the fallbacks, and the bytes
this rank sent in the two all-to-alls (codes and scales; the fallbacks' reduce-scatters are DeepSpeed's)."""


def quantize_int4(x16: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2: int4 symmetric codes (int8 in [−8, 7]) and the fp32 stored scales (``absmax / 8``) of ``x16``
    (fp16, flat) in ``groups`` equal groups."""
    g = x16.view(groups, -1).float()
    absmax = g.abs().amax(dim=1)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), (1 << 4) / (2 * absmax))
    q = torch.round(g * scale[:, None]).clamp(-8, 7).to(torch.int8)  # torch.round: half to even, as __float2int_rn
    return q.view(-1), (1.0 / scale).float()


def dequantize_int4(q: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """Codes times the stored scale, in fp32, rounded to fp16 (the kernels' ``conversion::to<__half>``)."""
    return (q.view(stored.numel(), -1).float() * stored[:, None]).to(torch.float16).view(-1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [−8, 7] two per byte (what the kernels send: ``numel / 2`` bytes)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(-1, 2)
    return u[:, 0] | (u[:, 1] << 4)


def unpack_int4(b: torch.Tensor) -> torch.Tensor:
    return (torch.stack([b & 0xF, b >> 4], dim=1).view(-1).to(torch.int16) - 8).to(torch.int8)


def check_shape(numel: int, groups: int, world: int) -> None:
    """Refuse what DeepSpeed's kernels would not cover (see the module docstring)."""
    if groups % world:
        raise NotImplementedError(f"qgZ emulation: groups ({groups}) must be a multiple of the world size ({world}); "
                                  f"DeepSpeed's swizzle kernel would leave the last groups unwritten")
    if numel % groups:
        raise NotImplementedError(f"qgZ emulation: numel ({numel}) must be a multiple of groups ({groups}); "
                                  f"DeepSpeed's kernel would leave the tail unwritten")
    if numel // groups > MAX_GROUP_ELEMENTS:
        raise NotImplementedError(f"qgZ emulation: a group of {numel // groups} elements must be at most "
                                  f"{MAX_GROUP_ELEMENTS}; DeepSpeed's swizzle kernel launches nothing above it")


def quant_reduce_one(tensor: torch.Tensor, local: int, nodes: int, intra_idx: int, inter_idx: int,
                     all_to_all_intra, all_to_all_inter) -> torch.Tensor:
    """Steps 2-6 for one tensor. ``all_to_all_intra(out, inp)`` / ``all_to_all_inter(out, inp)`` exchange equal
    splits within the node and across nodes; returns this rank's partition of the result (fp16, flat)."""
    world = local * nodes
    numel = tensor.numel()
    groups = max(tensor.shape[0], tensor.shape[1], world)
    check_shape(numel, groups, world)
    inter_groups = groups // local
    # Step 2: quantize (fp16 input, as the kernel reads it).
    q, sc = quantize_int4(tensor.reshape(-1).to(torch.float16), groups)
    # Step 3: swizzle: partition p = k·local + d to slot d·nodes + k; then the intra-node all-to-all.
    order = [k * local + d for d in range(local) for k in range(nodes)]
    q = q.view(world, -1)[order].reshape(-1)
    sc = sc.view(world, -1)[order].reshape(-1)
    packed = pack_int4(q)
    recv, recv_sc = torch.empty_like(packed), torch.empty_like(sc)
    all_to_all_intra(recv, packed)
    all_to_all_intra(recv_sc, sc)
    stats["bytes_sent"] += (local - 1) * (packed.numel() + 4 * sc.numel()) // local
    # Step 4: dequantize each local peer's chunk (its nodes partitions for this local index), sum in fp16,
    # re-quantize in groups of the same size.
    per_peer = unpack_int4(recv).view(local, -1)
    per_peer_sc = recv_sc.view(local, -1)
    acc = torch.zeros(per_peer.shape[1], dtype=torch.float16)
    for j in range(local):
        acc = acc + dequantize_int4(per_peer[j], per_peer_sc[j])
    q2, sc2 = quantize_int4(acc, inter_groups)
    # Step 5: across nodes, chunk k (partition k·local + this local index) to node k.
    packed2 = pack_int4(q2)
    recv2, recv_sc2 = torch.empty_like(packed2), torch.empty_like(sc2)
    all_to_all_inter(recv2, packed2)
    all_to_all_inter(recv_sc2, sc2)
    stats["bytes_sent"] += (nodes - 1) * (packed2.numel() + 4 * sc2.numel()) // nodes
    # Step 6: dequantize, sum over nodes, divide by the number of nodes (fp16 throughout, as DeepSpeed).
    final = dequantize_int4(unpack_int4(recv2), recv_sc2)
    return (sum(list(final.chunk(nodes))) / nodes).view(-1)


@torch.no_grad()
def all_to_all_quant_reduce(tensors: List[torch.Tensor], groups: dict) -> List[torch.Tensor]:
    """Drop-in for DeepSpeed 0.19.8's ``all_to_all_quant_reduce(tensors, groups)`` (same arguments, same
    results' layout), emulated on CPU: see the module docstring."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    stats["calls"] += 1
    local = get_accelerator().device_count()
    world = dist.get_world_size()
    nodes = world // local
    rank = dist.get_rank()
    intra_idx, inter_idx = rank // local, rank % local
    out: List[torch.Tensor] = [None] * len(tensors)
    for i, tensor in enumerate(tensors):
        # Step 1: the fallbacks, through DeepSpeed's own reduce-scatter.
        if tensor.dim() == 1 or tensor.numel() % (2 * world) != 0:
            stats["fallback_tensors"] += 1
            out[i] = reduce_scatter_coalesced([tensor])[0]
            continue
        stats["quantized_tensors"] += 1
        res = quant_reduce_one(
            tensor, local, nodes, intra_idx, inter_idx,
            lambda o, x: dist.all_to_all_single(o, x, group=groups[f"local_{intra_idx}"]),
            lambda o, x: dist.all_to_all_single(o, x, group=groups[f"global_{inter_idx}"]))
        out[i] = res.to(tensor.dtype)
    return out


def install() -> None:
    """Make DeepSpeed ZeRO-3 call the emulation where it calls ``all_to_all_quant_reduce``."""
    import deepspeed.runtime.zero.stage3 as stage3

    stage3.all_to_all_quant_reduce = all_to_all_quant_reduce


def reference(inputs: List[torch.Tensor], local: int) -> List[torch.Tensor]:
    """What every rank should get, computed directly from all ranks' inputs (a float reference of the same
    quantization, no swizzle and no collectives): per rank ``r = k·local + d``, partition ``r`` of
    ``Σ_nodes deq(q(Σ_local deq(q(x))))) / nodes`` with the same groups and fp16 steps. For tests."""
    world = len(inputs)
    nodes = world // local
    shape = inputs[0].shape
    groups = max(shape[0], shape[1], world)
    check_shape(inputs[0].numel(), groups, world)
    g_size = inputs[0].numel() // groups
    deq = []
    for x in inputs:
        q, sc = quantize_int4(x.reshape(-1).to(torch.float16), groups)
        deq.append(dequantize_int4(q, sc))
    outs = []
    part = inputs[0].numel() // world
    node_sums = {}
    for k in range(nodes):  # per node, the fp16 sum of its ranks' dequantized tensors, peer by peer
        acc = torch.zeros(inputs[0].numel(), dtype=torch.float16)
        for d in range(local):
            acc = acc + deq[k * local + d]
        node_sums[k] = acc
    for r in range(world):
        sl = slice(r * part, (r + 1) * part)
        chunks = []
        for k in range(nodes):
            x = node_sums[k][sl]
            q, sc = quantize_int4(x, x.numel() // g_size)
            chunks.append(dequantize_int4(q, sc))
        outs.append(sum(chunks) / nodes)
    return outs
