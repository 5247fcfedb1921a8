# SPDX-License-Identifier: Apache-2.0
"""Foo cache context: the server's view of a Foo worker's (shared-memory) KV caches."""

from __future__ import annotations

from typing import ClassVar

from lmcache.v1.platform.api import CPUCacheContext


class FooCacheContext(CPUCacheContext):
    device_type: ClassVar[str] = "foo"
