"""Each rank's memory in a recipe run, split at engine init (``--memory_report``).

A rank's peak resident set (``ru_maxrss``) over a whole run can be set at init (a model built in full on
every rank before ZeRO-3 partitions it) and then hides what training adds (the optimizer's state, ZEN's
DGC residual and buffers). So the report records, per rank:

1. at engine init, before the first step: the resident set now (``init_rss_mib``) and the peak so far
   (``init_peak_mib``), then resets the kernel's peak (``/proc/self/clear_refs``, "5": Linux >= 4.0), so
2. after the last training step, before the final checkpoint is saved: the peak since init
   (``train_peak_mib``: the training steps, and the evaluation at the last one; ``ru_maxrss``, KiB on
   Linux), the resident set now (``end_rss_mib``), and zen_ext's own state bytes: every tensor of the
   Synchronizer's ``state_dict()`` (DGC residual or its 4-bit codes and scales, thresholds), summed by
   storage, with the parameters ``params`` and those routed to DGC ``dgc_params``.

``peak_rss_mib`` is the run's peak up to its last step, the larger of the two (the checkpoint save after
it is not counted). Where the kernel refuses the reset, ``train_peak_mib`` is the peak of the whole run
and ``peak_reset`` is false. A CPU resident set includes the allocator's caches and the interpreter,
torch and DeepSpeed themselves (about 500 MiB a rank).
"""

from __future__ import annotations

import resource

import torch


def _rss_kib() -> int:
    """The resident set now (VmRSS, KiB)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no VmRSS line: the memory report needs Linux")


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> bool:
    """Reset this process's peak resident set to the current one; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def state_bytes(tensors) -> int:
    """Bytes of the storages under the tensors of a nested dict/list, each storage counted once (views of
    one flat buffer are one buffer)."""
    seen: dict[int, int] = {}

    def walk(obj) -> None:
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(tensors)
    return sum(seen.values())


class MemoryReport:
    """One rank's record: ``at_init()`` once the engine is built, ``at_train_end(zen, module)`` after the
    last step (before the checkpoint); ``rec`` is what the recipe gathers and writes into summary.json."""

    def __init__(self) -> None:
        self.rec: dict = {}

    def at_init(self) -> None:
        # Step 1: what init left resident and its own peak, then a fresh peak for the training steps.
        self.rec.update(init_rss_mib=_rss_kib() / 1024, init_peak_mib=_peak_kib() / 1024)
        self.rec["peak_reset"] = _reset_peak()

    def at_train_end(self, zen, module) -> None:
        # Step 2: the training peak and what zen_ext itself holds (no zen: 0 bytes).
        self.rec.update(train_peak_mib=_peak_kib() / 1024, end_rss_mib=_rss_kib() / 1024)
        self.rec["peak_rss_mib"] = max(self.rec["train_peak_mib"], self.rec.get("init_peak_mib", 0.0))
        numel = {n: getattr(p, "ds_numel", p.numel()) for n, p in module.named_parameters()}
        self.rec["params"] = sum(numel.values())
        if zen is None:
            self.rec.update(zen_state_bytes=0, dgc_params=0)
            return
        self.rec["zen_state_bytes"] = state_bytes(zen.sync.state_dict())
        self.rec["dgc_params"] = sum(numel[n] for n, k in zen.sync.param_kinds.items() if k == "dgc" and n in numel)
