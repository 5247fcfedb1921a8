"""The serdes of lmcache.v1.distributed.serde on their own (docs/storage-backends.md#serdes):
round trips, stored sizes, rejection of damaged or foreign input, key handling, the factory,
and AsyncSerdeProcessor's threads and results."""

from __future__ import annotations

import logging
import select
import threading

import pytest
import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    SerdeConfig,
    SerdeRejectedError,
    Serializer,
    create_serde_processor,
    get_registered_serde_types,
)
from lmcache.v1.distributed.serde.aesgcm import AesGcmDeserializer, AesGcmSerializer
from lmcache.v1.distributed.serde.checksum import ChecksumDeserializer, ChecksumSerializer
from lmcache.v1.distributed.serde.fp8 import (
    Fp8QuantizationDeserializer,
    Fp8QuantizationSerializer,
)
from lmcache.v1.distributed.serde.identity import IdentityDeserializer, IdentitySerializer
from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider, read_master_key
from lmcache.v1.memory_management import (
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
)

SHAPE = torch.Size([2, 4, 8, 16])
LAYOUT = MemoryLayoutDesc([SHAPE], [torch.bfloat16])
NBYTES = SHAPE.numel() * 2
KEY = ObjectKey(b"\x01" * 16, "model", 0, cache_salt="tenant-a")
MASTER = b"master key bytes for the tests!!"


def kv(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> TensorMemoryObj:
    t = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)
    meta = MemoryObjMetadata(
        shape=SHAPE, dtype=dtype, address=0, phy_size=t.numel() * t.element_size(), ref_count=1
    )
    meta.fmt = MemoryFormat.KV_2LTD
    return TensorMemoryObj(t.reshape(-1).view(torch.uint8), meta)


def empty_kv(dtype: torch.dtype = torch.bfloat16) -> TensorMemoryObj:
    obj = kv(0, dtype)
    obj.tensor.zero_()
    return obj


def buffer(n: int) -> BytesBufferMemoryObj:
    return BytesBufferMemoryObj(bytearray(n))


def round_trip(ser: Serializer, de: Deserializer, src, key=KEY):
    buf = buffer(ser.estimate_serialized_size(LAYOUT))
    n = ser.serialize(src, buf, key)
    stored = bytes(buf.byte_array[:n])
    out = empty_kv(src.tensor.dtype)
    de.deserialize(BytesBufferMemoryObj(stored), out, key)
    return stored, out


def aes(bits: int = 128):
    p = HkdfKeyProvider(MASTER, bits // 8, b"lmcache-l2-aesgcm-v1")
    return AesGcmSerializer(p), AesGcmDeserializer(p)


# --- round trips and sizes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "pair", "overhead"),
    [
        ("identity", (IdentitySerializer(), IdentityDeserializer()), 0),
        ("checksum", (ChecksumSerializer(), ChecksumDeserializer()), 32),
        ("aesgcm-128", aes(128), 29),
        ("aesgcm-256", aes(256), 29),
    ],
)
def test_lossless_serdes_round_trip_exactly_with_exact_sizes(name, pair, overhead):
    ser, de = pair
    src = kv(1)
    stored, out = round_trip(ser, de, src)
    assert len(stored) == NBYTES + overhead == ser.estimate_serialized_size(LAYOUT)
    assert torch.equal(out.tensor, src.tensor)
    if name.startswith("aesgcm"):
        assert bytes(src.byte_array)[:32] not in stored  # sealed, not copied
        assert stored != round_trip(ser, de, src)[0]  # a fresh IV each time


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_stores_one_byte_per_element_and_decodes_to_the_cast(fp8):
    dtype = getattr(torch, fp8)
    ser, de = Fp8QuantizationSerializer(dtype), Fp8QuantizationDeserializer(dtype)
    src = kv(2)
    stored, out = round_trip(ser, de, src)
    assert len(stored) == SHAPE.numel() == ser.estimate_serialized_size(LAYOUT)
    assert stored == src.tensor.to(dtype).view(torch.uint8).numpy().tobytes()
    assert torch.equal(out.tensor, src.tensor.to(dtype).to(torch.bfloat16))
    assert not torch.equal(out.tensor, src.tensor)  # lossy


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_decode_of_every_byte_is_the_cast_bit_for_bit(fp8, dtype):
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=dtype)
    meta = MemoryObjMetadata(
        shape=out.shape, dtype=dtype, address=0, phy_size=256 * out.element_size(), ref_count=1
    )
    Fp8QuantizationDeserializer(fp8).deserialize(
        BytesBufferMemoryObj(every.numpy().tobytes()),
        TensorMemoryObj(out.view(torch.uint8), meta),
        KEY,
    )
    want = every.view(fp8).to(dtype)  # NaN patterns included: compare the bits
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_fp8_keeps_the_destination_dtype():
    ser, de = Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()
    src = kv(3, torch.float32)
    buf = buffer(ser.estimate_serialized_size(MemoryLayoutDesc([SHAPE], [torch.float32])))
    ser.serialize(src, buf, KEY)
    out = empty_kv(torch.float32)
    de.deserialize(buf, out, KEY)
    assert out.tensor.dtype == torch.float32
    assert torch.equal(out.tensor, src.tensor.to(torch.float8_e4m3fn).to(torch.float32))


