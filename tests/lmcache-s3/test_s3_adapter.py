"""The s3 adapter against a real S3 server (moto, path style): put/head/get/delete, object
names, listing, bounds-checked loads, locks and accounting
(docs/design/storage-engine.md#backend-s3, docs/design/storage-engine.md#backends)."""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj


def _objects(client, bucket: str) -> dict[str, int]:
    resp = client.list_objects_v2(Bucket=bucket)
    return {o["Key"]: o["Size"] for o in resp.get("Contents", [])}


def _body(client, bucket: str, name: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=name)["Body"].read()


def test_put_head_get_delete_round_trip(h, moto, bucket, s3_adapter):
    a = s3_adapter()
    # The start-up bucket check succeeds (and counts as the first good answer).
    assert h.wait_until(lambda: a.report_status()["last_success_time"] is not None)
    assert a.report_status()["healthy"] is True
    rec = h.Recorder()
    a.register_listener(rec)
    keys = [h.key(i) for i in range(3)]
    objs = [h.make_obj(64 * 1024 + i, seed=i) for i in range(3)]  # unequal sizes in one batch
    res = h.store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == sum(o.get_size() for o in objs)

    client = moto.client()
    stored = _objects(client, bucket)
    for k, o in zip(keys, objs, strict=True):  # the value is the raw bytes, no header
        assert _body(client, bucket, object_key_to_string(k)) == bytes(o.byte_array)
    assert sorted(stored.values()) == sorted(o.get_size() for o in objs)

    fresh = h.build("s3", **moto.spec(bucket))  # no size cache: lookups go out as HEADs
    try:
        bm = h.lookup(fresh, keys + [h.key(99)])
        assert [bm.test(i) for i in range(4)] == [True, True, True, False]
        dst = [h.empty_like(o) for o in objs]
        bm = h.load(fresh, keys, dst)
        assert bm.popcount() == 3
        assert all(torch.equal(d.tensor, o.tensor) for d, o in zip(dst, objs, strict=True))
        fresh.submit_unlock(keys)
    finally:
        fresh.close()

    assert a.get_usage().total_bytes_used == sum(o.get_size() for o in objs)
    a.delete(keys[:2])
    assert set(_objects(client, bucket)) == {object_key_to_string(keys[2])}
    assert a.get_usage().total_bytes_used == objs[2].get_size()
    assert rec.deleted == keys[:2]
    assert [k for k, _ in rec.stored] == keys
    bm = h.lookup(a, keys)
    assert [bm.test(i) for i in range(3)] == [False, False, True]


def test_object_names_are_the_native_key_strings(h, moto, bucket, s3_adapter):
    a = s3_adapter()
    keys = [
        ObjectKey(bytes([0, 1, 2, 3]), "llama", 255),
        ObjectKey(bytes([0, 1, 2, 3]), "llama", 255, cache_salt="alice"),
        ObjectKey(bytes([0, 1, 2, 3]), "llama", 255, object_group_id=26),
        ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42),
    ]
    assert h.store(a, keys, [h.make_obj(100, seed=i) for i in range(4)]).is_successful()
    assert set(_objects(moto.client(), bucket)) == {
        "llama@000000ff@0@00010203",
        "llama@000000ff@0@00010203@alice",
        "llama@000000ff@1a@00010203",
        "meta-llama/Llama-3@0000002a@0@deadbeef",
    }


def test_objects_written_by_another_client_under_native_names_load(h, moto, bucket, s3_adapter):
    """What LMCache 0.5.6 (or any writer of the format) put in the bucket is served."""
    key = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42, cache_salt="t1")
    payload = bytes(range(256)) * 16
    moto.client().put_object(
        Bucket=bucket, Key="meta-llama/Llama-3@0000002a@0@deadbeef@t1", Body=payload
    )
    a = s3_adapter()
    assert h.lookup(a, [key]).test(0) is True
    dst = h.make_obj(len(payload), seed=-1)
    assert h.load(a, [key], [dst]).test(0) is True
    assert bytes(dst.byte_array) == payload


def test_duplicate_store_counts_once(h, s3_adapter):
    a = s3_adapter()
    rec = h.Recorder()
    a.register_listener(rec)
    k, o = h.key(1), h.make_obj(4096)
    assert h.store(a, [k], [o]).bytes_transferred() == 4096
    again = h.store(a, [k], [o])
    assert again.is_successful() and again.bytes_transferred() == 0
    assert a.get_usage().total_bytes_used == 4096
    assert rec.stored == [(k, 4096)]


