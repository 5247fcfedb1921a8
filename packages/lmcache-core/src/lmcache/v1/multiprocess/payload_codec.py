"""Copy-path payload encodings of ``commit_store.data`` / ``prepare_retrieve.data``.

docs/design/protocol.md#payload-encodings, docs/design/platform.md#payload-safety. One
implementation shared by server and client:

* empty bytes: the SHM path, no payload;
* ``0x80``: pickle of ``list[torch.Tensor]`` (LMCache 0.5.6 clients). It is read ONLY
  through ``restricted_unpickle_tensors``, which resolves exactly three globals and
  never runs anything else. Nothing of ours calls ``pickle.loads`` on peer bytes;
* ``LMCRAW01``: raw_v1 (ours, negotiated): magic, uint32 chunk count, uint64 lengths,
  concatenated chunk bytes, all little-endian.

Producing pickle for old peers (``pickle_tensors``) is safe and uses ``pickle.dumps``.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import warnings
from dataclasses import dataclass

import torch

RAW_V1_MAGIC = b"LMCRAW01"
PICKLE_PROTO = 0x80
PICKLE_SLACK_PER_CHUNK = 64 * 1024

ENCODING_EMPTY = "empty"
ENCODING_PICKLE = "pickle"
ENCODING_RAW_V1 = "raw_v1"


class PayloadError(ValueError):
    """A payload that must be rejected; ``reason`` is a short metrics label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def detect_encoding(data: bytes | memoryview) -> str:
    if len(data) == 0:
        return ENCODING_EMPTY
    if bytes(data[:8]) == RAW_V1_MAGIC:
        return ENCODING_RAW_V1
    if data[0] == PICKLE_PROTO:
        return ENCODING_PICKLE
    raise PayloadError(
        "unknown_encoding",
        f"payload starts with {bytes(data[:8])!r}: expected empty (SHM), pickle (0x80) or "
        f"{RAW_V1_MAGIC!r}",
    )


# ---------------------------------------------------------------------------
# raw_v1
# ---------------------------------------------------------------------------


def encode_raw_v1(chunks: list[bytes | memoryview | torch.Tensor | None]) -> bytes:
    """raw_v1 bytes of ``chunks`` (None or empty = "no data for this chunk")."""
    views: list[memoryview] = []
    for c in chunks:
        if c is None:
            views.append(memoryview(b""))
        elif isinstance(c, torch.Tensor):
            views.append(tensor_bytes(c))
        else:
            views.append(memoryview(c).cast("B"))
    header = RAW_V1_MAGIC + struct.pack(f"<I{len(views)}Q", len(views), *(v.nbytes for v in views))
    out = bytearray(len(header) + sum(v.nbytes for v in views))
    out[: len(header)] = header
    pos = len(header)
    for v in views:
        out[pos : pos + v.nbytes] = v
        pos += v.nbytes
    return bytes(out)


