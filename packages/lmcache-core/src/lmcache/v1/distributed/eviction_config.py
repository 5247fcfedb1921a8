"""``EvictionConfig``: the eviction settings of one L1 or one L2 adapter
(docs/design/storage-engine.md). Its own module so that both ``config`` (L1 flags) and
``l2_adapters.config`` (each adapter's ``eviction`` block) import it from below;
``lmcache.v1.distributed.config`` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVICTION_POLICIES", "EvictionConfig"]

#: The eviction policies an L1 or an L2 adapter may name.
EVICTION_POLICIES = ("LRU", "ARC", "IsolatedLRU", "noop")


@dataclass
class EvictionConfig:
    """When and how much to evict: above ``trigger_watermark`` (a fraction of capacity),
    free ``eviction_ratio`` of it in ``eviction_policy`` order."""

    eviction_policy: str
    trigger_watermark: float = 0.8
    eviction_ratio: float = 0.2
    extra_logging_enabled: bool = False
    extra_logging_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                "eviction.eviction_policy must be 'LRU', 'ARC', 'IsolatedLRU', or 'noop', "
                f"got {self.eviction_policy!r}"
            )
        for name in ("trigger_watermark", "eviction_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1] (got {v!r})")
