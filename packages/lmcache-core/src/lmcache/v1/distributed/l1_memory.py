"""L1 memory: an aligned first-fit address manager over one contiguous arena
(docs/design/storage-engine.md#l1-memory).

Arenas:
- anonymous memory (``mmap``; pages are committed by the OS on first touch), optionally
  2 MiB hugepages;
- a POSIX shared-memory segment (``/dev/shm/lmcache_l1_pool_<name>``), created at the full
  L1 size as a sparse file so it works with lazy growth too (docs/design/protocol.md#defaults-shm).
  When ``/dev/shm`` has less free space than the L1 size, SHM is not used and a WARNING says why
  (``shm_disabled_reason``).

Allocators: ``L1Allocator`` with ``lazy=False`` commits the whole pool at start; with
``lazy=True`` it commits ``init_size`` and a background thread commits the rest in 1 GiB
steps (64 MiB pin steps) until the final size; allocation beyond the committed prefix is OOM
until it grows (``grow_now()`` commits the next region at once for demand eviction).
There is no page pinning on CPU-only hosts, so committing only moves the usable limit.

Prefaulting: the kernel backs a page on its first write, and a store that copies into
never-touched L1 pays that fault for every 4 KiB (a copy into fresh pages runs at a third of
the speed of one into backed pages), or, if a background thread backs the pages just then,
shares the cores with the kernel zeroing them. ``prefault`` chooses when pages are backed,
always by a background thread with ``madvise(MADV_POPULATE_WRITE)``:

- ``all`` (default): the whole pool, front to back, from the start: memory use reaches the
  L1 size within seconds (as LMCache 0.5.6 commits its L1) and no store ever waits for page
  allocation. When the host has less memory available than the pool, it falls back to
  ``ahead`` with a WARNING.
- ``ahead``: ``prefault_headroom`` bytes (256 MiB) beyond the highest allocated address, so
  memory use grows only as L1 fills.
- ``off``: pages are backed on first write.

Once L1 is full, evicted blocks are reused and nothing is left to fault.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache.utils import init_logger
from lmcache.v1.distributed import page_residency
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l1_mapping import (
    PREFAULT_MODES,
    map_anonymous,
)
from lmcache.v1.distributed.l1_mapping import (
    mapping_error as mapping_error,  # re-exported: its importers found it here
)
from lmcache.v1.distributed.page_residency import lower_thread_priority, populate_write
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

logger = init_logger(__name__)

# The page helpers lived here before page_residency; their importers (worker_transfer, tests)
# still find them here.
_MADV_POPULATE_WRITE = page_residency._MADV_POPULATE_WRITE
is_resident = page_residency.is_resident
populate_read = page_residency.populate_read

__all__ = [
    "SHM_PREFIX",
    "AddressManager",
    "L1Allocator",
    "normalize_shm_name",
]

SHM_PREFIX = "lmcache_l1_pool_"
SHM_DIR = "/dev/shm"
PIN_STEP = 64 << 20
COMMIT_STEP = 1 << 30
PREFAULT_HEADROOM = 256 << 20
PREFAULT_STEP = 16 << 20
HUGEPAGE_SIZE = 2 << 20
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)

_live_shm_names: set[str] = set()
_live_lock = threading.Lock()


def normalize_shm_name(name: str) -> str:
    """Strip a leading ``/``; add the ``lmcache_l1_pool_`` prefix unless present."""
    name = name.lstrip("/")
    return name if name.startswith(SHM_PREFIX) else SHM_PREFIX + name


def layout_nbytes(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> int:
    total = 0
    for s, d in zip(shapes, dtypes, strict=False):
        total += torch.Size(s).numel() * d.itemsize
    return total


class AddressManager:
    """First-fit over a sorted free list of ``[offset, size)`` holes with neighbour coalescing.

    Not thread-safe; the owning allocator serialises calls.
    """

    def __init__(self, size: int, align: int) -> None:
        self.align = align
        self.size = size
        self._limit = size  # allocations must end at or below this offset (lazy commit)
        self._offsets: list[int] = [0] if size else []
        self._sizes: list[int] = [size] if size else []
        self._allocated: dict[int, int] = {}
        self.used = 0

    def round_up(self, n: int) -> int:
        a = self.align
        return (n + a - 1) // a * a

    def set_limit(self, limit: int) -> None:
        self._limit = min(limit, self.size)

    @property
    def limit(self) -> int:
        return self._limit

    def allocate(self, nbytes: int) -> int | None:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive (got {nbytes})")
        need = self.round_up(nbytes)
        for i, (off, sz) in enumerate(zip(self._offsets, self._sizes, strict=False)):
            if sz >= need and off + need <= self._limit:
                if sz == need:
                    del self._offsets[i]
                    del self._sizes[i]
                else:
                    self._offsets[i] = off + need
                    self._sizes[i] = sz - need
                self._allocated[off] = need
                self.used += need
                return off
        return None

    def free(self, off: int) -> int:
        need = self._allocated.pop(off, None)
        if need is None:
            raise ValueError(f"double free or unknown block at offset {off}")
        self.used -= need
        i = bisect.bisect_left(self._offsets, off)
        # coalesce with the previous and next holes
        if i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == off:
            i -= 1
            self._sizes[i] += need
        else:
            self._offsets.insert(i, off)
            self._sizes.insert(i, need)
        if i + 1 < len(self._offsets) and self._offsets[i] + self._sizes[i] == self._offsets[i + 1]:
            self._sizes[i] += self._sizes[i + 1]
            del self._offsets[i + 1]
            del self._sizes[i + 1]
        return need

    def block_size(self, off: int) -> int | None:
        return self._allocated.get(off)

    def largest_free(self) -> int:
        return max(
            (
                min(o + s, self._limit) - o
                for o, s in zip(self._offsets, self._sizes, strict=False)
                if o < self._limit
            ),
            default=0,
        )

    def memcheck(self) -> bool:
        """Holes are sorted, disjoint, non-adjacent, and holes + blocks tile the space."""
        prev_end = -1
        for o, s in zip(self._offsets, self._sizes, strict=False):
            if s <= 0 or o <= prev_end:
                return False
            prev_end = o + s
        spans = sorted(
            [(o, s) for o, s in zip(self._offsets, self._sizes, strict=False)]
            + list(self._allocated.items())
        )
        pos = 0
        for o, s in spans:
            if o != pos:
                return False
            pos = o + s
        return pos == self.size and self.used == sum(self._allocated.values())


class _Arena:
    """Owns the mapping; ``tensor`` is a flat uint8 view over all of it."""

    def __init__(self, size: int, shm_name: str, use_hugepages: bool) -> None:
        self.size = size
        self.shm_name = ""
        self.shm_disabled_reason = ""
        self._shm_path = ""
        self._mm: mmap.mmap | None = None
        if shm_name:
            self._mm = self._open_shm(normalize_shm_name(shm_name), size)
        if self._mm is None and use_hugepages:
            self._mm = self._open_hugepages(size)
        if self._mm is None:
            try:
                self._mm = map_anonymous(size)
            except OSError as exc:
                raise MemoryError(
                    f"cannot map an L1 pool of {size / 2**30:.2f} GiB ({exc.strerror}); "
                    "lower --l1-size-gb"
                ) from exc
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()

    def populate(self, offset: int, length: int) -> None:
        """Back [offset, offset + length) with memory now (page-aligned offset).

        Through ctypes, which drops the GIL for the call (``mmap.madvise`` holds it for the
        milliseconds the kernel spends faulting pages in, stalling every other thread).
        """
        if self._mm is None:
            raise ValueError("arena is closed")
        populate_write(self.ptr + offset, length)

    def _open_shm(self, name: str, size: int) -> mmap.mmap | None:
        if not os.path.isdir(SHM_DIR):
            self.shm_disabled_reason = f"{SHM_DIR} does not exist on this host"
            logger.warning("SHM pool %r disabled: %s", name, self.shm_disabled_reason)
            return None
        with _live_lock:
            if name in _live_shm_names:
                raise ValueError(
                    f"shm name {name!r} is already used by another L1 pool in this process; "
                    "give each L1 its own --shm-name"
                )
        path = os.path.join(SHM_DIR, name)
        if os.path.exists(path):
            logger.warning("Replacing stale shared-memory segment %s", path)
            os.unlink(path)  # only names carrying our prefix ever reach here
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if free < size:
            self.shm_disabled_reason = (
                f"{SHM_DIR} has {free / 2**30:.2f} GiB free but the L1 pool needs "
                f"{size / 2**30:.2f} GiB"
            )
            logger.warning(
                "SHM pool %r NOT used: %s. Fix: enlarge %s (e.g. docker run --shm-size=%dg), "
                "lower --l1-size-gb, or drop --shm-name.",
                name,
                self.shm_disabled_reason,
                SHM_DIR,
                -(-size // 2**30) + 1,
            )
            return None
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: pages are committed on first use
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        with _live_lock:
            _live_shm_names.add(name)
        self.shm_name = name
        self._shm_path = path
        return mm

    @staticmethod
    def _open_hugepages(size: int) -> mmap.mmap | None:
        base = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages"
        try:
            with open(base) as f:
                free_pages = int(f.read().strip())
        except OSError:
            free_pages = 0
        need = -(-size // HUGEPAGE_SIZE)
        if free_pages < need:
            logger.warning(
                "L1 hugepages requested but only %d free 2 MiB hugepages (need %d); "
                "using normal pages",
                free_pages,
                need,
            )
            return None
        try:
            return mmap.mmap(
                -1, need * HUGEPAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB
            )
        except OSError as exc:
            logger.warning("L1 hugepage mapping failed (%s); using normal pages", exc)
            return None

    def close(self) -> None:
        # Never munmap explicitly: tensors and memoryviews handed out (possibly still used by
        # a late adapter thread) keep a reference to the mapping, which is released when the
        # last of them dies. Closing it here would turn those into dangling pointers.
        self.tensor = None  # type: ignore[assignment]
        self._mm = None
        if self._shm_path:
            try:
                os.unlink(self._shm_path)
            except FileNotFoundError:
                pass
            with _live_lock:
                _live_shm_names.discard(self.shm_name)
            self._shm_path = ""


def _available_memory_bytes() -> int | None:
    """MemAvailable (free plus reclaimable page cache), else free pages; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _fits_in_available_memory(size: int) -> bool:
    """Whether the pool fits in the memory available now; warns when it does not (pages
    are backed as the pool is used, so too large a size is only a warning)."""
    available = _available_memory_bytes()
    if available is not None and size > available:
        logger.warning(
            "L1 size %.2f GiB is larger than the memory available now (%.2f GiB); the pool "
            "commits pages as it fills, so the host may run out of memory before L1 is full. "
            "Lower --l1-size-gb to fit.",
            size / 2**30,
            available / 2**30,
        )
        return False
    return True


