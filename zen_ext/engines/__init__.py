"""Engine adapters: the only place that imports a training engine. ``import zen_ext`` imports none.

* ``zen_ext.engines.deepspeed``: ``initialize`` / ``enable`` / ``attach`` for DeepSpeed (ZeRO 0/1/2,
  AutoTP); public alias ``zen_ext.deepspeed``. DeepSpeed itself is imported at first use.
* ``zen_ext.engines.ddp``: the torch DDP communication hook (no engine beyond torch).
* ``zen_ext.engines.colossalai``: the ColossalAI Booster plugins; public alias ``zen_ext.colossalai``.
  Importing it imports ColossalAI (its plugins subclass ColossalAI's), so only a ColossalAI user does.
  Adapters translate their engine's buckets into (flat buffer, slices) for the engine-neutral
  reduction layer, ``zen_ext.reduction`` (slices, re-bucketing to ``bucket_cap_mb``, node-sharded
  hierarchical reduction, TP-shared embedding rows, the communication worker); no adapter imports
  another.
"""
