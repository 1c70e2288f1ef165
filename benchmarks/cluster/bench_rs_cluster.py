"""Reduce-scatter wall time on the emulated cluster: dense, direct, zen and auto (docs/reduce_scatter.md),
and SparDL (docs/spardl.md) against ZEN + DGC, as reduce-scatter or all-reduce.

Usage (root; ``launch/netlab/launch.sh`` runs one process per emulated host)::

    launch/netlab/launch.sh -n 8 -r 250mbit -- benchmarks/cluster/bench_rs_cluster.py run \\
        --out benchmarks/cluster/results/cluster_rs.jsonl
    .venv/bin/python benchmarks/cluster/cluster_rs_report.py   # -> benchmarks/cluster/results/cluster_rs.md

Workloads: those of ``benchmarks/comm/bench_reduce_scatter.py`` (which counts their bytes in SimWorld), at
its sizes: ``dgc1`` / ``dgc5`` (DGC-like top-k at 1 % / 5 % of a 2^21-element fp32 bucket, integer
values) and ``text_rows`` (the embedding rows real text touches, 8192 × 256 fp32, values token
counts: skewed, the first ranges hold most rows). Owner ranges are even (FSDP2's chunks). Rank 0 builds
every rank's input from the workload's seed and writes it to ``--cache-dir``; every rank reads it and
keeps its own (one build instead of ``n`` on the shared cores). ``dense`` gets its input densified
before any timing (what ZeRO-3 holds before its reduce-scatter); the sparse schemes get the SparseGrad.

Per workload: a warm-up round (connections, ``zen``'s layout tables, ``auto``'s profile), every
scheme's shard compared with ``dense``'s for exact equality (integer values: any summation order is
exact); then ``--reps`` repeats, each running every scheme once in an order rotated by one, after a
barrier, each reduce-scatter written into one preallocated ``out=`` shard. A reduce-scatter's time is
the span from the first rank's start to the last rank's end (``cluster_common.SpanProbe``). Per scheme
the JSON line holds min/median/max, the Communicator's logical bytes per rank, the interface bytes, the
link bound ``max over ranks of max(sent, received) / goodput`` and time / bound, rounds and messages,
the byte/round model's prediction (``zen_ext/core/rs_auto.py``'s, on the lab's rate) and, for ``auto``,
its choice, why, and its predicted time against the measured one; the machine's CPU in every repeat.

SparDL (``--schemes ...,spardl``, DGC workloads only; benchmarks/cluster/results/cluster_spardl.md): lossy, so it
is left out of the exact check. It selects ``k/P`` entries per block itself, so it is handed what DGC
would hand it: the rank's dense gradient of the workload (``workloads.dgc_dense``, the one ``dgc1`` /
``dgc5`` took their top-k from; a fresh copy every call, made before the timing, as its memory) at
the workload's density; ZEN + DGC is ``zen`` on the ``dgc1`` / ``dgc5`` entries. ``dgc_select`` times
DGC's own selection of those entries on every rank (``DGCSparsifier.compress``, no communication), the
part of ZEN + DGC's step that SparDL's time includes. ``--collective all_reduce`` runs the all-reduce
forms instead (``dense``, ``zen``, ``spardl``: SRS + Bruck all-gather), each into one full-size ``out=``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import (  # noqa: E402
    Lab, SpanProbe, append_jsonl, finish_process, init_from_env, mmm, rotated, wait_quiet_all,
)

SCHEMES = ("dense", "direct", "zen", "auto")
#: Not in the default list: the lossy SparDL and DGC's selection alone (DGC workloads only).
SPARDL = ("spardl", "dgc_select")
ALL_REDUCE = ("dense", "zen", "spardl", "dgc_select")
DGC_DENSITY = {"dgc1": 0.01, "dgc5": 0.05}
WORKLOADS = ("dgc1", "dgc5", "text_rows")
#: 7 repeats: on the 2 shared cores the 8/16-host labs' medians moved by up to ±20 % between runs with 5
#: (benchmarks/cluster/results/cluster_pull16.md); the median of 7 ignores up to 3 disturbed repeats, and a
#: repeat of all four schemes costs ~1-3 s here, so a workload stays well under a minute.
DEFAULT_REPS = 7


# --- inputs --------------------------------------------------------------------------------------
def build_inputs(label: str, n: int, cache_dir: str) -> list:
    """Every rank's SparseGrad of workload ``label`` at ``n`` ranks (bench_reduce_scatter.py's)."""
    from benchmarks.comm.bench_reduce_scatter import text_rows

    from zen_ext.analysis.workloads import dgc_topk

    if label in ("dgc1", "dgc5"):
        return dgc_topk(n, numel=1 << 21, density=0.01 if label == "dgc1" else 0.05, seed=1)
    if label == "text_rows":
        return text_rows(n, cache_dir)
    raise SystemExit(f"--workloads ({label!r}) must be from {list(WORKLOADS)}")


def shared_inputs(label: str, n: int, rank: int, cache_dir: str) -> list:
    """Rank 0 builds every rank's input and writes it; every rank then reads the same file."""
    import torch.distributed as dist

    from zen_ext.core.types import SparseGrad

    path = os.path.join(cache_dir, f"rs_inputs_{label}_n{n}.pt")
    if rank == 0:
        os.makedirs(cache_dir, exist_ok=True)
        grads = build_inputs(label, n, cache_dir)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save([(g.indices, g.values, g.numel) for g in grads], tmp)
        os.replace(tmp, path)
    dist.barrier()
    return [SparseGrad(i, v, numel) for i, v, numel in torch.load(path)]


