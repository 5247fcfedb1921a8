"""Page residency of mapped memory: back or map a range's pages now, in one kernel call
(``MADV_POPULATE_WRITE``/``_READ``) instead of one fault per page; ask whether a range is
in memory (``mincore``); and give page-filling threads the lowest CPU priority. The L1
prefaulter and the worker side of SHM transfers use them."""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
import threading

# Linux 5.14+; Python's mmap module names it only from 3.12 on.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else None)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def populate_write(ptr: int, length: int) -> None:
    """Back and map the pages of [ptr, ptr + length) now, as writes would, in one kernel call
    (``MADV_POPULATE_WRITE``) instead of one fault per 4 KiB page. ``ptr`` is rounded down to
    a page. Runs without the GIL. Raises OSError where the kernel lacks it (before 5.14)."""
    _populate(ptr, length, _MADV_POPULATE_WRITE, "MADV_POPULATE_WRITE")


def populate_read(ptr: int, length: int) -> None:
    """Map the pages of [ptr, ptr + length) of a shared mapping into this process now
    (``MADV_POPULATE_READ``). For pages another process already backed this costs about half
    of ``populate_write``: read faults map 16 neighbouring pages at once, and a shared tmpfs
    mapping gets writable entries, so later writes fault no more. Holes are backed as a
    fault would. Runs without the GIL; OSError before Linux 5.14."""
    _populate(ptr, length, _MADV_POPULATE_READ, "MADV_POPULATE_READ")


def lower_thread_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; Linux only, where the nice
    value is per thread). Page-filling threads call it: backing or mapping a pool ahead of use
    should take CPU time that transfers leave idle, not slow the first transfers down on a
    host with few cores. The kernel work of their madvise calls is charged to them too."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass  # not Linux, or not allowed: run at normal priority


def is_resident(ptr: int, length: int) -> bool:
    """Whether every page of [ptr, ptr + length) is in memory (``mincore``), without faulting
    any in. For a shared mapping this tells whether its owner has backed those pages."""
    raw = _residency(ptr, length)
    return raw.count(1) == len(raw)


def resident_regions(ptr: int, length: int, region: int) -> list[bool]:
    """For each ``region``-byte piece of [ptr, ptr + length) (``ptr`` and ``region`` page
    aligned), whether all its pages are in memory: one ``mincore`` for the whole range, so a
    background thread walking a large pool takes the GIL a few times, not twice per region
    (each take can wait behind a low-priority thread that holds it)."""
    raw = _residency(ptr, length)
    per = region // mmap.PAGESIZE
    full = b"\x01" * per
    return [raw[i : i + per] == full[: len(raw[i : i + per])] for i in range(0, len(raw), per)]


def _residency(ptr: int, length: int) -> bytes:
    start = ptr - ptr % mmap.PAGESIZE
    n = length + ptr - start
    vec = (ctypes.c_ubyte * (-(-n // mmap.PAGESIZE)))()
    if _libc().mincore(ctypes.c_void_p(start), ctypes.c_size_t(n), vec):
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return bytes(vec)  # 1 per resident page (the other bits are reserved, 0)


def _populate(ptr: int, length: int, advice: int | None, what: str) -> None:
    if advice is None:
        raise OSError(errno.ENOSYS, f"{what} is Linux-only")
    start = ptr - ptr % mmap.PAGESIZE
    if _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(length + ptr - start), advice):
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({what}): {os.strerror(err)}")
