"""Anonymous host mappings for the L1 pool, without torch (``config`` checks sizes with it
at flag-parsing time, ``l1_memory`` builds its arena with it).

- ``PREFAULT_MODES``: when L1 pages are backed (see ``l1_memory``): the whole pool at
  start, ahead of use, or never.
- ``map_anonymous(size)``: a private anonymous mapping that reserves no swap.
- ``mapping_error(size)``: why this machine cannot map ``size`` bytes, or None.
"""

from __future__ import annotations

import mmap
import sys

__all__ = ["MAP_NORESERVE", "PREFAULT_MODES", "map_anonymous", "mapping_error"]

#: when L1 pages are backed (see l1_memory): the whole pool at start, ahead of use, or never
PREFAULT_MODES = ("all", "ahead", "off")

#: ``mmap.MAP_NORESERVE`` where Python exposes it (Linux's value otherwise, 0 elsewhere).
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


def map_anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes. NORESERVE: a lazy L1 larger than free
    RAM only commits what it touches, so it must start (with a warning) instead of failing
    with ENOMEM."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)


def mapping_error(size: int) -> str | None:
    """Why this machine cannot map an L1 pool of ``size`` bytes (its address space or the
    kernel's overcommit policy), or None when it can. Maps nothing for long: no page is
    touched and the mapping is closed at once."""
    try:
        map_anonymous(size).close()
    except (OSError, OverflowError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc)
    return None
