"""Communicator rules checked without processes: call signatures in SimWorld, devices, options.

* SimWorld behaves as TorchCommunicator when ranks pass different gradients to ``scheme.sync``
  (tests/multiproc/test_nccl_rules.py is the gloo twin): a RuntimeError naming both ranks' values.
* Every tensor the base Communicator hands to its transport lives on ``comm.device`` (a recording
  communicator declares ``meta``, the one device besides the CPU that CI has).
"""

import pytest
import torch

from zen_ext import SimWorld, SparseGrad, build_scheme
from zen_ext.comm.base import Communicator, describe_signature, encode_signature
from zen_ext.core.registry import available_schemes


def _grad(rank: int, numel: int) -> SparseGrad:
    return SparseGrad(torch.tensor([0, 3, numel - 1]), torch.tensor([1.0, 2.0, 3.0]) * (rank + 1), numel)


@pytest.mark.parametrize("name", available_schemes())
def test_simworld_numel_mismatch_raises_every_time_and_never_sums(name):
    scheme = build_scheme(name)
    for _ in range(20):
        with pytest.raises(RuntimeError, match=r"rank \d has numel 10[47].*rank \d has numel 10[47]"):
            SimWorld(2).run(lambda c, x: scheme.sync(c, x), [_grad(0, 104), _grad(1, 107)])


@pytest.mark.parametrize("name", ["dense", "zen", "sparcml"])
def test_simworld_one_odd_rank_of_three_is_detected_by_every_rank(name):
    errors = []

    def body(comm, grad):
        try:
            return build_scheme(name).sync(comm, grad, op="mean" if comm.rank == 2 else "sum")
        except RuntimeError:
            errors.append(comm.rank)
            raise

    with pytest.raises(RuntimeError, match="op 'mean'"):
        SimWorld(3).run(body, [_grad(r, 60) for r in range(3)])
    assert sorted(errors) == [0, 1, 2]  # nobody waits on a collective the others skipped


def test_signature_round_trip_and_nesting():
    w = encode_signature(214_000_000, torch.bfloat16, "mean")
    assert describe_signature(w) == "numel 214000000, dtype torch.bfloat16, op 'mean'"
    assert describe_signature(0).startswith("no sync call")
    comm = SimWorld(1).communicators()[0]
    with comm.signed(5, torch.float32, "sum", "outer"):
        with comm.signed(7, torch.float16, "sum", "inner"):
            assert comm._sig_word == encode_signature(7, torch.float16, "sum")
        assert comm._sig_word == encode_signature(5, torch.float32, "sum")
    assert comm._sig_word == 0


class _Recorder(Communicator):
    """Two-rank communicator that records where its transport's tensors live, then stops."""

    rank, size = 0, 2

    def __init__(self):
        super().__init__()
        self.seen = []

    @property
    def device(self):
        return torch.device("meta")

    def _stop(self, *tensors):
        self.seen += [t.device.type for t in tensors]
        raise StopIteration

    def _exchange_v(self, send):
        self._stop(*send)

    def _all_gather_v(self, t):
        self._stop(t)

    def _all_reduce(self, t, op):
        self._stop(t)

    def _broadcast(self, t, src):
        self._stop(t)


def test_object_gathers_and_signature_checks_are_built_on_comm_device():
    comm = _Recorder()
    with pytest.raises(StopIteration):
        comm.all_gather_object({"scheme": "zen"})
    with pytest.raises(StopIteration), comm.signed(10, torch.float32, "sum", "dense"):
        comm.all_reduce(torch.empty(10, device="meta"))  # the signature all-gather comes first
    assert comm.seen == ["meta", "meta"]


def test_nonfinite_guard_flag_is_built_on_the_guard_comm_device():
    from zen_ext.reduction import BucketReducer

    comm = _Recorder()
    red = BucketReducer.__new__(BucketReducer)  # only the guard step runs before the recorder stops it
    red.calls, red._stats, red.dp_size, red.guard_comm = 0, BucketReducer._empty(), 2, comm
    with pytest.raises(StopIteration):
        red.reduce_(torch.ones(6), [], "sum")
    assert comm.seen == ["meta"]


def test_options_name_transport_and_device():
    comm = SimWorld(2).communicators()[0]
    assert comm.options() == {"transport": "sim", "device_type": "cpu"}
    assert SimWorld(2, device="meta").communicators()[1].device == torch.device("meta")


@pytest.mark.parametrize("name, phases", [
    ("dense", {"comm_s"}), ("agsparse", {"encode_s", "allgather_s", "aggregate_s"}),
    ("sparcml", {"coalesce_s", "rounds_s", "decode_s"}),
    ("omnireduce", {"blocks_s", "partition_s", "push_s", "aggregate_s", "pull_s", "decode_s"}),
    ("sparse_ps", {"partition_s", "push_s", "aggregate_s", "pull_s", "decode_s"}),
])
def test_baseline_phase_timings_come_from_phase_timer(name, phases):
    timings = [{}, {}]
    SimWorld(2).run(lambda c, x: build_scheme(name).sync(c, x, timings=timings[c.rank]), [_grad(r, 300) for r in range(2)])
    for t in timings:
        assert set(t) == phases and all(v >= 0 for v in t.values()), t


def test_nccl_device_is_resolved_at_each_use(monkeypatch):
    from zen_ext.comm.torch_dist import backend_device

    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    assert backend_device("nccl") == torch.device("cuda", 0)
    current[0] = 3  # torch.cuda.set_device(3) after the communicator was built
    assert backend_device("nccl") == torch.device("cuda", 3)
    assert backend_device("cpu:gloo,cuda:nccl") == torch.device("cuda", 3)
    assert backend_device("gloo") == torch.device("cpu")
