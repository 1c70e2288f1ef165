"""Host synchronizations per ``zen`` call are bounded by a constant independent of the ranks.

On a GPU every read of a device value on the host (``.item()``, ``.tolist()``, ``int(t)``, ``.cpu()``,
``nonzero``, boolean-mask indexing, ...) stalls the stream. The counter below wraps those tensor
functions with a ``TorchFunctionMode`` in every SimWorld rank and counts the calls a ``zen`` sync makes
(the scheme, its ops' Python wrappers and the communicator's Python code; C++ ops are opaque to it,
and their CPU kernels read nothing back). The bound must hold at n = 4 and n = 16 with the same count.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.unit.test_zen_scheme import int_inputs
from zen_ext import SimWorld, build_scheme

MAX_SYNCS = 8
_T = torch.Tensor
SYNCING = {
    _T.item, _T.tolist, _T.cpu, _T.numpy, _T.__int__, _T.__float__, _T.__bool__, _T.__index__, _T.nonzero,
    torch.nonzero, _T.unique, torch.unique, torch.masked_select, _T.masked_select,
}
"""(``any``/``all`` return a device tensor: the read is the ``bool()`` of it, counted as ``__bool__``.)"""


class SyncCounter(TorchFunctionMode):
    """Counts calls that read device data on the host (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in SYNCING:
            self.calls.append(name)
        elif func is _T.__getitem__ and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            self.calls.append("bool-mask index")
        elif func is _T.to and any(isinstance(a, (str, torch.device)) and str(a) == "cpu" for a in args[1:]):
            self.calls.append("to(cpu)")
        return func(*args, **kwargs)


def test_counter_sees_the_usual_suspects():
    t = torch.arange(5)
    with SyncCounter() as c:
        t.sum().item(), t.tolist(), int(t[0]), t.nonzero(), bool(t.any()), t[t > 2], float(t[1])
    assert len(c.calls) >= 7, c.calls


def _count(n, pull_format, op, width=1, dtype=torch.float32):
    inputs = int_inputs(n, numel=50_003, nnz=400, seed=n, width=width, dtype=dtype)
    scheme = build_scheme("zen", pull_format=pull_format)

    def fn(comm, x):
        scheme.sync(comm, x, op=op)  # warm-up: builds the partitioner, caches keys per device
        with SyncCounter() as c:
            out = scheme.sync(comm, x, op=op)
        return c.calls, out

    return SimWorld(n).run(fn, inputs)


@pytest.mark.parametrize("pull_format", ["auto", "coo", "bitmap", "dense"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_host_syncs_bounded_and_independent_of_n(pull_format, op):
    per_n = {}
    for n in (4, 16):
        got = _count(n, pull_format, op)
        counts = {len(calls) for calls, _ in got}
        assert max(counts) <= MAX_SYNCS, got[0][0]
        per_n[n] = max(counts)
    assert per_n[4] == per_n[16], per_n


def test_row_form_half_precision_bounded():
    got = _count(16, "auto", "mean", width=3, dtype=torch.bfloat16)
    assert max(len(calls) for calls, _ in got) <= MAX_SYNCS
