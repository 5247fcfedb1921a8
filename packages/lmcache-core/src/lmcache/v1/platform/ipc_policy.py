"""Process-global IPC policy, set from server config flags (not env)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class IPCPolicy:
    isolated_ipc: bool = False
    use_vmm_api: bool = False


_lock = threading.Lock()
_policy = IPCPolicy()


def set_ipc_policy(policy: IPCPolicy) -> None:
    global _policy
    with _lock:
        _policy = policy


def get_ipc_policy() -> IPCPolicy:
    return _policy


def _update(**changes: bool) -> None:
    global _policy
    with _lock:
        _policy = replace(_policy, **changes)


def set_isolated_ipc(value: bool) -> None:
    _update(isolated_ipc=bool(value))


def is_isolated_ipc() -> bool:
    return _policy.isolated_ipc


def set_use_vmm_api(value: bool) -> None:
    _update(use_vmm_api=bool(value))


def is_use_vmm_api() -> bool:
    return _policy.use_vmm_api
