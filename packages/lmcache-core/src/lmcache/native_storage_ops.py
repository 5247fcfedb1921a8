"""Newer-LMCache import path for the storage helpers (re-exports ``lmcache.lmcache_native``)."""

from lmcache.lmcache_native import (
    Bitmap,
    PeriodicEventNotifier,
    TTLLock,
    fold,
    fold_grouped,
    unfold,
    unfold_grouped,
)

__all__ = [
    "Bitmap",
    "PeriodicEventNotifier",
    "TTLLock",
    "fold",
    "fold_grouped",
    "unfold",
    "unfold_grouped",
]
