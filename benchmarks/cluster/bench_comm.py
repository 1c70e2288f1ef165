"""Communication benchmark on the emulated cluster: time per sync and bytes per rank of every scheme.

Usage (``benchmarks/cluster/run_cluster_report.sh`` runs all of it)::

    # 1. synthetic workloads, written once as trace step files (one process)
    .venv/bin/python benchmarks/cluster/bench_comm.py prepare --work /tmp/zen_cluster/workloads
    # 2. measure: one process per emulated host (``scale`` instead predicts bytes at more hosts)
    launch/netlab/launch.sh -n 4 -r 1gbit -- benchmarks/cluster/bench_comm.py run \\
        --workload synth_dgc1=/tmp/zen_cluster/workloads/synth_dgc1 --out benchmarks/cluster/results/cluster_comm.jsonl

A workload is a gradient trace (``zen_ext.analysis.traces``: one file per step, every rank's sparse
gradients) — recorded from the fine-tuning recipe, or synthetic (``zen_ext.analysis.workloads``,
calibrated to the paper). Rank ``r`` of the lab replays rank ``r``'s gradients of one step; one
*sync* is every slice of that step through one scheme, as a training step would do; ``dense`` gets
each slice already densified (what a training step without sparsification all-reduces).

Each repeat runs every scheme once, in a rotated order (interleaved, so slow drifts of the shared
machine hit all schemes alike), after a barrier; a sync's time is the span from the first rank's
start to the last rank's end. Per scheme the JSON line holds min/median/max over the repeats, the
Communicator's logical bytes per rank (deterministic), the bytes each host's interface really sent,
the link-rate bound ``max over ranks of max(sent, received) / goodput`` and its efficiency, the α–β
model's time for the measured traffic (``cost_model.modeled_time_s``) and the planner's prediction
from a sparsity profile (``cost_model.predict_time_s``), per-phase seconds (median over repeats of
the slowest rank), and the machine's CPU (ours vs foreign). Every scheme's result is checked against
``dense`` on the first round (max |difference|), so a fast wrong scheme cannot win. Results are
written into one preallocated buffer per slice (``out=``, as the engines pass their bucket; before
2026-11-25 every sync made a fresh result, ``--fresh-result``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster_common import (  # noqa: E402
    Lab, SpanProbe, append_jsonl, finish_process, init_from_env, mmm, portable_path, rotated, wait_quiet_all,
)

if TYPE_CHECKING:
    from zen_ext.analysis.traces import TraceStep

SCHEMES = ("dense", "agsparse", "sparcml", "omnireduce", "sparse_ps", "zen", "zen_coo")
#: ZEN with ``zen.dgc.value_bits`` (``core/lowbit.py``): the recorded values quantized in the push and the
#: owners' sums in the pull, with the owner residual kept per slice across repeats, as training keeps it
#: (the sender's feedback goes to DGC, which a replay has not: values alone are timed). Lossy by design:
#: the warm-up check reports its error against dense instead of zero.
LOW_BIT = {"zen_v8": 8, "zen_v4": 4}
#: Measured too: the planner, calibrated in the lab (link probe, compute micro-benchmark) and profiled
#: on the warm-up round (``profile_steps`` 1), then refined by every timed sync as in training.
AUTO = "auto"


# --- workloads -----------------------------------------------------------------------------------
def synthetic_workloads(n: int, dgc_numel: int, emb_row_width: int, seed: int) -> dict[str, dict[str, list]]:
    """The calibrated synthetic workloads, each one step with one slice (label → {key: grads})."""
    from zen_ext.analysis.workloads import dgc_topk, zipf_embedding

    return {
        "synth_dgc1": {"bucket": dgc_topk(n, numel=dgc_numel, density=0.01, seed=seed)},
        "synth_dgc5": {"bucket": dgc_topk(n, numel=dgc_numel, density=0.05, seed=seed)},
        "synth_embedding": {"embedding": zipf_embedding(n, row_width=emb_row_width, form="row", seed=seed)},
    }


def cmd_prepare(a) -> int:
    from zen_ext.analysis.traces import TraceStep, save_step, step_path

    for label, slices in synthetic_workloads(a.ranks, a.dgc_numel, a.emb_row_width, a.seed).items():
        path = step_path(os.path.join(a.work, label), 0)
        save_step(path, TraceStep(0, slices))
        nnz = [g.indices.numel() for g in next(iter(slices.values()))]
        print(f"{label}: {path} (nnz per rank {nnz})")
    return 0


def cmd_scale(a) -> int:
    """Bytes per rank at more hosts than the lab holds: the cost model's prediction (exact per rank for
    SimWorld, tests/unit/test_planner.py) on the synthetic workloads, nested over ``n`` (rank r's
    gradient does not depend on n)."""
    from zen_ext.planner import cost_model as cm
    from zen_ext.planner.profile import profile_from_grads

    ranks = [int(x) for x in a.ranks.split(",")]
    for label, slices in synthetic_workloads(max(ranks), a.dgc_numel, a.emb_row_width, a.seed).items():
        grads = next(iter(slices.values()))
        for n in ranks:
            prof = profile_from_grads(grads[:n])
            sent = {s: max(x.bytes_sent for x in cm.predict_stats(s, prof)) for s in SCHEMES if s in cm.modeled_schemes()}
            rec = dict(bench="scale", workload=label, n=n, gamma_n=prof.gamma(n), density=prof.density(),
                       max_bytes_sent=sent)
            print(f"{label:>16} n={n:3d} gamma_n={rec['gamma_n']:.2f} " +
                  " ".join(f"{k} {v / 1e6:.2f}" for k, v in sent.items()) + " (MB)", flush=True)
            if a.out:
                append_jsonl(a.out, rec)
    return 0


def load_workload(spec: str) -> tuple[str, str, "TraceStep"]:
    """``label=path[@step]`` → (label, file, TraceStep); a directory without ``@step`` gives its last step."""
    from zen_ext.analysis.traces import load_step, trace_files

    if "=" not in spec:
        raise SystemExit(f"--workload ({spec!r}) must be label=path[@step]")
    label, path = spec.split("=", 1)
    step = None
    if "@" in path:
        path, step = path.rsplit("@", 1)
    files = trace_files(path)
    if step is None:
        f = files[-1]
    else:
        want = f"step_{int(step):08d}.pt"
        match = [x for x in files if os.path.basename(x) == want]
        if not match:
            raise SystemExit(f"--workload {label}: step ({step}) must be one of the trace's "
                             f"{[os.path.basename(x) for x in files]}")
        f = match[0]
    return label, f, load_step(f)


# --- one workload --------------------------------------------------------------------------------
def _predictions(step, n: int, schemes: list[str], net, first_call: bool = False) -> dict[str, dict]:
    """Planner-model prediction (time and max bytes sent) per scheme, summed over the step's slices: of
    a slot's repeat (counts in the payload), or with ``first_call`` of the count-round form."""
    from zen_ext.planner import cost_model as cm
    from zen_ext.planner.network import modeled_time_s
    from zen_ext.planner.profile import profile_from_grads

    out = {s: dict(predicted_s=0.0, predicted_max_sent=0) for s in schemes
           if s in cm.modeled_schemes() or s in LOW_BIT}
    for grads in step.slices.values():
        prof = profile_from_grads(grads[:n])
        for s in out:
            stats = (cm.predict_stats("zen", prof, {"value_bits": LOW_BIT[s]}, first_call=first_call) if s in LOW_BIT
                     else cm.predict_stats(s, prof, first_call=first_call))
            out[s]["predicted_s"] += modeled_time_s(stats, net) if net else float("nan")
            out[s]["predicted_max_sent"] += max(x.bytes_sent for x in stats)
    return out