def _guarded_obj(nbytes: int, guard: int) -> tuple[TensorMemoryObj, torch.Tensor]:
    """A MemoryObj of ``nbytes`` inside a larger buffer whose tail is a 0xAB guard."""
    backing = torch.full((nbytes + guard,), 0xAB, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes]), dtype=torch.uint8, address=0, phy_size=nbytes, ref_count=1
    )
    return TensorMemoryObj(raw_data=backing[:nbytes], metadata=meta), backing


@pytest.mark.parametrize("object_size", [4096 + 1, 4096 + 3 * 1024 * 1024])
def test_an_oversized_object_fails_its_load_without_overflow(
    h, moto, bucket, s3_adapter, object_size
):
    big, small = h.key(1), h.key(2)
    client = moto.client()
    client.put_object(Bucket=bucket, Key=object_key_to_string(big), Body=b"\x11" * object_size)
    client.put_object(Bucket=bucket, Key=object_key_to_string(small), Body=b"\x22" * 4096)
    a = s3_adapter()
    dst_big, backing_big = _guarded_obj(4096, 1 << 22)
    dst_ok, _ = _guarded_obj(4096, 64)
    bm = h.load(a, [big, small], [dst_big, dst_ok])
    assert bm.test(0) is False and bm.test(1) is True
    assert bool((backing_big[4096:] == 0xAB).all()), "the load wrote past the buffer"
    assert bytes(dst_ok.byte_array) == b"\x22" * 4096
    assert a.report_status()["healthy"] is True  # a data problem, not a backend failure


def test_a_shorter_object_is_a_miss(h, moto, bucket, s3_adapter):
    k = h.key(3)
    moto.client().put_object(Bucket=bucket, Key=object_key_to_string(k), Body=b"\x33" * 1000)
    a = s3_adapter()
    dst, _ = _guarded_obj(4096, 16)
    assert h.load(a, [k], [dst]).test(0) is False


def test_a_missing_key_is_a_miss_and_others_still_load(h, s3_adapter):
    a = s3_adapter()
    k, o = h.key(1), h.make_obj(2048, seed=5)
    assert h.store(a, [k], [o]).is_successful()
    dst = [h.empty_like(o), h.empty_like(o)]
    bm = h.load(a, [h.key(404), k], dst)
    assert bm.test(0) is False and bm.test(1) is True
    assert torch.equal(dst[1].tensor, o.tensor)


def test_load_notifies_access(h, s3_adapter):
    a = s3_adapter()
    rec = h.Recorder()
    a.register_listener(rec)
    k, o = h.key(1), h.make_obj(512)
    h.store(a, [k], [o])
    h.load(a, [k], [h.empty_like(o)])
    assert rec.accessed == [k]


def test_a_lookup_lock_blocks_delete_until_unlock(h, moto, bucket, s3_adapter):
    a = s3_adapter()
    k = h.key(7)
    h.store(a, [k], [h.make_obj(1000)])
    assert h.lookup(a, [k]).test(0) is True
    a.delete([k])
    assert object_key_to_string(k) in _objects(moto.client(), bucket)
    a.submit_unlock([k])
    a.delete([k])
    assert _objects(moto.client(), bucket) == {}
    assert a.get_usage().total_bytes_used == 0


def test_unlock_of_unknown_keys_is_harmless(h, s3_adapter):
    a = s3_adapter()
    a.submit_unlock([h.key(1), h.key(2)])
    a.delete([h.key(1)])  # an absent object: S3 answers 204, nothing breaks


def test_list_l2_keys_pages_and_skips_foreign_objects(h, moto, bucket, s3_adapter):
    a = s3_adapter()
    keys = [h.key(i) for i in range(7)] + [h.key(i, model="other") for i in range(2)]
    sizes = [100 + i for i in range(9)]
    assert h.store(a, keys, [h.make_obj(n) for n in sizes]).is_successful()
    client = moto.client()
    for name in ("README.txt", "llama@zz@0@00", "llama@00000000@0@0102.tmp", "dir/x@1@2"):
        client.put_object(Bucket=bucket, Key=name, Body=b"foreign")

    seen, cursor, pages = {}, None, 0
    while True:
        page = a.list_l2_keys(page_size=3, cursor=cursor)
        pages += 1
        assert len(page.entries) <= 3
        for e in page.entries:
            seen[e.key.to_object_key()] = e.size_bytes
        cursor = page.next_page_token
        if cursor is None:
            break
    assert seen == dict(zip(keys, sizes, strict=True))
    assert pages >= 5  # 13 objects in pages of 3

    only_llama = a.list_l2_keys(model_name="llama", page_size=1000)
    assert {e.key.to_object_key() for e in only_llama.entries} == set(keys[:7])
    assert only_llama.next_page_token is None


