"""Time to quality: dense vs natural-only vs DGC variants, at equal steps and to a target loss.

Each run is the DeepSpeed recipe (``recipes/finetune_llm.py``) on 2 CPU ranks with the demo's tiny Llama
and DeepSpeed settings (``configs/demo_ds.json``: AdamW lr 3e-3, ZeRO-1; the ``*_zero3`` variants take
ZeRO-3 from ``configs/demo_ds_zero3.json``; the ``*_fsdp*`` variants run the FSDP2 recipe
``recipes/finetune_llm_fsdp.py`` under torchrun on the ZeRO-3 variant's settings, translated by
``benchmarks/quality/quality_fsdp.py``, fine-tuning from the same DeepSpeed-pretrained HF checkpoint), one variant's
``zen`` section and one seed (model initialization, data order and eval split), in two settings:

* ``scratch``: random initialization, the whole built-in text, ``--scratch_steps`` steps;
* ``finetune``: from a model pretrained densely on the first half of the text (built once, cached in
  ``<runs>/pretrained``), fine-tuned on the second half (documents it has not seen).

Steps:
1. Build each variant's DeepSpeed config from the demo's (``VARIANTS``: overrides of ``zen.dgc``).
2. Run every (setting, variant, seed) that has no result yet (a run's ``summary.json`` is its result, so
   an interrupted sweep resumes), with a progress line per run.
3. Report per setting, against dense *of the same seed* (paired; on a decaying learning rate, against
   dense on that schedule: ``baseline_of``): eval loss at equal steps (median and
   min–max over seeds), the gap to dense, steps to the target (dense's final eval loss + 1 %, linear
   between evaluations) and time to the target with per-step times measured in the emulated cluster
   (``benchmarks/cluster/results/cluster_e2e.jsonl``, 4 hosts at 1 Gbit/s), and plot the curves against steps
   and against that time.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/bench_quality.py --seeds 0 1 2 \\
        --variants dense natural dgc5 dgc1 --out benchmarks/quality/results/time_to_quality.md
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

import quality_fsdp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = "configs/models/llama-tiny-untied.json"
RUN_TIMEOUT_S = 1200
DIVERGED = 1.05
"""A run whose final eval loss exceeds its best by more than this factor got worse as it trained (it blew
up, or regressed from an early best): its best is then an early point that says
nothing of reaching dense's quality, so it gets no equal-loss ratio and is counted as diverged."""
PLOT_LAB = (4, "1gbit")
PLOT_VARIANTS = ("dense", "dgc5", "dgc1", "dgc5_catchup")
"""The curves the plot shows (all variants would not be readable); the tables show every variant."""
"""The emulated-cluster setting whose measured step times put the curves on a time axis."""
TARGET_MARGIN = 0.01
"""The target is dense's final eval loss (same seed) times ``1 + TARGET_MARGIN``."""

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


def free_port() -> int:
    """A port no process listens on now (a fixed one collides with other jobs on a shared machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args_list: list[str], log_path: str, port: int | None = None, fsdp: bool = False,
            nodes: int = 0) -> float:
    """Run the recipe on 2 ranks (the DeepSpeed recipe under its launcher, or with ``fsdp`` the FSDP2 recipe
    under torchrun), or with ``nodes`` on that many emulated nodes of 2 ranks (``quality_nodes.py``);
    returns its wall time in seconds. Raises on a failed run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    port = port or free_port()
    if nodes:
        import quality_nodes

        return quality_nodes.launch_nodes("recipes/finetune_llm.py", args_list, log_path, port, nodes, 2,
                                          ROOT, env, RUN_TIMEOUT_S * nodes)
    if fsdp:
        cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
               "--master_port", str(port), "recipes/finetune_llm_fsdp.py", *args_list]
    else:
        cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
               "--master_port", str(port), "recipes/finetune_llm.py", *args_list]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:  # a run of this size takes about a minute; a stuck rendezvous must not stall the sweep
            rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        raise RuntimeError(f"run failed (exit {rc}): {' '.join(cmd)}; see {log_path}")
    return time.perf_counter() - t0


