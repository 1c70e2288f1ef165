"""The offline demo: ``python -m zen_ext demo`` (or ``bash launch/run_demo.sh``, which sets up first).

A short fine-tune of a tiny untied-embedding Llama (configs/models/llama-tiny-untied.json) on 2 CPU
processes through the ``deepspeed`` launcher, with DGC top-5 % on the dense weights, natural
embedding-row sparsity and ``scheme: "auto"`` (configs/demo_ds.json), trained with
``zen_ext.optim.CatchUpAdamW`` (the config's AdamW settings; ``--plain_adam``: the config's AdamW). The text is real and already
on the machine: the Python reference documentation that ships inside CPython (``pydoc_data``); the
tokenizer is a byte-level BPE trained on it with HF ``tokenizers`` and cached in the output
directory. Nothing is downloaded. It prints, in order:

1. the ZEN run: the recipe's summary (loss curve, bytes sent against a dense all-reduce, the schemes
   the planner chose) and its eval losses; ``loss.png`` next to them;
2. with ``--dense``, the dense DeepSpeed baseline (same model, data and seed), then one table of both
   runs side by side (eval and train loss and the gap, bytes per rank, tokens/s, the training loop's
   time, and apart from it the start-up and the rest of the run) and one plot of both loss curves
   (``compare.png``);
3. ``auto``'s cost-model prediction for the same gradients at 8 and 16 hosts on 1 and 10 Gbit/s links
   (``analysis/at_scale.py``), labelled as a prediction: where ZEN would win.

DeepSpeed's launcher log lines that say nothing to a demo user are hidden (``--verbose`` shows them).

Ranks run with ``OMP_NUM_THREADS=1`` and ``DS_ACCELERATOR=cpu``. The first DeepSpeed run on a
machine JIT-compiles its shared-memory comm op (about 30–80 s, then cached): a one-time cost of
whichever run comes first (the ZEN run), so the comparison sets the training loops side by side (the
sum of the step times) and shows each run's start-up apart (``split_times``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m zen_ext demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200, about a minute)")
    p.add_argument("--nproc", type=int, default=2, help="CPU processes (default 2)")
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "demo_ds.json"), help="DeepSpeed config")
    p.add_argument("--output_dir", default=os.path.join(ROOT, "runs", "demo"))
    p.add_argument("--dense", action="store_true", help="also run the dense baseline (configs/demo_ds_dense.json) "
                   "and compare the two runs side by side (losses, bytes, speed, one plot)")
    p.add_argument("--verbose", action="store_true", help="show the launcher command and DeepSpeed's launcher log lines")
    p.add_argument("--plain_adam", action="store_true", help="train the ZEN run with the config's AdamW instead of "
                   "zen_ext.optim.CatchUpAdamW (which takes a gradient DGC held back as the steps it missed)")
    return p.parse_args(argv)


def _launcher() -> list[str]:
    """The ``deepspeed`` launcher of this Python environment."""
    script = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    if os.path.isfile(script):
        return [script]
    found = shutil.which("deepspeed")
    return [found] if found else [sys.executable, "-m", "deepspeed.launcher.runner"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launcher lines that say nothing a demo user needs, or that are untrue on a CPU machine: DeepSpeed's
# launcher logs its plan at INFO (world info, ranks, CUDA_VISIBLE_DEVICES even without GPUs), and the
# engine asks WarmupLR for a learning rate before its first step (harmless: the scheduler starts at
# step 1). Hidden from the demo's output unless --verbose; the run itself is untouched.
HARMLESS = ("[launch.py:", "[runner.py:", "Unable to find hostfile", "Setting CUDA_VISIBLE_DEVICES",
            "Attempting to get learning rate from scheduler before it has started",
            "deepspeed_shm_comm_op built successfully",
            # DeepSpeed's warning for any client optimizer under ZeRO: CatchUpAdamW is elementwise, ZeRO 1-2
            # hand it flat fp32 partitions (tests/e2e: resume and the recipe's runs).
            "You are using ZeRO with an untested optimizer")


# The recipe's start line (recipes/finetune_llm.py, rank 0), printed once the engine is built and right
# before the first step: its arrival ends the run's start-up.
START_LINE = "deepspeed recipe: zen="


def split_times(run: dict) -> dict:
    """A run's wall time in three parts, in seconds: ``startup_s`` (launcher, imports, data and tokenizer,
    model, engine and its comm op, which the first DeepSpeed run on a machine compiles), ``loop_s`` (the
    training loop: the sum of the step times the recipe records) and ``other_s`` (evaluation, checkpoints,
    the summary, exit). Only ``loop_s`` compares two runs' training; NaN where the start line never came."""
    loop = sum(r.get("step_s", 0.0) for r in run["records"])
    start = run.get("startup_s", float("nan"))
    return {"startup_s": start, "loop_s": loop, "other_s": run["wall_s"] - start - loop}


