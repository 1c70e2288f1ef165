"""A CUDA gradient that meets a build without the CUDA kernel takes the reference, with ONE warning."""

import types
import warnings

import pytest
import torch

import zen_ext.ops as ops


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build without a usable CUDA kernel")
def test_cuda_tensor_without_cuda_kernel_warns_once_with_the_fix(monkeypatch):
    monkeypatch.setattr(ops, "_warned_reference", set())
    fake_cuda = types.SimpleNamespace(device=torch.device("cuda"))  # what _has_kernel reads of a CUDA tensor
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert ops._has_kernel("permute", fake_cuda) is False
        assert ops._has_kernel("decode_pull_", fake_cuda) is False
        assert ops._has_kernel("permute", torch.zeros(1, dtype=torch.int64)) is ops.HAVE_CPP_OP  # CPU: no warning
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "pure-torch reference" in msgs[0] and "CUDA_HOME" in msgs[0] and "launch/setup.sh" in msgs[0]
