"""The ColossalAI JSON config and the CPU patches, in one process: exact error texts, shipped configs."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

pytest.importorskip("colossalai")

from zen_ext.colossalai import ColossalAIConfig, apply_cpu_patches, check_plugin_kwargs  # noqa: E402
from zen_ext.config import ZenConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HYBRID = {"plugin": "hybrid_parallel", "plugin_kwargs": {"tp_size": 2, "precision": "fp32"}, "zen": {}}


def _hybrid(**kwargs) -> dict:
    return {**HYBRID, "plugin_kwargs": {**HYBRID["plugin_kwargs"], **kwargs}}


def _raises(exc, text: str, config: dict):
    with pytest.raises(exc) as info:
        ColossalAIConfig.from_json(config)
    assert str(info.value) == text


def test_valid_config_and_defaults():
    cfg = ColossalAIConfig.from_json(_hybrid(zero_stage=0))
    assert cfg.plugin == "hybrid_parallel" and cfg.zen.enabled and cfg.zen.bucket_cap_mb == 128
    assert ColossalAIConfig.from_json(cfg.to_dict()).to_dict() == cfg.to_dict()
    # Without a "zen" section ZEN is off (the stock DDP all-reduce, same buckets).
    assert not ColossalAIConfig.from_json({"plugin": "torch_ddp"}).zen.enabled


def test_top_level_and_plugin_errors():
    _raises(ValueError, "ColossalAI config got unknown key(s) ['optimizer']; valid keys are "
                        "['plugin', 'plugin_kwargs', 'train', 'zen']", {"optimizer": {}})
    _raises(ValueError, "plugin ('ddp') must be one of ['hybrid_parallel', 'torch_ddp']", {"plugin": "ddp"})
    _raises(TypeError, "plugin_kwargs ([2]) must be a JSON object (dict)",
            {"plugin": "torch_ddp", "plugin_kwargs": [2]})
    _raises(TypeError, "train (3) must be a JSON object (dict)", {"train": 3})


def test_plugin_kwargs_errors():
    with pytest.raises(ValueError) as info:
        ColossalAIConfig.from_json(_hybrid(tp_sise=2))
    assert re.fullmatch(r"plugin_kwargs got unknown key\(s\) \['tp_sise'\] for plugin 'hybrid_parallel'; "
                        r"did you mean 'tp_size' for 'tp_sise'\? "
                        r"valid keys are \[.*'tp_size'.*\]", str(info.value))
    assert "'ddp_bucket_cap_mb'" not in str(info.value)  # owned by zen.bucket_cap_mb
    _raises(ValueError, "plugin_kwargs.ddp_bucket_cap_mb (25) must not be set: zen.bucket_cap_mb (128.0) sets the "
                        "DDP bucket size", _hybrid(ddp_bucket_cap_mb=25))
    _raises(ValueError, "plugin_kwargs.bucket_cap_mb (25) must not be set: zen.bucket_cap_mb (64) sets the DDP "
                        "bucket size", {"plugin_kwargs": {"bucket_cap_mb": 25}, "zen": {"bucket_cap_mb": 64}})
    _raises(ValueError, "plugin_kwargs.tp_size must be set for plugin 'hybrid_parallel' (1 for data parallelism "
                        "only)", {"plugin": "hybrid_parallel", "zen": {}})
    _raises(TypeError, "plugin_kwargs.tp_size ('2') must be an integer", _hybrid(tp_size="2"))
    _raises(ValueError, "plugin_kwargs.tp_size (0) must be >= 1", _hybrid(tp_size=0))
    _raises(ValueError, "plugin_kwargs.precision ('fp8') must be one of ['fp16', 'bf16', 'fp32']",
            _hybrid(precision="fp8"))
    _raises(ValueError, "plugin_kwargs.zero_stage (3) must be 0, 1 or 2", _hybrid(zero_stage=3))
    _raises(ValueError, "plugin_kwargs.fp8_communication (True) must be false with zen enabled: both register a DDP "
                        "communication hook", {"plugin_kwargs": {"fp8_communication": True}, "zen": {}})
    assert ColossalAIConfig.from_json({"plugin_kwargs": {"guard_nonfinite": True}}).plugin_kwargs == {
        "guard_nonfinite": True}
    with pytest.raises(ValueError, match=r"^plugin_kwargs.tp_size \(3\) must divide the world size \(4\)$"):
        check_plugin_kwargs("hybrid_parallel", {"tp_size": 3}, zen=ZenConfig(), world_size=4)


def test_unsupported_modes_are_clear():
    zero_cpu = ("plugin_kwargs.zero_stage (1) must be 0 on CPU: ColossalAI 0.5.0's ZeRO optimizer needs a CUDA or "
                "NPU device (LowLevelZeroOptimizer asserts it); supported: zero_stage 0, where DDP reduces over the "
                "data-parallel group")
    _raises(NotImplementedError, zero_cpu, _hybrid(zero_stage=1))
    # ColossalAI's ZeRO refuses the CPU even without ZEN: say so before it asserts.
    _raises(NotImplementedError, zero_cpu, {**_hybrid(zero_stage=1), "zen": {"enabled": False}})
    _raises(NotImplementedError, "plugin_kwargs.pp_size (2) must be 1 with zen: with pipeline parallelism "
                                 "ColossalAI reduces each gradient in sync_dp_grads instead of through DDP; "
                                 "supported: tp_size >= 1, pp_size 1, zero_stage 0", _hybrid(pp_size=2))
    with pytest.raises(NotImplementedError) as info:  # what a GPU user reads
        check_plugin_kwargs("hybrid_parallel", {"tp_size": 2, "zero_stage": 2}, zen=ZenConfig(), on_cpu=False)
    assert str(info.value) == (
        "plugin_kwargs.zero_stage (2) must be 0 with zen: ZeRO-1/2 reduce through LowLevelZeroOptimizer's own "
        "buckets, and their ZEN replacement is not implemented (ColossalAI's ZeRO does not run on CPU, where it would "
        "be tested); supported: zero_stage 0 (torch DDP), or ZeRO-1/2/3 through zen_ext.deepspeed")
    for plugin in ("low_level_zero", "gemini"):  # ColossalAI's ZeRO plugins: refused, saying why
        with pytest.raises(NotImplementedError) as info:
            check_plugin_kwargs(plugin, {}, zen=ZenConfig(), on_cpu=False)
        assert str(info.value).startswith(f"plugin ({plugin!r}) is ColossalAI's ZeRO, which zen does not serve: "
                                          "ColossalAI 0.5.0's ZeRO optimizer needs a CUDA or NPU device"), info.value
    _raises(NotImplementedError, "plugin_kwargs.enable_sequence_parallelism must be false with zen: supported are "
                                 "tensor + data parallelism (tp_size, pp_size 1, zero_stage 0)",
            _hybrid(enable_sequence_parallelism=True))
    # Without ZEN the stock plugin's own modes pass through (pipeline parallelism on a GPU).
    check_plugin_kwargs("hybrid_parallel", {"tp_size": 2, "pp_size": 2}, zen=ZenConfig(enabled=False), on_cpu=False)


def test_zen_section_errors_are_the_deepspeed_ones():
    _raises(ValueError, "zen.bucket_cap_mb (0) must be in (0, 1048576]", {"zen": {"bucket_cap_mb": 0}})
    with pytest.raises(ValueError, match=r"^zen.dgc.density \(2\.0\) must "):
        ColossalAIConfig.from_json({"zen": {"dgc": {"density": 2.0}}})
    with pytest.raises(ValueError, match=r"^zen got unknown key\(s\) \['sheme'\]; did you mean 'scheme' for 'sheme'\? valid keys are "):
        ColossalAIConfig.from_json({"zen": {"sheme": "zen"}})


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "colossalai_*.json"))))
def test_shipped_configs_validate(path):
    cfg = ColossalAIConfig.from_json(path)
    with open(path) as f:
        raw = json.load(f)
    assert cfg.plugin == raw["plugin"]
    assert cfg.zen.enabled == raw.get("zen", {}).get("enabled", "zen" in raw)


def test_cpu_patches_serve_rng_and_sync_methods_and_only_on_cpu(monkeypatch):
    from colossalai.accelerator import get_accelerator

    import zen_ext.engines.colossalai_compat as compat

    assert apply_cpu_patches() and apply_cpu_patches()  # idempotent
    accel = get_accelerator()
    accel.manual_seed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(a, torch.rand(3))
    assert torch.equal(accel.get_rng_state(), torch.get_rng_state())
    assert accel.initial_seed() == 7
    accel.synchronize()  # a no-op on CPU (optimizer checkpoint loading calls it)

    class FakeCuda:
        name = "cuda"

    monkeypatch.setattr(compat, "get_accelerator", lambda: FakeCuda())
    assert apply_cpu_patches() is False
    assert not hasattr(FakeCuda, "_zen_ext_cpu_patched")
