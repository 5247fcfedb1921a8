"""The serde contract of an L2 adapter's ``"serde"`` block (LMCache 0.5.6's
``lmcache.v1.distributed.serde.base``; docs/storage-backends.md#serdes).

Two layers, as in 0.5.6:

* ``Serializer`` / ``Deserializer``: what a serde author writes. A pure, synchronous
  transform between a KV-shaped ``MemoryObj`` (shapes and dtypes known) and a byte buffer,
  given the object's ``ObjectKey`` (content-agnostic serdes ignore it).
* ``SerdeProcessor``: what the L2 serde wrapper drives: submit a batch, wait on an event
  fd, query the result. ``AsyncSerdeProcessor`` builds one from a Serializer/Deserializer
  pair and runs the work on a bounded thread pool, never on the caller's thread.

A deserializer that finds its input corrupt, truncated or not its own raises
``SerdeRejectedError`` (ours): the load becomes a miss and the wrapper counts the chunk.
Any other exception also turns the load into a miss.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing this module (adapter configs do) needs no torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

__all__ = [
    "Deserializer",
    "SerdeConfig",
    "SerdeProcessor",
    "SerdeRejectedError",
    "SerdeTaskId",
    "Serializer",
]

#: Id of one submitted serialize or deserialize batch.
SerdeTaskId = int


@dataclass
class SerdeConfig:
    """An adapter's ``"serde"`` block: ``type`` names a registered serde, every other key
    goes to its factory as ``kwargs``."""

    type: str
    kwargs: dict[str, object] = field(default_factory=dict)


class SerdeRejectedError(ValueError):
    """A stored object failed a serde's integrity check (corrupt, truncated, wrong key or
    not written by this serde): the load is a miss, never wrong KV."""


class Serializer(abc.ABC):
    """KV-shaped data -> serialized bytes."""

    @abc.abstractmethod
    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        """Write ``src``'s serialized form into the byte buffer ``dst`` (at least
        ``estimate_serialized_size`` bytes) and return the number of bytes written."""

    @abc.abstractmethod
    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """An upper bound of the serialized size of an object of ``layout_desc``; loads
        read this many bytes back, so a serde whose output size varies should make it
        exact or the adapter must tolerate a longer buffer."""


class Deserializer(abc.ABC):
    """Serialized bytes -> KV-shaped data."""

    @abc.abstractmethod
    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        """Fill the KV-shaped ``dst`` from the bytes in ``src`` (which may be longer than
        what was written). Raise on anything that is not a valid serialized object."""


class SerdeProcessor(abc.ABC):
    """Asynchronous serde driven by the L2 serde wrapper: ``submit_*`` returns a task id,
    the matching event fd becomes readable when a task ends, ``query_*`` pops its result
    (True success, False failure, None still running). The two fds must differ."""

    @abc.abstractmethod
    def get_serialize_event_fd(self) -> int:
        """The fd that becomes readable when a serialize task ends."""

    @abc.abstractmethod
    def get_deserialize_event_fd(self) -> int:
        """The fd that becomes readable when a deserialize task ends (not the serialize one)."""

    @abc.abstractmethod
    def submit_serialize(
        self, src_objs: list[MemoryObj], dst_objs: list[MemoryObj], keys: list[ObjectKey]
    ) -> SerdeTaskId:
        """Start serializing each KV object of ``src_objs`` into the byte buffer at the same
        position of ``dst_objs`` (``keys`` pair up with both); returns the task id."""

    @abc.abstractmethod
    def query_serialize_result(self, task_id: SerdeTaskId) -> bool | None:
        """True (every object serialized) or False once the task ended, then forgets it;
        None while it runs."""

    @abc.abstractmethod
    def submit_deserialize(
        self, src_objs: list[MemoryObj], dst_objs: list[MemoryObj], keys: list[ObjectKey]
    ) -> SerdeTaskId:
        """Start deserializing each byte buffer of ``src_objs`` into the KV object at the
        same position of ``dst_objs``; returns the task id."""

    @abc.abstractmethod
    def query_deserialize_result(self, task_id: SerdeTaskId) -> bool | None:
        """True or False once the task ended (False: some object could not be decoded, the
        load must be a miss), then forgets it; None while it runs."""

    @abc.abstractmethod
    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        """The serializer's ``estimate_serialized_size``: the temporary buffer size."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish running tasks and release threads and fds."""