def predictions(grads: list, ranges: list, bandwidth_gbps: float, latency_us: float) -> dict:
    """Per candidate, the byte/round model's busiest-rank bytes, messages, rounds and seconds, from the
    profile ``auto`` gathers (``AutoReduceScatter._profile``, built here from every rank's input)."""
    from zen_ext.core.rs_auto import CANDIDATES, predict
    from zen_ext.core.rs_base import RSProfile, as_units
    from zen_ext.core.types import index_dtype

    n = len(grads)
    counts = []
    for g in grads:
        sg, urs = as_units(g, ranges)
        ends = torch.tensor([e for _, e in urs], dtype=torch.int64)
        counts.append(torch.bincount(torch.searchsorted(ends, sg.indices, right=True), minlength=n)[:n].tolist())
    sg, urs = as_units(grads[0], ranges)
    isz = torch.empty(0, dtype=index_dtype(sg.numel)).element_size()
    itemsize, width = sg.values.element_size(), sg.row_width
    p = RSProfile(n, [e - s for s, e in urs], counts, isz, itemsize * width)
    out = {}
    for s in CANDIDATES:
        v = predict(s, p, itemsize, width)
        out[s] = dict(v, seconds=v["bytes"] * 8 / (bandwidth_gbps * 1e9) + v["msgs"] * latency_us * 1e-6)
    return out


