"""MODELLED time to dense + 1 % of zen.outer against dense DDP, dense DiLoCo and SparseLoCo on two lab sizes:
8 hosts × 250 Mbit/s and 16 hosts × 100 Mbit/s (one replica per host), in ``peers_time.py``'s model.

Not measured on the emulated cluster: on this 2-core machine 8 or 16 ranks' compute queues on 2 cores, so a lab
run's wall time would measure the queue, not the method. Instead, as ``peers_time.py`` does:

1. Steps: each (setting, variant, seed) of ``bench_outer_quality.py --jsonl`` (2 SimWorld replicas, equal inner
   steps, eval of θ_global every 15 inner steps) gives the inner steps to dense's final eval loss + 1 % of the
   same seed (paired; linear between evaluations; ``quality_report.steps_to``), and dense's own steps to it.
2. Bytes per rank per inner step at ``n`` hosts: dense DDP a ring all-reduce of fp32 gradients,
   2 (n − 1) / n · 4 P; dense DiLoCo on ZEN (``density: 1`` takes the dense all-reduce) that / H; zen.outer
   K · (ZEN's bits per own pick, measured by ``benchmarks/comm/bench_outer_bytes.py`` on real pseudo-gradients
   of the demo model at n replicas and the variant's density and H) / 8 / H; SparseLoCo its all-gather of
   2-bit values and 12-bit indices, (n − 1) · K · 14 / 8 / H (its own wire; ``bench_outer_bytes.py``'s
   formula), and, for each 4-bit zen.outer setting, the same picks and 4-bit values sent by that all-gather
   (n − 1) · (K · (12 + 4) / 8 + 4 ⌈K / 128⌉) / H: what ZEN's sum buys over SparseLoCo's transport.
   For the 58 M Llama (``configs/models/llama-h768-l8.json``) K = density · P and the bits per own pick are the
   demo's times the ratio measured on the 58 M Llama at 8 replicas (SparseLoCo's density, fp32 and 4-bit:
   ``benchmarks/comm/results/outer_bytes_58m.md`` against ``outer_bytes.md``), the only 58 M point measured.
3. Compute per inner step, demo model: the least over every run of its median inner step (forward, backward,
   AdamW on one replica's micro-batch: the same work in every method), plus the method's median outer step
   (pseudo-gradient, error feedback, top-k, the SimWorld sum's local work, the outer optimizer) / H, measured
   here; for the 58 M Llama zero: the communication-bound limit.
4. Per-step time = compute + bytes / link rate; time to quality × dense = median over the seeds that reach
   the target of (steps · step time) / (dense's steps · dense's step time), ``peers_time._row``.

Usage: python benchmarks/quality/outer_time.py --runs benchmarks/quality/results/outer_time_runs.jsonl
--out benchmarks/quality/results/outer_time_to_quality.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from peers_time import LABS, _row  # noqa: E402  (the per-step model and its table row, shared with the peers)
from quality_report import steps_to  # noqa: E402

DEMO_P = 213_312
"""Parameters of the demo Llama (``configs/models/llama-tiny-untied.json`` at the 1,024-token vocabulary)."""
BIG_P = 58_209_024
"""Parameters of the 58 M Llama (``configs/models/llama-h768-l8.json``)."""
BYTES_MD = {(0.015625, 15): "outer_bytes.md", (0.0625, 15): "outer_bytes_d0625.md",
            (0.25, 15): "outer_bytes_d25.md", (0.0625, 5): "outer_bytes_d0625_h5.md",
            (0.25, 5): "outer_bytes_d25_h5.md"}
"""(density, H) → ``benchmarks/comm/results`` file with ZEN's bits per own pick at 8 and 16 replicas."""
METHODS = [  # (label, variant whose steps count, bytes: kind and arguments)
    ("dense DDP (ring all-reduce every step)", "dense", ("dense",)),
    ("dense DiLoCo on ZEN (density 1, H 15, outer Nesterov)", "diloco", ("diloco", 15)),
    ("SparseLoCo (defaults: top-64/4096, H 15, 2-bit all-gather; quality of `outer`)", "outer",
     ("allgather", 0.015625, 15, 2)),
    ("zen.outer, SparseLoCo's defaults (top-64/4096, H 15), fp32", "outer", ("zen", 0.015625, 15, 32)),
    ("zen.outer, SparseLoCo's defaults, 4-bit", "outer_4bit", ("zen", 0.015625, 15, 4)),
    ("zen.outer top-256/4096, H 15, fp32", "outer_d0625", ("zen", 0.0625, 15, 32)),
    ("zen.outer top-1024/4096, H 15, fp32", "outer_d25", ("zen", 0.25, 15, 32)),
    ("zen.outer top-1024/4096, H 15, 4-bit", "outer_d25_4bit", ("zen", 0.25, 15, 4)),
    ("top-1024/4096, H 15, 4-bit by SparseLoCo's all-gather (12-bit indices)", "outer_d25_4bit",
     ("allgather", 0.25, 15, 4)),
    ("zen.outer top-256/4096, H 5, fp32", "outer_d0625_h5", ("zen", 0.0625, 5, 32)),
    ("zen.outer top-256/4096, H 5, 4-bit", "outer_d0625_h5_4bit", ("zen", 0.0625, 5, 4)),
    ("top-256/4096, H 5, 4-bit by SparseLoCo's all-gather (12-bit indices)", "outer_d0625_h5_4bit",
     ("allgather", 0.0625, 5, 4)),
    ("zen.outer top-1024/4096, H 5, fp32", "outer_d25_h5", ("zen", 0.25, 5, 32)),
    ("zen.outer top-1024/4096, H 5, 4-bit", "outer_d25_h5_4bit", ("zen", 0.25, 5, 4)),
    ("top-1024/4096, H 5, 4-bit by SparseLoCo's all-gather (12-bit indices)", "outer_d25_h5_4bit",
     ("allgather", 0.25, 5, 4)),
]
BIT_COL = {32: 0, 8: 1, 4: 2}
HEADER = """# zen.outer: modelled time to dense + 1 % (8 hosts × 250 Mbit/s, 16 hosts × 100 Mbit/s)

MODELLED, not measured on the emulated cluster (this 2-core machine queues 8 or 16 ranks' compute): steps to
dense's final eval loss + 1 % measured at 2 replicas (paired seeds), bytes per rank per inner step measured on real
pseudo-gradients at 8 and 16 replicas (demo model; the 58 M Llama scaled from its 8-replica measurement), compute
measured here; per-step time = compute + bytes / link rate (`benchmarks/quality/outer_time.py`'s docstring,
`peers_time.py`'s model). "× dense": time to the target over dense DDP's time to it, median over the seeds that
reach it. Demo: the compute-bound form (CPU compute); 58 M: the communication-bound limit (compute 0).

MEASURED since: zen.outer's `diloco`, `outer_d25_4bit` and `outer_d25_h5_4bit` trained through `register_outer` in
the peers harness (`benchmarks/quality/results/peers.md`, rows `zen_outer_*`: 2 DDP ranks, 5 seeds) and timed on
the emulated cluster at both lab sizes beside dense DDP, per-step DGC, torchft DiLoCo and SparseLoCo:
`benchmarks/quality/results/outer_time_measured.md`.

Commands (`Q` = `OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/quality/bench_outer_quality.py
--seeds 0 1 2 3 4 --eval_every 1 --jsonl benchmarks/quality/results/outer_time_runs.jsonl`, `B` = `OMP_NUM_THREADS=1 nice -n 10
.venv/bin/python benchmarks/comm/bench_outer_bytes.py --replicas 8 16 --rounds 4 --shared_steps 30`):

```
V="dense diloco outer outer_4bit outer_d0625 outer_d25 outer_d25_4bit outer_d0625_h5 outer_d0625_h5_4bit \\
   outer_d25_h5 outer_d25_h5_4bit"
W="dense diloco outer outer_4bit outer_d25 outer_d25_4bit outer_d0625_h5_4bit outer_d25_h5_4bit"
$Q --setting finetune --variants $V --out benchmarks/quality/results/outer_time_quality_finetune.md
$Q --setting scratch --variants $V --out benchmarks/quality/results/outer_time_quality_scratch.md
$Q --setting finetune --steps 300 --variants $W --out benchmarks/quality/results/outer_time_quality_finetune_300.md
$Q --setting scratch --steps 300 --variants $W --out benchmarks/quality/results/outer_time_quality_scratch_300.md
$B --every 15 --density 0.0625 --out benchmarks/comm/results/outer_bytes_d0625.md
$B --every 15 --density 0.25 --out benchmarks/comm/results/outer_bytes_d25.md
$B --every 5 --density 0.0625 --out benchmarks/comm/results/outer_bytes_d0625_h5.md
$B --every 5 --density 0.25 --out benchmarks/comm/results/outer_bytes_d25_h5.md
.venv/bin/python benchmarks/quality/outer_time.py --out benchmarks/quality/results/outer_time_to_quality.md
```

(SparseLoCo's density at H 15: `benchmarks/comm/results/outer_bytes.md`; the 58 M Llama at 8 replicas:
`outer_bytes_58m.md`.)"""


