"""A retrieve's copy gate and the server-side deadline: how a worker that stops waiting for a
retrieve makes sure nothing writes into those KV blocks afterwards (vLLM may have handed them
to another request). Torch-free: the connector imports it before any worker exists."""

from __future__ import annotations

import threading
import time

__all__ = ["CopyGate", "server_copy_deadline"]


class CopyGate:
    """Whether a retrieve may still write into the engine's KV blocks.

    The thread that copies holds it open for the copy (``begin``/``end``); the thread that
    waits for the retrieve closes it when it gives up (``close``). After a successful close
    the blocks are the engine's again (vLLM may hand them to another request), so no copy
    starts; a close fails while a copy runs, and the waiter then waits for that copy, which
    is local and short.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed = False

    def begin(self) -> bool:
        """True: the copy may run, and must call ``end`` after it. False: given up on."""
        self._lock.acquire()
        if self._closed:
            self._lock.release()
            return False
        return True

    def end(self) -> None:
        self._lock.release()

    def close(self) -> bool:
        """Give up on the retrieve: True once no copy can start; False while one runs."""
        if not self._lock.acquire(blocking=False):
            return False
        self._closed = True
        self._lock.release()
        return True


def server_copy_deadline(timeout: float) -> float:
    """The ``FEATURE_RETRIEVE_DEADLINE`` deadline of a retrieve its worker waits ``timeout``
    seconds for: the server must start the copy a margin before the worker gives up, the
    time a started copy may take (2 s, or a quarter of a short timeout)."""
    return time.time() + timeout - min(2.0, timeout / 4)
