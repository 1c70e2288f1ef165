"""Sparsity analytics, gradient traces, calibrated workloads, the α–β cost model and the ``auto`` planner.

Nothing here imports an engine; ``zen_ext.analysis.planner`` registers the ``auto`` scheme.
"""
