"""What ``auto`` would choose for a run's gradients at more hosts: a cost-model prediction.

A 2-rank run on one machine cannot show where ZEN wins (its buckets are small and its link is a local
socket). This module takes what a run recorded about its gradients (one ``zen_stats.jsonl`` record:
elements and non-zeros per sparsifier kind, the embedding's union over ranks) and predicts, for more
hosts and other links, the sync time of every scheme ``auto`` ranks (``planner/candidates.py``
``candidate_schemes``, the planner's own list: lossless schemes only, so never ``spardl``) with the
same model ``auto`` uses:

1. Build ``n`` synthetic ranks with the recorded densities (``workloads.py``): the embedding
   rows from a Zipf draw of the run's tokens per rank, the DGC bucket as top-k at the recorded density.
2. Profile them (``planner/profile.py``: ``profile_from_grads``) and predict each scheme's traffic (α–β wire at the
   link rate and latency) plus its computation at ``ComputeRates`` (calibrated on this machine by the
   caller, or the defaults).
3. Per slice, the cheapest candidate (what ``auto`` would pick) against a dense all-reduce.

It is a model prediction, not a measurement: the emulated-cluster report (docs/benchmarks.md) holds
measured times at 4–16 hosts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.cost import WorkCounts
from ..planner import cost_model as cm
from ..planner.candidates import candidate_schemes
from ..planner.compute_model import ComputeRates
from ..planner.network import Network
from ..planner.profile import profile_from_grads
from ..planner.refinement import Wire
from .workloads import dgc_topk, zipf_embedding


@dataclass
class ScalePrediction:
    """One slice at one scale: ``auto``'s choice, its predicted time and a dense all-reduce's;
    ``predicted_s`` holds every candidate's."""

    slice: str
    hosts: int
    bandwidth_gbps: float
    choice: str
    choice_s: float
    dense_s: float
    predicted_s: dict[str, float]


def _grads(kind: str, n: int, record: dict, row_width: int, tokens_per_rank: int, seed: int):
    """Step 1: ``n`` ranks' gradients of one sparsifier kind with the record's sizes and density."""
    numel, nnz = record["numel"][kind], record["nnz"][kind]
    if kind == "natural":
        return zipf_embedding(n, vocab_rows=max(1, numel // row_width), tokens_per_rank=tokens_per_rank,
                              row_width=row_width, form="row", seed=seed)
    return dgc_topk(n, numel=numel, density=max(nnz / max(numel, 1), 1e-6), seed=seed)


def predict_at_scale(record: dict, row_width: int, tokens_per_rank: int, hosts=(8, 16), gbps=(1.0, 10.0),
                     latency_us: float = 50.0, rates: ComputeRates | None = None,
                     seed: int = 0) -> list[ScalePrediction]:
    """Predictions for the ``natural`` and ``dgc`` slices of ``record`` at each host count and link rate.

    Args:
        record: one ``zen_stats.jsonl`` record (``numel`` and ``nnz`` per kind).
        row_width: the embedding's row width (elements per row).
        tokens_per_rank: tokens in one rank's micro-batch (the embedding rows it touches come from them).
        hosts, gbps, latency_us: the scales and links to predict.
        rates: computation rates (``planner/compute_model.py``: ``calibrate_compute``); the model's defaults when None.
    """
    rates = rates or ComputeRates()
    # The planner's candidates, not every scheme with a cost model: a lossy one is never auto's choice.
    schemes = candidate_schemes()
    out = []
    for kind in ("natural", "dgc"):
        if not record.get("nnz", {}).get(kind):
            continue
        for n in hosts:
            # Step 2: one profile per scale, every link.
            profile = profile_from_grads(_grads(kind, n, record, row_width, tokens_per_rank, seed), seed=seed)
            work = WorkCounts.from_profile(profile)
            stats = {s: cm.predict_stats(s, profile) for s in schemes}
            for bw in gbps:
                net = Network(bw, latency_us)
                total = {s: cm.predict_total_s(s, work, Wire.of(stats[s], net), latency_us * 1e-6, rates)
                         for s in schemes}
                # Step 3: the cheapest, as auto's model ranks them.
                best = min(total, key=total.get)
                out.append(ScalePrediction(kind, n, bw, best, total[best], total["dense"], total))
    return out


def format_predictions(preds: list[ScalePrediction]) -> str:
    """The table the demo prints, labelled as a prediction."""
    names = {"natural": "embedding rows (natural)", "dgc": "DGC tensors (top-k)"}
    lines = ["Model prediction, not a measurement: auto's cost model (α–β wire + computation) on synthetic ranks",
             "with this run's gradient sizes and densities, at more hosts:",
             f"  {'slice':<26}{'hosts':>6}{'link':>11}   {'auto would pick':<16}{'predicted':>11}"
             f"{'dense all-reduce':>18}{'vs dense':>10}"]
    for p in preds:
        lines.append(f"  {names.get(p.slice, p.slice):<26}{p.hosts:>6}{p.bandwidth_gbps:>7g} Gb/s   {p.choice:<16}"
                     f"{p.choice_s * 1e3:>8.2f} ms{p.dense_s * 1e3:>15.2f} ms{p.dense_s / p.choice_s:>9.1f}x")
    lines.append("Measured times on an emulated cluster (4-16 hosts, rate-limited links): docs/benchmarks.md.")
    return "\n".join(lines)
