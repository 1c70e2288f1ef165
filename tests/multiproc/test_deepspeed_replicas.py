"""zen_ext.engines.deepspeed_replicas (the mpu of recipes/finetune_llm.py's ``--replicas``) on 4 gloo ranks:
R replica groups of world/R consecutive ranks as DeepSpeed's data-parallel group (a sum over it is the
group's sum), one-rank model-parallel groups (a sum over one is the rank's own value), the data shares
``replica · G + group rank`` covering the world once, and the bad values refused: R not dividing the world
(the library's ValueError and the recipe's ``--replicas (<v>) must divide`` line), R below 2."""

import torch

from tests.multiproc.launch import run_workers


def _worker(rank, world):
    import torch.distributed as dist

    from recipes import common, finetune_llm
    from zen_ext.engines.deepspeed_replicas import replica_mpu

    out = {}
    for replicas in (2, 4):
        mpu = replica_mpu(replicas)
        x = torch.tensor([float(10 ** rank)])
        dist.all_reduce(x, group=mpu.get_data_parallel_group())  # digits: which ranks took part
        y = torch.tensor([float(10 ** rank)])
        dist.all_reduce(y, group=mpu.get_model_parallel_group())
        out[replicas] = {"dp_sum": x.item(), "mp_sum": y.item(), "ranks": mpu.get_data_parallel_group_ranks(),
                         "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
                         "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
                         "replica": mpu.replica, "data": (mpu.data_rank, mpu.data_world), "text": mpu.describe()}
    errors = []
    for bad in (3, 1, 0):
        try:
            replica_mpu(bad)
        except ValueError as exc:
            errors.append(str(exc))
    try:
        finetune_llm.replica_mpu(3)
    except common.ConfigError as exc:
        errors.append(str(exc))
    out["errors"] = errors
    return out


def test_replica_groups_as_deepspeed_mpu():
    run = run_workers(_worker, 4, timeout_s=300)
    for rank, r in enumerate(run):
        two, four = r[2], r[4]
        group = [0, 1] if rank < 2 else [2, 3]
        assert two["ranks"] == group and two["dp_sum"] == sum(10 ** g for g in group)
        assert two["dp"] == (rank % 2, 2) and two["replica"] == rank // 2
        assert four["ranks"] == [rank] and four["dp_sum"] == 10 ** rank and four["dp"] == (0, 1)
        assert four["replica"] == rank
        for r_ in (two, four):
            assert r_["mp"] == (0, 1) and r_["mp_sum"] == 10 ** rank  # nothing summed across replicas
            assert r_["data"] == (rank, 4)  # every rank of the world a share of its own
        assert two["text"] == "2 replica groups x 2 ranks ([0, 1] [2, 3])"
        assert four["text"] == "4 replica groups x 1 ranks ([0] [1] [2] [3])"
        lib3, lib1, lib0, recipe3 = r["errors"]
        for bad, text in ((3, lib3), (1, lib1), (0, lib0)):
            assert text == (f"zen.outer replicas ({bad}) must be an integer >= 2 that divides the world size (4): the "
                            f"outer sync runs across >= 2 equal replica groups")
        assert recipe3 == "--replicas (3) must divide the world size (4)"
