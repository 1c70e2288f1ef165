"""The time-to-quality benchmark's variants: what each one changes, the DeepSpeed config it runs, the dense
run it is measured against and the emulated-cluster measurement that times its step.

A variant is a set of overrides of the demo's ``zen.dgc`` section (``configs/demo_ds.json``); keys starting
with ``_`` are the benchmark's own (the engine, the optimizer, the schedule, how the run is launched:
``ds_config`` lists them). ``bench_quality.py`` runs them (``quality_runs.py``) and reports them
(``quality_report.py``, ``quality_bytes.py``).
"""

from __future__ import annotations

import copy
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS: dict[str, dict | None] = {
    # name → overrides of the demo's zen.dgc section; None: dense DeepSpeed (no zen section).
    "dense": None,
    "natural": {"enabled": False},
    "dgc5": {},
    "dgc1": {"density": 0.01},
    "dgc5_warm100": {"warmup_steps": 100},
    "dgc5_dense_start": {"warmup_steps": 60, "warmup_start_density": 1.0},
    "dgc5_head_dense": {"dense_params": ["lm_head"]},
    "dgc5_head_dense_warm100": {"dense_params": ["lm_head"], "warmup_steps": 100},
    "dgc1_head_dense_warm100": {"density": 0.01, "dense_params": ["lm_head"], "warmup_steps": 100},
    # A learning-rate check: Adam divides each coordinate by its recent RMS, so a coordinate that DGC
    # sends once every T steps as a T-step sum moves about sqrt(T) times less than dense (a smaller
    # effective learning rate). If twice the rate closes much of the gap, that is the cause; dense at
    # twice the rate says whether the baseline itself was tuned.
    "dense_lr2x": {"_lr_scale": 2.0, "_dense": True},
    "dgc5_lr2x": {"_lr_scale": 2.0},
    # Dense while Adam's second moment learns, then DGC.
    "dgc5_dense60": {"dense_steps": 60},
    # A check of the pipeline itself: DGC's path at density 1 all run long must track dense.
    "dgc_density1": {"dense_steps": 100000},
    "dgc5_per_bucket": {"selection": "per_bucket"},
    # DGC's residual in 4 bits with block-wise min/max (MicroAdam's error feedback; 0.53 bytes per element
    # against fp32's 4): benchmarks/quality/results/residual_int4.md.
    "dgc5_int4": {"residual_dtype": "int4"},
    "dgc5_int4_sr": {"residual_dtype": "int4", "int4_rounding": "stochastic"},
    # zen.dgc.value_bits (docs/sparsifiers.md): the selected values on the wire in 8 or 4 bits, error feedback
    # at the sender (DGC's residual) and at each ZEN owner (owner residual; _noowner: off, to show what it buys).
    "dgc5_v8": {"value_bits": 8},
    "dgc5_v4": {"value_bits": 4},
    "dgc5_v4_noowner": {"value_bits": 4, "owner_error_feedback": False},
    "dgc5_v4_int4": {"value_bits": 4, "residual_dtype": "int4"},
    "dgc1_v8": {"density": 0.01, "value_bits": 8},
    "dgc1_v4": {"density": 0.01, "value_bits": 4},
    "dgc1_v4_noowner": {"density": 0.01, "value_bits": 4, "owner_error_feedback": False},
    "dgc10": {"density": 0.10},
    "dgc20": {"density": 0.20},
    "dgc25": {"density": 0.25},  # about the elements dgc5_attn_dense sends (26 % of the non-embedding gradient)
    # The sampled threshold search against the exact top-k (one sort per tensor): does the estimate's
    # error (units keep 0.8-1.25 k) cost quality?
    "dgc5_exact": {"threshold": "exact"},
    # Where the gradient is clipped. DeepSpeed clips the *synchronized* gradient's global norm (1.0 in the
    # demo): under DGC that gradient is the top-k of residuals that accumulated for ~1/density steps, a
    # norm several times dense's, so the clip scales every step down (a smaller effective rate) and the
    # clipped-away part is lost to error feedback too. DGC's own recipe clips each local gradient before
    # it enters the residual (zen.dgc.clip_norm) and leaves the sparse sum alone.
    "dense_noclip": {"_dense": True, "_ds_clip": 0.0},
    "dgc5_noclip": {"_ds_clip": 0.0},
    "dgc1_noclip": {"density": 0.01, "_ds_clip": 0.0},
    # A bound on how long error feedback holds a coordinate back, at equal density: a rotating stride
    # of residuals (the same on every rank) takes 20 % / 50 % of the budget (zen.dgc.flush_fraction).
    "dgc5_flush20": {"flush_fraction": 0.2},
    "dgc5_flush50": {"flush_fraction": 0.5},
    # Adam's second moment remembering longer (beta2 0.999, Adam's default, against the demo's 0.95): after
    # a burst that error feedback releases, v decays as sqrt(beta2)^t while m decays as beta1^t, so a burst
    # keeps moving the weight for longer; dense with the same betas is the paired baseline.
    "dense_b2_999": {"_beta2": 0.999, "_dense": True},
    "dgc5_b2_999": {"_beta2": 0.999},
    # Which layers stay dense: attention (q, k, v, o: 16 K elements per layer) or the MLP (24 K per
    # layer); the output layer (64 K) is dgc5_head_dense. Dense layers send more bytes than 5 %.
    "dgc5_attn_dense": {"dense_params": ["self_attn"]},
    "dgc5_mlp_dense": {"dense_params": [r"\.mlp\."]},
    # A decaying learning rate, as fine-tuning recipes use (HF Trainer decays linearly by default): cosine
    # from the peak to 10 % of it over the run (DeepSpeed's WarmupCosineLR, the same 10 warm-up steps),
    # dense paired on the same schedule. Error feedback releases a coordinate's residual late; at a
    # decaying rate a late step moves the weights less, and so does the noise of its delay.
    "dense_cosine": {"_cosine": 0.1, "_dense": True},
    "dgc5_cosine": {"_cosine": 0.1},
    "dgc1_cosine": {"density": 0.01, "_cosine": 0.1},
    "dgc10_cosine": {"density": 0.10, "_cosine": 0.1},
    "dgc20_cosine": {"density": 0.20, "_cosine": 0.1},
    # On the decaying rate, a cheap way to spend more than 5 %: a longer density ramp (25 % → 5 % over
    # 100 steps).
    "dgc5_cosine_warm100": {"warmup_steps": 100, "_cosine": 0.1},
    "dgc1_cosine_warm100": {"density": 0.01, "warmup_steps": 100, "_cosine": 0.1},
    # The paper configs' selection (one threshold per 128 MB bucket, as ZEN's paper applies DGC to DDP's
    # fused buckets) on the decaying rate.
    "dgc5_cosine_per_bucket": {"selection": "per_bucket", "_cosine": 0.1},
    # The same decay to 0, as HF Trainer's linear schedule ends.
    "dense_cosine0": {"_cosine": 0.0, "_dense": True},
    "dgc5_cosine0": {"_cosine": 0.0},
    "dgc1_cosine0": {"density": 0.01, "_cosine": 0.0},
    # A burst error feedback releases after k steps taken as k steps' worth by the optimizer
    # (zen_ext.optim.CatchUpAdamW, the recipe's --catch_up_adam): a zero gradient waits, a burst G moves
    # the weight as k steps of mean G/k and mean square G²/k would. Dense on the same optimizer is paired
    # (it differs from AdamW only where a gradient is exactly zero: embedding rows no batch touched).
    "dense_catchup": {"_catch_up": True, "_dense": True},
    "dgc5_catchup": {"_catch_up": True},
    "dgc1_catchup": {"density": 0.01, "_catch_up": True},
    "dgc10_catchup": {"density": 0.10, "_catch_up": True},
    "dgc5_catchup_warm100": {"warmup_steps": 100, "_catch_up": True},
    "dense_cosine_catchup": {"_catch_up": True, "_dense": True, "_cosine": 0.1},
    "dgc5_cosine_catchup": {"_catch_up": True, "_cosine": 0.1},
    "dgc1_cosine_catchup": {"density": 0.01, "_catch_up": True, "_cosine": 0.1},
    # CatchUpAdamW with the other levers, from scratch at the demo's settings (a 20-step ramp): does any
    # close the rest of the gap there? (DeepSpeed's global clip off; local clipping instead; a rotating
    # flush; exact selection; the output layer dense; a 50-step ramp.)
    "dgc5_catchup_noclip": {"_catch_up": True, "_ds_clip": 0.0},
    "dgc5_catchup_localclip": {"_catch_up": True, "clip_norm": 1.0, "_ds_clip": 0.0},
    "dgc5_catchup_flush20": {"_catch_up": True, "flush_fraction": 0.2},
    "dgc5_catchup_exact": {"_catch_up": True, "threshold": "exact"},
    "dgc5_catchup_head_dense": {"_catch_up": True, "dense_params": ["lm_head"]},
    "dgc5_catchup_warm50": {"_catch_up": True, "warmup_steps": 50},
    "dgc5_catchup_flush10": {"_catch_up": True, "flush_fraction": 0.1},
    "dgc5_catchup_flush50": {"_catch_up": True, "flush_fraction": 0.5},
    "dgc1_catchup_flush20": {"density": 0.01, "_catch_up": True, "flush_fraction": 0.2},
    "dgc10_catchup_flush20": {"density": 0.10, "_catch_up": True, "flush_fraction": 0.2},
    # zen.dgc's defaults before the density ramp became one (only enabled and density set, warmup_steps
    # pinned to 0), as docs/results/time_to_quality_history.md's "+9.2 %" row was measured, with each optimizer.
    "dgc5_defaults": {"_dgc_defaults": True},
    "dgc5_defaults_catchup": {"_dgc_defaults": True, "_catch_up": True},
    "dgc5_defaults_catchup_flush20": {"_dgc_defaults": True, "_catch_up": True, "flush_fraction": 0.2},
    "dgc5_defaults_catchup_flush10": {"_dgc_defaults": True, "_catch_up": True, "flush_fraction": 0.1},
    # The same with a density ramp (DGC's warm-up, 25 % → 5 %) of 20 / 50 / 100 steps: which length, if
    # any, should zen.dgc.warmup_steps default to?
    "dgc5_defaults_catchup_flush10_warm20": {"_dgc_defaults": True, "_catch_up": True, "flush_fraction": 0.1,
                                             "warmup_steps": 20},
    "dgc5_defaults_catchup_flush10_warm50": {"_dgc_defaults": True, "_catch_up": True, "flush_fraction": 0.1,
                                             "warmup_steps": 50},
    "dgc5_defaults_catchup_flush10_warm100": {"_dgc_defaults": True, "_catch_up": True, "flush_fraction": 0.1,
                                              "warmup_steps": 100},
    # What the recipe does when told nothing: the demo's config, the optimizer and flush it chooses
    # (CatchUpAdamW, and zen.dgc.flush_fraction null decided for it). It must equal the variant whose
    # choices it makes (dgc5_catchup_flush10).
    "dgc5_recipe_default": {"_recipe_default": True},
    # The project's defaults end to end: only enabled and density set, and the recipe choosing the rest
    # (CatchUpAdamW, flush 0.1, the default 100-step ramp). It must equal dgc5_defaults_catchup_flush10_warm100.
    "dgc5_project_defaults": {"_dgc_defaults": True, "_recipe_default": True},
    "dgc1_project_defaults": {"_dgc_defaults": True, "_recipe_default": True, "density": 0.01},  # no flush at 1 %
    "dgc10_catchup_flush10": {"density": 0.10, "_catch_up": True, "flush_fraction": 0.1},
    "dgc1_catchup_flush10": {"density": 0.01, "_catch_up": True, "flush_fraction": 0.1},
    # Under ZeRO-3 (docs/deepspeed_zero3.md): zero_optimization from configs/demo_ds_zero3.json (parameters, gradients and
    # optimizer state sharded; ZEN's sparse reduce-scatter) in place of the demo's ZeRO-1, everything else
    # as the ZeRO-1 variant of the same name; each measured against dense ZeRO-3 of the same seed.
    "dense_zero3": {"_dense": True, "_zero3": True},
    "dgc5_project_defaults_zero3": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True},
    # ZeRO-3 on 2 emulated nodes × 2 ranks (quality_nodes.py: one DeepSpeed launcher per node, ZEN_EXT_HOST
    # names it), DGC 5 % at the project's defaults flat (every rank's DGC on the whole bucket) against
    # node-level (docs/deepspeed_zero3.md: dense reduce-scatter inside the node, DGC on the node's sum of
    # the rank's shard across nodes), with the fp32 and the 4-bit residual; against dense ZeRO-3 at 2 × 2.
    "dense_zero3_2x2": {"_dense": True, "_zero3": True, "_nodes": 2},
    "dgc5_zero3_2x2_flat": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True, "_nodes": 2,
                            "_hierarchical": False},
    "dgc5_zero3_2x2_node": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True, "_nodes": 2,
                            "_hierarchical": True},
    "dgc5_zero3_2x2_node_int4": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True, "_nodes": 2,
                                 "_hierarchical": True, "residual_dtype": "int4"},
    # zen.dgc.value_bits on the node-level path: the node's sums across nodes in 8 or 4 bits, error feedback
    # at the sending node (DGC's residual) and at the owning node (owner residual; _noowner: off).
    "dgc5_zero3_2x2_node_v8": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True, "_nodes": 2,
                               "_hierarchical": True, "value_bits": 8},
    "dgc5_zero3_2x2_node_v4": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True, "_nodes": 2,
                               "_hierarchical": True, "value_bits": 4},
    "dgc5_zero3_2x2_node_v4_noowner": {"_dgc_defaults": True, "_recipe_default": True, "_zero3": True,
                                       "_nodes": 2, "_hierarchical": True, "value_bits": 4,
                                       "owner_error_feedback": False},
    # SparDL (docs/spardl.md) in place of ZEN at the project's defaults: the same DGC section (its density,
    # ramp, CatchUpAdamW and flush), scheme spardl selecting k/P per block itself, with the seed's global
    # residual or only the local one (zen.spardl.residual); measured against dense of the same seed.
    "spardl5_global": {"_dgc_defaults": True, "_recipe_default": True, "_scheme": "spardl",
                       "_spardl_residual": "global"},
    "spardl5_local": {"_dgc_defaults": True, "_recipe_default": True, "_scheme": "spardl",
                      "_spardl_residual": "local"},
    "spardl1_global": {"_dgc_defaults": True, "_recipe_default": True, "density": 0.01, "_scheme": "spardl",
                       "_spardl_residual": "global"},
    "spardl1_local": {"_dgc_defaults": True, "_recipe_default": True, "density": 0.01, "_scheme": "spardl",
                      "_spardl_residual": "local"},
    # Under FSDP2 (recipes/finetune_llm_fsdp.py under torchrun; quality_fsdp.fsdp_config translates the
    # ZeRO-3 variant's DeepSpeed config: same AdamW, clip, warm-up, micro-batch and zen section), each
    # measured against dense FSDP2 of the same seed: the project defaults (CatchUpAdamW) and the same
    # zen section with the config's plain AdamW (``_plain_adam``: --plain_adam, nothing else changed).
    "dense_fsdp": {"_dense": True, "_fsdp": True},
    "dgc5_project_defaults_fsdp": {"_dgc_defaults": True, "_recipe_default": True, "_fsdp": True},
    "dgc5_project_defaults_fsdp_plain_adam": {"_dgc_defaults": True, "_recipe_default": True, "_fsdp": True,
                                              "_plain_adam": True},
    "dgc5_localclip": {"clip_norm": 1.0, "_ds_clip": 0.0},
    "dgc1_localclip": {"density": 0.01, "clip_norm": 1.0, "_ds_clip": 0.0},
}
STEP_TIME_CONFIG = {"dense": "dense", "dense_lr2x": "dense", "dense_noclip": "dense",
                    "dense_b2_999": "dense", "dense_cosine": "dense", "dense_cosine0": "dense",
                    "dense_catchup": "dense", "dense_cosine_catchup": "dense", "dense_zero3": "dense",
                    "dense_fsdp": "dense", "dense_zero3_2x2": "dense",
                    "natural": "zen_natural",
                    "dgc_density1": "dense",
                    # no emulated-cluster measurement of SparDL: its time columns stay empty
                    "spardl5_global": "spardl", "spardl5_local": "spardl",
                    "spardl1_global": "spardl", "spardl1_local": "spardl"}
