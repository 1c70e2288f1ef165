"""End-to-end benchmark on the emulated cluster: tokens/s of the DeepSpeed fine-tuning recipe, dense vs ZEN.

Usage (``benchmarks/cluster/run_cluster_report.sh`` runs it)::

    .venv/bin/python benchmarks/cluster/bench_e2e.py --rate 1gbit --out benchmarks/cluster/results/cluster_e2e.jsonl

Runs ``recipes/finetune_llm.py`` itself, one process per emulated host (``launch/netlab/launch.sh``),
once per configuration and repeat. The configurations differ only in the DeepSpeed config's
``"zen"`` section (ZeRO-0 unless a configuration names other ZeRO settings, AdamW, micro-batch ``--micro-batch`` × ``--seq-len`` tokens per rank).
The recipe trains the DGC configurations with its default for DGC under Adam, ``CatchUpAdamW`` (one
fused step), and dense on the config's AdamW: each as a user gets it. DGC's density ramp is pinned off
(``warmup_steps: 0``) so that the timed steps are steady-state ones:

* ``dense``: no section, DeepSpeed's own gradient all-reduce;
* ``zen_dgc1`` / ``zen_dgc5``: ``{"scheme": "zen", "dgc": {"enabled": true, "density": 0.01 / 0.05}}``
  (DGC on every parameter of ≥ ``dgc.min_numel`` elements, the embedding included);
  ``zen_dgc1_v8`` / ``zen_dgc1_v4``: DGC 1 % with ``value_bits`` 8 / 4 (not in the default list);
* ``zen_natural``: ``{"scheme": "zen"}`` with natural sparsity only: the untied embedding's non-zero
  rows go through ZEN, everything else through the dense all-reduce (lossless: same losses as dense);
* ``dense_z3`` / ``zen_dgc1_z3`` / ``zen_dgc5_z3`` / ``zen_natural_z3``: ZeRO-3 as
  ``configs/demo_ds_zero3.json`` sets it (``reduce_scatter`` on), DeepSpeed's dense reduce-scatter vs
  ZEN's reduce-scatter (each rank receives only its partition; docs/deepspeed_zero3.md); not in the default list (run
  as root, not under ``launch.sh``: the script starts the lab itself, e.g. ``bench_e2e.py --hosts 8
  --rate 250mbit --configs dense_z3,zen_dgc1_z3``).
  Each configuration is compared with the dense one of its ZeRO settings (``baseline_of``);
* ``zen_dgc1_z3_flat`` / ``zen_dgc1_z3_node``: ZeRO-3, DGC 1 %, ZEN's reduce-scatter over all ranks at once
  (``zen.hierarchical`` false) against the node-level one (true: a dense reduce-scatter inside each
  emulated host, DGC on the node-summed shard, ZEN across hosts; docs/deepspeed_zero3.md). They need
  several processes per host (``--procs-per-host 2``: ``launch.sh -p``, intra-host traffic on the
  host's loopback); not in the default list (benchmarks/cluster/results/cluster_node_level.md);
* ``zen_dgc10`` / ``zen_dgc20``: DGC at 10 % / 20 % (not in the default list: time to quality);
* ``zen_dgc1_b8`` / ``zen_dgc1_b8_async``: DGC 1 % with 8 MB ZEN buckets, in turn / pipelined with
  ``zen.async_sync`` (not in the default list; benchmarks/cluster/results/deepspeed_pipeline.md);
* ``zen_dgc1_z2`` / ``zen_dgc1_z2_async``: DGC 1 % under ZeRO-2 with ``overlap_comm`` and 2 M-element
  IPG buckets, reduced in turn / handed whole to the communication worker while the backward pass
  goes on (not in the default list; the same results file).

Every run starts from the same weights and sees the same batches (same seed), so the loss curves are
comparable step by step. Repeats are interleaved (each repeat runs every configuration, in a rotated
order), with an optional wait for an idle machine before each run. Per run, the recipe's
``train_log.jsonl`` gives tokens/s of every step (rank 0's step time, which ends with an all-reduce of
the loss, so it includes the slowest rank); the first ``--warmup`` steps are dropped and the run's
median is one sample. Reported per configuration: min/median/max over the repeats, the loss curve of
the first repeat, and from ``zen_stats.jsonl`` ZEN's time inside the gradient reduction (``sync_s``,
DGC compression included) and bytes sent per step; per run the machine's CPU: busy fraction over the
run (``cpu_all``), the ranks' own share (``cpu_ours``, from the launcher's children) and the rest
(``foreign``: other programs on the machine). Checkpoints the recipe writes at the end are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import (  # noqa: E402
    append_jsonl, cpu_ticks, goodput_bytes_per_s, mmm, portable_path, read_jsonl, rotated, wait_quiet,
)

DEFAULT_MODEL = os.path.join(ROOT, "benchmarks", "cluster", "configs", "llama-bench.json")
RECIPE = os.path.join(ROOT, "recipes", "finetune_llm.py")
_Z2_OVERLAP = {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 2_000_000}
# ZeRO-3 as the ZeRO-3 demo sets it (parameters, gradients and optimizer state sharded; reduce_scatter on,
# so the zen configurations run ZEN's reduce-scatter: docs/deepspeed_zero3.md).
with open(os.path.join(ROOT, "configs", "demo_ds_zero3.json")) as _f:
    _Z3 = json.load(_f)["zero_optimization"]
CONFIGS = {
    "dense": dict(describe="DeepSpeed all-reduce", zen=None),
    "zen_dgc1": dict(describe="zen, DGC 1 %", zen={"scheme": "zen", "dgc": {"enabled": True, "density": 0.01},
                                                  "natural": {"enabled": False}}),
    "zen_dgc5": dict(describe="zen, DGC 5 %", zen={"scheme": "zen", "dgc": {"enabled": True, "density": 0.05},
                                                  "natural": {"enabled": False}}),
    # zen.dgc.value_bits (core/lowbit.py): DGC 1 %'s values and the owners' sums in 8 / 4 bits.
    "zen_dgc1_v8": dict(describe="zen, DGC 1 %, 8-bit values", zen={
        "scheme": "zen", "dgc": {"enabled": True, "density": 0.01, "value_bits": 8}, "natural": {"enabled": False}}),
    "zen_dgc1_v4": dict(describe="zen, DGC 1 %, 4-bit values", zen={
        "scheme": "zen", "dgc": {"enabled": True, "density": 0.01, "value_bits": 4}, "natural": {"enabled": False}}),
    # Higher densities, for time to quality (benchmarks/quality/bench_quality.py: 20 % keeps fine-tuning within
    # 1 % of dense): not in the default list.
    "zen_dgc10": dict(describe="zen, DGC 10 %", zen={"scheme": "zen", "dgc": {"enabled": True, "density": 0.10},
                                                    "natural": {"enabled": False}}),
    "zen_dgc20": dict(describe="zen, DGC 20 %", zen={"scheme": "zen", "dgc": {"enabled": True, "density": 0.20},
                                                    "natural": {"enabled": False}}),
    # zen.async_sync under DeepSpeed: 8 MB ZEN buckets so the engine bucket re-buckets into several,
    # pipelined (compress k + 1 while k is on the wire) vs the same buckets in turn.
    "zen_dgc1_b8": dict(describe="zen, DGC 1 %, 8 MB buckets", zen={
        "scheme": "zen", "bucket_cap_mb": 8, "dgc": {"enabled": True, "density": 0.01}, "natural": {"enabled": False}}),
    "zen_dgc1_b8_async": dict(describe="zen, DGC 1 %, 8 MB buckets pipelined", zen={
        "scheme": "zen", "bucket_cap_mb": 8, "async_sync": True, "dgc": {"enabled": True, "density": 0.01},
        "natural": {"enabled": False}}),
    # zen.async_sync under ZeRO-2 overlap_comm: the worker takes whole IPG buckets (2 M elements, about
    # ten per step of the bench model) while the backward pass fills the other buffer, vs in turn.
    "zen_dgc1_z2": dict(describe="zen, DGC 1 %, ZeRO-2 overlap_comm, IPG buckets in turn", zero=_Z2_OVERLAP, zen={
        "scheme": "zen", "dgc": {"enabled": True, "density": 0.01}, "natural": {"enabled": False}}),
    "zen_dgc1_z2_async": dict(describe="zen, DGC 1 %, ZeRO-2 overlap_comm, IPG buckets on the worker",
                              zero=_Z2_OVERLAP, zen={"scheme": "zen", "async_sync": True,
                                                     "dgc": {"enabled": True, "density": 0.01},
                                                     "natural": {"enabled": False}}),
    "zen_natural": dict(describe="zen, embedding rows (rest dense)",
                        zen={"scheme": "zen", "natural": {"enabled": True}, "dgc": {"enabled": False}}),
    # ZeRO-3 (docs/deepspeed_zero3.md): DeepSpeed's dense reduce-scatter against ZEN's, each rank receiving only its
    # partition; not in the default list. DGC needs gradient_accumulation_steps 1 under ZeRO-3 (set above).
    "dense_z3": dict(describe="DeepSpeed ZeRO-3, dense reduce-scatter", zero=_Z3, zen=None),
    "zen_dgc1_z3": dict(describe="zen reduce-scatter, DGC 1 %, ZeRO-3", zero=_Z3, zen={
        "scheme": "zen", "dgc": {"enabled": True, "density": 0.01}, "natural": {"enabled": False}}),
    "zen_dgc5_z3": dict(describe="zen reduce-scatter, DGC 5 %, ZeRO-3", zero=_Z3, zen={
        "scheme": "zen", "dgc": {"enabled": True, "density": 0.05}, "natural": {"enabled": False}}),
    # ZeRO-3 on several processes per emulated host: flat ZEN over all ranks vs the node-level reduce-scatter.
    "zen_dgc1_z3_flat": dict(describe="zen reduce-scatter, DGC 1 %, ZeRO-3, flat (zen.hierarchical false)",
                             zero=_Z3, zen={"scheme": "zen", "hierarchical": False,
                                            "dgc": {"enabled": True, "density": 0.01}, "natural": {"enabled": False}}),
    "zen_dgc1_z3_node": dict(describe="zen node-level reduce-scatter, DGC 1 %, ZeRO-3 (zen.hierarchical true)",
                             zero=_Z3, zen={"scheme": "zen", "hierarchical": True,
                                            "dgc": {"enabled": True, "density": 0.01}, "natural": {"enabled": False}}),
    "zen_natural_z3": dict(describe="zen reduce-scatter, embedding rows (rest dense), ZeRO-3", zero=_Z3,
                           zen={"scheme": "zen", "natural": {"enabled": True}, "dgc": {"enabled": False}}),
}


def baseline_of(name: str) -> str | None:
    """The dense configuration with ``name``'s ZeRO settings (``dense`` for ZeRO-0, ``dense_z3`` for ZeRO-3):
    ratios and the bytes a dense step sends are taken against it."""
    zero = CONFIGS[name].get("zero", {"stage": 0})
    return next((k for k, c in CONFIGS.items() if c["zen"] is None and c.get("zero", {"stage": 0}) == zero), None)


def ds_config(name: str, a) -> dict:
    """The DeepSpeed config of one configuration (the recipe's format, ``configs/demo_ds.json``)."""
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "torch_adam": True}},
           "zero_optimization": dict(CONFIGS[name].get("zero", {"stage": 0})), "steps_per_print": 10**9}
    zen = CONFIGS[name]["zen"]
    if zen is not None:
        cfg["zen"] = {**zen, "stats": {"summary": False}}
        if (zen.get("dgc") or {}).get("enabled"):  # steady-state steps: no default density ramp (25 % at first)
            cfg["zen"]["dgc"] = {**zen["dgc"], "warmup_steps": 0}
    return cfg


