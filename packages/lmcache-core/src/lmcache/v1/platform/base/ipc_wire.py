"""msgpack ext type 1: DeviceIPCWrapper on the wire, through a tag registry.

Body: a msgpack map ``{"type": tag, "version": 1, "metadata": {...}, <variant fields>}``.
Only classes registered here can be decoded (nothing is unpickled). Core's ``cpu_shm``
comes first; then, on first use, every registered spec's ``ipc_wire_types``; plus explicit
``register_wire_wrapper`` calls. A taken tag keeps its first class.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec

from lmcache.utils import init_logger
from lmcache.v1.platform.base.active import active_platform
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper, TensorMetadata

logger = init_logger(__name__)

# The plugin API of this module (logger and the private registry are not part of it).
__all__ = [
    "IPC_WRAPPER_EXT_TYPE",
    "WIRE_VERSION",
    "decode_wrapper",
    "enc_hook",
    "encode_wrapper",
    "ext_hook",
    "register_wire_wrapper",
    "registered_wire_tags",
    "reset_wire_registry",
    "wire_tag_of",
    "wrapper_from_dict",
    "wrapper_to_dict",
]

IPC_WRAPPER_EXT_TYPE = 1
"""The msgpack extension type code of an IPC wrapper on the wire (same as 0.5.6)."""
WIRE_VERSION = 1
"""The ``version`` field of every wrapper body; another value is rejected on decode."""
_RESERVED = ("type", "version", "metadata")

_lock = threading.RLock()
_by_tag: dict[str, type[DeviceIPCWrapper]] = {}
_by_cls: dict[type[DeviceIPCWrapper], str] = {}
_builtins_done = False
_specs_done = False

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _register(cls: Any, tag: str | None, source: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, DeviceIPCWrapper)):
        raise TypeError(f"{cls!r} is not a DeviceIPCWrapper subclass; cannot register a wire tag")
    tag = tag or cls.wire_tag
    if not tag or not isinstance(tag, str):
        raise ValueError(
            f"{cls.__qualname__} has no wire tag: set wire_tag or pass tag= to register_wire_wrapper"
        )
    with _lock:
        owner = _by_tag.get(tag)
        if owner is cls:
            return
        if owner is not None:
            logger.warning(
                "Ignoring IPC wrapper %s for wire tag %r (%s): the tag is already registered by %s",
                cls.__qualname__,
                tag,
                source,
                owner.__qualname__,
            )
            return
        _by_tag[tag] = cls
        _by_cls.setdefault(cls, tag)


def _ensure_builtins() -> None:
    global _builtins_done
    if _builtins_done:
        return
    with _lock:
        if _builtins_done:
            return
        _builtins_done = True
        from lmcache.v1.platform.devices.cpu.ipc_wrapper import CpuShmTensorWrapper

        _register(CpuShmTensorWrapper, "cpu_shm", "core")


def _ensure_specs() -> None:
    global _specs_done
    _ensure_builtins()
    if _specs_done:
        return
    with _lock:
        if _specs_done:
            return
        _specs_done = True
        for name, spec in active_platform().backends().items():
            try:
                types = tuple(spec.ipc_wire_types or ())
            except Exception as exc:
                logger.warning("Backend %r: ipc_wire_types raised %s; skipped", name, exc)
                continue
            for cls in types:
                try:
                    _register(cls, getattr(cls, "wire_tag", None) or name, f"backend {name!r}")
                except (TypeError, ValueError) as exc:
                    logger.warning("Backend %r: cannot register IPC wrapper %r: %s", name, cls, exc)


def register_wire_wrapper(cls: type[DeviceIPCWrapper], tag: str | None = None) -> None:
    """Make ``cls`` encodable/decodable under ``tag`` (default: ``cls.wire_tag``)."""
    _ensure_builtins()
    _register(cls, tag, "explicit")


def registered_wire_tags() -> dict[str, type[DeviceIPCWrapper]]:
    """A copy of the tag -> wrapper class registry, after loading every spec's
    ``ipc_wire_types`` (``lmcache plugins`` and tests list it)."""
    _ensure_specs()
    with _lock:
        return dict(_by_tag)


def reset_wire_registry() -> None:
    """Forget every registration (tests; part of reset_platform_caches)."""
    global _builtins_done, _specs_done
    with _lock:
        _by_tag.clear()
        _by_cls.clear()
        _builtins_done = False
        _specs_done = False


def _unknown_tag(tag: Any) -> ValueError:
    return ValueError(
        f"Unknown IPC wrapper wire tag {tag!r}: no installed device backend registers it; install "
        "the device wheel that provides it on both worker and server"
    )


def wire_tag_of(wrapper: DeviceIPCWrapper) -> str:
    """The tag ``wrapper``'s exact class is registered under; ``ValueError`` telling how to
    register it when it is not (subclasses are not matched: each needs its own tag)."""
    _ensure_specs()
    with _lock:
        tag = _by_cls.get(type(wrapper))
    if tag is None:
        raise ValueError(
            f"IPC wrapper class {type(wrapper).__qualname__} is not registered for the wire; "
            "return it from its DeviceSpec.ipc_wire_types or call register_wire_wrapper()"
        )
    return tag


def wrapper_to_dict(wrapper: DeviceIPCWrapper) -> dict[str, Any]:
    """The map carried in the ext body."""
    fields = dict(wrapper.to_wire())
    for key in _RESERVED:
        fields.pop(key, None)
    return {
        "type": wire_tag_of(wrapper),
        "version": WIRE_VERSION,
        "metadata": wrapper.wire_metadata().to_dict(),
        **fields,
    }


def wrapper_from_dict(data: Any) -> DeviceIPCWrapper:
    """Rebuild a wrapper from a decoded ext body: look its ``type`` up in the registry, check
    ``version``, then ``cls.from_wire(data)`` and ``restore_metadata``. Anything malformed or
    unknown is a ``ValueError``; nothing is unpickled."""
    if not isinstance(data, dict):
        raise ValueError(f"IPC wrapper body must be a map, got {type(data).__name__}")
    tag = data.get("type")
    _ensure_specs()
    with _lock:
        cls = _by_tag.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise _unknown_tag(tag)
    version = data.get("version")
    if version != WIRE_VERSION:
        raise ValueError(f"IPC wrapper {tag!r}: unsupported wire version {version!r} (expected 1)")
    md = TensorMetadata.from_dict(data.get("metadata"))
    wrapper = cls.from_wire(data)
    wrapper.restore_metadata(md)
    return wrapper


def encode_wrapper(wrapper: DeviceIPCWrapper) -> msgspec.msgpack.Ext:
    """``msgspec.msgpack.Ext(1, body)`` for a registered wrapper."""
    return msgspec.msgpack.Ext(IPC_WRAPPER_EXT_TYPE, _encoder.encode(wrapper_to_dict(wrapper)))


def decode_wrapper(ext_data: bytes | memoryview) -> DeviceIPCWrapper:
    """Inverse of :func:`encode_wrapper` given the ext body bytes."""
    try:
        data = _decoder.decode(ext_data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed IPC wrapper ext body: {exc}") from None
    return wrapper_from_dict(data)


def enc_hook(obj: Any) -> Any:
    """msgspec ``enc_hook``: wrappers become ext type 1."""
    if isinstance(obj, DeviceIPCWrapper):
        return encode_wrapper(obj)
    raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")


def ext_hook(code: int, data: memoryview) -> Any:
    """msgspec ``ext_hook`` for ext type 1; other codes are rejected."""
    if code == IPC_WRAPPER_EXT_TYPE:
        return decode_wrapper(bytes(data))
    raise ValueError(f"unknown msgpack ext type {code}")
