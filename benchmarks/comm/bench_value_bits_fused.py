"""CPU time of ``zen.dgc.value_bits``' sender and owner steps: the fused ops against the torch sequences they
replaced (``core/zen_lowbit.py`` before the fusion), on one bucket, in the same run.

Usage::

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/comm/bench_value_bits_fused.py \\
        --out benchmarks/comm/results/value_bits_fused.md

1. One bucket of ``--numel`` elements (default 2^22, a 16 MB fp32 DDP bucket) at DGC ``--density`` (1 %) in a
   world of ``--ranks`` (16): every rank selects ``density · numel`` distinct positions (uniform, a new draw
   per rank), values Gaussian with a log-normal spread (DGC's selected tail); ZEN's hash partition
   (``zen`` scheme, seed 0) groups each rank's selection by owner, and owner 0's contributions are the 16
   ranks' segments for partition 0, quantized as their senders do.
2. Three steps, each timed both ways, interleaved per repeat (``--reps``, default 20, after 2 warm-ups):
   * **sender** (rank 0): gather its values in owner order, quantize, DGC's feedback ``R[pos] += sent − x̂``
     into its fp32 residual (unfused: ``index_select``, ``quantize_blocks``, ``index_select`` ×2, casts,
     ``sub``, ``index_add_``; fused: ``quantize_sent_``);
   * **owner aggregation** (owner 0): every contribution dequantized and summed in fp32 into the owner's
     compact buffer, touched positions marked (unfused: ``dequantize_blocks``, ``index_add_``,
     ``index_fill_``; fused: ``dequantize_add_blocks_``); the buffers' allocation and the messages'
     concatenation, common to both, are timed too;
   * **owner pull** (owner 0): the touched positions' sums plus the owner residual, quantized, the owner
     residual updated to ``sum − applied`` (mean over the ranks, the gradient's dtype; unfused:
     ``index_select`` ×3, ``add``, ``quantize_blocks``, ``div``/cast/``mul``, ``sub``, ``isfinite``,
     ``where``, ``index_copy_``; fused: ``quantize_owned_``).
   Each way keeps its own copy of the residuals across repeats (the work does not depend on what they
   hold); both ways' outputs are checked equal bit for bit first, from the same state.
3. Reported per (gradient dtype, bits): min / median / max ms of each step both ways and the ratio of the
   medians (unfused / fused), per one bucket. One thread (``OMP_NUM_THREADS=1``), a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.comm.bench_outer_bytes import provenance  # noqa: E402
from zen_ext import ops  # noqa: E402
from zen_ext.core.registry import build_scheme  # noqa: E402
from zen_ext.ops._reference_lowbit import applied  # noqa: E402

BLOCK = 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_bucket(numel: int, n: int, density: float, dtype, bits: int, seed: int = 0) -> dict:
    """Step 1: rank 0's selection (sender) and owner 0's contributions (owner)."""
    g = torch.Generator().manual_seed(seed)
    K = int(density * numel)
    part = build_scheme("zen").partitioner(numel, n)
    owner_pos, owner_vals, counts = [], [], []
    sender = None
    for r in range(n):
        idx = torch.randperm(numel, generator=g)[:K].sort().values
        vals = (torch.randn(K, generator=g) * torch.exp(torch.randn(K, generator=g))).to(dtype)
        counts_P, order_K, pos_K, _ = part.partition(idx)
        bounds = counts_P.to(torch.int64).cumsum(0).tolist()
        if r == 0:
            sender = dict(values=vals, order=order_K, pos=idx, bounds=bounds, R=torch.randn(numel, generator=g) * 0.01)
        k0 = bounds[0]  # the segment this rank pushes to owner 0
        owner_pos.append(pos_K[:k0])
        owner_vals.append(vals.index_select(0, order_K[:k0]))
        counts.append(k0)
    # What owner 0 receives: each sender's segment quantized as its sender does (one segment each).
    cd, sc = [], []
    for v in owner_vals:
        c, s, _ = ops.quantize_blocks(v, [v.numel()], bits, BLOCK)
        cd.append(c)
        sc.append(s)
    m = part.part_size(0)
    return dict(sender=sender, pos=owner_pos, codes=cd, scales=sc, ends=torch.tensor(counts).cumsum(0).tolist(), m=m,
                R_owner=torch.randn(m, generator=g) * 0.01, dtype=dtype, bits=bits, n=n)


# --- the sequences before the fusion (core/zen_lowbit.py and DGC's sender_feedback) ---------------------------
def sender_unfused(b, R):
    s = b["sender"]
    codes, scales, deq = ops.quantize_blocks(s["values"].index_select(0, s["order"]), s["bounds"], b["bits"], BLOCK)
    idx = s["pos"].index_select(0, s["order"])
    sent = s["values"].index_select(0, s["order"])
    R.index_add_(0, idx, sent.to(torch.float32) - deq.to(torch.float32))
    return codes, scales


def sender_fused(b, R):
    s = b["sender"]
    codes, scales, _ = ops.quantize_sent_(s["values"], s["order"], R, s["pos"], s["bounds"], b["bits"], BLOCK)
    return codes, scales


def aggregate_unfused(b):
    acc = torch.zeros(b["m"], dtype=torch.float32)
    touched = torch.zeros(b["m"], dtype=torch.bool)
    pos_R = torch.cat(b["pos"]).to(torch.int64)
    acc.index_add_(0, pos_R, ops.dequantize_blocks(torch.cat(b["codes"]), torch.cat(b["scales"]), b["ends"], b["bits"],
                                                   BLOCK))
    touched.index_fill_(0, pos_R, True)
    return acc, touched


def aggregate_fused(b):
    acc = torch.zeros(b["m"], dtype=torch.float32)
    touched = torch.zeros(b["m"], dtype=torch.bool)
    ops.dequantize_add_blocks_(acc, touched, torch.cat(b["pos"]), torch.cat(b["codes"]), torch.cat(b["scales"]),
                               b["ends"], b["bits"], BLOCK)
    return acc, touched


def pull_unfused(b, acc, pos_C, R):
    S_C = acc.index_select(0, pos_C) + R.index_select(0, pos_C)
    codes, scales, deq = ops.quantize_blocks(S_C, [pos_C.numel()], b["bits"], BLOCK)
    new = S_C - applied(deq, b["dtype"], b["n"])
    R.index_copy_(0, pos_C, torch.where(torch.isfinite(new), new, R.index_select(0, pos_C)))
    return codes, scales


def pull_fused(b, acc, pos_C, R):
    return ops.quantize_owned_(acc, pos_C, R, [pos_C.numel()], b["bits"], BLOCK, b["dtype"], b["n"])


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def measure(b: dict, reps: int, warmup: int = 2) -> dict:
    """Step 2: per step, both ways interleaved per repeat; outputs checked equal first."""
    R0, Ro0 = b["sender"]["R"], b["R_owner"]
    # Bitwise check.
    R1, R2 = R0.clone(), R0.clone()
    assert all(torch.equal(x, y) for x, y in zip(sender_unfused(b, R1), sender_fused(b, R2))) and torch.equal(R1, R2)
    a1, a2 = aggregate_unfused(b), aggregate_fused(b)
    assert torch.equal(a1[0], a2[0]) and torch.equal(a1[1], a2[1])
    acc, touched = a1
    pos_C = torch.nonzero(touched).flatten()
    R1, R2 = Ro0.clone(), Ro0.clone()
    assert all(torch.equal(x, y) for x, y in zip(pull_unfused(b, acc, pos_C, R1), pull_fused(b, acc, pos_C, R2)))
    assert torch.equal(R1, R2)
    steps = {
        "sender": (lambda R: sender_unfused(b, R), lambda R: sender_fused(b, R), R0),
        "owner aggregation": (lambda _: aggregate_unfused(b), lambda _: aggregate_fused(b), None),
        "owner pull": (lambda R: pull_unfused(b, acc, pos_C, R), lambda R: pull_fused(b, acc, pos_C, R), Ro0),
    }
    out = {}
    for name, (unf, fus, base) in steps.items():
        times = {"unfused": [], "fused": []}
        # One residual per way, reused: a fresh 16 MB copy per repeat made the sender's times swing with the
        # allocator (the values it accumulates do not change the work).
        mine = {way: base.clone() if base is not None else None for way in times}
        for rep in range(warmup + reps):
            for way, fn in (("unfused", unf), ("fused", fus)) if rep % 2 == 0 else (("fused", fus), ("unfused", unf)):
                R = mine[way]
                dt = _timed(lambda: fn(R))
                if rep >= warmup:
                    times[way].append(dt)
        out[name] = times
    out["_sizes"] = dict(sender_K=b["sender"]["values"].numel(), owner_contributions=b["ends"][-1],
                         owner_carried=pos_C.numel(), owner_m=b["m"])
    return out


def _mmm(ts: list[float]) -> str:
    return f"{min(ts):.3f} / {statistics.median(ts):.3f} / {max(ts):.3f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--cases", nargs="+", default=["fp32:4", "fp32:8", "bf16:4"], help="dtype:bits")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "# value_bits: fused sender and owner ops against the unfused torch sequences (CPU)",
        "",
        f"Generated by `benchmarks/comm/bench_value_bits_fused.py` (its docstring: what is timed). One bucket of "
        f"{args.numel:,} elements, DGC {args.density:.0%}, {args.ranks} ranks, ZEN's hash partition, mean; "
        f"{args.reps} repeats per way, interleaved, after 2 warm-ups; outputs equal bit for bit. "
        + provenance("one thread; the ratios compare two ways timed in the same run") + ".",
        "",
        "| gradient | bits | step | elements | unfused ms (min / median / max) | fused ms (min / median / max) "
        "| unfused / fused (medians) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in args.cases:
        dname, bits = case.split(":")
        b = make_bucket(args.numel, args.ranks, args.density, DTYPES[dname], int(bits))
        got = measure(b, args.reps)
        sz = got.pop("_sizes")
        elems = {"sender": f"{sz['sender_K']:,} selected", "owner aggregation": f"{sz['owner_contributions']:,} received",
                 "owner pull": f"{sz['owner_carried']:,} carried of {sz['owner_m']:,}"}
        for name, t in got.items():
            ratio = statistics.median(t["unfused"]) / statistics.median(t["fused"])
            lines.append(f"| {dname} | {bits} | {name} | {elems[name]} | {_mmm(t['unfused'])} | {_mmm(t['fused'])} "
                         f"| {ratio:.2f}× |")
            print(lines[-1], flush=True)
        tot = {w: sum(statistics.median(t[w]) for t in got.values()) for w in ("unfused", "fused")}
        lines.append(f"| {dname} | {bits} | **the three** (sum of medians) | | {tot['unfused']:.3f} | {tot['fused']:.3f} "
                     f"| {tot['unfused'] / tot['fused']:.2f}× |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
