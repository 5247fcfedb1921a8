"""Multipart send/receive for the RPC hot path (server loop and client), without pyzmq's
Python-level wrappers.

``Socket.send_multipart`` / ``recv_multipart`` and ``getsockopt(zmq.EVENTS) & zmq.POLLIN``
cost about 12 us per message pair in enum arithmetic and per-frame checks; a ``noop`` round
trip is ~100 us, so that is a tenth of it. These helpers call the backend socket methods
directly with plain-int flags. Frames below ``ZERO_COPY_MIN`` bytes are copied (cheaper
than pinning them); larger ones (payloads of the byte path) are sent without a copy.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.backend import Socket as _BackendSocket

__all__ = ["ZERO_COPY_MIN", "has_input", "recv_frames", "send_frames"]

ZERO_COPY_MIN = 65536

_send = _BackendSocket.send
_recv = _BackendSocket.recv
_get = _BackendSocket.get
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list[Any]) -> None:
    """Sends ``frames`` as one multipart message (blocking like ``send_multipart``)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, _SNDMORE if i < last else 0, len(frame) < ZERO_COPY_MIN, False)


def recv_frames(sock: zmq.Socket, block: bool = False) -> list[zmq.Frame]:
    """Receives one whole multipart message; raises ``zmq.Again`` if none is there (or, with
    ``block``, if none came within the socket's ``RCVTIMEO``)."""
    frames = [_recv(sock, 0 if block else _NOBLOCK, False, False)]
    while frames[-1].more:
        frames.append(_recv(sock, 0, False, False))
    return frames


def has_input(sock: zmq.Socket) -> bool:
    """``ZMQ_EVENTS & POLLIN``: a message can be received now. Also re-arms ``zmq.FD``."""
    return bool(_get(sock, _EVENTS) & _POLLIN)
