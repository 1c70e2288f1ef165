"""zen_ext and its peers on the emulated cluster: tokens/s of each method's training step over rate-limited links.

Usage (as root: the script brings up its own lab, ``launch/netlab/netlab.sh``, and takes it down)::

    NETLAB_PREFIX=zenp- NETLAB_SUBNET=10.79.0 nice -n 10 .venv/bin/python benchmarks/cluster/bench_peers_lab.py \\
        --labs 8:250mbit,16:100mbit --reps 3 --out benchmarks/cluster/results/peers_lab.jsonl \\
        --md benchmarks/cluster/results/peers_lab.md
    .venv/bin/python benchmarks/cluster/bench_peers_lab.py --report-only      # re-render the markdown

Method:

1. Per lab (``--labs``: hosts:rate, one rank per emulated host), bring the lab up once; every run uses it
   (``launch/netlab/launch.sh --reuse``).
2. Every method is ``benchmarks/quality/peers_ddp.py``, the runner of the time-to-quality comparison
   (``benchmarks/quality/bench_peers.py``), with its settings there, on the model, micro-batch and sequence
   length ``benchmarks/cluster/bench_e2e.py`` uses at 8 hosts (``benchmarks/cluster/configs/llama-lab16.json``,
   ~2.5 M parameters, 8,192-token trained tokenizer, micro-batch 2 × 64 tokens per rank; AdamW and clip from
   ``configs/demo_ds_dense.json``). Timing settings: zen_ext's DGC without its density ramp
   (``--zen_warmup_steps 0``) and PowerSGD compressing from step 3 (``start_powerSGD_iter`` 2, the least
   torch allows with warm start), so every timed step is a steady-state one; PowerSGD with one DDP bucket
   (with DDP's default two, torch's hook crashed on the lab with a gloo collective mismatch) and torchft's
   DiLoCo with ``init_sync`` off (identical seeded replicas; its healing is unreachable across namespaces):
   the markdown says why in full. ZeRO++ qgZ is the DeepSpeed
   recipe under ZeRO-3 with the CPU emulation of its quantized reduce-scatter
   (``benchmarks/quality/qgz_recipe.py``; one rank per emulated node, ``LOCAL_SIZE=1``), timed against dense
   ZeRO-3 (``dense_z3``) and dense DDP; it runs only where the emulation accepts every gradient's shape
   (DeepSpeed's kernels do not cover groups that are not a multiple of the world size), else it is skipped
   with the reason.
3. Repeats are interleaved: each repeat is one launch (``benchmarks/cluster/peers_lab_runs.py``: the runners
   in turn in one process per rank, so the ranks' start-up is paid once per repeat) running every method
   once, in an order rotated by the repeat (the DeepSpeed runs first, DiLoCo last), so a slow drift of the
   shared machine hits all methods alike.
4. A run's time per step is its timed window's wall time over its steps: the window starts after
   ``--warmup`` steps and is ``--steps`` steps long, or ``H`` for the DiLoCo family (DiLoCo H 50, SparseLoCo
   H 15, zen.outer H 5, 15 or 50: steps 3 to H + 2 hold step H), so it holds exactly one outer
   synchronization and its mean is the per-inner-step time including the outer all-reduce (all-gather)
   spread over H. A ``delay: 1`` method's window starts one round later (steps H + 3 to 2H + 2), so it holds
   the wait for the round in flight and the next launch, as every later round. ``inner_only``: 15 steps with
   no synchronization at all (the floor). The wall time is rank 0's ``elapsed_s`` (start of step 1 to
   the end of the step's loss all-reduce, which waits for the slowest rank); for the DeepSpeed recipe (qgZ,
   dense ZeRO-3) the sum of its step times (forward, backward and step; ZeRO-3's own collectives synchronize
   the ranks inside each). Tokens/s = ranks × micro-batch
   × sequence length / time per step. A run's first ``--warmup`` steps (2) are not timed.
5. Reported per lab and method: tokens/s min / median / max over the repeats, the median's ratio to dense DDP
   of the same lab and invocation (and qgZ's to dense ZeRO-3), bytes this rank sent per timed step (the
   runner's own count), and the machine's CPU per launch (busy fraction, the ranks' share, the rest).

All ranks share the machine's cores (2 on the reference machine): 8 or 16 ranks are compute-bound on them
while the links are emulated, so absolute tokens/s are this machine's; the ratios are what to read.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))
from cluster_common import append_jsonl, cpu_ticks, mmm, portable_path, read_jsonl, rotated  # noqa: E402

MODEL = os.path.join(ROOT, "benchmarks", "cluster", "configs", "llama-lab16.json")
PEERS = os.path.join(ROOT, "benchmarks", "quality", "peers_ddp.py")
RUNS = os.path.join(HERE, "peers_lab_runs.py")
NETLAB = os.path.join(ROOT, "launch", "netlab", "netlab.sh")
LAUNCH = os.path.join(ROOT, "launch", "netlab", "launch.sh")
RESULTS = os.path.join(ROOT, "benchmarks", "cluster", "results")

METHODS: dict[str, dict] = {
    # name → the runner's arguments (as bench_peers.py's VARIANTS, with the timing settings of Step 2), the
    # outer period H of the DiLoCo family (the timed window), and the baseline its ratio is taken against.
    "dense": dict(describe="dense DDP all-reduce", args=["--method", "dense"]),
    "zen_dgc5": dict(describe="zen_ext DDP hook, DGC 5 %", args=[
        "--method", "zen", "--zen_density", "0.05", "--zen_warmup_steps", "0"]),
    "zen_dgc1": dict(describe="zen_ext DDP hook, DGC 1 %", args=[
        "--method", "zen", "--zen_density", "0.01", "--zen_warmup_steps", "0"]),
    "zen_dgc1_v4": dict(describe="zen_ext DDP hook, DGC 1 %, value_bits 4", args=[
        "--method", "zen", "--zen_density", "0.01", "--zen_warmup_steps", "0", "--zen_value_bits", "4"]),
    "powersgd_r1": dict(describe="torch powerSGD_hook rank 1", args=[
        "--method", "powersgd", "--powersgd_rank", "1", "--powersgd_start_iter", "2", "--ddp_bucket_cap_mb", "64"]),
    "powersgd_r4": dict(describe="torch powerSGD_hook rank 4", args=[
        "--method", "powersgd", "--powersgd_rank", "4", "--powersgd_start_iter", "2", "--ddp_bucket_cap_mb", "64"]),
    "diloco_h50": dict(describe="torchft DiLoCo H 50 (per inner step)", args=[
        "--method", "diloco", "--sync_every", "50", "--no-torchft_init_sync"], H=50),
    "sparseloco_h15": dict(describe="SparseLoCo H 15 (per inner step)", args=[
        "--method", "sparseloco", "--sync_every", "15"], H=15),
    # zen_ext's own outer sync (peers_ddp --method zen_outer, bench_peers.py's zen_outer rows): the window is H.
    "zen_outer_diloco": dict(describe="zen.outer dense DiLoCo on ZEN, H 15 (per inner step)", args=[
        "--method", "zen_outer", "--zen_outer", "diloco", "--sync_every", "15"], H=15),
    "zen_outer_d25_4bit": dict(describe="zen.outer top-1,024 of 4,096, 4-bit, H 15 (per inner step)", args=[
        "--method", "zen_outer", "--zen_outer", "outer_d25_4bit", "--sync_every", "15"], H=15),
    "zen_outer_d25_h5_4bit": dict(describe="zen.outer top-1,024 of 4,096, 4-bit, H 5 (per inner step)", args=[
        "--method", "zen_outer", "--zen_outer", "outer_d25_h5_4bit"], H=5),
    # delay 1: round t's sum runs while round t+1 trains, and the next outer step waits for it; one untimed
    # round first (``lead``), so the window holds one wait for a round in flight and one launch, as every later round.
    "zen_outer_d25_4bit_delay1": dict(describe="zen.outer top-1,024 of 4,096, 4-bit, H 15, delay 1 (per inner step)",
                                      args=["--method", "zen_outer", "--zen_outer", "outer_d25_4bit_delay1",
                                            "--sync_every", "15"], H=15, lead=15),
    "zen_outer_d25_4bit_h50": dict(describe="zen.outer top-1,024 of 4,096, 4-bit, H 50 (per inner step)", args=[
        "--method", "zen_outer", "--zen_outer", "outer_d25_4bit", "--sync_every", "50"], H=50),
    # The floor of the DiLoCo family: the same inner steps with no synchronization in the window (zen.outer's
    # runner, whose DDP sends nothing per step, with its first outer step far past the run's end).
    "inner_only": dict(describe="inner steps alone, no synchronization (the DiLoCo family's floor)", args=[
        "--method", "zen_outer", "--zen_outer", "outer_d25_4bit", "--sync_every", "1000000"], H=15),
    "dense_z3": dict(describe="DeepSpeed ZeRO-3, dense reduce-scatter", deepspeed={}),
    "qgz_z3": dict(describe="ZeRO++ qgZ (CPU emulation), ZeRO-3", deepspeed={"zero_quantized_gradients": True},
                   baseline2="dense_z3"),
}


def qgz_refusal(model_path: str, vocab: int, world: int) -> str | None:
    """Why the qgZ emulation would refuse a gradient of this model at ``world`` ranks (None: it runs)."""
    import qgz_emulation

    sys.path.insert(0, ROOT)
    from recipes import common

    for name, p in common.build_model(model_path, vocab_size=vocab).named_parameters():
        if p.dim() == 1 or p.numel() % (2 * world):
            continue  # DeepSpeed's fallback: a plain reduce-scatter
        groups = max(p.shape[0], p.shape[1], world)
        try:
            qgz_emulation.check_shape(p.numel(), groups, world)
        except NotImplementedError as e:
            return f"{name} {tuple(p.shape)}: {e}"
    return None


def ds_config(method: str, a) -> dict:
    """The DeepSpeed recipe's config of a ZeRO-3 method: bench_e2e's ZeRO-3, the peers' micro-batch."""
    from bench_e2e import _Z3

    return {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
            "zero_optimization": {**_Z3, **METHODS[method]["deepspeed"]}, "steps_per_print": 10**9}


