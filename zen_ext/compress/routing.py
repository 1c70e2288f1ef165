"""Which sparsifier each parameter's gradient goes to (``param_kinds``), decided once per model.

``classify_parameters`` gathers the facts about every trainable parameter once (``ParamFacts``: its
shape, its size over the tensor-parallel group, whether it is an embedding and whether that embedding
is tied to an output layer), then gives each parameter to the first *enabled* registered sparsifier,
by priority, whose ``claims`` takes it (``registry.py``), and to ``"dense"`` when none does.
"""

from __future__ import annotations

import logging
import math

from torch import nn

from .registry import DENSE, ParamFacts, registered

logger = logging.getLogger(__name__)
_logged: set[str] = set()


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
    model: nn.Module, *, sections: "dict | None" = None, log: bool = True, tp_comm=None, **by_kind,
) -> dict[str, str]:
    """Each trainable parameter's path, keyed by its ``named_parameters()`` name.

    1. Parse every registered sparsifier's section (absent = disabled).
    2. Find embedding weights and which of them are tied: the same Parameter object is also the
       weight of a non-embedding module (e.g. the LM head) or HF's ``get_output_embeddings()``.
    3. Size each parameter by its *largest shard over the TP group* (one gathered fact, the same on
       every TP rank), never the local shard's: with uneven AutoTP shards a local size would route a
       parameter to DGC on one TP rank and dense on another, and DGC's per-layer threshold exchange
       over the TP group would then wait for a rank that never joins.
    4. Give each parameter to the first enabled sparsifier (by priority) that claims it, else
       ``"dense"``. The built-ins: untied embeddings → ``"natural"``; then parameters that are not
       1-D, have at least ``dgc.min_numel`` elements and match no ``dgc.dense_params`` → ``"dgc"``.

    Args:
        model: the model (unwrapped or wrapped: names are those of ``model.named_parameters()``).
        sections: the ``zen.<kind>`` section of each sparsifier to use, by kind, as a dict or its config
            class (``ZenConfig.sections()``); a kind without one is disabled.
        log: log a summary and each tied embedding once.
        tp_comm: the tensor-parallel group (a Communicator), or None. With more than one rank, the
            TP ranks gather their parameter names and shard sizes once (a collective: every TP rank
            must call this).
        **by_kind: sections given one by one as keywords, e.g. ``natural={}``, ``dgc={"enabled": True}``
            (merged with ``sections``; a value None = disabled).

    Returns:
        ``{name: kind}`` for parameters with ``requires_grad`` (a registered kind or ``"dense"``),
        identical on every rank of ``tp_comm``.

    Raises:
        ValueError: ``sections`` names a kind that is not registered.
        RuntimeError: TP ranks hold different trainable parameter names or shapes of different rank.
    """
    # Step 1: the enabled sparsifiers, in classification order.
    given = {**by_kind, **(sections or {})}
    specs = {s.kind: s for s in registered()}
    unknown = sorted(set(given) - set(specs))
    if unknown:
        raise ValueError(f"classify_parameters sections ({unknown}) must be registered sparsifier kinds: "
                         f"{sorted(specs)}")
    claimants = []
    for spec in specs.values():  # by priority
        cfg = spec.parse(given[spec.kind]) if given.get(spec.kind) is not None else None
        if cfg is not None and cfg.enabled:
            claimants.append((spec, cfg))

    # Step 2: embedding weights, and the modules that own each parameter object.
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

    # Step 3: sizes agreed over the TP group.
    numel_of = _tp_agreed_numels(model, tp_comm)

    # Step 4: the first claim wins.
    kinds: dict[str, str] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        facts = ParamFacts(name, len(_full_shape(p)), numel_of[name], id(p) in emb_ids, id(p) in tied)
        kinds[name] = next((spec.kind for spec, cfg in claimants if spec.cls.claims(facts, cfg)), DENSE)
        if facts.tied and log:
            _log_once("zen: embedding %r is tied to an output layer (its gradient is dense); routing it %r",
                      name, kinds[name])
    if log:
        names = [s.kind for s in specs.values()] + [DENSE]
        counts = ", ".join(f"{k}={sum(v == k for v in kinds.values())}" for k in names)
        _log_once("zen: parameter routing %s (%s)", type(model).__name__, counts)
    return kinds


def _tp_agreed_numels(model: nn.Module, tp_comm) -> dict[str, int]:
    """Trainable parameter name → the largest numel any TP rank holds for it (the local numel without TP).

    Raises:
        RuntimeError: TP ranks disagree on the trainable names or on a parameter's number of dims.
    """
    mine = {name: (math.prod(_full_shape(p)), len(_full_shape(p))) for name, p in model.named_parameters()
            if p.requires_grad}
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


def _full_shape(p) -> tuple:
    """A parameter's full shape, also when DeepSpeed ZeRO-3 has partitioned it (``ds_shape``: the local
    tensor is then empty, and the routing must see the parameter the gradient covers)."""
    return tuple(getattr(p, "ds_shape", p.shape))
