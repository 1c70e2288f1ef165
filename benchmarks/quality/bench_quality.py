"""Time to quality: dense vs natural-only vs DGC variants, at equal steps and to a target loss.

Each run is the DeepSpeed recipe (``recipes/finetune_llm.py``) on 2 CPU ranks with the demo's tiny Llama
and DeepSpeed settings (``configs/demo_ds.json``: AdamW lr 3e-3, ZeRO-1; the ``*_zero3`` variants take
ZeRO-3 from ``configs/demo_ds_zero3.json``; the ``*_fsdp*`` variants run the FSDP2 recipe
``recipes/finetune_llm_fsdp.py`` under torchrun on the ZeRO-3 variant's settings, translated by
``benchmarks/quality/quality_fsdp.py``, fine-tuning from the same DeepSpeed-pretrained HF checkpoint), one variant's
``zen`` section and one seed (model initialization, data order and eval split), in two settings:

* ``scratch``: random initialization, the whole built-in text, ``--scratch_steps`` steps;
* ``finetune``: from a model pretrained densely on the first half of the text (built once, cached in
  ``<runs>/pretrained``), fine-tuned on the second half (documents it has not seen).

Steps:
1. Build each variant's DeepSpeed config from the demo's (``quality_variants.py``: ``VARIANTS``, overrides of
   ``zen.dgc``, and ``ds_config``).
2. Run every (setting, variant, seed) that has no result yet (a run's ``summary.json`` is its result, so
   an interrupted sweep resumes), with a progress line per run (``quality_runs.py``).
3. Report per setting, against dense *of the same seed* (paired; on a decaying learning rate, against
   dense on that schedule: ``baseline_of``): eval loss at equal steps (median and
   min–max over seeds), the gap to dense, steps to the target (dense's final eval loss + 1 %, linear
   between evaluations) and time to the target with per-step times measured in the emulated cluster
   (``benchmarks/cluster/results/cluster_e2e.jsonl``, 4 hosts at 1 Gbit/s), and plot the curves against steps
   and against that time (``quality_report.py``; at equal bytes: ``quality_bytes.py``).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/bench_quality.py --seeds 0 1 2 \\
        --variants dense natural dgc5 dgc1 --out benchmarks/quality/results/time_to_quality.md
"""

from __future__ import annotations

import argparse
import json
import os
import time

