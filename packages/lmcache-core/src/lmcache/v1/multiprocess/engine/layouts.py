"""``LayoutTable``: the host chunk layout registered for each (model_name, world_size).

Workers of one model and world size share a layout; it stays after its last worker leaves
(refcount 0, dormant), so lookups keep working across worker restarts."""

from __future__ import annotations

import threading

import torch

from lmcache.utils import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.multiprocess.engine.records import Layout

logger = init_logger(__name__)


class LayoutTable:
    """The registered layouts by (model_name, world_size); registrations change them under
    the table's own lock, requests read them without it (single dict operations)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, int], Layout] = {}
        self._lock = threading.Lock()

    def __getitem__(self, key: tuple[str, int]) -> Layout:
        return self._by_key[key]

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    def get(self, key: tuple[str, int]) -> Layout | None:
        return self._by_key.get(key)

    def items(self) -> list[tuple[tuple[str, int], Layout]]:
        """A snapshot of (key, layout) pairs."""
        return list(self._by_key.items())

    def acquire(
        self, key: tuple[str, int], shape: tuple[int, ...], dtype: torch.dtype, block_size: int = 0
    ) -> None:
        """One more worker uses the layout ``key`` with this chunk ``shape`` and ``dtype``;
        a different shape or dtype replaces the layout (keeping its refcount). ``block_size``
        is the worker's tokens per engine block (the granularity of tails)."""
        with self._lock:
            lay = self._by_key.get(key)
            if lay is None or lay.shape != shape or lay.dtype != dtype:
                if lay is not None and lay.refcount > 0:
                    logger.warning(
                        "layout of model %r world_size %d changes from %s %s to %s %s",
                        key[0],
                        key[1],
                        lay.shape,
                        lay.dtype,
                        shape,
                        dtype,
                    )
                desc = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype])
                refs = lay.refcount if lay is not None else 0
                lay = Layout(key[0], key[1], shape, dtype, desc, refs)
                self._by_key[key] = lay
            lay.refcount += 1
            if block_size > 0:
                lay.block_size = block_size

    def release(self, key: tuple[str, int]) -> None:
        """One worker of the layout ``key`` left."""
        with self._lock:
            lay = self._by_key.get(key)
            if lay is not None and lay.refcount > 0:
                lay.refcount -= 1  # dormant at 0: lookups keep working across restarts
