# SPDX-License-Identifier: Apache-2.0
"""Foo IPC wrapper. The fictional Foo device keeps its memory in host shared memory,
so the wrapper reuses core's SHM wrapper; its wire tag defaults to the backend name."""

from __future__ import annotations

from typing import ClassVar

from lmcache.v1.platform.api import CpuShmTensorWrapper


class FooIPCWrapper(CpuShmTensorWrapper):
    device_type: ClassVar[str] = "foo"
    wire_tag: ClassVar[str | None] = None  # -> "foo", the registering spec's backend_name
