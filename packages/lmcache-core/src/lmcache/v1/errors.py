"""The errors LMCache raises on purpose, one small hierarchy.

Each class also derives from the built-in exception the same failure raised before it
existed, so ``except ValueError`` / ``except RuntimeError`` keep working. Messages name
the bad value and the fix; the ``lmcache`` CLI prints them without a traceback.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "L2_TYPE_REFUSALS",
    "L2_TYPE_WHEELS",
    "LMCACHE_056_ONLY_L2_TYPES",
    "DeviceBackendError",
    "L2TypeRefusal",
    "LMCacheConfigError",
    "LMCacheError",
    "PluginError",
    "UnknownL2AdapterTypeError",
]


class LMCacheError(Exception):
    """Base of every error LMCache raises deliberately."""


class LMCacheConfigError(LMCacheError, ValueError):
    """A configuration value (flag, JSON field, environment variable) is wrong."""


class PluginError(LMCacheError, RuntimeError):
    """A plugin (device backend or L2 adapter type) is broken or incomplete."""


class DeviceBackendError(LMCacheError, RuntimeError):
    """No usable device backend, or several where exactly one must be chosen."""


# The L2 adapter types our storage wheels register (their ``lmcache.l2_adapters`` hooks), so an
# install hint only ever names a wheel that exists.
L2_TYPE_WHEELS: dict[str, str] = {
    "fs": "lmcache-fs",
    "fs_native": "lmcache-fs",
    "resp": "lmcache-redis",
    "redis": "lmcache-redis",
    "s3": "lmcache-s3",
    "valkey": "lmcache-valkey",
    "nixl_store": "lmcache-nixl",
    "nixl_native": "lmcache-nixl",
    "raw_block": "lmcache-raw-block",
    "mooncake_store": "lmcache-mooncake",
}

# Types LMCache 0.5.6 registers that no wheel of this release provides (docs/compat.md,
# "L2 adapter types"). 0.5.6 also has fault_inject, mock, native_plugin and plugin (core
# built-ins) and the types in L2_TYPE_WHEELS.
LMCACHE_056_ONLY_L2_TYPES: frozenset[str] = frozenset(
    {
        "aerospike",
        "bigtable",
        "dax",
        "hf3fs",
        "hfbucket",
        "nixl_store_dynamic",
        "p2p",
        "sagemaker-hyperpod",
    }
)


@dataclass(frozen=True)
class L2TypeRefusal:
    """Why an LMCache 0.5.6 L2 type is not provided, and what to use instead."""

    what: str  # what the type is
    why: str  # why this release does not provide it
    instead: str  # what to use instead

    def message(self, name: str, where: str = "") -> str:
        prefix = f"{where}: " if where else ""
        return (
            f"{prefix}L2 adapter type {name!r} (LMCache 0.5.6's {self.what}) is not provided by "
            f"this release: {self.why}. Use instead: {self.instead}"
        )


# The 0.5.6 types whose backend needs hardware or a service this release cannot run or test
# (docs/compat.md, "L2 adapter types"): asking for one fails at start-up with this text, never
# with "unknown type". A wheel that registers the name wins over its refusal.
L2_TYPE_REFUSALS: dict[str, L2TypeRefusal] = {
    "aerospike": L2TypeRefusal(
        "Aerospike store through its compiled C++ Aerospike client",
        "it needs an Aerospike database cluster and that native client, neither shipped here",
        'resp (Redis/Valkey), s3, or {"type":"native_plugin",...} wrapping your own '
        "Aerospike client (docs/l2-plugins.md)",
    ),
    "bigtable": L2TypeRefusal(
        "Google Cloud Bigtable store (google-cloud-bigtable)",
        "it needs a Bigtable instance and Google Cloud credentials",
        "s3 (any S3-compatible store, e.g. GCS's XML API), resp, or a plugin type of your own",
    ),
    "dax": L2TypeRefusal(
        "CXL / persistent-memory store on a device-DAX character device (/dev/daxX.Y, mmap)",
        "it needs device-DAX hardware",
        "raw_block (the lmcache-raw-block wheel) on a block device or pre-sized file, or fs",
    ),
    "hf3fs": L2TypeRefusal(
        "DeepSeek 3FS store through its compiled USRBIO client",
        "it needs a 3FS cluster and its client library, neither shipped here",
        "fs or fs_native on the 3FS FUSE mount, or nixl_store with NIXL's HF3FS backend",
    ),
    "hfbucket": L2TypeRefusal(
        "Hugging Face Hub bucket store (huggingface_hub)",
        "it needs a Hugging Face account token and network access to the Hub",
        "s3 or fs",
    ),
    "nixl_store_dynamic": L2TypeRefusal(
        "NIXL store that opens and registers one file per operation",
        "it is not implemented in lmcache-nixl yet",
        "nixl_native (one file or object per key through NIXL, kept across restarts) or "
        "nixl_store (the lmcache-nixl wheel)",
    ),
    "p2p": L2TypeRefusal(
        "peer-to-peer type that reads KV objects from another cache server's L1 through that "
        "server's P2P controller",
        "this release's server has no P2P controller (--p2p-advertise-url is not provided), so "
        "there is no peer to read from",
        'one L2 store both servers use (fs on a shared mount, resp or s3) with "shared": true',
    ),
    "sagemaker-hyperpod": L2TypeRefusal(
        "AWS SageMaker HyperPod tiered KV-cache store (the ai-toolkit service on HyperPod nodes)",
        "it needs a HyperPod cluster running that service",
        "s3 or resp",
    ),
}

_PLUGINS_HINT = "`lmcache plugins` lists the installed types and the plugins that failed to load"


class _FailedPluginLike(Protocol):
    name: str
    value: str
    distribution: str
    reason: str


def _canonical_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _failure_of(wheel: str, failed: list[_FailedPluginLike]) -> _FailedPluginLike | None:
    """The failed entry point that belongs to ``wheel`` (by distribution or module), if any."""
    package = "lmcache.storage." + wheel.removeprefix("lmcache-")
    for plugin in failed:
        value = plugin.value or ""
        if _canonical_dist(plugin.distribution or "") == wheel or (
            value == package or value.startswith(package + ".") or value.startswith(package + ":")
        ):
            return plugin
    return None


class UnknownL2AdapterTypeError(LMCacheConfigError):
    """An ``--l2-adapter`` ``type`` that no installed package registers.

    The message starts with LMCache 0.5.6's text, verbatim (``--l2-adapter #1: unknown adapter
    type 'x'. Known: a, b`` with ``where``; ``unknown L2 adapter type 'x'`` without), so scripts
    matching it keep working. Then, on the same line (CLI errors are one line), ``hint`` names
    the fix: the wheel that provides the type (only wheels that exist, ``L2_TYPE_WHEELS``), why
    that wheel's plugin did not load, or that the type is one of 0.5.6's that this release does
    not provide. A type in :data:`L2_TYPE_REFUSALS` gets its refusal instead (what it is, why
    it is not provided, what to use), with no "unknown".
    """

    def __init__(
        self,
        type_name: object,
        known: Iterable[str],
        where: str = "",
        *,
        failed_plugins: Iterable[_FailedPluginLike] = (),
    ) -> None:
        """``where`` prefixes the message (e.g. ``--l2-adapter #2``); ``failed_plugins``: the
        registry's failed entry points (``FailedPlugin``), to tell an installed wheel that
        failed to load from a missing one."""
        self.type_name = type_name
        self.known = sorted(known)
        self.failed_plugins = list(failed_plugins)
        self.wheel = L2_TYPE_WHEELS.get(type_name) if isinstance(type_name, str) else None
        known_text = ", ".join(self.known) or "(none)"
        self.hint = self._hint()
        refusal = L2_TYPE_REFUSALS.get(type_name) if isinstance(type_name, str) else None
        if refusal is not None:  # a 0.5.6 type we refuse: never "unknown"
            LMCacheConfigError.__init__(self, refusal.message(str(type_name), where))
            return
        if where:
            text = f"{where}: unknown adapter type {type_name!r}. Known: {known_text}"
        else:
            text = f"unknown L2 adapter type {type_name!r}. Known: {known_text}"
        super().__init__(f"{text}. {self.hint}")

    def _hint(self) -> str:
        name = self.type_name
        if not isinstance(name, str):
            return f"'type' must be a string naming one of the known types; {_PLUGINS_HINT}."
        if self.wheel is not None:
            failure = _failure_of(self.wheel, self.failed_plugins)
            if failure is not None:
                reason = " ".join(str(failure.reason).split())  # the message stays one line
                return (
                    f"Type {name!r} comes with the {self.wheel} wheel, which is installed but "
                    f"its plugin {failure.name!r} ({failure.value}) failed to load: {reason}. "
                    f"Fix that (or reinstall {self.wheel}); `lmcache plugins` shows the failure."
                )
            return (
                f"Type {name!r} comes with the {self.wheel} wheel: pip install {self.wheel}; "
                f"{_PLUGINS_HINT}."
            )
        refusal = L2_TYPE_REFUSALS.get(name)
        if refusal is not None:
            return f"Use instead: {refusal.instead}"
        if name in LMCACHE_056_ONLY_L2_TYPES:
            return (
                f"{name!r} is an LMCache 0.5.6 type not provided by this release (see "
                f"docs/compat.md, L2 adapter types); use one of the known types. {_PLUGINS_HINT}."
            )
        close = difflib.get_close_matches(name, self.known, n=1)
        did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
        return (
            f"Fix the spelling{did_you_mean}, or install the package that provides it; "
            f"{_PLUGINS_HINT}."
        )