def test_list_l2_keys_rejects_bad_arguments(s3_adapter):
    a = s3_adapter()
    with pytest.raises(ValueError, match=r"^page_size must be positive \(got 0\)"):
        a.list_l2_keys(page_size=0)
    with pytest.raises(ValueError, match=r"^page_size must be positive \(got -5\)"):
        a.list_l2_keys(page_size=-5)
    # (S3 answers 400 to a token it did not issue, which also becomes a ValueError; moto does
    # not check tokens.)
    for bad in ("", 17):
        with pytest.raises(ValueError, match="cursor"):
            a.list_l2_keys(cursor=bad)


def test_empty_tasks_complete(h, s3_adapter):
    a = s3_adapter()
    assert h.store(a, [], []).is_successful()
    assert h.lookup(a, []).size() == 0
    assert h.load(a, [], []).size() == 0


def test_fds_are_distinct_and_close_is_idempotent(s3_adapter):
    a = s3_adapter()
    fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
    assert len(fds) == 3
    a.close()
    a.close()


def test_a_missing_bucket_fails_with_the_reason_and_the_endpoint(h, moto, adapters):
    a = h.build("s3", **moto.spec("no-such-bucket-here"))
    adapters.append(a)
    # The start-up bucket check already tells.
    assert h.wait_until(lambda: a.report_status()["last_error"] is not None)
    st = a.report_status()
    assert st["healthy"] is False
    assert st["last_error"] == f"HEAD {moto.endpoint}/no-such-bucket-here: HTTP 404: no such bucket"
    res = h.store(a, [h.key(1)], [h.make_obj(100)])
    assert not res.is_successful()
    st = a.report_status()
    assert st["healthy"] is False and st["is_healthy"] is False
    assert "HTTP 404 NoSuchBucket" in st["last_error"]
    assert f"{moto.endpoint}/no-such-bucket-here" in st["last_error"]
    assert st["breaker"]["state"] == "closed"  # the server answered: not a connection failure
    # The next success makes it healthy again.
    moto.client().create_bucket(Bucket="no-such-bucket-here")
    assert h.store(a, [h.key(1)], [h.make_obj(100)]).is_successful()
    assert a.report_status()["healthy"] is True


def test_usage_is_per_salt_and_capacity_enables_eviction(h, s3_adapter):
    a = s3_adapter(max_capacity_gb=1, eviction={"eviction_policy": "LRU"})
    assert a.supports_global_eviction
    h.store(a, [h.key(1, salt="t1"), h.key(2)], [h.make_obj(300), h.make_obj(200)])
    usage = a.get_usage()
    assert dict(usage.bytes_by_cache_salt) == {"t1": 300, "": 200}
    assert usage.total_capacity_bytes == 1 << 30


def test_the_eviction_controller_deletes_s3_objects(h, moto, bucket, s3_adapter):
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.eviction import L2EvictionController

    a = s3_adapter(max_capacity_gb=10_000 / (1 << 30))  # 10 000 bytes
    ctl = L2EvictionController(interval_s=3600)
    assert ctl.add_adapter(0, a, EvictionConfig("LRU", trigger_watermark=0.8, eviction_ratio=0.5))
    old, new = [h.key(i) for i in range(5)], [h.key(100 + i) for i in range(5)]
    h.store(a, old, [h.make_obj(1000, seed=i) for i in range(5)])
    h.store(a, new, [h.make_obj(1000, seed=i) for i in range(5)])
    assert a.get_usage().usage_fraction == 1.0
    ctl.run_once()
    assert h.wait_until(lambda: a.get_usage().total_bytes_used == 5000)
    assert set(_objects(moto.client(), bucket)) == {object_key_to_string(k) for k in new}


def test_mismatched_keys_and_objects_raise_before_any_request(h, moto, bucket, s3_adapter):
    a = s3_adapter()
    with pytest.raises(ValueError, match="2 keys but 1 memory objects"):
        a.submit_store_task([h.key(1), h.key(2)], [h.make_obj(10)])
    with pytest.raises(ValueError, match="2 keys but 1 memory objects"):
        a.submit_load_task([h.key(1), h.key(2)], [h.make_obj(10)])
    assert a.report_status()["in_flight_requests"] == 0
    assert _objects(moto.client(), bucket) == {}
