"""Helpers the built-in serdes share (not a public face)."""

from __future__ import annotations

import difflib
import functools

import torch

from lmcache.utils import init_logger
from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)


def group_tensors(obj: MemoryObj) -> list[torch.Tensor]:
    """Each group of a KV-shaped object as a tensor (one for a plain object)."""
    n = max(1, len(obj.get_shapes()))
    out = []
    for i in range(n):
        t = obj.get_tensor(i) if n > 1 else obj.tensor
        if t is None:
            raise ValueError(f"{type(obj).__name__} has no tensor for group {i}")
        out.append(t)
    return out


def byte_tensor(obj: MemoryObj, serde: str) -> torch.Tensor:
    """A byte buffer object's data as a flat uint8 tensor (a view: writes land in ``obj``)."""
    t = obj.tensor
    if t is None:
        raise ValueError(f"{serde} serde: the byte buffer has no tensor")
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


def byte_view(obj: MemoryObj) -> memoryview:
    """``obj``'s logical bytes as a writable, flat ``B`` memoryview."""
    return memoryview(obj.byte_array).cast("B")


def physical_bytes(obj: MemoryObj) -> memoryview:
    """All of ``obj``'s buffer (a load's temporary may hold more than its logical size)."""
    return memoryview(obj.physical_byte_array()).cast("B")


def int_option(kwargs: dict[str, object], name: str, default: int) -> int:
    value = kwargs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"serde option {name!r} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"serde option {name!r} must be an integer, got {value!r}") from None


def check_options(serde: str, kwargs: dict[str, object], known: set[str]) -> None:
    """Warn about options the serde does not take (as unknown adapter keys: a config
    written for 0.5.6, which ignores them, keeps working)."""
    for name in sorted(set(kwargs) - known):
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; it takes {sorted(known)}"
        logger.warning("serde %r: unknown option %r ignored%s", serde, name, hint)


@functools.lru_cache(maxsize=32)
def fp8_decode_table(fp8_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """The 256 fp8 byte values cast to ``dtype``: decoding is a lookup, bit-identical to the
    cast and about 20x faster on a CPU than torch's fp8 cast."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).to(dtype)
