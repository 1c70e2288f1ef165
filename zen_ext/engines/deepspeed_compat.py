"""Which DeepSpeed releases the DeepSpeed adapter serves, and the private hooks that differ between them.

The adapter overrides private DeepSpeed methods (``engines/deepspeed.py`` has the table), so a release
is served only where its tests passed: ``launch/test_deepspeed_versions.sh VERSION`` runs them against
that release with the venv's torch (docs/deepspeed.md, "DeepSpeed versions", has each line's result).

1. ``TESTED_DEEPSPEED``: the releases the adapter's tests passed on (the latest patch of each served
   minor line). ``check_version`` serves them silently; another patch of a served line gets a warning
   (patches of one line differ: 0.17.0's ZeRO-1/2 hooks take no communication dtype, 0.18.0's
   ``IPGBucket.clear`` is 0.17's, 0.19.0 lacks 0.19.8's compact partitions; ``hook_mismatch`` refuses
   a hook whose signature the overrides cannot serve, at attach); any other version is refused,
   naming the tested releases, and for a line known to lack a hook, that hook.
2. The hooks that differ between the served lines, one function each, decided from what the installed
   DeepSpeed has (an attribute, a signature), not from its version string:

   ======================================  ======================  ====================================
   hook                                    0.17.x, 0.18.x          0.19.x
   ======================================  ======================  ====================================
   ZeRO-3 ``_get_param_partition_group``   absent: the DP group    the parameter's partition group
   ZeRO-3 ``_gradient_averaging_world_     absent: the group size  the group size, or fewer ranks
   size``                                                          (AutoEP)
   ZeRO-3 result dtype of                  ``optimizer.dtype``     ``gradient_accumulation_dtype``
   ``__avg_scatter_grads``
   ZeRO-1/2 ``allreduce_and_scatter``      ``(rank, tensor)``      ``(ranks, tensor, output)``
   bucket entries
   ZeRO-1/2 ``allreduce_no_retain``        no ``output_bucket``    ``output_bucket`` (compact
                                                                   partitions of fp32 accumulation)
   ZeRO-1/2 ``copy_grads_in_partition``    ``(param)``             ``(param, group_idx=None)``
   engine ``managed_gradient_accumulation`` absent: always managed the config's setting
   ZeRO-1/2 ``IPGBucket.clear``            0.17: resets ``index``  keeps ``index`` (double buffer)
                                           (one IPG buffer in use)
   ======================================  ======================  ====================================
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

log = logging.getLogger("zen_ext.engines.deepspeed")

TESTED_DEEPSPEED = ("0.18.9", "0.19.8")
"""The DeepSpeed releases the adapter's tests passed on (``launch/test_deepspeed_versions.sh``)."""

DEFAULT_DEEPSPEED = "0.19.8"
"""The release ``launch/setup.sh`` installs and CI tests."""

MISSING_HOOKS: dict[str, str] = {
    "0.17": ("a double IPG buffer (ZeRO-1/2's IPGBucket.clear resets its index, so zen.async_sync cannot hand "
             "whole IPG buckets over) and a gradient reset after bf16 steps without ZeRO (its "
             "DeepSpeedEngine._take_model_step clears no gradient there, so each step reduces the sum of all "
             "steps' gradients, with or without zen); 0.17.6's results are in docs/deepspeed.md, "
             "\"DeepSpeed versions\""),
}
"""Minor line -> what it lacks (a private hook, a behaviour the adapter relies on), for the lines checked
with ``launch/test_deepspeed_versions.sh`` and not served; each claim read in that release's source."""

ALLOW_UNVERIFIED_ENV = "ZEN_EXT_ALLOW_UNVERIFIED_DEEPSPEED"


# --- 1. the version gate --------------------------------------------------------------------------------
def _line(version: str) -> str:
    from packaging.version import Version

    v = Version(version)
    return f"{v.major}.{v.minor}"


