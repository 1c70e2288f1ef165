"""Running the time-to-quality benchmark's variants: one run of the recipe per (setting, variant, seed),
its result cached in its run folder, and the densely pretrained start of the fine-tuning setting.

A run is the DeepSpeed recipe (``recipes/finetune_llm.py``) on 2 CPU ranks under DeepSpeed's launcher, the
FSDP2 recipe under torchrun for the ``_fsdp`` variants (its config translated by ``quality_fsdp.py``), or
one launcher per emulated node for the ``_nodes`` variants (``quality_nodes.py``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
import subprocess
import sys
import time

import quality_fsdp
from quality_variants import ROOT, VARIANTS, ds_config

MODEL = "configs/models/llama-tiny-untied.json"
RUN_TIMEOUT_S = 1200


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
    port = port or free_port()
    try:
        return _run_recipe(args_list, log_path, port, fsdp, nodes)
    finally:
        unlink_ds_shm(port)


def unlink_ds_shm(port: int) -> None:
    """Remove the /dev/shm buffers DeepSpeed's CPU shared-memory all-reduce made for the run on ``port``: it
    names one per rank by the master port and never unlinks it (69 MB each), so a sweep of a few hundred runs
    filled 16 GB of RAM and the OOM killer took other jobs (tests/conftest.py does the same for the tests)."""
    import glob

    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:  # gone already
            pass


def _run_recipe(args_list: list[str], log_path: str, port: int, fsdp: bool, nodes: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
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
