"""Loads NIXL's Python API (``nixl_agent``, ``nixl_agent_config``) for the adapters.

``pip install nixl==1.5.1`` is a meta package that installs two builds, ``nixl_cu12`` and
``nixl_cu13``; ``import nixl`` picks one from the CUDA version torch reports and, with no CUDA
at all (CPU hosts), takes ``nixl_cu13`` first. That build's OBJ plugin links the CUDA-only
``libcuobjclient.so.1``, so on a CPU host ``create_backend("OBJ")`` fails with
NIXL_ERR_NOT_FOUND ("unsupported backend 'OBJ'"). Without CUDA we therefore prefer
``nixl_cu12``, whose POSIX and OBJ plugins both load on CPU. ``LMCACHE_NIXL_MODULE``
(``nixl``, ``nixl_cu12`` or ``nixl_cu13``) overrides the choice.

NIXL's Python logger writes INFO lines to stdout, which would corrupt the JSON that commands
such as ``lmcache bench l2`` print there: its handler is moved to stderr and, unless
``NIXL_LOG_LEVEL`` is set, lowered to warnings.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from types import ModuleType

ENV_MODULE = "LMCACHE_NIXL_MODULE"
PIP_HINT = "pip install nixl==1.5.1"

_lock = threading.Lock()
_loaded: ModuleType | None = None


def _candidates() -> list[str]:
    chosen = os.environ.get(ENV_MODULE, "").strip()
    if chosen:
        return [chosen]
    try:
        from nixl_meta_utils import detect_cuda_major

        cuda = detect_cuda_major()
    except Exception:  # no meta package, or its probe failed: try the builds directly
        cuda = None
    if cuda is not None:
        return ["nixl"]  # the meta package matches the build to the CUDA runtime
    return ["nixl_cu12", "nixl_cu13", "nixl"]


def _keep_stdout_clean() -> None:
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)


def nixl_api() -> ModuleType:
    """The ``_api`` module of the NIXL build in use (one per process, chosen on first call)."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        errors = []
        for name in _candidates():
            try:
                _loaded = importlib.import_module(f"{name}._api")
                _keep_stdout_clean()
                return _loaded
            except ImportError as exc:
                errors.append(f"{name}: {exc}")
        hint = f" or unset {ENV_MODULE}" if os.environ.get(ENV_MODULE, "").strip() else ""
        raise ImportError(
            f"the nixl adapters need NIXL's Python API ({'; '.join(errors)}); "
            f"install it with `{PIP_HINT}`{hint}"
        )


def nixl_build_name() -> str:
    """``nixl_cu12`` / ``nixl_cu13`` / ``nixl``: which build ``nixl_api()`` loaded."""
    api = nixl_api()
    return api.__name__.rsplit(".", 1)[0]


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def new_agent(name: str, backend: str, params: dict[str, str]) -> object:
    """A NIXL agent (no listener, thread-sync NONE: one thread at a time uses it) with
    ``backend`` created. A backend NIXL cannot create raises RuntimeError naming the plugins
    it found."""
    api = nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    try:
        agent.create_backend(backend, params)
    except Exception as exc:
        plugins = ", ".join(agent.get_plugin_list()) or "none"
        raise RuntimeError(
            f"NIXL ({nixl_build_name()}) could not create backend {backend!r} "
            f"({describe_error(exc)}); plugins found: {plugins}. Check backend_params "
            "(NIXL logs the cause above)"
        ) from exc
    return agent
