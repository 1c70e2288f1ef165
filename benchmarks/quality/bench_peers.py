"""Time to quality: zen_ext against PowerSGD, DiLoCo and SparseLoCo on plain DDP (2 CPU ranks).

Each run is ``benchmarks/quality/peers_ddp.py`` under ``torchrun`` on the time-to-quality benchmark's model,
data and settings (``benchmarks/quality/bench_quality.py``: the demo's tiny Llama, AdamW lr 3e-3, 10 log warm-up
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
sys.path.insert(0, HERE)
from quality_report import steps_to  # noqa: E402  (the interpolation every quality report shares)

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
    "diloco_h15": ["--method", "diloco", "--sync_every", "15"],  # torchft at zen_outer_diloco's H: the same algorithm
    "sparseloco_h15": ["--method", "sparseloco", "--sync_every", "15"],
    # zen_ext's own outer sync (zen.outer through register_outer) at the outer harness's settings of these names
    # (bench_outer_quality.py VARIANTS): dense DiLoCo on ZEN, and top-1,024 of 4,096 in 4 bits at H 15 and H 5.
    "zen_outer_diloco": ["--method", "zen_outer", "--zen_outer", "diloco", "--sync_every", "15"],
    "zen_outer_d25_4bit": ["--method", "zen_outer", "--zen_outer", "outer_d25_4bit", "--sync_every", "15"],
    "zen_outer_d25_h5_4bit": ["--method", "zen_outer", "--zen_outer", "outer_d25_h5_4bit"],
    # the same H 15 setting with its sum overlapped with the next round's inner steps (zen.outer.delay 1)
    "zen_outer_d25_4bit_delay1": ["--method", "zen_outer", "--zen_outer", "outer_d25_4bit_delay1",
                                  "--sync_every", "15"],
    # the H 15 setting at DiLoCo H 50's period (fewer outer steps: less CPU and fewer bytes per inner step)
    "zen_outer_d25_4bit_h50": ["--method", "zen_outer", "--zen_outer", "outer_d25_4bit", "--sync_every", "50"],
}
NODE_VARIANTS: dict[str, dict] = {
    # DeepSpeed ZeRO-3 on 2 emulated nodes × 2 ranks (quality_nodes.py), the recipe with the qgZ emulation
    # installed (qgz_recipe.py): dense ZeRO-3 and ZeRO++ qgZ (zero_optimization.zero_quantized_gradients),
    # everything else bench_quality's dense_zero3_2x2; qgZ is paired with zero3_2x2_dense.
    "zero3_2x2_dense": {},
    "zero3_2x2_qgz": {"zero_quantized_gradients": True},
}
BASELINE = {v: "zero3_2x2_dense" for v in NODE_VARIANTS}
"""The paired baseline of a variant (default: ddp_dense)."""


def run_one(runs: str, setting: str, variant: str, seed: int, steps: int, eval_every: int, start: str | None) -> dict:
    """Step 1: one run (or its cached result)."""
    run_args = ["--data", "pydoc", "--steps", str(steps), "--eval_every", str(eval_every), "--seed", str(seed)]
    if setting == "finetune":
        run_args += ["--model", start, "--tokenizer", start, "--data_part", "second"]
    else:
        run_args += ["--model", MODEL, "--tokenizer", "train"]
    nodes = variant in NODE_VARIANTS
    if nodes:
        import quality_variants

        cfg = quality_variants.ds_config("dense_zero3_2x2")
        cfg["zero_optimization"].update(NODE_VARIANTS[variant])
        key_src = ["peers", "zero3_2x2", cfg, run_args]
    else:
        run_args += VARIANTS[variant]
        key_src = ["peers", run_args]
    key = hashlib.sha1(json.dumps(key_src).encode()).hexdigest()[:12]
    out = os.path.join(runs, setting, variant, f"seed{seed}")
    path = os.path.join(out, "result.json")
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
        if result.get("key") == key:
            return result
    os.makedirs(out, exist_ok=True)
    import quality_runs

    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    if nodes:
        import quality_nodes

        cfg_path = os.path.join(out, "ds_config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
        quality_nodes.launch_nodes(os.path.join(HERE, "qgz_recipe.py"),
                                   ["--deepspeed_config", cfg_path, "--output_dir", out, *run_args],
                                   os.path.join(out, "log.txt"), quality_runs.free_port(), 2, 2, ROOT, env,
                                   2 * RUN_TIMEOUT_S)
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(quality_runs.free_port()), os.path.join(HERE, "peers_ddp.py"), "--output_dir", out, *run_args]
        with open(os.path.join(out, "log.txt"), "w") as log:
            try:
                rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0:
            raise RuntimeError(f"run failed (exit {rc}): {' '.join(cmd)}; see {out}/log.txt")
    with open(os.path.join(out, "train_log.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    if nodes:  # the DeepSpeed recipe logs no bytes without zen: the qgZ emulation's own count (rank 0)
        with open(os.path.join(out, "log.txt")) as f:
            line = next((x for x in f if x.startswith("qgz emulation: rank 0 ")), None)
        sent = json.loads(line.split(" ", 4)[4])["bytes_sent"] if line else 0
        for r in recs:
            r["bytes_sent"], r["dense_bytes"] = sent * r["step"] / len(recs), 1
    result = {"key": key, "setting": setting, "variant": variant, "seed": seed, "steps": steps,
              "eval": [[r["step"], r["eval_loss"]] for r in recs if "eval_loss" in r],
              "bytes_per_step": recs[-1]["bytes_sent"] / len(recs),
              "dense_bytes_per_step": recs[-1]["dense_bytes"] / len(recs),
              "step_s_med": statistics.median(r["step_s"] for r in recs[len(recs) // 10:]),
              "wall_s": time.perf_counter() - t0}
    with open(path, "w") as f:
        json.dump(result, f)
    return result


def _rng(values, fmt: str) -> str:
    if not values:
        return "–"
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def report(results: list[dict]) -> str:
    """Step 2: one table per setting, each variant paired by seed against its baseline (``BASELINE``)."""
    lines = []
    for setting in ("finetune", "scratch"):
        by: dict[str, dict[int, dict]] = {}
        for r in results:
            if r["setting"] == setting:
                by.setdefault(r["variant"], {})[r["seed"]] = r
        ref = by.get("ddp_dense") or next(iter(by.values()), None)
        if not ref:
            continue
        steps = next(iter(ref.values()))["steps"]
        marks = [steps // 4, steps // 2, steps]
        lines += [f"### {setting}: {steps} steps, seeds {sorted(ref)}", "",
                  "| variant | " + " | ".join(f"eval @ {m}" for m in marks) + f" | gap to dense @ {steps} | "
                  f"reaches dense + {TARGET_MARGIN:.0%} (seeds; median step) | bytes / rank / step (× dense) | "
                  "step s here |", "|---|" + "---|" * (len(marks) + 4)]
        for variant, seeds in by.items():
            base = by.get(BASELINE.get(variant, "ddp_dense"), {})
            paired = {s: r for s, r in seeds.items() if s in base}
            if not paired:
                continue
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
                f"{variant} ({len(paired)} seeds" + (f", against {BASELINE[variant]})" if variant in BASELINE else ")"), *(_rng([x for x in v if x is not None], ".4f") for v in at),
                f"{_rng(gaps, '+.2f')} %", f"{len(got)}/{len(reach)}" + (f"; {statistics.median(got):.0f}" if got else ""),
                f"{b / 1024:.1f} KiB" + (f" ({b / d:.4f}×)" if d > 1 else " (quantized path only)"),
                _rng([r["step_s_med"] for r in paired.values()], ".3f")]) + " |")
        lines.append("")
    return "\n".join(lines)


def gap_curve(results: list[dict], setting: str, plot_path: str | None = None) -> str:
    """Each variant's gap to its paired dense at every evaluation (median [min–max] over seeds, %): whether a
    gap grows with training length, settles or closes. With ``plot_path`` the medians are drawn too."""
    by: dict[str, dict[int, dict]] = {}
    for r in results:
        if r["setting"] == setting:
            by.setdefault(r["variant"], {})[r["seed"]] = r
    curves = {}
    for variant, seeds in by.items():
        base = by.get(BASELINE.get(variant, "ddp_dense"), {})
        if variant == BASELINE.get(variant, "ddp_dense") or not base:
            continue
        at: dict[int, list[float]] = {}
        for s, r in seeds.items():
            if s in base:
                d = dict(map(tuple, base[s]["eval"]))
                for step, loss in r["eval"]:
                    if step in d:
                        at.setdefault(step, []).append(100 * (loss / d[step] - 1))
        curves[variant] = at
    if not curves:
        return ""
    steps = sorted({st for c in curves.values() for st in c})
    lines = ["| step | " + " | ".join(f"{v}: gap to dense %" for v in curves) + " |",
             "|---|" + "---|" * len(curves)]
    for st in steps:
        lines.append(f"| {st} | " + " | ".join(_rng(c.get(st, []), "+.2f") for c in curves.values()) + " |")
    if plot_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.8))
        for v, c in curves.items():
            xs = sorted(c)
            ax.plot(xs, [statistics.median(c[x]) for x in xs], "o-", ms=3, label=v)
        ax.axhline(0, color="black", lw=0.8)
        ax.axhline(100 * TARGET_MARGIN, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="step", ylabel="eval loss gap to dense (%)", title=f"{setting}: gap to dense, median over seeds")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=100)
        plt.close(fig)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS) + list(NODE_VARIANTS))
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
    p.add_argument("--curve", action="store_true", help="also each variant's gap to dense at every evaluation")
    p.add_argument("--no_time_model", action="store_true", help="leave out the modelled lab times")
    args = p.parse_args(argv)
    for v in list(args.variants):
        if BASELINE.get(v, "ddp_dense") not in args.variants:
            args.variants.insert(0, BASELINE.get(v, "ddp_dense"))
    import quality_runs

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
            start = quality_runs.pretrained(args.runs, args.pretrain_steps)
        t0 = time.perf_counter()
        r = run_one(args.runs, setting, variant, seed, steps, args.eval_every, start)
        results.append(r)
        print(f"[{i + 1}/{len(jobs)}] {setting} {variant} seed {seed}: eval {r['eval'][-1][1]:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    text = report(results)
    if args.curve:
        text += "\n### Gap to dense along the run\n\n" + "\n\n".join(
            gap_curve(results, st, None if not args.out else args.out[:-3] + (f"_{st}" if len(args.settings) > 1 else "")
                      + "_gap.png") for st in args.settings)
        text += "\n"
    # The modelled lab times (peers_time.py) from these runs and the bytes of each implementation.
    if args.no_time_model or "finetune" not in args.settings:
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return
    import peers_bytes
    import peers_time

    cache: dict = {}
    demo = peers_bytes.rows(peers_bytes.build(peers_bytes.MODELS["demo tiny Llama"]), cache)[:-1]
    big = peers_bytes.rows(peers_bytes.build(peers_bytes.MODELS["58 M Llama"]), cache)[:-1]
    measured = peers_bytes.measured_zen(args.runs)
    at2 = next(r for r in demo if r["n"] == 2)
    scale = {k: measured[f"ddp_{k}"] / at2[k] for k in ("zen_dgc5", "zen_dgc1") if f"ddp_{k}" in measured}
    lab = peers_time.lab_step_s(os.path.join(ROOT, "benchmarks/cluster/results/peers_lab.jsonl"))
    text += ("\n### Modelled time to dense + 1 % (finetune; peers_time.py)\n\n"
             + peers_time.report(results, demo, big, scale, lab)
             + ("\n\nMEASURED columns: step seconds on the emulated cluster (benchmarks/cluster/results/peers_lab.md), "
                "time × dense from the same paired seeds' steps." if lab else "")
             + "\n\nzen_ext's modelled demo bytes scaled by measured / modelled at 2 ranks: "
             + ", ".join(f"{k} {v:.3f}" for k, v in scale.items()) + ". Model check: "
             + "; ".join(peers_time.calibration(os.path.join(ROOT, "benchmarks/cluster/results/cluster_e2e.jsonl")))
             + ".\n")
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
