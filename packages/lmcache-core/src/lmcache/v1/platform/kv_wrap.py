"""Wrap a worker's KV caches for IPC: one wrapper per layer (docs/design/platform.md#kv-wrap)."""

from __future__ import annotations

from typing import Any

from lmcache.utils import init_logger

logger = init_logger(__name__)


def _first_tensor(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        if not value:
            raise ValueError("empty KV plane tuple")
        return value[0]
    return value


def wrap_one_kv_cache(value: Any) -> Any:
    """Wrap one layer (a tensor or a plane tuple, passed whole) with its device's factory."""
    from lmcache.v1.platform import resolve_kv_wrapper_factory

    device_type = _first_tensor(value).device.type
    return resolve_kv_wrapper_factory(device_type)(value)


def _unlink(wrapper: Any) -> None:
    if getattr(wrapper, "shm_name", None):
        unlink = getattr(wrapper, "unlink", None)
        try:
            if callable(unlink):
                unlink()
            else:
                from multiprocessing import shared_memory

                seg = shared_memory.SharedMemory(name=str(wrapper.shm_name).lstrip("/"))
                seg.close()
                seg.unlink()
        except Exception as exc:
            logger.warning("could not unlink shared memory %s: %s", wrapper.shm_name, exc)


def wrap_kv_caches(kv_caches: dict[str, Any]) -> dict[str, Any]:
    """``{layer_name: wrapper}``; on failure, unlink segments already created and re-raise."""
    logger.info("Wrapping %d KV cache tensors for IPC", len(kv_caches))
    out: dict[str, Any] = {}
    try:
        for name, value in kv_caches.items():
            out[name] = wrap_one_kv_cache(value)
    except BaseException:
        for wrapper in out.values():
            _unlink(wrapper)
        raise
    return out
