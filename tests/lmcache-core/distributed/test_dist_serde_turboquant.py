"""The ``turboquant`` serde on its own (docs/storage-backends.md#turboquant): the stored
size and layout, round-trip error bounds per preset, raw skipped layers, decode of known
bytes, rejection of short input, bad options, and the processor from the factory. The
interchange with LMCache 0.5.6's own codec is tests/compat/test_turboquant_compat.py."""

from __future__ import annotations

import math
import select

import pytest
import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import (
    SerdeConfig,
    SerdeRejectedError,
    TurboQuantDeserializer,
    TurboQuantSerdeConfig,
    TurboQuantSerializer,
    create_serde_processor,
    get_registered_serde_types,
)
from lmcache.v1.memory_management import (
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

KEY = ObjectKey(b"\x02" * 16, "model", 0)
PRESETS = ["turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"]
# [2, layers, tokens, hidden]: 6 layers (2 raw at each end by default), 20 tokens (two
# blocks of 16, the second partly used), two heads of 64
SHAPE = torch.Size([2, 6, 20, 128])


def kv_obj(t: torch.Tensor) -> TensorMemoryObj:
    meta = MemoryObjMetadata(
        shape=t.shape,
        dtype=t.dtype,
        address=0,
        phy_size=t.numel() * t.element_size(),
        ref_count=1,
    )
    meta.fmt = MemoryFormat.KV_2LTD
    return TensorMemoryObj(t.contiguous().reshape(-1).view(torch.uint8), meta)


def source(dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def encode(cfg: TurboQuantSerdeConfig, t: torch.Tensor) -> bytes:
    ser = TurboQuantSerializer(cfg)
    size = ser.estimate_serialized_size(MemoryLayoutDesc([t.shape], [t.dtype]))
    buf = BytesBufferMemoryObj(bytearray(size))
    assert ser.serialize(kv_obj(t), buf, KEY) == size  # the estimate is exact
    return bytes(buf.byte_array)


def decode(cfg: TurboQuantSerdeConfig, data: bytes, like: torch.Tensor) -> torch.Tensor:
    out = kv_obj(torch.zeros_like(like))
    TurboQuantDeserializer(cfg).deserialize(BytesBufferMemoryObj(data), out, KEY)
    return out.tensor.view(like.shape).clone()


def cfg_of(preset: str, **kw) -> TurboQuantSerdeConfig:
    return TurboQuantSerdeConfig(preset=preset, head_dim=64, **kw)


@pytest.mark.parametrize(
    ("preset", "slot"),
    # key (fp8 bytes, or packed indices + fp16 norm) + value (packed + fp16 scale, min),
    # padded to even: 64 + (32 + 4); (32 + 2) + 36; (24 + 2) + 36; 26 + (24 + 4)
    [
        ("turboquant_k8v4", 100),
        ("turboquant_4bit_nc", 70),
        ("turboquant_k3v4_nc", 62),
        ("turboquant_3bit_nc", 54),
    ],
)
def test_size_is_raw_skipped_layers_plus_whole_blocks_of_slots(preset, slot):
    cfg = cfg_of(preset)
    assert cfg.slot_size == slot
    raw = 2 * 20 * 128 * 2  # one raw layer, K and V, bfloat16
    quant = 32 * 2 * slot  # 20 tokens -> 2 blocks of 16 token slots, 2 heads
    assert len(encode(cfg, source())) == 4 * raw + 2 * quant


def test_skipped_layers_are_stored_raw_and_come_back_exactly():
    t = source()
    data = encode(cfg_of("turboquant_4bit_nc"), t)
    raw = 2 * 2 * 20 * 128 * 2
    assert data[:raw] == t[:, :2].contiguous().view(torch.uint8).numpy().tobytes()
    assert data[-raw:] == t[:, 4:].contiguous().view(torch.uint8).numpy().tobytes()
    back = decode(cfg_of("turboquant_4bit_nc"), data, t)
    assert torch.equal(back[:, :2], t[:, :2]) and torch.equal(back[:, 4:], t[:, 4:])
    assert not torch.equal(back[:, 2:4], t[:, 2:4])  # really quantized


@pytest.mark.parametrize(
    ("preset", "key_err", "value_err"),
    # relative RMS error bounds (keys/values), measured 0.027/0.089, 0.095/0.089,
    # 0.181/0.089, 0.181/0.192 on Gaussian data, with margin
    [
        ("turboquant_k8v4", 0.05, 0.15),
        ("turboquant_4bit_nc", 0.15, 0.15),
        ("turboquant_k3v4_nc", 0.25, 0.15),
        ("turboquant_3bit_nc", 0.25, 0.3),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_error_is_bounded(preset, key_err, value_err, dtype):
    cfg = TurboQuantSerdeConfig(preset=preset, head_dim=64, skip_first_layers=0, skip_last_layers=0)
    t = source(dtype)
    back = decode(cfg, encode(cfg, t), t).float()
    assert torch.equal(t, source(dtype))  # the source is left alone
    for i, bound in ((0, key_err), (1, value_err)):
        err = (back[i] - t[i].float()).pow(2).mean().sqrt() / t[i].float().pow(2).mean().sqrt()
        assert err < bound, (i, err)
    # values: each element within half a quantization step (+ fp16 rounding) of the source
    v = t[1].float().view(6, 20, 2, 64)
    step = (v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True)) / (2**cfg.value_bits - 1)
    assert ((back[1].view(6, 20, 2, 64) - v).abs() <= step * 0.5 + 0.02 * v.abs() + 2e-3).all()


def test_fp8_keys_saturate_instead_of_becoming_nan():
    t = source()
    t[0, 2, 0, :8] = 1000.0
    t[0, 2, 0, 8:16] = -1000.0
    back = decode(cfg_of("turboquant_k8v4"), encode(cfg_of("turboquant_k8v4"), t), t)
    assert (back[0, 2, 0, :8] == 448).all() and (back[0, 2, 0, 8:16] == -448).all()


def test_decode_of_hand_made_bytes():
    """One quantized layer, one token, one head of 8, 4-bit keys and values: the format
    spelled out (codebook index 15 is the largest centroid, 0 the smallest)."""
    cfg = TurboQuantSerdeConfig(
        preset="turboquant_4bit_nc",
        head_dim=8,
        block_size=1,
        skip_first_layers=0,
        skip_last_layers=0,
    )
    norm = torch.tensor([2.0], dtype=torch.float16).view(torch.uint8).tolist()
    scale = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8).tolist()
    vmin = torch.tensor([-1.0], dtype=torch.float16).view(torch.uint8).tolist()
    key = [0xF0] * 4 + norm  # indices 0, 15, 0, 15, ... (low nibble first)
    value = [0x10, 0x32, 0x54, 0x76] + scale + vmin  # indices 0..7
    slot = bytes(key + value)
    assert len(slot) == cfg.slot_size == 14
    like = torch.zeros(2, 1, 1, 8, dtype=torch.float32)
    back = decode(cfg, slot, like)
    assert back[1, 0, 0].tolist() == [-1 + 0.5 * i for i in range(8)]
    # keys: +-c (c the outer centroid) renormalized to unit length, times the norm 2, is
    # +-2/sqrt(8) per element before the rotation; the rotation keeps the length
    k = back[0, 0, 0]
    assert math.isclose(k.norm().item(), 2.0, rel_tol=2e-3)


def test_a_short_buffer_is_rejected_not_decoded():
    cfg = cfg_of("turboquant_k8v4")
    data = encode(cfg, source())
    with pytest.raises(SerdeRejectedError):
        decode(cfg, data[:-1], source())


def test_layout_errors_name_the_fix():
    ser = TurboQuantSerializer(TurboQuantSerdeConfig(head_dim=128))
    with pytest.raises(ValueError, match="not a multiple of head_dim 128; set head_dim"):
        ser.estimate_serialized_size(
            MemoryLayoutDesc([torch.Size([2, 4, 16, 96])], [torch.bfloat16])
        )
    with pytest.raises(ValueError, match=r"\[2, layers, tokens, hidden\]"):
        ser.estimate_serialized_size(MemoryLayoutDesc([torch.Size([4, 16, 128])], [torch.bfloat16]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"preset": "turboquant_2bit"}, "unknown preset 'turboquant_2bit'; use one of"),
        ({"head_dim": 96}, "head_dim 96 must be a power of two"),
        ({"head_dim": "x"}, "'head_dim' must be an integer"),
        ({"block_size": 0}, "block_size 0 must be >= 1"),
        ({"skip_first_layers": -1}, "must be >= 0"),
    ],
)
def test_bad_options_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        create_serde_processor(SerdeConfig(type="turboquant", kwargs=kwargs))


