"""Engine adapters: the only place that imports a training engine, and only lazily.

* ``zen_ext.engines.deepspeed``: ``initialize`` / ``enable`` / ``attach`` for DeepSpeed (ZeRO 0/1/2,
  AutoTP); public alias ``zen_ext.deepspeed``.
* ``zen_ext.engines._buckets``: engine-neutral bucket handling (slices, re-bucketing to
  ``bucket_cap_mb``, node-sharded hierarchical reduction, TP-shared embedding rows).
* ``zen_ext.engines.stats``: per-step JSONL statistics and the end-of-run summary.
"""
