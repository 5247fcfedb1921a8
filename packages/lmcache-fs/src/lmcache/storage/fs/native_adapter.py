"""``fs_native``: the C++ file connector behind core's ``NativeConnectorL2Adapter``
(docs/design/storage-engine.md#backend-fs-native).

The bridge does locking and accounting; this subclass adds the start-up usage recovery that
``fs`` has (a background scan that counts existing files, oldest first).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from lmcache.storage.fs._files import ScanProgress, scan_directory
from lmcache.storage.fs.config import FSNativeL2AdapterConfig, check_relative_tmp_dir
from lmcache.v1.distributed.l2_adapters.api import NativeConnectorL2Adapter


def _load_client_class() -> Any:
    try:
        from lmcache.storage.fs._native import LMCacheFSClient
    except ImportError as exc:
        raise ImportError(
            f"fs_native needs the compiled client of lmcache-fs ({exc}); reinstall it with "
            "`pip install lmcache-fs`, or use the pure-Python type 'fs'"
        ) from exc
    return LMCacheFSClient


class FSNativeL2Adapter(NativeConnectorL2Adapter):
    replay_known_keys = True  # recovered or stored keys reach late listeners

    # Publish through unnamed O_TMPFILE inodes where the filesystem supports them (the client
    # probes); False forces named temp files, as on filesystems without O_TMPFILE.
    allow_tmpfile = True

    def __init__(self, config: FSNativeL2AdapterConfig) -> None:
        check_relative_tmp_dir(config.relative_tmp_dir)
        base = os.path.abspath(config.base_path)
        client = _load_client_class()(
            base,
            config.num_workers,
            config.relative_tmp_dir,
            config.use_odirect,
            config.read_ahead_size or 0,
            config.fsync,
            allow_tmpfile=self.allow_tmpfile,
        )
        self._scan = ScanProgress()
        self._base_path = base
        self._fs_client = client
        super().__init__(
            client,
            max_capacity_gb=config.max_capacity_gb,
            type_name="fs_native",
            extra_status=self._status,
            pad_buffers_to_alignment=config.use_odirect,
            endpoint=base,
        )
        tmp_dir = os.path.join(base, config.relative_tmp_dir) if config.relative_tmp_dir else base
        self._scan_thread = threading.Thread(
            target=scan_directory,
            args=(base, tmp_dir, self.record_known_keys, self._scan),
            name="lmc-fs-native-scan",
            daemon=True,
        )
        self._scan_thread.start()

    def _status(self) -> dict[str, Any]:
        return {
            "base_path": self._base_path,
            "scan": self._scan.as_dict(),
            "fsync_count": self._fs_client.fsync_count,
            "publish_mode": self._fs_client.publish_mode,
        }


def create_fs_native_adapter(config: FSNativeL2AdapterConfig) -> FSNativeL2Adapter:
    return FSNativeL2Adapter(config)
