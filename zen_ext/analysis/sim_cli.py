"""``python -m zen_ext sim``: run every scheme's real code on n simulated ranks and model its time.

For each rank count the per-rank gradients come from a calibrated workload (``--workload``) or a
recorded trace (``--trace``); every scheme runs in a ``SimWorld`` (one thread per rank, the same code as
on real processes) and is reported with: max abs error against the dense all-reduce, bytes sent and
received per rank (max and mean over ranks), messages, Push/Pull imbalance (paper Def. 8, for the
Parallelism schemes), α–β modeled time (``cost_model``) and speedup over dense. The paper's Eq. 1 and
Eq. 2 and the sparsity analytics (density, γ, skewness) are printed per rank count. ``--plot`` draws
modeled time normalized to dense all-reduce against n — the analogue of the paper's Fig. 8.

Memory: each rank compares its result with the oracle inside the rank function and returns only a
few numbers, so a 128-rank run holds one dense tensor per rank at a time, not 128 results.

Example::

    python -m zen_ext sim --workload embedding --ranks 2,4,...,128 --schemes all \\
        --bandwidth-gbps 10 --latency-us 50 --json sim.json --plot sim.png
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from typing import Sequence

import torch

from ..comm.simulated import SimWorld
from ..core.registry import available_schemes, build_scheme, registered_schemes, scheme_class
from ..core.types import SparseGrad
from ..planner import cost_model as cm
from ..planner.network import Network, modeled_time_s
from . import metrics
from .traces import load_trace
from .workloads import WORKLOADS, build_workload

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_ranks(text: str) -> list[int]:
    """``"2,4,8"`` or ``"2,4,...,128"`` (``...`` continues a doubling or an arithmetic step to the end).

    Raises:
        ValueError: malformed list or a rank count < 1.
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    out: list[int] = []
    try:
        for i, tok in enumerate(items):
            if tok == "...":
                if len(out) < 2 or i + 1 >= len(items):
                    raise ValueError
                a, b, end = out[-2], out[-1], int(items[i + 1])
                if b == 2 * a:
                    while out[-1] * 2 < end:
                        out.append(out[-1] * 2)
                elif b > a:
                    while out[-1] + (b - a) < end:
                        out.append(out[-1] + (b - a))
                else:
                    raise ValueError
            else:
                out.append(int(tok))
    except ValueError:
        raise ValueError(f"sim.ranks ({text!r}) must be a comma list like 2,4,8 or 2,4,...,128") from None
    if not out or min(out) < 1:
        raise ValueError(f"sim.ranks ({text!r}) must be rank counts >= 1")
    return sorted(dict.fromkeys(out))