def test_a_longer_source_buffer_is_fine():  # a load's temporary may be padded
    ser, de = ChecksumSerializer(), ChecksumDeserializer()
    src = kv(4)
    stored, _ = round_trip(ser, de, src)
    out = empty_kv()
    de.deserialize(BytesBufferMemoryObj(stored + b"\0" * 4096), out, KEY)
    assert torch.equal(out.tensor, src.tensor)


# --- rejection: damaged, truncated, foreign, wrong key --------------------------------------


@pytest.mark.parametrize("pair", ["checksum", "aesgcm"])
@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "empty", "zeros"])
def test_damaged_input_is_rejected_never_decoded(pair, damage):
    ser, de = (ChecksumSerializer(), ChecksumDeserializer()) if pair == "checksum" else aes()
    stored, _ = round_trip(ser, de, kv(5))
    blob = bytearray(stored)
    if damage == "flip-payload":
        blob[len(blob) // 2] ^= 0x01
    elif damage == "flip-header":
        blob[0] ^= 0x01
    elif damage == "truncate":
        blob = blob[:-1]
    elif damage == "empty":
        blob = bytearray()
    else:
        blob = bytearray(len(blob))
    out = empty_kv()
    with pytest.raises(SerdeRejectedError):
        de.deserialize(BytesBufferMemoryObj(bytes(blob)), out, KEY)
    assert int(out.tensor.float().abs().sum()) == 0  # nothing written


@pytest.mark.parametrize(
    "pair",
    [
        (IdentitySerializer(), IdentityDeserializer()),
        (Fp8QuantizationSerializer(), Fp8QuantizationDeserializer()),
    ],
)
def test_a_short_object_is_rejected_by_the_unchecked_serdes_too(pair):
    ser, de = pair
    stored, _ = round_trip(ser, de, kv(11))
    with pytest.raises(SerdeRejectedError):
        de.deserialize(BytesBufferMemoryObj(stored[:-1]), empty_kv(), KEY)


def test_checksum_binds_the_key():
    ser, de = ChecksumSerializer(), ChecksumDeserializer()
    stored, _ = round_trip(ser, de, kv(6))
    for other in (
        ObjectKey(b"\x02" * 16, "model", 0, cache_salt="tenant-a"),
        ObjectKey(b"\x01" * 16, "model", 1, cache_salt="tenant-a"),
        ObjectKey(b"\x01" * 16, "model", 0, cache_salt="tenant-b"),
    ):
        with pytest.raises(SerdeRejectedError, match="digest mismatch"):
            de.deserialize(BytesBufferMemoryObj(stored), empty_kv(), other)


def test_aesgcm_wrong_master_key_or_tenant_is_rejected():
    ser, _ = aes()
    stored, _ = round_trip(ser, aes()[1], kv(7))
    other = AesGcmDeserializer(HkdfKeyProvider(b"another key", 16, b"lmcache-l2-aesgcm-v1"))
    with pytest.raises(SerdeRejectedError, match="authentication failed"):
        other.deserialize(BytesBufferMemoryObj(stored), empty_kv(), KEY)
    tenant_b = ObjectKey(KEY.chunk_hash, "model", 0, cache_salt="tenant-b")
    with pytest.raises(SerdeRejectedError):
        aes()[1].deserialize(BytesBufferMemoryObj(stored), empty_kv(), tenant_b)


def test_hkdf_keys_differ_per_tenant_and_length():
    p16 = HkdfKeyProvider(MASTER, 16, b"x")
    p32 = HkdfKeyProvider(MASTER, 32, b"x")
    assert len(p16.get_key("a")) == 16 and len(p32.get_key("a")) == 32
    assert p16.get_key("a") != p16.get_key("b") and p16.get_key("a") == p16.get_key("a")
    with pytest.raises(ValueError, match="key_len must be 16"):
        HkdfKeyProvider(MASTER, 24, b"x")
    with pytest.raises(ValueError, match="non-empty"):
        HkdfKeyProvider(b"", 16, b"x")


# --- key handling: file or environment, never shown -----------------------------------------


def test_master_key_from_file_or_env_and_errors_name_the_source(tmp_path, monkeypatch):
    path = tmp_path / "mk"
    path.write_bytes(MASTER)
    monkeypatch.setenv("MK_TEST", MASTER.decode())
    assert read_master_key(str(path)) == MASTER == read_master_key(master_key_env="MK_TEST")
    with pytest.raises(ValueError, match="exactly one of 'master_key_path'"):
        read_master_key(str(path), "MK_TEST")
    with pytest.raises(ValueError, match="exactly one of"):
        read_master_key()
    with pytest.raises(ValueError, match="cannot read master_key_path '/nonexistent/mk'"):
        read_master_key("/nonexistent/mk")
    monkeypatch.delenv("MK_TEST")
    with pytest.raises(ValueError, match="environment variable 'MK_TEST'"):
        read_master_key(master_key_env="MK_TEST")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        read_master_key(str(tmp_path / "empty"))


def test_the_key_never_appears_in_repr_logs_or_errors(tmp_path, monkeypatch, caplog):
    secret = "s3cr3t-master-key-value"
    monkeypatch.setenv("MK_SECRET", secret)
    caplog.set_level(logging.DEBUG)
    proc = create_serde_processor(SerdeConfig("aesgcm", {"master_key_env": "MK_SECRET"}))
    try:
        provider = proc.serializer._keys  # type: ignore[attr-defined]
        derived = provider.get_key("")
        texts = [repr(provider), repr(proc), str(vars(proc))]
        src, buf, out = kv(8), buffer(NBYTES + 29), empty_kv()
        sid = proc.submit_serialize([src], [buf], [KEY])
        _wait(proc.get_serialize_event_fd(), lambda: proc.query_serialize_result(sid))
        bad = BytesBufferMemoryObj(b"\x01" + b"\0" * (NBYTES + 28))
        did = proc.submit_deserialize([bad], [out], [KEY])
        assert (
            _wait(proc.get_deserialize_event_fd(), lambda: proc.query_deserialize_result(did))
            is False
        )
        monkeypatch.setenv("MK_EMPTY", "")
        with pytest.raises(ValueError) as ei:
            create_serde_processor(SerdeConfig("aesgcm", {"master_key_env": "MK_EMPTY"}))
        texts += [caplog.text, str(ei.value)]
    finally:
        proc.close()
    for text in texts:
        assert secret not in text
        assert derived.hex() not in text and repr(derived) not in text
    assert "<redacted>" in repr(provider)


# --- factory ----------------------------------------------------------------------------------


def test_factory_builds_each_builtin_and_names_them_on_a_typo(tmp_path):
    assert {"aesgcm", "checksum", "fp8", "identity"} <= set(get_registered_serde_types())
    (tmp_path / "mk").write_bytes(MASTER)
    for cfg in (
        SerdeConfig("identity"),
        SerdeConfig("checksum", {"max_workers": 2}),
        SerdeConfig("fp8", {"fp8_dtype": "float8_e5m2"}),
        SerdeConfig("aesgcm", {"master_key_path": str(tmp_path / "mk"), "aes_bits": 256}),
    ):
        proc = create_serde_processor(cfg)
        assert isinstance(proc, AsyncSerdeProcessor)
        proc.close()
    with pytest.raises(ValueError, match=r"Unknown serde type 'fp16'\. Registered: aesgcm, "):
        create_serde_processor(SerdeConfig("fp16"))
    with pytest.raises(ValueError, match="fp8_dtype 'bfloat16' is not a float8 dtype"):
        create_serde_processor(SerdeConfig("fp8", {"fp8_dtype": "bfloat16"}))
    with pytest.raises(ValueError, match="aes_bits must be 128 or 256, got 192"):
        create_serde_processor(
            SerdeConfig("aesgcm", {"master_key_path": str(tmp_path / "mk"), "aes_bits": 192})
        )
    with pytest.raises(ValueError, match="key_provider 'keyring' is not supported"):
        create_serde_processor(SerdeConfig("aesgcm", {"key_provider": "keyring"}))


def test_unknown_option_is_a_warning_naming_the_close_one(caplog):
    proc = create_serde_processor(SerdeConfig("fp8", {"fp8_dtyp": "float8_e4m3fn"}))
    proc.close()
    assert "unknown option 'fp8_dtyp' ignored; did you mean 'fp8_dtype'?" in caplog.text


# --- AsyncSerdeProcessor ----------------------------------------------------------------------


def _wait(fd: int, query):
    for _ in range(200):
        select.select([fd], [], [], 0.1)
        result = query()
        if result is not None:
            return result
    raise AssertionError("serde task did not finish")


def test_processor_runs_off_the_caller_thread_and_pops_results_once():
    seen = []

    class Recording(IdentitySerializer):
        def serialize(self, src, dst, key):
            seen.append(threading.current_thread().name)
            return super().serialize(src, dst, key)

    proc = AsyncSerdeProcessor(Recording(), IdentityDeserializer(), max_workers=2)
    try:
        assert proc.get_serialize_event_fd() != proc.get_deserialize_event_fd()
        srcs, bufs = [kv(i) for i in range(3)], [buffer(NBYTES + 100) for _ in range(3)]
        sid = proc.submit_serialize(srcs, bufs, [KEY] * 3)
        assert _wait(proc.get_serialize_event_fd(), lambda: proc.query_serialize_result(sid))
        assert proc.query_serialize_result(sid) is None  # popped
        assert all(b.get_size() == NBYTES for b in bufs)  # the used size is what was written
        assert seen and all(n.startswith("l2-serde") for n in seen)
        assert threading.current_thread().name not in seen
        outs = [empty_kv() for _ in range(3)]
        did = proc.submit_deserialize(bufs, outs, [KEY] * 3)
        assert _wait(proc.get_deserialize_event_fd(), lambda: proc.query_deserialize_result(did))
        assert all(torch.equal(o.tensor, s.tensor) for o, s in zip(outs, srcs, strict=True))
        with pytest.raises(ValueError, match="must pair up"):
            proc.submit_serialize(srcs, bufs[:2], [KEY] * 3)
    finally:
        proc.close()
    with pytest.raises(RuntimeError, match="closed"):
        proc.submit_serialize([], [], [])


def test_processor_counts_each_rejected_object_and_fails_the_task():
    ser, de = ChecksumSerializer(), ChecksumDeserializer()
    proc = AsyncSerdeProcessor(ser, de)
    try:
        good, _ = round_trip(ser, de, kv(9))
        bad = bytearray(good)
        bad[100] ^= 0xFF
        srcs = [BytesBufferMemoryObj(good), BytesBufferMemoryObj(bytes(bad))] * 2
        did = proc.submit_deserialize(srcs, [empty_kv() for _ in srcs], [KEY] * 4)
        assert (
            _wait(proc.get_deserialize_event_fd(), lambda: proc.query_deserialize_result(did))
            is False
        )
        assert proc.rejected_chunks == 2
        assert proc.pop_rejected_positions(did) == [1, 3]  # the others were decoded
        assert proc.pop_rejected_positions(did) is None
    finally:
        proc.close()


def test_a_failure_other_than_a_rejection_fails_the_whole_batch():
    class Broken(ChecksumDeserializer):
        def deserialize(self, src, dst, key):
            if bytes(src.byte_array[:4]) != b"LMCK":
                raise RuntimeError("not a rejection")
            super().deserialize(src, dst, key)

    ser = ChecksumSerializer()
    proc = AsyncSerdeProcessor(ser, Broken())
    try:
        good, _ = round_trip(ser, ChecksumDeserializer(), kv(10))
        bad = bytearray(good)
        bad[100] ^= 0xFF
        srcs = [BytesBufferMemoryObj(bytes(bad)), BytesBufferMemoryObj(b"junk" * 10)]
        did = proc.submit_deserialize(srcs, [empty_kv(), empty_kv()], [KEY] * 2)
        fd = proc.get_deserialize_event_fd()
        assert _wait(fd, lambda: proc.query_deserialize_result(did)) is False
        assert proc.pop_rejected_positions(did) is None  # no partial result
    finally:
        proc.close()