def decode_raw_v1(data: bytes | memoryview, expected_chunks: int | None = None) -> list[memoryview]:
    """Zero-copy views of each chunk; raises PayloadError on any length inconsistency."""
    mv = memoryview(data).cast("B")
    if bytes(mv[:8]) != RAW_V1_MAGIC or len(mv) < 12:
        raise PayloadError("raw_v1_header", "raw_v1 payload has no LMCRAW01 header")
    (n,) = struct.unpack_from("<I", mv, 8)
    if expected_chunks is not None and n != expected_chunks:
        raise PayloadError(
            "raw_v1_count", f"raw_v1 payload has {n} chunks, expected {expected_chunks}"
        )
    hdr = 12 + 8 * n
    if len(mv) < hdr:
        raise PayloadError("raw_v1_header", f"raw_v1 header truncated ({len(mv)} bytes)")
    lengths = struct.unpack_from(f"<{n}Q", mv, 12)
    if hdr + sum(lengths) != len(mv):
        raise PayloadError(
            "raw_v1_length",
            f"raw_v1 lengths sum to {sum(lengths)} but the body has {len(mv) - hdr} bytes",
        )
    out, pos = [], hdr
    for ln in lengths:
        out.append(mv[pos : pos + ln])
        pos += ln
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor (copies only when not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


# ---------------------------------------------------------------------------
# pickle (0.5.6 peers)
# ---------------------------------------------------------------------------


def pickle_tensors(tensors: list[torch.Tensor]) -> bytes:
    """pickle of contiguous CPU tensors, what a 0.5.6 peer expects."""
    return pickle.dumps([t.detach().cpu().contiguous() for t in tensors])


@dataclass(frozen=True)
class _Expect:
    dtype: torch.dtype | None


class _StorageLoader:
    """Substitute for torch.storage._load_from_bytes: weights_only torch.load, CPU only."""

    def __init__(self, expect: _Expect) -> None:
        self._expect = expect
        self.storages: list[object] = []

    def __call__(self, b: bytes) -> object:
        if not isinstance(b, bytes | bytearray):
            raise PayloadError("pickle_storage", "storage payload is not bytes")
        with warnings.catch_warnings():  # TypedStorage is what 0.5.6 peers send
            warnings.simplefilter("ignore", UserWarning)
            obj = torch.load(io.BytesIO(b), weights_only=True, map_location="cpu")
            if not isinstance(obj, torch.storage.TypedStorage | torch.UntypedStorage):
                raise PayloadError("pickle_storage", f"nested object is {type(obj).__name__}")
            device_type = obj.device.type
        if device_type != "cpu":
            raise PayloadError("pickle_storage", "nested storage is not a CPU storage")
        if (
            self._expect.dtype is not None
            and isinstance(obj, torch.storage.TypedStorage)
            and obj.dtype != self._expect.dtype
        ):
            raise PayloadError(
                "pickle_dtype",
                f"storage dtype {obj.dtype} differs from the registered {self._expect.dtype}",
            )
        self.storages.append(obj)
        return obj


def _empty_ordered_dict(*args: object) -> collections.OrderedDict:
    if args:
        raise PayloadError("pickle_global", "OrderedDict with arguments is not allowed")
    return collections.OrderedDict()


class _TensorRebuilder:
    def __init__(self, loader: _StorageLoader) -> None:
        self._loader = loader

    def __call__(self, storage, storage_offset, size, stride, requires_grad, backward_hooks, *rest):
        if not any(storage is s for s in self._loader.storages):
            raise PayloadError("pickle_global", "tensor storage was not produced by the loader")
        if requires_grad:
            raise PayloadError("pickle_tensor", "tensor has requires_grad=True")
        if not isinstance(backward_hooks, collections.OrderedDict) or backward_hooks:
            raise PayloadError("pickle_tensor", "tensor carries backward hooks")
        if rest and rest[0]:
            raise PayloadError("pickle_tensor", "tensor carries extra metadata")
        size, stride = tuple(size), tuple(stride)
        if len(size) != len(stride) or any(
            not isinstance(v, int) or v < 0 for v in (*size, *stride, storage_offset)
        ):
            raise PayloadError("pickle_tensor", f"bad size {size} / stride {stride}")
        numel_storage = storage.size() if hasattr(storage, "size") else len(storage)
        if all(size):
            last = storage_offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
            if last >= numel_storage:
                raise PayloadError("pickle_tensor", "tensor view exceeds its storage")
        t = torch._utils._rebuild_tensor_v2(
            storage, storage_offset, size, stride, False, collections.OrderedDict()
        )
        if t.device.type != "cpu":
            raise PayloadError("pickle_tensor", "tensor is not on CPU")
        return t


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, expect: _Expect) -> None:
        super().__init__(file)
        self._loader = _StorageLoader(expect)
        self._allowed = {
            ("torch._utils", "_rebuild_tensor_v2"): _TensorRebuilder(self._loader),
            ("torch.storage", "_load_from_bytes"): self._loader,
            ("collections", "OrderedDict"): _empty_ordered_dict,
        }

    def find_class(self, module: str, name: str):
        fn = self._allowed.get((module, name))
        if fn is None:
            raise PayloadError("pickle_global", f"forbidden global {module}.{name} in pickle")
        return fn

    def persistent_load(self, pid):  # pragma: no cover - never produced by dumps
        raise PayloadError("pickle_global", "persistent ids are not allowed")


def restricted_unpickle_tensors(
    data: bytes | memoryview,
    *,
    expected_count: int | None = None,
    expected_shape: tuple[int, ...] | None = None,
    expected_dtype: torch.dtype | None = None,
    max_bytes: int | None = None,
) -> list[torch.Tensor]:
    """Decode a 0.5.6 pickle of ``list[Tensor]`` without running anything it names.

    Raises PayloadError (with a ``reason`` label) on any forbidden global, a wrong count,
    shape or dtype, or a payload larger than ``max_bytes``.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise PayloadError("oversized", f"pickle payload of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = _RestrictedUnpickler(io.BytesIO(bytes(data)), _Expect(expected_dtype)).load()
    except PayloadError:
        raise
    except Exception as exc:
        raise PayloadError(
            "pickle_decode", f"undecodable pickle: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, list) or not all(isinstance(t, torch.Tensor) for t in obj):
        raise PayloadError(
            "pickle_type", f"pickle top-level is {type(obj).__name__}, not list[Tensor]"
        )
    if expected_count is not None and len(obj) != expected_count:
        raise PayloadError(
            "pickle_count", f"pickle has {len(obj)} chunks, expected {expected_count}"
        )
    for t in obj:
        if expected_shape is not None and tuple(t.shape) != tuple(expected_shape):
            raise PayloadError(
                "pickle_shape", f"chunk shape {tuple(t.shape)} differs from {tuple(expected_shape)}"
            )
        if expected_dtype is not None and t.dtype != expected_dtype:
            raise PayloadError(
                "pickle_dtype", f"chunk dtype {t.dtype} differs from {expected_dtype}"
            )
    return obj
