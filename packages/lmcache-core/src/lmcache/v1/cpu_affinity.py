"""Keep our helper threads off an engine's compute cores.

vLLM's CPU worker pins its process to the cores its OpenMP threads compute on; the cores it
reserves (``VLLM_CPU_NUM_OF_RESERVED_CPU``) are left to the serving framework and stay
allowed to the processes around the worker (its parent, vLLM's engine core). Every thread a
pinned process starts inherits the pinning, so without a move a store our transfer thread
copies in the background runs on a compute core, time-sliced with the forward.

A process opts in with :func:`enable` (the vLLM connector's worker does); its helper
threads then call :func:`move_to_spare_cpus` as they start, which moves the calling thread
to the *spare* CPUs: those the parent
process may use and neither this process nor a sibling pinned like it may (with tensor
parallelism each rank's worker is pinned to its own cores). A process that is not pinned
narrower than its parent (an ``lmcache server``, a test, vLLM on a GPU) has none, and its
threads stay where they are. Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import os

from lmcache.utils import init_logger

logger = init_logger(__name__)

_enabled = False


def enable() -> None:
    """From now on, helper threads of this process move to the spare CPUs as they start."""
    global _enabled
    _enabled = True


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (``/proc/PID/task/*/children``; empty where unknown)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def spare_cpus() -> frozenset[int]:
    """The CPUs this process's parent may run on and that neither this process (its main
    thread) nor a sibling pinned narrower than the parent may run on."""
    try:
        mine = os.sched_getaffinity(os.getpid())  # the main thread's set
        ppid = os.getppid()
        parent = os.sched_getaffinity(ppid)
    except (AttributeError, OSError):
        return frozenset()
    if not mine < parent:
        return frozenset()
    busy = set(mine)
    for pid in _children(ppid):
        try:
            theirs = os.sched_getaffinity(pid)
        except OSError:
            continue  # gone meanwhile
        if theirs < parent:
            busy |= theirs
    return frozenset(parent - busy)


def move_to_spare_cpus() -> frozenset[int]:
    """Run the calling thread on :func:`spare_cpus` (threads it starts later inherit them);
    returns them, empty when the thread stays where it was (also before :func:`enable`)."""
    if not _enabled:
        return frozenset()
    spare = spare_cpus()
    if not spare:
        return frozenset()
    try:
        os.sched_setaffinity(0, spare)  # 0: the calling thread
    except OSError as exc:
        logger.debug("could not move a helper thread to CPUs %s: %s", sorted(spare), exc)
        return frozenset()
    return spare