class _Prefaulter:
    """Keeps ``headroom`` bytes past the highest used offset of a mapping backed ahead of use,
    from a background thread (module docstring). ``populate(offset, length)`` backs a range;
    ``note_used(end)`` reports that [0, end) is in use now."""

    def __init__(
        self, size: int, populate: Callable[[int, int], None], headroom: int, name: str
    ) -> None:
        self._size = size
        self._populate = populate
        self._headroom = headroom
        self._faulted = 0  # [0, _faulted) is backed
        self._target = self._aligned(min(size, headroom))
        self._wake = threading.Event()
        self._stop = False
        self._wake.set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _aligned(self, n: int) -> int:
        # page-aligned, so every populate call starts on a page boundary
        return min(self._size, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)

    def note_used(self, end: int) -> None:
        want = self._aligned(end + self._headroom)
        if want > self._target:
            self._target = want
            self._wake.set()

    @property
    def faulted_bytes(self) -> int:
        return self._faulted

    def _run(self) -> None:
        lower_thread_priority()
        t0 = time.monotonic()
        while True:
            self._wake.wait()
            self._wake.clear()
            while not self._stop and self._faulted < self._target:
                n = min(PREFAULT_STEP, self._target - self._faulted)
                try:
                    self._populate(self._faulted, n)
                except (OSError, ValueError) as exc:
                    logger.info("prefaulting off (%s); pages are backed on first write", exc)
                    return
                self._faulted += n
                if self._faulted >= self._size:
                    logger.info(
                        "L1 pool fully backed: %.2f GiB, %.1f s after start",
                        self._size / 2**30,
                        time.monotonic() - t0,
                    )
            if self._stop:
                return

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)


