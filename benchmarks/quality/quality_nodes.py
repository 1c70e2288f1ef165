"""Emulated nodes for the time-to-quality benchmark: the DeepSpeed recipe on ``nodes × local`` ranks of
this machine, launched as DeepSpeed's multi-node runner launches them.

DeepSpeed's ``deepspeed --hostfile`` runner starts ``deepspeed.launcher.launch`` once per node (over pdsh)
with the same ``--world_info`` (every node's local ranks) and that node's ``--node_rank``; each starts
its local ranks with ``RANK``, ``LOCAL_RANK`` and ``LOCAL_SIZE`` set. Here every node's launcher runs on
this machine with ``ZEN_EXT_HOST=node<k>``, the name zen_ext decides its hierarchy from
(``zen_ext/reduction/hierarchy.py``), so ``zen.hierarchical`` sees ``nodes`` nodes of ``local`` ranks, as
on a real cluster. Used by ``bench_quality.py`` for the variants with ``_nodes`` (ZeRO-3 node-level
against flat DGC at 2 nodes × 2 ranks: ``benchmarks/quality/results/time_to_quality_node_level.md``).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time


def launch_nodes(script: str, args_list: list[str], log_path: str, port: int, nodes: int, local: int,
                 cwd: str, env: dict, timeout_s: float) -> float:
    """Run ``script`` on ``nodes × local`` ranks, one DeepSpeed launcher per emulated node; returns the wall
    time in seconds. Raises naming the log when any node's launcher fails (the others are stopped)."""
    # Step 1: the world every launcher is given: node name -> its local device indices.
    world = {f"node{k}": list(range(local)) for k in range(nodes)}
    world_info = base64.urlsafe_b64encode(json.dumps(world).encode()).decode()
    t0 = time.perf_counter()
    procs, logs = [], []
    try:
        # Step 2: one launcher per node, each under its own emulated host name, all logging to one file
        # per node (``log_path`` for node 0, ``log_path.node<k>`` for the others).
        for k in range(nodes):
            path = log_path if k == 0 else f"{log_path}.node{k}"
            log = open(path, "w")
            logs.append(log)
            cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}",
                   f"--node_rank={k}", "--master_addr=127.0.0.1", f"--master_port={port}", script, *args_list]
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=dict(env, ZEN_EXT_HOST=f"node{k}"),
                                          stdout=log, stderr=subprocess.STDOUT))
        # Step 3: wait for all; a failed or stuck node stops the rest (its peers would wait forever).
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(c != 0 for c in codes):
        raise RuntimeError(f"run on {nodes} emulated nodes × {local} ranks failed (exit codes {codes}, "
                           f"None: stopped); see {log_path} and {log_path}.node*")
    return time.perf_counter() - t0
