"""Bounded waits for state that appears asynchronously (a background store, a prefault, a
reap): each polls until the state is there and fails, naming what never came, once its
timeout passes. They bound how long a test waits; none of them checks speed.

Tests import it as ``testsupport.waiting`` (pyproject's pytest ``pythonpath`` puts
``tests/`` on the path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def eventually(
    cond: Callable[[], Any], what: str = "", timeout: float = 10.0, interval: float = 0.01
) -> None:
    """Return once ``cond()`` is true; AssertionError if it is still false after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"never happened within {timeout} s: {what or cond}")
        time.sleep(interval)


def wait_result(
    poll: Callable[[], T | None], what: str = "", timeout: float = 10.0, interval: float = 0.002
) -> T:
    """The first value of ``poll()`` that is not None; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = poll()
        if value is not None:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"no result within {timeout} s: {what or poll}")
        time.sleep(interval)
