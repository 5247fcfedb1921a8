"""The L2 adapter test helpers (``tests/native/l2_helpers.py``: ``Helpers`` and the engine /
KV-cache functions of the server tests), loaded once for every test folder.

``tests/native`` is not importable as a package (the repository's own ``native/`` would
shadow it), so the file is loaded by path; the root conftest's ``h`` and ``adapters``
fixtures use it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_NAME = "_lmcache_l2_test_helpers"


def _load() -> ModuleType:
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    path = Path(__file__).resolve().parents[1] / "native" / "l2_helpers.py"
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = mod
    spec.loader.exec_module(mod)
    return mod


L2_HELPERS = _load()
Helpers = L2_HELPERS.Helpers
