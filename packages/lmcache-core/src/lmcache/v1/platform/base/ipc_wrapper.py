"""``DeviceIPCWrapper``: a cross-process handle to one engine KV tensor (lmcache_driven).

Concrete wrappers declare ``device_type``, a ``wrap(tensor)`` classmethod, ``to_tensor()``,
``to_wire()`` (variant fields as msgpack primitives) and ``from_wire(data)``. Core adds
``type``, ``version`` and ``metadata`` on the wire (``ipc_wire``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "DeviceIPCWrapper",
    "TensorMetadata",
    "device_index_for_uuid",
    "device_uuid_for_index",
    "dtype_from_name",
    "dtype_name",
]


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> Any:
    """``"bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` naming ``name`` when it is not a
    torch dtype (wire metadata is validated with it before any tensor is built)."""
    import torch

    dt = getattr(torch, str(name), None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(
            f"invalid dtype name {name!r}: expected a torch dtype name such as 'bfloat16'"
        )
    return dt


def _check_ints(field_name: str, values: Any) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"TensorMetadata.{field_name}={values!r}: expected a list of ints")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"TensorMetadata.{field_name}={values!r}: expected non-negative ints")
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class TensorMetadata:
    """dtype/shape/stride/offset of a tensor view plus the device that holds it."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int = 0
    device_uuid: str = ""

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        object.__setattr__(self, "shape", _check_ints("shape", self.shape))
        object.__setattr__(self, "stride", _check_ints("stride", self.stride))
        if len(self.shape) != len(self.stride):
            raise ValueError(
                f"TensorMetadata rank mismatch: shape {list(self.shape)} vs stride {list(self.stride)}"
            )
        if (
            isinstance(self.storage_offset, bool)
            or not isinstance(self.storage_offset, int)
            or self.storage_offset < 0
        ):
            raise ValueError(
                f"TensorMetadata.storage_offset={self.storage_offset!r}: expected a non-negative int"
            )
        if not isinstance(self.device_uuid, str):
            raise ValueError(f"TensorMetadata.device_uuid={self.device_uuid!r}: expected a str")

    @property
    def element_size(self) -> int:
        """Bytes per element of ``dtype``."""
        return dtype_from_name(self.dtype).itemsize

    def span_bytes(self) -> int:
        """Bytes from the start of the allocation to the end of the view."""
        if any(s == 0 for s in self.shape):
            return self.storage_offset * self.element_size
        last = self.storage_offset + sum(
            (s - 1) * st for s, st in zip(self.shape, self.stride, strict=False)
        )
        return (last + 1) * self.element_size

    def check_fits(self, alloc_nbytes: int) -> None:
        """``ValueError`` when the view reaches past an allocation of ``alloc_nbytes`` bytes.
        Wrappers call it before building a tensor over memory opened from a peer's handle."""
        span = self.span_bytes()
        if span > alloc_nbytes:
            raise ValueError(
                f"tensor view of {span} bytes (shape {list(self.shape)}, stride "
                f"{list(self.stride)}, offset {self.storage_offset}) exceeds its "
                f"{alloc_nbytes}-byte allocation"
            )

    def to_dict(self) -> dict[str, Any]:
        """The wire's ``metadata`` map (msgpack primitives only)."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "storage_offset": self.storage_offset,
            "device_uuid": self.device_uuid,
        }

    @classmethod
    def from_dict(cls, data: Any) -> TensorMetadata:
        """Inverse of :meth:`to_dict`, validating every field; ``ValueError`` naming the bad
        or missing field."""
        if not isinstance(data, dict):
            raise ValueError(f"IPC wrapper metadata must be a map, got {type(data).__name__}")
        try:
            return cls(
                dtype=data["dtype"],
                shape=tuple(data["shape"]) if isinstance(data["shape"], list) else data["shape"],
                stride=tuple(data["stride"])
                if isinstance(data["stride"], list)
                else data["stride"],
                storage_offset=data.get("storage_offset", 0),
                device_uuid=data.get("device_uuid", "") or "",
            )
        except KeyError as exc:
            raise ValueError(f"IPC wrapper metadata lacks field {exc.args[0]!r}") from None

    @classmethod
    def of_tensor(cls, tensor: Any, device_uuid: str = "") -> TensorMetadata:
        """The metadata of ``tensor``'s view (dtype, shape, stride, storage offset in
        elements); ``device_uuid`` names the device holding it."""
        return cls(
            dtype=dtype_name(tensor.dtype),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            storage_offset=int(tensor.storage_offset()),
            device_uuid=device_uuid,
        )


def device_uuid_for_index(module: Any, index: int) -> str:
    """The UUID of device ``index`` of the torch device ``module`` (``torch.cuda``...).
    Wrappers send UUIDs, not ordinals: the two processes may see devices in different
    orders (``CUDA_VISIBLE_DEVICES``)."""
    return str(module.get_device_properties(index).uuid)


def device_index_for_uuid(module: Any, uuid: str) -> int:
    """The local ordinal of the device with ``uuid`` (the receiving side of
    :func:`device_uuid_for_index`); ``RuntimeError`` telling to make all devices visible
    when none matches."""
    for i in range(int(module.device_count())):
        if device_uuid_for_index(module, i) == uuid:
            return i
    raise RuntimeError(
        f"no visible accelerator device has uuid {uuid!r}; make all accelerator devices "
        "visible to this process (e.g. unset CUDA_VISIBLE_DEVICES or list every device)"
    )


class DeviceIPCWrapper:
    """Base of every IPC wrapper; equality compares the exact type and all fields."""

    device_type: ClassVar[str] = ""
    # Wire tag; None = the backend_name of the spec that registers the class.
    wire_tag: ClassVar[str | None] = None

    handle: Any = None
    dtype: Any = None
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    storage_offset: int = 0
    device_uuid: str = ""

    def __init__(self, tensor: Any = None) -> None:
        if tensor is not None:
            self.dtype = tensor.dtype
            self.shape = tuple(tensor.shape)
            self.stride = tuple(tensor.stride())
            self.storage_offset = int(tensor.storage_offset())
            self.device_uuid = ""

    @classmethod
    def wrap(cls, tensor: Any) -> DeviceIPCWrapper:
        """Export ``tensor`` (one engine KV layer or plane) for another process. Called on the
        worker by ``kv_wrap.wrap_kv_caches`` when it registers in LMCache-driven mode; the
        tensor must stay alive while the server uses the wrapper."""
        return cls(tensor)

    def to_tensor(self) -> Any:
        """Open the handle in this process and return a tensor viewing the same memory with
        the recorded dtype, shape, stride and offset. Called by the server's cache context
        when it registers the worker's KV caches."""
        raise NotImplementedError(f"{type(self).__name__}.to_tensor")

    def close(self) -> None:
        """Release what :meth:`to_tensor` opened (mappings, imported handles); the tensor must
        no longer be used. Called when the cache context closes. The base does nothing."""
        return None

    def _fields(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return id(self)

    def wire_metadata(self) -> TensorMetadata:
        """The ``metadata`` core puts on the wire next to the variant fields."""
        return TensorMetadata(
            dtype=dtype_name(self.dtype),
            shape=tuple(self.shape),
            stride=tuple(self.stride),
            storage_offset=int(self.storage_offset),
            device_uuid=self.device_uuid or "",
        )

    def restore_metadata(self, md: TensorMetadata) -> None:
        """Set dtype, shape, stride, offset and device UUID from decoded wire metadata
        (called by the wire codec after :meth:`from_wire`)."""
        self.dtype = dtype_from_name(md.dtype)
        self.shape = tuple(md.shape)
        self.stride = tuple(md.stride)
        self.storage_offset = int(md.storage_offset)
        self.device_uuid = md.device_uuid

    def to_wire(self) -> dict[str, Any]:
        """The variant's own fields (the handle, in msgpack primitives: bytes, str, int).
        ``type``, ``version`` and ``metadata`` are reserved; core adds them."""
        raise NotImplementedError(f"{type(self).__name__}.to_wire")

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> DeviceIPCWrapper:
        """Rebuild a wrapper from the decoded body map (reserved keys included); raise
        ``ValueError`` on a malformed field. Metadata is restored by the caller."""
        raise NotImplementedError(f"{cls.__name__}.from_wire")