def test_registered_with_0_5_6_keys_and_an_unknown_key_only_warns(caplog):
    assert "turboquant" in get_registered_serde_types()
    kwargs = {
        "preset": "turboquant_3bit_nc",
        "head_dim": 64,
        "block_size": 8,
        "skip_first_layers": 1,
        "skip_last_layers": 0,
        "max_workers": 2,
        "head_dimm": 64,
    }
    proc = create_serde_processor(SerdeConfig(type="turboquant", kwargs=kwargs))
    try:
        assert "did you mean 'head_dim'" in caplog.text
        t = source()
        layout = MemoryLayoutDesc([t.shape], [t.dtype])
        cfg = TurboQuantSerdeConfig(
            preset="turboquant_3bit_nc",
            head_dim=64,
            block_size=8,
            skip_first_layers=1,
            skip_last_layers=0,
        )
        size = TurboQuantSerializer(cfg).estimate_serialized_size(layout)
        assert proc.estimate_serialized_size(layout) == size
        buf = BytesBufferMemoryObj(bytearray(size))
        tid = proc.submit_serialize([kv_obj(t)], [buf], [KEY])
        select.select([proc.get_serialize_event_fd()], [], [], 30)
        result = None
        for _ in range(3000):
            result = proc.query_serialize_result(tid)
            if result is not None:
                break
            select.select([proc.get_serialize_event_fd()], [], [], 0.01)
        assert result is True
        assert bytes(buf.byte_array) == encode(cfg, t)
    finally:
        proc.close()


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="needs a CUDA GPU (the codec on device tensors); a skip is not a "
                "device check",
            ),
        ],
    ),
]


