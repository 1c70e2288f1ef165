"""The DeepSpeed recipe (``recipes/finetune_llm.py``) with the ZeRO++ qgZ CPU emulation installed.

For the peers benchmark only: ``qgz_emulation.install()`` puts the emulation where ZeRO-3 calls
``all_to_all_quant_reduce``; a config with ``"zero_quantized_gradients": true`` on more than one (emulated)
node then trains with it. Each rank prints, at the end, how many tensors went through the quantized path and
the fallbacks and the bytes it sent in the all-to-alls (a line starting ``qgz emulation:``).
Launched per emulated node by ``benchmarks/quality/quality_nodes.py`` (``bench_peers.py``'s ``zero3_2x2_*``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import torch.distributed as dist  # noqa: E402

import qgz_emulation  # noqa: E402
from recipes import common, finetune_llm  # noqa: E402

if __name__ == "__main__":
    qgz_emulation.install()
    common.exit_on_config_error(finetune_llm.main)
    if dist.is_initialized():
        print(f"qgz emulation: rank {dist.get_rank()} {json.dumps(qgz_emulation.stats)}", flush=True)
        dist.barrier()
        dist.destroy_process_group()
