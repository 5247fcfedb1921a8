"""Byte-exact L2 object names (docs/design/storage-formats.md#l2-names)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.key_codec import (
    filename_to_object_key,
    object_key_to_filename,
    object_key_to_string,
    string_to_object_key,
)
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import _object_key_to_string

LLAMA = ObjectKey(ObjectKey.IntHash2Bytes(0x00010203), "llama", 255)
META = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42)


def test_native_string_worked_examples():
    assert object_key_to_string(LLAMA) == "llama@000000ff@0@00010203"
    salted = ObjectKey(LLAMA.chunk_hash, "llama", 255, cache_salt="alice")
    assert object_key_to_string(salted) == "llama@000000ff@0@00010203@alice"
    gid = ObjectKey(LLAMA.chunk_hash, "llama", 255, object_group_id=26)
    assert object_key_to_string(gid) == "llama@000000ff@1a@00010203"
    assert object_key_to_string(META) == "meta-llama/Llama-3@0000002a@0@deadbeef"
    assert _object_key_to_string(LLAMA) == "llama@000000ff@0@00010203"


def test_file_name_worked_examples():
    assert object_key_to_filename(META) == "meta-llama-SEP-Llama-3@0x0000002a@0@deadbeef.data"
    salted = ObjectKey(META.chunk_hash, META.model_name, 42, cache_salt="t1")
    assert object_key_to_filename(salted) == "meta-llama-SEP-Llama-3@0x0000002a@0@deadbeef@t1.data"


def test_deterministic_across_processes():
    code = (
        "from lmcache.v1.distributed.api import ObjectKey\n"
        "from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string\n"
        "print(object_key_to_string(ObjectKey(ObjectKey.IntHash2Bytes(0x00010203), 'llama', 255, 0, 's')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == object_key_to_string(
        ObjectKey(LLAMA.chunk_hash, "llama", 255, 0, "s")
    )


@pytest.mark.parametrize("salt", ["", "t1"])
@pytest.mark.parametrize("gid", [0, 26])
def test_round_trips(salt, gid):
    k = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42, gid, salt)
    assert filename_to_object_key(object_key_to_filename(k)) == k
    assert string_to_object_key(object_key_to_string(k)) == k


def test_parsers_accept_0x_prefix():
    assert string_to_object_key("llama@0x000000ff@0@00010203") == LLAMA
    assert filename_to_object_key("llama@0x000000ff@0x0@00010203.data") == LLAMA


@pytest.mark.parametrize(
    "name",
    [
        "random.txt",
        "llama@0x000000ff@0@00010203.tmp",
        "llama@0x000000ff@0@00010203.123-4-abcdef01.tmp",
        "llama@0x000000ff@00010203.data",  # 3 fields
        "llama@0x000000ff@0@00010203@a@b.data",  # 6 fields
        "llama@0xzz@0@00010203.data",  # bad hex
        "llama@0x000000ff@0@0001020.data",  # odd hash length
        "llama@0x000000ff@0@00010203@bad\\salt.data",  # invalid salt
        "llama@0x000000ff@0@00010203@.data",  # empty salt field
        "llama@0x000000ff@0@00010203",  # no .data
        "a@0x0@0@.data",  # empty hash field
        "a@0x0@0@0x.data",  # empty hash after the 0x prefix
        "a@0x0@0@@s.data",  # empty hash with a salt
    ],
)
def test_foreign_file_names_give_none(name):
    assert filename_to_object_key(name) is None


@pytest.mark.parametrize(
    "s",
    [
        "a@b@c",
        "llama@000000ff@0@00010203@s@x",
        "llama@zz@0@00",
        "@1@0@00",
        "a@0@0@",  # empty hash field
        "a@0@0@0x",
        "a@0@0@@salt",
    ],
)
def test_foreign_strings_give_none(s):
    assert string_to_object_key(s) is None
