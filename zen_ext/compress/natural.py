"""``natural``: the non-zero rows of embedding gradients, sent losslessly (ZEN paper §2.2, §4).

An embedding's gradient is non-zero only in the rows of the tokens in the batch. ``natural`` sends
those rows as they are, so the synchronized result equals the dense all-reduce. By default the
index is a *row* id with a whole row of values behind it (EmbRace's row granularity): ZEN then
hashes row ids, which keeps the partitions balanced and cuts the Push index bytes by the row width
``W`` (a rank sends ``K_rows·(4 + W·itemsize)`` bytes instead of ``K_rows·W·(4 + itemsize)``;
docs/sparsifiers.md has the measured bytes per rank on a Zipf workload).

``classify_parameters`` decides each parameter's path: embeddings (``nn.Embedding``,
``nn.EmbeddingBag``, a HF model's ``get_input_embeddings()``, vocab-parallel shards whose class name
contains ``Embedding`` and whose weight is ``[rows, width]``) go ``natural`` unless the weight is
*tied* to an output layer: the LM head then makes its gradient dense, so it is routed like any other
matrix and the log says so once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..core.types import SparseGrad
from .base import NamedGrad, Sparsifier, check_bool, config_from_dict

logger = logging.getLogger(__name__)
_logged: set[str] = set()


@dataclass(frozen=True)
class NaturalConfig:
    """The ``zen.natural`` section."""

    enabled: bool = True
    """Send only the non-zero rows of embedding gradients (lossless). Default on."""
    row_granularity: bool = True
    """Index rows, not elements: Push index bytes shrink by the row width (EmbRace; measured in
    docs/sparsifiers.md). ``False`` sends element-wise COO of the non-zeros."""

    def __post_init__(self) -> None:
        check_bool("natural", "enabled", self.enabled)
        check_bool("natural", "row_granularity", self.row_granularity)

    @classmethod
    def from_dict(cls, values: "dict | NaturalConfig | None") -> "NaturalConfig":
        return config_from_dict(cls, values, "natural")


class NaturalSparsifier(Sparsifier):
    """The non-zero rows (or elements) of one embedding gradient; stateless and lossless."""

    kind = "natural"
    lossless = True

    def __init__(self, config: NaturalConfig | None = None) -> None:
        self.config = config or NaturalConfig()

    def compress(self, grads: Sequence[NamedGrad], tp_comm=None) -> SparseGrad:
        """The non-zero rows of one gradient, indexed by row (row form), or its non-zero elements.

        Args:
            grads: exactly one gradient, shaped like its parameter (rows along dim 0).
            tp_comm: unused (a vocab-parallel shard's rows are local to it).

        Raises:
            ValueError: not exactly one gradient (row widths differ between parameters).
        """
        if len(grads) != 1:
            raise ValueError(f"NaturalSparsifier.compress takes one gradient at a time, got {len(grads)}")
        return self.compress_each(grads)[0]

    def compress_each(self, grads: Sequence[NamedGrad]) -> list[SparseGrad]:
        """``compress`` of every gradient of ``grads``, with one host read for all of them.

        1. Mark each gradient's non-zero rows (or elements) and count them, on the device.
        2. Read every count at once (the one host synchronization, whatever the number of gradients).
        3. Find each gradient's marked rows with ``nonzero_static`` of the known count (no read).
        """
        # Step 1: marks and counts.
        srcs, marks = [], []
        for ng in grads:
            g = ng.grad
            if self.config.row_granularity and g.dim() >= 2:
                src = g.reshape(g.shape[0], -1)
                marks.append(src.ne(0).any(1))
            else:
                src = g.reshape(-1)
                marks.append(src.ne(0))
            srcs.append(src)
        if not marks:
            return []
        # Step 2: one read.
        counts = torch.stack([m.sum() for m in marks]).tolist()
        # Step 3: the rows.
        out = []
        for src, mark, k in zip(srcs, marks, counts):
            idx = torch.nonzero_static(mark, size=int(k)).flatten()
            out.append(SparseGrad(idx, src.index_select(0, idx), src.shape[0], in_range=True))
        return out


def _log_once(msg: str, *args) -> None:
    text = msg % args
    if text not in _logged:
        _logged.add(text)
        logger.info(text)


def _is_embedding(module: nn.Module, hf_input: nn.Module | None) -> bool:
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or module is hf_input:
        return True
    # Vocab-parallel shards (ColossalAI VocabParallelEmbedding1D, Megatron VocabParallelEmbedding) are
    # not nn.Embedding subclasses; their own weight is a [rows, width] shard.
    w = module._parameters.get("weight")
    return "Embedding" in type(module).__name__ and w is not None and w.dim() == 2


def _hf_embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The HF ``get_input_embeddings()`` / ``get_output_embeddings()`` modules, when the model has them."""
    out = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            out.append(fn() if callable(fn) else None)
        except (NotImplementedError, AttributeError):
            out.append(None)
    return out[0], out[1]


def classify_parameters(
    model: nn.Module, *, natural: "dict | NaturalConfig | None", dgc: "dict | None", log: bool = True,
    tp_comm=None,
) -> dict[str, str]:
    """Each trainable parameter's path, keyed by its ``named_parameters()`` name.

    1. Find embedding weights and which of them are tied: the same Parameter object is also the
       weight of a non-embedding module (e.g. the LM head) or HF's ``get_output_embeddings()``.
    2. Untied embeddings → ``"natural"`` if ``natural`` is enabled.
    3. Every other parameter (tied embeddings included): 1-D, fewer than ``dgc.min_numel``
       elements or matching ``dgc.dense_params`` → ``"dense"``; otherwise ``"dgc"`` if DGC is
       enabled, else ``"dense"``. Under tensor parallelism the size is that of the parameter's
       *largest shard over the TP group* (one gathered fact, the same on every TP rank), never the
       local shard's: with uneven AutoTP shards a local size would route a parameter to DGC on one TP
       rank and dense on another, and DGC's per-layer threshold exchange over the TP group would then
       wait for a rank that never joins.

    Args:
        model: the model (unwrapped or wrapped: names are those of ``model.named_parameters()``).
        natural: the ``zen.natural`` section (dict or NaturalConfig); ``None`` = disabled.
        dgc: the ``zen.dgc`` section (dict or DGCConfig); ``None`` = disabled.
        log: log a summary and each tied embedding once.
        tp_comm: the tensor-parallel group (a Communicator), or None. With more than one rank, the
            TP ranks gather their parameter names and shard sizes once (a collective: every TP rank
            must call this).

    Returns:
        ``{name: "natural" | "dgc" | "dense"}`` for parameters with ``requires_grad``, identical on
        every rank of ``tp_comm``.

    Raises:
        RuntimeError: TP ranks hold different trainable parameter names or shapes of different rank.
    """
    from .dgc import DGCConfig  # natural ← dgc only for the config, avoid an import cycle at load

    nat = NaturalConfig.from_dict(natural) if natural is not None else NaturalConfig(enabled=False)
    dgc_cfg = DGCConfig.from_dict(dgc) if dgc is not None else DGCConfig(enabled=False)

    # Step 1: embedding weights, and the modules that own each parameter object.
    hf_in, hf_out = _hf_embeddings(model)
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    tied_ids = set()
    if hf_out is not None and getattr(hf_out, "weight", None) is not None:
        tied_ids.add(id(hf_out.weight))
    emb_ids, tied = set(), set()
    for m in model.modules():
        w = m._parameters.get("weight")
        if w is None or not _is_embedding(m, hf_in):
            continue
        emb_ids.add(id(w))
        if id(w) in tied_ids or any(not _is_embedding(o, hf_in) for o in owners[id(w)]):
            tied.add(id(w))

    numel_of = _tp_agreed_numels(model, tp_comm)
    kinds: dict[str, str] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Step 2: untied embeddings are naturally sparse.
        if id(p) in emb_ids and id(p) not in tied and nat.enabled:
            kinds[name] = "natural"
            continue
        # Step 3: the rest by shape and size (the largest TP shard's size).
        if (p.dim() <= 1 or numel_of[name] < dgc_cfg.min_numel or not dgc_cfg.enabled
                or dgc_cfg.keeps_dense(name)):
            kinds[name] = "dense"
        else:
            kinds[name] = "dgc"
        if id(p) in tied and log:
            _log_once("zen: embedding %r is tied to an output layer (its gradient is dense); routing it %r",
                      name, kinds[name])
    if log:
        counts = {k: sum(v == k for v in kinds.values()) for k in ("natural", "dgc", "dense")}
        _log_once("zen: parameter routing %s (natural=%d, dgc=%d, dense=%d)", type(model).__name__,
                  counts["natural"], counts["dgc"], counts["dense"])
    return kinds


def _tp_agreed_numels(model: nn.Module, tp_comm) -> dict[str, int]:
    """Trainable parameter name → the largest numel any TP rank holds for it (the local numel without TP).

    Raises:
        RuntimeError: TP ranks disagree on the trainable names or on a parameter's number of dims.
    """
    mine = {name: (p.numel(), p.dim()) for name, p in model.named_parameters() if p.requires_grad}
    if tp_comm is None or tp_comm.size == 1:
        return {name: numel for name, (numel, _) in mine.items()}
    out = {name: numel for name, (numel, _) in mine.items()}
    for r, theirs in enumerate(tp_comm.all_gather_object(mine)):
        if theirs.keys() != mine.keys():
            diff = sorted(set(theirs) ^ set(mine))
            raise RuntimeError(f"zen: tensor-parallel ranks hold different trainable parameters: rank {r} has "
                               f"{len(theirs)}, rank {tp_comm.rank} has {len(mine)} (differing names, e.g. "
                               f"{diff[:3]}); every TP rank must wrap the same model")
        for name, (numel, dim) in theirs.items():
            if dim != mine[name][1]:
                raise RuntimeError(f"zen: tensor-parallel ranks disagree on parameter {name!r}: rank {r} holds a "
                                   f"{dim}-D shard, rank {tp_comm.rank} a {mine[name][1]}-D one")
            out[name] = max(out[name], numel)
    return out
