"""ZEN for torch FSDP2, the public surface: ``import zen_ext.fsdp``.

After the ``fully_shard`` calls, before the first backward::

    zen = zen_ext.fsdp.attach(model, {"dgc": {"enabled": True, "density": 0.05}})  # or a JSON path
    ...                    # train as usual: FSDP reduce-scatters every module's gradients with ZEN
    zen.summary()          # bytes against FSDP's dense reduce-scatter (all ranks)
    zen.close()

``config`` is the ``"zen"`` section (docs/deepspeed.md lists every key); docs/fsdp.md has the rest.
Importing this module imports torch.distributed.fsdp, nothing else.
A model on a 2-D (replicate, shard) mesh (HSDP) is served too: ZEN all-reduces each shard across the
replicas (docs/fsdp.md, "HSDP").
"""

from .engines import fsdp as _flat
from .engines import fsdp_hsdp as _hsdp
from .engines.fsdp import SUPPORTED, ZenFSDP, ZenFSDPReduceScatter, chunk_layout
from .engines.fsdp_compat import check_fsdp_internals
from .engines.fsdp_hsdp import ZenHSDP, shard_layout

__all__ = ["SUPPORTED", "ZenFSDP", "ZenFSDPReduceScatter", "ZenHSDP", "attach", "chunk_layout", "shard_layout"]


def attach(model, config=None, *, optimizer=None, guard_nonfinite: bool = False) -> "ZenFSDP | ZenHSDP":
    """Attach ZEN to an FSDP2 ``model`` after its ``fully_shard`` calls; returns the attachment.

    On a 1-D mesh, ZEN's reduce-scatter on every FSDP module (``zen_ext.engines.fsdp.attach``, whose
    docstring lists the arguments); on a 2-D ``("replicate", "shard")`` mesh (HSDP), FSDP's reduce-scatter
    inside the node and ZEN's all-reduce of each shard across the replicas
    (``zen_ext.engines.fsdp_hsdp.attach``, a ``ZenHSDP``). docs/fsdp.md has both.
    """
    try:  # each engine checks torch (fsdp_compat) first; telling them apart reads a few of its internals
        hsdp = bool(_hsdp.hsdp_param_groups(model))
    except (ImportError, AttributeError):
        check_fsdp_internals(model, path=None)  # the version, or the missing internal by name
        raise
    engine = _hsdp if hsdp else _flat
    return engine.attach(model, config, optimizer=optimizer, guard_nonfinite=guard_nonfinite)