def window(method: str, a) -> int:
    """Step 4: timed steps of a run (H for the DiLoCo family: exactly one outer synchronization)."""
    return METHODS[method].get("H", a.steps)


def untimed(method: str, a) -> int:
    """Step 4: steps before the window: ``--warmup``, and a delay-1 method's first round (``lead``)."""
    return a.warmup + METHODS[method].get("lead", 0)


def launch(prog: list[str], run_dir: str, a, env_extra: dict | None = None) -> dict:
    """One ``launch.sh --reuse`` of ``prog`` on the running lab; the machine's CPU over it."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **(env_extra or {}))
    cmd = [LAUNCH, "--reuse", "--nice", str(a.nice), "--timeout", str(a.run_timeout_s),
           "--logdir", os.path.join(run_dir, "logs"), "--", *prog]
    t0, ticks0 = time.time(), cpu_ticks()
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.run_timeout_s + 60)
    wall, ticks1 = time.time() - t0, cpu_ticks()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])
        raise SystemExit(f"bench_peers_lab: launch failed ({r.returncode}); logs in {run_dir}/logs")
    ours = (kids1.ru_utime + kids1.ru_stime) - (kids0.ru_utime + kids0.ru_stime)
    cpu_all = (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1])
    cpu_ours = ours / (wall * (os.cpu_count() or 1))
    return dict(wall_s=wall, cpu_all=cpu_all, cpu_ours=cpu_ours, foreign=max(0.0, cpu_all - cpu_ours))


def timed(method: str, out_dir: str, a) -> dict:
    """Step 4: a run's time per timed step and bytes per timed step from its ``train_log.jsonl``."""
    recs = read_jsonl(os.path.join(out_dir, "train_log.jsonl"))
    skip = untimed(method, a)
    steps = skip + window(method, a)
    if len(recs) != steps:
        raise SystemExit(f"bench_peers_lab: {method} logged {len(recs)} of {steps} steps ({out_dir})")
    shutil.rmtree(os.path.join(out_dir, "checkpoints"), ignore_errors=True)
    win = recs[skip:]
    if "elapsed_s" in recs[0]:
        span = recs[-1]["elapsed_s"] - recs[skip - 1]["elapsed_s"]
    else:  # the DeepSpeed recipe: its step times, each ending with the loss all-reduce
        span = sum(x["step_s"] for x in win)
    sent = None
    if "elapsed_s" in recs[0]:
        sent = (win[-1]["bytes_sent"] - recs[skip - 1]["bytes_sent"]) / len(win)
    qgz = os.path.join(out_dir, "qgz_stats.json")
    if os.path.isfile(qgz):  # the DeepSpeed runs: the qgZ emulation's all-to-all bytes (0 for dense ZeRO-3)
        with open(qgz) as f:
            stats = json.load(f)
        if METHODS[method]["deepspeed"].get("zero_quantized_gradients") and not stats["quantized_tensors"]:
            raise SystemExit(f"bench_peers_lab: {method} sent no tensor through qgZ's quantized path ({out_dir})")
        sent = stats["bytes_sent"] / len(recs) if stats["quantized_tensors"] else None
    return dict(step_s=span / len(win), bytes_per_step=sent, loss_last=recs[-1]["loss"])


