"""Quality of zen.outer at equal inner steps: sparse outer sync vs dense DiLoCo vs a dense per-step sync.

Fine-tuning on 2 replicas (SimWorld ranks) with the demo's tiny Llama: a model pretrained densely on the
first half of the built-in text (``--pretrain_steps``, AdamW) is fine-tuned on the second half, each
replica on its own shard, for ``--steps`` inner steps (AdamW lr ``--lr``, clip 1), in these variants:

* ``dense``: the replicas' gradients averaged every step (what DDP's all-reduce computes: one model on
  the concatenation of the replicas' micro-batches, equal sizes, mean loss);
* ``diloco``: zen.outer with density 1, outer SGD lr 0.7, momentum 0.9, Nesterov (DiLoCo / torchft);
* ``outer``: zen.outer with SparseLoCo's defaults (top-64 of 4,096, β 0.95, contributors, lr 1, no
  momentum), summed by ZEN;
* ``outer_mean``: the same with ``average: "mean"``;
* ``outer_8bit``, ``outer_4bit``: ``outer`` with ``value_bits`` 8 or 4 (the picks block-quantized, what
  quantization loses kept in the error feedback).
* ``diloco_delay1``, ``outer_delay1``: ``diloco`` and ``outer`` with ``delay: 1`` (the sum of round t
  runs while round t + 1 trains and is merged one round late; each replica's communication thread
  drives a second SimWorld's ranks);
* ``average``, ``average_delay1``: density 1, outer SGD lr 1 without momentum (the replicas' parameters
  averaged: local SGD), at delay 0 and 1: what the delay costs without DiLoCo's outer momentum.
* ``outer_d0625``, ``outer_d25``, ``outer_h5``, ``outer_d0625_h5``, ``outer_d25_h5``: ``outer`` denser
  (top-256 or top-1,024 of 4,096) and / or synced every 5 steps (H = 5 whatever ``--every`` is; ``--every``
  must then be a multiple of 5): the settings between SparseLoCo's defaults and dense DiLoCo, for time to
  quality; ``outer_d25_4bit``, ``outer_d0625_h5_4bit``, ``outer_d25_h5_4bit`` with ``value_bits: 4``; ``outer_nesterov``,
  ``outer_d0625_nesterov``, ``outer_d25_nesterov``: DiLoCo's outer optimizer (lr 0.7, momentum 0.9, Nesterov)
  on the sparse sums.

Every variant but the ``_h5`` ones syncs every H = ``--every`` steps (``--steps`` a multiple of it), so the eval loss is that of
θ_global, on the held-out blocks of the second half, every ``--eval_every`` outer steps. At ``delay: 1``
θ_global is read from ``state_dict()`` (which waits for the round's sum: θ_global then holds every round
started, what ``finish()`` would leave there) into a copy of the model, so evaluating changes nothing in the
run; at the end ``finish()`` flushes the last round and the model itself is evaluated (it is θ_global). Reported per
variant: final eval loss (median, min–max over seeds) and its gap to dense of the same seed (paired),
and the bytes each replica sent per inner step (SimWorld's counters; dense: a ring all-reduce's).

``--setting scratch`` trains from random weights instead (no pretraining); ``--jsonl`` appends each run's eval
curve, bytes and step seconds for ``outer_time.py`` (the modelled time to dense + 1 %).

Usage: nice -n 10 python benchmarks/quality/bench_outer_quality.py --seeds 0 1 2 --out benchmarks/quality/results/outer_quality.md
(``--variants dense diloco diloco_delay1 outer outer_delay1 --out benchmarks/quality/results/outer_delay_quality.md``
for the overlap's cost)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from benchmarks.comm.bench_outer_bytes import provenance  # noqa: E402  (one provenance line for both)

from recipes.common import (build_model, build_tokenizer, load_texts, pack_tokens, select_texts,  # noqa: E402
                            split_blocks, train_batches)
from zen_ext.comm.simulated import SimWorld  # noqa: E402
from zen_ext.outer import OuterSync  # noqa: E402

VARIANTS = {
    "dense": None,
    "diloco": dict(density=1, lr=0.7, momentum=0.9, nesterov=True, average="mean"),
    "outer": dict(),
    "outer_mean": dict(average="mean"),
    "outer_8bit": dict(value_bits=8),
    "outer_4bit": dict(value_bits=4),
    "diloco_delay1": dict(density=1, lr=0.7, momentum=0.9, nesterov=True, average="mean", delay=1),
    "outer_delay1": dict(delay=1),
    "average": dict(density=1, lr=1.0, average="mean"),
    "average_delay1": dict(density=1, lr=1.0, average="mean", delay=1),
    "outer_d0625": dict(density=0.0625),
    "outer_d25": dict(density=0.25),
    "outer_h5": dict(every=5),
    "outer_d0625_h5": dict(density=0.0625, every=5),
    "outer_d25_h5": dict(density=0.25, every=5),
    "outer_nesterov": dict(lr=0.7, momentum=0.9, nesterov=True),
    "outer_d0625_nesterov": dict(density=0.0625, lr=0.7, momentum=0.9, nesterov=True),
    "outer_d25_nesterov": dict(density=0.25, lr=0.7, momentum=0.9, nesterov=True),
    "outer_d25_4bit": dict(density=0.25, value_bits=4),
    "outer_d25_4bit_delay1": dict(density=0.25, value_bits=4, delay=1),
    "outer_d0625_h5_4bit": dict(density=0.0625, every=5, value_bits=4),
    "outer_d25_h5_4bit": dict(density=0.25, every=5, value_bits=4),
}


def _eval(model, blocks, mb: int = 8) -> float:
    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for at in range(0, blocks.shape[0], mb):
            x = blocks[at:at + mb]
            tot += model(input_ids=x, labels=x).loss.item() * x.shape[0]
            n += x.shape[0]
    model.train()
    return tot / n


def _global_model(model, outer):
    """A copy of ``model`` holding θ_global (``delay: 1``: ``state_dict`` waits for the round in flight)."""
    import copy

    theta = {}
    for b, saved in zip(outer.buckets, outer.state_dict()["buckets"]):
        at = 0
        for n, p in zip(b.names, b.params):
            theta[n] = saved["theta"][at:at + p.numel()].view_as(p)
            at += p.numel()
    g = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in g.named_parameters():
            if n in theta:
                p.copy_(theta[n])
    return g


def _opt(model, lr):
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _step(model, opt, x):
    model(input_ids=x, labels=x).loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def run_variant(name, args, start_sd, train, evalb, seed: int, R: int):
    """Eval losses of θ_global (every ``eval_every`` outer steps) and bytes sent per inner step per replica."""
    if VARIANTS[name] is None:  # dense per-step: the mean gradient over the replicas' micro-batches
        model = build_model(args.model, vocab_size=args.vocab)
        model.load_state_dict(start_sd)
        opt = _opt(model, args.lr)
        shards = [train_batches(train, args.micro_batch, r, R, seed=seed) for r in range(R)]
        losses, step_s = [], []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            _step(model, opt, torch.cat([next(s) for s in shards]))
            step_s.append(time.perf_counter() - t0)
            if step % (args.every * args.eval_every) == 0 or step == args.steps:
                losses.append(_eval(model, evalb))
        numel = sum(p.numel() for p in model.parameters())
        # one process steps on all R micro-batches: a replica's share of the compute is 1/R of it
        return losses, 2 * (R - 1) / R * numel * 4, _timing([t / R for t in step_s], [], 1)

    cfg = {"enabled": True, "every": args.every, **VARIANTS[name]}  # a variant may set its own H
    delayed = cfg.get("delay", 0) == 1
    overlap = SimWorld(R).communicators() if delayed else [None] * R

    def replica(comm):
        model = build_model(args.model, vocab_size=args.vocab)
        model.load_state_dict(start_sd)
        opt = _opt(model, args.lr)
        outer = OuterSync(model.named_parameters(), comm, cfg, scheme="zen", overlap_comm=overlap[comm.rank])
        batches = train_batches(train, args.micro_batch, comm.rank, R, seed=seed)
        losses, inner_s, outer_s = [], [], []
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            _step(model, opt, next(batches))
            t1 = time.perf_counter()
            outer.maybe_step(step)
            inner_s.append(t1 - t0)
            if step % cfg["every"] == 0:
                outer_s.append(time.perf_counter() - t1)
            if step == args.steps:
                outer.finish()  # delay 1: the last round's sum merged (nothing at delay 0)
            if comm.rank == 0 and (step % (args.every * args.eval_every) == 0 or step == args.steps):
                if delayed and step < args.steps:
                    losses.append(_eval(_global_model(model, outer), evalb))
                else:
                    losses.append(_eval(model, evalb))  # right after an outer step (and finish): θ_global
        stats = outer.pop_stats()
        outer.close()
        return losses, stats["bytes_sent"] / args.steps, _timing(inner_s, outer_s, cfg["every"])

    res = SimWorld(R, max_active=R if delayed else 2).run(replica)
    return res[0][0], statistics.mean(r[1] for r in res), res[0][2]


def _timing(inner_s: list, outer_s: list, every: int) -> dict:
    """Rank 0's seconds: median inner step (forward, backward, AdamW), median outer step (pseudo-gradient, error
    feedback, top-k, the SimWorld sum, the outer optimizer; at delay 1 only what the training thread waits for),
    and the outer step spread over its H inner steps."""
    outer = statistics.median(outer_s) if outer_s else 0.0
    return {"inner_s_med": statistics.median(inner_s), "outer_s_med": outer, "outer_s_per_step": outer / every}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="configs/models/llama-tiny-untied.json")
    p.add_argument("--variants", nargs="+", default=["dense", "diloco", "outer", "outer_mean"], choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--pretrain_steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=15)
    p.add_argument("--eval_every", type=int, default=2, help="outer steps between evaluations")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    p.add_argument("--jsonl", help="also append one record per (variant, seed): eval curve (inner step, loss), "
                   "bytes and seconds per step (for outer_time.py)")
    p.add_argument("--setting", default="finetune", choices=["finetune", "scratch"],
                   help="scratch: no dense pretraining, the replicas train the second half from random weights")
    args = p.parse_args()
    if args.steps % args.every:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --every ({args.every})")
    for v in args.variants:
        h = (VARIANTS[v] or {}).get("every", args.every)
        if args.every % h:
            raise SystemExit(f"--every ({args.every}) must be a multiple of {v}'s H ({h}): evaluations follow --every")
    if args.setting == "scratch":
        args.pretrain_steps = 0
    torch.set_num_threads(1)
    t0 = time.time()
    texts = load_texts("pydoc")
    tok = build_tokenizer("train", texts, os.path.join(ROOT, "runs", "outer_bytes_tok"), 1024)
    args.vocab = len(tok)
    first = pack_tokens(select_texts(texts, "first"), tok, args.seq_len)
    second_train, second_eval = split_blocks(pack_tokens(select_texts(texts, "second"), tok, args.seq_len), 0.05)
    R = args.replicas
    results: dict[str, list] = {v: [] for v in args.variants}
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = build_model(args.model, seed=seed, vocab_size=args.vocab)
        opt = _opt(model, args.lr)
        pre = train_batches(first, args.micro_batch * R, 0, 1, seed=seed)
        for _ in range(args.pretrain_steps):
            _step(model, opt, next(pre))
        start_sd = {k: v.clone() for k, v in model.state_dict().items()}
        for v in args.variants:
            losses, bps, timing = run_variant(v, args, start_sd, second_train, second_eval, seed, R)
            results[v].append((losses, bps))
            if args.jsonl:
                at = [s for s in range(1, args.steps + 1) if s % (args.every * args.eval_every) == 0 or s == args.steps]
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps({"setting": args.setting, "variant": v, "seed": seed, "steps": args.steps,
                                        "every": (VARIANTS[v] or {}).get("every", args.every),
                                        "eval": [[s, x] for s, x in zip(at, losses)], "bytes_per_step": bps,
                                        **timing}) + "\n")
            print(f"seed {seed} {v}: eval {' '.join(f'{x:.4f}' for x in losses)}; {bps / 1e3:.1f} kB/step",
                  flush=True)

    def mmm(xs, f="{:.4f}"):
        xs = sorted(xs)
        return f"{f.format(statistics.median(xs))} ({f.format(xs[0])}–{f.format(xs[-1])})"
    title = "fine-tuning" if args.setting == "finetune" else "from scratch"
    lines = [f"# zen.outer: eval loss at equal inner steps ({title}, 2 replicas)", "",
             f"Command: `nice -n 10 python benchmarks/quality/bench_outer_quality.py --seeds "
             f"{' '.join(map(str, args.seeds))} --steps {args.steps} --every {args.every} --pretrain_steps "
             f"{args.pretrain_steps} --eval_every {args.eval_every} --setting {args.setting} --variants "
             f"{' '.join(args.variants)} --out {args.out}`", "",
             f"Demo Llama ({os.path.basename(args.model)}), " + (
                 f"pretrained densely {args.pretrain_steps} steps on the first half of the pydoc text, fine-tuned "
                 if args.setting == "finetune" else "from random weights (no pretraining), trained ") +
             f"{args.steps} inner steps on the second half by {R} replicas, each on "
             f"its own shard (micro-batch {args.micro_batch} × seq {args.seq_len}, AdamW lr {args.lr}, betas (0.9, 0.95), "
             f"wd 0.1, clip 1); outer sync every H = {args.every} steps; eval on held-out blocks of the second half. "
             f"Median (min–max) over seeds {args.seeds}; gap: paired against dense of the same seed.", "",
             "| variant | final eval loss | gap to dense | bytes per replica per inner step |",
             "| --- | --- | --- | --- |"]
    dense = [r[0][-1] for r in results.get("dense", [])]
    for v, runs in results.items():
        final = [r[0][-1] for r in runs]
        gap = mmm([100 * (f / d - 1) for f, d in zip(final, dense)], "{:+.2f} %") if dense and v != "dense" else "—"
        lines.append(f"| {v} | {mmm(final)} | {gap} | {mmm([r[1] for r in runs], '{:,.0f}')} B |")
    lines += ["", "Eval loss of θ_global every " f"{args.every * args.eval_every} inner steps (seed {args.seeds[0]}):", "",
              "| variant | " + " | ".join(str(args.every * args.eval_every * (i + 1)) for i in
                                        range(len(results[args.variants[0]][0][0]))) + " |",
              "| --- |" + " --- |" * len(results[args.variants[0]][0][0])]
    for v, runs in results.items():
        lines.append(f"| {v} | " + " | ".join(f"{x:.4f}" for x in runs[0][0]) + " |")
    lines += ["", f"{provenance('')}; {time.time() - t0:.0f} s in total."]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
