"""Peak memory per rank: DeepSpeed ZeRO-3 dense vs ZeRO-3 with DGC, node-level with the 4-bit residual
and flat with the fp32 one, on 2 emulated nodes × 2 ranks of this machine.

Each run is the DeepSpeed recipe (``recipes/finetune_llm.py --memory_report``) launched as DeepSpeed's
multi-node runner launches it (``benchmarks/quality/quality_nodes.py``: one launcher per node, ``ZEN_EXT_HOST``
set), ZeRO-3 from ``configs/demo_ds_zero3.json``, the same AdamW for all (``--plain_adam``: the
recipe's default under DGC, CatchUpAdamW, would add optimizer state of its own), and:

* ``dense``: no ``"zen"`` section (DeepSpeed's own reduce-scatter);
* ``flat_fp32``: ``zen.hierarchical`` false, ``zen.dgc.residual_dtype`` "float32": DGC 5 % on every
  rank's full gradient, its residual full size on every rank (``4·P_dgc`` bytes);
* ``node_int4``: ``zen.hierarchical`` true, ``residual_dtype`` "int4": DGC 5 % on the node's sum of the
  rank's ``1/L`` shard (``0.53·P_dgc/L`` bytes: half a byte a code plus a float32 min and max per 256).

Per rank the recipe records the resident set after engine init and its peak so far (the model is built
in full on every rank before ZeRO-3 partitions it), then the peak over the training steps alone (the
kernel's peak is reset after init: ``recipes/memory_report.py``), and zen_ext's state bytes (every tensor
of the Synchronizer's ``state_dict()``, summed by storage). The table gives the largest rank's of each.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_peak_memory.py --steps 4 \\
        --out benchmarks/memory/results/peak_memory_zero3.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

# The quality benchmark's multi-node launcher and its helpers (benchmarks/quality/).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "quality"))
import quality_nodes  # noqa: E402
from quality_runs import ROOT, free_port  # noqa: E402

MODEL = "configs/models/llama-h768-l8.json"
NODES, LOCAL = 2, 2
CONFIGS = ("dense", "flat_fp32", "node_int4")
INT4_PER_ELEMENT = 0.5 + 8 / 256
"""Bytes a 4-bit residual holds per element: a half-byte code, a float32 min and max per 256."""


def ds_config(name: str, micro_batch: int, dgc_warmup_steps: int = 0) -> dict:
    """``configs/demo_ds_zero3.json`` as ``name`` asks (module docstring), DGC's density warm-up
    (``zen.dgc.warmup_steps``; the demo's 20 start at 25 % density) set to ``dgc_warmup_steps``."""
    with open(os.path.join(ROOT, "configs", "demo_ds_zero3.json")) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    if name == "dense":
        del cfg["zen"]
        return cfg
    if name not in CONFIGS:
        raise ValueError(f"config {name!r} must be one of {', '.join(CONFIGS)}")
    cfg["zen"]["hierarchical"] = name == "node_int4"
    cfg["zen"]["dgc"]["residual_dtype"] = "int4" if name == "node_int4" else "float32"
    cfg["zen"]["dgc"]["warmup_steps"] = dgc_warmup_steps
    return cfg


def run(name: str, a, runs: str) -> dict:
    """One run of the recipe under config ``name``; its per-rank memory records and step times."""
    out = os.path.join(runs, name)
    os.makedirs(out, exist_ok=True)
    cfg_path = os.path.join(out, "ds_config.json")
    cfg = ds_config(name, a.micro_batch, a.dgc_warmup_steps)
    wall_s = None
    if a.reuse:  # a finished run of this very config: report it as it is
        with open(cfg_path) as f:
            if json.load(f) != cfg:
                raise ValueError(f"--reuse: {cfg_path} is not the config these arguments make; run without --reuse")
        return _result(name, out, wall_s)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    args = ["--deepspeed_config", cfg_path, "--output_dir", out, "--model", a.model, "--data", "pydoc",
            "--max_docs", str(a.max_docs), "--seq_len", str(a.seq_len), "--steps", str(a.steps),
            "--eval_every", "0", "--plain_adam", "--memory_report"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    wall_s = quality_nodes.launch_nodes("recipes/finetune_llm.py", args, os.path.join(out, "log.txt"), free_port(),
                                        NODES, LOCAL, ROOT, env, a.timeout_s)
    return _result(name, out, wall_s)


def _result(name: str, out: str, wall_s: float | None) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "train_log.jsonl")) as f:
        step_s = [json.loads(line)["step_s"] for line in f]
    return {"name": name, "memory": summary["memory"], "wall_s": wall_s, "step_s": step_s}