def run_rep(methods: list[str], n: int, rep: int, a) -> dict[str, dict]:
    """Steps 2-3, one repeat: every method in one launch (``peers_lab_runs.py``), in the repeat's rotated
    order, except that the DeepSpeed runs come first and DiLoCo last (torchft's Manager leaves threads)."""
    rep_dir = os.path.join(a.work, f"n{n}", f"r{rep}")
    shutil.rmtree(rep_dir, ignore_errors=True)
    os.makedirs(rep_dir)
    tok = os.path.join(a.work, "tokenizer.json")  # trained once, by the first run, reused by the others
    common = ["--model", a.model, "--vocab_size", str(a.vocab), "--seq_len", str(a.seq_len)]
    order = rotated(methods, rep)
    order = ([m for m in order if "deepspeed" in METHODS[m]] + [m for m in order if "deepspeed" not in METHODS[m]
                                                                 and m != "diloco_h50"]
             + [m for m in order if m == "diloco_h50"])
    ds_path = os.path.join(rep_dir, "ds_config.json")
    with open(os.path.join(ROOT, "configs", "demo_ds_dense.json")) as f:
        ds = json.load(f)
    ds["train_micro_batch_size_per_gpu"] = a.micro_batch
    with open(ds_path, "w") as f:
        json.dump(ds, f)
    runs = []
    for m in order:
        out = os.path.join(rep_dir, m)
        os.makedirs(out)
        if os.path.isfile(tok):
            shutil.copy(tok, os.path.join(out, "tokenizer.json"))
        steps = ["--steps", str(untimed(m, a) + window(m, a)), "--output_dir", out]
        if "deepspeed" in METHODS[m]:
            cfg = os.path.join(out, "ds_config.json")
            with open(cfg, "w") as f:
                json.dump(ds_config(m, a), f)
            runs.append({"name": m, "runner": "qgz", "argv": ["--deepspeed_config", cfg, *common, *steps]})
        else:
            runs.append({"name": m, "runner": "peers", "argv": ["--ds_config", ds_path, *METHODS[m]["args"],
                                                               *common, *steps]})
    spec = os.path.join(rep_dir, "runs.json")
    with open(spec, "w") as f:
        json.dump(runs, f)
    # One rank per emulated node: DeepSpeed's node count (world // LOCAL_SIZE) is then the world size.
    cpu = launch([RUNS, "--runs", spec], rep_dir, a, {"LOCAL_SIZE": "1"})
    results = {}
    for m in order:
        results[m] = {**timed(m, os.path.join(rep_dir, m), a), **cpu, "order": order}
        if not os.path.isfile(tok) and os.path.isfile(os.path.join(rep_dir, m, "tokenizer.json")):
            shutil.copy(os.path.join(rep_dir, m, "tokenizer.json"), tok)
    return results