# --- one workload --------------------------------------------------------------------------------
def run_workload(a, lab: Lab, label: str, comm, rank: int, n: int) -> list[dict]:
    """Measure every scheme of ``a.schemes`` on one workload; returns the JSON records (rank 0 only).

    1. Inputs: this rank's gradient (densified for ``dense``), the even ranges, one ``out=`` shard;
       on rank 0 the model's predictions from every rank's input.
    2. Warm-up round: every scheme once, its shard compared with ``dense``'s (exact equality).
    3. Repeats: every scheme once per repeat, in an order rotated by one each repeat, timed over all
       ranks with logical bytes, interface bytes, CPU and phase timers.
    4. Summary per scheme (rank 0).
    """
    import torch.distributed as dist

    from zen_ext.core.reduce_scatter import build_reduce_scatter
    from zen_ext.core.registry import build_scheme
    from zen_ext.core.rs_base import even_ranges

    # Step 1: inputs.
    t_inputs = time.perf_counter()
    grads = shared_inputs(label, n, rank, a.cache_dir)
    mine = grads[rank]
    numel = mine.dense_numel
    ranges = even_ranges(numel, n)
    lo, hi = ranges[rank]
    mine_dense = mine.to_dense()
    all_reduce = a.collective == "all_reduce"
    out = torch.empty(numel if all_reduce else hi - lo, dtype=mine.values.dtype)
    bw_gbps = lab.goodput * 8 / 1e9 if lab.goodput else None
    names = [s for s in a.schemes if s not in SPARDL or label in DGC_DENSITY]
    build = build_scheme if all_reduce else build_reduce_scatter
    schemes = {s: build_reduce_scatter(s, bandwidth_gbps=bw_gbps, latency_us=a.latency_us) if s == "auto"
               else build(s) for s in names if s != "dgc_select"}
    preds = predictions(grads, ranges, bw_gbps or 10.0, a.latency_us) if rank == 0 and not all_reduce else {}
    if rank == 0 and not all_reduce and "spardl" in names:
        from zen_ext.core.rs_spardl import predict_spardl_bytes

        v = predict_spardl_bytes(n, [e - s for s, e in ranges], DGC_DENSITY[label], numel, mine.values.dtype)
        spardl_pred = dict(v, seconds=v["bytes"] / (lab.goodput or 1.25e9) + v["msgs"] * a.latency_us * 1e-6)
    else:
        spardl_pred = None
    fresh = new_input_factory(label, rank, numel, names)
    facts = dict(numel=numel, row_width=mine.row_width, dtype=str(mine.values.dtype),
                 nnz=[g.nnz for g in grads], density=sum(g.nnz * g.row_width for g in grads) / (n * numel))
    del grads
    t_inputs = time.perf_counter() - t_inputs

    def one(name: str, timings: dict | None, x=None) -> torch.Tensor:
        """One call of ``name``; ``x``: spardl's / dgc_select's input from ``fresh`` (made untimed)."""
        if name == "dgc_select":
            return x()
        x = x if x is not None else mine_dense if name == "dense" else mine
        # One slot per scheme, as a Synchronizer's bucket: exchanges carry their counts in the payload
        # from the second call on (comm/base.py); --count-round measures the old form.
        with (nullcontext() if a.count_round else comm.slot((name, label))):
            if all_reduce:
                return schemes[name].sync(comm, x, op="sum", out=out, timings=timings, key=label)
            return schemes[name].reduce_scatter(comm, x, ranges, op="sum", out=out, timings=timings, key=label)

    # Step 2: warm-up and the exact check against dense.
    ref = one("dense", None).clone()
    check: dict[str, dict] = {}
    for name in names:
        if name in SPARDL:  # lossy (spardl) or no reduction at all (dgc_select): warm-up only
            one(name, None, fresh(name))
            check[name] = dict(equal=None, max_abs_err=None)
            continue
        # auto runs its close candidates twice each before it settles (core/rs_auto.py): those calls are
        # warm-up here, so the repeats time its decision.
        for _ in range(2 * len(schemes["auto"].schemes) if name == "auto" else 1):
            got = one(name, None)
        mine_ok = [bool(torch.equal(got, ref)), float((got.double() - ref.double()).abs().max()) if got.numel() else 0.0]
        allv = comm.all_gather_object(mine_ok)
        check[name] = dict(equal=all(v[0] for v in allv), max_abs_err=max(v[1] for v in allv))
    del ref

    # Step 3: interleaved repeats.
    pre_busy = wait_quiet_all(a.quiet_wait, a.quiet_level, rank)
    recs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(a.reps):
        for name in rotated(names, rep):
            x = fresh(name) if name in SPARDL else None
            dist.barrier()
            before = comm.stats.snapshot()
            timings: dict = {}
            probe = SpanProbe(lab)
            one(name, timings, x)
            d = comm.stats - before
            rec = probe.finish(extra=[d.bytes_sent, d.bytes_recv, d.msgs_sent, d.msgs_recv, d.rounds])
            phases = comm.all_gather_object({k: v for k, v in timings.items() if isinstance(v, (float, str))
                                             and k != "why"})
            rec["phases"], rec["why"] = phases, timings.get("why")
            recs[name].append(rec)

    # Step 4: summary per scheme.
    if rank != 0:
        return []
    return [summarize(name, recs[name], check[name], dict(preds, spardl=spardl_pred) if spardl_pred else preds,
                      lab, n, label, facts, a, pre_busy, t_inputs) for name in names]


