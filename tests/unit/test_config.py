"""The "zen" config section: defaults, round-trips, and the exact text of every kind of error."""

import json
import os

import pytest

from zen_ext.config import PlannerConfig, StatsConfig, ZenConfig
from zen_ext.config_reference import reference_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_match_the_documented_ones():
    c = ZenConfig()
    assert (c.enabled, c.scheme, c.seed, c.pull_format, c.exchange_impl, c.bucket_cap_mb, c.hierarchical) == (
        True, "zen", 0, "auto", "p2p", 128.0, "auto")
    assert (c.dgc.enabled, c.dgc.density, c.dgc.selection, c.dgc.threshold, c.dgc.sample_fraction) == (
        False, 0.05, "per_tensor", "sampled", 0.01)
    assert (c.dgc.momentum, c.dgc.momentum_correction, c.dgc.momentum_masking, c.dgc.clip_norm) == (
        0.9, None, True, None)
    assert (c.dgc.warmup_steps, c.dgc.ramp_steps, c.dgc.warmup_start_density, c.dgc.min_numel) == (None, 0, 0.25, 1024)
    assert c.dgc.default_ramp_steps() == 100
    assert (c.natural.enabled, c.natural.row_granularity) == (True, True)
    assert (c.planner.bandwidth_gbps, c.planner.latency_us, c.planner.profile_steps, c.planner.reprofile_every) == (
        None, None, 3, 1000)  # null: measured at start
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
    assert c.sections() == {"natural": c.natural, "dgc": c.dgc} and c.section("dgc") is c.dgc
    off = ZenConfig.from_dict({"natural": {"enabled": False}})
    assert off.sections() == {} and off.sections_line() == "natural=off dgc=off"
    assert off.with_section("dgc", {"enabled": True}).dgc.enabled and not off.dgc.enabled  # a validated copy
    with pytest.raises(AttributeError, match="no attribute or sparsifier section 'dgcc'"):
        off.dgcc  # noqa: B018
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
     "zen got unknown key(s) ['sceme']; did you mean 'scheme' for 'sceme'? valid keys are ['async_sync', 'bucket_cap_mb', 'dgc', 'enabled', 'exchange_impl', "
     "'hierarchical', 'natural', 'outer', 'planner', 'pull_format', 'scheme', 'seed', 'spardl', 'stats']"),
    ({"dgc": {"densty": 0.1}}, ValueError,
     "zen.dgc got unknown key(s) ['densty']; did you mean 'density' for 'densty'? valid keys are ['clip_norm', 'dense_params', 'dense_steps', 'density', 'enabled', 'flush_fraction', 'int4_rounding', 'min_numel', "
     "'momentum', 'momentum_correction', 'momentum_masking', 'owner_error_feedback', 'residual_dtype', 'sample_fraction', 'selection', 'threshold', 'value_bits', "
     "'warmup_start_density', 'warmup_steps']"),
    ({"planner": {"bandwith_gbps": 1}}, ValueError,
     "zen.planner got unknown key(s) ['bandwith_gbps']; did you mean 'bandwidth_gbps' for 'bandwith_gbps'? valid keys are ['bandwidth_gbps', 'latency_us', "
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
    ({"bucket_cap_mb": 0}, ValueError, "zen.bucket_cap_mb (0) must be in (0, 1048576]"),
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
    ({"zero_optimization": {"stage": 4}}, "zen supports zero_optimization.stage in [0, 1, 2, 3], got stage 4"),
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
    # The DeepSpeed configs (colossalai_*.json and fsdp2_*.json belong to their recipes and schemas; the
    # FSDP2 ones' "zen" sections validate in tests/e2e/test_fsdp_recipe.py).
    configs = [os.path.join(ROOT, "configs", f) for f in sorted(os.listdir(os.path.join(ROOT, "configs")))
               if f.endswith(".json") and not f.startswith(("colossalai_", "fsdp2_"))]
    assert configs
    for path in configs:
        with open(path) as f:
            ds = json.load(f)
        cfg = ZenConfig.from_ds_config(ds)
        assert cfg.enabled == ("zen" in ds and ds["zen"].get("enabled", True)), path


def test_docs_hold_the_generated_reference():
    """docs/deepspeed.md embeds ``python -m zen_ext.config_reference``'s tables (regenerate on change); the README
    links to them rather than repeating them."""
    with open(os.path.join(ROOT, "docs", "deepspeed.md")) as f:
        assert reference_markdown() in f.read(), "docs/deepspeed.md lacks the current reference"
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "(docs/deepspeed.md#config-reference)" in f.read()


# --- values a JSON parser accepts that must not reach the engine ---------------------
@pytest.mark.parametrize("section, exc, text", [
    # Python's json module reads NaN, Infinity and -Infinity: every numeric field refuses them by name.
    ({"bucket_cap_mb": float("inf")}, ValueError, "zen.bucket_cap_mb (inf) must be a finite number"),
    ({"bucket_cap_mb": float("nan")}, ValueError, "zen.bucket_cap_mb (nan) must be a finite number"),
    ({"bucket_cap_mb": 1e308}, ValueError, "zen.bucket_cap_mb (1e+308) must be in (0, 1048576]"),
    ({"planner": {"bandwidth_gbps": float("inf")}}, ValueError,
     "zen.planner.bandwidth_gbps (inf) must be a finite number"),
    ({"planner": {"latency_us": float("inf")}}, ValueError, "zen.planner.latency_us (inf) must be a finite number"),
    ({"planner": {"latency_us": float("nan")}}, ValueError, "zen.planner.latency_us (nan) must be a finite number"),
    ({"dgc": {"density": float("nan")}}, ValueError, "zen.dgc.density (nan) must be a finite number"),
    ({"dgc": {"clip_norm": float("inf")}}, ValueError, "zen.dgc.clip_norm (inf) must be a finite number"),
    ({"dgc": {"momentum": float("-inf")}}, ValueError, "zen.dgc.momentum (-inf) must be a finite number"),
    ({"dgc": {"sample_fraction": float("nan")}}, ValueError,
     "zen.dgc.sample_fraction (nan) must be a finite number"),
    ({"dgc": {"warmup_start_density": float("inf")}}, ValueError,
     "zen.dgc.warmup_start_density (inf) must be a finite number"),
    ({"seed": float("inf")}, TypeError, "zen.seed (inf) must be an integer"),
    ({"planner": {"profile_steps": float("nan")}}, TypeError, "zen.planner.profile_steps (nan) must be an integer"),
    # Masking zeroes momentum that only momentum correction keeps: asking for both is a contradiction.
    ({"dgc": {"momentum_correction": False, "momentum_masking": True}}, ValueError,
     "zen.dgc.momentum_masking (True) must be false when zen.dgc.momentum_correction is false, because "
     "masking zeroes the momentum that only momentum correction keeps"),
])
def test_nonfinite_and_contradictory_values_name_the_field(section, exc, text):
    with pytest.raises(exc) as info:
        ZenConfig.from_dict(section)
    assert str(info.value) == text
    # The same text from a JSON file, whose parser produced the value.
    with pytest.raises(exc) as info:
        ZenConfig.from_ds_config(json.loads(json.dumps({"zen": section})))
    assert str(info.value) == text


def test_infinite_bucket_cap_from_json_text_is_refused_before_use():
    ds = json.loads('{"zen": {"bucket_cap_mb": Infinity}}')
    with pytest.raises(ValueError, match=r"^zen.bucket_cap_mb \(inf\) must be a finite number$"):
        ZenConfig.from_ds_config(ds)
    # The largest accepted cap still gives an integer byte count.
    assert ZenConfig.from_dict({"bucket_cap_mb": 2**20}).bucket_cap_bytes == 2**40


def test_momentum_masking_left_at_its_default_is_not_an_error():
    c = ZenConfig.from_dict({"dgc": {"enabled": True, "momentum_correction": False}})
    assert c.dgc.momentum_correction is False
    both_off = ZenConfig.from_dict({"dgc": {"momentum_correction": False, "momentum_masking": False}})
    assert both_off.dgc.momentum_masking is False


def test_direct_dgc_config_refuses_infinite_clip_norm():
    from zen_ext.compress import DGCConfig

    with pytest.raises(ValueError) as info:
        DGCConfig(clip_norm=float("inf"))
    assert str(info.value) == "zen.dgc.clip_norm (inf) must be a finite number or null (off)"


def test_null_zen_section_is_refused_with_both_meanings_spelled_out():
    text = ('zen (None) must be a JSON object (dict): write "zen": {} for the defaults, or '
            '"zen": {"enabled": false} (or no "zen" key) to keep the engine\'s all-reduce')
    with pytest.raises(TypeError) as info:
        ZenConfig.from_ds_config(json.loads('{"zen": null}'))
    assert str(info.value) == text
    with pytest.raises(TypeError) as info:  # what ColossalAIConfig.from_json calls for its "zen" key
        ZenConfig.from_json_section(None)
    assert str(info.value) == text
    # The Python API keeps None = defaults (register_zen_hook(model, None)).
    assert ZenConfig.from_dict(None) == ZenConfig()


STAGE_RULE = "must be an integer (one of [0, 1, 2, 3] with zen)"


@pytest.mark.parametrize("ds, text", [
    ({"zero_optimization": {"stage": "1"}}, f"zero_optimization.stage ('1') {STAGE_RULE}"),
    ({"zero_optimization": {"stage": 1.0}}, f"zero_optimization.stage (1.0) {STAGE_RULE}"),
    ({"zero_optimization": {"stage": True}}, f"zero_optimization.stage (True) {STAGE_RULE}"),
    ({"zero_optimization": 1}, "zero_optimization (1) must be a JSON object (dict)"),
    ({"pipeline": {"stages": "2"}}, "pipeline.stages ('2') must be an integer"),
    ({"sequence_parallel_size": "2"}, "sequence_parallel_size ('2') must be an integer"),
])
def test_engine_settings_of_the_wrong_type_name_the_field(ds, text):
    with pytest.raises(TypeError) as info:
        ZenConfig.from_ds_config({**ds, "zen": {}})
    assert str(info.value) == text

