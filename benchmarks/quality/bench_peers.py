"""Time to quality: zen_ext against PowerSGD, DiLoCo and SparseLoCo on plain DDP (2 CPU ranks).

Each run is ``benchmarks/quality/peers_ddp.py`` under ``torchrun`` on the time-to-quality benchmark's model,
data and settings (``benchmarks/bench_quality.py``: the demo's tiny Llama, AdamW lr 3e-3, 10 log warm-up
steps, clip 1.0, micro-batch 8 × 128 tokens per rank; ``finetune`` starts from the same densely pretrained
checkpoint, built by ``bench_quality.pretrained`` in the same ``--runs`` folder; ``scratch`` from random
initialization), one variant and one seed. Every variant is paired with plain DDP (``ddp_dense``) of the
same seed.

Steps:
1. Run every (setting, variant, seed) without a cached result (``result.json`` with the same key).
2. Report per setting: eval loss at a quarter, half and all the steps (median [min–max] over seeds), the gap
   to DDP dense at the end, how many seeds reach dense's final loss + 1 % and at which step (linear between
   evaluations), bytes per rank per step (the run's own count; per inner step for the DiLoCo family), and
   the measured step seconds on this machine (2 ranks, compute plus loopback).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/bench_peers.py --settings finetune --seeds 0 1 2 \\
        --variants ddp_dense ddp_zen_dgc5 powersgd_r1 diloco_h10 sparseloco_h15 --out runs/peers.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))

MODEL = "configs/models/llama-tiny-untied.json"
RUN_TIMEOUT_S = 1200
TARGET_MARGIN = 0.01

VARIANTS: dict[str, list[str]] = {
    # name → peers_ddp.py arguments. Settings: each peer's published or recommended ones (see the script).
    "ddp_dense": ["--method", "dense"],
    "ddp_zen_dgc5": ["--method", "zen", "--zen_density", "0.05"],
    "ddp_zen_dgc1": ["--method", "zen", "--zen_density", "0.01"],
    "ddp_zen_dgc5_int4": ["--method", "zen", "--zen_density", "0.05", "--zen_residual_dtype", "int4"],
    "ddp_zen_dgc1_int4": ["--method", "zen", "--zen_density", "0.01", "--zen_residual_dtype", "int4"],
    "powersgd_r1": ["--method", "powersgd", "--powersgd_rank", "1"],
    "powersgd_r4": ["--method", "powersgd", "--powersgd_rank", "4"],
    "diloco_h10": ["--method", "diloco", "--sync_every", "10"],
    "diloco_h50": ["--method", "diloco", "--sync_every", "50"],
    "sparseloco_h15": ["--method", "sparseloco", "--sync_every", "15"],
}


def run_one(runs: str, setting: str, variant: str, seed: int, steps: int, eval_every: int, start: str | None) -> dict:
    """Step 1: one run (or its cached result)."""
    run_args = ["--data", "pydoc", "--steps", str(steps), "--eval_every", str(eval_every), "--seed", str(seed),
                *VARIANTS[variant]]
    if setting == "finetune":
        run_args += ["--model", start, "--tokenizer", start, "--data_part", "second"]
    else:
        run_args += ["--model", MODEL, "--tokenizer", "train"]
    key = hashlib.sha1(json.dumps(["peers", run_args]).encode()).hexdigest()[:12]
    out = os.path.join(runs, setting, variant, f"seed{seed}")
    path = os.path.join(out, "result.json")
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        if result.get("key") == key:
            return result
    os.makedirs(out, exist_ok=True)
    import bench_quality

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(bench_quality.free_port()), os.path.join(HERE, "peers_ddp.py"), "--output_dir", out, *run_args]
    t0 = time.perf_counter()
    with open(os.path.join(out, "log.txt"), "w") as log:
        try:
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        raise RuntimeError(f"run failed (exit {rc}): {' '.join(cmd)}; see {out}/log.txt")
    with open(os.path.join(out, "train_log.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    result = {"key": key, "setting": setting, "variant": variant, "seed": seed, "steps": steps,
              "eval": [[r["step"], r["eval_loss"]] for r in recs if "eval_loss" in r],
              "bytes_per_step": recs[-1]["bytes_sent"] / len(recs),
              "dense_bytes_per_step": recs[-1]["dense_bytes"] / len(recs),
              "step_s_med": statistics.median(r["step_s"] for r in recs[len(recs) // 10:]),
              "wall_s": time.perf_counter() - t0}
    with open(path, "w") as f:
        json.dump(result, f)
    return result


def steps_to(evals, target: float):
    """The first step where the eval loss reaches ``target`` (linear between evaluations); None: never."""
    prev = None
    for step, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            s0, l0 = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def _rng(values, fmt: str) -> str:
    if not values:
        return "–"
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def report(results: list[dict], baseline: str = "ddp_dense") -> str:
    """Step 2: one table per setting, paired by seed against ``baseline``."""
    lines = []
    for setting in ("finetune", "scratch"):
        by: dict[str, dict[int, dict]] = {}
        for r in results:
            if r["setting"] == setting:
                by.setdefault(r["variant"], {})[r["seed"]] = r
        base = by.get(baseline)
        if not base:
            continue
        steps = next(iter(base.values()))["steps"]
        marks = [steps // 4, steps // 2, steps]
        lines += [f"### {setting}: {steps} steps, seeds {sorted(base)} (paired with {baseline})", "",
                  "| variant | " + " | ".join(f"eval @ {m}" for m in marks) + f" | gap to dense @ {steps} | "
                  f"reaches dense + {TARGET_MARGIN:.0%} (seeds; median step) | bytes / rank / step (× dense) | "
                  "step s here |", "|---|" + "---|" * (len(marks) + 4)]
        for variant, seeds in by.items():
            paired = {s: r for s, r in seeds.items() if s in base}
            at = [[dict(map(tuple, r["eval"])).get(m) for r in paired.values()] for m in marks]
            gaps, reach = [], []
            for s, r in paired.items():
                d_final = base[s]["eval"][-1][1]
                gaps.append(100 * (r["eval"][-1][1] / d_final - 1))
                reach.append(steps_to(r["eval"], d_final * (1 + TARGET_MARGIN)))
            got = [x for x in reach if x is not None]
            b = statistics.median(r["bytes_per_step"] for r in paired.values())
            d = statistics.median(r["dense_bytes_per_step"] for r in paired.values())
            lines.append("| " + " | ".join([
                f"{variant} ({len(paired)} seeds)", *(_rng([x for x in v if x is not None], ".4f") for v in at),
                f"{_rng(gaps, '+.2f')} %", f"{len(got)}/{len(reach)}" + (f"; {statistics.median(got):.0f}" if got else ""),
                f"{b / 1024:.1f} KiB ({b / d:.4f}×)",
                _rng([r["step_s_med"] for r in paired.values()], ".3f")]) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--settings", nargs="+", default=["finetune"], choices=["scratch", "finetune"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--scratch_steps", type=int, default=300)
    p.add_argument("--finetune_steps", type=int, default=200)
    p.add_argument("--pretrain_steps", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "quality"),
                   help="run folders; the fine-tuning start is bench_quality's, shared")
    p.add_argument("--out", default=None, help="markdown report")
    p.add_argument("--report_only", action="store_true")
    args = p.parse_args(argv)
    if "ddp_dense" not in args.variants:
        args.variants.insert(0, "ddp_dense")
    import bench_quality

    start = None
    results = []
    jobs = [(s, seed, v) for s in args.settings for seed in args.seeds for v in args.variants]
    for i, (setting, seed, variant) in enumerate(jobs):
        steps = args.finetune_steps if setting == "finetune" else args.scratch_steps
        if args.report_only:
            path = os.path.join(args.runs, setting, variant, f"seed{seed}", "result.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            continue
        if setting == "finetune" and start is None:
            start = bench_quality.pretrained(args.runs, args.pretrain_steps)
        t0 = time.perf_counter()
        r = run_one(args.runs, setting, variant, seed, steps, args.eval_every, start)
        results.append(r)
        print(f"[{i + 1}/{len(jobs)}] {setting} {variant} seed {seed}: eval {r['eval'][-1][1]:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    text = report(results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
