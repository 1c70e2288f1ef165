"""Several runs of the peers runners (``benchmarks/quality/peers_ddp.py``, ``qgz_recipe.py``) in turn, in one
process per rank.

Started by ``benchmarks/cluster/bench_peers_lab.py`` under ``launch/netlab/launch.sh``, once per lab size and
repeat::

    peers_lab_runs.py --runs RUNS.json      # [{"name": "dense", "runner": "peers", "argv": [...]}, ...]

Each entry is ``peers_ddp.main(argv)`` (runner ``peers``) or the DeepSpeed recipe with the ZeRO++ qgZ CPU
emulation installed (runner ``qgz``: what ``benchmarks/quality/qgz_recipe.py`` runs, ``finetune_llm.main(argv)``)
with its own ``--output_dir``, in the file's order; the entries share
the process group, the imports and the trained tokenizer. Why: 8 or 16 ranks on 2 shared cores spend most of
a launch starting (torch and transformers imports, ~4 CPU-s a rank); one launch per repeat pays that once
instead of once per method, which is what makes three interleaved repeats of every method fit in the time.
A barrier separates the runs, so no rank starts the next method while another still evaluates the last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "quality"))

import torch.distributed as dist  # noqa: E402

import peers_ddp  # noqa: E402
import qgz_emulation  # noqa: E402
from recipes import common, finetune_llm  # noqa: E402

RUNNERS = {"peers": peers_ddp.main, "qgz": finetune_llm.main}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", required=True, help="JSON list of {name, argv}")
    a = p.parse_args(argv)
    with open(a.runs) as f:
        runs = json.load(f)
    if not runs or any(set(r) != {"name", "runner", "argv"} or r["runner"] not in RUNNERS for r in runs):
        raise SystemExit(f"--runs ({a.runs}) must be a non-empty JSON list of {{name, runner, argv}}, runner "
                         f"one of {sorted(RUNNERS)}")
    if any(r["runner"] == "qgz" for r in runs):
        qgz_emulation.install()  # only a config with zero_quantized_gradients takes the quantized path
    for r in runs:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"peers_lab_runs: {r['name']}", flush=True)
        before = dict(qgz_emulation.stats)
        common.exit_on_config_error(RUNNERS[r["runner"]], r["argv"])
        if r["runner"] == "qgz" and int(os.environ.get("RANK", "0")) == 0:
            # What the emulation did in this run (rank 0): tensors through the quantized path, all-to-all bytes.
            with open(os.path.join(r["argv"][r["argv"].index("--output_dir") + 1], "qgz_stats.json"), "w") as f:
                json.dump({k: v - before[k] for k, v in qgz_emulation.stats.items()}, f)
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
