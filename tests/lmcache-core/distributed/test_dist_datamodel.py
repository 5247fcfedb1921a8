"""ObjectKey, kv_rank helpers, EncodedObjectKey, L2StoreResult, AdapterUsage, layouts
(docs/design/storage-engine.md#data-model)."""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.distributed.api import (
    ComputeKVRank,
    EncodedObjectKey,
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
    WorldSizeFromKVRank,
)
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage


def test_object_key_field_order_and_value_equality():
    a = ObjectKey(b"\x01", "m", 3, 2, "s")
    assert (a.chunk_hash, a.model_name, a.kv_rank, a.object_group_id, a.cache_salt) == (
        b"\x01",
        "m",
        3,
        2,
        "s",
    )
    assert a == ObjectKey(b"\x01", "m", 3, 2, "s")
    assert len({a, ObjectKey(b"\x01", "m", 3, 2, "s")}) == 1


def test_salt_takes_part_in_equality_and_hash():
    a = ObjectKey(b"\x01", "m", 0)
    b = ObjectKey(b"\x01", "m", 0, cache_salt="alice")
    assert a != b
    assert len({a, b}) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_name": "a@b"}, "model_name must not contain '@' (got 'a@b')"),
        ({"object_group_id": -1}, "object_group_id must be >= 0 (got -1)"),
        ({"cache_salt": "x" * 129}, "cache_salt exceeds max length 128 (got 129)"),
    ],
)
def test_object_key_rejections(kwargs, message):
    base = {"chunk_hash": b"\x00", "model_name": "m", "kv_rank": 0}
    base.update(kwargs)
    with pytest.raises(ValueError) as exc:
        ObjectKey(**base)
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize("bad", ["a@b", "a/b", "a\\b", "a\x00b"])
def test_salt_bad_characters(bad):
    with pytest.raises(ValueError, match=r"^cache_salt must not contain \[") as exc:
        ObjectKey(b"\x00", "m", 0, cache_salt=bad)
    assert repr(bad) in str(exc.value)


def test_salt_of_exactly_128_is_accepted():
    assert ObjectKey(b"\x00", "m", 0, cache_salt="y" * 128).cache_salt == "y" * 128


@pytest.mark.parametrize(
    ("ws", "rank", "expected"),
    [(1, 0, 0x01000100), (2, 1, 0x02010201), (4, 2, 0x04020402), (8, 7, 0x08070807)],
)
def test_kv_rank_packing(ws, rank, expected):
    kv = ComputeKVRank(ws, rank, ws, rank)
    assert kv == expected
    assert ObjectKey.ComputeKVRank(ws, rank, ws, rank) == expected
    assert WorldSizeFromKVRank(kv) == ws


def test_kv_rank_rejects_out_of_range_fields():
    with pytest.raises(ValueError):
        ComputeKVRank(256, 0, 256, 0)


def test_int_hash_helpers():
    assert ObjectKey.IntHash2Bytes(0x00010203) == bytes([0, 1, 2, 3])
    assert ObjectKey.Bytes2IntHash(bytes([0, 1, 2, 3])) == 0x00010203
    assert ObjectKey.Bytes2IntHash(b"\xff" * 9) == 0xFFFFFFFFFFFFFFFF  # masked to 64 bits


def test_encoded_object_key_round_trip_and_revalidation():
    k = ObjectKey(bytes.fromhex("deadbeef"), "m/x", 42, 3, "t1")
    enc = k.to_encoded_object_key()
    assert enc == EncodedObjectKey("deadbeef", "m/x", 42, 3, "t1")
    assert EncodedObjectKey.from_dict(enc.to_dict()).to_object_key() == k
    with pytest.raises(ValueError):
        EncodedObjectKey("00", "bad@model", 0).to_object_key()


def test_l2_store_result_semantics():
    ok0 = L2StoreResult(True, 0)
    assert ok0.is_successful() and int(ok0) == 0 and not ok0  # falsy but successful
    failed = L2StoreResult(False, 9)
    assert failed == -1 and failed.bytes_transferred() == 0 and not failed.is_successful()
    assert L2StoreResult(True, 77).bytes_transferred() == 77
    with pytest.raises(ValueError, match=r"^bytes_transferred must be >= 0, got -1"):
        L2StoreResult(True, -1)


