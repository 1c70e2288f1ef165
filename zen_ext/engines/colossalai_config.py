"""ColossalAI's side of a run config, validated before anything is built: the JSON config zen_ext defines
(``ColossalAIConfig``: plugin, its arguments, the ``"zen"`` section, recipe settings) and the plugin
arguments' checks, with errors that name what is supported (``check_plugin_kwargs``). The plugins that
use them are in ``colossalai.py``.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field

from colossalai.accelerator import get_accelerator
from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

from .._keys import unknown_keys_message
from ..config import ZenConfig, load_json_config

VERIFIED_COLOSSALAI = "0.5.0"
PRECISIONS = ("fp16", "bf16", "fp32")
CONFIG_KEYS = ("plugin", "plugin_kwargs", "zen", "train")


def _on_cpu() -> bool:
    return get_accelerator().name == "cpu"


# --- validation ---------------------------------------------------------------------------------------------
_BASES = {"torch_ddp": TorchDDPPlugin, "hybrid_parallel": HybridParallelPlugin}
# Keys the ZEN plugins set themselves: the DDP bucket size comes from zen.bucket_cap_mb.
_OWNED = {"torch_ddp": {"bucket_cap_mb": "zen.bucket_cap_mb"},
          "hybrid_parallel": {"ddp_bucket_cap_mb": "zen.bucket_cap_mb"}}
# Keys the ZEN plugins add to the stock ones (hybrid_parallel guards by itself when precision is fp16).
_ADDED = {"torch_ddp": ("guard_nonfinite",), "hybrid_parallel": ()}
ZERO_PLUGINS = ("low_level_zero", "gemini")
"""ColossalAI's ZeRO plugins (booster names), refused with zen: their ZeRO does not run on CPU."""


def check_plugin_kwargs(plugin: str, kwargs: dict, *, zen: ZenConfig, world_size: int | None = None,
                        on_cpu: bool | None = None) -> None:
    """Validate a plugin's keyword arguments before anything is built.

    Args:
        plugin: ``"torch_ddp"`` or ``"hybrid_parallel"``.
        kwargs: the keyword arguments (the JSON ``plugin_kwargs``).
        zen: the ``"zen"`` section (the ZeRO / pipeline / fp8 limits apply when it is enabled).
        world_size: when given, ``tp_size`` must divide it.
        on_cpu: whether the accelerator is the CPU (default: ColossalAI's choice).

    Raises:
        ValueError: unknown plugin or key, a key ZEN sets itself, a value out of range.
        TypeError: a value of the wrong type.
        NotImplementedError: a mode ZEN (or ColossalAI on CPU) does not serve.
    """
    if plugin in ZERO_PLUGINS:
        raise NotImplementedError(
            f"plugin ({plugin!r}) is ColossalAI's ZeRO, which zen does not serve: ColossalAI 0.5.0's ZeRO optimizer "
            f"needs a CUDA or NPU device (LowLevelZeroOptimizer asserts it), so a ZEN replacement of its buckets "
            f"cannot be tested on CPU; supported: {sorted(_BASES)} with zero_stage 0, or ZeRO-1/2/3 through "
            f"zen_ext.deepspeed (docs/deepspeed_zero3.md)")
    if plugin not in _BASES:
        raise ValueError(f"plugin ({plugin!r}) must be one of {sorted(_BASES)}")
    if not isinstance(kwargs, dict):
        raise TypeError(f"plugin_kwargs ({kwargs!r}) must be a JSON object (dict)")
    valid = [p for p in inspect.signature(_BASES[plugin].__init__).parameters if p != "self"] + list(_ADDED[plugin])
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(unknown_keys_message("plugin_kwargs", unknown, set(valid) - set(_OWNED[plugin]),
                                              f" for plugin {plugin!r}"))
    for key, owner in _OWNED[plugin].items():
        if key in kwargs:
            raise ValueError(f"plugin_kwargs.{key} ({kwargs[key]!r}) must not be set: {owner} "
                             f"({zen.bucket_cap_mb!r}) sets the DDP bucket size")
    if zen.enabled and kwargs.get("fp8_communication"):
        raise ValueError("plugin_kwargs.fp8_communication (True) must be false with zen enabled: both register "
                         "a DDP communication hook")
    if plugin == "hybrid_parallel":
        _check_hybrid(kwargs, zen, world_size, _on_cpu() if on_cpu is None else on_cpu)


def _check_int(key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"plugin_kwargs.{key} ({value!r}) must be an integer")
    if value < minimum:
        raise ValueError(f"plugin_kwargs.{key} ({value!r}) must be >= {minimum}")
    return value


