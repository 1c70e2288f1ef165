"""The demo's own output: the side-by-side table, the plot, the at-scale prediction, the log filter."""

from __future__ import annotations

import json
import os

import pytest

from zen_ext import demo
from zen_ext.analysis.at_scale import format_predictions, predict_at_scale

RECORD = {"numel": {"dense": 320, "natural": 65536, "dgc": 147456}, "nnz": {"dense": 320, "natural": 23616, "dgc": 7274}}


def _run(losses, evals, tps, sent, dense, wall, step_s=1.0, startup_s=1.0):
    recs = [{"step": i + 1, "loss": v, "tokens_per_s": t, "step_s": step_s}
            for i, (v, t) in enumerate(zip(losses, tps))]
    return {"losses": losses, "eval": evals, "final": {"bytes_sent": sent, "dense_bytes": dense}, "records": recs,
            "wall_s": wall, "startup_s": startup_s, "nproc": 2}


def _row(text, label):
    """The cells of the comparison table's row ``label``, split on runs of two spaces."""
    line = next(x for x in text.split("\n") if x.strip().startswith(label))
    return [c.strip() for c in line[len(line) - len(line.lstrip()) + len(label):].split("  ") if c.strip()]


def test_comparison_table_has_both_runs_and_the_gaps(tmp_path):
    # ZEN's run took 60 s, 35 of them start-up (the first DeepSpeed run compiles its shm op), its loop 2 x 10 s;
    # dense's 30 s, 5 s start-up, its loop 2 x 10.5 s: the table compares the loops, not the wall times.
    zen = {**_run([7.0, 4.2], [[2, 4.4]], [100.0, 300.0], 50 * 2**20, 100 * 2**20, 60.0, 10.0, 35.0), "sync_s": 12.5}
    dense = _run([7.0, 4.0], [[2, 4.0]], [200.0, 200.0], 0, 0, 30.0, 10.5, 5.0)
    text = demo.compare(zen, dense)
    assert "final eval loss" in text and "4.4000" in text and "4.0000" in text and "+10.0%" in text
    assert "50.0 MiB" in text and "100.0 MiB" in text and "50.0% of dense" in text
    assert "12.5 s" in text
    assert _row(text, "training loop (sum of step times)") == ["20.0 s", "21.0 s", "0.95x"]
    assert _row(text, "start-up (launch to first step)") == ["35 s", "5 s"]
    assert _row(text, "evaluation, checkpoints, exit") == ["5 s", "4 s"]
    assert "wall time" not in text  # the whole run's time is not set side by side (docs/demo.md)
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    assert demo.plot_both(zen, dense, str(png)) and png.stat().st_size > 1000


def test_split_times_parts_add_up_to_the_wall_time():
    run = _run([7.0] * 4, [], [1.0] * 4, 1, 2, 50.0, 2.5, 30.0)
    assert demo.split_times(run) == {"startup_s": 30.0, "loop_s": 10.0, "other_s": 10.0}
    assert demo._times_text(run).startswith("training loop 10 s (4 steps), start-up 30 s (")
    # No start line seen (a run that failed before training, or a recipe that changed its line): NaN, said so.
    t = demo.split_times({**run, "startup_s": float("nan")})
    assert t["loop_s"] == 10.0 and t["startup_s"] != t["startup_s"]


def test_the_start_line_is_the_recipe_s():
    """The demo ends a run's start-up when the recipe's start line arrives: the recipe must print it."""
    from recipes import finetune_llm

    src = open(finetune_llm.__file__).read()
    assert f'print(f"{demo.START_LINE}' in src
    assert '"step_s": step_s' in src


def test_at_scale_prediction_is_labelled_and_picks_the_cheapest():
    preds = predict_at_scale(RECORD, row_width=64, tokens_per_rank=1024, hosts=(8,), gbps=(1.0,))
    assert [p.slice for p in preds] == ["natural", "dgc"]
    for p in preds:
        assert p.choice_s <= p.dense_s and p.hosts == 8
    text = format_predictions(preds)
    assert text.startswith("Model prediction, not a measurement") and "docs/benchmarks.md" in text


def test_at_scale_ranks_what_auto_ranks(monkeypatch):
    """The table says what ``auto`` would pick, so it ranks auto's candidates only: a lossy scheme whose
    model claims no cost at all (SparDL here) is never its choice, and every candidate is predicted."""
    from zen_ext.core.cost import Traffic
    from zen_ext.core.registry import scheme_class
    from zen_ext.planner.auto import AutoScheme

    spardl = scheme_class("spardl")
    monkeypatch.setattr(spardl, "predict_traffic", staticmethod(lambda p, o: Traffic(p.n)))
    monkeypatch.setattr(spardl, "predict_work", staticmethod(lambda w, o: {}))
    preds = predict_at_scale(RECORD, row_width=64, tokens_per_rank=1024, hosts=(16,), gbps=(1.0,))
    assert len(preds) == 2
    for p in preds:
        assert list(p.predicted_s) == AutoScheme.valid_candidates()
        assert "spardl" not in p.predicted_s and p.choice != "spardl"
        assert p.choice_s == min(p.predicted_s.values()) and p.dense_s == p.predicted_s["dense"]


