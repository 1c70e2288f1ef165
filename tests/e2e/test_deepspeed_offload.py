"""DeepSpeed ZeRO offload with ZEN's reduce-scatter (ZeRO-3; ZeRO-2 with ``reduce_scatter: true``), on real
gloo processes (2 ranks, ``DS_ACCELERATOR=cpu``).

With ``offload_optimizer`` (and, for ZeRO-3, ``offload_param``) DeepSpeed still reduces each bucket
through the method ZEN overrides, and only then copies the partition to the host: natural-only ZEN
equals plain DeepSpeed with the same offload bit for bit (``ExactToy``: integer gradients), and with DGC
the ``zen`` reduce-scatter equals the ``dense`` one fed the same DGC output. On the CPU accelerator the
"host" is the same memory, so what this holds is the control flow (the override is called, DeepSpeed's
offload bookkeeping runs on its result), not a device-to-host copy. The optimizer is torch's AdamW
(``zero_force_ds_cpu_optimizer: false``), not DeepSpeedCPUAdam, whose C++ build the CPU lab skips.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_deepspeed_zero3 import DGC, _batches, _ds_config, _engine, _train, _weights
from tests.multiproc.launch import run_workers

STEPS = 3
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu"}}
OFFLOAD_BOTH = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
CASES = [("zero3_offload_optimizer", 3, OFFLOAD_OPT), ("zero3_offload_param", 3, OFFLOAD_BOTH),
         ("zero2_offload_optimizer", 2, OFFLOAD_OPT)]


def _offloaded(engine) -> bool:
    opt = engine.optimizer
    return bool(getattr(opt, "offload_optimizer", False) or getattr(opt, "cpu_offload", False))


def _run(rank, stage, zero, zen):
    cfg = _ds_config(stage, zen=zen, zero=zero)
    cfg["zero_force_ds_cpu_optimizer"] = False
    toy = zen is None or "dgc" not in zen  # DGC needs tensors above its min_numel: the tiny Llama
    e = _engine(cfg, toy)
    losses = _train(e, _batches(rank, STEPS, toy), toy)
    out = {"losses": losses, "w": _weights(e), "offloaded": _offloaded(e),
           "param_offload": bool(getattr(e.optimizer, "offload_param", False))}
    if getattr(e, "zen", None) is not None:
        out.update(calls=e.zen.override_calls, sharded=e.zen.sharded, totals=e.zen.totals)
        e.zen.close()
    return out


def _worker(rank, world):
    out = {}
    for name, stage, zero in CASES:
        out[name] = (_run(rank, stage, zero, None), _run(rank, stage, zero, {"scheme": "zen"}))
    dgc = {name: _run(rank, 3, OFFLOAD_OPT, {"scheme": name, "dgc": DGC}) for name in ("zen", "dense")}
    out["dgc"] = dgc
    return out


@pytest.fixture(scope="module")
def runs():
    return run_workers(_worker, 2, timeout_s=900)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_natural_zen_with_offload_equals_plain_offload(runs, name):
    for rank, out in enumerate(runs):
        plain, ours = out[name]
        assert plain["offloaded"] and ours["offloaded"], (name, rank)
        if "param" in name:
            assert ours["param_offload"], (name, rank)
        assert ours["sharded"] and ours["calls"] >= STEPS, (name, rank, ours.get("calls"))
        assert ours["losses"] == plain["losses"], (name, rank)
        assert torch.equal(ours["w"], plain["w"]), (name, rank)


def test_dgc_with_offload_zen_equals_dense_reduce_scatter(runs):
    for rank, out in enumerate(runs):
        zen, dense = out["dgc"]["zen"], out["dgc"]["dense"]
        assert zen["offloaded"] and zen["sharded"], rank
        assert zen["losses"] == dense["losses"], rank
        assert torch.equal(zen["w"], dense["w"]), rank
        assert 0 < zen["totals"]["bytes_sent"] < dense["totals"]["bytes_sent"], rank
