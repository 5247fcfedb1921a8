"""``nixl_native``: the NIXL connector behind core's ``NativeConnectorL2Adapter``
(docs/design/storage-engine.md#native-bridge, docs/design/storage-engine.md#backend-nixl).

The bridge does locking, accounting and routing; this subclass builds the connector (FILE or
OBJ, inferred from the plugin), refuses eviction where the storage cannot delete, turns padding
on exactly when direct I/O is in effect, recovers the usage of files already under
``file_path`` at start (oldest first, like ``fs``), and reports health.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from lmcache.storage.nixl._arena import Arena
from lmcache.storage.nixl._health import Health
from lmcache.storage.nixl._native_connector import NixlConnector, open_connector
from lmcache.storage.nixl._nixl_api import nixl_build_name
from lmcache.storage.nixl.config import NixlNativeL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import (
    NativeConnectorL2Adapter,
    filename_to_object_key,
    init_logger,
)

logger = init_logger(__name__)

STALE_TMP_S = 3600
SCAN_BATCH = 1024


class NixlNativeL2Adapter(NativeConnectorL2Adapter):
    replay_known_keys = True  # recovered or stored keys reach late listeners

    def __init__(self, config: NixlNativeL2AdapterConfig, l1_memory_desc: Any) -> None:
        arena = Arena(l1_memory_desc, "nixl_native")
        self._cfg = config
        # NIXL's own errors (the base class keeps a HealthTracker of its own in _health)
        self._nixl_health = Health(logger, f"nixl_native ({config.backend})")
        connector = open_connector(
            config.backend, config.backend_params, config.num_workers, arena, self._nixl_health
        )
        try:
            if config.eviction_config is not None and not connector.supports_delete:
                raise ValueError(
                    f"{connector.storage_type} storage does not support eviction: NIXL's "
                    f"{config.backend} plugin cannot delete — remove the 'eviction' block"
                )
        except BaseException:
            connector.close()
            raise
        self._connector: NixlConnector = connector
        self._scan_state = {"done": False, "files": 0, "error": None}
        super().__init__(
            connector,
            max_capacity_gb=config.max_capacity_gb,
            type_name="nixl_native",
            extra_status=self._status,
            # Direct I/O needs whole blocks: stores ship the object's full (page-aligned) slot.
            pad_buffers_to_alignment=connector.supports_direct_io,
        )
        if connector.storage_type == "FILE":
            threading.Thread(target=self._scan, name="lmc-nixl-native-scan", daemon=True).start()
        else:
            self._scan_state["done"] = True
        logger.info(
            "nixl_native ready: backend %s (%s), %s storage, %d workers, padding %s",
            config.backend,
            nixl_build_name(),
            connector.storage_type,
            config.num_workers,
            connector.supports_direct_io,
        )

    def _scan(self) -> None:
        """Charge the files already there (oldest first) so usage and eviction see them."""
        root = self._connector.root  # type: ignore[attr-defined]
        try:
            found = []
            now = time.time()
            with os.scandir(root) as it:
                for e in it:
                    if not e.is_file(follow_symlinks=False):
                        continue
                    st = e.stat(follow_symlinks=False)
                    if e.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                        try:
                            os.unlink(e.path)  # left by a writer that died
                        except OSError:
                            pass
                        continue
                    key = filename_to_object_key(e.name)
                    if key is not None and st.st_size > 0:
                        found.append((st.st_mtime, key, st.st_size))
            found.sort(key=lambda t: t[0])
            for i in range(0, len(found), SCAN_BATCH):
                chunk = found[i : i + SCAN_BATCH]
                self.record_known_keys([k for _, k, _ in chunk], [s for _, _, s in chunk])
            self._scan_state["files"] = len(found)
        except Exception as exc:
            self._scan_state["error"] = f"{type(exc).__name__}: {exc}"
            logger.warning("nixl_native: start-up scan of %s failed: %s", root, exc)
        finally:
            self._scan_state["done"] = True

    def _status(self) -> dict[str, Any]:
        c = self._connector
        status: dict[str, Any] = {
            "backend": self._cfg.backend,
            "nixl_build": nixl_build_name(),
            "storage_type": c.storage_type,
            "num_workers": self._cfg.num_workers,
            "supports_query": c.supports_query,
            "supports_delete": c.supports_delete,
            "supports_direct_io": c.supports_direct_io,
            "atomic_publication": c.atomic_publication,
            "pad_buffers_to_alignment": c.supports_direct_io,
            "scan": dict(self._scan_state),
        }
        if c.storage_type == "FILE":
            status["file_path"] = self._cfg.backend_params["file_path"]
            status["use_direct_io"] = c.supports_direct_io
        return status

    def report_status(self) -> dict[str, Any]:
        status = super().report_status()
        # NIXL tells a backend failure from a caller's bad buffer; the base class's tracker
        # counts every failed task, so NIXL's verdict decides.
        nixl = self._nixl_health.snapshot(alive=self._thread.is_alive() and not self._closed)
        status.update({k: v for k, v in nixl.items() if v is not None})
        return status


def create_nixl_native_adapter(
    config: NixlNativeL2AdapterConfig, l1_memory_desc: Any
) -> NixlNativeL2Adapter:
    if l1_memory_desc is None:
        raise ValueError("nixl_native requires an L1MemoryDesc")
    return NixlNativeL2Adapter(config, l1_memory_desc)
