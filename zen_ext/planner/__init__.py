"""The runtime planner: the ``auto`` scheme (``auto.py``) and what it predicts with (the α–β cost model,
the compute model, sparsity profiles, calibration, refinement from measured syncs). Offline tools
(simulator CLI, traces, workloads, predictions at scale) are ``zen_ext/analysis/``."""
