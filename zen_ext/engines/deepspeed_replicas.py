"""Replica groups for ``zen.outer`` under DeepSpeed ZeRO-1/2: the ``mpu`` that confines ZeRO to one.

``zen_ext/engines/deepspeed_outer.py`` serves ZeRO-1/2 when DeepSpeed's data-parallel group is the rank's
replica group: ZeRO partitions and reduces inside it, the outer sync runs across the groups.
``deepspeed.initialize(..., mpu=...)`` takes that group from ``mpu.get_data_parallel_group()``.
``replica_mpu(R)`` builds it: R replica groups of ``G = world / R`` consecutive ranks (group ``g`` holds
ranks ``g·G … g·G + G − 1``, the rows of FSDP2's ``(replicate, shard)`` mesh; best the ranks of one node,
where ZeRO's per-step traffic stays), and a one-rank model-parallel group per rank (DeepSpeed all-reduces
gradient norms over it: one rank, nothing summed across replicas).

The data-parallel rank DeepSpeed sees is the rank inside the replica group, so a sampler sharded by it
would give every replica group the same batches. Shard the data by ``data_rank`` / ``data_world``
(``replica · G + group rank`` of ``world``): every rank of the world a share of its own.
"""

from __future__ import annotations


class ReplicaMPU:
    """What DeepSpeed asks an ``mpu``, for R replica groups of consecutive ranks (module docstring).

    Attributes:
        replicas: R, the number of replica groups.
        group_size: G = world / R, the ranks of one replica group.
        replica: this rank's replica group, ``rank // G`` (the outer checkpoint's ``replica<g>`` directory).
        data_rank, data_world: this rank's share of the data and the number of shares (``replica · G +
            group rank``, the world size).

    Raises:
        ValueError: ``replicas`` not a divisor of the world size, or below 2 (no replicas to sync across).
    """

    def __init__(self, replicas: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2 or world % replicas:
            raise ValueError(f"zen.outer replicas ({replicas!r}) must be an integer >= 2 that divides the world size "
                             f"({world}): the outer sync runs across >= 2 equal replica groups")
        self.replicas, self.group_size = replicas, world // replicas
        self.replica = rank // self.group_size
        # Every rank creates every replica group, in the same order (new_group is collective over the world).
        self._dp = None
        for g in range(replicas):
            ranks = list(range(g * self.group_size, (g + 1) * self.group_size))
            pg = dist.new_group(ranks)
            if g == self.replica:
                self._dp, self._dp_ranks = pg, ranks
        # One rank alone: local synchronization spares the world-wide barrier of world one-rank groups.
        self._alone = dist.new_group([rank], use_local_synchronization=True)
        self.data_rank, self.data_world = self.replica * self.group_size + dist.get_rank(self._dp), world

    # --- the data-parallel group: this rank's replica group -------------------------------------------------
    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_data_parallel_world_size(self) -> int:
        return self.group_size

    def get_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self._dp)

    # --- no model parallelism: one-rank groups ----------------------------------------------------------------
    def get_model_parallel_group(self):
        return self._alone

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def describe(self) -> str:
        """The layout in one phrase, e.g. ``2 replica groups x 2 ranks ([0, 1] [2, 3])``."""
        G = self.group_size
        groups = " ".join(str(list(range(g * G, (g + 1) * G))) for g in range(min(self.replicas, 4)))
        more = f" ... {self.replicas - 4} more" if self.replicas > 4 else ""
        return f"{self.replicas} replica groups x {G} ranks ({groups}{more})"


def replica_mpu(replicas: int) -> ReplicaMPU:
    """R replica groups of world/R consecutive ranks as a DeepSpeed ``mpu`` (module docstring); call on every
    rank after ``torch.distributed`` (or ``deepspeed.init_distributed``) started, then pass it to
    ``zen_ext.deepspeed.initialize(..., mpu=...)`` with ``zero_optimization.stage`` 1 or 2 and ``zen.outer``."""
    return ReplicaMPU(replicas)
