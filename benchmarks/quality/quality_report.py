"""Reporting the time-to-quality benchmark: per setting, each variant against dense of the same seed at
equal steps, to a target loss and in emulated-cluster time, and the curves' plot.

The step times come from the emulated cluster's end-to-end measurements
(``benchmarks/cluster/results/cluster_e2e.jsonl``, ``cluster_step_s``); the same runs at equal bytes are
``quality_bytes.py``'s.
"""

from __future__ import annotations

import json
import math
import os
import statistics

from quality_variants import baseline_of, step_time_key

DIVERGED = 1.05
"""A run whose final eval loss exceeds its best by more than this factor got worse as it trained (it blew
up, or regressed from an early best): its best is then an early point that says
nothing of reaching dense's quality, so it gets no equal-loss ratio and is counted as diverged."""
PLOT_LAB = (4, "1gbit")
"""The emulated-cluster setting whose measured step times put the curves on a time axis."""
PLOT_VARIANTS = ("dense", "dgc5", "dgc1", "dgc5_catchup")
"""The curves the plot shows (all variants would not be readable); the tables show every variant."""
TARGET_MARGIN = 0.01
"""The target is dense's final eval loss (same seed) times ``1 + TARGET_MARGIN``."""


def steps_to(evals: list[list[float]], target: float) -> float | None:
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


def cluster_step_s(path: str) -> dict[tuple[int, str], dict[str, float]]:
    """Median step seconds measured end to end in the emulated cluster: ``{(hosts, rate): {config: s}}``
    for every lab setting where dense was measured (``bench_e2e.py``'s records)."""
    out: dict[tuple[int, str], dict[str, float]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("bench") == "e2e":
                    out.setdefault((rec["n"], rec["rate"]), {})[rec["config"]] = rec["step_s_med"]
    return {k: v for k, v in sorted(out.items()) if "dense" in v}


def fmt_range(values: list[float], fmt: str) -> str:
    """``median [min–max]`` of ``values`` in ``fmt``; a dash for none."""
    if not values:
        return "–"
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def report(results: list[dict], step_s: dict[str, float], plot_path: str | None,
           plot_variants=PLOT_VARIANTS) -> str:
    """Step 3: the markdown tables (and the plot) of every setting.

    Everything is paired by seed (a seed fixes the initialization, the data order and the eval split):
    a variant's gap and its target are against its dense baseline (``baseline_of``) of the same seed;
    medians and ranges are over seeds.
    """
    lines = []
    for setting in ("scratch", "finetune"):
        rows = [r for r in results if r["setting"] == setting]
        by = {}
        for r in rows:
            by.setdefault(r["variant"], {})[r["seed"]] = r
        # The checkpoints and the seed list come from dense (ZeRO-1), else from another baseline present.
        dense = by.get("dense") or next((by[baseline_of(v)] for v in by if baseline_of(v) in by), {})
        if not dense:
            continue
        steps = rows[0]["steps"]
        checkpoints = sorted({s for d in dense.values() for s, _ in d["eval"]})
        marks = [c for c in checkpoints if c in (steps // 4, steps // 2, steps)] or checkpoints[-1:]
        labs = list(step_s)
        lines += [f"### {setting}: {steps} steps, seeds {sorted(dense)}", "",
                  "| variant | " + " | ".join(f"eval @ {m}" for m in marks) + f" | gap to dense @ {steps}"
                  + f" | reaches dense + {TARGET_MARGIN:.0%} (seeds; median step) | steps × dense to equal loss | "
                  + " | ".join(f"time × dense, {n} hosts {rate}" for n, rate in labs) + " |",
                  "|---|" + "---|" * (len(marks) + 3 + len(labs))]
        for variant, seeds in by.items():
            base = by.get(baseline_of(variant), {})
            paired = {s: r for s, r in seeds.items() if s in base}
            evals_at = [[dict(map(tuple, r["eval"]))[m] for r in paired.values() if m in dict(map(tuple, r["eval"]))]
                        for m in marks]
            gaps, reach, equal, diverged = [], [], [], 0
            for s, r in paired.items():
                d_final, final = base[s]["eval"][-1][1], r["eval"][-1][1]
                gaps.append(100 * (final / d_final - 1))
                reach.append(steps_to(r["eval"], d_final * (1 + TARGET_MARGIN)))
                # Equal loss: the steps this run needs to reach its best eval loss over the steps dense
                # needs to reach it (eval loss is noisy late in a run, so the best, not the last). A run
                # better than dense anywhere counts as at most its steps over dense's.
                best = min(loss for _, loss in r["eval"])
                if not final < DIVERGED * best:  # a run that blew up has no equal-loss point
                    diverged += 1
                    continue
                d_steps = steps_to(base[s]["eval"], best)
                equal.append(steps_to(r["eval"], best) / (d_steps or steps))
            reached = [x for x in reach if x is not None]
            times = []
            for lab in labs:
                st, dense_st = step_s[lab].get(step_time_key(variant)), step_s[lab]["dense"]
                times.append(f"**{fmt_range([q * st / dense_st for q in equal], '.2f')}×**" if st and equal else "–")
            label = variant if len(paired) == len(dense) else f"{variant} ({len(paired)} seed{'s' * (len(paired) > 1)})"
            if baseline_of(variant) not in ("dense", variant):
                label += f" (against {baseline_of(variant)})"
            cells = [label, *(fmt_range(v, ".4f") for v in evals_at), f"{fmt_range(gaps, '+.2f')} %",
                     f"{len(reached)}/{len(reach)}" + (f"; {statistics.median(reached):.0f}" if reached else ""),
                     (fmt_range(equal, ".2f") + "×" if equal else "–") + (f" ({diverged} diverged)" if diverged else ""),
                     *times]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if plot_path:
        _plot(results, step_s, plot_path, plot_variants)
    return "\n".join(lines)


def _plot(results: list[dict], step_s: dict[str, float], path: str, plot_variants=PLOT_VARIANTS) -> None:
    """Eval loss (median over seeds) against steps and against emulated-cluster time, per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r["variant"] in plot_variants] or results
    settings = [s for s in ("scratch", "finetune") if any(r["setting"] == s for r in results)]
    fig, axes = plt.subplots(len(settings), 2, figsize=(11, 3.8 * len(settings)), squeeze=False)
    for row, setting in zip(axes, settings):
        by = {}
        for r in results:
            if r["setting"] == setting:
                by.setdefault(r["variant"], []).append(r)
        for variant, runs in by.items():
            steps = sorted({s for r in runs for s, _ in r["eval"]})
            med = [statistics.median(dict(map(tuple, r["eval"])).get(s, math.nan) for r in runs) for s in steps]
            style = dict(lw=2.2, color="black") if variant == "dense" else dict(lw=1.2)
            row[0].plot(steps, med, label=variant, **style)
            lab = step_s.get(PLOT_LAB, {})
            st = lab.get(step_time_key(variant))
            if st:
                row[1].plot([s * st for s in steps], med, label=variant, **style)
        row[0].set(title=f"{setting}: eval loss vs steps (median over seeds)", xlabel="step", ylabel="eval loss")
        row[1].set(title=f"{setting}: vs time (step times of 4 emulated hosts, 1 Gbit/s)", xlabel="s",
                   ylabel="eval loss")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
