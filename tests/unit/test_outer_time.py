"""zen.outer's modelled time to quality (``benchmarks/quality/outer_time.py``): the bytes each method sends per
inner step, the parsing of ``bench_outer_bytes.py``'s results, and the paired time table and targets."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

import outer_time  # noqa: E402

BITS = {(0.015625, 15): {8: (300.0, 140.0, 110.0), 16: (450.0, 180.0, 140.0)},
        (0.25, 15): {8: (100.0, 50.0, 40.0), 16: (80.0, 40.0, 30.0)},
        (0.0625, 15): {8: (200.0, 90.0, 70.0), 16: (250.0, 100.0, 80.0)},
        (0.0625, 5): {8: (200.0, 90.0, 70.0), 16: (250.0, 100.0, 80.0)},
        (0.25, 5): {8: (100.0, 50.0, 40.0), 16: (80.0, 40.0, 30.0)}}


def test_bytes_per_inner_step_follow_each_transport():
    P = 4096 * 64
    ring = 2 * 15 / 16 * 4 * P
    assert outer_time.bytes_per_step(("dense",), 16, P, BITS, None) == ring
    assert outer_time.bytes_per_step(("diloco", 15), 16, P, BITS, None) == ring / 15
    K = P // 4  # density 0.25
    assert outer_time.bytes_per_step(("zen", 0.25, 15, 4), 16, P, BITS, None) == K * 30.0 / 8 / 15
    assert outer_time.bytes_per_step(("zen", 0.25, 15, 4), 16, P, BITS, {32: 1.0, 8: 1.0, 4: 2.0}) == K * 60.0 / 8 / 15
    # SparseLoCo's wire: (n − 1)·K entries of 12-bit index + 2-bit value; 4-bit adds one fp32 scale per 128 values
    k = P // 64
    assert outer_time.bytes_per_step(("allgather", 0.015625, 15, 2), 16, P, BITS, None) == 15 * k * 14 / 8 / 15
    assert outer_time.bytes_per_step(("allgather", 0.25, 15, 4), 8, P, BITS, None) == 7 * (K * 2 + 4 * K // 128) / 15


def test_zen_bits_reads_the_ratios_table(tmp_path):
    md = tmp_path / "b.md"
    md.write_text("| R | K picks / replica | union |\n| 8 | 3,333 | 0.7 |\n\n"
                  "| R | a | b | c | d | e | f | bits | ag |\n| --- |\n"
                  "| 8 | 0.6 | 0.5 | 0.4 | 1.1 | 1.0 | 0.6 | 288.5/137.2/111.7 | 448/282/254 [114] |\n"
                  "| 16 | 0.4 | 0.3 | 0.2 | 0.6 | 1.0 | 0.5 | 432.7/179.4/136.8 | 960/604/544 [244] |\n")
    assert outer_time.zen_bits(str(md)) == {8: (288.5, 137.2, 111.7), 16: (432.7, 179.4, 136.8)}


def _run(variant, seed, evals, inner=0.01, outer=0.0):
    return {"setting": "finetune", "variant": variant, "seed": seed, "eval": evals, "inner_s_med": inner,
            "outer_s_med": outer * 15, "outer_s_per_step": outer}


def test_report_pairs_seeds_and_states_targets():
    runs = {"finetune": {
        "dense": {s: _run("dense", s, [[50, 4.0], [100, 3.5], [150, 3.0]]) for s in (0, 1)},
        "diloco": {s: _run("diloco", s, [[50, 4.0], [100, 3.2], [150, 2.9]]) for s in (0, 1)},
        "outer": {s: _run("outer", s, [[50, 4.5], [100, 4.0], [150, 3.5]]) for s in (0, 1)},
        "outer_d25_4bit": {0: _run("outer_d25_4bit", 0, [[50, 4.0], [100, 3.0], [150, 2.9]]),
                           1: _run("outer_d25_4bit", 1, [[50, 4.0], [100, 3.5], [150, 3.0]])},
        "outer_d0625_h5_4bit": {0: _run("outer_d0625_h5_4bit", 0, [[50, 4.0], [100, 3.0], [150, 2.9]]),
                                1: _run("outer_d0625_h5_4bit", 1, [[50, 4.0], [100, 3.5], [150, 3.2]])}}}
    text = "\n".join(outer_time.report(runs, BITS, {32: 1.0, 8: 1.0, 4: 1.0}))
    rows = {line.split(" |")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # dense + 1 % = 3.03: diloco between 100 (3.2) and 150 (2.9) → 128; dense itself at 147
    assert "| diloco | 128 | 128 |" in text and "| outer_d0625_h5_4bit | 98 | — |" in text
    label = "| zen.outer top-1024/4096, H 15, 4-bit |"
    byt, top, verdict = [line for line in text.splitlines() if line.startswith(label)]  # bytes, time, targets
    assert top.split("|")[2].strip() == "2/2" and "yes / yes" in verdict
    half = [line for line in text.splitlines() if line.startswith("| zen.outer top-256/4096, H 5, 4-bit |")]
    # one seed of two reaches it: the time table takes that seed (as peers_time), the targets the median of both
    assert half[1].split("|")[2].strip() == "1/2" and "median seed does not reach it" in half[2]
    sparse = [line for line in text.splitlines() if line.startswith("| SparseLoCo")][1]
    assert sparse == rows["SparseLoCo (defaults: top-64/4096, H 15, 2-bit all-gather; quality of `outer`)"]
    assert "not reached" in sparse
    assert "ahead (SparseLoCo does not reach it)" in text
    # 58 M comm-bound at 16 hosts: steps 98 / 147 × bytes (K·30/8/15) / ring
    K, ring = round(0.25 * outer_time.BIG_P), 2 * 15 / 16 * 4 * outer_time.BIG_P
    want = (98.5 / 147.0 + 1.0) / 2 * (K * 30 / 8 / 15) / ring  # median of the two seeds' ratios
    assert top.split("|")[-2].strip() == f"**{want:.3f}×**"
