"""The ``turboquant`` serde (LMCache 0.5.6's): KV objects ``[2, layers, tokens, hidden]``
stored with keys and values quantized per token and head, in 0.5.6's byte format, decoded as
0.5.6 decodes. 0.5.6 runs it as Triton kernels on CUDA; this is plain torch, so it runs on
the CPU or on whatever device the objects live (docs/storage-backends.md#turboquant).

Options (0.5.6's keys and defaults): ``preset`` (``turboquant_k8v4``, ``turboquant_4bit_nc``,
``turboquant_k3v4_nc``, ``turboquant_3bit_nc``), ``head_dim`` (128), ``block_size`` (16),
``skip_first_layers`` (2), ``skip_last_layers`` (2), ``max_workers`` (pool size, 1).

Format of one object (a KV object of several groups: their formats one after another):

* the first ``skip_first_layers`` layers raw: ``obj[:, :first]`` in the object's dtype;
* each quantized layer: ``ceil(tokens / block_size) * block_size`` token slots (the tail of
  the last block unused), each of ``heads`` head slots of ``slot_size`` bytes:
  the key part, then the value part, then a pad byte when the sum is odd;
* the last ``skip_last_layers`` layers raw.

Key part: for 8-bit presets the key's elements as ``float8_e4m3fn`` bytes (saturated to
+-448); otherwise the key divided by its L2 norm, rotated by a per-layer randomized Hadamard
matrix and bucketed against a Lloyd-Max codebook for N(0, 1/head_dim), ``bits`` per element
packed little-endian (eight indices in ``bits`` bytes), then the norm as little-endian fp16.
Decoding takes the codebook centroids (renormalized to unit length in ``_nc`` presets),
scales them by the norm, rounds to fp16 and rotates back. Value part: ``bits`` per element
with the same packing, an asymmetric uniform quantizer per head (``(v - min) / scale``
rounded half up), then ``scale`` and ``min`` as little-endian fp16. Everything decodes
through fp16 into the object's dtype.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde._common import (
    byte_tensor,
    check_options,
    fp8_decode_table,
    group_tensors,
    int_option,
)
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import (
    Deserializer,
    SerdeProcessor,
    SerdeRejectedError,
    Serializer,
)
from lmcache.v1.distributed.serde.factory import register_serde_factory
from lmcache.v1.memory_management import MemoryObj

__all__ = ["TurboQuantDeserializer", "TurboQuantSerdeConfig", "TurboQuantSerializer"]

#: preset -> (key bits, value bits, renormalize key centroids); 8 key bits means fp8 keys.
TQ_PRESETS: dict[str, tuple[int, int, bool]] = {
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value; 0.5.6's GPU cast saturates there


@dataclass(frozen=True)
class TurboQuantSerdeConfig:
    """A ``turboquant`` serde's settings (0.5.6's fields; ``cuda_device`` is accepted for
    0.5.6 code that builds one and unused: the work runs where the objects are)."""

    preset: str = "turboquant_k8v4"
    head_dim: int = 128
    block_size: int = 16
    skip_first_layers: int = 2
    skip_last_layers: int = 2
    cuda_device: str = ""

    OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {"preset", "head_dim", "block_size", "skip_first_layers", "skip_last_layers"}
    )

    def __post_init__(self) -> None:
        if self.preset not in TQ_PRESETS:
            raise ValueError(
                f"turboquant serde: unknown preset {self.preset!r}; use one of "
                f"{', '.join(TQ_PRESETS)}"
            )
        d = self.head_dim
        if d < 8 or d & (d - 1):
            raise ValueError(
                f"turboquant serde: head_dim {d} must be a power of two >= 8 (the model's "
                "per-head size, e.g. 128)"
            )
        if self.block_size < 1:
            raise ValueError(f"turboquant serde: block_size {self.block_size} must be >= 1")
        if self.skip_first_layers < 0 or self.skip_last_layers < 0:
            raise ValueError(
                "turboquant serde: skip_first_layers and skip_last_layers must be >= 0, got "
                f"{self.skip_first_layers} and {self.skip_last_layers}"
            )

    @property
    def key_bits(self) -> int:
        """Bits per key element (8: fp8 keys, else codebook indices)."""
        return TQ_PRESETS[self.preset][0]

    @property
    def value_bits(self) -> int:
        """Bits per value element."""
        return TQ_PRESETS[self.preset][1]

    @property
    def norm_correction(self) -> bool:
        """Whether decoding renormalizes the key centroids to unit length."""
        return TQ_PRESETS[self.preset][2]

    @property
    def key_fp8(self) -> bool:
        """Whether keys are stored as fp8 bytes."""
        return self.key_bits == 8

    @property
    def key_index_bytes(self) -> int:
        """Bytes of the key's element data (fp8 bytes or packed codebook indices)."""
        return self.head_dim * self.key_bits // 8

    @property
    def key_packed_size(self) -> int:
        """Bytes of one head's key part (element data, then the fp16 norm for codebook keys)."""
        return self.key_index_bytes + (0 if self.key_fp8 else 2)  # + fp16 norm

    @property
    def value_data_bytes(self) -> int:
        """Bytes of one head's packed value indices."""
        return self.head_dim * self.value_bits // 8

    @property
    def value_packed_size(self) -> int:
        """Bytes of one head's value part (packed indices, fp16 scale, fp16 min)."""
        return self.value_data_bytes + 4  # + fp16 scale, fp16 min

    @property
    def slot_size(self) -> int:
        """Bytes of one token's one head, padded to even."""
        s = self.key_packed_size + self.value_packed_size
        return s + s % 2