def version_status(version: str) -> tuple[str, str]:
    """``("tested" | "warned" | "refused", message)`` for a DeepSpeed version string.

    1. A local suffix (``0.18.9+abc``) is ignored; a release in ``TESTED_DEEPSPEED`` is tested.
    2. Another patch of a tested minor line is warned about: untested, its hooks' signatures checked at
       attach (``hook_mismatch``).
    3. Anything else is refused; a line in ``MISSING_HOOKS`` names the hook it lacks.
    """
    # Step 1: the release itself.
    public = version.split("+")[0]
    tested = ", ".join(TESTED_DEEPSPEED)
    if public in TESTED_DEEPSPEED:
        return "tested", f"deepspeed {version} is tested with zen_ext"
    line = _line(public)
    lines = {_line(v): v for v in TESTED_DEEPSPEED}
    # Step 2: a sibling patch release.
    if line in lines:
        return "warned", (f"zen_ext's DeepSpeed overrides were tested on deepspeed {tested}, not {version}: the "
                          f"signatures of the hooks it overrides are checked at attach, and every optimizer step "
                          f"checks that the override ran. Tested in this line: deepspeed=={lines[line]} "
                          f"(launch/test_deepspeed_versions.sh {public} runs the adapter's tests on yours)")
    # Step 3: refused.
    why = (f"deepspeed {line} lacks {MISSING_HOOKS[line]}" if line in MISSING_HOOKS
           else "other releases are untested")
    return "refused", (f"zen_ext overrides private DeepSpeed methods and was tested on deepspeed {tested}, found "
                       f"{version} ({why}); install one of them (launch/setup.sh installs {DEFAULT_DEEPSPEED}), or "
                       f"set {ALLOW_UNVERIFIED_ENV}=1 to try anyway (every optimizer step checks that the override "
                       f"ran)")


def check_version(version: str) -> str:
    """Serve, warn about, or refuse (RuntimeError) a DeepSpeed version (``version_status``); the override
    environment variable turns a refusal into a warning. Returns the version."""
    status, msg = version_status(version)
    if status == "refused" and os.environ.get(ALLOW_UNVERIFIED_ENV) != "1":
        raise RuntimeError(msg)
    if status != "tested":
        log.warning(msg)
    return version


def served_text() -> str:
    """The served releases, for error messages."""
    return f"deepspeed {', '.join(TESTED_DEEPSPEED)} (and other patches of those lines, with a warning)"


# --- 2. hooks that differ between the served lines ------------------------------------------------------
def managed_gradient_accumulation(engine) -> bool:
    """Whether DeepSpeed counts micro-batches (``engine.step`` ends a step only at the boundary); releases
    before 0.19 have no setting and always do."""
    fn = getattr(engine, "managed_gradient_accumulation", None)
    return True if fn is None else bool(fn())


def z3_partition_group(opt, param):
    """The group ZeRO-3 reduce-scatters ``param``'s gradient over (0.19: per parameter; before: DP)."""
    fn = getattr(opt, "_get_param_partition_group", None)
    return opt.dp_process_group if fn is None else fn(param)


def z3_averaging_world_size(opt, params, partition_world_size: int) -> int:
    """The rank count ZeRO-3 averages ``params``'s gradients over (0.19; before: the partition group's)."""
    fn = getattr(opt, "_gradient_averaging_world_size", None)
    return partition_world_size if fn is None else fn(params, partition_world_size)


def z3_result_dtype(opt):
    """The dtype ZeRO-3's ``__avg_scatter_grads`` returns its partitions in."""
    return getattr(opt, "gradient_accumulation_dtype", opt.dtype)


def scatter_entry(entry) -> tuple:
    """An ``allreduce_and_scatter`` bucket entry as ``(owner ranks, tensor, output or None)``:
    0.19 gives ``(frozenset ranks, tensor[, output])``, earlier releases ``(rank, tensor)``."""
    ranks, tensor, *rest = entry
    if isinstance(ranks, int):
        ranks = frozenset((ranks, ))
    return ranks, tensor, (rest[0] if rest else None)


def call_allreduce_no_retain(orig, bucket, communication_data_type, numel_per_bucket, rank, log_, divide,
                             process_group, output_bucket):
    """DeepSpeed's ``allreduce_no_retain``; ``output_bucket`` only where the release has it (0.19)."""
    args = (bucket, communication_data_type, numel_per_bucket, rank, log_, divide, process_group)
    if output_bucket is None:
        return orig(*args)
    return orig(*args, output_bucket)


@functools.lru_cache(maxsize=8)
def _takes_group_idx(cls) -> bool:
    return "group_idx" in inspect.signature(cls.copy_grads_in_partition).parameters


def copy_grads_in_partition(opt, param, group_idx: int) -> None:
    """ZeRO-1/2's per-parameter copy into the gradient partition (0.19 takes the group index)."""
    if _takes_group_idx(type(opt)):
        opt.copy_grads_in_partition(param, group_idx)
    else:
        opt.copy_grads_in_partition(param)


def async_ipg_unsupported(opt) -> str | None:
    """Why this release's IPG buckets cannot be handed to the worker whole, or None.

    The hand-over reduces one IPG buffer while the backward pass fills the other; DeepSpeed 0.17's
    ``IPGBucket.clear`` resets the buffer index that the caller then flips, so every bucket after the
    first lands in the same buffer and the worker would read one the backward pass is writing.
    """
    buckets = getattr(opt, "ipg_buckets", None)
    if not buckets:
        return None
    bucket_cls = type(next(iter(buckets.values())))
    probe = bucket_cls()
    probe.index = 1
    probe.clear()
    if probe.index != 1:
        return "this DeepSpeed's IPGBucket.clear resets the IPG buffer index (one buffer in use)"
    return None