def new_input_factory(label: str, rank: int, numel: int, names: list[str]):
    """``fresh(name)``: a new input for ``spardl`` (an ``AccumulatedGrad`` over a copy of this rank's dense
    gradient: the scheme overwrites its memory with the residual) or ``dgc_select`` (a call of DGC's
    selection on such a copy), built before the timing."""
    if not any(s in SPARDL for s in names):
        return None
    from zen_ext.analysis.workloads import dgc_dense
    from zen_ext.compress.base import NamedGrad
    from zen_ext.compress.dgc.sparsifier import DGCSparsifier
    from zen_ext.core.types import AccumulatedGrad

    density = DGC_DENSITY[label]
    dense = dgc_dense([rank], numel=numel, seed=1)[0]  # the seed of build_inputs' dgc_topk
    sparsifier = DGCSparsifier({"density": density, "warmup_steps": 0, "momentum_correction": False})

    def select(g: torch.Tensor):
        sg = sparsifier.compress([NamedGrad("bucket", g)])
        sparsifier.end_step()
        return sg

    def fresh(name: str):
        g = dense.clone()
        return AccumulatedGrad.of(g, density, g.dtype) if name == "spardl" else (lambda: select(g))

    return fresh


def summarize(name: str, rs: list[dict], check: dict, preds: dict, lab: Lab, n: int, label: str, facts: dict,
              a, pre_busy: float, t_inputs: float) -> dict:
    """One scheme's JSON record from its repeats (every rank's numbers, gathered on rank 0)."""
    ts = [r["span"] for r in rs]
    ex = rs[0]["extra"]  # logical bytes are the same in every repeat
    sent, recv = [int(e[0]) for e in ex], [int(e[1]) for e in ex]
    busiest = max(max(s, r) for s, r in zip(sent, recv))
    bound = busiest / lab.goodput if lab.goodput else float("nan")
    t_min, t_med, t_max = mmm(ts)
    chosen = sorted({p.get("scheme") for r in rs for p in r["phases"] if p.get("scheme")})
    phase_keys = sorted({k for r in rs for p in r["phases"] for k, v in p.items() if isinstance(v, float)})
    phases = {k: statistics.median(max(p.get(k, 0.0) for p in r["phases"]) for r in rs) for k in phase_keys}
    model = preds.get(chosen[0] if name == "auto" and len(chosen) == 1 else name)
    # The model's own pick from the same profile: auto's choice should equal it (a check, not a given).
    lossless = {s: v for s, v in preds.items() if s != "spardl"}
    model_choice = min(lossless, key=lambda s: lossless[s]["seconds"]) if lossless else None
    return dict(
        bench="ar" if a.collective == "all_reduce" else "rs", collective=a.collective, **lab.meta(), n=n,
        workload=label, **facts, scheme=name, reps=len(ts), times=ts,
        t_min=t_min, t_med=t_med, t_max=t_max, bytes_sent=sent, bytes_recv=recv, busiest_bytes=busiest,
        msgs_sent=[int(e[2]) for e in ex], msgs_recv=[int(e[3]) for e in ex], rounds=max(int(e[4]) for e in ex),
        wire_tx=[statistics.median(r["wire_tx"][k] for r in rs) for k in range(n)],
        wire_rx=[statistics.median(r["wire_rx"][k] for r in rs) for k in range(n)],
        bound_s=bound, time_over_bound=t_med / bound if lab.goodput and bound > 0 else None,
        latency_us=a.latency_us, predicted=preds, predicted_s=model["seconds"] if model else None,
        predicted_bytes=model["bytes"] if model else None, chosen=chosen, model_choice=model_choice,
        why=rs[0]["why"] if name == "auto" else None, phases=phases, check_equal=check["equal"],
        check_max_abs_err=check["max_abs_err"], cpu_all=statistics.median(r["cpu_all"] for r in rs),
        cpu_ours=statistics.median(r["cpu_ours"] for r in rs), foreign=statistics.median(r["foreign"] for r in rs),
        pre_busy=pre_busy, inputs_s=t_inputs, tag=a.tag, commit=_commit(), counts="round" if a.count_round else "inline",
        utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        records=[dict(span=r["span"], cpu_all=r["cpu_all"], cpu_ours=r["cpu_ours"], foreign=r["foreign"])
                 for r in rs],
    )


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip()


