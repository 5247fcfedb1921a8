"""Fake accelerator modules for tests (docs/design/platform.md#device-wheels). Tensors stay on CPU.

``install_fake_device("mlu", vendor_module="torch_mlu")`` sets ``torch.mlu`` to a fake
module; for ``cuda``/``xpu`` (which stock torch already has) it patches the module's
functions instead. Platform caches are reset on entry and exit.

Checks a device wheel's own tests can call (they raise AssertionError):
``check_device_wheel_contract(distribution, spec)`` (packaging and explicit capability
overrides) and ``check_canonical_block_transfer(ops, fmt, block_ids, skip)`` (the
canonical host-chunk layout of ``multi_layer_block_kv_transfer``, CPU tensors).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

__all__ = [
    "FakeDeviceModule",
    "FakeEvent",
    "FakeExternalStream",
    "FakeStream",
    "check_canonical_block_transfer",
    "check_device_wheel_contract",
    "extra_device_specs",
    "install_fake_device",
]


class FakeStream:
    """A stream object; records waits and synchronizes into its module's counters."""

    def __init__(
        self, device: Any = None, priority: int = 0, *, _module: Any = None, handle: int = 0
    ):
        self.device = device
        self.priority = priority
        self._module = _module
        self.handle = int(handle)
        self.synchronize_calls = 0
        self.waited_events: list[Any] = []

    def synchronize(self) -> None:
        self.synchronize_calls += 1
        if self._module is not None:
            self._module.stream_synchronize_calls += 1

    def wait_event(self, event: Any) -> None:
        self.waited_events.append(event)
        if self._module is not None:
            self._module.stream_wait_calls += 1

    def wait_stream(self, stream: Any) -> None:
        if self._module is not None:
            self._module.stream_wait_calls += 1

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> Any:
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class FakeExternalStream(FakeStream):
    """Wraps a raw int stream handle (like ``torch.cuda.ExternalStream``)."""

    def __init__(self, stream_ptr: int, device: Any = None, *, _module: Any = None):
        super().__init__(device, _module=_module, handle=stream_ptr)


