"""MODELLED time to dense + 1 % for zen_ext and its peers on two lab sizes: 8 hosts × 250 Mbit/s and
16 hosts × 100 Mbit/s (one rank per host).

Per-step time = compute + bytes per rank per step / link rate, where

* bytes per rank per step at ``n`` hosts are ``peers_bytes.rows`` (each implementation's message sizes; per
  inner step for the DiLoCo family, whose one outer all-reduce or all-gather per ``H`` steps is spread over
  them; zen_ext's on the demo model scaled by its measured / modelled ratio at 2 ranks, see below);
* compute is, for the demo model, the method's own step seconds measured in its runs here (2 CPU ranks:
  forward, backward, optimizer, the method's compression, loopback communication; each run's median step,
  the least of the seeds' as the machine is shared and other jobs only add), and for the 58 M
  Llama zero (the communication-bound limit: a GPU's compute of one step is small beside 400 MB at 250 Mbit/s);
* steps come from the measured runs (``bench_peers.py``): a seed's steps to dense's final eval loss + 1 %
  (paired seed; linear between evaluations). qgZ's steps are from ZeRO-3 on 2 emulated nodes (paired with
  dense ZeRO-3 of the same seed), its compute from dense DDP, its bytes the gradient sync only (ZeRO-3's
  parameter all-gathers left out: a lower bound).

Not measured on the emulated cluster: the lab runs (network namespaces, root) did not fit in the session.
A check of the model against what the lab measured for zen_ext (``benchmarks/cluster/results/cluster_e2e.jsonl``,
``llama-lab16`` at 8 hosts): see ``calibration``.
"""

from __future__ import annotations

import json
import os
import statistics

from quality_report import steps_to  # the one interpolation the time-to-quality reports share

LABS = {"8 hosts × 250 Mbit/s": (8, 250e6 / 8), "16 hosts × 100 Mbit/s": (16, 100e6 / 8)}
"""Lab name → (hosts, bytes per second of each host's link)."""
BYTES_KEY = {"ddp_dense": "dense", "ddp_zen_dgc5": "zen_dgc5", "ddp_zen_dgc1": "zen_dgc1",
             "ddp_zen_dgc5_int4": "zen_dgc5", "powersgd_r1": "powersgd_r1", "powersgd_r4": "powersgd_r4",
             "diloco_h10": "diloco_h10", "diloco_h50": "diloco_h50", "sparseloco_h15": "sparseloco_h15",
             "zero3_2x2_qgz": "qgz"}
EXTRA_ROWS = {"zero3_2x2_qgz": [("qgz_zero3", "zero3_2x2_qgz + ZeRO-3 fp32 parameter all-gathers"),
                                ("qgz_qwz", "zero3_2x2_qgz + qwZ int8 parameter all-gathers")]}
"""Further rows for a variant: the same steps with other bytes (qgZ runs only under ZeRO-3, which all-gathers
the parameters twice per step)."""


def calibration(cluster_jsonl: str) -> list[str]:
    """The model against the lab's measured step times at 8 hosts (llama-lab16): compute from dense at 1 Gbit/s,
    then predicted vs measured at 100 Mbit/s."""
    recs = []
    if os.path.exists(cluster_jsonl):
        with open(cluster_jsonl) as f:
            recs = [json.loads(x) for x in f if '"e2e"' in x]
    at = {(r["n"], r["rate"], r["config"]): r for r in recs if r.get("bench") == "e2e" and r["n"] == 8}
    d1, d100, z100 = at.get((8, "1gbit", "dense")), at.get((8, "100mbit", "dense")), at.get((8, "100mbit", "zen_dgc1"))
    if not (d1 and d100 and z100):
        return []
    compute = d1["step_s_med"] - d1["bytes_sent_per_step"] / 125e6
    out = []
    for r in (d100, z100):
        pred = compute + r.get("compress_s_med", 0.0) + r["bytes_sent_per_step"] / 12.5e6
        out.append(f"{r['config']} at 8 hosts × 100 Mbit/s: modelled {pred:.3f} s, measured {r['step_s_med']:.3f} s "
                   f"({pred / r['step_s_med']:.2f}×)")
    return out


def report(results: list[dict], demo_bytes: list[dict], big_bytes: list[dict], zen_scale: dict) -> str:
    """Per lab: per-step seconds and time to dense + 1 % (median over seeds that reach it, × dense's)."""
    by: dict[str, dict[int, dict]] = {}
    for r in results:
        if r["setting"] == "finetune":
            by.setdefault(r["variant"], {})[r["seed"]] = r
    dense, z3 = by.get("ddp_dense", {}), by.get("zero3_2x2_dense", {})
    if not dense:
        return ""
    compute = {v: min(r["step_s_med"] for r in s.values()) for v, s in by.items()}
    compute["zero3_2x2_qgz"] = compute["ddp_dense"]
    lines = ["| method | seeds reaching | " + " | ".join(
        f"{lab}: demo step s | demo time × dense | 58 M comm-bound step s | 58 M time × dense" for lab in LABS) + " |",
        "|---|---|" + "---|---|---|---|" * len(LABS)]
    for variant, seeds in by.items():
        if variant not in BYTES_KEY and variant != "ddp_dense":
            continue
        base = z3 if variant == "zero3_2x2_qgz" else dense
        reach = {}
        for s, r in seeds.items():
            if s in base:
                t = steps_to(r["eval"], base[s]["eval"][-1][1] * 1.01)
                d = steps_to(base[s]["eval"], base[s]["eval"][-1][1] * 1.01)
                reach[s] = (t, d)
        got = [(t, d) for t, d in reach.values() if t is not None]
        for key, label in [(BYTES_KEY.get(variant, "dense"), variant)] + EXTRA_ROWS.get(variant, []):
            lines.append(_row(label, key, variant, got, reach, compute, demo_bytes, big_bytes, zen_scale))
    return "\n".join(lines)


def _row(label, key, variant, got, reach, compute, demo_bytes, big_bytes, zen_scale) -> str:
    """One table row: ``label`` with bytes ``key`` and the steps and compute of ``variant``."""
    cells = [label, f"{len(got)}/{len(reach)}"]
    for lab, (n, rate) in LABS.items():
        row = next(x for x in demo_bytes if x["n"] == n)
        big = next(x for x in big_bytes if x["n"] == n)
        scale = zen_scale.get(key, 1.0)
        st = compute[variant] + row[key] * scale / rate
        st_d = compute["ddp_dense"] + row["dense"] / rate
        bt, bt_d = big[key] / rate, big["dense"] / rate
        if got:
            demo_x = statistics.median(t * st / (d * st_d) for t, d in got)
            big_x = statistics.median(t * bt / (d * bt_d) for t, d in got)
            cells += [f"{st:.3f}", f"**{demo_x:.2f}×**", f"{bt:.2f}", f"**{big_x:.3f}×**"]
        else:
            cells += [f"{st:.3f}", "not reached in the run", f"{bt:.2f}", "not reached"]
    return "| " + " | ".join(cells) + " |"
