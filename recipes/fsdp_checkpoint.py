"""Checkpoints of the FSDP2 recipe (recipes/finetune_llm_fsdp.py): ``torch.distributed.checkpoint``
(DCP) with zen_ext's state inside.

A checkpoint is ``<output_dir>/checkpoints/step<N>/``, one DCP folder holding

* ``model`` and ``optim``: the state dicts of ``torch.distributed.checkpoint.state_dict.get_state_dict``
  (DTensor shards, each rank writing its own; CatchUpAdamW's per-element state is placed as its
  parameter, so it is sharded the same way);
* ``recipe.step``: the optimizer steps done (the data order resumes from it);
* ``zen_ext.rank<NNNNN>``: each rank's ``ZenAttachment.state_dict()`` (DGC residuals differ per rank, so
  every rank has an entry of its own, serialized with ``torch.save`` and read back with
  ``weights_only=True``), as the DeepSpeed recipe's ``<tag>/zen_ext/rank<NNNNN>.pt`` files;

and ``recipe_optimizer.json`` (``common.save_optimizer_name``); ``checkpoints/latest`` names the newest
folder, written once every rank has finished writing.
"""

from __future__ import annotations

import io
import os

import torch
import torch.distributed as dist

from recipes import common

LATEST = "latest"
ZEN_KEY = "zen_ext"


def _entry(rank: int) -> str:
    return f"rank{rank:05d}"


def save(ckpt_dir: str, step: int, model, optimizer, zen, optimizer_name: str) -> str:
    """Write the checkpoint of ``step`` (a collective: every rank calls it); returns its folder.

    1. The model's and the optimizer's sharded state dicts, the step, this rank's ZEN state.
    2. ``dcp.save`` (each rank writes its shards and its ZEN entry; rank 0 the metadata).
    3. Rank 0 records the optimizer's name and, after every rank is done, points ``latest`` here.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    # Step 1: the state.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "recipe": {"step": step}}
    if zen is not None:
        buf = io.BytesIO()
        torch.save(zen.state_dict(), buf)
        state[ZEN_KEY] = {_entry(rank): buf.getvalue()}
    # Step 2: the folder.
    path = os.path.join(ckpt_dir, f"step{step}")
    dcp.save(state, checkpoint_id=path)
    # Step 3: the optimizer's name and the pointer.
    common.save_optimizer_name(path, optimizer_name, rank)
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(ckpt_dir, f"{LATEST}.tmp")
        with open(tmp, "w") as f:
            f.write(os.path.basename(path))
        os.replace(tmp, os.path.join(ckpt_dir, LATEST))
    return path


def latest(ckpt_dir: str) -> str | None:
    """The newest checkpoint folder under ``ckpt_dir``, or None."""
    pointer = os.path.join(ckpt_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(ckpt_dir, f.read().strip())


def load(path: str, model, optimizer, zen) -> int:
    """Restore the model, the optimizer and ZEN from the checkpoint folder ``path`` (a collective);
    returns the step it was saved at.

    1. Fresh state dicts of this run's model and optimizer (DCP loads in place, resharding at another
       world size) and the ZEN entries to read: this rank's, and rank 0's when the checkpoint was saved
       at another world size or holds no entry of this rank's (``ZenAttachment.load_own_or_shared``).
    2. ``dcp.load``, then ``set_state_dict`` into the model and optimizer.
    3. ZEN's state: all of it at the same world size, else the shared part (step counters), with a
       warning.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank()
    # Step 1: what to read.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "recipe": {"step": -1}}
    if zen is not None:
        saved = {k.split(".", 1)[1] for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
                 if k.startswith(ZEN_KEY + ".")}
        want = {e for e in (_entry(rank), _entry(0)) if e in saved}
        if len(saved) == zen.dp_size and _entry(rank) in saved:
            want = {_entry(rank)}  # the usual case: no other rank's residuals read
        if want:
            state[ZEN_KEY] = {e: b"" for e in want}
    # Step 2: the model and the optimizer.
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # Step 3: ZEN.
    if zen is not None:
        entries = state.get(ZEN_KEY, {})

        def read(entry: str) -> dict:
            return torch.load(io.BytesIO(entries[entry]), map_location="cpu", weights_only=True)

        mine = read(_entry(rank)) if _entry(rank) in entries else None
        shared = (lambda: read(_entry(0))) if _entry(0) in entries else None
        zen.load_own_or_shared(mine, shared, where=f"{path} ({ZEN_KEY}.{_entry(rank)})")
    return int(state["recipe"]["step"])
