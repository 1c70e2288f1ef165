"""Bytes on ZEN's wire with ``zen.dgc.value_bits`` (8 and 4) against today's values in the gradient's dtype.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_value_bits.py \\
        --out benchmarks/comm/results/value_bits_bytes.md

1. One bucket of ``--numel`` elements (default 2^22, as one 16 MB fp32 DDP bucket) under DGC (the
   Synchronizer's path: ``zen`` scheme, per-tensor selection over 8 equal tensors, no warm-up ramp, no
   momentum correction), in a SimWorld of ``--ranks`` (16) ranks; Gaussian gradients, a different draw per
   rank and step (so the ranks' selections overlap as independent ones do).
2. Per (density, dtype, value_bits): ``--steps`` steps (default 3), the last measured. Every message of
   the push (``exchange_v``) and the pull (``all_gather_v``) is recorded and split into its parts: push
   indices / values / scales (a message's count follows from its size), pull header / index part (hash
   bitmap or COO positions) / values / scales (from its header). Bytes a rank sends: its push messages to
   the other ranks, its pull message times ``n − 1`` (the communicator's own headers excluded; they are
   the same in every variant).
3. Reported per configuration: the busiest rank's bytes (push, pull, total), the split summed over
   ranks as shares, and the ratio of the busiest rank's total to today's fp32 and bf16 runs of the same
   density. Exact byte counts (deterministic inputs); no timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from zen_ext import SimWorld  # noqa: E402
from zen_ext.core import lowbit  # noqa: E402
from zen_ext.core.registry import build_scheme  # noqa: E402
from zen_ext.core.types import index_dtype  # noqa: E402
from zen_ext.core.wire import view_as  # noqa: E402
from zen_ext.core.zen_wire import FMT_BITMAP, FMT_COO, FMT_DENSE  # noqa: E402
from zen_ext.reduction.plan import GradSlice  # noqa: E402
from zen_ext.reduction.synchronizer import Synchronizer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARTS = ("push_idx", "push_val", "push_scale", "pull_head", "pull_idx", "pull_val", "pull_scale")


class Recorder:
    """Wraps one rank's communicator: records the messages it sends in the push and the pull."""

    def __init__(self, comm):
        self.comm, self.push, self.pull = comm, [], []
        ex, ag = comm.exchange_v, comm.all_gather_v

        def exchange_v(msgs, *a, **k):
            self.push.append([m.numel() for m in msgs])
            return ex(msgs, *a, **k)

        self.depth = 0

        def all_gather_v(msg, *a, **k):  # one may call the other: record the outermost call only
            if not self.depth:
                self.pull.append(msg.clone())
            self.depth += 1
            try:
                return ag(msg, *a, **k)
            finally:
                self.depth -= 1

        comm.exchange_v, comm.all_gather_v = exchange_v, all_gather_v
        start = getattr(comm, "all_gather_v_start", None)
        if start is not None:  # today's pull starts asynchronously: record it there too
            def all_gather_v_start(msg, *a, **k):
                if not self.depth:
                    self.pull.append(msg.clone())
                self.depth += 1
                try:
                    return start(msg, *a, **k)
                finally:
                    self.depth -= 1

            comm.all_gather_v_start = all_gather_v_start

    def clear(self):
        self.push, self.pull = [], []


