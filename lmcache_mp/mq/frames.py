"""The message queue's frames, and the two functions that move them.

A request is three frames, a reply three (the daemon's ROUTER puts the client's identity
before both, and takes it off):

    request   REQUEST_ID | request type (msgpack int) | payload (one msgpack array)
    reply     REQUEST_ID | status (msgpack int, an `ErrorCode`) | body (the reply, or an `ErrorReply`)

Invariants:
- A request id is the client's own: the daemon checks only its size and echoes it back, and a
  client never reuses one (its ids count up), so a late reply can match no other request.
- Every frame is msgpack or a packed integer: nothing is pickled on any socket.
- No frame is larger than MAX_FRAME_BYTES: KV bytes never travel here, and the daemon drops a
  connection that sends more (see `server.MessageQueueServer`).
- Only the thread that owns a socket calls `send_frames` / `recv_frames` on it.
"""

from __future__ import annotations

import struct

import msgspec
import zmq

from lmcache_mp.protocol import ErrorCode, RequestType

REQUEST_ID = struct.Struct("<Q")
MAX_FRAME_BYTES = 64 * 2**20

# Each request type's frame, both ways (a frame that is not here may still be the msgpack of a
# known type in another encoding: decoded the slow way).
TYPE_FRAME = {rt: msgspec.msgpack.encode(int(rt)) for rt in RequestType}
TYPE_BY_FRAME = {frame: rt for rt, frame in TYPE_FRAME.items()}
STATUS_FRAME = {int(code): msgspec.msgpack.encode(int(code)) for code in ErrorCode}

# pyzmq's flags are IntFlag enums, and `send_multipart` ORs SNDMORE into each frame's flags:
# an enum operation in pure Python per frame, on the daemon's and every client's critical path
# (its cost: docs/benchmarks.md section 1, third round). These are the same flags as plain
# ints, for arithmetic.
NOBLOCK = int(zmq.NOBLOCK)
POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list[bytes] | list[bytes | zmq.Frame], flags: int = 0) -> None:
    """`sock.send_multipart(frames, flags)` for our small frames, without the enum arithmetic.
    (Frames this small are copied by libzmq whatever `copy` says, so none is asked for; a
    `zmq.Frame`, a large reply the daemon tracks, goes as it is, zero-copy.)"""
    send = sock.send
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        send(frame, more)
    send(frames[-1], flags)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """`sock.recv_multipart(zmq.NOBLOCK)`, as `send_frames` is `send_multipart`. Each frame is
    read as a `zmq.Frame`, whose `more` costs less than asking the socket for RCVMORE (an enum
    conversion per call), and copied out."""
    recv = sock.recv
    frame = recv(NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = recv(NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames
