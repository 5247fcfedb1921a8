"""Two `lmcache server` processes sharing one S3 bucket (the multi-node story): a prompt
stored through one is retrieved, byte-identical, through the other."""

from __future__ import annotations

import json

from lmcache.storage.s3.objects import s3_name_to_object_key


def test_chunk_stored_by_one_server_is_served_by_another(h, moto, bucket, lmcache_server):
    adapter = json.dumps({"type": "s3", **moto.spec(bucket)})
    client = moto.client()

    def count() -> int:
        return client.list_objects_v2(Bucket=bucket).get("KeyCount", 0)

    h.cross_server_round_trip(lmcache_server, adapter, count, model="xsrv/s3")
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert all(n.startswith("xsrv/s3@") for n in names)
    assert all(s3_name_to_object_key(n).model_name == "xsrv/s3" for n in names)
