"""``benchmarks/quality/bench_quality.py``'s arithmetic: configs per variant (``quality_variants.py``), steps to a loss
and the paired report (``quality_report.py``, ``quality_bytes.py``), the runs' launch and cache (``quality_runs.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

import quality_report as qrep  # noqa: E402
import quality_runs as qruns  # noqa: E402
import quality_variants as qv  # noqa: E402


def test_variant_configs():
    dense = qv.ds_config("dense")
    assert "zen" not in dense and dense["optimizer"]["params"]["lr"] == 0.003
    assert qv.ds_config("dense_lr2x")["optimizer"]["params"]["lr"] == 0.006
    assert qv.ds_config("dense_lr2x")["scheduler"]["params"]["warmup_max_lr"] == 0.006
    dgc1 = qv.ds_config("dgc1")
    assert dgc1["zen"]["dgc"]["density"] == 0.01 and dgc1["zen"]["dgc"]["enabled"]
    # The benchmark's own keys never reach the zen section.
    catch_up = qv.ds_config("dgc5_catchup_flush20")
    assert catch_up["zen"]["dgc"]["flush_fraction"] == 0.2 and not any(k.startswith("_") for k in catch_up["zen"]["dgc"])
    assert qv.ds_config("dgc5_b2_999")["optimizer"]["params"]["betas"][1] == 0.999
    assert not qv.ds_config("natural")["zen"]["dgc"]["enabled"]
    # The cosine variants decay over the run's own steps; without them the config cannot be built.
    cosine = qv.ds_config("dgc5_cosine", 300)["scheduler"]
    assert cosine["type"] == "WarmupCosineLR" and cosine["params"]["total_num_steps"] == 300
    assert cosine["params"]["cos_min_ratio"] == 0.1 and cosine["params"]["warmup_num_steps"] == 10
    assert qv.ds_config("dense_cosine", 200)["scheduler"]["params"]["total_num_steps"] == 200
    with pytest.raises(ValueError, match="needs its steps"):
        qv.ds_config("dgc5_cosine")


def test_steps_to_interpolates_between_evaluations():
    evals = [[25, 5.0], [50, 4.0], [75, 3.0]]
    assert qrep.steps_to(evals, 5.0) == 25.0
    assert qrep.steps_to(evals, 3.5) == pytest.approx(62.5)
    assert qrep.steps_to(evals, 2.9) is None


def _run(setting, variant, seed, evals):
    return {"setting": setting, "variant": variant, "seed": seed, "steps": evals[-1][0], "eval": evals,
            "losses": [], "wall_s": 1.0}


def test_report_pairs_by_seed_and_marks_divergence():
    dense = [_run("scratch", "dense", s, [[50, 4.0 + s], [100, 3.0 + s], [200, 2.0 + s]]) for s in (0, 1)]
    # Twice as many steps as dense to every loss, on each seed.
    slow = [_run("scratch", "dgc5", s, [[50, 5.0 + s], [100, 4.0 + s], [200, 3.0 + s]]) for s in (0, 1)]
    blown = [_run("scratch", "dgc1", 0, [[50, 4.0], [100, 3.5], [200, 900.0]])]
    step_s = {(4, "1gbit"): {"dense": 2.0, "zen_dgc5": 1.0}}
    text = qrep.report(dense + slow + blown, step_s, None)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    # dense against itself: no gap, 1x steps and time; the paired gap uses each seed's own dense.
    assert rows["dense"][3].startswith("+0.00") and rows["dense"][5].startswith("1.00") and "1.00" in rows["dense"][6]
    assert rows["dgc5"][3] == f"{qrep.fmt_range([50.0, 100 / 3], '+.2f')} %"
    assert rows["dgc5"][5].startswith("2.00")  # dense reaches 3.0 (seed 0) at step 100, dgc5 at 200
    assert rows["dgc5"][6] == "**1.00 [1.00–1.00]×**"  # 2x the steps at half the step time
    assert "1 diverged" in rows["dgc1 (1 seed)"][5] and rows["dgc1 (1 seed)"][6] == "–"


def test_a_run_that_regresses_from_an_early_best_has_no_equal_loss_point():
    dense = [_run("finetune", "dense", 0, [[50, 3.6], [100, 3.4], [200, 3.3]])]
    # Best at its first evaluation, 14 % worse at the end: not "as fast as dense to its best loss".
    worse = [_run("finetune", "dgc1", 0, [[50, 4.09], [100, 4.46], [200, 4.67]])]
    kept = [_run("finetune", "dgc5", 0, [[50, 3.7], [100, 3.45], [200, 3.46]])]  # 0.3 % above its best
    text = qrep.report(dense + worse + kept, {(4, "1gbit"): {"dense": 1.0, "zen_dgc5": 1.0}}, None)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert "1 diverged" in rows["dgc1"][5] and rows["dgc1"][6] == "–"
    assert "diverged" not in rows["dgc5"][5] and rows["dgc5"][6] != "–"


def test_a_schedule_variant_is_measured_against_dense_on_the_same_schedule():
    assert qv.baseline_of("dgc5") == "dense" and qv.baseline_of("dgc5_b2_999") == "dense"
    assert qv.baseline_of("dgc5_cosine") == "dense_cosine" and qv.baseline_of("dgc1_cosine0") == "dense_cosine0"
    dense = [_run("finetune", "dense", 0, [[100, 3.4], [200, 3.3]])]
    cosine = [_run("finetune", "dense_cosine", 0, [[100, 3.3], [200, 3.0]])]
    dgc = [_run("finetune", "dgc5_cosine", 0, [[100, 3.4], [200, 3.03]])]
    text = qrep.report(dense + cosine + dgc, {(4, "1gbit"): {"dense": 1.0, "zen_dgc5": 1.0}}, None)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    # +1 % against dense_cosine's 3.0, not −8.2 % against constant-rate dense's 3.3.
    assert rows["dgc5_cosine (against dense_cosine)"][2] == f"{qrep.fmt_range([1.0], '+.2f')} %"
    assert rows["dense_cosine"][2].startswith("+0.00")


def test_zero3_variants_shard_and_pair_with_dense_zero3():
    dense3, dgc3 = qv.ds_config("dense_zero3"), qv.ds_config("dgc5_project_defaults_zero3")
    assert dense3["zero_optimization"]["stage"] == 3 and "zen" not in dense3
    assert dgc3["zero_optimization"]["stage"] == 3 and dgc3["zero_optimization"]["reduce_scatter"]
    assert dgc3["zen"]["scheme"] == "zen" and "planner" not in dgc3["zen"]
    # Everything but the ZeRO section and the scheme equals the ZeRO-1 variant of the same name.
    dgc1 = qv.ds_config("dgc5_project_defaults")
    assert dgc1["zero_optimization"] == {"stage": 1} and dgc3["zen"]["dgc"] == dgc1["zen"]["dgc"] == {
        "enabled": True, "density": 0.05}
    assert {k: v for k, v in dgc3.items() if k not in ("zero_optimization", "zen")} == {
        k: v for k, v in dgc1.items() if k not in ("zero_optimization", "zen")}
    assert qv.ds_config("dense")["zero_optimization"]["stage"] == 1  # the existing variants are unchanged
    assert qv.baseline_of("dgc5_project_defaults_zero3") == "dense_zero3"
    assert qv.baseline_of("dense_zero3") == "dense_zero3" and qv.baseline_of("dgc5_project_defaults") == "dense"


def test_node_variants_set_the_hierarchy_and_pair_with_dense_on_the_same_nodes(tmp_path, monkeypatch):
    flat, node, int4 = (qv.ds_config(v) for v in ("dgc5_zero3_2x2_flat", "dgc5_zero3_2x2_node",
                                                   "dgc5_zero3_2x2_node_int4"))
    assert (flat["zen"]["hierarchical"], node["zen"]["hierarchical"], int4["zen"]["hierarchical"]) == (
        False, True, True)
    assert node["zen"]["dgc"] == {"enabled": True, "density": 0.05} and int4["zen"]["dgc"] == {
        "enabled": True, "density": 0.05, "residual_dtype": "int4"}
    # Everything else is the 2-rank ZeRO-3 variant's; dense on 2 × 2 has no zen section.
    base = qv.ds_config("dgc5_project_defaults_zero3")
    assert {k: v for k, v in node.items() if k != "zen"} == {k: v for k, v in base.items() if k != "zen"}
    assert "zen" not in qv.ds_config("dense_zero3_2x2")
    for v in ("dgc5_zero3_2x2_flat", "dgc5_zero3_2x2_node", "dgc5_zero3_2x2_node_int4", "dense_zero3_2x2"):
        assert qv.baseline_of(v) == "dense_zero3_2x2"
    assert qv.baseline_of("dgc5_project_defaults_zero3") == "dense_zero3"
    # run_one launches them on 2 emulated nodes, and caches them apart from the 2-rank runs.
    nodes_seen = []

    def fake_launch(args_list, log_path, port=None, fsdp=False, nodes=0):
        nodes_seen.append(nodes)
        out = args_list[args_list.index("--output_dir") + 1]
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"eval": [[25, 3.5]], "losses": [3.6]}, f)
        open(os.path.join(out, "train_log.jsonl"), "w").close()
        return 1.0

    monkeypatch.setattr(qruns, "_launch", fake_launch)
    keys = [qruns.run_one(str(tmp_path), "scratch", v, 0, 25, 25, None, None)["key"]
            for v in ("dense_zero3_2x2", "dense_zero3")]
    assert nodes_seen == [2, 0] and keys[0] != keys[1]


def test_report_pairs_a_zero3_variant_with_dense_zero3_alone():
    # Only ZeRO-3 runs (no ZeRO-1 dense): the ZeRO-3 DGC row's gap is against dense_zero3 of its seed.
    dense3 = [_run("finetune", "dense_zero3", s, [[100, 3.5], [200, 3.0 + s]]) for s in (0, 1)]
    dgc3 = [_run("finetune", "dgc5_project_defaults_zero3", s, [[100, 3.6], [200, final]])
            for s, final in ((0, 3.03), (1, 4.12))]  # 1 % and 3 % above dense_zero3 of the seed
    text = qrep.report(dense3 + dgc3, {}, None)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert rows["dense_zero3"][2].startswith("+0.00")
    assert rows["dgc5_project_defaults_zero3 (against dense_zero3)"][2] == "+2.00 [+1.00–+3.00] %"


def test_spardl_variants_name_the_scheme_and_its_residual():
    """SparDL's variants are the project-defaults DGC variant with the scheme named (no planner section)
    and zen.spardl.residual set; their time columns stay empty (no cluster measurement of SparDL)."""
    base = qv.ds_config("dgc5_project_defaults")
    for residual in ("global", "local"):
        cfg = qv.ds_config(f"spardl5_{residual}")
        assert cfg["zen"]["scheme"] == "spardl" and cfg["zen"]["spardl"] == {"residual": residual}
        assert "planner" not in cfg["zen"] and cfg["zen"]["dgc"] == base["zen"]["dgc"]
        assert {k: v for k, v in cfg.items() if k != "zen"} == {k: v for k, v in base.items() if k != "zen"}
        assert qv.baseline_of(f"spardl5_{residual}") == "dense"
        assert qv.step_time_key(f"spardl5_{residual}") == "spardl"
    assert qv.ds_config("spardl1_local")["zen"]["dgc"]["density"] == 0.01
    assert base["zen"]["scheme"] == "auto" and "spardl" not in base["zen"]  # the DGC variant is unchanged
    from zen_ext.config import ZenConfig

    ZenConfig.from_dict(qv.ds_config("spardl5_global")["zen"])  # a valid zen section


def _bytes_run(variant, seed, evals, per_step_sent, dense_per_step=100):
    r = _run("finetune", variant, seed, evals)
    if per_step_sent is not None:
        r["bytes"] = [[s, s * per_step_sent, s * dense_per_step] for s in range(1, r["steps"] + 1)]
    return r


def test_equal_bytes_compares_where_each_run_has_sent_the_same():
    import quality_bytes as qb

    # dense sends 100 per step (taken from the zen runs' dense_bytes), "half" 50, "quarter" 25: the budget
    # is quarter's total (200 steps x 25 = 5,000), reached by dense at step 50 and by half at step 100.
    dense = _bytes_run("dense", 0, [[50, 4.0], [100, 3.0], [200, 2.0]], None)
    half = _bytes_run("dgc5_project_defaults", 0, [[50, 4.5], [100, 3.3], [200, 2.02]], 50)
    quarter = _bytes_run("spardl5_global", 0, [[50, 4.8], [100, 3.6], [200, 2.2]], 25)
    assert qb.dense_step_bytes([dense, half, quarter]) == 100
    text = qb.report([dense, half, quarter])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert "finetune, DGC 5%: at equal bytes (dense sends 0.1 KiB per rank per step)" in text
    assert rows["dense"][0].startswith("1.000") and rows["spardl5_global"][0].startswith("0.250")
    assert rows["dense"][2].startswith("50 ") and rows["dgc5_project_defaults"][2].startswith("100 ")
    assert rows["spardl5_global"][2].startswith("200 ")
    assert rows["dense"][3].startswith("4.0000") and rows["dgc5_project_defaults"][3].startswith("3.3000")
    assert rows["spardl5_global"][4] == f"{qrep.fmt_range([100 * (2.2 / 4.0 - 1)], '+.2f')} %"
    # dense + 1 % = 2.02: dense at step 198 (19,800 bytes), half at 200 (10,000), quarter never.
    assert rows["dgc5_project_defaults"][5].startswith(f"{10000 / 19800:.2f}")
    assert rows["spardl5_global"][5] == "– (0/1 seeds reach it)"
    # A run at another density gets its own table and budget (with dense in it), not the 5 % one's.
    tenth = _bytes_run("spardl1_global", 0, [[50, 4.9], [100, 3.9], [200, 2.5]], 10)
    both = qb.report([dense, half, quarter, tenth])
    five, one = both.split("### finetune, DGC 1%")
    assert "spardl1_global" not in five and "spardl5_global" not in one and "| dense |" in one
    assert five.strip() == text.strip()
    # dense of a seed no 1 % run has stays out of the 1 % table (its budget would be dense's own total)
    other = _bytes_run("dense", 1, [[50, 4.0], [100, 3.0], [200, 2.0]], None)
    assert qb.report([dense, other, half, quarter, tenth]).split("### finetune, DGC 1%")[1] == one


def test_interpolation_in_cumulative_bytes():
    import quality_bytes as qb

    curve = [(0.0, 0.0), (1.0, 10.0), (2.0, 30.0)]
    assert qb._interp(curve, 20.0, by=1) == 1.5 and qb._interp(curve, 1.5) == 20.0
    assert qb._interp(curve, 31.0, by=1) is None


def test_fsdp_variants_translate_the_zero3_settings_and_pair_with_dense_fsdp():
    import quality_fsdp

    dense, dgc, plain = (quality_fsdp.fsdp_config(qv.ds_config(v)) for v in (
        "dense_fsdp", "dgc5_project_defaults_fsdp", "dgc5_project_defaults_fsdp_plain_adam"))
    # The demo's DeepSpeed settings, key for key: AdamW, the clip, micro-batch, WarmupLR's 10 log steps.
    assert dense == {"fsdp": {"micro_batch": 8, "lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8,
                              "weight_decay": 0.01, "grad_clip": 1.0, "param_dtype": "fp32",
                              "warmup_steps": 10, "warmup_type": "log"}}
    # DGC's zen section is the ZeRO-3 variant's; the two DGC variants differ only in the recipe flag.
    assert dgc["zen"] == qv.ds_config("dgc5_project_defaults_zero3")["zen"] == plain["zen"]
    assert dgc["fsdp"] == plain["fsdp"] == dense["fsdp"]
    for v in ("dgc5_project_defaults_fsdp", "dgc5_project_defaults_fsdp_plain_adam", "dense_fsdp"):
        assert qv.baseline_of(v) == "dense_fsdp"
    assert qv.baseline_of("dgc5_project_defaults_zero3") == "dense_zero3"  # ZeRO-3 still pairs with ZeRO-3
    assert qv.step_time_key("dense_fsdp") == "dense" and qv.step_time_key("dgc5_project_defaults_fsdp") == "zen_dgc5"


def test_settings_the_fsdp_recipe_cannot_reproduce_are_refused():
    import quality_fsdp

    base = qv.ds_config("dense_fsdp")
    for change, rule in (({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type"),
                         ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
                         ({"bf16": {"enabled": True}}, "bf16.enabled"),
                         ({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, "scheduler.type"),
                         ({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4}}}, "warm up from 0")):
        with pytest.raises(ValueError, match=rule):
            quality_fsdp.fsdp_config({**base, **change})
    assert quality_fsdp.fsdp_config({k: v for k, v in base.items() if k != "scheduler"})["fsdp"]["warmup_steps"] == 0


def test_run_one_launches_the_fsdp_recipe_with_its_config_and_flags(tmp_path, monkeypatch):
    calls = []

    def fake_launch(args_list, log_path, port=None, fsdp=False, nodes=0):
        calls.append((args_list, fsdp))
        assert nodes == 0
        out = args_list[args_list.index("--output_dir") + 1]
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump({"eval": [[25, 3.5]], "losses": [3.6]}, f)
        open(os.path.join(out, "train_log.jsonl"), "w").close()
        return 1.0

    monkeypatch.setattr(qruns, "_launch", fake_launch)
    start = str(tmp_path / "pretrained")
    for variant in ("dense_fsdp", "dgc5_project_defaults_fsdp", "dgc5_project_defaults_fsdp_plain_adam", "dense"):
        qruns.run_one(str(tmp_path), "finetune", variant, 1, 25, 25, start, None)
    (dense, f1), (dgc, f2), (plain, f3), (ds, f4) = calls
    assert (f1, f2, f3, f4) == (True, True, True, False)
    # The same data, model start, seed and steps as the DeepSpeed run; only the optimizer flag differs.
    common = ["--data", "pydoc", "--steps", "25", "--eval_every", "25", "--seed", "1", "--model", start,
              "--tokenizer", start, "--data_part", "second"]
    for args in (dense, dgc, plain):
        assert args[0] == "--config" and args[1].endswith("fsdp_config.json")
        assert [a for a in args[4:] if a not in ("--plain_adam",)] == common
    assert "--plain_adam" not in dgc and "--plain_adam" in plain and ds[0] == "--deepspeed_config"
    with open(dgc[1]) as f:
        assert json.load(f)["zen"]["dgc"] == {"enabled": True, "density": 0.05}
    # A cached result is read back, not re-run.
    qruns.run_one(str(tmp_path), "finetune", "dense_fsdp", 1, 25, 25, start, None)
    assert len(calls) == 4


def test_value_bits_variants_pair_with_todays_dgc_of_the_same_path(tmp_path):
    import value_bits_report as vbr

    node_v4 = qv.ds_config("dgc5_zero3_2x2_node_v4")
    assert node_v4["zen"]["dgc"]["value_bits"] == 4 and node_v4["zen"]["hierarchical"] is True
    assert node_v4["zero_optimization"]["stage"] == 3
    assert qv.ds_config("dgc5_zero3_2x2_node_v4_noowner")["zen"]["dgc"]["owner_error_feedback"] is False
    assert qv.baseline_of("dgc5_zero3_2x2_node_v4") == "dense_zero3_2x2"  # the dense run of the same nodes
    # Today's DGC on the same path, not the first DGC variant of the name's prefix.
    assert vbr.baseline_of("dgc5_zero3_2x2_node_v4") == "dgc5_zero3_2x2_node"
    assert vbr.baseline_of("dgc5_zero3_2x2_node_v8") == "dgc5_zero3_2x2_node"
    assert vbr.baseline_of("dgc1_v4_noowner") == "dgc1" and vbr.baseline_of("dgc5_v8") == "dgc5"
    # The gap pairs by seed (seed 2 has no baseline: left out) and judges the median against the target.
    for variant, seed, last in [("dgc1", 0, 3.0), ("dgc1", 1, 3.0), ("dgc1_v4", 0, 3.003), ("dgc1_v4", 1, 3.009),
                                ("dgc1_v4", 2, 9.0), ("dgc1_v8", 0, 3.009)]:
        d = tmp_path / "scratch" / variant / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(_run("scratch", variant, seed, [[25, 4.0], [50, last]])))
    v4, v8 = vbr.gap_rows(str(tmp_path), ["scratch", "finetune"], ["dgc1_v4", "dgc1_v8"])
    assert "| dgc1_v4 | dgc1 | 2 (0, 1) | +0.200% [+0.100% – +0.300%] | +0.100% [+0.050% – +0.150%] |" in v4
    assert v4.endswith("| met (+0.200% ≤ 0.3%) | met (+0.100% ≤ 0.3%) |")
    assert "| 1 (0) | +0.300% [+0.300% – +0.300%]" in v8  # 8 bits: 0.1 %
    assert v8.endswith("| **not met** (+0.200% over) | **not met** (+0.050% over) |")
    (only,) = vbr.gap_rows(str(tmp_path), ["scratch"], ["dgc1_v4"], only=[1, 2])  # --seeds: seed 1 alone is paired
    assert "| dgc1_v4 | dgc1 | 1 (1) | +0.300% [+0.300% – +0.300%]" in only


def test_the_modules_depend_one_way():
    """Variants ← runs, report ← bytes ← the CLI: no module imports the CLI (``bench_quality.py``), so
    importing any one loads no cycle; the CLI imports them all."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import quality_variants, quality_runs, quality_report, quality_bytes; "
            "assert 'bench_quality' not in sys.modules, 'a module imports the CLI'; "
            "import bench_quality; print(sorted(m for m in sys.modules if m.startswith('quality_')))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "benchmarks", "quality")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() and "quality_bytes" in out.stdout and "quality_fsdp" in out.stdout


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_run_leaves_no_deepspeed_shm_buffer(monkeypatch, tmp_path):
    """DeepSpeed's CPU all-reduce leaves a /dev/shm buffer per rank named by the master port: each run removes
    its own (a failed one too), and only its own."""
    port, other = qruns.free_port(), qruns.free_port()
    mine = [f"/dev/shm/deepspeed_allreduce_buffer_{r}_127.0.0.1_{port}_0" for r in (0, 1)]
    theirs = f"/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_{other}_0"

    def fake_run(*_):
        for path in mine + [theirs]:
            open(path, "w").close()
        raise RuntimeError("run failed")

    monkeypatch.setattr(qruns, "_run_recipe", fake_run)
    try:
        with pytest.raises(RuntimeError, match="run failed"):
            qruns._launch(["--steps", "1"], str(tmp_path / "log.txt"), port)
        assert not any(os.path.exists(p) for p in mine) and os.path.exists(theirs)
    finally:
        for path in mine + [theirs]:
            if os.path.exists(path):
                os.unlink(path)
