"""``lmcache_nvtx_annotate``: NVTX ranges around hot functions when CUDA profiling is possible.

vLLM's in-tree LMCache connector imports this decorator from ``lmcache.utils`` under
LMCache's name ``_lmcache_nvtx_annotate``. Without a
CUDA build of torch (or without a GPU) it returns the function unchanged, so it costs nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _nvtx_range_factory() -> Callable[[str], Any] | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.nvtx.range
    except Exception:  # no torch, or a torch without a usable CUDA runtime
        return None
    return None


def lmcache_nvtx_annotate(func: F | None = None, *, name: str | None = None) -> Any:
    """Decorate ``func`` so each call is one NVTX range named after it (or ``name``)."""

    def decorate(f: F) -> F:
        nvtx_range = _nvtx_range_factory()
        if nvtx_range is None:
            return f
        label = name or getattr(f, "__qualname__", getattr(f, "__name__", "lmcache"))

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with nvtx_range(label):
                return f(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate(func) if func is not None else decorate