def _check_hybrid(kw: dict, zen: ZenConfig, world_size: int | None, on_cpu: bool) -> None:
    if "tp_size" not in kw:
        raise ValueError("plugin_kwargs.tp_size must be set for plugin 'hybrid_parallel' (1 for data parallelism only)")
    tp = _check_int("tp_size", kw["tp_size"], 1)
    pp = _check_int("pp_size", kw.get("pp_size", 1), 1)
    zero = _check_int("zero_stage", kw.get("zero_stage", 0), 0)
    if zero > 2:
        raise ValueError(f"plugin_kwargs.zero_stage ({zero}) must be 0, 1 or 2")
    precision = kw.get("precision", "fp16")
    if precision not in PRECISIONS:
        raise ValueError(f"plugin_kwargs.precision ({precision!r}) must be one of {list(PRECISIONS)}")
    if world_size is not None and world_size % tp:
        raise ValueError(f"plugin_kwargs.tp_size ({tp}) must divide the world size ({world_size})")
    if zero > 0 and on_cpu:
        raise NotImplementedError(
            f"plugin_kwargs.zero_stage ({zero}) must be 0 on CPU: ColossalAI 0.5.0's ZeRO optimizer needs a CUDA or "
            f"NPU device (LowLevelZeroOptimizer asserts it); supported: zero_stage 0, where DDP reduces over the "
            f"data-parallel group")
    if not zen.enabled:
        return
    if pp > 1:
        raise NotImplementedError(
            f"plugin_kwargs.pp_size ({pp}) must be 1 with zen: with pipeline parallelism ColossalAI reduces each "
            f"gradient in sync_dp_grads instead of through DDP; supported: tp_size >= 1, pp_size 1, zero_stage 0")
    if zero > 0:
        raise NotImplementedError(
            f"plugin_kwargs.zero_stage ({zero}) must be 0 with zen: ZeRO-1/2 reduce through LowLevelZeroOptimizer's "
            f"own buckets, and their ZEN replacement is not implemented (ColossalAI's ZeRO does not run on CPU, "
            f"where it would be tested); supported: zero_stage 0 (torch DDP), or ZeRO-1/2/3 through zen_ext.deepspeed")
    if kw.get("enable_sequence_parallelism") or (kw.get("sp_size") or 1) > 1:
        raise NotImplementedError("plugin_kwargs.enable_sequence_parallelism must be false with zen: supported are "
                                  "tensor + data parallelism (tp_size, pp_size 1, zero_stage 0)")


# --- the JSON config ----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class ColossalAIConfig:
    """A ColossalAI run config: which plugin, its arguments, and the ``"zen"`` section.

    ColossalAI has no JSON config of its own (plugins take Python arguments), so zen_ext defines this
    one, e.g. ``{"plugin": "hybrid_parallel", "plugin_kwargs": {"tp_size": 2, "precision": "bf16"},
    "zen": {"dgc": {"enabled": true}}}``.
    """

    plugin: str = "torch_ddp"
    """``"torch_ddp"`` (data parallelism) or ``"hybrid_parallel"`` (tensor + data). Default torch_ddp."""
    plugin_kwargs: dict = field(default_factory=dict)
    """The plugin's keyword arguments (ColossalAI's names and defaults), except the DDP bucket size,
    which is ``zen.bucket_cap_mb``. hybrid_parallel needs ``tp_size``; ``pp_size`` must be 1 and
    ``zero_stage`` 0."""
    zen: ZenConfig = field(default_factory=lambda: ZenConfig(enabled=False))
    """The ``"zen"`` section, the same keys and validation as in a DeepSpeed config. Absent: ZEN off
    (the plugin's own DDP all-reduce, with ``zen.bucket_cap_mb`` buckets)."""
    train: dict = field(default_factory=dict)
    """Recipe settings (batch size, learning rate, ...), read by recipes/finetune_llm_colossalai.py;
    ``build_booster`` ignores them."""

    @classmethod
    def from_json(cls, config: "str | os.PathLike | dict") -> "ColossalAIConfig":
        """Read and validate a config (a path or a dict); world-size checks wait for ``build_plugin``.

        Raises:
            ValueError: unknown top-level key (lists the valid ones) or invalid plugin / plugin_kwargs.
            TypeError: a value of the wrong type.
            NotImplementedError: a mode ZEN does not serve (see ``check_plugin_kwargs``).
        """
        d = load_json_config(config)
        if not isinstance(d, dict):
            raise TypeError(f"ColossalAI config ({d!r}) must be a JSON object")
        unknown = sorted(set(d) - set(CONFIG_KEYS))
        if unknown:
            raise ValueError(unknown_keys_message("ColossalAI config", unknown, CONFIG_KEYS))
        zen = ZenConfig.from_json_section(d["zen"]) if "zen" in d else ZenConfig(enabled=False)
        plugin = d.get("plugin", "torch_ddp")
        kwargs = d.get("plugin_kwargs", {})
        if not isinstance(plugin, str):
            raise TypeError(f"plugin ({plugin!r}) must be a string")
        train = d.get("train", {})
        if not isinstance(train, dict):
            raise TypeError(f"train ({train!r}) must be a JSON object (dict)")
        check_plugin_kwargs(plugin, kwargs, zen=zen)
        return cls(plugin=plugin, plugin_kwargs=dict(kwargs), zen=zen, train=dict(train))

    def to_dict(self) -> dict:
        return {"plugin": self.plugin, "plugin_kwargs": dict(self.plugin_kwargs), "zen": self.zen.to_dict(),
                "train": dict(self.train)}


def config_summary(cfg: ColossalAIConfig) -> str:
    """One line for logs: plugin, its arguments and the zen switches."""
    z = cfg.zen
    return (f"plugin={cfg.plugin} {json.dumps(cfg.plugin_kwargs, sort_keys=True)} zen={'on' if z.enabled else 'off'}"
            f" scheme={z.scheme} {z.sections_line()}"
            f" bucket_cap_mb={z.bucket_cap_mb}")

