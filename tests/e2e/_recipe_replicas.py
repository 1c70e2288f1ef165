"""recipes/finetune_llm.py, then each rank's full weights to ``<output_dir>/weights_rank<r>.pt`` and the
first micro-batches it trained on to ``<output_dir>/batches_rank<r>.pt``.

The recipe saves one rank's model (``--save_model``); a test that checks the data-parallel replicas
agree needs every rank's. This script runs the recipe unchanged (launched as the recipe is, with its
arguments) and keeps the engine ``zen_ext.deepspeed.initialize`` builds, so that after training each
rank writes the parameters it holds (and, from the recipe's own batch iterator, which data it read).
ZeRO stages 0-2 only: under ZeRO-3 a rank holds a shard.
"""

import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import zen_ext.deepspeed  # noqa: E402
from recipes import finetune_llm  # noqa: E402

FIRST_BATCHES = 4
"""Micro-batches kept per rank: enough to show which share of each step's data a rank read."""


def main() -> None:
    engines = []
    build = zen_ext.deepspeed.initialize

    def keep(*args, **kwargs):
        out = build(*args, **kwargs)
        engines.append(out[0])
        return out

    zen_ext.deepspeed.initialize = keep  # the recipe looks it up on the module at call time
    read = []
    batches = finetune_llm.common.train_batches

    def record(*args, **kwargs):  # the recipe's iterator, its first micro-batches kept as they are yielded
        for i, batch in enumerate(batches(*args, **kwargs)):
            if i < FIRST_BATCHES:
                read.append(batch.clone())
            yield batch

    finetune_llm.common.train_batches = record
    args = finetune_llm.parse_args()
    finetune_llm.main()
    (engine,) = engines
    if engine.zero_optimization_stage() >= 3:
        raise SystemExit("tests/e2e/_recipe_replicas.py: ZeRO-3 partitions the parameters; use stage 0-2")
    weights = {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
    torch.save(weights, os.path.join(args.output_dir, f"weights_rank{dist.get_rank()}.pt"))
    torch.save(read, os.path.join(args.output_dir, f"batches_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
