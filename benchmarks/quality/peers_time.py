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

MEASURED on the emulated cluster where a measurement exists (``benchmarks/cluster/bench_peers_lab.py``, results in
``benchmarks/cluster/results/peers_lab.jsonl``): each method's step seconds at both lab sizes, on the lab's model
(``benchmarks/cluster/configs/llama-lab16.json``, ~2.5 M parameters, micro-batch 2 × 64 tokens per rank; 8 and
16 ranks on 2 shared cores) — per inner step for the DiLoCo family, its outer synchronization included. The
lab columns are time × dense = (steps to dense + 1 % / dense's) × (lab step s / dense DDP's lab step s); the
modelled columns stay beside them. qgZ's lab step is ZeRO-3 with its real parameter all-gathers, so it times
the ``+ ZeRO-3 fp32 parameter all-gathers`` row. A check of the model against what the lab measured for zen_ext
(``benchmarks/cluster/results/cluster_e2e.jsonl``, ``llama-lab16`` at 8 hosts): see ``calibration``.

Regenerating the lab section of ``benchmarks/quality/results/peers.md`` alone (the per-seed run folders of
``bench_peers.py`` are not kept; the steps are then the quality table's median step of the seeds that reach
dense + 1 %, divided by dense's)::

    .venv/bin/python benchmarks/quality/peers_time.py --lab benchmarks/cluster/results/peers_lab.jsonl \
        --peers-md benchmarks/quality/results/peers.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
LAB_METHOD = {"ddp_dense": "dense", "ddp_zen_dgc5": "zen_dgc5", "ddp_zen_dgc1": "zen_dgc1",
              "powersgd_r1": "powersgd_r1", "powersgd_r4": "powersgd_r4", "diloco_h50": "diloco_h50",
              "sparseloco_h15": "sparseloco_h15", "zero3_2x2_qgz + ZeRO-3 fp32 parameter all-gathers": "qgz_z3",
              "zen_outer_diloco": "zen_outer_diloco", "zen_outer_d25_4bit": "zen_outer_d25_4bit",
              "zen_outer_d25_h5_4bit": "zen_outer_d25_h5_4bit",
              "zen_outer_d25_4bit_delay1": "zen_outer_d25_4bit_delay1",
              "zen_outer_d25_4bit_h50": "zen_outer_d25_4bit_h50"}
"""Table row → the ``bench_peers_lab.py`` method whose measured step time it takes; rows not listed have no lab
measurement (a 4-bit residual, DiLoCo H 10, qgZ without ZeRO-3's all-gathers or with qwZ's). The zen.outer rows
have no modelled time (``BYTES_KEY``): their lab section rows say so and carry the measured columns alone."""
LAB_RUNS = {"8 hosts × 250 Mbit/s": (8, "250mbit"), "16 hosts × 100 Mbit/s": (16, "100mbit")}


def lab_step_s(lab_jsonl: str) -> dict[str, dict[str, float]]:
    """Lab name → method → measured median step seconds, from the latest ``bench_peers_lab.py`` invocation per
    lab size (empty where the file or a lab size is missing)."""
    if not os.path.exists(lab_jsonl):
        return {}
    with open(lab_jsonl) as f:
        recs = [json.loads(x) for x in f if x.strip()]
    out = {}
    for lab, (n, rate) in LAB_RUNS.items():
        rows = [r for r in recs if r.get("bench") == "peers_lab" and r["n"] == n and r["rate"] == rate]
        if rows:
            stamp = max(r["stamp"] for r in rows)
            out[lab] = {r["method"]: r["step_s_med"] for r in rows if r["stamp"] == stamp and "step_s_med" in r}
    return out


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


def report(results: list[dict], demo_bytes: list[dict], big_bytes: list[dict], zen_scale: dict,
           lab: dict | None = None) -> str:
    """Per lab: per-step seconds and time to dense + 1 % (median over seeds that reach it, × dense's); with
    ``lab`` (``lab_step_s``), the lab-measured step seconds and time × dense in further columns at the end."""
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
        f"{lab}: demo step s | demo time × dense | 58 M comm-bound step s | 58 M time × dense" for lab in LABS)
        + "".join(f" | {name}: MEASURED lab step s | lab time × dense" for name in (lab or {})) + " |",
        "|---|---|" + "---|---|---|---|" * len(LABS) + "---|---|" * len(lab or {})]
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
            lines.append(_row(label, key, variant, got, reach, compute, demo_bytes, big_bytes, zen_scale)
                         + _lab_cells(label, got, lab or {}))
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


def _lab_cells(row: str, got: list, lab: dict) -> str:
    """A row's measured columns: the lab step seconds of its method and time × dense (median over the seeds that
    reach the target of steps × lab step s over dense's)."""
    cells = []
    for steps in lab.values():
        s, d = steps.get(LAB_METHOD.get(row, "")), steps.get("dense")
        if s is None or d is None:
            cells += ["–", "no lab measurement"]
        elif got:
            cells += [f"{s:.3f}", f"**{statistics.median(t * s / (dd * d) for t, dd in got):.2f}×**"]
        else:
            cells += [f"{s:.3f}", "not reached in the run"]
    return "".join(f" {c} |" for c in cells)