def split(rec: Recorder, n: int, rank: int, numel: int, vbytes: int, bits: int | None) -> dict:
    """The bytes this rank sent, by part."""
    isz = torch.empty(0, dtype=index_dtype(numel)).element_size()
    out = dict.fromkeys(PARTS, 0)
    for sizes in rec.push:
        for j, size in enumerate(sizes):
            if j == rank or size == 0:
                continue
            m_j = max(0, (numel - j + n - 1) // n)
            if bits:
                c = lowbit.push_count(size, isz, bits)
                out["push_idx"] += c * isz
                out["push_scale"] += lowbit.SCALE_BYTES[bits] * ((c + lowbit.VALUE_BLOCK[bits] - 1) // lowbit.VALUE_BLOCK[bits])
                out["push_val"] += (c * bits + 7) // 8
            elif size == m_j * vbytes:  # the partition sent dense
                out["push_val"] += size
            else:
                c = size // (isz + vbytes)
                out["push_idx"] += c * isz
                out["push_val"] += c * vbytes
    for msg in rec.pull:
        fmt, count = view_as(msg, 0, 2, torch.int64).tolist()
        m = max(0, (numel - rank + n - 1) // n)
        head, total = 16, msg.numel()
        if bits:
            scales = lowbit.SCALE_BYTES[bits] * ((count + lowbit.VALUE_BLOCK[bits] - 1) // lowbit.VALUE_BLOCK[bits])
            vals = (count * bits + 7) // 8
        else:
            scales, vals = 0, count * vbytes if fmt != FMT_DENSE else m * vbytes
        idx = total - head - scales - vals
        for k, v in (("pull_head", head), ("pull_idx", idx), ("pull_val", vals), ("pull_scale", scales)):
            out[k] += v * (n - 1)
    return out


def run(n: int, numel: int, density: float, dtype, bits, steps: int) -> list[dict]:
    names = [f"w{i}" for i in range(8)]
    each = numel // 8
    slices = [GradSlice(nm, i * each, each, (each // 512, 512)) for i, nm in enumerate(names)]
    dgc = {"enabled": True, "density": density, "momentum_correction": False, "warmup_steps": 0,
           "value_bits": bits}

    def fn(comm):
        rec = Recorder(comm)
        sync = Synchronizer(dp_comm=comm, scheme=build_scheme("zen"), param_kinds={nm: "dgc" for nm in names},
                            dgc=dgc)
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + comm.rank)
            x = torch.randn(each * 8, generator=g).to(dtype)
            rec.clear()
            sync.sync_flat(x, slices, "mean")
            sync.end_step()
        vbytes = torch.empty(0, dtype=dtype).element_size()
        return split(rec, comm.size, comm.rank, each * 8, vbytes, bits)

    return SimWorld(n).run(fn)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for density in args.densities:
        base = {}
        for dt in args.dtypes:
            for bits in (None, 8, 4):
                t0 = time.perf_counter()
                per_rank = run(args.ranks, args.numel, density, DTYPES[dt], bits, args.steps)
                tot = [sum(r.values()) for r in per_rank]
                busiest = max(range(args.ranks), key=lambda r: tot[r])
                b = per_rank[busiest]
                push = sum(v for k, v in b.items() if k.startswith("push"))
                pull = sum(v for k, v in b.items() if k.startswith("pull"))
                allp = {k: sum(r[k] for r in per_rank) for k in PARTS}
                s = sum(allp.values())
                row = dict(density=density, dtype=dt, bits=bits, push=push, pull=pull, total=push + pull,
                           shares={k: allp[k] / s for k in PARTS})
                if bits is None:
                    base[dt] = row["total"]
                rows.append(row)
                print(f"density {density} {dt} bits {bits}: busiest {push + pull} B (push {push}, pull {pull}) "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
        for row in rows:
            if row["density"] == density:
                row["x_fp32"] = base.get("fp32", float("nan")) / row["total"]
                row["x_bf16"] = base.get("bf16", float("nan")) / row["total"]
    cmd = (f"OMP_NUM_THREADS=1 .venv/bin/python benchmarks/comm/bench_value_bits.py --ranks {args.ranks} --numel "
           f"{args.numel} --densities {' '.join(map(str, args.densities))} --dtypes {' '.join(args.dtypes)} --steps "
           f"{args.steps}" + (f" --out {os.path.relpath(args.out)}" if args.out else ""))
    lines = ["# Bytes with zen.dgc.value_bits", "", f"Command: `{cmd}`", "",
             f"Generated by `benchmarks/comm/bench_value_bits.py` ({time.strftime('%Y-%m-%d')}; method in its "
             f"docstring): SimWorld, {args.ranks} ranks, one bucket of {args.numel} elements (8 tensors), DGC per "
             f"tensor, `zen` scheme (pull format: the cheapest per message), step {args.steps} of {args.steps}. "
             "Bytes of the busiest rank (the communicator's headers excluded); the split is over all ranks' "
             "bytes; ×fp32 / ×bf16 = today's busiest-rank bytes at that gradient dtype over this row's.", "",
             "| density | grads | value bits | push B | pull B | total B | × fp32 today | × bf16 today | push idx | "
             "push val | push scale | pull idx | pull val | pull scale |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = r["shares"]
        lines.append(f"| {r['density'] * 100:g} % | {r['dtype']} | {r['bits'] or 'dtype'} | {r['push']:,} | "
                     f"{r['pull']:,} | {r['total']:,} | {r['x_fp32']:.2f} | {r['x_bf16']:.2f} | "
                     f"{sh['push_idx']:.0%} | {sh['push_val']:.0%} | {sh['push_scale']:.0%} | "
                     f"{sh['pull_idx'] + sh['pull_head']:.0%} | {sh['pull_val']:.0%} | {sh['pull_scale']:.0%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
