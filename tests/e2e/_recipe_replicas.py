"""recipes/finetune_llm.py, then each rank's full weights to ``<output_dir>/weights_rank<r>.pt``.

The recipe saves one rank's model (``--save_model``); a test that checks the data-parallel replicas
agree needs every rank's. This script runs the recipe unchanged (launched as the recipe is, with its
arguments) and keeps the engine ``zen_ext.deepspeed.initialize`` builds, so that after training each
rank writes the parameters it holds. ZeRO stages 0-2 only: under ZeRO-3 a rank holds a shard.
"""

import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import zen_ext.deepspeed  # noqa: E402
from recipes import finetune_llm  # noqa: E402


def main() -> None:
    engines = []
    build = zen_ext.deepspeed.initialize

    def keep(*args, **kwargs):
        out = build(*args, **kwargs)
        engines.append(out[0])
        return out

    zen_ext.deepspeed.initialize = keep  # the recipe looks it up on the module at call time
    args = finetune_llm.parse_args()
    finetune_llm.main()
    (engine,) = engines
    if engine.zero_optimization_stage() >= 3:
        raise SystemExit("tests/e2e/_recipe_replicas.py: ZeRO-3 partitions the parameters; use stage 0-2")
    weights = {name: p.detach().float().cpu().clone() for name, p in engine.module.named_parameters()}
    torch.save(weights, os.path.join(args.output_dir, f"weights_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