def resolve_schemes(text: str) -> list[str]:
    """``"all"`` (every registered lossless scheme, ``auto`` included) or a comma list of names."""
    names = available_schemes()
    if text == "all":
        chosen = [s for s in names if scheme_class(s).lossless]
    else:
        chosen = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [s for s in chosen if s not in names]
        if unknown:
            raise ValueError(f"sim.schemes ({text!r}) must be 'all' or names from {names}; unknown: {unknown}")
    if "dense" not in chosen:
        chosen.append("dense")  # the reference of errors and speedups
    # Tables and plots list schemes in the registry's order: the oracle (dense) first, the built-ins,
    # then auto and outside schemes.
    order = registered_schemes()
    return sorted(chosen, key=lambda s: (order.index(s), s))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zen_ext sim", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=sorted(WORKLOADS), default="embedding",
                     help="calibrated synthetic workload (default: embedding)")
    src.add_argument("--trace", metavar="FILE", help="a recorded trace step file or directory (first step used)")
    p.add_argument("--trace-step", type=int, default=0, help="which step of a trace directory (0-based)")
    p.add_argument("--ranks", default="2,4,...,128", help="rank counts, e.g. 2,4,...,128 (default)")
    p.add_argument("--schemes", default="all", help="'all' or a comma list (dense is always added)")
    p.add_argument("--bandwidth-gbps", type=float, default=10.0, help="link bandwidth, Gbit/s (default 10)")
    p.add_argument("--latency-us", type=float, default=50.0, help="per-message latency, us (default 50)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write modeled time / dense vs n as a PNG")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as Markdown")
    p.add_argument("--op", choices=("sum", "mean"), default="sum")
    p.add_argument("--seed", type=int, default=0, help="workload and hash seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    w = p.add_argument_group("workload options")
    w.add_argument("--row-width", type=int, default=64, help="embedding: elements per row (default 64)")
    w.add_argument("--form", choices=("element", "row"), default="element", help="embedding: COO granularity")
    w.add_argument("--vocab-rows", type=int, default=30522)
    w.add_argument("--tokens-per-rank", type=int, default=600)
    w.add_argument("--zipf-s", type=float, default=1.05)
    w.add_argument("--duplicates", action="store_true",
                   help="embedding: one entry per token (uncoalesced, like nn.Embedding(sparse=True))")
    w.add_argument("--numel", type=int, default=1 << 21, help="dgc: bucket elements")
    w.add_argument("--density", type=float, default=0.01, help="dgc: top-k density")
    w.add_argument("--shared-fraction", type=float, default=0.5, help="dgc: variance share common to ranks")
    w.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    return p


def workload_options(args: argparse.Namespace) -> dict:
    dtype = _DTYPES[args.dtype]
    if args.workload == "embedding":
        return dict(vocab_rows=args.vocab_rows, tokens_per_rank=args.tokens_per_rank, zipf_s=args.zipf_s,
                    row_width=args.row_width, form=args.form, coalesce=not args.duplicates, dtype=dtype,
                    seed=args.seed)
    return dict(numel=args.numel, density=args.density, shared_fraction=args.shared_fraction, dtype=dtype,
                seed=args.seed)


def input_source(args: argparse.Namespace):
    """A function ``n → {slice key: per-rank gradients}`` for the workload or the trace step."""
    if args.trace is None:
        opts = workload_options(args)
        return lambda n: {"grad": build_workload(args.workload, n, **opts)}
    for i, step in enumerate(load_trace(args.trace)):
        if i == args.trace_step:
            break
    else:
        raise ValueError(f"sim.trace_step ({args.trace_step}) must be < the number of steps in {args.trace}")

    def from_trace(n: int) -> dict[str, list[SparseGrad]]:
        if n > step.world_size:
            raise ValueError(f"sim.ranks ({n}) must be <= the {step.world_size} ranks recorded in {args.trace}")
        return {k: v[:n] for k, v in step.slices.items()}

    return from_trace


def tolerance(grads: list[SparseGrad], oracle: torch.Tensor, exact: bool) -> float:
    """Allowed max abs error against dense: 0 for the integer-valued fp32/fp64 workloads (sums are exact
    whatever the order), else a few roundings of the largest partial sum."""
    dtype = grads[0].dtype
    if exact and dtype in (torch.float32, torch.float64):
        return 0.0
    return torch.finfo(dtype).eps * float(oracle.abs().max()) * 2 * len(grads)


def analytics(slices: dict[str, list[SparseGrad]], net: Network, seed: int) -> dict:
    """Sparsity analytics and the paper's Eq. 1/2 for the largest slice."""
    key = max(slices, key=lambda k: slices[k][0].dense_numel)
    grads = slices[key]
    n, numel = len(grads), grads[0].numel
    d = sum(metrics.density(g) for g in grads) / n
    gammas = metrics.densification_curve(grads)
    word = grads[0].values.element_size()
    m = numel * grads[0].row_width
    out = dict(slice=key, n=n, numel=numel, row_width=grads[0].row_width, density=d,
               union_density=metrics.union_density(grads), gammas={str(k): v for k, v in gammas.items()},
               skewness=sum(metrics.skewness(g, numel, n) for g in grads) / n,
               skewness_union=metrics.skewness(torch.cat([g.indices for g in grads]), numel, n),
               overlap_mean=(sum(metrics.overlap_ratio(grads[i], grads[i + 1]) for i in range(n - 1)) / (n - 1)
                             if n > 1 else 1.0))
    if n > 1:
        out["eq1_s"] = cm.eq1_balanced_parallelism_s(n, m, d, gammas[n], net.bandwidth_gbps, word)
        out["eq2_s"] = (cm.eq2_hierarchical_centralization_s(n, m, d, gammas, net.bandwidth_gbps, word)
                        if n & (n - 1) == 0 else None)
        out["dense_bandwidth_s"] = 2 * (n - 1) / n * m * word / net.bytes_per_s
        out["prefers"] = "balanced_parallelism" if cm.prefers_balanced_parallelism(n, gammas) else \
            "hierarchical_centralization"
    return out


def run_scheme(name: str, slices: dict[str, list[SparseGrad]], oracle: dict[str, torch.Tensor], op: str,
               net: Network, seed: int) -> dict:
    """Run ``name`` on every slice in one SimWorld; returns the row of the results table."""
    n = len(next(iter(slices.values())))
    # auto plans for the simulated network; one instance per rank, as in a real job. The simulator's
    # times are the α–β model of the measured traffic, so auto plans with that model too (the compute
    # of SimWorld's threads on this machine is not the simulated cluster's).
    per_rank = [build_scheme(name, bandwidth_gbps=net.bandwidth_gbps, latency_us=net.latency_us, seed=seed,
                             model="alpha_beta") for _ in range(n)] if name == "auto" else None
    takes_seed = "seed" in inspect.signature(scheme_class(name).__init__).parameters
    shared = None if per_rank else build_scheme(name, **({"seed": seed} if takes_seed else {}))
    keys = list(slices)

    def rank_fn(comm, rank_inputs):
        scheme = per_rank[comm.rank] if per_rank else shared
        worst, timings = 0.0, {}
        for k, g in zip(keys, rank_inputs):
            out = scheme.sync(comm, g, op=op, timings=timings, key=k)
            if not torch.equal(out, oracle[k]):
                worst = max(worst, (out.double() - oracle[k].double()).abs().max().item())
            del out
        return worst, timings.get("scheme")

    world = SimWorld(n)
    res = world.run(rank_fn, [[slices[k][r] for k in keys] for r in range(n)])
    stats = world.stats
    row = dict(
        scheme=name, n=n, max_abs_err=max(r[0] for r in res),
        bytes_sent_max=max(s.bytes_sent for s in stats), bytes_sent_mean=sum(s.bytes_sent for s in stats) / n,
        bytes_recv_max=max(s.bytes_recv for s in stats), bytes_recv_mean=sum(s.bytes_recv for s in stats) / n,
        msgs_max=max(max(s.msgs_sent, s.msgs_recv) for s in stats),
        modeled_time_s=modeled_time_s(stats, net),
    )
    row["bytes_max"] = max(row["bytes_sent_max"], row["bytes_recv_max"])
    chosen = res[0][1] if name == "auto" else name
    if name == "auto":
        row["choice"] = chosen
    big = max(keys, key=lambda k: slices[k][0].dense_numel)
    row["push_imbalance"], row["pull_imbalance"] = imbalances(chosen, slices[big], seed)
    return row


def imbalances(scheme: str, grads: list[SparseGrad], seed: int) -> tuple[float | None, float | None]:
    """Def. 8 Push and Pull imbalance of ``scheme``'s partition (None for Centralization schemes)."""
    n, g0 = len(grads), grads[0]
    part = metrics.partition_fn(scheme, g0.numel, n, seed=seed, row_width=g0.row_width)
    if part is None:
        return None, None
    if scheme_class(scheme).partition_unit == "block":
        grads = [metrics.block_ids(g) for g in grads]
    return metrics.push_imbalance(grads, part, n), metrics.pull_imbalance(grads, part, n)


def simulate(args: argparse.Namespace) -> dict:
    """Run the whole sweep; returns the JSON-able report."""
    net = Network(args.bandwidth_gbps, args.latency_us)
    ranks = parse_ranks(args.ranks)
    schemes = resolve_schemes(args.schemes)
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=len(ranks) * len(schemes), desc="sim", unit="run", file=sys.stderr)
    report = dict(config=dict(source=args.trace or args.workload, workload_options=_jsonable(
        workload_options(args)) if args.trace is None else None, ranks=ranks, schemes=schemes,
        bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us, op=args.op, seed=args.seed),
        analytics=[], results=[])
    source = input_source(args)
    try:
        for n in ranks:
            slices = source(n)
            oracle = {}
            for k, grads in slices.items():
                acc = grads[0].to_dense()
                for g in grads[1:]:
                    acc += g.to_dense()  # rank order: the bits SimWorld's dense all-reduce produces
                oracle[k] = acc.div_(n) if args.op == "mean" else acc
            tol = max(tolerance(slices[k], oracle[k], exact=args.trace is None) for k in slices)
            report["analytics"].append(analytics(slices, net, args.seed))
            rows = []
            for name in schemes:
                if progress is not None:
                    progress.set_postfix_str(f"n={n} {name}")
                rows.append(run_scheme(name, slices, oracle, args.op, net, args.seed))
                if progress is not None:
                    progress.update()
            dense_t = next(r["modeled_time_s"] for r in rows if r["scheme"] == "dense")
            for r in rows:
                r["speedup_vs_dense"] = dense_t / r["modeled_time_s"] if r["modeled_time_s"] else 1.0
                r["tolerance"] = tol
            report["results"].extend(rows)
            del slices, oracle
    finally:
        if progress is not None:
            progress.close()
    return report


