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

import logging
import os
import sys

import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

from ..config import ZenConfig
from .colossalai_compat import apply_cpu_patches
from .colossalai_config import VERIFIED_COLOSSALAI, ColossalAIConfig, check_plugin_kwargs
from .colossalai_policies import policy_for
from .ddp import ZenHookState, register_zen_hook

log = logging.getLogger(__name__)


__all__ = ["ZenHybridParallelPlugin", "ZenTorchDDPPlugin", "build_booster", "build_plugin"]


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