class FakeEvent:
    """Records every call; ``query()`` is True."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        self.calls: list[tuple[str, Any]] = [("init", None)]

    def record(self, stream: Any = None) -> None:
        self.calls.append(("record", stream))

    def wait(self, stream: Any = None) -> None:
        self.calls.append(("wait", stream))
        if stream is not None and hasattr(stream, "waited_events"):
            stream.waited_events.append(self)

    def query(self) -> bool:
        self.calls.append(("query", None))
        return True

    def synchronize(self) -> None:
        self.calls.append(("synchronize", None))


class FakeIPCEvent(FakeEvent):
    """An event that accepts ``interprocess=True`` and round-trips IPC handles."""

    _registry: dict[bytes, FakeIPCEvent] = {}
    _counter = 0
    _lock = threading.Lock()

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ):
        super().__init__(enable_timing, blocking)
        self.interprocess = interprocess

    def ipc_handle(self) -> bytes:
        with FakeIPCEvent._lock:
            FakeIPCEvent._counter += 1
            handle = b"fake_ipc_%08d" % FakeIPCEvent._counter
            FakeIPCEvent._registry[handle] = self
        self.calls.append(("ipc_handle", handle))
        return handle

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: bytes) -> FakeIPCEvent:
        ev = cls(interprocess=True)
        ev.calls.append(("from_ipc_handle", (device, bytes(handle))))
        return ev


class FakeDeviceModule(types.ModuleType):
    """Stands in for ``torch.<name>``; counters let tests check ordering calls."""

    def __init__(
        self,
        name: str,
        *,
        available: bool = True,
        device_count: int = 1,
        with_ipc_events: bool = False,
    ):
        super().__init__(f"torch.{name}")
        self.device_name = name
        self.available = available
        self._device_count = device_count
        self._current = 0
        self.synchronize_calls = 0
        self.synchronize_devices: list[Any] = []
        self.stream_synchronize_calls = 0
        self.stream_wait_calls = 0
        self.set_device_calls: list[Any] = []
        self.Event = FakeIPCEvent if with_ipc_events else FakeEvent
        module = self

        class _Stream(FakeStream):
            def __init__(self, device: Any = None, priority: int = 0, **kw: Any):
                super().__init__(device, priority, _module=module)

        class _ExternalStream(FakeExternalStream):
            def __init__(self, stream_ptr: int, device: Any = None, **kw: Any):
                super().__init__(stream_ptr, device, _module=module)

        self.Stream = _Stream
        self.ExternalStream = _ExternalStream
        self._default_stream = _Stream()
        self._current_stream = self._default_stream

    def is_available(self) -> bool:
        if isinstance(self.available, BaseException):
            raise self.available
        if callable(self.available):
            return bool(self.available())
        return bool(self.available)

    def device_count(self) -> int:
        return self._device_count

    def set_device(self, device: Any) -> None:
        self.set_device_calls.append(device)
        self._current = int(getattr(device, "index", device) or 0)

    def current_device(self) -> int:
        return self._current

    def synchronize(self, device: Any = None) -> None:
        self.synchronize_calls += 1
        self.synchronize_devices.append(device)

    def current_stream(self, device: Any = None) -> Any:
        return self._current_stream

    def default_stream(self, device: Any = None) -> Any:
        return self._default_stream

    def set_stream(self, stream: Any) -> None:
        self._current_stream = stream

    def stream(self, stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(stream)

    def device(self, device: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(device)

    def empty_cache(self) -> None:
        return None

    def init(self) -> None:
        return None

    def get_device_properties(self, device: Any = None) -> types.SimpleNamespace:
        idx = int(getattr(device, "index", device) or 0)
        return types.SimpleNamespace(
            name=f"fake-{self.device_name}",
            uuid=f"fake-{self.device_name}-{idx:04d}",
            total_memory=0,
        )


_PATCHED_NAMES = (
    "is_available",
    "device_count",
    "set_device",
    "current_device",
    "synchronize",
    "Stream",
    "Event",
    "ExternalStream",
    "current_stream",
    "default_stream",
    "set_stream",
    "stream",
    "device",
    "get_device_properties",
    "empty_cache",
)
_MISSING = object()


def _reset() -> None:
    from lmcache.v1.platform import reset_platform_caches

    reset_platform_caches()


@contextlib.contextmanager
def install_fake_device(
    name: str,
    *,
    available: Any = True,
    device_count: int = 1,
    vendor_module: Any = None,
    with_ipc_events: bool = False,
    version_attrs: dict[str, Any] | None = None,
) -> Iterator[FakeDeviceModule]:
    """Install a fake ``torch.<name>`` (``available`` may be a bool, callable or exception).

    ``vendor_module``: a module name (``"torch_mlu"``) or module object put into
    ``sys.modules``. ``version_attrs``: values patched onto ``torch.version``
    (e.g. ``{"cuda": "12.4", "hip": None}``). Yields the fake module (counters).
    """
    import torch

    fake = FakeDeviceModule(
        name, available=available, device_count=device_count, with_ipc_events=with_ipc_events
    )
    restore: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        restore.append(
            (
                obj,
                attr,
                obj.__dict__.get(attr, _MISSING)
                if hasattr(obj, "__dict__")
                else getattr(obj, attr, _MISSING),
            )
        )
        setattr(obj, attr, value)

    existing = getattr(torch, name, None)
    if name in ("cuda", "xpu") and isinstance(existing, types.ModuleType):
        for attr in _PATCHED_NAMES:
            patch(existing, attr, getattr(fake, attr))
        fake.patched_module = existing  # type: ignore[attr-defined]
    else:
        patch(torch, name, fake)
        saved = sys.modules.get(f"torch.{name}", _MISSING)
        restore.append((sys.modules, f"torch.{name}", saved))
        sys.modules[f"torch.{name}"] = fake
    for attr, value in (version_attrs or {}).items():
        patch(torch.version, attr, value)
    if vendor_module is not None:
        mod = types.ModuleType(vendor_module) if isinstance(vendor_module, str) else vendor_module
        mod_name = mod.__name__
        restore.append((sys.modules, mod_name, sys.modules.get(mod_name, _MISSING)))
        sys.modules[mod_name] = mod
    _reset()
    try:
        yield fake
    finally:
        for obj, attr, old in reversed(restore):
            if obj is sys.modules:
                if old is _MISSING:
                    sys.modules.pop(attr, None)
                else:
                    sys.modules[attr] = old
            elif old is _MISSING:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, old)
        _reset()


@contextlib.contextmanager
def extra_device_specs(*specs: Any) -> Iterator[Any]:
    """Use a fresh default ``DeviceRegistry`` that also registers ``specs`` (after CPU and
    any specs an enclosing call added, before entry points); yields that registry."""
    from lmcache.v1.platform._device_detect import (
        DeviceRegistry,
        default_device_registry,
        use_device_registry,
    )

    outer = default_device_registry()
    registry = DeviceRegistry(
        [*outer.extra_specs, *specs], entry_point_group=outer.entry_point_group
    )
    try:
        with use_device_registry(registry):
            _reset()
            yield registry
    finally:
        _reset()  # the outer registry again, and wire tags / op singletons of the fresh one


# ---- checks for device wheels' own tests -----------------------------------------------


def check_device_wheel_contract(distribution: str, spec: Any) -> None:
    """A device wheel depends on ``lmcache-core`` within the device plugin API's range
    (``>=PLUGIN_API_VERSION,<0.6``) and on torch only as a range (never a pin), and its spec
    states its capability explicitly (no reliance on the base-class bridge): either it
    declares ``lmcache_driven = True/False``, or it overrides both capability flags and the
    default transfer mode."""
    import importlib.metadata as md

    from lmcache.v1.platform.api import PLUGIN_API_VERSION
    from lmcache.v1.platform.base.device_spec import overrides

    requires = md.requires(distribution) or []
    core = [r.split(";")[0].replace(" ", "") for r in requires if r.startswith("lmcache-core")]
    assert len(core) == 1, requires
    assert f">={PLUGIN_API_VERSION}" in core[0] and "<0.6" in core[0], requires
    torch_reqs = [r for r in requires if r.startswith("torch")]
    assert torch_reqs and all("==" not in r for r in torch_reqs), torch_reqs
    if type(spec).lmcache_driven is not None:
        return
    for name in (
        "is_lmcache_driven_available",
        "is_handle_transfer_available",
        "default_mp_transfer_mode",
    ):
        assert overrides(spec, name), (
            f"{type(spec).__name__} neither declares lmcache_driven nor overrides {name}"
        )


# Per-layer shapes of the formats check_canonical_block_transfer covers.
_CANONICAL_FORMAT_SHAPES = {
    1: lambda nb, bs, nh, hs: (2, nb, bs, nh, hs),  # NL x [2, NB, BS, NH, HS]
    2: lambda nb, bs, nh, hs: (nb, 2, bs, nh, hs),  # NL x [NB, 2, BS, NH, HS]
    3: lambda nb, bs, nh, hs: (nb, bs, hs),  # MLA: NL x [NB, BS, HS]
    6: lambda nb, bs, nh, hs: (2, nb, nh, bs, hs),  # HND: NL x [2, NB, NH, BS, HS]
}


def _canonical_rows(fmt: int, layer: Any, bid: int) -> Any:
    """Token-major rows of one block (docs/design/storage-formats.md#host-chunk): [2, BS, NH*HS] or
    [BS, HS]."""
    if fmt == 3:
        return layer[bid]
    if fmt == 1:
        return layer[:, bid].reshape(2, layer.shape[2], -1)
    if fmt == 2:
        return layer[bid].reshape(2, layer.shape[2], -1)
    return layer[:, bid].permute(0, 2, 1, 3).reshape(2, layer.shape[3], -1)  # 6: HND


def check_canonical_block_transfer(ops: Any, fmt: int, block_ids: list[int], skip: int) -> None:
    """Round-trip ``ops.multi_layer_block_kv_transfer`` on CPU tensors for engine format
    ``fmt`` (1, 2, 3 or 6), 2 layers, 5 blocks of 4 tokens, 8-token chunks.

    D2H must write each block's canonical token-major rows and leave the first ``skip``
    blocks' rows untouched; H2D into zeroed layers must restore exactly the blocks of
    ``block_ids[skip:]`` and nothing else.
    """
    import torch

    from lmcache.v1.platform.ops_types import PageBufferShapeDesc, TransferDirection

    if fmt not in _CANONICAL_FORMAT_SHAPES:
        raise ValueError(f"fmt={fmt!r}: check_canonical_block_transfer covers formats 1, 2, 3, 6")
    nb, bs, nh, hs, nl, chunk = 5, 4, 2, 8, 2, 8
    g = torch.Generator().manual_seed(fmt)
    shape = _CANONICAL_FORMAT_SHAPES[fmt](nb, bs, nh, hs)
    layers = [torch.randn(*shape, generator=g).to(torch.bfloat16) for _ in range(nl)]
    originals = [t.clone() for t in layers]
    mla = fmt == 3
    kv, width = (1, hs) if mla else (2, nh * hs)
    sd = PageBufferShapeDesc(
        kv_size=kv,
        nl=nl,
        nb=nb,
        bs=bs,
        nh=1 if mla else nh,
        hs=hs,
        element_size=2,
        dtype=torch.bfloat16,
    )
    cshape = (nl, chunk, width) if mla else (2, nl, chunk, width)
    n_objs = -(-len(block_ids) // (chunk // bs))
    chunks = [torch.full(cshape, 5.0, dtype=torch.bfloat16) for _ in range(n_objs)]
    ops.multi_layer_block_kv_transfer(
        layers, chunks, block_ids, "cpu", TransferDirection.D2H, sd, chunk, fmt, skip
    )
    for p, bid in enumerate(block_ids):
        obj, t0 = divmod(p, chunk // bs)
        for li, layer in enumerate(originals):
            rows = chunks[obj][li] if mla else chunks[obj][:, li]
            got = rows[..., t0 * bs : (t0 + 1) * bs, :]
            if p < skip:
                assert torch.all(got == 5.0), f"block {bid} (before skip) was written"
            else:
                assert torch.equal(got, _canonical_rows(fmt, layer, bid)), (fmt, p, bid, li)
    for t in layers:
        t.zero_()
    ops.multi_layer_block_kv_transfer(
        layers, chunks, block_ids, "cpu", TransferDirection.H2D, sd, chunk, fmt, skip
    )
    axis = 1 if fmt in (1, 6) else 0
    for t, o in zip(layers, originals, strict=True):
        for b in range(nb):
            if b in block_ids[skip:]:
                assert torch.equal(t.select(axis, b), o.select(axis, b)), (fmt, b)
            else:
                assert not t.select(axis, b).any(), f"block {b} written by H2D"