def pretrained(runs: str, steps: int) -> str:
    """The dense model pretrained on the first half of the text (built once per ``runs`` folder)."""
    path = os.path.join(runs, "pretrained")
    if not os.path.exists(os.path.join(path, "config.json")):
        out = os.path.join(runs, "pretrain_run")
        os.makedirs(out, exist_ok=True)
        cfg = os.path.join(out, "ds_config.json")
        with open(cfg, "w") as f:
            json.dump(ds_config("dense"), f)
        print(f"pretraining the fine-tuning start ({steps} dense steps on the first half) ...", flush=True)
        _launch(["--deepspeed_config", cfg, "--model", MODEL, "--data", "pydoc", "--data_part", "first",
                 "--tokenizer", "train", "--steps", str(steps), "--output_dir", out, "--save_model", path],
                os.path.join(out, "log.txt"))
    return path


def _key_of(cfg: dict, run_args: list[str]) -> list:
    """What identifies a run for the cache: its config and arguments, less what only spells out the
    behaviour every earlier run had implicitly (``--plain_adam``, ``zen.dgc.flush_fraction: 0`` and
    ``zen.dgc.warmup_steps: 0``, before CatchUpAdamW, its flush and the density ramp became defaults), so
    those cached results stay valid."""
    cfg = copy.deepcopy(cfg)
    dgc = (cfg.get("zen") or {}).get("dgc") or {}
    for name in ("flush_fraction", "warmup_steps"):
        if dgc.get(name) == 0:
            del dgc[name]
    return [cfg, [a for a in run_args if a != "--plain_adam"]]


def run_one(runs: str, setting: str, variant: str, seed: int, steps: int, eval_every: int,
            start: str | None, port: int) -> dict:
    """Step 2: one run (or its cached result): eval curve, train losses and wall time."""
    cfg = ds_config(variant, steps)
    run_args = ["--data", "pydoc", "--steps", str(steps), "--eval_every", str(eval_every), "--seed", str(seed)]
    spec = VARIANTS[variant] or {}
    if spec.get("_catch_up"):
        run_args += ["--catch_up_adam"]
    elif spec.get("_plain_adam") or not spec.get("_recipe_default"):
        run_args += ["--plain_adam"]  # the config's AdamW, which the recipe otherwise swaps for CatchUpAdamW
    if setting == "finetune":
        run_args += ["--model", start, "--tokenizer", start, "--data_part", "second"]
    else:
        run_args += ["--model", MODEL, "--tokenizer", "train"]
    fsdp = spec.get("_fsdp", False)
    if fsdp:  # the same settings in the FSDP recipe's config; --plain_adam is part of its identity
        cfg = quality_fsdp.fsdp_config(cfg)
        key = hashlib.sha1(json.dumps(["fsdp", cfg, run_args]).encode()).hexdigest()[:12]
    else:
        key = hashlib.sha1(json.dumps(_key_of(cfg, run_args) + ([["nodes", spec["_nodes"]]] if spec.get("_nodes")
                                                                else [])).encode()).hexdigest()[:12]
    out = os.path.join(runs, setting, variant, f"seed{seed}")
    result_path = os.path.join(out, "result.json")
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
        if result.get("key") == key:
            return result
    os.makedirs(out, exist_ok=True)
    cfg_path = os.path.join(out, "fsdp_config.json" if fsdp else "ds_config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)
    wall_s = _launch(["--config" if fsdp else "--deepspeed_config", cfg_path, "--output_dir", out, *run_args],
                     os.path.join(out, "log.txt"), port, fsdp=fsdp, nodes=spec.get("_nodes", 0))
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "train_log.jsonl")) as f:  # cumulative bytes per rank (zen runs only)
        sent = [[r["step"], r["bytes_sent"], r["dense_bytes"]] for r in map(json.loads, f) if "bytes_sent" in r]
    result = {"key": key, "setting": setting, "variant": variant, "seed": seed, "steps": steps,
              "eval": summary["eval"], "losses": summary["losses"], "wall_s": wall_s, "bytes": sent}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return result


