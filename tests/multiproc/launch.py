"""Test-side alias of the local gloo launcher (``zen_ext.comm.local.run_workers``)."""

from zen_ext.comm.local import free_port, run_workers

__all__ = ["free_port", "run_workers"]
