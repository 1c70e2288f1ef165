"""Where 4-bit values lose the small ones: the share of non-zero values that quantize to 0, push, pull and
the reduce-scatter's reply.

Usage (the traces as ``benchmarks/cluster/run_cluster_report.sh``'s ``traces`` stage records them: the first
steps of training the randomly initialized ``llama-lab16.json`` on 16 SimWorld ranks)::

    .venv/bin/python benchmarks/cluster/record_traces.py --out $WORK/traces16 --ranks 16 \\
        --model benchmarks/cluster/configs/llama-lab16.json
    .venv/bin/python benchmarks/cluster/bench_comm.py prepare --work $WORK/workloads --ranks 16
    .venv/bin/python benchmarks/comm/bench_value_bits_zeros.py --workload trace_dgc5=$WORK/traces16/dgc5 \\
        --workload trace_dgc1=$WORK/traces16/dgc1 --workload synth_dgc1=$WORK/workloads/synth_dgc1 \\
        --codes --out benchmarks/comm/results/value_bits_zeros.md

A block of ``VALUE_BLOCK[bits]`` values (128 at 8 bits; at 4, 16 with bf16 scales now, 32 and 128 with fp32
ones before) shares the scale ``amax/qmax``, so at 4 bits a value below ``amax/14`` travels as 0 (error
feedback keeps it, to be sent later). The ops truncate every 4-bit scale to bf16 whatever the block.
Per workload (one recorded step, every rank's selected values) and per width/block (``--widths``):

1. **Push**: each rank's values grouped by owner in the order ZEN sends them (within an owner: ascending
   index, i.e. tensor by tensor of the bucket), against the same segments sorted by index (a check: equal).
2. **Pull**: each owner's carried sums (the first step's, no owner residual) in hash order (the owner's compact
   positions, which mix every tensor of the bucket in each block: how ZEN quantized them until 2026-12-06),
   against ascending global index (each block then mostly one tensor: how ZEN quantizes them now,
   ``core/zen_lowbit.py`` step 4).
3. **Reduce-scatter reply** (ZeRO-2/3, FSDP2: ``core/rs_zen.py``): each hash owner's sums, a segment per range
   owner (``even_ranges``: FSDP's chunks, ZeRO's partitions alike), its touched positions only (the bitmap and
   COO formats DGC's densities pick), in the server's position order within a segment (how the reply went
   until 2026-12-06) against ascending global index (how it goes now: ``_Layout``'s ``index_order``).

4. **Other 4-bit codes** (``--codes``; pure torch, the push by index only, each 4-bit block of ``--widths``): the nearest of
   a non-uniform grid times the block's ``amax`` (powers of two ``2^-6 … 1``; FP4 E2M1 ``{0.5 … 6}/6``),
   against the uniform grid ZEN uses: fewer zeros is not less error.

Reported: the share of non-zero values whose code is 0, and the relative L2 error of the dequantized values.
The gap between the two orders of the pull (and of the reply) is what mixing tensors in a block cost; the
synthetic workload (i.i.d. values, no tensors) is the control, where the order cannot matter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster"))
from bench_comm import load_workload  # noqa: E402

from zen_ext import ops  # noqa: E402
from zen_ext.core.lowbit import VALUE_BLOCK  # noqa: E402
from zen_ext.core.registry import build_scheme  # noqa: E402
from zen_ext.core.rs_base import even_ranges  # noqa: E402


CODES = {"powers of two": [0.0] + [2.0 ** -k for k in range(6, -1, -1)],
         "FP4 E2M1": [0.0, 0.5 / 6, 1 / 6, 1.5 / 6, 2 / 6, 3 / 6, 4 / 6, 1.0]}
"""Step 4's non-uniform 4-bit grids, as fractions of a block's ``amax`` (8 magnitudes and a sign)."""


def zero_share(v: torch.Tensor, ends: list[int], bits: int, block: int, grid: list[float] | None = None
               ) -> tuple[int, int, float, float]:
    """(non-zero values coded 0, non-zero values, squared error, squared norm) of ``v`` quantized in ``ends``
    (``grid``: step 4's nearest-magnitude code instead of ZEN's, segments ignored)."""
    if grid is None:
        _, _, deq = ops.quantize_blocks(v, ends, bits, block)
    else:
        g, n = torch.tensor(grid), v.numel()
        m = torch.cat([v, v.new_zeros(-n % block)]).view(-1, block)
        a = m.abs().amax(1, keepdim=True)
        r = torch.where(a > 0, m.abs() / torch.where(a > 0, a, torch.ones_like(a)), torch.zeros_like(m))
        deq = (torch.sign(m) * g[(r.unsqueeze(-1) - g).abs().argmin(-1)] * a).flatten()[:n]
    nz = v != 0
    return int(((deq == 0) & nz).sum()), int(nz.sum()), float(((deq - v) ** 2).sum()), float((v ** 2).sum())


def measure(step, bits: int, block: int) -> dict:
    """Steps 1-3 of the module docstring on one recorded step (its single slice), and step 4's codes."""
    (grads,) = step.slices.values()
    n, numel = len(grads), grads[0].numel
    part = build_scheme("zen").partitioner(numel, n)
    out = {k: [0, 0, 0.0, 0.0] for k in ("push today", "push by index", "pull hash order", "pull by index",
                                          "reply hash order", "reply by index", *CODES)}

    def add(key, got):
        out[key] = [a + b for a, b in zip(out[key], got)]

    # Step 1: push, per rank.
    total = torch.zeros(numel)
    for g in grads:
        total.index_add_(0, g.indices.long(), g.values.float())
        counts, order, _, _ = part.partition(g.indices)
        ends = counts.cumsum(0).tolist()
        vals, gi = g.values.float()[order], g.indices.long()[order]
        add("push today", zero_share(vals, ends, bits, block))
        starts = [0] + ends[:-1]
        by_index = torch.cat([vals[s:e][torch.argsort(gi[s:e])] for s, e in zip(starts, ends)]) if ends else vals
        add("push by index", zero_share(by_index, ends, bits, block))
        for code, grid in CODES.items():  # Step 4
            add(code, zero_share(by_index, ends, bits, block, grid))
    # Step 2: pull, per owner: the touched positions' sums.
    touched = torch.zeros(numel, dtype=torch.bool)
    for g in grads:
        touched[g.indices.long()] = True
    idx = touched.nonzero().flatten()
    y = ops.permute(idx, numel, part.keys)
    owner, pos = y % n, y // n
    for i in range(n):
        sel = owner == i
        gi, p = idx[sel], pos[sel]
        add("pull hash order", zero_share(total[gi[torch.argsort(p)]], [int(sel.sum())], bits, block))
        add("pull by index", zero_share(total[gi[torch.argsort(gi)]], [int(sel.sum())], bits, block))
    # Step 3: the reduce-scatter's reply, per hash owner: a segment per range owner.
    ends_R = torch.tensor([e for _, e in even_ranges(numel, n)])
    for i in range(n):
        sel = owner == i
        gi, p = idx[sel], pos[sel]
        rng = torch.searchsorted(ends_R, gi, right=True)
        seg = torch.bincount(rng, minlength=n).cumsum(0).tolist()
        by_pos = torch.argsort(rng * (numel // n + 2) + p)  # range owner, then position: the old S_ir order
        add("reply hash order", zero_share(total[gi[by_pos]], seg, bits, block))
        add("reply by index", zero_share(total[gi[torch.argsort(gi)]], seg, bits, block))  # ranges ascend with index
    return {k: dict(zero_share=z / max(1, c), rel_l2=(e / r) ** 0.5 if r else 0.0, values=c)
            for k, (z, c, e, r) in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", action="append", required=True, help="label=path[@step]; repeatable")
    p.add_argument("--widths", nargs="+", default=["4/16", "4/32", "4/128", "8/128"],
                   help="bits/block pairs (default: ZEN's 4 bits now and before, and its 8 bits)")
    p.add_argument("--codes", action="store_true", help="step 4: other 4-bit codes on the push")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = ["# Where low-bit values lose the small ones", "",
             f"Generated by `benchmarks/comm/bench_value_bits_zeros.py` ({time.strftime('%Y-%m-%d')}; method and "
             "commands in its docstring): the share of non-zero values whose code is 0 and the relative L2 error "
             f"after quantizing in blocks (scale amax / qmax, truncated to bf16 at 4 bits; ZEN's blocks: {VALUE_BLOCK}), on the push (each rank's selected "
             "values per owner), on the pull (each owner's sums, first step, no owner residual) and on the "
             "reduce-scatter's reply (the same sums, a segment per range owner), in hash order (ZEN's pull and reply "
             "until 2026-12-06) and by ascending index (tensor by tensor: ZEN's push, and its pull and reply since).",
             "",
             "| workload | ranks | bits | block | push: ZEN's order | push: by index | pull: hash order (before) "
             "| pull: by index (now) | reduce-scatter reply: hash order (before) "
             "| reduce-scatter reply: by index (now) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    codes = ["| workload | block | uniform (ZEN) | " + " | ".join(CODES) + " |", "|---|---|---|" + "---|" * len(CODES)]
    for spec in a.workload:
        label, _, step = load_workload(spec)
        for width in a.widths:
            bits, block = (int(x) for x in width.split("/"))
            r = measure(step, bits, block)
            cell = lambda k: f"{100 * r[k]['zero_share']:.1f} % coded 0, L2 {r[k]['rel_l2']:.3f}"  # noqa: E731
            if bits == 4 and a.codes:
                codes.append(f"| `{label}` | {block} | {cell('push by index')} | " + " | ".join(cell(c) for c in CODES) + " |")
            lines.append(f"| `{label}` | {step.world_size} | {bits} | {block} | {cell('push today')} | {cell('push by index')} | "
                         f"{cell('pull hash order')} | {cell('pull by index')} | {cell('reply hash order')} | "
                         f"{cell('reply by index')} |")
            print(lines[-1], flush=True)
    if a.codes:
        lines += ["", "Other 4-bit codes (step 4), the push by index, the same bytes as ZEN's uniform grid:", "", *codes]
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