def lab(n: int, rate: str, methods: list[str], a) -> list[dict]:
    """Steps 1, 3 and 5 for one lab size."""
    skipped = {}
    if "qgz_z3" in methods:
        why = qgz_refusal(a.model, a.vocab, n)
        if why:
            skipped["qgz_z3"] = f"the qgZ emulation refuses {why} (DeepSpeed's kernel would leave it unwritten)"
            methods = [m for m in methods if m not in ("qgz_z3", "dense_z3")]
    subprocess.run([NETLAB, "up", "-n", str(n), "-r", rate], check=True)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    t_start = time.time()
    try:
        for rep in range(a.reps):
            if rep and a.budget_s and time.time() - t_start > a.budget_s * rep / a.reps * 1.15:
                print(f"bench_peers_lab: {n} hosts over its time budget after {rep} repeats", flush=True)
                break
            for m, r in run_rep(methods, n, rep, a).items():
                runs[m].append(r)
                print(f"{n} hosts {rate} repeat {rep} {m:>15}: {r['step_s']:.3f} s/step (launch {r['wall_s']:.0f} s, "
                      f"cpu {r['cpu_all']:.2f}, ours {r['cpu_ours']:.2f}, foreign {r['foreign']:.2f})", flush=True)
    finally:
        subprocess.run([NETLAB, "down"], check=False)
    tokens = n * a.micro_batch * a.seq_len
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start))
    out = []
    for m, rs in runs.items():
        tps = [tokens / r["step_s"] for r in rs]
        lo, med, hi = mmm(tps)
        out.append(dict(bench="peers_lab", stamp=stamp, n=n, rate=rate, method=m, describe=METHODS[m]["describe"],
                        command=a.command, args=METHODS[m].get("args"), deepspeed=METHODS[m].get("deepspeed"),
                        model=portable_path(a.model), micro_batch=a.micro_batch, seq_len=a.seq_len,
                        tokens_per_step=tokens, warmup=a.warmup, timed_steps=window(m, a), reps=len(rs),
                        tokens_per_s_runs=tps, tokens_per_s_min=lo, tokens_per_s_med=med, tokens_per_s_max=hi,
                        step_s_med=tokens / med, step_s_runs=[r["step_s"] for r in rs],
                        bytes_per_step_med=statistics.median(r["bytes_per_step"] for r in rs)
                        if rs[0]["bytes_per_step"] is not None else None,
                        cpu_all_runs=[r["cpu_all"] for r in rs], cpu_ours_runs=[r["cpu_ours"] for r in rs],
                        foreign_runs=[r["foreign"] for r in rs], launch_wall_s=[r["wall_s"] for r in rs],
                        orders=[r["order"] for r in rs], loss_last_runs=[r["loss_last"] for r in rs],
                        cpus=os.cpu_count()))
    for m, why in skipped.items():
        out.append(dict(bench="peers_lab", stamp=stamp, n=n, rate=rate, method=m, describe=METHODS[m]["describe"],
                        skipped=why, model=portable_path(a.model)))
    med = {r["method"]: r.get("tokens_per_s_med") for r in out}
    for r in out:
        if r.get("tokens_per_s_med"):
            r["vs_dense"] = r["tokens_per_s_med"] / med["dense"] if med.get("dense") else None
            b2 = METHODS[r["method"]].get("baseline2")
            r["vs_baseline2"] = r["tokens_per_s_med"] / med[b2] if b2 and med.get(b2) else None
    return out