def zen_bits(path: str) -> dict[int, tuple[float, float, float]]:
    """``bench_outer_bytes.py``'s results: replicas → ZEN's bits per own pick (fp32, 8-bit, 4-bit)."""
    out = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 9 and cells[0].isdigit():  # the ratios table's rows
                out[int(cells[0])] = tuple(float(x) for x in cells[7].split("/"))
    return out


def bytes_per_step(kind: tuple, n: int, P: int, bits: dict, big_scale: dict | None) -> float:
    """Bytes each of ``n`` ranks sends per inner step (step 2 of the module docstring)."""
    ring = 2 * (n - 1) / n * 4 * P
    if kind[0] == "dense":
        return ring
    if kind[0] == "diloco":
        return ring / kind[1]
    density, H, b = kind[1:]
    K = round(density * P)
    if kind[0] == "allgather":
        per_pick = 14 if b == 2 else 12 + b  # SparseLoCo's wire: 12-bit index + 2-bit value, no scales
        scales = 0 if b == 2 else 4 * math.ceil(K / 128)
        return (n - 1) * (K * per_pick / 8 + scales) / H
    per_pick = bits[(density, H)][n][BIT_COL[b]] * (big_scale[b] if big_scale else 1.0)
    return K * per_pick / 8 / H


def load_runs(path: str) -> dict[str, dict[str, dict[int, dict]]]:
    """"setting, steps" → variant → seed → the run's record (the last one written wins)."""
    by: dict = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            by.setdefault(f"{r['setting']}, {r['steps']} inner steps", {}).setdefault(r["variant"], {})[r["seed"]] = r
    return by


