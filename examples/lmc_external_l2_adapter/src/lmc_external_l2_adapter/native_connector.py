"""``PyMemoryConnector``: a pure-Python object with the native connector contract.

It shows what a C++/pybind11 connector exposes to the ``native_plugin`` type, without a
compiler: one event fd, ``submit_batch_get/set/exists/delete`` returning future ids at once,
``drain_completions()`` returning ``(future_id, ok, error, result_bools)`` and ``close()``::

    --l2-adapter '{"type":"native_plugin","module_path":"lmc_external_l2_adapter",
                   "class_name":"PyMemoryConnector","adapter_params":{"num_workers":2}}'
"""

from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class PyMemoryConnector:
    def __init__(self, num_workers: int = 2) -> None:
        if not isinstance(num_workers, int) or num_workers <= 0:
            raise ValueError("num_workers must be a positive integer")
        self._data: dict[str, bytes] = {}
        self._mu = threading.Lock()
        self._done: list[tuple[int, bool, str, list[bool] | None]] = []
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="pymem-conn")
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def event_fd(self) -> int:
        return self._r

    def _complete(self, fid: int, ok: bool, error: str, bools: list[bool] | None) -> None:
        with self._mu:
            if self._closed:
                return
            self._done.append((fid, ok, error, bools))
            try:
                os.write(self._w, b"\x01")
            except BlockingIOError:
                pass

    def _submit(self, work: Any) -> int:
        if self._closed:
            raise RuntimeError("connector is closed")
        fid = next(self._ids)

        def run() -> None:
            try:
                ok, bools = work()
                self._complete(fid, ok, "", bools)
            except Exception as exc:  # a failed batch still completes
                self._complete(fid, False, str(exc), None)

        self._pool.submit(run)
        return fid

    @staticmethod
    def _check(keys: list[str], views: list[Any]) -> None:
        if not keys:
            raise RuntimeError("keys list is empty")
        if len(keys) != len(views):
            raise RuntimeError("keys and memviews size mismatch")

    def submit_batch_set(self, keys: list[str], memoryviews: list[Any]) -> int:
        self._check(keys, memoryviews)
        payload = [bytes(v) for v in memoryviews]

        def work() -> tuple[bool, None]:
            with self._mu:
                for k, p in zip(keys, payload, strict=False):
                    self._data[k] = p
            return True, None

        return self._submit(work)

    def submit_batch_get(self, keys: list[str], memoryviews: list[Any]) -> int:
        self._check(keys, memoryviews)

        def work() -> tuple[bool, list[bool]]:
            out = []
            for k, v in zip(keys, memoryviews, strict=False):
                with self._mu:
                    data = self._data.get(k)
                if data is None or len(data) != len(v):
                    out.append(False)
                    continue
                v[:] = data
                out.append(True)
            return True, out

        return self._submit(work)

    def submit_batch_exists(self, keys: list[str]) -> int:
        if not keys:
            raise RuntimeError("keys list is empty")

        def work() -> tuple[bool, list[bool]]:
            with self._mu:
                return True, [k in self._data for k in keys]

        return self._submit(work)

    def submit_batch_delete(self, keys: list[str]) -> int:
        if not keys:
            raise RuntimeError("keys list is empty")

        def work() -> tuple[bool, list[bool]]:
            with self._mu:
                return True, [self._data.pop(k, None) is not None for k in keys]

        return self._submit(work)

    def drain_completions(self) -> list[tuple[int, bool, str, list[bool] | None]]:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._mu:
            out, self._done = self._done, []
        return out

    def keys(self) -> list[str]:
        with self._mu:
            return list(self._data)

    def close(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        os.close(self._r)
        os.close(self._w)
