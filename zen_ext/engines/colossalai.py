"""ColossalAI integration: Booster plugins that synchronize gradients with ZEN (paper §4).

The paper ran ZEN inside ColossalAI as a DDP ``custom_comm_hook`` with 128 MB buckets, for data
parallelism and for tensor (8) + data hybrid parallelism. With zero_stage 0 both plugins below wrap
the model in torch DDP, so no ColossalAI source patch is needed: each plugin's ``configure`` (run by
``Booster.boost``) calls the stock one and registers ``zen_ext.engines.ddp.zen_comm_hook`` on the DDP
it built (shared/research/engines.md B7, C9).

==========================  ======================================  ===========================  ==========
plugin (JSON ``plugin``)    DDP spans                               hook registered on           checked on
==========================  ======================================  ===========================  ==========
``ZenTorchDDPPlugin``       the default group                       ``model.module`` (DDP)       0.5.0
(``torch_ddp``)
``ZenHybridParallelPlugin`` ``plugin.mixed_dp_group`` (the DP       ``model.module`` (DDP of     0.5.0
(``hybrid_parallel``)       group; DGC thresholds over              the ShardFormer-sharded
                            ``plugin.tp_group``)                    module)
==========================  ======================================  ===========================  ==========

With tensor parallelism the data-parallel ranks of one DDP share a TP rank, so they hold the same
shards and their buckets line up. The vocab-parallel embedding shard (``VocabParallelEmbedding1D``)
stays naturally sparse: only the rows of tokens that fall into the shard are non-zero (a *tied*
embedding shares its shard with the LM head and is dense).

Each rank sends what the Synchronizer sends per DDP bucket (reduction/synchronizer.py; ``zen``: paper
Eq. 1) instead of DDP's ring all-reduce of ``2·(n−1)/n`` of the bucket.

Not served (clear errors): ``pp_size > 1`` (ColossalAI then reduces per parameter in
``sync_dp_grads``, not through DDP), ``zero_stage > 0`` (LowLevelZeroOptimizer buckets; on CPU
ColossalAI's ZeRO refuses to run at all), sequence parallelism, ``fp8_communication`` (a second comm
hook). On CPU the plugins apply ``colossalai_compat.apply_cpu_patches`` (ColossalAI 0.5.0's
``CpuAccelerator`` RNG methods, upstream #5211). A ``Gemma2ForCausalLM`` is sharded with
``colossalai_policies.Gemma2ForCausalLMPolicy``: ColossalAI 0.5.0 has no Gemma2 policy.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass, field

import torch.distributed as dist
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

from .._keys import unknown_keys_message
from ..config import ZenConfig, load_json_config
from .colossalai_compat import apply_cpu_patches
from .colossalai_policies import policy_for
from .ddp import ZenHookState, register_zen_hook

log = logging.getLogger(__name__)

VERIFIED_COLOSSALAI = "0.5.0"
PRECISIONS = ("fp16", "bf16", "fp32")
CONFIG_KEYS = ("plugin", "plugin_kwargs", "zen", "train")

__all__ = [
    "ColossalAIConfig", "ZenHybridParallelPlugin", "ZenTorchDDPPlugin", "apply_cpu_patches", "build_booster",
    "build_plugin", "check_plugin_kwargs",
]


def _on_cpu() -> bool:
    return get_accelerator().name == "cpu"


# --- validation ---------------------------------------------------------------------------------------------
_BASES = {"torch_ddp": TorchDDPPlugin, "hybrid_parallel": HybridParallelPlugin}
# Keys the ZEN plugins set themselves: the DDP bucket size comes from zen.bucket_cap_mb.
_OWNED = {"torch_ddp": {"bucket_cap_mb": "zen.bucket_cap_mb"},
          "hybrid_parallel": {"ddp_bucket_cap_mb": "zen.bucket_cap_mb"}}
# Keys the ZEN plugins add to the stock ones (hybrid_parallel guards by itself when precision is fp16).
_ADDED = {"torch_ddp": ("guard_nonfinite",), "hybrid_parallel": ()}


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
            f"own buckets, and their ZEN replacement is not implemented (it needs a GPU to test); supported: "
            f"zero_stage 0 (torch DDP), or ZeRO-1/2 through zen_ext.deepspeed")
    if kw.get("enable_sequence_parallelism") or (kw.get("sp_size") or 1) > 1:
        raise NotImplementedError("plugin_kwargs.enable_sequence_parallelism must be false with zen: supported are "
                                  "tensor + data parallelism (tp_size, pp_size 1, zero_stage 0)")


# --- the plugins --------------------------------------------------------------------------------------------
def _zen_config(zen) -> ZenConfig:
    if zen is None:
        return ZenConfig()
    return zen if isinstance(zen, ZenConfig) else ZenConfig.from_dict(zen)


class ZenTorchDDPPlugin(TorchDDPPlugin):
    """``TorchDDPPlugin`` whose DDP synchronizes gradients with ZEN (data parallelism).

    Args:
        zen: the ``"zen"`` section (ZenConfig or dict; None: defaults, i.e. natural sparsity, no DGC).
            ``zen.bucket_cap_mb`` (128) is DDP's bucket size; ``zen.enabled`` false keeps DDP's
            all-reduce (the dense baseline with the same buckets).
        guard_nonfinite: with ``Booster(mixed_precision="fp16")`` (a loss scaler), set it: a NaN/Inf on
            any rank then NaN-fills every rank's bucket, so the scaler still sees an overflow that DGC
            could otherwise drop. The booster applies mixed precision after the plugin, so the
            plugin cannot tell by itself. Default False.
        **kwargs: ``TorchDDPPlugin`` arguments except ``bucket_cap_mb``.

    Attributes:
        zen: the ``ZenHookState`` after ``boost`` (statistics, ``state_dict``), None before or when
            disabled.

    Example::

        >>> plugin = ZenTorchDDPPlugin(zen={"dgc": {"enabled": True}})  # doctest: +SKIP
        >>> model, optimizer, *_ = Booster(plugin=plugin).boost(model, optimizer)  # doctest: +SKIP
    """

    def __init__(self, zen: "ZenConfig | dict | None" = None, guard_nonfinite: bool = False, **kwargs) -> None:
        self.zen_config = _zen_config(zen)
        check_plugin_kwargs("torch_ddp", kwargs, zen=self.zen_config)
        if not isinstance(guard_nonfinite, bool):
            raise TypeError(f"plugin_kwargs.guard_nonfinite ({guard_nonfinite!r}) must be a bool (true or false)")
        apply_cpu_patches()
        super().__init__(bucket_cap_mb=self.zen_config.bucket_cap_mb, **kwargs)
        self.guard_nonfinite = guard_nonfinite
        self.zen: ZenHookState | None = None

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        out = super().configure(model, optimizer, criterion, dataloader, lr_scheduler)
        if self.zen_config.enabled:
            self.zen = register_zen_hook(out[0].module, self.zen_config, guard_nonfinite=self.guard_nonfinite,
                                         optimizer=optimizer)
        return out


class ZenHybridParallelPlugin(HybridParallelPlugin):
    """``HybridParallelPlugin`` (tensor + data parallelism, pp_size 1, zero_stage 0) with ZEN on its DDP.

    DDP spans ``mixed_dp_group`` (the data-parallel group); DGC agrees one threshold per layer
    across ``tp_group``; with fp16 a NaN/Inf on any rank NaN-fills every bucket so the loss scaler
    still skips the step.

    Args:
        tp_size: tensor-parallel degree.
        pp_size: must be 1 when ZEN is enabled.
        zen: the ``"zen"`` section (see ``ZenTorchDDPPlugin``); ``zen.bucket_cap_mb`` is DDP's bucket.
        **kwargs: ``HybridParallelPlugin`` arguments except ``ddp_bucket_cap_mb``.

    A ``Gemma2ForCausalLM`` without ``custom_policy`` is sharded with zen_ext's
    ``Gemma2ForCausalLMPolicy`` (ColossalAI 0.5.0 has none).

    Raises:
        NotImplementedError: pp_size > 1, zero_stage > 0, sequence parallelism (and ZeRO on CPU).
        ValueError, TypeError: see ``check_plugin_kwargs``.
    """

    def __init__(self, tp_size: int = 1, pp_size: int = 1, *, zen: "ZenConfig | dict | None" = None,
                 **kwargs) -> None:
        self.zen_config = _zen_config(zen)
        check_plugin_kwargs("hybrid_parallel", {"tp_size": tp_size, "pp_size": pp_size, **kwargs},
                            zen=self.zen_config, world_size=dist.get_world_size() if dist.is_initialized() else None)
        apply_cpu_patches()
        super().__init__(tp_size, pp_size, ddp_bucket_cap_mb=self.zen_config.bucket_cap_mb, **kwargs)
        self.zen: ZenHookState | None = None

    def __del__(self, _finalizing=sys.is_finalizing, _initialized=dist.is_initialized) -> None:
        """Destroy the plugin's process groups (ColossalAI's ``__del__``) only while that can work.

        ColossalAI 0.5.0's ``HybridParallelPlugin.__del__`` destroys the mesh's groups and calls
        ``gc.collect()``; run at interpreter exit (the plugin lives in a script's globals) the modules
        are already torn down, and Python prints ``Exception ignored in: HybridParallelPlugin.__del__
        ... TypeError: 'NoneType' object is not callable``. At exit, or after
        ``destroy_process_group()`` (which destroys every group), there is nothing left to free, so it
        is skipped; the builtins it needs are bound as defaults because module globals may be None then.
        """
        if _finalizing() or not _initialized():
            return
        super().__del__()

    def configure(self, model, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # Models ColossalAI has no ShardFormer policy for (Gemma2) get zen_ext's, for this call only.
        own = self.custom_policy is None and policy_for(model) is not None
        if own:
            self.custom_policy = policy_for(model)
        try:
            out = super().configure(model, optimizer, criterion, dataloader, lr_scheduler)
        finally:
            if own:
                self.custom_policy = None
        if self.zen_config.enabled:
            from torch.nn.parallel import DistributedDataParallel

            ddp = out[0].module
            if not isinstance(ddp, DistributedDataParallel):  # pp_size 1 and zero_stage 0 always build DDP
                raise RuntimeError(f"zen: HybridParallelModule wraps a {type(ddp).__name__}, not torch DDP; "
                                   f"ColossalAI {VERIFIED_COLOSSALAI} builds DDP for pp_size 1, zero_stage 0")
            self.zen = register_zen_hook(ddp, self.zen_config, tp_group=self.tp_group if self.tp_size > 1 else None,
                                         guard_nonfinite=self.precision == "fp16", optimizer=optimizer)
        return out


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


PLUGINS = {"torch_ddp": ZenTorchDDPPlugin, "hybrid_parallel": ZenHybridParallelPlugin}


def build_plugin(config: "ColossalAIConfig | str | os.PathLike | dict"):
    """The ZEN plugin a config describes (torch.distributed must be initialized)."""
    cfg = config if isinstance(config, ColossalAIConfig) else ColossalAIConfig.from_json(config)
    if not dist.is_initialized():
        raise RuntimeError("zen: initialize torch.distributed first (colossalai.launch_from_torch() under torchrun "
                           "or the deepspeed launcher)")
    return PLUGINS[cfg.plugin](zen=cfg.zen, **cfg.plugin_kwargs)


def build_booster(config: "ColossalAIConfig | str | os.PathLike | dict") -> Booster:
    """A ``Booster`` with the ZEN plugin a config describes; the plugin is ``booster.plugin``.

    Args:
        config: a ``ColossalAIConfig``, a JSON path, or a dict (keys: plugin, plugin_kwargs, zen, train).

    Returns:
        The booster; after ``booster.boost(model, optimizer)``, ``booster.plugin.zen`` is the hook state.

    Raises:
        ValueError, TypeError, NotImplementedError: an invalid config (see ``ColossalAIConfig.from_json``).
        RuntimeError: torch.distributed is not initialized.
    """
    return Booster(plugin=build_plugin(config))


def config_summary(cfg: ColossalAIConfig) -> str:
    """One line for logs: plugin, its arguments and the zen switches."""
    z = cfg.zen
    return (f"plugin={cfg.plugin} {json.dumps(cfg.plugin_kwargs, sort_keys=True)} zen={'on' if z.enabled else 'off'}"
            f" scheme={z.scheme} dgc={'on' if z.dgc.enabled else 'off'} natural={'on' if z.natural.enabled else 'off'}"
            f" bucket_cap_mb={z.bucket_cap_mb}")

