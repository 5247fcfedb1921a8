"""Run by both venvs (LMCache 0.5.6's and ours) with their own ``lmcache``: builds the
``valkey`` adapter from a JSON config through the 0.5.6 registry functions and stores or loads
a fixed set of objects. Prints one JSON line: the task result, the load bitmap and the bytes
loaded (hex), so the test compares the two sides.

    python valkey_driver.py store|load '<adapter JSON>'
"""

from __future__ import annotations

import json
import select
import sys

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

N, SIZE = 6, 3000


def keys() -> list[ObjectKey]:
    return [
        ObjectKey(
            chunk_hash=bytes([i + 1]) * 16,
            model_name="org/compat-model",
            kv_rank=i % 2,
            object_group_id=i % 3,
            cache_salt="salt" if i % 2 else "",
        )
        for i in range(N)
    ]


def payload(i: int) -> bytes:
    return bytes((i * 31 + j * 7) % 256 for j in range(SIZE))


class Obj:
    """The part of a MemoryObj an adapter uses: its logical bytes."""

    def __init__(self, data: bytes | None) -> None:
        self.buf = bytearray(data) if data is not None else bytearray(SIZE)

    def get_size(self) -> int:
        return len(self.buf)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.buf)


def wait(fd: int, poll) -> object:
    for _ in range(600):
        got = poll()
        if got is not None:
            return got
        select.select([fd], [], [], 0.05)
    raise SystemExit("no result within 30 s")


def main() -> None:
    mode, spec = sys.argv[1], json.loads(sys.argv[2])
    cfg = get_l2_adapter_config_class("valkey").from_dict(spec)
    adapter = create_l2_adapter_from_registry(cfg)
    ks = keys()
    try:
        if mode == "store":
            tid = adapter.submit_store_task(ks, [Obj(payload(i)) for i in range(N)])
            res = wait(
                adapter.get_store_event_fd(),
                lambda: adapter.pop_completed_store_tasks().get(tid),
            )
            print(json.dumps({"stored": int(res) >= 0 if isinstance(res, int) else bool(res)}))
        else:
            outs = [Obj(None) for _ in range(N)]
            tid = adapter.submit_load_task(ks, outs)
            bm = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid))
            hits = [i for i in range(N) if bm.test(i)]
            ok = all(bytes(outs[i].buf) == payload(i) for i in hits)
            print(json.dumps({"hits": hits, "bytes_equal": ok}))
    finally:
        adapter.close()


if __name__ == "__main__":
    main()
