"""ZEN for torch FSDP2, the public surface: ``import zen_ext.fsdp``.

After the ``fully_shard`` calls, before the first backward::

    zen = zen_ext.fsdp.attach(model, {"dgc": {"enabled": True, "density": 0.05}})  # or a JSON path
    ...                    # train as usual: FSDP reduce-scatters every module's gradients with ZEN
    zen.summary()          # bytes against FSDP's dense reduce-scatter (all ranks)
    zen.close()

``config`` is the ``"zen"`` section (docs/deepspeed.md lists every key); docs/fsdp.md has the rest.
Importing this module imports torch.distributed.fsdp, nothing else.
"""

from .engines.fsdp import SUPPORTED, ZenFSDP, ZenReduceScatter, attach, chunk_layout

__all__ = ["SUPPORTED", "ZenFSDP", "ZenReduceScatter", "attach", "chunk_layout"]