class L1Allocator:
    """Allocator of ``TensorMemoryObj`` slices of one arena; thread-safe."""

    def __init__(
        self,
        size: int,
        align: int = 4096,
        *,
        lazy: bool = False,
        init_size: int | None = None,
        shm_name: str = "",
        use_hugepages: bool = False,
        commit_step: int = COMMIT_STEP,
        pin_step: int = PIN_STEP,
        grow_in_background: bool = True,
        prefault: str = "all",
        prefault_headroom: int = PREFAULT_HEADROOM,
    ) -> None:
        if size <= 0:
            raise ValueError(f"L1 size must be positive (got {size})")
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align_bytes must be a power of two (got {align})")
        if use_hugepages and shm_name:
            raise ValueError(
                'l1-use-hugepages is incompatible with shared memory. Please set --shm-name "" '
                "to disable SHM when enabling hugepages."
            )
        if prefault not in PREFAULT_MODES:
            raise ValueError(
                f"L1 prefault must be one of {', '.join(PREFAULT_MODES)} (got {prefault!r})"
            )
        if use_hugepages and lazy:
            logger.info("L1 hugepages force --no-l1-use-lazy")
            lazy = False
        size = (size + align - 1) // align * align
        fits = _fits_in_available_memory(size)
        self.align = align
        self.size = size
        self._lock = threading.Lock()
        self._arena = _Arena(size, shm_name, use_hugepages)
        self._am = AddressManager(size, align)
        self.lazy = lazy
        self._commit_step = max(align, commit_step)
        self._pin_step = max(align, pin_step)
        committed = size
        if lazy:
            committed = min(size, max(align, (init_size if init_size is not None else size)))
            committed = (committed + align - 1) // align * align
        self._committed = min(committed, size)
        self._am.set_limit(self._committed)
        self._stop = threading.Event()
        self._grower: threading.Thread | None = None
        if lazy and self._committed < size and grow_in_background:
            self._grower = threading.Thread(
                target=self._grow_loop, name="l1-lazy-grow", daemon=True
            )
            self._grower.start()
        self._prefaulter: _Prefaulter | None = None
        if prefault == "all" and not fits:
            logger.warning(
                "L1 prefault 'all' skipped: the %.2f GiB pool does not fit in the memory "
                "available now; backing pages %d MiB ahead of use instead",
                size / 2**30,
                prefault_headroom >> 20,
            )
            prefault = "ahead"
        if prefault == "all":
            headroom = size
        elif prefault == "ahead":
            headroom = prefault_headroom
        else:
            headroom = 0
        if headroom > 0 and _MADV_POPULATE_WRITE is not None and not use_hugepages:
            self._prefaulter = _Prefaulter(size, self._arena.populate, headroom, "l1-prefault")
        #: the mode in effect ("off" where the kernel cannot prefault or hugepages back L1)
        self.prefault = prefault if self._prefaulter is not None else "off"

    # --- lazy growth -----------------------------------------------------------------------

    def _pin(self, offset: int, length: int) -> None:
        """Pin pages for device DMA. CPU-only hosts have nothing to pin."""

    def grow_now(self) -> bool:
        """Commit the next region at once. Returns False when already at full size."""
        with self._lock:
            if self._committed >= self.size:
                return False
            start = self._committed
            end = min(self.size, start + self._commit_step)
        off = start
        while off < end:
            n = min(self._pin_step, end - off)
            self._pin(off, n)
            off += n
        with self._lock:
            self._committed = max(self._committed, end)
            self._am.set_limit(self._committed)
        return True

    def _grow_loop(self) -> None:
        while not self._stop.is_set():
            if not self.grow_now():
                logger.info("lazy L1 fully committed (%d bytes)", self.size)
                return
            self._stop.wait(0.01)

    @property
    def growth_pending(self) -> bool:
        return self._committed < self.size

    @property
    def committed_size(self) -> int:
        return self._committed

    # --- allocation ------------------------------------------------------------------------------

    def _make_obj(
        self,
        off: int,
        phy: int,
        shapes: Sequence[torch.Size],
        dtypes: Sequence[torch.dtype],
        nbytes: int,
    ) -> TensorMemoryObj:
        meta = MemoryObjMetadata(
            shape=torch.Size(shapes[0]),
            dtype=dtypes[0],
            address=off,
            phy_size=phy,
            ref_count=1,
            fmt=MemoryFormat.UNDEFINED,
            shapes=[torch.Size(s) for s in shapes],
            dtypes=list(dtypes),
        )
        raw = self._arena.tensor[off : off + phy]
        return TensorMemoryObj(raw, meta, parent_allocator=self)

    def allocate(
        self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]
    ) -> TensorMemoryObj | None:
        objs = self.batched_allocate(shapes, dtypes, 1)
        return objs[0] if objs else None

    def batched_allocate(
        self, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype], n: int
    ) -> list[TensorMemoryObj] | None:
        """n blocks (not necessarily contiguous) or None; a failed batch frees its partial work."""
        if len(shapes) != len(dtypes) or not shapes:
            raise ValueError("batched_allocate needs equal, non-empty shapes and dtypes lists")
        nbytes = layout_nbytes(shapes, dtypes)
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive (got {nbytes})")
        if n <= 0:
            return []
        offs: list[int] = []
        with self._lock:
            for _ in range(n):
                off = self._am.allocate(nbytes)
                if off is None:
                    for o in offs:
                        self._am.free(o)
                    return None
                offs.append(off)
            phy = self._am.round_up(nbytes)
        if self._prefaulter is not None:
            self._prefaulter.note_used(max(offs) + phy)
        return [self._make_obj(o, phy, shapes, dtypes, nbytes) for o in offs]

    def free(self, obj: Any) -> None:
        with self._lock:
            self._am.free(obj.metadata.address)

    def fits(self, nbytes: int, n: int) -> bool:
        with self._lock:
            return self._am.limit - self._am.used >= self._am.round_up(nbytes) * n

    # --- info --------------------------------------------------------------------------------------

    def block_size(self, address: int) -> int | None:
        """Allocated size of the block at ``address`` (None when nothing is allocated there)."""
        with self._lock:
            return self._am.block_size(address)

    def used_bytes(self) -> int:
        with self._lock:
            return self._am.used

    def memcheck(self) -> bool:
        with self._lock:
            return self._am.memcheck()

    @property
    def shm_name(self) -> str:
        return self._arena.shm_name

    @property
    def shm_disabled_reason(self) -> str:
        return self._arena.shm_disabled_reason

    @property
    def pool_size(self) -> int:
        """Bytes a process mapping the SHM segment must map (0 without SHM)."""
        return self.size if self._arena.shm_name else 0

    @property
    def base_ptr(self) -> int:
        return self._arena.ptr

    def memory_desc(self) -> L1MemoryDesc:
        return L1MemoryDesc(
            ptr=self._arena.ptr,
            size=self.size,
            align_bytes=self.align,
            stable_registration_size=(
                self._committed if (self.lazy and not self._arena.shm_name) else None
            ),
        )

    def arena_tensor(self) -> torch.Tensor:
        return self._arena.tensor

    @property
    def prefaulted_bytes(self) -> int:
        """Bytes from the start of the arena backed ahead of use (0 when prefaulting is off)."""
        return self._prefaulter.faulted_bytes if self._prefaulter is not None else 0

    def close(self) -> None:
        self._stop.set()
        if self._grower is not None:
            self._grower.join(timeout=2)
        if self._prefaulter is not None:
            self._prefaulter.stop()
        self._arena.close()
