"""Prefix-chained chunk hashes (docs/design/protocol.md#token-hashing) and kv_rank packing
(docs/design/protocol.md#object-keys).

``h_i = blake3(h_{i-1} || uint32_be(t) for t in chunk_i)`` starting from
``NONE_HASH = blake3(12 zero bytes)``. Only complete chunks are hashed.
"""

from __future__ import annotations

import array
import sys
import threading
from collections import OrderedDict

import numpy as np
from blake3 import blake3

SUPPORTED_HASH_ALGORITHMS = ("blake3",)
LATER_HASH_ALGORITHMS = ("builtin", "sha256_cbor", "sha256_cbor_64bit")

NONE_HASH: bytes = blake3((0).to_bytes(8, "big", signed=True) + (0).to_bytes(4, "big")).digest()


def tokens_to_be_bytes(token_ids: list[int] | np.ndarray | bytes) -> bytes:
    """uint32 big-endian bytes of the tokens; ValueError names an out-of-range token.

    Bytes are taken to be that form already (the ``token_ids_u32be`` wire form)."""
    if isinstance(token_ids, bytes | bytearray | memoryview):
        raw = bytes(token_ids)
        if len(raw) % 4:
            raise ValueError(f"token bytes must hold whole uint32 values (got {len(raw)} bytes)")
        return raw
    if isinstance(token_ids, np.ndarray):
        token_ids = token_ids.tolist()
    try:
        arr = array.array("I", token_ids)  # 'I' is 4 bytes on every platform we run on
    except (OverflowError, TypeError):
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < 1 << 32), None)
        raise ValueError(
            f"token id {bad!r} is outside [0, 2^32); token ids must be uint32"
        ) from None
    if sys.byteorder == "little":
        arr.byteswap()
    return arr.tobytes()


def chunk_hashes(
    token_ids: list[int] | np.ndarray,
    chunk_size: int,
    *,
    prefix: list[bytes] | None = None,
    token_bytes: bytes | None = None,
) -> list[bytes]:
    """Hashes of every complete chunk of ``token_ids``.

    ``prefix`` holds already-known hashes of the first chunks (the session cache); only
    the chunks after them are computed.
    """
    raw = token_bytes if token_bytes is not None else tokens_to_be_bytes(token_ids)
    n_chunks = (len(raw) // 4) // chunk_size
    out = list(prefix[:n_chunks]) if prefix else []
    prev = out[-1] if out else NONE_HASH
    step = chunk_size * 4
    for i in range(len(out), n_chunks):
        prev = blake3(prev + raw[i * step : (i + 1) * step]).digest()
        out.append(prev)
    return out


# Appended to a tail's tokens before hashing (with its token count): a whole chunk's hash
# input is its parent and exactly chunk_size tokens, so no tail can share a whole chunk's key.
TAIL_TAG = b"lmcache-tail"


def tail_hash(parent: bytes, token_bytes: bytes) -> bytes:
    """The key hash of a tail (docs/design/protocol.md#partial-chunk): the tokens after the
    last whole chunk (``token_bytes``, uint32 big-endian, fewer than a chunk), chained to
    that chunk's hash ``parent`` (``NONE_HASH`` for a request shorter than one chunk):
    ``blake3(parent || tokens || TAIL_TAG || uint32_be(token count))``."""
    n = len(token_bytes) // 4
    return blake3(parent + token_bytes + TAIL_TAG + n.to_bytes(4, "big")).digest()


def shared_chunks(a: bytes, b: bytes, step: int, limit: int) -> int:
    """How many whole ``step``-byte chunks ``a`` and ``b`` share from the start, at most
    ``limit`` (both hold at least ``limit`` chunks). One comparison when all of them match."""
    if a[: limit * step] == b[: limit * step]:
        return limit
    n = 0
    while a[n * step : (n + 1) * step] == b[n * step : (n + 1) * step]:
        n += 1  # stops before limit: the whole span differs somewhere
    return n


class PrefixHashMemo:
    """Chunk hashes of recently hashed token sequences, for any request to reuse.

    A KV cache hits because a new request shares a prefix with an earlier one, and every
    such request would hash that prefix again (16 blake3 calls, ~50 us, per 4096 tokens).
    Here it takes the hashes of the longest whole-chunk prefix it shares with a remembered
    sequence and hashes only the chunks after it. Sequences are found by their first chunk
    and compared byte for byte, so a reused hash always belongs to the same tokens. At most
    ``max_bytes`` of token bytes are kept (``PER_FIRST_CHUNK`` sequences per first chunk),
    the least recently used first chunk going first. Thread-safe.
    """

    PER_FIRST_CHUNK = 4

    def __init__(self, chunk_size: int, max_bytes: int = 32 << 20) -> None:
        self.step = chunk_size * 4
        self.max_bytes = max_bytes
        self.bytes = 0
        # first chunk -> [(token bytes of whole chunks, their hashes)], newest first
        self._by_first: OrderedDict[bytes, list[tuple[bytes, list[bytes]]]] = OrderedDict()
        self._lock = threading.Lock()

    def known_prefix(self, raw: bytes) -> list[bytes]:
        """Hashes of the longest whole-chunk prefix of ``raw`` a remembered sequence shares."""
        step = self.step
        if len(raw) < step:
            return []
        first = raw[:step]
        with self._lock:
            seqs = self._by_first.get(first)
            if seqs is None:
                return []
            self._by_first.move_to_end(first)
            best: list[bytes] = []
            for seq, hashes in seqs:
                n = shared_chunks(seq, raw, step, min(len(hashes), len(raw) // step))
                if n > len(best):
                    best = hashes[:n]
            return best

    def remember(self, raw: bytes, hashes: list[bytes]) -> None:
        """Keep the hashes of ``raw``'s whole chunks (``hashes`` is one per whole chunk)."""
        step = self.step
        n = min(len(hashes), len(raw) // step)
        if n == 0 or n * step > self.max_bytes:
            return
        raw, hashes = raw[: n * step], list(hashes[:n])
        first = raw[:step]
        with self._lock:
            seqs = self._by_first.pop(first, [])
            for i, (seq, _) in enumerate(seqs):
                if raw.startswith(seq):  # the new one extends (or repeats) it: replace it
                    self.bytes -= len(seq)
                    del seqs[i]
                    break
                if seq.startswith(raw):  # already covered by a longer one
                    self._by_first[first] = seqs
                    return
            seqs.insert(0, (raw, hashes))
            self.bytes += len(raw)
            for seq, _ in seqs[self.PER_FIRST_CHUNK :]:
                self.bytes -= len(seq)
            del seqs[self.PER_FIRST_CHUNK :]
            self._by_first[first] = seqs
            while self.bytes > self.max_bytes:
                _, dropped = self._by_first.popitem(last=False)
                self.bytes -= sum(len(seq) for seq, _ in dropped)


def compute_kv_rank(world_size: int, rank: int) -> int:
    """MP kv_rank: (ws << 24) | (rank << 16) | (ws << 8) | rank, 8 bits per field."""
    if not 1 <= world_size <= 255:
        raise ValueError(f"world_size must be in 1..255 (got {world_size})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) (got {rank})")
    return (world_size << 24) | (rank << 16) | (world_size << 8) | rank