def run_once(name: str, rep: int, a) -> dict:
    """One launch of the recipe on the lab; returns its per-step records."""
    run_dir = os.path.join(a.work, "runs", f"{name}-r{rep}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    # Every run trains the same tokenizer; train it once and hand each run a copy (the recipe reuses it).
    tok = os.path.join(a.work, "tokenizer.json")
    if os.path.isfile(tok):
        shutil.copy(tok, os.path.join(run_dir, "tokenizer.json"))
    cfg_path = os.path.join(run_dir, "ds_config.json")
    with open(cfg_path, "w") as f:
        json.dump(ds_config(name, a), f, indent=1)
    cmd = [os.path.join(ROOT, "launch", "netlab", "launch.sh"), "-n", str(a.hosts), "-p", str(a.procs_per_host),
           "-r", a.rate, "--nice", str(a.nice), "--timeout", str(a.run_timeout_s), "--logdir", os.path.join(run_dir, "logs"), "--", RECIPE,
           "--deepspeed_config", cfg_path, "--model", a.model, "--vocab_size", str(a.tokenizer_vocab),
           "--seq_len", str(a.seq_len), "--steps", str(a.steps), "--seed", str(a.seed), "--output_dir", run_dir]
    t0, ticks0 = time.time(), cpu_ticks()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.run_timeout_s + 60)
    # The machine's CPU over the run: busy fraction, the ranks' share (the launcher's waited-for
    # descendants: ip netns exec, timeout, python) and what other programs took.
    wall, ticks1 = time.time() - t0, cpu_ticks()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    ours_s = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    cpu_all = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1])
    cpu_ours = ours_s / (wall * (os.cpu_count() or 1))
    if r.returncode:
        sys.stderr.write(r.stdout[-3000:] + r.stderr[-3000:])
        raise SystemExit(f"bench_e2e: run {name} repeat {rep} failed ({r.returncode}); logs in {run_dir}/logs")
    if not os.path.isfile(tok) and os.path.isfile(os.path.join(run_dir, "tokenizer.json")):
        shutil.copy(os.path.join(run_dir, "tokenizer.json"), tok)
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)  # ~1 GB per run, not needed
    steps = read_jsonl(os.path.join(run_dir, "train_log.jsonl"))
    zen = read_jsonl(os.path.join(run_dir, "zen_stats.jsonl"))
    if len(steps) != a.steps:
        raise SystemExit(f"bench_e2e: run {name} repeat {rep} logged {len(steps)} of {a.steps} steps ({run_dir})")
    return dict(steps=steps, zen=zen, wall_s=wall, cpu_all=cpu_all, cpu_ours=cpu_ours,
                foreign=max(0.0, cpu_all - cpu_ours))