def bf16_reduces_before_accumulating(engine_cls) -> bool:
    """Whether ``engine_cls._backward_epilogue`` all-reduces before ``BF16_Optimizer`` adds the micro-batch's
    gradients to its fp32 buffers (DeepSpeed before 0.19; 0.19 runs ``optimizer.backward_epilogue()``
    first). Read from the method's source: the order of the two calls is the whole difference."""
    try:
        src = inspect.getsource(engine_cls._backward_epilogue)
    except (AttributeError, OSError, TypeError):
        return False
    accumulate, reduce = src.find("optimizer.backward_epilogue()"), src.find("allreduce_gradients()")
    return accumulate != -1 and reduce != -1 and reduce < accumulate


def late_bf16_refusal(engine) -> str | None:
    """Why ZEN cannot serve this engine's BF16_Optimizer, or None.

    Without ``bf16.immediate_grad_update``, BF16_Optimizer adds each micro-batch's bf16 gradients to its
    fp32 buffers in ``backward_epilogue``; DeepSpeed before 0.19 all-reduces those buffers first, so the
    reduction sees the buffers without the last micro-batch (zeros at ``gradient_accumulation_steps`` 1)
    and every rank steps on its own gradients, with or without ZEN. ZEN would synchronize nothing.
    """
    opt = engine.optimizer
    if type(opt).__name__ != "BF16_Optimizer" or getattr(opt, "immediate_grad_update", True):
        return None
    if not bf16_reduces_before_accumulating(type(engine)):
        return None
    import deepspeed

    return (f"zen with BF16_Optimizer (bf16 with data_types.grad_accum_dtype fp32) needs "
            f"bf16.immediate_grad_update true on deepspeed {deepspeed.__version__}: its engine all-reduces the fp32 "
            f"gradient buffers before the micro-batch's gradients are added to them (DeepSpeed 0.19 reorders "
            f"DeepSpeedEngine._backward_epilogue), so no rank would receive the others' gradients; set "
            f"\"immediate_grad_update\": true in the \"bf16\" section, or use deepspeed 0.19.8")


# Each overridden method -> the parameters DeepSpeed calls it with in the served lines (the overrides take
# exactly these). A release whose method lacks one calls the override differently: refused at attach.
_ZERO_HOOKS = {"gradient_reduction_w_predivide": ("tensor", "communication_data_type"),
               "average_tensor": ("tensor", "communication_data_type"),
               "allreduce_and_scatter": ("bucket", "communication_data_type", "divide", "process_group"),
               "allreduce_no_retain": ("bucket", "communication_data_type", "rank", "divide", "process_group")}
_ENGINE_HOOKS = {"allreduce_bucket": ("bucket", "dp_group", "dp_world_size")}


def hook_mismatch(engine, zero_reduces: bool) -> str | None:
    """The first overridden method whose signature lacks a parameter the override is called with, as an
    error message, or None (ZeRO-1/2: the ZeRO optimizer's reduction methods; otherwise the engine's)."""
    owner, hooks = (engine.optimizer, _ZERO_HOOKS) if zero_reduces else (engine, _ENGINE_HOOKS)
    for name, wanted in hooks.items():
        fn = getattr(type(owner), name, None)
        if fn is None:
            return (f"zen overrides {type(owner).__name__}.{name}, which this DeepSpeed lacks; supported: "
                    f"{served_text()}")
        have = inspect.signature(fn).parameters
        lacking = [w for w in wanted if w not in have]
        if lacking:
            return (f"zen overrides {type(owner).__name__}.{name}({', '.join(wanted)}), but this DeepSpeed's takes "
                    f"({', '.join(p for p in have if p != 'self')}): no {', '.join(lacking)}; supported: "
                    f"{served_text()}")
    return None


def checkpoint_tag(engine, tag: str | None) -> str:
    """The tag ``engine.save_checkpoint(dir, tag)`` writes: DeepSpeed's default (``global_step<N>``),
    resolved before the save increments anything, when ``tag`` is None."""
    return tag if tag is not None else f"global_step{engine.global_steps}"


def loaded_tag(load_dir: str, tag: str | None) -> str:
    """The tag ``engine.load_checkpoint(dir, tag)`` read: the ``latest`` file's when ``tag`` is None."""
    if tag is not None:
        return tag
    with open(os.path.join(load_dir, "latest")) as f:
        return f.read().strip()

