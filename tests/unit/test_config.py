"""The "zen" config section: defaults, round-trips, and the exact text of every kind of error."""

import json
import os

import pytest

from zen_ext.config import PlannerConfig, StatsConfig, ZenConfig, config_reference_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_match_the_documented_ones():
    c = ZenConfig()
    assert (c.enabled, c.scheme, c.seed, c.pull_format, c.exchange_impl, c.bucket_cap_mb, c.hierarchical) == (
        True, "zen", 0, "auto", "p2p", 128.0, "auto")
    assert (c.dgc.enabled, c.dgc.density, c.dgc.selection, c.dgc.threshold, c.dgc.sample_fraction) == (
        False, 0.05, "per_tensor", "sampled", 0.01)
    assert (c.dgc.momentum, c.dgc.momentum_correction, c.dgc.momentum_masking, c.dgc.clip_norm) == (
        0.9, None, True, None)
    assert (c.dgc.warmup_steps, c.dgc.warmup_start_density, c.dgc.min_numel) == (0, 0.25, 1024)
    assert (c.natural.enabled, c.natural.row_granularity) == (True, True)
    assert (c.planner.bandwidth_gbps, c.planner.latency_us, c.planner.profile_steps, c.planner.reprofile_every) == (
        10.0, 50.0, 3, 1000)
    assert (c.stats.jsonl_path, c.stats.summary) == (None, True)
    assert c.bucket_cap_bytes == 128 * 2**20


def test_round_trip_and_nested_values():
    section = {"scheme": "zen", "seed": 7, "bucket_cap_mb": 64, "hierarchical": False,
               "dgc": {"enabled": True, "density": 0.01, "warmup_steps": 10},
               "natural": {"row_granularity": False}, "stats": {"jsonl_path": "/tmp/x.jsonl"}}
    c = ZenConfig.from_dict(section)
    assert c.dgc.density == 0.01 and c.dgc.warmup_steps == 10 and c.natural.row_granularity is False
    assert c.hierarchical is False and c.bucket_cap_mb == 64 and c.stats.jsonl_path == "/tmp/x.jsonl"
    again = ZenConfig.from_dict(json.loads(json.dumps(c.to_dict())))
    assert again == c


def test_sections_build_what_the_engine_needs():
    c = ZenConfig.from_dict({"seed": 3, "pull_format": "bitmap", "dgc": {"enabled": True}})
    assert c.scheme_options() == {"seed": 3, "pull_format": "bitmap"}
    assert c.build_scheme().options()["seed"] == 3
    assert c.dgc_options() is c.dgc and c.natural_options() is c.natural
    off = ZenConfig.from_dict({"natural": {"enabled": False}})
    assert off.dgc_options() is None and off.natural_options() is None
    # Schemes without a seed or pull format do not receive them.
    assert ZenConfig.from_dict({"scheme": "dense"}).scheme_options() == {}


