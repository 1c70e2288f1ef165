"""Bytes per outer step of zen.outer on real pseudo-gradients, against SparseLoCo's all-gather.

Each of R replicas starts from a short shared training run, then trains alone on its own data shard
(AdamW, its state kept across rounds) for H steps per round (the replicas train one after the other on
one model, so memory holds one model, not R); at the end of each round, in SimWorld, zen.outer
(chunked top-k with error feedback, ``zen_ext/outer/``) sums the picks. On the same picks, in the
same outer step, this script also sums them with:

* ``zen`` with contributors counted at its owners (``op="contributors"``, what zen.outer sends by
  default), with fp32 values and with 8- and 4-bit values (``zen.outer.value_bits``); with one value
  per pick averaged over R (``average: "mean"``); and with ``(value, 1)`` rows (the form schemes that
  cannot count use; its count column gives the exact union of the picks);
* ``agsparse``: the all-gather SparseLoCo runs (each replica receives (R−1)·k entries), measured at
  fp32; at 8 and 4 bits, and SparseLoCo's own 2-bit/12-bit wire, by formula (the results file states
  each).

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
from zen_ext.core.lowbit import value_bytes  # noqa: E402
from zen_ext.core.lowbit import LowBitValues  # noqa: E402
from zen_ext.core.registry import build_scheme  # noqa: E402
from zen_ext.core.types import SparseGrad  # noqa: E402
from zen_ext.outer import OuterSync  # noqa: E402


class _Measured(OuterSync):
    """zen.outer whose outer step also sums the same picks with the compared forms (bytes only).

    ``compare``: ``(label, scheme name, form, value bits)``; form ``"mean"`` (one value per pick, op
    sum), ``"rows"`` (``(value, 1)`` rows, op sum: its count column gives the exact union) or
    ``"counted"`` (op contributors: the owners count the senders); bits None (fp32), 8 or 4."""

    def __init__(self, *a, compare=(), **k):
        self.compare = [(label, build_scheme(s), form, bits) for label, s, form, bits in compare]
        self.rows = []
        super().__init__(*a, **k)

    def _sparse_sum(self, i, b, idx_K, val_K):
        comm = self.comm
        got = {}
        for label, scheme, form, bits in self.compare:
            vals = torch.stack([val_K, torch.ones_like(val_K)], 1) if form == "rows" else val_K
            lowbit = LowBitValues(bits=bits) if bits else None
            before = comm.stats.snapshot()
            with comm.slot(("cmp", label, i)):
                (res,) = scheme.sync_group(comm, [SparseGrad(idx_K, vals, b.numel, in_range=True, lowbit=lowbit)],
                                           "contributors" if form == "counted" else "sum", keys=[label])
            got[label] = (comm.stats - before).bytes_sent
            if form == "rows":
                got["union"] = int(res.view(b.numel, 2)[:, 1].gt(0).sum())
        out = super()._sparse_sum(i, b, idx_K, val_K)
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
    compare = [("zen_mean", "zen", "mean", None), ("zen_rows", "zen", "rows", None),
               ("zen_cnt32", "zen", "counted", None), ("zen_cnt8", "zen", "counted", 8),
               ("zen_cnt4", "zen", "counted", 4), ("agsparse", "agsparse", "mean", None)]

    def outer_step(comm):
        if outers[comm.rank] is None:
            outers[comm.rank] = _Measured(views[comm.rank], comm, cfg, scheme="zen", compare=compare,
                                          bucket_cap_mb=args.bucket_cap_mb)
        o = outers[comm.rank]
        o.comm = o.sum_comm = comm  # this round's SimWorld communicator (the sum runs on sum_comm since delay 1)
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
             f"round 1's error feedback starts empty); every form sums the same picks, in the same outer step.", "",
             "Wire per picked entry. ZEN: push = int32 position + value; pull = its partition of the union with "
             "the cheapest index part (hash bitmap: |𝕀_i|/8 bytes, or int32 positions) + value; values fp32, or "
             "8/4-bit codes + one fp32 scale per 128 values (+0.25 bit a value); contributors counted at the "
             "owners (one value per entry, as mean). All-gather: each replica receives (R−1)·K entries of "
             "index + value: measured at fp32 (AGsparse, int32 index, 64 bits an entry); at 8/4 bits the "
             "formula (R−1)·(K·(32 + b)/8 + 4·⌈K/128⌉) with int32 indices, and with SparseLoCo's 12-bit "
             "indices (R−1)·(K·(12 + b)/8 + 4·⌈K/128⌉); SparseLoCo's own wire (2-bit values, 12-bit indices, "
             "a per-tensor table) (R−1)·K·14/8.", "",
             "Bytes each replica sends per outer step, MB (min/median/max over rounds):", "",
             "| R | K picks / replica | union / (R·K) | ZEN fp32 (counted) | ZEN 8-bit | ZEN 4-bit | ZEN (value, 1) "
             "rows, fp32 | ZEN mean, fp32 | all-gather fp32 (measured) | all-gather 8-bit | all-gather 4-bit | "
             "SparseLoCo wire (2-bit) | dense ring all-reduce |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    ratios = ["", "Ratios (min/median/max over rounds); all-gather with int32 indices, [with SparseLoCo's 12-bit "
              "indices]:", "",
              "| R | ZEN fp32 / all-gather fp32 | ZEN 8 / all-gather 8 [12-bit] | ZEN 4 / all-gather 4 [12-bit] | "
              "ZEN 4 / SparseLoCo's 2-bit wire | counted / mean (fp32) | counted / (value, 1) rows (fp32) | "
              "ZEN bits per own pick: fp32 / 8 / 4 | all-gather bits per own pick: fp32 / 8 / 4 [12-bit 4] |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
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
        z = {k: [per(k, r) / MB for r in rounds] for k in ("zen_cnt32", "zen_cnt8", "zen_cnt4", "zen_rows", "zen_mean",
                                                           "agsparse")}
        ag = {8: (R - 1) * (K * 4 + value_bytes(K, 8)) / MB, 4: (R - 1) * (K * 4 + value_bytes(K, 4)) / MB}
        ag12 = {b: (R - 1) * (K * (12 + b) / 8 + 4 * -(-K // 128)) / MB for b in (8, 4)}
        sparseloco = (R - 1) * K * 14 / 8 / MB
        dense = 2 * (R - 1) / R * numel * 4 / MB

        def mmm(v, f="{:.3f}"):
            v = sorted(v)
            return "/".join(f.format(x) for x in (v[0], statistics.median(v), v[-1]))

        def ratio(a, b, f="{:.2f}"):
            return mmm([x / y for x, y in zip(a, b)] if isinstance(b, list) else [x / b for x in a], f)
        lines.append(f"| {R} | {K:,} | {mmm(unions)} | {mmm(z['zen_cnt32'])} | {mmm(z['zen_cnt8'])} | "
                     f"{mmm(z['zen_cnt4'])} | {mmm(z['zen_rows'])} | {mmm(z['zen_mean'])} | {mmm(z['agsparse'])} | "
                     f"{ag[8]:.3f} | {ag[4]:.3f} | {sparseloco:.3f} | {dense:.3f} |")
        bits = "/".join(f"{statistics.median(z[k]) * MB * 8 / K:.1f}" for k in ("zen_cnt32", "zen_cnt8", "zen_cnt4"))
        ag_bits = "/".join(f"{(R - 1) * (32 + b + (32 / 128 if b < 32 else 0)):.0f}" for b in (32, 8, 4))
        ratios.append(f"| {R} | {ratio(z['zen_cnt32'], z['agsparse'])} | {ratio(z['zen_cnt8'], ag[8])} "
                      f"[{ratio(z['zen_cnt8'], ag12[8])}] | {ratio(z['zen_cnt4'], ag[4])} [{ratio(z['zen_cnt4'], ag12[4])}] | "
                      f"{ratio(z['zen_cnt4'], sparseloco)} | {ratio(z['zen_cnt32'], z['zen_mean'], '{:.3f}')} | "
                      f"{ratio(z['zen_cnt32'], z['zen_rows'])} | {bits} | {ag_bits} [{(R - 1) * (16 + 0.25):.0f}] |")
        print(lines[-1], ratios[-1], f"({time.time() - t:.0f} s)", sep="\n", flush=True)
        _write(args.out, lines + ratios + ["", f"{provenance()}; {time.time() - t0:.0f} s so far."])
    _write(args.out, lines + ratios + ["", f"{provenance()}; {time.time() - t0:.0f} s in total."])


def _write(path: str, lines: list[str]) -> None:
    """The results file, rewritten after every R (a run stopped for memory keeps the rows it has)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
