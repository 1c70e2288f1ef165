"""Per-step synchronization statistics: a JSONL writer, DeepSpeed's monitor, and the rank-0 summary.

One record per optimizer step, with this rank's numbers (ranks are balanced by design, paper
Def. 8; the summary gathers every rank's totals once at the end):

* ``bytes_sent`` / ``bytes_recv``: what the schemes sent on the data-parallel group (plus the
  tensor-parallel and intra-node groups, reported apart), with the Communicator's byte model;
* ``dense_bytes``: what DeepSpeed's ring all-reduce of the same buckets would have sent
  (``2·(n−1)/n · numel · itemsize``), so ``bytes_sent / dense_bytes`` is the saving;
* ``sync_s``: wall time inside the gradient reduction; plus whatever the Synchronizer reports for
  the step (density, γ, scheme chosen, hashing time), passed through unchanged;
* fields the training loop adds with ``annotate`` (loss, tokens).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter

from ..compress.registry import DENSE, all_kinds, spec_of

_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """A one-line text plot of ``values`` (averaged into ``width`` bins)."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    bins = min(width, len(vals))
    edges = [len(vals) * i // bins for i in range(bins + 1)]
    means = [sum(vals[a:b]) / (b - a) for a, b in zip(edges, edges[1:])]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((m - lo) / span * len(_SPARK)))] for m in means)


