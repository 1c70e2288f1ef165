"""Time to quality at equal bytes: ``bench_quality.py``'s runs compared where each has sent as many bytes.

A zen run records its cumulative bytes sent per rank after every step (``result["bytes"]``: ``[step,
bytes_sent, dense_bytes]`` from the recipe's ``train_log.jsonl``; ``dense_bytes`` is what a dense
all-reduce, or under ZeRO-3 DeepSpeed's dense reduce-scatter, of the same gradients would have sent). A
dense run (no zen) sends that dense amount every step: its cumulative bytes at step s are s times the
per-step dense bytes of the zen runs of the same setting (the same model, so the same for all of them).

Steps:
1. Per setting, DGC density and seed, the byte budget is the smallest total any compared run of that
   density sent over the whole run (the cheapest variant's last step); dense is in every density's table.
2. Each run's step at that budget (linear in its cumulative bytes between steps), and its eval loss
   there (linear between evaluations; none before the first evaluation).
3. The gap to dense of the same seed at the same budget, and the bytes each run sends until it reaches
   dense's final eval loss + 1 % (the steps of ``quality_report.steps_to`` turned into bytes) over the
   bytes dense needs for it.
"""

from __future__ import annotations

import statistics

from quality_report import TARGET_MARGIN, fmt_range, steps_to
from quality_variants import VARIANTS, baseline_of


def density_of(variant: str) -> float | None:
    """The DGC density of a zen variant; None for a dense one (compared at every density)."""
    spec = VARIANTS.get(variant) or {}
    return None if not spec or spec.get("_dense") else spec.get("density", 0.05)


def dense_step_bytes(results: list[dict]) -> float | None:
    """Per-step bytes of a dense synchronization of this setting's model (from any zen run's record)."""
    per = [r["bytes"][-1][2] / r["bytes"][-1][0] for r in results if r.get("bytes")]
    return statistics.median(per) if per else None


def cumulative(result: dict, dense_per_step: float) -> list[tuple[float, float]]:
    """``[(step, bytes sent so far)]`` from step 0 on."""
    if result.get("bytes"):
        return [(0.0, 0.0)] + [(float(s), float(b)) for s, b, _ in result["bytes"]]
    return [(float(s), s * dense_per_step) for s in range(result["steps"] + 1)]


def _interp(points: list[tuple[float, float]], x: float, by: int = 0) -> float | None:
    """Linear interpolation in a monotone list of pairs: the other coordinate where coordinate ``by``
    equals ``x``; None outside the list."""
    for (a0, b0), (a1, b1) in zip(points, points[1:]):
        p0, p1, q0, q1 = (a0, a1, b0, b1) if by == 0 else (b0, b1, a0, a1)
        if p0 <= x <= p1:
            return q0 if p1 == p0 else q0 + (q1 - q0) * (x - p0) / (p1 - p0)
    return None


def report(results: list[dict]) -> str:
    """Step 1-3: one markdown table per setting (medians [min–max] over seeds)."""
    lines = []
    densities = sorted({d for r in results if (d := density_of(r["variant"])) is not None}, reverse=True)
    for setting, density in ((s, d) for s in ("scratch", "finetune") for d in densities):
        rows = [r for r in results if r["setting"] == setting and density_of(r["variant"]) in (None, density)]
        seeds_run = {r["seed"] for r in rows if density_of(r["variant"]) is not None}
        rows = [r for r in rows if r["seed"] in seeds_run]  # dense only where this density ran too
        per_step = dense_step_bytes(rows)
        if not rows or per_step is None:
            continue
        by = {}
        for r in rows:
            by.setdefault(r["variant"], {})[r["seed"]] = r
        curves = {(r["variant"], r["seed"]): cumulative(r, per_step) for r in rows}
        budgets = {s: min(curves[(v, s)][-1][1] for v in by if s in by[v]) for s in {r["seed"] for r in rows}}
        lines += [f"### {setting}, DGC {density:.0%}: at equal bytes (dense sends {per_step / 1024:.1f} KiB per rank "
                  "per step)", "",
                  "| variant | bytes per step × dense | budget (KiB per rank) | step at the budget | eval loss at the "
                  f"budget | gap to dense at equal bytes | bytes × dense to dense + {TARGET_MARGIN:.0%} |",
                  "|---|---|---|---|---|---|---|"]
        for variant, seeds in by.items():
            base = by.get(baseline_of(variant), {})
            ratio, steps_at, losses, gaps, to_target = [], [], [], [], []
            for s, r in seeds.items():
                curve = curves[(variant, s)]
                ratio.append(curve[-1][1] / (curve[-1][0] * per_step))
                step = _interp(curve, budgets[s], by=1)
                loss = _interp([tuple(e) for e in r["eval"]], step) if step is not None else None
                steps_at.append(step)
                if loss is not None:
                    losses.append(loss)
                if s not in base:
                    continue
                d_curve = curves[(baseline_of(variant), s)]
                d_step = _interp(d_curve, budgets[s], by=1)
                d_loss = _interp([tuple(e) for e in base[s]["eval"]], d_step) if d_step is not None else None
                if loss is not None and d_loss is not None:
                    gaps.append(100 * (loss / d_loss - 1))
                target = base[s]["eval"][-1][1] * (1 + TARGET_MARGIN)
                mine, theirs = steps_to(r["eval"], target), steps_to(base[s]["eval"], target)
                if mine is not None and theirs is not None:
                    to_target.append(_interp(curve, mine) / _interp(d_curve, theirs))
            budget = statistics.median(budgets[s] for s in seeds) / 1024
            lines.append("| " + " | ".join([
                variant, fmt_range(ratio, ".3f"), f"{budget:,.0f}", fmt_range([x for x in steps_at if x], ".0f"),
                fmt_range(losses, ".4f"), (fmt_range(gaps, "+.2f") + " %") if gaps else "–",
                (fmt_range(to_target, ".2f") + "×" + ("" if len(to_target) == len(seeds) else
                                                        f" ({len(to_target)}/{len(seeds)} seeds reach it)"))
                if to_target else f"– (0/{len(seeds)} seeds reach it)"]) + " |")
        lines.append("")
    return "\n".join(lines)
