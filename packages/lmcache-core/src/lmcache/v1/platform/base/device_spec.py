"""``DeviceSpec``: what a device backend declares to the platform registry.

A plain class: ``DeviceSpec()`` is the no-op fallback. Subclasses keep imports cheap
(ops, IPC wrappers, event backends and cache contexts behind lazy properties) because
entry-point modules are imported while the registry is built.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from lmcache.utils import init_logger
from lmcache.v1.platform.transfer_mode import MPTransferMode, parse_mp_transfer_mode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.event_ipc import EventIPCBackend
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

logger = init_logger(__name__)

# One lock for every spec's lazy singletons: creation is rare, and an RLock lets an
# ensure_native() that resolves another backend's ops (tensor_from_ptr) re-enter.
_SINGLETON_LOCK = threading.RLock()


def overrides(spec: Any, method_name: str) -> bool:
    """True when ``spec``'s class defines ``method_name`` somewhere other than DeviceSpec."""
    found = getattr(type(spec), method_name, None)
    return found is not None and found is not getattr(DeviceSpec, method_name)


# ---- what a spec's answers mean for the MP transfer mode (platform.md §2.3) -----------

_warned: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def effective_lmcache_driven_available(spec: Any) -> bool:
    """The router's capability gate (platform.md §2.3): ``is_lmcache_driven_available()``.

    Logs once when a spec overrides both flags and they disagree.
    """
    lmc = bool(spec.is_lmcache_driven_available())
    if overrides(spec, "is_lmcache_driven_available") and overrides(
        spec, "is_handle_transfer_available"
    ):
        handle = bool(spec.is_handle_transfer_available())
        if handle != lmc:
            _warn_once(
                ("disagree", type(spec).__qualname__),
                "DeviceSpec %s: is_lmcache_driven_available()=%s disagrees with "
                "is_handle_transfer_available()=%s; using the former",
                type(spec).__qualname__,
                lmc,
                handle,
            )
    return lmc


def effective_default_mode(spec: Any) -> MPTransferMode:
    """What AUTO means for ``spec``: never AUTO; a raising/AUTO answer becomes ENGINE_DRIVEN."""
    if spec is None:
        return MPTransferMode.ENGINE_DRIVEN
    name = getattr(spec, "backend_name", "?")
    try:
        mode = parse_mp_transfer_mode(spec.default_mp_transfer_mode())
    except Exception as exc:
        _warn_once(
            ("raise", str(name)),
            "DeviceSpec %s (backend %r): default_mp_transfer_mode() raised %s; using engine_driven",
            type(spec).__qualname__,
            name,
            exc,
        )
        return MPTransferMode.ENGINE_DRIVEN
    if mode is MPTransferMode.AUTO:
        _warn_once(
            ("auto", str(name)),
            "DeviceSpec %s (backend %r): default_mp_transfer_mode() returned AUTO; using engine_driven",
            type(spec).__qualname__,
            name,
        )
        return MPTransferMode.ENGINE_DRIVEN
    return mode


def _rewrap_error(exc: BaseException, backend: str) -> BaseException:
    """The same error type with the backend named, when the type allows it."""
    msg = f"{exc} (while creating the DeviceOps singleton of backend {backend!r})"
    try:
        new = type(exc)(msg)
    except Exception:
        new = RuntimeError(msg)
    return new