def _times_text(run: dict) -> str:
    t = split_times(run)
    return (f"training loop {t['loop_s']:.0f} s ({len(run['records'])} steps), start-up {t['startup_s']:.0f} s "
            f"(launcher, data, engine and its comm op), evaluation, checkpoints and exit {t['other_s']:.0f} s")


def _rel(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def run_recipe(config: str, output_dir: str, steps: int, nproc: int, verbose: bool = False,
               extra: tuple[str, ...] = ()) -> dict:
    """Launch recipes/finetune_llm.py with the ``deepspeed`` launcher; returns its summary.json plus the
    per-step records (``records``), the run's wall time (``wall_s``) and its start-up (``startup_s``:
    launch to the recipe's start line)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [*_launcher(), "--num_gpus", str(nproc), "--master_port", str(_free_port()),
           os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config", config,
           "--model", os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json"), "--data", "pydoc",
           "--tokenizer", "train", "--vocab_size", "1024", "--seq_len", "128", "--steps", str(steps),
           "--eval_every", str(max(1, steps // 4)), "--output_dir", output_dir, *extra]
    if verbose:
        print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    # stdout through the filter (log lines); stderr (the progress bar) straight to the terminal.
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True, bufsize=1)
    hidden, startup = 0, float("nan")
    for line in proc.stdout:
        if startup != startup and START_LINE in line:  # the first one only (NaN != NaN until set)
            startup = time.time() - t0
        if not verbose and any(h in line for h in HARMLESS):
            hidden += 1
            continue
        print(line, end="", flush=True)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    with open(os.path.join(output_dir, "summary.json")) as f:
        out = json.load(f)
    with open(os.path.join(output_dir, "train_log.jsonl")) as f:
        out["records"] = [json.loads(line) for line in f if line.strip()]
    out["wall_s"] = time.time() - t0
    out["startup_s"] = startup
    out["hidden_lines"] = hidden
    stats = os.path.join(output_dir, "zen_stats.jsonl")
    if os.path.exists(stats):  # ZEN's own sync timer, per step on rank 0 (a dense run has none)
        with open(stats) as f:
            out["sync_s"] = sum(json.loads(line).get("sync_s", 0.0) for line in f if line.strip())
    return out


def steps_to_reach(evals: list, target: float) -> float | None:
    """The step at which an eval-loss curve first reaches ``target``, interpolated linearly between eval
    points (from step 0 at the first point's loss); None when it never does."""
    prev_s, prev_v = None, None
    for s, v in evals:
        if v <= target:
            if prev_s is None or prev_v == v:
                return float(s)
            return prev_s + (s - prev_s) * (prev_v - target) / (prev_v - v)
        prev_s, prev_v = s, v
    return None


def compare(zen: dict, dense: dict) -> str:
    """The side-by-side table of a ZEN run and the dense baseline (same model, data, steps, seed)."""
    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if xs else float("nan")

    ze, de = zen["eval"][-1][1], dense["eval"][-1][1]
    zf = zen["final"]
    zt, dt = split_times(zen), split_times(dense)
    ranks = zen.get("nproc", 2)
    rows = [
        ("final eval loss", f"{ze:.4f}", f"{de:.4f}", f"{(ze - de) / de:+.1%}"),
        ("final train loss (mean over ranks)", f"{zen['losses'][-1]:.4f}", f"{dense['losses'][-1]:.4f}",
         f"{(zen['losses'][-1] - dense['losses'][-1]) / dense['losses'][-1]:+.1%}"),
        ("gradient bytes sent per rank", f"{zf.get('bytes_sent', 0) / 2**20:.1f} MiB",
         f"{zf.get('dense_bytes', 0) / 2**20:.1f} MiB",
         f"{zf.get('bytes_sent', 0) / max(zf.get('dense_bytes', 1), 1):.1%} of dense"),
        ("gradient sync time, whole run (rank 0)", f"{zen.get('sync_s', float('nan')):.1f} s",
         "not timed", ""),
        ("median tokens/s (all ranks)", f"{median([r['tokens_per_s'] for r in zen['records']]):,.0f}",
         f"{median([r['tokens_per_s'] for r in dense['records']]):,.0f}", ""),
        ("training loop (sum of step times)", f"{zt['loop_s']:.1f} s", f"{dt['loop_s']:.1f} s",
         f"{zt['loop_s'] / dt['loop_s']:.2f}x" if dt["loop_s"] > 0 else ""),
        ("start-up (launch to first step)", f"{zt['startup_s']:.0f} s", f"{dt['startup_s']:.0f} s", ""),
        ("evaluation, checkpoints, exit", f"{zt['other_s']:.0f} s", f"{dt['other_s']:.0f} s", ""),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"ZEN (DGC 5 % + natural, auto) vs dense DeepSpeed, {len(zen['losses'])} steps, {ranks} ranks:",
             f"  {'':<{w}}  {'ZEN':>12}  {'dense':>12}  {'ZEN vs dense':>14}"]
    lines += [f"  {a:<{w}}  {b:>12}  {c:>12}  {d:>14}" for a, b, c, d in rows]
    # Time to quality (benchmarks/quality/results/time_to_quality.md): when does dense reach the quality ZEN ends with?
    reach = steps_to_reach(dense["eval"], ze)
    steps = len(zen["losses"])
    if reach is not None and reach < steps:
        lines.append(f"  steps to ZEN's final eval loss: dense gets there at step ~{reach:.0f} of {steps},\n"
                     f"    so at these settings ZEN needs ~{steps / reach:.2f}x the steps for the same quality")
    lines += ["  Dense bytes: a ring all-reduce of the same gradients (DeepSpeed does not time its own all-reduce).",
              "  The eval-loss gap is DGC's: with natural sparsity alone ZEN equals dense bit for bit.",
              "  Compare the training loops: start-up is not training (a machine's first DeepSpeed run, the ZEN run",
              "  when the demo runs first, also compiles DeepSpeed's shm comm op, once), and the runs take turns on",
              "  this machine, so another program's load slows whichever loop it overlaps."]
    return "\n".join(lines)


def plot_both(zen: dict, dense: dict, path: str) -> bool:
    """One figure: train and eval loss of both runs against steps. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, name, color in ((zen, "ZEN (DGC 5 % + natural, auto)", "tab:blue"), (dense, "dense DeepSpeed", "tab:gray")):
        steps = [r["step"] for r in run["records"]]
        ax.plot(steps, run["losses"], color=color, alpha=0.6, lw=1, label=f"{name}: train")
        if run["eval"]:
            ax.plot(*zip(*run["eval"]), "o-", color=color, lw=2, label=f"{name}: eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def at_scale(output_dir: str) -> str | None:
    """``auto``'s cost-model prediction for this run's gradients at 8 and 16 hosts (analysis/at_scale.py)."""
    from zen_ext.analysis.at_scale import format_predictions, predict_at_scale
    from zen_ext.planner.compute_model import calibrate_compute

    path = os.path.join(output_dir, "zen_stats.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        return None
    record = json.loads(lines[-1])
    with open(os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json")) as f:
        width = json.load(f)["hidden_size"]
    with open(os.path.join(ROOT, "configs", "demo_ds.json")) as f:
        tokens = json.load(f)["train_micro_batch_size_per_gpu"] * 128  # --seq_len 128
    preds = predict_at_scale(record, row_width=width, tokens_per_rank=tokens, rates=calibrate_compute("cpu"))
    return format_predictions(preds)


def _optimizer_args(args) -> tuple[str, ...]:
    """The ZEN run's optimizer: the recipe's default, CatchUpAdamW when DGC trains under Adam/AdamW (DGC's
    loss gap to dense shrinks most with it: docs/results/time_to_quality_history.md), or the config's with
    ``--plain_adam``. The dense baseline keeps the config's optimizer: it is what a user compares against."""
    return ("--plain_adam",) if args.plain_adam else ()


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    # Start fresh: a resumed run would skip the training this demo is meant to show.
    shutil.rmtree(os.path.join(args.output_dir, "checkpoints"), ignore_errors=True)
    for name in ("train_log.jsonl", "zen_stats.jsonl"):
        if os.path.exists(os.path.join(args.output_dir, name)):
            os.remove(os.path.join(args.output_dir, name))
    # Step 1: the ZEN run.
    print(f"[1/{3 if args.dense else 2}] ZEN run ({_rel(args.config)}, {args.nproc} processes, {args.steps} steps) "
          f"-> {_rel(args.output_dir)}", flush=True)
    zen = run_recipe(args.config, args.output_dir, args.steps, args.nproc, args.verbose, _optimizer_args(args))
    zen["nproc"] = args.nproc
    print(f"ZEN run finished in {zen['wall_s']:.0f} s: {_times_text(zen)}", flush=True)
    print(f"  {_rel(args.output_dir)}/ holds summary.json, loss.png, train_log.jsonl (per step), zen_stats.jsonl "
          "(ZEN per step), checkpoints/" + (f"; {zen['hidden_lines']} DeepSpeed launcher log lines hidden (--verbose "
                                            "shows them)" if zen["hidden_lines"] else ""), flush=True)
    if zen["eval"]:
        print("eval loss: " + "  ".join(f"step {s}: {v:.4f}" for s, v in zen["eval"]), flush=True)
    # Step 2: the dense baseline and the comparison.
    outputs = [_rel(args.output_dir)]
    if args.dense:
        dense_dir = args.output_dir.rstrip("/") + "_dense"
        shutil.rmtree(dense_dir, ignore_errors=True)
        dense_cfg = os.path.join(ROOT, "configs", "demo_ds_dense.json")
        print(f"\n[2/3] dense DeepSpeed baseline ({_rel(dense_cfg)}, same model, data and seed) -> {_rel(dense_dir)}",
              flush=True)
        base = run_recipe(dense_cfg, dense_dir, args.steps, args.nproc, args.verbose)
        print(f"dense run finished in {base['wall_s']:.0f} s: {_times_text(base)}", flush=True)
        print("\n" + compare(zen, base), flush=True)
        png = os.path.join(args.output_dir, "compare.png")
        if plot_both(zen, base, png):
            print(f"  loss curves of both runs: {_rel(png)}", flush=True)
            outputs.append(_rel(png))
        outputs.append(_rel(dense_dir))
    # Step 3: where ZEN would win, by the model.
    print(f"\n[{3 if args.dense else 2}/{3 if args.dense else 2}] ", end="", flush=True)
    text = at_scale(args.output_dir)
    print(text or "no zen_stats.jsonl: no prediction", flush=True)
    print(f"\nDemo finished in {time.time() - t0:.0f} s. Outputs: {', '.join(outputs)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
