"""``raw_block`` under a real ``lmcache server``: a prompt stored through one server is
retrieved byte-identical through a second server started on the same device after the first
stopped (the index is checkpointed at shutdown and found at start-up)."""

from __future__ import annotations

import json
import struct
import time

SLOT = 4096 + 98304  # header + one chunk of the test model (2 x 3 x 256 x 32 bf16)
META = 1 << 20


def _slots_written(device) -> int:
    """Slots whose header carries the raw_block magic (the data is on the device)."""
    raw = device.read_bytes()
    count = 0
    for off in range(META, len(raw) - SLOT + 1, SLOT):
        if raw[off : off + 8] == b"LMCBLK01":
            count += 1
    return count


def test_a_restarted_server_serves_what_the_first_one_stored(lmcache_server, device, h):
    spec = {
        "type": "raw_block",
        "device_path": str(device),
        "slot_bytes": SLOT,
        "meta_total_bytes": META,
        "use_odirect": False,
    }
    flags = ("--l2-adapter", json.dumps(spec), "--supported-transfer-mode", "auto")
    n_blocks = len(h.BLOCK_IDS)
    src_ids = h.BLOCK_IDS
    dst_ids = list(range(1 + n_blocks, 1 + 2 * n_blocks))[::-1]

    a = lmcache_server(*flags)
    h.store_prompt(a, "rb-model", src_ids)
    assert h.wait_until(lambda: _slots_written(device) >= 4, 60), a.log()[-4000:]
    time.sleep(0.5)  # let the write-behind task complete
    assert a.stop() == 0, a.log()[-4000:]
    magic, _v, seq, _n, _crc = struct.unpack("<8sIQQI", device.read_bytes()[:32])
    assert (magic, seq) == (b"LMCIDX01", 1), "no checkpoint at shutdown"

    b = lmcache_server(*flags)
    h.retrieve_prompt(b, "rb-model", src_ids, dst_ids)
