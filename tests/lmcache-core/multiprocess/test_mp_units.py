"""Unit checks of the MP protocol pieces: hashing, kv_rank, fan-out, payload codec
(docs/design/protocol.md#operations, docs/design/protocol.md#payload-encodings)."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import msgspec
import pytest
import torch

from lmcache.v1.multiprocess import payload_codec as codec
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.engine import fan_out_keys
from lmcache.v1.multiprocess.token_hasher import NONE_HASH, chunk_hashes, compute_kv_rank


def test_blake3_vectors_and_partial_chunk():
    assert NONE_HASH.hex() == "7e3eff9ef7613a50340eb12677ee03b83ac759fcba9bb32705f07248d56d473b"
    h = chunk_hashes(list(range(1, 513)), 256)
    assert [x.hex() for x in h] == [
        "3c8582932142a7d831a2a6150bbd9cc64dc3a55070cae822a3d527ff5b8dbe6e",
        "0b709854b9759133e1c54f017a552f33944b3316376c97e3d9798eba1ce64c81",
    ]
    assert len(chunk_hashes(list(range(300)), 256)) == 1
    # cached prefix reuse gives the same chain
    assert chunk_hashes(list(range(1, 513)), 256, prefix=h[:1]) == h


def test_token_out_of_range_rejected():
    with pytest.raises(ValueError, match="2\\^32"):
        chunk_hashes([1, 2**32], 1)


@pytest.mark.parametrize(
    "ws,rank,expected",
    [(1, 0, 0x01000100), (2, 1, 0x02010201), (4, 2, 0x04020402), (8, 7, 0x08070807)],
)
def test_kv_rank(ws, rank, expected):
    assert compute_kv_rank(ws, rank) == expected


def _key(**kw):
    base = dict(
        model_name="m",
        world_size=4,
        worker_id=None,
        token_ids=list(range(1, 513)),
        start=0,
        end=512,
        request_id="r",
        num_kv_readers=1,
    )
    base.update(kw)
    return P.IPCCacheServerKey(**base)


def test_world_size_256_rejected():
    with pytest.raises(ValueError):
        compute_kv_rank(256, 0)
    with pytest.raises(P.RequestError, match="world_size"):
        P.validate_key(_key(world_size=256), chunk_aligned=False, chunk_size=256)


def test_fan_out():
    hashes = chunk_hashes(list(range(1, 513)), 256)
    rows = fan_out_keys(_key(worker_id=None), hashes, 0, 2)
    assert sum(len(r) for r in rows) == 8
    assert {k.kv_rank for r in rows for k in r} == {compute_kv_rank(4, r) for r in range(4)}
    own = fan_out_keys(_key(worker_id=2), hashes, 0, 2)
    assert len(own) == 1 and {k.kv_rank for k in own[0]} == {compute_kv_rank(4, 2)}


def test_fan_out_reuses_key_objects_and_rows_stay_correct(monkeypatch):
    from lmcache.v1.multiprocess import engine

    hashes = chunk_hashes(list(range(1, 1025)), 256)
    first = fan_out_keys(_key(worker_id=1), hashes, 0, 4)
    again = fan_out_keys(_key(worker_id=1), hashes, 0, 4)
    assert again == first and all(a is b for a, b in zip(again[0], first[0], strict=True))
    again[0].clear()  # callers own their rows
    assert fan_out_keys(_key(worker_id=1), hashes, 0, 4) == first
    assert [k.chunk_hash for k in fan_out_keys(_key(worker_id=1), hashes, 1, 3)[0]] == hashes[1:3]
    salted = fan_out_keys(_key(worker_id=1, cache_salt="s"), hashes, 0, 4)[0]
    assert [k.cache_salt for k in salted] == ["s"] * 4 and salted != first[0]
    # past its bound the cache starts over; rows built after that are still right
    monkeypatch.setattr(engine.object_key_cache, "MAX_KEYS", 2)
    for end in (1, 2, 3, 4):
        row = fan_out_keys(_key(worker_id=2), hashes, 0, end)[0]
        assert [k.chunk_hash for k in row] == hashes[:end]
        assert {k.kv_rank for k in row} == {compute_kv_rank(4, 2)}
    assert fan_out_keys(_key(worker_id=1), hashes, 0, 4) == first


def test_key_validation_messages():
    with pytest.raises(P.RequestError, match="aligned"):
        P.validate_key(
            _key(end=300, token_ids=list(range(300))), chunk_aligned=True, chunk_size=256
        )
    with pytest.raises(P.RequestError, match="outside"):
        P.validate_key(_key(end=600), chunk_aligned=False, chunk_size=256)
    with pytest.raises(P.RequestError, match="cache_salt"):
        P.validate_key(_key(cache_salt="a/b"), chunk_aligned=False, chunk_size=256)


def test_struct_decoding_rules():
    # unknown fields ignored, defaults filled, ints accepted as bools
    raw = msgspec.msgpack.encode(
        {
            "instance_id": 1,
            "model_name": "m",
            "world_size": 1,
            "block_size": 16,
            "num_layers": 2,
            "hidden_dim_size": 8,
            "dtype_str": "float16",
            "use_mla": 1,
            "future_field": "x",
        }
    )
    payload = P.convert_param(P.Param("p", P.RegisterEngineDrivenContextPayload), P.decode(raw))
    assert payload.use_mla is True and payload.num_physical_slots is None
    assert (
        P.lookup_op(21).name == "get_chunk_size" and P.lookup_op("get_chunk_size").legacy_id == 21
    )
    assert P.lookup_op(11) is None and P.lookup_op(999) is None


def test_remote_error_ext_roundtrip():
    err = P.decode(P.encode(P.RemoteError("UNKNOWN_OP", "nope", False)))
    assert isinstance(err, P.RemoteError) and err.code == "UNKNOWN_OP" and err.message == "nope"


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8])
def test_restricted_unpickler_accepts_tensor_lists(protocol, dtype):
    chunks = [(torch.arange(24) % 7).to(dtype).reshape(2, 3, 4) for _ in range(2)]
    out = codec.restricted_unpickle_tensors(
        pickle.dumps(chunks, protocol=protocol),
        expected_count=2,
        expected_shape=(2, 3, 4),
        expected_dtype=dtype,
    )
    assert all(torch.equal(a, b) for a, b in zip(out, chunks, strict=True))


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_restricted_unpickler_rejects_globals_without_running_them(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(codec.PayloadError) as exc:
        codec.restricted_unpickle_tensors(pickle.dumps([_Evil(str(marker))]))
    assert exc.value.reason == "pickle_global" and "system" in str(exc.value)
    assert not marker.exists()
    with pytest.raises(codec.PayloadError, match="_codecs.encode"):
        codec.restricted_unpickle_tensors(pickle.dumps([torch.zeros(2)], protocol=2))


def test_restricted_unpickler_rejects_wrong_count_shape_dtype_size():
    data = pickle.dumps([torch.zeros(2, 3, dtype=torch.float16)])
    for kw, reason in (
        ({"expected_count": 2}, "pickle_count"),
        ({"expected_shape": (3, 2)}, "pickle_shape"),
        ({"expected_dtype": torch.bfloat16}, "pickle_dtype"),
        ({"max_bytes": 10}, "oversized"),
    ):
        with pytest.raises(codec.PayloadError) as exc:
            codec.restricted_unpickle_tensors(data, **kw)
        assert exc.value.reason == reason
    with pytest.raises(codec.PayloadError):
        codec.restricted_unpickle_tensors(pickle.dumps([torch.zeros(2, requires_grad=True)]))


def test_raw_v1_roundtrip_and_length_checks():
    t = torch.arange(10, dtype=torch.float16)
    data = codec.encode_raw_v1([t, None, b"xyz"])
    assert data[:8] == b"LMCRAW01" and codec.detect_encoding(data) == "raw_v1"
    parts = codec.decode_raw_v1(data, 3)
    assert (
        bytes(parts[0]) == t.numpy().tobytes() and len(parts[1]) == 0 and bytes(parts[2]) == b"xyz"
    )
    with pytest.raises(codec.PayloadError):
        codec.decode_raw_v1(data, 2)
    with pytest.raises(codec.PayloadError):
        codec.decode_raw_v1(data[:-1], 3)
    with pytest.raises(codec.PayloadError):
        codec.detect_encoding(b"GARBAGE!")


def test_no_module_unpickles_peer_bytes():
    import lmcache.v1.multiprocess as mp

    root = Path(mp.__file__).parent
    bad = re.compile(r"pickle\.loads?\(|weights_only\s*=\s*False|Unpickler\(\s*[^)]*\)\.load\(")
    offenders = []
    for path in root.rglob("*.py"):
        text = path.read_text()
        for line in text.splitlines():
            if bad.search(line) and "_RestrictedUnpickler" not in line:
                offenders.append(f"{path.name}: {line.strip()}")
    assert offenders == []


def test_counters_carry_0_5_6_labels_reach_every_reader_and_reset_drops_them():
    from lmcache.v1.multiprocess.metrics import ServerMetrics

    m = ServerMetrics("unit")
    who = {"cache_salt": "", "model_name": "m"}
    for _ in range(3):
        m.inc("lmcache_mp_lookups_requests", **who)
    m.inc("lmcache_mp_lookup_hit_tokens", 512, **who)
    m.inc("lmcache_mp_request_errors", op="lookup", code="BAD_REQUEST")
    # cache_salt on the L1 chunk counters: only for salted keys, as in 0.5.6
    m.inc("lmcache_mp_l1_write_chunks", 2, l1_tag="_default", cache_salt="")
    m.inc("lmcache_mp_l1_write_chunks", 1, l1_tag="_default", cache_salt="tenant-a")
    text = m.render().decode()
    assert 'lmcache_mp_lookups_requests_total{cache_salt="",model_name="m"} 3.0' in text
    assert 'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="m"} 512.0' in text
    assert 'lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 2.0' in text
    assert 'lmcache_mp_l1_write_chunks_total{cache_salt="tenant-a",l1_tag="_default"} 1.0' in text
    assert "lmcache_mp_l1_eviction_loop_ticks_total 0.0" in text  # there from the start
    assert 'python_info{implementation="CPython"' in text
    assert 'target_info{service_instance_id="unit",service_name=' in text
    m.inc("lmcache_mp_lookups_requests", cache_salt="", model_name="other")
    assert m.value("lmcache_mp_lookups_requests") == 4  # every series
    assert m.value("lmcache_mp_lookups_requests", model_name="m") == 3
    assert m.value("lmcache_mp_request_errors", op="lookup", code="BAD_REQUEST") == 1
    with pytest.raises(ValueError, match="only grow"):
        m.inc("lmcache_mp_lookups_requests", -1, **who)
    with pytest.raises(KeyError):
        m.inc("lmcache_mp_no_such_counter")
    with pytest.raises(ValueError, match="takes the labels"):  # a labelled counter needs them
        m.inc("lmcache_mp_request_errors")
    with pytest.raises(ValueError, match="takes the labels"):  # and no others
        m.inc("lmcache_mp_lookups_requests", worker="1", **who)
    m.inc_many({"lmcache_mp_lookup_hit_tokens": 256, "lmcache_mp_lookup_hit_l2_keys": 0}, **who)
    assert m.value("lmcache_mp_lookup_hit_tokens") == 768
    with pytest.raises(ValueError, match="takes the labels"):
        m.inc_many({"lmcache_mp_lookup_hit_tokens": 1, "lmcache_mp_request_errors": 1}, **who)
    assert m.value("lmcache_mp_lookup_hit_tokens") == 768  # nothing of a rejected call counts
    m.reset()
    assert m.value("lmcache_mp_lookups_requests") == 0
    assert "lmcache_mp_lookups_requests_total" not in m.render().decode()


def test_token_bytes_memo_never_serves_a_changed_list():
    from lmcache.v1.multiprocess.client import _TokenBytesMemo
    from lmcache.v1.multiprocess.token_hasher import tokens_to_be_bytes

    memo = _TokenBytesMemo()
    tokens = list(range(70000, 74096))
    assert memo.to_bytes(tokens) == tokens_to_be_bytes(tokens)
    assert memo.to_bytes(list(tokens)) == tokens_to_be_bytes(tokens)  # an equal list hits
    tokens[100] = 5  # changed in place: same length, same last token
    assert memo.to_bytes(tokens) == tokens_to_be_bytes(tokens)
    tokens.append(9)
    assert memo.to_bytes(tokens) == tokens_to_be_bytes(tokens)
    for i in range(_TokenBytesMemo.SIZE + 2):  # older entries fall out; answers stay right
        other = [i] * 10
        assert memo.to_bytes(other) == tokens_to_be_bytes(other)
    assert memo.to_bytes([]) == b""
    with pytest.raises(ValueError, match="uint32"):
        memo.to_bytes([1, -2])


def _u32be(tokens):
    from lmcache.v1.multiprocess.token_hasher import tokens_to_be_bytes

    return tokens_to_be_bytes(tokens)


def test_prefix_hash_memo_reuses_only_shared_whole_chunks():
    from lmcache.v1.multiprocess.token_hasher import PrefixHashMemo

    cs = 4
    memo = PrefixHashMemo(cs)
    base = list(range(1, 17))  # 4 chunks
    memo.remember(_u32be(base), chunk_hashes(base, cs))
    # shares 2 whole chunks, then differs inside the third
    other = base[:9] + [99] + base[10:] + [5, 6, 7, 8]
    known = memo.known_prefix(_u32be(other))
    assert known == chunk_hashes(base, cs)[:2] == chunk_hashes(other, cs)[:2]
    assert memo.known_prefix(_u32be(base + [1, 2, 3, 4])) == chunk_hashes(base, cs)
    assert memo.known_prefix(_u32be(base[:6])) == chunk_hashes(base, cs)[:1]
    assert memo.known_prefix(_u32be([7] + base[1:])) == []  # differs in the first chunk
    assert memo.known_prefix(_u32be(base[:3])) == []  # no whole chunk


def test_prefix_hash_memo_keeps_to_its_byte_budget():
    from lmcache.v1.multiprocess.token_hasher import PrefixHashMemo

    cs = 4
    memo = PrefixHashMemo(cs, max_bytes=3 * 32)  # three 2-chunk sequences of 32 bytes
    seqs = [[i] * 8 for i in range(1, 6)]
    for s in seqs:
        memo.remember(_u32be(s), chunk_hashes(s, cs))
    assert memo.bytes <= 3 * 32
    assert memo.known_prefix(_u32be(seqs[0])) == []  # least recently used: gone
    assert memo.known_prefix(_u32be(seqs[-1])) == chunk_hashes(seqs[-1], cs)
    longer = seqs[-1] + [9] * 4
    memo.remember(_u32be(longer), chunk_hashes(longer, cs))  # replaces its own prefix
    assert memo.bytes <= 3 * 32
    assert memo.known_prefix(_u32be(longer)) == chunk_hashes(longer, cs)


def test_session_hashes_reuse_other_requests_prefix_and_stay_right(monkeypatch):
    from lmcache.v1.multiprocess import token_hasher
    from lmcache.v1.multiprocess.sessions import Session

    cs = 16
    memo = token_hasher.PrefixHashMemo(cs)
    calls = []
    real = token_hasher.blake3
    monkeypatch.setattr(token_hasher, "blake3", lambda data: calls.append(1) or real(data))
    prompt = list(range(1000, 1000 + 8 * cs))
    follow_up = prompt + list(range(5000, 5000 + 2 * cs))  # a new request: the old prompt + more
    edited = list(prompt)
    edited[3 * cs + 1] += 1  # same length, one token changed in chunk 3
    expected = [chunk_hashes(p, cs) for p in (prompt, follow_up, edited)]
    calls.clear()
    assert Session("a").hashes_for(prompt, cs, memo) == expected[0]
    assert len(calls) == 8
    calls.clear()
    assert Session("b").hashes_for(follow_up, cs, memo) == expected[1]
    assert len(calls) == 2  # only the two new chunks
    calls.clear()
    assert Session("c").hashes_for(edited, cs, memo) == expected[2]
    assert len(calls) == 5  # chunks 0-2 are shared; 3-7 differ


def test_client_sends_ops_by_legacy_id_and_anything_else_as_given():
    from lmcache.v1.multiprocess.client import _op_info

    noop = P.OPS_BY_NAME["noop"]
    assert _op_info("noop") == _op_info(noop.legacy_id) == ("noop", P.encode(noop.legacy_id))
    named = next(s for s in P.OPS if s.legacy_id is None)
    assert _op_info(named.name) == (named.name, P.encode(named.name))
    assert _op_info(True) == ("True", P.encode(True))  # not op 1, although True == 1
    assert _op_info(999) == ("999", P.encode(999))
    assert _op_info("no_such_op") == ("no_such_op", P.encode("no_such_op"))
