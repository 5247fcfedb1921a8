"""docs/design/architecture.md#vllm-imports: the names vLLM's in-tree connector imports from
custom_types."""

import subprocess
import sys

import msgspec
import torch


def test_vllm_style_imports_resolve_to_the_protocol_structs():
    from lmcache.v1.multiprocess import protocol
    from lmcache.v1.multiprocess.custom_types import (
        BlockAllocationRecord,
        IPCCacheServerKey,
        KVCache,
        RequestAllocationRecord,
    )

    # One concept, one place: the wire key is the protocol's struct, not a copy.
    assert IPCCacheServerKey is protocol.IPCCacheServerKey
    assert BlockAllocationRecord is RequestAllocationRecord
    assert KVCache == list[torch.Tensor]

    rec = RequestAllocationRecord(req_id="r1", new_block_ids=[3, 4], new_token_ids=[7, 8, 9])
    assert (rec.req_id, rec.new_block_ids, rec.new_token_ids) == ("r1", [3, 4], [7, 8, 9])
    # It survives the wire encoding used by the protocol.
    back = msgspec.msgpack.decode(protocol.encode(rec), type=BlockAllocationRecord)
    assert back == rec


def test_custom_types_import_does_not_pull_zmq_or_server():
    code = (
        "import sys\n"
        "import lmcache.v1.multiprocess.custom_types as m\n"
        "bad = [n for n in ('zmq', 'lmcache.v1.multiprocess.server') if n in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
