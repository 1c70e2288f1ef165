"""The offline demo: ``python -m zen_ext demo`` (or ``bash launch/run_demo.sh``, which sets up first).

A short fine-tune of a tiny untied-embedding Llama (configs/models/llama-tiny-untied.json) on 2 CPU
processes through the ``deepspeed`` launcher, with DGC top-5 % on the dense weights, natural
embedding-row sparsity and ``scheme: "auto"`` (configs/demo_ds.json). The text is real and already
on the machine: the Python reference documentation that ships inside CPython (``pydoc_data``); the
tokenizer is a byte-level BPE trained on it with HF ``tokenizers`` and cached in the output
directory. Nothing is downloaded. It ends with the recipe's summary (loss curve, bytes sent against
a dense all-reduce, the schemes the planner chose) and writes ``loss.png`` next to it.

Ranks run with ``OMP_NUM_THREADS=1`` and ``DS_ACCELERATOR=cpu``. The first DeepSpeed run on a
machine JIT-compiles its shared-memory comm op (about 30–80 s, then cached).
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
                   "and compare the losses")
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


def run_recipe(config: str, output_dir: str, steps: int, nproc: int) -> dict:
    """Launch recipes/finetune_llm.py with the ``deepspeed`` launcher; returns its summary.json."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [*_launcher(), "--num_gpus", str(nproc), "--master_port", str(_free_port()),
           os.path.join(ROOT, "recipes", "finetune_llm.py"), "--deepspeed_config", config,
           "--model", os.path.join(ROOT, "configs", "models", "llama-tiny-untied.json"), "--data", "pydoc",
           "--tokenizer", "train", "--vocab_size", "1024", "--seq_len", "128", "--steps", str(steps),
           "--eval_every", str(max(1, steps // 4)), "--output_dir", output_dir]
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True)
    with open(os.path.join(output_dir, "summary.json")) as f:
        return json.load(f)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    # Start fresh: a resumed run would skip the training this demo is meant to show.
    shutil.rmtree(os.path.join(args.output_dir, "checkpoints"), ignore_errors=True)
    for name in ("train_log.jsonl", "zen_stats.jsonl"):
        if os.path.exists(os.path.join(args.output_dir, name)):
            os.remove(os.path.join(args.output_dir, name))
    zen = run_recipe(args.config, args.output_dir, args.steps, args.nproc)
    print(f"\nDemo finished in {time.time() - t0:.0f} s. Outputs in {args.output_dir}: summary.json, "
          f"loss.png, train_log.jsonl (per step), zen_stats.jsonl (ZEN per step), checkpoints/")
    if zen["eval"]:
        print("eval loss: " + "  ".join(f"step {s}: {v:.4f}" for s, v in zen["eval"]))
    if args.dense:
        dense_dir = args.output_dir.rstrip("/") + "_dense"
        shutil.rmtree(dense_dir, ignore_errors=True)
        base = run_recipe(os.path.join(ROOT, "configs", "demo_ds_dense.json"), dense_dir, args.steps, args.nproc)
        print(f"final train loss: zen {zen['losses'][-1]:.4f}  dense {base['losses'][-1]:.4f}; final eval loss: "
              f"zen {zen['eval'][-1][1]:.4f}  dense {base['eval'][-1][1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