def format_bytes(n: float) -> str:
    """Bytes in binary units (KiB, MiB, ...: powers of 1024), the unit system every zen_ext summary uses."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class StepStats:
    """Accumulates one step's numbers, writes them, and keeps the run's totals.

    Args:
        rank: this process's global rank (only rank 0 writes the file and the monitor).
        jsonl_path: the per-step file, or None for none.
        monitor: DeepSpeed's ``MonitorMaster`` (``engine.monitor``) or None.
    """

    _TOTALS = ("bytes_sent", "dp_bytes_recv", "dense_bytes", "tp_bytes_sent", "intra_bytes_sent", "sync_s",
               "reduce_s", "hash_s", "reduce_calls", "nonfinite_steps")

    def __init__(self, rank: int, jsonl_path: str | None = None, monitor=None) -> None:
        self.rank = rank
        self.jsonl_path = jsonl_path
        self.monitor = monitor if monitor is not None and getattr(monitor, "enabled", False) else None
        self.current: dict = {}
        self.last: dict = {}
        self.dense_name = "dense all-reduce"  # what dense_bytes counts (a sharded engine: its reduce-scatter)
        self.totals: dict = {k: 0 for k in self._TOTALS}
        self.steps = 0
        self.losses: list[float] = []
        self.schemes: Counter = Counter()  # (gradient slice, scheme) -> steps
        self._file = None
        if rank == 0 and jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._file = open(jsonl_path, "a", buffering=1)

    def add(self, **values) -> None:
        """Add numeric values to the current step (summed when added twice)."""
        for k, v in values.items():
            self.current[k] = self.current.get(k, 0) + v

    def annotate(self, **values) -> None:
        """Set fields of the current step's record (e.g. ``loss``); the last value wins."""
        self.current.update(values)

    def end_step(self, step: int, extra: dict | None = None, sample_count: int | None = None) -> dict:
        """Close the step: update totals, write the record (rank 0) and return it."""
        rec = {"step": step, **self.current, **(extra or {})}
        if rec.get("dense_bytes"):
            rec["sent_vs_dense"] = rec.get("bytes_sent", 0) / rec["dense_bytes"]
        for k in self._TOTALS:
            if isinstance(rec.get(k), (int, float)):
                self.totals[k] += rec[k]
        # One count per gradient slice and step, so that the counts add up to steps x slices.
        # The Synchronizer's per-part record names the slices; the plain list only the schemes.
        for key in ("slice_schemes",) if isinstance(rec.get("slice_schemes"), dict) else ("scheme", "schemes"):
            chosen = rec.get(key)
            if isinstance(chosen, str):
                self.schemes[("all", chosen)] += 1
            elif isinstance(chosen, dict):
                self.schemes.update((str(k), str(v)) for k, v in chosen.items())
            elif isinstance(chosen, (list, tuple)):
                self.schemes.update(("bucket", str(v)) for v in chosen)  # schemes a bucket's parts ran
        if isinstance(rec.get("loss"), (int, float)):
            self.losses.append(float(rec["loss"]))
        self.steps += 1
        if self._file is not None:
            self._file.write(json.dumps(rec, default=_jsonable) + "\n")
        if self.monitor is not None and self.rank == 0:
            x = sample_count if sample_count is not None else step
            self.monitor.write_events([(f"Zen/{k}", float(v), x) for k, v in rec.items()
                                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"])
        self.current = {}
        self.last = rec
        return rec

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(obj):
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def summarize(totals_by_rank: list[dict], steps: int, schemes: Counter, losses: list[float],
              config_line: str = "", dense_name: str = "dense all-reduce") -> str:
    """The end-of-run summary: bytes vs dense (``dense_name``: what ``dense_bytes`` counts), scheme
    choices, loss curve, time."""
    sent = sum(t["bytes_sent"] for t in totals_by_rank)
    dense = sum(t["dense_bytes"] for t in totals_by_rank)
    n = len(totals_by_rank)
    lines = ["=" * 72, f"ZEN gradient synchronization summary ({n} ranks, {steps} optimizer steps)"]
    if config_line:
        lines.append(f"  config:          {config_line}")
    if dense:
        lines.append(f"  bytes sent:      {format_bytes(sent / n)} per rank  vs  {dense_name} "
                     f"{format_bytes(dense / n)}  ->  {sent / dense:.1%} of dense "
                     f"({dense / max(sent, 1):.1f}x less)")
    tp = sum(t.get("tp_bytes_sent", 0) for t in totals_by_rank)
    intra = sum(t.get("intra_bytes_sent", 0) for t in totals_by_rank)
    if tp:
        lines.append(f"  tensor-parallel: {format_bytes(tp / n)} per rank (DGC thresholds, embedding share)")
    if intra:
        lines.append(f"  intra-node:      {format_bytes(intra / n)} per rank (hierarchical reduce-scatter)")
    sync = max(t["sync_s"] for t in totals_by_rank)
    lines.append(f"  sync time:       {sync:.2f} s total on the slowest rank "
                 f"({1e3 * sync / max(steps, 1):.1f} ms per step)")
    if schemes:
        lines.extend(scheme_lines(schemes))
    if losses:
        lines.append(f"  train loss:      {losses[0]:.4f} -> {losses[-1]:.4f}   {sparkline(losses)}  (mean over ranks)")
    lines.append("=" * 72)
    return "\n".join(lines)


def startup_line(engine_line: str, cfg, kinds: dict[str, str], numels: dict[str, int] | None = None,
                 note: str = "") -> str:
    """The one line an adapter prints on rank 0 when ZEN is attached, so a user sees it is on.

    Example: ``zen_ext: ZEN on DeepSpeed ZeRO-1 (dp=2, tp=1): scheme=auto, buckets 128 MB |
    natural 1 tensor (65.5 K elements), dgc 5% 8 tensors (...), dense 9 tensors | momentum_correction=...``

    Args:
        engine_line: the engine and its groups, e.g. ``"DeepSpeed ZeRO-1 (dp=2, tp=1, hierarchical=False)"``.
        cfg: the validated (resolved) ``ZenConfig``.
        kinds: parameter name → a registered kind or ``"dense"`` (``classify_parameters``).
        numels: parameter name → element count, for the element totals (optional).
        note: what ``ZenConfig.resolve_defaults`` decided and why (empty when nothing).
    """
    parts = []
    for kind in all_kinds():  # the registered sparsifiers by priority, then dense
        names = [n for n, k in kinds.items() if k == kind]
        if not names:
            continue
        label = spec_of(kind).cls.label(cfg.section(kind)) if kind != DENSE else kind
        text = f"{label}: {len(names)} tensor{'s' if len(names) != 1 else ''}"
        if numels:
            text += f" ({_count(sum(numels.get(n, 0) for n in names))} elements)"
        parts.append(text)
    line = (f"zen_ext: ZEN on {engine_line}: scheme={cfg.scheme}, buckets {cfg.bucket_cap_mb:g} MB"
            + (", async_sync" if cfg.async_sync else "") + " | "
            + ", ".join(parts or ["no trainable parameters"]))
    return line + (f" | {note}" if note else "")


def _count(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return str(n)


def scheme_lines(schemes: Counter, most: int = 6) -> list[str]:
    """``scheme choices`` lines: per gradient slice, each scheme with the steps it ran (the counts of a
    slice add up to its synchronized steps); the ``most`` busiest slices, the rest summed."""
    by_slice: dict[str, Counter] = {}
    for key, steps in schemes.items():
        slice_name, scheme = key if isinstance(key, tuple) else ("all", key)
        by_slice.setdefault(slice_name, Counter())[scheme] += steps
    order = sorted(by_slice, key=lambda k: (-sum(by_slice[k].values()), k))
    lines = ["  scheme choices:  (gradient slice -> scheme x steps it ran)"]
    for name in order[:most]:
        lines.append(f"    {name} -> " + ", ".join(f"{sch} x{v}" for sch, v in by_slice[name].most_common()))
    if len(order) > most:
        rest = Counter()
        for name in order[most:]:
            rest.update(by_slice[name])
        lines.append(f"    {len(order) - most} more slices -> " + ", ".join(f"{sch} x{v}" for sch, v in rest.most_common()))
    return lines


def mean_losses(totals_by_rank: list[dict], fallback: list[float]) -> list[float]:
    """Per-step train loss averaged over the ranks (each rank's ``losses`` as gathered with its totals),
    the value the recipes log; ``fallback`` (this rank's) where the ranks did not send theirs."""
    per_rank = [p for p in (t.get("losses") for t in totals_by_rank) if isinstance(p, list) and p]
    if not per_rank:  # no rank annotated losses (or an older peer sent none)
        return fallback
    steps = min(len(p) for p in per_rank)
    return [sum(p[i] for p in per_rank) / len(per_rank) for i in range(steps)]


def report_summary(stats, cfg, totals_by_rank: list[dict], rank: int, engine_line: str,
                   print_it: bool | None = None) -> str:
    """The summary text both adapters end a run with; rank 0 prints it when ``zen.stats.summary`` is on.

    Args:
        stats: the adapter's ``StepStats`` (steps, schemes, losses).
        cfg: the validated ``ZenConfig``.
        totals_by_rank: every rank's totals, already gathered.
        engine_line: what the engine side looks like (e.g. ``"ZeRO-1 hierarchical=False"``).
    """
    config_line = f"scheme={cfg.scheme} {cfg.sections_line()} {engine_line}"
    text = summarize(totals_by_rank, stats.steps, stats.schemes, mean_losses(totals_by_rank, stats.losses),
                     config_line, stats.dense_name)
    if (cfg.stats.summary if print_it is None else print_it) and rank == 0:
        print(text, flush=True)
    return text


def append_planner_reasons(text: str, scheme, cfg, rank: int, print_it: bool | None) -> str:
    """Add ``auto``'s per-slice reasons (``scheme.explain()``) to a summary; rank 0 prints them when the
    summary is printed. Other schemes have no reasons: ``text`` is returned as it is."""
    explain = getattr(scheme, "explain", None)
    if explain is None:
        return text
    why = explain()
    if (cfg.stats.summary if print_it is None else print_it) and rank == 0:
        print(why, flush=True)
    return text + "\n" + why