import quality_bytes
from quality_report import PLOT_VARIANTS, cluster_step_s, report
from quality_runs import pretrained, run_one
from quality_variants import ROOT, VARIANTS, baseline_of


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["dense", "natural", "dgc5", "dgc1"], choices=list(VARIANTS))
    p.add_argument("--settings", nargs="+", default=["scratch", "finetune"], choices=["scratch", "finetune"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--scratch_steps", type=int, default=300)
    p.add_argument("--finetune_steps", type=int, default=200)
    p.add_argument("--pretrain_steps", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "quality"), help="run folders (cached results)")
    p.add_argument("--out", default=None, help="markdown report (and a .png next to it)")
    p.add_argument("--report_only", action="store_true", help="only tabulate the cached results")
    p.add_argument("--port", type=int, default=None,
                   help="first master port of the runs (default: a free port for each run)")
    p.add_argument("--plot_variants", nargs="+", default=list(PLOT_VARIANTS), choices=list(VARIANTS),
                   help="the variants the plot draws (default: %(default)s)")
    args = p.parse_args(argv)
    for base in dict.fromkeys(baseline_of(v) for v in args.variants):
        if base not in args.variants:  # every gap is relative to a dense run of the same seed (and engine)
            args.variants.insert(0 if base == "dense" else 1, base)

    # Step 2: the runs (cached ones are read back).
    jobs = [(s, v, seed) for s in args.settings for seed in args.seeds for v in args.variants]
    results = []
    start = None
    for i, (setting, variant, seed) in enumerate(jobs):
        if setting == "finetune" and start is None and not args.report_only:
            start = pretrained(args.runs, args.pretrain_steps)
        steps = args.scratch_steps if setting == "scratch" else args.finetune_steps
        if args.report_only:
            path = os.path.join(args.runs, setting, variant, f"seed{seed}", "result.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            continue
        t0 = time.perf_counter()
        r = run_one(args.runs, setting, variant, seed, steps, args.eval_every, start,
                    args.port + i % 200 if args.port else None)
        results.append(r)
        print(f"[{i + 1}/{len(jobs)}] {setting} {variant} seed {seed}: eval {r['eval'][-1][1]:.4f} at step "
              f"{r['eval'][-1][0]} ({time.perf_counter() - t0:.0f} s)", flush=True)

    # Step 3: the report.
    step_s = cluster_step_s(os.path.join(ROOT, "benchmarks/cluster/results/cluster_e2e.jsonl"))
    text = report(results, step_s, args.out[:-3] + ".png" if args.out else None, args.plot_variants)
    if any(r.get("bytes") for r in results):  # runs that recorded their bytes: the same runs at equal bytes
        text += "\n" + quality_bytes.report(results)
    header = ["# Time to quality: dense vs DGC variants", "",
              f"Generated by `benchmarks/quality/bench_quality.py` ({time.strftime('%Y-%m-%d')}; its docstring has the method). "
              "2 CPU ranks (deepspeed launcher; `*_fsdp*` variants: torchrun and the FSDP2 recipe on the "
              "same settings, `benchmarks/quality/quality_fsdp.py`; `*_2x2*` variants: 2 emulated nodes × 2 ranks, "
              "`benchmarks/quality/quality_nodes.py`), the demo's tiny Llama and DeepSpeed settings (AdamW "
              "lr 3e-3, betas 0.9/0.95, 10 warm-up steps, ZeRO-1 (`*_zero3` variants: ZeRO-3), micro-batch 8 × 128 "
              "tokens), eval every "
              f"{args.eval_every} steps on held-out blocks. `scratch`: random initialization, the whole "
              "built-in text; `finetune`: from a model pretrained densely on the first half of the text "
              f"({args.pretrain_steps} steps), fine-tuned on the second half. Variants: `VARIANTS` in `benchmarks/quality/quality_variants.py`.", "",
              "Columns: eval loss median [min–max] over seeds; the gap to dense of the same seed at the last "
              "step (a variant on a decaying rate, \"against dense_cosine\", is measured against dense on the same "
              "schedule, and so are its target and its equal loss); how many seeds reach dense's final eval loss + 1 % (same seed) and the median step; "
              "**steps × dense to equal loss** = the steps the run needs to reach its best eval loss over the steps "
              "dense needs to reach that loss (1.5× = dense gets there in two thirds of the steps); **time × "
              "dense** = that "
              "times the per-step time measured in the emulated cluster for the bench model "
              "(`cluster_e2e.jsonl`: "
              + "; ".join(f"{n} hosts at {rate}: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(cfgs.items()))
                          for (n, rate), cfgs in step_s.items()) + "), "
              "below 1× = sooner than dense to the same loss. A variant with dense steps or dense tensors is timed at "
              "its DGC density's step time, a lower bound. Cross-model: quality from the tiny Llama, step times from "
              "the lab's bench models.", "",
              "Reproduce (cached runs are reused; a variant marked with fewer seeds ran only those): "
              f"`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/bench_quality.py --settings {' '.join(args.settings)} "
              f"--seeds {' '.join(map(str, args.seeds))} --variants {' '.join(args.variants)}"
              + (f" --plot_variants {' '.join(args.plot_variants)}" if list(args.plot_variants) != list(PLOT_VARIANTS) else "")
              + f" --out {os.path.relpath(args.out, ROOT) if args.out else '...'}`.", ""]
    text = "\n".join(header) + "\n" + text
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
