"""Hand-offs too big for one WebSocket message (the seed: up to W positions) travel in chunks.

The server encodes the hand-off once, and when it is longer than ``chunk_bytes`` (which fits under every
client's message limit: aiohttp's default is 4 MiB, the 26B-A4B seed is about 6.3 MB) it sends the
verdict with a ``handoff_ref`` (count, total bytes, chunk size, sha256) and then ``count`` handoff_chunk
frames with indices 0, 1, ... in order. The phone feeds them to a :class:`HandoffAssembler`, which
rejects missing, duplicate or out-of-order chunks and a wrong size or digest with typed errors.

>>> from vllm_hyco.handoff.limits import WireLimits
>>> ref, chunks = split_handoff(b"x" * 10, round=0, chunk_bytes=4)
>>> (ref.chunks, [len(c.data) for c in chunks])
(3, [4, 4, 2])
>>> asm = HandoffAssembler(0, ref)
>>> [asm.add(c) for c in chunks]
[False, False, True]
>>> asm.data()
b'xxxxxxxxxx'
"""

from __future__ import annotations

import hashlib

from vllm_hyco.errors import HandoffSchemaError
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.schema import HandoffPayload, HandoffSpec, decode_handoff, encode_handoff
from vllm_hyco.handoff.server_frames import HandoffChunkFrame, HandoffRef

_E = HandoffSchemaError


def split_handoff(encoded: bytes, round: int, chunk_bytes: int) -> tuple[HandoffRef, list[HandoffChunkFrame]]:
    """Cut an encoded hand-off into chunk frames of ``chunk_bytes`` (the last one shorter)."""
    count = -(-len(encoded) // chunk_bytes)
    ref = HandoffRef(count, len(encoded), chunk_bytes, hashlib.sha256(encoded).digest())
    frames = [
        HandoffChunkFrame(round, i, count, encoded[i * chunk_bytes : (i + 1) * chunk_bytes])
        for i in range(count)
    ]
    return ref, frames


def plan_handoff(
    payload: HandoffPayload,
    round: int,
    limits: WireLimits = DEFAULT_LIMITS,
    client_max_message_bytes: int | None = None,
) -> tuple[HandoffPayload | None, HandoffRef | None, list[HandoffChunkFrame]]:
    """How the server sends one hand-off: ``(inline_payload, ref, chunk_frames)``.

    Inline (``(payload, None, [])``) when the encoding fits in one chunk, else ``(None, ref, frames)``.
    The chunk size is ``limits.chunk_bytes``, lowered to fit the client's stated message limit.
    """
    chunk_bytes = limits.chunk_bytes
    if client_max_message_bytes is not None:
        chunk_bytes = min(chunk_bytes, client_max_message_bytes - 1024)
    encoded = encode_handoff(payload)
    if len(encoded) <= chunk_bytes:
        return payload, None, []
    ref, frames = split_handoff(encoded, round, chunk_bytes)
    return None, ref, frames


class HandoffAssembler:
    """Collects the chunk frames announced by one verdict's ``handoff_ref``, in order."""

    def __init__(self, round: int, ref: HandoffRef, limits: WireLimits = DEFAULT_LIMITS):
        if ref.total_bytes > limits.max_handoff_bytes:
            raise _E(
                f"hand-off of {ref.total_bytes} bytes is over the limit of {limits.max_handoff_bytes}",
                code="bad_handoff",
            )
        self.round, self.ref, self.limits = round, ref, limits
        self._parts: list[bytes] = []

    @property
    def complete(self) -> bool:
        return len(self._parts) == self.ref.chunks

    def add(self, chunk: HandoffChunkFrame) -> bool:
        """Take the next chunk; True once all have arrived. Raises HandoffSchemaError on any defect."""
        if chunk.round != self.round:
            raise _E(
                f"hand-off chunk of round {chunk.round} while assembling round {self.round}",
                code="chunk_out_of_order",
            )
        if chunk.count != self.ref.chunks:
            raise _E(
                f"hand-off chunk says {chunk.count} chunks, the verdict announced {self.ref.chunks}",
                code="chunk_corrupt",
            )
        expected = len(self._parts)
        if chunk.index < expected:
            raise _E(
                f"hand-off chunk {chunk.index} of round {self.round} arrived twice", code="chunk_duplicate"
            )
        if chunk.index > expected:
            raise _E(
                f"hand-off chunk {chunk.index} of round {self.round} arrived before chunk {expected}",
                code="chunk_out_of_order",
            )
        last = chunk.index == self.ref.chunks - 1
        want = self.ref.total_bytes - self.ref.chunk_bytes * chunk.index if last else self.ref.chunk_bytes
        if len(chunk.data) != want:
            raise _E(
                f"hand-off chunk {chunk.index} has {len(chunk.data)} bytes, expected {want}",
                code="chunk_corrupt",
            )
        self._parts.append(chunk.data)
        return self.complete

    def data(self) -> bytes:
        """The reassembled encoding; raises chunk_missing if incomplete, chunk_corrupt on a bad digest."""
        if not self.complete:
            raise _E(
                f"hand-off of round {self.round}: {len(self._parts)} of {self.ref.chunks} chunks arrived; "
                f"chunk {len(self._parts)} is missing (resume with need_seed)",
                code="chunk_missing",
            )
        data = b"".join(self._parts)
        if hashlib.sha256(data).digest() != self.ref.sha256:
            raise _E(
                f"hand-off of round {self.round}: sha256 of the {len(data)} reassembled bytes differs "
                f"from the verdict's reference",
                code="chunk_corrupt",
            )
        return data

    def payload(self, schema: HandoffSpec) -> HandoffPayload:
        """The reassembled hand-off, read with the session's schema."""
        return decode_handoff(self.data(), schema, limits=self.limits)
