"""torch 2.13's known exit abort on gloo, and the one retry policy the e2e tests apply to it.

torch's DDP/FSDP2 process groups on gloo abort at interpreter exit in about 1 run in 20-60, with or without
ZEN, after the run's work is done (docs/colossalai.md, "Ending a run"; the last line it prints is
``TORCH_EXIT_ABORT``). A launch that fails with exactly that is run again, up to ``EXIT_ABORT_TRIES`` times in
all (a CI run on 2026-11-27 hit it twice in a row); any other failure is returned at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

TORCH_EXIT_ABORT = "terminate called without an active exception"
EXIT_ABORT_TRIES = 3


def run_retrying_exit_abort(cmd: list[str], out_dir: str | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, again after torch's exit abort.

    ``out_dir``: the run's output directory, put back as it was before the first try (or removed) before each
    retry, so a retried run writes exactly what one run would (logs appended to, checkpoints a resumed run
    starts from)."""
    backup = None
    if out_dir and os.path.isdir(out_dir):
        backup = os.path.join(tempfile.mkdtemp(), "before")
        shutil.copytree(out_dir, backup)
    try:
        for attempt in range(EXIT_ABORT_TRIES):
            proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
            if (proc.returncode == 0 or TORCH_EXIT_ABORT not in proc.stdout + proc.stderr
                    or attempt == EXIT_ABORT_TRIES - 1):
                return proc
            print(f"retrying {' '.join(cmd)[-80:]!r} after torch's exit abort")
            if out_dir:
                shutil.rmtree(out_dir, ignore_errors=True)
                if backup:
                    shutil.copytree(backup, out_dir)
    finally:
        if backup:
            shutil.rmtree(os.path.dirname(backup), ignore_errors=True)
    raise AssertionError("unreachable")
