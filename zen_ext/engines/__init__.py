"""Engine adapters: the only place that imports a training engine. ``import zen_ext`` imports none.

* ``zen_ext.engines.deepspeed``: ``initialize`` / ``enable`` / ``attach`` for DeepSpeed (ZeRO 0/1/2/3,
  AutoTP); public alias ``zen_ext.deepspeed``. DeepSpeed itself is imported at first use. The
  attachment is ``deepspeed_engine.ZenDeepSpeed``, ZeRO's ``overlap_comm`` hand-over ``deepspeed_ipg``,
  the reduce-scatter of ZeRO-3 and ZeRO-1/2 ``reduce_scatter`` ``deepspeed_zero3``.
* ``zen_ext.engines.ddp``: the torch DDP communication hook (no engine beyond torch); what it keeps is
  ``ddp_state.ZenHookState``.
* ``zen_ext.engines.fsdp``: a ZEN reduce-scatter on every torch FSDP2 module (``attach`` after
  ``fully_shard``); public alias ``zen_ext.fsdp``. The attachment is ``ZenFSDP``. On a 2-D
  ``(replicate, shard)`` mesh (HSDP) ``fsdp_hsdp``: FSDP's reduce-scatter inside the node, ZEN's
  all-reduce of each shard across the replicas (``ZenHSDP``); ``zen_ext.fsdp.attach`` picks by mesh.
* ``zen_ext.engines.colossalai``: the ColossalAI Booster plugins; public alias ``zen_ext.colossalai``.
  Importing it imports ColossalAI (its plugins subclass ColossalAI's), so only a ColossalAI user does.
  Its JSON config and the plugin arguments' checks are ``colossalai_config``.
  Its plugins wrap the model in torch DDP, so it registers the DDP hook (the one adapter built on
  another; the DeepSpeed and DDP adapters import no other).
Adapters translate their engine's buckets into (flat buffer, slices) for the engine-neutral reduction
layer, ``zen_ext.reduction`` (``attachment``: the machinery every attachment builds and its statistics,
summary and checkpoint state; slices, re-bucketing to ``bucket_cap_mb``, node-sharded hierarchical
reduction, TP-shared embedding rows, the communication worker).
"""
