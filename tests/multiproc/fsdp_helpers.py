"""What the FSDP2 and HSDP tests share (tests/multiproc/test_fsdp.py, test_fsdp_hsdp.py, test_fsdp_node.py,
test_fsdp_float_sums.py): the SGD loop that records a run (every step's loss and gradient shard, the final
weight shards), the bitwise comparison of two such runs, a resume from a run's state, the bytes of a state
dict, an error caught for the test to read."""

from __future__ import annotations

from typing import Callable, Iterator

import torch


def train_sgd(model, batch: Callable[[int], tuple], steps: int, start: int = 0, lr: float = 0.25,
              accumulate: int = 1) -> tuple[list[float], list[dict], dict]:
    """``steps`` SGD steps of the sharded ``model``, step ``s`` on micro-batches ``batch(accumulate·s + m)``.

    With ``accumulate`` > 1 the micro-batches but the last only reduce-scatter (HSDP's
    ``set_requires_all_reduce(False)``). Returns ``(losses, grads, params)``: the last micro-batch's loss of
    every step, every step's local gradient shards and the final local parameter shards, by name.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for step in range(start, start + steps):
        for micro in range(accumulate):
            if accumulate > 1:
                model.set_requires_all_reduce(micro == accumulate - 1)
            loss = model(*batch(accumulate * step + micro))
            loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().to_local().clone() for n, p in model.named_parameters()}


def resume_into(model, weights_from, zen: dict, state: dict):
    """``zen_ext.fsdp.attach(model, zen)`` resumed as from a checkpoint: ``model``'s local shards copied from
    ``weights_from`` (what the engine's checkpoint restores), then ``state`` loaded (what zen_ext's restores).
    Returns the attachment and its state dict right after loading (for the round-trip check)."""
    import zen_ext.fsdp

    with torch.no_grad():
        for p, q in zip(model.parameters(), weights_from.parameters()):
            p.to_local().copy_(q.to_local())
    attachment = zen_ext.fsdp.attach(model, zen)
    attachment.load_state_dict(state)
    return attachment, attachment.state_dict()


def assert_same_run(ref, got, where: str) -> None:
    """Two ``train_sgd`` results are bitwise equal: losses, every step's gradient shards, final weights."""
    assert got[0] == ref[0], where
    for step, (r, g) in enumerate(zip(ref[1], got[1])):
        for name in r:
            assert torch.equal(g[name], r[name]), f"{where} step {step} {name}"
    for name in ref[2]:
        assert torch.equal(got[2][name], ref[2][name]), f"{where} {name}"


def tensors(sd) -> Iterator[torch.Tensor]:
    """Every tensor inside a state dict (nested dicts, lists and tuples)."""
    if isinstance(sd, torch.Tensor):
        yield sd
    elif isinstance(sd, dict):
        for v in sd.values():
            yield from tensors(v)
    elif isinstance(sd, (list, tuple)):
        for v in sd:
            yield from tensors(v)


def state_bytes(sd) -> int:
    """Bytes of every tensor inside a state dict (DGC's residuals and thresholds)."""
    return sum(t.numel() * t.element_size() for t in tensors(sd))


def caught(fn) -> tuple[str, str] | None:
    """``(type name, message)`` of the exception ``fn()`` raises; None when it raises none."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        return type(exc).__name__, str(exc)
    return None
