"""Helpers of the serde interchange tests with LMCache 0.5.6 (tests/compat/test_serde_compat.py,
tests/compat/test_turboquant_compat.py): ``drive`` runs tests/compat/serde_fs_driver.py in
one side's venv, ``files`` reads what an fs L2 directory holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DRIVER = Path(__file__).parent.parent / "compat" / "serde_fs_driver.py"
SIDES = ("theirs", "ours")
ALL_HITS = {"hits": [True] * 4}
NO_HITS = {"hits": [False] * 4}


def drive(
    venvs, side: str, *steps: tuple[str, dict, Path], env: dict[str, str] | None = None
) -> list[dict]:
    """Run ``(op, adapter spec, out dir)`` steps in one process of ``side``'s venv (``env``:
    extra environment variables); the driver's list of results."""
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", **(env or {})}
    if side == "theirs":  # a PYTHONPATH naming our sources would shadow 0.5.6's
        env.pop("PYTHONPATH", None)
        python = str(venvs["theirs"] / "bin" / "python")
    else:
        python = sys.executable
    arg = json.dumps([{"op": op, "spec": spec, "out": str(out)} for op, spec, out in steps])
    proc = subprocess.run(
        [python, str(DRIVER), arg], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, (side, steps, proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def files(base: Path) -> dict[str, bytes]:
    """The ``*.data`` files of an fs L2 directory by name."""
    return {p.name: p.read_bytes() for p in sorted(base.iterdir()) if p.suffix == ".data"}