class DeviceSpec:
    """Device backend declaration; base = no capabilities (the fallback spec)."""

    _ops_cache: DeviceOps | None = None
    _pin_backend_cache: PinMemoryBackend | None = None

    # ---- identity ------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return ""

    @property
    def backend_name(self) -> str:
        return self.device_type

    @property
    def torch_module_name(self) -> str:
        return ""

    def is_available(self) -> bool:
        return False

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}(backend_name={self.backend_name!r})"
        except Exception:
            return f"{type(self).__name__}()"

    # ---- ops -----------------------------------------------------------------------
    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.v1.platform.base.device_ops import DeviceOps

        return DeviceOps

    def get_ops(self) -> DeviceOps:
        """The backend's DeviceOps singleton; ``ensure_native()`` runs once on creation."""
        ops = self._ops_cache
        if ops is not None:
            return ops
        with _SINGLETON_LOCK:
            ops = self._ops_cache
            if ops is not None:
                return ops
            try:
                ops = self.ops_cls()
                ops.ensure_native()
            except Exception as exc:
                raise _rewrap_error(exc, _safe_name(self)) from exc
            self._ops_cache = ops
            return ops

    # ---- capability flags (platform.md §2.3 bridge) ----------------------------------
    def is_lmcache_driven_available(self) -> bool:
        if overrides(self, "is_handle_transfer_available"):
            return bool(self.is_handle_transfer_available())
        try:
            wrapper = self.ipc_wrapper_cls
        except Exception as exc:
            logger.warning(
                "DeviceSpec %s: evaluating ipc_wrapper_cls raised %s; treating it as None",
                type(self).__qualname__,
                exc,
            )
            wrapper = None
        return wrapper is not None

    def is_handle_transfer_available(self) -> bool:
        if overrides(self, "is_lmcache_driven_available"):
            return bool(self.is_lmcache_driven_available())
        return True

    def default_mp_transfer_mode(self) -> MPTransferMode:
        gate = self.is_lmcache_driven_available()
        if overrides(self, "is_lmcache_driven_available"):
            return MPTransferMode.LMCACHE_DRIVEN if gate else MPTransferMode.ENGINE_DRIVEN
        if self.device_type == "cuda" and gate:
            return MPTransferMode.LMCACHE_DRIVEN
        return MPTransferMode.ENGINE_DRIVEN

    # ---- streams (§2.4): the spec's own module, never the active accelerator's -------
    def _torch_module(self) -> Any:
        if self.device_type == "cpu":
            from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice

            return StubCPUDevice("cpu")
        import torch

        name = self.torch_module_name
        module = getattr(torch, name, None) if name else None
        if module is None:
            raise RuntimeError(
                f"torch.{name or '<empty torch_module_name>'} is not available for LMCache "
                f"backend {_safe_name(self)!r}; install the vendor's PyTorch extension"
            )
        return module

    def current_stream(self, device: Any = None) -> Any:
        return self._torch_module().current_stream(device)

    def get_stream_handle(self, stream: Any) -> int:
        raise NotImplementedError(
            f"DeviceSpec for backend {_safe_name(self)!r} does not expose raw stream handles"
        )

    def synchronize_stream(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize_device(self, device: Any = None) -> None:
        self._torch_module().synchronize(device=device)

    def create_stream_event(self, device: Any = None) -> Any:
        return self._torch_module().Event()

    def record_stream_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def is_stream_event_complete(self, event: Any) -> bool:
        return bool(event.query())

    # ---- LMCache-driven capabilities ---------------------------------------------------
    @property
    def event_ipc_backend(self) -> EventIPCBackend | None:
        return None

    @property
    def ipc_wrapper_cls(self) -> type[DeviceIPCWrapper] | None:
        return None

    @property
    def ipc_wire_types(self) -> tuple[type[DeviceIPCWrapper], ...]:
        cls = self.ipc_wrapper_cls
        return (cls,) if cls is not None else ()

    def create_cache_context(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"DeviceSpec for device_type={self.device_type!r} does not provide a BaseCacheContext implementation."
        )

    # ---- host pinning ------------------------------------------------------------------
    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend] | None:
        return None

    def _pin_backend(self) -> PinMemoryBackend:
        backend = self._pin_backend_cache
        if backend is None:
            with _SINGLETON_LOCK:
                backend = self._pin_backend_cache
                if backend is None:
                    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

                    cls = self.pin_memory_backend or PinMemoryBackend
                    backend = cls()
                    self._pin_backend_cache = backend
        return backend

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        return bool(self._pin_backend().pin_memory(ptr, size, flags))

    def unpin_memory(self, ptr: int) -> bool:
        return bool(self._pin_backend().unpin_memory(ptr))

    @property
    def is_pin_supported(self) -> bool:
        return bool(self._pin_backend().is_pin_supported)


def _safe_name(spec: DeviceSpec) -> str:
    try:
        return str(spec.backend_name)
    except Exception:
        return type(spec).__qualname__