def test_l2_store_result_says_which_keys_landed():
    from lmcache.lmcache_native import Bitmap

    keys = ["a", "b", "c"]
    assert L2StoreResult(True, 5).landed_keys(keys) == keys
    assert L2StoreResult(False, 0).landed_keys(keys) == []
    landed = Bitmap(3)
    landed.set(2)
    partly = L2StoreResult(False, 0, error="b failed", landed=landed)
    assert partly.landed_keys(keys) == ["c"] and not partly.is_successful()
    with pytest.raises(ValueError, match=r"^landed bitmap has 3 bits for 2 keys"):
        partly.landed_keys(keys[:2])


@pytest.mark.parametrize(
    ("raw", "ok", "nbytes"),
    [(True, True, 8), (False, False, 0), (None, False, 0), (5, True, 5), (-3, False, 0)],
)
def test_l2_store_result_normalisation(raw, ok, nbytes):
    class Obj:
        def get_size(self):
            return 4

    res, legacy = L2StoreResult.normalise(raw, [Obj(), Obj()])
    assert legacy
    assert res.is_successful() is ok and res.bytes_transferred() == nbytes


def test_adapter_usage():
    u = AdapterUsage(10, 0, {"a": 5, "b": 0})
    assert u.usage_fraction == -1.0
    assert dict(u.bytes_by_cache_salt) == {"a": 5}
    with pytest.raises(TypeError):
        u.bytes_by_cache_salt["c"] = 1  # read-only
    assert AdapterUsage(400, 2000).usage_fraction == pytest.approx(0.2)


def test_layout_and_prefetch_spec_validation():
    with pytest.raises(ValueError):
        MemoryLayoutDesc([torch.Size([2])], [])
    lay = MemoryLayoutDesc([torch.Size([2, 3]), torch.Size([4])], [torch.float16, torch.float32])
    assert lay.nbytes() == 2 * 3 * 2 + 4 * 4
    k = ObjectKey(b"\x00", "m", 0)
    with pytest.raises(ValueError, match="same length"):
        PrefetchTaskSpec([GroupedObjectKeys([k], 0, lay), GroupedObjectKeys([k, k], 1, lay)])
    with pytest.raises(ValueError):
        PrefetchTaskSpec([GroupedObjectKeys([k], 0, lay)], fetching_policy="bogus")


def test_object_key_pickled_in_another_process_hashes_like_a_local_one():
    """Keys cache their hash, and str hashes differ between processes: a key unpickled here
    must be rebuilt with this process's hash, or dict lookups would miss it."""
    import os
    import pickle
    import subprocess
    import sys

    from lmcache.v1.distributed.api import ObjectKey

    code = (
        "import pickle, sys\n"
        "from lmcache.v1.distributed.api import ObjectKey\n"
        "sys.stdout.buffer.write(pickle.dumps(ObjectKey(b'\\x01\\x02', 'model/x', 7, 0, 'salt')))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    remote = pickle.loads(out.stdout)
    local = ObjectKey(b"\x01\x02", "model/x", 7, 0, "salt")
    assert remote == local and hash(remote) == hash(local)
    assert {local: "hit"}[remote] == "hit"


def test_store_result_per_key_names_the_keys_that_landed():
    from lmcache.v1.distributed.internal_api import L2StoreResult

    keys = ["a", "b", "c"]
    ok = L2StoreResult.per_key([True, True, True], 30)
    assert ok.is_successful() and ok.bytes_transferred() == 30 and ok.landed_keys(keys) == keys
    part = L2StoreResult.per_key([True, False, True], 20, error="b: disk full")
    assert not part.is_successful() and part.error == "b: disk full"
    assert part.landed_keys(keys) == ["a", "c"]
    assert L2StoreResult.per_key([False, False, False], 0).landed_keys(keys) == []