def report(runs: dict, bits: dict, big_scale: dict) -> list[str]:
    """Per setting: steps to dense + 1 % per seed, bytes per inner step, and the time table."""
    out = []
    for setting, by in runs.items():
        dense = by["dense"]
        inner = min(r["inner_s_med"] for v, s in by.items() if v != "dense" for r in s.values())
        reach_all = {}
        for v, seeds in by.items():
            reach_all[v] = {}
            for s, r in seeds.items():
                target = dense[s]["eval"][-1][1] * 1.01
                reach_all[v][s] = (steps_to(r["eval"], target), steps_to(dense[s]["eval"], target))
        seeds = sorted(dense)
        out += [f"### {setting}: inner steps to dense's final eval loss + 1 % (paired seeds)", "",
                "| variant | " + " | ".join(f"seed {s}" for s in seeds) + " | final gap to dense, median [min–max] |",
                "|---|" + "---|" * (len(seeds) + 1)]
        for v, reach in reach_all.items():
            gaps = sorted(100 * (by[v][s]["eval"][-1][1] / dense[s]["eval"][-1][1] - 1) for s in by[v])
            cells = [f"{reach[s][0]:.0f}" if reach.get(s, (None,))[0] is not None else "—" for s in seeds]
            out.append(f"| {v} | " + " | ".join(cells) +
                       f" | {statistics.median(gaps):+.2f} [{gaps[0]:+.2f}–{gaps[-1]:+.2f}] % |")
        out += ["", f"Compute per inner step (demo model, measured here): {inner * 1e3:.1f} ms (the least of the "
                "runs' median inner steps); outer step / H, median over seeds: " +
                ", ".join(f"{v} {statistics.median(r['outer_s_per_step'] for r in by[v].values()) * 1e3:.2f} ms"
                          for v in by if v != "dense") + ".", ""]
        demo_rows, big_rows = [], []
        for n, _ in LABS.values():
            demo_rows.append({"n": n, **{lab: bytes_per_step(k, n, DEMO_P, bits, None) for lab, _, k in METHODS}})
            big_rows.append({"n": n, **{lab: bytes_per_step(k, n, BIG_P, bits, big_scale) for lab, _, k in METHODS}})
        for rows in (demo_rows, big_rows):
            for row in rows:
                row["dense"] = row[METHODS[0][0]]
        out += [f"### {setting}: bytes per rank per inner step", "",
                "| method | " + " | ".join(f"demo, {n} hosts | 58 M, {n} hosts" for n, _ in LABS.values()) + " |",
                "|---|" + "---|---|" * len(LABS)]
        for lab, _, _ in METHODS:
            out.append(f"| {lab} | " + " | ".join(
                f"{d[lab]:,.0f} B ({d[lab] / d['dense']:.4f}×) | {b[lab] / 1e6:,.3f} MB ({b[lab] / b['dense']:.4f}×)"
                for d, b in zip(demo_rows, big_rows)) + " |")
        compute = {v: inner + statistics.median(r["outer_s_per_step"] for r in s.values()) if v != "dense" else inner
                   for v, s in by.items()}
        compute["ddp_dense"] = inner
        out += ["", f"### {setting}: modelled time to dense + 1 % (median over the seeds that reach it)", "",
                "| method | seeds reaching | " + " | ".join(
                    f"{lab}: demo step s | demo time × dense | 58 M comm-bound step s | 58 M time × dense"
                    for lab in LABS) + " |", "|---|---|" + "---|---|---|---|" * len(LABS)]
        x = {}
        for lab, v, _ in METHODS:
            if v not in by:
                continue
            reach = reach_all[v]
            got = [(t, d) for t, d in reach.values() if t is not None]
            out.append(_row(lab, lab, v, got, reach, compute, demo_rows, big_rows, {}))
            x[lab] = (len(got), len(reach), _times(lab, v, list(reach.values()), compute, demo_rows, big_rows))
        out += ["", *targets(setting, x), ""]
    return out