def steps_to(evals: list[list[float]], target: float) -> float | None:
    """The first step where the eval loss reaches ``target`` (linear between evaluations); None: never."""
    prev = None
    for step, loss in evals:
        if loss <= target:
            if prev is None or prev[1] == loss:
                return float(step)
            s0, l0 = prev
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        prev = (step, loss)
    return None


def cluster_step_s(path: str) -> dict[tuple[int, str], dict[str, float]]:
    """Median step seconds measured end to end in the emulated cluster: ``{(hosts, rate): {config: s}}``
    for every lab setting where dense was measured (``bench_e2e.py``'s records)."""
    out: dict[tuple[int, str], dict[str, float]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("bench") == "e2e":
                    out.setdefault((rec["n"], rec["rate"]), {})[rec["config"]] = rec["step_s_med"]
    return {k: v for k, v in sorted(out.items()) if "dense" in v}


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
    if variant in STEP_TIME_CONFIG:
        return STEP_TIME_CONFIG[variant]
    density = (VARIANTS[variant] or {}).get("density", 0.05)
    return f"zen_dgc{round(density * 100)}"


def _fmt_range(values: list[float], fmt: str) -> str:
    if not values:
        return "–"
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def report(results: list[dict], step_s: dict[str, float], plot_path: str | None,
           plot_variants=PLOT_VARIANTS) -> str:
    """Step 3: the markdown tables (and the plot) of every setting.

    Everything is paired by seed (a seed fixes the initialization, the data order and the eval split):
    a variant's gap and its target are against its dense baseline (``baseline_of``) of the same seed;
    medians and ranges are over seeds.
    """
    lines = []
    for setting in ("scratch", "finetune"):
        rows = [r for r in results if r["setting"] == setting]
        by = {}
        for r in rows:
            by.setdefault(r["variant"], {})[r["seed"]] = r
        # The checkpoints and the seed list come from dense (ZeRO-1), else from another baseline present.
        dense = by.get("dense") or next((by[baseline_of(v)] for v in by if baseline_of(v) in by), {})
        if not dense:
            continue
        steps = rows[0]["steps"]
        checkpoints = sorted({s for d in dense.values() for s, _ in d["eval"]})
        marks = [c for c in checkpoints if c in (steps // 4, steps // 2, steps)] or checkpoints[-1:]
        labs = list(step_s)
        lines += [f"### {setting}: {steps} steps, seeds {sorted(dense)}", "",
                  "| variant | " + " | ".join(f"eval @ {m}" for m in marks) + f" | gap to dense @ {steps}"
                  + f" | reaches dense + {TARGET_MARGIN:.0%} (seeds; median step) | steps × dense to equal loss | "
                  + " | ".join(f"time × dense, {n} hosts {rate}" for n, rate in labs) + " |",
                  "|---|" + "---|" * (len(marks) + 3 + len(labs))]
        for variant, seeds in by.items():
            base = by.get(baseline_of(variant), {})
            paired = {s: r for s, r in seeds.items() if s in base}
            evals_at = [[dict(map(tuple, r["eval"]))[m] for r in paired.values() if m in dict(map(tuple, r["eval"]))]
                        for m in marks]
            gaps, reach, equal, diverged = [], [], [], 0
            for s, r in paired.items():
                d_final, final = base[s]["eval"][-1][1], r["eval"][-1][1]
                gaps.append(100 * (final / d_final - 1))
                reach.append(steps_to(r["eval"], d_final * (1 + TARGET_MARGIN)))
                # Equal loss: the steps this run needs to reach its best eval loss over the steps dense
                # needs to reach it (eval loss is noisy late in a run, so the best, not the last). A run
                # better than dense anywhere counts as at most its steps over dense's.
                best = min(loss for _, loss in r["eval"])
                if not final < DIVERGED * best:  # a run that blew up has no equal-loss point
                    diverged += 1
                    continue
                d_steps = steps_to(base[s]["eval"], best)
                equal.append(steps_to(r["eval"], best) / (d_steps or steps))
            reached = [x for x in reach if x is not None]
            times = []
            for lab in labs:
                st, dense_st = step_s[lab].get(step_time_key(variant)), step_s[lab]["dense"]
                times.append(f"**{_fmt_range([q * st / dense_st for q in equal], '.2f')}×**" if st and equal else "–")
            label = variant if len(paired) == len(dense) else f"{variant} ({len(paired)} seed{'s' * (len(paired) > 1)})"
            if baseline_of(variant) not in ("dense", variant):
                label += f" (against {baseline_of(variant)})"
            cells = [label, *(_fmt_range(v, ".4f") for v in evals_at), f"{_fmt_range(gaps, '+.2f')} %",
                     f"{len(reached)}/{len(reach)}" + (f"; {statistics.median(reached):.0f}" if reached else ""),
                     (_fmt_range(equal, ".2f") + "×" if equal else "–") + (f" ({diverged} diverged)" if diverged else ""),
                     *times]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if plot_path:
        _plot(results, step_s, plot_path, plot_variants)
    return "\n".join(lines)


def _plot(results: list[dict], step_s: dict[str, float], path: str, plot_variants=PLOT_VARIANTS) -> None:
    """Eval loss (median over seeds) against steps and against emulated-cluster time, per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if r["variant"] in plot_variants] or results
    settings = [s for s in ("scratch", "finetune") if any(r["setting"] == s for r in results)]
    fig, axes = plt.subplots(len(settings), 2, figsize=(11, 3.8 * len(settings)), squeeze=False)
    for row, setting in zip(axes, settings):
        by = {}
        for r in results:
            if r["setting"] == setting:
                by.setdefault(r["variant"], []).append(r)
        for variant, runs in by.items():
            steps = sorted({s for r in runs for s, _ in r["eval"]})
            med = [statistics.median(dict(map(tuple, r["eval"])).get(s, math.nan) for r in runs) for s in steps]
            style = dict(lw=2.2, color="black") if variant == "dense" else dict(lw=1.2)
            row[0].plot(steps, med, label=variant, **style)
            lab = step_s.get(PLOT_LAB, {})
            st = lab.get(step_time_key(variant))
            if st:
                row[1].plot([s * st for s in steps], med, label=variant, **style)
        row[0].set(title=f"{setting}: eval loss vs steps (median over seeds)", xlabel="step", ylabel="eval loss")
        row[1].set(title=f"{setting}: vs time (step times of 4 emulated hosts, 1 Gbit/s)", xlabel="s",
                   ylabel="eval loss")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["dense", "natural", "dgc5", "dgc1"], choices=list(VARIANTS))
    p.add_argument("--settings", nargs="+", default=["scratch", "finetune"], choices=["scratch", "finetune"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--scratch_steps", type=int, default=300)
    p.add_argument("--finetune_steps", type=int, default=200)
    p.add_argument("--pretrain_steps", type=int, default=300)
    p.add_argument("--eval_every", type=int, default=25)
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "quality"), help="run folders (cached results)")
    p.add_argument("--out", default=None, help="markdown report (and a .png next to it)")
    p.add_argument("--report_only", action="store_true", help="only tabulate the cached results")
    p.add_argument("--port", type=int, default=None,
                   help="first master port of the runs (default: a free port for each run)")
    p.add_argument("--plot_variants", nargs="+", default=list(PLOT_VARIANTS), choices=list(VARIANTS),
                   help="the variants the plot draws (default: %(default)s)")
    args = p.parse_args(argv)
    for base in dict.fromkeys(baseline_of(v) for v in args.variants):
        if base not in args.variants:  # every gap is relative to a dense run of the same seed (and engine)
            args.variants.insert(0 if base == "dense" else 1, base)

    # Step 2: the runs (cached ones are read back).
    jobs = [(s, v, seed) for s in args.settings for seed in args.seeds for v in args.variants]
    results = []
    start = None
    for i, (setting, variant, seed) in enumerate(jobs):
        if setting == "finetune" and start is None and not args.report_only:
            start = pretrained(args.runs, args.pretrain_steps)
        steps = args.scratch_steps if setting == "scratch" else args.finetune_steps
        if args.report_only:
            path = os.path.join(args.runs, setting, variant, f"seed{seed}", "result.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
            continue
        t0 = time.perf_counter()
        r = run_one(args.runs, setting, variant, seed, steps, args.eval_every, start,
                    args.port + i % 200 if args.port else None)
        results.append(r)
        print(f"[{i + 1}/{len(jobs)}] {setting} {variant} seed {seed}: eval {r['eval'][-1][1]:.4f} at step "
              f"{r['eval'][-1][0]} ({time.perf_counter() - t0:.0f} s)", flush=True)

    # Step 3: the report.
    step_s = cluster_step_s(os.path.join(ROOT, "benchmarks/cluster/results/cluster_e2e.jsonl"))
    text = report(results, step_s, args.out[:-3] + ".png" if args.out else None, args.plot_variants)
    if any(r.get("bytes") for r in results):  # runs that recorded their bytes: the same runs at equal bytes
        import quality_bytes

        text += "\n" + quality_bytes.report(results)
    header = ["# Time to quality: dense vs DGC variants", "",
              f"Generated by `benchmarks/quality/bench_quality.py` ({time.strftime('%Y-%m-%d')}; its docstring has the method). "
              "2 CPU ranks (deepspeed launcher; `*_fsdp*` variants: torchrun and the FSDP2 recipe on the "
              "same settings, `benchmarks/quality/quality_fsdp.py`; `*_2x2*` variants: 2 emulated nodes × 2 ranks, "
              "`benchmarks/quality/quality_nodes.py`), the demo's tiny Llama and DeepSpeed settings (AdamW "
              "lr 3e-3, betas 0.9/0.95, 10 warm-up steps, ZeRO-1 (`*_zero3` variants: ZeRO-3), micro-batch 8 × 128 "
              "tokens), eval every "
              f"{args.eval_every} steps on held-out blocks. `scratch`: random initialization, the whole "
              "built-in text; `finetune`: from a model pretrained densely on the first half of the text "
              f"({args.pretrain_steps} steps), fine-tuned on the second half. Variants: `VARIANTS` in the script.", "",
              "Columns: eval loss median [min–max] over seeds; the gap to dense of the same seed at the last "
              "step (a variant on a decaying rate, \"against dense_cosine\", is measured against dense on the same "
              "schedule, and so are its target and its equal loss); how many seeds reach dense's final eval loss + 1 % (same seed) and the median step; "
              "**steps × dense to equal loss** = the steps the run needs to reach its best eval loss over the steps "
              "dense needs to reach that loss (1.5× = dense gets there in two thirds of the steps); **time × "
              "dense** = that "
              "times the per-step time measured in the emulated cluster for the bench model "
              "(`cluster_e2e.jsonl`: "
              + "; ".join(f"{n} hosts at {rate}: " + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(cfgs.items()))
                          for (n, rate), cfgs in step_s.items()) + "), "
              "below 1× = sooner than dense to the same loss. A variant with dense steps or dense tensors is timed at "
              "its DGC density's step time, a lower bound. Cross-model: quality from the tiny Llama, step times from "
              "the lab's bench models.", "",
              "Reproduce (cached runs are reused; a variant marked with fewer seeds ran only those): "
              f"`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/bench_quality.py --settings {' '.join(args.settings)} "
              f"--seeds {' '.join(map(str, args.seeds))} --variants {' '.join(args.variants)}"
              + (f" --plot_variants {' '.join(args.plot_variants)}" if list(args.plot_variants) != list(PLOT_VARIANTS) else "")
              + f" --out {os.path.relpath(args.out, ROOT) if args.out else '...'}`.", ""]
    text = "\n".join(header) + "\n" + text
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
