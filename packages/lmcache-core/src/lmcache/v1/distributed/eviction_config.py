"""``EvictionConfig``: the eviction settings of one L1 or one L2 adapter
(docs/design/storage-engine.md). Its own module so that both ``config`` (L1 flags) and
``l2_adapters.config`` (each adapter's ``eviction`` block) import it from below;
``lmcache.v1.distributed.config`` re-exports both names. Its fields declare their
``lmcache server`` flags (``config_flags``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache.v1.distributed.config_flags import flag

__all__ = ["EVICTION_POLICIES", "EvictionConfig"]

#: The eviction policies an L1 or an L2 adapter may name.
EVICTION_POLICIES = ("LRU", "ARC", "IsolatedLRU", "noop")


@dataclass
class EvictionConfig:
    """When and how much to evict: above ``trigger_watermark`` (a fraction of capacity),
    free ``eviction_ratio`` of it in ``eviction_policy`` order."""

    # The flags configure the L1's eviction (an L2 adapter's comes from its JSON).
    eviction_policy: str = flag(
        "--eviction-policy", "L1 eviction policy", choices=EVICTION_POLICIES, flag_default=None
    )
    trigger_watermark: float = flag(
        "--eviction-trigger-watermark",
        "evict when L1 usage reaches this fraction",
        default=0.8,
        type=float,
    )
    eviction_ratio: float = flag(
        "--eviction-ratio",
        "fraction of used bytes freed per eviction cycle",
        default=0.2,
        type=float,
    )
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
