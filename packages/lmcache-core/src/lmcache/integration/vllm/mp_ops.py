"""Per-request transfer descriptions that travel from the scheduler to the workers.

Both classes are plain dataclasses so vLLM can pickle the connector metadata
between its scheduler and worker processes. The keyword names of
``LoadStoreOp`` are the ones vLLM's builtin copy of the connector uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Direction = Literal["STORE", "RETRIEVE"]


@dataclass
class LoadStoreOp:
    """One chunk-aligned token range of one request and the vLLM blocks that hold it.

    ``token_ids`` is the request's token sequence from position 0 (the server
    hashes prefix-chained chunks, so the whole prefix is needed); ``block_ids``
    has one list per KV cache group, covering exactly ``[start, end)``.
    """

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    start: int = 0
    end: int = 0
    skip_first_n_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return self.end - self.start

    def all_block_ids(self) -> list[int]:
        return [b for group in self.block_ids for b in group]


@dataclass
class LMCacheMPRequestMetadata:
    request_id: str
    direction: Direction
    op: LoadStoreOp
    cache_salt: str = ""


def chunk_floor(n: int, chunk_size: int) -> int:
    return n // chunk_size * chunk_size
