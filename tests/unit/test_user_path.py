"""The pieces of the user's path that need no processes: Accelerate's "auto" placeholders
and the ``"zen"`` section, DGC's optimizer-dependent default, near-miss section names, the
start-up line."""

import copy
import json
import logging
import os

import pytest
import torch

from zen_ext.compress.dgc.defaults import optimizer_momentum
from zen_ext.config import ZenConfig, near_miss_sections
from zen_ext.reduction.stats import startup_line


def resolve_dgc_defaults(cfg: ZenConfig, optimizer):
    """``ZenConfig.resolve_defaults`` as the engines call it, and the note without its ``dgc `` prefix."""
    out, note = cfg.resolve_defaults(optimizer)
    assert note == "" or note.startswith("dgc ")
    return out, note[len("dgc "):]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _readme_json() -> dict:
    from tests.e2e.test_readme_snippets import BY_NAME

    return json.loads(BY_NAME["deepspeed-json"].text)


# --- Accelerate ---------------------------------------------------------------------------------------------
def _accelerate_process(ds_config: dict) -> dict:
    """What Accelerate's prepare does with a DeepSpeed config before deepspeed.initialize (1.15)."""
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(ds_config))
    plugin.deepspeed_config_process(must_match=False, **{"train_micro_batch_size_per_gpu": 4,
                                                         "optimizer.params.lr": 1e-4})
    return plugin.deepspeed_config


def test_accelerate_rejects_zen_auto_without_enable_and_keeps_it_with():
    """The README JSON (``"scheme": "auto"``, and ``"hierarchical": "auto"`` too) through Accelerate."""
    import zen_ext.deepspeed

    ds = _readme_json()
    ds["zen"]["hierarchical"] = "auto"
    zen_ext.deepspeed.disable()
    with pytest.raises(ValueError, match="`zen.scheme` not found in kwargs"):
        _accelerate_process(ds)
    zen_ext.deepspeed.enable()
    try:
        out = _accelerate_process(ds)
        assert out["zen"] == ds["zen"]  # untouched, "auto" values included
        ds_auto = dict(ds, train_micro_batch_size_per_gpu="auto")
        assert _accelerate_process(ds_auto)["train_micro_batch_size_per_gpu"] == 4  # HF's own "auto" still filled
        zen_ext.deepspeed.enable()  # idempotent: one wrapper, not two
        from accelerate.utils import DeepSpeedPlugin

        assert not hasattr(DeepSpeedPlugin.fill_match._zen_ext_original, "_zen_ext_original")
    finally:
        zen_ext.deepspeed.disable()
    from accelerate.utils import DeepSpeedPlugin

    assert not hasattr(DeepSpeedPlugin.fill_match, "_zen_ext_original")


# --- DGC momentum correction --------------------------------------------------------------------------------
class _Wrapper:  # DeepSpeed's ZeRO / BF16 optimizers and Accelerate's wrap the torch optimizer like this
    def __init__(self, optimizer):
        self.optimizer = optimizer


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("make, expected, text", [
    (lambda: torch.optim.AdamW(_params()), True, "AdamW keeps its own moments"),
    (lambda: torch.optim.Adam(_params()), True, "Adam keeps its own moments"),
    (lambda: torch.optim.SGD(_params(), lr=0.1, momentum=0.9), True, "SGD with momentum 0.9"),
    (lambda: torch.optim.SGD(_params(), lr=0.1), False, "SGD with momentum 0"),
    (lambda: _Wrapper(_Wrapper(torch.optim.SGD(_params(), lr=0.1))), False, "SGD with momentum 0"),
    (lambda: _Wrapper(torch.optim.AdamW(_params())), True, "AdamW keeps its own moments"),
    (lambda: torch.optim.Adagrad(_params()), None, "Adagrad (not known to be momentum-free)"),
    (lambda: None, None, "no optimizer given"),
])
def test_optimizer_momentum(make, expected, text):
    assert optimizer_momentum(make()) == (expected, text)


