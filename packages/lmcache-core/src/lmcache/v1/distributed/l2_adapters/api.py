"""The storage plugin API: everything an L2 storage wheel may import from lmcache-core.

A storage wheel (``lmcache-fs``, a vendor's L2 plugin) imports from core only:

- this module, which re-exports every name below: the adapter contract, the pluggy
  ``hookimpl`` marker and ``L2AdapterTypeSpec``, the key codec (the byte-exact L2 names),
  the native-connector bridge, the completion/lock/health helpers adapters are built from,
  ``Bitmap``, ``LMCacheConfigError`` (a bad configuration found while creating an adapter)
  and the logging helpers;
- the LMCache 0.5.6 paths the L2 plugin guide documents, listed in :data:`FACE_MODULES`
  (``lmcache.v1.distributed.l2_adapters.base.L2AdapterInterface``, ``...l2_adapters.config``,
  ``lmcache.v1.distributed.api.ObjectKey``).

Anything else in core (``internal_api``, the L1 manager, the controllers) is internal and may
change in any release. Storage wheels never import the device plugin API
(``lmcache.v1.platform.api``) nor each other.

Versioning: :data:`PLUGIN_API_VERSION` is ``"0.5.6.1"``. The first three numbers are the LMCache
release whose plugin contract we implement; the fourth is our own release on that line. A
plugin that imports this module pins ``lmcache>=0.5.6.1,<0.6``; one written only against the
0.5.x paths pins ``lmcache>=0.5,<0.6``.

Importing this module is cheap (no torch): hook modules import it while the L2 registry is
listed. ``NativeConnectorL2Adapter`` and ``MemoryObj`` (their modules import torch) load on
first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.lmcache_native import Bitmap
from lmcache.utils import RateLimitedLog, init_logger
from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.health import HealthTracker
from lmcache.v1.distributed.l2_adapters.hookspecs import (
    L2AdapterTypeSpec,
    hookimpl,
    import_dependency,
)
from lmcache.v1.distributed.l2_adapters.key_codec import (
    filename_to_object_key,
    object_key_to_filename,
    object_key_to_string,
    string_to_object_key,
)
from lmcache.v1.distributed.l2_adapters.utils import (
    CompletionChannels,
    KeyLockTable,
    NativeCompletion,
    PythonNativeConnector,
    TaskIds,
    fsync_dir,
    record_unknown_keys,
)
from lmcache.v1.errors import LMCacheConfigError
from lmcache.v1.platform.event_notifier import EventNotifier, create_event_notifier

if TYPE_CHECKING:
    # Typed views of the lazy names below; at run time __getattr__ imports them.
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        NativeConnectorL2Adapter,
    )
    from lmcache.v1.memory_management import MemoryObj

PLUGIN_API_VERSION = "0.5.6.1"
"""Version of this contract: LMCache release implemented (0.5.6) + our release on it (.1).
Plugins importing this module declare ``lmcache>=0.5.6.1,<0.6``."""

FACE_MODULES: tuple[str, ...] = (
    "lmcache.v1.distributed.api",
    "lmcache.v1.distributed.l2_adapters.api",
    "lmcache.v1.distributed.l2_adapters.base",
    "lmcache.v1.distributed.l2_adapters.config",
    "lmcache.v1.distributed.serde",
)
"""Every lmcache-core module a storage wheel may import: this module plus the 0.5.6 paths.
The plugin-faces test enforces it on our wheels; ``nox -s typecheck`` runs mypy on them."""

# Names whose modules import torch: resolved on first access (PEP 562) so that importing
# this module from a hook module stays cheap.
_LAZY: dict[str, tuple[str, str | None]] = {
    "NativeConnectorL2Adapter": (
        "lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter",
        "NativeConnectorL2Adapter",
    ),
    "MemoryObj": ("lmcache.v1.memory_management", "MemoryObj"),
}

__all__ = [
    "FACE_MODULES",
    "PLUGIN_API_VERSION",
    # the adapter contract (0.5.6 paths: ...l2_adapters.base / .config, ...distributed.api)
    "AdapterUsage",
    "KeyEntry",
    "KeyListPage",
    "L1MemoryDesc",
    "L2AdapterConfigBase",
    "L2AdapterInterface",
    "L2StoreResult",
    "L2TaskId",
    "MemoryLayoutDesc",
    "MemoryObj",
    "ObjectKey",
    # discovery (entry-point group "lmcache.l2_adapters")
    "L2AdapterTypeSpec",
    "hookimpl",
    "import_dependency",
    # L2 names (byte-exact, docs/design/storage-formats.md#l2-names)
    "filename_to_object_key",
    "object_key_to_filename",
    "object_key_to_string",
    "string_to_object_key",
    # building blocks of adapters
    "Bitmap",
    "CompletionChannels",
    "EventNotifier",
    "HealthTracker",
    "KeyLockTable",
    "NativeCompletion",
    "NativeConnectorL2Adapter",
    "PythonNativeConnector",
    "TaskIds",
    "create_event_notifier",
    "fsync_dir",
    "record_unknown_keys",
    # errors (the lmcache CLI prints their message as one line, without a traceback)
    "LMCacheConfigError",
    # logging (the same helpers the device API re-exports)
    "RateLimitedLog",
    "init_logger",
]


# Hidden from type checkers: with a visible module __getattr__, mypy would accept any
# misspelt name imported from this module as Any.
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _LAZY)


__dir__ = lazy_dir(globals(), _LAZY)
