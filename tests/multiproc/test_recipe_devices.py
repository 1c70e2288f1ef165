"""Recipes move batches to the model's device and reduce metrics on the group's device.

DeepSpeed's ``engine(...)`` and ColossalAI's DDP (no ``device_ids``) leave inputs where they are, and
NCCL refuses CPU metric tensors. CI has no GPU, so the model here lives on ``meta`` (the one device
besides the CPU) and records where its inputs arrive; the metric all-reduce runs under the NCCL guard.
"""

import torch

from tests.multiproc.launch import run_workers


class _Out:
    def __init__(self, loss):
        self.loss = loss


class _MetaModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(2, device="meta"))
        self.seen = []

    def forward(self, input_ids, labels, use_cache):
        self.seen.append(input_ids.device.type)
        return _Out(torch.tensor(float(input_ids.float().mean().item() if input_ids.device.type == "cpu" else 1.0)))


def _worker(rank, world_size):
    import torch.distributed as dist

    from recipes import common

    model = _MetaModel()
    blocks = torch.arange(40).view(10, 4)
    loss = common.evaluate(model, blocks, micro_batch=2, dp_rank=rank, dp_size=world_size, dp_group=dist.group.WORLD)
    mean = common.all_reduce_mean(float(rank + 1), dist.group.WORLD)
    return model.seen, loss, mean, common.metric_device(dist.group.WORLD).type


def test_eval_batches_follow_the_model_and_metrics_the_group():
    for seen, loss, mean, metric_dev in run_workers(_worker, 2, timeout_s=120):
        assert seen and set(seen) == {"meta"}, seen
        assert loss == 1.0 and mean == 1.5 and metric_dev == "cpu"
