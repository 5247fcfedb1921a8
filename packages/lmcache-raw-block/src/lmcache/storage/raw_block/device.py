"""The block device (or pre-sized file) under a ``raw_block`` adapter: LMCache 0.5.6's
``lmcache-rust-raw-block-io`` (pread/pwrite, or io_uring batches) opened the way 0.5.6 opens
it, with errors that name the path and the fix."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any

from lmcache.storage.raw_block.config import RawBlockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import LMCacheConfigError, import_dependency

DEPENDENCY = "lmcache_rust_raw_block_io"
INSTALL = "pip install lmcache-rust-raw-block-io"


@dataclass
class IO:
    """One transfer: ``payload_len`` bytes of ``buf`` at ``offset``; ``total_len`` >= it is
    what reaches the device (O_DIRECT pads to block_align; writes pad with zeros)."""

    offset: int
    buf: Any
    payload_len: int
    total_len: int


class Device:
    """Synchronous batched reads and writes; each returns one success flag per transfer."""

    def __init__(self, config: RawBlockL2AdapterConfig) -> None:
        module = import_dependency(DEPENDENCY, "the raw_block L2 adapter type needs it", INSTALL)
        self.path = config.device_path
        self.uring = config.io_engine == "io_uring"
        self.align = config.block_align
        self.padded = config.use_odirect  # O_DIRECT: lengths rounded up to block_align
        try:
            self._dev = module.RawBlockDevice(
                config.device_path,
                writable=True,
                use_odirect=config.use_odirect,
                alignment=config.block_align,
                io_engine=config.io_engine,
                iouring_queue_depth=config.iouring_queue_depth,
                use_uring_cmd=False,
            )
        except OSError as exc:
            hint = ""
            if exc.errno == errno.EINVAL and config.use_odirect:
                hint = " (a file system without O_DIRECT, such as tmpfs? set use_odirect=false)"
            raise LMCacheConfigError(
                f"raw_block: cannot open device_path {config.device_path!r}: {exc}{hint}. Give an "
                "existing block device or a pre-sized file (e.g. truncate -s 8G "
                f"{config.device_path}) that this process may read and write"
            ) from exc
        except Exception as exc:
            raise LMCacheConfigError(
                f"raw_block: cannot open device_path {config.device_path!r} with io_engine "
                f"{config.io_engine!r}: {exc}"
            ) from exc
        self.size = int(self._dev.size_bytes())
        self.last_error = ""  # the latest failed transfer's error (for health)

    def length(self, payload_len: int) -> int:
        """What a transfer of ``payload_len`` bytes occupies on the device."""
        return -(-payload_len // self.align) * self.align if self.padded else payload_len

    def write(self, ios: list[IO]) -> list[bool]:
        if not ios:
            return []
        if self.uring:
            batch = self._dev.batched_write(
                [io.offset for io in ios],
                [io.buf for io in ios],
                [io.total_len for io in ios],
                None,
                [io.payload_len for io in ios],
            )
            return self._wait(batch, len(ios))
        return self._one_by_one(self._dev.pwrite_from_buffer, ios, "write")

    def read(self, ios: list[IO]) -> list[bool]:
        if not ios:
            return []
        if self.uring:
            batch = self._dev.batched_read(
                [io.offset for io in ios], [io.buf for io in ios], [io.total_len for io in ios]
            )
            return self._wait(batch, len(ios))
        return self._one_by_one(self._dev.pread_into, ios, "read")

    def _one_by_one(self, call: Any, ios: list[IO], verb: str) -> list[bool]:
        """POSIX: ``call(offset, buf, payload_len, total_len)`` per transfer."""
        out = []
        for io in ios:
            try:
                call(io.offset, io.buf, io.payload_len, io.total_len)
                out.append(True)
            except Exception as exc:
                self.last_error = f"{verb} at offset {io.offset}: {exc}"
                out.append(False)
        return out

    def _wait(self, batch: int, n: int) -> list[bool]:
        flags, errors = self._dev.wait_iouring(batch)
        flags = [bool(f) for f in flags]
        if errors:
            self.last_error = f"io_uring: {errors[0][1]}"
        return flags if len(flags) == n else [False] * n

    def worker_error(self) -> str | None:
        return self._dev.worker_error() if self.uring else None

    def close(self) -> None:
        self._dev.close()
