"""ZeRO-1/2 with ``reduce_scatter: true``, ``overlap_comm`` and ``zen.async_sync``: whole IPG buckets go
to the communication worker, which runs ZEN's reduce-scatter of DeepSpeed's owner segments and
DeepSpeed's copy into the gradient partition while the backward pass fills the other IPG buffer
(``engines/deepspeed_ipg.py``), on 2 gloo processes (tiny untied Llama).

* natural rows and DGC: the asynchronous run equals the blocking one bitwise (losses, weights), and
  natural-only equals plain DeepSpeed;
* proof of overlap: the worker holds each bucket 50 ms longer, and gradients of earlier layers are
  produced inside those windows;
* ZeRO-3 says why it keeps the reduce-scatter on the training thread.
"""

import time

import torch

from tests.e2e.test_deepspeed_engine import _batches, _ds_config, _engine, _train, _weights
from tests.multiproc.launch import run_workers

ZERO = {"overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 20000}
DGC = {"enabled": True, "min_numel": 1024, "momentum_correction": False, "warmup_steps": 0}


def _worker(rank, world):
    out = {}
    for stage in (1, 2):
        batches = _batches(rank, 3, seed=7)
        for what, zen in (("natural", {"scheme": "zen"}), ("dgc", {"scheme": "zen", "dgc": DGC})):
            blocking = _engine(_ds_config(stage, zen=dict(zen), zero=ZERO))
            piped = _engine(_ds_config(stage, zen=dict(zen, async_sync=True), zero=ZERO))
            windows, grad_times = [], []
            finish = piped.zen.async_ipg.finish

            def slow_finish(*a, finish=finish, windows=windows):
                t0 = time.perf_counter()
                time.sleep(0.05)
                res = finish(*a)
                windows.append((t0, time.perf_counter()))
                return res

            piped.zen.async_ipg.finish = slow_finish
            for p in piped.module.parameters():
                p.register_hook(lambda g, ts=grad_times: ts.append(time.perf_counter()))
            case = {"blocking": _train(blocking, batches), "async": _train(piped, batches),
                    "blocking_w": _weights(blocking), "async_w": _weights(piped), "off": piped.zen.async_ipg_off,
                    "sharded": piped.zen.sharded, "ipg_buckets": piped.zen.async_ipg_buckets,
                    "windows": len(windows), "last": piped.zen.stats.last,
                    "overlapped": sum(1 for t in grad_times if any(a < t < b for a, b in windows))}
            if what == "natural":
                plain = _engine(_ds_config(stage, zero=ZERO))
                case["plain"], case["plain_w"] = _train(plain, batches), _weights(plain)
            piped.zen.close()
            blocking.zen.close()
            out[(stage, what)] = case
    z3 = _engine(_ds_config(3, zen={"scheme": "zen", "async_sync": True}, zero=ZERO))
    out["zero3_off"] = z3.zen.async_ipg_off
    z3.zen.close()
    return out


def test_reduce_scatter_ipg_buckets_overlap_the_backward_pass_bitwise():
    for rank, res in enumerate(run_workers(_worker, 2, timeout_s=900)):
        for (stage, what), got in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
            where = (rank, stage, what)
            assert got["sharded"] and got["off"] is None, where
            assert got["ipg_buckets"] >= 6 and got["windows"] == got["ipg_buckets"], (where, got["ipg_buckets"])
            assert got["overlapped"] >= 1, where
            assert got["async"] == got["blocking"], where
            assert torch.equal(got["async_w"], got["blocking_w"]), where
            if what == "natural":
                assert got["async"] == got["plain"], where
                assert torch.equal(got["async_w"], got["plain_w"]), where
                assert 0 < got["last"]["nnz"]["natural"] < got["last"]["numel"]["natural"], where
            else:
                assert got["last"]["nnz"]["dgc"] < got["last"]["numel"]["dgc"], where
        assert "ZeRO-3" in res["zero3_off"], res["zero3_off"]
