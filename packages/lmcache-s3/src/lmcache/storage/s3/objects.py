"""S3 object names and ListObjectsV2 pages (docs/design/storage-formats.md#l2-names,
docs/design/storage-engine.md#backend-s3).

The object name of a key is its native string (core's codec); request paths URL-quote it with
``/`` left as is. Listing skips objects whose names are not keys.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from urllib.parse import quote, urlencode

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.api import string_to_object_key

MAX_KEYS_PER_PAGE = 1000  # the ListObjectsV2 ceiling


def object_path(path_prefix: str, name: str) -> str:
    """Request path of an object: ``<prefix>/<quoted name>``."""
    return f"{path_prefix}/{quote(name, safe='/')}"


def s3_name_to_object_key(name: str) -> ObjectKey:
    """The key an object name encodes; ``ValueError`` for a name that is not a key."""
    key = string_to_object_key(name)
    if key is None:
        raise ValueError(
            f"unparsable S3 object name {name!r}: expected "
            "<model>@<kv_rank hex>@<group hex>@<chunk hash hex>[@<cache_salt>]"
        )
    return key


def list_path(path_prefix: str, prefix: str | None, max_keys: int, token: str | None) -> str:
    params = [("list-type", "2"), ("max-keys", str(max_keys))]
    if prefix:
        params.append(("prefix", prefix))
    if token:
        params.append(("continuation-token", token))
    # Everything quoted (also "/" in model names and tokens): SigV4 signs the encoded form.
    query = urlencode(params, quote_via=lambda v, *_: quote(v, safe=""))
    return f"{path_prefix or '/'}?{query}"


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def parse_list_page(body: bytes) -> tuple[list[tuple[ObjectKey, int]], list[str], str | None]:
    """``(entries, skipped names, next continuation token)`` of one ListObjectsV2 response."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise ValueError(f"malformed ListObjectsV2 response: {exc}") from None
    entries: list[tuple[ObjectKey, int]] = []
    skipped: list[str] = []
    token = None
    for child in root:
        tag = _local(child.tag)
        if tag == "NextContinuationToken" and child.text:
            token = child.text
        if tag != "Contents":
            continue
        name, size = None, 0
        for field in child:
            ftag = _local(field.tag)
            if ftag == "Key":
                name = field.text
            elif ftag == "Size" and field.text and field.text.strip().isdigit():
                size = int(field.text)
        if not name:
            continue
        try:
            entries.append((s3_name_to_object_key(name), size))
        except ValueError:
            skipped.append(name)
    return entries, skipped, token