def cmd_run(a) -> int:
    from zen_ext.comm.torch_dist import TorchCommunicator

    rank, n = init_from_env()
    lab = Lab.from_env()
    comm = TorchCommunicator(exchange_impl="p2p")
    if rank == 0:
        print(f"# bench_rs_cluster: n={n} rate={lab.rate} goodput={lab.goodput * 8 / 1e9:.3f} Gbit/s/host "
              f"schemes={a.schemes} reps={a.reps} loadavg={lab.meta()['loadavg']}", flush=True)
        print(f"{'workload':>10} {'scheme':>7} {'t_min':>7} {'t_med':>7} {'t_max':>7} {'bound':>7} {'t/bnd':>5} "
              f"{'pred':>7} {'MB max':>7} {'wire MB':>7} {'rnds':>4} {'equal':>5} {'cpu':>4} {'fgn':>4} chosen",
              flush=True)
    for label in a.workloads:
        t0 = time.time()
        for r in run_workload(a, lab, label, comm, rank, n):
            tob = f"{r['time_over_bound']:5.1f}" if r["time_over_bound"] else "  nan"
            pred = f"{r['predicted_s']:7.4f}" if r["predicted_s"] is not None else "    nan"
            print(f"{label:>10} {r['scheme']:>7} {r['t_min']:7.4f} {r['t_med']:7.4f} {r['t_max']:7.4f} "
                  f"{r['bound_s']:7.4f} {tob} {pred} {r['busiest_bytes'] / 1e6:7.3f} "
                  f"{max(r['wire_tx']) / 1e6:7.3f} {r['rounds']:4d} {str(r['check_equal']):>5} "
                  f"{r['cpu_all']:4.2f} {r['foreign']:4.2f} {','.join(r['chosen'])}", flush=True)
            if a.out:
                append_jsonl(a.out, r)
        if rank == 0:
            print(f"# {label}: {time.time() - t0:.0f} s", flush=True)
    finish_process(0)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="measure (one process per host, under launch/netlab/launch.sh)")
    pr.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS),
                    help=f"comma list from {list(WORKLOADS)}")
    pr.add_argument("--schemes", type=lambda s: s.split(","), default=list(SCHEMES),
                    help=f"comma list from {list(SCHEMES + SPARDL)} (all_reduce: {list(ALL_REDUCE)})")
    pr.add_argument("--collective", choices=("reduce_scatter", "all_reduce"), default="reduce_scatter",
                    help="time the schemes' reduce-scatter (default) or all-reduce forms")
    pr.add_argument("--reps", type=int, default=DEFAULT_REPS, help="interleaved repeats (default 7: see DEFAULT_REPS)")
    pr.add_argument("--latency-us", type=float, default=50.0, help="α of the predictions and of auto (planner default)")
    pr.add_argument("--cache-dir", default="/tmp/zen_bench_rs", help="tokenizer and the ranks' shared inputs")
    pr.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="before each workload wait up to S s for the machine to be idle")
    pr.add_argument("--quiet-level", type=float, default=0.3)
    pr.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    pr.add_argument("--tag", default="", help="a label of this run (cluster_rs_report.py shows it)")
    pr.add_argument("--count-round", action="store_true",
                    help="exchanges send their counts in a round of their own (no slot), as before the "
                         "count-carrying exchange")
    a = p.parse_args(argv)
    if a.reps < 1:
        raise SystemExit(f"--reps ({a.reps}) must be >= 1")
    valid = ALL_REDUCE if a.collective == "all_reduce" else SCHEMES + SPARDL
    bad = sorted(set(a.schemes) - set(valid)) + sorted(set(a.workloads) - set(WORKLOADS))
    if bad or "dense" not in a.schemes:
        raise SystemExit(f"--schemes must include dense and be from {list(valid)} (--collective {a.collective}), "
                         f"--workloads from {list(WORKLOADS)} (got unknown {bad})")
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