"""Which emulated-cluster measurement times a variant's step: DGC variants take the ``zen_dgc<d>`` of
their density; the per-step time of a variant with more dense tensors is then a lower bound."""



def ds_config(variant: str, steps: int | None = None) -> dict:
    """Step 1: the demo's DeepSpeed config with the variant's ``zen.dgc`` overrides (keys starting with
    ``_`` are the benchmark's own: ``_dense`` for DeepSpeed without zen, ``_lr_scale`` for the rate,
    ``_beta1`` / ``_beta2`` for AdamW's betas, ``_ds_clip`` for DeepSpeed's gradient clipping,
    ``_cosine`` for a cosine decay over the run's ``steps`` to that fraction of the rate, ``_dgc_defaults``
    for a ``zen.dgc`` section of only ``enabled`` and ``density`` in place of the demo's, ``_zero3`` for
    ``configs/demo_ds_zero3.json``'s ZeRO-3 ``zero_optimization`` and zen scheme in place of ZeRO-1's,
    ``_fsdp`` for the FSDP2 recipe: the ``_zero3`` config, which ``quality_fsdp.fsdp_config`` translates;
    ``_plain_adam`` is a recipe argument)."""
    spec = copy.deepcopy(VARIANTS[variant]) if VARIANTS[variant] is not None else {"_dense": True}
    lr_scale, dense = spec.pop("_lr_scale", 1.0), spec.pop("_dense", False)
    spec.pop("_catch_up", None), spec.pop("_plain_adam", None)  # recipe arguments (run_one)
    beta1, beta2 = spec.pop("_beta1", None), spec.pop("_beta2", None)
    ds_clip = spec.pop("_ds_clip", None)
    cosine = spec.pop("_cosine", None)
    dgc_defaults = spec.pop("_dgc_defaults", False)
    recipe_default = spec.pop("_recipe_default", False)
    zero3 = spec.pop("_zero3", False) | spec.pop("_fsdp", False)  # FSDP2 shards as ZeRO-3 does
    scheme, residual = spec.pop("_scheme", None), spec.pop("_spardl_residual", None)
    spec.pop("_nodes", None)  # how the run is launched (run_one)
    hierarchical = spec.pop("_hierarchical", None)
    with open(os.path.join(ROOT, "configs/demo_ds_dense.json" if dense else "configs/demo_ds.json")) as f:
        cfg = json.load(f)
    if not dense:
        if dgc_defaults:  # zen.dgc's defaults, not the demo's settings
            cfg["zen"]["dgc"] = {"enabled": True, "density": 0.05}
        if not recipe_default:  # no flush unless the variant asks (null would choose one for CatchUpAdamW)
            cfg["zen"]["dgc"]["flush_fraction"] = 0.0
            cfg["zen"]["dgc"].setdefault("warmup_steps", 0)  # nor the default ramp (the demo's sets its own)
        cfg["zen"]["dgc"].update(spec)
        cfg["zen"]["stats"] = {"summary": False}
        if scheme is not None:  # a named scheme: the ZeRO-1 demo's planner has nothing to choose
            cfg["zen"]["scheme"] = scheme
            cfg["zen"].pop("planner", None)
            if residual is not None:
                cfg["zen"]["spardl"] = {"residual": residual}
    if zero3:  # ZeRO-3's sharding and ZEN's reduce-scatter, as the ZeRO-3 demo sets them
        with open(os.path.join(ROOT, "configs/demo_ds_zero3.json")) as f:
            zero3_cfg = json.load(f)
        cfg["zero_optimization"] = zero3_cfg["zero_optimization"]
        if not dense:  # the ZeRO-3 demo names its scheme; the ZeRO-1 demo's planner has nothing to choose
            cfg["zen"]["scheme"] = zero3_cfg["zen"]["scheme"]
            cfg["zen"].pop("planner", None)
    if hierarchical is not None and not dense:
        cfg["zen"]["hierarchical"] = hierarchical
    if beta1 is not None:
        cfg["optimizer"]["params"]["betas"][0] = beta1
    if beta2 is not None:
        cfg["optimizer"]["params"]["betas"][1] = beta2
    if ds_clip is not None:
        cfg["gradient_clipping"] = ds_clip
    if lr_scale != 1.0:
        cfg["optimizer"]["params"]["lr"] *= lr_scale
        cfg["scheduler"]["params"]["warmup_max_lr"] *= lr_scale
    if cosine is not None:
        if steps is None:
            raise ValueError(f"variant {variant} decays its rate over the run: ds_config needs its steps")
        warmup = cfg["scheduler"]["params"]["warmup_num_steps"]
        cfg["scheduler"] = {"type": "WarmupCosineLR",  # scales the optimizer's lr by a ratio: peak = lr
                            "params": {"total_num_steps": steps, "warmup_num_steps": warmup,
                                       "warmup_min_ratio": 0.0, "cos_min_ratio": cosine}}
    return cfg


def baseline_of(variant: str) -> str:
    """The dense run a variant is measured against: dense on the same learning-rate schedule (a decaying
    rate changes dense's loss too, so DGC on it is compared with dense on it) and the same ZeRO stage."""
    spec = VARIANTS[variant] or {}
    cosine, zero3, fsdp = spec.get("_cosine"), spec.get("_zero3", False), spec.get("_fsdp", False)
    nodes = spec.get("_nodes", 0)
    if cosine is None and not zero3 and not fsdp:
        return "dense"
    return next(v for v, s in VARIANTS.items()
                if s and s.get("_dense") and s.get("_cosine") == cosine and s.get("_zero3", False) == zero3
                and s.get("_fsdp", False) == fsdp and s.get("_nodes", 0) == nodes)


def step_time_key(variant: str) -> str:
    """The ``bench_e2e.py`` configuration whose measured step time times ``variant`` (``STEP_TIME_CONFIG``)."""
    if variant in STEP_TIME_CONFIG:
        return STEP_TIME_CONFIG[variant]
    density = (VARIANTS[variant] or {}).get("density", 0.05)
    return f"zen_dgc{round(density * 100)}"


