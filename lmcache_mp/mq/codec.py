"""`Codec`: the typed encoders and decoders of every request's payload frame and its reply.

Invariants:
- What each request carries and what it gets back is `protocol.PROTOCOL`'s, nothing else: a
  payload is decoded as a fixed-length typed array of that request's schema, a reply as its
  reply type, an error as an `ErrorReply` (raised again as `ServerError` on the client).
- Encoding and decoding never touch a socket: the daemon and every client use this one class,
  so both ends of the wire read the same table.
- Tensor handles go through `custom_types`' msgpack extensions; nothing is pickled.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lmcache_mp.custom_types import get_customized_decoder, get_customized_encoder
from lmcache_mp.errors import ServerError
from lmcache_mp.mq.frames import REQUEST_ID, TYPE_BY_FRAME, TYPE_FRAME
from lmcache_mp.protocol import PROTOCOL, ErrorCode, ErrorReply, RequestType


class Codec:
    """Typed encoders and decoders for every request's payload frame and its reply."""

    def __init__(self) -> None:
        self.encoder = get_customized_encoder()
        self._int = msgspec.msgpack.Decoder(int)
        self._error = msgspec.msgpack.Decoder(ErrorReply)
        # One decoder per request type, of the whole payload as a typed fixed-length array.
        self._payload = {rt: get_customized_decoder(tuple[spec.payload]) for rt, spec in PROTOCOL.items()}
        self._legacy_hello = [get_customized_decoder(t) for t in PROTOCOL[RequestType.HELLO].payload]
        self._reply = {rt: get_customized_decoder(spec.reply) for rt, spec in PROTOCOL.items()}

    def encode_request(self, request_id: int, request_type: RequestType, payload: list[Any]) -> list[bytes]:
        expected = len(PROTOCOL[request_type].payload)
        if len(payload) != expected:
            raise ValueError(f"{request_type.name} takes {expected} payload values, got {len(payload)}")
        return [REQUEST_ID.pack(request_id), TYPE_FRAME[request_type], self.encoder.encode(payload)]

    def decode_status(self, frame: bytes) -> int:
        return self._int.decode(frame)

    def decode_request_type(self, frame: bytes) -> RequestType:
        """Raises msgspec.DecodeError or ValueError on a frame that names no request type."""
        request_type = TYPE_BY_FRAME.get(frame)  # every request's: one dict lookup
        return request_type if request_type is not None else RequestType(self._int.decode(frame))

    def decode_payload(self, request_type: RequestType, frames: list[bytes]) -> list[Any]:
        if len(frames) == 1:
            return list(self._payload[request_type].decode(frames[0]))
        if request_type is RequestType.HELLO and len(frames) == len(self._legacy_hello):
            # Protocols 1-2 sent one frame per payload value. A client of theirs still learns
            # which protocol this daemon speaks, and says so, instead of getting BAD_PAYLOAD.
            return [dec.decode(frame) for dec, frame in zip(self._legacy_hello, frames, strict=True)]
        raise ValueError(f"{request_type.name} takes one payload frame, got {len(frames)}")

    def encode_reply(self, value: Any) -> bytes:
        return self.encoder.encode(value)

    def encode_error(self, code: ErrorCode, message: str) -> bytes:
        return self.encoder.encode(ErrorReply(int(code), message))

    def decode_reply(self, request_type: RequestType, status: int, body: bytes) -> Any:
        if status != ErrorCode.OK:
            err = self._error.decode(body)
            raise ServerError(err.code, err.message)
        return self._reply[request_type].decode(body)
