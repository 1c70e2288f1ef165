"""DeepSpeed integration: ``initialize`` = ``deepspeed.initialize`` + ZEN attached to the engine.

DeepSpeed has no gradient-reduction hook (no ``register_comm_hook``, config entry or plugin registry),
so ``attach`` replaces, on the engine instance only, the method that all-reduces one flat gradient
bucket (docs/deepspeed.md, "What is supported"):

=============================  ===================================================  =================
who reduces                    overridden instance method                           checked on
=============================  ===================================================  =================
the engine: ZeRO-0 (fp32,      ``engine.allreduce_bucket(bucket, dp_group,          TESTED_DEEPSPEED
fp16, bf16, AutoTP) and        dp_world_size)``
BF16_Optimizer (bf16 + ZeRO-1
+ fp32 grad accumulation)
the ZeRO optimizer: ZeRO 1, 2  ``engine.optimizer.gradient_reduction_w_predivide(   TESTED_DEEPSPEED
with ``reduce_scatter`` false  tensor, communication_data_type)``, with
(or unset)                     ``contiguous_gradients`` true
ZeRO 1, 2 with                 ZEN's reduce-scatter: ``deepspeed_zero3`` (its       TESTED_DEEPSPEED
``reduce_scatter`` true;       docstring has the table)
ZeRO-3
=============================  ===================================================  =================

``TESTED_DEEPSPEED`` (``deepspeed_compat``): 0.18.9 and 0.19.8, where the adapter's tests
passed; the hooks that differ between those lines are resolved there (its docstring has the table).

With ``zen.async_sync`` and ZeRO's ``overlap_comm`` (two IPG buffers), ``engine.optimizer.reduce_ipg_grads``
is replaced too: a full IPG bucket goes to the communication worker, which reduces it and runs
DeepSpeed's per-parameter copy into the gradient partition, while the backward pass fills the other
buffer (``deepspeed_ipg.AsyncIPG``, which ``ZenDeepSpeed`` holds).

Both overrides keep DeepSpeed's semantics: values travel in ``communication_data_type``, the result is
the data-parallel mean (or sum with ``gradient_allreduce_op: "sum"``), and groups other than the
data-parallel one (MoE expert groups) go to the original method. ``engine.step`` is wrapped to end
the Synchronizer's step and write statistics; ``save_checkpoint`` / ``load_checkpoint`` are wrapped
to store each rank's ZEN state (DGC residuals differ per rank) in ``<dir>/<tag>/zen_ext/``.
After every optimizer step the wrapper checks that the override ran, so a DeepSpeed release that
moves the reduction fails loudly instead of silently training with the wrong gradients.

This module holds the entry points (``initialize``, ``enable``, ``attach``); the attachment itself is
``deepspeed_engine.ZenDeepSpeed``, its ZeRO ``overlap_comm`` hand-over ``deepspeed_ipg``, its
reduce-scatter (ZeRO-3, ZeRO-1/2 with ``reduce_scatter``) ``deepspeed_zero3``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os

from ..config import SECTION, ZenConfig, load_json_config, near_miss_sections
from . import deepspeed_compat
from .deepspeed_compat import ALLOW_UNVERIFIED_ENV
from .deepspeed_engine import VERIFIED_DEEPSPEED, ZenDeepSpeed, refuse_pipeline_model

log = logging.getLogger(__name__)

__all__ = ["ZenDeepSpeed", "attach", "check_deepspeed_version", "disable", "enable", "initialize"]

_original_initialize = None


# --- public entry points --------------------------------------------------------------------------------
def check_deepspeed_version(version: str | None = None) -> str:
    """Serve a DeepSpeed release the adapter's tests passed on (``VERIFIED_DEEPSPEED``), warn about
    another patch of the same minor line, raise RuntimeError otherwise (or warn, with the override
    environment variable); ``deepspeed_compat.version_status`` has the rules. Returns the version."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    return deepspeed_compat.check_version(version)


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with ZEN attached when the config has an enabled ``"zen"`` section.

    Same arguments and return value as ``deepspeed.initialize``: ``(engine, optimizer,
    training_dataloader, lr_scheduler)``; the attachment is ``engine.zen``.

    1. Find the config (``config``, ``config_params`` or ``args.deepspeed_config``) and validate its
       ``"zen"`` section and the engine settings it needs.
    2. Rewrite the ZeRO settings the override relies on (``_rewrite_zero_settings``) in a copy of the
       config.
    3. Call DeepSpeed, then ``attach``.
    """
    orig = _original_initialize or _deepspeed_initialize()
    bound = inspect.signature(orig).bind(*args, **kwargs)
    a = bound.arguments
    # Step 1: the config and its "zen" section.
    ds_args = a.get("args")
    source = a.get("config") if a.get("config") is not None else a.get("config_params")
    if source is None and getattr(ds_args, "deepspeed_config", None) is not None:
        source = ds_args.deepspeed_config
    if source is None:
        return orig(*bound.args, **bound.kwargs)
    ds_config = copy.deepcopy(load_json_config(source))
    cfg = ZenConfig.from_ds_config(ds_config)  # warns about a near-miss section name ("zne")
    if not cfg.enabled:
        result = orig(*bound.args, **bound.kwargs)
        _mark_without_zen(result[0], _off_reason(ds_config))
        return result
    check_deepspeed_version()
    refuse_pipeline_model(a.get("model"))
    # Step 2: the ZeRO settings the override needs.
    _rewrite_zero_settings(ds_config)
    a["config"] = ds_config
    a.pop("config_params", None)
    if ds_args is not None and getattr(ds_args, "deepspeed_config", None) is not None:
        a["args"] = copy.copy(ds_args)
        a["args"].deepspeed_config = None
    # Step 3: DeepSpeed, then ZEN.
    result = orig(*bound.args, **bound.kwargs)
    attach(result[0], cfg)
    return result


def enable() -> None:
    """Make plain ``deepspeed.initialize`` attach ZEN (one line for HF Trainer / Accelerate users).

    1. Route ``deepspeed.initialize`` through ``initialize`` (Accelerate looks it up at ``prepare``).
    2. Make Accelerate leave the ``"zen"`` section alone: it treats every ``"auto"`` value of a
       DeepSpeed config as a placeholder it must fill from its own arguments and raises
       "`zen.scheme` not found in kwargs" otherwise, while ``"scheme": "auto"`` and
       ``"hierarchical": "auto"`` are zen_ext's own values (the planner, node detection).

    Example::

        >>> import zen_ext.deepspeed; zen_ext.deepspeed.enable()  # doctest: +SKIP
        >>> TrainingArguments(..., deepspeed="ds_config.json")  # a "zen" section in it now applies
    """
    import deepspeed

    global _original_initialize
    # Step 1: the initialize seam.
    if _original_initialize is None:
        _original_initialize = deepspeed.initialize
    deepspeed.initialize = _patched_initialize
    # Step 2: Accelerate's placeholder filling skips the "zen" section.
    _patch_accelerate_fill_match(True)


def disable() -> None:
    """Undo ``enable``."""
    import deepspeed

    global _original_initialize
    if _original_initialize is not None:
        deepspeed.initialize = _original_initialize
        _original_initialize = None
    _patch_accelerate_fill_match(False)


def _patch_accelerate_fill_match(on: bool) -> None:
    """Wrap (or unwrap) ``accelerate.utils.DeepSpeedPlugin.fill_match`` so that keys under ``zen.``
    are not treated as Accelerate placeholders (checked on accelerate 1.15: ``deepspeed_config_process``
    walks every leaf of the config through ``fill_match``; HF Trainer's own ``HfTrainerDeepSpeedConfig``
    only fills the keys it names, so it needs nothing). A no-op without Accelerate."""
    try:
        from accelerate.utils.dataclasses import DeepSpeedPlugin
    except ImportError:
        return
    current = DeepSpeedPlugin.fill_match
    original = getattr(current, "_zen_ext_original", None)
    if not on:
        if original is not None:
            DeepSpeedPlugin.fill_match = original
        return
    if original is not None:
        return  # already wrapped

    @functools.wraps(current)
    def fill_match(self, ds_key_long, *args, **kwargs):
        if ds_key_long == SECTION or ds_key_long.startswith(SECTION + "."):
            return None  # zen_ext's section: its "auto" values are zen_ext's choices, not placeholders
        return current(self, ds_key_long, *args, **kwargs)

    fill_match._zen_ext_original = current
    DeepSpeedPlugin.fill_match = fill_match


@functools.wraps(initialize)
def _patched_initialize(*args, **kwargs):
    return initialize(*args, **kwargs)


def _deepspeed_initialize():
    import deepspeed

    return deepspeed.initialize


def attach(engine, cfg: "ZenConfig | dict") -> "ZenDeepSpeed":
    """Attach ZEN to an initialized DeepSpeed engine; returns the attachment (also ``engine.zen``):
    ``ZenDeepSpeed``, or with ``zen.outer`` enabled ``deepspeed_outer.OuterDeepSpeed`` (local steps and the
    outer synchronization, docs/outer.md).

    Raises:
        NotImplementedError: pipeline or sequence parallelism, MoE, or what a ZeRO reduce-scatter cannot
            serve (``engines/deepspeed_zero3.py``).
    """
    if isinstance(cfg, dict):
        cfg = ZenConfig.from_dict(cfg)
    check_deepspeed_version()
    if getattr(engine, "zen", None) is not None:
        raise RuntimeError("zen: this engine already has ZEN attached")
    if cfg.outer.enabled:  # local steps and the outer sync instead of a per-step reduction
        from .deepspeed_outer import OuterDeepSpeed

        engine.zen = OuterDeepSpeed(engine, cfg)
        return engine.zen
    engine.zen = ZenDeepSpeed(engine, cfg)
    return engine.zen


def _off_reason(ds_config: dict) -> str:
    """Why ``initialize`` left an engine without ZEN, in the words a user needs."""
    if SECTION in ds_config:
        return 'the config\'s "zen" section has "enabled": false'
    near = near_miss_sections(ds_config)
    if near:
        return f'the config has no "zen" section (it has {", ".join(map(repr, near))}: a misspelling?)'
    return 'the config has no "zen" section'


def _mark_without_zen(engine, reason: str) -> None:
    """Let ``engine.zen`` on an engine without ZEN raise an AttributeError that says why.

    ``getattr(engine, "zen", None)`` still returns None (the idiom the recipes use); only a direct
    ``engine.zen.summary()`` gets the explanation instead of DeepSpeed's generic "object has no
    attribute 'zen'". DeepSpeedEngine.__getattr__ is wrapped once, for the name ``zen`` only.
    """
    cls = type(engine)
    engine.__dict__["_zen_off_reason"] = reason
    if getattr(cls.__getattr__, "_zen_ext_original", None) is not None:
        return
    original = cls.__getattr__

    @functools.wraps(original)
    def __getattr__(self, name):
        if name == "zen" and "_zen_off_reason" in self.__dict__:
            raise AttributeError(
                f"zen: ZEN is not attached to this {type(self).__name__}: {self.__dict__['_zen_off_reason']}; "
                f"DeepSpeed's dense all-reduce synchronized the gradients. Add a \"zen\" section to the config "
                f"given to zen_ext.deepspeed.initialize (or to deepspeed.initialize after "
                f"zen_ext.deepspeed.enable()); check with getattr(engine, \"zen\", None)")
        return original(self, name)

    __getattr__._zen_ext_original = original
    cls.__getattr__ = __getattr__


# --- helpers -------------------------------------------------------------------------------------------
def _all_gather_object(dist, obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _rewrite_zero_settings(ds_config: dict) -> None:
    """The ZeRO settings the overrides rely on.

    ZeRO-1/2: ``contiguous_gradients`` true (one flat bucket); ``reduce_scatter`` as the user set it
    (true: ZEN's reduce-scatter, each rank receives only its partition; ``engines/deepspeed_zero3.py``),
    false when unset (ZEN's all-reduce, each rank keeps its partition). ZeRO-3: ``reduce_scatter`` true
    (the path ZEN replaces; false would all-reduce contiguous buckets).
    """
    zero = ds_config.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    wanted = {1: (("contiguous_gradients", True),), 2: (("contiguous_gradients", True),),
              3: (("reduce_scatter", True),)}.get(stage, ())
    for key, value in wanted:
        if zero.get(key, None) not in (None, value):
            log.warning("zen: setting zero_optimization.%s = %s (was %s): ZEN's reduction needs it", key, value,
                        zero[key])
        zero[key] = value
    if stage in (1, 2) and zero.get("reduce_scatter") is not True:
        zero["reduce_scatter"] = False
