"""Bytes per outer step of zen.outer on real pseudo-gradients, against SparseLoCo's all-gather.

Each of R replicas starts from a short shared training run, then trains alone on its own data shard
(AdamW, its state kept across rounds) for H steps per round (the replicas train one after the other on
one model, so memory holds one model, not R); at the end of each round, in SimWorld, zen.outer
(chunked top-k with error feedback, ``zen_ext/outer/``) sums the picks. On the same picks, in the
same outer step, this script also sums them with:

* ``zen`` with one value per pick (``average: "mean"``: index + 1 value), and with ``(value, 1)`` rows
  (``average: "contributors"``: the count of senders per index rides along);
* ``agsparse``: the all-gather SparseLoCo runs (each replica receives (R−1)·k entries), measured;
  its formula ``(R−1)·K·(4 + 4)`` bytes (int32 index, fp32 value) is printed next to it.

Bytes are what each rank sends (SimWorld's counters), mean over ranks, per outer step, averaged over
rounds 2.. (round 1's error feedback is empty). ``union`` = |∪ picks| / (R·K): the overlap of the
replicas' picks (1: disjoint; 1/R: identical).

Usage: nice -n 10 python benchmarks/comm/bench_outer_bytes.py --replicas 4 8 16 --out benchmarks/comm/results/outer_bytes.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from recipes.common import build_model, build_tokenizer, load_texts, pack_tokens, train_batches  # noqa: E402
from zen_ext.comm.simulated import SimWorld  # noqa: E402
from zen_ext.core.registry import build_scheme  # noqa: E402
from zen_ext.core.types import SparseGrad  # noqa: E402
from zen_ext.outer import OuterSync  # noqa: E402


class _Measured(OuterSync):
    """zen.outer whose outer step also sums the same picks with the compared schemes (bytes only)."""

    def __init__(self, *a, compare=(), **k):
        self.compare = [(label, build_scheme(s), w) for label, s, w in compare]
        self.rows = []
        super().__init__(*a, **k)

    def _sparse_sum(self, i, b, idx_K, val_K):
        comm = self.comm
        got = {}
        for label, scheme, width in self.compare:
            vals = torch.stack([val_K, torch.ones_like(val_K)], 1) if width == 2 else val_K
            before = comm.stats.snapshot()
            with comm.slot(("cmp", label, i)):
                scheme.sync_group(comm, [SparseGrad(idx_K, vals, b.numel, in_range=True)], "sum", keys=[label])
            got[label] = (comm.stats - before).bytes_sent
        out = super()._sparse_sum(i, b, idx_K, val_K)
        got["union"] = int(out[1].gt(0).sum())
        got["picks"] = idx_K.numel()
        self.rows.append(got)
        return out


def _train_replica(model, opt, batches, steps: int) -> None:
    for _ in range(steps):
        x = next(batches)
        model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def run_replicas(args, model, start_flat, blocks, R: int) -> tuple[list[list[dict]], int]:
    """R replicas, ``args.rounds`` rounds: each replica trains H steps alone (one after the other on one
    model, its AdamW state kept on the side), then one SimWorld outer step over all of them.

    Each rank's OuterSync lives across rounds (its error feedback must); its parameters are views into
    that replica's flat buffer, and each round's SimWorld hands it that round's communicator.
    Returns per rank the per-round rows (summed over buckets) and the number of elements."""
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    locals_ = [start_flat.clone() for _ in range(R)]
    views = []
    for buf in locals_:
        at, named = 0, []
        for n, s in shapes:
            k = torch.Size(s).numel()
            named.append((n, torch.nn.Parameter(buf[at:at + k].view(s), requires_grad=True)))
            at += k
        views.append(named)
    opt_states = [None] * R
    outers: list = [None] * R
    cfg = dict(enabled=True, every=args.every, density=args.density, chunk=4096, error_decay=0.95)
    compare = [("zen_mean", "zen", 1), ("zen_contrib", "zen", 2), ("agsparse", "agsparse", 1)]

    def outer_step(comm):
        if outers[comm.rank] is None:
            outers[comm.rank] = _Measured(views[comm.rank], comm, cfg, scheme="zen", compare=compare,
                                          bucket_cap_mb=args.bucket_cap_mb)
        o = outers[comm.rank]
        o.comm = comm  # this round's SimWorld communicator
        o.outer_step()

    world = SimWorld(R, max_active=args.max_active)
    world.run(lambda c: outers.__setitem__(c.rank, _Measured(views[c.rank], c, cfg, scheme="zen", compare=compare,
                                                             bucket_cap_mb=args.bucket_cap_mb)))
    theta = start_flat
    for rnd in range(args.rounds):
        for r in range(R):
            with torch.no_grad():
                at = 0
                for p in model.parameters():
                    p.copy_(theta[at:at + p.numel()].view_as(p))
                    at += p.numel()
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
            if opt_states[r] is not None and not args.reset_inner_opt:
                opt.load_state_dict(opt_states[r])
            batches = train_batches(blocks, args.micro_batch, r, R, seed=1, start_step=rnd * args.every)
            _train_replica(model, opt, batches, args.every)
            opt_states[r] = None if args.reset_inner_opt else opt.state_dict()
            locals_[r].copy_(_flat(model))
        world.run(outer_step)
        theta = torch.cat([b.theta_N for b in outers[0].buckets]).clone()
    rows = []
    for o in outers:
        nb = len(o.buckets)
        rows.append([{k: sum(row[k] for row in o.rows[i * nb:(i + 1) * nb]) for k in o.rows[0]}
                     for i in range(args.rounds)])
    return rows, start_flat.numel()


def provenance(note: str = "bytes are counted, not timed") -> str:
    """When, at which commit and where the run was made (the results files' rule, benchmarks/README.md);
    also the outer-sync quality benchmark's (``benchmarks/quality/bench_outer_quality.py``)."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=30).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return (f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC at commit {commit} on a shared 2-core CPU "
            f"machine (other jobs running{'; ' + note if note else ''})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="configs/models/llama-tiny-untied.json")
    p.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--every", type=int, default=15, help="H (SparseLoCo's 512M sweep: 15)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shared_steps", type=int, default=30)
    p.add_argument("--density", type=float, default=64 / 4096)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket_cap_mb", type=float, default=128.0)
    p.add_argument("--reset_inner_opt", action="store_true",
                   help="a fresh AdamW per replica each round (memory: R AdamW states are not kept; large models)")
    p.add_argument("--max_active", type=int, default=1, help="SimWorld ranks computing at once (memory)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    texts = load_texts("pydoc")
    tok = build_tokenizer("train", texts, os.path.join(ROOT, "runs", "outer_bytes_tok"), 1024)
    args.vocab = len(tok)
    blocks = pack_tokens(texts, tok, args.seq_len)
    # The shared start: one model on every block's first share.
    model = build_model(args.model, vocab_size=args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    shared = train_batches(blocks, args.micro_batch, 0, 1, seed=0)
    for _ in range(args.shared_steps):
        x = next(shared)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    start_flat = _flat(model)
    del opt
    P = start_flat.numel()
    lines = [f"# zen.outer: bytes per outer step against SparseLoCo's all-gather ({os.path.basename(args.model)})", "",
             f"Command: `nice -n 10 python benchmarks/comm/bench_outer_bytes.py --model {args.model} --replicas "
             f"{' '.join(map(str, args.replicas))} --every {args.every} --rounds {args.rounds} --shared_steps "
             f"{args.shared_steps} --density {args.density}{' --reset_inner_opt' if args.reset_inner_opt else ''} --out "
             f"{args.out}`", "",
             f"P = {P:,} parameters; after {args.shared_steps} shared AdamW steps each replica trains alone on its "
             f"own shard of the pydoc text (seq {args.seq_len}, micro-batch {args.micro_batch}, AdamW lr {args.lr}"
             f"{', a fresh AdamW each round' if args.reset_inner_opt else ', its AdamW state kept across rounds'}), "
             f"H = {args.every} steps per round, {args.rounds} rounds; zen.outer with SparseLoCo's defaults (top-"
             f"{round(args.density * 4096)} of 4,096 per chunk, β 0.95, contributors, lr 1). Bytes each replica sends "
             f"per outer step (SimWorld's counters; mean over replicas, min/median/max over rounds 2..{args.rounds}; "
             f"round 1's error feedback starts empty). fp32 values everywhere; all-gather formula: (R−1)·K·(4 + 4) "
             f"(int32 index + fp32 value); SparseLoCo's own wire (2-bit values, 12-bit indices) would be "
             f"(R−1)·K·1.75 B.", "",
             "| R | K picks / replica | union / (R·K) | ZEN mean (1 value) MB | ZEN contributors (value, 1) MB | "
             "AGsparse all-gather MB (measured) | all-gather formula MB | ZEN mean / all-gather | "
             "ZEN contributors / all-gather | dense ring all-reduce MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    MB = 1e6
    for R in args.replicas:
        t = time.time()
        rows, numel = run_replicas(args, model, start_flat, blocks, R)
        rounds = range(1, args.rounds) if args.rounds > 1 else range(1)

        def per(key, r):
            return statistics.mean(rank[r][key] for rank in rows)
        K = rows[0][0]["picks"]
        unions = [rows[0][r]["union"] / (R * K) for r in rounds]
        print(f"R={R} union per round: {[round(rows[0][r]['union'] / (R * K), 3) for r in range(args.rounds)]}",
              flush=True)
        zm = [per("zen_mean", r) / MB for r in rounds]
        zc = [per("zen_contrib", r) / MB for r in rounds]
        ag = [per("agsparse", r) / MB for r in rounds]
        formula = (R - 1) * K * 8 / MB
        dense = 2 * (R - 1) / R * numel * 4 / MB

        def mmm(v, f="{:.3f}"):
            v = sorted(v)
            return "/".join(f.format(x) for x in (v[0], statistics.median(v), v[-1]))
        lines.append(f"| {R} | {K:,} | {mmm(unions)} | {mmm(zm)} | {mmm(zc)} | {mmm(ag)} | {formula:.3f} | "
                     f"{mmm([a / b for a, b in zip(zm, ag)], '{:.2f}')} | {mmm([a / b for a, b in zip(zc, ag)], '{:.2f}')} | "
                     f"{dense:.3f} |")
        print(lines[-1], f"({time.time() - t:.0f} s)", flush=True)
        _write(args.out, lines + ["", f"{provenance()}; {time.time() - t0:.0f} s so far."])
    _write(args.out, lines + ["", f"{provenance()}; {time.time() - t0:.0f} s in total."])


def _write(path: str, lines: list[str]) -> None:
    """The results file, rewritten after every R (a run stopped for memory keeps the rows it has)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
