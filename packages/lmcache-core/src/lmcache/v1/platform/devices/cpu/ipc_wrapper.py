"""``CpuShmTensorWrapper`` (wire tag ``cpu_shm``): CPU KV tensors shared through POSIX SHM.

The worker's KV tensor must live in a named segment ``/lmcache_kv_*``. Tensors made by
:func:`create_shm_tensor` already do; ``wrap`` moves any other CPU tensor's storage into a
new segment in place (``Tensor.set_``), so later engine writes through that tensor
object are seen by the server. The creating process unlinks its segments
(:meth:`CpuShmTensorWrapper.unlink`, or at exit).
"""

from __future__ import annotations

import atexit
import os
import threading
import uuid
from multiprocessing import shared_memory
from typing import Any, ClassVar

import torch

from lmcache.utils import init_logger
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

logger = init_logger(__name__)

SHM_PREFIX = "/lmcache_kv_"

_lock = threading.Lock()
# storage data_ptr -> (segment name with "/", nbytes, SharedMemory kept open by the owner)
_owned: dict[int, tuple[str, int, shared_memory.SharedMemory]] = {}


def _new_segment(nbytes: int) -> shared_memory.SharedMemory:
    name = f"{SHM_PREFIX[1:]}{os.getpid()}_{uuid.uuid4().hex[:12]}"
    return shared_memory.SharedMemory(name=name, create=True, size=max(int(nbytes), 1))


def _segment_storage(shm: shared_memory.SharedMemory, nbytes: int) -> torch.UntypedStorage:
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(int(nbytes), 1))
    return flat.untyped_storage()


def create_shm_tensor(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by a new ``/lmcache_kv_*`` segment."""
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    shm = _new_segment(nbytes)
    storage = _segment_storage(shm, nbytes)
    t = torch.empty(0, dtype=dtype)
    t.set_(storage, 0, shape)
    with _lock:
        _owned[storage.data_ptr()] = ("/" + shm.name.lstrip("/"), nbytes, shm)
    return t


def shm_segment_of(tensor: torch.Tensor) -> tuple[str, int] | None:
    with _lock:
        entry = _owned.get(tensor.untyped_storage().data_ptr())
    return (entry[0], entry[1]) if entry else None


def _unlink_name(name: str) -> None:
    try:
        seg = shared_memory.SharedMemory(name=name.lstrip("/"), create=False)
    except FileNotFoundError:
        return
    try:
        seg.close()
    finally:
        seg.unlink()


@atexit.register
def _unlink_all_owned() -> None:
    with _lock:
        entries = list(_owned.values())
        _owned.clear()
    for _name, _n, shm in entries:
        try:
            shm.unlink()
        except Exception:
            pass


class CpuShmTensorWrapper(DeviceIPCWrapper):
    device_type: ClassVar[str] = "cpu"
    wire_tag: ClassVar[str | None] = "cpu_shm"

    def __init__(self, tensor: torch.Tensor | None = None, shm_name: str = "", nbytes: int = 0):
        super().__init__(tensor)
        self.shm_name = shm_name
        self.nbytes = int(nbytes)
        self.handle = shm_name
        self._attached: shared_memory.SharedMemory | None = None

    @classmethod
    def wrap(cls, tensor: Any) -> CpuShmTensorWrapper:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"cpu_shm wraps one CPU tensor per layer, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"cpu_shm wraps CPU tensors, got a tensor on {tensor.device}")
        found = shm_segment_of(tensor)
        if found is None:
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            shm = _new_segment(nbytes)
            new_storage = _segment_storage(shm, nbytes)
            new_storage.copy_(storage)
            tensor.set_(new_storage, tensor.storage_offset(), tensor.shape, tensor.stride())
            with _lock:
                _owned[new_storage.data_ptr()] = ("/" + shm.name.lstrip("/"), nbytes, shm)
            logger.info("moved a CPU KV tensor (%d bytes) into shared memory /%s", nbytes, shm.name)
            found = ("/" + shm.name.lstrip("/"), nbytes)
        return cls(tensor, shm_name=found[0], nbytes=found[1])

    def to_tensor(self) -> torch.Tensor:
        md = self.wire_metadata()
        md.check_fits(self.nbytes)
        if self._attached is None:
            shm = shared_memory.SharedMemory(name=self.shm_name.lstrip("/"), create=False)
            from lmcache.v1.platform.torch_ops._memory import untrack_shm

            with _lock:
                ours = any(name == self.shm_name for name, _n, _s in _owned.values())
            if not ours:
                untrack_shm(shm)  # the creating process owns (and unlinks) the segment
            if shm.size < self.nbytes:
                shm.close()
                raise ValueError(
                    f"shared memory {self.shm_name} has {shm.size} bytes, wrapper says {self.nbytes}"
                )
            self._attached = shm
        usable = self.nbytes - self.nbytes % self.dtype.itemsize
        flat = torch.frombuffer(self._attached.buf, dtype=torch.uint8, count=max(usable, 1))
        typed = flat[:usable].view(self.dtype)
        return torch.as_strided(typed, self.shape, self.stride, self.storage_offset)

    def close(self) -> None:
        shm, self._attached = self._attached, None
        if shm is not None:
            try:
                shm.close()
            except BufferError:
                pass  # tensors still view it; the mapping goes away with them

    def unlink(self) -> None:
        """Remove the segment (the creating process's job)."""
        with _lock:
            for key, (name, _n, shm) in list(_owned.items()):
                if name == self.shm_name:
                    del _owned[key]
                    try:
                        shm.unlink()
                    except FileNotFoundError:
                        pass
                    return
        _unlink_name(self.shm_name)

    def to_wire(self) -> dict[str, Any]:
        return {"shm_name": self.shm_name, "nbytes": self.nbytes}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CpuShmTensorWrapper:
        name, nbytes = data.get("shm_name"), data.get("nbytes")
        if not isinstance(name, str) or not name.startswith(SHM_PREFIX) or "/" in name[1:]:
            raise ValueError(f"cpu_shm: invalid shm_name {name!r} (expected '{SHM_PREFIX}*')")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"cpu_shm: invalid nbytes {nbytes!r}")
        return cls(None, shm_name=name, nbytes=nbytes)
