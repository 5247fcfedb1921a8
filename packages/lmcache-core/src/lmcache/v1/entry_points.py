"""Loading plugins from an entry-point group, each one isolated from the others.

Both plugin kinds (``lmcache.device_plugins`` and ``lmcache.l2_adapters``) load through
here: ``ep.load()`` plus the caller's ``validate(ep, obj)``. Whatever either raises makes
that one entry point a :class:`FailedPlugin` (logged with the reason, listed by
``lmcache plugins``); it never stops the others from loading.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from lmcache.utils import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

__all__ = [
    "FailedPlugin",
    "LoadedPlugin",
    "distribution_of",
    "entry_points_of",
    "load_entry_point",
    "load_entry_point_group",
]


@dataclass(frozen=True)
class LoadedPlugin(Generic[T]):
    """What ``validate`` returned for one entry point, and where the entry point came from."""

    name: str
    value: str
    distribution: str
    version: str
    obj: T


@dataclass(frozen=True)
class FailedPlugin:
    """An entry point that did not load, with the reason (``ExcType: message``)."""

    name: str
    value: str
    distribution: str
    reason: str

    def as_tuple(self) -> tuple[str, str, str]:
        """``(name, value, reason)``: the shape ``failed_*_plugins()`` return."""
        return (self.name, self.value, self.reason)


def distribution_of(ep: Any) -> tuple[str, str]:
    """(distribution name, version) of an entry point; empty strings when unknown."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "", ""
    try:
        return str(dist.metadata["Name"]), str(dist.version)
    except Exception:
        return "", ""


def entry_points_of(group: str) -> list[md.EntryPoint]:
    """Every entry point of ``group`` in discovery (sys.path) order."""
    return list(md.entry_points(group=group))


def load_entry_point(
    ep: Any, validate: Callable[[Any, Any], T], *, kind: str
) -> LoadedPlugin[T] | FailedPlugin:
    """``validate(ep, ep.load())``; any exception becomes a logged :class:`FailedPlugin`.

    ``kind`` names the plugin kind in the log line ("device", "L2 adapter").
    """
    dist, version = distribution_of(ep)
    try:
        obj = validate(ep, ep.load())
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "Failed to load LMCache %s plugin %r (%s, distribution %s): %s",
            kind,
            ep.name,
            ep.value,
            dist or "unknown",
            reason,
        )
        logger.debug("traceback of %s plugin %r", kind, ep.name, exc_info=True)
        return FailedPlugin(ep.name, ep.value, dist, reason)
    return LoadedPlugin(ep.name, ep.value, dist, version, obj)


def load_entry_point_group(
    group: str,
    validate: Callable[[Any, Any], T],
    *,
    kind: str,
    entry_points: Iterable[Any] | None = None,
) -> tuple[list[LoadedPlugin[T]], list[FailedPlugin]]:
    """Load every entry point of ``group`` (or the given ``entry_points``, in that order).

    Returns the loaded plugins and the failed ones; a failure never raises.
    """
    loaded: list[LoadedPlugin[T]] = []
    failed: list[FailedPlugin] = []
    for ep in entry_points_of(group) if entry_points is None else entry_points:
        result = load_entry_point(ep, validate, kind=kind)
        if isinstance(result, FailedPlugin):
            failed.append(result)
        else:
            loaded.append(result)
    return loaded, failed


class ProcessDefault(Generic[T]):
    """The one registry a process uses, created on first use; tests swap in their own.

    ``get()`` builds it with ``factory`` on the first call; ``use(obj)`` makes ``obj`` the
    default for a ``with`` block and restores the previous one after it.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    @contextlib.contextmanager
    def use(self, value: T) -> Iterator[T]:
        with self._lock:
            previous, self._value = self._value, value
        try:
            yield value
        finally:
            with self._lock:
                self._value = previous
