"""End-to-end benchmark on the emulated cluster: tokens/s of DeepSpeed fine-tuning, dense vs ZEN.

Usage (``benchmarks/run_cluster_report.sh`` runs it)::

    .venv/bin/python benchmarks/bench_e2e.py --rate 1gbit --out benchmarks/results/cluster_e2e.jsonl

This driver starts the lab (``launch/netlab/launch.sh``, 4 hosts) and, on every host, the worker
(``bench_e2e.py worker``), which trains the recipes' model/data pipeline (``recipes/common.py``: a
Llama from ``--model``, BPE tokenizer trained on the built-in ``pydoc`` text, packed blocks, a
disjoint batch per rank) with DeepSpeed ZeRO-0 and AdamW, one engine per configuration, all in the
same processes:

* ``dense``: DeepSpeed's own gradient all-reduce (no ``"zen"`` section);
* ``zen_dgc1`` / ``zen_dgc5``: ``zen_ext.deepspeed.initialize`` with ``{"scheme": "zen", "dgc":
  {"enabled": true, "density": 0.01 / 0.05}}`` (DGC on every parameter, embedding included);
* ``zen_natural``: ``{"scheme": "zen"}`` with natural sparsity only: the untied embedding's rows go
  through ZEN, the rest through the dense all-reduce.

Every engine starts from the same weights and sees the same batches in the same order, so the loss
curves are comparable step by step. After ``--warmup`` untimed steps each, the configurations take
turns in blocks of ``--block`` steps, rotated every repeat (``--reps`` repeats, interleaved), so load
on the shared machine hits all of them alike. A step's time is the span from the first rank's start
to the last rank's end; it is split into forward, backward (DeepSpeed reduces gradients at the end
of backward in ZeRO-0) and optimizer step. tokens/s = ranks × micro-batch × sequence length / step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import Lab, SpanProbe, append_jsonl, finish_process, init_from_env, mmm, wait_quiet  # noqa: E402

DEFAULT_MODEL = os.path.join(ROOT, "benchmarks", "configs", "llama-bench.json")
CONFIGS = {
    "dense": dict(describe="DeepSpeed all-reduce", zen=None),
    "zen_dgc1": dict(describe="zen, DGC 1 %", zen={"scheme": "zen", "dgc": {"enabled": True, "density": 0.01}}),
    "zen_dgc5": dict(describe="zen, DGC 5 %", zen={"scheme": "zen", "dgc": {"enabled": True, "density": 0.05}}),
    "zen_natural": dict(describe="zen, embedding rows (rest dense)",
                        zen={"scheme": "zen", "natural": {"enabled": True}, "dgc": {"enabled": False}}),
}


# --- worker (one per emulated host) ---------------------------------------------------------------------
def _engine(name: str, a, world: int):
    import deepspeed

    import zen_ext.deepspeed as zds
    from recipes.common import build_model

    model = build_model(a.model, seed=a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    ds_config = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
                 "train_batch_size": a.micro_batch * world, "zero_optimization": {"stage": 0},
                 "steps_per_print": 10**9, "wall_clock_breakdown": False}
    zen = CONFIGS[name]["zen"]
    if zen is None:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    else:
        engine, *_ = zds.initialize(model=model, optimizer=opt,
                                    config={**ds_config, "zen": {**zen, "stats": {"summary": False}}})
    return engine


def _train_step(engine, ids: torch.Tensor, lab: Lab) -> tuple[dict, float]:
    """One optimizer step, timed per phase; returns (span record, this rank's loss)."""
    import torch.distributed as dist

    dist.barrier()
    zen = getattr(engine, "zen", None)
    before = zen.totals if zen is not None else {}
    probe = SpanProbe(lab)
    t0 = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    engine.step()
    t3 = time.perf_counter()
    after = zen.totals if zen is not None else {}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("sync_s", "hash_s", "bytes_sent")}
    rec = probe.finish(extra=[t1 - t0, t2 - t1, t3 - t2, d.get("sync_s", 0.0), d.get("hash_s", 0.0),
                              d.get("bytes_sent", 0)])
    return rec, float(loss.detach())