def format_markdown(report: dict) -> str:
    """The report as Markdown: one analytics line and one table per rank count."""
    cfg = report["config"]
    lines = [f"Source: `{cfg['source']}` {cfg['workload_options'] or ''}; network {cfg['bandwidth_gbps']:g} Gbit/s, "
             f"{cfg['latency_us']:g} us per message; op={cfg['op']}.", ""]
    for a in report["analytics"]:
        n = a["n"]
        gam = a["gammas"].get(str(n), 1.0)
        eq = ""
        if n > 1:
            eq2 = f"{a['eq2_s'] * 1e3:.2f} ms" if a.get("eq2_s") is not None else "n/a (n not a power of 2)"
            eq = (f"; paper Eq.1 {a['eq1_s'] * 1e3:.2f} ms, Eq.2 {eq2}, bandwidth-only dense "
                  f"{a['dense_bandwidth_s'] * 1e3:.2f} ms → {a['prefers'].replace('_', ' ')}")
        lines += [f"### n = {n}", "",
                  f"density {a['density']:.3%}, after aggregation {a['union_density']:.2%} (γ_n = {gam:.2f}), "
                  f"skewness {a['skewness']:.1f} per rank, {a['skewness_union']:.1f} aggregated (Def. 5, n ranges), "
                  f"mean overlap {a['overlap_mean']:.2f}{eq}", "",
                  "| scheme | max abs err | sent max / mean (MB) | recv max / mean (MB) | msgs max | push imb | "
                  "pull imb | modeled ms | speedup vs dense |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in report["results"] if r["n"] == n):
            name = f"auto → {r['choice']}" if r.get("choice") else r["scheme"]
            sent = f"{r['bytes_sent_max'] / 1e6:.3f} / {r['bytes_sent_mean'] / 1e6:.3f}"
            recv = f"{r['bytes_recv_max'] / 1e6:.3f} / {r['bytes_recv_mean'] / 1e6:.3f}"
            lines.append(
                f"| {name} | {r['max_abs_err']:.3g} | {sent} | {recv} | {r['msgs_max']} | "
                f"{_fmt(r['push_imbalance'])} | {_fmt(r['pull_imbalance'])} | {r['modeled_time_s'] * 1e3:.3f} | "
                f"{r['speedup_vs_dense']:.2f}× |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Modeled time normalized to dense all-reduce vs n (log2 axis), plus the paper's Eq. 1/2 curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    schemes = report["config"]["schemes"]
    for name in schemes:
        rows = [r for r in report["results"] if r["scheme"] == name]
        ax.plot([r["n"] for r in rows], [1.0 / r["speedup_vs_dense"] for r in rows], marker="o",
                label=name, linewidth=2.5 if name in ("zen", "dense") else 1.4)
    eq = [a for a in report["analytics"] if a["n"] > 1]
    if eq:
        ax.plot([a["n"] for a in eq], [a["eq1_s"] / a["dense_bandwidth_s"] for a in eq], "k--", linewidth=1,
                label="Eq. 1 (BP, bandwidth only)")
        eq2 = [a for a in eq if a.get("eq2_s") is not None]
        ax.plot([a["n"] for a in eq2], [a["eq2_s"] / a["dense_bandwidth_s"] for a in eq2], "k:", linewidth=1,
                label="Eq. 2 (HC, bandwidth only)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks n")
    ax.set_ylabel("modeled time / dense all-reduce")
    cfg = report["config"]
    ax.set_title(f"{cfg['source']}: {cfg['bandwidth_gbps']:g} Gbit/s, {cfg['latency_us']:g} us")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m zen_ext sim``; returns the exit status (1 if a lossless scheme erred)."""
    args = build_parser().parse_args(argv)
    try:
        report = simulate(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = format_markdown(report)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    bad = [r for r in report["results"] if r["max_abs_err"] > r["tolerance"]]
    for r in bad:
        print(f"error: {r['scheme']} at n={r['n']} differs from dense by {r['max_abs_err']:.3g}", file=sys.stderr)
    return 1 if bad else 0


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in d.items()}
