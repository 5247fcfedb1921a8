"""``DeviceSpec``: what a device backend declares to the platform registry.

A device backend (a wheel such as ``lmcache-xpu``, or a vendor's own) is one
``DeviceSpec`` subclass, named by an entry point of group ``lmcache.device_plugins``
(name = ``backend_name``), plus usually a ``DeviceOps`` subclass with its copy kernels.
The registry imports every entry point at first use, instantiates each spec class once
with no arguments and keeps the instance for the life of the process; detection then
picks the one backend whose ``is_available()`` answers True (``LMCACHE_DEVICE_BACKEND``
and ``DEVICE_TYPE`` override the choice). See ``docs/design/platform.md``.

Two ways to write a spec, freely mixed:

* **Declarative** (new): set class attributes and inherit the behaviour::

      class XpuDeviceSpec(DeviceSpec):
          name = "xpu"                       # backend_name, device_type, torch module
          ops_class = "lmcache.devices.xpu.device_ops:XpuDeviceOps"
          lmcache_driven = False             # engine-driven only
          stream_handle_attr = "sycl_queue"

* **Overriding** (LMCache 0.5.6 and first-generation device guides): override the properties and methods
  (``device_type``, ``backend_name``, ``torch_module_name``, ``ops_cls``,
  ``is_available``, the capability flags, ...). An override always wins over a
  declared attribute.

Rules every spec follows: the module that defines it imports cheaply (the registry
imports it while the process starts; keep ops, native libraries, IPC wrappers, event
backends and cache contexts behind lazy properties), ``is_available()`` never raises,
and nothing here may import ``lmcache.v1.platform``'s facade (detection would recurse).
The spec object is shared by every thread of the process: anything it caches must be
created under a lock (``get_ops`` shows how).

``DeviceSpec()`` itself is valid: the no-capability fallback spec.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache.utils import init_logger
from lmcache.v1.platform.transfer_mode import MPTransferMode, parse_mp_transfer_mode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.event_ipc import EventIPCBackend
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

logger = init_logger(__name__)

# The plugin API of this module (logger and the private helpers are not part of it).
__all__ = [
    "DeviceSpec",
    "effective_default_mode",
    "effective_lmcache_driven_available",
    "overrides",
]

# One lock for every spec's lazy singletons: creation is rare, and an RLock lets an
# ensure_native() that resolves another backend's ops (tensor_from_ptr) re-enter.
_SINGLETON_LOCK = threading.RLock()


def overrides(spec: Any, method_name: str) -> bool:
    """True when ``spec``'s class defines ``method_name`` somewhere other than DeviceSpec.

    Declared class attributes (``lmcache_driven``...) are not overrides of a method.
    """
    found = getattr(type(spec), method_name, None)
    return found is not None and found is not getattr(DeviceSpec, method_name)


# ---- the MP transfer mode a spec's answers give (docs/design/platform.md#capability-flags) -------

_warned: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def effective_lmcache_driven_available(spec: Any) -> bool:
    """The router's capability gate (docs/design/platform.md#capability-flags):
    ``is_lmcache_driven_available()``.

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
    """Device backend declaration; base = no capabilities (the fallback spec).

    Every member has a working default, so a subclass states only what differs. The
    declarative class attributes below are read by the default implementations; a
    subclass that overrides a property or method is never affected by them.
    """

    # ---- declarative attributes (read only by the default implementations) ---------
    #: Backend name: the entry-point name and ``backend_name``; also the device type and
    #: torch module unless ``torch_device_type`` / ``torch_module`` say otherwise.
    #: Unique, non-empty, lowercase.
    name: ClassVar[str] = ""
    #: torch's device type when several backends share it (ROCm: ``"cuda"``).
    torch_device_type: ClassVar[str] = ""
    #: ``torch.<torch_module>`` is the device module; defaults to the device type.
    torch_module: ClassVar[str] = ""
    #: Imported by ``is_available()`` for its side effect of registering
    #: ``torch.<torch_module>`` (``"torch_mlu"``); failing to import means unavailable.
    vendor_module: ClassVar[str] = ""
    #: ``"package.module:ClassName"`` of the backend's ``DeviceOps`` subclass, imported
    #: lazily by ``ops_cls`` (empty: the torch baseline ``DeviceOps``).
    ops_class: ClassVar[str] = ""
    #: Declared LMCache-driven capability: ``False`` = engine-driven only (both flags
    #: False, AUTO = ``engine_driven``); ``True`` = both flags True, AUTO =
    #: ``lmcache_driven``; ``None`` = the base-class bridge decides (see
    #: ``is_lmcache_driven_available``).
    lmcache_driven: ClassVar[bool | None] = None
    #: Attribute of a torch stream object that holds its raw handle (``"cuda_stream"``,
    #: ``"sycl_queue"``), used by ``get_stream_handle``.
    stream_handle_attr: ClassVar[str] = ""
    #: ``"package.module:ClassName"`` of the ``DeviceIPCWrapper`` subclass ``ipc_wrapper_cls``
    #: returns (empty: None, engine-driven only).
    ipc_wrapper_class: ClassVar[str] = ""
    #: True: ``event_ipc_backend`` is one ``DefaultEventIPCBackend`` over this spec's torch
    #: module (CPU: the stub device), built on first use.
    event_ipc: ClassVar[bool] = False
    #: ``"package.module:ClassName"`` that ``create_cache_context`` builds with the
    #: arguments it gets (empty: ``NotImplementedError``).
    cache_context_class: ClassVar[str] = ""
    #: ``"package.module:ClassName"`` of the ``PinMemoryBackend`` ``pin_memory_backend``
    #: returns (empty: None, no pinning).
    pin_memory_class: ClassVar[str] = ""

    _ops_cache: DeviceOps | None = None
    _pin_backend_cache: PinMemoryBackend | None = None
    _event_backend_cache: EventIPCBackend | None = None

    # ---- identity ------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        """torch's device category (``"cuda"``, ``"mlu"``): non-empty and lowercase for a
        real backend. Several backends may share one (cuda and rocm both answer
        ``"cuda"``). Read at registration and by every lookup; must be constant."""
        cls = type(self)
        return cls.torch_device_type or cls.name

    @property
    def backend_name(self) -> str:
        """Unique selector (``LMCACHE_DEVICE_BACKEND``); must equal the entry-point name.
        Defaults to ``device_type``; differs only when a device type is shared."""
        return type(self).name or self.device_type

    @property
    def torch_module_name(self) -> str:
        """Name of the torch device module: ``getattr(torch, name)`` must exist whenever
        ``is_available()`` is True. Stream helpers and ``synchronize_device`` use it."""
        cls = type(self)
        if cls.torch_module:
            return cls.torch_module
        return self.device_type if cls.name else ""

    def is_available(self) -> bool:
        """Whether this host can use the backend now (driver, runtime, at least one device).

        Called once per process during detection, possibly before torch finished
        importing its extensions; must never raise (any error means False) and must not
        import the ``lmcache.v1.platform`` facade. The default answers False for
        ``DeviceSpec()`` and for specs that override the identity properties; a
        declarative spec (``name`` set) imports ``vendor_module`` if any, then asks
        ``torch.<torch_module_name>.is_available()``.
        """
        cls = type(self)
        if not (cls.name or cls.torch_module):
            return False
        try:
            if cls.vendor_module:
                importlib.import_module(cls.vendor_module)
            import torch

            module = getattr(torch, self.torch_module_name, None)
            return module is not None and bool(module.is_available())
        except Exception:
            return False

    def __repr__(self) -> str:
        try:
            return f"{type(self).__name__}(backend_name={self.backend_name!r})"
        except Exception:
            return f"{type(self).__name__}()"

    def _declared_class(self, attribute: str) -> Any:
        """The class a ``"package.module:ClassName"`` attribute names (imported now), or None
        when the attribute is empty."""
        target = getattr(type(self), attribute)
        if not target:
            return None
        module_name, _, name = target.partition(":")
        if not module_name or not name:
            raise ValueError(
                f"{type(self).__qualname__}.{attribute}={target!r}: expected "
                "'package.module:ClassName'"
            )
        return getattr(importlib.import_module(module_name), name)

    # ---- ops -----------------------------------------------------------------------
    @property
    def ops_cls(self) -> type[DeviceOps]:
        """The ``DeviceOps`` subclass ``get_ops()`` instantiates (no arguments).

        Import it lazily inside the property: it may pull in torch and native code. The
        default imports ``ops_class`` when declared, else returns the torch baseline
        ``DeviceOps``.
        """
        declared = self._declared_class("ops_class")
        if declared is not None:
            return declared
        from lmcache.v1.platform.base.device_ops import DeviceOps

        return DeviceOps

    def get_ops(self) -> DeviceOps:
        """The backend's DeviceOps singleton; ``ensure_native()`` runs once on creation.

        Do not override. Thread-safe: concurrent first calls build one instance. If the
        constructor or ``ensure_native()`` raises, nothing is cached and the error
        propagates (same type where possible) with the backend named, so the next call
        tries again.
        """
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

    # ---- capability flags -------------------------------------------------------------
    # The transfer router asks only is_lmcache_driven_available(). First-generation plugins know
    # only is_handle_transfer_available() (base True), 0.5.6 plugins only
    # is_lmcache_driven_available() (base False): each default mirrors the other one when
    # only that one is overridden, so both kinds behave as their authors expect.
    def is_lmcache_driven_available(self) -> bool:
        """Whether the server may copy KV directly from this device's memory
        (``lmcache_driven`` mode); the router's only capability gate.

        Called by the worker's transfer router when a transfer context is created (and by
        ``lmcache plugins``). True requires an ``ipc_wrapper_cls``, an
        ``event_ipc_backend`` and a cache context (``create_cache_context``); the router
        still runs hard checks on each and fails with a ``ValueError`` naming
        ``engine_driven`` as the fix. Default: the declared ``lmcache_driven``; else the
        answer of an overridden ``is_handle_transfer_available``; else whether
        ``ipc_wrapper_cls`` is not None. Must not raise.
        """
        declared = type(self).lmcache_driven
        if declared is not None and not overrides(self, "is_handle_transfer_available"):
            return bool(declared)
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
        """First-generation name of the same gate. Default: the declared ``lmcache_driven``; else
        mirrors an overridden ``is_lmcache_driven_available``; else True (the first-generation
        default). When both are overridden and disagree, the router uses
        ``is_lmcache_driven_available`` and logs a warning."""
        declared = type(self).lmcache_driven
        if declared is not None and not overrides(self, "is_lmcache_driven_available"):
            return bool(declared)
        if overrides(self, "is_lmcache_driven_available"):
            return bool(self.is_lmcache_driven_available())
        return True

    def default_mp_transfer_mode(self) -> MPTransferMode:
        """What ``LMCACHE_MP_TRANSFER_MODE=auto`` means on this device: ``ENGINE_DRIVEN``
        or ``LMCACHE_DRIVEN``, never ``AUTO`` (the router then warns and uses
        engine_driven, as it does when this raises).

        Default: ``LMCACHE_DRIVEN`` when ``lmcache_driven`` is declared True;
        ``ENGINE_DRIVEN`` when declared False; for an overridden
        ``is_lmcache_driven_available``, its answer; otherwise LMCache-driven only for
        ``device_type == "cuda"`` with the gate open.
        """
        declared = type(self).lmcache_driven
        if declared is not None and not overrides(self, "is_lmcache_driven_available"):
            return MPTransferMode.LMCACHE_DRIVEN if declared else MPTransferMode.ENGINE_DRIVEN
        gate = self.is_lmcache_driven_available()
        if overrides(self, "is_lmcache_driven_available"):
            return MPTransferMode.LMCACHE_DRIVEN if gate else MPTransferMode.ENGINE_DRIVEN
        if self.device_type == "cuda" and gate:
            return MPTransferMode.LMCACHE_DRIVEN
        return MPTransferMode.ENGINE_DRIVEN

    # ---- streams: the spec's own torch module, never the active accelerator's ---------
    # A CPU spec must keep working on an accelerator host, so each spec resolves its own
    # module (CPU: the stub device) instead of asking detection.
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
        """``torch.<module>.current_stream(device)``; raises ``RuntimeError`` naming the
        backend when the torch module is missing."""
        return self._torch_module().current_stream(device)

    def get_stream_handle(self, stream: Any) -> int:
        """The raw runtime handle of ``stream`` as an int (what native kernels and the
        stream-ordered recorders receive; 0 = the current device's default stream).
        Default: ``int(getattr(stream, stream_handle_attr))`` when declared, else
        ``NotImplementedError``."""
        attr = type(self).stream_handle_attr
        if attr:
            return int(getattr(stream, attr))
        raise NotImplementedError(
            f"DeviceSpec for backend {_safe_name(self)!r} does not expose raw stream handles"
        )

    def synchronize_stream(self, stream: Any) -> None:
        """Block the calling thread until ``stream``'s queued work is done."""
        stream.synchronize()

    def synchronize_device(self, device: Any = None) -> None:
        """Block the calling thread until all work on ``device`` (keeps its index) is done."""
        self._torch_module().synchronize(device=device)

    def create_stream_event(self, device: Any = None) -> Any:
        """A new (process-local) event of this device's torch module."""
        return self._torch_module().Event()

    def record_stream_event(self, event: Any, stream: Any) -> None:
        """Enqueue ``event`` on ``stream``."""
        event.record(stream)

    def is_stream_event_complete(self, event: Any) -> bool:
        """Whether ``event`` has completed; must not block (pollers call it)."""
        return bool(event.query())

    # ---- LMCache-driven capabilities ---------------------------------------------------
    # Needed only for lmcache_driven. The worker wraps each KV layer with ipc_wrapper_cls
    # and sends the wrappers over the wire; the server opens them in a cache context and
    # orders its copies after the worker's stream with event_ipc_backend.
    @property
    def event_ipc_backend(self) -> EventIPCBackend | None:
        """Cross-process event backend (``DefaultEventIPCBackend`` fits CUDA-style
        modules), or None. Build it lazily and cache it on the instance: futures poll it
        from several threads and it must not be rebuilt per call. Default with ``event_ipc``
        declared: one ``DefaultEventIPCBackend`` over this spec's torch module."""
        if not type(self).event_ipc:
            return None
        backend = self._event_backend_cache
        if backend is None:
            with _SINGLETON_LOCK:
                backend = self._event_backend_cache
                if backend is None:
                    from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend

                    backend = DefaultEventIPCBackend(self._torch_module(), self.device_type)
                    self._event_backend_cache = backend
        return backend

    @property
    def ipc_wrapper_cls(self) -> type[DeviceIPCWrapper] | None:
        """The ``DeviceIPCWrapper`` subclass the worker wraps KV tensors with (its
        ``wrap(tensor)`` classmethod is the factory), or None: engine-driven only. Default:
        the declared ``ipc_wrapper_class``, else None."""
        return self._declared_class("ipc_wrapper_class")

    @property
    def ipc_wire_types(self) -> tuple[type[DeviceIPCWrapper], ...]:
        """Every wrapper class this backend may put on the wire; registered in the wire
        tag registry so the server can decode them. Default: ``(ipc_wrapper_cls,)``."""
        cls = self.ipc_wrapper_cls
        return (cls,) if cls is not None else ()

    def create_cache_context(self, *args: Any, **kwargs: Any) -> Any:
        """Server side of lmcache_driven: build the ``BaseCacheContext`` over a worker's
        opened KV tensors.

        Called on the server's request thread when a worker registers (``create_cache_
        context`` forwards seven positional values: kv_caches, lmcache_tokens_per_chunk,
        layout_hints, engine_group_infos, engine_type, separate_object_groups,
        full_sw_kv). Import the context class lazily and forward the arguments verbatim.
        The context then belongs to that registration and is closed when the worker
        unregisters or is reaped. Raising fails that registration only; the default builds
        the declared ``cache_context_class``, else raises ``NotImplementedError``.
        """
        context_cls = self._declared_class("cache_context_class")
        if context_cls is not None:
            return context_cls(*args, **kwargs)
        raise NotImplementedError(
            f"DeviceSpec for device_type={self.device_type!r} does not provide a BaseCacheContext implementation."
        )

    # ---- host pinning ------------------------------------------------------------------
    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend] | None:
        """A ``PinMemoryBackend`` *class* (instantiated once) that registers host memory
        with the device runtime, or None. Optional: pinning only speeds up host copies of
        SHM staging buffers; nothing requires it. Default: the declared
        ``pin_memory_class``, else None."""
        return self._declared_class("pin_memory_class")

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
        """Register ``size`` host bytes at ``ptr`` with the device runtime; False when
        unsupported or failed (never raises). The caller keeps the memory alive and calls
        ``unpin_memory`` before freeing it."""
        return bool(self._pin_backend().pin_memory(ptr, size, flags))

    def unpin_memory(self, ptr: int) -> bool:
        """Undo ``pin_memory(ptr, ...)``; False when it was not pinned or failed."""
        return bool(self._pin_backend().unpin_memory(ptr))

    @property
    def is_pin_supported(self) -> bool:
        """Whether ``pin_memory`` can succeed on this host."""
        return bool(self._pin_backend().is_pin_supported)


def _safe_name(spec: DeviceSpec) -> str:
    try:
        return str(spec.backend_name)
    except Exception:
        return type(spec).__qualname__
