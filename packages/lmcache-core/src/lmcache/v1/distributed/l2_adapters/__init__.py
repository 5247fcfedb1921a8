"""L2 adapters: the interface, the type registry, the built-in types.

``create_l2_adapter(config, l1_memory_desc=None)`` (0.5.6's name, defined in
``lmcache.v1.distributed.compat_056``) builds an adapter from a parsed config; core code calls
``default_l2_adapter_registry().create`` (``registry``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.distributed.compat_056_names import compat_lazy_table
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

if TYPE_CHECKING:
    from lmcache.v1.distributed.compat_056 import create_l2_adapter

__all__ = ["L2AdapterConfigBase", "L2AdapterInterface", "create_l2_adapter"]

_LAZY = compat_lazy_table(__name__)

if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _LAZY)


__dir__ = lazy_dir(globals(), _LAZY)