def test_momentum_correction_default_follows_the_optimizer():
    cfg = ZenConfig.from_dict({"dgc": {"enabled": True}})
    assert cfg.dgc.momentum_correction is None
    adam, why = resolve_dgc_defaults(cfg, torch.optim.AdamW(_params()))
    assert adam.dgc.momentum_correction is False and cfg.dgc.momentum_correction is None  # a copy
    assert why == ("momentum_correction=false (chosen: AdamW keeps its own moments; momentum correction would "
                   "apply momentum twice); warmup_steps=100 (default: DGC's warm-up, density 0.25 → 0.05)")
    sgd, why = resolve_dgc_defaults(cfg, torch.optim.SGD(_params(), lr=0.1))
    assert sgd.dgc.momentum_correction is True and "DGC supplies the momentum (dgc.momentum 0.9)" in why
    msgd, _ = resolve_dgc_defaults(cfg, torch.optim.SGD(_params(), lr=0.1, momentum=0.9))
    assert msgd.dgc.momentum_correction is False
    none, why = resolve_dgc_defaults(cfg, None)
    assert none.dgc.momentum_correction is False and "plain error feedback" in why
    off, why = resolve_dgc_defaults(ZenConfig(), torch.optim.AdamW(_params()))
    assert off.dgc.momentum_correction is None and why == ""  # DGC off: nothing to decide


def test_warmup_default_is_dgc_ramp_where_it_sends_more():
    """null warmup_steps: 100 steps from 0.25 down to the density where the density is below 0.25,
    none at or above it; an explicit value is kept and not reported. A sparsifier built without an engine
    reads null as no ramp."""
    adam = torch.optim.AdamW(_params())
    cfg = ZenConfig.from_dict({"dgc": {"enabled": True, "density": 0.01}})
    assert cfg.dgc.warmup_steps is None and cfg.dgc.density_at(0) == 0.01
    out, why = resolve_dgc_defaults(cfg, adam)
    assert out.dgc.warmup_steps == 100 and why.endswith("; warmup_steps=100 (default: DGC's warm-up, density 0.25 → 0.01)")
    assert out.dgc.density_at(0) == 0.25 and out.dgc.density_at(50) == pytest.approx(0.05)  # geometric mean
    assert out.dgc.density_at(99) > 0.01 and out.dgc.density_at(100) == 0.01
    high, why = resolve_dgc_defaults(ZenConfig.from_dict({"dgc": {"enabled": True, "density": 0.3}}), adam)
    assert high.dgc.warmup_steps == 0 and "warmup" not in why and high.dgc.density_at(0) == 0.3
    mine, why = resolve_dgc_defaults(ZenConfig.from_dict({"dgc": {"enabled": True, "warmup_steps": 20}}), adam)
    assert mine.dgc.warmup_steps == 20 and "warmup" not in why


def test_flush_default_follows_whether_the_optimizer_catches_up():
    """null flush_fraction: 0.1 under CatchUpAdamW at density >= 0.05 (wrapped too, as ZeRO wraps it), 0
    under plain AdamW, without an optimizer and at 1 %; an explicit value is kept."""
    from zen_ext.optim import CatchUpAdamW

    class Wrapper:  # as DeepSpeed's ZeRO optimizer holds the client optimizer
        def __init__(self, inner):
            self.optimizer = inner

    cfg = ZenConfig.from_dict({"dgc": {"enabled": True}})
    assert cfg.dgc.flush_fraction is None and cfg.dgc.flush_stride(0.05) == 0
    up = CatchUpAdamW([{"params": _params(), "catch_up": True}])
    out, why = resolve_dgc_defaults(cfg, Wrapper(up))
    assert out.dgc.flush_fraction == 0.1 and out.dgc.flush_stride(0.05) == 200
    assert why.endswith("; flush_fraction=0.1 (chosen: the optimizer catches up held-back gradients; each "
                        "coordinate is sent at least every 200 steps); warmup_steps=100 (default: DGC's warm-up, density 0.25 → 0.05)"), why
    adam, why = resolve_dgc_defaults(cfg, torch.optim.AdamW(_params()))
    assert adam.dgc.flush_fraction == 0.0 and "flush" not in why
    assert resolve_dgc_defaults(cfg, None)[0].dgc.flush_fraction == 0.0
    none_up = CatchUpAdamW([{"params": _params(), "catch_up": False}])  # no DGC tensor catches up
    assert resolve_dgc_defaults(cfg, none_up)[0].dgc.flush_fraction == 0.0
    low, why = resolve_dgc_defaults(ZenConfig.from_dict({"dgc": {"enabled": True, "density": 0.01}}), up)
    assert low.dgc.flush_fraction == 0.0 and "; flush_fraction=0 (chosen: density 0.01 < 0.05);" in why
    kept, why = resolve_dgc_defaults(ZenConfig.from_dict({"dgc": {"enabled": True, "flush_fraction": 0.5}}), up)
    assert kept.dgc.flush_fraction == 0.5 and "flush" not in why