@dataclass(frozen=True)
class _Geometry:
    """Where each part of one object group lives in the serialized bytes."""

    layers: int
    tokens: int
    heads: int
    first: int  # quantized layers are [first, end)
    end: int
    token_slots: int  # tokens rounded up to whole blocks
    slot_size: int
    raw_layer_bytes: int  # one raw layer: K and V

    @property
    def quant_layer_bytes(self) -> int:
        return self.token_slots * self.heads * self.slot_size

    @property
    def nbytes(self) -> int:
        raw_layers = self.layers - (self.end - self.first)
        return raw_layers * self.raw_layer_bytes + (self.end - self.first) * (
            self.quant_layer_bytes
        )


def _geometry(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, cfg: TurboQuantSerdeConfig
) -> _Geometry:
    if len(shape) != 4 or int(shape[0]) != 2:
        raise ValueError(
            f"turboquant serde: a KV object must be [2, layers, tokens, hidden], got "
            f"{tuple(shape)} (use another serde for this layout)"
        )
    layers, tokens, hidden = (int(s) for s in shape[1:])
    if hidden % cfg.head_dim:
        raise ValueError(
            f"turboquant serde: hidden size {hidden} is not a multiple of head_dim "
            f"{cfg.head_dim}; set head_dim to the model's per-head size"
        )
    first = min(cfg.skip_first_layers, layers)
    end = max(first, layers - cfg.skip_last_layers)
    blocks = -(-tokens // cfg.block_size)
    return _Geometry(
        layers=layers,
        tokens=tokens,
        heads=hidden // cfg.head_dim,
        first=first,
        end=end,
        token_slots=blocks * cfg.block_size,
        slot_size=cfg.slot_size,
        raw_layer_bytes=2 * tokens * hidden * dtype.itemsize,
    )


# -- the per-layer rotation and the key codebook (part of the format) ------------------------


def _rotation(head_dim: int, layer: int) -> torch.Tensor:
    """Layer ``layer``'s orthonormal rotation ``R`` (keys are stored as ``k @ R``): the
    normalized Sylvester Hadamard matrix with row ``i`` negated where a seeded coin says so
    (seed ``42 + 1337 * layer``, torch's CPU generator)."""
    gen = torch.Generator(device="cpu").manual_seed(42 + 1337 * layer)
    signs = torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (signs[:, None] * (h / math.sqrt(head_dim))).contiguous()


@functools.lru_cache(maxsize=64)
def _rotations(head_dim: int, first: int, count: int) -> torch.Tensor:
    """``[count, D, D]``: the rotations of layers ``first .. first + count - 1``."""
    return torch.stack([_rotation(head_dim, layer) for layer in range(first, first + count)])


@functools.lru_cache(maxsize=32)
def _codebook(head_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centroids, boundaries)`` of the ``2**bits``-level Lloyd-Max quantizer of
    N(0, 1/head_dim), as float32. The values define the format, so they are computed
    exactly as 0.5.6 does in double precision: levels start evenly spread over +-3.5 sigma,
    each round moves every centroid to the mean of its cell (cells between midpoints, the
    outer ones ending at +-10.5 sigma; each integral a 200-piece trapezoid rule), for at most
    200 rounds or until no centroid moves by 1e-10."""
    var = 1.0 / head_dim
    coef = 1.0 / math.sqrt(2 * math.pi * var)

    def density(x: float) -> float:
        return coef * math.exp(-x * x / (2 * var))

    def first_moment(x: float) -> float:
        return x * density(x)

    def trapezoid(f: Callable[[float], float], a: float, b: float, pieces: int = 200) -> float:
        step = (b - a) / pieces
        acc = 0.5 * (f(a) + f(b))
        for i in range(1, pieces):
            acc += f(a + i * step)
        return acc * step

    levels = 2**bits
    lo = -3.5 * math.sqrt(var)
    hi = -lo
    centroids = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]

    def midpoints(c: list[float]) -> list[float]:
        return [(c[i] + c[i + 1]) / 2.0 for i in range(levels - 1)]

    for _ in range(200):
        edges = [3 * lo, *midpoints(centroids), 3 * hi]
        moved = []
        for i, old in enumerate(centroids):
            mass = trapezoid(density, edges[i], edges[i + 1])
            mean = trapezoid(first_moment, edges[i], edges[i + 1]) / mass if mass > 1e-15 else old
            moved.append(mean)
        if max(abs(m - o) for m, o in zip(moved, centroids, strict=True)) < 1e-10:
            break
        centroids = moved
    return (
        torch.tensor(centroids, dtype=torch.float32),
        torch.tensor(midpoints(centroids), dtype=torch.float32),
    )


# -- bit packing: eight b-bit indices in b bytes, little-endian ------------------------------


def _pack(indices: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` integer indices below ``2**bits`` -> ``[..., n * bits / 8]`` uint8."""
    if bits == 4:  # the same bytes, by nibbles: the low one first
        q = indices.to(torch.uint8)
        return q[..., 0::2] | (q[..., 1::2] << 4)
    groups = indices.to(torch.int32).reshape(*indices.shape[:-1], -1, 8)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int32, device=indices.device)
    word = (groups << shifts).sum(-1, dtype=torch.int32)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int32, device=indices.device)
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.to(torch.uint8).reshape(*indices.shape[:-1], -1)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    """``_pack``'s inverse: ``[..., m]`` uint8 -> ``[..., m * 8 / bits]`` integer indices."""
    if bits == 4:
        return torch.stack([data & 0xF, data >> 4], -1).reshape(*data.shape[:-1], -1)
    groups = data.to(torch.int32).reshape(*data.shape[:-1], -1, bits)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int32, device=data.device)
    word = (groups << byte_shifts).sum(-1, dtype=torch.int32)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int32, device=data.device)
    out = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return out.reshape(*data.shape[:-1], -1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 ``[...]`` -> its fp16 bytes ``[..., 2]`` (little-endian hosts, as 0.5.6)."""
    return x.to(torch.float16).contiguous().unsqueeze(-1).view(torch.uint8)


def _fp16_from(data: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` fp16 bytes -> float32 ``[...]``."""
    return data.contiguous().view(torch.float16).squeeze(-1).float()


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements in row-major order as flat bytes."""
    return t.contiguous().reshape(-1).view(torch.uint8)


# -- the quantized layers, all at once: [layers, tokens * heads, head_dim] -------------------


def _quantize_values(v: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` float32 (overwritten) -> ``[..., value_packed_size]`` bytes."""
    top = float((1 << bits) - 1)
    vmin = v.amin(-1, keepdim=True)
    scale = (v.amax(-1, keepdim=True) - vmin) / top
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    q = v.sub_(vmin).div_(scale).add_(0.5).to(torch.int32).clamp_(0, int(top))
    return torch.cat([_pack(q, bits), _fp16_bytes(scale[..., 0]), _fp16_bytes(vmin[..., 0])], -1)


def _dequantize_values(data: torch.Tensor, cfg: TurboQuantSerdeConfig) -> torch.Tensor:
    """``_quantize_values``'s bytes -> fp16 ``[..., D]``."""
    n = cfg.value_data_bytes
    q = _unpack(data[..., :n], cfg.value_bits).float()
    scale = _fp16_from(data[..., n : n + 2]).unsqueeze(-1)
    vmin = _fp16_from(data[..., n + 2 : n + 4]).unsqueeze(-1)
    return (q * scale + vmin).to(torch.float16)


def _quantize_keys(k: torch.Tensor, cfg: TurboQuantSerdeConfig, first: int) -> torch.Tensor:
    """Keys ``[layers, N, D]`` (layer ``first`` onwards) in the object's dtype ->
    ``[layers, N, key_packed_size]`` bytes."""
    if cfg.key_fp8:
        fp8 = k.float().clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        return fp8.view(torch.uint8)
    kf = k.float()
    norms = kf.norm(dim=-1, keepdim=True)
    rotations = _rotations(cfg.head_dim, first, k.shape[0]).to(k.device)
    rotated = torch.matmul(kf / (norms + 1e-8), rotations)
    bounds = _codebook(cfg.head_dim, cfg.key_bits)[1].to(k.device)
    # the cell: how many bounds are at or below (none for NaN, as 0.5.6's comparisons)
    indices = torch.bucketize(rotated, bounds, right=True).masked_fill_(rotated.isnan(), 0)
    return torch.cat([_pack(indices, cfg.key_bits), _fp16_bytes(norms[..., 0])], -1)


def _dequantize_keys(data: torch.Tensor, cfg: TurboQuantSerdeConfig, first: int) -> torch.Tensor:
    """``_quantize_keys``'s bytes ``[layers, N, ...]`` -> fp16 ``[layers, N, D]``."""
    d = cfg.head_dim
    if cfg.key_fp8:
        table = fp8_decode_table(torch.float8_e4m3fn, torch.float16).to(data.device)
        return table[data[..., :d].to(torch.int32)]
    n = cfg.key_index_bytes
    centroids = _codebook(d, cfg.key_bits)[0].to(data.device)
    unit = centroids[_unpack(data[..., :n], cfg.key_bits).int()]
    if cfg.norm_correction:
        unit = unit * (1.0 / torch.sqrt(_pairwise_sum(unit * unit) + 1e-16))
    k16 = (_fp16_from(data[..., n : n + 2]).unsqueeze(-1) * unit).to(torch.float16)
    back = _rotations(d, first, data.shape[0]).to(data.device).transpose(1, 2).contiguous()
    return torch.matmul(k16.float(), back).to(torch.float16)


def _pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two >= 8) in a fixed order, so a decode is
    reproducible: eight running sums over strides of 8, combined as a tree; halves first
    above 128 elements (numpy's float32 order, which 0.5.6's kernel has under Triton's
    interpreter; on a GPU 0.5.6's reduction order differs in the last bit)."""
    n = x.shape[-1]
    if n > 128:
        half = n // 2
        return _pairwise_sum(x[..., :half]) + _pairwise_sum(x[..., half:])
    lanes = x.reshape(*x.shape[:-1], n // 8, 8)
    acc = lanes[..., 0, :]
    for i in range(1, n // 8):
        acc = acc + lanes[..., i, :]
    return ((acc[..., 0:1] + acc[..., 1:2]) + (acc[..., 2:3] + acc[..., 3:4])) + (
        (acc[..., 4:5] + acc[..., 5:6]) + (acc[..., 6:7] + acc[..., 7:8])
    )


# -- serializer / deserializer ---------------------------------------------------------------


def _group_nbytes(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, cfg: TurboQuantSerdeConfig
) -> int:
    return _geometry(torch.Size(shape), dtype, cfg).nbytes


class TurboQuantSerializer(Serializer):
    """KV object -> 0.5.6's turboquant bytes."""

    def __init__(self, cfg: TurboQuantSerdeConfig) -> None:
        self._cfg = cfg

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        out = byte_tensor(dst, "turboquant")
        off = 0
        for t in group_tensors(src):
            g = _geometry(t.shape, t.dtype, self._cfg)
            if out.numel() < off + g.nbytes:
                raise ValueError(
                    f"turboquant serde: {out.numel()}-byte buffer, needs {off + g.nbytes}"
                )
            for part in self._parts(t, g):
                out[off : off + part.numel()].copy_(part)
                off += part.numel()
        return off

    def _parts(self, t: torch.Tensor, g: _Geometry) -> Iterator[torch.Tensor]:
        cfg = self._cfg
        if g.first:
            yield _raw_bytes(t[:, : g.first])
        if g.end > g.first:
            n, count, kps = g.tokens * g.heads, g.end - g.first, cfg.key_packed_size
            keys = t[0, g.first : g.end].reshape(count, n, cfg.head_dim)
            values = (
                t[1, g.first : g.end].reshape(count, n, cfg.head_dim).to(torch.float32, copy=True)
            )
            slots = torch.zeros(
                count, g.token_slots * g.heads, cfg.slot_size, dtype=torch.uint8, device=t.device
            )
            slots[:, :n, :kps] = _quantize_keys(keys, cfg, g.first)
            slots[:, :n, kps : kps + cfg.value_packed_size] = _quantize_values(
                values, cfg.value_bits
            )
            yield slots.reshape(-1)
        if g.end < g.layers:
            yield _raw_bytes(t[:, g.end :])

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return sum(
            _group_nbytes(s, d, self._cfg)
            for s, d in zip(layout_desc.shapes, layout_desc.dtypes, strict=True)
        )


class TurboQuantDeserializer(Deserializer):
    """0.5.6's turboquant bytes -> KV object (0.5.6's decode)."""

    def __init__(self, cfg: TurboQuantSerdeConfig) -> None:
        self._cfg = cfg

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        data = byte_tensor(src, "turboquant")
        groups = group_tensors(dst)
        geos = [_geometry(t.shape, t.dtype, self._cfg) for t in groups]
        need = sum(g.nbytes for g in geos)
        if data.numel() < need:
            raise SerdeRejectedError(f"turboquant: {data.numel()} bytes, the object needs {need}")
        off = 0
        for t, g in zip(groups, geos, strict=True):
            self._decode(data[off : off + g.nbytes].to(t.device), t, g)
            off += g.nbytes

    def _decode(self, data: torch.Tensor, t: torch.Tensor, g: _Geometry) -> None:
        cfg = self._cfg
        off = 0

        def raw(first: int, end: int) -> None:
            nonlocal off
            part = t[:, first:end]
            n = part.numel() * t.element_size()
            part.copy_(data[off : off + n].clone().view(t.dtype).view(part.shape))
            off += n

        if g.first:
            raw(0, g.first)
        if g.end > g.first:
            n, count, kps = g.tokens * g.heads, g.end - g.first, cfg.key_packed_size
            nbytes = count * g.quant_layer_bytes
            slots = data[off : off + nbytes].view(count, -1, cfg.slot_size)[:, :n]
            shape = (count, g.tokens, g.heads * cfg.head_dim)
            t[0, g.first : g.end].copy_(
                _dequantize_keys(slots[..., :kps], cfg, g.first).view(shape)
            )
            values = _dequantize_values(slots[..., kps : kps + cfg.value_packed_size], cfg)
            t[1, g.first : g.end].copy_(values.view(shape))
            off += nbytes
        if g.end < g.layers:
            raw(g.end, g.layers)


def _create_turboquant_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    check_options("turboquant", kwargs, set(TurboQuantSerdeConfig.OPTIONS) | {"max_workers"})
    d = TurboQuantSerdeConfig()  # the defaults
    cfg = TurboQuantSerdeConfig(
        preset=str(kwargs.get("preset", d.preset)),
        head_dim=int_option(kwargs, "head_dim", d.head_dim),
        block_size=int_option(kwargs, "block_size", d.block_size),
        skip_first_layers=int_option(kwargs, "skip_first_layers", d.skip_first_layers),
        skip_last_layers=int_option(kwargs, "skip_last_layers", d.skip_last_layers),
    )
    return AsyncSerdeProcessor(
        TurboQuantSerializer(cfg),
        TurboQuantDeserializer(cfg),
        int_option(kwargs, "max_workers", 1),
    )


register_serde_factory("turboquant", _create_turboquant_serde)
