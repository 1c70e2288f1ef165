"""The engine-neutral reduction layer between the core (Synchronizer, schemes) and the engine adapters.

An adapter translates its engine's buckets into (flat buffer, slices) and back, and hooks the engine;
everything else about reducing a bucket lives here, one concern per module. Dependencies run one way:
``core`` (types, schemes) ← ``compress`` (sparsifiers) ← ``reduction`` ← ``engines``.

* ``synchronizer``: ``Synchronizer`` routes a bucket's slices (dense / natural rows / DGC) to the
  sparsifiers and the configured scheme, with zen_ext's state;
* ``plan``: a bucket layout's routing (``GradSlice``, ``Plan``) and the cross-rank agreement on it;
* ``prepared``: one bucket between the Synchronizer's local half and its communicating half;
* ``slices``: flat buffers ↔ named ``GradSlice``s (by storage address), re-bucketing to
  ``zen.bucket_cap_mb``, shards that keep embedding rows whole, a parameter's piece as whole-row slices;
* ``hierarchy``: whether node-sharded reduction applies (decided alike on every rank), its groups,
  and ``NodeShardedReduce``;
* ``reducer``: ``BucketReducer``, what every adapter calls per bucket;
* ``worker``: ``CommWorker``, the communication thread of ``zen.async_sync``;
* ``stats``: per-step JSONL statistics, the start-up line and the end-of-run summary;
* ``assembly``: routing and the Synchronizer, the summary text, restoring zen_ext's state;
* ``attachment``: ``assemble`` (the machinery an attachment keeps) and ``ZenAttachment``, the base of
  the adapters' attachments (statistics, summary, per-rank checkpoint files, shutdown).
"""

from .hierarchy import NodeShardedReduce, decide_hierarchy, maybe_node_sharding
from .reducer import BucketReducer
from .slices import clip_slices, locate_slices, piece_slices, shard_bounds, split_to_cap
from .worker import CommWorker

__all__ = ["BucketReducer", "CommWorker", "NodeShardedReduce", "clip_slices", "decide_hierarchy", "locate_slices",
           "maybe_node_sharding", "piece_slices", "shard_bounds", "split_to_cap"]