def lab_section(peers_md: str, lab: dict) -> str:
    """The lab section of ``peers.md`` from its quality table (median step of the seeds that reach dense + 1 %)
    and modelled table (kept as they are), with the lab-measured step seconds; see the module docstring."""
    reach, modelled = {}, {}
    for line in peers_md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"(\S+) \((\d+) seeds", cells[0]) if line.startswith("| ") else None
        if m and len(cells) > 5 and "/" in cells[5] and m.group(1) not in reach:  # the finetune table comes first
            hit = re.match(r"(\d+)/(\d+)(?:; (\d+))?", cells[5])
            reach[m.group(1)] = (hit.group(1), hit.group(2), float(hit.group(3)) if hit.group(3) else None)
        elif line.startswith("| ") and len(cells) == 10 and cells[0] not in modelled and cells[1].count("/") == 1:
            modelled[cells[0]] = (cells[1], cells[3], cells[5], cells[7], cells[9])
    for row in reach:  # quality rows measured on the lab but not modelled (zen.outer): measured columns only
        if row not in modelled and row in LAB_METHOD:
            modelled[row] = (reach[row][0],) + ("not modelled",) * 4
    dense = reach.get("ddp_dense", (0, 0, None))[2]
    z3 = reach.get("zero3_2x2_dense", (0, 0, None))[2]
    head = ["method", "seeds reaching; median step"]
    for name in LAB_RUNS:
        head += [f"{name}: MEASURED lab step s (× dense DDP)", "MEASURED lab time × dense",
                 "modelled demo time × dense", "modelled 58 M time × dense"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---|---|---|---|" * len(LAB_RUNS)]
    for row, mod in modelled.items():
        variant = row.split(" + ")[0]
        hit = reach.get(variant)
        if hit is None:
            continue
        base = z3 if variant.startswith("zero3_2x2") else dense
        cells = [row, f"{hit[0]}/{hit[1]}" + (f"; {hit[2]:.0f}" if hit[2] is not None else "")]
        for k, name in enumerate(LAB_RUNS):
            steps = lab.get(name, {})
            s, d = steps.get(LAB_METHOD.get(row, "")), steps.get("dense")
            if s is None or d is None:
                cells += ["–", "no lab measurement"]
            else:
                cells += [f"{s:.3f} ({s / d:.2f}×)",
                          f"**{hit[2] / base * s / d:.2f}×**" if hit[2] is not None and base else "not reached in the run"]
            cells += [mod[1 + 2 * k], mod[2 + 2 * k]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SECTION = "### Lab-measured time to dense + 1 % (finetune; peers_time.py --lab)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Regenerate the lab section of peers.md (see the module docstring).")
    p.add_argument("--lab", required=True, help="bench_peers_lab.py's JSON lines")
    p.add_argument("--peers-md", required=True, help="benchmarks/quality/results/peers.md: read, and its lab section "
                                                     "written in place (before '### scratch')")
    a = p.parse_args(argv)
    lab = lab_step_s(a.lab)
    if not lab:
        raise SystemExit(f"--lab ({a.lab}) holds no bench_peers_lab.py record of {list(LAB_RUNS)}")
    with open(a.peers_md) as f:
        text = f.read()
    text = re.sub(re.escape(SECTION) + r".*?(?=\n### |\n## )", "", text, flags=re.S).rstrip("\n") + "\n"
    body = (f"{SECTION}\n\nCommand: `.venv/bin/python benchmarks/quality/peers_time.py --lab "
            "benchmarks/cluster/results/peers_lab.jsonl --peers-md benchmarks/quality/results/peers.md`. "
            "MEASURED columns: each method's step seconds on the emulated cluster "
            "(`benchmarks/cluster/results/peers_lab.md`: `benchmarks/cluster/configs/llama-lab16.json`, micro-batch "
            "2 × 64 tokens per rank, one rank per emulated host, median of interleaved repeats; per inner step for "
            "the DiLoCo family, one outer synchronization in every timed window; 8 and 16 ranks share 2 CPU cores, "
            "so the lab steps are compute-heavy and the ratios, not the seconds, carry over); time × dense = "
            "(median step at which the seeds that reach dense + 1 % reach it / dense's, from the fine-tuning table "
            "above; qgZ against dense ZeRO-3's) × (lab step s / dense DDP's lab step s). The steps are the demo "
            "model's, the step times the lab model's, as the modelled 58 M columns combine the demo's steps with "
            "the 58 M Llama's bytes. modelled columns: the table above, unchanged (compute measured on 2 ranks + "
            "counted bytes / link rate). qgZ's lab step is ZeRO-3 with its real fp32 parameter all-gathers (the "
            "`+ ZeRO-3 fp32` row); rows without a lab run say so"
            + "".join(f"; at {name} " + ("qgZ did not run" if name in lab else "no method was measured")
                      + " (why: `benchmarks/cluster/results/peers_lab.md`)"
                      for name in LAB_RUNS if "qgz_z3" not in lab.get(name, {}))
            + ".\n\n" + lab_section(text, lab) + "\n")
    at = text.find("\n### scratch")
    text = text[:at + 1] + body + "\n" + text[at + 1:] if at >= 0 else text + "\n" + body
    with open(a.peers_md, "w") as f:
        f.write(text)
    print(body)


if __name__ == "__main__":
    main()
