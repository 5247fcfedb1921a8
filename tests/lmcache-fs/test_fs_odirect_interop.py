"""fs_native with O_DIRECT reads files written without padding
(docs/design/storage-formats.md#value-bytes).

Padded writes happen only on store; a reader accepts any file at least as long as the
destination's logical size and uses its first len(buffer) bytes.
"""

from __future__ import annotations

import pytest

from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_filename


@pytest.mark.parametrize(
    "writer",
    [("fs", {}), ("fs_native", {}), ("fs", {"use_odirect": True})],
    ids=["fs", "fs_native-no-odirect", "fs-odirect"],
)
def test_unpadded_file_is_a_hit_for_odirect_reader(h, adapters, tmp_path, writer):
    w_type, w_fields = writer
    w = h.build(w_type, base_path=str(tmp_path), **w_fields)
    adapters.append(w)
    obj = h.make_obj(4000, seed=11, align=4096, phy=4096)
    k = h.key(1)
    assert h.store(w, [k], [obj]).is_successful()
    written = (tmp_path / object_key_to_filename(k)).read_bytes()
    assert written[:4000] == bytes(obj.byte_array)

    r = h.build("fs_native", base_path=str(tmp_path), use_odirect=True)
    adapters.append(r)
    dst = h.make_obj(4000, seed=-1, align=4096, phy=4096)
    dst.raw_tensor[4000:4096] = 0xCD  # the reader must not touch the slot's tail
    assert h.lookup(r, [k]).test(0) is True
    r.submit_unlock([k])
    assert h.load(r, [k], [dst]).test(0) is True
    assert bytes(dst.byte_array) == bytes(obj.byte_array)
    assert bytes(dst.raw_tensor[4000:4096].numpy()) == b"\xcd" * 96


def test_odirect_store_still_pads_and_round_trips(h, adapters, tmp_path):
    a = h.build("fs_native", base_path=str(tmp_path), use_odirect=True)
    adapters.append(a)
    obj = h.make_obj(4000, seed=12, align=4096, phy=4096)
    k = h.key(2)
    assert h.store(a, [k], [obj]).is_successful()
    assert len((tmp_path / object_key_to_filename(k)).read_bytes()) == 4096
    # A plain fs reader with an unpadded destination uses the first 4000 bytes.
    py = h.build("fs", base_path=str(tmp_path))
    adapters.append(py)
    dst = h.make_obj(4000, seed=-1)
    assert h.load(py, [k], [dst]).test(0) is True
    assert bytes(dst.byte_array) == bytes(obj.byte_array)
