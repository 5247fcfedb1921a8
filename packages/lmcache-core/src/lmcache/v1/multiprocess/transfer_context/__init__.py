"""Worker transfer contexts and the mode router (docs/design/platform.md#transfer-router).

``create_transfer_context(kv_caches, *, instance_id, req_client, mode=None, **kw)`` picks
``lmcache_driven`` or ``engine_driven`` (AUTO follows the device spec's
``default_mp_transfer_mode()``) and returns a context from ``worker_transfer``.
"""

from __future__ import annotations

from typing import Any

from lmcache.utils import init_logger
from lmcache.utils.lazy import lazy_attributes

logger = init_logger(__name__)

__all__ = [
    "EngineDrivenTransferContext",
    "LMCacheDrivenTransferContext",
    "create_transfer_context",
]


def _device_type(kv_caches: Any) -> str:
    tensors = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
    if not tensors:
        raise ValueError("kv_caches is empty")
    types = sorted({(t[0] if isinstance(t, tuple | list) else t).device.type for t in tensors})
    if len(types) != 1:
        raise ValueError(f"kv_caches must share one device type, got {', '.join(types)}")
    return types[0]


def create_transfer_context(
    kv_caches: Any, *, instance_id: int, req_client: Any, mode: Any = None, **kwargs: Any
) -> Any:
    from lmcache.v1.platform.base.device_spec import effective_default_mode
    from lmcache.v1.platform.transfer_mode import MPTransferMode, resolve_mp_transfer_mode

    device_type = _device_type(kv_caches)
    resolved = resolve_mp_transfer_mode(mode)
    if resolved == MPTransferMode.AUTO:
        try:
            from lmcache.v1.platform import get_device_spec

            spec = get_device_spec(device_type)
        except Exception:
            spec = None
        resolved = effective_default_mode(spec)
    logger.info("Creating transfer context (device_type=%s, mode=%s)", device_type, resolved.value)
    if resolved == MPTransferMode.LMCACHE_DRIVEN:
        return _build_lmcache_driven_context(
            kv_caches, device_type, instance_id=instance_id, req_client=req_client, **kwargs
        )
    return _build_engine_driven_context(
        kv_caches, instance_id=instance_id, req_client=req_client, **kwargs
    )


def _build_engine_driven_context(kv_caches: Any, **kwargs: Any) -> Any:
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import EngineDrivenTransferContext

    return EngineDrivenTransferContext(kv_caches, **kwargs)


def _build_lmcache_driven_context(kv_caches: Any, device_type: str, **kwargs: Any) -> Any:
    from lmcache.v1.multiprocess.transfer_context.worker_transfer import (
        LMCacheDrivenTransferContext,
    )
    from lmcache.v1.platform import get_device_spec, resolve_kv_wrapper_factory
    from lmcache.v1.platform.base.device_spec import effective_lmcache_driven_available

    try:
        factory = resolve_kv_wrapper_factory(device_type)
    except ValueError:
        raise ValueError(
            f"MP transfer mode 'lmcache_driven' is not supported for device type {device_type!r}: "
            "no KV-cache wrapper factory is registered. Use mode 'engine_driven' instead."
        ) from None
    spec = get_device_spec(device_type)
    # effective_...: same answer, plus the docs/design/platform.md#capability-flags warning when the
    # spec's two capability flags disagree
    if spec is not None and not effective_lmcache_driven_available(spec):
        raise ValueError(
            f"MP transfer mode 'lmcache_driven' is not available for device type {device_type!r}: "
            "required platform capability checks failed. Use mode 'engine_driven' instead."
        )
    return LMCacheDrivenTransferContext(kv_caches, wrapper_factory=factory, **kwargs)


_WORKER_TRANSFER = "lmcache.v1.multiprocess.transfer_context.worker_transfer"
__getattr__ = lazy_attributes(
    __name__,
    {
        "EngineDrivenTransferContext": (_WORKER_TRANSFER, "EngineDrivenTransferContext"),
        "LMCacheDrivenTransferContext": (_WORKER_TRANSFER, "LMCacheDrivenTransferContext"),
    },
)
