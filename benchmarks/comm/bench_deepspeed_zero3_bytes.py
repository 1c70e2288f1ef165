"""Bytes each rank sends per optimizer step under DeepSpeed with ZEN's reduce-scatter, against the dense
reduce-scatter and ZEN's all-reduce-then-keep (ZeRO-2 ``reduce_scatter: false``), on real gloo processes.

The tiny untied Llama (configs/models/llama-tiny-untied.json), natural rows + DGC 5 % (no warm-up),
5 steps of random tokens, ``reduce_bucket_size`` 20000. ``dense baseline`` is what the engine's dense
collective of the same buckets sends: the dense reduce-scatter (uneven ranges padded to the longest, so
ZeRO-2's skewed buckets cost more than its all-reduce) or the ring all-reduce. Run::

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python benchmarks/comm/bench_deepspeed_zero3_bytes.py --ranks 2 4
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

STEPS = 5
DGC = {"enabled": True, "density": 0.05, "min_numel": 256, "momentum_correction": False, "momentum_masking": False,
       "warmup_steps": 0}
RUNS = [("ZeRO-3, zen reduce-scatter", 3, "zen", True), ("ZeRO-3, dense reduce-scatter", 3, "dense", True),
        ("ZeRO-2, zen reduce-scatter", 2, "zen", True), ("ZeRO-2, zen all-reduce then keep", 2, "zen", False)]


def _worker(rank, world):
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import zen_ext.deepspeed as zds
    from recipes.common import build_model

    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 1000, (2, 16), generator=g) for _ in range(STEPS)]
    out = {}
    for name, stage, scheme, rs in RUNS:
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6,
               "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}},
               "zero_optimization": {"stage": stage, "reduce_scatter": rs, "reduce_bucket_size": 20000,
                                     "stage3_param_persistence_threshold": 0},
               "zen": {"scheme": scheme, "dgc": DGC, "stats": {"summary": False}}}
        engine, *_ = zds.initialize(model=build_model(os.path.join(ROOT, "configs/models/llama-tiny-untied.json"),
                                                      seed=0), config=cfg)
        for x in batches:
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        out[name] = (engine.zen.totals["bytes_sent"], engine.zen.totals["dense_bytes"])
        engine.zen.close()
    return out


def main() -> None:
    from zen_ext.comm.local import run_workers

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    # The busiest rank sets the step's time; the mean is what research/sharded.md's arithmetic gives.
    print("| n | run | KiB sent per step, busiest rank | dense baseline, busiest rank | ratio | ratio on the ranks' "
          "mean |\n|---|---|---|---|---|---|")
    for n in args.ranks:
        res = run_workers(_worker, n, timeout_s=1800)
        for name, *_ in RUNS:
            sent = max(r[name][0] for r in res) / STEPS / 1024
            dense = max(r[name][1] for r in res) / STEPS / 1024
            mean = sum(r[name][1] for r in res) / max(sum(r[name][0] for r in res), 1)
            print(f"| {n} | {name} | {sent:.1f} | {dense:.1f} | {dense / sent:.1f}x | {mean:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