def formula(name: str, dgc_params: int) -> tuple[str, float]:
    """zen_ext's state per rank the arithmetic predicts (benchmarks/memory/results/state_memory.md)."""
    if name == "flat_fp32":
        return f"4·P_dgc = {4 * dgc_params / 2**20:,.1f} MiB", 4.0 * dgc_params
    if name == "node_int4":
        return (f"0.53·P_dgc/{LOCAL} = {INT4_PER_ELEMENT * dgc_params / LOCAL / 2**20:,.1f} MiB",
                INT4_PER_ELEMENT * dgc_params / LOCAL)
    return "0", 0.0


def report(results: list[dict], a, command: str) -> str:
    mem0 = results[0]["memory"][0]
    P = mem0["params"]
    dgc = max(r["memory"][0]["dgc_params"] for r in results)
    dense = next((r for r in results if r["name"] == "dense"), None)
    dense_train = max(m["train_peak_mib"] for m in dense["memory"]) if dense else None
    dense_peak = max(m["peak_rss_mib"] for m in dense["memory"]) if dense else None
    lines = [f"Command: `{command}`", "",
             f"Model: `{a.model}` (Llama, random init, vocabulary from the trained tokenizer), P = {P:,} parameters "
             f"({4 * P / 2**20:,.1f} MiB in fp32); P_dgc = {dgc:,} of them routed to DGC (the matrices; the "
             f"untied embedding goes to natural rows). ZeRO-3 on {NODES} emulated nodes × {LOCAL} ranks "
             f"(n = {NODES * LOCAL}, L = {LOCAL}), micro-batch {a.micro_batch} × {a.seq_len} tokens, {a.steps} steps, "
             f"DGC 5 % with zen.dgc.warmup_steps {a.dgc_warmup_steps} (from 25 % when > 0), "
             f"AdamW (fp32, `torch_adam`), CPU (gloo). MiB = 2^20 bytes; each column is the largest rank's.", "",
             "| config | RSS after init | peak at init | peak over training steps | training peak − dense's | "
             "run peak | run peak − dense's | RSS after last step | zen_ext state per rank | formula | "
             "measured / formula | median step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["memory"]
        train, peak = max(x["train_peak_mib"] for x in m), max(x["peak_rss_mib"] for x in m)
        state = max(x["zen_state_bytes"] for x in m)
        text, want = formula(r["name"], dgc)
        ratio = f"{state / want:.3f}" if want else "–"
        lines.append(f"| {r['name']} | {max(x['init_rss_mib'] for x in m):,.0f} | "
                     f"{max(x['init_peak_mib'] for x in m):,.0f} | {train:,.0f} | "
                     f"{train - dense_train:+,.0f} | {peak:,.0f} | {peak - dense_peak:+,.0f} | "
                     f"{max(x['end_rss_mib'] for x in m):,.0f} | "
                     f"{state / 2**20:,.2f} MiB | {text} | {ratio} | {statistics.median(r['step_s']):.1f} s |")
    lines += ["", "Per rank (MiB: after init / init peak / training peak; zen_ext state):", ""]
    for r in results:
        per = "; ".join(f"{x['init_rss_mib']:,.0f} / {x['init_peak_mib']:,.0f} / {x['train_peak_mib']:,.0f}, "
                        f"{x['zen_state_bytes'] / 2**20:,.2f}" for x in r["memory"])
        lines.append(f"- {r['name']}: {per}")
    if not all(x.get("peak_reset") for r in results for x in r["memory"]):
        lines += ["", "The kernel refused the peak reset on some rank: its training peak is the whole run's."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--model", default=MODEL, help="model-config JSON (random init; no downloads)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dgc_warmup_steps", type=int, default=0,
                    help="zen.dgc.warmup_steps: 0 measures DGC at its 5 %% from the first step; the demo's 20 start "
                    "at 25 %%, whose larger sparse buffers then set the peak")
    ap.add_argument("--micro_batch", type=int, default=2)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--max_docs", type=int, default=200, help="documents of the built-in text (tokenizer and data)")
    ap.add_argument("--runs", default=os.path.join(ROOT, "runs", "peak_memory"))
    ap.add_argument("--reuse", action="store_true", help="report the runs already in --runs (made with the same "
                    "arguments) instead of launching them again")
    ap.add_argument("--timeout_s", type=float, default=1800)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    command = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory/bench_peak_memory.py " + " ".join(sys.argv[1:])
    results = []
    for name in a.configs:
        print(f"{name} ...", flush=True)
        results.append(run(name, a, a.runs))
        print(json.dumps(results[-1]), flush=True)
    text = report(results, a, command)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write("# Peak memory per rank: ZeRO-3 dense vs DGC (node-level 4-bit, flat fp32)\n\n"
                    + "\n\n".join(__doc__.split("\n\n")[1:4]) + "\n\n" + text)


if __name__ == "__main__":
    main()
