"""ZeRO-2 with ``reduce_scatter: true`` and ``overlap_comm``: does ``zen.async_sync`` overlap ZEN's
reduce-scatter with the backward pass? Backward + sync time per step, blocking against asynchronous,
next to their sum.

Usage: ``OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python benchmarks/comm/bench_rs_overlap.py [--steps 10]
[--seq 128] [--out benchmarks/comm/results/rs_overlap.md]``

Set-up: 2 gloo ranks on this machine, the tiny untied Llama (``configs/models/llama-tiny-untied.json``),
micro-batch 4 × ``--seq`` tokens, ZeRO-2 (``reduce_scatter`` and ``overlap_comm`` true,
``reduce_bucket_size`` 20000: several IPG buckets per layer), ZEN DGC 5 % + natural rows. Two engines
per rank, stepped alternately (so the machine's load hits both alike): ``blocking`` (the reduce-scatter
on the training thread) and ``async`` (``zen.async_sync``: whole IPG buckets on the communication
worker while the backward pass fills the other IPG buffer). Per step: ``backward+step`` is the wall
time of ``engine.backward`` plus ``engine.step`` (the step waits for the last bucket), ``sync`` is the
seconds ZEN spent reducing (its ``reduce_s``, on whichever thread), ``compute`` is the blocking run's
``backward+step − sync``. Perfect overlap would make the asynchronous ``backward+step`` ``max(compute,
sync)``; none, ``compute + sync``. min / median / max over the steps after two warm-up steps, rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from zen_ext.comm.local import run_workers  # noqa: E402

MODEL = os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")
DGC = {"enabled": True, "density": 0.05, "min_numel": 1024, "momentum_correction": False, "warmup_steps": 0}


def _engine(zen: dict):
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model

    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 2, "reduce_scatter": True, "overlap_comm": True,
                                 "reduce_bucket_size": 20000},
           "steps_per_print": 10**6, "zen": zen}
    engine, *_ = zds.initialize(model=build_model(MODEL, seed=0), config=cfg)
    return engine


def _worker(rank, world, steps, seq):
    import torch

    engines = {"blocking": _engine({"scheme": "zen", "dgc": DGC}),
               "async": _engine({"scheme": "zen", "dgc": DGC, "async_sync": True})}
    assert engines["async"].zen.async_ipg_off is None, engines["async"].zen.async_ipg_off
    g = torch.Generator().manual_seed(rank)
    times = {k: [] for k in engines}
    for step in range(steps):
        x = torch.randint(0, 1000, (4, seq), generator=g)
        for name, e in engines.items():
            loss = e(input_ids=x, labels=x).loss
            t0 = time.perf_counter()
            e.backward(loss)
            e.step()
            wall = time.perf_counter() - t0
            times[name].append((wall, e.zen.stats.last.get("reduce_s", 0.0)))
    for e in engines.values():
        e.zen.close()
    return {k: v[2:] for k, v in times.items()}


def _mmm(xs) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = run_workers(_worker, 2, a.steps, a.seq, timeout_s=1800)[0]
    blk, asy = res["blocking"], res["async"]
    compute = [w - s for w, s in blk]
    lines = [f"Command: `OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu .venv/bin/python benchmarks/comm/bench_rs_overlap.py "
             f"--steps {a.steps} --seq {a.seq}`", "",
             "| run | backward+step s | sync s | compute s (blocking − sync) |", "|---|---|---|---|",
             f"| blocking | {_mmm([w for w, _ in blk])} | {_mmm([s for _, s in blk])} | {_mmm(compute)} |",
             f"| async (`zen.async_sync`) | {_mmm([w for w, _ in asy])} | {_mmm([s for _, s in asy])} | — |", ""]
    med_c, med_s = statistics.median(compute), statistics.median([s for _, s in asy])
    med_a = statistics.median([w for w, _ in asy])
    lines.append(f"Medians: async backward+step {med_a:.3f} s against compute + sync {med_c + med_s:.3f} s (no "
                 f"overlap) and max(compute, sync) {max(med_c, med_s):.3f} s (perfect overlap): "
                 f"{(med_c + med_s - med_a) / min(med_c, med_s) * 100:.0f} % of the shorter one hidden.")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# ZeRO-2 reduce-scatter overlapped with the backward pass (`zen.async_sync`)\n\n"
                    + "\n\n".join(__doc__.split("\n\n")[2:3]) + "\n\n" + text)


if __name__ == "__main__":
    main()