def test_explicit_momentum_correction_with_adam_is_kept_with_a_warning(caplog):
    cfg = ZenConfig.from_dict({"dgc": {"enabled": True, "momentum_correction": True}})
    with caplog.at_level(logging.WARNING, logger="zen_ext.config"):
        out, why = resolve_dgc_defaults(cfg, torch.optim.AdamW(_params()))
    assert out.dgc.momentum_correction is True and "set in the config" in why
    assert "momentum is applied twice" in caplog.text


def test_momentum_correction_type_is_checked():
    with pytest.raises(TypeError, match=r"zen.dgc.momentum_correction \('yes'\) must be a bool"):
        ZenConfig.from_dict({"dgc": {"momentum_correction": "yes"}})


# --- a misspelled section -----------------------------------------------------------------------------------
def test_near_miss_section_names(caplog):
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}, "zne": {"scheme": "auto"},
          "Zen ": {}, "zen_ext": {}, "amp": {}, "fp16": {}, "wall_clock_breakdown": False}
    assert near_miss_sections(ds) == ["zne", "Zen ", "zen_ext"]
    with caplog.at_level(logging.WARNING, logger="zen_ext.config"):
        cfg = ZenConfig.from_ds_config(ds)
    assert not cfg.enabled
    assert 'has "zne", "Zen ", "zen_ext"; did you mean "zen"? Without it ZEN is NOT attached' in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zen_ext.config"):
        ZenConfig.from_ds_config({"zero_optimization": {"stage": 1}, "mean": 1, "zero": 2})
    assert caplog.text == ""  # DeepSpeed-like keys are not flagged


def test_every_shipped_deepspeed_config_has_no_near_miss():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".json"):
            with open(os.path.join(ROOT, "configs", name)) as f:
                assert near_miss_sections(json.load(f)) == [], name


# --- the start-up line --------------------------------------------------------------------------------------
def test_startup_line():
    cfg, note = ZenConfig.from_dict({"scheme": "auto", "dgc": {"enabled": True}}).resolve_defaults(
        torch.optim.AdamW(_params()))
    kinds = {"emb.weight": "natural", "l1.weight": "dgc", "l2.weight": "dgc", "l1.bias": "dense"}
    numels = {"emb.weight": 65536, "l1.weight": 4096, "l2.weight": 4096, "l1.bias": 64}
    line = startup_line("DeepSpeed ZeRO-1 (dp=2, tp=1, hierarchical=False)", cfg, kinds, numels, note)
    assert line == ("zen_ext: ZEN on DeepSpeed ZeRO-1 (dp=2, tp=1, hierarchical=False): scheme=auto, buckets 128 MB | "
                    "natural: 1 tensor (65.5 K elements), dgc 0.05: 2 tensors (8.2 K elements), dense: 1 tensor "
                    "(64 elements) | dgc momentum_correction=false (chosen: AdamW keeps its own moments; momentum "
                    "correction would apply momentum twice); warmup_steps=100 (default: DGC's warm-up, density 0.25 → 0.05)")