def summarize(name: str, runs: list[dict], a, pre_busy: list[float]) -> dict:
    tokens = a.hosts * a.procs_per_host * a.micro_batch * a.seq_len
    timed = slice(a.warmup, None)
    per_run_tps = [statistics.median(s["tokens_per_s"] for s in r["steps"][timed]) for r in runs]
    all_tps = [s["tokens_per_s"] for r in runs for s in r["steps"][timed]]
    lo, med, hi = mmm(per_run_tps)
    rec = dict(bench="e2e", rate=a.rate, n=a.hosts, procs_per_host=a.procs_per_host,
               world=a.hosts * a.procs_per_host, nice=a.nice, config=name, describe=CONFIGS[name]["describe"],
               zen=CONFIGS[name]["zen"], ds_config=ds_config(name, a), model=portable_path(a.model),
               micro_batch=a.micro_batch,
               seq_len=a.seq_len, tokens_per_step=tokens, steps=a.steps, warmup=a.warmup, reps=len(runs),
               steps_timed=len(all_tps), tokens_per_s_runs=per_run_tps, tokens_per_s_min=lo, tokens_per_s_med=med,
               tokens_per_s_max=hi, step_s_min=tokens / hi, step_s_med=tokens / med, step_s_max=tokens / lo,
               step_times=[tokens / x for x in all_tps], losses=[s["loss"] for s in runs[0]["steps"]],
               eval_loss=runs[0]["steps"][-1].get("eval_loss"), run_wall_s=[r["wall_s"] for r in runs],
               pre_busy=pre_busy, loadavg=open("/proc/loadavg").read().split()[:3],
               cpu_all_runs=[r["cpu_all"] for r in runs], cpu_ours_runs=[r["cpu_ours"] for r in runs],
               foreign_runs=[r["foreign"] for r in runs])
    if CONFIGS[name]["zen"] is not None:
        zs = [z for r in runs for z in r["zen"][timed]]
        rec["sync_s_med"] = statistics.median(z["sync_s"] for z in zs)
        rec["compress_s_med"] = statistics.median(z.get("compress_s", 0.0) for z in zs)
        rec["hash_s_med"] = statistics.median(z.get("hash_s", 0.0) for z in zs)
        rec["bytes_sent_per_step"] = statistics.median(z["bytes_sent"] for z in zs)
        rec["dense_bytes_per_step"] = statistics.median(z["dense_bytes"] for z in zs)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="dense,zen_dgc1,zen_dgc5,zen_natural", help=f"comma list from {sorted(CONFIGS)}")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--procs-per-host", type=int, default=1,
                   help="processes per emulated host (launch.sh -p; the _node configurations need >= 2)")
    p.add_argument("--nice", type=int, default=0, help="launch.sh --nice: the ranks' niceness (root may go below 0)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model-config JSON (or HF name / checkpoint)")
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "cluster_e2e"),
                   help="run directories (tokenizer, logs, step logs); default runs/cluster_e2e in the repo")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of a run not timed")
    p.add_argument("--reps", type=int, default=5, help="interleaved repeats (runs per configuration)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-vocab", type=int, default=8192)
    p.add_argument("--run-timeout-s", type=int, default=540, help="limit of one recipe run on the lab (s)")
    p.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                   help="before each run wait up to S s for the machine to be idle")
    p.add_argument("--quiet-level", type=float, default=0.3)
    p.add_argument("--out", default=None, help="append JSON lines here")
    a = p.parse_args(argv)
    names = a.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs {unknown} must be from {sorted(CONFIGS)}")
    if a.procs_per_host < 1:
        raise SystemExit(f"--procs-per-host ({a.procs_per_host}) must be >= 1")
    if a.warmup >= a.steps:
        raise SystemExit(f"--warmup ({a.warmup}) must be < --steps ({a.steps})")
    os.makedirs(a.work, exist_ok=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    busy: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(a.reps):
        for name in rotated(names, rep):
            busy[name].append(wait_quiet(a.quiet_wait, a.quiet_level) if a.quiet_wait > 0 else -1.0)
            r = run_once(name, rep, a)
            runs[name].append(r)
            tps = statistics.median(s["tokens_per_s"] for s in r["steps"][a.warmup:])
            print(f"repeat {rep} {name:>12}: {tps:7.0f} tokens/s (median of steps {a.warmup + 1}..{a.steps}), "
                  f"final loss {r['steps'][-1]['loss']:.4f}, run {r['wall_s']:.0f} s, load {busy[name][-1]:.2f}, "
                  f"cpu busy {r['cpu_all']:.2f} (ours {r['cpu_ours']:.2f}, foreign {r['foreign']:.2f})",
                  flush=True)
    recs = {name: summarize(name, runs[name], a, busy[name]) for name in names}
    # What the dense collective sends per step for the same buckets (DeepSpeed's ring all-reduce, or its
    # reduce-scatter under ZeRO-3), as ZEN's statistics count it: per ZeRO setting, from a zen configuration.
    goodput = goodput_bytes_per_s(a.rate)
    for name, r in recs.items():
        base = baseline_of(name)
        dense_bytes = next((x["dense_bytes_per_step"] for k, x in recs.items()
                            if x.get("dense_bytes_per_step") and baseline_of(k) == base), None)
        if dense_bytes:
            r["dense_bound_s"] = dense_bytes / goodput if goodput else None
            if base == "dense":  # the key benchmarks/cluster/cluster_report.py reads
                r["dense_allreduce_bound_s"] = r["dense_bound_s"]
            if name == base:
                r["bytes_sent_per_step"] = dense_bytes
    for name, rec in recs.items():
        base = baseline_of(name)
        dense_med = recs[base]["tokens_per_s_med"] if base in recs and base != name else None
        rec["baseline"] = base
        rec["vs_baseline"] = rec["tokens_per_s_med"] / dense_med if dense_med else None
        vs = f", {rec['tokens_per_s_med'] / dense_med:.2f}x {base}" if dense_med else ""
        print(f"{name:>12}: tokens/s {rec['tokens_per_s_min']:.0f} / {rec['tokens_per_s_med']:.0f} / "
              f"{rec['tokens_per_s_max']:.0f} (min/median/max of {rec['reps']} runs){vs}", flush=True)
        if a.out:
            append_jsonl(a.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
