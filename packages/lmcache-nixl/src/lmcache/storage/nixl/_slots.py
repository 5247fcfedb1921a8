"""NIXL side of ``nixl_store``: one agent, the L1 arena registered once (one descriptor per
page) and a fixed set of page-sized storage slots (offsets in pre-created files, or one-page
objects). A transfer moves any list of arena pages to or from a list of slots.

NIXL agents are created with thread-sync NONE here, so one thread drives all the calls after
construction (the adapter's I/O thread).
"""

from __future__ import annotations

import os
import secrets
import uuid
from typing import Any

import numpy as np

from lmcache.storage.nixl._arena import Arena
from lmcache.storage.nixl._nixl_api import new_agent
from lmcache.storage.nixl.config import NixlStoreL2AdapterConfig


class SlotStorage:
    def __init__(self, config: NixlStoreL2AdapterConfig, arena: Arena) -> None:
        self.backend = config.backend
        self.page = arena.page
        self.files: list[str] = []
        self._fds: list[int] = []
        self._handles: list[Any] = []  # prepped dlists, released in reverse order
        self._regs: list[Any] = []  # registered descriptor lists
        self.file_size = 0
        if config.is_file_backend:
            self.file_size = int(config.backend_params.get("file_size", arena.page))
            if self.file_size % arena.page:
                raise ValueError(
                    f"file_size ({self.file_size}) must be a multiple of page_size ({arena.page})"
                )
            self.num_slots = config.pool_size * (self.file_size // arena.page)
        else:
            self.num_slots = config.pool_size
        self.name = f"lmcache-nixl-store-{uuid.uuid4()}"
        self.agent: Any = new_agent(self.name, config.backend, config.nixl_backend_params())
        try:
            self._regs.append(self.agent.register_memory(arena.region(), mem_type="DRAM"))
            self._mem = self.agent.prep_xfer_dlist("", arena.page_descs(), mem_type="DRAM")
            self._handles.append(self._mem)
            if config.is_file_backend:
                self._slots = self._file_slots(config)
            else:
                self._slots = self._object_slots(config.pool_size)
            self._handles.append(self._slots)
        except BaseException:
            self.close()
            raise

    def _file_slots(self, config: NixlStoreL2AdapterConfig) -> Any:
        path = config.backend_params["file_path"]
        os.makedirs(path, exist_ok=True)
        flags = os.O_CREAT | os.O_RDWR
        if config.use_direct_io:
            flags |= getattr(os, "O_DIRECT", 0)
        for i in range(config.pool_size):
            name = os.path.join(path, f"obj_{i}_{secrets.token_hex(2)}.bin")
            fd = os.open(name, flags, 0o600)
            self._fds.append(fd)
            self.files.append(name)
        self._regs.append(
            self.agent.register_memory(
                [(0, self.file_size, fd, "") for fd in self._fds], mem_type="FILE"
            )
        )
        per_file = self.file_size // self.page
        descs = np.empty((self.num_slots, 3), dtype=np.uint64)
        slot = np.arange(self.num_slots, dtype=np.uint64)
        descs[:, 0] = (slot % per_file) * self.page
        descs[:, 1] = self.page
        descs[:, 2] = np.asarray(self._fds, dtype=np.uint64)[slot // per_file]
        return self.agent.prep_xfer_dlist(self.name, descs, mem_type="FILE")

    def _object_slots(self, count: int) -> Any:
        tag = secrets.token_hex(2)
        self._regs.append(
            self.agent.register_memory(
                [(0, self.page, i, f"obj_{i}_{tag}") for i in range(count)], mem_type="OBJ"
            )
        )
        return self.agent.prep_xfer_dlist(
            self.name, [(0, self.page, i) for i in range(count)], mem_type="OBJ"
        )

    # --- transfers (I/O thread only) -------------------------------------------------------

    def post(self, op: str, pages: list[int], slots: list[int]) -> Any:
        """Start moving ``pages[i]`` to (WRITE) or from (READ) ``slots[i]``. Returns the handle;
        raises if NIXL refuses the request. Indexes are checked by the caller."""
        handle = self.agent.make_prepped_xfer(
            op,
            self._mem,
            np.asarray(pages, dtype=np.int32),
            self._slots,
            np.asarray(slots, dtype=np.int32),
        )
        try:
            state = self.agent.transfer(handle)
        except BaseException:
            self.release(handle)
            raise
        if state == "ERR":
            self.release(handle)
            raise RuntimeError(f"NIXL refused to post the {op} transfer")
        return handle

    def state(self, handle: Any) -> str:
        """``DONE``, ``PROC`` or ``ERR`` (a backend error is ``ERR``)."""
        return self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> None:
        self.agent.release_xfer_handle(handle)

    # --- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Release NIXL resources and remove the slot files (the index that gave them meaning
        lives in memory only)."""
        for h in reversed(self._handles):
            _quietly(self.agent.release_dlist_handle, h)
        self._handles.clear()
        for reg in reversed(self._regs):
            _quietly(self.agent.deregister_memory, reg)
        self._regs.clear()
        for fd in self._fds:
            _quietly(os.close, fd)
        self._fds.clear()
        for name in self.files:
            _quietly(os.unlink, name)
        self.files.clear()


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:
        pass