def _times(key, variant, reach, compute, demo_rows, big_rows) -> dict:
    """lab → (demo time × dense, 58 M time × dense) as ``peers_time._row`` computes them, but the median over
    every seed, a seed that does not reach the target counted as beyond the run (inf); None: the median seed
    does not reach it."""
    out = {}
    for lab, (n, rate) in LABS.items():
        row, big = next(r for r in demo_rows if r["n"] == n), next(r for r in big_rows if r["n"] == n)
        st, st_d = compute[variant] + row[key] / rate, compute["ddp_dense"] + row["dense"] / rate
        demo = statistics.median(math.inf if t is None else t * st / (d * st_d) for t, d in reach)
        big_x = statistics.median(math.inf if t is None else t * big[key] / (d * big["dense"]) for t, d in reach)
        out[lab] = None if math.isinf(demo) else (demo, big_x)
    return out


def targets(setting: str, x: dict) -> list[str]:
    """The issue's targets per lab: zen.outer ≤ 0.25× dense's time, and ahead of dense DiLoCo and SparseLoCo."""
    base = {"DiLoCo": METHODS[1][0], "SparseLoCo": METHODS[2][0]}
    out = [f"### {setting}: targets (time to dense + 1 % ≤ 0.25× dense; ahead of dense DiLoCo and SparseLoCo)", "",
           "Here the median is over every seed, a seed that does not reach the target within the run counted as "
           "beyond it (the table above, as `peers_time.py`, takes the median over the seeds that reach it).", "",
           "| zen.outer setting | seeds reaching | " + " | ".join(
               f"{lab}: demo × dense / 58 M × dense | ≤ 0.25× (demo / 58 M) | vs DiLoCo (demo / 58 M) | "
               "vs SparseLoCo"
               for lab in LABS) + " |", "|---|---|" + "---|---|---|---|" * len(LABS)]
    for lab, (k, n, t) in x.items():
        if not lab.startswith("zen.outer"):
            continue
        cells = [lab, f"{k}/{n}"]
        for lname in LABS:
            if t[lname] is None:
                cells += ["median seed does not reach it", "no / no", "—", "—"]
                continue
            d, b = t[lname]
            dl = x[base["DiLoCo"]][2][lname]
            sl = x[base["SparseLoCo"]][2][lname]
            cells += [f"{d:.3f}× / {b:.4f}×", f"{'yes' if d <= 0.25 else 'no'} / {'yes' if b <= 0.25 else 'no'}",
                      f"{d / dl[0]:.2f}× / {b / dl[1]:.2f}× DiLoCo's" if dl else "DiLoCo not reached",
                      "ahead (SparseLoCo does not reach it)" if sl is None
                      else f"{d / sl[0]:.2f}× / {b / sl[1]:.2f}×"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default=os.path.join(HERE, "results", "outer_time_runs.jsonl"))
    p.add_argument("--bytes_dir", default=os.path.join(os.path.dirname(HERE), "comm", "results"))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    bits = {k: zen_bits(os.path.join(args.bytes_dir, f)) for k, f in BYTES_MD.items()
            if os.path.exists(os.path.join(args.bytes_dir, f))}
    big, demo = zen_bits(os.path.join(args.bytes_dir, "outer_bytes_58m.md"))[8], bits[(0.015625, 15)][8]
    big_scale = {b: big[i] / demo[i] for b, i in BIT_COL.items()}
    lines = [HEADER, ""] + report(load_runs(args.runs), bits, big_scale)
    lines.append(f"58 M bits per own pick / the demo's at 8 replicas (SparseLoCo's density): fp32 {big_scale[32]:.3f}, "
                 f"4-bit {big_scale[4]:.3f} (applied to every 58 M zen.outer row).")
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    from benchmarks.comm.bench_outer_bytes import provenance  # the results files' one provenance line

    lines += ["", provenance("the report reads the runs above; compute was timed in them") + "."]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
