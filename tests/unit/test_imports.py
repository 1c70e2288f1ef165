"""``import zen_ext`` (and its DeepSpeed alias) imports no training engine (engines/__init__.py's promise)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_import_zen_ext_imports_no_engine():
    code = ("import sys, zen_ext, zen_ext.deepspeed, zen_ext.engines.ddp, zen_ext.optim; "
            "print(sorted(m for m in ('deepspeed', 'colossalai') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout
