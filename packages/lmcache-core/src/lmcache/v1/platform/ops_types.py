"""Shared enums, shape descriptors and native-plan stubs of the ops layer.

Pure Python on purpose: importing this module never imports torch, so device
specs and the CLI can use the enums cheaply. Native modules that export their own
``EngineKVFormat`` must use the same integer values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BatchStep",
    "EngineKVFormat",
    "KernelGroupSpec",
    "LaunchVar",
    "PageBufferShapeDesc",
    "StagingCopy",
    "TransferDirection",
    "TransferPhase",
    "is_cross_layer",
    "is_fused_packed",
    "is_hnd",
    "is_kv_list",
    "is_kv_second_tuple",
    "is_layer_list",
    "is_mla",
    "is_pbs_fused",
    "is_single_kv",
    "is_two_major",
]


class TransferDirection(enum.IntEnum):
    H2D = 0  # LMCache -> engine (retrieve)
    D2H = 1  # engine -> LMCache (store)


class TransferPhase(enum.IntEnum):
    KERNEL = 0
    STAGING = 1


class EngineKVFormat(enum.IntEnum):
    NB_NL_TWO_BS_NH_HS = 0
    NL_X_TWO_NB_BS_NH_HS = 1
    NL_X_NB_TWO_BS_NH_HS = 2
    NL_X_NB_BS_HS = 3
    TWO_X_NL_X_NBBS_NH_HS = 4
    NL_X_NBBS_ONE_HS = 5
    NL_X_TWO_NB_NH_BS_HS = 6
    NL_X_NB_TWO_NH_BS_HS = 7
    NB_NL_TWO_NH_BS_HS = 8
    TWO_X_NL_X_NB_BS_NH_HS = 9
    NL_X_NB_NH_BS_TWO_HS = 10
    NL_X_NB_BS_NH_TWO_HS = 11
    NL_X_NB_NH_BS_CS = 12
    NL_X_NB_BS_NH_CS = 13
    NL_X_NB_BSV_BSS = 14
    NL_X_TWO_NB_NH_ONE_BS_HS = 15
    NL_X_TWO_X_NB_BS_NH_HS = 16
    NL_X_NP_X_NB_BS_ONE_HS = 17
    NL_X_NB_BS_NH_HS = 18


_F = EngineKVFormat

# One table of flags per format (docs/design/platform.md#kv-formats); the predicates below read it.
_FLAGS: dict[int, frozenset[str]] = {
    _F.NB_NL_TWO_BS_NH_HS: frozenset({"cross_layer"}),
    _F.NL_X_TWO_NB_BS_NH_HS: frozenset({"layer_list", "two_major"}),
    _F.NL_X_NB_TWO_BS_NH_HS: frozenset({"layer_list"}),
    _F.NL_X_NB_BS_HS: frozenset({"layer_list", "mla"}),
    _F.TWO_X_NL_X_NBBS_NH_HS: frozenset({"kv_list", "pbs_fused"}),
    _F.NL_X_NBBS_ONE_HS: frozenset({"layer_list", "mla", "pbs_fused"}),
    _F.NL_X_TWO_NB_NH_BS_HS: frozenset({"layer_list", "two_major", "hnd"}),
    _F.NL_X_NB_TWO_NH_BS_HS: frozenset({"layer_list", "hnd"}),
    _F.NB_NL_TWO_NH_BS_HS: frozenset({"cross_layer", "hnd"}),
    _F.TWO_X_NL_X_NB_BS_NH_HS: frozenset({"kv_list"}),
    _F.NL_X_NB_NH_BS_TWO_HS: frozenset({"layer_list", "hnd", "fused_packed"}),
    _F.NL_X_NB_BS_NH_TWO_HS: frozenset({"layer_list", "fused_packed"}),
    _F.NL_X_NB_NH_BS_CS: frozenset({"layer_list", "hnd", "fused_packed"}),
    _F.NL_X_NB_BS_NH_CS: frozenset({"layer_list", "fused_packed"}),
    _F.NL_X_NB_BSV_BSS: frozenset({"layer_list", "mla"}),
    _F.NL_X_TWO_NB_NH_ONE_BS_HS: frozenset({"layer_list", "two_major", "hnd"}),
    _F.NL_X_TWO_X_NB_BS_NH_HS: frozenset({"layer_list", "kv_second_tuple"}),
    _F.NL_X_NP_X_NB_BS_ONE_HS: frozenset({"layer_list", "mla", "kv_second_tuple"}),
    _F.NL_X_NB_BS_NH_HS: frozenset({"layer_list", "single_kv"}),
}


def _member(enum_cls: Any, value: Any, bad: str) -> Any:
    """``enum_cls`` member from itself, a native module's enum or a plain int; else
    ValueError ``bad`` (which names the value and what is expected)."""
    try:
        return enum_cls(int(value))
    except (TypeError, ValueError):
        raise ValueError(bad) from None


def to_engine_kv_format(fmt: Any) -> EngineKVFormat:
    """Accept our enum, a native module's enum or a plain int; reject anything else."""
    expected = f"an EngineKVFormat value 0..{len(_F) - 1}"
    return _member(EngineKVFormat, fmt, f"unknown engine_kv_format {fmt!r}: expected {expected}")


def parse_direction(direction: Any) -> TransferDirection:
    """``TransferDirection`` from an enum member or its int; ValueError naming the value."""
    return _member(
        TransferDirection,
        direction,
        f"invalid transfer direction {direction!r}: expected TransferDirection.H2D or D2H",
    )


def _has(fmt: Any, flag: str) -> bool:
    return flag in _FLAGS[to_engine_kv_format(fmt)]


def is_kv_list(fmt: Any) -> bool:
    """The engine passes two lists, K layers then V layers (``2 × NL × [...]``, SGLang MHA)."""
    return _has(fmt, "kv_list")


def is_layer_list(fmt: Any) -> bool:
    """The engine passes one tensor (or one K/V tuple, or planes) per layer: ``NL × [...]``."""
    return _has(fmt, "layer_list")


def is_cross_layer(fmt: Any) -> bool:
    """One tensor holds every layer, block-major: ``[NB, NL, 2, ...]``."""
    return _has(fmt, "cross_layer")


def is_mla(fmt: Any) -> bool:
    """Multi-head latent attention: one latent plane per token, no K/V split (``kv_size == 1``)."""
    return _has(fmt, "mla")


def is_kv_second_tuple(fmt: Any) -> bool:
    """Each layer is a tuple of planes, ``(K, V)`` or MLA planes, not one tensor."""
    return _has(fmt, "kv_second_tuple")


def is_hnd(fmt: Any) -> bool:
    """Heads before tokens inside a block (``[..., NH, BS, HS]``); NHD otherwise."""
    return _has(fmt, "hnd")


def is_two_major(fmt: Any) -> bool:
    """The K/V axis of 2 comes before the block axis in each layer (``[2, NB, ...]``)."""
    return _has(fmt, "two_major")


def is_pbs_fused(fmt: Any) -> bool:
    """Blocks and tokens are one flat axis (``[NB*BS, ...]``), SGLang style."""
    return _has(fmt, "pbs_fused")


def is_fused_packed(fmt: Any) -> bool:
    """K and V are packed into the last axis of one plane (``2*HS`` or ``CS`` wide)."""
    return _has(fmt, "fused_packed")


def is_single_kv(fmt: Any) -> bool:
    """The layer holds K or V alone (one plane per token, ``kv_size == 1``)."""
    return _has(fmt, "single_kv")


def kv_size_of(fmt: Any) -> int:
    """Planes per token in the canonical host chunk: 2 for split K/V, 1 otherwise."""
    f = to_engine_kv_format(fmt)
    return 1 if (is_mla(f) or is_fused_packed(f) or is_single_kv(f)) else 2


@dataclass
class PageBufferShapeDesc:
    """Geometry of the engine's paged KV buffers (mutable, constructible empty).

    ``block_stride_elems == 0`` means tight blocks. MLA uses ``nh = 1`` and ``kv_size = 1``.
    ``dtype`` (a ``torch.dtype`` or None) disambiguates fp16/bf16 for pointer operands.
    """

    kv_size: int = 2
    nl: int = 0
    nb: int = 0
    bs: int = 0
    nh: int = 0
    hs: int = 0
    element_size: int = 0
    block_stride_elems: int = 0
    dtype: Any = None


@dataclass
class KernelGroupSpec:
    """Arguments of one kernel launch; plain data in core (0.5.6 took it from its extension)."""

    paged_buffer_ptrs: Any = None
    lmcache_objects_ptrs: Any = None
    shape_desc: PageBufferShapeDesc = field(default_factory=PageBufferShapeDesc)
    lmcache_chunk_size: int = 0
    engine_kv_format: Any = EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    block_ids_base: int = 0
    block_ids_capacity: int = 0


class _NativeOnly:
    """Placeholder for a type that only a native ops module provides."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} requires a native ops backend; the torch baseline does "
            "not provide it (install a device wheel whose native module exports it)"
        )


class StagingCopy(_NativeOnly):
    pass


class LaunchVar(_NativeOnly):
    pass


class BatchStep(_NativeOnly):
    pass
