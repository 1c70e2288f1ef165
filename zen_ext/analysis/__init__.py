"""Offline tools: sparsity metrics, gradient traces, calibrated workloads, the simulator CLI
(``python -m zen_ext sim``) and ``auto``'s predictions at more hosts. Training never imports them; the
runtime planner is ``zen_ext/planner/``.
"""