def test_from_ds_config_reads_path_and_dict(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 1, "zen": {"dgc": {"enabled": True, "density": 0.02}}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    assert ZenConfig.from_ds_config(str(p)).dgc.density == 0.02
    assert ZenConfig.from_ds_config(ds).dgc.density == 0.02
    assert ZenConfig.from_ds_config({"train_micro_batch_size_per_gpu": 1}).enabled is False


@pytest.mark.parametrize("section, exc, text", [
    ({"sceme": "zen"}, ValueError,
     "zen got unknown key(s) ['sceme']; valid keys are ['bucket_cap_mb', 'dgc', 'enabled', 'exchange_impl', "
     "'hierarchical', 'natural', 'planner', 'pull_format', 'scheme', 'seed', 'stats']"),
    ({"dgc": {"densty": 0.1}}, ValueError,
     "zen.dgc got unknown key(s) ['densty']; valid keys are ['clip_norm', 'density', 'enabled', 'min_numel', "
     "'momentum', 'momentum_correction', 'momentum_masking', 'sample_fraction', 'selection', 'threshold', "
     "'warmup_start_density', 'warmup_steps']"),
    ({"planner": {"bandwith_gbps": 1}}, ValueError,
     "zen.planner got unknown key(s) ['bandwith_gbps']; valid keys are ['bandwidth_gbps', 'latency_us', "
     "'profile_steps', 'reprofile_every']"),
    ({"stats": {"path": "x"}}, ValueError,
     "zen.stats got unknown key(s) ['path']; valid keys are ['jsonl_path', 'summary']"),
    ({"enabled": 1}, TypeError, "zen.enabled (1) must be a bool (true or false)"),
    ({"seed": 1.5}, TypeError, "zen.seed (1.5) must be an integer"),
    ({"seed": True}, TypeError, "zen.seed (True) must be an integer"),
    ({"bucket_cap_mb": "128"}, TypeError, "zen.bucket_cap_mb ('128') must be a number"),
    ({"scheme": 3}, TypeError, "zen.scheme (3) must be a string"),
    ({"hierarchical": 1}, TypeError, 'zen.hierarchical (1) must be true, false or "auto"'),
    ({"dgc": 5}, TypeError, "zen.dgc (5) must be a JSON object (dict)"),
    ({"dgc": {"density": "0.05"}}, TypeError, "zen.dgc.density ('0.05') must be a number"),
    ({"natural": {"enabled": "yes"}}, TypeError, "zen.natural.enabled ('yes') must be a bool"),
    ({"planner": {"profile_steps": 2.0}}, TypeError, "zen.planner.profile_steps (2.0) must be an integer"),
    ({"stats": {"jsonl_path": 3}}, TypeError, "zen.stats.jsonl_path (3) must be a string"),
    ({"seed": -1}, ValueError, "zen.seed (-1) must be >= 0"),
    ({"pull_format": "csr"}, ValueError, "zen.pull_format ('csr') must be one of ['auto', 'coo', 'bitmap', 'dense']"),
    ({"exchange_impl": "mpi"}, ValueError, "zen.exchange_impl ('mpi') must be one of ['p2p', 'a2a']"),
    ({"bucket_cap_mb": 0}, ValueError, "zen.bucket_cap_mb (0) must be > 0"),
    ({"hierarchical": "yes"}, ValueError, 'zen.hierarchical (\'yes\') must be true, false or "auto"'),
    ({"dgc": {"density": 0}}, ValueError, "zen.dgc.density (0) must be in (0, 1]"),
    ({"dgc": {"density": 1.5}}, ValueError, "zen.dgc.density (1.5) must be in (0, 1]"),
    ({"dgc": {"momentum": 1.0}}, ValueError, "zen.dgc.momentum (1.0) must be in [0, 1)"),
    ({"dgc": {"selection": "global"}}, ValueError,
     "zen.dgc.selection ('global') must be one of ['per_tensor', 'per_bucket']"),
    ({"planner": {"bandwidth_gbps": 0}}, ValueError, "zen.planner.bandwidth_gbps (0) must be > 0"),
    ({"planner": {"latency_us": -1}}, ValueError, "zen.planner.latency_us (-1) must be >= 0"),
    ({"planner": {"profile_steps": 0}}, ValueError, "zen.planner.profile_steps (0) must be >= 1"),
    ({"planner": {"reprofile_every": -5}}, ValueError, "zen.planner.reprofile_every (-5) must be >= 0 (0: never)"),
    ({"stats": {"jsonl_path": ""}}, ValueError, "zen.stats.jsonl_path ('') must be a non-empty path or null"),
])
def test_error_text(section, exc, text):
    with pytest.raises(exc) as info:
        ZenConfig.from_dict(section)
    assert str(info.value) == text


def test_unknown_scheme_lists_the_registered_ones():
    from zen_ext.core import available_schemes

    with pytest.raises(ValueError) as info:
        ZenConfig.from_dict({"scheme": "zenn"})
    assert str(info.value) == f"zen.scheme ('zenn') must be one of {available_schemes()}"


def test_sections_validate_when_built_directly():
    with pytest.raises(ValueError, match=r"^zen.planner.bandwidth_gbps \(-1\) must be > 0$"):
        PlannerConfig(bandwidth_gbps=-1)
    with pytest.raises(TypeError, match=r"^zen.stats.summary \('no'\) must be a bool"):
        StatsConfig(summary="no")
    with pytest.raises(TypeError, match=r"^zen.planner \(3\) must be a PlannerConfig or a JSON object$"):
        ZenConfig(planner=3)


@pytest.mark.parametrize("ds, text", [
    ({"zero_optimization": {"stage": 3}},
     "zen supports zero_optimization.stage in [0, 1, 2] (with optional AutoTP tensor parallelism), got stage 3: "
     "ZeRO-3 reduce-scatters partitioned gradients, so there is no full gradient bucket to synchronize sparsely; "
     "use stage 1 or 2, or remove \"zen\""),
    ({"pipeline": {"stages": 2}},
     "zen supports data parallelism and AutoTP tensor + data parallelism, not pipeline parallelism "
     "(pipeline.stages = 2); remove \"zen\" or run without pipeline stages"),
    ({"sequence_parallel_size": 2},
     "zen supports data parallelism and AutoTP tensor + data parallelism, not sequence parallelism "
     "(sequence_parallel_size = 2)"),
])
def test_incompatible_engine_settings(ds, text):
    with pytest.raises(NotImplementedError) as info:
        ZenConfig.from_ds_config({**ds, "zen": {}})
    assert str(info.value) == text
    # A disabled section does not refuse anything: DeepSpeed runs as usual.
    assert ZenConfig.from_ds_config({**ds, "zen": {"enabled": False}}).enabled is False


def test_every_shipped_config_validates():
    # The DeepSpeed configs (colossalai_*.json belong to the ColossalAI recipe and its own schema).
    configs = [os.path.join(ROOT, "configs", f) for f in sorted(os.listdir(os.path.join(ROOT, "configs")))
               if f.endswith(".json") and not f.startswith("colossalai_")]
    assert configs
    for path in configs:
        with open(path) as f:
            ds = json.load(f)
        cfg = ZenConfig.from_ds_config(ds)
        assert cfg.enabled == ("zen" in ds and ds["zen"].get("enabled", True)), path


def test_docs_hold_the_generated_reference():
    """README.md and docs/deepspeed.md embed ``python -m zen_ext.config``'s tables: regenerate on change."""
    for path in (("docs", "deepspeed.md"), ("README.md",)):
        with open(os.path.join(ROOT, *path)) as f:
            assert config_reference_markdown() in f.read(), f"{os.path.join(*path)} lacks the current reference"