def test_harmless_launcher_lines_are_the_known_ones():
    for line in ("[2026-11-26 05:37:17,404] [INFO] [launch.py:174:main] Setting CUDA_VISIBLE_DEVICES=0,1",
                 "[WARNING] [runner.py:232:main] Unable to find hostfile, will proceed with training",
                 "[WARNING] [engine.py:2304:_do_optimizer_sanity_check] **** You are using ZeRO with an untested "
                 "optimizer, proceed with caution *****"):
        assert any(h in line for h in demo.HARMLESS)
    for line in ("zen_ext: ZEN on DeepSpeed ZeRO-1 (dp=2 ...)", "ZEN gradient synchronization summary (2 ranks"):
        assert not any(h in line for h in demo.HARMLESS)


def test_at_scale_reads_the_last_stats_record(tmp_path):
    (tmp_path / "zen_stats.jsonl").write_text(json.dumps({**RECORD, "step": 1}) + "\n")
    text = demo.at_scale(str(tmp_path))
    assert text is not None and "DGC tensors (top-k)" in text
    assert demo.at_scale(os.path.join(str(tmp_path), "nowhere")) is None


def _block(path: str, name: str) -> str:
    """The fenced block after ``<!-- snippet: NAME (output) -->`` in ``path`` (repo-relative)."""
    text = open(os.path.join(demo.ROOT, path)).read()
    start = text.index(f"<!-- snippet: {name} (output) -->")
    return text[start:text.index("```", text.index("```", start) + 3)]


def test_demo_doc_sample_has_the_demo_s_own_lines_in_order():
    """docs/demo.md's sample output shows what demo.main prints today, in the order it prints it."""
    block = _block("docs/demo.md", "demo-output")
    marks = ["ZEN gradient synchronization summary (", "  train loss:", "ZEN run finished in ", "eval loss: step ",
             "[2/2] Model prediction, not a measurement", "Demo finished in "]
    at = [block.find(m) for m in marks]
    assert all(i >= 0 for i in at) and at == sorted(at), dict(zip(marks, at))
    src = open(demo.__file__).read()
    for m in ("ZEN run finished in ", "eval loss: ", "Demo finished in "):
        assert m in src


def test_readme_excerpt_is_lines_of_the_demo_doc_sample():
    """The README's short excerpt copies its lines from docs/demo.md's full sample, so the numbers agree."""
    full = _block("docs/demo.md", "demo-output").split("\n")
    excerpt = [line for line in _block("README.md", "demo-summary").split("\n")[2:] if line.strip()]
    assert excerpt[0].startswith("ZEN gradient synchronization summary (") and len(excerpt) >= 8, excerpt
    assert [line for line in excerpt if line not in full] == []


def test_steps_to_reach_interpolates_between_eval_points():
    evals = [[50, 5.0], [100, 4.0], [150, 3.5], [200, 3.0]]
    assert demo.steps_to_reach(evals, 4.0) == 100
    assert demo.steps_to_reach(evals, 3.75) == 125
    assert demo.steps_to_reach(evals, 2.0) is None
    zen = _run([7.0] * 200, [[200, 3.75]], [1.0] * 200, 1, 2, 1.0)
    dense = _run([7.0] * 200, evals, [1.0] * 200, 1, 2, 1.0)
    assert "dense gets there at step ~125 of 200" in demo.compare(zen, dense) and "~1.60x the steps" in demo.compare(zen, dense)


def test_the_zen_run_trains_with_the_recipes_default_optimizer_unless_told(tmp_path):
    """The recipe's default (CatchUpAdamW for DGC under Adam/AdamW, the demo's config), the config's
    optimizer with --plain_adam."""
    from recipes import finetune_llm

    assert demo._optimizer_args(demo.parse_args([])) == ()
    assert demo._optimizer_args(demo.parse_args(["--plain_adam"])) == ("--plain_adam",)
    base = ["--deepspeed_config", os.path.join(demo.ROOT, "configs", "demo_ds.json"), "--output_dir", str(tmp_path)]
    for extra, kind in (((), "catch_up"), (("--plain_adam",), "config")):
        args = finetune_llm.parse_args([*base, *extra])
        assert finetune_llm.optimizer_choice(args, finetune_llm.load_ds_config(args))[0] == kind
