"""The FSDP2 recipe's config equivalent to a DeepSpeed config of ``bench_quality.py``.

``bench_quality.py`` builds every variant as a DeepSpeed config (the demo's settings plus the variant's
overrides); its FSDP2 variants run ``recipes/finetune_llm_fsdp.py`` on the same settings, translated here
key by key so that the two engines cannot drift apart: micro-batch, AdamW's ``lr``/``betas``/``eps``/
``weight_decay``, the gradient clip, ``WarmupLR``'s warm-up (``fsdp.warmup_steps``/``warmup_type``, the
same rate at every step: ``recipes.common.warmup_lr_factor``) and the ``zen`` section as it is. A setting
the FSDP recipe cannot reproduce (another optimizer or scheduler, accumulation, a warm-up that does not
start at 0 or peak at ``lr``, fp16/bf16) is refused, naming it.
"""

from __future__ import annotations

ADAMW_DEFAULTS = {"eps": 1e-8, "weight_decay": 0.01}
"""DeepSpeed's AdamW (``torch_adam``: torch's) where the config leaves a key out."""


def fsdp_config(ds_cfg: dict) -> dict:
    """The ``{"fsdp": ..., "zen": ...}`` config of ``recipes/finetune_llm_fsdp.py`` for ``ds_cfg``.

    1. Refuse what the FSDP recipe cannot reproduce.
    2. Copy the micro-batch, AdamW's settings, the clip and the warm-up; keep the ``zen`` section.

    Raises:
        ValueError: ``ds_cfg`` holds a setting the FSDP recipe has no equivalent of.
    """
    # Step 1: what has no equivalent.
    opt = ds_cfg.get("optimizer") or {}
    if opt.get("type", "").lower() not in ("adamw", "adam"):
        raise ValueError(f"optimizer.type ({opt.get('type')!r}) must be AdamW for the FSDP recipe")
    if ds_cfg.get("gradient_accumulation_steps", 1) != 1:
        raise ValueError(f"gradient_accumulation_steps ({ds_cfg['gradient_accumulation_steps']}) must be 1 "
                         f"for the FSDP recipe")
    for half in ("fp16", "bf16"):
        if (ds_cfg.get(half) or {}).get("enabled"):
            raise ValueError(f"{half}.enabled must be false: the FSDP variants train in fp32")
    params = opt.get("params") or {}
    sched = ds_cfg.get("scheduler")
    warmup, warmup_type = 0, "log"
    if sched is not None:
        sp = sched.get("params") or {}
        if sched.get("type") != "WarmupLR":
            raise ValueError(f"scheduler.type ({sched.get('type')!r}) must be WarmupLR (or no scheduler) for the "
                             f"FSDP recipe")
        if sp.get("warmup_min_lr", 0) != 0 or sp.get("warmup_max_lr", params["lr"]) != params["lr"]:
            raise ValueError(f"scheduler.params ({sp}) must warm up from 0 to optimizer.params.lr "
                             f"({params['lr']}) for the FSDP recipe")
        warmup, warmup_type = sp.get("warmup_num_steps", 1000), sp.get("warmup_type", "log")
    # Step 2: the equivalent settings.
    fsdp = {"micro_batch": ds_cfg["train_micro_batch_size_per_gpu"], "lr": params["lr"],
            "betas": list(params.get("betas", [0.9, 0.999])),
            "eps": params.get("eps", ADAMW_DEFAULTS["eps"]),
            "weight_decay": params.get("weight_decay", ADAMW_DEFAULTS["weight_decay"]),
            "grad_clip": ds_cfg.get("gradient_clipping", 0.0), "param_dtype": "fp32",
            "warmup_steps": warmup, "warmup_type": warmup_type}
    out = {"fsdp": fsdp}
    if ds_cfg.get("zen") is not None:
        out["zen"] = ds_cfg["zen"]
    return out