def cmd_worker(a) -> int:
    import torch.distributed as dist

    from recipes.common import build_tokenizer, load_texts, pack_tokens, split_blocks, train_batches

    rank, n = init_from_env()
    lab = Lab.from_env()
    names = a.configs.split(",")
    texts = load_texts("pydoc")
    # Rank 0 trains the tokenizer once; the others read the cached file.
    if rank == 0:
        tok = build_tokenizer("train", texts, cache_dir=a.work, vocab_size=a.tokenizer_vocab)
    dist.barrier()
    if rank != 0:
        tok = build_tokenizer("train", texts, cache_dir=a.work, vocab_size=a.tokenizer_vocab)
    blocks, _ = split_blocks(pack_tokens(texts, tok, a.seq_len), eval_fraction=0.0, seed=a.seed)
    engines = {name: _engine(name, a, n) for name in names}
    data = {name: train_batches(blocks, a.micro_batch, rank, n, seed=a.seed) for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    recs: dict[str, list[dict]] = {name: [] for name in names}
    if rank == 0:
        print(f"# bench_e2e: n={n} rate={lab.rate} configs={names} model={a.model} micro_batch={a.micro_batch} "
              f"seq_len={a.seq_len} params={sum(p.numel() for p in engines[names[0]].module.parameters()):,}",
              flush=True)

    def step(name: str, timed: bool) -> None:
        rec, loss = _train_step(engines[name], next(data[name]), lab)
        got = [0.0] * n
        dist.all_gather_object(got, loss)
        losses[name].append(sum(got) / n)
        if timed:
            recs[name].append(rec)
        if rank == 0:
            print(f"{name:>12} step {len(losses[name]):3d} loss {losses[name][-1]:.4f} {rec['span']:.3f} s"
                  f"{'' if timed else ' (warm-up)'}", flush=True)

    for name in names:
        for _ in range(a.warmup):
            step(name, timed=False)
    pre_busy = []
    for rep in range(a.reps):
        if a.quiet_wait > 0:
            pre_busy.append(wait_quiet(a.quiet_wait, a.quiet_level) if rank == 0 else -1.0)
            dist.barrier()
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            for _ in range(a.block):
                step(name, timed=True)

    if rank == 0:
        tokens = n * a.micro_batch * a.seq_len
        for name in names:
            rs = recs[name]
            spans = [r["span"] for r in rs]
            col = lambda i: statistics.median(max(row[i] for row in r["extra"]) for r in rs)  # noqa: E731
            s_min, s_med, s_max = mmm(spans)
            rec = dict(bench="e2e", **lab.meta(), n=n, config=name, describe=CONFIGS[name]["describe"],
                       zen=CONFIGS[name]["zen"], model=a.model, micro_batch=a.micro_batch, seq_len=a.seq_len,
                       tokens_per_step=tokens, warmup=a.warmup, block=a.block, reps=a.reps, steps_timed=len(rs),
                       step_times=spans, step_s_min=s_min, step_s_med=s_med, step_s_max=s_max,
                       tokens_per_s_med=tokens / s_med, tokens_per_s_max=tokens / s_min,
                       forward_s_med=col(0), backward_s_med=col(1), optimizer_s_med=col(2),
                       sync_s_med=col(3) if CONFIGS[name]["zen"] else None,
                       hash_s_med=col(4) if CONFIGS[name]["zen"] else None,
                       bytes_sent_per_step=statistics.median(max(row[5] for row in r["extra"]) for r in rs)
                       if CONFIGS[name]["zen"] else
                       2 * (n - 1) / n * sum(p.numel() * p.element_size() for p in engines[name].module.parameters()),
                       wire_tx_per_step=statistics.median(max(r["wire_tx"]) for r in rs),
                       losses=losses[name], cpu_all=statistics.median(r["cpu_all"] for r in rs),
                       foreign=statistics.median(r["foreign"] for r in rs), pre_busy=pre_busy,
                       records=[dict(step_s=r["span"], cpu_all=r["cpu_all"], cpu_ours=r["cpu_ours"],
                                     foreign=r["foreign"]) for r in rs])
            print(f"{name:>12}: step {s_min:.3f} / {s_med:.3f} / {s_max:.3f} s, {tokens / s_med:.0f} tokens/s, "
                  f"fwd {rec['forward_s_med']:.3f} bwd+sync {rec['backward_s_med']:.3f} opt {rec['optimizer_s_med']:.3f}"
                  f", cpu {rec['cpu_all']:.2f} foreign {rec['foreign']:.2f}", flush=True)
            if a.out:
                append_jsonl(a.out, rec)
    finish_process(0)
    return 0


# --- driver (on the host) -----------------------------------------------------------------------------
def cmd_drive(a) -> int:
    os.makedirs(a.work, exist_ok=True)
    cmd = [os.path.join(ROOT, "launch", "netlab", "launch.sh"), "-n", str(a.hosts), "-r", a.rate,
           "--timeout", str(a.timeout_s), "--logdir", os.path.join(a.work, "logs"), "--",
           os.path.abspath(__file__), "worker", "--configs", a.configs, "--model", a.model, "--work", a.work,
           "--micro-batch", str(a.micro_batch), "--seq-len", str(a.seq_len), "--warmup", str(a.warmup),
           "--block", str(a.block), "--reps", str(a.reps), "--lr", str(a.lr), "--seed", str(a.seed),
           "--tokenizer-vocab", str(a.tokenizer_vocab), "--quiet-wait", str(a.quiet_wait),
           "--quiet-level", str(a.quiet_level)]
    if a.out:
        cmd += ["--out", os.path.abspath(a.out)]
    return subprocess.run(cmd, cwd=ROOT, timeout=a.timeout_s + 60).returncode


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default="dense,zen_dgc1,zen_dgc5,zen_natural",
                   help=f"comma list from {sorted(CONFIGS)}")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model-config JSON (or HF name / checkpoint)")
    p.add_argument("--work", default="/tmp/zen_cluster/e2e", help="tokenizer cache and logs")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration")
    p.add_argument("--block", type=int, default=2, help="consecutive timed steps of one configuration")
    p.add_argument("--reps", type=int, default=5, help="interleaved repeats (blocks per configuration)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-vocab", type=int, default=8192)
    p.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                   help="before each repeat wait up to S s for the machine to be idle")
    p.add_argument("--quiet-level", type=float, default=0.3)
    p.add_argument("--out", default=None, help="append JSON lines here")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        p = argparse.ArgumentParser(description="one host's worker (under launch/netlab/launch.sh)")
        _common(p)
        a = p.parse_args(argv[1:])
        return cmd_worker(a)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common(p)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--timeout-s", type=int, default=590, help="limit of the lab run (s)")
    a = p.parse_args(argv)
    unknown = sorted(set(a.configs.split(",")) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs {unknown} must be from {sorted(CONFIGS)}")
    return cmd_drive(a)


if __name__ == "__main__":
    sys.exit(main())
