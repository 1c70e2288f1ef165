"""The peers benchmark's arithmetic (``benchmarks/quality/``): PowerSGD's bytes from torch's own rule,
SparseLoCo's message size, qgZ's installation point, and the paired report and time model."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

import bench_peers  # noqa: E402
import peers_time  # noqa: E402
import qgz_emulation  # noqa: E402
import sparseloco  # noqa: E402
from peers_ddp import powersgd_step_bytes, ring_allreduce_bytes  # noqa: E402


def test_powersgd_bytes_follow_torch_rule():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(4, 4, bias=False))
    # weight 128 × 64 compressed at rank 4: P 128·4 + Q 64·4; the 4 × 4 weight fails min_compression_rate 2
    # ((4 + 4)·4·2 > 16) and goes with the 1-D bias into the uncompressed all-reduce.
    want = ring_allreduce_bytes(128 + 16, 4, 8) + ring_allreduce_bytes(128 * 4, 4, 8) + ring_allreduce_bytes(64 * 4, 4, 8)
    assert powersgd_step_bytes(model, 4, 8) == want
    assert ring_allreduce_bytes(1000, 4, 2) == 4000 and ring_allreduce_bytes(1000, 4, 1) == 0


def test_sparseloco_message_bytes():
    layout = sparseloco.layout_of([torch.empty(128, 192), torch.empty(100)], 64, 64)
    # 6 tiles of 4,096 × 64 picks; 100 = 2 chunks of 50 (its largest divisor up to 64; all 50 sent).
    assert layout == [(6, 4096, 64), (2, 50, 50)]
    assert sparseloco.message_bytes(layout) == (384 // 2 * 3 + 384 // 4 + 20) + (100 // 2 * 3 + 100 // 4 + 20)
    with pytest.raises(ValueError, match="1-D or 2-D"):
        sparseloco.to_chunks(torch.zeros(2, 2, 2), 64)


def test_qgz_install_replaces_zero3_call():
    import deepspeed.runtime.zero.stage3 as stage3

    saved = stage3.all_to_all_quant_reduce
    try:
        qgz_emulation.install()
        assert stage3.all_to_all_quant_reduce is qgz_emulation.all_to_all_quant_reduce
    finally:
        stage3.all_to_all_quant_reduce = saved


def _result(variant, seed, evals, bytes_per_step=100.0, step_s=0.1):
    return {"setting": "finetune", "variant": variant, "seed": seed, "steps": 200, "eval": evals,
            "bytes_per_step": bytes_per_step, "dense_bytes_per_step": 1000.0, "step_s_med": step_s}


def test_report_pairs_by_seed_and_counts_reach():
    dense = [_result("ddp_dense", s, [[50, 4.0], [100, 3.5], [200, 3.0]], 1000.0) for s in (0, 1)]
    good = [_result("ddp_zen_dgc5", s, [[50, 3.9], [100, 3.0], [200, 2.9]]) for s in (0, 1)]
    bad = [_result("powersgd_r1", 0, [[50, 4.5], [100, 4.0], [200, 3.5]])]
    text = bench_peers.report(dense + good + bad)
    rows = {line.split(" |")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "2/2; 98" in rows["ddp_zen_dgc5 (2 seeds)"]  # 3.03 reached between 50 (3.9) and 100 (3.0)
    assert "-3.33" in rows["ddp_zen_dgc5 (2 seeds)"] and "0.1000×" in rows["ddp_zen_dgc5 (2 seeds)"]
    assert "0/1" in rows["powersgd_r1 (1 seeds)"] and "+16.67" in rows["powersgd_r1 (1 seeds)"]
    assert peers_time.steps_to([[50, 4.0], [100, 3.0]], 3.5) == 75.0 and peers_time.steps_to([[50, 4.0]], 3.0) is None


def test_time_model_uses_bytes_over_rate_plus_compute():
    dense = [_result("ddp_dense", 0, [[100, 3.5], [200, 3.0]], step_s=0.1)]
    zen = [_result("ddp_zen_dgc5", 0, [[100, 3.0], [200, 2.9]], step_s=0.2)]
    demo = [{"n": n, "dense": 3.125e6, "zen_dgc5": 0.3125e6} for n in (8, 16)]
    big = [{"n": n, "dense": 31.25e6, "zen_dgc5": 3.125e6} for n in (8, 16)]
    text = peers_time.report(dense + zen, demo, big, {"zen_dgc5": 2.0})
    row = next(line for line in text.splitlines() if line.startswith("| ddp_zen_dgc5"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # 8 hosts × 250 Mbit/s = 31.25 MB/s: zen 0.2 + 2·0.3125e6/31.25e6 = 0.22 s; dense 0.1 + 0.1 = 0.2 s.
    # Steps to 3.03: zen 100, dense 194: time × dense = 100·0.22 / (197·0.2).
    assert cells[2] == "0.220"
    assert cells[3] == f"**{100 * 0.22 / (194 * 0.2):.2f}×**"
    assert cells[4] == "0.10" and cells[5] == f"**{100 * 0.1 / (194 * 1.0):.3f}×**"


def test_time_model_lab_columns_use_measured_step_ratio():
    dense = [_result("ddp_dense", 0, [[100, 3.5], [200, 3.0]], step_s=0.1)]
    zen = [_result("ddp_zen_dgc5", 0, [[100, 3.0], [200, 2.9]], step_s=0.2)]
    demo = [{"n": n, "dense": 3.125e6, "zen_dgc5": 0.3125e6} for n in (8, 16)]
    big = [{"n": n, "dense": 31.25e6, "zen_dgc5": 3.125e6} for n in (8, 16)]
    lab = {"8 hosts × 250 Mbit/s": {"dense": 2.0, "zen_dgc5": 0.5}, "16 hosts × 100 Mbit/s": {"dense": 4.0}}
    text = peers_time.report(dense + zen, demo, big, {"zen_dgc5": 2.0}, lab)
    cells = [c.strip() for c in next(x for x in text.splitlines() if x.startswith("| ddp_zen_dgc5")).strip("|").split("|")]
    # The modelled cells keep their places; the lab ones follow: steps 100 vs dense's 194, step 0.5 s vs 2.0 s.
    assert cells[2] == "0.220" and len(cells) == 14
    assert cells[10:] == ["0.500", f"**{100 * 0.5 / (194 * 2.0):.2f}×**", "–", "no lab measurement"]


def test_lab_section_reads_quality_and_modelled_tables(tmp_path):
    md = "\n".join([
        "| variant | e1 | e2 | e3 | gap | reaches | bytes | step |",
        "| ddp_dense (5 seeds) | 1 | 1 | 1 | +0 % | 5/5; 100 | 1 KiB | 0.1 |",
        "| ddp_zen_dgc5 (5 seeds) | 1 | 1 | 1 | +0 % | 5/5; 90 | 1 KiB | 0.1 |",
        "| powersgd_r1 (3 seeds) | 1 | 1 | 1 | +9 % | 0/3 | 1 KiB | 0.1 |",
        "| zen_outer_d25_4bit (5 seeds) | 1 | 1 | 1 | +1 % | 3/5; 180 | 1 KiB | 0.1 |",
        "| ddp_dense (3 seeds) | 1 | 1 | 1 | +0 % | 3/3; 500 | 1 KiB | 0.1 |",  # a later (scratch) table: ignored
        "| ddp_dense | 5/5 | 0.1 | **1.00×** | 1 | **1.000×** | 0.2 | **1.00×** | 2 | **1.000×** |",
        "| ddp_zen_dgc5 | 5/5 | 0.1 | **0.80×** | 1 | **0.238×** | 0.2 | **0.64×** | 2 | **0.345×** |",
        "| powersgd_r1 | 0/3 | 0.1 | not reached | 1 | not reached | 0.2 | not reached | 2 | not reached |"])
    lab = {"8 hosts × 250 Mbit/s": {"dense": 2.0, "zen_dgc5": 1.0, "powersgd_r1": 0.5},
           "16 hosts × 100 Mbit/s": {"dense": 4.0, "zen_dgc5": 3.0}}
    rows = {r.split(" |")[0].strip("| "): [c.strip() for c in r.strip("|").split("|")]
            for r in peers_time.lab_section(md, lab).splitlines()[2:]}
    assert rows["ddp_zen_dgc5"][1:] == ["5/5; 90", "1.000 (0.50×)", "**0.45×**", "**0.80×**", "**0.238×**",
                                        "3.000 (0.75×)", "**0.68×**", "**0.64×**", "**0.345×**"]
    assert rows["powersgd_r1"][2:4] == ["0.500 (0.25×)", "not reached in the run"]
    assert rows["powersgd_r1"][6:8] == ["–", "no lab measurement"]
    # a row with a lab method but no modelled row (zen.outer): the measured columns, the modelled ones said absent
    lab["8 hosts × 250 Mbit/s"]["zen_outer_d25_4bit"] = 0.4
    rows = {r.split(" |")[0].strip("| "): [c.strip() for c in r.strip("|").split("|")]
            for r in peers_time.lab_section(md, lab).splitlines()[2:]}
    assert rows["zen_outer_d25_4bit"][1:] == ["3/5; 180", "0.400 (0.20×)", "**0.36×**", "not modelled", "not modelled",
                                              "–", "no lab measurement", "not modelled", "not modelled"]


def test_reachable_address_is_localhost_on_one_machine(monkeypatch):
    from peers_ddp import reachable_address

    for master in ("127.0.0.1", "localhost"):
        monkeypatch.setenv("MASTER_ADDR", master)
        assert reachable_address() == "localhost"
    monkeypatch.delenv("MASTER_ADDR")
    assert reachable_address() == "localhost"


def test_zen_outer_variants_are_the_outer_harness_settings():
    from bench_outer_quality import VARIANTS

    from peers_ddp import zen_outer_config
    from recipes.common import ConfigError
    from zen_ext.config import ZenConfig

    # bench_peers' rows name the outer harness's variants; H: the variant's own, else --sync_every, else 15.
    for row, (name, h) in {"zen_outer_diloco": ("diloco", 15), "zen_outer_d25_4bit": ("outer_d25_4bit", 15),
                           "zen_outer_d25_h5_4bit": ("outer_d25_h5_4bit", 5),
                           "zen_outer_d25_4bit_delay1": ("outer_d25_4bit_delay1", 15),
                           "zen_outer_d25_4bit_h50": ("outer_d25_4bit", 50)}.items():
        argv = bench_peers.VARIANTS[row]
        assert argv[argv.index("--zen_outer") + 1] == name
        sync = int(argv[argv.index("--sync_every") + 1]) if "--sync_every" in argv else None
        cfg = ZenConfig.from_dict(zen_outer_config(name, sync))
        assert cfg.scheme == "zen" and cfg.outer.enabled and cfg.outer.every == h
        for key, value in VARIANTS[name].items():
            assert getattr(cfg.outer, key) == value, (row, key)
    diloco = ZenConfig.from_dict(zen_outer_config("diloco", 15)).outer
    assert (diloco.density, diloco.lr, diloco.momentum, diloco.nesterov, diloco.average) == (1.0, 0.7, 0.9, True, "mean")
    d25 = ZenConfig.from_dict(zen_outer_config("outer_d25_4bit", 15)).outer
    assert (d25.density, d25.value_bits, d25.lr, d25.momentum, d25.error_decay) == (0.25, 4, 1.0, 0.0, 0.95)
    assert ZenConfig.from_dict(zen_outer_config("outer_d25_4bit", None)).outer.every == 15
    for bad in ("dense", "nope", None):
        with pytest.raises(ConfigError, match="--zen_outer"):
            zen_outer_config(bad, 15)
