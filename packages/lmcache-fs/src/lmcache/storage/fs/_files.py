"""File protocol shared by ``fs`` and ``fs_native`` (docs/design/storage-formats.md#l2-names,
docs/design/storage-engine.md#backend-fs).

A value is written to a temp file with a name unique per writer, fsynced, then published
with ``link()`` (or ``renameat2(RENAME_NOREPLACE)``), which never replaces an existing file:
concurrent writers, including LMCache 0.5.6 ones, leave exactly one complete file, and a
crash never leaves a torn ``.data`` file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.api import filename_to_object_key, fsync_dir, init_logger

logger = init_logger(__name__)

DATA_SUFFIX = ".data"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 3600

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc = None


def _renameat2_noreplace(src: str, dst: str) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    rc = _libc.renameat2(
        _AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


def unique_tmp_name(final_name: str) -> str:
    """``<stem>.<pid>-<tid>-<8 hex>.tmp``: unique per writer, never a parseable ``.data``."""
    stem = final_name[: -len(DATA_SUFFIX)] if final_name.endswith(DATA_SUFFIX) else final_name
    return f"{stem}.{os.getpid()}-{threading.get_native_id()}-{secrets.token_hex(4)}{TMP_SUFFIX}"


def publish_no_replace(tmp_path: str, final_path: str) -> bool:
    """Make ``tmp_path`` visible as ``final_path`` unless it exists; removes the temp file.

    Returns False when another writer published first (our copy is discarded).
    """
    try:
        try:
            os.link(tmp_path, final_path)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # No hard links here: an atomic rename that refuses to replace.
            try:
                _renameat2_noreplace(tmp_path, final_path)
            except FileExistsError:
                return False
        return True
    finally:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass


def _open(path: str, flags: int, direct: bool, mode: int = 0o644) -> int:
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, mode)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # the file system refuses O_DIRECT: buffered I/O
                raise
    return os.open(path, flags, mode)


def write_new_file(
    final_path: str, tmp_dir: str, data: memoryview, *, fsync: bool, direct: bool
) -> int:
    """Write ``data`` under ``final_path`` unless it exists. Returns the new bytes (0 if not new)."""
    if os.path.exists(final_path):
        return 0
    tmp_path = os.path.join(tmp_dir, unique_tmp_name(os.path.basename(final_path)))
    fd = _open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, direct)
    try:
        try:
            done, n = 0, len(data)
            while done < n:  # os.write may be short: retry the rest
                done += os.write(fd, data[done:])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(tmp_path)
        except FileNotFoundError:
            pass
        raise
    if not publish_no_replace(tmp_path, final_path):
        return 0
    if fsync:  # make the new directory entry durable too
        fsync_dir(os.path.dirname(final_path))
    return len(data)


def read_file_into(path: str, dest: memoryview, *, direct: bool, read_ahead: int | None) -> bool:
    """Fill ``dest`` from the first ``len(dest)`` bytes of ``path``; False on a miss."""
    try:
        fd = _open(path, os.O_RDONLY | os.O_CLOEXEC, direct)
    except FileNotFoundError:
        return False
    try:
        n = len(dest)
        if os.fstat(fd).st_size < n:  # a shorter file is a miss; a longer one is padded
            return False
        if read_ahead:
            os.posix_fadvise(fd, 0, read_ahead, os.POSIX_FADV_WILLNEED)
        done = 0
        while done < n:
            got = os.preadv(fd, [dest[done:]], done)
            if got <= 0:
                return False
            done += got
        return True
    finally:
        os.close(fd)


def fs_block_size(path: str) -> int:
    try:
        return max(512, os.statvfs(path).f_bsize)
    except OSError:
        return 4096


@dataclass
class ScanProgress:
    """Start-up usage recovery state, shown in ``report_status()``."""

    done: bool = False
    files_seen: int = 0
    keys_recovered: int = 0
    bytes_recovered: int = 0
    skipped_empty: int = 0
    skipped_unparseable: int = 0
    stale_tmp_removed: int = 0
    error: str | None = None
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def scan_directory(
    base_path: str,
    tmp_dir: str,
    on_batch: Callable[[list[ObjectKey], list[int]], None],
    progress: ScanProgress,
    *,
    batch_size: int = 512,
) -> None:
    """Count existing values (oldest mtime first) and remove stale temp files."""
    try:
        now = time.time()
        found: list[tuple[float, ObjectKey, int]] = []
        dirs = [base_path] + ([tmp_dir] if tmp_dir != base_path else [])
        for d in dirs:
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for entry in entries:
                name = entry.name
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_SECONDS:
                        try:
                            os.unlink(entry.path)
                            progress.stale_tmp_removed += 1
                        except FileNotFoundError:
                            pass
                    continue
                if d != base_path or not name.endswith(DATA_SUFFIX):
                    continue
                progress.files_seen += 1
                key = filename_to_object_key(name)
                if key is None:
                    progress.skipped_unparseable += 1
                    logger.info("fs scan: skipping unparseable file %s", entry.path)
                    continue
                if st.st_size == 0:
                    progress.skipped_empty += 1
                    logger.info("fs scan: skipping empty file %s", entry.path)
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort(key=lambda t: t[0])
        for i in range(0, len(found), batch_size):
            chunk = found[i : i + batch_size]
            on_batch([k for _, k, _ in chunk], [s for _, _, s in chunk])
            progress.keys_recovered += len(chunk)
            progress.bytes_recovered += sum(s for _, _, s in chunk)
    except Exception as exc:  # a scan failure must not take the adapter down
        progress.error = f"{type(exc).__name__}: {exc}"
        logger.exception("fs scan of %s failed", base_path)
    finally:
        progress.done = True
