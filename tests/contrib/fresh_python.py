"""Shared by the contrib alias tests: run a script in a fresh interpreter (nothing culmen or apex imported yet,
so ``culmen.compat.install()`` starts from a clean ``sys.modules``) with the repo on ``PYTHONPATH``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout: float = 120) -> str:
    """Run the (dedented) ``code`` with ``python -c`` from the repo root; assert it exits 0 and return its
    stripped stdout (the failure message carries stdout and stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()