def _auto_predicted(auto, keys: list[str], rank: int) -> float:
    """``auto``'s own predicted time of what it chose, summed over the slices (its latest profile)."""
    total = 0.0
    for key in keys:
        st = auto._states.get((key, rank))
        if st is None or not st.predictions or st.choice is None:
            return float("nan")
        total += st.predictions[-1].get(st.choice, float("nan"))
    return total


def run_workload(a, lab: Lab, label: str, path: str, step, comm, rank: int, n: int) -> list[dict]:
    """Measure every scheme of ``a.schemes`` on one workload; returns the JSON records (rank 0 only).

    1. Inputs: this rank's gradients of the step (densified for ``dense``), the schemes, and on rank 0
       the cost model's predictions from a sparsity profile of every rank's gradients.
    2. Warm-up round: every scheme once (connections, caches), its result compared with ``dense``.
    3. Repeats: every scheme once per repeat, in an order rotated by one each repeat; each sync timed
       over all ranks with its logical bytes, wire bytes, CPU and phase timers.
    4. Summary per scheme: min/median/max, bound and efficiency, modeled and predicted time.
    """
    import torch.distributed as dist

    from zen_ext import build_scheme
    from zen_ext.comm.base import CommStats
    from zen_ext.planner.network import Network, modeled_time_s

    # Step 1: inputs, schemes, predictions.
    if step.world_size < n:
        raise SystemExit(f"workload {label}: trace has {step.world_size} ranks, the lab {n}")
    mine = {key: grads[rank] for key, grads in step.slices.items()}
    # The dense baseline all-reduces the gradient a training step already holds in dense form, so it
    # gets it densified before any timing (its all-reduce still copies it, as DeepSpeed's flatten does).
    mine_dense = {key: g.to_dense() for key, g in mine.items()} if "dense" in a.schemes else {}
    schemes = {name: build_scheme(name, profile_steps=1) if name == AUTO else
               build_scheme("zen") if name in LOW_BIT else build_scheme(name) for name in a.schemes}
    owner_res: dict = {}  # (low-bit variant, slice) → this rank's owner residual, zeros at first

    def low_bit(name: str, key: str, g):
        """The slice as DGC hands it over with ``value_bits``: ``g`` with its ``LowBitValues``."""
        import dataclasses

        from zen_ext.core.lowbit import LowBitValues

        def residual(m, device, slot=(name, key)):
            if slot not in owner_res:
                owner_res[slot] = torch.zeros(m, dtype=torch.float32, device=device)
            return owner_res[slot]

        return dataclasses.replace(g, lowbit=LowBitValues(LOW_BIT[name], owner_residual=residual))
    net = Network(bandwidth_gbps=lab.goodput * 8 / 1e9, latency_us=a.latency_us) if lab.goodput else None
    preds = _predictions(step, n, list(schemes), net, a.count_round) if rank == 0 else {}

    # Results land in one buffer per slice, reused by every scheme and repeat, as the engines pass
    # their bucket (``out=``); ``--fresh-result`` gives every sync a new tensor instead (on the CPU a
    # new mapping whose page faults every scheme then pays).
    outs_buf = {} if a.fresh_result else {
        key: torch.empty(g.dense_numel, dtype=g.values.dtype) for key, g in mine.items()}

    def sync_all(name: str, timings: dict | None = None) -> list[torch.Tensor]:
        scheme, outs = schemes[name], []
        for key, g in (mine_dense if scheme.name == "dense" else mine).items():
            t: dict = {}
            if name in LOW_BIT:
                g = low_bit(name, key, g)
            # One slot per scheme and slice, as a Synchronizer's bucket: exchanges carry their counts in
            # the payload from the second call on (comm/base.py); --count-round measures the old form.
            with (nullcontext() if a.count_round else comm.slot((name, key))):
                res = scheme.sync(comm, g, key=key, timings=t, out=outs_buf.get(key))
            # The warm-up round (no timings) compares the results afterwards: keep copies.
            outs.append(res.clone() if outs_buf and timings is None else res)
            if timings is not None:
                for k, v in t.items():
                    if isinstance(v, float):
                        timings[k] = timings.get(k, 0.0) + v
                if "scheme" in t:  # auto: what it ran
                    timings.setdefault("chosen", []).append(t["scheme"])
        return outs

    # Step 2: warm-up round: connections, partitioner caches; every result checked against dense.
    ref = sync_all("dense") if "dense" in schemes else None
    check = {}
    for name in schemes:
        outs = sync_all(name)
        err = max((float((o.double() - r.double()).abs().max()) if o.numel() else 0.0 for o, r in zip(outs, ref)),
                  default=0.0) if ref is not None else float("nan")
        errs = [0.0] * n
        dist.all_gather_object(errs, err)
        check[name] = max(errs)
    if AUTO in schemes:
        # auto measures every close candidate before its choice is final: warm it up until then,
        # so the repeats time what a long run settles on (the same count on every rank).
        from zen_ext.planner.auto import MEASURED_RUNS

        for _ in range((1 + MEASURED_RUNS) * len(schemes[AUTO].candidates) + 1):
            if all(schemes[AUTO].settled(k) for k in mine):
                break
            sync_all(AUTO)
    del ref

    # Step 3: interleaved repeats, after waiting (bounded) for an idle machine.
    pre_busy = wait_quiet_all(a.quiet_wait, a.quiet_level, rank)
    names = list(schemes)
    recs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(a.reps):
        order = rotated(names, rep)
        for name in order:
            dist.barrier()
            before = comm.stats.snapshot()
            ag = comm.op_stats.setdefault("all_gather_v", CommStats())
            ag_before = ag.snapshot()
            timings: dict = {}
            probe = SpanProbe(lab)
            sync_all(name, timings)
            d = comm.stats - before
            dag = comm.op_stats["all_gather_v"] - ag_before
            rec = probe.finish(extra=[d.bytes_sent, d.bytes_recv, d.msgs_sent, d.msgs_recv, d.rounds,
                                      dag.bytes_sent, dag.bytes_recv, dag.rounds])
            phases = [{}] * n
            dist.all_gather_object(phases, timings)
            rec["phases"] = phases
            recs[name].append(rec)

    # Step 4: summary per scheme (rank 0 holds every rank's numbers).
    if rank != 0:
        return []
    out = []
    slices = [dict(key=k, numel=g[0].numel, row_width=g[0].row_width, dtype=str(g[0].dtype),
                   nnz=[x.indices.numel() for x in g[:n]]) for k, g in step.slices.items()]
    density = statistics.mean(s["nnz"][r] / s["numel"] for s in slices for r in range(n))
    for name in names:
        rs = recs[name]
        ts = [r["span"] for r in rs]
        ex = rs[0]["extra"]  # logical bytes are identical in every repeat
        sent, recv = [int(e[0]) for e in ex], [int(e[1]) for e in ex]
        msgs_sent, msgs_recv = [int(e[2]) for e in ex], [int(e[3]) for e in ex]
        stats = [CommStats(s, r, ms, mr) for s, r, ms, mr in zip(sent, recv, msgs_sent, msgs_recv)]
        bound = max(max(s, r) for s, r in zip(sent, recv)) / lab.goodput if lab.goodput else float("nan")
        # The all-gather part (ZEN's pull, AGsparse, the PS pulls): its own link bound and rounds.
        ag_bound = (max(max(int(e[5]), int(e[6])) for e in ex) / lab.goodput) if lab.goodput else float("nan")
        rounds, ag_rounds = max(int(e[4]) for e in ex), max(int(e[7]) for e in ex)
        t_min, t_med, t_max = mmm(ts)
        chosen = sorted({c for r in rs for p in r["phases"] for c in p.get("chosen", [])})
        phase_keys = sorted({k for r in rs for p in r["phases"] for k in p if k != "chosen"})
        phases = {k: statistics.median(max(p.get(k, 0.0) for p in r["phases"]) for r in rs) for k in phase_keys}
        out.append(dict(
            bench="comm", **lab.meta(), n=n, workload=label, path=portable_path(path), step=step.step, slices=slices,
            density=density, scheme=name, reps=len(ts), times=ts, t_min=t_min, t_med=t_med, t_max=t_max,
            bytes_sent=sent, bytes_recv=recv, msgs_sent=msgs_sent, msgs_recv=msgs_recv,
            wire_tx=[statistics.median(r["wire_tx"][k] for r in rs) for k in range(n)],
            bound_s=bound, eff=bound / t_med if lab.goodput else None, rounds=rounds,
            gather_rounds=ag_rounds, gather_bound_s=ag_bound, gather_impl=comm.gather_impl,
            counts="round" if a.count_round else "inline",
            auto_predicted_s=(_auto_predicted(schemes[name], list(mine), rank) if name == AUTO else None),
            latency_us=a.latency_us, modeled_s=modeled_time_s(stats, net) if net else None,
            **preds.get(name, dict(predicted_s=None, predicted_max_sent=None)),
            phases=phases, check_max_abs_err=check[name], chosen=chosen,
            explain=schemes[name].explain() if name == AUTO else None,
            cpu_all=statistics.median(r["cpu_all"] for r in rs), cpu_ours=statistics.median(r["cpu_ours"] for r in rs),
            foreign=statistics.median(r["foreign"] for r in rs), pre_busy=pre_busy,
            records=[dict(span=r["span"], cpu_all=r["cpu_all"], cpu_ours=r["cpu_ours"], foreign=r["foreign"])
                     for r in rs],
        ))
    return out


def cmd_run(a) -> int:
    from zen_ext.comm.torch_dist import TorchCommunicator

    rank, n = init_from_env()
    lab = Lab.from_env()
    comm = TorchCommunicator(exchange_impl="p2p", gather_impl=a.gather_impl)
    if rank == 0:
        print(f"# bench_comm: n={n} rate={lab.rate} goodput={lab.goodput * 8 / 1e9:.3f} Gbit/s/host "
              f"schemes={a.schemes} reps={a.reps} gather={a.gather_impl} loadavg={lab.meta()['loadavg']}",
              flush=True)
        print(f"{'workload':>16} {'scheme':>10} {'t_min':>8} {'t_med':>8} {'t_max':>8} {'bound':>8} {'eff%':>5} "
              f"{'modeled':>8} {'MB sent':>8} {'wire MB':>8} {'err':>8} {'cpu':>5} {'fgn':>5} {'rnds':>4} "
              f"{'ag_rnd':>6} {'ag_bnd':>7} {'pull_s':>7} {'pred':>7}", flush=True)
    for spec in a.workload:
        label, path, step = load_workload(spec)
        t0 = time.time()
        for r in run_workload(a, lab, label, path, step, comm, rank, n):
            eff = f"{100 * r['eff']:5.1f}" if r["eff"] else "  nan"
            mod = f"{r['modeled_s']:8.4f}" if r["modeled_s"] is not None else "     nan"
            print(f"{label:>16} {r['scheme']:>10} {r['t_min']:8.4f} {r['t_med']:8.4f} {r['t_max']:8.4f} "
                  f"{r['bound_s']:8.4f} {eff} {mod} {max(r['bytes_sent']) / 1e6:8.3f} "
                  f"{max(r['wire_tx']) / 1e6:8.3f} {r['check_max_abs_err']:8.1e} {r['cpu_all']:5.2f} "
                  f"{r['foreign']:5.2f} {r['rounds']:4d} {r['gather_rounds']:6d} {r['gather_bound_s']:7.4f} "
                  f"{r['phases'].get('pull_s', float('nan')):7.4f} "
                  f"{r['auto_predicted_s'] if r['auto_predicted_s'] is not None else float('nan'):7.4f} "
                  f"{','.join(r['chosen'])}", flush=True)
            if a.out:
                append_jsonl(a.out, {**r, "tag": a.tag})
        if rank == 0:
            print(f"# {label}: {time.time() - t0:.0f} s", flush=True)
        del step
    finish_process(0)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the synthetic workloads as trace step files")
    pp.add_argument("--work", required=True, help="directory; one sub-directory per workload")
    pp.add_argument("--ranks", type=int, default=4, help="ranks to generate (a lab of n <= this uses the first n)")
    pp.add_argument("--dgc-numel", type=int, default=1 << 24, help="DGC bucket elements (default 2^24: 64 MiB fp32)")
    pp.add_argument("--emb-row-width", type=int, default=768, help="embedding row width (BERT: 768)")
    pp.add_argument("--seed", type=int, default=0)
    ps = sub.add_parser("scale", help="predicted bytes per rank of every scheme at more hosts (cost model)")
    ps.add_argument("--ranks", default="4,8,16,32")
    ps.add_argument("--dgc-numel", type=int, default=1 << 24)
    ps.add_argument("--emb-row-width", type=int, default=768)
    ps.add_argument("--seed", type=int, default=0)
    ps.add_argument("--out", default=None, help="append JSON lines here")
    pr = sub.add_parser("run", help="measure (one process per host, under launch/netlab/launch.sh)")
    pr.add_argument("--workload", action="append", required=True, help="label=path[@step]; repeatable")
    pr.add_argument("--schemes", type=lambda s: s.split(","), default=[*SCHEMES, AUTO],
                    help=f"of {', '.join([*SCHEMES, AUTO, *LOW_BIT])} (zen_v8/zen_v4: ZEN with zen.dgc.value_bits)")
    pr.add_argument("--reps", type=int, default=5)
    pr.add_argument("--latency-us", type=float, default=50.0, help="α of the modeled time (cost model default)")
    pr.add_argument("--quiet-wait", type=float, default=0.0, metavar="S",
                    help="before each workload wait up to S s for the machine to be idle")
    pr.add_argument("--quiet-level", type=float, default=0.2)
    pr.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    pr.add_argument("--tag", default="")
    pr.add_argument("--gather-impl", default="auto", choices=["auto", "direct", "ring", "bruck", "bruck4"],
                    help="the all-gather's rounds (zen_ext/comm/gather.py); 'direct' is the pre-issue-38 structure")
    pr.add_argument("--count-round", action="store_true",
                    help="exchanges send their counts in a round of their own (no slot), as before the "
                         "count-carrying exchange")
    pr.add_argument("--fresh-result", action="store_true",
                    help="a new result tensor per sync instead of one reused buffer per slice (out=)")
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        return cmd_prepare(a)
    if a.cmd == "scale":
        return cmd_scale(a)
    if a.reps < 1:
        raise SystemExit(f"--reps ({a.reps}) must be >= 1")
    return cmd_run(a)


if __name__ == "__main__":
    sys.exit(main())