class DeviceObj:
    """A bare object around a device tensor: the codec reads ``.tensor`` and the shapes."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_shapes(self) -> list[torch.Size]:
        return [self.tensor.shape]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_on_the_objects_device_the_codec_matches_the_cpu_path(preset, device):
    """Plain torch ops run where the tensors are: the same format. On a GPU, fp8 keys and
    values match the CPU bit for bit; codebook keys go through a matmul whose device rounding
    may move an element across a cell boundary or the last fp16 bit."""
    cfg = cfg_of(preset)
    t = source()
    on_cpu = torch.frombuffer(bytearray(encode(cfg, t)), dtype=torch.uint8)
    ser = TurboQuantSerializer(cfg)
    buf = torch.zeros(on_cpu.numel(), dtype=torch.uint8, device=device)
    assert ser.serialize(DeviceObj(t.to(device)), DeviceObj(buf), KEY) == on_cpu.numel()
    back = torch.zeros(t.shape, dtype=t.dtype, device=device)
    TurboQuantDeserializer(cfg).deserialize(DeviceObj(on_cpu.to(device)), DeviceObj(back), KEY)
    cpu_back = decode(cfg, on_cpu.numpy().tobytes(), t)
    assert back.device.type == buf.device.type == device
    if device == "cpu" or preset == "turboquant_k8v4":
        assert torch.equal(buf.cpu(), on_cpu)
        assert torch.equal(back.cpu(), cpu_back)
    else:
        assert (buf.cpu() != on_cpu).float().mean() < 0.01
        torch.testing.assert_close(back.cpu().float(), cpu_back.float(), atol=2e-2, rtol=1e-2)
