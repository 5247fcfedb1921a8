"""The paged KV copy functions at their LMCache 0.5.6 import path.

They live in ``lmcache.v1.multiprocess.kv_copy``, the one copy module the server's engine and
the worker contexts share; this module re-exports them for code written against 0.5.6.
"""

from lmcache.v1.multiprocess.kv_copy import (
    KVGeometry,
    compute_kv_layout,
    gather_paged_kv_to_cpu,
    kv_geometry,
    scatter_cpu_to_paged_kv,
)

__all__ = [
    "KVGeometry",
    "compute_kv_layout",
    "gather_paged_kv_to_cpu",
    "kv_geometry",
    "scatter_cpu_to_paged_kv",
]