def render(recs: list[dict]) -> str:
    """The markdown of the latest invocation's records per lab size."""
    latest: dict[int, str] = {}
    for r in recs:
        latest[r["n"]] = max(latest.get(r["n"], ""), r["stamp"])
    lines = ["# zen_ext and its peers on the emulated cluster: tokens/s", "",
             "Measured by `benchmarks/cluster/bench_peers_lab.py` (its docstring has the method); raw records in "
             "`benchmarks/cluster/results/peers_lab.jsonl`. One rank per emulated host "
             "(`launch/netlab`, a rate-limited virtual NIC per host); every method is the time-to-quality "
             "comparison's own runner (`benchmarks/quality/peers_ddp.py`, qgZ the DeepSpeed recipe with "
             "`benchmarks/quality/qgz_recipe.py`) on the model bench_e2e uses at these sizes.", "",
             "**Read the ratios, not the absolute numbers:** all 8 or 16 ranks share this machine's "
             f"{next((r['cpus'] for r in recs if r.get('cpus')), '?')} CPU cores (compute-bound: each rank gets "
             "1/4 to 1/8 of a core; the link rates are emulated by netlab), so absolute tokens/s are this "
             "machine's. Ratios are to dense DDP of the same lab in the same invocation, repeats interleaved.", "",
             "Timing settings (each a property of the run, not of the method's quality runs): zen_ext's DGC without "
             "its density ramp (`dgc.warmup_steps: 0`: steady-state steps); PowerSGD compressing from step 3 "
             "(`start_powerSGD_iter` 2, the least torch allows with warm start; steps 1-2 are the warm-up) and with "
             "one DDP bucket (`bucket_cap_mb` 64): with DDP's default buckets (1 MB first bucket, then 25 MB) torch's "
             "hook crashed on 4 emulated hosts with a gloo collective size mismatch (`op.preamble.length <= "
             "op.nbytes. 320 vs 64`), most likely because it issues its Q all-reduce from a future's callback, so "
             "two buckets' all-reduces can reach gloo in a different order on different ranks (not investigated "
             "further); torchft's DiLoCo with `Manager(init_sync=False)`: the replicas start from the same seeded "
             "weights (torchft's docstring asks for False then), and its step-0 healing fetches replica 0's "
             "checkpoint from an address built from `socket.gethostname()`, which another emulated host cannot "
             "reach (it failed after 120 s). DiLoCo's lighthouse, store and manager addresses are each rank's lab "
             "address (`peers_ddp.reachable_address`). The DeepSpeed runs (dense ZeRO-3, qgZ) come first in every "
             "launch and DiLoCo last; the others rotate. CPU columns are over the whole launch (all methods of a "
             "repeat share one). Bytes: what the runner counts per timed step (qgZ: the emulation's quantized "
             "all-to-alls only, without ZeRO-3's parameter all-gathers and the fallbacks' reduce-scatters).", ""]
    for n in sorted(latest):
        rows = [r for r in recs if r["n"] == n and r["stamp"] == latest[n]]
        ok = [r for r in rows if "skipped" not in r]
        if not ok:  # a lab size that could not be measured at all: its reason
            lines += [f"## {n} hosts × {rows[0]['rate']}: not measured", ""] + [r["skipped"] for r in rows] + [""]
            continue
        r0 = ok[0]
        lines += [f"## {n} hosts × {r0['rate']} ({r0['stamp']})", "",
                  f"Model `{r0['model']}`, micro-batch {r0['micro_batch']} × {r0['seq_len']} tokens per rank "
                  f"({r0['tokens_per_step']} tokens per step), {r0['warmup']} warm-up steps, then the timed window. "
                  f"Command: `{r0.get('command')}`.",
                  "", "| method | timed steps × repeats | tokens/s min / median / max | step s (median) | × dense DDP "
                  "(median) | bytes / rank / step | CPU busy / ours / foreign (median) |", "|---|---|---|---|---|---|---|"]
        for r in ok:
            vs = f"**{r['vs_dense']:.2f}×**" if r.get("vs_dense") else "–"
            if r.get("vs_baseline2"):
                vs += f" ({r['vs_baseline2']:.2f}× {METHODS[r['method']]['baseline2']})"
            b = f"{r['bytes_per_step_med'] / 1024:,.1f} KiB" if r.get("bytes_per_step_med") is not None else "–"
            cpu = "/".join(f"{statistics.median(r[k]):.2f}" for k in ("cpu_all_runs", "cpu_ours_runs", "foreign_runs"))
            lines.append(f"| {r['method']}: {r['describe']} | {r['timed_steps']} × {r['reps']} | "
                         f"{r['tokens_per_s_min']:.0f} / {r['tokens_per_s_med']:.0f} / {r['tokens_per_s_max']:.0f} | "
                         f"{r['step_s_med']:.3f} | {vs} | {b} | {cpu} |")
        for r in rows:
            if "skipped" in r:
                lines.append(f"\nNot run: {r['method']} ({r['describe']}): {r['skipped']}.")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--labs", default="8:250mbit,16:100mbit", help="comma list of hosts:rate")
    p.add_argument("--methods", default=",".join(m for m in METHODS), help=f"comma list from {list(METHODS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=5, help="timed steps of the per-step methods (DiLoCo family: H)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--vocab", type=int, default=8192, help="trained tokenizer's vocabulary (bench_e2e's)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--nice", type=int, default=10, help="the ranks' niceness (launch.sh --nice)")
    p.add_argument("--run-timeout-s", type=int, default=400)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="per lab: start no further repeat once the lab's time is past its share of this (0: off)")
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "zen_peers_lab"))
    p.add_argument("--out", default=os.path.join(RESULTS, "peers_lab.jsonl"))
    p.add_argument("--md", default=os.path.join(RESULTS, "peers_lab.md"))
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    a.command = (f"NETLAB_PREFIX={os.environ.get('NETLAB_PREFIX', 'zenb-')} "
                 f"NETLAB_SUBNET={os.environ.get('NETLAB_SUBNET', '10.77.0')} "
                 + (f"nice -n {os.nice(0)} " if os.nice(0) else "") + ".venv/bin/python benchmarks/cluster/bench_peers_lab.py "
                 + " ".join(sys.argv[1:] if argv is None else argv))
    if not a.report_only:
        methods = a.methods.split(",")
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise SystemExit(f"--methods {unknown} must be from {list(METHODS)}")
        if "dense" not in methods:
            raise SystemExit("--methods must include dense (every ratio is to it)")
        if a.warmup < 2 or a.steps < 1:
            raise SystemExit(f"--warmup ({a.warmup}) must be >= 2 (PowerSGD sends dense until step 2, "
                             f"start_powerSGD_iter) and --steps ({a.steps}) >= 1")
        os.makedirs(a.work, exist_ok=True)
        sys.path.insert(0, ROOT)
        from recipes import common

        # The runs' tokenizer (the recipes' default text, BPE of --vocab tokens), trained once here.
        common.build_tokenizer("train", common.load_texts(common.BUILTIN_TEXT), a.work, a.vocab)
        for spec in a.labs.split(","):
            n, rate = spec.split(":")
            for rec in lab(int(n), rate, list(methods), a):
                append_jsonl(a.out, rec)
    text = render([r for r in read_jsonl(a.out) if r.get("bench") == "peers_lab"])
    with open(a.md, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
