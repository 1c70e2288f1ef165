"""Hierarchical (node-sharded) reduction, paper §4: whether it applies, its groups, and the reduction.

``maybe_node_sharding`` decides from facts every rank gathers once (host, local rank, every DP group),
so the decision is the same on all ranks; ``NodeShardedReduce`` reduce-scatters inside the node, runs
the sparse sync across nodes per shard, and all-gathers back.
"""

from __future__ import annotations

import os
from typing import Hashable, Iterable, Sequence

import torch

from .plan import GradSlice
from .slices import clip_slices, shard_bounds


HOST_ENV = "ZEN_EXT_HOST"
"""Overrides the host name a rank reports for the hierarchy decision: set it per machine when host
names do not tell machines apart (identical container names), or per emulated node in tests."""


def local_host_facts() -> tuple[str, int]:
    """This process's ``(host, local rank)``: ``$ZEN_EXT_HOST`` or the host name, and ``$LOCAL_RANK``
    (-1 when the launcher sets none)."""
    import socket

    return os.environ.get(HOST_ENV) or socket.gethostname(), int(os.environ.get("LOCAL_RANK", "-1"))


def node_layout(dp_ranks: Sequence[int], node_of: "int | Sequence[Hashable]") -> list[list[int]]:
    """The data-parallel ranks grouped by node, nodes ordered by their lowest rank.

    Args:
        dp_ranks: the group's global ranks.
        node_of: each global rank's host (a sequence indexed by global rank), or, for a launcher
            that numbers ranks node by node with equal nodes, the ranks per node (``rank // node_of``).
    """
    nodes: dict[Hashable, list[int]] = {}
    for r in sorted(dp_ranks):
        nodes.setdefault(r // node_of if isinstance(node_of, int) else node_of[r], []).append(r)
    return sorted(nodes.values(), key=lambda members: members[0])


def hierarchy_applies(nodes: list[list[int]]) -> bool:
    """Node sharding needs several nodes, each holding the same number (> 1) of the group's ranks."""
    sizes = {len(n) for n in nodes}
    return len(nodes) > 1 and len(sizes) == 1 and sizes.pop() > 1


def decide_hierarchy(setting: "bool | str", hosts: Sequence[Hashable], dp_groups: Iterable[Sequence[int]],
                     local_ranks: Sequence[int] | None = None) -> tuple[dict | None, str]:
    """Whether to reduce node by node, from facts every rank holds alike (a pure function).

    Every rank must reach the same answer, because creating the node groups is a collective over
    the whole world: so the decision reads gathered facts (each rank's host and local rank, every
    data-parallel group), never a rank's own environment (``LOCAL_WORLD_SIZE`` differs between the
    nodes of an uneven hostfile), and node membership is the actual host membership.

    1. Host names must identify machines: two ranks reporting the same host and local rank mean
       they do not (set ``ZEN_EXT_HOST`` per machine).
    2. Every data-parallel group must span several nodes with the same number (> 1) of its ranks on
       each; uneven nodes are not supported (shards would differ in length across nodes).

    Args:
        setting: ``zen.hierarchical``: True, False or ``"auto"``.
        hosts: each global rank's host (index = global rank).
        dp_groups: every data-parallel group (global ranks; repeats are fine).
        local_ranks: each global rank's launcher local rank (-1 unknown), for step 1.

    Returns:
        ``(layouts, reason)``: ``layouts`` maps each DP group (a sorted tuple) to its nodes, or is
        None when flat ZEN runs; ``reason`` says why, in words.

    Raises:
        ValueError: ``setting`` is True and there are not several multi-rank nodes, or the hosts are
            ambiguous.
        NotImplementedError: ``setting`` is True and a group's nodes hold different numbers of ranks.
    """
    if setting is False:
        return None, "zen.hierarchical is false"
    required = setting is True
    # Step 1: host names must tell machines apart.
    seen: dict[tuple, int] = {}
    for r, (host, lr) in enumerate(zip(hosts, local_ranks or [-1] * len(hosts))):
        if lr >= 0 and (host, lr) in seen:
            reason = (f"ranks {seen[(host, lr)]} and {r} both report host {host!r} with local rank {lr}, so host "
                      f"names do not identify machines (set {HOST_ENV} to a per-machine name)")
            if required:
                raise ValueError(f'zen.hierarchical (True) must be false or "auto" here: {reason}')
            return None, reason
        seen[(host, lr)] = r
    # Step 2: every group over several equal multi-rank nodes.
    layouts = {g: node_layout(g, hosts) for g in sorted({tuple(sorted(g)) for g in dp_groups})}
    for g, nodes in layouts.items():
        if hierarchy_applies(nodes):
            continue
        where = ", ".join(f"{hosts[n[0]]}: {n}" for n in nodes)
        sizes = {len(n) for n in nodes}
        if len(nodes) > 1 and len(sizes) > 1 and max(sizes) > 1:
            reason = f"the data-parallel group {list(g)} spans nodes of different sizes ({where})"
            if required:
                raise NotImplementedError(
                    f"zen.hierarchical (True) supports data-parallel groups spread evenly over several nodes (the "
                    f"same number, > 1, of ranks on each); {reason}; use \"auto\" (flat ZEN here) or false")
        else:
            reason = f"the data-parallel group {list(g)} does not span several nodes with several ranks each ({where})"
            if required:
                raise ValueError(f'zen.hierarchical (True) must be false or "auto" here: {reason}')
        return None, reason
    nodes = next(iter(layouts.values()))
    return layouts, f"{len(nodes)} nodes of {len(nodes[0])} ranks per data-parallel group"


def owner_order(nodes: list[list[int]], dp_ranks: Sequence[int]) -> list[list[int]]:
    """``owners[l]``: the data-parallel ranks (places in ``dp_ranks``) of the ranks with local index
    ``l``, in the rank order of their inter-node group (``new_group`` orders its members by global
    rank): whose ranges the node-level reduce-scatter gives local rank ``l`` (``reduction/node_scatter.py``)."""
    place = {g: i for i, g in enumerate(dp_ranks)}
    return [[place[g] for g in sorted(n[l] for n in nodes)] for l in range(len(nodes[0]))]


def create_node_groups(layouts: dict, rank: int, dp_ranks: Sequence[int] | None = None):
    """Create the intra-node and inter-node groups of every data-parallel group (a collective).

    ``torch.distributed.new_group`` must be called by every rank for every group in the same order:
    ``layouts`` (from ``decide_hierarchy``, the same on every rank) is walked in sorted order.
    ``dp_ranks`` (this rank's group in its rank order; default: sorted) gives the node-level
    reduce-scatter its ``owner_order``.

    Returns:
        ``(NodeShardedReduce, inter_node_group)`` of this rank.
    """
    import torch.distributed as dist

    from ..comm.torch_dist import TorchCommunicator

    node = inter_group = None
    for g in sorted(layouts):
        nodes = layouts[g]
        for members in nodes:
            grp = dist.new_group(members)
            if rank in members:
                node = NodeShardedReduce(TorchCommunicator(grp), members.index(rank), len(members),
                                         owners=owner_order(nodes, g if dp_ranks is None else dp_ranks))
        for i in range(len(nodes[0])):
            across = [n[i] for n in nodes]
            grp = dist.new_group(across)
            if rank in across:
                inter_group = grp
    return node, inter_group


def build_node_sharding(dp_ranks: Sequence[int], all_dp_groups: Iterable[Sequence[int]],
                        node_of: "int | Sequence[Hashable]", rank: int, required: bool = False):
    """Decide (``decide_hierarchy``) and create the node groups (a collective over the world).

    Args:
        dp_ranks: this rank's data-parallel group (global ranks).
        all_dp_groups: every data-parallel group, as seen by any rank.
        node_of: each global rank's host, or the ranks per node (see ``node_layout``).
        rank: this rank's global rank.
        required: ``zen.hierarchical`` true (raise when it cannot apply) instead of ``"auto"``.

    Returns:
        ``(NodeShardedReduce, inter_node_group)``, or ``(None, None)`` when node sharding does not apply.

    Raises:
        ValueError, NotImplementedError: ``required`` and node sharding cannot apply (``decide_hierarchy``).
    """
    groups = [tuple(g) for g in all_dp_groups]
    if isinstance(node_of, int):
        node_of = [r // node_of for r in range(max(max(g) for g in groups) + 1)]
    layouts, _ = decide_hierarchy(True if required else "auto", node_of, groups)
    return create_node_groups(layouts, rank, list(dp_ranks)) if layouts is not None else (None, None)


def maybe_node_sharding(setting: "bool | str", dp_ranks: Sequence[int], rank: int, log=None):
    """The engine's hierarchy step: gather the facts once, decide, create the groups.

    One object all-gather over the world (each rank's setting, host, local rank and data-parallel
    group), at attach time only, even when the setting is false: a rank configured differently must
    not skip a collective its peers enter. The decision is then identical on every rank by
    construction, so either every rank creates the node groups or none does.

    Args:
        setting: ``zen.hierarchical``.
        dp_ranks: this rank's data-parallel group.
        rank: this rank's global rank.
        log: a logger for the one line that says why ``"auto"`` runs flat (rank 0 only), or None.

    Returns:
        ``(NodeShardedReduce | None, inter_node_group | None, reason)``.

    Raises:
        RuntimeError: ranks are configured with different ``zen.hierarchical`` (naming both).
        ValueError, NotImplementedError: see ``decide_hierarchy`` (on every rank alike).
    """
    import torch.distributed as dist

    facts = [None] * dist.get_world_size()
    dist.all_gather_object(facts, (setting, *local_host_facts(), tuple(dp_ranks)))
    for r, f in enumerate(facts):
        if f[0] != setting or type(f[0]) is not type(setting):  # True == 1 must not pass
            raise RuntimeError(f"zen: ranks disagree on zen.hierarchical: rank {r} has {f[0]!r}, rank {rank} has "
                               f"{setting!r}; every rank must use the same value")
    hosts, local_ranks, groups = [f[1] for f in facts], [f[2] for f in facts], [f[3] for f in facts]
    layouts, reason = decide_hierarchy(setting, hosts, groups, local_ranks)
    if layouts is None:
        if log is not None and rank == 0 and setting == "auto":
            log.info('zen: hierarchical "auto" runs flat ZEN over each data-parallel group: %s', reason)
        return None, None, reason
    return (*create_node_groups(layouts, rank, dp_ranks), reason)


class NodeShardedReduce:
    """Dense reduce-scatter inside the node, a sparse sync across nodes per shard, all-gather back.

    With ``L`` ranks per node and ``N`` nodes, a bucket of ``M`` elements costs each rank about
    ``2·(L−1)/L·M`` dense elements on the fast intra-node links and one sparse synchronization of
    ``M/L`` elements over ``N`` ranks on the slow inter-node links (paper §4: ZEN runs on the
    inter-node level, where the bandwidth is).

    Args:
        intra: the Communicator of this rank's node (within its DP group): its ``reduce_scatter`` and
            ``all_gather`` carry the dense part and count its bytes (so SimWorld runs it too).
        local_rank: this rank's index in ``intra`` (default: its rank there).
        local_size: ``L`` (default: ``intra``'s size).
        owners: ``owners[l]``, the data-parallel ranks with local index ``l`` in their inter-node
            group's rank order (``owner_order``); the node-level reduce-scatter needs it, the
            all-reduce does not.
    """

    def __init__(self, intra, local_rank: int | None = None, local_size: int | None = None,
                 owners: list[list[int]] | None = None) -> None:
        self.intra = intra
        self.local_rank = intra.rank if local_rank is None else local_rank
        self.local_size = intra.size if local_size is None else local_size
        self.owners = owners

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent inside the node so far."""
        return self.intra.stats.bytes_sent

    def reduce(self, flat: torch.Tensor, slices: Sequence[GradSlice], op: str, sync_shard) -> torch.Tensor:
        """Reduce ``flat`` over all ranks of all nodes; ``sync_shard(shard, shard_slices, op)`` reduces
        one shard across the nodes (the Synchronizer over the inter-node group).

        1. Cut the bucket into ``L`` shards at row boundaries and pad them to one length.
        2. Reduce-scatter inside the node (sum): rank ``l`` holds the node's sum of shard ``l``.
        3. Synchronize shard ``l`` across the nodes (sparse; the mean divides by ``L`` first).
        4. All-gather the shards inside the node and drop the padding.
        """
        L, flat_N = self.local_size, flat.reshape(-1)
        # Step 1: shards.
        cuts = shard_bounds(flat_N.numel(), slices, L)
        width = max(b - a for a, b in zip(cuts, cuts[1:]))
        padded = torch.zeros(L, width, dtype=flat_N.dtype, device=flat_N.device)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            padded[i, : b - a] = flat_N[a:b]
        # Step 2: reduce-scatter inside the node.
        mine = self.intra.reduce_scatter(padded.reshape(-1))
        # Step 3: across nodes, on this rank's shard.
        a, b = cuts[self.local_rank], cuts[self.local_rank + 1]
        shard = mine[: b - a]
        if op == "mean":
            shard.div_(L)
        # An empty shard is synchronized too: the Synchronizer agrees each new layout over the TP group,
        # and a TP peer with a longer bucket may hold a non-empty shard here. An empty part of the
        # bucket's first slice names the layout, so it is new for each bucket, as on the peers.
        part = clip_slices(slices, a, b)
        if not part and slices:
            first = min(slices, key=lambda s: s.offset)
            part = [GradSlice(first.name, 0, 0, (0,), start=first.start)]
        mine[: b - a] = sync_shard(shard, part, op)
        # Step 4: all-gather inside the node.
        rows = self.intra.all_gather(mine).view(L, width)
        out = torch.empty_like(flat_N)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
            out[a:b] = rows[i, : b - a]
        return out.view_as(flat)
